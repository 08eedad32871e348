//! Every socket path side by side in one run (issue: "no path slower than
//! plain TCP in any cell"):
//! - `rr/<size>`: request/response round trips of 64 B .. 1 MiB over plain
//!   loopback TCP with no programs attached, TCP seen by sockops but not
//!   covered, mirror-paired redirect (mode always, and mode adaptive),
//!   capture-paired redirect through iptables REDIRECT, and a Unix socket pair
//!   (and one whose ends wait in poll(), in the interleaved comparison;
//!   `MESHWARP_BENCH_HALT_POLL_NS=N` adds the two-CPU comparison with the
//!   guest's halt polling set to N ns, restored after);
//! - `stream/<conns>x<write>_<nagle>`: one-way bulk throughput, 64 B .. 64 KiB
//!   writes, 1, 8 and 64 connections, TCP_NODELAY on and off: TCP, mode
//!   always, mode adaptive (`MESHWARP_BENCH_QUICK=1`: 1 and 8 connections);
//!   then the same matrix with the paths in alternation (interleaved
//!   medians, a table on stderr, with TCP against itself as the noise
//!   floor), and placed threads for one connection's 16 and 64 KiB writes;
//! - `download/<size>MiB_<write>B_<nagle>`: a 64 B request answered by 1 or
//!   16 MiB written in 1 or 16 KiB writes,
//!   `upload/<size>MiB_<write>B_<nagle>`: 1 MiB in 16 KiB writes or one,
//!   16 MiB in 16 KiB writes, each answered with 64 B once read, and
//!   `burst/<k>x<size>B[_ack<answer>B]_<nagle>`: pipelined requests each
//!   answered as it is read, interleaved only (a table on stderr, with the
//!   same noise floor);
//! - `control`: registering pairs one by one vs in one batch (library).
//!
//! `cargo bench -p meshwarp-benches --bench paths` (as root); a filter
//! (`-- stream/8x1024B_nagle`, `-- rr`, `-- 'download|burst'`) also selects
//! the interleaved cells, whose ids are `stream/<conns>x<write>B_<nagle>`,
//! `rr/interleaved/<size>` and the exchanges' above. `MESHWARP_STREAM_TURNS`
//! fixes the turns of every interleaved stream and exchange cell,
//! `MESHWARP_STREAM_MIB` the bytes of every stream cell.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::os::unix::thread::JoinHandleExt;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use meshwarp_core::{CaptureRule, Endpoint, EndpointPair, FastPathMode};
use meshwarp_testbed::{
    accept_timeout, read_exact_ready, read_ready, redirect_output, spawn_echo, write_all_ready, KernelTest, NetNs,
};

const SIZES: [usize; 5] = [64, 1024, 16 * 1024, 64 * 1024, 1 << 20];
/// Interleaved request/response comparison: turns per path, round trips per turn.
const RR_TURNS: usize = 15;
const RR_TURN: u32 = 2_000;

#[path = "interleave.rs"]
mod interleave;
use interleave::{interleaved_medians, interleaved_timed};
#[path = "exchange.rs"]
mod exchange;

/// The bench's filter (criterion's free argument), which the interleaved
/// comparisons also follow, as a substring of their cell's id (`a|b`:
/// either; no other regex): `--bench paths -- stream/8x1024B_nagle` runs
/// that one cell.
fn selected(id: &str) -> bool {
    // Criterion's options that take a value: the value is no filter.
    const VALUED: [&str; 14] = [
        "--save-baseline",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--sample-size",
        "--warm-up-time",
        "--measurement-time",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--profile-time",
        "--plotting-backend",
        "--output-format",
    ];
    let mut args = std::env::args().skip(1);
    let mut filter = None;
    while let Some(a) = args.next() {
        if VALUED.contains(&a.as_str()) || a == "--color" {
            args.next();
        } else if !a.starts_with('-') {
            filter = Some(a);
            break;
        }
    }
    filter.is_none_or(|f| f.split('|').any(|f| id.contains(f)))
}

/// A number from the environment (`MESHWARP_STREAM_TURNS`, ...), else `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The guest's cpuidle halt polling (`haltpoll.guest_halt_poll_ns`) set for
/// a comparison, and restored when dropped. This VM boots with it at 0: an
/// idle vCPU halts at once, and waking it takes tens of µs, the largest
/// cost of a round trip between two CPUs for every path. Only with
/// `MESHWARP_BENCH_HALT_POLL_NS` (a host-wide knob: never by default; a
/// run killed by a signal leaves it set: write the old value back by hand).
struct HaltPoll(Option<String>);

