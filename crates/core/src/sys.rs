//! What the data path needs from the host: a bpffs to pin into and a cgroup v2
//! hierarchy to attach sockops to, mounted when absent; netns cookies.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use nix::mount::{mount, MsFlags};
use nix::sys::statfs::{statfs, BPF_FS_MAGIC, CGROUP2_SUPER_MAGIC};

/// Where a cgroup2 hierarchy is mounted when the host has none.
pub const FALLBACK_CGROUP2: &str = "/run/meshwarp/cgroup2";
/// Where bpffs is mounted when absent.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("mounting {fstype} at {path}: {source}")]
    Mount { fstype: &'static str, path: PathBuf, source: nix::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path} is not on a bpffs (pins must live on one)")]
    NotBpffs { path: PathBuf },
    #[error("{path} is not a cgroup v2 directory")]
    NotCgroup2 { path: PathBuf },
    #[error("reading the netns cookie: {0}")]
    NetnsCookie(io::Error),
    #[error("entering netns {path}: {source}")]
    Setns { path: PathBuf, source: nix::Error },
    #[error("spawning a network namespace thread: {0}")]
    Spawn(#[source] io::Error),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SysError + '_ {
    move |source| SysError::Io { path: path.to_path_buf(), source }
}

/// Mount points of `fstype`, from /proc/self/mountinfo (procfs parses it,
/// escapes included).
pub fn mounts_of(fstype: &str) -> Vec<PathBuf> {
    let Ok(info) = procfs::process::Process::myself().and_then(|p| p.mountinfo()) else {
        return Vec::new();
    };
    info.into_iter().filter(|m| m.fs_type == fstype).map(|m| m.mount_point).collect()
}

fn is_fs(path: &Path, magic: nix::sys::statfs::FsType) -> bool {
    statfs(path).map(|s| s.filesystem_type() == magic).unwrap_or(false)
}

/// Makes sure `pin_root`'s nearest existing ancestor is on a bpffs, mounting
/// bpffs at /sys/fs/bpf when that is where the pins go and nothing is mounted.
pub fn ensure_bpffs(pin_root: &Path) -> Result<(), SysError> {
    let mut probe = pin_root.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    if is_fs(&probe, BPF_FS_MAGIC) {
        return Ok(());
    }
    let default = Path::new(DEFAULT_BPFFS);
    if pin_root.starts_with(default) && !is_fs(default, BPF_FS_MAGIC) {
        fs::create_dir_all(default).map_err(io_err(default))?;
        mount(Some("bpf"), default, Some("bpf"), MsFlags::empty(), None::<&str>).map_err(|source| SysError::Mount {
            fstype: "bpf",
            path: default.to_path_buf(),
            source,
        })?;
        tracing::info!(path = %default.display(), "mounted bpffs");
        return Ok(());
    }
    Err(SysError::NotBpffs { path: pin_root.to_path_buf() })
}

/// The root of a cgroup v2 hierarchy: the first mounted one, else one mounted
/// at [`FALLBACK_CGROUP2`].
pub fn cgroup2_root() -> Result<PathBuf, SysError> {
    if let Some(p) = mounts_of("cgroup2").into_iter().next() {
        return Ok(p);
    }
    let p = PathBuf::from(FALLBACK_CGROUP2);
    if is_fs(&p, CGROUP2_SUPER_MAGIC) {
        return Ok(p);
    }
    fs::create_dir_all(&p).map_err(io_err(&p))?;
    mount(Some("none"), &p, Some("cgroup2"), MsFlags::empty(), None::<&str>).map_err(|source| SysError::Mount {
        fstype: "cgroup2",
        path: p.clone(),
        source,
    })?;
    tracing::info!(path = %p.display(), "mounted cgroup2");
    Ok(p)
}

/// Checks that `path` is a cgroup v2 directory.
pub fn check_cgroup2(path: &Path) -> Result<(), SysError> {
    if is_fs(path, CGROUP2_SUPER_MAGIC) {
        Ok(())
    } else {
        Err(SysError::NotCgroup2 { path: path.to_path_buf() })
    }
}

/// Runs `f` on a scoped thread that has entered the network namespace at
/// `netns` (a bind mount such as /var/run/netns/NAME), or stays in the
/// caller's namespace for `None`. Only that thread changes namespace.
pub fn run_in_netns<T: Send>(netns: Option<&Path>, f: impl FnOnce() -> T + Send) -> Result<T, SysError> {
    on_netns_thread(|| {
        if let Some(p) = netns {
            let file = fs::File::open(p).map_err(io_err(p))?;
            nix::sched::setns(std::os::fd::AsFd::as_fd(&file), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|source| SysError::Setns { path: p.to_path_buf(), source })?;
        }
        Ok(f())
    })
}

/// Runs `f` on a scoped thread of its own, named `meshwarp-netns` (an
/// unnamed thread would carry its creator's name, such as the guard's).
fn on_netns_thread<T: Send>(f: impl FnOnce() -> Result<T, SysError> + Send) -> Result<T, SysError> {
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("meshwarp-netns".into())
            .spawn_scoped(s, f)
            .map_err(SysError::Spawn)?
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Runs `f` on a scoped thread moved into a new, private network namespace
/// (only loopback, down); the namespace goes away with its last socket.
pub fn run_in_new_netns<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T, SysError> {
    on_netns_thread(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|source| SysError::Setns { path: PathBuf::from("(new namespace)"), source })?;
        Ok(f())
    })
}

