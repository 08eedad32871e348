//! Real programs through the three socket paths, interleaved (issue: "never
//! slower than plain TCP"; real programs are the judge of what a connection
//! does). In one namespace, on loopback, each server (redis-server, nginx,
//! or this bench reading what socat sends) has four ports: two not covered
//! (plain TCP), one registered in mode always, one in mode adaptive. The contenders take turns (TCP, always, adaptive, TCP again as
//! the noise floor) and each cell prints its medians as a table:
//! - `redis/<test>_c<conns>_P<pipeline>_d<bytes>`: redis-benchmark against
//!   redis-server (its own requests/s, as time per request);
//! - `nginx/<size>_<sendfile|write>`: curl fetching static files from nginx
//!   on one keep-alive connection (curl's `time_total`, the mean per transfer),
//!   with sendfile and TCP_NOPUSH (cork) as Debian ships it, and with plain
//!   writes;
//! - `socat/<buffer>B`: socat sending a file (its writes of `-b` bytes, Nagle
//!   on), read to its end here;
//! - `haproxy/<workload>_<splice>`: haproxy in TCP mode as a sidecar between
//!   this bench's client and its upstream, both legs registered (the front
//!   and the upstream port of a contender in the same mode), without splice
//!   and with `option splice-auto`: 64 B round trips (`rr64`), uploads of
//!   64 MiB in 16 KiB writes (`up64m`) and of 4 MiB in 64 B writes
//!   (`up4m_64B`), and a 64 MiB download (`down64m`), time per round trip or
//!   transfer. haproxy can splice (it imports splice), so its sockets are no
//!   redirect targets; with `MESHWARP_APPS_TRUST_HAPROXY=1` the operator
//!   vouches for it (`--trust-reader`), and only the cells without splice
//!   run (`_nosplice_trusted`): with splice-auto that vouching would be false;
//! - `memcached/<op>_<bytes>`: this bench's client against memcached on one
//!   connection: `get` round trips of a 64 B and a 16 KiB value, and `set` of
//!   1 MiB (time per request);
//! - `postgres/select_c<clients>`: pgbench's select-only transactions
//!   (`-S`) against PostgreSQL, its own latency average (a backend forked
//!   per connection, libpq polling);
//! - `node/post<bytes>`: POST round trips of 64 B and 16 KiB bodies from this
//!   bench to an echo on Node's http module (libuv), one keep-alive
//!   connection (time per request);
//! - `nghttp2/h2load_<bytes>_c<conns>_m<streams>`: h2load's GETs of a file
//!   from nghttpd (HTTP/2, libev), streams multiplexed on each connection
//!   (h2load's own time to finish, per request).
//!
//! `cargo bench -p meshwarp-benches --bench apps [-- FILTER]` (as root; the
//! programs from scripts/install-deps.sh); FILTER selects cells by substring
//! (`a|b`: either). `MESHWARP_APPS_TURNS` sets the turns per cell (default 9).
//! `MESHWARP_APPS_TIMES=1` prints every curl transfer's time (stderr).

use std::io::{BufRead, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meshwarp_core::{Endpoint, EndpointPair, FastPathMode};
use meshwarp_testbed::{
    accept_timeout, postgres_bin, read_exact_ready, read_ready, redis_server, wait_listening, which, write_all_ready,
    KernelTest, NetNs, Program, ScratchDir, TestbedError, NODE_HTTP_ECHO,
};

// Shared with the other benches, which use its other functions.
#[allow(dead_code)]
#[path = "interleave.rs"]
mod interleave;
use interleave::{interleaved_timed, selected};

const T: Duration = Duration::from_secs(60);
/// The contenders' names and which of a program's four ports each one uses
/// (TCP again has a server of its own: a turn that follows one on the same
/// server finds it warm). They take their turns in a new order every round.
const PATHS: [(&str, u16); 4] = [("tcp", 0), ("always", 1), ("adaptive", 2), ("tcp again", 3)];

fn lo(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port)
}

fn turns() -> usize {
    std::env::var("MESHWARP_APPS_TURNS").ok().and_then(|v| v.parse().ok()).unwrap_or(9)
}

/// One table of interleaved cells: a cell's `run(port)` is one turn's time
/// per request (transfer, stream) on the server's `port`.
struct Table {
    title: &'static str,
    /// The bench namespace's TCP congestion control, for the header.
    cc: String,
    rows: Vec<String>,
}

