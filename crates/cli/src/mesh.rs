//! `meshwarp bench mesh`: the end-to-end mesh benchmark. An Istio-like request
//! path built in namespaces with real programs — wrk (client) -> haproxy
//! sidecar A (captured to 127.0.0.1:15001) -> haproxy sidecar B (captured to
//! pod_ip:15006, forwarding from 127.0.0.6) -> nginx (app) — on one node and
//! across two vxlan nodes, at several concurrencies, without and with
//! meshwarp interleaved A/B/A/B, with p50/p90/p99, requests/s and CPU per
//! request. Everything it starts and creates is removed at the end.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use meshwarp_core::tc::{TcConfig, TcDataplane};
use meshwarp_core::{CaptureRule, Dataplane, DataplaneConfig, Endpoint, EndpointPair};
use meshwarp_testbed::{
    redirect_output, redirect_prerouting, unique_name, NetNs, NodeWithPods, OverlayEgress, TestCgroup, TwoNodes,
    SERVICE_V4,
};

#[derive(Debug, clap::Args)]
pub struct MeshArgs {
    /// Seconds per wrk run.
    #[arg(long, default_value_t = 4)]
    duration: u64,
    /// Repetitions of each (plain, meshwarp) pair, interleaved.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Concurrencies (wrk connections).
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    concurrency: Vec<usize>,
    /// Only the one-node or the two-node topology.
    #[arg(long, value_enum)]
    only: Option<Topo>,
    /// Response body sizes (nginx serves a file of each; k and m suffixes are KiB and MiB).
    #[arg(long, value_delimiter = ',', default_value = "1k,1m,16m", value_parser = parse_size)]
    body: Vec<u64>,
}

/// `1k`, `16m`, `512`: a byte count.
fn parse_size(v: &str) -> Result<u64, String> {
    let v = v.trim().to_ascii_lowercase();
    let (num, mult) = match v.strip_suffix('k') {
        Some(n) => (n, 1u64 << 10),
        None => match v.strip_suffix('m') {
            Some(n) => (n, 1 << 20),
            None => (v.as_str(), 1),
        },
    };
    let n: u64 = num.parse().map_err(|_| format!("{v:?} is not a size like 1k or 16m"))?;
    n.checked_mul(mult).filter(|b| *b > 0).ok_or_else(|| format!("{v:?} is out of range"))
}

/// How a body size is shown and named: 1 KiB, 16 MiB.
fn show_size(b: u64) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Topo {
    OneNode,
    TwoNodes,
}

const OWNER: &str = "mesh-bench";
const APP_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;

/// A child process in a process group of its own; the whole group (nginx's
/// workers too) is killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

fn spawn_in(ns: &NetNs, what: &'static str, args: &[&str]) -> Result<Proc> {
    let child = Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {what} (make bench-mesh installs it)"))?;
    Ok(Proc(child))
}

/// Where `tool` is on PATH.
fn which(tool: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(tool)).find(|p| p.is_file())
}

fn need(tool: &str) -> Result<()> {
    if Command::new("sh").args(["-c", &format!("command -v {tool}")]).output()?.status.success() {
        Ok(())
    } else {
        bail!("{tool} is not installed: `make bench-mesh` installs nginx, haproxy and wrk")
    }
}

/// Writes the configs and the bodies (`<dir>/www/<size>`), and starts the
/// app and both sidecars.
fn start_mesh(dir: &Path, client_pod: &NetNs, server_pod: &NetNs, pod_b: IpAddr, bodies: &[u64]) -> Result<Vec<Proc>> {
    let www = dir.join("www");
    std::fs::create_dir_all(&www)?;
    for &b in bodies {
        std::fs::write(www.join(b.to_string()), vec![b'x'; usize::try_from(b)?])?;
    }
    let nginx = format!(
        "worker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\nevents {{ worker_connections 4096; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/cb; proxy_temp_path {d}/px; fastcgi_temp_path {d}/fc;\n \
         uwsgi_temp_path {d}/uw; scgi_temp_path {d}/sc;\n keepalive_requests 1000000;\n \
         server {{ listen {pod_b}:{APP_PORT}; location / {{ root {d}/www; }} }}\n}}\n",
        d = dir.display()
    );
    std::fs::write(dir.join("nginx.conf"), nginx)?;
    let haproxy = |listen: String, upstream: String, source: &str| {
        format!(
            "global\n maxconn 8192\ndefaults\n mode tcp\n timeout connect 5s\n timeout client 120s\n timeout server 120s\n\
             listen sidecar\n bind {listen}\n {source}\n server up {upstream}\n"
        )
    };
    std::fs::write(
        dir.join("sidecar-a.cfg"),
        haproxy("127.0.0.1:15001".into(), format!("{pod_b}:{SERVICE_PORT}"), ""),
    )?;
    std::fs::write(
        dir.join("sidecar-b.cfg"),
        haproxy(format!("{pod_b}:15006"), format!("{pod_b}:{APP_PORT}"), "source 127.0.0.6"),
    )?;
    let p = |n: &str| dir.join(n).display().to_string();
    let procs = vec![
        spawn_in(server_pod, "nginx", &["nginx", "-c", &p("nginx.conf"), "-g", "daemon off;"])?,
        spawn_in(server_pod, "haproxy", &["haproxy", "-db", "-f", &p("sidecar-b.cfg")])?,
        spawn_in(client_pod, "haproxy", &["haproxy", "-db", "-f", &p("sidecar-a.cfg")])?,
    ];
    std::thread::sleep(Duration::from_millis(500));
    Ok(procs)
}

