//! Knowing the kernel: what the socket fast path's safety depends on, found out
//! by experiment rather than by kernel version.
//!
//! [`KernelProbe::run`] loads a private, unpinned copy of the socket programs
//! with the reader guard off, attaches it to this process's cgroup for a few
//! milliseconds, and drives real connections on a loopback address of a
//! private network namespace (no other socket on the node matches its rule):
//! does `splice()` see redirected bytes, does FIONREAD count them (and TCP
//! bytes of a socket that has a psock), is SO_RCVLOWAT honoured, does MSG_PEEK
//! work, can a blocked read return EAGAIN, is kTLS offered. The data path's
//! reader guard is configured from the answers.

use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use libbpf_rs::skel::OpenSkel;
use libbpf_rs::{Link, MapCore, MapFlags};
use meshwarp_bpf::shared::{raw_addr, Link as LinkValue, PairKey, Pod, Rule, RuleStats, EF_TARGET, END_SERVER};

/// The probe's loopback address: no rule of a real node names it.
const PROBE_ADDR: Ipv4Addr = Ipv4Addr::new(127, 77, 0, 1);
const T: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{what}: {source}")]
    Bpf {
        what: String,
        #[source]
        source: libbpf_rs::Error,
    },
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
    #[error("the probe connection was not accelerated ({0}); the kernel's behaviour could not be observed")]
    NotRedirected(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ProbeError {
    let what = what.into();
    move |source| ProbeError::Io { what, source }
}

fn bpf_err(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> ProbeError {
    let what = what.into();
    move |source| ProbeError::Bpf { what, source }
}

/// What the kernel does with redirected bytes and sockets that have a psock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelProbe {
    /// `uname -r`.
    pub release: String,
    /// `splice(socket -> pipe)` returns bytes that were redirected into the
    /// socket (upstream "sockmap: Fix reading with splice(2)"). If not, a
    /// splicing reader must never be a redirect target.
    pub splice_sees_redirected: bool,
    /// FIONREAD/SIOCINQ counts redirected bytes.
    pub fionread_counts_redirected: bool,
    /// FIONREAD counts TCP-path bytes of a socket that has a psock.
    pub fionread_counts_tcp_with_psock: bool,
    /// poll() honours SO_RCVLOWAT for redirected bytes.
    pub rcvlowat_honoured: bool,
    /// recv(MSG_PEEK) returns redirected bytes without consuming them.
    pub msg_peek: bool,
    /// A read blocked on a socket with a psock returns EAGAIN when the socket's
    /// own write side is shut down (tcp_bpf_recvmsg does not wait again).
    pub blocked_read_eagain: bool,
    /// The "tls" ULP (kTLS) is offered.
    pub ktls: bool,
}

impl KernelProbe {
    /// The probe, run once per process (its answers do not change while the
    /// kernel runs).
    pub fn cached() -> Result<&'static KernelProbe, &'static ProbeError> {
        static PROBE: OnceLock<Result<KernelProbe, ProbeError>> = OnceLock::new();
        PROBE.get_or_init(Self::run).as_ref()
    }

    /// Runs every experiment now.
    pub fn run() -> Result<Self, ProbeError> {
        let release =
            nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
        crate::sys::run_in_new_netns(|| probe_in_netns(release))?
    }

    /// The answers as (name, ok-for-the-fast-path, detail), for doctor, node
    /// info, GetNodeInfo and /metrics.
    pub fn facts(&self) -> Vec<KernelFact> {
        let f = |name: &'static str, value: bool, safe: bool, detail: &'static str| KernelFact {
            name,
            value,
            safe,
            detail,
        };
        vec![
            f(
                "splice_sees_redirected",
                self.splice_sees_redirected,
                self.splice_sees_redirected,
                "splice() reads redirected bytes; if not, sockets of programs that can splice are never redirect targets",
            ),
            f(
                "fionread_counts_redirected",
                self.fionread_counts_redirected,
                self.fionread_counts_redirected,
                "FIONREAD counts redirected bytes",
            ),
            f(
                "fionread_counts_tcp_with_psock",
                self.fionread_counts_tcp_with_psock,
                self.fionread_counts_tcp_with_psock,
                "FIONREAD counts TCP-path bytes of an accelerated socket; if not, a FIONREAD reader only gets a psock when both directions are redirected",
            ),
            f(
                "rcvlowat_honoured",
                self.rcvlowat_honoured,
                self.rcvlowat_honoured,
                "SO_RCVLOWAT holds back redirected bytes; if not, a socket with SO_RCVLOWAT set is not a redirect target",
            ),
            f("msg_peek", self.msg_peek, self.msg_peek, "recv(MSG_PEEK) sees redirected bytes"),
            f(
                "blocked_read_eagain",
                self.blocked_read_eagain,
                !self.blocked_read_eagain,
                "a blocked read of an accelerated socket returns EAGAIN on its own shutdown(SHUT_WR); if so, only sockets read without blocking are accelerated",
            ),
            f("ktls", self.ktls, true, "the tls ULP is offered; a socket that enables it leaves the fast path"),
        ]
    }

    /// Whether the reader guard has anything to protect against.
    pub fn needs_guard(&self) -> bool {
        !self.splice_sees_redirected
            || !self.fionread_counts_tcp_with_psock
            || !self.rcvlowat_honoured
            || self.blocked_read_eagain
    }

    /// The worst case, assumed when the probe cannot run.
    pub fn unknown() -> Self {
        Self {
            release: String::new(),
            splice_sees_redirected: false,
            fionread_counts_redirected: false,
            fionread_counts_tcp_with_psock: false,
            rcvlowat_honoured: false,
            msg_peek: false,
            blocked_read_eagain: true,
            ktls: true,
        }
    }
}

/// One answer of the probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelFact {
    pub name: &'static str,
    /// What the kernel does.
    pub value: bool,
    /// Whether that is what the fast path would like (else the guard works around it).
    pub safe: bool,
    pub detail: &'static str,
}