impl Table {
    fn new(ns: &NetNs, title: &'static str) -> Self {
        Self { title, cc: ns.congestion_control().expect("congestion control"), rows: Vec::new() }
    }

    fn cell(&mut self, id: &str, base: u16, mut run: impl FnMut(u16) -> Duration) {
        if !selected(id) {
            return;
        }
        let turns = turns();
        let m = interleaved_timed(PATHS.len(), turns, |i| run(base + PATHS[i].1));
        let mark = |r: f64| if r > 1.05 { " SLOWER" } else { "" };
        let [a, d, aa] = [m[1], m[2], m[3]].map(|t| t / m[0]);
        let row =
            format!("| {id} | {turns} | {:.1} us | {a:.2}x{} | {d:.2}x{} | {aa:.2}x |", m[0] / 1e3, mark(a), mark(d));
        eprintln!("{row}");
        self.rows.push(row);
    }

    /// The table, and what the pairs' connections did (a cell whose
    /// program never reaches the fast path measures nothing of ours).
    fn print(&self, k: &KernelTest, pairs: &[EndpointPair; 2]) {
        if self.rows.is_empty() {
            return;
        }
        eprintln!(
            "\n{} (interleaved medians; time per request, transfer or stream, ratio to TCP's; congestion control {}):\n\
             | workload | turns | tcp (not covered) | always / tcp | adaptive / tcp | tcp again / tcp (A/A) |\n\
             |---|---:|---:|---:|---:|---:|\n{}\n",
            self.title,
            self.cc,
            self.rows.join("\n")
        );
        for (mode, pair) in ["always", "adaptive"].iter().zip(pairs) {
            eprintln!("{mode}: {:?}", k.dp().stats(pair).expect("stats"));
        }
    }
}

/// Registers `base+1` (always) and `base+2` (adaptive) on 127.0.0.1.
fn register(k: &KernelTest, base: u16) -> [EndpointPair; 2] {
    [(base + 1, FastPathMode::Always), (base + 2, FastPathMode::Adaptive)].map(|(port, mode)| {
        let pair = EndpointPair::new(lo(0).ip(), Endpoint::new(lo(0).ip(), port)).expect("pair").with_mode(mode);
        k.dp().insert(&pair, "apps-bench").expect("register pair");
        pair
    })
}

/// Four copies of a server, on `base` .. `base + 3` (TCP, always, adaptive,
/// TCP again: see `PATHS`), each listening before the next starts;
/// `spawn(i)` starts copy `i`.
fn four_servers(
    ns: &NetNs,
    base: u16,
    what: &str,
    spawn: impl Fn(u16) -> Result<Program, TestbedError>,
) -> Vec<Program> {
    (0..4)
        .map(|i| {
            let p = spawn(i).unwrap_or_else(|e| panic!("{what}: {e}"));
            wait_listening(ns, lo(base + i), T).unwrap_or_else(|e| panic!("{what} listening: {e}"));
            p
        })
        .collect()
}

fn need(tools: &[&str]) -> bool {
    let missing: Vec<_> = tools.iter().filter(|t| which(t).is_none()).collect();
    if !missing.is_empty() {
        eprintln!("!!! apps bench: {missing:?} not installed (scripts/install-deps.sh installs them): their cells are left out");
    }
    missing.is_empty()
}

