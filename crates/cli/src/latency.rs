//! `meshwarp latency`, apart from the RPCs: the rule keys and metrics its
//! flags name, the report a GetLatency answer becomes (what `-o json|yaml`
//! prints: buckets with their bounds, quantiles), the monitor's state in a
//! line and the histograms drawn in the terminal. The SVG picture is
//! [`crate::svg`]'s.

use std::net::{IpAddr, SocketAddr};

use meshwarp_grpc_api::pb;
use serde::Serialize;

use crate::output::{human_ns, rule_description};

/// A latency metric, as flags and reports name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MetricArg {
    /// A send to the peer's read that returns it, bytes redirected.
    Fast,
    /// The same for bytes that crossed the TCP path.
    Tcp,
    /// connect() to ESTABLISHED, at the client end.
    Setup,
    /// A client end's send to its next read: request to response.
    Response,
    /// A server end's read to its next send: the application's own time.
    Think,
    /// A proxy's read on one rule's socket to its send on another's.
    Hop,
    /// An interface route's: a packet's time from its sender's TCP
    /// transmit to the route that redirects it.
    Transit,
}

impl MetricArg {
    /// The API's metric of this name.
    pub fn to_pb(self) -> pb::LatencyMetric {
        match self {
            MetricArg::Fast => pb::LatencyMetric::Fast,
            MetricArg::Tcp => pb::LatencyMetric::Tcp,
            MetricArg::Setup => pb::LatencyMetric::Setup,
            MetricArg::Response => pb::LatencyMetric::Response,
            MetricArg::Think => pb::LatencyMetric::Think,
            MetricArg::Hop => pb::LatencyMetric::Hop,
            MetricArg::Transit => pb::LatencyMetric::Transit,
        }
    }

    /// The metric the API names `m` (None: unspecified or unknown).
    pub fn from_pb(m: i32) -> Option<Self> {
        Some(match pb::LatencyMetric::try_from(m).ok()? {
            pb::LatencyMetric::Fast => MetricArg::Fast,
            pb::LatencyMetric::Tcp => MetricArg::Tcp,
            pb::LatencyMetric::Setup => MetricArg::Setup,
            pb::LatencyMetric::Response => MetricArg::Response,
            pb::LatencyMetric::Think => MetricArg::Think,
            pb::LatencyMetric::Hop => MetricArg::Hop,
            pb::LatencyMetric::Transit => MetricArg::Transit,
            pb::LatencyMetric::Unspecified => return None,
        })
    }

    /// What it measures, in a few words.
    pub fn label(self) -> &'static str {
        match self {
            MetricArg::Fast => "fast-path delivery",
            MetricArg::Tcp => "TCP delivery",
            MetricArg::Setup => "connection setup",
            MetricArg::Response => "response (send to next read)",
            MetricArg::Think => "think (read to next send)",
            MetricArg::Hop => "proxy hop",
            MetricArg::Transit => "route transit (sender's TCP transmit to the route)",
        }
    }
}

/// A pair's key on the command line: `CLIENT_IP=SERVER_IP:PORT` (the
/// arguments of `pair get`, joined), `[IPv6]:PORT` for an IPv6 server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairKeyArg {
    pub client: IpAddr,
    pub server: SocketAddr,
}

/// A capture rule's key on the command line: `DST_IP:PORT` (the rule for
/// any client, `capture rm --dst`) or `CLIENT_IP=DST_IP:PORT` (with
/// `--client`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureKeyArg {
    pub client: Option<IpAddr>,
    pub dst: SocketAddr,
}

/// Parses `--pair CLIENT_IP=SERVER_IP:PORT`.
pub fn parse_pair_key(s: &str) -> Result<PairKeyArg, String> {
    let (client, server) = s.split_once('=').ok_or_else(|| format!("{s:?} is not CLIENT_IP=SERVER_IP:PORT"))?;
    let client = client.trim().parse().map_err(|e| format!("client {client:?}: {e}"))?;
    let server = server.trim().parse().map_err(|e| format!("server {server:?} (IP:PORT, [IPv6]:PORT): {e}"))?;
    Ok(PairKeyArg { client, server })
}