const HALT_POLL: &str = "/sys/module/haltpoll/parameters/guest_halt_poll_ns";

impl HaltPoll {
    fn set(ns: u64) -> Self {
        let old = std::fs::read_to_string(HALT_POLL).ok();
        match &old {
            Some(_) => std::fs::write(HALT_POLL, ns.to_string()).expect("setting guest_halt_poll_ns"),
            None => eprintln!("rr: {HALT_POLL} missing (no haltpoll cpuidle driver): the comparison runs as it is"),
        }
        Self(old)
    }
}

impl Drop for HaltPoll {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            if let Err(e) = std::fs::write(HALT_POLL, old.trim()) {
                eprintln!("rr: restoring {HALT_POLL} to {}: {e}", old.trim());
            }
        }
    }
}

/// A socket `rtt` drives, of either family.
trait ReadWriteFd: Read + Write + std::os::fd::AsFd {}
impl<T: Read + Write + std::os::fd::AsFd> ReadWriteFd for T {}
const VIP: &str = "198.19.0.10";

/// The bench namespace: loopback, plus an interface (a veth whose peer stays
/// in the namespace) so that a service address can be routed, and captured by
/// iptables before it leaves.
fn bench_ns() -> NetNs {
    let ns = NetNs::new("paths").expect("netns");
    ns.ip(&["link", "add", "svc0", "type", "veth", "peer", "name", "svc1"]).expect("veth");
    ns.ip(&["addr", "add", "198.18.0.1/24", "dev", "svc0"]).expect("addr");
    ns.ip(&["link", "set", "svc0", "up"]).expect("up");
    ns.ip(&["link", "set", "svc1", "up"]).expect("up");
    ns.ip(&["route", "add", "198.19.0.0/16", "dev", "svc0"]).expect("route");
    let cc = ns.bench_congestion_control().expect("MESHWARP_BENCH_CC");
    eprintln!("paths bench: TCP congestion control {cc} (MESHWARP_BENCH_CC sets another)");
    ns
}

/// Lets a thread run on `cpus` only: one CPU to place it (its placement
/// decides whether a round trip wakes a halted vCPU, a bigger difference here
/// than any path's), every CPU to let it go again.
fn set_cpus(thread: libc::pthread_t, cpus: impl IntoIterator<Item = usize>) {
    // SAFETY: a zeroed cpu_set_t is empty; the thread is alive (its handle is held).
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::pthread_setaffinity_np(thread, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(rc, 0, "setting a thread's CPUs");
}

/// The echo server's thread of a connection, to pin.
type Echo = std::thread::JoinHandle<std::io::Result<()>>;

/// A connected client whose peer echoes `msg` bytes at a time, and the
/// echoing thread.
fn echo_conn(ns: &NetNs, listen: SocketAddr, connect: SocketAddr, msg: usize, nodelay: bool) -> (TcpStream, Echo) {
    let (c, s) = exchange::connected(ns, listen, connect, nodelay);
    // Blocking round trips (see common.rs).
    c.set_nonblocking(false).expect("blocking");
    s.set_nonblocking(false).expect("blocking");
    let echo = spawn_echo(s, msg);
    (c, echo)
}

/// A Unix socket pair whose far end echoes. `polled`: both ends wait in
/// poll() instead of a blocking read. A blocked Unix reader sleeps on the
/// wait queue its socket's write space is announced on too, so it is woken
/// as soon as its peer reads what it sent, one step before the answer comes
/// (a wake-up TCP and the redirect do not give); a poll() waiter for POLLIN
/// is not. On two CPUs of this VM that early wake-up hides the other vCPU's
/// halt exit, the largest cost of a round trip.
fn unix_echo(msg: usize, polled: bool) -> (UnixStream, Echo) {
    let (c, mut s) = UnixStream::pair().expect("unix pair");
    c.set_nonblocking(polled).expect("nonblocking");
    s.set_nonblocking(polled).expect("nonblocking");
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; msg];
        while read_exact_ready(&mut s, &mut buf, None).is_ok() && write_all_ready(&mut s, &buf, None).is_ok() {}
        Ok(())
    });
    (c, echo)
}

