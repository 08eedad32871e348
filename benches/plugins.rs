//! The cost of plugins on the accelerated path: 64 B request/response round
//! trips over a redirected pair with 0, 1 and 4 no-op on_message plugins in
//! the chain, side by side in one run (then 0 again, to see drift on this
//! noisy machine), with loopback TCP for scale. bpf_stats gives the sk_msg
//! program's run time per message, tail-called plugins included (the kernel
//! accounts a tail-call chain to its entry program).
//!
//! `cargo bench -p meshwarp-benches --bench plugins` (as root).

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_bpf::plugins::NOOP_MSG;
use meshwarp_core::{Endpoint, EndpointPair, Hook, PluginChain, PluginManifest};
use meshwarp_testbed::{KernelTest, NetNs};

const MSG: usize = 64;
const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

#[path = "common.rs"]
mod common;
use common::{bench_rtt, prog_cost, tcp_pair};

fn noop(name: &str) -> PluginManifest {
    PluginManifest::new(name, Hook::Message)
}

fn plugins_rtt(c: &mut Criterion) {
    let Some(k) = KernelTest::start(1024) else {
        return;
    };
    let chain = PluginChain::open(Some(k.dp()), None).expect("plugin chain");
    let ns = NetNs::new("bench").expect("netns");
    let plain: SocketAddr = "127.0.0.1:9200".parse().expect("addr");
    let redirected: SocketAddr = "127.0.0.1:9201".parse().expect("addr");
    let pair = EndpointPair::new(redirected.ip(), Endpoint::from(redirected)).expect("pair");
    k.dp().insert(&pair, "bench").expect("register pair");
    let mut tcp = tcp_pair(&ns, plain, MSG);
    let mut fast = tcp_pair(&ns, redirected, MSG);

    let stats_enabled = std::fs::read_to_string(BPF_STATS).unwrap_or_default();
    let _ = std::fs::write(BPF_STATS, "1");
    let mut g = c.benchmark_group("rtt_64B_plugins");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    bench_rtt::<_, MSG>(&mut g, "loopback_tcp", &mut tcp);
    // Two rounds of 0 -> 1 -> 4 plugins: drift shows as a difference between rounds.
    let entry = k.dp().sk_msg_prog_id().expect("sk_msg prog id");
    let mut costs = Vec::new();
    let mut list = Vec::new();
    let mut measure = |g: &mut criterion::BenchmarkGroup<'_, _>, name: String, fast: &mut TcpStream| {
        let (ns0, n0) = prog_cost(entry).unwrap_or_default();
        bench_rtt::<_, MSG>(g, &name, fast);
        let (ns1, n1) = prog_cost(entry).unwrap_or_default();
        costs.push((name, (ns1 - ns0) as f64 / (n1 - n0).max(1) as f64));
    };
    for round in ["a", "b"] {
        measure(&mut g, format!("redirect_0_plugins_{round}"), &mut fast);
        chain.load(&noop("noop-0"), NOOP_MSG, &[], false, "bench").expect("load");
        measure(&mut g, format!("redirect_1_plugin_{round}"), &mut fast);
        for i in 1..4 {
            chain.load(&noop(&format!("noop-{i}")), NOOP_MSG, &[], false, "bench").expect("load");
        }
        measure(&mut g, format!("redirect_4_plugins_{round}"), &mut fast);
        list = chain.list().expect("list");
        for i in 0..4 {
            chain.unload(&format!("noop-{i}"), None).expect("unload");
        }
    }
    g.finish();
    let _ = std::fs::write(BPF_STATS, stats_enabled.trim());

    let st = k.dp().stats(&pair).expect("stats");
    assert!(st.redirected_msgs > 0 && st.fallback_tcp_path == 0, "the path stayed redirected: {st:?}");
    assert!(list.iter().all(|p| p.counters.runs > 0), "every plugin ran: {list:?}");
    for (name, ns) in costs {
        eprintln!("{name}: sk_msg chain {ns:.0} ns per message (bpf_stats)");
    }
}

criterion_group!(benches, plugins_rtt);
criterion_main!(benches);