/// Parses `--capture [CLIENT_IP=]DST_IP:PORT`.
pub fn parse_capture_key(s: &str) -> Result<CaptureKeyArg, String> {
    let (client, dst) = match s.split_once('=') {
        Some((c, d)) => (Some(c.trim().parse().map_err(|e| format!("client {c:?}: {e}"))?), d),
        None => (None, s),
    };
    let dst = dst.trim().parse().map_err(|e| format!("original destination {dst:?} (IP:PORT, [IPv6]:PORT): {e}"))?;
    Ok(CaptureKeyArg { client, dst })
}

/// Parses `--route IFACE[:egress]=DST/LEN`: the route on IFACE's ingress
/// (or egress) hook for that destination prefix.
pub fn parse_route_key(s: &str) -> Result<pb::RouteKey, String> {
    let (at, dst) = s.split_once('=').ok_or_else(|| format!("{s:?} is not IFACE[:egress]=DST/LEN"))?;
    let (attach, egress) = match at.rsplit_once(':') {
        Some((a, "egress")) => (a, true),
        Some((a, "ingress")) => (a, false),
        Some((_, d)) => return Err(format!("{d:?} is not a direction (ingress, egress)")),
        None => (at, false),
    };
    if attach.is_empty() || dst.is_empty() {
        return Err(format!("{s:?} is not IFACE[:egress]=DST/LEN"));
    }
    Ok(pb::RouteKey {
        attach: crate::output::iface(attach),
        direction: crate::output::dir(egress),
        dst: crate::output::prefix(dst),
    })
}

fn endpoint(a: SocketAddr) -> Option<pb::Endpoint> {
    Some(pb::Endpoint { ip: a.ip().to_string(), port: u32::from(a.port()) })
}

/// The rules and routes a latency command is about, by key; none: every
/// rule and route.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RuleSelectorArgs {
    /// A pair, as CLIENT_IP=SERVER_IP:PORT ([IPv6]:PORT for IPv6). Repeatable.
    #[arg(long = "pair", value_name = "CLIENT_IP=SERVER_IP:PORT", value_parser = parse_pair_key)]
    pub pairs: Vec<PairKeyArg>,
    /// A capture rule, as DST_IP:PORT (the rule for any client) or
    /// CLIENT_IP=DST_IP:PORT. Repeatable.
    #[arg(long = "capture", value_name = "[CLIENT_IP=]DST_IP:PORT", value_parser = parse_capture_key)]
    pub captures: Vec<CaptureKeyArg>,
    /// An interface route, as IFACE=DST/LEN (its ingress hook) or
    /// IFACE:egress=DST/LEN. Repeatable.
    #[arg(long = "route", value_name = "IFACE[:egress]=DST/LEN", value_parser = parse_route_key)]
    pub routes: Vec<pb::RouteKey>,
}

impl RuleSelectorArgs {
    /// The selector of the API: no rule named, every rule.
    pub fn to_pb(&self) -> pb::RuleSelector {
        pb::RuleSelector {
            pairs: self
                .pairs
                .iter()
                .map(|p| pb::PairKey { client_ip: p.client.to_string(), server: endpoint(p.server) })
                .collect(),
            capture_rules: self
                .captures
                .iter()
                .map(|c| pb::CaptureRuleKey {
                    client_ip: c.client.map(|c| c.to_string()).unwrap_or_default(),
                    original_dst: endpoint(c.dst),
                })
                .collect(),
            routes: self.routes.clone(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty() && self.captures.is_empty()
    }
}

/// `latency on --sampling`: which messages the monitor measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SamplingArg {
    /// Every message of sockets that send less than about once per ms, one
    /// request in up to 64 (with its whole chain of hops) on busier ones.
    Adaptive,
    /// Every message: exact counts, at a higher cost per message.
    Every,
}

impl SamplingArg {
    /// The API's value.
    pub fn to_pb(self) -> pb::LatencySampling {
        match self {
            SamplingArg::Adaptive => pb::LatencySampling::Adaptive,
            SamplingArg::Every => pb::LatencySampling::Every,
        }
    }
}

/// Where the monitor runs, and how it samples.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StateView {
    pub enabled: bool,
    pub all_rules: bool,
    pub rule_ids: Vec<u32>,
    pub route_ids: Vec<u32>,
    /// `adaptive` or `every` (empty from a node that does not say).
    pub sampling: String,
}

