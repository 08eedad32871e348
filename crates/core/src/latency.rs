//! The latency monitor: per-rule log2 histograms the socket programs record
//! in the kernel (`mw_lat_rows` by index for the first rule ids, `mw_lat_hist`
//! hashed for the others and for hops), switched on and off at run time
//! node-wide or per rule.
//!
//! What is measured ([`Metric`]): delivery of a send to the peer's read on the
//! fast path and on the TCP path, connection setup, request to response at a
//! client end, an application's own time between a read and its reply, and a
//! proxy's time between reading one rule's socket and writing another's
//! ([`Metric::Hop`]): the hops of a mesh request, app → sidecar → sidecar →
//! app, stitched through the rules they cross.
//!
//! Interface routes (the tc family) have a monitor of their own with one
//! metric, [`Metric::Transit`]: a packet's time from its sender's TCP transmit
//! to the route that redirects it.
//!
//! Off costs the data path one flag test per message: sk_msg and the read
//! tracepoint test the switch, and the TCP-path send tracepoint (`mw_lat_send`
//! on `tcp_sendmsg_locked`) is a pinned link only while it runs. On, it
//! samples ([`Sampling`]): every message of a socket that sends less than
//! about once per ms, and on busier sockets one request in up to 64 with its
//! whole chain (delivery, think time, each hop, the response), so that its
//! cost stays a few percent of the fastest round trip.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Mutex;

use libbpf_rs::ProgramHandle;
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    Config, LatHist, CFG_LATENCY, CFG_LAT_ALL, CFG_LAT_CLEAN, CFG_LAT_EVERY, LAT_BUCKETS, LAT_FAST, LAT_HOP,
    LAT_RESPONSE, LAT_SETUP, LAT_TCP, LAT_THINK, LAT_TRANSIT,
};

use crate::error::{BpfError, IoError};
use crate::maps::{add_hist, MapError, RowShape, RuleLatency, TypedMap};
use crate::pins::FamilyPins;
use crate::upgrade::{self, UpgradeError};

/// `MW_NO_ID`: no rule.
const NO_ID: u32 = u32::MAX;

#[derive(Debug, thiserror::Error)]
pub enum LatencyError {
    #[error(transparent)]
    Map(#[from] MapError),
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Attach(#[from] UpgradeError),
    #[error("rule id {id} is out of range (the data path has room for {max} rules)")]
    RuleOutOfRange { id: u32, max: u32 },
}

/// What one histogram measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Metric {
    /// A send to the peer's read that returns it, bytes redirected.
    Fast,
    /// The same for bytes that crossed the TCP path.
    Tcp,
    /// connect() to ESTABLISHED, at the client end.
    Setup,
    /// A client end's send to its next read: request to response as the
    /// application sees it.
    Response,
    /// A server end's read to the same thread's next send on it: the
    /// application's own time (think time).
    Think,
    /// A read of one rule's socket to the same thread's next send on another
    /// connection: a proxy between two hops.
    Hop,
    /// An interface route's: a packet's time from its sender's TCP transmit
    /// to the route that redirects it (the sender's queues and devices).
    /// Its histogram's `rule_id` is a route id.
    Transit,
}

impl Metric {
    pub const ALL: [Metric; 7] =
        [Metric::Fast, Metric::Tcp, Metric::Setup, Metric::Response, Metric::Think, Metric::Hop, Metric::Transit];

    fn code(self) -> u32 {
        match self {
            Metric::Fast => LAT_FAST,
            Metric::Tcp => LAT_TCP,
            Metric::Setup => LAT_SETUP,
            Metric::Response => LAT_RESPONSE,
            Metric::Think => LAT_THINK,
            Metric::Hop => LAT_HOP,
            Metric::Transit => LAT_TRANSIT,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.code() == code)
    }

    /// Its stable name (API, metrics labels, CLI).
    pub fn name(self) -> &'static str {
        match self {
            Metric::Fast => "fast",
            Metric::Tcp => "tcp",
            Metric::Setup => "setup",
            Metric::Response => "response",
            Metric::Think => "think",
            Metric::Hop => "hop",
            Metric::Transit => "transit",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }
}

impl fmt::Display for Metric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Buckets of every histogram: bucket i counts [2^i, 2^(i+1)) ns (the first
/// also 0, the last everything above).
pub const BUCKETS: usize = LAT_BUCKETS;

/// One histogram, summed over CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    pub rule_id: u32,
    pub metric: Metric,
    /// [`Metric::Hop`]: the rule whose socket the proxy read.
    pub from_rule: Option<u32>,
    pub count: u64,
    pub sum_ns: u64,
    pub buckets: [u64; BUCKETS],
}

impl Histogram {
    /// Bucket `i`'s bounds in ns, `[lower, upper)`.
    pub fn bounds(i: usize) -> (u64, u64) {
        let lower = if i == 0 { 0 } else { 1u64 << i };
        (lower, 1u64 << (i + 1))
    }

