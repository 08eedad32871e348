//! Prometheus metrics of the node service: RPC counts and latencies, and the
//! data path's counters read at scrape time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use meshwarp_core::tc::TcDataplane;
use meshwarp_core::{Dataplane, PluginChain};
use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    pub plugin: String,
    pub hook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    pub plugin: String,
    pub hook: String,
    pub verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub transition: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FeatureLabel {
    pub feature: String,
}

/// Labels of one latency histogram: the rule (its id and what it is), the
/// metric, and for a hop the rule it came from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    pub rule_id: String,
    pub rule: String,
    pub metric: String,
    pub from_rule_id: String,
}

/// The data path's latency histograms as read at the last scrape: the
/// kernel keeps log2 buckets, exported as they are (`le` = 2^(i+1) ns).
#[derive(Debug, Default)]
struct LatencyCollector {
    now: Mutex<Vec<(LatencyLabels, meshwarp_core::Histogram)>>,
}

impl prometheus_client::collector::Collector for LatencyCollector {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        if now.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(
            "path_latency_seconds",
            "Latency monitor, per rule: delivery on the fast and TCP paths, setup, response, think time, proxy hops (samples: every message, or adaptive sampling on busy sockets); per interface route: transit",
            None,
            prometheus_client::metrics::MetricType::Histogram,
        )?;
        for (labels, h) in now.iter() {
            let last = h.buckets.len() - 1;
            let buckets: Vec<(f64, u64)> = h
                .buckets
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let upper = meshwarp_core::Histogram::bounds(i).1 as f64 / 1e9;
                    (if i == last { f64::INFINITY } else { upper }, n)
                })
                .collect();
            family.encode_family(labels)?.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                h.sum_ns as f64 / 1e9,
                h.count,
                &buckets,
                None,
            )?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IncidentLabels {
    pub kind: String,
    pub reset: String,
}

/// Sets a counter to a total read at scrape time (kept monotonic by
/// `Totals`; a plugin's own counters restart when it is replaced, which
/// Prometheus reads as a counter reset).
fn set_total(c: &Counter, v: u64) {
    c.inner().store(v, std::sync::atomic::Ordering::Relaxed);
}

/// One rule's counters, flattened (see `Metrics::render`).
type RuleTotals = [u64; 32];

/// Node-wide totals of per-rule counters that never go back: a rule's counts
/// live in its slot, which a deleted rule frees and a new rule starts from
/// zero, so the sum over the rules that exist now would fall. What a rule
/// counted up to the last scrape before it went (or was recreated, its
/// counts lower than before) is kept in `retired`.
#[derive(Debug, Default)]
struct Totals {
    last: HashMap<String, RuleTotals>,
    retired: RuleTotals,
}

impl Totals {
    /// Takes this scrape's per-rule counters; returns the node-wide totals.
    fn update(&mut self, now: HashMap<String, RuleTotals>) -> RuleTotals {
        for (rule, before) in &self.last {
            let after = now.get(rule);
            for (i, b) in before.iter().enumerate() {
                if after.is_none_or(|a| a[i] < *b) {
                    self.retired[i] = self.retired[i].wrapping_add(*b);
                }
            }
        }
        let mut total = self.retired;
        for v in now.values() {
            for (t, x) in total.iter_mut().zip(v) {
                *t = t.wrapping_add(*x);
            }
        }
        self.last = now;
        total
    }
}

