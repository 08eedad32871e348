//! Control-path latency over the node service's Unix socket: unary
//! CreatePair, and BatchUpsertPairs of 10 000 pairs. The daemon runs in this
//! process (its own cgroup, pin root and socket), exactly as `meshwarp serve`.
//!
//! `cargo bench -p meshwarp-benches --bench grpc` (as root).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_core::DataplaneConfig;
use meshwarp_grpc_api::daemon::{self, DaemonOptions};
use meshwarp_grpc_api::pb;
use meshwarp_grpc_api::server::ServerConfig;
use meshwarp_testbed::{unique_name, TestCgroup};

const OWNER: &str = "bench";

/// Distinct pairs: client 10.x.y.z style addresses in the benchmarking range.
fn nth_pair(n: u32) -> pb::EndpointPair {
    let client = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + 1 + n / 60_000);
    pb::EndpointPair {
        client_ip: client.to_string(),
        server: Some(pb::Endpoint { ip: "198.19.0.1".into(), port: 1 + n % 60_000 }),
        ..Default::default()
    }
}

fn key_of(p: &pb::EndpointPair) -> pb::PairKey {
    pb::PairKey { client_ip: p.client_ip.clone(), server: p.server.clone() }
}

fn control_path(c: &mut Criterion) {
    let cgroup = TestCgroup::new().expect("cgroup v2");
    let dir = meshwarp_testbed::ScratchDir::new("meshwarp-bench-").expect("scratch dir");
    let socket = dir.path("meshwarp.sock");
    let pin_root = PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-bench-")));
    let opts = DaemonOptions {
        dataplane: DataplaneConfig {
            pin_root: pin_root.clone(),
            cgroup: Some(cgroup.path.clone()),
            max_rules: 131_072,
            max_sockets: 1024,
            ..DataplaneConfig::default()
        },
        server: ServerConfig { max_batch_size: 10_000, ..ServerConfig::default() },
        socket: Some(socket.clone()),
        cleanup_on_exit: true,
        ..DaemonOptions::default()
    };
    let node = daemon::EmbeddedNode::start(opts).expect("node service");
    // The client runs on a runtime of its own, as a controller process would.
    let crt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("client runtime");
    let mut client =
        crt.block_on(meshwarp_grpc_api::client::connect(socket.to_str().expect("utf-8"))).expect("connect");

    let mut g = c.benchmark_group("grpc_uds");
    g.sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(1));
    // The transport floor: an RPC that reads one empty filter result.
    g.bench_function("list_pairs_empty", |b| {
        b.iter_custom(|iters| {
            crt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    client
                        .list_pairs(pb::ListPairsRequest { owner: "nobody".into(), ..Default::default() })
                        .await
                        .expect("ListPairs");
                }
                t.elapsed()
            })
        })
    });
    let mut next = 0u32;
    g.bench_function("create_pair", |b| {
        b.iter_custom(|iters| {
            let mut made = Vec::with_capacity(iters as usize);
            let mut total = Duration::ZERO;
            crt.block_on(async {
                for _ in 0..iters {
                    let p = nth_pair(next);
                    next += 1;
                    let t = Instant::now();
                    client
                        .create_pair(pb::CreatePairRequest { pair: Some(p.clone()), owner: OWNER.into() })
                        .await
                        .expect("CreatePair");
                    total += t.elapsed();
                    made.push(key_of(&p));
                }
                for chunk in made.chunks(10_000) {
                    client
                        .batch_delete_pairs(pb::BatchDeletePairsRequest {
                            keys: chunk.to_vec(),
                            owner: OWNER.into(),
                            allow_missing: false,
                        })
                        .await
                        .expect("cleanup");
                }
            });
            total
        })
    });
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("batch_upsert_10k_pairs", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            crt.block_on(async {
                for _ in 0..iters {
                    let pairs: Vec<_> = (0..10_000).map(|i| nth_pair(next + i)).collect();
                    next += 10_000;
                    let keys: Vec<_> = pairs.iter().map(key_of).collect();
                    let t = Instant::now();
                    let r = client
                        .batch_upsert_pairs(pb::BatchUpsertPairsRequest { pairs, owner: OWNER.into() })
                        .await
                        .expect("BatchUpsertPairs")
                        .into_inner();
                    total += t.elapsed();
                    assert_eq!(r.created, 10_000);
                    client
                        .batch_delete_pairs(pb::BatchDeletePairsRequest {
                            keys,
                            owner: OWNER.into(),
                            allow_missing: false,
                        })
                        .await
                        .expect("cleanup");
                }
            });
            total
        })
    });
    g.finish();

    drop(node);
    drop(dir);
    let _ = meshwarp_core::node::uninstall(&pin_root);
}

criterion_group!(benches, control_path);
criterion_main!(benches);
