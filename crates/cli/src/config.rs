//! `meshwarp serve` configuration, layered by figment: built-in defaults <
//! the TOML file (`--config`) < `MESHWARP_*` environment variables < flags
//! (clap reads a flag or, when absent, its variable). Every setting of the
//! daemon has a key in the file and a flag (`--log`, the log filter, is a
//! flag only); the switches `--cleanup`, `--no-syscall-watch` and
//! `--no-guard-realtime` only turn their setting one way, over whatever the
//! file says.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use meshwarp_core::dataplane::DEFAULT_PIN_ROOT;
use meshwarp_core::DataplaneConfig;
use meshwarp_grpc_api::access::{Grant, OwnerPatterns, Principal};
use meshwarp_grpc_api::daemon::{DaemonOptions, TlsFiles};
use meshwarp_grpc_api::server::ServerConfig;
use serde::{Deserialize, Serialize};

/// A configuration the daemon cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid {what}: {source}")]
    Invalid {
        what: String,
        #[source]
        source: Box<figment::Error>,
    },
    #[error("[[allow]]: {0}")]
    Allow(String),
    #[error("socket mode {0:?} is not an octal mode of at most 0777")]
    SocketMode(String),
    #[error("mTLS needs all of tls_cert, tls_key and tls_client_ca")]
    PartialTls,
}

type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// One layer of settings: the config file, or the flags and environment.
/// Unknown keys in the file are errors, so a typo is never ignored; absent
/// settings fall through to the layer below.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_group: Option<String>,
    /// Octal, as a string: "0660".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_listen: Option<SocketAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin_root: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rules: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_sockets: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_size: Option<usize>,
    /// Events kept for Watch resumption (never fewer than max_batch_size).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_history: Option<usize>,
    /// Largest request message, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_message_bytes: Option<usize>,
    /// Largest plugin object, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_plugin_bytes: Option<usize>,
    /// Watch streams open at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_watchers: Option<usize>,
    /// Watch streams one caller (one identity) may hold open at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_watchers_per_caller: Option<usize>,
    /// Concurrent HTTP/2 streams per connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent_streams: Option<u32>,
    /// Seconds a unary RPC may take.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_timeout_secs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain_timeout_secs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reader_guard: Option<ReaderGuard>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_readers: Option<Vec<PathBuf>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub syscall_watch: Option<bool>,
    /// The guard thread at SCHED_FIFO while it waits and serves unlinks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guard_realtime: Option<bool>,
    /// Network namespace (path) whose interfaces tc routes name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    /// On stop, also detach and unpin the data path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cleanup: Option<bool>,
    /// Who may call besides root and the daemon's user (`[[allow]]` tables).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<Allow>>,
}

/// One `[[allow]]` table: a principal (exactly one of `user`, `uid`,
/// `group`, `gid`, `cert`) and what it may do.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Allow {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// A name of the client certificate and its field: `cn:NAME`, `dns:NAME`
    /// or `uri:NAME` (e.g. a SPIFFE ID).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<String>,
    /// Owners it may act as: names, or prefixes ending in `*` ("*": any).
    #[serde(default)]
    pub owners: Vec<String>,
    /// May load/unload/configure plugins and attach/detach interfaces.
    #[serde(default)]
    pub node_admin: bool,
}

impl Allow {
    fn grant(&self) -> Result<Grant> {
        let who = match (&self.user, self.uid, &self.group, self.gid, &self.cert) {
            (Some(u), None, None, None, None) => match nix::unistd::User::from_name(u) {
                Ok(Some(u)) => Principal::Uid(u.uid.as_raw()),
                _ => return Err(ConfigError::Allow(format!("unknown user {u:?}"))),
            },
            (None, Some(uid), None, None, None) => Principal::Uid(uid),
            (None, None, Some(g), None, None) => match nix::unistd::Group::from_name(g) {
                Ok(Some(g)) => Principal::Gid(g.gid.as_raw()),
                _ => return Err(ConfigError::Allow(format!("unknown group {g:?}"))),
            },
            (None, None, None, Some(gid), None) => Principal::Gid(gid),
            (None, None, None, None, Some(c)) => Principal::Cert(c.parse().map_err(ConfigError::Allow)?),
            _ => return Err(ConfigError::Allow("name exactly one of user, uid, group, gid or cert".into())),
        };
        Ok(Grant { who, owners: OwnerPatterns(self.owners.clone()), node_admin: self.node_admin })
    }
}

