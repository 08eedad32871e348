//! The latency monitor's histograms and the connection list.

use meshwarp_core::conns::Traffic;
use meshwarp_core::registry::RuleRef;
use meshwarp_core::tc::InstalledRoute;
use meshwarp_core::{ConnFilter, Connection, Histogram, LatencySampling, LatencyScope, Metric, PathNow, Registered};

use super::Violations;
use crate::pb;

/// The rule with counter slot `id`, as the API shows it (`found`: the
/// registry's answer; an id without a rule keeps only the id).
pub fn rule_ref_to_pb(id: u32, found: Option<(RuleRef, String)>) -> pb::RuleRef {
    let rule = found.map(|(r, owner)| match r {
        RuleRef::Pair(rule) => pb::rule_ref::Rule::Pair(super::pair_to_pb(&Registered { rule, owner })),
        RuleRef::Capture(rule) => pb::rule_ref::Rule::CaptureRule(super::capture_to_pb(&Registered { rule, owner })),
    });
    pb::RuleRef { rule_id: id, rule }
}

/// Route `id` as a latency histogram's rule (`found`: the route with that
/// id now, if any).
pub fn route_ref_to_pb(id: u32, found: Option<&InstalledRoute>) -> pb::RuleRef {
    pb::RuleRef { rule_id: id, rule: found.map(|r| pb::rule_ref::Rule::Route(super::route_to_pb(r, None))) }
}

pub fn metric_to_pb(m: Metric) -> pb::LatencyMetric {
    match m {
        Metric::Fast => pb::LatencyMetric::Fast,
        Metric::Tcp => pb::LatencyMetric::Tcp,
        Metric::Setup => pb::LatencyMetric::Setup,
        Metric::Response => pb::LatencyMetric::Response,
        Metric::Think => pb::LatencyMetric::Think,
        Metric::Hop => pb::LatencyMetric::Hop,
        Metric::Transit => pb::LatencyMetric::Transit,
    }
}

pub fn histogram_to_pb(h: &Histogram, rule: pb::RuleRef, from_rule: Option<pb::RuleRef>) -> pb::LatencyHistogram {
    let q = |x| h.quantile_ns(x).unwrap_or(0);
    pb::LatencyHistogram {
        rule: Some(rule),
        metric: metric_to_pb(h.metric).into(),
        from_rule,
        count: h.count,
        sum_ns: h.sum_ns,
        buckets: h.buckets.to_vec(),
        p50_ns: q(0.5),
        p90_ns: q(0.9),
        p99_ns: q(0.99),
    }
}

/// Where the monitor runs: for pairs and capture rules (`rules`), and for
/// interface routes (`routes`; `None` on a node without tc redirection).
pub fn latency_state_to_pb(
    rules: &LatencyScope,
    routes: Option<&LatencyScope>,
    sampling: LatencySampling,
) -> pb::LatencyState {
    let ids = |s: Option<&LatencyScope>| match s {
        Some(LatencyScope::Rules(ids)) => ids.iter().copied().collect(),
        _ => Vec::new(),
    };
    let on = |s: Option<&LatencyScope>| s.is_some_and(|s| *s != LatencyScope::Off);
    pb::LatencyState {
        enabled: on(Some(rules)) || on(routes),
        all_rules: *rules == LatencyScope::All && routes.is_none_or(|r| *r == LatencyScope::All),
        rule_ids: ids(Some(rules)),
        route_ids: ids(routes),
        sampling: sampling_to_pb(sampling).into(),
    }
}

/// The monitor's sampling, as LatencyState says it.
pub fn sampling_to_pb(s: LatencySampling) -> pb::LatencySampling {
    match s {
        LatencySampling::Adaptive => pb::LatencySampling::Adaptive,
        LatencySampling::Every => pb::LatencySampling::Every,
    }
}

/// A SetLatencyRequest's sampling: `None` keeps the node's.
pub fn sampling_from_pb(v: i32) -> Result<Option<LatencySampling>, Violations> {
    match pb::LatencySampling::try_from(v) {
        Ok(pb::LatencySampling::Unspecified) => Ok(None),
        Ok(pb::LatencySampling::Adaptive) => Ok(Some(LatencySampling::Adaptive)),
        Ok(pb::LatencySampling::Every) => Ok(Some(LatencySampling::Every)),
        Err(_) => {
            let mut bad = Violations::default();
            bad.add("sampling", format!("unknown LatencySampling {v}"));
            Err(bad)
        }
    }
}

