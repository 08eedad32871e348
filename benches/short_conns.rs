//! Short connections: a new connection per request, as a client without a
//! connection pool makes them (a 1 KiB request, a 1 KiB or 64 KiB answer,
//! then the client closes), with and without TCP Fast Open (the request in
//! the SYN; the listener's `TCP_FASTOPEN`, the client's
//! `TCP_FASTOPEN_CONNECT`, the namespace's `net.ipv4.tcp_fastopen=3`). A
//! covered connection pays for its handshake's BPF work (sockops, a link, two
//! SOCKMAP inserts) and a Fast Open server end also for its relink, which
//! the guard thread serves; what it gains is a few redirected messages. Mode
//! never shows what is left without the SOCKMAP: the covered connection's
//! own BPF work (sockops with the close watched, socket storage, the reads'
//! tracepoint), which the uncovered listeners do not pay. An uncovered
//! connection still pays the data path's cgroup programs (sockops, connect4,
//! setsockopt run for every TCP socket of the cgroup); a sixth listener and
//! its clients live in a cgroup beside it without the data path (what a pod
//! meshwarp does not watch pays: the global tracepoints only). On loopback
//! in one namespace, the six take turns as in the apps bench (TCP, always,
//! adaptive, never, TCP again as the noise floor, TCP in the bare cgroup);
//! the client's time per connection, from `socket()` to its close, medians.
//!
//! `cargo bench -p meshwarp-benches --bench short_conns` (as root;
//! `MESHWARP_SHORT_TURNS`, default 61; a filter selects cells by substring).
//! After the turns, each listener's connections are made once more with
//! bpf_stats on: BPF time per connection, by program.
//! Everything runs on the machine's last CPU (client, servers, the data
//! path's thread): a turn's time is then the CPU work of its connections,
//! and the A/A column stays within a few percent. Spread over two CPUs
//! (`MESHWARP_SHORT_UNPINNED=1`) a turn's time depends on where the
//! scheduler put the client and the server, for long stretches (a cross-CPU
//! wake-up halts and wakes a vCPU of this VM): 30 us and 70 us per
//! connection in one cell, A/A up to 2x.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use meshwarp_core::{Endpoint, EndpointPair, FastPathMode};
use meshwarp_testbed::{
    read_exact_ready, read_ready, set_int_opt, write_all_ready, BareCgroup, KernelTest, NetNs, TCP_FASTOPEN_CONNECT,
};

// interleaved_medians is not used here.
#[allow(dead_code)]
#[path = "interleave.rs"]
mod interleave;
use interleave::selected;

const T: Duration = Duration::from_secs(60);
const BASE: u16 = 9740;
const REQUEST: usize = 1024;
/// Connections per turn.
const CONNS: usize = 300;
/// The listener whose sockets are in a cgroup without the data path.
const BARE: u16 = 5;

fn lo(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from([127, 0, 0, 1]), port)
}

/// Serves `l` forever, one connection after another: reads the request,
/// writes `answer` bytes, reads to the client's close (non-blocking reads,
/// as an event-driven server: the reader guard judges the program by them).
fn serve(l: TcpListener, answer: usize) {
    l.set_nonblocking(false).expect("blocking accept");
    let body = vec![0x61u8; answer];
    let mut req = vec![0u8; REQUEST];
    loop {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nonblocking(true).expect("non-blocking");
        read_exact_ready(&mut s, &mut req, Some(T)).expect("request");
        write_all_ready(&mut s, &body, Some(T)).expect("answer");
        while read_ready(&mut s, &mut req, Some(T)).expect("read to the close") > 0 {}
    }
}