impl StateView {
    pub fn from_pb(s: &Option<pb::LatencyState>) -> Self {
        let s = s.clone().unwrap_or_default();
        let sampling = meshwarp_grpc_api::convert::sampling_from_pb(s.sampling)
            .ok()
            .flatten()
            .map_or_else(String::new, |s| s.name().to_string());
        Self { enabled: s.enabled, all_rules: s.all_rules, rule_ids: s.rule_ids, route_ids: s.route_ids, sampling }
    }

    /// `latency monitor off`, `... on for every rule`, `... on for rules 3,
    /// 7`, `... on for rule 3 and route 0`.
    pub fn line(&self) -> String {
        let list = |what: &str, ids: &[u32]| {
            let s = if ids.len() == 1 { "" } else { "s" };
            let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
            format!("{what}{s} {}", ids.join(", "))
        };
        let sampling = match self.sampling.as_str() {
            "" => String::new(),
            "every" => ", every message".into(),
            s => format!(", sampling {s}"),
        };
        if !self.enabled {
            "latency monitor off".into()
        } else if self.all_rules || (self.rule_ids.is_empty() && self.route_ids.is_empty()) {
            format!("latency monitor on for every rule{sampling}")
        } else {
            let parts: Vec<String> = [("rule", &self.rule_ids), ("route", &self.route_ids)]
                .into_iter()
                .filter(|(_, ids)| !ids.is_empty())
                .map(|(what, ids)| list(what, ids))
                .collect();
            format!("latency monitor on for {}{sampling}", parts.join(" and "))
        }
    }
}

/// One bucket: the samples in `[lower_ns, upper_ns)` (no upper: the last
/// bucket, which also takes everything above).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BucketView {
    pub lower_ns: u64,
    pub upper_ns: Option<u64>,
    pub count: u64,
}

/// One histogram as the report shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HistogramView {
    pub rule_id: u32,
    /// What the rule is (empty: the node knows only its id).
    pub rule: String,
    pub metric: MetricArg,
    /// Proxy hops: the rule whose socket the proxy read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_rule_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_rule: Option<String>,
    pub count: u64,
    pub sum_ns: u64,
    pub mean_ns: Option<u64>,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    /// From the first to the last non-empty bucket.
    pub buckets: Vec<BucketView>,
}

/// Bucket `i`'s bounds of a histogram of `n` buckets: `[2^i, 2^(i+1))` ns,
/// the first from 0, the last open.
pub fn bucket_bounds(i: usize, n: usize) -> (u64, Option<u64>) {
    let lower = if i == 0 { 0 } else { 1u64.checked_shl(i as u32).unwrap_or(u64::MAX) };
    let upper = if i + 1 >= n { None } else { Some(1u64.checked_shl(i as u32 + 1).unwrap_or(u64::MAX)) };
    (lower, upper)
}

fn name(id: u32, desc: &str) -> String {
    if desc.is_empty() {
        format!("rule {id}")
    } else {
        format!("rule {id} ({desc})")
    }
}

impl HistogramView {
    /// The histogram of the API (None: a metric this client does not know).
    pub fn from_pb(h: &pb::LatencyHistogram) -> Option<Self> {
        let metric = MetricArg::from_pb(h.metric)?;
        let rule = h.rule.clone().unwrap_or_default();
        let first = h.buckets.iter().position(|&n| n > 0);
        let last = h.buckets.iter().rposition(|&n| n > 0);
        let buckets = match (first, last) {
            (Some(a), Some(b)) => (a..=b)
                .map(|i| {
                    let (lower_ns, upper_ns) = bucket_bounds(i, h.buckets.len());
                    BucketView { lower_ns, upper_ns, count: h.buckets[i] }
                })
                .collect(),
            _ => Vec::new(),
        };
        Some(Self {
            rule_id: rule.rule_id,
            rule: rule_description(&rule),
            metric,
            from_rule_id: h.from_rule.as_ref().map(|r| r.rule_id),
            from_rule: h.from_rule.as_ref().map(rule_description),
            count: h.count,
            sum_ns: h.sum_ns,
            mean_ns: h.sum_ns.checked_div(h.count),
            p50_ns: h.p50_ns,
            p90_ns: h.p90_ns,
            p99_ns: h.p99_ns,
            buckets,
        })
    }

    /// `rule 3 (pair ...)`.
    pub fn rule_name(&self) -> String {
        name(self.rule_id, &self.rule)
    }

