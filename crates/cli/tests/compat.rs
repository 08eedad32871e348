//! The compatibility suite: real programs (haproxy, socat, nginx, redis, curl,
//! openssl, python, memcached, gRPC, PostgreSQL, Node.js, Go, Java, nghttp2,
//! iperf3) through registered pairs and capture rules on a real
//! kernel, checksummed both ways, 100 connections each, the first one after
//! the data path starts included. A program that loses, duplicates or
//! reorders a byte, or hangs, fails its test; so does a missing program or
//! kernel feature under CI=true.
//!
//! Each scenario loads a fresh data path (reader guard on, as a node runs it)
//! before its programs start, and reports what was accelerated.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use meshwarp_core::{CaptureRule, Endpoint, EndpointPair, GuardMode, RuleCounters};
use meshwarp_testbed::{
    accept_timeout, echo_integrity, missing_feature, postgres_bin, read_exact_ready, read_ready, redirect_output,
    redis_server, splice_echo, wait_listening, wait_port_listening, which, write_all_ready, Fnv, KernelTest, NetNs,
    NodeWithPods, Pattern, Program, ScratchDir, StreamEcho, NODE_HTTP_ECHO, SERVICE_V4,
};

const CONNS: usize = 100;
const CONCURRENT: usize = 10;
const T: Duration = Duration::from_secs(60);
const OWNER: &str = "compat";

/// Bytes each way of connection `i`: mostly small and medium, every tenth large.
fn size_of_conn(i: usize) -> usize {
    match i % 10 {
        0 => 8 << 20,
        1 | 2 => 1 << 20,
        3..=5 => 64 << 10,
        6 => 1,
        _ => 4096 + i * 37,
    }
}

/// Runs `CONNS` checksummed full-duplex exchanges, `CONCURRENT` at a time;
/// `one(i)` does connection `i` and fails on any byte out of place.
fn run_connections(one: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    for batch in (0..CONNS).collect::<Vec<_>>().chunks(CONCURRENT) {
        thread::scope(|s| {
            let one = &one;
            let hs: Vec<_> = batch.iter().map(|&i| (i, s.spawn(move || one(i)))).collect();
            for (i, h) in hs {
                h.join().unwrap().with_context(|| format!("connection {i} ({} bytes each way)", size_of_conn(i)))?;
            }
            Ok::<_, anyhow::Error>(())
        })?;
    }
    Ok(())
}

/// A fresh data path with the reader guard as a node runs it: nothing
/// trusted, every program judged by its ELF and what it is seen doing.
fn node() -> Option<KernelTest> {
    let guard = if std::env::var("COMPAT_GUARD_OFF").is_ok() { GuardMode::Off } else { GuardMode::Auto };
    KernelTest::start_with(4096, 64, |c| {
        c.trusted_readers.clear();
        c.guard = guard;
    })
}

/// Two pods on a node, pod A to `port` on pod B registered: the node, the
/// server's address and the pair.
fn pods_with_pair(k: &KernelTest, port: u16) -> Result<(NodeWithPods, SocketAddr, EndpointPair)> {
    let net = NodeWithPods::new(2)?;
    let server = SocketAddr::new(net.pods[1].v4.into(), port);
    let pair = EndpointPair::new(net.pods[0].v4.into(), server.into())?;
    k.dp().insert(&pair, OWNER)?;
    Ok((net, server, pair))
}

/// The tools a scenario needs; a missing one fails under CI, else skips loudly.
fn tools(names: &[&str]) -> bool {
    for n in names {
        if which(n).is_none() {
            return missing_feature::<()>(&format!("{n} (scripts/install-deps.sh installs it)")).is_some();
        }
    }
    true
}

/// Runs `args` in `ns` to its end (within `timeout`): whether it exited with
/// success, and what it printed on stdout.
fn run_to_end(ns: &NetNs, args: &[&str], timeout: Duration) -> Result<(bool, String)> {
    let (ok, out) = output_of(ns, args, timeout)?;
    Ok((ok, String::from_utf8_lossy(&out).into_owned()))
}

/// [`run_to_end`], with the bytes the program wrote on stdout.
fn output_of(ns: &NetNs, args: &[&str], timeout: Duration) -> Result<(bool, Vec<u8>)> {
    let mut p = Program::spawn_with(ns, args, Stdio::null(), Stdio::piped())?;
    let mut out = Vec::new();
    p.child().stdout.take().context("stdout")?.read_to_end(&mut out)?;
    Ok((p.wait_timeout(timeout)?.success(), out))
}

fn report(what: &str, counters: &[(&str, RuleCounters)]) {
    for (rule, c) in counters {
        eprintln!(
            "[compat] {what}: {rule}: sockets {} redirected {} B ({} msgs); fallbacks: reader {} splice {} no_peer {} tcp_path {} collision {}; splice hits {}; urgent {} (hits {}); zerocopy {} (refused {}); readers woken {}; clients without sk_msg {}",
            c.sockets,
            c.redirected_bytes,
            c.redirected_msgs,
            c.fallback_reader,
            c.fallback_splice,
            c.fallback_no_peer,
            c.fallback_tcp_path,
            c.fallback_collision,
            c.splice_hits,
            c.fallback_urgent,
            c.urgent_hits,
            c.fallback_zerocopy,
            c.zerocopy_refused,
            c.reader_wakeups,
            c.tgtmap_clients
        );
    }
}

// ---------------------------------------------------------------------------
// haproxy

#[derive(Debug, Clone, Copy)]
enum Splice {
    None,
    Auto,
    Request,
    Response,
}

impl Splice {
    fn option(self) -> &'static str {
        match self {
            Splice::None => "",
            Splice::Auto => "option splice-auto",
            Splice::Request => "option splice-request",
            Splice::Response => "option splice-response",
        }
    }
}

/// haproxy in TCP mode from `listen` to `upstream`, with edge-triggered
/// polling. haproxy 2.6's default (level-triggered epoll) ends a full-duplex
/// stream early now and then, on a plain kernel path too: FD_POLL_HUP stays
/// set across poll reports while FD_POLL_IN is replaced by each, so once the
/// peer's FIN was reported, an EPOLLOUT-only report while reading is paused
/// (buffer full) leaves HUP without IN, and haproxy's next read
/// (`raw_sock_to_buf`, `raw_sock_to_pipe`) takes that as the end without
/// calling recv or splice. The rest stays unread and the client gets a reset
/// (bpftrace: no recv or splice returned 0; `tcp_send_active_reset` from
/// haproxy's close, unread data). Measured with `haproxy_outbound_*`, 4 tests a
/// run: no rule registered 1 truncation in 32 runs, both rules 8 in 40, and
/// edge-triggered 0 in 40, where every report carries EPOLLIN while bytes wait.
fn haproxy_config(
    dir: &ScratchDir,
    name: &str,
    listen: SocketAddr,
    upstream: SocketAddr,
    splice: Splice,
) -> Result<String> {
    let cfg = format!(
        "global\n maxconn 4096\n expose-experimental-directives\n tune.fd.edge-triggered on\ndefaults\n mode tcp\n timeout connect 5s\n timeout client 120s\n timeout server 120s\n\
         listen sidecar\n bind {listen}\n {}\n server app {upstream}\n",
        splice.option()
    );
    let path = dir.path(name);
    std::fs::write(&path, cfg)?;
    Ok(path.display().to_string())
}

/// The shape of the issue's report: pods A and B on a bridge; in B a proxy
/// (the program under test) listens on B:7102 and forwards to an echo on
/// 127.0.0.1:7003; registered: A -> B:7102 and 127.0.0.1 -> 127.0.0.1:7003.
struct Inbound {
    k: KernelTest,
    net: NodeWithPods,
    front: SocketAddr,
    app: SocketAddr,
    inner: EndpointPair,
    outer: EndpointPair,
    dir: ScratchDir,
    _echo: StreamEcho,
}

impl Inbound {
    fn new(k: KernelTest) -> Result<Self> {
        let net = NodeWithPods::new(2)?;
        let lo: IpAddr = "127.0.0.1".parse()?;
        let (app, front) = (SocketAddr::new(lo, 7003), SocketAddr::new(net.pods[1].v4.into(), 7102));
        let _echo = StreamEcho::start(net.pods[1].ns.listen(app)?)?;
        let inner = EndpointPair::new(lo, app.into())?;
        let outer = EndpointPair::new(net.pods[0].v4.into(), front.into())?;
        k.dp().insert(&inner, OWNER)?;
        k.dp().insert(&outer, OWNER)?;
        Ok(Self { k, net, front, app, inner, outer, dir: ScratchDir::new("meshwarp-compat-")?, _echo })
    }

    /// The proxy's namespace (pod B).
    fn pod(&self) -> &NetNs {
        &self.net.pods[1].ns
    }

    /// Runs the connections through the proxy; the counters of (outer, inner).
    fn run(&self, what: &str, seed: u64) -> Result<(RuleCounters, RuleCounters)> {
        let client = &self.net.pods[0].ns;
        wait_listening(client, self.front, T)?;
        run_connections(|i| {
            echo_integrity(client.connect(self.front)?, seed + i as u64, size_of_conn(i), T).map_err(Into::into)
        })?;
        let (o, i) = (self.k.dp().stats(&self.outer)?, self.k.dp().stats(&self.inner)?);
        report(what, &[("outer", o), ("inner", i)]);
        Ok((o, i))
    }
}