/// One wrk run's results.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    p50: f64,
    p90: f64,
    p99: f64,
    rps: f64,
    cpu_us_per_req: f64,
}

fn parse_latency(v: &str) -> Option<f64> {
    let (num, unit) = v.trim().split_at(v.trim().find(|c: char| c.is_alphabetic())?);
    let n: f64 = num.parse().ok()?;
    Some(match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        _ => return None,
    })
}

/// Machine-wide busy CPU time in microseconds (user+nice+system+irq+softirq).
fn busy_cpu_us() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat")?;
    let v: Vec<f64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let ticks = v.first().copied().unwrap_or(0.0)
        + v.get(1).copied().unwrap_or(0.0)
        + v.get(2).copied().unwrap_or(0.0)
        + v.get(5).copied().unwrap_or(0.0)
        + v.get(6).copied().unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz * 1e6)
}

/// wrk's per-request timeout (its own default is 2 s): all `conns` bodies at
/// once at 100 MB/s, far below either path here, so a slow transfer is not
/// taken for a lost one (16 MiB at 100 connections takes about 3.5 s on the
/// plain path of a 2-core VM), while a hung connection still is.
fn wrk_timeout_secs(conns: usize, body: u64) -> u64 {
    (conns as u64 * body).div_ceil(100_000_000).max(2)
}

fn wrk(client_pod: &NetNs, conns: usize, secs: u64, body: u64) -> Result<Run> {
    let url = format!("http://{SERVICE_V4}:{SERVICE_PORT}/{body}");
    let cpu0 = busy_cpu_us()?;
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            client_pod.name(),
            "wrk",
            "-t1",
            &format!("-c{conns}"),
            &format!("-d{secs}s"),
            "--timeout",
            &format!("{}s", wrk_timeout_secs(conns, body)),
            "--latency",
            &url,
        ])
        .output()
        .context("running wrk")?;
    let cpu = busy_cpu_us()? - cpu0;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.contains("Socket errors") || text.contains("Non-2xx") {
        bail!("wrk reported errors:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    }
    let mut run = Run::default();
    let mut requests = 0.0;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["50%", v] => run.p50 = parse_latency(v).unwrap_or(0.0),
            ["90%", v] => run.p90 = parse_latency(v).unwrap_or(0.0),
            ["99%", v] => run.p99 = parse_latency(v).unwrap_or(0.0),
            ["Requests/sec:", v] => run.rps = v.parse().unwrap_or(0.0),
            [n, "requests", "in", ..] => requests = n.parse().unwrap_or(0.0),
            _ => {}
        }
    }
    if requests == 0.0 || run.p50 == 0.0 {
        bail!("could not read wrk's output:\n{text}");
    }
    run.cpu_us_per_req = cpu / requests;
    Ok(run)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// What acceleration means for one topology: turn it on and off.
trait Accel {
    fn enable(&self) -> Result<()>;
    fn disable(&self) -> Result<()>;
}

struct SocketRules<'a> {
    dp: &'a Dataplane,
    pairs: Vec<EndpointPair>,
    captures: Vec<CaptureRule>,
}

impl Accel for SocketRules<'_> {
    fn enable(&self) -> Result<()> {
        self.dp.registry().batch_upsert(&self.pairs, OWNER)?;
        self.dp.registry().batch_upsert(&self.captures, OWNER)?;
        Ok(())
    }
    fn disable(&self) -> Result<()> {
        self.dp.registry().batch_remove(&self.pairs, OWNER, true)?;
        self.dp.registry().batch_remove(&self.captures, OWNER, true)?;
        Ok(())
    }
}

