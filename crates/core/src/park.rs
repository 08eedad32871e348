//! Takes demoted connection ends out of the SOCKMAP and puts them back, at
//! the programs' request (`MW_EV_UNLINK`, `MW_EV_RELINK`; see `mw_dir` in
//! shared.h). A psock socket pays tcp_bpf on every send and read even when its
//! bytes take the TCP path, so an end that keeps streaming small writes leaves
//! the map and is plain TCP again; its peer's next message brings it back.
//!
//! The work is the `mw_park` iter/tcp program: it runs in the socket's network
//! namespace, under the socket's lock, and refuses (busy) while bytes
//! redirected into the socket are unread or in flight. This module feeds it
//! requests, batched per namespace, retries busy ones, and after
//! [`MAX_TRIES`] gives up: the end is a target again and stays a psock on the
//! TCP path, as before the request.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libbpf_rs::{MapCore, MapFlags, MapHandle, ProgramHandle};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    Event, ParkReq, Pod, EV_RELINK, EV_UNLINK, PARK_BUSY, PARK_DONE, PARK_FAILED, PARK_MOOT, PARK_PENDING, PARK_RELINK,
    PARK_UNLINK, PARK_UNPARK,
};

/// Attempts of a busy unlink before it is given up (one per [`RETRY_EVERY`]).
pub const MAX_TRIES: u32 = 100;
/// How long a busy request waits before its next attempt.
pub const RETRY_EVERY: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    #[error("{what}: {source}")]
    Bpf {
        what: String,
        #[source]
        source: libbpf_rs::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
}

/// Maps a libbpf error to [`ParkError::Bpf`], saying what was being done.
pub(crate) fn bpf_err(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> ParkError {
    let what = what.into();
    move |source| ParkError::Bpf { what, source }
}

/// One socket waiting for `mw_park`.
#[derive(Debug, Clone, Copy)]
struct Request {
    cookie: u64,
    netns: u64,
    /// The thread that asked (its namespace is tried first).
    tid: u32,
    op: u32,
    tries: u32,
    due: Instant,
}

/// The user-space half of unlinking: owns the iterator link and the queue.
pub(crate) struct Parker {
    req: MapHandle,
    link: OwnedFd,
    /// Namespace cookie -> a path that enters it (found once, re-found when stale).
    netns: BTreeMap<u64, PathBuf>,
    queue: Vec<Request>,
}

impl Parker {
    pub(crate) fn open(pin_dir: &Path) -> Result<Self, ParkError> {
        let req = MapHandle::from_pinned_path(pin_dir.join("maps").join(names::MAP_PARK_REQ))
            .map_err(bpf_err("opening pinned mw_park_req"))?;
        let prog = ProgramHandle::from_pinned_path(pin_dir.join("progs").join(names::PROG_PARK))
            .map_err(bpf_err("opening pinned mw_park"))?;
        let link = crate::sys::iter_link(&prog)
            .map_err(|source| ParkError::Io { what: "creating the mw_park iterator link".into(), source })?;
        Ok(Self { req, link, netns: BTreeMap::new(), queue: Vec::new() })
    }

    /// Queues a program's request; false if `ev` is not one.
    pub(crate) fn accept(&mut self, ev: &Event) -> bool {
        let op = match ev.kind {
            EV_UNLINK => PARK_UNLINK,
            EV_RELINK => PARK_RELINK,
            _ => return false,
        };
        // A newer request for the same socket replaces an older one.
        self.queue.retain(|r| r.cookie != ev.cookie);
        self.queue.push(Request { cookie: ev.cookie, netns: ev.netns, tid: ev.pid, op, tries: 0, due: Instant::now() });
        true
    }

    /// Whether requests wait for a retry (the caller polls sooner).
    pub(crate) fn waiting(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Runs every due request, one iterator per namespace.
    pub(crate) fn run_due(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<Request>, Vec<Request>) = self.queue.drain(..).partition(|r| r.due <= now);
        self.queue = later;
        let mut by_ns: BTreeMap<u64, Vec<Request>> = BTreeMap::new();
        for r in due {
            by_ns.entry(r.netns).or_default().push(r);
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
                        self.settle(&mut r, PARK_BUSY);
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
            PARK_FAILED => {
                tracing::info!(cookie = r.cookie, op = r.op, "mw_park: the SOCKMAP refused; the end stays on TCP")
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
                r.tries += 1;
                if r.tries < MAX_TRIES {
                    r.due = Instant::now() + RETRY_EVERY;
                    self.queue.push(*r);
                } else if r.op == PARK_UNLINK {
                    // Its reader does not drain: a target again, on TCP.
                    tracing::debug!(cookie = r.cookie, "mw_park: unlink given up");
                    self.queue.push(Request { op: PARK_UNPARK, tries: MAX_TRIES - 1, due: Instant::now(), ..*r });
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
                let p = crate::sys::find_netns(ns, tid).ok_or_else(|| ParkError::Io {
                    what: format!("finding network namespace {ns}"),
                    source: std::io::ErrorKind::NotFound.into(),
                })?;
                self.netns.insert(ns, p.clone());
                p
            }
        };
        for r in reqs {
            let v = ParkReq { op: r.op, result: PARK_PENDING };
            self.req
                .update(&r.cookie.to_ne_bytes(), v.as_bytes(), MapFlags::ANY)
                .map_err(bpf_err("writing mw_park_req"))?;
        }
        let link = self.link.as_fd();
        let ran = crate::sys::run_in_netns(Some(&path), || crate::sys::drain_iterator(link));
        let results = reqs
            .iter()
            .map(|r| {
                let key = r.cookie.to_ne_bytes();
                let v = self.req.lookup(&key, MapFlags::ANY).ok().flatten().and_then(|b| ParkReq::from_bytes(&b));
                let _ = self.req.delete(&key);
                v.map_or(PARK_PENDING, |v| v.result)
            })
            .collect();
        // The results stand even if the walk failed part-way: a request it
        // served must not be retried as if it had not been.
        if let Err(e) = ran
            .map_err(ParkError::from)
            .and_then(|r| r.map_err(|source| ParkError::Io { what: "reading the mw_park iterator".into(), source }))
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
        _ => "unknown",
    }
}