fn redis(k: &KernelTest, ns: &NetNs, dir: &ScratchDir) {
    const BASE: u16 = 6380;
    if !need(&["redis-server", "redis-benchmark"]) {
        return;
    }
    let pairs = register(k, BASE);
    let _servers = four_servers(ns, BASE, "redis-server", |i| redis_server(ns, "127.0.0.1", BASE + i, &dir.0));
    // GETs find values of the size they ask for: every key of the keyspace
    // (-r 100) set first, per value size.
    let mut filled = Vec::new();
    let mut table = Table::new(ns, "redis-benchmark against redis-server");
    // (test, connections, pipeline, value bytes)
    let cells: &[(&str, usize, usize, usize)] = &[
        ("get", 1, 1, 64),
        ("get", 1, 16, 64),
        ("get", 1, 100, 64),
        ("set", 1, 16, 1024),
        ("set", 1, 100, 1024),
        ("get", 50, 1, 1024),
        ("get", 50, 16, 1024),
        ("set", 1, 1, 16384),
        ("get", 1, 1, 262144),
        ("get", 1, 16, 16384),
    ];
    for &(test, c, p, size) in cells {
        let id = format!("redis/{test}_c{c}_P{p}_d{size}");
        if !selected(&id) {
            continue;
        }
        if test == "get" && !filled.contains(&size) {
            for i in 0..4 {
                redis_benchmark(ns, BASE + i, "set", 50, 16, size, 2_000);
            }
            filled.push(size);
        }
        // About 0.3 s per turn on TCP: requests from a first run's rate.
        let mut n = 10_000usize;
        let first = redis_benchmark(ns, BASE, test, c, p, size, n);
        // A whole number of pipelines: redis-benchmark 7 issues requests a
        // pipeline at a time, and when the last reply overshoots -n its
        // 250 ms timer may see every client gone with requests_finished !=
        // requests and abort ("All clients disconnected"), whatever the path.
        n = ((0.3 / first.as_secs_f64()) as usize).clamp(200, 2_000_000).div_ceil(p) * p;
        table.cell(&id, BASE, |port| redis_benchmark(ns, port, test, c, p, size, n));
    }
    table.print(k, &pairs);
}

/// One redis-benchmark run: its requests/s as time per request.
fn redis_benchmark(ns: &NetNs, port: u16, test: &str, c: usize, p: usize, size: usize, n: usize) -> Duration {
    let port = port.to_string();
    let (c, p, size, n) = (c.to_string(), p.to_string(), size.to_string(), n.to_string());
    let args = [
        "ip",
        "netns",
        "exec",
        ns.name(),
        "redis-benchmark",
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-c",
        &c,
        "-P",
        &p,
        "-d",
        &size,
        "-n",
        &n,
        "-t",
        test,
        "-r",
        "100",
        "--csv",
    ];
    let out = Command::new(args[0]).args(&args[1..]).stderr(Stdio::piped()).output().expect("redis-benchmark");
    assert!(
        out.status.success(),
        "redis-benchmark -t {test} -c {c} -P {p} -d {size} against port {port} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "SET","123456.79",... (a header line first in newer versions).
    let text = String::from_utf8_lossy(&out.stdout);
    let rps: f64 = text
        .lines()
        .filter_map(|l| l.split(',').nth(1))
        .find_map(|v| v.trim_matches('"').parse().ok())
        .unwrap_or_else(|| panic!("no requests/s in redis-benchmark's output: {text}"));
    Duration::from_secs_f64(1.0 / rps)
}

fn nginx(k: &KernelTest, ns: &NetNs, dir: &ScratchDir) {
    const BASE: u16 = 8480;
    if !need(&["nginx", "curl"]) {
        return;
    }
    let pairs = register(k, BASE);
    let d = dir.0.display();
    for (name, size) in [("1k", 1usize << 10), ("1m", 1 << 20), ("16m", 16 << 20)] {
        std::fs::write(dir.path(name), vec![b'x'; size]).expect("body file");
    }
    let servers: String = (0..4)
        .map(|i| {
            format!(
                "server {{ listen 127.0.0.1:{}; root {d}; keepalive_requests 100000; \
                 location /w/ {{ alias {d}/; sendfile off; tcp_nopush off; }} }}\n",
                BASE + i
            )
        })
        .collect();
    let conf = format!(
        "user root;\nworker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 1024; }}\nhttp {{ access_log off; sendfile on; tcp_nopush on; \
         client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n{servers}}}\n"
    );
    std::fs::write(dir.path("nginx.conf"), conf).expect("nginx.conf");
    let _nginx = Program::spawn(ns, &["nginx", "-c", &dir.path("nginx.conf").display().to_string()]).expect("nginx");
    for i in 0..4 {
        wait_listening(ns, lo(BASE + i), T).expect("nginx listening");
    }
    let mut table = Table::new(ns, "curl against nginx (static files, one keep-alive connection)");
    for (name, count) in [("1k", 200usize), ("1m", 32), ("16m", 4)] {
        for (how, prefix) in [("sendfile", ""), ("write", "w/")] {
            let id = format!("nginx/{name}_{how}");
            table.cell(&id, BASE, |port| curl(ns, port, &format!("{prefix}{name}"), count));
        }
    }
    table.print(k, &pairs);
}

/// `count` transfers of `path` by one curl on one connection: the mean of
/// curl's own time_total (process start left out).
fn curl(ns: &NetNs, port: u16, path: &str, count: usize) -> Duration {
    let url = format!("http://127.0.0.1:{port}/{path}");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns.name(), "curl", "-sS", "--fail", "-w", "%{time_total}\\n"]);
    for _ in 0..count {
        cmd.args([url.as_str(), "-o", "/dev/null"]);
    }
    let out = cmd.stderr(Stdio::piped()).output().expect("curl");
    assert!(out.status.success(), "curl {url}: {}", String::from_utf8_lossy(&out.stderr));
    let times: Vec<f64> = out.stdout.lines().map(|l| l.expect("utf-8").trim().parse().expect("time_total")).collect();
    assert_eq!(times.len(), count, "curl transfers");
    // Every transfer's time, in order: a connection that turns slow for good
    // shows as a run of slow transfers, a costly transition as one.
    if std::env::var_os("MESHWARP_APPS_TIMES").is_some() {
        let us: Vec<String> = times.iter().map(|t| format!("{:.0}", t * 1e6)).collect();
        eprintln!("curl times (us), port {port}, /{path}: {}", us.join(" "));
    }
    Duration::from_secs_f64(times.iter().sum::<f64>() / count as f64)
}

