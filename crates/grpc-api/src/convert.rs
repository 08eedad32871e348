//! Proto <-> core conversions. Parsing collects every field violation with its
//! proto path, so a client learns all that is wrong with a request at once.

use std::net::IpAddr;

use meshwarp_core::maps::KernelMaps;
use meshwarp_core::registry::RuleRef;
use meshwarp_core::table::Stored;
use meshwarp_core::{
    CaptureRule, Endpoint, EndpointPair, FastPathMode, GlobalCounters, Incident, IncidentKind, NeverRedirectInto,
    RuleCounters, ValidationError,
};
use meshwarp_core::{Registered, SockRule};

use crate::pb;
use crate::pb::watch_response::Resource;

/// A field that is wrong, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub field: String,
    pub description: String,
}

/// Every violation found in one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Violations(pub Vec<Violation>);

impl Violations {
    pub fn add(&mut self, field: impl Into<String>, description: impl Into<String>) {
        self.0.push(Violation { field: field.into(), description: description.into() });
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `Ok(v)` if nothing was wrong.
    pub fn into_result<T>(self, v: T) -> Result<T, Violations> {
        if self.0.is_empty() {
            Ok(v)
        } else {
            Err(self)
        }
    }
}

fn join(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_string()
    } else {
        format!("{prefix}.{field}")
    }
}

fn ip(v: &mut Violations, field: String, s: &str) -> Option<IpAddr> {
    if s.is_empty() {
        v.add(field, "required");
        return None;
    }
    match s.parse() {
        Ok(ip) => Some(ip),
        Err(_) => {
            v.add(field, format!("{s:?} is not an IPv4 or IPv6 address"));
            None
        }
    }
}

fn endpoint(v: &mut Violations, field: String, e: Option<&pb::Endpoint>) -> Option<Endpoint> {
    let Some(e) = e else {
        v.add(field, "required");
        return None;
    };
    let addr = ip(v, join(&field, "ip"), &e.ip);
    let port = match u16::try_from(e.port) {
        Ok(p) => Some(p),
        Err(_) => {
            v.add(join(&field, "port"), format!("{} is not a port (1-65535)", e.port));
            None
        }
    };
    Some(Endpoint::new(addr?, port?))
}

/// Maps a core validation error to the proto field it concerns. Core names
/// the endpoint ("server", "listener", ...) or "client"; the proto calls the
/// latter `client_ip` and an endpoint's address `<endpoint>.ip`.
fn validation(v: &mut Violations, prefix: &str, e: &ValidationError) {
    let addr_field = |core: &str| match core {
        "client" => "client_ip".to_string(),
        endpoint => format!("{endpoint}.ip"),
    };
    let field = match e {
        ValidationError::PortZero { field } => format!("{field}.port"),
        ValidationError::Unspecified { field, .. }
        | ValidationError::Multicast { field, .. }
        | ValidationError::Broadcast { field, .. }
        | ValidationError::V4Mapped { field, .. } => addr_field(field),
        ValidationError::MixedFamilies { b_field, .. } => addr_field(b_field),
        ValidationError::Mode(_) => "mode".to_string(),
    };
    v.add(join(prefix, &field), e.to_string());
}

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

/// Checks the owner of a mutating request.
pub fn owner(v: &mut Violations, field: &str, owner: &str) {
    if owner.is_empty() {
        v.add(field, "required: the controller that owns the resource");
    } else if owner.len() >= meshwarp_bpf::shared::OWNER_LEN {
        v.add(field, format!("at most {} bytes", meshwarp_bpf::shared::OWNER_LEN - 1));
    } else if owner.chars().any(|c| c.is_control()) {
        v.add(field, "control characters are not allowed");
    }
}

pub fn endpoint_to_pb(e: Endpoint) -> pb::Endpoint {
    pb::Endpoint { ip: e.addr.to_string(), port: u32::from(e.port) }
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

    #[test]
    fn owners() {
        for (o, bad) in [("istio", false), ("", true), ("a\nb", true)] {
            let mut v = Violations::default();
            owner(&mut v, "owner", o);
            assert_eq!(!v.is_empty(), bad, "{o:?}");
        }
        let mut v = Violations::default();
        owner(&mut v, "owner", &"x".repeat(64));
        assert!(!v.is_empty());
    }
}

// ---- interface routes ----

use meshwarp_core::tc::{self, Direction, IfaceRef, InstalledRoute, MacRewrite, Prefix, RouteAction};

