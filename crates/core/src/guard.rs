//! The reader guard's user-space half: a thread beside the data path that
//! classifies executables the programs ask about (their ELF, see
//! [`crate::execlass`]), turns what the programs saw into [`Incident`]s, and
//! resets a connection whose reader spliced while redirected bytes were
//! waiting for it (`mw_destroy`, an `iter/tcp` program calling
//! `bpf_sock_destroy`, run in the socket's network namespace), so that the
//! application sees an error instead of a silently truncated stream.
//!
//! The same thread serves the adaptive policy's requests to take streaming
//! ends out of the SOCKMAP and back (the `park` module), with or without the
//! guard's classification.
//!
//! Only one guard runs per pin root (a lock file under /run/meshwarp); a
//! second process adopting the same data path leaves it to the first.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use libbpf_rs::{MapHandle, ProgramHandle, RingBufferBuilder};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    ip_from_raw, str_of, Event, Exe, ExeClass, ExeKey, Pod, EV_CLASSIFY, EV_SPLICE_HIT, EV_SPLICE_SEEN, EV_URGENT_HIT,
    EXE_CLASSIFIED, EXE_OPAQUE, EXE_PENDING, EXE_SPLICE, EXE_TRUSTED,
};

use crate::error::{BpfError, IoError};
use crate::execlass::{self, ExeFacts};
use crate::maps::{MapError, TypedMap};
use crate::park::Parker;
use crate::slots::SlotSweeper;

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error(transparent)]
    Bpf(#[from] crate::error::BpfError),
    #[error(transparent)]
    Io(#[from] crate::error::IoError),
    #[error(transparent)]
    Classify(#[from] execlass::ClassifyError),
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
    #[error(transparent)]
    Map(#[from] MapError),
}

fn bpf_err(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> GuardError {
    let what = what.into();
    move |source| GuardError::Bpf(BpfError::new(what, source))
}

/// Whether the reader guard decides which sockets are redirect targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GuardMode {
    /// On when the kernel probe finds a gap the fast path must avoid
    /// (splice blind to redirected bytes, blocked reads returning EAGAIN,
    /// FIONREAD or SO_RCVLOWAT not honoured); off on a kernel without gaps.
    #[default]
    Auto,
    /// Every covered socket is a redirect target: the operator vouches that
    /// no reader splices, blocks while its own socket is shut down, or relies
    /// on SO_RCVLOWAT/FIONREAD. SO_RCVLOWAT, kTLS and SO_ZEROCOPY are still handled.
    Off,
}

/// What happened to a connection or a program that the operator should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incident {
    pub kind: IncidentKind,
    /// The thread that did it, its process, and its name.
    pub pid: u32,
    pub tgid: u32,
    pub comm: String,
    pub exe: Option<PathBuf>,
    /// The rule covering the connection (counter slot), if any.
    pub rule_id: Option<u32>,
    pub client: Option<SocketAddr>,
    /// Mirror pairing: the server; capture pairing: the proxy's listener.
    pub server: Option<SocketAddr>,
    /// Redirected bytes unread: splice() could not see them, or urgent
    /// data would have been read in their place.
    pub pending_bytes: u32,
    /// Whether the connection was reset.
    pub reset: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncidentKind {
    /// A reader spliced a socket while redirected bytes waited in it: the
    /// connection is reset (never truncated silently).
    SpliceHit,
    /// A program was first seen splicing a covered socket; its sockets are
    /// not redirect targets from now on.
    SpliceSeen,
    /// A program sent urgent data (MSG_OOB) into a reader with redirected
    /// bytes unread: its recv(MSG_OOB) would read those in-band bytes
    /// instead, so the connection is reset.
    UrgentHit,
}

/// Subscribers to incidents.
#[derive(Debug, Default)]
pub(crate) struct Subscribers {
    txs: Mutex<Vec<mpsc::Sender<Incident>>>,
}

impl Subscribers {
    pub(crate) fn subscribe(&self) -> mpsc::Receiver<Incident> {
        let (tx, rx) = mpsc::channel();
        crate::sys::lock(&self.txs).push(tx);
        rx
    }

    fn publish(&self, i: &Incident) {
        crate::sys::lock(&self.txs).retain(|tx| tx.send(i.clone()).is_ok());
    }
}

/// The maps and program the guard works with, opened from the pins.
struct GuardMaps {
    events: MapHandle,
    exes: TypedMap<ExeKey, Exe>,
    class: TypedMap<ExeKey, ExeClass>,
    doomed: TypedMap<u64, u32>,
    /// An iter/tcp link of mw_destroy; iterators are created from it in the
    /// namespace whose sockets are to be reset.
    destroy_link: OwnedFd,
}

impl GuardMaps {
    fn open(pin_dir: &Path) -> Result<Self, GuardError> {
        let maps = pin_dir.join("maps");
        let prog = ProgramHandle::from_pinned_path(pin_dir.join("progs").join(names::PROG_DESTROY))
            .map_err(bpf_err("opening pinned mw_destroy"))?;
        let destroy_link = crate::sys::iter_link(&prog)
            .map_err(|source| GuardError::Io(IoError::new("creating the mw_destroy iterator link", source)))?;
        Ok(Self {
            events: MapHandle::from_pinned_path(maps.join(names::MAP_EVENTS))
                .map_err(bpf_err("opening pinned mw_events"))?,
            exes: TypedMap::pinned(&maps, names::MAP_EXES)?,
            class: TypedMap::pinned(&maps, names::MAP_EXE_CLASS)?,
            doomed: TypedMap::pinned(&maps, names::MAP_DOOMED)?,
            destroy_link,
        })
    }

    fn write_class(&self, key: &ExeKey, flags: u32) -> Result<(), GuardError> {
        Ok(self.class.put(key, &ExeClass { flags, pad: 0 })?)
    }

    fn classified(&self, key: &ExeKey) -> bool {
        self.class.get(key).ok().flatten().is_some()
    }
}

fn class_flags(f: &ExeFacts, trusted: bool) -> u32 {
    let mut flags = EXE_CLASSIFIED;
    if f.splice {
        flags |= EXE_SPLICE;
    }
    if f.opaque {
        flags |= EXE_OPAQUE;
    }
    if trusted {
        flags |= EXE_TRUSTED;
    }
    flags
}

/// The running guard; stopped (and joined) on drop.
#[derive(Debug)]
pub(crate) struct GuardThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    /// The thread's id (gettid), once it runs; 0 before.
    tid: Arc<AtomicI32>,
    _lock: nix::fcntl::Flock<fs::File>,
}

impl GuardThread {
    /// The thread's id, once it started.
    pub(crate) fn tid(&self) -> Option<i32> {
        Some(self.tid.load(Ordering::Acquire)).filter(|&t| t != 0)
    }
}

impl Drop for GuardThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Where the guard of the data path pinned at `pin_dir` takes its lock.
fn lock_path(pin_dir: &Path) -> PathBuf {
    // FNV-1a of the pin directory: one lock per data path.
    let hash = pin_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
    Path::new(LOCK_DIR).join(format!("guard-{hash:016x}.lock"))
}

const LOCK_DIR: &str = "/run/meshwarp";

/// Removes the guard lock file of a data path that was uninstalled (one
/// file per pin root would otherwise pile up in /run).
pub(crate) fn remove_lock(pin_dir: &Path) {
    let _ = fs::remove_file(lock_path(pin_dir));
}

/// The lock that makes one guard per pin root; `None` if another holds it.
fn guard_lock(pin_dir: &Path) -> Result<Option<nix::fcntl::Flock<fs::File>>, GuardError> {
    fs::create_dir_all(LOCK_DIR)
        .map_err(|source| GuardError::Io(IoError::new(format!("creating {LOCK_DIR}"), source)))?;
    let path = lock_path(pin_dir);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| GuardError::Io(IoError::new(format!("opening {}", path.display()), source)))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(Some(l)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(GuardError::Io(IoError::new(format!("locking {}", path.display()), e.into()))),
    }
}

/// Starts the guard for the data path pinned at `pin_dir`, unless another
/// process's guard serves it. Classifies this process's executable and the
/// trusted ones before returning, the rest of the running processes in the
/// background.
pub(crate) fn start(
    pin_dir: &Path,
    trusted: &[PathBuf],
    subscribers: Arc<Subscribers>,
    classify: bool,
    realtime: bool,
) -> Result<Option<GuardThread>, GuardError> {
    let Some(lock_file) = guard_lock(pin_dir)? else {
        tracing::info!(dir = %pin_dir.display(), "another process guards this data path");
        return Ok(None);
    };
    let maps = GuardMaps::open(pin_dir)?;
    let mut trusted_keys = BTreeSet::new();
    for t in trusted.iter().filter(|_| classify) {
        let key = execlass::exe_key(t)?;
        let facts = execlass::classify_file(t)?;
        maps.write_class(&key, class_flags(&facts, true))?;
        trusted_keys.insert(key);
        tracing::info!(exe = %t.display(), "trusted reader: {}", facts.reason);
    }
    // Every running program, before the first connection can need it.
    let mut libs = execlass::LibCache::new();
    if classify {
        classify_running(&maps, &trusted_keys, &mut libs);
    }
    drop(maps);
    let stop = Arc::new(AtomicBool::new(false));
    let (stop2, dir) = (Arc::clone(&stop), pin_dir.to_path_buf());
    let tid = Arc::new(AtomicI32::new(0));
    let tid2 = Arc::clone(&tid);
    let handle = std::thread::Builder::new()
        .name("meshwarp-guard".into())
        .spawn(move || {
            tid2.store(nix::unistd::gettid().as_raw(), Ordering::Release);
            if let Err(e) = run(&dir, &stop2, &trusted_keys, &subscribers, realtime) {
                tracing::error!("reader guard stopped: {e}");
            }
        })
        .map_err(|source| GuardError::Io(IoError::new("spawning the guard thread", source)))?;
    Ok(Some(GuardThread { stop, handle: Some(handle), tid, _lock: lock_file }))
}

/// The guard thread's real-time priority (SCHED_FIFO's lowest: above every
/// normal thread, below any real-time one the node runs).
pub const GUARD_RT_PRIORITY: i32 = 1;

/// The guard thread's two priorities. It waits for the programs' requests
/// and serves unlinks (one BPF_PROG_TEST_RUN each) at SCHED_FIFO
/// ([`GUARD_RT_PRIORITY`]): until its unlink is done, a demoted end sends
/// TCP through its psock, several times a plain send's cost, and at normal
/// priority on a busy node the thread's wake-up waited milliseconds behind
/// the applications' threads (8 connections of 1 KiB writes: 590 such sends
/// per connection, 67 at SCHED_FIFO; benches/README.md). Walks (relinks,
/// wakes, resets visit every TCP socket of the host), classifications (ELF
/// files read) and sweeps run at normal priority, never holding a CPU from
/// the applications for their length.
struct Sched {
    realtime: bool,
    fifo: bool,
}

impl Sched {
    /// SCHED_FIFO (if `realtime` and the kernel allows it: CAP_SYS_NICE),
    /// for waiting and serving unlinks.
    fn urgent(&mut self) {
        if !self.realtime || self.fifo {
            return;
        }
        match crate::sys::set_thread_fifo(Some(GUARD_RT_PRIORITY)) {
            Ok(()) => self.fifo = true,
            Err(e) => {
                self.realtime = false;
                tracing::warn!(
                    "the guard thread runs at normal priority (SCHED_FIFO refused: {e}; it needs CAP_SYS_NICE): \
                     on a busy node, demoted connections wait longer to leave the SOCKMAP"
                );
            }
        }
    }

    /// SCHED_OTHER, for work whose length grows with the node.
    fn background(&mut self) {
        if !self.fifo {
            return;
        }
        self.fifo = false;
        if let Err(e) = crate::sys::set_thread_fifo(None) {
            // Leaving real time is always allowed; should it fail, stay
            // there rather than switch back and forth.
            self.realtime = false;
            self.fifo = true;
            tracing::warn!("the guard thread could not leave SCHED_FIFO: {e}");
        }
    }
}

fn run(
    pin_dir: &Path,
    stop: &AtomicBool,
    trusted: &BTreeSet<ExeKey>,
    subs: &Subscribers,
    realtime: bool,
) -> Result<(), GuardError> {
    let maps = GuardMaps::open(pin_dir)?;
    let queue: Rc<RefCell<Vec<Event>>> = Rc::default();
    let q = Rc::clone(&queue);
    let mut builder = RingBufferBuilder::new();
    builder
        .add(&maps.events, move |data: &[u8]| {
            if let Some(ev) = Event::from_bytes(data) {
                q.borrow_mut().push(ev);
            }
            0
        })
        .map_err(bpf_err("ring buffer"))?;
    let rb = builder.build().map_err(bpf_err("ring buffer"))?;
    let mut guard = Guard { maps: &maps, trusted, subs, tries: BTreeMap::new(), libs: execlass::LibCache::new() };
    let mut parker = match Parker::open(pin_dir) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(
                "demoted connections stay in the SOCKMAP, and one that asked to leave stays parked (its peer \
                 sends on TCP) until a data path process can serve it: {e}"
            );
            None
        }
    };
    let mut sweeper = match SlotSweeper::open(pin_dir) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("stale SOCKMAP slots are not freed: {e}");
            None
        }
    };
    let mut last_retry = Instant::now();
    let mut sched = Sched { realtime, fifo: false };
    while !stop.load(Ordering::Relaxed) {
        sched.urgent();
        let idle = Duration::from_millis(50);
        let wait = poll_wait(parker.as_ref().and_then(Parker::next_due_in), idle);
        if let Err(e) = rb.poll(wait) {
            tracing::warn!("polling mw_events: {e}");
        }
        let events: Vec<Event> = queue.borrow_mut().drain(..).collect();
        // Classifications (an ELF and its libraries read) come after the
        // data path's requests, once per executable: each new process of
        // an unclassified one asks, and a burst of them held moves back.
        let mut asks = BTreeMap::new();
        for ev in events {
            if parker.as_mut().is_some_and(|p| p.accept(&ev)) || sweeper.as_mut().is_some_and(|s| s.accept(&ev)) {
                continue;
            }
            if ev.kind == EV_CLASSIFY {
                asks.insert(ev.exe, ev);
            } else {
                // A reset is a walk.
                sched.background();
                guard.handle(&ev);
            }
        }
        if let Some(p) = parker.as_mut() {
            p.take_joins();
            if p.next_due_in() == Some(Duration::ZERO) {
                sched.background();
            }
            p.run_due();
        }
        if !asks.is_empty() {
            sched.background();
        }
        for ev in asks.values() {
            guard.handle(ev);
        }
        if last_retry.elapsed() > Duration::from_millis(500) {
            sched.background();
            guard.retry_pending();
            if let Some(p) = parker.as_mut().filter(|p| p.rescan_due()) {
                p.rescan();
            }
            if let Some(s) = sweeper.as_mut() {
                s.sweep();
            }
            last_retry = Instant::now();
        }
    }
    Ok(())
}

