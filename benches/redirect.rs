//! 64 B request/response round trips, side by side in one run: plain loopback
//! TCP, the same with the endpoint pair registered (sk_msg redirect), and a
//! Unix socket pair. Loopback runs inside a namespace of its own; sockops is
//! attached to a cgroup of this process only.
//!
//! `cargo bench -p meshwarp-benches --bench redirect` (as root).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_core::{Endpoint, EndpointPair};
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
    // Per-program run time (bpf_stats) while the redirected path runs.
    let stats_enabled = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
    let _ = std::fs::write(BPF_STATS, "1");
    bench_rtt::<_, MSG>(&mut g, "sk_msg_redirect", &mut fast);
    let prog_cost = k.dp().sk_msg_prog_id().ok().and_then(prog_cost);
    let _ = std::fs::write(BPF_STATS, stats_enabled.trim());
    bench_rtt::<_, MSG>(&mut g, "unix_socket", &mut unix);
    g.finish();

    let st = k.dp().stats(&pair).expect("stats");
    assert!(st.redirected_msgs > 0, "the redirected path was not redirected: {st:?}");
    eprintln!("pair counters after the run: {st:?}");
    if let Some((ns, runs)) = prog_cost {
        eprintln!("sk_msg program: {:.0} ns per run over {runs} runs (bpf_stats)", ns as f64 / runs as f64);
    }
}

criterion_group!(benches, rtt_64b);
criterion_main!(benches);