fn iface(v: &mut Violations, field: String, i: Option<&pb::Interface>) -> Option<IfaceRef> {
    match i.and_then(|i| i.r#ref.as_ref()) {
        Some(pb::interface::Ref::Name(n)) if !n.is_empty() && n.len() < 16 => Some(IfaceRef::Name(n.clone())),
        Some(pb::interface::Ref::Name(n)) => {
            v.add(field, format!("{n:?} is not an interface name (1-15 bytes)"));
            None
        }
        Some(pb::interface::Ref::Index(i)) if *i > 0 => Some(IfaceRef::Index(*i)),
        Some(pb::interface::Ref::Index(_)) => {
            v.add(field, "ifindex 0 names no interface");
            None
        }
        None => {
            v.add(field, "required: an interface name or index");
            None
        }
    }
}

fn direction(v: &mut Violations, field: String, d: i32) -> Option<Direction> {
    match pb::Direction::try_from(d) {
        Ok(pb::Direction::Ingress) => Some(Direction::Ingress),
        Ok(pb::Direction::Egress) => Some(Direction::Egress),
        Ok(pb::Direction::Unspecified) => {
            v.add(field, "required: DIRECTION_INGRESS or DIRECTION_EGRESS");
            None
        }
        Err(_) => {
            v.add(field, format!("unknown enum value {d}"));
            None
        }
    }
}

fn prefix(v: &mut Violations, field: String, p: Option<&pb::IpPrefix>) -> Option<Prefix> {
    let Some(p) = p else {
        v.add(field, "required");
        return None;
    };
    let addr = ip(v, join(&field, "ip"), &p.ip)?;
    let Ok(len) = u8::try_from(p.length) else {
        v.add(join(&field, "length"), format!("{} is not a prefix length", p.length));
        return None;
    };
    match Prefix::new("dst", addr, len) {
        Ok(p) => Some(p),
        Err(e) => {
            v.add(join(&field, "length"), e.to_string());
            None
        }
    }
}

fn mac(v: &mut Violations, field: String, s: &str) -> Option<[u8; 6]> {
    let parts: Vec<_> = s.split(':').collect();
    let mut out = [0u8; 6];
    if parts.len() == 6
        && parts.iter().zip(out.iter_mut()).all(|(p, o)| u8::from_str_radix(p, 16).map(|b| *o = b).is_ok())
    {
        return Some(out);
    }
    v.add(field, format!("{s:?} is not a MAC address (aa:bb:cc:dd:ee:ff)"));
    None
}

fn show_mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// A route from its proto form; `prefix` is its path in the request.
pub fn route_from_pb(prefix_path: &str, r: Option<&pb::InterfaceRoute>) -> Result<tc::InterfaceRoute, Violations> {
    let mut v = Violations::default();
    let Some(r) = r else {
        v.add(prefix_path, "required");
        return Err(v);
    };
    let f = |name: &str| join(prefix_path, name);
    let attach = iface(&mut v, f("attach"), r.attach.as_ref());
    let dir = direction(&mut v, f("direction"), r.direction);
    let dst = prefix(&mut v, f("dst"), r.dst.as_ref());
    let src = r.src.as_ref().map(|s| prefix(&mut v, f("src"), Some(s)));
    let target = iface(&mut v, f("target"), r.target.as_ref());
    let next_hop = if r.next_hop.is_empty() { Some(None) } else { ip(&mut v, f("next_hop"), &r.next_hop).map(Some) };
    let rewrite = match &r.rewrite {
        None => Some(None),
        Some(m) => match (mac(&mut v, f("rewrite.src"), &m.src), mac(&mut v, f("rewrite.dst"), &m.dst)) {
            (Some(src), Some(dst)) => Some(Some(MacRewrite { src, dst })),
            _ => None,
        },
    };
    let action = match pb::RouteAction::try_from(r.action) {
        Ok(pb::RouteAction::Redirect) => target.clone().map(RouteAction::Redirect),
        Ok(pb::RouteAction::RedirectPeer) => target.clone().map(RouteAction::RedirectPeer),
        Ok(pb::RouteAction::RedirectNeigh) => {
            target.clone().and_then(|t| next_hop.map(|nh| RouteAction::RedirectNeigh { to: t, next_hop: nh }))
        }
        Ok(pb::RouteAction::Unspecified) => {
            v.add(f("action"), "required: ROUTE_ACTION_REDIRECT, _REDIRECT_PEER or _REDIRECT_NEIGH");
            None
        }
        Err(_) => {
            v.add(f("action"), format!("unknown enum value {}", r.action));
            None
        }
    };
    if !r.next_hop.is_empty() && r.action != pb::RouteAction::RedirectNeigh as i32 {
        v.add(f("next_hop"), "only ROUTE_ACTION_REDIRECT_NEIGH takes a next hop");
    }
    let (Some(attach), Some(direction), Some(dst), Some(action), Some(rewrite)) = (attach, dir, dst, action, rewrite)
    else {
        return Err(v);
    };
    let src = match src {
        None => None,
        Some(Some(s)) => Some(s),
        Some(None) => return Err(v),
    };
    let route = tc::InterfaceRoute { attach, direction, dst, src, action, rewrite };
    if let Err(e) = route.validate() {
        let field = match e {
            tc::RouteError::PeerOnEgress => f("direction"),
            tc::RouteError::MixedFamilies(_) => f("src"),
            _ => f("dst"),
        };
        v.add(field, e.to_string());
    }
    v.into_result(route)
}