    pub fn mean_ns(&self) -> Option<u64> {
        self.sum_ns.checked_div(self.count)
    }

    /// The `q` quantile (0..=1), interpolated within its bucket.
    pub fn quantile_ns(&self, q: f64) -> Option<u64> {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * total as f64).max(1.0);
        let mut seen = 0u64;
        for (i, &n) in self.buckets.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if (seen + n) as f64 >= rank {
                let (lo, hi) = Self::bounds(i);
                let within = (rank - seen as f64) / n as f64;
                return Some(lo + ((hi - lo) as f64 * within) as u64);
            }
            seen += n;
        }
        Some(Self::bounds(BUCKETS - 1).1)
    }

    /// The index of the bucket holding `ns`.
    pub fn bucket_of(ns: u64) -> usize {
        if ns <= 1 {
            return 0;
        }
        (63 - ns.leading_zeros() as usize).min(BUCKETS - 1)
    }
}

/// For which rules the monitor runs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Scope {
    #[default]
    Off,
    /// Every rule.
    All,
    /// These rule ids.
    Rules(BTreeSet<u32>),
}

/// Which messages the monitor measures (node-wide; routes measure every
/// packet either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sampling {
    /// Every message of a socket that sends less than about once per ms; a
    /// busier socket starts a measured chain after skipping up to
    /// [`meshwarp_bpf::shared::LAT_SKIP_MAX`] sends (the count doubles
    /// while its samples come closer than ~1 ms, halves otherwise, and
    /// starts over within 8 sends after ~20 ms of quiet), and every read and send that
    /// request's stamp reaches is measured with it. Counts in the histograms
    /// are then samples, not messages.
    #[default]
    Adaptive,
    /// Every message: exact counts, at about twice the cost of the data
    /// path's own programs (benches/README.md).
    Every,
}

impl Sampling {
    /// Its name in the API's logs and the CLI (`adaptive`, `every`).
    pub fn name(self) -> &'static str {
        match self {
            Sampling::Adaptive => "adaptive",
            Sampling::Every => "every",
        }
    }
}

/// The monitor of one socket data path (its pinned maps and programs).
#[derive(Debug)]
pub struct LatencyMonitor {
    layout: FamilyPins,
    config: TypedMap<u32, Config>,
    lat: RuleLatency,
    /// The program that stamps TCP-path sends, attached only while the
    /// monitor runs (the socket family's; none for routes).
    send_prog: Option<&'static str>,
    /// One switch at a time: a switch is several map writes.
    switching: Mutex<()>,
}

/// CLOCK_MONOTONIC in ns: the programs' `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| (t.tv_sec() as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec() as u64))
        .unwrap_or(1)
        .max(1)
}

impl LatencyMonitor {
    /// The monitor of the socket family pinned at `layout`.
    pub(crate) fn sockets(layout: &FamilyPins) -> Result<Self, LatencyError> {
        Self::open(layout, RowShape::SOCKETS, Some(names::PROG_LAT_SEND))
    }

    /// The monitor of the tc family pinned at `layout` (interface routes).
    pub(crate) fn routes(layout: &FamilyPins) -> Result<Self, LatencyError> {
        Self::open(layout, RowShape::ROUTES, None)
    }

    fn open(layout: &FamilyPins, shape: RowShape, send_prog: Option<&'static str>) -> Result<Self, LatencyError> {
        let dir = layout.maps_dir();
        Ok(Self {
            layout: layout.clone(),
            config: TypedMap::pinned(&dir, names::MAP_CONFIG)?,
            lat: RuleLatency::open(&dir, shape)?,
            send_prog,
            switching: Mutex::new(()),
        })
    }

    /// Where it runs now.
    pub fn scope(&self) -> Result<Scope, LatencyError> {
        let flags = self.config.get(&0)?.unwrap_or_default().flags;
        if flags & CFG_LATENCY == 0 {
            return Ok(Scope::Off);
        }
        if flags & CFG_LAT_ALL != 0 {
            return Ok(Scope::All);
        }
        let on = self.lat.rules.entries()?.into_iter().filter(|(_, v)| *v != 0).map(|(k, _)| k).collect();
        Ok(Scope::Rules(on))
    }

