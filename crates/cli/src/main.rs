//! `meshwarp`: the node daemon (`serve`), a gRPC client for everything a
//! controller or operator does (`pair`, `capture`, `stats`, `watch`, `node`),
//! `doctor`, `uninstall` and the `demo`.

mod demo;
mod doctor;
mod mesh;
mod remote;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use meshwarp_cli::config;
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
    /// Check what this machine offers meshwarp and how to fix what is missing.
    Doctor {
        #[command(flatten)]
        pins: PinArgs,
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
    /// Per connection and direction: streams of small writes that TCP
    /// coalesces (Nagle/cork), or whose reader falls behind, move to TCP,
    /// and come back when safe.
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
        | Cmd::Node(Remote { remote, .. }) => {
            init_logs("warn", false);
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(remote_cmd(remote, &cli.cmd))
        }
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
    }
}