/// One connection to `addr`: the request (in the SYN with `fast_open` once
/// the client holds a cookie), the whole answer, the close.
fn one(addr: SocketAddr, fast_open: bool, req: &[u8], answer: &mut [u8]) {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    if fast_open {
        set_int_opt(&s, libc::IPPROTO_TCP, TCP_FASTOPEN_CONNECT, 1).expect("TCP_FASTOPEN_CONNECT");
    }
    s.set_tcp_nodelay(true).expect("nodelay");
    // Blocking connect and write (with Fast Open the connect returns at once
    // and the write sends the SYN); reads without blocking.
    s.connect(&addr.into()).expect("connect");
    let mut c = TcpStream::from(s);
    c.write_all(req).expect("request");
    c.set_nonblocking(true).expect("non-blocking");
    read_exact_ready(&mut c, answer, Some(T)).expect("answer");
}

/// Cumulative (run_time_ns, run_cnt) of every loaded program named `mw_*`.
fn bpf_costs() -> std::collections::BTreeMap<String, (u64, u64)> {
    libbpf_rs::query::ProgInfoIter::default()
        .filter_map(|p| {
            let name = p.name.to_str()?.to_string();
            name.starts_with("mw_").then_some((name, (p.run_time_ns, p.run_cnt)))
        })
        .fold(std::collections::BTreeMap::new(), |mut m, (name, (t, n))| {
            let e = m.entry(name).or_insert((0, 0));
            *e = (e.0 + t, e.1 + n);
            m
        })
}

/// The BPF work of `conns` connections made by `run`, per connection and
/// program (bpf_stats on meanwhile, off again after): "total (program runs
/// x ns, ...)". Each run counts the stats' own two clock reads (tens of ns
/// on this VM), and the global tracepoints count every process's calls.
fn bpf_per_connection(conns: usize, run: impl FnOnce()) -> String {
    const KNOB: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let was = std::fs::read_to_string(KNOB).unwrap_or_default();
    std::fs::write(KNOB, "1").expect("enabling bpf_stats");
    let before = bpf_costs();
    run();
    let after = bpf_costs();
    let _ = std::fs::write(KNOB, if was.trim() == "1" { "1" } else { "0" });
    let n = conns as f64;
    let mut total = 0.0;
    let parts: Vec<String> = after
        .iter()
        .filter_map(|(name, &(t, c))| {
            let (t0, c0) = before.get(name).copied().unwrap_or((0, 0));
            let (dt, dc) = (t.saturating_sub(t0), c.saturating_sub(c0));
            (dc > 0).then(|| {
                total += dt as f64 / n;
                format!("{name} {:.1} x {:.0} ns", dc as f64 / n, dt as f64 / dc as f64)
            })
        })
        .collect();
    format!("{:.2} us ({})", total / 1e3, parts.join(", "))
}