fn rtt<S: Read + Write + std::os::fd::AsFd>(s: &mut S, msg: &[u8], buf: &mut [u8], iters: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..iters {
        write_all_ready(s, msg, None).expect("write");
        read_exact_ready(s, buf, None).expect("read");
    }
    t.elapsed()
}

fn paths(c: &mut Criterion) {
    let Some(k) =
        KernelTest::start_with(8192, 4096, |cfg| cfg.guard_realtime = meshwarp_testbed::bench_guard_realtime())
    else {
        return;
    };
    let ns = bench_ns();
    let lo = |p: u16| SocketAddr::new(IpAddr::from([127, 0, 0, 1]), p);
    // Pairs and the capture rule, registered once.
    let mirror =
        EndpointPair::new(lo(0).ip(), Endpoint::new(lo(0).ip(), 9301)).expect("pair").with_mode(FastPathMode::Always);
    k.dp().insert(&mirror, "bench").expect("pair");
    let adaptive = EndpointPair::new(lo(0).ip(), Endpoint::new(lo(0).ip(), 9302)).expect("pair");
    k.dp().insert(&adaptive, "bench").expect("pair");
    let vip: IpAddr = VIP.parse().expect("vip");
    redirect_output(&ns, vip, 80, 15001).expect("iptables");
    let capture = CaptureRule::new(
        Some("198.18.0.1".parse().expect("ip")),
        Endpoint::new(vip, 80),
        Endpoint::new(lo(0).ip(), 15001),
    )
    .expect("capture rule");
    k.dp().insert(&capture, "bench").expect("capture");

    let mut port = 9400u16;
    let mut next_port = || {
        port += 1;
        port
    };
    let mut g = c.benchmark_group("rr");
    g.sample_size(15).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    for size in SIZES {
        let msg = vec![0x5a; size];
        let mut buf = vec![0u8; size];
        g.throughput(Throughput::Bytes(2 * size as u64));
        let p = next_port();
        let (mut plain, e0) = k.cgroup.outside(|| echo_conn(&ns, lo(p), lo(p), size, true)).expect("outside cgroup");
        let p = next_port();
        let (mut seen, e1) = echo_conn(&ns, lo(p), lo(p), size, true);
        let (mut redir, e2) = echo_conn(&ns, lo(9301), lo(9301), size, true);
        let (mut adapt, e3) = echo_conn(&ns, lo(9302), lo(9302), size, true);
        let (mut captured, e4) = echo_conn(&ns, lo(15001), SocketAddr::new(vip, 80), size, true);
        let (mut unix, e5) = unix_echo(size, false);
        let (mut unix_polled, e6) = unix_echo(size, true);
        let echoes = [e0, e1, e2, e3, e4, e5, e6];
        // One exchange each, so the check below holds whatever a filter runs.
        for s in [&mut redir, &mut adapt, &mut captured] {
            rtt(s, &msg, &mut buf, 1);
        }
        g.bench_with_input(BenchmarkId::new("tcp", size), &size, |b, _| {
            b.iter_custom(|n| rtt(&mut plain, &msg, &mut buf, n))
        });
        g.bench_with_input(BenchmarkId::new("tcp_not_covered", size), &size, |b, _| {
            b.iter_custom(|n| rtt(&mut seen, &msg, &mut buf, n))
        });
        g.bench_with_input(BenchmarkId::new("redirect_mirror", size), &size, |b, _| {
            b.iter_custom(|n| rtt(&mut redir, &msg, &mut buf, n))
        });
        g.bench_with_input(BenchmarkId::new("redirect_adaptive", size), &size, |b, _| {
            b.iter_custom(|n| rtt(&mut adapt, &msg, &mut buf, n))
        });
        g.bench_with_input(BenchmarkId::new("redirect_capture", size), &size, |b, _| {
            b.iter_custom(|n| rtt(&mut captured, &msg, &mut buf, n))
        });
        g.bench_with_input(BenchmarkId::new("unix", size), &size, |b, _| {
            b.iter_custom(|n| rtt(&mut unix, &msg, &mut buf, n))
        });
        // The goal's cells again, the seven in alternation (criterion's
        // groups run back to back, and this host drifts by more than the
        // differences between paths), with the threads placed: client and
        // echo on one CPU, then on two (where a round trip wakes the other,
        // often halted, vCPU). Unpinned, the scheduler's choice per
        // connection decides a cell more than its path does.
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        if size <= 1024 && cpus < 2 {
            eprintln!("rr {size} B: interleaved comparison skipped: it places threads on CPUs 0 and 1, this process may use {cpus}");
        }
        if size <= 1024 && cpus >= 2 && selected(&format!("rr/interleaved/{size}")) {
            let names = [
                "tcp",
                "tcp_not_covered",
                "redirect_mirror",
                "redirect_adaptive",
                "redirect_capture",
                "unix",
                "unix_polled",
            ];
            let mut placements = vec![("one CPU".to_string(), 1, None), ("two CPUs".to_string(), 0, None)];
            if let Some(ns) = std::env::var("MESHWARP_BENCH_HALT_POLL_NS").ok().and_then(|v| v.parse::<u64>().ok()) {
                placements.push((format!("two CPUs, guest halt polling {ns} ns"), 0, Some(ns)));
            }
            for (placement, echo_cpu, halt_poll) in placements {
                let _poll = halt_poll.map(HaltPoll::set);
                // SAFETY: pthread_self is always valid.
                set_cpus(unsafe { libc::pthread_self() }, [1]);
                for e in &echoes {
                    set_cpus(e.as_pthread_t(), [echo_cpu]);
                }
                let m = interleaved_medians(
                    names.len(),
                    RR_TURNS,
                    RR_TURN,
                    |_| {},
                    |i| {
                        let s: &mut dyn ReadWriteFd = match i {
                            0 => &mut plain,
                            1 => &mut seen,
                            2 => &mut redir,
                            3 => &mut adapt,
                            4 => &mut captured,
                            5 => &mut unix,
                            _ => &mut unix_polled,
                        };
                        rtt(&mut { s }, &msg, &mut buf, 1);
                    },
                );
                let cells: Vec<String> =
                    names.iter().zip(&m).map(|(n, t)| format!("{n} {:.1} us ({:.2}x)", t / 1e3, t / m[0])).collect();
                eprintln!(
                    "rr {size} B, {placement}, interleaved medians ({RR_TURNS} turns of {RR_TURN}): {}",
                    cells.join(", ")
                );
            }
            // SAFETY: pthread_self is always valid.
            let me = unsafe { libc::pthread_self() };
            for e in echoes.iter().map(|e| e.as_pthread_t()).chain([me]) {
                set_cpus(e, 0..libc::CPU_SETSIZE as usize);
            }
        }
        // Each listener served one connection; drop them before the next size.
        drop((plain, seen, redir, adapt, captured, unix, unix_polled, echoes));
    }
    g.finish();
    let st = k.dp().stats(&mirror).expect("stats");
    let cs = k.dp().stats(&capture).expect("stats");
    assert!(st.redirected_msgs > 0 && cs.redirected_msgs > 0, "redirected paths were not redirected: {st:?} {cs:?}");
    let ad = k.dp().stats(&adaptive).expect("stats");
    eprintln!("mirror pair: {st:?}\ncapture rule: {cs:?}\nadaptive pair after rr: {ad:?}");
    stream(c, &k, &ns, &mirror, &adaptive);
    exchanges(&k, &ns, &mirror, &adaptive);
    control(c, &k);
}

