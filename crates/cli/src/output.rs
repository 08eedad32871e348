//! What the table output of every client command shares: the plain table
//! style, human units (durations in ns/µs/ms/s, byte counts and rates) and
//! how an endpoint and a rule ([`pb::RuleRef`]) are written.

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};
use meshwarp_grpc_api::pb;

/// A plain table: no borders, each column as wide as its widest cell (an
/// IPv6 endpoint widens its column instead of shifting the row); the
/// columns named in `right` (numbers) aligned right.
pub fn table(header: &[&str], right: &[usize]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING).set_content_arrangement(ContentArrangement::Disabled).set_header(header.to_vec());
    for &i in right {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    // Rows start at the margin, as the hand-padded tables did.
    if let Some(c) = t.column_mut(0) {
        c.set_padding((0, 1));
    }
    t
}

/// `v` scaled down by `step` until it is below 1000 of its unit (one
/// decimal; rounding never shows "1000.0" of a unit when the next fits).
fn scaled(v: f64, step: f64, units: &[&str]) -> String {
    let mut x = v;
    let mut u = 0;
    while u + 1 < units.len() && (x * 10.0).round() / 10.0 >= 1000.0 {
        x /= step;
        u += 1;
    }
    format!("{x:.1}{}", units[u])
}

/// A duration in nanoseconds in the unit that suits it: `512ns`, `1.0µs`,
/// `2.1ms`, `4.3s`.
pub fn human_ns(ns: u64) -> String {
    if ns < 1000 {
        return format!("{ns}ns");
    }
    scaled(ns as f64 / 1000.0, 1000.0, &["µs", "ms", "s"])
}

/// A byte count: `512B`, `1.5KiB`, `3.2MiB`, `1.1GiB`.
pub fn human_bytes(n: u64) -> String {
    if n < 1024 {
        return format!("{n}B");
    }
    scaled(n as f64 / 1024.0, 1024.0, &["KiB", "MiB", "GiB", "TiB", "PiB"])
}

/// A rate in bytes per second: `0B/s`, `1.2MiB/s`.
pub fn human_rate(bytes_per_s: f64) -> String {
    let b = bytes_per_s.max(0.0);
    if b < 1024.0 {
        return format!("{}B/s", b.round() as u64);
    }
    format!("{}/s", scaled(b / 1024.0, 1024.0, &["KiB", "MiB", "GiB", "TiB", "PiB"]))
}

/// A count per second: `0/s`, `12/s`, `1.5k/s`, `2.0M/s`.
pub fn human_per_s(per_s: f64) -> String {
    let r = per_s.max(0.0);
    if r < 1000.0 {
        return format!("{}/s", r.round() as u64);
    }
    format!("{}/s", scaled(r / 1000.0, 1000.0, &["k", "M", "G", "T"]))
}

/// `ip:port`, `[ip6]:port`, or `-`.
pub fn show_endpoint(e: &Option<pb::Endpoint>) -> String {
    match e {
        Some(e) if e.ip.contains(':') => format!("[{}]:{}", e.ip, e.port),
        Some(e) => format!("{}:{}", e.ip, e.port),
        None => "-".into(),
    }
}

/// What a rule is, as `stats` names it: `pair 10.0.0.1 -> 10.0.0.2:80` or
/// `capture -> 10.96.0.10:80 at 127.0.0.1:15001` (with `from CLIENT` when
/// the capture rule has one); empty when the node knows only the id.
pub fn rule_description(r: &pb::RuleRef) -> String {
    match &r.rule {
        Some(pb::rule_ref::Rule::Pair(p)) => format!("pair {} -> {}", p.client_ip, show_endpoint(&p.server)),
        Some(pb::rule_ref::Rule::CaptureRule(c)) => {
            let from = if c.client_ip.is_empty() { String::new() } else { format!(" from {}", c.client_ip) };
            format!("capture -> {} at {}{from}", show_endpoint(&c.original_dst), show_endpoint(&c.listener))
        }
        Some(pb::rule_ref::Rule::Route(r)) => format!("route {}", show_route(r)),
        None => String::new(),
    }
}

/// `rule 3 (pair 10.0.0.1 -> 10.0.0.2:80)`, or `rule 3` when the rule is
/// known only by its id.
pub fn rule_name(r: &pb::RuleRef) -> String {
    match rule_description(r) {
        d if d.is_empty() => format!("rule {}", r.rule_id),
        d => format!("rule {} ({d})", r.rule_id),
    }
}