/// How long the guard thread waits for events: until the first queued park
/// request is due, at most `idle`, in whole milliseconds rounded up (the ring
/// buffer's epoll takes milliseconds and cuts the rest: a wait of 0.9 ms
/// became 0, and the thread spun until the request was due).
fn poll_wait(next_due: Option<Duration>, idle: Duration) -> Duration {
    next_due.map_or(idle, |d| Duration::from_millis(d.as_micros().div_ceil(1000) as u64).min(idle))
}

struct Guard<'a> {
    maps: &'a GuardMaps,
    trusted: &'a BTreeSet<ExeKey>,
    subs: &'a Subscribers,
    /// Classification attempts per pending executable.
    tries: BTreeMap<ExeKey, u32>,
    libs: execlass::LibCache,
}

/// Classifies `pid`'s executable, stored under the key the kernel uses.
fn classify_one(
    maps: &GuardMaps,
    trusted: &BTreeSet<ExeKey>,
    libs: &mut execlass::LibCache,
    pid: u32,
    kernel_key: Option<ExeKey>,
) -> Result<ExeKey, GuardError> {
    let (key, facts) = execlass::classify_process_cached(pid, kernel_key.map(|k| k.ino), libs)?;
    let key = kernel_key.unwrap_or(key);
    if trusted.contains(&key) {
        return Ok(key);
    }
    maps.write_class(&key, class_flags(&facts, false))?;
    tracing::debug!(pid, exe = ?fs::read_link(format!("/proc/{pid}/exe")).ok(), "classified: {}", facts.reason);
    Ok(key)
}