/// `reader_guard`: see [`meshwarp_core::GuardMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
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
    #[arg(long, env = "MESHWARP_TLS_CERT")]
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
    /// Log format.
    #[arg(long, env = "MESHWARP_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// cgroup v2 directory to attach sockops to [default: the cgroup2 root].
    #[arg(long, env = "MESHWARP_CGROUP")]
    pub cgroup: Option<PathBuf>,
    /// Most rules (pairs and captures) the data path holds [default: 4096].
    #[arg(long, env = "MESHWARP_MAX_RULES")]
    pub max_rules: Option<u32>,
    /// Most accelerated sockets (two per connection) [default: 65536].
    #[arg(long, env = "MESHWARP_MAX_SOCKETS")]
    pub max_sockets: Option<u32>,
    /// Most rules one batch RPC may carry [default: 10000].
    #[arg(long, env = "MESHWARP_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<usize>,
    /// Seconds in-flight RPCs get to finish on SIGTERM [default: 10].
    #[arg(long = "drain-timeout", env = "MESHWARP_DRAIN_TIMEOUT")]
    pub drain_timeout_secs: Option<u64>,
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
    /// Do not watch splice()/FIONREAD/send(MSG_OOB) at system call entry
    /// (saves ~50-130 ns per system call of the node; an unforeseen splicer
    /// can then lose bytes, and urgent data arrives in-band).
    #[arg(long, env = "MESHWARP_NO_SYSCALL_WATCH")]
    pub no_syscall_watch: bool,
    /// Run the guard thread at normal priority (default: SCHED_FIFO 1 while
    /// it waits for and serves unlink requests; walks and classifications
    /// are normal priority either way). Demoted connections may then wait
    /// for the CPU to leave the SOCKMAP on a busy node.
    #[arg(long, env = "MESHWARP_NO_GUARD_REALTIME")]
    pub no_guard_realtime: bool,
}

fn parse_mode(s: &str) -> Result<u32> {
    match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(ConfigError::SocketMode(s.to_string())),
    }
}

impl ServeArgs {
    /// The settings given as flags or environment variables (`pin_root` is
    /// the global `--pin-root`/`MESHWARP_PIN_ROOT`, when given).
    fn layer(&self, pin_root: Option<&Path>) -> FileConfig {
        let some_vec = |v: &Vec<PathBuf>| (!v.is_empty()).then(|| v.clone());
        FileConfig {
            socket: self.socket.clone(),
            socket_group: self.socket_group.clone(),
            socket_mode: self.socket_mode.clone(),
            tcp_listen: self.tcp_listen,
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_client_ca: self.tls_client_ca.clone(),
            metrics_listen: self.metrics_listen,
            log_format: self.log_format,
            pin_root: pin_root.map(Path::to_path_buf),
            cgroup: self.cgroup.clone(),
            max_rules: self.max_rules,
            max_sockets: self.max_sockets,
            max_batch_size: self.max_batch_size,
            // File keys only: limits an operator sets once per node.
            event_history: None,
            max_message_bytes: None,
            max_plugin_bytes: None,
            max_watchers: None,
            max_watchers_per_caller: None,
            max_concurrent_streams: None,
            request_timeout_secs: None,
            drain_timeout_secs: self.drain_timeout_secs,
            reader_guard: self.reader_guard,
            trusted_readers: some_vec(&self.trusted_readers),
            syscall_watch: self.no_syscall_watch.then_some(false),
            guard_realtime: self.no_guard_realtime.then_some(false),
            netns: self.netns.clone(),
            cleanup: self.cleanup.then_some(true),
            // A file key only: access is configured once per node.
            allow: None,
        }
    }
}

/// Layers the file (if any) under the flags and environment; what neither
/// sets keeps its default.
pub fn layered(args: &ServeArgs, pin_root: Option<&Path>) -> Result<FileConfig> {
    let mut fig = Figment::new();
    if let Some(p) = &args.config {
        // Read here, so that a missing --config file is an error rather
        // than an empty layer.
        let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: p.clone(), source })?;
        fig = fig.merge(Toml::string(&text));
    }
    let what = args.config.as_ref().map_or("settings".to_string(), |p| format!("config {}", p.display()));
    fig.merge(Serialized::defaults(args.layer(pin_root)))
        .extract()
        .map_err(|source| ConfigError::Invalid { what, source: Box::new(source) })
}

/// The daemon's options: defaults < file < environment < flags.
pub fn resolve(args: &ServeArgs, pin_root: Option<&Path>) -> Result<(DaemonOptions, LogFormat)> {
    options(layered(args, pin_root)?)
}