/// Reads `s` to its end in 64 KiB reads; the bytes read.
fn read_to_eof(s: &mut TcpStream, what: &str) -> usize {
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0usize;
    loop {
        match read_ready(s, &mut buf, Some(T)) {
            Ok(0) => return got,
            Ok(n) => got += n,
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

fn socat(k: &KernelTest, ns: &NetNs, dir: &ScratchDir) {
    const BASE: u16 = 9680;
    if !need(&["socat"]) {
        return;
    }
    let pairs = register(k, BASE);
    let file = dir.path("stream");
    std::fs::write(&file, vec![0x42u8; 64 << 20]).expect("stream file");
    let file = file.display().to_string();
    let listeners: Vec<_> = (0..4).map(|i| ns.listen(lo(BASE + i)).expect("listen")).collect();
    let mut table = Table::new(ns, "socat sending 64 MiB (Nagle on), read here in 64 KiB reads");
    for buffer in [1024usize, 8192, 65536] {
        let id = format!("socat/{buffer}B");
        table.cell(&id, BASE, |port| {
            let l = &listeners[usize::from(port - BASE)];
            let b = buffer.to_string();
            let mut sender = Program::spawn(
                ns,
                &["socat", "-u", "-b", &b, &format!("OPEN:{file}"), &format!("TCP:127.0.0.1:{port}")],
            )
            .expect("socat");
            let mut s = accept_timeout(l, T).expect("accept");
            // From the accept: socat's start is not the path's.
            let start = Instant::now();
            let got = read_to_eof(&mut s, "socat stream");
            let t = start.elapsed();
            assert_eq!(got, 64 << 20, "socat stream bytes");
            assert!(sender.wait_timeout(T).expect("socat exit").success(), "socat failed");
            t
        });
    }
    table.print(k, &pairs);
}

fn main() {
    // The operator's vouching (`--trust-reader`) for two programs the reader
    // guard would keep off the fast path for good after one blocking read:
    // redis-benchmark asks the server's configuration on a blocking
    // connection first, socat reads blocking sockets after select(). Neither
    // blocks in a read across its own shutdown(SHUT_WR), the kernel's gap.
    let mut vouched = vec!["redis-benchmark", "socat"];
    if trust_haproxy() {
        vouched.push("haproxy");
    }
    let trusted: Vec<_> = vouched.into_iter().filter_map(which).collect();
    let Some(k) = KernelTest::start_with(8192, 64, |cfg| {
        cfg.trusted_readers.extend(trusted);
        cfg.guard_realtime = meshwarp_testbed::bench_guard_realtime();
    }) else {
        return;
    };
    let ns = NetNs::new("apps").expect("netns");
    let cc = ns.bench_congestion_control().expect("MESHWARP_BENCH_CC");
    eprintln!("apps bench: TCP congestion control {cc} (MESHWARP_BENCH_CC sets another)");
    let dir = ScratchDir::new("meshwarp-apps-").expect("scratch dir");
    redis(&k, &ns, &dir);
    nginx(&k, &ns, &dir);
    socat(&k, &ns, &dir);
    haproxy(&k, &ns, &dir);
    memcached(&k, &ns);
    postgres(&k, &ns, &dir);
    node(&k, &ns);
    nghttp2(&k, &ns, &dir);
}

/// `MESHWARP_APPS_TRUST_HAPROXY` is set: haproxy is a trusted reader.
fn trust_haproxy() -> bool {
    std::env::var_os("MESHWARP_APPS_TRUST_HAPROXY").is_some_and(|v| !v.is_empty() && v != "0")
}

/// What haproxy's upstream does with a connection, by its first byte: `e`
/// echoes until EOF; `s` reads to EOF, then answers the byte count (8 bytes,
/// little endian); `d` reads a size (8 bytes) and writes that many bytes in
/// 16 KiB writes, then closes.
fn upstream(l: TcpListener) {
    // The testbed's listeners are non-blocking (for accept_timeout).
    l.set_nonblocking(false).expect("blocking listener");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut op = [0u8; 1];
                if c.read_exact(&mut op).is_err() {
                    return;
                }
                let mut buf = vec![0u8; 64 << 10];
                match op[0] {
                    b'e' => loop {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if c.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    },
                    b's' => {
                        let mut got = 0u64;
                        loop {
                            match c.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) => got += n as u64,
                                Err(_) => return,
                            }
                        }
                        let _ = c.write_all(&got.to_le_bytes());
                    }
                    b'd' => {
                        let mut size = [0u8; 8];
                        if c.read_exact(&mut size).is_err() {
                            return;
                        }
                        let mut left = u64::from_le_bytes(size) as usize;
                        buf.fill(0x44);
                        while left > 0 {
                            let n = left.min(16 << 10);
                            if c.write_all(&buf[..n]).is_err() {
                                return;
                            }
                            left -= n;
                        }
                    }
                    _ => {}
                }
            });
        }
    });
}