/// Keeps this thread, and every thread it starts from now on, on the last CPU.
fn pin_to_last_cpu() {
    // SAFETY: a zeroed cpu_set_t is empty; pid 0 is the calling thread.
    let rc = unsafe {
        let cpus = libc::sysconf(libc::_SC_NPROCESSORS_ONLN).max(1) as usize;
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus - 1, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(rc, 0, "sched_setaffinity: {}", std::io::Error::last_os_error());
}

fn main() {
    if std::env::var_os("MESHWARP_SHORT_UNPINNED").is_none() {
        pin_to_last_cpu();
    }
    let Some(k) = KernelTest::start(4096) else { return };
    let bare = BareCgroup::new().expect("bare cgroup");
    let turns = std::env::var("MESHWARP_SHORT_TURNS").ok().and_then(|v| v.parse().ok()).unwrap_or(61);
    let ns = NetNs::new("short").expect("netns");
    ns.fast_open_on().expect("net.ipv4.tcp_fastopen");
    let mut rows = Vec::new();
    let mut cell_base = BASE;
    for (fast_open, answer) in [(false, 1024usize), (true, 1024), (false, 64 << 10), (true, 64 << 10)] {
        let base = cell_base;
        cell_base += 6;
        let id = format!("short/{}_{}B", if fast_open { "fastopen" } else { "plain" }, answer);
        if !selected(&id) {
            continue;
        }
        let modes = [(1u16, FastPathMode::Always), (2, FastPathMode::Adaptive), (3, FastPathMode::Never)];
        let pairs = modes.map(|(i, mode)| {
            let pair =
                EndpointPair::new(lo(0).ip(), Endpoint::new(lo(0).ip(), base + i)).expect("pair").with_mode(mode);
            k.dp().insert(&pair, "short-conns-bench").expect("register pair");
            pair
        });
        for i in 0..6u16 {
            let listen =
                || ns.listen_with(lo(base + i), |s| set_int_opt(s, libc::IPPROTO_TCP, libc::TCP_FASTOPEN, 256));
            // Accepted sockets belong to their listener's cgroup.
            let l = if i == BARE { bare.visit(&k.cgroup, listen).expect("cgroup") } else { listen() }.expect("listen");
            thread::spawn(move || serve(l, answer));
        }
        let medians = ns
            .enter(|| {
                let req = vec![0x71u8; REQUEST];
                let mut buf = vec![0u8; answer];
                // The cookies, and each program seen reading (a first covered
                // connection waits on TCP until then).
                for i in 0..6u16 {
                    for _ in 0..3 {
                        one(lo(base + i), fast_open, &req, &mut buf);
                    }
                }
                interleave::interleaved_timed(6, turns, |i| {
                    let addr = lo(base + i as u16);
                    let mut turn = || {
                        let start = Instant::now();
                        for _ in 0..CONNS {
                            one(addr, fast_open, &req, &mut buf);
                        }
                        start.elapsed() / CONNS as u32
                    };
                    // The cgroup moves are outside the timed part.
                    if i == usize::from(BARE) {
                        bare.visit(&k.cgroup, turn).expect("cgroup")
                    } else {
                        turn()
                    }
                })
            })
            .expect("netns");
        // Where each listener's connections spend BPF time, apart from the
        // timed turns (bpf_stats costs clock reads of its own).
        let costs = ns
            .enter(|| {
                let req = vec![0x71u8; REQUEST];
                let mut buf = vec![0u8; answer];
                [(0u16, "tcp"), (1, "always"), (2, "adaptive"), (3, "never"), (BARE, "tcp, cgroup without meshwarp")]
                    .map(|(i, what)| {
                        let mut run = || {
                            bpf_per_connection(CONNS, || {
                                for _ in 0..CONNS {
                                    one(lo(base + i), fast_open, &req, &mut buf);
                                }
                            })
                        };
                        let cost = if i == BARE { bare.visit(&k.cgroup, run).expect("cgroup") } else { run() };
                        format!("  BPF per connection, {what}: {cost}")
                    })
            })
            .expect("netns");
        let mark = |r: f64| if r > 1.05 { " SLOWER" } else { "" };
        let [a, d, n, aa, out] = [medians[1], medians[2], medians[3], medians[4], medians[5]].map(|t| t / medians[0]);
        let row = format!(
            "| {id} | {turns} x {CONNS} | {:.1} us | {a:.2}x{} | {d:.2}x{} | {n:.2}x{} | {aa:.2}x | {out:.2}x |",
            medians[0] / 1e3,
            mark(a),
            mark(d),
            mark(n)
        );
        eprintln!("{row}");
        for (mode, pair) in ["always", "adaptive", "never"].iter().zip(&pairs) {
            let st = k.dp().stats(pair).expect("stats");
            eprintln!(
                "  {mode}: sockets {} redirected {} B; relinks {}; fallbacks: reader {} no_peer {} tcp_path {}",
                st.sockets,
                st.redirected_bytes,
                st.relinks,
                st.fallback_reader,
                st.fallback_no_peer,
                st.fallback_tcp_path
            );
        }
        for c in &costs {
            eprintln!("{c}");
        }
        rows.push(row);
    }
    eprintln!(
        "\nshort connections (interleaved medians; the client's time per connection, ratio to TCP's):\n\
         | workload | turns x connections | tcp (not covered) | always / tcp | adaptive / tcp | never / tcp | tcp again / tcp (A/A) | tcp, cgroup without meshwarp / tcp |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n{}\n",
        rows.join("\n")
    );
}