/// The (attach point, direction, destination) a key names.
pub fn route_key_from_pb(
    prefix_path: &str,
    k: Option<&pb::RouteKey>,
) -> Result<(IfaceRef, Direction, Prefix), Violations> {
    let mut v = Violations::default();
    let Some(k) = k else {
        v.add(prefix_path, "required");
        return Err(v);
    };
    let a = iface(&mut v, join(prefix_path, "attach"), k.attach.as_ref());
    let d = direction(&mut v, join(prefix_path, "direction"), k.direction);
    let p = prefix(&mut v, join(prefix_path, "dst"), k.dst.as_ref());
    match (a, d, p) {
        (Some(a), Some(d), Some(p)) if v.is_empty() => Ok((a, d, p)),
        _ => Err(v),
    }
}

/// Parses an interface reference (for attach/detach).
pub fn iface_from_pb(field: &str, i: Option<&pb::Interface>) -> Result<IfaceRef, Violations> {
    let mut v = Violations::default();
    let r = iface(&mut v, field.to_string(), i);
    match r {
        Some(r) => Ok(r),
        None => Err(v),
    }
}

pub fn direction_from_pb(field: &str, d: i32) -> Result<Direction, Violations> {
    let mut v = Violations::default();
    direction(&mut v, field.to_string(), d).ok_or(v)
}

pub fn direction_to_pb(d: Direction) -> i32 {
    match d {
        Direction::Ingress => pb::Direction::Ingress as i32,
        Direction::Egress => pb::Direction::Egress as i32,
    }
}

fn iface_to_pb(i: &IfaceRef) -> pb::Interface {
    pb::Interface {
        r#ref: Some(match i {
            IfaceRef::Name(n) => pb::interface::Ref::Name(n.clone()),
            IfaceRef::Index(x) => pb::interface::Ref::Index(*x),
        }),
    }
}

fn prefix_to_pb(p: &Prefix) -> pb::IpPrefix {
    pb::IpPrefix { ip: p.addr().to_string(), length: u32::from(p.len()) }
}

pub fn route_to_pb(r: &InstalledRoute, stale: Option<&str>) -> pb::InterfaceRoute {
    let (action, target, next_hop) = match &r.route.action {
        RouteAction::Redirect(t) => (pb::RouteAction::Redirect, t, None),
        RouteAction::RedirectPeer(t) => (pb::RouteAction::RedirectPeer, t, None),
        RouteAction::RedirectNeigh { to, next_hop } => (pb::RouteAction::RedirectNeigh, to, *next_hop),
    };
    pb::InterfaceRoute {
        attach: Some(iface_to_pb(&r.route.attach)),
        direction: direction_to_pb(r.route.direction),
        dst: Some(prefix_to_pb(&r.route.dst)),
        src: r.route.src.as_ref().map(prefix_to_pb),
        action: action as i32,
        target: Some(iface_to_pb(target)),
        next_hop: next_hop.map(|n| n.to_string()).unwrap_or_default(),
        rewrite: r.route.rewrite.map(|m| pb::MacRewrite { src: show_mac(m.src), dst: show_mac(m.dst) }),
        owner: r.owner.clone(),
        attach_ifindex: r.attach_ifindex,
        target_ifindex: r.target_ifindex,
        stale: stale.is_some(),
        stale_reason: stale.unwrap_or_default().to_string(),
    }
}

#[cfg(test)]
mod route_tests {
    use super::*;

