//! `meshwarp`: load the socket-redirect data path, register endpoint pairs and
//! capture rules on the pinned instance, read counters, run the demo.

mod demo;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use meshwarp_core::dataplane::{remove_pinned, DEFAULT_PIN_ROOT};
use meshwarp_core::{
    CaptureRule, Dataplane, DataplaneConfig, Endpoint, EndpointPair, RuleCounters,
};

#[derive(Debug, Parser)]
#[command(
    name = "meshwarp",
    version,
    about = "Shorten service-mesh traffic paths in the kernel with eBPF"
)]
struct Cli {
    /// bpffs directory holding meshwarp's pins.
    #[arg(long, global = true, env = "MESHWARP_PIN_ROOT", default_value = DEFAULT_PIN_ROOT)]
    pin_root: PathBuf,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, global = true, env = "MESHWARP_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Load and pin the data path (or adopt the pinned one) and attach it.
    Load {
        /// cgroup v2 directory to attach sockops to (default: the cgroup2 root).
        #[arg(long)]
        cgroup: Option<PathBuf>,
        #[arg(long, default_value_t = 16384)]
        max_rules: u32,
        #[arg(long, default_value_t = 65536)]
        max_sockets: u32,
    },
    /// Mirror-pairing rules: connections CLIENT -> SERVER_IP:PORT.
    #[command(subcommand)]
    Pair(PairCmd),
    /// Capture-pairing rules: connections captured by iptables to a proxy.
    #[command(subcommand)]
    Capture(CaptureCmd),
    /// Node-wide counters.
    Stats,
    /// Detach and unpin everything meshwarp pinned under --pin-root.
    Uninstall,
    /// Two pods in namespaces: the same ping-pong without and with a registered pair.
    Demo(demo::DemoArgs),
}

#[derive(Debug, Subcommand)]
enum PairCmd {
    Add { client: IpAddr, server: SocketAddr },
    Rm { client: IpAddr, server: SocketAddr },
    Ls,
}

#[derive(Debug, Subcommand)]
enum CaptureCmd {
    Add {
        /// Original destination the application connects to.
        #[arg(long)]
        dst: SocketAddr,
        /// Where iptables delivers the captured connection (e.g. 127.0.0.1:15001).
        #[arg(long)]
        listener: SocketAddr,
        /// Only connections from this client address (default: any).
        #[arg(long)]
        client: Option<IpAddr>,
    },
    Rm {
        #[arg(long)]
        dst: SocketAddr,
        #[arg(long)]
        client: Option<IpAddr>,
        #[arg(long)]
        listener: SocketAddr,
    },
    Ls,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = DataplaneConfig {
        pin_root: cli.pin_root.clone(),
        ..DataplaneConfig::default()
    };
    let open = || Dataplane::open(&cfg).context("opening the data path (are you root?)");
    match cli.cmd {
        Cmd::Load {
            cgroup,
            max_rules,
            max_sockets,
        } => {
            let dp = Dataplane::open(&DataplaneConfig {
                cgroup,
                max_rules,
                max_sockets,
                ..cfg.clone()
            })?;
            println!("{:?} data path at {}", dp.origin(), dp.pin_dir().display());
        }
        Cmd::Pair(PairCmd::Add { client, server }) => {
            open()?.insert_pair(&EndpointPair::new(client, server.into())?, "cli")?;
        }
        Cmd::Pair(PairCmd::Rm { client, server }) => {
            open()?.remove_pair(&EndpointPair::new(client, server.into())?)?;
        }
        Cmd::Pair(PairCmd::Ls) => {
            let dp = open()?;
            println!(
                "{:<44} {:>8} {:>12} {:>14} {:>10}",
                "PAIR", "SOCKETS", "MSGS", "BYTES", "FALLBACKS"
            );
            for p in dp.pairs() {
                print_row(&p.to_string(), &dp.pair_stats(&p)?);
            }
        }
        Cmd::Capture(CaptureCmd::Add {
            dst,
            listener,
            client,
        }) => {
            open()?.insert_capture(
                &CaptureRule::new(client, dst.into(), Endpoint::from(listener))?,
                "cli",
            )?;
        }
        Cmd::Capture(CaptureCmd::Rm {
            dst,
            client,
            listener,
        }) => {
            open()?.remove_capture(&CaptureRule::new(
                client,
                dst.into(),
                Endpoint::from(listener),
            )?)?;
        }
        Cmd::Capture(CaptureCmd::Ls) => {
            let dp = open()?;
            println!(
                "{:<44} {:>8} {:>12} {:>14} {:>10}",
                "CAPTURE RULE", "SOCKETS", "MSGS", "BYTES", "FALLBACKS"
            );
            for r in dp.captures() {
                print_row(&r.to_string(), &dp.capture_stats(&r)?);
            }
        }
        Cmd::Stats => {
            let g = open()?.global_stats()?;
            println!(
                "established {}\nnot_covered {}\nno_state {}",
                g.established, g.not_covered, g.no_state
            );
        }
        Cmd::Uninstall => {
            remove_pinned(&cli.pin_root)?;
            println!("removed meshwarp's pins under {}", cli.pin_root.display());
        }
        Cmd::Demo(args) => demo::run(&args)?,
    }
    Ok(())
}

fn print_row(name: &str, c: &RuleCounters) {
    let fallbacks =
        c.fallback_no_peer + c.fallback_tcp_path + c.fallback_map_full + c.fallback_insert_error;
    println!(
        "{name:<44} {:>8} {:>12} {:>14} {:>10}",
        c.sockets, c.redirected_msgs, c.redirected_bytes, fallbacks
    );
}