/// The cgroup v2 directory this process is in.
fn own_cgroup() -> Result<PathBuf, ProbeError> {
    let root = crate::sys::cgroup2_root()?;
    let me = std::fs::read_to_string("/proc/self/cgroup").map_err(io_err("reading /proc/self/cgroup"))?;
    let rel = me.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("/");
    let dir = root.join(rel.trim_start_matches('/'));
    Ok(if dir.is_dir() { dir } else { root })
}

fn probe_in_netns(release: String) -> Result<KernelProbe, ProbeError> {
    crate::sys::loopback_up().map_err(io_err("bringing lo up in the probe namespace"))?;
    let listener = TcpListener::bind(SocketAddrV4::new(PROBE_ADDR, 0)).map_err(io_err("probe listener"))?;
    let port = listener.local_addr().map_err(io_err("probe listener"))?.port();

    // A private copy of the programs, guard off (config all zero).
    let mut obj = MaybeUninit::uninit();
    let mut open = crate::loader::open_sockredir(&mut obj, 64).map_err(bpf_err("opening BPF object"))?;
    for (map, n) in [
        (&mut open.maps.mw_sockmap, 128),
        (&mut open.maps.mw_tgtmap, 128),
        (&mut open.maps.mw_slots, 64),
        (&mut open.maps.mw_links, 64),
        (&mut open.maps.mw_observe, 64),
        (&mut open.maps.mw_cookies, 64),
        (&mut open.maps.mw_pairs, 4),
        (&mut open.maps.mw_capture, 4),
        (&mut open.maps.mw_stats, 4),
        (&mut open.maps.mw_owners, 4),
    ] {
        map.set_max_entries(n).map_err(bpf_err("sizing probe maps"))?;
    }
    let (loaded, log) = crate::loader::with_libbpf_log(|| open.load());
    let skel = loaded.map_err(|source| ProbeError::Bpf { what: format!("loading probe programs: {log}"), source })?;
    let maps = &skel.maps;
    let (ip, family) = raw_addr(PROBE_ADDR.into());
    let key = PairKey { client_ip: ip, server_ip: ip, server_port: u32::from(port), family };
    maps.mw_pairs.update(key.as_bytes(), Rule::default().as_bytes(), MapFlags::ANY).map_err(bpf_err("probe rule"))?;
    skel.progs
        .mw_sk_msg
        .attach_sockmap(maps.mw_sockmap.as_fd().as_raw_fd())
        .map_err(bpf_err("attaching probe sk_msg"))?;
    let cgroup = own_cgroup()?;
    let cg = std::fs::File::open(&cgroup).map_err(io_err(format!("opening {}", cgroup.display())))?;
    let _sockops: Link = skel
        .progs
        .mw_sockops
        .attach_cgroup(cg.as_raw_fd())
        .map_err(bpf_err(format!("attaching probe sockops to {}", cgroup.display())))?;

    let stats = || -> RuleStats {
        maps.mw_stats
            .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
            .ok()
            .flatten()
            .unwrap_or_default()
            .iter()
            .filter_map(|v| RuleStats::from_bytes(v))
            .fold(RuleStats::default(), |mut a, b| {
                crate::maps::add_rule_stats(&mut a, &b);
                a
            })
    };
    let conn = || -> Result<(TcpStream, TcpStream), ProbeError> {
        let c = connect_from_probe_addr(port)?;
        let (s, _) = listener.accept().map_err(io_err("probe accept"))?;
        for x in [&c, &s] {
            x.set_read_timeout(Some(T)).map_err(io_err("probe timeout"))?;
        }
        Ok((c, s))
    };
    // Writes `n` bytes client -> server and checks they were redirected.
    let redirected = |c: &TcpStream, n: usize| -> Result<(), ProbeError> {
        let before = stats().bytes;
        write_all(c, &vec![0x5a; n])?;
        let after = stats();
        if after.bytes < before + n as u64 {
            return Err(ProbeError::NotRedirected(format!("{after:?}")));
        }
        Ok(())
    };

    // splice: 4000 redirected bytes, one non-blocking splice into a pipe.
    let (c, s) = conn()?;
    redirected(&c, 4000)?;
    // tcp_splice_read honours only the socket's own O_NONBLOCK.
    s.set_nonblocking(true).map_err(io_err("probe nonblocking"))?;
    let spliced = splice_once(s.as_raw_fd(), 4000)?;
    s.set_nonblocking(false).map_err(io_err("probe blocking"))?;
    drain(&s, 4000)?;
    let splice_sees_redirected = spliced == 4000;

    // FIONREAD and MSG_PEEK on redirected bytes.
    redirected(&c, 100)?;
    let fionread_counts_redirected = fionread(s.as_raw_fd())? == 100;
    let mut peek = [0u8; 200];
    // SAFETY: valid fd and buffer.
    let n = unsafe { libc::recv(s.as_raw_fd(), peek.as_mut_ptr().cast(), peek.len(), libc::MSG_PEEK) };
    let msg_peek = n == 100 && fionread(s.as_raw_fd())? == 100;
    drain(&s, 100)?;

    // SO_RCVLOWAT: 500 wanted, 100 redirected: readable?
    set_int(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVLOWAT, 500)?;
    redirected(&c, 100)?;
    let rcvlowat_honoured = !readable(s.as_raw_fd(), 50)?;
    set_int(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVLOWAT, 1)?;
    drain(&s, 100)?;

    // FIONREAD of TCP bytes on a socket that has a psock: stop redirecting
    // into the server end, then send.
    // mw_links is an array by slot: the probe's one link is its only
    // element with an id.
    let (link_key, mut l) = maps
        .mw_links
        .keys()
        .find_map(|k| {
            let v = maps.mw_links.lookup(&k, MapFlags::ANY).ok().flatten()?;
            LinkValue::from_bytes(&v).filter(|l| l.id != 0).map(|l| (k, l))
        })
        .ok_or_else(|| ProbeError::NotRedirected("no link".into()))?;
    l.end_flags[END_SERVER as usize] &= !EF_TARGET;
    maps.mw_links.update(&link_key, l.as_bytes(), MapFlags::ANY).map_err(bpf_err("probe link"))?;
    write_all(&c, &[1u8; 100])?;
    let deadline = Instant::now() + T;
    while !readable(s.as_raw_fd(), 10)? && Instant::now() < deadline {}
    let fionread_counts_tcp_with_psock = fionread(s.as_raw_fd())? == 100;
    drain(&s, 100)?;
    drop((c, s));

    // A blocked read and the socket's own shutdown(SHUT_WR).
    let (c, s) = conn()?;
    redirected(&c, 1)?;
    drain(&s, 1)?;
    let blocked_read_eagain = blocked_read_eagain(&c, s)?;

    let ktls = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp")
        .map(|s| s.split_whitespace().any(|u| u == "tls"))
        .unwrap_or(false)
        || ulp_tls_accepted(&listener, port);

    Ok(KernelProbe {
        release,
        splice_sees_redirected,
        fionread_counts_redirected,
        fionread_counts_tcp_with_psock,
        rcvlowat_honoured,
        msg_peek,
        blocked_read_eagain,
        ktls,
    })
}