/// An interface by name, or by index when `name` is a number.
pub fn iface(name: &str) -> Option<pb::Interface> {
    let r = match name.parse::<u32>() {
        Ok(i) => pb::interface::Ref::Index(i),
        Err(_) => pb::interface::Ref::Name(name.to_string()),
    };
    Some(pb::Interface { r#ref: Some(r) })
}

/// An interface as a table shows it: its name, or `#index`.
pub fn show_iface(i: &Option<pb::Interface>) -> String {
    match i.as_ref().and_then(|i| i.r#ref.as_ref()) {
        Some(pb::interface::Ref::Name(n)) => n.clone(),
        Some(pb::interface::Ref::Index(x)) => format!("#{x}"),
        None => "-".into(),
    }
}

/// The tc hook: egress, else ingress.
pub fn dir(egress: bool) -> i32 {
    if egress {
        pb::Direction::Egress as i32
    } else {
        pb::Direction::Ingress as i32
    }
}

/// "198.18.2.0/24" into a prefix (the server validates the parts).
pub fn prefix(s: &str) -> Option<pb::IpPrefix> {
    let (ip, len) = s.split_once('/').unwrap_or((s, ""));
    let length = len.parse().unwrap_or(if ip.contains(':') { 128 } else { 32 });
    Some(pb::IpPrefix { ip: ip.to_string(), length })
}

/// A route in one line: `IFACE DIR DST -> ACTION TARGET ...`.
pub fn show_route(r: &pb::InterfaceRoute) -> String {
    let d = if r.direction == pb::Direction::Egress as i32 { "egress" } else { "ingress" };
    let a = pb::RouteAction::try_from(r.action).map(|a| a.as_str_name()).unwrap_or("?");
    let dst = r.dst.as_ref().map(|p| format!("{}/{}", p.ip, p.length)).unwrap_or_default();
    format!(
        "{} {d} {dst} -> {} {}",
        show_iface(&r.attach),
        a.trim_start_matches("ROUTE_ACTION_"),
        show_iface(&r.target)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_human_units() {
        let cases = [
            (0, "0ns"),
            (1, "1ns"),
            (999, "999ns"),
            (1000, "1.0µs"),
            (1024, "1.0µs"),
            (524_288, "524.3µs"),
            (999_949, "999.9µs"),
            // Rounds up to the next unit rather than "1000.0µs".
            (999_960, "1.0ms"),
            (1_048_576, "1.0ms"),
            (2_097_152, "2.1ms"),
            (1_000_000_000, "1.0s"),
            (4_294_967_296, "4.3s"),
            (65_000_000_000, "65.0s"),
            (5_000_000_000_000, "5000.0s"),
        ];
        for (ns, want) in cases {
            assert_eq!(human_ns(ns), want, "{ns} ns");
        }
    }

    #[test]
    fn bytes_and_rates_in_human_units() {
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(1023), "1023B");
        assert_eq!(human_bytes(1536), "1.5KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 + 200 * 1024), "3.2MiB");
        assert_eq!(human_bytes(1024 * 1024 - 1), "1.0MiB");
        assert_eq!(human_rate(-5.0), "0B/s");
        assert_eq!(human_rate(100.4), "100B/s");
        assert_eq!(human_rate(1.25 * 1024.0 * 1024.0), "1.2MiB/s");
        assert_eq!(human_per_s(12.0), "12/s");
        assert_eq!(human_per_s(1500.0), "1.5k/s");
    }

    #[test]
    fn rules_by_name() {
        let pair = pb::RuleRef {
            rule_id: 3,
            rule: Some(pb::rule_ref::Rule::Pair(pb::EndpointPair {
                client_ip: "10.0.0.1".into(),
                server: Some(pb::Endpoint { ip: "fd00::2".into(), port: 80 }),
                ..Default::default()
            })),
        };
        assert_eq!(rule_name(&pair), "rule 3 (pair 10.0.0.1 -> [fd00::2]:80)");
        let capture = pb::RuleRef {
            rule_id: 4,
            rule: Some(pb::rule_ref::Rule::CaptureRule(pb::CaptureRule {
                original_dst: Some(pb::Endpoint { ip: "10.96.0.10".into(), port: 80 }),
                listener: Some(pb::Endpoint { ip: "127.0.0.1".into(), port: 15001 }),
                ..Default::default()
            })),
        };
        assert_eq!(rule_description(&capture), "capture -> 10.96.0.10:80 at 127.0.0.1:15001");
        assert_eq!(rule_name(&pb::RuleRef { rule_id: 9, rule: None }), "rule 9");
    }
}