struct WithTc<'a> {
    sockets: SocketRules<'a>,
    net: &'a TwoNodes,
    tc: [&'a TcDataplane; 2],
}

impl Accel for WithTc<'_> {
    fn enable(&self) -> Result<()> {
        self.sockets.enable()?;
        self.net.install_fast_path(self.tc[0], self.tc[1], false, OverlayEgress::Redirect)?;
        Ok(())
    }
    fn disable(&self) -> Result<()> {
        self.sockets.disable()?;
        for tc in self.tc {
            for r in tc.routes() {
                tc.remove_route(r.attach_ifindex, r.route.direction, r.route.dst)?;
            }
        }
        Ok(())
    }
}

/// Rules for the socket hops on the path (all on the node of each pod).
fn socket_rules(dp: &Dataplane, pod_a: IpAddr, pod_b: IpAddr, cross_node: bool) -> Result<SocketRules<'_>> {
    let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let mut captures = vec![CaptureRule::new(
        Some(pod_a),
        Endpoint::new(IpAddr::V4(SERVICE_V4), SERVICE_PORT),
        Endpoint::new(lo, 15001),
    )?];
    if !cross_node {
        // Sidecar to sidecar on one node: the inbound capture pairs them.
        captures.push(CaptureRule::new(Some(pod_a), Endpoint::new(pod_b, SERVICE_PORT), Endpoint::new(pod_b, 15006))?);
    }
    let pairs = vec![EndpointPair::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6)), Endpoint::new(pod_b, APP_PORT))?];
    Ok(SocketRules { dp, pairs, captures })
}

struct Row {
    topo: &'static str,
    body: u64,
    conns: usize,
    plain: Run,
    fast: Run,
}

fn measure(
    topo: &'static str,
    client_pod: &NetNs,
    accel: &dyn Accel,
    args: &MeshArgs,
    rows: &mut Vec<Row>,
) -> Result<()> {
    for (&body, &c) in args.body.iter().flat_map(|b| args.concurrency.iter().map(move |c| (b, c))) {
        let (mut plain, mut fast) = (Vec::new(), Vec::new());
        for rep in 0..args.repeat {
            eprintln!("  {topo} body={} c={c} repetition {}/{}", show_size(body), rep + 1, args.repeat);
            let cell = |path: &str| format!("{topo}, {path} path, body {}, {c} connections", show_size(body));
            accel.disable()?;
            plain.push(wrk(client_pod, c, args.duration, body).with_context(|| cell("plain"))?);
            accel.enable()?;
            fast.push(wrk(client_pod, c, args.duration, body).with_context(|| cell("meshwarp"))?);
        }
        accel.disable()?;
        let med = |runs: &[Run]| Run {
            p50: median(runs.iter().map(|r| r.p50).collect()),
            p90: median(runs.iter().map(|r| r.p90).collect()),
            p99: median(runs.iter().map(|r| r.p99).collect()),
            rps: median(runs.iter().map(|r| r.rps).collect()),
            cpu_us_per_req: median(runs.iter().map(|r| r.cpu_us_per_req).collect()),
        };
        rows.push(Row { topo, body, conns: c, plain: med(&plain), fast: med(&fast) });
    }
    Ok(())
}

pub fn run(args: &MeshArgs) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the mesh benchmark loads BPF programs and creates namespaces: run it as root");
    }
    for tool in ["nginx", "haproxy", "wrk", "iptables"] {
        need(tool)?;
    }
    // An unpredictable name root creates itself (nothing can be planted
    // there first), readable by the proxies' own users (nginx's workers read
    // the bodies they serve from it).
    let dir = meshwarp_testbed::ScratchDir::new("meshwarp-mesh-")?;
    std::fs::set_permissions(&dir.0, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let rows = run_in(args, &dir.0)?;
    print!("{}", table(&rows, args));
    Ok(())
}