/// One-way bulk: `conns` connections each write `total / conns` bytes in
/// `write`-byte writes (a small-write total is smaller: they are slow).
fn stream(c: &mut Criterion, k: &KernelTest, ns: &NetNs, always: &EndpointPair, adaptive: &EndpointPair) {
    let quick = std::env::var_os("MESHWARP_BENCH_QUICK").is_some();
    let mut g = c.benchmark_group("stream");
    g.sample_size(10).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    let lo = |p: u16| SocketAddr::new(IpAddr::from([127, 0, 0, 1]), p);
    let conns_list: &[usize] = if quick { &[1, 8] } else { &[1, 8, 64] };
    for write in [64usize, 1024, 16 << 10, 64 << 10] {
        let total = stream_total(write);
        g.throughput(Throughput::Bytes(total as u64));
        for &conns in conns_list {
            for nodelay in [true, false] {
                let nagle = if nodelay { "nodelay" } else { "nagle" };
                for (path, port) in [
                    ("tcp_not_covered", 9501u16),
                    ("redirect_always", always.server().port),
                    ("redirect_adaptive", adaptive.server().port),
                ] {
                    let id = BenchmarkId::new(format!("{conns}x{write}B_{nagle}"), path);
                    g.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            let mut t = Duration::ZERO;
                            for _ in 0..iters {
                                t += one_stream(ns, lo(port), conns, nodelay, write, total / conns, None);
                            }
                            t
                        })
                    });
                }
            }
        }
    }
    g.finish();
    stream_interleaved(ns, conns_list, always, adaptive);
    eprintln!("adaptive pair: {:?}", k.dp().stats(adaptive).expect("stats"));
}

