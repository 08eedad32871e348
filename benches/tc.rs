//! Pod-to-pod request/response across two namespace "nodes" joined by vxlan,
//! side by side in one run: the bridge path (no meshwarp), Redirect +
//! RedirectPeer, and RedirectNeigh + RedirectPeer.
//!
//! `cargo bench -p meshwarp-benches --bench tc` (as root).

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use meshwarp_core::tc::{TcConfig, TcDataplane};
use meshwarp_testbed::{round_trip, unique_name, OverlayEgress, StreamEcho, TwoNodes};

const MSG: usize = 64;
const PORT: u16 = 8080;

fn tc_for(node: &meshwarp_testbed::NetNs) -> (TcDataplane, PathBuf) {
    let pin_root = PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-tcbench-")));
    let cfg = TcConfig { pin_root: pin_root.clone(), netns: Some(node.path()), max_routes: 64 };
    (TcDataplane::open(&cfg).expect("tc data path"), pin_root)
}

fn clear(tc: &TcDataplane) {
    for r in tc.routes() {
        tc.remove_route(r.attach_ifindex, r.route.direction, r.route.dst).expect("remove route");
    }
}

fn connect(net: &TwoNodes) -> TcpStream {
    let c = net.a.pods[0].ns.connect(SocketAddr::new(net.b.pods[0].v4.into(), PORT)).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    c
}

fn cross_node(c: &mut Criterion) {
    let net = TwoNodes::new(1).expect("two nodes");
    let _echo =
        StreamEcho::start(net.b.pods[0].ns.listen(SocketAddr::new(net.b.pods[0].v4.into(), PORT)).expect("listen"))
            .expect("echo");
    let ((tc_a, root_a), (tc_b, root_b)) = (tc_for(&net.a.node), tc_for(&net.b.node));
    let msg = [0x42u8; MSG];
    let mut buf = [0u8; MSG];
    let mut g = c.benchmark_group("tc_pod_to_pod_rr_64B");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for (name, egress) in [
        ("bridge", None),
        ("redirect+peer", Some(OverlayEgress::Redirect)),
        ("neigh+peer", Some(OverlayEgress::RedirectNeigh)),
    ] {
        clear(&tc_a);
        clear(&tc_b);
        if let Some(e) = egress {
            net.install_fast_path(&tc_a, &tc_b, false, e).expect("routes");
        }
        let mut s = connect(&net);
        let before = net.bridge_bytes().expect("bridge counters");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    round_trip(&mut s, &msg, &mut buf).expect("round trip");
                }
                t.elapsed()
            })
        });
        let crossed = net.bridge_bytes().expect("bridge counters") - before;
        eprintln!("{name}: {crossed} bytes crossed the bridges during the run");
    }
    g.finish();
    let _ = tc_a.teardown();
    let _ = tc_b.teardown();
    let _ = meshwarp_core::node::uninstall(&root_a);
    let _ = meshwarp_core::node::uninstall(&root_b);
}

criterion_group!(benches, cross_node);
criterion_main!(benches);
