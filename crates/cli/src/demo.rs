//! `meshwarp demo`: an Istio-like request path on one node, built in network
//! namespaces, run without and then with meshwarp.
//!
//! ```text
//!  pod A                                   pod B
//!  app --VIP:80--> [OUTPUT REDIRECT]        [PREROUTING REDIRECT] --> sidecar B :15006
//!                  sidecar A :15001 --podB:80-->                      | from 127.0.0.6
//!                                                                      v
//!                                                                    app :8080 (echo)
//! ```
//! The demo starts an embedded node service and registers the acceleration
//! through its gRPC API, as a controller would: two capture rules (app ->
//! sidecar A, sidecar A -> sidecar B) and one mirror pair (127.0.0.6 -> app).
//! Everything it creates is removed at the end, also on Ctrl-C.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use meshwarp_core::DataplaneConfig;
use meshwarp_grpc_api::daemon::{self, DaemonOptions};
use meshwarp_grpc_api::pb;
use meshwarp_testbed::{
    echo_integrity, redirect_output, redirect_prerouting, round_trip, unique_name, CaptureProxy, NodeWithPods,
    ScratchDir, StreamEcho, TestCgroup, SERVICE_V4,
};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Requests per phase.
    #[arg(long, default_value_t = 5_000)]
    requests: usize,
    /// Request and response size in bytes.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Bytes each way of the checksummed integrity stream per phase.
    #[arg(long, default_value_t = 4 << 20)]
    integrity_bytes: usize,
}

const OWNER: &str = "meshwarp-demo";
const APP_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;

struct Phase {
    name: &'static str,
    lat: Vec<Duration>,
    wall: Duration,
    redirected_bytes: u64,
    veth_bytes: u64,
    integrity: Result<(), String>,
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

/// The demo's node service (in this process) and a controller's client of it;
/// the service stops and removes its data path on drop.
struct EmbeddedNode {
    // Field order: the client goes before the service it talks to.
    client: pb::node_service_client::NodeServiceClient<tonic::transport::Channel>,
    node: daemon::EmbeddedNode,
    // Last: removed once the service has stopped.
    _dir: ScratchDir,
}

impl EmbeddedNode {
    fn start(cgroup: PathBuf) -> Result<Self> {
        // Private (0700, unpredictable name): the daemon's socket lives here.
        let dir = ScratchDir::new("meshwarp-demo-")?;
        let opts = DaemonOptions {
            dataplane: DataplaneConfig {
                pin_root: PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-demo-"))),
                cgroup: Some(cgroup),
                ..DataplaneConfig::default()
            },
            socket: Some(dir.0.join("meshwarp.sock")),
            cleanup_on_exit: true,
            ..DaemonOptions::default()
        };
        let node = daemon::EmbeddedNode::start(opts).context("starting the embedded node service")?;
        let client = node.client()?;
        Ok(Self { client, node, _dir: dir })
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.node.runtime().block_on(f)
    }

    fn redirected_bytes(&mut self) -> Result<u64> {
        let mut c = self.client.clone();
        let st = self.block_on(c.get_stats(pb::GetStatsRequest {}))?.into_inner();
        let pairs = st.pairs.iter().filter_map(|p| p.counters).map(|c| c.redirected_bytes);
        let rules = st.capture_rules.iter().filter_map(|r| r.counters).map(|c| c.redirected_bytes);
        Ok(pairs.chain(rules).sum())
    }
}

fn ep(ip: IpAddr, port: u16) -> Option<pb::Endpoint> {
    Some(pb::Endpoint { ip: ip.to_string(), port: u32::from(port) })
}

/// What an Istio-aware controller would register for this request path.
fn register(node: &mut EmbeddedNode, pod_a: IpAddr, pod_b: IpAddr) -> Result<()> {
    let passthrough = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6));
    let outbound = pb::CaptureRule {
        client_ip: pod_a.to_string(),
        original_dst: ep(IpAddr::V4(SERVICE_V4), SERVICE_PORT),
        listener: ep(IpAddr::V4(Ipv4Addr::LOCALHOST), 15001),
        owner: String::new(),
        ..Default::default()
    };
    let sidecar_to_sidecar = pb::CaptureRule {
        client_ip: pod_a.to_string(),
        original_dst: ep(pod_b, SERVICE_PORT),
        listener: ep(pod_b, 15006),
        owner: String::new(),
        ..Default::default()
    };
    let inbound = pb::EndpointPair {
        client_ip: passthrough.to_string(),
        server: ep(pod_b, APP_PORT),
        owner: String::new(),
        ..Default::default()
    };
    let mut c = node.client.clone();
    node.block_on(async {
        c.batch_upsert_capture_rules(pb::BatchUpsertCaptureRulesRequest {
            rules: vec![outbound, sidecar_to_sidecar],
            owner: OWNER.into(),
        })
        .await?;
        c.create_pair(pb::CreatePairRequest { pair: Some(inbound), owner: OWNER.into() }).await?;
        Ok::<_, tonic::Status>(())
    })?;
    Ok(())
}