fn haproxy_inbound(splice: Splice) -> Result<()> {
    if !tools(&["haproxy"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let t = Inbound::new(k)?;
    let cfg = haproxy_config(&t.dir, "inbound.cfg", t.front, t.app, splice)?;
    let _haproxy = Program::spawn(t.pod(), &["haproxy", "-db", "-f", &cfg])?;
    let (outer, inner) = t.run(&format!("haproxy inbound {splice:?}"), 1000)?;
    ensure!(inner.splice_hits == 0, "haproxy spliced a socket holding redirected bytes: {inner:?}");
    // haproxy can splice: its sockets are never redirect targets, but what it
    // sends to the echo is.
    ensure!(inner.redirected_bytes > 0, "haproxy -> app was accelerated: {inner:?}");
    // Its clients' sends can never be redirected: once haproxy has accepted
    // one, the next ones run no sk_msg (mw_tgtmap).
    ensure!(outer.tgtmap_clients > 0, "clients of haproxy skip sk_msg: {outer:?}");
    Ok(())
}

/// Why the guard exists: the same setup with the guard off. Where the probe
/// says splice() cannot see redirected bytes, haproxy with splice-request
/// loses or corrupts the very first stream; elsewhere it is intact.
#[test]
fn without_the_guard_haproxy_splice_request_breaks_streams() -> Result<()> {
    if !tools(&["haproxy"]) {
        return Ok(());
    }
    let Some(k) = KernelTest::start_with(4096, 64, |c| c.guard = GuardMode::Off) else { return Ok(()) };
    let t = Inbound::new(k)?;
    let cfg = haproxy_config(&t.dir, "inbound.cfg", t.front, t.app, Splice::Request)?;
    let _haproxy = Program::spawn(t.pod(), &["haproxy", "-db", "-f", &cfg])?;
    let a = &t.net.pods[0].ns;
    wait_listening(a, t.front, T)?;
    let r = echo_integrity(a.connect(t.front)?, 1, 8 << 20, Duration::from_secs(10));
    if t.k.dp().kernel().splice_sees_redirected {
        r?;
    } else {
        ensure!(r.is_err(), "expected the splice gap to break the stream");
        eprintln!("[compat] without the guard, haproxy splice-request: {}", r.unwrap_err());
    }
    Ok(())
}

#[test]
fn haproxy_inbound_without_splice() -> Result<()> {
    haproxy_inbound(Splice::None)
}

#[test]
fn haproxy_inbound_splice_auto() -> Result<()> {
    haproxy_inbound(Splice::Auto)
}

#[test]
fn haproxy_inbound_splice_request() -> Result<()> {
    haproxy_inbound(Splice::Request)
}

#[test]
fn haproxy_inbound_splice_response() -> Result<()> {
    haproxy_inbound(Splice::Response)
}

/// A client whose reader asks FIONREAD (as nginx's does) through haproxy,
/// which can splice and so is never a redirect target. The client's first
/// accelerated connection joins mw_sockmap before haproxy's end decides
/// (nothing hints at connect: haproxy is in another pod), and moves to
/// mw_tgtmap, where its sends run no sk_msg (here served at the accept,
/// before any byte; guard.rs has the move that waits for unread bytes). An
/// nginx-style reader (epoll, edge-triggered, FIONREAD after a full read)
/// gets every byte, before and after the move, and never waits for good.
#[test]
fn a_fionread_client_of_haproxy_moves_to_the_target_map() -> Result<()> {
    use meshwarp_bpf::shared::{EF_FIONREAD, EF_TGTMAP, END_CLIENT};
    if !tools(&["haproxy"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let t = Inbound::new(k)?;
    let cfg = haproxy_config(&t.dir, "inbound.cfg", t.front, t.app, Splice::Auto)?;
    let _haproxy = Program::spawn(t.pod(), &["haproxy", "-db", "-f", &cfg])?;
    let link_of = |s: &TcpStream| -> Result<Option<meshwarp_bpf::shared::Link>> {
        let Some(cv) = t.k.dp().socket_link(meshwarp_core::sys::socket_cookie_of(s)?)? else { return Ok(None) };
        Ok(t.k.dp().link(&cv)?)
    };
    // This executable is seen reading without blocking (the first inner
    // connection, not accelerated), then asking FIONREAD on an
    // accelerated socket (the second).
    echo_integrity(t.pod().connect(t.app)?, 1, 4096, T)?;
    let warm = t.pod().connect(t.app)?;
    ensure!(link_of(&warm)?.is_some(), "the second inner connection is accelerated");
    let mut nread: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    ensure!(unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&warm), libc::FIONREAD, &mut nread) } == 0);
    echo_integrity(warm, 2, 4096, T)?;
    let fionread = !t.k.dp().kernel().fionread_counts_tcp_with_psock;

    // Waited for from haproxy's own pod: a connection no rule covers.
    let a = &t.net.pods[0].ns;
    wait_listening(t.pod(), t.front, T)?;
    let exchange = |c: &TcpStream, seed: u64, len: usize| -> Result<()> {
        let data: Vec<u8> = (0..len as u64).map(|i| (i.wrapping_mul(seed) >> 3) as u8).collect();
        thread::scope(|sc| -> Result<()> {
            let w = sc.spawn(|| write_all_ready(&mut &*c, &data, Some(T)));
            let got = meshwarp_testbed::fionread_reader(c, len, Duration::from_secs(5));
            if got.is_err() {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
            w.join().expect("writer")?;
            ensure!(got? == data, "echo through haproxy, {len} B");
            Ok(())
        })
    };
    // The first covered connections teach the guard how haproxy reads (not
    // accelerated); the first accelerated one is the first its listener
    // decided, with no hint at connect.
    let mut conns = 0u64;
    let (c, link) = loop {
        let c = a.connect(t.front)?;
        conns += 1;
        match link_of(&c)? {
            Some(link) => break (c, link),
            None if conns < 4 => exchange(&c, conns, 64 << 10)?,
            None => bail!("no accelerated client after {conns} connections"),
        }
    };
    if fionread {
        ensure!(link.end_flags[END_CLIENT as usize] & EF_FIONREAD != 0, "a FIONREAD reader at insert: {link:?}");
    }
    exchange(&c, 5, 256 << 10)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let link = link_of(&c)?.context("link")?;
        if link.end_flags[END_CLIENT as usize] & EF_TGTMAP != 0 {
            break;
        }
        ensure!(Instant::now() < deadline, "the client never moved to mw_tgtmap: {link:?}");
        thread::sleep(Duration::from_millis(2));
    }
    let moved = t.k.dp().stats(&t.outer)?;
    for (i, len) in [1usize, 1000, 64 << 10, 1 << 20].into_iter().enumerate() {
        exchange(&c, 7 + i as u64, len)?;
    }
    let after = t.k.dp().stats(&t.outer)?;
    report("FIONREAD client of haproxy", &[("outer", after)]);
    // The only accelerated client so far: it moved, no hint let it in.
    ensure!(moved.tgtmap_clients == 1, "one client moved: {moved:?}");
    ensure!(after.fallback_no_peer == moved.fallback_no_peer, "its sends ran sk_msg after the move: {after:?}");
    ensure!(after.redirected_bytes > moved.redirected_bytes, "haproxy -> client redirected: {after:?}");
    Ok(())
}

/// Outbound, as Istio's 15001: the app in pod A connects to a service
/// address, iptables captures it to haproxy on 127.0.0.1:15001 in A, which
/// connects to the app in pod B. Registered: the capture rule and A -> B:8080.
fn haproxy_outbound(splice: Splice) -> Result<()> {
    if !tools(&["haproxy", "iptables"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let net = NodeWithPods::new(2)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let upstream = SocketAddr::new(b.v4.into(), 8080);
    let listener = SocketAddr::from(([127, 0, 0, 1], 15001));
    let service = SocketAddr::new(SERVICE_V4.into(), 80);
    let _echo = StreamEcho::start(b.ns.listen(upstream)?)?;
    redirect_output(&a.ns, service.ip(), 80, 15001)?;
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let cfg = haproxy_config(&dir, "outbound.cfg", listener, upstream, splice)?;
    let capture = CaptureRule::new(Some(a.v4.into()), service.into(), listener.into())?;
    let pair = EndpointPair::new(a.v4.into(), upstream.into())?;
    k.dp().insert(&capture, OWNER)?;
    k.dp().insert(&pair, OWNER)?;
    let _haproxy = Program::spawn(&a.ns, &["haproxy", "-db", "-f", &cfg])?;
    wait_listening(&a.ns, listener, T)?;

    run_connections(|i| {
        let c = a.ns.connect(service)?;
        echo_integrity(c, 3000 + i as u64, size_of_conn(i), T)?;
        Ok(())
    })
    .with_context(|| {
        // Which fallback or reset the data path counted, for a failure.
        format!("counters: capture {:?}, pair {:?}", k.dp().stats(&capture).ok(), k.dp().stats(&pair).ok())
    })?;
    let (cst, pst) = (k.dp().stats(&capture)?, k.dp().stats(&pair)?);
    report(&format!("haproxy outbound {splice:?}"), &[("capture", cst), ("pair", pst)]);
    ensure!(cst.splice_hits == 0 && pst.splice_hits == 0, "hits: {cst:?} {pst:?}");
    ensure!(cst.redirected_bytes > 0, "app -> haproxy was accelerated: {cst:?}");
    // The app's sends into haproxy (never a target) run no sk_msg once
    // haproxy has accepted one of its captured connections.
    ensure!(cst.tgtmap_clients > 0, "the app's ends skip sk_msg: {cst:?}");
    Ok(())
}

#[test]
fn haproxy_outbound_without_splice() -> Result<()> {
    haproxy_outbound(Splice::None)
}

#[test]
fn haproxy_outbound_splice_auto() -> Result<()> {
    haproxy_outbound(Splice::Auto)
}

#[test]
fn haproxy_outbound_splice_request() -> Result<()> {
    haproxy_outbound(Splice::Request)
}

#[test]
fn haproxy_outbound_splice_response() -> Result<()> {
    haproxy_outbound(Splice::Response)
}

// ---------------------------------------------------------------------------
// socat

/// socat as the inbound proxy (a process per connection, blocking reads).
#[test]
fn socat_proxy() -> Result<()> {
    if !tools(&["socat"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let t = Inbound::new(k)?;
    let listen = format!("TCP4-LISTEN:7102,bind={},reuseaddr,fork,backlog=128", t.front.ip());
    let _socat = Program::spawn(t.pod(), &["socat", &listen, "TCP4:127.0.0.1:7003"])?;
    t.run("socat", 5000)?;
    Ok(())
}

// ---------------------------------------------------------------------------
// nginx proxy_pass + curl

/// A minimal HTTP/1.1 server that answers every request with its body
/// (Content-Length requests, one per connection); stops when dropped.
struct HttpEcho {
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
}

impl HttpEcho {
    fn start(listener: TcpListener) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let handle = thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match accept_timeout(&listener, Duration::from_millis(100)) {
                    Ok(s) => {
                        thread::spawn(move || {
                            if let Err(e) = http_echo_one(s) {
                                eprintln!("[compat] http echo: {e}");
                            }
                        });
                    }
                    Err(_) => continue,
                }
            }
        });
        Self { stop, handle: Some(handle) }
    }
}

impl Drop for HttpEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn http_echo_one(mut s: TcpStream) -> Result<()> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        ensure!(read_ready(&mut s, &mut b, Some(T))? == 1, "request ended in its head");
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse())
        .transpose()?
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    read_exact_ready(&mut s, &mut body, Some(T))?;
    let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n");
    write_all_ready(&mut s, resp.as_bytes(), Some(T))?;
    write_all_ready(&mut s, &body, Some(T))?;
    s.shutdown(std::net::Shutdown::Write)?;
    Ok(())
}

/// Deterministic bytes of stream `seed` in a file.
fn pattern_file(path: &Path, seed: u64, len: usize) -> Result<u64> {
    let mut data = vec![0u8; len.div_ceil(8) * 8];
    Pattern::new(seed).fill(&mut data);
    data.truncate(len);
    std::fs::write(path, &data)?;
    Ok(fnv(&data))
}

fn fnv(data: &[u8]) -> u64 {
    let mut h = Fnv::default();
    h.update(data);
    h.0
}

/// A TCP extended counter (`nstat`) of namespace `ns`.
fn tcp_ext_counter(ns: &NetNs, name: &str) -> Result<u64> {
    let (ok, out) = run_to_end(ns, &["nstat", "-az", name], T)?;
    ensure!(ok, "nstat: {out}");
    out.lines()
        .find_map(|l| l.split_whitespace().collect::<Vec<_>>().get(1).filter(|_| l.starts_with(name)).copied())
        .with_context(|| format!("no {name} in {out:?}"))?
        .parse()
        .with_context(|| format!("{name} in {out:?}"))
}

/// What one run of [`nginx_proxy_pass_echo`] shows: the counters of curl ->
/// nginx and of nginx -> the echo, and how many connections opened fast.
struct ProxyPassRun {
    outer: RuleCounters,
    inner: RuleCounters,
    fast_opened: u64,
}

/// curl in pod A posts bodies through nginx (proxy_pass) in pod B, on
/// `port`, to an HTTP echo on 127.0.0.1:`app_port`, and checks each answer
/// byte for byte. With `fast_open`, the pods allow TCP Fast Open
/// (`net.ipv4.tcp_fastopen=3`), nginx listens with `fastopen=256` and curl
/// connects with `--tcp-fastopen`. None: a tool or BPF is missing.
fn nginx_proxy_pass_echo(port: u16, app_port: u16, fast_open: bool) -> Result<Option<ProxyPassRun>> {
    if !tools(&["nginx", "curl", "nstat", "sysctl"]) {
        return Ok(None);
    }
    let Some(k) = node() else { return Ok(None) };
    let net = NodeWithPods::new(2)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    if fast_open {
        for ns in [&a.ns, &b.ns] {
            let (ok, out) = run_to_end(ns, &["sysctl", "-w", "net.ipv4.tcp_fastopen=3"], T)?;
            ensure!(ok, "sysctl: {out}");
        }
    }
    let lo: IpAddr = "127.0.0.1".parse()?;
    let front = SocketAddr::new(b.v4.into(), port);
    let _app = HttpEcho::start(b.ns.listen(SocketAddr::new(lo, app_port))?);
    let (inner, outer) =
        (EndpointPair::new(lo, Endpoint::new(lo, app_port))?, EndpointPair::new(a.v4.into(), front.into())?);
    k.dp().insert(&inner, OWNER)?;
    k.dp().insert(&outer, OWNER)?;
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let d = dir.0.display();
    let listen_opts = if fast_open { " fastopen=256" } else { "" };
    let conf = format!(
        "user root;\nworker_processes 2;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/cb; proxy_temp_path {d}/px; fastcgi_temp_path {d}/fc;\n \
         uwsgi_temp_path {d}/uw; scgi_temp_path {d}/sc;\n client_max_body_size 0;\n \
         server {{ listen {front}{listen_opts}; location / {{ proxy_pass http://127.0.0.1:{app_port}; }} }}\n}}\n"
    );
    std::fs::write(dir.path("nginx.conf"), conf)?;
    let _nginx = Program::spawn(&b.ns, &["nginx", "-c", &dir.path("nginx.conf").display().to_string()])?;
    wait_port_listening(&b.ns, port, T)?;
    let url = format!("http://{front}/echo");
    let fast_before = tcp_ext_counter(&b.ns, "TcpExtTCPFastOpenPassive")?;
    run_connections(|i| {
        let (body, out) = (dir.path(&format!("body{i}")), dir.path(&format!("out{i}")));
        let sent = pattern_file(&body, u64::from(port) * 100 + i as u64, size_of_conn(i))?;
        let (body_arg, out_arg) = (format!("@{}", body.display()), out.display().to_string());
        let mut args = vec!["curl", "-sS", "--fail", "--max-time", "60", "-H", "Expect:"];
        if fast_open {
            args.push("--tcp-fastopen");
        }
        args.extend(["--data-binary", &body_arg, "-o", &out_arg, &url]);
        ensure!(Program::spawn(&a.ns, &args)?.wait_timeout(T)?.success(), "curl failed");
        let got = std::fs::read(&out)?;
        ensure!(got.len() == size_of_conn(i), "{} of {} bytes came back", got.len(), size_of_conn(i));
        ensure!(fnv(&got) == sent, "the echoed body differs");
        let _ = std::fs::remove_file(body);
        let _ = std::fs::remove_file(out);
        Ok(())
    })?;
    let fast_opened = tcp_ext_counter(&b.ns, "TcpExtTCPFastOpenPassive")? - fast_before;
    let (ist, ost) = (k.dp().stats(&inner)?, k.dp().stats(&outer)?);
    let what = if fast_open { "nginx + curl, TCP Fast Open" } else { "nginx + curl" };
    report(what, &[("outer", ost), ("inner", ist)]);
    Ok(Some(ProxyPassRun { outer: ost, inner: ist, fast_opened }))
}

