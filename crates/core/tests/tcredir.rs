//! tc redirection across two namespace "nodes" joined by vxlan: pod A's
//! traffic to pod B skips node A's bridge and routing (pod veth ingress ->
//! vxlan egress) and node B's (vxlan ingress -> straight into pod B), with MAC
//! rewrite; the RedirectNeigh variant lets the kernel fill in L2.
//!
//! Fails (never skips) when CI=true and the kernel refuses tc BPF.

#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use meshwarp_core::netlink::Link;
use meshwarp_core::tc::{
    Direction, IfaceRef, InterfaceRoute, MacRewrite, Prefix, RouteAction, TcConfig, TcDataplane, TcError,
};
use meshwarp_core::Outcome;
use meshwarp_testbed::{accept_timeout, exchange, link_in, NodeWithPods, OverlayEgress, TcTest, TwoNodes};

const T: Duration = Duration::from_secs(60);
const PORT: u16 = 8080;

/// A tc data path per node, removed on drop.
struct Node<'a> {
    net: &'a NodeWithPods,
    t: TcTest,
}

impl<'a> Node<'a> {
    fn open(net: &'a NodeWithPods) -> Option<Self> {
        Some(Self { net, t: TcTest::start(&net.node)? })
    }

    fn tc(&self) -> &TcDataplane {
        self.t.tc()
    }

    /// Drops this handle, as a restarted daemon would, and adopts the pins
    /// again; while it was held, no second opener got in.
    fn readopt(&mut self) -> Result<()> {
        let cfg = TcConfig { pin_root: self.t.pin_root.clone(), netns: Some(self.net.node.path()), max_routes: 64 };
        let e = TcDataplane::open(&cfg).err().context("a second opener of held pins is refused")?;
        ensure!(e.to_string().contains("held by another meshwarp process"), "{e}");
        drop(self.t.tc.take());
        self.t.tc = Some(TcDataplane::open(&cfg)?);
        Ok(())
    }

    fn link(&self, name: &str) -> Link {
        link_in(&self.net.node, name).unwrap()
    }

    fn route(
        &self,
        attach: &str,
        dst: IpAddr,
        len: u8,
        action: RouteAction,
        rewrite: Option<MacRewrite>,
    ) -> Result<()> {
        let r = InterfaceRoute {
            attach: IfaceRef::Name(attach.into()),
            direction: Direction::Ingress,
            dst: Prefix::new("dst", dst, len)?,
            src: None,
            action,
            rewrite,
        };
        self.tc().insert_route(&r, "test").with_context(|| format!("route {r}"))?;
        Ok(())
    }
}

/// Connects pod A -> pod B and checks a stream both ways.
fn traffic(net: &TwoNodes, v6: bool, seed: u64, listener: &std::net::TcpListener) -> Result<()> {
    let c = net.a.pods[0].ns.connect(SocketAddr::new(net.b.pods[0].addr(v6), PORT))?;
    let s = accept_timeout(listener, T)?;
    exchange(c, s, seed, 2 << 20, T)?;
    Ok(())
}

fn bridges(net: &TwoNodes) -> Result<u64> {
    Ok(net.bridge_bytes()?)
}

macro_rules! nodes_or_skip {
    ($net:expr) => {
        match (Node::open(&$net.a), Node::open(&$net.b)) {
            (Some(a), Some(b)) => (a, b),
            _ => return Ok(()),
        }
    };
}

fn redirect_and_peer(v6: bool) -> Result<()> {
    let net = TwoNodes::new(1)?;
    let listener = net.b.pods[0].ns.listen(SocketAddr::new(net.b.pods[0].addr(v6), PORT))?;
    // Without meshwarp: the overlay works and the payload crosses both bridges.
    let before = bridges(&net)?;
    traffic(&net, v6, 1, &listener)?;
    ensure!(bridges(&net)? - before > 4 << 20, "payload crossed the bridges without meshwarp");

    let (na, nb) = nodes_or_skip!(net);
    net.install_fast_path(na.tc(), nb.tc(), v6, OverlayEgress::Redirect)?;
    let b_ip = net.b.pods[0].addr(v6);

    // A connection opened on the routed path, to outlive the routes later.
    let long_c = net.a.pods[0].ns.connect(SocketAddr::new(b_ip, PORT))?;
    let long_s = accept_timeout(&listener, T)?;
    let before = bridges(&net)?;
    traffic(&net, v6, 3, &listener)?;
    let crossed = bridges(&net)? - before;
    ensure!(crossed < 256 * 1024, "{crossed} bytes still crossed the bridges with routes registered");
    for n in [&na, &nb] {
        for r in n.tc().routes() {
            let st = n.tc().route_stats(&r)?;
            ensure!(st.packets > 0 && st.redirect_err == 0, "route {} counted {st:?}", r.route);
        }
        let pod_if = n.link("vpod0").index;
        ensure!(n.tc().attach_stats(pod_if, Direction::Ingress)?.packets > 0);
    }

    // Removing the routes returns traffic to the bridges; open connections live on.
    for n in [&na, &nb] {
        for r in n.tc().routes() {
            n.tc().remove_route(r.attach_ifindex, r.route.direction, r.route.dst)?;
        }
    }
    let before = bridges(&net)?;
    exchange(long_c, long_s, 5, 2 << 20, T)?;
    traffic(&net, v6, 7, &listener)?;
    ensure!(bridges(&net)? - before > 4 << 20, "after removal the payload crosses the bridges again");
    Ok(())
}