    /// `rule 3 (pair ...)  fast-path delivery`, for a hop `... proxy hop
    /// from rule 2 (...)`.
    pub fn title(&self) -> String {
        match self.from_rule_id {
            Some(id) => format!(
                "{}  {} from {}",
                self.rule_name(),
                self.metric.label(),
                name(id, self.from_rule.as_deref().unwrap_or(""))
            ),
            None => format!("{}  {}", self.rule_name(), self.metric.label()),
        }
    }

    /// `count 12  mean 1.2ms  p50 1.0ms  p90 2.0ms  p99 3.9ms`.
    pub fn summary(&self) -> String {
        if self.count == 0 {
            return "no samples".into();
        }
        format!(
            "count {}  mean {}  p50 {}  p90 {}  p99 {}",
            self.count,
            self.mean_ns.map(human_ns).unwrap_or_else(|| "-".into()),
            human_ns(self.p50_ns),
            human_ns(self.p90_ns),
            human_ns(self.p99_ns)
        )
    }
}

/// A GetLatency answer as `latency show` reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LatencyReport {
    pub state: StateView,
    pub histograms: Vec<HistogramView>,
}

impl LatencyReport {
    /// The histograms of `metrics` (none: every metric), by rule, metric
    /// and hop origin.
    pub fn from_pb(r: &pb::GetLatencyResponse, metrics: &[MetricArg]) -> Self {
        let mut histograms: Vec<HistogramView> = r
            .histograms
            .iter()
            .filter_map(HistogramView::from_pb)
            .filter(|h| metrics.is_empty() || metrics.contains(&h.metric))
            .collect();
        histograms.sort_by_key(|h| (h.rule_id, h.metric, h.from_rule_id));
        Self { state: StateView::from_pb(&r.state), histograms }
    }
}

/// Widest bar of a histogram, in characters.
pub const BAR_WIDTH: usize = 40;

/// `count` of `max` as a bar of at most `width` characters, in eighths of a
/// character (a non-empty bucket shows at least a sliver).
fn bar(count: u64, max: u64, width: usize) -> String {
    const PARTS: [&str; 8] = ["", "▏", "▎", "▍", "▌", "▋", "▊", "▉"];
    if count == 0 || max == 0 {
        return String::new();
    }
    let eighths = ((count as u128 * width as u128 * 8 + max as u128 / 2) / max as u128).max(1) as usize;
    let mut s = "█".repeat(eighths / 8);
    s.push_str(PARTS[eighths % 8]);
    s
}

/// `[lower, upper)` in human units, each bound right-aligned in 7 columns.
fn range_label(b: &BucketView) -> String {
    let upper = b.upper_ns.map(human_ns).unwrap_or_else(|| "∞".into());
    format!("[{:>7}, {:>7})", human_ns(b.lower_ns), upper)
}

/// The histogram drawn in text: a title line, the summary, then one line per
/// bucket from the first to the last non-empty one, its bar scaled to the
/// fullest bucket ([`BAR_WIDTH`] characters).
pub fn render_histogram(h: &HistogramView) -> String {
    let mut out = format!("{}\n  {}\n", h.title(), h.summary());
    let max = h.buckets.iter().map(|b| b.count).max().unwrap_or(0);
    let digits = max.to_string().len();
    for b in &h.buckets {
        let bar = bar(b.count, max, BAR_WIDTH);
        out.push_str(&format!("  {}  {bar:<BAR_WIDTH$}  {:>digits$}\n", range_label(b), b.count));
    }
    out
}

