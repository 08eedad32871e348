//! `meshwarp`: the node daemon (`serve`), a gRPC client for everything a
//! controller or operator does (`pair`, `capture`, `stats`, `watch`, `node`)
//! and observes (`latency`, `conns`, `top`), `doctor`, `uninstall` and the
//! `demo`.

mod demo;
mod doctor;
mod live;
mod mesh;
mod remote;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use meshwarp_cli::config;
use meshwarp_cli::conns::ConnsFilterArgs;
use meshwarp_cli::latency::{MetricArg, RuleSelectorArgs, SamplingArg};
use meshwarp_core::dataplane::DEFAULT_PIN_ROOT;

#[derive(Debug, Parser)]
#[command(name = "meshwarp", version, about = "Shorten service-mesh traffic paths in the kernel with eBPF")]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// How to reach a node and show its answers: the flags of every command that
/// talks to a node (given anywhere after that command's name).
#[derive(Debug, Clone, clap::Args)]
pub struct RemoteArgs {
    /// Node service address: a Unix socket path or http(s)://HOST:PORT.
    #[arg(long, global = true, env = "MESHWARP_ADDR", default_value = meshwarp_grpc_api::client::DEFAULT_SOCKET)]
    addr: String,
    /// CA (PEM) of the node's certificate, for https:// addresses.
    #[arg(long, global = true, env = "MESHWARP_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for https:// addresses.
    #[arg(long = "tls-client-cert", id = "tls_cert", global = true, env = "MESHWARP_TLS_CLIENT_CERT")]
    tls_cert: Option<PathBuf>,
    /// Client key (PEM) for https:// addresses.
    #[arg(long = "tls-client-key", id = "tls_key", global = true, env = "MESHWARP_TLS_CLIENT_KEY")]
    tls_key: Option<PathBuf>,
    /// Owner recorded on what this command creates, checked on what it changes.
    #[arg(long, global = true, env = "MESHWARP_OWNER", default_value = "meshwarp-cli")]
    owner: String,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value = "table")]
    output: remote::Output,
    /// Same as `-o json`.
    #[arg(short = 'j', long = "json", global = true)]
    json: bool,
}

/// A command that talks to a node, with its subcommands.
#[derive(Debug, clap::Args)]
pub struct Remote<C: Subcommand> {
    #[command(flatten)]
    remote: RemoteArgs,
    #[command(subcommand)]
    cmd: C,
}

/// Where meshwarp's pins live: the flag of every command that works on this
/// node's pins.
#[derive(Debug, Clone, clap::Args)]
pub struct PinArgs {
    /// bpffs directory of meshwarp's pins [default: /sys/fs/bpf/meshwarp].
    #[arg(long, env = "MESHWARP_PIN_ROOT")]
    pin_root: Option<PathBuf>,
}

impl PinArgs {
    /// `--pin-root`, or the default.
    fn pin_root(&self) -> PathBuf {
        self.pin_root.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_PIN_ROOT))
    }
}