/// A connection from PROBE_ADDR (loopback would pick 127.0.0.1 as source).
fn connect_from_probe_addr(port: u16) -> Result<TcpStream, ProbeError> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).map_err(io_err("probe socket"))?;
    s.bind(&SocketAddr::from((PROBE_ADDR, 0)).into()).map_err(io_err("probe bind"))?;
    s.connect_timeout(&SocketAddr::from((PROBE_ADDR, port)).into(), T).map_err(io_err("probe connect"))?;
    Ok(s.into())
}

fn last_err(what: &str) -> ProbeError {
    ProbeError::Io { what: what.into(), source: io::Error::last_os_error() }
}

fn write_all(mut s: &TcpStream, data: &[u8]) -> Result<(), ProbeError> {
    use std::io::Write;
    s.write_all(data).map_err(io_err("probe write"))
}

/// Reads exactly `n` bytes (blocking, with the socket's timeout).
fn drain(mut s: &TcpStream, n: usize) -> Result<(), ProbeError> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).map_err(io_err("probe read"))
}

fn fionread(fd: RawFd) -> Result<i32, ProbeError> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) } != 0 {
        return Err(last_err("FIONREAD"));
    }
    Ok(n)
}

fn set_int(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> Result<(), ProbeError> {
    // SAFETY: an int option.
    let rc = unsafe {
        libc::setsockopt(fd, level, opt, (&v as *const libc::c_int).cast(), size_of::<libc::c_int>() as libc::socklen_t)
    };
    if rc != 0 {
        return Err(last_err("setsockopt"));
    }
    Ok(())
}

fn readable(fd: RawFd, ms: i32) -> Result<bool, ProbeError> {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        return Err(last_err("poll"));
    }
    Ok(n > 0 && p.revents & libc::POLLIN != 0)
}

