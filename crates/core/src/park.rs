//! Takes demoted connection ends out of the SOCKMAP and puts them back, at
//! the programs' request (`MW_EV_UNLINK`, `MW_EV_RELINK`; see `mw_dir` in
//! shared.h). A psock socket pays tcp_bpf on every send and read even when its
//! bytes take the TCP path, so an end that keeps streaming small writes leaves
//! the map and is plain TCP again; its peer's next message brings it back
//! (not a direction of large writes into a reader on another CPU,
//! `MW_DIR_STREAMED`: the programs never ask for that end).
//!
//! Unlinking: the end's own sk_msg program, under the socket's lock, parks it
//! and checks that nothing redirected into it is unread or in flight; only
//! the delete is left, which sk_msg may not do. This module runs `mw_unlink`
//! (a tc program, never attached) with BPF_PROG_TEST_RUN at once: no
//! namespace switch, no walk of the TCP hash.
//!
//! Relinking needs the socket itself: the `mw_park` iter/tcp program finds it
//! in its network namespace, under its lock. This module feeds it requests,
//! batched per namespace, and retries those a failed walk did not serve, up to
//! [`MAX_TRIES`] times (a move answered busy: until served, less and less
//! often). The same walk wakes readers (`MW_EV_WAKE`): a reader
//! that asked FIONREAD with TCP bytes queued behind its psock, which this
//! kernel's FIONREAD does not count (see `MW_EF_WAKE` in shared.h).
//!
//! Joining: a TCP Fast Open server end, which claims its link at a state
//! change where sockops may not insert it, is relinked like an unlinked end;
//! the programs ask in `mw_joins`, not by an event, and this thread takes the
//! requests [`JOIN_AFTER`] after it first saw them (a connection that closes
//! before takes its request back: most of them, which then cost no walk).
//!
//! Moving (`MW_EV_MOVE`, `MW_DIR_MOVE`): a client end whose server end turned
//! out to be no target leaves `mw_sockmap` (`mw_unlink`) and joins `mw_tgtmap`
//! (`mw_park`, once its psock is gone), where no sk_msg runs on its sends.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libbpf_rs::ProgramHandle;
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    CookieVal, Event, Join, Link, ParkReq, Pod, UnlinkCtx, DIR_MOVE, DIR_RELINK_REQ, DIR_UNLINKED, DIR_UNLINKING,
    DIR_UNLINK_REQ, EF_CLOSED, EF_GONE, EF_WAKE, EV_MOVE, EV_RELINK, EV_UNLINK, EV_WAKE, PARK_BUSY, PARK_DONE,
    PARK_FAILED, PARK_MOOT, PARK_PENDING, PARK_RELINK, PARK_WAKE,
};

use crate::error::{BpfError, IoError};
use crate::maps::{MapError, TypedMap};

/// Attempts of a relink a failed walk did not serve (one per [`RETRY_EVERY`]).
pub const MAX_TRIES: u32 = 100;
/// How long an unserved relink waits before its next attempt.
pub const RETRY_EVERY: Duration = Duration::from_millis(5);
/// The longest wait between the attempts of a move still busy after
/// [`MAX_TRIES`] (a client inside a long send, a FIONREAD client that does
/// not read yet): it is asked again, less and less often, until served.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How long a quiet join waits in `mw_joins` before it is served. A walk
/// visits every TCP socket of the host (TIME_WAIT ones too), and most Fast
/// Open connections are short: one that closes meanwhile takes its request
/// back (`MW_SOCK_JOIN_ASKED`) and costs no walk and no system call here.
pub const JOIN_AFTER: Duration = Duration::from_millis(2);

/// A walk that could not run (its namespace not entered): its requests are
/// retried [`MAX_TRIES`] times, then given up.
const WALK_FAILED: u32 = u32::MAX;

/// The wait before the attempt after `tries` busy ones: [`RETRY_EVERY`] for
/// the first [`MAX_TRIES`], then doubling up to [`BACKOFF_MAX`].
fn retry_after(tries: u32) -> Duration {
    if tries < MAX_TRIES {
        return RETRY_EVERY;
    }
    let doublings = (tries - MAX_TRIES + 1).min(16);
    (RETRY_EVERY * (1u32 << doublings)).min(BACKOFF_MAX)
}

