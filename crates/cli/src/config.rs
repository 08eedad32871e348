//! `meshwarp serve` configuration: a TOML file, overridden by flags and
//! `MESHWARP_*` environment variables.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use meshwarp_core::DataplaneConfig;
use meshwarp_grpc_api::daemon::{DaemonOptions, TlsFiles};
use meshwarp_grpc_api::server::ServerConfig;
use serde::Deserialize;

/// The config file. Unknown keys are errors, so a typo is never ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub socket: Option<PathBuf>,
    pub socket_group: Option<String>,
    /// Octal, as a string: "0660".
    pub socket_mode: Option<String>,
    pub tcp_listen: Option<SocketAddr>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub metrics_listen: Option<SocketAddr>,
    pub log_format: Option<LogFormat>,
    pub pin_root: Option<PathBuf>,
    pub cgroup: Option<PathBuf>,
    pub max_rules: Option<u32>,
    pub max_sockets: Option<u32>,
    pub max_batch_size: Option<usize>,
    pub drain_timeout_secs: Option<u64>,
    pub reader_guard: Option<ReaderGuard>,
    pub trusted_readers: Option<Vec<PathBuf>>,
    pub syscall_watch: Option<bool>,
}

/// `reader_guard`: see [`meshwarp_core::GuardMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ReaderGuard {
    /// On when the kernel probe finds a gap (splice, EAGAIN, FIONREAD, SO_RCVLOWAT).
    Auto,
    /// Every covered socket is a redirect target (you vouch for every reader).
    Off,
}

impl From<ReaderGuard> for meshwarp_core::GuardMode {
    fn from(g: ReaderGuard) -> Self {
        match g {
            ReaderGuard::Auto => Self::Auto,
            ReaderGuard::Off => Self::Off,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Flags of `meshwarp serve` (each also from its environment variable).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// TOML config file; flags and environment override it.
    #[arg(long, env = "MESHWARP_CONFIG")]
    pub config: Option<PathBuf>,
    /// Unix socket to serve on [default: /run/meshwarp/meshwarp.sock].
    #[arg(long, env = "MESHWARP_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Group that may use the socket besides root.
    #[arg(long, env = "MESHWARP_SOCKET_GROUP")]
    pub socket_group: Option<String>,
    /// Socket file mode, octal [default: 0660].
    #[arg(long, env = "MESHWARP_SOCKET_MODE")]
    pub socket_mode: Option<String>,
    /// Also serve gRPC on this TCP address (loopback only without mTLS).
    #[arg(long, env = "MESHWARP_TCP_LISTEN")]
    pub tcp_listen: Option<SocketAddr>,
    /// Server certificate (PEM) for mTLS on --tcp-listen.
    #[arg(long, env = "MESHWARP_TLS_CERT", requires_all = ["tls_key", "tls_client_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "MESHWARP_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// CA (PEM) that signs client certificates; clients must present one.
    #[arg(long, env = "MESHWARP_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve Prometheus /metrics on this address.
    #[arg(long, env = "MESHWARP_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    #[arg(long, env = "MESHWARP_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// cgroup v2 directory to attach sockops to [default: the cgroup2 root].
    #[arg(long, env = "MESHWARP_CGROUP")]
    pub cgroup: Option<PathBuf>,
    #[arg(long, env = "MESHWARP_MAX_RULES")]
    pub max_rules: Option<u32>,
    #[arg(long, env = "MESHWARP_MAX_SOCKETS")]
    pub max_sockets: Option<u32>,
    #[arg(long, env = "MESHWARP_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<usize>,
    /// Network namespace whose interfaces tc routes name (default: the daemon's own).
    #[arg(long, env = "MESHWARP_NETNS")]
    pub netns: Option<PathBuf>,
    /// On stop, also detach and unpin the data path (default: leave it forwarding).
    #[arg(long)]
    pub cleanup: bool,
    /// Which sockets may receive redirected bytes [default: auto].
    #[arg(long, env = "MESHWARP_READER_GUARD", value_enum)]
    pub reader_guard: Option<ReaderGuard>,
    /// An executable that never splices the sockets it reads (e.g. a proxy
    /// without splice options); repeatable.
    #[arg(long = "trust-reader", env = "MESHWARP_TRUSTED_READERS", value_delimiter = ',')]
    pub trusted_readers: Vec<PathBuf>,
    /// Do not watch splice()/FIONREAD at system call entry (saves ~50-130 ns
    /// per system call of the node; an unforeseen splicer can then lose bytes).
    #[arg(long, env = "MESHWARP_NO_SYSCALL_WATCH")]
    pub no_syscall_watch: bool,
}

pub fn read_file(path: &Path) -> Result<FileConfig> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))
}