/// Every running process's executable, so that their next connections
/// need not wait for a classification.
fn classify_running(maps: &GuardMaps, trusted: &BTreeSet<ExeKey>, libs: &mut execlass::LibCache) {
    let Ok(dir) = fs::read_dir("/proc") else { return };
    let mut seen = BTreeSet::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(key) = execlass::exe_key(&e.path().join("exe")) else { continue };
        if !seen.insert(key) || maps.classified(&key) {
            continue;
        }
        let _ = classify_one(maps, trusted, libs, pid, None);
    }
}

impl Guard<'_> {
    fn classify(&mut self, pid: u32, kernel_key: Option<ExeKey>) -> Result<ExeKey, GuardError> {
        classify_one(self.maps, self.trusted, &mut self.libs, pid, kernel_key)
    }

    fn handle(&mut self, ev: &Event) {
        match ev.kind {
            // Every new process of an executable not classified yet asks:
            // those queued behind the one that succeeded are not served.
            EV_CLASSIFY if self.maps.classified(&ev.exe) => {}
            EV_CLASSIFY => {
                if let Err(e) = self.classify(ev.tgid, Some(ev.exe)) {
                    tracing::debug!(tgid = ev.tgid, "classification deferred: {e}");
                }
            }
            EV_SPLICE_SEEN => {
                let i = incident(
                    ev,
                    IncidentKind::SpliceSeen,
                    false,
                    "splices a covered socket: no longer a redirect target".into(),
                );
                tracing::info!(pid = ev.pid, comm = %i.comm, exe = ?i.exe, "reader guard: program seen splicing; its sockets are not redirect targets");
                self.subs.publish(&i);
            }
            EV_SPLICE_HIT | EV_URGENT_HIT => {
                let (reset, detail) = match self.reset(ev) {
                    Ok(true) => (true, "connection reset".to_string()),
                    Ok(false) => (false, "socket already gone".to_string()),
                    Err(e) => (false, format!("reset failed: {e}")),
                };
                let (kind, what) = if ev.kind == EV_SPLICE_HIT {
                    (IncidentKind::SpliceHit, "splice() on a socket holding redirected bytes it cannot see")
                } else {
                    (IncidentKind::UrgentHit, "urgent data (MSG_OOB) sent into a reader with redirected bytes unread")
                };
                let i = incident(ev, kind, reset, detail);
                tracing::error!(
                    pid = ev.pid,
                    comm = %i.comm,
                    exe = ?i.exe,
                    client = ?i.client,
                    server = ?i.server,
                    pending = ev.pending,
                    reset,
                    "reader guard: {what} ({} bytes); {}",
                    ev.pending,
                    i.detail
                );
                self.subs.publish(&i);
            }
            other => tracing::debug!("unknown guard event {other}"),
        }
    }

    /// Resets a hit connection: the socket the event names (the splicer's,
    /// the urgent sender's) and its peer, when it lives in the same
    /// namespace; that socket's next call gets ECONNABORTED, its peer a RST.
    fn reset(&self, ev: &Event) -> Result<bool, GuardError> {
        for c in [ev.cookie, ev.peer_cookie].into_iter().filter(|c| *c != 0) {
            self.maps.doomed.put(&c, &1)?;
        }
        // The socket's namespace is not necessarily the splicing thread's.
        let ns = crate::sys::find_netns(ev.netns, ev.pid).ok_or_else(|| {
            GuardError::Io(IoError::new(
                format!("finding network namespace {} of the hit socket", ev.netns),
                std::io::ErrorKind::NotFound.into(),
            ))
        })?;
        let link = self.maps.destroy_link.as_fd();
        crate::sys::run_in_netns(Some(&ns), || crate::sys::drain_iterator(link))?
            .map_err(|source| GuardError::Io(IoError::new("reading the mw_destroy iterator", source)))?;
        let gone = self.maps.doomed.get(&ev.cookie).ok().flatten().is_none();
        // Whatever was not found (a peer in another namespace) is not kept.
        for c in [ev.cookie, ev.peer_cookie] {
            let _ = self.maps.doomed.delete(&c);
        }
        Ok(gone)
    }

    /// Executables the programs asked about whose process was gone before
    /// the request was served: any process running them will do.
    fn retry_pending(&mut self) {
        let keys = self.maps.exes.keys().unwrap_or_default();
        for key in keys {
            if self.maps.classified(&key) {
                continue;
            }
            let Some(exe) = self.maps.exes.get(&key).ok().flatten() else {
                continue;
            };
            if exe.flags & EXE_PENDING == 0 {
                continue;
            }
            let n = self.tries.entry(key).or_default();
            *n += 1;
            if *n > 20 {
                continue;
            }
            if self.classify(exe.tgid, Some(key)).is_ok() {
                continue;
            }
            if let Some(pid) = find_process_running(key.ino) {
                let _ = self.classify(pid, Some(key));
            }
        }
    }
}

