//! Interface routes and attachments.

use super::{ip, join, Violations};
use crate::pb;
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