/// Bytes one stream cell moves (all connections together): small writes are
/// slow, so their cells move less.
fn stream_total(write: usize) -> usize {
    if write < 1024 {
        4 << 20
    } else {
        32 << 20
    }
}

/// `place`: the reader's and the writer's CPU (every connection's).
fn one_stream(
    ns: &NetNs,
    addr: SocketAddr,
    conns: usize,
    nodelay: bool,
    write: usize,
    each: usize,
    place: Option<(usize, usize)>,
) -> Duration {
    let l = ns.listen(addr).expect("listen");
    let mut pairs = Vec::with_capacity(conns);
    for _ in 0..conns {
        let c = ns.connect(addr).expect("connect");
        let s = accept_timeout(&l, Duration::from_secs(5)).expect("accept");
        c.set_nodelay(nodelay).expect("nodelay");
        pairs.push((c, s));
    }
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (mut c, mut s) in pairs {
            scope.spawn(move || {
                if let Some((cpu, _)) = place {
                    // SAFETY: pthread_self is always valid.
                    set_cpus(unsafe { libc::pthread_self() }, [cpu]);
                }
                let mut buf = vec![0u8; 64 * 1024];
                let mut got = 0;
                while got < each {
                    match read_ready(&mut s, &mut buf, Some(Duration::from_secs(30))) {
                        Ok(0) => break,
                        Ok(n) => got += n,
                        Err(e) => panic!("stream read: {e}"),
                    }
                }
                assert_eq!(got, each, "short stream");
            });
            scope.spawn(move || {
                if let Some((_, cpu)) = place {
                    // SAFETY: pthread_self is always valid.
                    set_cpus(unsafe { libc::pthread_self() }, [cpu]);
                }
                let chunk = vec![0x42u8; write];
                let mut sent = 0;
                while sent < each {
                    write_all_ready(&mut c, &chunk[..write.min(each - sent)], None).expect("stream write");
                    sent += write;
                }
            });
        }
    });
    start.elapsed()
}