/// Brings `lo` up in the calling thread's network namespace.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: a datagram socket for interface ioctls, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: an all-zero ifreq is valid; the name fits with its NUL.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq's flags.
    let rc = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr) != 0 {
            -1
        } else {
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr)
        }
    };
    let err = io::Error::last_os_error();
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    if rc != 0 {
        return Err(err);
    }
    Ok(())
}

/// splice(2) of up to `len` bytes from `fd_in` to `fd_out`, made by system
/// call number: meshwarp must never import `splice`, or its own reader guard
/// would class every program linking it as one that splices.
pub fn splice(fd_in: RawFd, fd_out: RawFd, len: usize, flags: libc::c_uint) -> io::Result<usize> {
    // SAFETY: the caller's fds; null offsets (sockets and pipes have none).
    let n = unsafe {
        libc::syscall(
            libc::SYS_splice,
            fd_in,
            std::ptr::null_mut::<libc::loff_t>(),
            fd_out,
            std::ptr::null_mut::<libc::loff_t>(),
            len,
            flags,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The calling thread's scheduling: `Some(priority)` for SCHED_FIFO at that
/// priority (reset to SCHED_OTHER in any child it forks), `None` for
/// SCHED_OTHER. Changing to SCHED_FIFO needs CAP_SYS_NICE (or an
/// RLIMIT_RTPRIO that allows it): EPERM otherwise.
pub fn set_thread_fifo(priority: Option<i32>) -> io::Result<()> {
    let (policy, prio) = match priority {
        Some(p) => (libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, p),
        None => (libc::SCHED_OTHER, 0),
    };
    let param = libc::sched_param { sched_priority: prio };
    // SAFETY: pid 0 is the calling thread; `param` outlives the call.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Thread `tid`'s scheduling policy (`libc::SCHED_*`, without
/// SCHED_RESET_ON_FORK).
pub fn thread_sched_policy(tid: i32) -> io::Result<i32> {
    // SAFETY: a plain query by thread id.
    let p = unsafe { libc::sched_getscheduler(tid) };
    if p < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(p & !libc::SCHED_RESET_ON_FORK)
}

/// A pipe (read end, write end), close-on-exec.
pub fn pipe() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

const SO_NETNS_COOKIE: libc::c_int = 71;

/// A u64 SOL_SOCKET option.
fn getsockopt_u64(sock: &impl AsRawFd, opt: libc::c_int) -> io::Result<u64> {
    let mut v: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid fd, out pointer and length of a u64.
    let rc =
        unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, opt, (&mut v as *mut u64).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// The socket cookie of `sock` (what `bpf_get_socket_cookie` returns for it).
pub fn socket_cookie_of(sock: &impl AsRawFd) -> io::Result<u64> {
    getsockopt_u64(sock, libc::SO_COOKIE)
}

/// The netns cookie of the namespace `sock` lives in (what
/// `bpf_get_netns_cookie` returns for it).
pub fn netns_cookie_of(sock: &impl AsRawFd) -> Result<u64, SysError> {
    getsockopt_u64(sock, SO_NETNS_COOKIE).map_err(SysError::NetnsCookie)
}

/// A BPF iterator link of `prog` (an iter program), from which iterators
/// are created in whatever namespace the caller is in.
pub fn iter_link(prog: &libbpf_rs::ProgramHandle) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsFd, FromRawFd};
    // SAFETY: a valid program fd; NULL opts create a plain iter link.
    let fd = unsafe {
        libbpf_rs::libbpf_sys::bpf_link_create(
            prog.as_fd().as_raw_fd(),
            0,
            libbpf_rs::libbpf_sys::BPF_TRACE_ITER,
            std::ptr::null(),
        )
    };
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// A BPF iterator link of `prog` over the elements of the map `map` (an
/// `iter/bpf_map_elem` or `iter/bpf_sk_storage_map` program).
pub fn iter_link_map(
    prog: &libbpf_rs::ProgramHandle,
    map: std::os::fd::BorrowedFd<'_>,
) -> io::Result<std::os::fd::OwnedFd> {
    use libbpf_rs::libbpf_sys as sys;
    use std::os::fd::{AsFd, FromRawFd};
    let mut info =
        sys::bpf_iter_link_info { map: sys::bpf_iter_link_info__bindgen_ty_1 { map_fd: map.as_raw_fd() as u32 } };
    // SAFETY: a plain C struct for which all-zeroes is the default.
    let mut opts: sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
    opts.sz = std::mem::size_of::<sys::bpf_link_create_opts>() as _;
    opts.iter_info = &mut info;
    opts.iter_info_len = std::mem::size_of::<sys::bpf_iter_link_info>() as u32;
    // SAFETY: valid fds; opts and info outlive the call.
    let fd = unsafe { sys::bpf_link_create(prog.as_fd().as_raw_fd(), 0, sys::BPF_TRACE_ITER, &opts) };
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Everything one iterator of `link` writes.
pub fn read_iterator(link: std::os::fd::BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: a valid iter link fd.
    let fd = unsafe { libbpf_rs::libbpf_sys::bpf_iter_create(link.as_raw_fd()) };
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new fd we own.
    let mut f = fs::File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    let mut out = Vec::new();
    loop {
        match f.read_to_end(&mut out) {
            Ok(_) => return Ok(out),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Runs `prog` once with BPF_PROG_TEST_RUN on a minimal Ethernet frame and
/// context `ctx` (a prefix of the program type's context); its return value.
pub fn test_run(prog: std::os::fd::BorrowedFd<'_>, ctx: &[u8]) -> io::Result<u32> {
    // Zeroes: an Ethernet header is all tc programs are guaranteed.
    let frame = [0u8; 14];
    let mut opts = libbpf_rs::libbpf_sys::bpf_test_run_opts {
        sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_test_run_opts>() as _,
        data_in: frame.as_ptr().cast(),
        data_size_in: frame.len() as u32,
        ctx_in: ctx.as_ptr().cast(),
        ctx_size_in: ctx.len() as u32,
        ..Default::default()
    };
    // SAFETY: a valid program fd; the buffers outlive the call and the
    // kernel only reads them (no output buffers are given).
    let rc = unsafe { libbpf_rs::libbpf_sys::bpf_prog_test_run_opts(prog.as_raw_fd(), &mut opts) };
    if rc < 0 {
        return Err(io::Error::from_raw_os_error(-rc));
    }
    Ok(opts.retval)
}

/// Reads a new iterator of `link` to its end, running its program on every
/// object (for iter/tcp: every TCP socket of the calling thread's namespace).
pub fn drain_iterator(link: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: a valid iter link fd.
    let fd = unsafe { libbpf_rs::libbpf_sys::bpf_iter_create(link.as_raw_fd()) };
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new fd we own.
    let mut f = fs::File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    let mut buf = [0u8; 512];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A path to the network namespace with cookie `cookie`: thread `tid`'s own
/// first, then named namespaces, then every process's and thread's; each
/// namespace entered once, and no further than the first match.
pub fn find_netns(cookie: u64, tid: u32) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::BTreeSet::new();
    netns_candidates(Some(tid)).find(|path| {
        let Ok(m) = fs::metadata(path) else { return false };
        seen.insert((m.dev(), m.ino())) && run_in_netns(Some(path), netns_cookie_here).ok().flatten() == Some(cookie)
    })
}

/// Paths that may name a network namespace, in the order they are tried:
/// thread `first`'s own (when given), this process's, the named ones
/// (/run/netns), then every process's and thread's. The same namespace
/// comes under many paths.
fn netns_candidates(first: Option<u32>) -> impl Iterator<Item = PathBuf> {
    let named = fs::read_dir("/run/netns").into_iter().flatten().flatten().map(|e| e.path());
    let procs = fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.parse::<u32>().is_ok()))
        .flat_map(|p| {
            let threads = fs::read_dir(p.path().join("task")).into_iter().flatten().flatten().map(|t| t.path());
            std::iter::once(p.path()).chain(threads).map(|d| d.join("ns/net"))
        });
    first
        .map(|tid| PathBuf::from(format!("/proc/{tid}/ns/net")))
        .into_iter()
        .chain(std::iter::once(PathBuf::from("/proc/self/ns/net")))
        .chain(named)
        .chain(procs)
}

/// Runs `f` once in each network namespace that can be entered (this
/// process's, the named ones, every process's and thread's), on one scoped
/// thread that enters them in turn. Namespaces are told apart by the file
/// opened (not its path, which a reused pid could point elsewhere); a path
/// gone by the time it is opened (its process exited), or one this process
/// may not open or enter, is skipped. A
/// namespace that only sockets keep alive (no process, no name) is not
/// among them.
pub fn in_each_netns<T: Send>(mut f: impl FnMut(&Path) -> T + Send) -> Result<Vec<T>, SysError> {
    use std::os::unix::fs::MetadataExt;
    on_netns_thread(|| {
        let mut seen = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        for path in netns_candidates(None) {
            // Gone (its process exited), or not ours to enter (a
            // process of another user namespace, such as a sandbox's
            // init): skipped. Anything else is an error.
            let skip =
                |errno: Option<i32>| matches!(errno, Some(libc::ENOENT | libc::ESRCH | libc::EACCES | libc::EPERM));
            let file = match fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if skip(e.raw_os_error()) => {
                    tracing::debug!(path = %path.display(), "network namespace skipped: {e}");
                    continue;
                }
                Err(e) => return Err(SysError::Io { path, source: e }),
            };
            let m = file.metadata().map_err(io_err(&path))?;
            if !seen.insert((m.dev(), m.ino())) {
                continue;
            }
            match nix::sched::setns(std::os::fd::AsFd::as_fd(&file), nix::sched::CloneFlags::CLONE_NEWNET) {
                Ok(()) => out.push(f(&path)),
                Err(e) if skip(Some(e as i32)) => {
                    tracing::debug!(path = %path.display(), "network namespace skipped: {e}");
                }
                Err(source) => return Err(SysError::Setns { path, source }),
            }
        }
        Ok(out)
    })
}

/// The cookie of the calling thread's network namespace.
fn netns_cookie_here() -> Option<u64> {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").or_else(|_| std::net::UdpSocket::bind("[::1]:0")).ok()?;
    netns_cookie_of(&s).ok()
}

/// Waits until thread `tid` of this process sleeps in system call `nr`
/// (its /proc/self/task/<tid>/syscall, which names the call only while the
/// thread is blocked in it); false after `timeout`. For whoever needs a
/// thread blocked in a read before acting, instead of a sleep that a slow or
/// busy machine can outlast.
pub fn wait_in_syscall(tid: libc::pid_t, nr: libc::c_long, timeout: std::time::Duration) -> bool {
    let path = format!("/proc/self/task/{tid}/syscall");
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let now = fs::read_to_string(&path).ok();
        if now.as_deref().and_then(|l| l.split_whitespace().next()).and_then(|f| f.parse::<libc::c_long>().ok())
            == Some(nr)
        {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Waits up to `timeout` for `done`; whether it held.
pub fn wait_for(timeout: std::time::Duration, done: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while !done() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    true
}

/// Locks `m` even if a thread panicked while holding it: one panicking
/// caller must not take every later call on the data path down with it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_blocked_in_a_read_is_seen_there() {
        let (r, w) = pipe().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let mut b = [0u8; 1];
            // SAFETY: a blocking read of a valid pipe into a valid buffer.
            unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) }
        });
        let tid = rx.recv().unwrap();
        assert!(wait_in_syscall(tid, libc::SYS_read, std::time::Duration::from_secs(10)));
        assert!(!wait_in_syscall(tid, libc::SYS_write, std::time::Duration::from_millis(20)));
        // SAFETY: a one-byte write into a valid pipe.
        assert_eq!(unsafe { libc::write(w.as_raw_fd(), [1u8].as_ptr().cast(), 1) }, 1);
        assert_eq!(t.join().unwrap(), 1);
        assert!(wait_for(std::time::Duration::from_secs(1), || true));
    }

    #[test]
    fn proc_mounts_lists_proc() {
        assert!(mounts_of("proc").iter().any(|p| p == Path::new("/proc")));
        assert!(mounts_of("no-such-fs").is_empty());
    }
}