/// haproxy (TCP mode) between this bench's client and `upstream`: per
/// contender a front port (BASE + offset + contender's port) and an upstream
/// port (UP + contender's port), both registered alike; offset 0 without
/// splice, 10 with `option splice-auto`.
fn haproxy(k: &KernelTest, ns: &NetNs, dir: &ScratchDir) {
    const BASE: u16 = 7780;
    const UP: u16 = 7880;
    const SPLICE: [(&str, u16, &str); 2] = [("nosplice", 0, ""), ("spliceauto", 10, "option splice-auto")];
    const BIG: usize = 64 << 20;
    if !need(&["haproxy"]) {
        return;
    }
    let front = [register(k, BASE), register(k, BASE + 10)];
    let back = register(k, UP);
    for i in 0..4 {
        upstream(ns.listen(lo(UP + i)).expect("upstream listen"));
    }
    let mut cfg = String::from(
        "global\n maxconn 4096\ndefaults\n mode tcp\n timeout connect 5s\n timeout client 120s\n timeout server 120s\n",
    );
    for (name, off, option) in SPLICE {
        for i in 0..4 {
            cfg += &format!(
                "listen {name}{i}\n bind 127.0.0.1:{}\n {option}\n server up 127.0.0.1:{}\n",
                BASE + off + i,
                UP + i
            );
        }
    }
    std::fs::write(dir.path("haproxy.cfg"), cfg).expect("haproxy.cfg");
    let _haproxy =
        Program::spawn(ns, &["haproxy", "-db", "-f", &dir.path("haproxy.cfg").display().to_string()]).expect("haproxy");
    for (_, off, _) in SPLICE {
        for i in 0..4 {
            wait_listening(ns, lo(BASE + off + i), T).expect("haproxy listening");
        }
    }
    let connect = |port: u16, op: u8| {
        let mut c = ns.connect(lo(port)).expect("connect to haproxy");
        write_all_ready(&mut c, &[op], Some(T)).expect("op");
        c
    };
    let trusted = trust_haproxy();
    let mut table = Table::new(
        ns,
        if trusted {
            "haproxy (TCP mode, trusted: --trust-reader) between a client and its upstream, both legs registered"
        } else {
            "haproxy (TCP mode) between a client and its upstream, both legs registered"
        },
    );
    // Trusted, only the configuration that never splices.
    for (name, off, _) in SPLICE.into_iter().filter(|(_, off, _)| !trusted || *off == 0) {
        let name = if trusted { format!("{name}_trusted") } else { name.to_string() };
        let base = BASE + off;
        table.cell(&format!("haproxy/rr64_{name}"), base, |port| {
            let mut c = connect(port, b'e');
            let (msg, mut ans) = ([0x52u8; 64], [0u8; 64]);
            // The first round trip sets the path up (haproxy's upstream
            // connection is made when the client's first bytes arrive).
            write_all_ready(&mut c, &msg, Some(T)).expect("rr write");
            read_exact_ready(&mut c, &mut ans, Some(T)).expect("rr read");
            const N: u32 = 2000;
            let start = Instant::now();
            for _ in 0..N {
                write_all_ready(&mut c, &msg, Some(T)).expect("rr write");
                read_exact_ready(&mut c, &mut ans, Some(T)).expect("rr read");
            }
            start.elapsed() / N
        });
        // 64 MiB in 16 KiB writes, 4 MiB in 64 B writes (Nagle on).
        for (id, total, write) in [("up64m", BIG, 16usize << 10), ("up4m_64B", 4 << 20, 64)] {
            table.cell(&format!("haproxy/{id}_{name}"), base, |port| {
                let mut c = connect(port, b's');
                let chunk = vec![0x55u8; write];
                let start = Instant::now();
                for _ in 0..total / write {
                    write_all_ready(&mut c, &chunk, Some(T)).expect("upload write");
                }
                c.shutdown(Shutdown::Write).expect("shutdown");
                let mut got = [0u8; 8];
                read_exact_ready(&mut c, &mut got, Some(T)).expect("upload count");
                let t = start.elapsed();
                assert_eq!(u64::from_le_bytes(got), total as u64, "upload bytes through haproxy");
                t
            });
        }
        table.cell(&format!("haproxy/down64m_{name}"), base, |port| {
            let mut c: TcpStream = connect(port, b'd');
            let start = Instant::now();
            write_all_ready(&mut c, &(BIG as u64).to_le_bytes(), Some(T)).expect("download size");
            let got = read_to_eof(&mut c, "download through haproxy");
            let t = start.elapsed();
            assert_eq!(got, BIG, "download bytes through haproxy");
            t
        });
    }
    table.print(k, &front[0]);
    if !trusted {
        eprintln!("splice-auto fronts:");
        for (mode, pair) in ["always", "adaptive"].iter().zip(&front[1]) {
            eprintln!("{mode}: {:?}", k.dp().stats(pair).expect("stats"));
        }
    }
    eprintln!("upstream legs:");
    for (mode, pair) in ["always", "adaptive"].iter().zip(&back) {
        eprintln!("{mode}: {:?}", k.dp().stats(pair).expect("stats"));
    }
}