    /// How it samples (kept while it is off, and across restarts).
    pub fn sampling(&self) -> Result<Sampling, LatencyError> {
        let flags = self.config.get(&0)?.unwrap_or_default().flags;
        Ok(if flags & CFG_LAT_EVERY != 0 { Sampling::Every } else { Sampling::Adaptive })
    }

    /// Switches how it samples, from the next message on; histograms are
    /// kept.
    pub fn set_sampling(&self, sampling: Sampling) -> Result<(), LatencyError> {
        let _one = self.switching.lock().unwrap_or_else(|p| p.into_inner());
        let mut cfg = self.config.get(&0)?.unwrap_or_default();
        let before = cfg.flags;
        match sampling {
            Sampling::Every => cfg.flags |= CFG_LAT_EVERY,
            Sampling::Adaptive => cfg.flags &= !CFG_LAT_EVERY,
        }
        if cfg.flags != before {
            self.config.put(&0, &cfg)?;
            tracing::info!(sampling = sampling.name(), "latency monitor sampling");
        }
        Ok(())
    }

    /// Runs the monitor for `scope` (replacing what ran before); with
    /// `reset`, forgets the histograms of its rules (all for
    /// [`Scope::All`] and [`Scope::Off`]). A rule switched on now only counts
    /// sends from now on. Turning it on attaches the TCP-path send
    /// tracepoint before the programs start stamping; turning it off stops
    /// the stamping, then detaches it. On an error the previous switch is
    /// put back (histograms a reset already deleted stay deleted, and maps
    /// marked `CFG_LAT_CLEAN` stay unmarked).
    pub fn set(&self, scope: &Scope, reset: bool) -> Result<(), LatencyError> {
        let max = self.lat.rules.capacity();
        if let Scope::Rules(ids) = scope {
            if let Some(&id) = ids.iter().find(|&&id| id >= max) {
                return Err(LatencyError::RuleOutOfRange { id, max });
            }
        }
        let _one = self.switching.lock().unwrap_or_else(|p| p.into_inner());
        let before_cfg = self.config.get(&0)?.unwrap_or_default();
        let before_rules: Vec<(u32, u64)> = self.lat.rules.entries()?.into_iter().filter(|(_, v)| *v != 0).collect();
        let before_links = self.send_prog.is_some_and(|p| self.layout.link(p).exists());
        let applied = self.apply(scope, &before_cfg, &before_rules).and_then(|()| match (reset, scope) {
            (false, _) => Ok(()),
            (true, Scope::Rules(ids)) => self.reset(ids),
            (true, _) => self.reset(&BTreeSet::new()),
        });
        if let Err(e) = applied {
            tracing::warn!("switching the latency monitor failed, putting the previous switch back: {e}");
            let restored = (|| -> Result<(), LatencyError> {
                // Every entry (an array: all ids are present) back to its value before.
                for (id, v) in self.lat.rules.entries()? {
                    let was = before_rules.iter().find(|(k, _)| *k == id).map_or(0, |(_, v)| *v);
                    if v != was {
                        self.lat.rules.put(&id, &was)?;
                    }
                }
                // The monitor may have recorded meanwhile: the maps stay marked used.
                let back = Config { flags: before_cfg.flags & !CFG_LAT_CLEAN, ..before_cfg };
                self.config.put(&0, &back)?;
                self.set_links(before_links)
            })();
            if let Err(r) = restored {
                tracing::error!("putting the previous latency switch back failed: {r}");
            }
            return Err(e);
        }
        tracing::info!(?scope, reset, "latency monitor");
        Ok(())
    }

    fn apply(&self, scope: &Scope, cfg: &Config, on_before: &[(u32, u64)]) -> Result<(), LatencyError> {
        let now = monotonic_ns();
        let on = *scope != Scope::Off;
        let mut next = *cfg;
        if on {
            // Before anything can record: new rule ids must forget again.
            if next.flags & CFG_LAT_CLEAN != 0 {
                next.flags &= !CFG_LAT_CLEAN;
                self.config.put(&0, &next)?;
            }
            self.set_links(true)?;
        }
        let want: BTreeSet<u32> = match scope {
            Scope::Rules(ids) => ids.clone(),
            _ => BTreeSet::new(),
        };
        for (id, _) in on_before {
            if !want.contains(id) {
                self.lat.rules.put(id, &0)?;
            }
        }
        for id in &want {
            // A rule on already keeps its start: its stamps stay valid.
            if !on_before.iter().any(|(k, _)| k == id) {
                self.lat.rules.put(id, &now)?;
            }
        }
        let was_all = cfg.flags & CFG_LATENCY != 0 && cfg.flags & CFG_LAT_ALL != 0;
        next.flags &= !(CFG_LATENCY | CFG_LAT_ALL);
        match scope {
            Scope::Off => {}
            Scope::All => {
                next.flags |= CFG_LATENCY | CFG_LAT_ALL;
                if !was_all {
                    next.lat_since = now;
                }
            }
            Scope::Rules(_) => next.flags |= CFG_LATENCY,
        }
        self.config.put(&0, &next)?;
        if !on {
            self.set_links(false)?;
        }
        Ok(())
    }

