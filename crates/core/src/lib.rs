//! meshwarp-core: the typed library over meshwarp's eBPF data path.
//!
//! A [`Dataplane`] loads (or adopts an already pinned) socket-redirection data
//! path, attaches it to a cgroup v2 and lets a controller register which
//! connections to accelerate: [`EndpointPair`]s (mirror pairing) and
//! [`CaptureRule`]s (connections captured by iptables REDIRECT to a proxy).
//!
//! ```no_run
//! use meshwarp_core::{Dataplane, DataplaneConfig, EndpointPair, Endpoint};
//! let dp = Dataplane::open(&DataplaneConfig::default())?;
//! let pair = EndpointPair::new("198.18.0.2".parse()?, Endpoint::new("198.18.0.3".parse()?, 8080))?;
//! dp.insert(&pair, "my-controller")?;
//! println!("{:?}", dp.stats(&pair)?);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod conns;
pub mod dataplane;
pub mod endpoint;
pub mod error;
pub mod execlass;
pub mod fault;
pub mod guard;
pub mod latency;
mod loader;
pub mod maps;
pub mod netlink;
pub mod node;
mod park;
pub mod pins;
pub mod plugin;
pub mod probe;
pub mod registry;
mod slots;
pub mod stats;
pub mod sys;
pub mod table;
pub mod tc;
pub mod upgrade;

pub use conns::{ConnFilter, ConnSource, Connection, PathNow, TcpReason};
pub use dataplane::{Dataplane, DataplaneConfig, DataplaneError, Origin as DataplaneOrigin};
pub use endpoint::{CaptureRule, Endpoint, EndpointPair, FastPathMode, NeverRedirectInto, ValidationError};
pub use guard::{GuardMode, Incident, IncidentKind};
pub use latency::{Histogram, LatencyMonitor, Metric, Sampling as LatencySampling, Scope as LatencyScope};
pub use plugin::{FailurePolicy, Hook, Phase, PluginChain, PluginError, PluginManifest};
pub use probe::{KernelFact, KernelProbe};
pub use registry::SockRule;
pub use stats::{GlobalCounters, RuleCounters};
pub use table::{Outcome, Registered, RuleError};
pub use upgrade::Upgrade;