/// A connection read through a buffer: answers are parsed line by line
/// without a system call per byte.
struct Buffered {
    s: TcpStream,
    buf: Vec<u8>,
    at: usize,
}

impl Buffered {
    fn new(s: TcpStream) -> Self {
        Self { s, buf: Vec::with_capacity(64 << 10), at: 0 }
    }

    fn fill(&mut self) {
        if self.at == self.buf.len() {
            self.buf.clear();
            self.at = 0;
        }
        let mut chunk = [0u8; 64 << 10];
        let n = read_ready(&mut self.s, &mut chunk, Some(T)).expect("read");
        assert!(n > 0, "connection closed mid-answer");
        self.buf.extend_from_slice(&chunk[..n]);
    }

    /// The next line, without its CRLF.
    fn line(&mut self) -> String {
        loop {
            if let Some(i) = self.buf[self.at..].windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[self.at..self.at + i]).into_owned();
                self.at += i + 2;
                return line;
            }
            self.fill();
        }
    }

    /// Skips the next `n` bytes.
    fn skip(&mut self, mut n: usize) {
        while n > 0 {
            if self.at == self.buf.len() {
                self.fill();
            }
            let k = n.min(self.buf.len() - self.at);
            self.at += k;
            n -= k;
        }
    }

    fn send(&mut self, req: &[u8]) {
        write_all_ready(&mut self.s, req, Some(T)).expect("request");
    }
}

