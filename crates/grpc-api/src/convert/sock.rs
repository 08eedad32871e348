//! Pairs, capture rules, their counters and the incidents they name.

use meshwarp_core::maps::KernelMaps;
use meshwarp_core::registry::RuleRef;
use meshwarp_core::table::Stored;
use meshwarp_core::{
    CaptureRule, EndpointPair, FastPathMode, GlobalCounters, Incident, IncidentKind, NeverRedirectInto, RuleCounters,
};
use meshwarp_core::{Registered, SockRule};

use super::{endpoint, endpoint_to_pb, ip, join, validation, Violations};
use crate::pb;
use crate::pb::watch_response::Resource;

fn pair_parts(
    v: &mut Violations,
    prefix: &str,
    client_ip: &str,
    server: Option<&pb::Endpoint>,
) -> Option<EndpointPair> {
    let client = ip(v, join(prefix, "client_ip"), client_ip);
    let server = endpoint(v, join(prefix, "server"), server);
    match EndpointPair::new(client?, server?) {
        Ok(p) => Some(p),
        Err(e) => {
            validation(v, prefix, &e);
            None
        }
    }
}

/// `never_redirect_into` from its proto form.
fn never_into(v: &mut Violations, field: String, ends: &[i32]) -> NeverRedirectInto {
    let mut n = NeverRedirectInto::NONE;
    for (i, e) in ends.iter().enumerate() {
        match pb::RuleEnd::try_from(*e) {
            Ok(pb::RuleEnd::Client) => n.client = true,
            Ok(pb::RuleEnd::Server) => n.server = true,
            _ => v.add(format!("{field}[{i}]"), format!("{e} is not RULE_END_CLIENT or RULE_END_SERVER")),
        }
    }
    n
}

/// `mode` from its proto form (unspecified: adaptive).
fn mode_from_pb(v: &mut Violations, field: String, m: i32) -> FastPathMode {
    match pb::FastPathMode::try_from(m) {
        Ok(pb::FastPathMode::Unspecified | pb::FastPathMode::Adaptive) => FastPathMode::Adaptive,
        Ok(pb::FastPathMode::Always) => FastPathMode::Always,
        Ok(pb::FastPathMode::Never) => FastPathMode::Never,
        Err(_) => {
            v.add(field, format!("{m} is not a FastPathMode"));
            FastPathMode::Adaptive
        }
    }
}

fn mode_to_pb(m: FastPathMode) -> i32 {
    (match m {
        FastPathMode::Adaptive => pb::FastPathMode::Adaptive,
        FastPathMode::Always => pb::FastPathMode::Always,
        FastPathMode::Never => pb::FastPathMode::Never,
    }) as i32
}

fn never_into_to_pb(n: NeverRedirectInto) -> Vec<i32> {
    let mut v = Vec::new();
    if n.client {
        v.push(pb::RuleEnd::Client as i32);
    }
    if n.server {
        v.push(pb::RuleEnd::Server as i32);
    }
    v
}

/// A pair from its proto form; `prefix` is its path in the request.
pub fn pair_from_pb(prefix: &str, p: Option<&pb::EndpointPair>) -> Result<EndpointPair, Violations> {
    let mut v = Violations::default();
    let Some(p) = p else {
        v.add(prefix, "required");
        return Err(v);
    };
    let pair = pair_parts(&mut v, prefix, &p.client_ip, p.server.as_ref());
    let never = never_into(&mut v, join(prefix, "never_redirect_into"), &p.never_redirect_into);
    let mode = mode_from_pb(&mut v, join(prefix, "mode"), p.mode);
    match pair {
        Some(pair) if v.is_empty() => Ok(pair.never_redirect_into(never).with_mode(mode)),
        _ => Err(v),
    }
}

/// The pair a key names.
pub fn pair_from_key(prefix: &str, k: Option<&pb::PairKey>) -> Result<EndpointPair, Violations> {
    let mut v = Violations::default();
    let Some(k) = k else {
        v.add(prefix, "required");
        return Err(v);
    };
    match pair_parts(&mut v, prefix, &k.client_ip, k.server.as_ref()) {
        Some(pair) if v.is_empty() => Ok(pair),
        _ => Err(v),
    }
}