/// One non-blocking splice of up to `len` bytes from `fd` into a fresh pipe:
/// bytes moved, 0 at EOF, -1 on EAGAIN.
fn splice_once(fd: RawFd, len: usize) -> Result<i64, ProbeError> {
    let (_r, w) = crate::sys::pipe().map_err(io_err("pipe"))?;
    match crate::sys::splice(fd, w.as_raw_fd(), len, libc::SPLICE_F_NONBLOCK) {
        Ok(n) => Ok(n as i64),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(-1),
        Err(source) => Err(ProbeError::Io { what: "splice".into(), source }),
    }
}

/// A thread blocks reading `s`; the socket's own write side is shut down.
/// Returns whether the read came back with EAGAIN (instead of waiting).
/// Waits for the reader to be in its read, and for the read to come back
/// after the shutdown, rather than sleeping: the probe runs while every
/// test of a binary loads its programs, and a late reader read the unblocking
/// byte instead (a wrong answer flips the guard's Auto mode).
fn blocked_read_eagain(c: &TcpStream, s: TcpStream) -> Result<bool, ProbeError> {
    let fd = s.as_raw_fd();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        let _ = tx.send(unsafe { libc::gettid() });
        let mut b = [0u8; 16];
        // SAFETY: valid fd and buffer; blocking read (with the socket's timeout).
        let n = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), b.len(), 0) };
        let e = io::Error::last_os_error();
        (n, e.raw_os_error(), s)
    });
    let tid = rx.recv().map_err(|_| ProbeError::NotRedirected("probe reader gone".into()))?;
    if !crate::sys::wait_in_syscall(tid, libc::SYS_recvfrom, Duration::from_secs(5)) {
        tracing::warn!("kernel probe: the reader was not seen blocked in recvfrom within 5 s");
    }
    // SAFETY: shutting down our own socket's write side.
    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
    if !crate::sys::wait_for(Duration::from_millis(500), || reader.is_finished()) {
        write_all(c, &[7])?;
    }
    let (n, errno, _s) = reader.join().map_err(|_| ProbeError::NotRedirected("probe reader panicked".into()))?;
    Ok(n < 0 && errno == Some(libc::EAGAIN))
}

/// Whether setsockopt(TCP_ULP, "tls") succeeds on a plain connection.
fn ulp_tls_accepted(listener: &TcpListener, port: u16) -> bool {
    let Ok(c) = connect_from_probe_addr(port) else {
        return false;
    };
    let _s = listener.accept();
    let name = b"tls";
    // SAFETY: a string option.
    let rc = unsafe {
        libc::setsockopt(c.as_raw_fd(), libc::SOL_TCP, libc::TCP_ULP, name.as_ptr().cast(), name.len() as u32)
    };
    rc == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_is_the_worst_case() {
        let u = KernelProbe::unknown();
        assert!(u.needs_guard());
        assert!(u.facts().iter().filter(|f| f.name != "ktls").all(|f| !f.safe), "{:?}", u.facts());
    }
}