    fn good() -> pb::InterfaceRoute {
        pb::InterfaceRoute {
            attach: Some(pb::Interface { r#ref: Some(pb::interface::Ref::Name("vpod0".into())) }),
            direction: pb::Direction::Ingress as i32,
            dst: Some(pb::IpPrefix { ip: "198.18.2.0".into(), length: 24 }),
            action: pb::RouteAction::Redirect as i32,
            target: Some(pb::Interface { r#ref: Some(pb::interface::Ref::Name("vxlan0".into())) }),
            rewrite: Some(pb::MacRewrite { src: "02:00:00:00:00:01".into(), dst: "02:00:00:00:00:02".into() }),
            ..Default::default()
        }
    }

    fn fields(r: pb::InterfaceRoute) -> Vec<String> {
        route_from_pb("route", Some(&r)).unwrap_err().0.into_iter().map(|v| v.field).collect()
    }

    #[test]
    fn routes_round_trip_and_violations_name_fields() {
        let r = route_from_pb("route", Some(&good())).unwrap();
        assert_eq!(r.rewrite.unwrap().dst, [2, 0, 0, 0, 0, 2]);
        assert_eq!(fields(pb::InterfaceRoute { direction: 7, ..good() }), vec!["route.direction"]);
        assert_eq!(fields(pb::InterfaceRoute { action: 9, ..good() }), vec!["route.action"]);
        assert_eq!(fields(pb::InterfaceRoute { direction: 0, ..good() }), vec!["route.direction"]);
        assert_eq!(
            fields(pb::InterfaceRoute { dst: Some(pb::IpPrefix { ip: "198.18.2.0".into(), length: 33 }), ..good() }),
            vec!["route.dst.length"]
        );
        assert_eq!(
            fields(pb::InterfaceRoute {
                rewrite: Some(pb::MacRewrite { src: "zz".into(), dst: "02:00:00:00:00:02".into() }),
                ..good()
            }),
            vec!["route.rewrite.src"]
        );
        assert_eq!(
            fields(pb::InterfaceRoute { src: Some(pb::IpPrefix { ip: "2001:db8::".into(), length: 64 }), ..good() }),
            vec!["route.src"]
        );
        assert_eq!(
            fields(pb::InterfaceRoute {
                direction: pb::Direction::Egress as i32,
                action: pb::RouteAction::RedirectPeer as i32,
                ..good()
            }),
            vec!["route.direction"]
        );
        assert_eq!(fields(pb::InterfaceRoute { next_hop: "198.18.255.2".into(), ..good() }), vec!["route.next_hop"]);
        assert_eq!(fields(pb::InterfaceRoute { attach: None, ..good() }), vec!["route.attach"]);
    }
}

// ---- plugins ----

use meshwarp_core::plugin::{hex, PluginCounters, PluginInfo};
use meshwarp_core::{FailurePolicy, Hook, Phase, PluginManifest};

pub fn hook_to_pb(h: Hook) -> i32 {
    (match h {
        Hook::Connection => pb::PluginHook::Connection,
        Hook::Message => pb::PluginHook::Message,
        Hook::Packet => pb::PluginHook::Packet,
    }) as i32
}

fn phase_to_pb(p: Phase) -> i32 {
    (match p {
        Phase::Authn => pb::PluginPhase::Authn,
        Phase::Authz => pb::PluginPhase::Authz,
        Phase::Stats => pb::PluginPhase::Stats,
        Phase::Unspecified => pb::PluginPhase::Unspecified,
    }) as i32
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A manifest from the wire; every violation under `field`.
pub fn manifest_from_pb(field: &str, m: Option<&pb::PluginManifest>) -> Result<PluginManifest, Violations> {
    let mut v = Violations::default();
    let Some(m) = m else {
        v.add(field, "required");
        return Err(v);
    };
    let hook = match pb::PluginHook::try_from(m.hook) {
        Ok(pb::PluginHook::Connection) => Some(Hook::Connection),
        Ok(pb::PluginHook::Message) => Some(Hook::Message),
        Ok(pb::PluginHook::Packet) => Some(Hook::Packet),
        Ok(pb::PluginHook::Unspecified) => {
            v.add(join(field, "hook"), "required");
            None
        }
        Err(_) => {
            v.add(join(field, "hook"), format!("unknown hook {}", m.hook));
            None
        }
    };
    let phase = match pb::PluginPhase::try_from(m.phase) {
        Ok(pb::PluginPhase::Authn) => Phase::Authn,
        Ok(pb::PluginPhase::Authz) => Phase::Authz,
        Ok(pb::PluginPhase::Stats) => Phase::Stats,
        Ok(pb::PluginPhase::Unspecified) => Phase::Unspecified,
        Err(_) => {
            v.add(join(field, "phase"), format!("unknown phase {}", m.phase));
            Phase::Unspecified
        }
    };
    let failure = match pb::FailurePolicy::try_from(m.failure_policy) {
        Ok(pb::FailurePolicy::FailClosed) => FailurePolicy::Closed,
        Ok(pb::FailurePolicy::FailOpen | pb::FailurePolicy::Unspecified) => FailurePolicy::Open,
        Err(_) => {
            v.add(join(field, "failure_policy"), format!("unknown failure policy {}", m.failure_policy));
            FailurePolicy::Open
        }
    };
    let sha256 = if m.sha256.is_empty() {
        None
    } else {
        let parsed = parse_hex32(&m.sha256.to_ascii_lowercase());
        if parsed.is_none() {
            v.add(join(field, "sha256"), "want 64 hex digits");
        }
        parsed
    };
    let out = PluginManifest {
        name: m.name.clone(),
        version: m.version.clone(),
        hook: hook.unwrap_or(Hook::Message),
        phase,
        priority: m.priority,
        failure,
        sha256,
    };
    if let Err(meshwarp_core::PluginError::Invalid { field: f, reason }) = out.validate() {
        v.add(join(field, f), reason);
    }
    v.into_result(out)
}

fn manifest_to_pb(m: &PluginManifest) -> pb::PluginManifest {
    pb::PluginManifest {
        name: m.name.clone(),
        version: m.version.clone(),
        hook: hook_to_pb(m.hook),
        phase: phase_to_pb(m.phase),
        priority: m.priority,
        failure_policy: (match m.failure {
            FailurePolicy::Open => pb::FailurePolicy::FailOpen,
            FailurePolicy::Closed => pb::FailurePolicy::FailClosed,
        }) as i32,
        sha256: m.sha256.as_ref().map(|d| hex(d)).unwrap_or_default(),
    }
}

pub fn plugin_counters_to_pb(hook: Hook, c: &PluginCounters) -> pb::PluginCounters {
    let mut out = pb::PluginCounters {
        runs: c.runs,
        continued: c.continued,
        dropped: c.dropped,
        invalid: c.invalid,
        missing: c.missing,
        ..Default::default()
    };
    match hook {
        Hook::Connection => out.declined = c.verdict1,
        Hook::Message => out.bypassed = c.verdict1,
        Hook::Packet => out.passed = c.verdict1,
    }
    out
}

pub fn plugin_to_pb(p: &PluginInfo) -> pb::Plugin {
    pb::Plugin {
        manifest: Some(manifest_to_pb(&p.manifest)),
        id: p.id,
        prog_id: p.prog_id,
        abi_version: format!("{}.{}", p.abi.0, p.abi.1),
        sha256: hex(&p.sha256),
        config: p.config.clone(),
        position: p.position,
        counters: Some(plugin_counters_to_pb(p.manifest.hook, &p.counters)),
        maps: p.maps.iter().map(|m| pb::PluginMap { name: m.name.clone(), pin: m.pin.display().to_string() }).collect(),
    }
}

#[cfg(test)]
mod plugin_tests {
    use super::*;

    #[test]
    fn manifest_round_trip_and_violations() {
        let m = pb::PluginManifest {
            name: "ports".into(),
            version: "1.0".into(),
            hook: pb::PluginHook::Connection as i32,
            phase: pb::PluginPhase::Authz as i32,
            priority: 7,
            failure_policy: pb::FailurePolicy::FailClosed as i32,
            sha256: "ab".repeat(32),
        };
        let core = manifest_from_pb("manifest", Some(&m)).unwrap();
        assert_eq!(core.sha256, Some([0xab; 32]));
        assert_eq!(manifest_to_pb(&core), m);

        let bad = pb::PluginManifest {
            name: "Bad Name".into(),
            hook: 9,
            phase: 8,
            failure_policy: 5,
            sha256: "xyz".into(),
            ..m
        };
        let v = manifest_from_pb("manifest", Some(&bad)).unwrap_err();
        let fields: Vec<&str> = v.0.iter().map(|x| x.field.as_str()).collect();
        assert_eq!(
            fields,
            ["manifest.hook", "manifest.phase", "manifest.failure_policy", "manifest.sha256", "manifest.name"]
        );
        let v = manifest_from_pb("manifest", None).unwrap_err();
        assert_eq!(v.0[0].field, "manifest");
        let unspecified = pb::PluginManifest { name: "x".into(), ..Default::default() };
        assert_eq!(manifest_from_pb("m", Some(&unspecified)).unwrap_err().0[0].field, "m.hook");
    }
}