fn capture_parts(
    v: &mut Violations,
    prefix: &str,
    client_ip: &str,
    dst: Option<&pb::Endpoint>,
    listener: Option<&pb::Endpoint>,
) -> Option<CaptureRule> {
    let client = if client_ip.is_empty() { Some(None) } else { ip(v, join(prefix, "client_ip"), client_ip).map(Some) };
    let dst = endpoint(v, join(prefix, "original_dst"), dst);
    let listener = endpoint(v, join(prefix, "listener"), listener);
    match CaptureRule::new(client?, dst?, listener?) {
        Ok(r) => Some(r),
        Err(e) => {
            validation(v, prefix, &e);
            None
        }
    }
}

pub fn capture_from_pb(prefix: &str, r: Option<&pb::CaptureRule>) -> Result<CaptureRule, Violations> {
    let mut v = Violations::default();
    let Some(r) = r else {
        v.add(prefix, "required");
        return Err(v);
    };
    let rule = capture_parts(&mut v, prefix, &r.client_ip, r.original_dst.as_ref(), r.listener.as_ref());
    let never = never_into(&mut v, join(prefix, "never_redirect_into"), &r.never_redirect_into);
    let mode = mode_from_pb(&mut v, join(prefix, "mode"), r.mode);
    match rule {
        Some(rule) if v.is_empty() => Ok(rule.never_redirect_into(never).with_mode(mode)),
        _ => Err(v),
    }
}

/// A capture rule key, completed with a placeholder listener (keys ignore it).
pub fn capture_from_key(prefix: &str, k: Option<&pb::CaptureRuleKey>) -> Result<CaptureRule, Violations> {
    let mut v = Violations::default();
    let Some(k) = k else {
        v.add(prefix, "required");
        return Err(v);
    };
    let dst = k.original_dst.clone();
    // The listener is not part of the key: reuse the destination so validation
    // of the key's own fields is all that can fail.
    match capture_parts(&mut v, prefix, &k.client_ip, dst.as_ref(), dst.as_ref()) {
        Some(rule) if v.is_empty() => Ok(rule),
        _ => Err(v),
    }
}

/// A socket rule kind as the API carries it: its message, its key message
/// and its Watch resource. The node service's bodies for pairs and capture
/// rules are written once over it.
pub trait RulePb: SockRule + Stored<KernelMaps> {
    type Pb: Clone;
    type PbKey;
    fn from_pb(field: &str, p: Option<&Self::Pb>) -> Result<Self, Violations>;
    fn from_key(field: &str, k: Option<&Self::PbKey>) -> Result<Self, Violations>;
    fn to_pb(r: &Registered<Self>) -> Self::Pb;
    fn resource(p: Self::Pb) -> Resource;
}

impl RulePb for EndpointPair {
    type Pb = pb::EndpointPair;
    type PbKey = pb::PairKey;
    fn from_pb(field: &str, p: Option<&Self::Pb>) -> Result<Self, Violations> {
        pair_from_pb(field, p)
    }
    fn from_key(field: &str, k: Option<&Self::PbKey>) -> Result<Self, Violations> {
        pair_from_key(field, k)
    }
    fn to_pb(r: &Registered<Self>) -> Self::Pb {
        pair_to_pb(r)
    }
    fn resource(p: Self::Pb) -> Resource {
        Resource::Pair(p)
    }
}

impl RulePb for CaptureRule {
    type Pb = pb::CaptureRule;
    type PbKey = pb::CaptureRuleKey;
    fn from_pb(field: &str, p: Option<&Self::Pb>) -> Result<Self, Violations> {
        capture_from_pb(field, p)
    }
    fn from_key(field: &str, k: Option<&Self::PbKey>) -> Result<Self, Violations> {
        capture_from_key(field, k)
    }
    fn to_pb(r: &Registered<Self>) -> Self::Pb {
        capture_to_pb(r)
    }
    fn resource(p: Self::Pb) -> Resource {
        Resource::CaptureRule(p)
    }
}

pub fn pair_to_pb(r: &Registered<EndpointPair>) -> pb::EndpointPair {
    pb::EndpointPair {
        client_ip: r.rule.client().to_string(),
        server: Some(endpoint_to_pb(r.rule.server())),
        owner: r.owner.clone(),
        never_redirect_into: never_into_to_pb(r.rule.never_into()),
        mode: mode_to_pb(r.rule.mode()),
    }
}

