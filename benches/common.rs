//! Helpers the request/response benches share (`#[path]`-included by each).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use meshwarp_testbed::{accept_timeout, round_trip, spawn_echo, NetNs};

/// A connected TCP pair in `ns` whose server end echoes `msg_len`-byte
/// messages; returns the client end.
pub fn tcp_pair(ns: &NetNs, addr: SocketAddr, msg_len: usize) -> TcpStream {
    let l = ns.listen(addr).expect("listen");
    let c = ns.connect(addr).expect("connect");
    let s = accept_timeout(&l, Duration::from_secs(5)).expect("accept");
    c.set_nodelay(true).expect("nodelay");
    s.set_nodelay(true).expect("nodelay");
    // Blocking round trips, as before the reader guard: this bench vouches
    // for its own reads (its KernelTest trusts it), and poll() would add a
    // system call per message to every path alike.
    c.set_nonblocking(false).expect("blocking");
    s.set_nonblocking(false).expect("blocking");
    spawn_echo(s, msg_len);
    c
}

/// One criterion function: round trips of `MSG` bytes over `s`.
pub fn bench_rtt<S: Read + Write + std::os::fd::AsFd, const MSG: usize>(
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

/// (run_time_ns, run_cnt) of a program, with bpf_stats enabled; a tail-call
/// chain counts towards its entry program.
pub fn prog_cost(id: u32) -> Option<(u64, u64)> {
    libbpf_rs::query::ProgInfoIter::default().find(|p| p.id == id).map(|p| (p.run_time_ns, p.run_cnt))
}