#[test]
fn redirect_and_redirect_peer_across_nodes_v4() -> Result<()> {
    redirect_and_peer(false)
}

#[test]
fn redirect_and_redirect_peer_across_nodes_v6() -> Result<()> {
    redirect_and_peer(true)
}

#[test]
fn redirect_neigh_lets_the_kernel_fill_l2() -> Result<()> {
    let net = TwoNodes::new(1)?;
    let listener = net.b.pods[0].ns.listen(SocketAddr::new(net.b.pods[0].addr(false), PORT))?;
    traffic(&net, false, 11, &listener)?; // resolves the overlay neighbours
    let (na, nb) = nodes_or_skip!(net);
    net.install_fast_path(na.tc(), nb.tc(), false, OverlayEgress::RedirectNeigh)?;
    let before = bridges(&net)?;
    traffic(&net, false, 13, &listener)?;
    ensure!(bridges(&net)? - before < 256 * 1024, "payload bypassed the bridges");
    for n in [&na, &nb] {
        for r in n.tc().routes() {
            let st = n.tc().route_stats(&r)?;
            ensure!(st.packets > 0 && st.redirect_err == 0, "route {} counted {st:?}", r.route);
        }
    }
    Ok(())
}

/// A redirect the program refuses (here: a route value whose action this
/// build does not know, as a damaged or newer map could hold) passes the
/// packet exactly as it came: no MAC rewrite, so the normal path still
/// delivers it, and the refusal is counted.
#[test]
fn a_refused_redirect_passes_the_packet_unchanged() -> Result<()> {
    use meshwarp_bpf::shared::{RouteKey4, RouteValue};
    use meshwarp_core::maps::TypedMap;

    let net = TwoNodes::new(1)?;
    let b_ip = net.b.pods[0].addr(false);
    let listener = net.b.pods[0].ns.listen(SocketAddr::new(b_ip, PORT))?;
    let (na, _nb) = nodes_or_skip!(net);
    // Addresses no interface has: a frame that kept them would be dropped.
    let bogus = MacRewrite { src: [2, 0, 0, 0xde, 0xad, 1], dst: [2, 0, 0, 0xde, 0xad, 2] };
    na.route("vpod0", b_ip, 32, RouteAction::Redirect(IfaceRef::Name("vxlan0".into())), Some(bogus))?;
    na.tc().attach(&IfaceRef::Name("vpod0".into()), Direction::Ingress)?;
    let rt4: TypedMap<RouteKey4, RouteValue> =
        TypedMap::pinned(&na.tc().pin_dir().join("maps"), meshwarp_bpf::names::MAP_RT4)?;
    let entries = rt4.entries()?;
    ensure!(entries.len() == 1, "one route: {entries:?}");
    for (k, v) in entries {
        rt4.put(&k, &RouteValue { action: 0, ..v })?;
    }
    let before = bridges(&net)?;
    traffic(&net, false, 13, &listener)?;
    ensure!(bridges(&net)? - before > 2 << 20, "the payload took the normal path");
    let r = na.tc().routes().into_iter().next().context("the route")?;
    let st = na.tc().route_stats(&r)?;
    ensure!(st.redirect_err > 0 && st.packets == 0, "refusals counted, nothing redirected: {st:?}");
    Ok(())
}