/// The stream matrix again, the paths in alternation (turns of one stream
/// each, in a new order every round, the median of each path's turns),
/// printed as a table. In a fixed order each path pays for the one before
/// it: a download turn right after mode always's took 1.08x its time (1.01x
/// with 100 ms between turns). Criterion
/// runs each path's samples back to back, and this host drifts between them
/// by more than some cells' differences. TCP runs twice per turn: the second
/// one's ratio to the first (A/A) is the noise a cell's ratios carry. The
/// single-connection 16 and 64 KiB cells also run with the reader and writer
/// placed (on one CPU, then on two): whether a reader sleeps between writes,
/// a vCPU halt and wake-up here, decides those more than their path.
/// A cell gets as many turns as make about a second per path (15 to 61: a
/// median of short streams moves more between runs than its paths differ);
/// `MESHWARP_STREAM_TURNS` and `MESHWARP_STREAM_MIB` (every cell's bytes)
/// override the defaults.
fn stream_interleaved(ns: &NetNs, conns_list: &[usize], always: &EndpointPair, adaptive: &EndpointPair) {
    let mib = env_or("MESHWARP_STREAM_MIB", 0);
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let lo = |p: u16| SocketAddr::new(IpAddr::from([127, 0, 0, 1]), p);
    let ports = [9501u16, always.server().port, adaptive.server().port, 9501];
    let mut placed = vec![("unpinned", None)];
    if cpus >= 2 {
        placed.extend([("one CPU", Some((1, 1))), ("two CPUs", Some((0, 1)))]);
    } else {
        eprintln!("stream: placed comparison skipped: it places threads on CPUs 0 and 1, this process may use {cpus}");
    }
    let mut rows = Vec::new();
    for write in [64usize, 1024, 16 << 10, 64 << 10] {
        let total = if mib > 0 { mib << 20 } else { stream_total(write) };
        for &conns in conns_list {
            for nodelay in [true, false] {
                let nagle = if nodelay { "nodelay" } else { "nagle" };
                if !selected(&format!("stream/{conns}x{write}B_{nagle}")) {
                    continue;
                }
                let placements = if conns == 1 && write >= 16 << 10 { &placed[..] } else { &placed[..1] };
                for &(placement, place) in placements {
                    // A first stream on TCP (not counted) times the cell.
                    let first = one_stream(ns, lo(ports[0]), conns, nodelay, write, total / conns, place);
                    let turns = turns_for(first);
                    let m = interleaved_timed(ports.len(), turns, |i| {
                        one_stream(ns, lo(ports[i]), conns, nodelay, write, total / conns, place)
                    });
                    let tcp = total as f64 / m[0] * 1e9 / f64::from(1u32 << 20);
                    let mark = |r: f64| if r < 0.95 { " SLOWER" } else { "" };
                    let [a, d, aa] = [m[1], m[2], m[3]].map(|t| m[0] / t);
                    rows.push(format!(
                        "| {conns} x {write} B, {nagle} | {placement} | {turns} | {tcp:.0} MiB/s | {a:.2}x{} | {d:.2}x{} | {aa:.2}x |",
                        mark(a),
                        mark(d),
                    ));
                }
            }
        }
    }
    if !rows.is_empty() {
        eprintln!(
            "stream, interleaved medians (congestion control {}):\n\
             | connections x write, Nagle | threads | turns | tcp (not covered) | always / tcp | adaptive / tcp | tcp again / tcp (A/A) |\n\
             |---|---|---:|---:|---:|---:|---:|\n{}",
            ns.congestion_control().expect("congestion control"),
            rows.join("\n")
        );
    }
}

/// Turns for an interleaved cell whose first run took `first`: about a
/// second per path, 15 to 61 (`MESHWARP_STREAM_TURNS` fixes it).
fn turns_for(first: Duration) -> usize {
    match env_or("MESHWARP_STREAM_TURNS", 0) {
        0 => (1.0 / first.as_secs_f64()).clamp(15.0, 61.0) as usize,
        n => n,
    }
}

/// One cell of [`exchanges`].
enum Exchange {
    Download { size: usize, write: usize, nodelay: bool },
    Upload { size: usize, write: usize, nodelay: bool },
    Burst { k: usize, size: usize, answer: usize, nodelay: bool },
}

impl Exchange {
    fn id(&self) -> String {
        let nagle = |nodelay: bool| if nodelay { "nodelay" } else { "nagle" };
        match *self {
            Self::Download { size, write, nodelay } => {
                format!("download/{}MiB_{write}B_{}", size >> 20, nagle(nodelay))
            }
            Self::Upload { size, write, nodelay } => format!("upload/{}MiB_{write}B_{}", size >> 20, nagle(nodelay)),
            Self::Burst { k, size, answer, nodelay } if answer != size => {
                format!("burst/{k}x{size}B_ack{answer}B_{}", nagle(nodelay))
            }
            Self::Burst { k, size, nodelay, .. } => format!("burst/{k}x{size}B_{}", nagle(nodelay)),
        }
    }

    /// Requests (bursts) per turn.
    fn per_turn(&self) -> u32 {
        match *self {
            Self::Download { size, .. } | Self::Upload { size, .. } if size > 1 << 20 => 4,
            Self::Download { .. } | Self::Upload { .. } => 16,
            Self::Burst { .. } => 50,
        }
    }

    /// One turn on a connection to `addr`: the time per request (burst).
    fn run(&self, ns: &NetNs, addr: SocketAddr) -> Duration {
        match *self {
            Self::Download { size, write, nodelay } => {
                exchange::download(ns, addr, nodelay, write, size, self.per_turn())
            }
            Self::Upload { size, write, nodelay } => exchange::upload(ns, addr, nodelay, write, size, self.per_turn()),
            Self::Burst { k, size, answer, nodelay } => {
                exchange::burst(ns, addr, nodelay, k, size, answer, self.per_turn())
            }
        }
    }
}

