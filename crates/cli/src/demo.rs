//! `meshwarp demo`: two pods on a bridge in namespaces, the same 64 B
//! ping-pong without and with a registered endpoint pair, side by side.
//! Everything it creates (namespaces, cgroup, pins) is removed at the end,
//! also on Ctrl-C.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use meshwarp_core::testbed::{
    accept_timeout, round_trip, spawn_echo, unique_name, NodeWithPods, TestCgroup,
};
use meshwarp_core::{Dataplane, DataplaneConfig, Endpoint, EndpointPair, RuleCounters};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Round trips per phase.
    #[arg(long, default_value_t = 20_000)]
    iterations: usize,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
}

struct Phase {
    name: &'static str,
    lat: Vec<Duration>,
    wall: Duration,
    veth_bytes: u64,
    counters: Option<RuleCounters>,
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

pub fn run(args: &DemoArgs) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the demo loads BPF programs and creates namespaces: run it as root");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = Arc::clone(&stop);
    ctrlc::set_handler(move || s2.store(true, Ordering::Relaxed))
        .context("installing the Ctrl-C handler")?;

    eprintln!("[1/4] building a node with two pods (netns + veth + bridge)...");
    let net = NodeWithPods::new(2)?;
    let cgroup = TestCgroup::new()?;
    let cfg = DataplaneConfig {
        pin_root: PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-demo-"))),
        cgroup: Some(cgroup.path.clone()),
        ..DataplaneConfig::default()
    };
    eprintln!(
        "[2/4] loading the sockops + sk_msg data path into cgroup {}...",
        cgroup.path.display()
    );
    let dp = Dataplane::open(&cfg)?;
    let result = phases(&net, &dp, args, &stop);
    eprintln!("[4/4] cleaning up (pins, cgroup, namespaces)...");
    dp.teardown()?;
    drop(cgroup);
    drop(net);
    let phases = result?;
    print_table(&phases, args);
    Ok(())
}

fn phases(
    net: &NodeWithPods,
    dp: &Dataplane,
    args: &DemoArgs,
    stop: &AtomicBool,
) -> Result<Vec<Phase>> {
    let server = SocketAddr::new(net.pods[1].v4.into(), 8080);
    let listener = net.pods[1].ns.listen(server)?;
    let pair = EndpointPair::new(net.pods[0].v4.into(), Endpoint::from(server))?;
    let mut out = Vec::new();
    for (name, register) in [
        ("plain TCP (veth + bridge)", false),
        ("meshwarp sk_msg redirect", true),
    ] {
        if register {
            dp.insert_pair(&pair, "demo")?;
        }
        eprintln!(
            "[3/4] {name}: {} round trips of {} B...",
            args.iterations, args.size
        );
        let mut c: TcpStream = net.pods[0].ns.connect(server)?;
        c.set_nodelay(true)?;
        let s = accept_timeout(&listener, Duration::from_secs(5))?;
        s.set_nodelay(true)?;
        let echo = spawn_echo(s, args.size);
        let before = net.veth_bytes(0)?;
        let msg = vec![0x5au8; args.size];
        let mut buf = vec![0u8; args.size];
        let mut lat = Vec::with_capacity(args.iterations);
        let start = Instant::now();
        for i in 0..args.iterations {
            if stop.load(Ordering::Relaxed) {
                bail!("interrupted");
            }
            let t = Instant::now();
            round_trip(&mut c, &msg, &mut buf)?;
            lat.push(t.elapsed());
            if buf != msg {
                bail!("round trip {i}: echo differs from what was sent");
            }
        }
        let wall = start.elapsed();
        c.shutdown(std::net::Shutdown::Both)?;
        echo.join()
            .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
        let veth_bytes = net.veth_bytes(0)? - before;
        lat.sort();
        let counters = if register {
            Some(dp.pair_stats(&pair)?)
        } else {
            None
        };
        out.push(Phase {
            name,
            lat,
            wall,
            veth_bytes,
            counters,
        });
    }
    Ok(out)
}

fn print_table(phases: &[Phase], args: &DemoArgs) {
    println!();
    println!(
        "{} round trips of {} B, pod0 -> pod1 on one node (echo verified)",
        args.iterations, args.size
    );
    println!(
        "{:<28} {:>10} {:>10} {:>12} {:>14}",
        "path", "p50 (us)", "p99 (us)", "round trips/s", "veth bytes"
    );
    for p in phases {
        println!(
            "{:<28} {:>10.1} {:>10.1} {:>12.0} {:>14}",
            p.name,
            pct(&p.lat, 0.5).as_secs_f64() * 1e6,
            pct(&p.lat, 0.99).as_secs_f64() * 1e6,
            p.lat.len() as f64 / p.wall.as_secs_f64(),
            p.veth_bytes
        );
    }
    if let [plain, fast] = phases {
        let r = pct(&fast.lat, 0.5).as_secs_f64() / pct(&plain.lat, 0.5).as_secs_f64();
        println!("\np50 ratio redirect / plain TCP: {r:.2}x");
        if let Some(c) = fast.counters {
            println!(
                "pair counters: sockets {} redirected msgs {} bytes {} fallbacks (no peer {}, tcp path {}, map full {})",
                c.sockets,
                c.redirected_msgs,
                c.redirected_bytes,
                c.fallback_no_peer,
                c.fallback_tcp_path,
                c.fallback_map_full
            );
        }
    }
}