fn path_to_pb(p: PathNow) -> pb::ConnectionPath {
    match p {
        PathNow::Fast => pb::ConnectionPath { fast: true, tcp_reason: String::new() },
        PathNow::Tcp(r) => pb::ConnectionPath { fast: false, tcp_reason: r.name().to_string() },
    }
}

fn traffic_to_pb(t: &Traffic) -> pb::ConnectionTraffic {
    pb::ConnectionTraffic {
        fast_messages: t.fast_msgs,
        fast_bytes: t.fast_bytes,
        tcp_bytes: t.tcp_bytes,
        tcp_segments: t.tcp_segs,
    }
}

pub fn connection_to_pb(c: &Connection, rule: pb::RuleRef) -> pb::Connection {
    pb::Connection {
        cookie: c.cookie,
        netns_cookie: c.netns,
        connection_id: c.conn_id,
        local: c.local.to_string(),
        remote: c.remote.to_string(),
        state: c.state_name().to_string(),
        rule: Some(rule),
        client_end: c.client_end,
        accelerated: c.accelerated,
        tx_path: Some(path_to_pb(c.tx_path)),
        rx_path: Some(path_to_pb(c.rx_path)),
        owner_pid: c.owner_pid.unwrap_or(0),
        reader_pid: c.reader_pid.unwrap_or(0),
        comm: c.comm.clone().unwrap_or_default(),
        tx: Some(traffic_to_pb(&c.tx)),
        rx: Some(traffic_to_pb(&c.rx)),
        unread_bytes: c.unread,
    }
}

/// Connections per page when the request says 0, and at most.
pub const DEFAULT_PAGE: usize = 100;
pub const MAX_PAGE: usize = 1000;

/// A ListConnections request's filter, page size and where the page
/// starts (after this cookie).
pub fn conn_query_from_pb(r: &pb::ListConnectionsRequest) -> Result<(ConnFilter, usize, Option<u64>), Violations> {
    let mut v = Violations::default();
    let port = match r.port.map(u16::try_from) {
        None => None,
        Some(Ok(p)) if p != 0 => Some(p),
        Some(_) => {
            v.add("port", format!("{} is not a port (1-65535)", r.port.unwrap_or(0)));
            None
        }
    };
    let fast = match pb::PathFilter::try_from(r.path) {
        Ok(pb::PathFilter::Unspecified) => None,
        Ok(pb::PathFilter::Fast) => Some(true),
        Ok(pb::PathFilter::Tcp) => Some(false),
        Err(_) => {
            v.add("path", format!("{} is not a PathFilter", r.path));
            None
        }
    };
    let size = match r.page_size as usize {
        0 => DEFAULT_PAGE,
        n if n > MAX_PAGE => {
            v.add("page_size", format!("{n} is more than {MAX_PAGE}"));
            0
        }
        n => n,
    };
    let after = if r.page_token.is_empty() {
        None
    } else {
        match r.page_token.parse::<u64>() {
            Ok(c) => Some(c),
            Err(_) => {
                v.add("page_token", "not a token this service returned");
                None
            }
        }
    };
    let filter = ConnFilter { rule_id: r.rule_id, netns: r.netns_cookie, pid: r.pid, cookie: r.cookie, port, fast };
    v.into_result((filter, size, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_queries_are_checked() {
        let ok = pb::ListConnectionsRequest { page_size: 5, page_token: "42".into(), ..Default::default() };
        let (f, size, after) = conn_query_from_pb(&ok).unwrap();
        assert_eq!((f, size, after), (ConnFilter::default(), 5, Some(42)));
        let bad = pb::ListConnectionsRequest {
            port: Some(70000),
            page_size: 5000,
            page_token: "x".into(),
            path: 9,
            ..Default::default()
        };
        let fields: Vec<_> = conn_query_from_pb(&bad).unwrap_err().0.into_iter().map(|v| v.field).collect();
        assert_eq!(fields, ["port", "path", "page_size", "page_token"]);
    }
}