pub fn pair_key_to_pb(p: &EndpointPair) -> pb::PairKey {
    pb::PairKey { client_ip: p.client().to_string(), server: Some(endpoint_to_pb(p.server())) }
}

pub fn capture_to_pb(r: &Registered<CaptureRule>) -> pb::CaptureRule {
    pb::CaptureRule {
        client_ip: r.rule.client().map(|c| c.to_string()).unwrap_or_default(),
        original_dst: Some(endpoint_to_pb(r.rule.original_dst())),
        listener: Some(endpoint_to_pb(r.rule.listener())),
        owner: r.owner.clone(),
        never_redirect_into: never_into_to_pb(r.rule.never_into()),
        mode: mode_to_pb(r.rule.mode()),
    }
}

pub fn capture_key_to_pb(r: &CaptureRule) -> pb::CaptureRuleKey {
    pb::CaptureRuleKey {
        client_ip: r.client().map(|c| c.to_string()).unwrap_or_default(),
        original_dst: Some(endpoint_to_pb(r.original_dst())),
    }
}

pub fn counters_to_pb(c: &RuleCounters) -> pb::RuleCounters {
    pb::RuleCounters {
        sockets: c.sockets,
        redirected_msgs: c.redirected_msgs,
        redirected_bytes: c.redirected_bytes,
        fallback_no_peer: c.fallback_no_peer,
        fallback_tcp_path: c.fallback_tcp_path,
        fallback_map_full: c.fallback_map_full,
        fallback_insert_error: c.fallback_insert_error,
        fallback_collision: c.fallback_collision,
        fallback_reader: c.fallback_reader,
        fallback_splice: c.fallback_splice,
        fallback_rcvlowat: c.fallback_rcvlowat,
        fallback_ulp: c.fallback_ulp,
        ulp_refused: c.ulp_refused,
        splice_hits: c.splice_hits,
        demotions_coalesce: c.demotions_coalesce,
        promotions: c.promotions,
        policy_tcp_msgs: c.policy_tcp_msgs,
        fallback_mode_never: c.fallback_mode_never,
        unlinks: c.unlinks,
        relinks: c.relinks,
        demotions_behind: c.demotions_behind,
        fallback_reader_busy: c.fallback_reader_busy,
        reader_wakeups: c.reader_wakeups,
        tgtmap_clients: c.tgtmap_clients,
        hint_stale: c.hint_stale,
        fallback_urgent: c.fallback_urgent,
        urgent_hits: c.urgent_hits,
        fallback_zerocopy: c.fallback_zerocopy,
        zerocopy_refused: c.zerocopy_refused,
        fallback_peek_off: c.fallback_peek_off,
        peek_off_refused: c.peek_off_refused,
        fallback_short: c.fallback_short,
        demotions_around: c.demotions_around,
    }
}

pub fn global_to_pb(g: &GlobalCounters) -> pb::GlobalCounters {
    pb::GlobalCounters {
        established: g.established,
        not_covered: g.not_covered,
        no_state: g.no_state,
        no_link: g.no_link,
        no_slot: g.no_slot,
        slots_stale: g.slots_stale,
    }
}