/// Every metric the node service exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    totals: Mutex<Totals>,
    rpcs: Family<RpcLabels, Counter>,
    latency: Family<MethodLabel, Histogram>,
    pairs: Gauge,
    captures: Gauge,
    redirected_msgs: Counter,
    redirected_bytes: Counter,
    fallbacks: Family<ReasonLabel, Counter>,
    plugin_runs: Family<PluginLabels, Counter>,
    plugin_verdicts: Family<VerdictLabels, Counter>,
    kernel: Family<FeatureLabel, Gauge>,
    reader_guard: Gauge,
    splice_hits: Counter,
    incidents: Family<IncidentLabels, Counter>,
    policy: Family<TransitionLabels, Counter>,
    policy_tcp_msgs: Counter,
    reader_wakeups: Counter,
    tgtmap_clients: Counter,
    hint_stale: Counter,
    urgent_hits: Counter,
    path_latency: std::sync::Arc<LatencyCollector>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("meshwarp");
        let rpcs = Family::<RpcLabels, Counter>::default();
        let latency = Family::<MethodLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_01, 2.0, 18))
        });
        let (pairs, captures, redirected_msgs, redirected_bytes) =
            (Gauge::default(), Gauge::default(), Counter::default(), Counter::default());
        let fallbacks = Family::<ReasonLabel, Counter>::default();
        registry.register("rpc_requests", "gRPC requests by method and status code", rpcs.clone());
        registry.register("rpc_duration_seconds", "gRPC request latency by method", latency.clone());
        registry.register("endpoint_pairs", "Registered endpoint pairs", pairs.clone());
        registry.register("capture_rules", "Registered capture rules", captures.clone());
        registry.register(
            "redirected_messages",
            "Messages redirected socket to socket (all rules)",
            redirected_msgs.clone(),
        );
        registry.register(
            "redirected_bytes",
            "Bytes redirected socket to socket (all rules)",
            redirected_bytes.clone(),
        );
        registry.register("fallbacks", "Traffic left on the normal TCP path, by reason", fallbacks.clone());
        let plugin_runs = Family::<PluginLabels, Counter>::default();
        let plugin_verdicts = Family::<VerdictLabels, Counter>::default();
        registry.register("plugin_runs", "Times each loaded plugin ran", plugin_runs.clone());
        registry.register(
            "plugin_verdicts",
            "Verdicts of each loaded plugin (continue, decline/bypass/pass, drop, invalid, missing)",
            plugin_verdicts.clone(),
        );
        let kernel = Family::<FeatureLabel, Gauge>::default();
        let (reader_guard, splice_hits) = (Gauge::default(), Counter::default());
        let incidents = Family::<IncidentLabels, Counter>::default();
        registry.register(
            "kernel_feature",
            "What the kernel does with redirected bytes, as probed at start (1: yes)",
            kernel.clone(),
        );
        registry.register(
            "reader_guard_enabled",
            "Whether the reader guard decides which sockets may receive redirected bytes",
            reader_guard.clone(),
        );
        registry.register(
            "splice_hits",
            "Readers that spliced a socket holding redirected bytes (connections reset)",
            splice_hits.clone(),
        );
        registry.register(
            "guard_incidents",
            "Reader guard incidents by kind and whether the connection was reset",
            incidents.clone(),
        );
        let (policy, policy_tcp_msgs) = (Family::<TransitionLabels, Counter>::default(), Counter::default());
        registry.register(
            "policy_transitions",
            "Adaptive policy: directions demoted to TCP or promoted back, ends unlinked from the SOCKMAP or relinked, by reason (all rules)",
            policy.clone(),
        );
        registry.register(
            "policy_tcp_messages",
            "Adaptive policy: messages demoted directions sent on the TCP path (all rules)",
            policy_tcp_msgs.clone(),
        );
        let reader_wakeups = Counter::default();
        registry.register(
            "reader_wakeups",
            "Readers woken because they asked FIONREAD with TCP bytes queued that the kernel's FIONREAD does not count (a psock socket; all rules)",
            reader_wakeups.clone(),
        );
        let tgtmap_clients = Counter::default();
        registry.register(
            "target_only_clients",
            "Client ends put at connect where no sk_msg runs on their sends: their server end is never a target (the rule, or the listener's last accepted end; all rules)",
            tgtmap_clients.clone(),
        );
        let hint_stale = Counter::default();
        registry.register(
            "stale_listener_hints",
            "Server ends withdrawn as targets because their client went by a stale hint of the listener (all rules)",
            hint_stale.clone(),
        );
        let urgent_hits = Counter::default();
        registry.register(
            "urgent_hits",
            "Urgent data (MSG_OOB) sent while its reader had redirected bytes unread: connection reset (all rules)",
            urgent_hits.clone(),
        );
        let path_latency = std::sync::Arc::new(LatencyCollector::default());
        registry.register_collector(Box::new(std::sync::Arc::clone(&path_latency)));
        Self {
            registry: Mutex::new(registry),
            totals: Mutex::new(Totals::default()),
            rpcs,
            latency,
            pairs,
            captures,
            redirected_msgs,
            redirected_bytes,
            fallbacks,
            plugin_runs,
            plugin_verdicts,
            kernel,
            reader_guard,
            splice_hits,
            incidents,
            policy,
            policy_tcp_msgs,
            reader_wakeups,
            tgtmap_clients,
            hint_stale,
            urgent_hits,
            path_latency,
        }
    }

    /// The latency monitor's histograms, labelled with their rules (and
    /// routes: metric "transit", `rule` "route ...").
    fn render_latency(&self, dp: &Dataplane, tc: Option<&TcDataplane>) {
        let hists = dp.latency().histograms(&std::collections::BTreeSet::new()).unwrap_or_default();
        let reg = dp.registry();
        let describe = |id: u32| match reg.rule_by_id(id) {
            Some((meshwarp_core::registry::RuleRef::Pair(p), _)) => format!("pair {p}"),
            Some((meshwarp_core::registry::RuleRef::Capture(c), _)) => format!("capture {c}"),
            None => String::new(),
        };
        let mut now: Vec<_> = hists
            .into_iter()
            .map(|h| {
                let labels = LatencyLabels {
                    rule_id: h.rule_id.to_string(),
                    rule: describe(h.rule_id),
                    metric: h.metric.name().to_string(),
                    from_rule_id: h.from_rule.map(|r| r.to_string()).unwrap_or_default(),
                };
                (labels, h)
            })
            .collect();
        if let Some(tc) = tc {
            let routes = tc.routes();
            let hists = tc.latency().histograms(&std::collections::BTreeSet::new()).unwrap_or_default();
            now.extend(hists.into_iter().map(|h| {
                let route = routes.iter().find(|r| r.id() == h.rule_id);
                let labels = LatencyLabels {
                    rule_id: h.rule_id.to_string(),
                    rule: route.map(|r| format!("route {}", r.route)).unwrap_or_default(),
                    metric: h.metric.name().to_string(),
                    from_rule_id: String::new(),
                };
                (labels, h)
            }));
        }
        *self.path_latency.now.lock().unwrap_or_else(|p| p.into_inner()) = now;
    }

    /// Counts one reader guard incident.
    pub fn incident(&self, i: &meshwarp_core::Incident) {
        let kind = match i.kind {
            meshwarp_core::IncidentKind::SpliceHit => "splice_hit",
            meshwarp_core::IncidentKind::SpliceSeen => "splice_seen",
            meshwarp_core::IncidentKind::UrgentHit => "urgent_hit",
        };
        self.incidents.get_or_create(&IncidentLabels { kind: kind.into(), reset: i.reset.to_string() }).inc();
    }

    /// Records one RPC.
    pub fn observe(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        self.rpcs.get_or_create(&RpcLabels { method: method.into(), code: format!("{code:?}") }).inc();
        self.latency.get_or_create(&MethodLabel { method: method.into() }).observe(elapsed.as_secs_f64());
    }

    /// The text exposition, with data-path counters read now.
    pub fn render(&self, dp: &Dataplane, tc: Option<&TcDataplane>, plugins: Option<&PluginChain>) -> String {
        self.render_plugins(plugins);
        self.render_latency(dp, tc);
        let reg = dp.registry();
        let flat = |c: meshwarp_core::RuleCounters| -> RuleTotals {
            [
                c.redirected_msgs,
                c.redirected_bytes,
                c.splice_hits,
                c.demotions_coalesce,
                c.demotions_behind,
                c.demotions_around,
                c.promotions,
                c.policy_tcp_msgs,
                c.unlinks,
                c.relinks,
                c.reader_wakeups,
                c.tgtmap_clients,
                c.hint_stale,
                c.urgent_hits,
                c.fallback_no_peer,
                c.fallback_tcp_path,
                c.fallback_map_full,
                c.fallback_insert_error,
                c.fallback_collision,
                c.fallback_reader,
                c.fallback_splice,
                c.fallback_rcvlowat,
                c.fallback_ulp,
                c.ulp_refused,
                c.fallback_mode_never,
                c.fallback_reader_busy,
                c.fallback_urgent,
                c.fallback_zerocopy,
                c.zerocopy_refused,
                c.fallback_peek_off,
                c.peek_off_refused,
                c.fallback_short,
            ]
        };
        // Keyed by the rule's identity (an update keeps the key and the
        // counter slot); a failed read keeps the rule's last values, so it
        // is not taken for deleted.
        let mut totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let mut now = HashMap::new();
        let mut put = |key: String, c: Option<meshwarp_core::RuleCounters>| {
            if let Some(v) = c.map(flat).or_else(|| totals.last.get(&key).copied()) {
                now.insert(key, v);
            }
        };
        let pairs = reg.pairs();
        for p in &pairs {
            put(format!("pair {:?}", p.rule.key()), reg.stats(&p.rule).ok());
        }
        let captures = reg.captures();
        for r in &captures {
            put(format!("capture {:?}", r.rule.key()), reg.stats(&r.rule).ok());
        }
        let not_covered = reg.global_stats().map(|g| g.not_covered).unwrap_or(0);
        drop(reg);
        let t = totals.update(now);
        drop(totals);
        let [msgs, bytes, hits, demoted, behind, around, promoted, tcp_msgs, unlinked, relinked, woken, tgt_only, stale, urgent_hits, fb @ ..] =
            t;
        self.pairs.set(pairs.len() as i64);
        self.captures.set(captures.len() as i64);
        set_total(&self.redirected_msgs, msgs);
        set_total(&self.redirected_bytes, bytes);
        set_total(&self.splice_hits, hits);
        self.reader_guard.set(i64::from(dp.guard_enabled()));
        for f in dp.kernel().facts() {
            self.kernel.get_or_create(&FeatureLabel { feature: f.name.into() }).set(i64::from(f.value));
        }
        for (reason, v) in [
            ("no_peer", fb[0]),
            ("tcp_path", fb[1]),
            ("map_full", fb[2]),
            ("insert_error", fb[3]),
            ("collision", fb[4]),
            ("reader", fb[5]),
            ("splice", fb[6]),
            ("rcvlowat", fb[7]),
            ("ulp", fb[8]),
            ("ulp_refused", fb[9]),
            ("mode_never", fb[10]),
            ("reader_busy", fb[11]),
            ("urgent", fb[12]),
            ("zerocopy", fb[13]),
            ("zerocopy_refused", fb[14]),
            ("peek_off", fb[15]),
            ("peek_off_refused", fb[16]),
            ("short", fb[17]),
            ("not_covered", not_covered),
        ] {
            set_total(&self.fallbacks.get_or_create(&ReasonLabel { reason: reason.into() }), v);
        }
        for (transition, reason, v) in [
            ("demotion", "coalesce", demoted),
            ("demotion", "reader_behind", behind),
            ("demotion", "around_reader", around),
            ("promotion", "drained", promoted),
            ("unlink", "streaming", unlinked),
            ("relink", "peer_sent", relinked),
        ] {
            let l = TransitionLabels { transition: transition.into(), reason: reason.into() };
            set_total(&self.policy.get_or_create(&l), v);
        }
        set_total(&self.policy_tcp_msgs, tcp_msgs);
        set_total(&self.reader_wakeups, woken);
        set_total(&self.tgtmap_clients, tgt_only);
        set_total(&self.hint_stale, stale);
        set_total(&self.urgent_hits, urgent_hits);
        self.encode()
    }

    /// Plugin counters; unloaded plugins disappear from the exposition.
    fn render_plugins(&self, plugins: Option<&PluginChain>) {
        self.plugin_runs.clear();
        self.plugin_verdicts.clear();
        let Some(list) = plugins.and_then(|p| p.list().ok()) else {
            return;
        };
        for p in list {
            let (plugin, hook) = (p.manifest.name.clone(), p.manifest.hook.callback().to_string());
            let c = p.counters;
            set_total(
                &self.plugin_runs.get_or_create(&PluginLabels { plugin: plugin.clone(), hook: hook.clone() }),
                c.runs,
            );
            for (verdict, v) in [
                ("continue", c.continued),
                (p.manifest.hook.verdict1(), c.verdict1),
                ("drop", c.dropped),
                ("invalid", c.invalid),
                ("missing", c.missing),
            ] {
                let l = VerdictLabels { plugin: plugin.clone(), hook: hook.clone(), verdict: verdict.into() };
                set_total(&self.plugin_verdicts.get_or_create(&l), v);
            }
        }
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        if encode(&mut out, &registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(list: &[(&str, u64)]) -> HashMap<String, RuleTotals> {
        list.iter()
            .map(|(k, v)| {
                let mut t: RuleTotals = [0; 32];
                t[0] = *v;
                (k.to_string(), t)
            })
            .collect()
    }

    /// Deleting a rule, or recreating it (its slot restarts from zero), never
    /// makes a node-wide total fall.
    #[test]
    fn totals_never_fall() {
        let mut t = Totals::default();
        assert_eq!(t.update(rules(&[("a", 5), ("b", 7)]))[0], 12);
        assert_eq!(t.update(rules(&[("a", 6)]))[0], 13, "b deleted: its 7 stay");
        assert_eq!(t.update(rules(&[("a", 1)]))[0], 14, "a recreated: its 6 stay");
        assert_eq!(t.update(rules(&[("a", 4), ("b", 2)]))[0], 19);
        assert_eq!(t.update(HashMap::new())[0], 19);
    }
}