/// Downloads (a 64 B request, a 1 or 16 MiB response written in 1 or 16 KiB
/// writes), uploads (a 1 MiB request in 16 KiB writes or one, a 16 MiB one in
/// 16 KiB writes, each answered with 64 B: a cache's set, a POST) and bursts (16 or 100 pipelined requests of 64 B or 1 KiB, each
/// answered alike; 16 of 16 KiB, each answered with 64 B), Nagle on and off: TCP, mode always and mode adaptive in
/// alternation (a new order every round, as the streams), TCP again as the
/// noise floor; time per request or burst,
/// medians, as a table (`download/<size>MiB_<write>B_<nagle>`,
/// `burst/<k>x<size>B[_ack<answer>B]_<nagle>`).
fn exchanges(kt: &KernelTest, ns: &NetNs, always: &EndpointPair, adaptive: &EndpointPair) {
    let lo = |p: u16| SocketAddr::new(IpAddr::from([127, 0, 0, 1]), p);
    let ports = [9501u16, always.server().port, adaptive.server().port, 9501];
    let mut cells = Vec::new();
    for size in [1usize << 20, 16 << 20] {
        for write in [1024usize, 16 << 10] {
            cells.extend([false, true].map(|nodelay| Exchange::Download { size, write, nodelay }));
        }
    }
    for (size, write) in [(1usize << 20, 16usize << 10), (1 << 20, 1 << 20), (16 << 20, 16 << 10)] {
        cells.extend([false, true].map(|nodelay| Exchange::Upload { size, write, nodelay }));
    }
    // Under and over MW_POLICY_COALESCE (64).
    for n in [16usize, 100] {
        for size in [64usize, 1024] {
            cells.extend([false, true].map(|nodelay| Exchange::Burst { k: n, size, answer: size, nodelay }));
        }
    }
    // Uploads in pieces: large requests, short acknowledgments.
    cells.extend([false, true].map(|nodelay| Exchange::Burst { k: 16, size: 16 << 10, answer: 64, nodelay }));
    let mut rows = Vec::new();
    for cell in cells {
        let id = cell.id();
        if !selected(&id) {
            continue;
        }
        let turns = turns_for(cell.run(ns, lo(ports[0])) * cell.per_turn());
        let m = interleaved_timed(ports.len(), turns, |i| cell.run(ns, lo(ports[i])));
        let mark = |r: f64| if r > 1.05 { " SLOWER" } else { "" };
        let [a, d, aa] = [m[1], m[2], m[3]].map(|t| t / m[0]);
        rows.push(format!(
            "| {id} | {turns} | {:.0} us | {a:.2}x{} | {d:.2}x{} | {aa:.2}x |",
            m[0] / 1e3,
            mark(a),
            mark(d)
        ));
    }
    if !rows.is_empty() {
        eprintln!(
            "exchanges, interleaved medians (time per request or burst, ratio to TCP's; congestion control {}):\n\
             | workload | turns | tcp (not covered) | always / tcp | adaptive / tcp | tcp again / tcp (A/A) |\n\
             |---|---:|---:|---:|---:|---:|\n{}",
            ns.congestion_control().expect("congestion control"),
            rows.join("\n")
        );
        eprintln!("adaptive pair after the exchanges: {:?}", kt.dp().stats(adaptive).expect("stats"));
    }
}

/// Registering 1 000 pairs: one call each vs one all-or-nothing batch.
fn control(c: &mut Criterion, k: &KernelTest) {
    let mut g = c.benchmark_group("control");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(1000));
    let pairs: Vec<EndpointPair> = (1..=1000u16)
        .map(|p| {
            EndpointPair::new("198.18.9.1".parse().expect("ip"), Endpoint::new("198.18.9.2".parse().expect("ip"), p))
                .expect("pair")
        })
        .collect();
    let dp = k.dp();
    g.bench_function("insert_1000_single", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                for p in &pairs {
                    dp.insert(p, "bench").expect("insert");
                }
                total += t.elapsed();
                dp.registry().batch_remove(&pairs, "bench", false).expect("cleanup");
            }
            total
        })
    });
    g.bench_function("insert_1000_batch", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                dp.registry().batch_upsert(&pairs, "bench").expect("batch");
                total += t.elapsed();
                dp.registry().batch_remove(&pairs, "bench", false).expect("cleanup");
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, paths);
criterion_main!(benches);