/// The whole report: the monitor's state, then every histogram.
pub fn render_report(r: &LatencyReport) -> String {
    let mut out = r.state.line();
    out.push('\n');
    if r.histograms.is_empty() {
        out.push_str(if r.state.enabled {
            "no histograms yet\n"
        } else {
            "no histograms (`meshwarp latency on` starts the monitor)\n"
        });
    }
    for h in &r.histograms {
        out.push('\n');
        out.push_str(&render_histogram(h));
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn pair_ref(id: u32, client: &str, server: &str, port: u32) -> pb::RuleRef {
        pb::RuleRef {
            rule_id: id,
            rule: Some(pb::rule_ref::Rule::Pair(pb::EndpointPair {
                client_ip: client.into(),
                server: Some(pb::Endpoint { ip: server.into(), port }),
                ..Default::default()
            })),
        }
    }

    /// A histogram of `metric` at rule `id` with `(bucket, count)` samples.
    pub(crate) fn hist(
        rule: pb::RuleRef,
        metric: pb::LatencyMetric,
        from: Option<pb::RuleRef>,
        samples: &[(usize, u64)],
    ) -> pb::LatencyHistogram {
        let mut buckets = vec![0u64; 32];
        let mut sum = 0;
        for &(i, n) in samples {
            buckets[i] += n;
            sum += n * (3u64 << i) / 2;
        }
        let count: u64 = buckets.iter().sum();
        pb::LatencyHistogram {
            rule: Some(rule),
            metric: metric as i32,
            from_rule: from,
            count,
            sum_ns: sum,
            buckets,
            p50_ns: 1_500_000,
            p90_ns: 2_900_000,
            p99_ns: 3_900_000,
        }
    }

    #[test]
    fn rule_keys_on_the_command_line() {
        let p = parse_pair_key("10.0.0.1=10.0.0.2:80").unwrap();
        assert_eq!(p.client, "10.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(p.server, "10.0.0.2:80".parse::<SocketAddr>().unwrap());
        let p6 = parse_pair_key("fd00::1=[fd00::2]:8080").unwrap();
        assert_eq!(p6.server.port(), 8080);
        for bad in ["10.0.0.1", "10.0.0.1=10.0.0.2", "x=10.0.0.2:80", "10.0.0.1=fd00::2:80"] {
            assert!(parse_pair_key(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_capture_key("10.96.0.10:80").unwrap().client, None);
        let c = parse_capture_key("10.0.0.5=10.96.0.10:80").unwrap();
        assert_eq!(c.client, Some("10.0.0.5".parse().unwrap()));
        let r = parse_route_key("vpod0:egress=198.18.0.0/24").unwrap();
        assert_eq!(r.direction, pb::Direction::Egress as i32);
        assert_eq!(r.dst.as_ref().unwrap().length, 24);
        assert_eq!(parse_route_key("vpod0=198.18.0.3").unwrap().direction, pb::Direction::Ingress as i32);
        for bad in ["vpod0", "=10.0.0.0/8", "vpod0:up=10.0.0.0/8"] {
            assert!(parse_route_key(bad).is_err(), "{bad}");
        }
        let sel = RuleSelectorArgs { pairs: vec![p], captures: vec![c], routes: vec![r] }.to_pb();
        assert_eq!(sel.routes.len(), 1);
        assert_eq!(sel.pairs[0].client_ip, "10.0.0.1");
        assert_eq!(sel.pairs[0].server.as_ref().unwrap().port, 80);
        assert_eq!(sel.capture_rules[0].client_ip, "10.0.0.5");
        assert!(RuleSelectorArgs::default().to_pb().pairs.is_empty());
    }

    #[test]
    fn bucket_bounds_are_powers_of_two() {
        assert_eq!(bucket_bounds(0, 32), (0, Some(2)));
        assert_eq!(bucket_bounds(1, 32), (2, Some(4)));
        assert_eq!(bucket_bounds(20, 32), (1 << 20, Some(1 << 21)));
        assert_eq!(bucket_bounds(31, 32), (1 << 31, None));
    }

    #[test]
    fn report_keeps_the_asked_metrics_in_order() {
        let a = pair_ref(3, "10.0.0.1", "10.0.0.2", 80);
        let b = pair_ref(2, "10.0.0.2", "10.0.0.3", 80);
        let resp = pb::GetLatencyResponse {
            state: Some(pb::LatencyState { enabled: true, all_rules: true, ..Default::default() }),
            histograms: vec![
                hist(a.clone(), pb::LatencyMetric::Tcp, None, &[(10, 1)]),
                hist(a.clone(), pb::LatencyMetric::Fast, None, &[(12, 4), (14, 1)]),
                hist(a.clone(), pb::LatencyMetric::Hop, Some(b.clone()), &[(20, 2)]),
                hist(b, pb::LatencyMetric::Fast, None, &[]),
            ],
        };
        let all = LatencyReport::from_pb(&resp, &[]);
        let order: Vec<(u32, MetricArg)> = all.histograms.iter().map(|h| (h.rule_id, h.metric)).collect();
        assert_eq!(order, [(2, MetricArg::Fast), (3, MetricArg::Fast), (3, MetricArg::Tcp), (3, MetricArg::Hop)]);
        let fast = &all.histograms[1];
        // Buckets 12..=14, the empty one between kept.
        let b: Vec<(u64, Option<u64>, u64)> = fast.buckets.iter().map(|b| (b.lower_ns, b.upper_ns, b.count)).collect();
        assert_eq!(b, [(4096, Some(8192), 4), (8192, Some(16384), 0), (16384, Some(32768), 1)]);
        assert_eq!(fast.mean_ns, Some((4 * 6144 + 24576) / 5));
        assert!(all.histograms[0].buckets.is_empty());
        let hop = LatencyReport::from_pb(&resp, &[MetricArg::Hop]);
        assert_eq!(hop.histograms.len(), 1);
        assert!(hop.histograms[0].title().contains("proxy hop from rule 2 (pair 10.0.0.2 -> 10.0.0.3:80)"));
        let json = serde_json::to_value(&hop).unwrap();
        assert_eq!(json["histograms"][0]["metric"], "hop");
        assert_eq!(json["histograms"][0]["from_rule_id"], 2);
        assert_eq!(json["histograms"][0]["buckets"][0]["lower_ns"], 1 << 20);
        assert_eq!(json["state"]["all_rules"], true);
    }

    #[test]
    fn histogram_drawn_in_the_terminal() {
        let a = pair_ref(3, "10.0.0.1", "10.0.0.2", 80);
        // 1 ms .. 2 ms: 80 samples; 4 ms .. 8 ms: 20; 2 ms .. 4 ms: none.
        let h = HistogramView::from_pb(&hist(a, pb::LatencyMetric::Response, None, &[(20, 80), (22, 20)])).unwrap();
        let text = render_histogram(&h);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "rule 3 (pair 10.0.0.1 -> 10.0.0.2:80)  response (send to next read)");
        assert_eq!(lines[1], "  count 100  mean 2.5ms  p50 1.5ms  p90 2.9ms  p99 3.9ms");
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[2].starts_with("  [  1.0ms,   2.1ms)  "), "{text}");
        assert!(lines[3].starts_with("  [  2.1ms,   4.2ms)  "), "{text}");
        assert!(lines[4].starts_with("  [  4.2ms,   8.4ms)  "), "{text}");
        // The fullest bucket is BAR_WIDTH wide, the other a quarter of it,
        // the empty one has no bar; the counts line up.
        assert_eq!(lines[2].matches('█').count(), BAR_WIDTH);
        assert_eq!(lines[4].matches('█').count(), BAR_WIDTH / 4);
        assert!(!lines[3].contains('█'));
        assert!(lines[2].ends_with("  80") && lines[3].ends_with("   0") && lines[4].ends_with("  20"), "{text}");
        let ends: Vec<usize> = lines[2..].iter().map(|l| l.chars().count()).collect();
        assert!(ends.iter().all(|&e| e == ends[0]), "{text}");
        // A sliver for a bucket far below the fullest; the last bucket is open.
        assert_eq!(bar(1, 10_000, BAR_WIDTH), "▏");
        assert_eq!(range_label(&BucketView { lower_ns: 1 << 31, upper_ns: None, count: 1 }), "[   2.1s,       ∞)");
    }

    #[test]
    fn report_says_when_the_monitor_is_off() {
        let r = LatencyReport::from_pb(&pb::GetLatencyResponse::default(), &[]);
        let text = render_report(&r);
        assert!(text.starts_with("latency monitor off\n"), "{text}");
        assert!(text.contains("latency on"), "{text}");
        let on = StateView { enabled: true, rule_ids: vec![3, 7], ..Default::default() };
        assert_eq!(on.line(), "latency monitor on for rules 3, 7");
        let both = StateView { enabled: true, rule_ids: vec![3], route_ids: vec![0], ..Default::default() };
        assert_eq!(both.line(), "latency monitor on for rule 3 and route 0");
        let sampled = StateView { enabled: true, all_rules: true, sampling: "adaptive".into(), ..Default::default() };
        assert_eq!(sampled.line(), "latency monitor on for every rule, sampling adaptive");
        let every = StateView { enabled: true, rule_ids: vec![3], sampling: "every".into(), ..Default::default() };
        assert_eq!(every.line(), "latency monitor on for rule 3, every message");
    }
}