#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error(transparent)]
    Bpf(#[from] crate::error::BpfError),
    #[error(transparent)]
    Io(#[from] crate::error::IoError),
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
    #[error(transparent)]
    Map(#[from] MapError),
}

/// Maps a libbpf error to [`ParkError::Bpf`], saying what was being done.
pub(crate) fn bpf_err(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> ParkError {
    let what = what.into();
    move |source| ParkError::Bpf(BpfError::new(what, source))
}

/// One socket waiting for `mw_park` to put it back or wake its reader.
#[derive(Debug, Clone, Copy)]
struct Request {
    /// `PARK_RELINK` or `PARK_WAKE`.
    op: u32,
    cookie: u64,
    netns: u64,
    /// The thread that asked (its namespace is tried first).
    tid: u32,
    tries: u32,
    due: Instant,
}

/// The user-space half of unlinking and relinking: owns `mw_unlink`, the
/// iterator link and the relink queue.
pub(crate) struct Parker {
    req: TypedMap<u64, ParkReq>,
    links: TypedMap<u32, Link>,
    /// Open accelerated sockets: a request for a cookie not in it is moot
    /// (the socket closed) and costs no walk.
    cookies: TypedMap<u64, CookieVal>,
    /// TCP Fast Open server ends asked to join quietly (`mw_joins`); absent
    /// while an older build's programs run.
    joins: Option<TypedMap<u64, Join>>,
    /// Quiet joins seen in `mw_joins`, and when first: served once
    /// [`JOIN_AFTER`] old.
    seen_joins: BTreeMap<u64, Instant>,
    unlink: ProgramHandle,
    link: OwnedFd,
    /// Namespace cookie -> a path that enters it (found once, re-found when stale).
    netns: BTreeMap<u64, PathBuf>,
    queue: Vec<Request>,
    /// An `mw_unlink` run failed: look for unserved ends again.
    rescan_due: bool,
}

impl Parker {
    pub(crate) fn open(pin_dir: &Path) -> Result<Self, ParkError> {
        let req = TypedMap::pinned(&pin_dir.join("maps"), names::MAP_PARK_REQ)?;
        let prog = ProgramHandle::from_pinned_path(pin_dir.join("progs").join(names::PROG_PARK))
            .map_err(bpf_err("opening pinned mw_park"))?;
        let unlink = ProgramHandle::from_pinned_path(pin_dir.join("progs").join(names::PROG_UNLINK))
            .map_err(bpf_err("opening pinned mw_unlink"))?;
        let links = TypedMap::pinned(&pin_dir.join("maps"), names::MAP_LINKS)?;
        let cookies = TypedMap::pinned(&pin_dir.join("maps"), names::MAP_COOKIES)?;
        let joins = TypedMap::pinned(&pin_dir.join("maps"), names::MAP_JOINS).ok();
        let link = crate::sys::iter_link(&prog)
            .map_err(|source| ParkError::Io(IoError::new("creating the mw_park iterator link", source)))?;
        let mut parker = Self {
            req,
            links,
            cookies,
            joins,
            seen_joins: BTreeMap::new(),
            unlink,
            link,
            netns: BTreeMap::new(),
            queue: Vec::new(),
            rescan_due: false,
        };
        // Requests made while no process served them (or before a restart).
        parker.rescan();
        Ok(parker)
    }

    /// Unlinks every end that asked and was not served: its request was
    /// lost (no process ran, the ring buffer was read by another) or the
    /// run failed. Such an end stays parked, so its peer sends on TCP.
    pub(crate) fn rescan(&mut self) {
        self.rescan_due = false;
        let links = match self.links.entries() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("mw_park: reading the links: {e}");
                return;
            }
        };
        for (_, l) in links.into_iter().filter(|(_, l)| l.id != 0) {
            for end in 0..2 {
                let flags = l.dir[end].flags;
                let (cookie, netns) = (l.cookie[end], l.netns[end]);
                // Out of mw_sockmap, not in mw_tgtmap, nobody asked (a withdrawn
                // end keeps DIR_RELINK_REQ: it stays out), and still open.
                let mut moved_out = flags & (DIR_MOVE | DIR_UNLINKED | DIR_UNLINKING | DIR_RELINK_REQ)
                    == DIR_MOVE | DIR_UNLINKED
                    && l.end_flags[end] & (EF_CLOSED | EF_GONE) == 0;
                if flags & (DIR_UNLINK_REQ | DIR_UNLINKED | DIR_UNLINKING) == DIR_UNLINK_REQ {
                    moved_out = self.unlink(cookie) == Some(PARK_DONE) && flags & DIR_MOVE != 0;
                }
                // A move whose second half was never asked for.
                if moved_out {
                    self.enqueue(PARK_RELINK, cookie, netns, 0);
                }
                // A wake-up asked while no process served: its reader may
                // still wait, and its flag keeps it from asking again.
                if l.end_flags[end] & EF_WAKE != 0 && l.end_flags[end] & (EF_CLOSED | EF_GONE) == 0 {
                    self.enqueue(PARK_WAKE, cookie, netns, 0);
                }
            }
        }
    }

    /// Serves or queues a program's request; false if `ev` is not one.
    pub(crate) fn accept(&mut self, ev: &Event) -> bool {
        let op = match ev.kind {
            EV_UNLINK => {
                self.unlink(ev.cookie);
                return true;
            }
            // Out of mw_sockmap first; mw_park then puts it into mw_tgtmap.
            EV_MOVE if self.unlink(ev.cookie) == Some(PARK_DONE) => PARK_RELINK,
            EV_MOVE => return true,
            EV_RELINK => PARK_RELINK,
            EV_WAKE => PARK_WAKE,
            _ => return false,
        };
        self.enqueue(op, ev.cookie, ev.netns, ev.pid);
        true
    }

    /// Queues the joins the programs asked for quietly (`mw_joins`) once
    /// they waited [`JOIN_AFTER`] there, each taken out of the map. The
    /// programs take back the request of a socket that closes, so what is
    /// left is for open connections (an older build's are settled moot in
    /// [`Parker::run_due`] once closed, without a walk).
    pub(crate) fn take_joins(&mut self) {
        let Some(joins) = &self.joins else { return };
        let asked = match joins.entries() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("mw_park: reading mw_joins: {e}");
                // Their deadlines would keep the thread from waiting.
                self.seen_joins.clear();
                return;
            }
        };
        let now = Instant::now();
        let seen = std::mem::take(&mut self.seen_joins);
        let mut taken = Vec::new();
        for (cookie, j) in asked {
            let first = seen.get(&cookie).copied().unwrap_or(now);
            if now.duration_since(first) < JOIN_AFTER {
                self.seen_joins.insert(cookie, first);
            } else if joins.delete(&cookie).map_err(|e| tracing::debug!(cookie, "mw_park: taking a join: {e}")).is_ok()
            {
                taken.push((cookie, j));
            }
        }
        for (cookie, j) in taken {
            self.enqueue(PARK_RELINK, cookie, j.netns, j.tid);
        }
    }

    /// Queues `op` for socket `cookie`, due now, unless one is queued: a
    /// waiting request keeps its schedule, so an end answered busy (a
    /// FIONREAD client with bytes unread) whose peer keeps sending, and so
    /// asking, is walked on its schedule (every RETRY_EVERY, then less
    /// often), not for every send.
    fn enqueue(&mut self, op: u32, cookie: u64, netns: u64, tid: u32) {
        if !self.queue.iter().any(|r| r.cookie == cookie && r.op == op) {
            self.queue.push(Request { op, cookie, netns, tid, tries: 0, due: Instant::now() });
        }
    }

    /// Deletes a parked, drained (or moving) end's `mw_sockmap` entry
    /// (`mw_unlink`); its `MW_PARK_*` result. `None` if it could not run:
    /// the end then stays parked in the map (its peer's bytes take TCP)
    /// until a later rescan.
    fn unlink(&mut self, cookie: u64) -> Option<u32> {
        let ctx = UnlinkCtx::for_cookie(cookie);
        match crate::sys::test_run(self.unlink.as_fd(), ctx.as_bytes()) {
            Ok(r) => {
                tracing::debug!(cookie, "mw_unlink: {}", result_name(r));
                Some(r)
            }
            Err(e) => {
                tracing::warn!(cookie, "mw_unlink could not run; the end stays parked until a rescan: {e}");
                self.rescan_due = true;
                None
            }
        }
    }

    /// Whether a failed run asked for a rescan.
    pub(crate) fn rescan_due(&self) -> bool {
        self.rescan_due
    }

    /// How long until the first queued request is due (the caller polls no
    /// later); `None` with none queued.
    pub(crate) fn next_due_in(&self) -> Option<Duration> {
        let now = Instant::now();
        let joins = self.seen_joins.values().map(|&seen| (seen + JOIN_AFTER).saturating_duration_since(now));
        self.queue.iter().map(|r| r.due.saturating_duration_since(now)).chain(joins).min()
    }

    /// Runs every due request, one iterator per namespace.
    pub(crate) fn run_due(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<Request>, Vec<Request>) = self.queue.drain(..).partition(|r| r.due <= now);
        self.queue = later;
        let mut by_ns: BTreeMap<u64, Vec<Request>> = BTreeMap::new();
        for mut r in due {
            // Closed since it asked (a short connection: a Fast Open server
            // end's first relink can come after its close): no walk of its
            // namespace, which would not find it.
            if matches!(self.cookies.get(&r.cookie), Ok(None)) {
                self.settle(&mut r, PARK_MOOT);
                continue;
            }
            let batch = by_ns.entry(r.netns).or_default();
            // mw_park_req holds one request per socket: a second one (a
            // relink and a wake) waits for the next walk.
            if batch.iter().any(|b| b.cookie == r.cookie) {
                self.queue.push(r);
            } else {
                batch.push(r);
            }
        }
        for (ns, reqs) in by_ns {
            match self.run_batch(ns, &reqs) {
                Ok(results) => {
                    for (mut r, result) in reqs.into_iter().zip(results) {
                        self.settle(&mut r, result);
                    }
                }
                Err(e) => {
                    tracing::debug!(netns = ns, "mw_park: {e}");
                    self.netns.remove(&ns);
                    for mut r in reqs {
                        self.settle(&mut r, WALK_FAILED);
                    }
                }
            }
        }
    }

    /// What to do after an attempt.
    fn settle(&mut self, r: &mut Request, result: u32) {
        let name = result_name(result);
        match result {
            PARK_DONE | PARK_MOOT => tracing::debug!(cookie = r.cookie, op = r.op, "mw_park: {name}"),
            PARK_FAILED if r.op == PARK_WAKE => {
                tracing::warn!(cookie = r.cookie, "mw_park: waking the reader failed (SO_RCVLOWAT refused)")
            }
            PARK_FAILED => {
                tracing::info!(cookie = r.cookie, "mw_park: the SOCKMAP refused; the end stays on TCP")
            }
            // Not met in that namespace: closed, or a stale path (once more).
            PARK_PENDING => {
                self.netns.remove(&r.netns);
                if r.tries == 0 {
                    r.tries = 1;
                    self.queue.push(*r);
                }
            }
            _ => {
                r.tries = r.tries.saturating_add(1);
                // Only mw_park answers busy (a move whose client still holds
                // its psock, or has TCP bytes its FIONREAD would miss): that
                // end is out of both maps, plain TCP, until asked again.
                let backs_off = result == PARK_BUSY && r.op == PARK_RELINK;
                if r.tries < MAX_TRIES || backs_off {
                    if r.tries == MAX_TRIES {
                        tracing::debug!(cookie = r.cookie, "mw_park: still busy; asked less often from now on");
                    }
                    r.due = Instant::now() + retry_after(r.tries);
                    self.queue.push(*r);
                } else if r.op == PARK_WAKE {
                    // Its MW_EF_WAKE stays set, so its reader would not ask
                    // again: a rescan finds it and tries anew.
                    tracing::warn!(cookie = r.cookie, "mw_park: waking the reader given up for now");
                    self.rescan_due = true;
                } else {
                    tracing::debug!(cookie = r.cookie, "mw_park: relink given up; the end stays on TCP");
                }
            }
        }
    }

    /// One iterator over namespace `ns` serving `reqs`; their results in order.
    fn run_batch(&mut self, ns: u64, reqs: &[Request]) -> Result<Vec<u32>, ParkError> {
        let path = match self.netns.get(&ns) {
            Some(p) => p.clone(),
            None => {
                let tid = reqs.first().map_or(0, |r| r.tid);
                let p = crate::sys::find_netns(ns, tid).ok_or_else(|| {
                    ParkError::Io(IoError::new(
                        format!("finding network namespace {ns}"),
                        std::io::ErrorKind::NotFound.into(),
                    ))
                })?;
                self.netns.insert(ns, p.clone());
                p
            }
        };
        for r in reqs {
            let v = ParkReq { op: r.op, result: PARK_PENDING };
            self.req.put(&r.cookie, &v)?;
        }
        let link = self.link.as_fd();
        let ran = crate::sys::run_in_netns(Some(&path), || crate::sys::drain_iterator(link));
        let results = reqs
            .iter()
            .map(|r| {
                let v = self.req.get(&r.cookie).ok().flatten();
                let _ = self.req.delete(&r.cookie);
                v.map_or(PARK_PENDING, |v| v.result)
            })
            .collect();
        // The results stand even if the walk failed part-way: a request it
        // served must not be retried as if it had not been.
        if let Err(e) = ran
            .map_err(ParkError::from)
            .and_then(|r| r.map_err(|source| ParkError::Io(IoError::new("reading the mw_park iterator", source))))
        {
            tracing::debug!(netns = ns, "mw_park: {e}");
        }
        Ok(results)
    }
}

/// The name of an `MW_PARK_*` result, for logs.
fn result_name(result: u32) -> &'static str {
    match result {
        PARK_PENDING => "pending",
        PARK_DONE => "done",
        PARK_BUSY => "busy",
        PARK_MOOT => "moot",
        PARK_FAILED => "failed",
        WALK_FAILED => "walk failed",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_move_is_asked_quickly_then_less_often() {
        assert_eq!(retry_after(0), RETRY_EVERY);
        assert_eq!(retry_after(MAX_TRIES - 1), RETRY_EVERY);
        assert_eq!(retry_after(MAX_TRIES), RETRY_EVERY * 2);
        assert_eq!(retry_after(MAX_TRIES + 1), RETRY_EVERY * 4);
        assert_eq!(retry_after(MAX_TRIES + 7), BACKOFF_MAX);
        assert_eq!(retry_after(u32::MAX), BACKOFF_MAX);
    }
}