fn memcached(k: &KernelTest, ns: &NetNs) {
    const BASE: u16 = 11280;
    if !need(&["memcached"]) {
        return;
    }
    let pairs = register(k, BASE);
    let _servers = four_servers(ns, BASE, "memcached", |i| {
        let port = (BASE + i).to_string();
        Program::spawn(
            ns,
            &["memcached", "-u", "root", "-l", "127.0.0.1", "-p", &port, "-U", "0", "-m", "256", "-I", "4m", "-t", "1"],
        )
    });
    let set = |c: &mut Buffered, key: &str, value: &[u8]| {
        let mut req = format!("set {key} 0 0 {}\r\n", value.len()).into_bytes();
        req.extend_from_slice(value);
        req.extend_from_slice(b"\r\n");
        c.send(&req);
        assert_eq!(c.line(), "STORED", "memcached set");
    };
    let connect = |port: u16| Buffered::new(ns.connect(lo(port)).expect("connect to memcached"));
    let mut table = Table::new(ns, "this bench's client against memcached, one connection");
    for (op, size, n) in [("get", 64usize, 2000u32), ("get", 16 << 10, 1000), ("set", 1 << 20, 40)] {
        let value = vec![0x6du8; size];
        let key = format!("k{size}");
        for i in 0..4 {
            set(&mut connect(BASE + i), &key, &value);
        }
        table.cell(&format!("memcached/{op}_{size}B"), BASE, |port| {
            let mut c = connect(port);
            let get = format!("get {key}\r\n");
            let one = |c: &mut Buffered| {
                if op == "set" {
                    set(c, &key, &value);
                } else {
                    c.send(get.as_bytes());
                    assert_eq!(c.line(), format!("VALUE {key} 0 {size}"), "memcached get");
                    c.skip(size + 2);
                    assert_eq!(c.line(), "END", "memcached get");
                }
            };
            one(&mut c);
            let start = Instant::now();
            for _ in 0..n {
                one(&mut c);
            }
            start.elapsed() / n
        });
    }
    table.print(k, &pairs);
}