/// A config file's text alone, over the defaults (what `--config` adds
/// before the environment and flags); the fuzz target's entry.
pub fn from_toml(text: &str) -> Result<(DaemonOptions, LogFormat)> {
    let c: FileConfig = Figment::new()
        .merge(Toml::string(text))
        .extract()
        .map_err(|source| ConfigError::Invalid { what: "config".into(), source: Box::new(source) })?;
    options(c)
}

/// The daemon's options from the layered settings.
fn options(c: FileConfig) -> Result<(DaemonOptions, LogFormat)> {
    let mut o = DaemonOptions::default();
    let dp_default = DataplaneConfig::default();
    o.dataplane = DataplaneConfig {
        pin_root: c.pin_root.unwrap_or_else(|| PathBuf::from(DEFAULT_PIN_ROOT)),
        cgroup: c.cgroup,
        max_rules: c.max_rules.unwrap_or(dp_default.max_rules),
        max_sockets: c.max_sockets.unwrap_or(dp_default.max_sockets),
        guard: c.reader_guard.map(Into::into).unwrap_or(dp_default.guard),
        trusted_readers: c.trusted_readers.unwrap_or_default(),
        syscall_watch: c.syscall_watch.unwrap_or(dp_default.syscall_watch),
        guard_realtime: c.guard_realtime.unwrap_or(dp_default.guard_realtime),
    };
    let d = ServerConfig::default();
    o.server = ServerConfig {
        max_batch_size: c.max_batch_size.unwrap_or(d.max_batch_size),
        event_history: c.event_history.unwrap_or(d.event_history),
        max_message_bytes: c.max_message_bytes.unwrap_or(d.max_message_bytes),
        max_plugin_bytes: c.max_plugin_bytes.unwrap_or(d.max_plugin_bytes),
        max_watchers: c.max_watchers.unwrap_or(d.max_watchers),
        max_watchers_per_caller: c.max_watchers_per_caller.unwrap_or(d.max_watchers_per_caller),
        max_concurrent_streams: c.max_concurrent_streams.unwrap_or(d.max_concurrent_streams),
        request_timeout: c.request_timeout_secs.map_or(d.request_timeout, Duration::from_secs),
        ..d
    };
    if let Some(s) = c.socket {
        o.socket = Some(s);
    }
    o.socket_group = c.socket_group;
    if let Some(m) = c.socket_mode.as_deref() {
        o.socket_mode = parse_mode(m)?;
    }
    o.tcp_listen = c.tcp_listen;
    o.tls = match (c.tls_cert, c.tls_key, c.tls_client_ca) {
        (Some(cert), Some(key), Some(client_ca)) => Some(TlsFiles { cert, key, client_ca }),
        (None, None, None) => None,
        _ => return Err(ConfigError::PartialTls),
    };
    o.metrics_listen = c.metrics_listen;
    o.grants = c.allow.unwrap_or_default().iter().map(Allow::grant).collect::<Result<_>>()?;
    o.cleanup_on_exit = c.cleanup.unwrap_or(false);
    o.netns = c.netns;
    if let Some(s) = c.drain_timeout_secs {
        o.drain_timeout = Duration::from_secs(s);
    }
    Ok((o, c.log_format.unwrap_or(LogFormat::Text)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshwarp_grpc_api::access::CertName;

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
    fn allow_tables_become_grants() {
        let f: FileConfig = toml::from_str(
            "[[allow]]\ngid = 4242\nowners = [\"team-a*\"]\n[[allow]]\ncert = \"dns:ctl\"\nowners = [\"*\"]\nnode_admin = true\n",
        )
        .unwrap();
        let grants: Vec<Grant> = f.allow.unwrap().iter().map(|a| a.grant().unwrap()).collect();
        assert_eq!(grants[0].who, Principal::Gid(4242));
        assert!(grants[0].owners.allows("team-a1") && !grants[0].node_admin);
        assert_eq!(grants[1].who, Principal::Cert(CertName::Dns("ctl".into())));
        assert!(grants[1].node_admin);
        let two: FileConfig = toml::from_str("[[allow]]\nuid = 1\ngid = 2\n").unwrap();
        assert!(two.allow.unwrap()[0].grant().is_err(), "one principal per table");
        let none: FileConfig = toml::from_str("[[allow]]\nowners = [\"x\"]\n").unwrap();
        assert!(none.allow.unwrap()[0].grant().is_err());
        assert!(toml::from_str::<FileConfig>("[[allow]]\nuid = 1\nowner = [\"x\"]\n").is_err(), "typo");
    }

    /// `meshwarp serve` arguments as clap parses them.
    fn serve_args(argv: &[&str]) -> ServeArgs {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            a: ServeArgs,
        }
        <Wrap as clap::Parser>::try_parse_from(std::iter::once("serve").chain(argv.iter().copied())).unwrap().a
    }

    /// A config file in a private scratch directory, removed on drop.
    struct TempConfig(meshwarp_testbed::ScratchDir);

    impl TempConfig {
        fn new(text: &str) -> Self {
            let dir = meshwarp_testbed::ScratchDir::new("meshwarp-cfg-").unwrap();
            std::fs::write(dir.path("serve.toml"), text).unwrap();
            Self(dir)
        }

        fn path(&self) -> String {
            self.0.path("serve.toml").display().to_string()
        }
    }

    /// defaults < file < environment/flags, for every setting, the global
    /// --pin-root included (the file's pin_root used to beat it).
    #[test]
    fn layers_in_the_documented_order() {
        let f = TempConfig::new(
            "pin_root = \"/sys/fs/bpf/from-file\"\nmax_rules = 7\nnetns = \"/run/netns/file\"\n\
             drain_timeout_secs = 3\nsocket_mode = \"0600\"\ncleanup = true\n",
        );
        let cfg = f.path();
        let cfg = cfg.as_str();

        let (o, fmt) = resolve(&serve_args(&[]), None).unwrap();
        assert_eq!(o.dataplane.pin_root, PathBuf::from(DEFAULT_PIN_ROOT));
        assert_eq!(o.dataplane.max_rules, DataplaneConfig::default().max_rules);
        assert_eq!(
            (o.netns, o.drain_timeout, o.cleanup_on_exit, fmt),
            (None, Duration::from_secs(10), false, LogFormat::Text)
        );

        let (o, _) = resolve(&serve_args(&["--config", cfg]), None).unwrap();
        assert_eq!(o.dataplane.pin_root, PathBuf::from("/sys/fs/bpf/from-file"));
        assert_eq!(o.dataplane.max_rules, 7);
        assert_eq!(o.netns.as_deref(), Some(Path::new("/run/netns/file")));
        assert_eq!((o.drain_timeout, o.socket_mode, o.cleanup_on_exit), (Duration::from_secs(3), 0o600, true));

        let args =
            serve_args(&["--config", cfg, "--max-rules", "9", "--netns", "/run/netns/flag", "--drain-timeout", "1"]);
        let (o, _) = resolve(&args, Some(Path::new("/sys/fs/bpf/from-flag"))).unwrap();
        assert_eq!(o.dataplane.pin_root, PathBuf::from("/sys/fs/bpf/from-flag"));
        assert_eq!(o.dataplane.max_rules, 9);
        assert_eq!(o.netns.as_deref(), Some(Path::new("/run/netns/flag")));
        assert_eq!(o.drain_timeout, Duration::from_secs(1));
        assert_eq!(o.socket_mode, 0o600, "what the flags leave alone comes from the file");
    }

    /// The guard's real-time priority: on by default, off by the file key or
    /// the switch (which beats a file that turns it on).
    #[test]
    fn the_guard_runs_real_time_unless_turned_off() {
        let (o, _) = resolve(&serve_args(&[]), None).unwrap();
        assert!(o.dataplane.guard_realtime);
        let off = TempConfig::new("guard_realtime = false\n");
        let (o, _) = resolve(&serve_args(&["--config", &off.path()]), None).unwrap();
        assert!(!o.dataplane.guard_realtime);
        let on = TempConfig::new("guard_realtime = true\n");
        let (o, _) = resolve(&serve_args(&["--config", &on.path(), "--no-guard-realtime"]), None).unwrap();
        assert!(!o.dataplane.guard_realtime);
    }

    #[test]
    fn a_bad_file_is_an_error_naming_it() {
        let f = TempConfig::new("sokcet = \"/tmp/x\"\n");
        let e = resolve(&serve_args(&["--config", &f.path()]), None).unwrap_err();
        assert!(format!("{e:#}").contains("sokcet") && format!("{e:#}").contains(&f.path()), "{e:#}");
        let e = resolve(&serve_args(&["--config", "/nonexistent/meshwarp.toml"]), None).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/meshwarp.toml"), "{e:#}");
    }

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0660").unwrap(), 0o660);
        assert_eq!(parse_mode("0o600").unwrap(), 0o600);
        assert!(parse_mode("0999").is_err());
        assert!(parse_mode("7777").is_err());
    }
}