/// curl in pod A posts a body through nginx (proxy_pass) in pod B to an HTTP
/// echo and checks the answer byte for byte. nginx reads with FIONREAD.
#[test]
fn nginx_proxy_pass_with_curl() -> Result<()> {
    let Some(run) = nginx_proxy_pass_echo(7102, 7003, false)? else { return Ok(()) };
    ensure!(run.outer.redirected_bytes > 0 && run.inner.redirected_bytes > 0, "curl <-> nginx <-> app accelerated");
    Ok(())
}

/// The same with TCP Fast Open: curl's request heads in the SYN after the
/// first connection (which fetches the cookie). nginx's end of a Fast Open
/// connection exists from the SYN on, before curl's end links at the
/// SYN-ACK: it claims the link at the handshake's last ACK and joins the
/// SOCKMAP by a relink once nginx (a FIONREAD reader) read the bytes that
/// came on TCP. Every body comes back byte for byte.
#[test]
fn nginx_and_curl_with_tcp_fast_open() -> Result<()> {
    let Some(ProxyPassRun { outer, inner, fast_opened }) = nginx_proxy_pass_echo(7115, 7016, true)? else {
        return Ok(());
    };
    // The first connection of each batch of 10 may fetch the cookie.
    ensure!(fast_opened + 10 >= CONNS as u64, "{fast_opened} of {CONNS} connections opened fast");
    ensure!(outer.sockets >= fast_opened && outer.redirected_bytes > 0, "Fast Open connections accelerated: {outer:?}");
    // nginx's end joins only once it read every byte curl sent on TCP, those
    // on their way included (checked before and after the insert, and again
    // once unparked, while a send curl began meanwhile still holds its lock),
    // with what it read published to curl's end at the join; a connection
    // whose request came on TCP before nginx's end linked (no Fast Open)
    // joins late the same way. Each gap, while open, made one connection
    // need a wake-up per read (87 to 1 692 in about 1 run of 20); since, at
    // most 93 in 50 runs. A few per connection are not a regression:
    // hundreds in one connection are.
    ensure!(outer.reader_wakeups < 3 * CONNS as u64, "nginx joined with TCP bytes on their way: {outer:?}");
    ensure!(inner.redirected_bytes > 0, "nginx <-> the echo accelerated: {inner:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// redis

/// A RESP bulk-string command.
fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend(format!("${}\r\n", a.len()).as_bytes());
        v.extend(*a);
        v.extend(b"\r\n");
    }
    v
}

fn read_line(s: &mut TcpStream) -> Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        ensure!(read_ready(s, &mut b, Some(T))? == 1, "connection closed mid-reply");
        line.push(b[0]);
    }
    Ok(String::from_utf8_lossy(&line[..line.len() - 2]).into_owned())
}