/// Adoption takes back every route it can; one it cannot (here: a slot held
/// twice, as a damaged map could have) leaves the data path instead of
/// keeping the node from starting.
#[test]
fn adoption_drops_a_route_it_cannot_take_back() -> Result<()> {
    use meshwarp_bpf::shared::{RouteKey4, RouteValue};
    use meshwarp_core::maps::TypedMap;

    let net = TwoNodes::new(1)?;
    let (mut na, _nb) = nodes_or_skip!(net);
    let to = RouteAction::Redirect(IfaceRef::Name("vxlan0".into()));
    na.route("vpod0", "198.18.7.0".parse()?, 24, to.clone(), None)?;
    na.route("vpod0", "198.18.8.0".parse()?, 24, to, None)?;
    let rt4: TypedMap<RouteKey4, RouteValue> =
        TypedMap::pinned(&na.tc().pin_dir().join("maps"), meshwarp_bpf::names::MAP_RT4)?;
    let mut entries = rt4.entries()?;
    entries.sort_by_key(|(_, v)| v.id);
    let [(_, first), (k, second)] = entries.as_slice() else { bail!("two routes: {entries:?}") };
    rt4.put(k, &RouteValue { id: first.id, ..*second })?;
    na.readopt()?;
    ensure!(na.tc().routes().len() == 1, "the consistent route is adopted: {:?}", na.tc().routes());
    ensure!(rt4.entries()?.len() == 1, "the other left the data path");
    Ok(())
}

#[test]
fn invalid_routes_are_refused_and_change_nothing() -> Result<()> {
    let net = TwoNodes::new(1)?;
    let (mut na, _nb) = nodes_or_skip!(net);
    let base = InterfaceRoute {
        attach: IfaceRef::Name("vpod0".into()),
        direction: Direction::Ingress,
        dst: Prefix::new("dst", "198.18.2.0".parse()?, 24)?,
        src: None,
        action: RouteAction::Redirect(IfaceRef::Name("vxlan0".into())),
        rewrite: None,
    };
    let unknown = InterfaceRoute { attach: IfaceRef::Name("nosuch0".into()), ..base.clone() };
    ensure!(na.tc().insert_route(&unknown, "test").unwrap_err().to_string().contains("unknown interface nosuch0"));
    let not_veth =
        InterfaceRoute { action: RouteAction::RedirectPeer(IfaceRef::Name("vxlan0".into())), ..base.clone() };
    ensure!(na.tc().insert_route(&not_veth, "test").unwrap_err().to_string().contains("not one"));
    na.tc().insert_route(&base, "test")?;
    ensure!(na.tc().insert_route(&base, "test").unwrap_err().to_string().contains("is already registered"));
    ensure!(na.tc().routes().len() == 1);
    // Adoption: the next process on the same pins sees the same route and attachments.
    na.tc().attach(&IfaceRef::Name("vpod0".into()), Direction::Ingress)?;
    let attached = na.tc().attachments();
    na.readopt()?;
    let again = na.tc();
    ensure!(again.routes().len() == 1 && again.routes()[0].route.dst == base.dst);
    ensure!(again.attachments() == attached && attached.len() == 1);
    ensure!(again.routes()[0].owner == "test", "owners survive adoption");

    // Owners and batches.
    let other = InterfaceRoute { dst: Prefix::new("dst", "198.18.3.0".parse()?, 24)?, ..base.clone() };
    let err = na.tc().upsert_route(&base, "intruder").unwrap_err();
    ensure!(matches!(err, TcError::Rule(meshwarp_core::RuleError::OwnerMismatch { .. })), "{err}");
    let err = na.tc().delete_route(&base.attach, base.direction, base.dst, Some("intruder")).unwrap_err();
    ensure!(matches!(err, TcError::Rule(meshwarp_core::RuleError::OwnerMismatch { .. })), "{err}");
    let batch = vec![other.clone(), other.clone()];
    ensure!(matches!(
        na.tc().batch_upsert_routes(&batch, "test"),
        Err(TcError::Rule(meshwarp_core::RuleError::DuplicateInBatch(_)))
    ));
    let batch = vec![other.clone(), base.clone()];
    ensure!(matches!(
        na.tc().batch_upsert_routes(&batch, "intruder"),
        Err(TcError::Rule(meshwarp_core::RuleError::OwnerMismatch { .. }))
    ));
    ensure!(na.tc().routes().len() == 1, "a refused batch changes nothing");
    let moved = InterfaceRoute {
        rewrite: Some(MacRewrite { src: [2, 0, 0, 0, 0, 1], dst: [2, 0, 0, 0, 0, 2] }),
        ..base.clone()
    };
    let out = na.tc().batch_upsert_routes(&[other.clone(), moved], "test")?;
    ensure!(out.iter().map(|(_, o)| *o).collect::<Vec<_>>() == vec![Outcome::Created, Outcome::Updated]);
    let keys = vec![
        (base.attach.clone(), base.direction, base.dst),
        (base.attach.clone(), base.direction, Prefix::new("dst", "198.18.9.0".parse()?, 24)?),
    ];
    ensure!(matches!(
        na.tc().batch_delete_routes(&keys, "test", false),
        Err(TcError::Rule(meshwarp_core::RuleError::NotFound(_)))
    ));
    ensure!(na.tc().routes().len() == 2);
    let gone = na.tc().batch_delete_routes(&keys, "test", true)?;
    ensure!(gone[0].is_some() && gone[1].is_none() && na.tc().routes().len() == 1);
    Ok(())
}