fn parse_mode(s: &str) -> Result<u32> {
    let m = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .with_context(|| format!("socket mode {s:?} is not octal"))?;
    if m > 0o777 {
        bail!("socket mode {s:?} is more than 0777");
    }
    Ok(m)
}

/// Merges defaults < file < flags/environment.
pub fn resolve(args: &ServeArgs, pin_root: &Path) -> Result<(DaemonOptions, LogFormat)> {
    let file = match &args.config {
        Some(p) => read_file(p)?,
        None => FileConfig::default(),
    };
    let mut o = DaemonOptions::default();
    let dp_default = DataplaneConfig::default();
    o.dataplane = DataplaneConfig {
        pin_root: file.pin_root.clone().unwrap_or_else(|| pin_root.to_path_buf()),
        cgroup: args.cgroup.clone().or(file.cgroup),
        max_rules: args.max_rules.or(file.max_rules).unwrap_or(dp_default.max_rules),
        max_sockets: args.max_sockets.or(file.max_sockets).unwrap_or(dp_default.max_sockets),
        guard: args.reader_guard.or(file.reader_guard).map(Into::into).unwrap_or(dp_default.guard),
        trusted_readers: if args.trusted_readers.is_empty() {
            file.trusted_readers.clone().unwrap_or_default()
        } else {
            args.trusted_readers.clone()
        },
        syscall_watch: !args.no_syscall_watch && file.syscall_watch.unwrap_or(dp_default.syscall_watch),
    };
    o.server = ServerConfig {
        max_batch_size: args.max_batch_size.or(file.max_batch_size).unwrap_or(ServerConfig::default().max_batch_size),
        ..ServerConfig::default()
    };
    if let Some(s) = args.socket.clone().or(file.socket) {
        o.socket = Some(s);
    }
    o.socket_group = args.socket_group.clone().or(file.socket_group);
    if let Some(m) = args.socket_mode.as_deref().or(file.socket_mode.as_deref()) {
        o.socket_mode = parse_mode(m)?;
    }
    o.tcp_listen = args.tcp_listen.or(file.tcp_listen);
    let tls = (
        args.tls_cert.clone().or(file.tls_cert),
        args.tls_key.clone().or(file.tls_key),
        args.tls_client_ca.clone().or(file.tls_client_ca),
    );
    o.tls = match tls {
        (Some(cert), Some(key), Some(client_ca)) => Some(TlsFiles { cert, key, client_ca }),
        (None, None, None) => None,
        _ => bail!("mTLS needs all of tls_cert, tls_key and tls_client_ca"),
    };
    o.metrics_listen = args.metrics_listen.or(file.metrics_listen);
    o.cleanup_on_exit = args.cleanup;
    o.netns = args.netns.clone();
    if let Some(s) = file.drain_timeout_secs {
        o.drain_timeout = Duration::from_secs(s);
    }
    Ok((o, args.log_format.or(file.log_format).unwrap_or(LogFormat::Text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_values_and_unknown_keys() {
        let f: FileConfig =
            toml::from_str("socket = \"/tmp/x.sock\"\nsocket_mode = \"0600\"\nlog_format = \"json\"\n").unwrap();
        assert_eq!(f.socket.as_deref(), Some(Path::new("/tmp/x.sock")));
        assert_eq!(f.log_format, Some(LogFormat::Json));
        assert!(toml::from_str::<FileConfig>("sokcet = \"/tmp/x\"").is_err());
        assert!(toml::from_str::<FileConfig>("max_rules = \"many\"").is_err());
        assert!(toml::from_str::<FileConfig>("socket = [").is_err());
        let g: FileConfig =
            toml::from_str("reader_guard = \"off\"\ntrusted_readers = [\"/usr/sbin/haproxy\"]\n").unwrap();
        assert_eq!(g.reader_guard, Some(ReaderGuard::Off));
        assert_eq!(g.trusted_readers.unwrap(), vec![PathBuf::from("/usr/sbin/haproxy")]);
        assert!(toml::from_str::<FileConfig>("reader_guard = \"sometimes\"").is_err());
    }

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0660").unwrap(), 0o660);
        assert_eq!(parse_mode("0o600").unwrap(), 0o600);
        assert!(parse_mode("0999").is_err());
        assert!(parse_mode("7777").is_err());
    }
}
