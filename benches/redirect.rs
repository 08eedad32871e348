//! 64 B request/response round trips, side by side in one run: plain loopback
//! TCP, the same with the endpoint pair registered (sk_msg redirect), and a
//! Unix socket pair. Loopback runs inside a namespace of its own; sockops is
//! attached to a cgroup of this process only. Then the redirected pair with
//! the latency monitor off, on (adaptive sampling, the default) and on
//! measuring every message, interleaved, with each program's bpf_stats per
//! run.
//!
//! `cargo bench -p meshwarp-benches --bench redirect` (as root).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_core::{Endpoint, EndpointPair, LatencySampling, LatencyScope};
use meshwarp_testbed::{KernelTest, NetNs};

const MSG: usize = 64;
const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
/// Turns per contender in the interleaved comparison.
const INTERLEAVED: usize = 21;

#[path = "common.rs"]
mod common;
use common::{bench_rtt, prog_cost, tcp_pair};
#[path = "interleave.rs"]
mod interleave;
use interleave::interleaved_medians;

/// Round trips per contender and turn in the interleaved comparisons.
const TURN: u32 = 20_000;

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
    // The ratios, from turns of the three in alternation.
    let (msg, mut buf) = ([0x42u8; MSG], [0u8; MSG]);
    let m = interleaved_medians(
        3,
        INTERLEAVED,
        TURN,
        |_| {},
        |i| {
            match i {
                0 => meshwarp_testbed::round_trip(&mut tcp, &msg, &mut buf),
                1 => meshwarp_testbed::round_trip(&mut fast, &msg, &mut buf),
                _ => meshwarp_testbed::round_trip(&mut unix, &msg, &mut buf),
            }
            .expect("round trip")
        },
    );
    eprintln!(
        "interleaved medians ({INTERLEAVED} turns of {TURN}): TCP {:.2} µs, redirected {:.2} µs ({:.3}x TCP), Unix {:.2} µs (redirected {:.3}x Unix)",
        m[0] / 1e3,
        m[1] / 1e3,
        m[1] / m[0],
        m[2] / 1e3,
        m[1] / m[2]
    );
    // The program's run time (bpf_stats) over 100 000 more round trips,
    // apart from the timed ones: bpf_stats reads the clock twice around
    // every program run (each system call's too, with the syscall watch),
    // which would add microseconds to the redirected round trip only.
    let stats_enabled = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
    let _ = std::fs::write(BPF_STATS, "1");
    let before = k.dp().sk_msg_prog_id().ok().and_then(prog_cost).unwrap_or_default();
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

/// The 64 B round trip of a registered pair with the latency monitor off,
/// on (adaptive sampling) and on for every message (its rule only),
/// interleaved twice; the per-run cost of every program on the way
/// (bpf_stats) in each.
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
    let modes = [("off", None), ("adaptive", Some(LatencySampling::Adaptive)), ("every", Some(LatencySampling::Every))];
    let switch = |mode: Option<LatencySampling>| {
        let mon = k.dp().latency();
        match mode {
            None => mon.set(&LatencyScope::Off, false),
            Some(s) => mon.set_sampling(s).and_then(|()| mon.set(&LatencyScope::Rules(BTreeSet::from([id])), false)),
        }
        .expect("switch the monitor");
    };

    // Timed without bpf_stats, which adds two clock reads to every program
    // run (and the monitor runs one program more).
    let mut g = c.benchmark_group("rtt_64B_monitor");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for round in 1..=2 {
        for (name, mode) in modes {
            switch(mode);
            bench_rtt::<_, MSG>(&mut g, &format!("monitor_{name}_{round}"), &mut fast);
        }
    }
    g.finish();
    // The ratios, from turns of the three modes in alternation on the
    // same connection.
    let (msg, mut buf) = ([0x42u8; MSG], [0u8; MSG]);
    let m = interleaved_medians(
        modes.len(),
        INTERLEAVED,
        TURN,
        |i| switch(modes[i].1),
        |_| meshwarp_testbed::round_trip(&mut fast, &msg, &mut buf).expect("round trip"),
    );
    eprintln!(
        "interleaved medians ({INTERLEAVED} turns of {TURN}): monitor off {:.2} µs, adaptive {:.2} µs ({:.3}x), every message {:.2} µs ({:.3}x)",
        m[0] / 1e3,
        m[1] / 1e3,
        m[1] / m[0],
        m[2] / 1e3,
        m[2] / m[0]
    );

    // Then each program's cost per run in each mode: 100 000 round trips each.
    let stats_enabled = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
    let _ = std::fs::write(BPF_STATS, "1");
    for (name, mode) in modes {
        switch(mode);
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
        eprintln!("monitor {name}: per run (bpf_stats) sk_msg {}, recv_len {}, lat_send {}", per(0), per(1), per(2));
    }
    let _ = std::fs::write(BPF_STATS, stats_enabled.trim());
    let hists = k.dp().latency().histograms(&BTreeSet::from([id])).expect("histograms");
    assert!(hists.iter().any(|h| h.count > 0), "the monitor recorded nothing");
}

criterion_group!(benches, rtt_64b, rtt_64b_monitor);
criterion_main!(benches);