fn postgres(k: &KernelTest, ns: &NetNs, dir: &ScratchDir) {
    const BASE: u16 = 5440;
    let Some(bin) = postgres_bin() else {
        eprintln!(
            "!!! apps bench: PostgreSQL not installed (scripts/install-deps.sh installs it): its cells are left out"
        );
        return;
    };
    if !need(&["runuser"]) {
        return;
    }
    let prog = |name: &str| bin.join(name).display().to_string();
    let pairs = register(k, BASE);
    // PostgreSQL refuses to run as root.
    let d = dir.0.display().to_string();
    assert!(Command::new("chown").args(["postgres", &d]).status().expect("chown").success(), "chown {d}");
    let _servers = four_servers(ns, BASE, "postgres", |i| {
        let data = dir.path(&format!("pg{i}")).display().to_string();
        let st = Command::new("runuser")
            .args(["-u", "postgres", "--", &prog("initdb"), "-A", "trust", "-U", "postgres", "-D", &data])
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(st.success(), "initdb");
        let port = (BASE + i).to_string();
        Program::spawn(
            ns,
            &[
                "runuser",
                "-u",
                "postgres",
                "--",
                &prog("postgres"),
                "-D",
                &data,
                "-k",
                &d,
                "-h",
                "127.0.0.1",
                "-p",
                &port,
            ],
        )
    });
    let pgbench = |port: u16, args: &[&str]| -> String {
        let port = port.to_string();
        let out = Command::new("ip")
            .args(["netns", "exec", ns.name(), &prog("pgbench"), "-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
            .args(args)
            .stderr(Stdio::piped())
            .output()
            .expect("pgbench");
        assert!(out.status.success(), "pgbench {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for i in 0..4 {
        // The server may take a moment after it listens.
        let start = Instant::now();
        while !Command::new("ip")
            .args(["netns", "exec", ns.name(), &prog("pg_isready"), "-h", "127.0.0.1", "-p", &(BASE + i).to_string()])
            .stdout(Stdio::null())
            .status()
            .expect("pg_isready")
            .success()
        {
            assert!(start.elapsed() < T, "PostgreSQL did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        pgbench(BASE + i, &["-i", "-q", "postgres"]);
    }
    let mut table = Table::new(ns, "pgbench against PostgreSQL (select-only, its latency average)");
    for (clients, n) in [(1usize, 3000usize), (8, 800)] {
        table.cell(&format!("postgres/select_c{clients}"), BASE, |port| {
            let (c, t) = (clients.to_string(), n.to_string());
            let out = pgbench(port, &["-S", "-n", "-c", &c, "-j", "1", "-t", &t, "postgres"]);
            let ms: f64 = out
                .lines()
                .find_map(|l| l.strip_prefix("latency average = ")?.strip_suffix(" ms")?.parse().ok())
                .unwrap_or_else(|| panic!("no latency average in pgbench's output: {out}"));
            Duration::from_secs_f64(ms / 1e3)
        });
    }
    table.print(k, &pairs);
}

fn node(k: &KernelTest, ns: &NetNs) {
    const BASE: u16 = 8580;
    if !need(&["node"]) {
        return;
    }
    let pairs = register(k, BASE);
    let _servers = four_servers(ns, BASE, "node", |i| {
        Program::spawn(ns, &["node", "-e", NODE_HTTP_ECHO, "127.0.0.1", &(BASE + i).to_string()])
    });
    let mut table = Table::new(ns, "this bench's HTTP client against Node's http module, one keep-alive connection");
    for (size, n) in [(64usize, 2000u32), (16 << 10, 1000)] {
        table.cell(&format!("node/post{size}B"), BASE, |port| {
            let mut c = Buffered::new(ns.connect(lo(port)).expect("connect to node"));
            let mut req = format!("POST / HTTP/1.1\r\nHost: bench\r\nContent-Length: {size}\r\n\r\n").into_bytes();
            req.extend(std::iter::repeat_n(0x6eu8, size));
            let one = |c: &mut Buffered| {
                c.send(&req);
                let mut len = None;
                loop {
                    let line = c.line();
                    if line.is_empty() {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse::<usize>().ok();
                    }
                }
                assert_eq!(len, Some(size), "node's answer");
                c.skip(size);
            };
            one(&mut c);
            let start = Instant::now();
            for _ in 0..n {
                one(&mut c);
            }
            start.elapsed() / n
        });
    }
    table.print(k, &pairs);
}

fn nghttp2(k: &KernelTest, ns: &NetNs, dir: &ScratchDir) {
    const BASE: u16 = 8680;
    if !need(&["nghttpd", "h2load"]) {
        return;
    }
    let pairs = register(k, BASE);
    for (name, size) in [("h2_1k", 1usize << 10), ("h2_64k", 64 << 10)] {
        std::fs::write(dir.path(name), vec![b'h'; size]).expect("body file");
    }
    let docs = dir.0.display().to_string();
    let _servers = four_servers(ns, BASE, "nghttpd", |i| {
        Program::spawn(ns, &["nghttpd", "--no-tls", "-a", "127.0.0.1", "-d", &docs, &(BASE + i).to_string()])
    });
    // h2load's first connection, before it was seen reading, is on TCP.
    h2load(ns, BASE + 2, "h2_1k", 1, 1, 10);
    let mut table = Table::new(ns, "h2load against nghttpd (HTTP/2 GETs of a file, streams multiplexed)");
    for (size, name, c, m, n) in [
        (1usize << 10, "h2_1k", 1usize, 10usize, 20_000usize),
        (64 << 10, "h2_64k", 1, 1, 4000),
        (64 << 10, "h2_64k", 10, 10, 4000),
    ] {
        table.cell(&format!("nghttp2/h2load_{size}B_c{c}_m{m}"), BASE, |port| h2load(ns, port, name, c, m, n));
    }
    table.print(k, &pairs);
}

/// `n` GETs of `path` by h2load over `c` connections, `m` streams each:
/// h2load's own time to finish them, per request.
fn h2load(ns: &NetNs, port: u16, path: &str, c: usize, m: usize, n: usize) -> Duration {
    let url = format!("http://127.0.0.1:{port}/{path}");
    let (c, m, count) = (c.to_string(), m.to_string(), n.to_string());
    let out = Command::new("ip")
        .args(["netns", "exec", ns.name(), "h2load", "-n", &count, "-c", &c, "-m", &m, &url])
        .output()
        .expect("h2load");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains(&format!("{n} succeeded, 0 failed")), "h2load {url}: {text}");
    // "finished in 1.23s, ..." (or ms, us)
    let took = text.split("finished in ").nth(1).and_then(|r| r.split(',').next()).expect("h2load's time");
    let (value, unit) = took.split_at(took.find(|ch: char| ch.is_ascii_alphabetic()).expect("h2load's unit"));
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "us" => 1e-6,
        _ => panic!("h2load's time: {took}"),
    };
    Duration::from_secs_f64(value.parse::<f64>().expect("h2load's time") * scale / n as f64)
}
