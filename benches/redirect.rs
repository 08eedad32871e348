//! 64 B request/response round trips, side by side in one run: plain loopback
//! TCP, the same with the endpoint pair registered (sk_msg redirect), and a
//! Unix socket pair. Loopback runs inside a namespace of its own; sockops is
//! attached to a cgroup of this process only.
//!
//! `cargo bench -p meshwarp-benches --bench redirect` (as root).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_core::testbed::{accept_timeout, round_trip, spawn_echo, KernelTest, NetNs};
use meshwarp_core::{Endpoint, EndpointPair};

const MSG: usize = 64;

fn tcp_pair(ns: &NetNs, addr: SocketAddr) -> TcpStream {
    let l = ns.listen(addr).expect("listen");
    let c = ns.connect(addr).expect("connect");
    let s = accept_timeout(&l, Duration::from_secs(5)).expect("accept");
    c.set_nodelay(true).expect("nodelay");
    s.set_nodelay(true).expect("nodelay");
    spawn_echo(s, MSG);
    c
}

fn bench_rtt<S: Read + Write>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    s: &mut S,
) {
    let msg = [0x42u8; MSG];
    let mut buf = [0u8; MSG];
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                round_trip(s, &msg, &mut buf).expect("round trip");
            }
            start.elapsed()
        })
    });
}

fn rtt_64b(c: &mut Criterion) {
    let Some(k) = KernelTest::start(1024) else {
        return;
    };
    let ns = NetNs::new("bench").expect("netns");
    let plain: SocketAddr = "127.0.0.1:9100".parse().expect("addr");
    let redirected: SocketAddr = "127.0.0.1:9101".parse().expect("addr");
    let pair = EndpointPair::new(redirected.ip(), Endpoint::from(redirected)).expect("pair");
    k.dp().insert_pair(&pair).expect("register pair");

    let mut tcp = tcp_pair(&ns, plain);
    let mut fast = tcp_pair(&ns, redirected);
    let (mut unix, peer) = UnixStream::pair().expect("unix pair");
    std::thread::spawn(move || {
        let mut peer = peer;
        let mut buf = [0u8; MSG];
        while peer.read_exact(&mut buf).is_ok() && peer.write_all(&buf).is_ok() {}
    });

    let mut g = c.benchmark_group("rtt_64B");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    // Interleave the three paths across repetitions: the machine is noisy.
    bench_rtt(&mut g, "loopback_tcp", &mut tcp);
    bench_rtt(&mut g, "sk_msg_redirect", &mut fast);
    bench_rtt(&mut g, "unix_socket", &mut unix);
    g.finish();

    let st = k.dp().pair_stats(&pair).expect("stats");
    assert!(
        st.redirected_msgs > 0,
        "the redirected path was not redirected: {st:?}"
    );
    eprintln!("pair counters after the run: {st:?}");
}

criterion_group!(benches, rtt_64b);
criterion_main!(benches);