/// The log filter of a command that runs the data path itself.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "MESHWARP_LOG", default_value = "info")]
    log: String,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the node service: load or adopt the data path, serve gRPC.
    Serve {
        #[command(flatten)]
        pins: PinArgs,
        #[command(flatten)]
        log: LogArgs,
        #[command(flatten)]
        args: Box<config::ServeArgs>,
    },
    /// Mirror-pairing rules: connections CLIENT_IP -> SERVER_IP:PORT.
    Pair(Remote<PairCmd>),
    /// Capture-pairing rules: connections iptables captured to a proxy.
    Capture(Remote<CaptureCmd>),
    /// Interface routes (tc redirection across interfaces).
    Route(Remote<RouteCmd>),
    /// Attach meshwarp's tc program to an interface.
    Attach {
        #[command(flatten)]
        remote: RemoteArgs,
        /// Interface name, in the node's network namespace.
        iface: String,
        /// The egress hook (default: ingress).
        #[arg(long)]
        egress: bool,
    },
    /// Detach it.
    Detach {
        #[command(flatten)]
        remote: RemoteArgs,
        /// Interface name, in the node's network namespace.
        iface: String,
        /// The egress hook (default: ingress).
        #[arg(long)]
        egress: bool,
        /// Succeed when it is not attached.
        #[arg(long)]
        allow_missing: bool,
    },
    /// Interfaces the tc program is attached to, with packets and misses.
    Attachments {
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Plugins: verified eBPF programs in the data path's hook chains.
    Plugin(Remote<PluginCmd>),
    /// Counters: node-wide and per rule.
    Stats {
        #[command(flatten)]
        remote: RemoteArgs,
    },
    /// Stream changes as they happen.
    Watch {
        #[command(flatten)]
        remote: RemoteArgs,
        /// Resume after this revision (needs --instance).
        #[arg(long, default_value_t = 0, requires = "instance")]
        after: u64,
        /// The node instance the revision belongs to (from `node info` or an
        /// earlier watch); another instance answers OUT_OF_RANGE.
        #[arg(long, default_value = "")]
        instance: String,
    },
    /// About the node.
    Node(Remote<NodeCmd>),
    /// Latency monitor: per-rule histograms of fast-path and TCP delivery,
    /// connection setup, response, think time and proxy hops. Without a
    /// subcommand: `latency show`.
    Latency(LatencyArgs),
    /// Connections meshwarp holds state for: path per direction (fast or
    /// tcp:<reason>), process, traffic. Cookies in decimal; `ss -e` prints
    /// the same cookie in hex as `sk:` (--cookie takes 0x... and sk:... too).
    Conns {
        #[command(flatten)]
        remote: RemoteArgs,
        #[command(flatten)]
        filter: ConnsFilterArgs,
    },
    /// Live view per rule, busiest first: connections (how many fully
    /// fast), bytes/s on the fast path and TCP, messages/s, latency p50/p99.
    /// Refreshed in place until Ctrl-C.
    Top {
        #[command(flatten)]
        remote: RemoteArgs,
        /// Between two refreshes, in ms (at least 100).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(100..))]
        interval_ms: u32,
        /// Refresh this many times, then exit.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
    /// Check what this machine offers meshwarp and how to fix what is missing.
    Doctor {
        #[command(flatten)]
        pins: PinArgs,
    },
    /// Ask the node service's gRPC health service (grpc.health.v1) whether
    /// it serves: exit 0 if SERVING (a readiness probe), 1 otherwise.
    Health {
        /// Node service address: a Unix socket path or http(s)://HOST:PORT.
        #[arg(long, env = "MESHWARP_ADDR", default_value = meshwarp_grpc_api::client::DEFAULT_SOCKET)]
        addr: String,
        /// Give up after this many milliseconds.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
    /// Detach and unpin everything meshwarp pinned under --pin-root.
    Uninstall {
        #[command(flatten)]
        pins: PinArgs,
    },
    /// Two pods in namespaces: the same ping-pong without and with a registered pair.
    Demo {
        #[command(flatten)]
        log: LogArgs,
        #[command(flatten)]
        args: demo::DemoArgs,
    },
    /// Benchmarks that need the whole node (criterion benches are in benches/).
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Print shell completions.
    Completions {
        /// The shell to print them for.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
pub enum PairCmd {
    /// Create a pair (fails if it exists).
    Add {
        /// Client IP of the connections (the end that connects).
        client: IpAddr,
        /// Server IP:PORT they connect to ([IPv6]:PORT for IPv6).
        server: SocketAddr,
        #[command(flatten)]
        opts: RuleOptions,
    },
    /// Update a pair; with --allow-missing create it if absent.
    Update {
        /// Client IP of the connections (the end that connects).
        client: IpAddr,
        /// Server IP:PORT they connect to ([IPv6]:PORT for IPv6).
        server: SocketAddr,
        /// Create it when absent instead of failing.
        #[arg(long)]
        allow_missing: bool,
        #[command(flatten)]
        opts: RuleOptions,
    },
    /// Delete a pair.
    Rm {
        /// Client IP of the connections (the end that connects).
        client: IpAddr,
        /// Server IP:PORT they connect to ([IPv6]:PORT for IPv6).
        server: SocketAddr,
        /// Succeed when it does not exist.
        #[arg(long)]
        allow_missing: bool,
    },
    /// Show a pair and its counters.
    Get {
        /// Client IP of the connections (the end that connects).
        client: IpAddr,
        /// Server IP:PORT they connect to ([IPv6]:PORT for IPv6).
        server: SocketAddr,
    },
    /// List pairs.
    Ls {
        /// Only pairs of this owner.
        #[arg(long, default_value = "")]
        owned_by: String,
    },
}

/// An end of a covered connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RuleEndArg {
    /// The end that connected (capture: the application).
    Client,
    /// The end that accepted (capture: the proxy's accepted socket).
    Server,
}

/// How a rule's connections use the fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ModeArg {
    /// Per connection and direction: streams of writes that TCP coalesces
    /// (Nagle/cork; small ones, or up to 32 KiB into a reader that keeps
    /// up), or whose reader falls behind, move to TCP, and come back when
    /// safe.
    #[default]
    Adaptive,
    /// Redirect every message the reader guard allows.
    Always,
    /// Covered, but every connection stays on TCP.
    Never,
}

#[derive(Debug, Clone, clap::Args)]
pub struct RuleOptions {
    /// Never give this end redirected bytes (e.g. a proxy configured to
    /// splice); what it sends is still accelerated. Repeatable.
    #[arg(long = "never-redirect-into", value_enum)]
    pub ends: Vec<RuleEndArg>,
    /// How the rule's connections use the fast path.
    #[arg(long, value_enum, default_value_t)]
    pub mode: ModeArg,
}

#[derive(Debug, Subcommand)]
pub enum CaptureCmd {
    /// Create a capture rule.
    Add {
        /// Original destination the application connects to.
        #[arg(long)]
        dst: SocketAddr,
        /// Where iptables delivers the captured connection (e.g. 127.0.0.1:15001).
        #[arg(long)]
        listener: SocketAddr,
        /// Only connections from this client (default: any).
        #[arg(long)]
        client: Option<IpAddr>,
        #[command(flatten)]
        opts: RuleOptions,
    },
    /// Delete the capture rule of (client, dst).
    Rm {
        /// Original destination of the rule.
        #[arg(long)]
        dst: SocketAddr,
        /// The rule's client (default: the rule for any client).
        #[arg(long)]
        client: Option<IpAddr>,
        /// Succeed when it does not exist.
        #[arg(long)]
        allow_missing: bool,
    },
    /// List capture rules.
    Ls {
        /// Only rules of this owner.
        #[arg(long, default_value = "")]
        owned_by: String,
    },
}

/// Where a route is attached and what it matches.
#[derive(Debug, clap::Args)]
pub struct RouteAt {
    /// Interface whose tc hook holds the route.
    #[arg(long)]
    pub attach: String,
    /// The egress hook (default: ingress).
    #[arg(long)]
    pub egress: bool,
    /// Destination prefix, e.g. 198.18.2.0/24.
    #[arg(long)]
    pub dst: String,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum HookArg {
    Connection,
    Message,
    Packet,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum PhaseArg {
    Authn,
    Authz,
    Stats,
}

/// A plugin's configuration bytes, from one of three sources.
#[derive(Debug, clap::Args)]
#[group(multiple = false)]
pub struct ConfigArg {
    /// Read the config bytes from a file.
    #[arg(long)]
    pub config_file: Option<PathBuf>,
    /// Config bytes in hex, e.g. 901f.
    #[arg(long)]
    pub config_hex: Option<String>,
    /// Little-endian fields, e.g. "u32:2 u32:2 u64:1000000 u64:65536"
    /// (u8, u16, u32, u64).
    #[arg(long)]
    pub config_le: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum PluginCmd {
    /// Load a plugin object (built with meshwarp/plugin.h) into its hook's chain.
    Load {
        /// The BPF ELF object.
        object: PathBuf,
        /// The plugin's name, unique on the node.
        #[arg(long)]
        name: String,
        /// The hook whose chain it joins.
        #[arg(long, value_enum)]
        hook: HookArg,
        #[arg(long, default_value = "")]
        version: String,
        /// Where in the chain it runs (with --priority within the phase).
        #[arg(long, value_enum)]
        phase: Option<PhaseArg>,
        /// Within a phase, higher runs first.
        #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
        priority: i32,
        /// Decline/drop when the plugin cannot decide (default: continue).
        #[arg(long)]
        fail_closed: bool,
        /// The object's expected SHA-256 (hex).
        #[arg(long)]
        sha256: Option<String>,
        /// Replace the loaded plugin of this name atomically.
        #[arg(long)]
        replace: bool,
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Take a plugin out of its chain and unload it.
    Unload {
        /// The plugin's name.
        name: String,
        /// Succeed when it is not loaded.
        #[arg(long)]
        allow_missing: bool,
    },
    /// Loaded plugins in chain order, with their counters.
    Ls,
    /// Write the example plugin objects (port_allow, byte_sampler,
    /// rate_limit) into a directory, ready for `plugin load`.
    Examples {
        /// Directory to write them into (created if absent).
        dir: PathBuf,
    },
    /// Give a plugin new configuration bytes.
    Config {
        /// The plugin's name.
        name: String,
        #[command(flatten)]
        config: ConfigArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum RouteCmd {
    /// Create a route (or replace yours with --update).
    Add {
        #[command(flatten)]
        at: RouteAt,
        /// Source prefix the packet must also match.
        #[arg(long)]
        src: Option<String>,
        /// bpf_redirect out of this interface.
        #[arg(long, group = "action")]
        redirect: Option<String>,
        /// bpf_redirect_peer into this veth's peer (ingress only).
        #[arg(long, group = "action")]
        redirect_peer: Option<String>,
        /// bpf_redirect_neigh out of this interface.
        #[arg(long, group = "action")]
        redirect_neigh: Option<String>,
        /// Next hop for --redirect-neigh.
        #[arg(long)]
        next_hop: Option<IpAddr>,
        /// Rewrite the source MAC (with --dmac).
        #[arg(long, requires = "dmac")]
        smac: Option<String>,
        /// Rewrite the destination MAC (with --smac).
        #[arg(long, requires = "smac")]
        dmac: Option<String>,
        /// Upsert instead of create.
        #[arg(long)]
        update: bool,
    },
    /// Delete a route.
    Rm {
        #[command(flatten)]
        at: RouteAt,
        /// Succeed when it does not exist.
        #[arg(long)]
        allow_missing: bool,
    },
    /// Show a route and its counters.
    Get {
        #[command(flatten)]
        at: RouteAt,
    },
    /// List routes.
    Ls {
        /// Also routes that went stale (their interface disappeared).
        #[arg(long)]
        stale: bool,
    },
}

/// `meshwarp latency`: a subcommand, or the flags of `latency show` (the
/// connection flags go anywhere, as for every command that talks to a node).
#[derive(Debug, clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    #[command(subcommand)]
    cmd: Option<LatencyCmd>,
    #[command(flatten)]
    show: LatencyShowArgs,
}

/// What `latency show` (and `latency` alone) prints.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LatencyShowArgs {
    #[command(flatten)]
    rules: RuleSelectorArgs,
    /// Only this metric (default: every one). Repeatable.
    #[arg(long = "metric", value_name = "METRIC", value_enum)]
    metrics: Vec<MetricArg>,
    /// Also draw the histograms (and, with proxy hops, the per-hop
    /// breakdown) into this SVG file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

impl LatencyShowArgs {
    /// Whether any of its flags was given.
    fn given(&self) -> bool {
        !self.rules.is_empty() || !self.metrics.is_empty() || self.svg.is_some()
    }
}

#[derive(Debug, Subcommand)]
pub enum LatencyCmd {
    /// Switch the monitor on: for the rules named (replacing the previous
    /// set; NOT_FOUND for an unknown one), or for every rule, also those
    /// registered later.
    On {
        #[command(flatten)]
        rules: RuleSelectorArgs,
        /// Forget the histograms recorded so far (of the rules named, or all).
        #[arg(long)]
        reset: bool,
        /// Which messages to measure (node-wide; default: as it is, adaptive
        /// on a new node).
        #[arg(long, value_enum)]
        sampling: Option<SamplingArg>,
    },
    /// Switch the monitor off on every rule (one flag test per message left).
    Off {
        /// Also forget the histograms recorded so far.
        #[arg(long)]
        reset: bool,
    },
    /// The histograms: count, mean, p50/p90/p99, and the buckets drawn.
    Show(LatencyShowArgs),
    /// The histograms (cumulative) every interval, redrawn in place until Ctrl-C.
    Watch {
        #[command(flatten)]
        rules: RuleSelectorArgs,
        /// Only this metric (default: every one). Repeatable.
        #[arg(long = "metric", value_name = "METRIC", value_enum)]
        metrics: Vec<MetricArg>,
        /// Between two updates, in ms (at least 100).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(100..))]
        interval_ms: u32,
        /// Stop after this many updates.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// The end-to-end mesh benchmark: wrk -> haproxy sidecars (Istio-style capture) -> nginx,
    /// one node and two nodes, without and with meshwarp.
    Mesh(mesh::MeshArgs),
}

#[derive(Debug, Subcommand)]
enum NodeCmd {
    /// Versions, kernel features found, what is attached.
    Info,
}

fn init_logs(filter: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| "info".into());
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", remote::describe(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Serve { pins, log, args } => {
            let (opts, fmt) = config::resolve(args, pins.pin_root.as_deref())?;
            init_logs(&log.log, fmt == config::LogFormat::Json);
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async move {
                use tokio::signal::unix::{signal, SignalKind};
                // Registered before the daemon starts: a SIGTERM that arrives
                // while it comes up (its socket may already answer) must
                // stop it gracefully, not kill it.
                let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
                let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
                let shutdown = async move {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                };
                meshwarp_grpc_api::daemon::run(opts, shutdown).await.map_err(anyhow::Error::from)
            })?;
            Ok(())
        }
        Cmd::Doctor { pins } => {
            init_logs("warn", false);
            doctor::run(&pins.pin_root())
        }
        Cmd::Health { addr, timeout_ms } => {
            let rt = tokio::runtime::Runtime::new()?;
            let status = rt.block_on(async {
                tokio::time::timeout(std::time::Duration::from_millis(*timeout_ms), async {
                    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
                    let ch = meshwarp_grpc_api::client::channel(addr).await?;
                    let service = "meshwarp.node.v1alpha1.NodeService".to_string();
                    let r = HealthClient::new(ch).check(HealthCheckRequest { service }).await?.into_inner();
                    anyhow::Ok(r.status)
                })
                .await
                .context("no answer in time")?
            })?;
            let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
            anyhow::ensure!(status == serving, "the node service is not serving (health status {status})");
            println!("SERVING");
            Ok(())
        }
        Cmd::Uninstall { pins } => {
            // Refused while a daemon holds the pins: stop it first (or run it
            // with --cleanup).
            meshwarp_core::node::uninstall_unheld(&pins.pin_root())?;
            println!("removed meshwarp's pins under {}", pins.pin_root().display());
            Ok(())
        }
        Cmd::Demo { log, args } => {
            init_logs(&log.log, false);
            demo::run(args)
        }
        Cmd::Bench(BenchCmd::Mesh(args)) => {
            init_logs("warn", false);
            mesh::run(args)
        }
        Cmd::Plugin(Remote { cmd: PluginCmd::Examples { dir }, .. }) => write_example_plugins(dir),
        Cmd::Completions { shell } => {
            clap_complete::generate(*shell, &mut Cli::command(), "meshwarp", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Pair(Remote { remote, .. })
        | Cmd::Capture(Remote { remote, .. })
        | Cmd::Route(Remote { remote, .. })
        | Cmd::Attach { remote, .. }
        | Cmd::Detach { remote, .. }
        | Cmd::Attachments { remote }
        | Cmd::Plugin(Remote { remote, .. })
        | Cmd::Stats { remote }
        | Cmd::Watch { remote, .. }
        | Cmd::Node(Remote { remote, .. })
        | Cmd::Latency(LatencyArgs { remote, .. })
        | Cmd::Conns { remote, .. }
        | Cmd::Top { remote, .. } => {
            check_flags(&cli.cmd)?;
            init_logs("warn", false);
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(remote_cmd(remote, &cli.cmd))
        }
    }
}

/// Flags the parser accepts that make no sense together, refused before
/// connecting.
fn check_flags(cmd: &Cmd) -> Result<()> {
    match cmd {
        Cmd::Latency(LatencyArgs { cmd: Some(sub), show, .. }) if show.given() => {
            let name = match sub {
                LatencyCmd::On { .. } => "on",
                LatencyCmd::Off { .. } => "off",
                LatencyCmd::Show(_) => "show",
                LatencyCmd::Watch { .. } => "watch",
            };
            anyhow::bail!("--pair, --capture, --metric and --svg go after `latency {name}`")
        }
        Cmd::Top { remote, .. } if remote.json || remote.output != remote::Output::Table => {
            anyhow::bail!("top shows a table only; for JSON/YAML use `conns -o json` and `latency show -o json`")
        }
        _ => Ok(()),
    }
}

fn write_example_plugins(dir: &std::path::Path) -> Result<()> {
    use meshwarp_bpf::plugins;
    std::fs::create_dir_all(dir)?;
    for (name, bytes, hook) in [
        ("port_allow", plugins::PORT_ALLOW, "connection"),
        ("byte_sampler", plugins::BYTE_SAMPLER, "message"),
        ("rate_limit", plugins::RATE_LIMIT, "message"),
    ] {
        let path = dir.join(format!("{name}.bpf.o"));
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        println!("{}  (--hook {hook}; source: examples/plugins/{name}.bpf.c)", path.display());
    }
    Ok(())
}

async fn remote_cmd(args: &RemoteArgs, cmd: &Cmd) -> Result<()> {
    let tls = match (&args.tls_ca, &args.tls_cert, &args.tls_key) {
        (Some(ca), Some(cert), Some(key)) => Some(meshwarp_grpc_api::client::ClientTls {
            ca: std::fs::read(ca)?,
            cert: std::fs::read(cert)?,
            key: std::fs::read(key)?,
            domain: None,
        }),
        _ => None,
    };
    let output = if args.json { remote::Output::Json } else { args.output };
    let mut c = remote::Remote::connect(&args.addr, tls.as_ref(), &args.owner, output).await?;
    match cmd {
        Cmd::Pair(p) => c.pair(&p.cmd).await,
        Cmd::Capture(p) => c.capture(&p.cmd).await,
        Cmd::Route(r) => c.route(&r.cmd).await,
        Cmd::Attach { iface, egress, .. } => c.attach(iface, *egress).await,
        Cmd::Detach { iface, egress, allow_missing, .. } => c.detach(iface, *egress, *allow_missing).await,
        Cmd::Attachments { .. } => c.attachments().await,
        Cmd::Plugin(p) => c.plugin(&p.cmd).await,
        Cmd::Stats { .. } => c.stats().await,
        Cmd::Watch { after, instance, .. } => c.watch(*after, instance).await,
        Cmd::Node(Remote { cmd: NodeCmd::Info, .. }) => c.node_info().await,
        Cmd::Latency(l) => match &l.cmd {
            Some(LatencyCmd::On { rules, reset, sampling }) => {
                live::latency_set(&mut c, true, rules, *reset, *sampling).await
            }
            Some(LatencyCmd::Off { reset }) => {
                live::latency_set(&mut c, false, &RuleSelectorArgs::default(), *reset, None).await
            }
            Some(LatencyCmd::Show(show)) => {
                live::latency_show(&mut c, &show.rules, &show.metrics, show.svg.as_deref()).await
            }
            None => live::latency_show(&mut c, &l.show.rules, &l.show.metrics, l.show.svg.as_deref()).await,
            Some(LatencyCmd::Watch { rules, metrics, interval_ms, count }) => {
                live::latency_watch(&mut c, rules, metrics, *interval_ms, *count).await
            }
        },
        Cmd::Conns { filter, .. } => live::conns(&mut c, filter).await,
        Cmd::Top { interval_ms, count, .. } => live::top(&mut c, *interval_ms, *count).await,
        _ => Ok(()),
    }
}

#[cfg(test)]
mod cli_tests {
    use super::*;

    /// Every argument of every command says what it is, and a command shows
    /// only the flags that apply to it.
    #[test]
    fn every_argument_has_help_and_only_its_own_flags() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>, flags: &mut Vec<(String, Vec<String>)>) {
            let mut longs = Vec::new();
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
                longs.extend(a.get_long().map(String::from));
            }
            flags.push((path.to_string(), longs));
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing, flags);
            }
        }
        let mut cmd = Cli::command();
        cmd.build();
        let (mut missing, mut flags) = (Vec::new(), Vec::new());
        walk(&cmd, "meshwarp", &mut missing, &mut flags);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
        let has = |path: &str, flag: &str| flags.iter().any(|(p, f)| p == path && f.iter().any(|x| x == flag));
        assert!(
            has("meshwarp pair rm", "addr") && !has("meshwarp pair rm", "pin-root") && !has("meshwarp pair rm", "log")
        );
        assert!(
            has("meshwarp serve", "pin-root") && !has("meshwarp serve", "owner") && !has("meshwarp serve", "output")
        );
        assert!(!has("meshwarp serve", "tls-client-cert") && !has("meshwarp doctor", "addr"));
        assert!(has("meshwarp latency on", "pair") && has("meshwarp latency on", "owner"));
        assert!(has("meshwarp conns", "cookie") && has("meshwarp top", "addr") && !has("meshwarp top", "pin-root"));
    }

    /// `latency` alone is `latency show` with its flags; connection flags go
    /// before or after the subcommand; cookies in hex.
    #[test]
    fn latency_and_conns_command_lines() {
        let cli = Cli::try_parse_from(["meshwarp", "latency", "--metric", "hop", "--svg", "x.svg"]).unwrap();
        let Cmd::Latency(l) = &cli.cmd else { panic!("{cli:?}") };
        assert!(l.cmd.is_none() && l.show.metrics == [MetricArg::Hop] && l.show.svg.is_some());
        assert!(check_flags(&cli.cmd).is_ok());

        let cli =
            Cli::try_parse_from(["meshwarp", "latency", "--addr", "/x.sock", "on", "--pair", "10.0.0.1=10.0.0.2:80"])
                .unwrap();
        let Cmd::Latency(l) = &cli.cmd else { panic!("{cli:?}") };
        assert_eq!(l.remote.addr, "/x.sock");
        assert!(
            matches!(&l.cmd, Some(LatencyCmd::On { rules, reset: false, sampling: None }) if rules.pairs.len() == 1)
        );

        // Flags of `show` before another subcommand: refused, not ignored.
        let cli = Cli::try_parse_from(["meshwarp", "latency", "--svg", "x.svg", "off"]).unwrap();
        assert!(check_flags(&cli.cmd).is_err());

        let cli = Cli::try_parse_from(["meshwarp", "conns", "--cookie", "0x1f", "--path", "tcp"]).unwrap();
        let Cmd::Conns { filter, .. } = &cli.cmd else { panic!("{cli:?}") };
        assert_eq!(filter.cookie, Some(31));
        let top = Cli::try_parse_from(["meshwarp", "top", "-o", "json"]).unwrap();
        assert!(check_flags(&top.cmd).is_err());
        assert!(Cli::try_parse_from(["meshwarp", "top", "--interval-ms", "10"]).is_err());
    }
}