fn find_process_running(ino: u64) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
        (fs::metadata(e.path().join("exe")).ok()?.ino() == ino).then_some(pid)
    })
}

fn incident(ev: &Event, kind: IncidentKind, reset: bool, detail: String) -> Incident {
    let ep = |ip: [u32; 4], port: u32| -> Option<SocketAddr> {
        let ip: IpAddr = ip_from_raw(ip, ev.family)?;
        Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
    };
    let has_link = ev.link != 0 || ev.family != 0;
    Incident {
        kind,
        pid: ev.pid,
        tgid: ev.tgid,
        comm: str_of(&ev.comm),
        exe: fs::read_link(format!("/proc/{}/exe", ev.tgid)).ok(),
        rule_id: has_link.then_some(ev.rule_id),
        client: if has_link { ep(ev.client_ip, ev.client_port) } else { None },
        server: if has_link { ep(ev.server_ip, ev.server_port) } else { None },
        pending_bytes: ev.pending,
        reset,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poll_wait_rounds_up_to_whole_milliseconds() {
        let idle = Duration::from_millis(50);
        assert_eq!(poll_wait(None, idle), idle);
        assert_eq!(poll_wait(Some(Duration::ZERO), idle), Duration::ZERO);
        assert_eq!(poll_wait(Some(Duration::from_micros(900)), idle), Duration::from_millis(1));
        assert_eq!(poll_wait(Some(Duration::from_micros(2100)), idle), Duration::from_millis(3));
        assert_eq!(poll_wait(Some(Duration::from_secs(1)), idle), idle);
    }

    #[test]
    fn flags_of_a_classification() {
        let f = ExeFacts { splice: true, opaque: false, reason: String::new() };
        assert_eq!(class_flags(&f, false), EXE_CLASSIFIED | EXE_SPLICE);
        assert_eq!(class_flags(&f, true), EXE_CLASSIFIED | EXE_SPLICE | EXE_TRUSTED);
        let o = ExeFacts { splice: true, opaque: true, reason: String::new() };
        assert_eq!(class_flags(&o, false), EXE_CLASSIFIED | EXE_SPLICE | EXE_OPAQUE);
    }

    #[test]
    fn incidents_name_the_connection() {
        let mut ev = Event { kind: EV_SPLICE_HIT, pid: 7, tgid: 7, family: 2, pending: 4000, ..Default::default() };
        ev.client_ip[0] = u32::from_ne_bytes([127, 0, 0, 1]);
        ev.server_ip[0] = u32::from_ne_bytes([127, 0, 0, 1]);
        ev.client_port = 40000;
        ev.server_port = 7003;
        ev.link = 1;
        ev.comm[..7].copy_from_slice(b"haproxy");
        let i = incident(&ev, IncidentKind::SpliceHit, true, "x".into());
        assert_eq!(i.comm, "haproxy");
        assert_eq!(i.client, Some("127.0.0.1:40000".parse().unwrap()));
        assert_eq!(i.server, Some("127.0.0.1:7003".parse().unwrap()));
        assert_eq!(i.pending_bytes, 4000);
    }
}