fn run_in(args: &MeshArgs, dir: &Path) -> Result<Vec<Row>> {
    let cgroup = TestCgroup::new()?;
    let pin_root = PathBuf::from(format!("/sys/fs/bpf/{}", unique_name("meshwarp-mesh-")));
    // The sidecars' haproxy configuration has no splice option: the bench
    // vouches for it, as an operator would (haproxy imports splice, so the
    // reader guard would otherwise keep its sockets off the redirect path).
    let dp = Dataplane::open(&DataplaneConfig {
        pin_root: pin_root.clone(),
        cgroup: Some(cgroup.path.clone()),
        trusted_readers: which("haproxy").into_iter().collect(),
        ..Default::default()
    })?;
    let mut rows = Vec::new();
    let result = (|| -> Result<()> {
        if args.only != Some(Topo::TwoNodes) {
            eprintln!("[one node] pods A and B on one bridge");
            let net = NodeWithPods::new(2)?;
            let (a, b) = (&net.pods[0], &net.pods[1]);
            let (pod_a, pod_b) = (IpAddr::V4(a.v4), IpAddr::V4(b.v4));
            redirect_output(&a.ns, IpAddr::V4(SERVICE_V4), SERVICE_PORT, 15001)?;
            redirect_prerouting(&b.ns, pod_b, SERVICE_PORT, 15006)?;
            let _procs = start_mesh(dir, &a.ns, &b.ns, pod_b, &args.body)?;
            let accel = socket_rules(&dp, pod_a, pod_b, false)?;
            measure("one node", &a.ns, &accel, args, &mut rows)?;
        }
        if args.only != Some(Topo::OneNode) {
            eprintln!("[two nodes] pod A on node A, pod B on node B, vxlan overlay");
            let net = TwoNodes::new(1)?;
            let (a, b) = (&net.a.pods[0], &net.b.pods[0]);
            let (pod_a, pod_b) = (IpAddr::V4(a.v4), IpAddr::V4(b.v4));
            redirect_output(&a.ns, IpAddr::V4(SERVICE_V4), SERVICE_PORT, 15001)?;
            redirect_prerouting(&b.ns, pod_b, SERVICE_PORT, 15006)?;
            let _procs = start_mesh(dir, &a.ns, &b.ns, pod_b, &args.body)?;
            let tc_cfg =
                |ns: &NetNs, n: &str| TcConfig { pin_root: pin_root.join(n), netns: Some(ns.path()), max_routes: 64 };
            let tc_a = TcDataplane::open(&tc_cfg(&net.a.node, "a"))?;
            let tc_b = TcDataplane::open(&tc_cfg(&net.b.node, "b"))?;
            let accel = WithTc { sockets: socket_rules(&dp, pod_a, pod_b, true)?, net: &net, tc: [&tc_a, &tc_b] };
            let r = measure("two nodes", &a.ns, &accel, args, &mut rows);
            let _ = tc_a.teardown();
            let _ = tc_b.teardown();
            r?;
        }
        Ok(())
    })();
    dp.teardown()?;
    for n in ["a", "b"] {
        let _ = meshwarp_core::node::uninstall(&pin_root.join(n));
    }
    let _ = std::fs::remove_dir(&pin_root);
    drop(cgroup);
    result.map(|()| rows)
}

fn table(rows: &[Row], args: &MeshArgs) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nwrk -> haproxy (15001) -> haproxy (15006) -> nginx (static file); {} s runs, medians of {} interleaved repetitions",
        args.duration, args.repeat
    );
    let _ = writeln!(
        s,
        "| topology | body | conns | path | p50 us | p90 us | p99 us | req/s | CPU us/req | p50 ratio | req/s ratio |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        for (name, x) in [("plain", r.plain), ("meshwarp", r.fast)] {
            let (lat, tput) = if name == "plain" {
                (String::from("1.00"), String::from("1.00"))
            } else {
                (format!("{:.2}", x.p50 / r.plain.p50), format!("{:.2}", x.rps / r.plain.rps))
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {lat} | {tput} |",
                r.topo,
                show_size(r.body),
                r.conns,
                x.p50,
                x.p90,
                x.p99,
                x.rps,
                x.cpu_us_per_req
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_latencies() {
        assert_eq!(parse_latency("123.45us"), Some(123.45));
        assert_eq!(parse_latency("1.50ms"), Some(1500.0));
        assert_eq!(parse_latency("2.00s"), Some(2_000_000.0));
        assert_eq!(parse_latency("abc"), None);
    }

    #[test]
    fn body_sizes() {
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(wrk_timeout_secs(1, 1 << 10), 2);
        assert_eq!(wrk_timeout_secs(100, 16 << 20), 17);
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("0").is_err() && parse_size("big").is_err());
        assert_eq!(show_size(16 << 20), "16 MiB");
        assert_eq!(show_size(1024), "1 KiB");
    }
}