/// redis-server in pod B; from pod A, redis-benchmark (50 connections) and
/// 100 connections that SET a value of up to 8 MiB and GET it back.
#[test]
fn redis_server_benchmark_and_values() -> Result<()> {
    if !tools(&["redis-server", "redis-benchmark"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 6379)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let bind = b.v4.to_string();
    let _redis = redis_server(&b.ns, &bind, 6379, &dir.0)?;
    wait_listening(&a.ns, server, T)?;
    run_connections(|i| {
        let mut c = a.ns.connect(server)?;
        let key = format!("compat:{i}");
        let mut value = vec![0u8; size_of_conn(i).div_ceil(8) * 8];
        Pattern::new(9000 + i as u64).fill(&mut value);
        value.truncate(size_of_conn(i));
        write_all_ready(&mut c, &resp(&[b"SET", key.as_bytes(), &value]), Some(T))?;
        ensure!(read_line(&mut c)? == "+OK", "SET refused");
        write_all_ready(&mut c, &resp(&[b"GET", key.as_bytes()]), Some(T))?;
        let n: usize = read_line(&mut c)?.trim_start_matches('$').parse()?;
        ensure!(n == value.len(), "GET returned {n} bytes, {} were set", value.len());
        let mut got = vec![0u8; n + 2];
        read_exact_ready(&mut c, &mut got, Some(T))?;
        ensure!(got[..n] == value[..], "GET returned other bytes");
        Ok(())
    })?;
    let (ok, out) = run_to_end(
        &a.ns,
        &["redis-benchmark", "-h", &bind, "-p", "6379", "-c", "50", "-n", "20000", "-d", "1024", "-t", "set,get", "-q"],
        T,
    )?;
    ensure!(ok, "redis-benchmark failed: {out}");
    ensure!(out.contains("SET") && out.contains("GET"), "redis-benchmark: {out}");
    let st = k.dp().stats(&pair)?;
    report("redis", &[("pair", st)]);
    ensure!(st.redirected_bytes > 0, "redis traffic accelerated: {st:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// openssl

/// openssl s_server in pod B and s_client in pod A, with kernel TLS asked for
/// (OPENSSL_CONF Options = KTLS: both try TCP_ULP "tls"), 100 connections, a
/// stream each way checked byte for byte.
#[test]
fn openssl_s_server_s_client_with_ktls_asked() -> Result<()> {
    if !tools(&["openssl"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 4433)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let (cert, key, conf) = (dir.path("cert.pem"), dir.path("key.pem"), dir.path("openssl.cnf"));
    let st = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=compat", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(Stdio::null())
        .status()?;
    ensure!(st.success(), "openssl req failed");
    std::fs::write(
        &conf,
        "openssl_conf = init\n[init]\nssl_conf = ssl\n[ssl]\nsystem_default = tls\n[tls]\nOptions = KTLS\n",
    )?;
    let addr = server.to_string();
    // One connection at a time: one s_server per connection.
    for i in 0..CONNS {
        let len = size_of_conn(i).min(1 << 20);
        openssl_one(a, b, &addr, [&cert, &key, &conf], i as u64, len)
            .with_context(|| format!("connection {i} ({len} B)"))?;
    }
    let st = k.dp().stats(&pair)?;
    report("openssl", &[("pair", st)]);
    eprintln!("[compat] openssl: kTLS offered by this kernel: {}", k.dp().kernel().ktls);
    Ok(())
}

fn openssl_one(
    a: &meshwarp_testbed::Pod,
    b: &meshwarp_testbed::Pod,
    addr: &str,
    [cert, key, conf]: [&Path; 3],
    i: u64,
    len: usize,
) -> Result<()> {
    let env = format!("OPENSSL_CONF={}", conf.display());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let mut srv = Program::spawn_with(
        &b.ns,
        &["env", &env, "openssl", "s_server", "-quiet", "-naccept", "1", "-accept", addr, "-cert", &cert, "-key", &key],
        Stdio::piped(),
        Stdio::piped(),
    )?;
    // Not by connecting: s_server -naccept 1 would take the probe as its one connection.
    wait_port_listening(&b.ns, addr.parse::<SocketAddr>()?.port(), T)?;
    let mut cli = Program::spawn_with(
        &a.ns,
        &["env", &env, "openssl", "s_client", "-quiet", "-nocommands", "-no_ign_eof", "-connect", addr],
        Stdio::piped(),
        Stdio::piped(),
    )?;
    // Each side's stdin carries its stream; stdin stays open until both
    // streams arrived (an EOF would end the session early).
    type Sender = thread::JoinHandle<Result<(u64, std::process::ChildStdin)>>;
    type Receiver = thread::JoinHandle<Result<(usize, u64)>>;
    let pump = |p: &mut Program, seed: u64| -> Result<(Sender, Receiver)> {
        let mut stdin = p.child().stdin.take().context("stdin")?;
        let mut stdout = p.child().stdout.take().context("stdout")?;
        let tx = thread::spawn(move || {
            // Digits only: s_server reads command letters (q, r, ...) on stdin.
            let mut data = vec![0u8; len.div_ceil(8) * 8];
            Pattern::new(seed).fill(&mut data);
            data.truncate(len);
            data.iter_mut().for_each(|b| *b = b'0' + *b % 10);
            stdin.write_all(&data)?;
            Ok((fnv(&data), stdin))
        });
        let rx = thread::spawn(move || {
            let mut got = Vec::with_capacity(len);
            let mut buf = vec![0u8; 64 << 10];
            while got.len() < len {
                let n = stdout.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            Ok((got.len(), fnv(&got)))
        });
        Ok((tx, rx))
    };
    let (stx, srx) = pump(&mut srv, 20_000 + 2 * i)?;
    let (ctx, crx) = pump(&mut cli, 20_001 + 2 * i)?;
    let ((s_sent, s_in), (c_sent, c_in)) = (stx.join().unwrap()?, ctx.join().unwrap()?);
    let (c_got, s_got) = (crx.join().unwrap()?, srx.join().unwrap()?);
    drop((s_in, c_in));
    ensure!(c_got == (len, s_sent), "client received {} of {len} bytes (or other bytes)", c_got.0);
    ensure!(s_got == (len, c_sent), "server received {} of {len} bytes (or other bytes)", s_got.0);
    Ok(())
}

// ---------------------------------------------------------------------------
// splice readers

/// A real program that reads its sockets with splice(2): a python echo
/// (non-blocking sockets, os.splice socket -> pipe -> socket). python
/// imports splice, so the guard knows before its first connection.
const PY_SPLICE_ECHO: &str = r#"
import os, select, socket, sys, threading
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.setblocking(False)
ls.bind((sys.argv[1], int(sys.argv[2])))
ls.listen(128)
def serve(c):
    c.setblocking(False)
    r, w = os.pipe()
    while True:
        select.select([c], [], [])
        try:
            n = os.splice(c.fileno(), w, 65536)
        except BlockingIOError:
            continue
        if n == 0:
            break
        while n:
            select.select([], [c], [])
            try:
                n -= os.splice(r, c.fileno(), n)
            except BlockingIOError:
                pass
    c.shutdown(socket.SHUT_WR)
    c.close()
while True:
    select.select([ls], [], [])
    try:
        c, _ = ls.accept()
    except BlockingIOError:
        continue
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

#[test]
fn python_splice_echo() -> Result<()> {
    if !tools(&["python3"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 7200)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let bind = b.v4.to_string();
    let _py = Program::spawn(&b.ns, &["python3", "-c", PY_SPLICE_ECHO, &bind, "7200"])?;
    wait_listening(&a.ns, server, T)?;
    run_connections(|i| {
        echo_integrity(a.ns.connect(server)?, 11_000 + i as u64, size_of_conn(i), T).map_err(Into::into)
    })?;
    let st = k.dp().stats(&pair)?;
    report("python splice echo", &[("pair", st)]);
    ensure!(st.splice_hits == 0, "{st:?}");
    // python imports splice, and never reads with recv(): the guard keeps
    // every connection of it off the redirect path.
    ensure!(st.redirected_bytes == 0 && st.fallback_reader + st.fallback_splice >= CONNS as u64, "{st:?}");
    Ok(())
}

/// A program that splices by raw system call cannot be known before it
/// splices. This one first serves a connection with recv() (so the guard has
/// seen it read without blocking and makes its sockets redirect targets),
/// then switches to splice. That first spliced connection, hit while
/// redirected bytes wait for it, must fail loudly (reset, an incident) and
/// never deliver a short or reordered stream; from then on its sockets are
/// not redirect targets and every connection is intact.
#[test]
fn raw_syscall_splice_reader_fails_loudly_once_then_is_safe() -> Result<()> {
    let Some(k) = node() else { return Ok(()) };
    if k.dp().kernel().splice_sees_redirected {
        eprintln!("[compat] this kernel's splice sees redirected bytes: nothing to guard");
        return Ok(());
    }
    let incidents = k.dp().incidents();
    let (net, server, pair) = pods_with_pair(&k, 7300)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let l = b.ns.listen(server)?;
    let mut failed_loudly = Vec::new();
    for i in 0..=CONNS {
        let c = a.ns.connect(server)?;
        let s = accept_timeout(&l, T)?;
        let len = if i == 1 { 8 << 20 } else { size_of_conn(i) };
        let srv = if i == 0 {
            let (s, w) = (s.try_clone()?, s);
            thread::spawn(move || -> Result<()> {
                let mut s = s;
                let mut w = w;
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = read_ready(&mut s, &mut buf, Some(T))?;
                    if n == 0 {
                        return Ok(w.shutdown(std::net::Shutdown::Write)?);
                    }
                    write_all_ready(&mut w, &buf[..n], Some(T))?;
                }
            })
        } else {
            thread::spawn(move || splice_echo(s, T).map_err(anyhow::Error::from))
        };
        let (sent, got) = exchange_both(c, 13_000 + i as u64, len);
        let server_end = srv.join().unwrap();
        match (&sent, &got, &server_end) {
            (Ok(_), Ok(_), Ok(())) => {}
            _ => {
                // Loud: an error the application sees (EACCES on send,
                // ECONNRESET/ECONNABORTED on receive or splice), never a
                // stream that ends early without one, nor other bytes.
                let os_error = |e: &std::io::Error| e.raw_os_error().is_some();
                let loud = sent.as_ref().err().is_some_and(os_error)
                    || got.as_ref().err().is_some_and(|e| matches!(e, Received::Io(e) if os_error(e)));
                ensure!(loud, "connection {i} failed quietly: sent {sent:?}, received {got:?}, server {server_end:?}");
                ensure!(!matches!(got, Err(Received::Wrong(_))), "connection {i} delivered other bytes: {got:?}");
                eprintln!("[compat] raw splice reader, connection {i} failed loudly: sent {sent:?}, received {got:?}");
                failed_loudly.push(i);
            }
        }
    }
    ensure!(failed_loudly == [1], "only the first spliced connection failed, loudly: {failed_loudly:?}");
    let st = k.dp().stats(&pair)?;
    report("raw syscall splice reader", &[("pair", st)]);
    ensure!(st.splice_hits == 1, "one hit: {st:?}");
    let hit = loop {
        let i = incidents.recv_timeout(T).context("no incident for the hit")?;
        if i.kind == meshwarp_core::IncidentKind::SpliceHit {
            break i;
        }
    };
    ensure!(hit.reset && hit.pending_bytes > 0, "{hit:?}");
    ensure!(hit.server == Some(server) && hit.tgid == std::process::id(), "names the connection and process: {hit:?}");
    Ok(())
}

#[derive(Debug)]
#[allow(dead_code)] // the fields are read through Debug in failure messages
enum Received {
    Io(std::io::Error),
    /// The stream ended early (`got` of the bytes sent).
    Short(usize),
    /// A byte differs (its offset).
    Wrong(usize),
}

/// Sends stream `seed` and reads its echo at once; the outcome of each side.
fn exchange_both(s: TcpStream, seed: u64, len: usize) -> (std::io::Result<u64>, std::result::Result<usize, Received>) {
    let r = match s.try_clone() {
        Ok(r) => r,
        Err(e) => return (Err(e), Err(Received::Short(0))),
    };
    thread::scope(|scope| {
        let tx = scope.spawn(|| meshwarp_testbed::send_pattern(&s, seed, len));
        let mut r = r;
        let mut all = Vec::with_capacity(len);
        let mut buf = vec![0u8; 65536];
        let ended = loop {
            match read_ready(&mut r, &mut buf, Some(T)) {
                Ok(0) => break None,
                Ok(n) => all.extend_from_slice(&buf[..n]),
                Err(e) => break Some(e),
            }
        };
        let mut expect = vec![0u8; len.div_ceil(8) * 8];
        Pattern::new(seed).fill(&mut expect);
        expect.truncate(len);
        let rx = if let Some(at) = all.iter().zip(&expect).position(|(a, b)| a != b) {
            Err(Received::Wrong(at))
        } else if all.len() > len {
            Err(Received::Wrong(len))
        } else if let Some(e) = ended {
            Err(Received::Io(e))
        } else if all.len() < len {
            Err(Received::Short(all.len()))
        } else {
            Ok(all.len())
        };
        (tx.join().unwrap(), rx)
    })
}

// ---------------------------------------------------------------------------
// blocking readers

/// A blocking full-duplex program: a reader thread and a writer thread per
/// socket, the writer half-closes while the reader is blocked; an EAGAIN
/// from a blocking read is an error, as for any such application.
fn blocking_duplex(s: TcpStream, seed: u64, len: usize, echo: bool) -> Result<()> {
    let r = s.try_clone()?;
    let mut w = s;
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let reader = thread::spawn(move || -> Result<(usize, u64)> {
        let mut r = r;
        let mut buf = vec![0u8; 65536];
        let (mut got, mut h) = (0usize, Fnv::default());
        loop {
            let n = r.read(&mut buf).context("blocking read")?;
            if n == 0 {
                return Ok((got, h.0));
            }
            h.update(&buf[..n]);
            got += n;
            if echo && tx.send(buf[..n].to_vec()).is_err() {
                bail!("echo writer gone");
            }
        }
    });
    let sent = if echo {
        let mut h = Fnv::default();
        for chunk in rx {
            w.write_all(&chunk)?;
            h.update(&chunk);
        }
        h.0
    } else {
        let mut data = vec![0u8; len.div_ceil(8) * 8];
        Pattern::new(seed).fill(&mut data);
        data.truncate(len);
        for c in data.chunks(4096 + (seed as usize % 60_000)) {
            w.write_all(c)?;
        }
        fnv(&data)
    };
    w.shutdown(std::net::Shutdown::Write)?;
    let (got, h) = reader.join().unwrap()?;
    if !echo {
        ensure!(got == len && h == sent, "{got} of {len} bytes echoed (or other bytes)");
    }
    Ok(())
}

fn blocking_socket(ns: &NetNs, to: Option<SocketAddr>, listen: Option<SocketAddr>) -> Result<socket2::Socket> {
    Ok(ns.enter(|| -> std::io::Result<socket2::Socket> {
        let addr = to.or(listen).unwrap();
        let s = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
        if let Some(l) = listen {
            s.set_reuse_address(true)?;
            s.bind(&l.into())?;
            s.listen(128)?;
        } else {
            s.connect_timeout(&addr.into(), Duration::from_secs(5))?;
        }
        Ok(s)
    })??)
}

#[test]
fn blocking_full_duplex_reader() -> Result<()> {
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 7400)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let l: TcpListener = blocking_socket(&b.ns, None, Some(server))?.into();
    let srv = thread::spawn(move || -> Result<()> {
        for _ in 0..CONNS {
            let (s, _) = l.accept()?;
            thread::spawn(move || {
                if let Err(e) = blocking_duplex(s, 0, 0, true) {
                    eprintln!("[compat] blocking echo: {e:#}");
                }
            });
        }
        Ok(())
    });
    run_connections(|i| {
        let c: TcpStream = blocking_socket(&a.ns, Some(server), None)?.into();
        blocking_duplex(c, 15_000 + i as u64, size_of_conn(i), false)
    })?;
    srv.join().unwrap()?;
    let st = k.dp().stats(&pair)?;
    report("blocking full-duplex reader", &[("pair", st)]);
    if k.dp().kernel().blocked_read_eagain {
        ensure!(st.sockets == 0, "blocking readers kept off the fast path on this kernel: {st:?}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// urgent data

/// What the python clients below share: their arguments (host, port,
/// connections, ...), `fail`, `recv_exact` on a non-blocking socket, and
/// `connect`: a connection that sent "abc" and was answered "ok".
const PY_CLIENT_PRELUDE: &str = r#"
import errno, select, socket, struct, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def fail(why):
    print("FAIL", why, flush=True)
    sys.exit(1)
def recv_exact(c, k):
    got = b""
    while len(got) < k:
        select.select([c], [], [])
        try:
            d = c.recv(k - len(got))
        except BlockingIOError:
            continue
        if not d:
            fail("connection closed early")
        got += d
    return got
def connect():
    c = socket.create_connection((host, port))
    c.setblocking(False)
    c.sendall(b"abc")
    if recv_exact(c, 2) != b"ok":
        fail("no ok")
    return c
"#;

/// A python client in one pod of a node, the server's listener in the other.
struct PythonClient {
    k: KernelTest,
    _net: NodeWithPods,
    l: std::net::TcpListener,
    pair: EndpointPair,
    py: Program,
}

/// Two pods, a pair from the first to `port` on the second and its
/// listener, for a python client in the first: its script (the prelude
/// first) started with the server's host, the port, `n` and `more` arguments.
fn python_client(port: u16, script: &str, n: usize, more: &[&str]) -> Result<Option<PythonClient>> {
    if !tools(&["python3"]) {
        return Ok(None);
    }
    let Some(k) = node() else { return Ok(None) };
    let (net, server, pair) = pods_with_pair(&k, port)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let l = b.ns.listen(server)?;
    let code = format!("{PY_CLIENT_PRELUDE}{script}");
    let (host, port, n) = (b.v4.to_string(), port.to_string(), n.to_string());
    let mut args = vec!["python3", "-c", &code, &host, &port, &n];
    args.extend_from_slice(more);
    let py = Program::spawn_with(&a.ns, &args, std::process::Stdio::null(), std::process::Stdio::piped())?;
    Ok(Some(PythonClient { k, _net: net, l, pair, py }))
}

/// A python client that sends urgent data: per connection "abc", waits for
/// "ok", then one byte with MSG_OOB and "def", and waits for "done"
/// (non-blocking sockets, so the guard sees it read without blocking).
const PY_URGENT_CLIENT: &str = r#"
for i in range(n):
    c = connect()
    if c.send(b"X", socket.MSG_OOB) != 1:
        fail("urgent send")
    c.sendall(b"def")
    if recv_exact(c, 4) != b"done":
        fail("no done")
    c.close()
    time.sleep(0.05)
"#;

/// A real program sending urgent data (python's `send(b"X", MSG_OOB)`):
/// every connection's reader gets the byte out of band and "abcdef"
/// in-band, as on plain TCP, whether its bytes were redirected before the
/// urgent send or its program was already known to send urgent data.
#[test]
fn python_urgent_data_arrives_out_of_band() -> Result<()> {
    use std::os::fd::AsRawFd;
    const N: usize = 8;
    let Some(PythonClient { k, _net, l, pair, mut py }) = python_client(7500, PY_URGENT_CLIENT, N, &[])? else {
        return Ok(());
    };
    for i in 0..N {
        let mut s = accept_timeout(&l, T)?;
        let mut got = [0u8; 3];
        read_exact_ready(&mut s, &mut got, Some(T))?;
        ensure!(&got == b"abc", "connection {i}: {got:?}");
        write_all_ready(&mut s, b"ok", Some(T))?;
        meshwarp_testbed::wait_ready(s.as_raw_fd(), libc::POLLPRI, Some(Instant::now() + T))
            .with_context(|| format!("connection {i}: no urgent data"))?;
        let mut u = 0u8;
        // SAFETY: one byte into a live buffer.
        let rc =
            unsafe { libc::recv(s.as_raw_fd(), (&mut u as *mut u8).cast(), 1, libc::MSG_OOB | libc::MSG_DONTWAIT) };
        ensure!(rc == 1 && u == b'X', "connection {i}: recv(MSG_OOB) {rc} {u}: {}", std::io::Error::last_os_error());
        read_exact_ready(&mut s, &mut got, Some(T))?;
        ensure!(&got == b"def", "connection {i}: the in-band stream without the urgent byte: {got:?}");
        write_all_ready(&mut s, b"done", Some(T))?;
    }
    let status = py.wait_timeout(T)?;
    ensure!(status.success(), "python: {status}");
    let st = k.dp().stats(&pair)?;
    report("python urgent data", &[("pair", st)]);
    ensure!(st.urgent_hits == 0 && st.fallback_urgent >= 1, "{st:?}");
    ensure!(st.redirected_bytes >= 3, "some connection redirected before its urgent send: {st:?}");
    Ok(())
}

/// python sending with MSG_ZEROCOPY on each connection, with SO_ZEROCOPY on
/// from the second one, as a program that can live without it does (the
/// first one lets the guard see python read): where the option is refused
/// (EOPNOTSUPP) it sends copies; where taken, it checks that the completions
/// on its error queue number its sends exactly, once each. Prints "OK taken
/// T refused R" or "FAIL why".
const PY_ZEROCOPY_CLIENT: &str = r#"
total = int(sys.argv[4])
SO_ZEROCOPY, MSG_ZEROCOPY, ORIGIN_ZEROCOPY = 60, 0x4000000, 5
SIZES = [1, 100, 4096, 32768, 65536, 200000, 1 << 20, 77]
def completions(c, ranges):
    while True:
        try:
            _, anc, _, _ = c.recvmsg(0, 512, socket.MSG_ERRQUEUE)
        except BlockingIOError:
            return
        for _, _, data in anc:
            err, origin, _, _, _, lo, hi = struct.unpack("=IBBBBII", data[:16])
            if origin != ORIGIN_ZEROCOPY or err:
                fail("not a zero-copy completion: %d %d" % (origin, err))
            ranges.append((lo, hi))
def completed(ranges, send):
    return any(lo <= send <= hi for lo, hi in ranges)
block = bytes(range(256)) * (total // 256 + 2)
# Send buffers used in turn, as a program that frees or reuses one once the
# kernel is done with it: before its next use a buffer waits for the
# completion of the send that used it last, then is overwritten. Had that
# completion come before the kernel was done with the pages, the receiver
# would read the overwrite.
RING = [bytearray(max(SIZES)) for _ in range(4)]
taken = refused = 0
for i in range(n):
    c = connect()
    zc = False
    try:
        if i > 0:
            c.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
            zc = True
            taken += 1
    except OSError as e:
        if e.errno != errno.EOPNOTSUPP:
            raise
        refused += 1
    data = memoryview(block)[i % 256 : i % 256 + total]
    sends = off = 0
    ranges = []
    while off < total:
        k = min(SIZES[sends % len(SIZES)], total - off)
        buf = RING[sends % len(RING)]
        deadline = time.time() + 10
        while zc and sends >= len(RING) and not completed(ranges, sends - len(RING)):
            if time.time() > deadline:
                fail("connection %d: no completion for send %d" % (i, sends - len(RING)))
            completions(c, ranges)
            time.sleep(0.0002)
        buf[:] = b"\xee" * len(buf)
        buf[:k] = data[off : off + k]
        try:
            r = c.send(memoryview(buf)[:k], MSG_ZEROCOPY)
        except BlockingIOError:
            select.select([], [c], [])
            continue
        except OSError as e:
            if e.errno != errno.ENOBUFS:
                raise
            completions(c, ranges)
            continue
        off += r
        sends += 1
    if recv_exact(c, 4) != b"done":
        fail("no done")
    deadline = time.time() + 10
    while zc and sum(hi - lo + 1 for lo, hi in ranges) < sends and time.time() < deadline:
        completions(c, ranges)
        time.sleep(0.005)
    time.sleep(0.05)
    completions(c, ranges)
    ranges.sort()
    nxt = 0
    for lo, hi in ranges:
        if lo != nxt or hi < lo:
            fail("connection %d: completions %s for %d sends" % (i, ranges, sends))
        nxt = hi + 1
    if nxt != (sends if zc else 0):
        fail("connection %d (SO_ZEROCOPY %s): completions %s for %d sends" % (i, zc, ranges, sends))
    c.close()
    time.sleep(0.05)
print("OK taken %d refused %d" % (taken, refused), flush=True)
"#;

/// A real program sending with MSG_ZEROCOPY (python): every stream arrives
/// intact although each send buffer is overwritten as soon as its completion
/// came, and wherever SO_ZEROCOPY is taken the completions number the sends
/// exactly, as on plain TCP. It is refused once, on the first
/// connection whose sends run sk_msg (tcp_bpf would number them wrong): the
/// program sends copies there, redirected; python is remembered, and on its
/// later connections the option is taken, their sends on TCP.
#[test]
fn python_zero_copy_sends_complete_as_on_tcp() -> Result<()> {
    use std::io::Read;
    const N: usize = 8;
    const TOTAL: usize = (8 << 20) + 300_000;
    let total = TOTAL.to_string();
    let Some(PythonClient { k, _net, l, pair, mut py }) = python_client(7501, PY_ZEROCOPY_CLIENT, N, &[&total])? else {
        return Ok(());
    };
    let served = (0..N).try_for_each(|i| -> Result<()> {
        let mut s = accept_timeout(&l, Duration::from_secs(20)).with_context(|| format!("connection {i}"))?;
        let mut got = [0u8; 3];
        read_exact_ready(&mut s, &mut got, Some(T))?;
        ensure!(&got == b"abc", "connection {i}: {got:?}");
        write_all_ready(&mut s, b"ok", Some(T))?;
        let mut data = vec![0u8; TOTAL];
        read_exact_ready(&mut s, &mut data, Some(T)).with_context(|| format!("connection {i}"))?;
        let bad = data.iter().enumerate().position(|(j, &v)| v != ((j + i % 256) % 256) as u8);
        ensure!(bad.is_none(), "connection {i}: the stream differs at byte {bad:?}");
        write_all_ready(&mut s, b"done", Some(T))?;
        Ok(())
    });
    // python's verdict names what went wrong on its side, if anything did
    // (its output can be read once it exited).
    let status = py.wait_timeout(if served.is_ok() { T } else { Duration::from_secs(2) });
    let mut out = String::from("(still running)");
    if status.is_ok() {
        out.clear();
        py.child().stdout.take().context("python's stdout")?.read_to_string(&mut out)?;
    }
    served.with_context(|| format!("python: {out}"))?;
    let status = status?;
    ensure!(status.success() && out.starts_with("OK"), "python: {status}: {out}");
    let refused: u64 = out.split_whitespace().last().and_then(|v| v.parse().ok()).context("python's summary")?;
    let st = k.dp().stats(&pair)?;
    report("python zero-copy sends", &[("pair", st)]);
    ensure!(refused == 1 && st.zerocopy_refused == 1, "python was refused {refused} times: {st:?}");
    ensure!(st.fallback_zerocopy >= 1, "some connection's sends took TCP for SO_ZEROCOPY: {st:?}");
    // Not all of them: the adaptive policy moves some on timing (a write
    // into a peer holding its lock takes TCP, and what follows it waits
    // until it was read; large writes into a reader copying out on another
    // CPU move a stream to TCP for good, demotions_around): 4 200 B on a
    // fresh CI machine (the first three sends, at fc82969, when its 4th send
    // of 32 KiB met the early large-write rule, which no longer applies to
    // a Nagle writer such as this client), 0.86 MB in a local run. More than every connection's handshake ("abc", "ok", "done": 9 B)
    // shows the refused connection's sends ran the fast path (the others'
    // took TCP: SO_ZEROCOPY).
    let handshakes = 9 * N as u64;
    ensure!(st.redirected_bytes > handshakes, "the refused connection's copies redirected: {st:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// nginx static files (sendfile)

/// nginx in pod B serves 100 files (1 B to 8 MiB) with `sendfile on` and
/// `tcp_nopush on`: file pages go to the socket by sendfile(), through
/// tcp_bpf's sends; curl in pod A downloads each and checks it byte for byte.
#[test]
fn nginx_sendfile_static_files_with_curl() -> Result<()> {
    if !tools(&["nginx", "curl"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let net = NodeWithPods::new(2)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let front = SocketAddr::new(b.v4.into(), 7104);
    let pair = EndpointPair::new(a.v4.into(), front.into())?;
    k.dp().insert(&pair, OWNER)?;
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let d = dir.0.display();
    std::fs::create_dir_all(dir.path("www"))?;
    let sums = (0..CONNS)
        .map(|i| pattern_file(&dir.path(&format!("www/f{i}")), 7400 + i as u64, size_of_conn(i)))
        .collect::<Result<Vec<_>>>()?;
    let conf = format!(
        "user root;\nworker_processes 2;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/cb; proxy_temp_path {d}/px; fastcgi_temp_path {d}/fc;\n \
         uwsgi_temp_path {d}/uw; scgi_temp_path {d}/sc;\n sendfile on; tcp_nopush on; sendfile_max_chunk 512k;\n \
         server {{ listen {front}; root {d}/www; }}\n}}\n"
    );
    std::fs::write(dir.path("nginx.conf"), conf)?;
    let _nginx = Program::spawn(&b.ns, &["nginx", "-c", &dir.path("nginx.conf").display().to_string()])?;
    wait_listening(&a.ns, front, T)?;
    run_connections(|i| {
        let out = dir.path(&format!("out{i}"));
        let url = format!("http://{front}/f{i}");
        let mut curl = Program::spawn(
            &a.ns,
            &["curl", "-sS", "--fail", "--max-time", "60", "-o", &out.display().to_string(), &url],
        )?;
        ensure!(curl.wait_timeout(T)?.success(), "curl failed");
        let got = std::fs::read(&out)?;
        ensure!(got.len() == size_of_conn(i), "{} of {} bytes came", got.len(), size_of_conn(i));
        ensure!(fnv(&got) == sums[i], "the file came with other bytes");
        let _ = std::fs::remove_file(out);
        Ok(())
    })?;
    let st = k.dp().stats(&pair)?;
    report("nginx sendfile + curl", &[("pair", st)]);
    // The files flow nginx -> curl: curl, a reader that polls, is a target.
    ensure!(st.redirected_bytes > (8 << 20), "nginx's sendfile() bytes redirected: {st:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// memcached

/// memcached in pod B (items up to 16 MiB); from pod A, 100 connections that
/// `set` a value of up to 8 MiB and `get` it back, then memcslap (20
/// concurrent clients).
#[test]
fn memcached_values_and_memcslap() -> Result<()> {
    if !tools(&["memcached", "memcslap"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 11211)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let bind = b.v4.to_string();
    let _mc = Program::spawn(
        &b.ns,
        &["memcached", "-u", "root", "-l", &bind, "-p", "11211", "-U", "0", "-m", "1024", "-I", "16m", "-t", "2"],
    )?;
    wait_listening(&a.ns, server, T)?;
    run_connections(|i| {
        let mut c = a.ns.connect(server)?;
        let key = format!("compat{i}");
        let mut value = vec![0u8; size_of_conn(i).div_ceil(8) * 8];
        Pattern::new(9100 + i as u64).fill(&mut value);
        value.truncate(size_of_conn(i));
        let mut set = format!("set {key} 0 0 {}\r\n", value.len()).into_bytes();
        set.extend_from_slice(&value);
        set.extend_from_slice(b"\r\n");
        write_all_ready(&mut c, &set, Some(T))?;
        let l = read_line(&mut c)?;
        ensure!(l == "STORED", "set answered {l:?}");
        write_all_ready(&mut c, format!("get {key}\r\n").as_bytes(), Some(T))?;
        let l = read_line(&mut c)?;
        ensure!(l == format!("VALUE {key} 0 {}", value.len()), "get answered {l:?}");
        let mut got = vec![0u8; value.len() + b"\r\nEND\r\n".len()];
        read_exact_ready(&mut c, &mut got, Some(T))?;
        ensure!(got[..value.len()] == value[..], "get returned other bytes");
        ensure!(&got[value.len()..] == b"\r\nEND\r\n", "get ended with {:?}", &got[value.len()..]);
        Ok(())
    })?;
    let servers = format!("--servers={bind}:11211");
    let (ok, out) = run_to_end(&a.ns, &["memcslap", &servers, "--concurrency=20", "--execute-number=2000"], T)?;
    ensure!(ok, "memcslap failed: {out}");
    ensure!(out.contains("Time to set"), "memcslap: {out}");
    let st = k.dp().stats(&pair)?;
    report("memcached", &[("pair", st)]);
    ensure!(st.redirected_bytes > (8 << 20), "memcached traffic accelerated: {st:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// gRPC (C-core, python grpcio)

/// An echo service with generic handlers (no generated code): a unary call,
/// a bidirectional stream, and a server stream of `n` bytes in 64 KiB
/// messages (a download).
const PY_GRPC_SERVER: &str = r#"
import sys, grpc
from concurrent import futures
host, port = sys.argv[1], sys.argv[2]
def unary(req, ctx):
    return req
def bidi(it, ctx):
    for m in it:
        yield m
def download(req, ctx):
    n, seed = int.from_bytes(req[:8], "big"), int.from_bytes(req[8:16], "big")
    import random
    data = random.Random(seed).randbytes(n)
    for o in range(0, n, 65536):
        yield data[o:o + 65536]
h = grpc.method_handlers_generic_handler("echo.Echo", {
    "Unary": grpc.unary_unary_rpc_method_handler(unary),
    "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    "Download": grpc.unary_stream_rpc_method_handler(download)})
opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
s = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=opts)
s.add_generic_rpc_handlers((h,))
s.add_insecure_port(f"{host}:{port}")
s.start()
s.wait_for_termination()
"#;

/// `n` channels, 10 threads; each channel its own connection (a local
/// subchannel pool): 4 unary calls (1 B to 8 MiB), a bidirectional stream
/// of 50 messages, a download of up to 16 MiB; every byte compared.
const PY_GRPC_CLIENT: &str = r#"
import sys, grpc, random, threading
host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
        ("grpc.use_local_subchannel_pool", 1)]
sizes = [1, 100, 4096, 65536, 1 << 20, 8 << 20, 3, 70000]
def one(i):
    with grpc.insecure_channel(f"{host}:{port}", options=opts) as ch:
        rnd = random.Random(i)
        unary = ch.unary_unary("/echo.Echo/Unary")
        for k in range(4):
            b = rnd.randbytes(sizes[(i + k) % len(sizes)])
            r = unary(b, timeout=60)
            if r != b:
                raise Exception(f"unary of {len(b)} bytes answered {len(r)} other bytes")
        msgs = [rnd.randbytes(sizes[(i + k) % len(sizes)] % 300000 + 1) for k in range(50)]
        got = list(ch.stream_stream("/echo.Echo/Bidi")(iter(msgs), timeout=60))
        if got != msgs:
            raise Exception(f"bidi: {len(got)} of {len(msgs)} messages, or other bytes")
        size = (16 << 20) if i % 10 == 0 else sizes[i % len(sizes)]
        want = random.Random(i).randbytes(size)
        got = b"".join(ch.unary_stream("/echo.Echo/Download")(size.to_bytes(8, "big") + i.to_bytes(8, "big"), timeout=60))
        if got != want:
            raise Exception(f"download: {len(got)} of {size} bytes, or other bytes")
errs = []
def worker(t):
    for i in range(t, n, 10):
        try:
            one(i)
        except Exception as e:
            errs.append((i, repr(e)))
ts = [threading.Thread(target=worker, args=(t,)) for t in range(10)]
[t.start() for t in ts]
[t.join() for t in ts]
if errs:
    print("FAIL", errs[:5], flush=True)
    sys.exit(1)
print("OK", flush=True)
"#;

/// A python gRPC server in pod B and client in pod A (grpcio: gRPC's C core,
/// epoll, TCP_INQ), 100 connections. python imports splice, so the operator vouches for it
/// (`--trust-reader`), as one would for a gRPC service. The counters after.
fn python_grpc(port: u16) -> Result<Option<RuleCounters>> {
    const PY: &str = "/usr/bin/python3";
    if !tools(&[PY]) {
        return Ok(None);
    }
    let ok = std::process::Command::new(PY).args(["-c", "import grpc"]).status()?.success();
    if !ok && missing_feature::<()>("python3-grpcio (scripts/install-deps.sh installs it)").is_none() {
        return Ok(None);
    }
    let python = std::fs::canonicalize(PY)?;
    let Some(k) = KernelTest::start_with(4096, 64, |c| {
        c.trusted_readers = vec![python.clone()];
        c.guard = GuardMode::Auto;
    }) else {
        return Ok(None);
    };
    let (net, server, pair) = pods_with_pair(&k, port)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let (host, port, n) = (b.v4.to_string(), port.to_string(), CONNS.to_string());
    let _srv = Program::spawn(&b.ns, &[PY, "-c", PY_GRPC_SERVER, &host, &port])?;
    wait_listening(&a.ns, server, T)?;
    let (done, out) = run_to_end(&a.ns, &[PY, "-c", PY_GRPC_CLIENT, &host, &port, &n], Duration::from_secs(300))?;
    let st = k.dp().stats(&pair)?;
    report("python gRPC", &[("pair", st)]);
    ensure!(done && out.contains("OK"), "the gRPC client: {out}");
    Ok(Some(st))
}

/// gRPC turns SO_ZEROCOPY on on its listeners (whether or not it sends
/// zero-copy): the accepted ends inherit it, so the server's sends stay on
/// TCP and only the client's are redirected.
#[test]
fn python_grpc_unary_streams_and_downloads() -> Result<()> {
    let Some(st) = python_grpc(7105)? else { return Ok(()) };
    ensure!(st.sockets >= CONNS as u64, "a connection per channel, accelerated: {st:?}");
    ensure!(st.redirected_bytes > (100 << 20), "the client's requests redirected: {st:?}");
    ensure!(st.fallback_zerocopy >= 1, "the server's sends on TCP (SO_ZEROCOPY from its listener): {st:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// PostgreSQL

/// PostgreSQL in pod B (a backend forked per connection, as user postgres);
/// from pod A, 100 psql sessions that each send a literal of 1 B to 8 MiB and
/// read it back, then pgbench (10 clients, 3000 transactions).
#[test]
fn postgres_psql_literals_and_pgbench() -> Result<()> {
    let Some(bin) = postgres_bin() else {
        missing_feature::<()>("PostgreSQL (scripts/install-deps.sh installs it)");
        return Ok(());
    };
    if !tools(&["runuser"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 5432)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let (d, data) = (dir.0.display().to_string(), dir.path("pg").display().to_string());
    let prog = |name: &str| bin.join(name).display().to_string();
    // PostgreSQL refuses to run as root.
    ensure!(std::process::Command::new("chown").args(["postgres", &d]).status()?.success(), "chown {d}");
    let init = std::process::Command::new("runuser")
        .args(["-u", "postgres", "--", &prog("initdb"), "-A", "trust", "-U", "postgres", "-D", &data])
        .stdout(Stdio::null())
        .status()?;
    ensure!(init.success(), "initdb");
    std::fs::write(dir.path("pg/pg_hba.conf"), "host all all 0.0.0.0/0 trust\nlocal all all trust\n")?;
    let host = b.v4.to_string();
    let _pg = Program::spawn(
        &b.ns,
        &["runuser", "-u", "postgres", "--", &prog("postgres"), "-D", &data, "-k", &d, "-h", &host],
    )?;
    wait_listening(&a.ns, server, T)?;
    let ready = Instant::now();
    while !Program::spawn(&a.ns, &[&prog("pg_isready"), "-h", &host, "-U", "postgres"])?.wait_timeout(T)?.success() {
        ensure!(ready.elapsed() < T, "PostgreSQL did not become ready");
        thread::sleep(Duration::from_millis(100));
    }
    run_connections(|i| {
        let n = size_of_conn(i);
        let mut raw = vec![0u8; n.div_ceil(8) * 8];
        Pattern::new(9300 + i as u64).fill(&mut raw);
        let literal: String = raw[..n].iter().map(|b| char::from(b'a' + b % 26)).collect();
        let query = dir.path(&format!("q{i}.sql"));
        std::fs::write(&query, format!("select '{literal}';\n"))?;
        let cmd = format!("{} -h {host} -U postgres -At -f {} 2>&1", prog("psql"), query.display());
        let (ok, out) = run_to_end(&a.ns, &["sh", "-c", &cmd], T)?;
        ensure!(ok, "psql: {}", &out[..out.len().min(300)]);
        let got = out.trim_end_matches('\n');
        ensure!(got == literal, "{} of {n} bytes came back, or other bytes", got.len());
        let _ = std::fs::remove_file(query);
        Ok(())
    })?;
    let pgbench = |args: &[&str]| -> Result<String> {
        let mut all = vec![prog("pgbench"), "-h".into(), host.clone(), "-U".into(), "postgres".into()];
        all.extend(args.iter().map(|a| a.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let (ok, out) = run_to_end(&a.ns, &all, T)?;
        ensure!(ok, "pgbench {args:?}: {out}");
        Ok(out)
    };
    pgbench(&["-i", "postgres"])?;
    let out = pgbench(&["-c", "10", "-j", "2", "-t", "300", "postgres"])?;
    ensure!(out.contains("processed: 3000/3000"), "pgbench: {out}");
    let st = k.dp().stats(&pair)?;
    report("postgres", &[("pair", st)]);
    ensure!(st.redirected_bytes > (8 << 20), "psql <-> postgres accelerated: {st:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// Node.js

/// `n` POSTs through Node's http client, 10 connections at a time, a new
/// connection each (`Connection: close`), sizes as `size_of_conn`, every answer
/// compared with its body.
const NODE_HTTP_CLIENT: &str = r#"
const http = require('http');
const crypto = require('crypto');
const [host, port, n] = process.argv.slice(1);
const sizes = [8 << 20, 1 << 20, 1 << 20, 65536, 65536, 65536, 1];
const agent = new http.Agent({keepAlive: false, maxSockets: 10});
function one(i) {
  const size = i % 10 < 7 ? sizes[i % 10] : 4096 + i * 37;
  const body = crypto.createHash('sha256').update(String(i)).digest();
  const buf = Buffer.alloc(size);
  for (let o = 0; o < size; o += 32) body.copy(buf, o, 0, Math.min(32, size - o));
  return new Promise((resolve, reject) => {
    const req = http.request({host, port: +port, method: 'POST', path: '/', agent,
                              headers: {'Content-Length': size, 'Connection': 'close'}}, res => {
      const parts = [];
      res.on('data', c => parts.push(c));
      res.on('end', () => {
        const got = Buffer.concat(parts);
        if (got.equals(buf)) resolve();
        else reject(new Error(`connection ${i}: ${got.length} of ${size} bytes, or other bytes`));
      });
    });
    req.on('error', reject);
    req.end(buf);
  });
}
Promise.all([...Array(+n).keys()].map(one))
  .then(() => console.log('OK'))
  .catch(e => { console.log('FAIL', e.message); process.exit(1); });
"#;

/// Node.js in both pods: its http server in pod B listening on `::` (dual
/// stack: an IPv4 client's server end is an IPv6 socket with IPv4-mapped
/// addresses), its http client in pod A; 100 POSTs of 1 B to 8 MiB echoed
/// over IPv4 twice (the second round after both programs were seen reading),
/// then over IPv6.
#[test]
fn node_http_server_and_client() -> Result<()> {
    if !tools(&["node"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let net = NodeWithPods::new(2)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let (v4, v6) = (SocketAddr::new(b.v4.into(), 7106), SocketAddr::new(b.v6.into(), 7106));
    let pair4 = EndpointPair::new(a.v4.into(), v4.into())?;
    let pair6 = EndpointPair::new(a.v6.into(), v6.into())?;
    k.dp().insert(&pair4, OWNER)?;
    k.dp().insert(&pair6, OWNER)?;
    let _srv = Program::spawn(&b.ns, &["node", "-e", NODE_HTTP_ECHO, "::", "7106"])?;
    wait_listening(&a.ns, v4, T)?;
    let n = CONNS.to_string();
    for (round, host) in [(1, b.v4.to_string()), (2, b.v4.to_string()), (3, b.v6.to_string())] {
        let (ok, out) = run_to_end(&a.ns, &["node", "-e", NODE_HTTP_CLIENT, &host, "7106", &n], T)?;
        ensure!(ok && out.contains("OK"), "round {round} ({host}): the node client: {out}");
    }
    let (st4, st6) = (k.dp().stats(&pair4)?, k.dp().stats(&pair6)?);
    report("node http", &[("IPv4 (mapped server ends)", st4), ("IPv6", st6)]);
    // Both ends are targets (no client in the target-only map, nothing seen
    // splicing; the first connections, before node was classified and seen
    // reading, take TCP),
    // and most bytes redirected: of 2 x 2 x ~107 MB over IPv4 and 2 x ~107
    // MB over IPv6, less the rest of each body whose write of 16 KiB or
    // more finds its reader copying out on another CPU (demotions_around,
    // for good: a choice of timing): 281-320 MB and 137-174 MB in four
    // local runs.
    for (st, family) in [(st4, "IPv4"), (st6, "IPv6")] {
        ensure!(
            st.tgtmap_clients == 0 && st.fallback_splice == 0,
            "node <-> node over {family}: every end a target: {st:?}"
        );
    }
    ensure!(st4.redirected_bytes > (160 << 20), "node <-> node over IPv4 accelerated: {st4:?}");
    ensure!(st6.redirected_bytes > (80 << 20), "node <-> node over IPv6 accelerated: {st6:?}");
    Ok(())
}

// ---------------------------------------------------------------------------
// Go

/// Go's net/http (the runtime's netpoller: epoll, non-blocking reads and
/// writes): `server ADDR` answers each POST with its body; `client URL N`
/// posts N bodies (sizes as `size_of_conn`), 10 at a time, a connection
/// each, and compares every answer.
const GO_HTTP: &str = r#"package main

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
)

func main() {
	switch os.Args[1] {
	case "server":
		http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
			b, err := io.ReadAll(r.Body)
			if err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
			w.Write(b)
		})
		if err := http.ListenAndServe(os.Args[2], nil); err != nil {
			fmt.Println("FAIL", err)
			os.Exit(1)
		}
	case "client":
		url := os.Args[2]
		n, _ := strconv.Atoi(os.Args[3])
		sizes := []int{8 << 20, 1 << 20, 1 << 20, 65536, 65536, 65536, 1}
		tr := &http.Transport{DisableKeepAlives: true, MaxConnsPerHost: 10}
		c := &http.Client{Transport: tr}
		var wg sync.WaitGroup
		errs := make(chan error, n)
		sem := make(chan struct{}, 10)
		for i := 0; i < n; i++ {
			wg.Add(1)
			sem <- struct{}{}
			go func(i int) {
				defer wg.Done()
				defer func() { <-sem }()
				size := 4096 + i*37
				if i%10 < 7 {
					size = sizes[i%10]
				}
				seed := sha256.Sum256([]byte(strconv.Itoa(i)))
				body := bytes.Repeat(seed[:], size/32+1)[:size]
				resp, err := c.Post(url, "application/octet-stream", bytes.NewReader(body))
				if err != nil {
					errs <- err
					return
				}
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(got, body) {
					errs <- fmt.Errorf("connection %d: %d of %d bytes, or other bytes", i, len(got), size)
				}
			}(i)
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			fmt.Println("FAIL", e)
			os.Exit(1)
		}
		fmt.Println("OK")
	}
}
"#;

/// A Go HTTP server and a Node.js client, then a Go client and a Node.js
/// server, 100 POSTs of 1 B to 8 MiB each way, twice. A Go binary carries the
/// standard library's splice path (`io.Copy` between TCP connections), so
/// its ends are never redirect targets: what Go sends is redirected (into
/// node), what it receives comes on TCP.
#[test]
fn go_http_with_node() -> Result<()> {
    if !tools(&["go", "node"]) {
        return Ok(());
    }
    let dir = ScratchDir::new("meshwarp-compat-")?;
    std::fs::write(dir.path("main.go"), GO_HTTP)?;
    let bin = dir.path("gohttp").display().to_string();
    let built = std::process::Command::new("go").args(["build", "-o", &bin, "main.go"]).current_dir(&dir.0).output()?;
    ensure!(built.status.success(), "go build: {}", String::from_utf8_lossy(&built.stderr));
    let Some(k) = node() else { return Ok(()) };
    let net = NodeWithPods::new(2)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let (go_server, node_server) = (SocketAddr::new(b.v4.into(), 7108), SocketAddr::new(b.v4.into(), 7109));
    let into_go = EndpointPair::new(a.v4.into(), go_server.into())?;
    let from_go = EndpointPair::new(a.v4.into(), node_server.into())?;
    k.dp().insert(&into_go, OWNER)?;
    k.dp().insert(&from_go, OWNER)?;
    let _go = Program::spawn(&b.ns, &[&bin, "server", &go_server.to_string()])?;
    let _node = Program::spawn(&b.ns, &["node", "-e", NODE_HTTP_ECHO, &b.v4.to_string(), "7109"])?;
    wait_listening(&a.ns, go_server, T)?;
    wait_listening(&a.ns, node_server, T)?;
    let (n, host, url) = (CONNS.to_string(), b.v4.to_string(), format!("http://{node_server}/"));
    let mut first = (RuleCounters::default(), RuleCounters::default());
    for round in 1..=2 {
        let (ok, out) = run_to_end(&a.ns, &["node", "-e", NODE_HTTP_CLIENT, &host, "7108", &n], T)?;
        ensure!(ok && out.contains("OK"), "round {round}, node client, go server: {out}");
        let (ok, out) = run_to_end(&a.ns, &[&bin, "client", &url, &n], T)?;
        ensure!(ok && out.contains("OK"), "round {round}, go client, node server: {out}");
        if round == 1 {
            first = (k.dp().stats(&into_go)?, k.dp().stats(&from_go)?);
        }
    }
    let (st_into, st_from) = (k.dp().stats(&into_go)?, k.dp().stats(&from_go)?);
    report("go http", &[("node -> go server", st_into), ("go client -> node", st_from)]);
    let second =
        (st_into.redirected_bytes - first.0.redirected_bytes, st_from.redirected_bytes - first.1.redirected_bytes);
    eprintln!(
        "[compat] go http, round 2: answers {} B (demotions_around {}), posts {} B (demotions_around {})",
        second.0,
        st_into.demotions_around - first.0.demotions_around,
        second.1,
        st_from.demotions_around - first.1.demotions_around
    );
    ensure!(
        st_into.fallback_splice >= 1 && st_from.fallback_splice >= 1,
        "go ends are no targets: {st_into:?} {st_from:?}"
    );
    // Judged in round 2: round 1's first connections wait on TCP until the
    // node client is classified (33 of them on a fresh CI machine, reading
    // all of node's ELF then), round 2's never. One direction of each
    // connection, ~107 MB a round, less the rest of each body whose write
    // of 16 KiB or more finds its reader copying out on another CPU
    // (demotions_around, for good: timing): 70-107 MB with 0-10 such on
    // this machine. A quarter of the least seen shows Go's sends redirected.
    ensure!(second.0 > (16 << 20), "the go server's answers redirected in round 2: {} B, {st_into:?}", second.0);
    ensure!(second.1 > (16 << 20), "the go client's posts redirected in round 2: {} B, {st_from:?}", second.1);
    Ok(())
}

// ---------------------------------------------------------------------------
// Java

/// Java 17 (run from source by the JDK's launcher): `post HOST PORT N` sends
/// N POSTs of 1 B to 8 MiB by the JDK's HttpClient (an HttpClient, so a
/// connection, each; non-blocking channels on a selector) and compares the
/// answers; `server HOST PORT DIR` answers POST /echo with the JDK's
/// HttpServer (whose handlers read in blocking mode) and, on PORT+1, slices
/// of a 16 MiB file by `FileChannel.transferTo` (sendfile); `download HOST
/// PORT N` reads N slices with blocking SocketChannels and compares them.
const JAVA_MAIN: &str = r#"import com.sun.net.httpserver.HttpServer;
import java.io.*;
import java.net.*;
import java.net.http.*;
import java.nio.ByteBuffer;
import java.nio.channels.*;
import java.nio.file.*;
import java.util.*;
import java.util.concurrent.*;

public class Main {
    static final int FILE = 16 << 20;
    static final byte[] PAT = new byte[FILE];
    static { new Random(42).nextBytes(PAT); }

    static int size(int i) {
        int[] sizes = {8 << 20, 1 << 20, 65536, 1, 100, 4096, 3};
        return i % 10 < 7 ? sizes[i % 10] : 4096 + i * 37;
    }

    public static void main(String[] a) throws Exception {
        String host = a[1];
        int port = Integer.parseInt(a[2]);
        if (a[0].equals("server")) server(host, port, a[3]);
        else run(Integer.parseInt(a[3]), a[0].equals("post") ? i -> post(host, port, i) : i -> download(host, port, i));
    }

    // POST /echo answers its body (the JDK's HttpServer: its handlers read in
    // blocking mode); PORT+1 answers "offset len" with that slice of a file,
    // sent by FileChannel.transferTo (sendfile).
    static void server(String host, int port, String dir) throws Exception {
        Path file = Paths.get(dir, "pattern");
        Files.write(file, PAT);
        HttpServer s = HttpServer.create(new InetSocketAddress(host, port), 128);
        s.createContext("/echo", ex -> {
            byte[] body = ex.getRequestBody().readAllBytes();
            ex.sendResponseHeaders(200, body.length == 0 ? -1 : body.length);
            try (OutputStream o = ex.getResponseBody()) { o.write(body); }
        });
        s.setExecutor(Executors.newFixedThreadPool(16));
        s.start();
        ServerSocketChannel l = ServerSocketChannel.open();
        l.bind(new InetSocketAddress(host, port + 1), 128);
        ExecutorService pool = Executors.newFixedThreadPool(16);
        while (true) {
            SocketChannel c = l.accept();
            pool.submit(() -> {
                try (c; FileChannel f = FileChannel.open(file)) {
                    ByteBuffer req = ByteBuffer.allocate(8);
                    while (req.hasRemaining() && c.read(req) >= 0) {}
                    req.flip();
                    long off = req.getInt(), len = req.getInt();
                    for (long done = 0; done < len; ) done += f.transferTo(off + done, len - done, c);
                    c.shutdownOutput();
                    while (c.read(ByteBuffer.allocate(1)) >= 0) {}
                } catch (IOException e) { System.out.println("server: " + e); }
                return null;
            });
        }
    }

    interface Conn { void run(int i) throws Exception; }

    // n connections, 10 at a time; the first five errors printed.
    static void run(int n, Conn one) throws Exception {
        List<String> errs = Collections.synchronizedList(new ArrayList<>());
        ExecutorService pool = Executors.newFixedThreadPool(10);
        List<Future<?>> fs = new ArrayList<>();
        for (int t = 0; t < n; t++) {
            final int i = t;
            fs.add(pool.submit(() -> {
                try { one.run(i); } catch (Exception e) { errs.add(i + ": " + e); }
            }));
        }
        for (Future<?> f : fs) f.get();
        if (!errs.isEmpty()) { System.out.println("FAIL " + errs.subList(0, Math.min(5, errs.size()))); System.exit(1); }
        System.out.println("OK");
        System.exit(0);
    }

    // A POST of size(i) bytes by an HttpClient of its own (a connection;
    // non-blocking channels on a selector thread), the answer compared.
    static void post(String host, int port, int i) throws Exception {
        int sz = size(i), off = i * 4099 % (FILE - sz);
        byte[] body = Arrays.copyOfRange(PAT, off, off + sz);
        String h = host.contains(":") ? "[" + host + "]" : host;
        HttpClient hc = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
        HttpResponse<byte[]> r = hc.send(HttpRequest.newBuilder(URI.create("http://" + h + ":" + port + "/echo"))
            .POST(HttpRequest.BodyPublishers.ofByteArray(body)).build(), HttpResponse.BodyHandlers.ofByteArray());
        if (!Arrays.equals(r.body(), body))
            throw new IOException("echo: " + r.body().length + " of " + sz + " bytes, or other bytes");
    }

    // A slice of the file (all 16 MiB every tenth), read by a blocking
    // SocketChannel to the end and compared.
    static void download(String host, int port, int i) throws Exception {
        int len = i % 10 == 0 ? FILE : size(i), off = i % 10 == 0 ? 0 : i * 7919 % (FILE - len);
        try (SocketChannel c = SocketChannel.open(new InetSocketAddress(host, port))) {
            ByteBuffer req = ByteBuffer.allocate(8).putInt(off).putInt(len);
            req.flip();
            while (req.hasRemaining()) c.write(req);
            ByteBuffer got = ByteBuffer.allocate(len + 1);
            while (c.read(got) >= 0) {}
            got.flip();
            if (got.remaining() != len || !Arrays.equals(Arrays.copyOfRange(got.array(), 0, len), Arrays.copyOfRange(PAT, off, off + len)))
                throw new IOException("download: " + got.remaining() + " of " + len + " bytes, or other bytes");
        }
    }
}
"#;

/// Every Java program is one executable, `java`. Its HttpClient posts to a
/// Node.js echo (both non-blocking: accelerated both ways). Then Java's own
/// HttpServer: its first connections get a psock (`java` was only seen
/// reading without blocking) and are read in blocking mode, every byte
/// intact; that shows the guard Java reading that service in blocking mode,
/// and from then on no end of it gets a psock, nor does a service `java` is
/// first seen reading after that (blocking downloads of sendfile). The
/// HttpClient's service, seen read only without blocking, stays accelerated
/// from its first connection on: the guard judges executables per service.
#[test]
fn java_http_client_server_and_sendfile() -> Result<()> {
    if !tools(&["java", "javac", "node"]) {
        return Ok(());
    }
    let dir = ScratchDir::new("meshwarp-compat-")?;
    std::fs::write(dir.path("Main.java"), JAVA_MAIN)?;
    let Some(k) = node() else { return Ok(()) };
    let net = NodeWithPods::new(2)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let addr = |port| SocketAddr::new(b.v4.into(), port);
    let rule = |port| EndpointPair::new(a.v4.into(), addr(port).into());
    let (to_node, to_java, files) = (rule(7111)?, rule(7112)?, rule(7113)?);
    for p in [&to_node, &to_java, &files] {
        k.dp().insert(p, OWNER)?;
    }
    let (src, host, n) = (dir.path("Main.java").display().to_string(), b.v4.to_string(), CONNS.to_string());
    let _node = Program::spawn(&b.ns, &["node", "-e", NODE_HTTP_ECHO, &host, "7111"])?;
    wait_listening(&a.ns, addr(7111), T)?;
    let java = |what: &str, mode: &str, port: &str| -> Result<()> {
        let (ok, out) = run_to_end(&a.ns, &["java", &src, mode, &host, port, &n], T)?;
        ensure!(ok && out.contains("OK"), "{what}: {out}");
        Ok(())
    };
    java("HttpClient -> node", "post", "7111")?;
    let first = k.dp().stats(&to_node)?;
    // Started only now, and found listening without a connection (one would
    // be read in blocking mode, which marks `java`): its first connections
    // are accelerated, read in blocking mode by a program the guard has
    // seen only read without blocking so far.
    let _java = Program::spawn(&b.ns, &["java", &src, "server", &host, "7112", &dir.0.display().to_string()])?;
    for port in [7112, 7113] {
        wait_port_listening(&b.ns, port, T)?;
    }
    java("HttpClient -> HttpServer", "post", "7112")?;
    java("blocking downloads of sendfile", "download", "7113")?;
    java("HttpClient -> node, again", "post", "7111")?;
    let (last, st_java, st_files) = (k.dp().stats(&to_node)?, k.dp().stats(&to_java)?, k.dp().stats(&files)?);
    report(
        "java",
        &[
            ("HttpClient -> node", first),
            ("HttpClient -> HttpServer", st_java),
            ("downloads", st_files),
            ("HttpClient -> node, again", last),
        ],
    );
    // The first 10-20 connections (10 at a time) wait on TCP until `java`
    // is classified and seen reading; none of the second run's do. How much
    // of the large full-duplex echoes stays redirected is the policy's call
    // and timing (demotions_around: a stream goes around a reader copying
    // out on another CPU): 88-148 MB per run of ~2 x 95 MB on this machine,
    // so the rule's totals cannot tell both ways from one. The claim here:
    // the two runs redirected more than one direction of one run carries
    // (the POST bodies, as Main.java sizes them).
    let one_way: u64 = (0..CONNS as u64)
        .map(|i| match i % 10 {
            0 => 8 << 20,
            1 => 1 << 20,
            2 => 65536,
            3 => 1,
            4 => 100,
            5 => 4096,
            6 => 3,
            _ => 4096 + i * 37,
        })
        .sum();
    ensure!(first.redirected_bytes > 0, "HttpClient -> node accelerated once java was classified: {first:?}");
    ensure!(last.redirected_bytes > one_way, "HttpClient <-> node accelerated (one way: {one_way} B): {last:?}");
    ensure!(st_java.sockets >= 2 && st_java.redirected_bytes > 0, "the first HttpServer connections: {st_java:?}");
    ensure!(st_files.sockets == 0, "no psock for a new service of java once seen blocking: {st_files:?}");
    // Every connection accelerated but those left on TCP because the
    // rule's last ones were all short (small POSTs: a request and its
    // answer), which is no judgement of the reader.
    let skipped = last.fallback_short - first.fallback_short;
    ensure!(
        last.fallback_reader == first.fallback_reader && last.sockets == first.sockets + 2 * (CONNS as u64 - skipped),
        "java's HttpClient, seen reading that service only without blocking, accelerated: {first:?} {last:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// HTTP/2 (nghttp2)

/// nghttpd (nghttp2's HTTP/2 server, libev: non-blocking reads) in pod B
/// serves 100 files of 1 B to 8 MiB and echoes uploads; from pod A, nghttp
/// downloads each and uploads each (a connection each: HTTP/2 flow control,
/// WINDOW_UPDATEs against DATA in 64 KiB windows), every byte compared; then
/// h2load multiplexes 5 000 requests of 64 KiB over 10 connections, 10
/// streams each.
#[test]
fn nghttp2_downloads_uploads_and_h2load() -> Result<()> {
    if !tools(&["nghttpd", "nghttp", "h2load"]) {
        return Ok(());
    }
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let sums = (0..CONNS)
        .map(|i| pattern_file(&dir.path(&format!("f{i}")), i as u64, size_of_conn(i)))
        .collect::<Result<Vec<_>>>()?;
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 7114)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let docs = dir.0.display().to_string();
    let _srv =
        Program::spawn(&b.ns, &["nghttpd", "--no-tls", "-a", &b.v4.to_string(), "-d", &docs, "--echo-upload", "7114"])?;
    wait_listening(&a.ns, server, T)?;
    run_connections(|i| {
        let (ok, got) = output_of(&a.ns, &["nghttp", &format!("http://{server}/f{i}")], T)?;
        ensure!(ok && fnv(&got) == sums[i], "download: {} of {} bytes, or other bytes", got.len(), size_of_conn(i));
        Ok(())
    })?;
    let downloads = k.dp().stats(&pair)?;
    run_connections(|i| {
        let file = dir.path(&format!("f{i}")).display().to_string();
        let (ok, got) = output_of(&a.ns, &["nghttp", "-d", &file, &format!("http://{server}/echo")], T)?;
        ensure!(
            ok && fnv(&got) == sums[i],
            "upload echoed: {} of {} bytes, or other bytes",
            got.len(),
            size_of_conn(i)
        );
        Ok(())
    })?;
    let files = k.dp().stats(&pair)?;
    let url = format!("http://{server}/f3");
    let (ok, out) = run_to_end(&a.ns, &["h2load", "-n", "5000", "-c", "10", "-m", "10", &url], T)?;
    ensure!(ok && out.contains("5000 succeeded, 0 failed"), "h2load: {out}");
    let st = k.dp().stats(&pair)?;
    report("nghttp2", &[("nghttp downloads", downloads), ("and uploads", files), ("with h2load", st)]);
    // Downloads: what a client sends (preface, SETTINGS, HEADERS,
    // WINDOW_UPDATEs) is under 100 KB for all of them, so more than 4 MiB
    // redirected is the server's files: the client ends are targets. Most
    // of a large file takes TCP (a write of 16 KiB or more into a reader
    // copying out on another CPU moves its direction there for good); the
    // small files and the large ones' first writes are redirected. (The
    // connections before nghttp was classified, 10 at a time, take TCP.)
    // 47 MB of 107 in a local run, uploads and echoes 33 MB of 214.
    ensure!(downloads.redirected_bytes > 4 << 20, "the downloads redirected: {downloads:?}");
    // Uploads: the server ends are targets (no client joined the
    // target-only map, nghttpd was never seen splicing), and the uploads
    // and their echoes redirected as much again.
    ensure!(
        files.tgtmap_clients == 0
            && files.fallback_splice == 0
            && files.redirected_bytes - downloads.redirected_bytes > 4 << 20,
        "the uploads and their echoes redirected: {downloads:?} {files:?}"
    );
    // h2load opens its 10 connections at once, before it was seen reading:
    // they take TCP (fallback_reader), and lose nothing (0 failed).
    Ok(())
}

// ---------------------------------------------------------------------------
// iperf3

/// One iperf3 client run from `ns` against `server` (`-J`): its JSON report.
fn iperf3(ns: &NetNs, server: SocketAddr, args: &[&str]) -> Result<serde_json::Value> {
    let (ip, port) = (server.ip().to_string(), server.port().to_string());
    let mut all = vec!["iperf3", "-c", &ip, "-p", &port, "-J"];
    all.extend_from_slice(args);
    let (ok, out) = output_of(ns, &all, T)?;
    let v: serde_json::Value = serde_json::from_slice(&out).with_context(|| format!("iperf3 {args:?}: its report"))?;
    ensure!(ok && v.get("error").is_none(), "iperf3 {args:?} failed: {}", v["error"]);
    Ok(v)
}

/// iperf3 3.12, the tool a mesh's users first measure it with, server in pod
/// B, client in pod A. First a file sent (`-F`) in writes of 64 B to 1 KiB,
/// Nagle on and off, the server writing what it received to a file:
/// iperf3's receiver stops reading when the sender says the test ended (on
/// TCP too), so what it wrote must be the file's beginning, byte for byte.
/// (Not larger writes: iperf3 3.12 refills its buffer over the unsent rest
/// of a partial write, so `-F` corrupts its own stream on plain TCP too
/// (seen with `-l 16K -w 64K`); a write of at most 1 KiB after select()
/// found room is never partial.) Then what iperf3 can do to a connection,
/// each run checked by its own report: reverse (`-R`), both ways at once
/// (`--bidir`), 8 streams (`-P 8`), sendfile (`-Z`, both ways), small socket
/// buffers (`-w`), 64 B writes.
///
/// iperf3 reads its control connection, and each new stream's cookie, in
/// blocking mode: the reader guard keeps every iperf3 end off the fast path
/// (asserted: a change in that judgement must show here and in README).
#[test]
fn iperf3_files_reverse_bidir_parallel_and_sendfile() -> Result<()> {
    if !tools(&["iperf3"]) {
        return Ok(());
    }
    let Some(k) = node() else { return Ok(()) };
    let (net, server, pair) = pods_with_pair(&k, 5201)?;
    let (a, b) = (&net.pods[0], &net.pods[1]);
    let dir = ScratchDir::new("meshwarp-compat-")?;
    let (sent, got) = (dir.path("sent"), dir.path("got"));
    let len = 16usize << 20;
    pattern_file(&sent, 31, len)?;
    let sent_bytes = std::fs::read(&sent)?;
    let (bind, port) = (b.v4.to_string(), server.port().to_string());
    let (sent_s, got_s) = (sent.display().to_string(), got.display().to_string());
    for (wlen, nodelay) in [("64", false), ("1K", false), ("128", true), ("1K", true)] {
        let _ = std::fs::remove_file(&got);
        let mut srv = Program::spawn(&b.ns, &["iperf3", "-s", "-1", "-B", &bind, "-p", &port, "-F", &got_s])?;
        wait_port_listening(&b.ns, server.port(), T)?;
        let mut args = vec!["-F", &sent_s, "-l", wlen];
        if nodelay {
            args.push("-N");
        }
        iperf3(&a.ns, server, &args)?;
        ensure!(srv.wait_timeout(T)?.success(), "iperf3 server (-F, -l {wlen})");
        let recv = std::fs::read(&got)?;
        eprintln!("[compat] iperf3 -F -l {wlen} nodelay {nodelay}: {} of {len} B written", recv.len());
        ensure!(!recv.is_empty() && recv.len() <= len, "-l {wlen}: {} of {len} B written", recv.len());
        if let Some(at) = recv.iter().zip(&sent_bytes).position(|(r, s)| r != s) {
            bail!("-l {wlen}: other bytes than sent from byte {at} of {}", recv.len());
        }
    }
    let _srv = Program::spawn(&b.ns, &["iperf3", "-s", "-B", &bind, "-p", &port])?;
    wait_port_listening(&b.ns, server.port(), T)?;
    for args in [
        &["-n", "64M"][..],
        &["-n", "64M", "-R"],
        &["-t", "2", "--bidir"],
        &["-n", "64M", "-P", "8"],
        &["-n", "64M", "-Z"],
        &["-n", "64M", "-Z", "-R"],
        &["-n", "8M", "-w", "32K"],
        &["-n", "4M", "-l", "64"],
    ] {
        let v = iperf3(&a.ns, server, args)?;
        let end = &v["end"];
        let (s, r) = (end["sum_sent"]["bytes"].as_u64(), end["sum_received"]["bytes"].as_u64());
        eprintln!("[compat] iperf3 {args:?}: sent {s:?} B, received {r:?} B");
        ensure!(s.unwrap_or(0) > 0 && r.unwrap_or(0) > 0, "iperf3 {args:?}: {end}");
    }
    let st = k.dp().stats(&pair)?;
    report("iperf3", &[("pair", st)]);
    ensure!(st.sockets == 0 && st.fallback_reader > 0, "iperf3 judged a blocking reader: {st:?}");
    Ok(())
}