/// An incident, with the rule that covers its connection (and its owner)
/// when that is still registered.
pub fn incident_to_pb(i: &Incident, rule: Option<(RuleRef, String)>) -> pb::Incident {
    let kind = match i.kind {
        IncidentKind::SpliceHit => pb::IncidentKind::SpliceHit,
        IncidentKind::SpliceSeen => pb::IncidentKind::SpliceSeen,
        IncidentKind::UrgentHit => pb::IncidentKind::UrgentHit,
    };
    pb::Incident {
        kind: kind as i32,
        pid: i.pid,
        tgid: i.tgid,
        comm: i.comm.clone(),
        exe: i.exe.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        client: i.client.map(|a| endpoint_to_pb(a.into())),
        server: i.server.map(|a| endpoint_to_pb(a.into())),
        pending_bytes: i.pending_bytes,
        reset: i.reset,
        detail: i.detail.clone(),
        rule: rule.map(|(r, owner)| match r {
            RuleRef::Pair(p) => pb::incident::Rule::Pair(pair_to_pb(&Registered { rule: p, owner })),
            RuleRef::Capture(c) => pb::incident::Rule::CaptureRule(capture_to_pb(&Registered { rule: c, owner })),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ip: &str, port: u32) -> Option<pb::Endpoint> {
        Some(pb::Endpoint { ip: ip.into(), port })
    }

    fn fields(v: &Violations) -> Vec<&str> {
        v.0.iter().map(|x| x.field.as_str()).collect()
    }

    #[test]
    fn pair_round_trip() {
        let p = pb::EndpointPair {
            client_ip: "198.18.0.2".into(),
            server: ep("198.18.0.3", 80),
            owner: "o".into(),
            never_redirect_into: vec![pb::RuleEnd::Server as i32],
            mode: pb::FastPathMode::Always as i32,
        };
        let pair = pair_from_pb("pair", Some(&p)).unwrap();
        assert!(pair.never_into().server && !pair.never_into().client);
        assert_eq!(pair.mode(), FastPathMode::Always);
        let back = pair_to_pb(&Registered { rule: pair, owner: "o".into() });
        assert_eq!(back, p);
        assert_eq!(pair_from_key("key", Some(&pair_key_to_pb(&pair))).unwrap().key(), pair.key());
        let unspecified = pb::EndpointPair { mode: 0, ..p.clone() };
        assert_eq!(pair_from_pb("pair", Some(&unspecified)).unwrap().mode(), FastPathMode::Adaptive);
        let bad = pb::EndpointPair { never_redirect_into: vec![0, 7], mode: 9, ..p };
        let v = pair_from_pb("pair", Some(&bad)).unwrap_err();
        assert_eq!(fields(&v), vec!["pair.never_redirect_into[0]", "pair.never_redirect_into[1]", "pair.mode"]);
    }

    #[test]
    fn violations_name_proto_fields() {
        let cases = [
            (
                pb::EndpointPair { client_ip: "nope".into(), server: ep("198.18.0.3", 80), ..Default::default() },
                "pair.client_ip",
            ),
            (
                pb::EndpointPair { client_ip: "198.18.0.2".into(), server: ep("198.18.0.3", 0), ..Default::default() },
                "pair.server.port",
            ),
            (
                pb::EndpointPair {
                    client_ip: "198.18.0.2".into(),
                    server: ep("198.18.0.3", 65536),
                    ..Default::default()
                },
                "pair.server.port",
            ),
            (
                pb::EndpointPair {
                    client_ip: "198.18.0.2".into(),
                    server: ep("2001:db8::1", 80),
                    ..Default::default()
                },
                "pair.server.ip",
            ),
            (
                pb::EndpointPair { client_ip: "0.0.0.0".into(), server: ep("198.18.0.3", 80), ..Default::default() },
                "pair.client_ip",
            ),
            (pb::EndpointPair { client_ip: "198.18.0.2".into(), server: None, ..Default::default() }, "pair.server"),
        ];
        for (p, want) in cases {
            let v = pair_from_pb("pair", Some(&p)).unwrap_err();
            assert_eq!(fields(&v), vec![want], "{p:?}: {v:?}");
        }
        // Everything wrong at once is reported at once.
        let p = pb::EndpointPair { client_ip: "x".into(), server: ep("y", 70000), ..Default::default() };
        let v = pair_from_pb("pair", Some(&p)).unwrap_err();
        assert_eq!(fields(&v), vec!["pair.client_ip", "pair.server.ip", "pair.server.port"]);
    }

    #[test]
    fn capture_rules() {
        let r = pb::CaptureRule {
            client_ip: String::new(),
            original_dst: ep("198.19.0.10", 80),
            listener: ep("127.0.0.1", 15001),
            owner: "o".into(),
            never_redirect_into: vec![],
            mode: pb::FastPathMode::Adaptive as i32,
        };
        let rule = capture_from_pb("rule", Some(&r)).unwrap();
        assert_eq!(rule.client(), None);
        assert_eq!(capture_to_pb(&Registered { rule, owner: "o".into() }), r);
        let bad = pb::CaptureRule { listener: ep("::1", 15001), ..r };
        assert_eq!(fields(&capture_from_pb("rule", Some(&bad)).unwrap_err()), vec!["rule.listener.ip"]);
        assert_eq!(capture_from_key("key", Some(&capture_key_to_pb(&rule))).unwrap().key(), rule.key());
    }
}