    /// Attaches (pins a link of) or detaches the TCP-path send tracepoint.
    /// A kernel without `tcp_sendmsg_locked` has no such program: sends of
    /// sockets outside the SOCKMAP are then not stamped.
    fn set_links(&self, on: bool) -> Result<(), LatencyError> {
        let Some(name) = self.send_prog else {
            return Ok(());
        };
        let path: PathBuf = self.layout.link(name);
        match (on, path.exists()) {
            (true, false) => {
                let prog_path = self.layout.prog(name);
                if !prog_path.exists() {
                    tracing::warn!("this kernel has no tcp_sendmsg_locked tracepoint: TCP-path sends of sockets outside the SOCKMAP are not measured");
                    return Ok(());
                }
                let prog = ProgramHandle::from_pinned_path(prog_path)
                    .map_err(|e| BpfError::new(format!("opening pinned program {name}"), e))?;
                let step = format!("attaching {name}");
                let link = upgrade::raw_tp_open(&step, prog.as_fd())?;
                upgrade::obj_pin(&step, link.as_fd(), &path)?;
            }
            (false, true) => fs::remove_file(&path).map_err(|e| IoError::new(path.display().to_string(), e))?,
            _ => {}
        }
        Ok(())
    }

    /// Every histogram recorded (for the rules in `rules`, all if empty).
    pub fn histograms(&self, rules: &BTreeSet<u32>) -> Result<Vec<Histogram>, LatencyError> {
        let mut acc: BTreeMap<(u32, Metric, Option<u32>), LatHist> = BTreeMap::new();
        let mut add = |rule_id: u32, code: u32, from: u32, h: &LatHist| {
            if let Some(metric) = Metric::from_code(code) {
                add_hist(acc.entry((rule_id, metric, (from != NO_ID).then_some(from))).or_default(), h);
            }
        };
        for id in self.lat.rows.ids(rules) {
            for (code, h) in self.lat.rows.of(id)? {
                add(id, code, NO_ID, &h);
            }
        }
        for key in self.lat.hists.keys()? {
            if rules.is_empty() || rules.contains(&key.rule_id) {
                add(key.rule_id, key.metric, key.from_rule, &self.lat.hists.sum(&key, add_hist)?);
            }
        }
        Ok(acc
            .into_iter()
            .map(|((rule_id, metric, from_rule), h)| Histogram {
                rule_id,
                metric,
                from_rule,
                count: h.count,
                sum_ns: h.sum_ns,
                buckets: h.bucket,
            })
            .collect())
    }

    /// Forgets the histograms of `rules` (all if empty).
    pub fn reset(&self, rules: &BTreeSet<u32>) -> Result<(), LatencyError> {
        for id in self.lat.rows.ids(rules) {
            self.lat.rows.zero(id)?;
        }
        for key in self.lat.hists.keys()? {
            if rules.is_empty() || rules.contains(&key.rule_id) {
                self.lat.hists.delete(&key)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_match_the_programs_log2() {
        assert_eq!(Histogram::bucket_of(0), 0);
        assert_eq!(Histogram::bucket_of(1), 0);
        assert_eq!(Histogram::bucket_of(2), 1);
        assert_eq!(Histogram::bucket_of(3), 1);
        assert_eq!(Histogram::bucket_of(2_000_000), 20);
        assert_eq!(Histogram::bucket_of(u64::MAX), BUCKETS - 1);
        assert_eq!(Histogram::bounds(20), (1 << 20, 1 << 21));
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket() {
        let mut h = Histogram {
            rule_id: 0,
            metric: Metric::Fast,
            from_rule: None,
            count: 100,
            sum_ns: 0,
            buckets: [0; BUCKETS],
        };
        h.buckets[10] = 50;
        h.buckets[20] = 50;
        let p50 = h.quantile_ns(0.5).unwrap();
        assert!((1 << 10..1 << 11).contains(&p50) || p50 == 1 << 11, "{p50}");
        let p99 = h.quantile_ns(0.99).unwrap();
        assert!((1 << 20..=1 << 21).contains(&p99), "{p99}");
        assert_eq!(Metric::from_name("hop"), Some(Metric::Hop));
    }
}
