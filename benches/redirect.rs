//! 64 B request/response round trips, side by side in one run: plain loopback
//! TCP, the same with the endpoint pair registered (sk_msg redirect), and a
//! Unix socket pair. Loopback runs inside a namespace of its own; sockops is
//! attached to a cgroup of this process only. Then the redirected pair with
//! the latency monitor off and on for its rule, interleaved, with each
//! program's bpf_stats per run.
//!
//! `cargo bench -p meshwarp-benches --bench redirect` (as root).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_core::{Endpoint, EndpointPair, LatencyScope};
use meshwarp_testbed::{KernelTest, NetNs};

const MSG: usize = 64;
const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

#[path = "common.rs"]
mod common;
use common::{bench_rtt, prog_cost, tcp_pair};

fn rtt_64b(c: &mut Criterion) {
    let Some(k) = KernelTest::start(1024) else {
        return;
    };
    let ns = NetNs::new("bench").expect("netns");
    let plain: SocketAddr = "127.0.0.1:9100".parse().expect("addr");
    let redirected: SocketAddr = "127.0.0.1:9101".parse().expect("addr");
    let pair = EndpointPair::new(redirected.ip(), Endpoint::from(redirected)).expect("pair");
    k.dp().insert(&pair, "bench").expect("register pair");

    let mut tcp = tcp_pair(&ns, plain, MSG);
    let mut fast = tcp_pair(&ns, redirected, MSG);
    let (mut unix, peer) = UnixStream::pair().expect("unix pair");
    std::thread::spawn(move || {
        let mut peer = peer;
        let mut buf = [0u8; MSG];
        while peer.read_exact(&mut buf).is_ok() && peer.write_all(&buf).is_ok() {}
    });

    let mut g = c.benchmark_group("rtt_64B");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    // Interleave the three paths across repetitions: the machine is noisy.
    bench_rtt::<_, MSG>(&mut g, "loopback_tcp", &mut tcp);
    bench_rtt::<_, MSG>(&mut g, "sk_msg_redirect", &mut fast);
    bench_rtt::<_, MSG>(&mut g, "unix_socket", &mut unix);
    g.finish();
    // The program's run time (bpf_stats) over 100 000 more round trips,
    // apart from the timed ones: bpf_stats reads the clock twice around
    // every program run (each system call's too, with the syscall watch),
    // which would add microseconds to the redirected round trip only.
    let stats_enabled = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
    let _ = std::fs::write(BPF_STATS, "1");
    let before = k.dp().sk_msg_prog_id().ok().and_then(prog_cost).unwrap_or_default();
    let (msg, mut buf) = ([0x42u8; MSG], [0u8; MSG]);
    for _ in 0..100_000 {
        meshwarp_testbed::round_trip(&mut fast, &msg, &mut buf).expect("round trip");
    }
    let prog_cost = k.dp().sk_msg_prog_id().ok().and_then(prog_cost).map(|(ns, runs)| (ns - before.0, runs - before.1));
    let _ = std::fs::write(BPF_STATS, stats_enabled.trim());

    let st = k.dp().stats(&pair).expect("stats");
    assert!(st.redirected_msgs > 0, "the redirected path was not redirected: {st:?}");
    eprintln!("pair counters after the run: {st:?}");
    if let Some((ns, runs)) = prog_cost {
        eprintln!("sk_msg program: {:.0} ns per run over {runs} runs (bpf_stats)", ns as f64 / runs as f64);
    }
}

/// The 64 B round trip of a registered pair with the latency monitor off
/// and on (its rule only), interleaved twice; the per-run cost of every
/// program on the way (bpf_stats), on and off.
fn rtt_64b_monitor(c: &mut Criterion) {
    let Some(k) = KernelTest::start(1024) else {
        return;
    };
    let ns = NetNs::new("bench").expect("netns");
    let addr: SocketAddr = "127.0.0.1:9102".parse().expect("addr");
    let pair = EndpointPair::new(addr.ip(), Endpoint::from(addr)).expect("pair");
    k.dp().insert(&pair, "bench").expect("register pair");
    let id = k.dp().rule_id(&pair).expect("rule id");
    let mut fast = tcp_pair(&ns, addr, MSG);
    let progs = ["mw_sk_msg", "mw_recv_len", "mw_lat_send"];
    let scope = |on: bool| if on { LatencyScope::Rules(BTreeSet::from([id])) } else { LatencyScope::Off };

    // Timed without bpf_stats, which adds two clock reads to every program
    // run (and the monitor runs one program more).
    let mut g = c.benchmark_group("rtt_64B_monitor");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for round in 1..=2 {
        for on in [false, true] {
            k.dp().latency().set(&scope(on), false).expect("switch the monitor");
            let label = format!("monitor_{}_{round}", if on { "on" } else { "off" });
            bench_rtt::<_, MSG>(&mut g, &label, &mut fast);
        }
    }
    g.finish();

    // Then each program's cost per run, off and on: 100 000 round trips each.
    let stats_enabled = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
    let _ = std::fs::write(BPF_STATS, "1");
    let (msg, mut buf) = ([0x42u8; MSG], [0u8; MSG]);
    for on in [false, true] {
        k.dp().latency().set(&scope(on), false).expect("switch the monitor");
        let before = progs.map(|p| k.dp().prog_id(p).ok().and_then(prog_cost).unwrap_or_default());
        for _ in 0..100_000 {
            meshwarp_testbed::round_trip(&mut fast, &msg, &mut buf).expect("round trip");
        }
        let after = progs.map(|p| k.dp().prog_id(p).ok().and_then(prog_cost).unwrap_or_default());
        let per = |i: usize| {
            let (ns, runs) = (after[i].0 - before[i].0, after[i].1 - before[i].1);
            if runs == 0 {
                "-".to_string()
            } else {
                format!("{:.0} ns", ns as f64 / runs as f64)
            }
        };
        eprintln!(
            "monitor {}: per run (bpf_stats) sk_msg {}, recv_len {}, lat_send {}",
            if on { "on" } else { "off" },
            per(0),
            per(1),
            per(2)
        );
    }
    let _ = std::fs::write(BPF_STATS, stats_enabled.trim());
    let hists = k.dp().latency().histograms(&BTreeSet::from([id])).expect("histograms");
    assert!(hists.iter().any(|h| h.count > 0), "the monitor recorded nothing");
}

criterion_group!(benches, rtt_64b, rtt_64b_monitor);
criterion_main!(benches);