fn run_phase(
    name: &'static str,
    net: &NodeWithPods,
    node: &mut EmbeddedNode,
    args: &DemoArgs,
    stop: &AtomicBool,
) -> Result<Phase> {
    let service = SocketAddr::new(IpAddr::V4(SERVICE_V4), SERVICE_PORT);
    let app = &net.pods[0].ns;
    let bytes0 = node.redirected_bytes()?;
    let veth0 = net.veth_bytes(0)? + net.veth_bytes(1)?;
    let mut c: TcpStream = app.connect(service)?;
    c.set_nodelay(true)?;
    let msg = vec![0x5au8; args.size];
    let mut buf = vec![0u8; args.size];
    let mut lat = Vec::with_capacity(args.requests);
    let start = Instant::now();
    for i in 0..args.requests {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        let t = Instant::now();
        round_trip(&mut c, &msg, &mut buf).with_context(|| format!("request {i}"))?;
        lat.push(t.elapsed());
        if buf != msg {
            bail!("request {i}: the response differs from what was sent");
        }
        if i % 1000 == 999 {
            eprint!(".");
        }
    }
    let wall = start.elapsed();
    drop(c);
    eprintln!();
    let integrity = echo_integrity(app.connect(service)?, 7, args.integrity_bytes, Duration::from_secs(60))
        .map_err(|e| e.to_string());
    lat.sort();
    Ok(Phase {
        name,
        lat,
        wall,
        redirected_bytes: node.redirected_bytes()? - bytes0,
        veth_bytes: net.veth_bytes(0)? + net.veth_bytes(1)? - veth0,
        integrity,
    })
}

pub fn run(args: &DemoArgs) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the demo loads BPF programs and creates namespaces: run it as root");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = Arc::clone(&stop);
    ctrlc::set_handler(move || s2.store(true, Ordering::Relaxed)).context("installing the Ctrl-C handler")?;

    eprintln!("[1/5] building pods A and B on one node (netns + veth + bridge)...");
    let net = NodeWithPods::new(2)?;
    let (pod_a, pod_b) = (IpAddr::V4(net.pods[0].v4), IpAddr::V4(net.pods[1].v4));
    eprintln!("[2/5] sidecars: iptables capture to :15001 (pod A out) and :15006 (pod B in), app on :{APP_PORT}...");
    let cgroup = TestCgroup::new()?;
    let _app = StreamEcho::start(net.pods[1].ns.listen(SocketAddr::new(pod_b, APP_PORT))?)?;
    redirect_output(&net.pods[0].ns, IpAddr::V4(SERVICE_V4), SERVICE_PORT, 15001)?;
    redirect_prerouting(&net.pods[1].ns, pod_b, SERVICE_PORT, 15006)?;
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let _sidecar_a =
        CaptureProxy::start(&net.pods[0].ns, SocketAddr::new(loopback, 15001), SocketAddr::new(pod_b, SERVICE_PORT))?;
    let _sidecar_b = CaptureProxy::start_from(
        &net.pods[1].ns,
        SocketAddr::new(pod_b, 15006),
        SocketAddr::new(pod_b, APP_PORT),
        Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6))),
    )?;
    eprintln!("[3/5] starting the embedded node service (data path attached to {})...", cgroup.path.display());
    let mut node = EmbeddedNode::start(cgroup.path.clone())?;

    eprintln!("[4/5] {} requests of {} B without meshwarp", args.requests, args.size);
    let plain = run_phase("kernel path (no meshwarp)", &net, &mut node, args, &stop)?;
    eprintln!("      registering 2 capture rules and 1 pair through the gRPC API...");
    register(&mut node, pod_a, pod_b)?;
    // A node's programs are known after their first connection: the reader
    // guard accelerates a program once it has seen how it reads its sockets.
    eprintln!("      one warm-up connection: the reader guard sees how the app and sidecars read...");
    echo_integrity(
        net.pods[0].ns.connect(SocketAddr::new(IpAddr::V4(SERVICE_V4), SERVICE_PORT))?,
        3,
        4096,
        Duration::from_secs(10),
    )
    .context("warm-up connection")?;
    eprintln!("[4/5] {} requests of {} B with meshwarp", args.requests, args.size);
    let fast = run_phase("meshwarp (sk_msg redirect)", &net, &mut node, args, &stop)?;

    eprintln!("[5/5] cleaning up (node service and pins, sidecars, cgroup, namespaces)...");
    drop(node);
    drop(cgroup);
    print_table(&[plain, fast], args);
    Ok(())
}

fn print_table(phases: &[Phase], args: &DemoArgs) {
    println!();
    println!(
        "app -> sidecar A -> sidecar B -> app on one node; {} requests of {} B; integrity: {} B each way, checksummed",
        args.requests, args.size, args.integrity_bytes
    );
    println!(
        "{:<28} {:>9} {:>9} {:>9} {:>10} {:>16} {:>12}  integrity",
        "path", "p50 us", "p90 us", "p99 us", "req/s", "redirected B", "veth B"
    );
    for p in phases {
        println!(
            "{:<28} {:>9.1} {:>9.1} {:>9.1} {:>10.0} {:>16} {:>12}  {}",
            p.name,
            pct(&p.lat, 0.5).as_secs_f64() * 1e6,
            pct(&p.lat, 0.9).as_secs_f64() * 1e6,
            pct(&p.lat, 0.99).as_secs_f64() * 1e6,
            p.lat.len() as f64 / p.wall.as_secs_f64(),
            p.redirected_bytes,
            p.veth_bytes,
            match &p.integrity {
                Ok(()) => "verified".to_string(),
                Err(e) => format!("FAILED: {e}"),
            }
        );
    }
    if let [plain, fast] = phases {
        let r = pct(&fast.lat, 0.5).as_secs_f64() / pct(&plain.lat, 0.5).as_secs_f64();
        let t = (fast.lat.len() as f64 / fast.wall.as_secs_f64()) / (plain.lat.len() as f64 / plain.wall.as_secs_f64());
        println!("\nwith meshwarp: p50 latency {r:.2}x, requests/s {t:.2}x of the kernel path");
    }
}