#[test]
fn a_deleted_pod_leaves_no_route_on_its_old_interface() -> Result<()> {
    let net = TwoNodes::new(2)?;
    let b_ip = net.b.pods[0].addr(false);
    let (mut na, _nb) = nodes_or_skip!(net);
    let (old_if, _) = na.tc().attach(&IfaceRef::Name("vpod0".into()), Direction::Ingress)?;
    na.tc().attach(&IfaceRef::Name("vpod1".into()), Direction::Ingress)?;
    for pod in ["vpod0", "vpod1"] {
        na.route(pod, b_ip, 24, RouteAction::Redirect(IfaceRef::Name("vxlan0".into())), None)?;
    }
    ensure!(na.tc().refresh()?.is_empty(), "nothing is stale while both pods live");

    // Delete pod 0 the way CNI does: its veth pair goes away.
    net.a.node.ip(&["link", "del", "vpod0"])?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stale = loop {
        let s = na.tc().refresh()?;
        if !s.is_empty() || std::time::Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    ensure!(stale.len() == 1 && stale[0].route.attach_name == "vpod0", "{stale:?}");
    ensure!(na.tc().routes().len() == 1 && na.tc().routes()[0].attach_name == "vpod1");
    ensure!(na.tc().stale_routes().len() == 1);
    ensure!(!na.tc().attachments().iter().any(|(i, _)| *i == old_if), "the attachment was released");

    // Recreate the pod: a new vpod0 has a new ifindex and no route points at it.
    net.a.node.ip(&["link", "add", "vpod0", "type", "veth", "peer", "name", "vpod0p"])?;
    let new_if = na.link("vpod0").index;
    ensure!(new_if != old_if);
    na.tc().forget_stale(old_if, Direction::Ingress, stale[0].route.route.dst)?;
    ensure!(na.tc().stale_routes().is_empty());
    na.readopt()?;
    ensure!(
        na.tc().routes().iter().all(|r| r.attach_ifindex != old_if && r.attach_ifindex != new_if),
        "the maps hold no route for vpod0"
    );
    Ok(())
}

/// tc programs of "another build" are replaced in place while a stream
/// crosses the routes: every tcx link and pin runs this build's programs
/// afterwards, the routes and their counters are kept, and no byte is lost.
#[test]
fn another_builds_tc_programs_are_replaced_under_traffic() -> Result<()> {
    use meshwarp_bpf::shared::Build;
    use meshwarp_core::maps::TypedMap;
    use meshwarp_core::upgrade::running_programs;
    use meshwarp_core::Upgrade;

    let net = TwoNodes::new(1)?;
    let listener = net.b.pods[0].ns.listen(SocketAddr::new(net.b.pods[0].addr(false), PORT))?;
    let (mut na, mut nb) = nodes_or_skip!(net);
    net.install_fast_path(na.tc(), nb.tc(), false, OverlayEgress::Redirect)?;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    // Connections of 4 MiB each way, one after the other, at least 16,
    // until both upgrades are done: streams cross them however fast this
    // machine is (one 64 MiB stream could end before they begin).
    let to = SocketAddr::new(net.b.pods[0].addr(false), PORT);
    let (upgraded, rounds) = (AtomicBool::new(false), AtomicU64::new(0));
    let (packets, total, during) = std::thread::scope(|scope| {
        let stream = scope.spawn(|| -> Result<u64> {
            let mut i = 0;
            while i < 16 || !upgraded.load(Ordering::Acquire) {
                let c = net.a.pods[0].ns.connect(to)?;
                let s = accept_timeout(&listener, T)?;
                exchange(c, s, 11 + 2 * i, 4 << 20, T)?;
                i += 1;
                rounds.store(i, Ordering::Release);
            }
            Ok(i)
        });
        let mut upgrades = || -> Result<Vec<_>> {
            ensure!(
                meshwarp_core::sys::wait_for(T, || rounds.load(Ordering::Acquire) > 0 || stream.is_finished()),
                "the first stream"
            );
            let mut packets = Vec::new();
            for (i, n) in [&mut na, &mut nb].into_iter().enumerate() {
                let dir = n.tc().pin_dir().to_path_buf();
                let old = running_programs(&dir)?;
                ensure!(old.keys().any(|k| k.starts_with("links/if")), "tcx links attached: {old:?}");
                TypedMap::<u32, Build>::pinned(&dir.join("maps"), meshwarp_bpf::names::MAP_BUILD)?
                    .put(&0, &Build { id: *b"0ther-build-0001" })?;
                let routes = n.tc().routes();
                n.readopt()?;
                ensure!(matches!(n.tc().upgrade(), Upgrade::Done { .. }), "{:?}", n.tc().upgrade());
                ensure!(n.tc().programs_build()? == meshwarp_bpf::BUILD_ID);
                let now = running_programs(&dir)?;
                ensure!(now.keys().eq(old.keys()), "pins and links changed: {now:?} against {old:?}");
                ensure!(now.contains_key("maps/mw_ch_pkt[fin]"), "{now:?}");
                for (k, id) in &now {
                    ensure!(old.get(k) != Some(id), "{k} still runs the old program {id}");
                }
                let key = |rs: &[meshwarp_core::tc::InstalledRoute]| {
                    rs.iter()
                        .map(|r| (r.attach_ifindex, r.target_ifindex, r.route.dst, r.owner.clone()))
                        .collect::<Vec<_>>()
                };
                ensure!(key(&n.tc().routes()) == key(&routes), "routes kept: {:?} against {routes:?}", n.tc().routes());
                for r in &routes {
                    packets.push((i, r.clone(), n.tc().route_stats(r)?.packets));
                }
            }
            Ok(packets)
        };
        // Whatever the upgrades did, the streams stop after them.
        let packets = upgrades();
        let during = rounds.load(Ordering::Acquire);
        upgraded.store(true, Ordering::Release);
        let total = stream.join().map_err(|_| anyhow::anyhow!("stream thread"));
        (packets, total, during)
    });
    let (packets, total) = (packets?, total??);
    eprintln!("{total} streams of 4 MiB each way, {during} of them over when the upgrades were");
    let before = bridges(&net)?;
    traffic(&net, false, 12, &listener)?;
    ensure!(bridges(&net)? - before < 256 * 1024, "after the upgrade the routes still carry the payload");
    for (i, r, was) in packets {
        let n = if i == 0 { &na } else { &nb };
        let now = n.tc().route_stats(&r)?.packets;
        ensure!(now > was, "route {} counted nothing after the upgrade ({was} -> {now})", r.route);
    }
    Ok(())
}

/// On kernels without tcx the tc programs hang off clsact filters, which are
/// not pinned: an upgrade finds meshwarp's filter on the node's interfaces
/// and replaces its program in place. The filter is made by hand here (this
/// kernel has tcx).
#[test]
fn an_upgrade_replaces_the_program_of_a_clsact_filter() -> Result<()> {
    use meshwarp_bpf::shared::Build;
    use meshwarp_core::maps::TypedMap;
    use meshwarp_core::Upgrade;
    use std::os::fd::AsFd;

    let net = TwoNodes::new(1)?;
    let (mut na, _nb) = nodes_or_skip!(net);
    let dir = na.tc().pin_dir().to_path_buf();
    let ifindex = na.link("vpod0").index;
    let pinned_ingress = || -> Result<libbpf_rs::ProgramHandle> {
        Ok(libbpf_rs::ProgramHandle::from_pinned_path(dir.join("progs").join(meshwarp_bpf::names::PROG_TC_INGRESS))?)
    };
    let filter = |prog: &libbpf_rs::ProgramHandle| {
        let mut h = libbpf_rs::TcHookBuilder::new(prog.as_fd());
        h.ifindex(ifindex as i32).replace(true).handle(0x6d77).priority(1);
        h.hook(libbpf_rs::TC_INGRESS)
    };
    let old = pinned_ingress()?;
    let old_id = old.id();
    net.a.node.enter(|| -> Result<()> {
        let mut hook = filter(&old);
        hook.create()?;
        hook.attach()?;
        Ok(())
    })??;
    TypedMap::<u32, Build>::pinned(&dir.join("maps"), meshwarp_bpf::names::MAP_BUILD)?
        .put(&0, &Build { id: *b"0ther-build-0001" })?;
    na.readopt()?;
    let Upgrade::Done { steps, .. } = na.tc().upgrade().clone() else { bail!("{:?}", na.tc().upgrade()) };
    ensure!(steps.iter().any(|s| s == &format!("clsact if{ifindex}-in")), "{steps:?}");
    let new = pinned_ingress()?;
    let running = net.a.node.enter(|| filter(&new).query())??;
    ensure!(running == new.id() && running != old_id, "the filter runs {running}, old {old_id}, new {}", new.id());
    Ok(())
}

/// The latency monitor of interface routes: a route on pod 0's veth that
/// puts its packets straight into pod 1 records each redirected packet's
/// time since pod 0's TCP sent it — nothing while off, well under a
/// millisecond on an idle path, and milliseconds once a token bucket on pod
/// 0's eth0 queues its packets (netem is not built into these kernels; tbf
/// is). The stream stays whole throughout.
#[test]
fn route_transit_latency_shows_the_senders_queue() -> Result<()> {
    use meshwarp_core::{LatencyScope, Metric};
    use std::collections::BTreeSet;

    let net = NodeWithPods::new(2)?;
    let dst = SocketAddr::new(net.pods[1].addr(false), PORT);
    let listener = net.pods[1].ns.listen(dst)?;
    let stream = |seed: u64| -> Result<()> {
        let c = net.pods[0].ns.connect(dst)?;
        let s = accept_timeout(&listener, T)?;
        Ok(exchange(c, s, seed, 1 << 20, T)?)
    };
    stream(1)?; // the normal path first: neighbours resolved
    let Some(t) = TcTest::start(&net.node) else {
        return Ok(());
    };
    let route = InterfaceRoute {
        attach: IfaceRef::Name(net.pods[0].host_veth.clone()),
        direction: Direction::Ingress,
        dst: Prefix::new("dst", net.pods[1].addr(false), 32)?,
        src: None,
        action: RouteAction::RedirectPeer(IfaceRef::Name(net.pods[1].host_veth.clone())),
        rewrite: None,
    };
    t.tc().attach(&route.attach, Direction::Ingress)?;
    t.tc().insert_route(&route, "test")?;
    let installed = t.tc().routes().into_iter().next().context("the route")?;
    let id = installed.id();
    let transit = || -> Result<Option<meshwarp_core::Histogram>> {
        let hs = t.tc().latency().histograms(&BTreeSet::from([id]))?;
        ensure!(hs.iter().all(|h| h.metric == Metric::Transit && h.rule_id == id), "{hs:?}");
        Ok(hs.into_iter().next())
    };

    stream(2)?;
    ensure!(t.tc().route_stats(&installed)?.packets > 0, "the route redirected pod 0's packets");
    ensure!(transit()?.is_none(), "the monitor is off: nothing recorded");

    t.tc().latency().set(&LatencyScope::Rules(BTreeSet::from([id])), false)?;
    stream(3)?;
    let idle = transit()?.context("transit samples with the monitor on")?;
    let p50 = idle.quantile_ns(0.5).unwrap_or(u64::MAX);
    ensure!(idle.count >= 16 && p50 < 1_000_000, "an idle veth: p50 {p50} ns, {idle:?}");

    // 8 Mbit/s: TCP keeps tens of kilobytes queued in the bucket, tens of ms.
    net.pods[0].ns.exec(&[
        "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "8mbit", "burst", "16kb", "latency", "2s",
    ])?;
    t.tc().latency().reset(&BTreeSet::new())?;
    stream(4)?;
    let queued = transit()?.context("transit samples behind the token bucket")?;
    let p90 = queued.quantile_ns(0.9).unwrap_or(0);
    ensure!(queued.count >= 16 && p90 >= 1_000_000, "behind an 8 Mbit/s bucket: p90 {p90} ns, {queued:?}");
    net.pods[0].ns.exec(&["tc", "qdisc", "del", "dev", "eth0", "root"])?;
    eprintln!(
        "route transit: idle p50 {p50} ns ({} packets); behind the bucket p90 {p90} ns ({} packets)",
        idle.count, queued.count
    );

    t.tc().latency().set(&LatencyScope::Off, false)?;
    let before = transit()?.map_or(0, |h| h.count);
    stream(5)?;
    ensure!(transit()?.map_or(0, |h| h.count) == before, "nothing recorded once off");
    Ok(())
}
