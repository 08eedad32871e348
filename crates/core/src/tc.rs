//! tc redirection: [`InterfaceRoute`]s (attach point, destination and optional
//! source prefix, an action and an optional MAC rewrite) and the
//! [`TcDataplane`] that attaches the tc programs (tcx where the kernel has it,
//! clsact otherwise) and keeps the routes in LPM maps.
//!
//! Every netlink lookup and attachment runs inside the dataplane's network
//! namespace (the node's), which may differ from the caller's.
//!
//! Pinned layout: [`FamilyPins::tcredir`]; a tcx attachment is the link
//! `links/if<ifindex>-<in|out>`.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::mem::MaybeUninit;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{libbpf_sys, MapCore, MapFlags, MapHandle, ProgramHandle};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    AttachKey, AttachStats, OwnerName, Pod, RouteKey4, RouteKey6, RouteStats, RouteValue, ACT_REDIRECT,
    ACT_REDIRECT_NEIGH, ACT_REDIRECT_PEER, AF_INET, AF_INET6, CHAIN_FIN, DIR_EGRESS, DIR_INGRESS, LAT_ROWS,
    LAT_RT_ROW_METRICS, ROUTE_HAS_NEXTHOP, ROUTE_HAS_SRC, ROUTE_KEY_PREFIX_BITS, ROUTE_REWRITE_MAC,
};
use meshwarp_bpf::tcredir::{TcredirProgs, TcredirSkelBuilder};

use crate::error::{BpfError, IoError};
use crate::latency::{LatencyError, LatencyMonitor};
use crate::maps::PerCpu;
use crate::maps::{MapError, RuleLatency, SlotMaps, TypedMap};
pub use crate::netlink::IfaceRef;
use crate::netlink::{self, NetlinkError};
use crate::pins::{FamilyPins, PinLock};
use crate::table::{self, Entry, Outcome, RuleError, Slots, Stored, Table};
use crate::upgrade::{self, Upgrade, UpgradeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    fn raw(self) -> u32 {
        match self {
            Self::Ingress => DIR_INGRESS,
            Self::Egress => DIR_EGRESS,
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::Ingress => "in",
            Self::Egress => "out",
        }
    }
}

/// A network prefix; host bits are cleared on construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Prefix {
    addr: IpAddr,
    len: u8,
}

impl Prefix {
    pub fn new(field: &'static str, addr: IpAddr, len: u8) -> Result<Self, RouteError> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if len > max {
            return Err(RouteError::PrefixLen { field, len, max });
        }
        let addr = match addr {
            IpAddr::V4(a) => {
                let mask = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len)) };
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = if len == 0 { 0 } else { u128::MAX << (128 - u32::from(len)) };
                IpAddr::V6((u128::from(a) & mask).into())
            }
        };
        Ok(Self { addr, len })
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn len(&self) -> u8 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn bytes(&self) -> Vec<u8> {
        match self.addr {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        }
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// What a matching packet gets.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteAction {
    /// `bpf_redirect`: out of `to` (its egress).
    Redirect(IfaceRef),
    /// `bpf_redirect_peer`: into the namespace of veth `to`'s peer, as if
    /// received there. Ingress attach points only.
    RedirectPeer(IfaceRef),
    /// `bpf_redirect_neigh`: out of `to` with L2 filled in by the kernel's
    /// neighbour table, for `next_hop` or else the packet's destination.
    RedirectNeigh { to: IfaceRef, next_hop: Option<IpAddr> },
}

impl RouteAction {
    fn target(&self) -> &IfaceRef {
        match self {
            Self::Redirect(t) | Self::RedirectPeer(t) | Self::RedirectNeigh { to: t, .. } => t,
        }
    }
}

/// Ethernet addresses written into a redirected frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MacRewrite {
    pub src: [u8; 6],
    pub dst: [u8; 6],
}

/// A route a controller registers on an interface's tc hook.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InterfaceRoute {
    pub attach: IfaceRef,
    pub direction: Direction,
    pub dst: Prefix,
    pub src: Option<Prefix>,
    pub action: RouteAction,
    pub rewrite: Option<MacRewrite>,
}

impl fmt::Display for InterfaceRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}: {}", self.attach, self.direction, self.dst)?;
        if let Some(s) = self.src {
            write!(f, " from {s}")?;
        }
        write!(f, " -> {:?}", self.action)
    }
}

/// Why a route was refused; nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("{field}: prefix length {len} is more than {max}")]
    PrefixLen { field: &'static str, len: u8, max: u8 },
    #[error("mixed address families: {0}")]
    MixedFamilies(String),
    #[error("RedirectPeer works only from an ingress hook (bpf_redirect_peer)")]
    PeerOnEgress,
    #[error("RedirectPeer needs a veth, and {0} is not one")]
    NotVeth(String),
    #[error("unknown interface {0}")]
    UnknownInterface(String),
}

impl InterfaceRoute {
    /// Checks what can be checked without the kernel.
    pub fn validate(&self) -> Result<(), RouteError> {
        let v4 = self.dst.addr.is_ipv4();
        if self.src.is_some_and(|s| s.addr.is_ipv4() != v4) {
            return Err(RouteError::MixedFamilies(format!("dst {} and src {:?}", self.dst, self.src)));
        }
        if let RouteAction::RedirectNeigh { next_hop: Some(nh), .. } = &self.action {
            if nh.is_ipv4() != v4 {
                return Err(RouteError::MixedFamilies(format!("dst {} and next hop {nh}", self.dst)));
            }
        }
        if matches!(self.action, RouteAction::RedirectPeer(_)) && self.direction == Direction::Egress {
            return Err(RouteError::PeerOnEgress);
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TcError {
    #[error(transparent)]
    Invalid(#[from] RouteError),
    #[error(transparent)]
    Sys(#[from] crate::sys::SysError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Bpf(#[from] crate::error::BpfError),
    #[error("loading the tc programs: {source}\n--- verifier/libbpf log ---\n{log}")]
    Load {
        #[source]
        source: libbpf_rs::Error,
        log: String,
    },
    #[error(transparent)]
    Io(#[from] crate::error::IoError),
    #[error(transparent)]
    Latency(#[from] LatencyError),
    /// Owners, slots, batches: what the rule table refused.
    #[error(transparent)]
    Rule(#[from] RuleError),
    #[error("{dir} holds a partial tc data path (missing {missing:?}); run `meshwarp uninstall`")]
    Partial { dir: PathBuf, missing: Vec<String> },
}

impl From<MapError> for TcError {
    fn from(e: MapError) -> Self {
        Self::Rule(e.into())
    }
}

fn bpf(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> TcError {
    let what = what.into();
    move |source| TcError::Bpf(BpfError::new(what, source))
}

/// How an attachment was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// A tcx bpf_link, pinned.
    Tcx,
    /// clsact qdisc + cls_bpf filter (kernels without tcx).
    Clsact,
}

/// Where the tc data path lives and which namespace it serves.
#[derive(Debug, Clone)]
pub struct TcConfig {
    pub pin_root: PathBuf,
    /// The node's network namespace (`None`: the caller's).
    pub netns: Option<PathBuf>,
    pub max_routes: u32,
}

/// A route with its interfaces resolved to indexes (and the names they had
/// then, to notice an index reused by another interface): what the route
/// table holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedRoute {
    pub route: InterfaceRoute,
    pub attach_ifindex: u32,
    pub target_ifindex: u32,
    pub attach_name: String,
    pub target_name: String,
}

impl fmt::Display for ResolvedRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.route.fmt(f)
    }
}

impl table::Rule for ResolvedRoute {
    /// One route per attach point, direction and destination prefix.
    type Key = (u32, Direction, Prefix);
    const WHAT: &'static str = "route";
    fn rule_key(&self) -> Self::Key {
        (self.attach_ifindex, self.route.direction, self.route.dst)
    }
}

/// The route maps: LPM tries per family, counters and owners per slot.
#[derive(Debug)]
struct TcMaps {
    rt4: TypedMap<RouteKey4, RouteValue>,
    rt6: TypedMap<RouteKey6, RouteValue>,
    rt_stats: PerCpu<u32, RouteStats>,
    rt_owner: TypedMap<u32, OwnerName>,
    /// The latency monitor's switch and histograms per route id.
    lat: RuleLatency,
}

// The maps are kernel objects written through shared handles, so the table
// writes through `&TcMaps` and route counters are read without its lock.
impl SlotMaps for &TcMaps {
    fn slot_capacity(&self) -> u32 {
        self.rt_stats.capacity()
    }

    fn reset_slot(&mut self, id: u32) -> Result<(), MapError> {
        self.rt_stats.zero(&id)?;
        self.lat.forget(id)
    }

    fn put_owner(&mut self, id: u32, owner: &OwnerName) -> Result<(), MapError> {
        self.rt_owner.put(&id, owner)
    }

    fn delete_owner(&mut self, id: u32) -> Result<(), MapError> {
        self.rt_owner.delete(&id)
    }
}

impl<'a> Stored<&'a TcMaps> for ResolvedRoute {
    fn write(&self, maps: &mut &'a TcMaps, id: u32) -> Result<(), MapError> {
        let v = route_value(&self.route, self.target_ifindex, id);
        let (ifindex, prefixlen, dir) = self.key_parts();
        match self.route.dst.addr {
            IpAddr::V4(a) => maps.rt4.put(&RouteKey4 { prefixlen, ifindex, dir, dst: a.octets() }, &v),
            IpAddr::V6(a) => maps.rt6.put(&RouteKey6 { prefixlen, ifindex, dir, dst: a.octets() }, &v),
        }
    }

    fn erase(&self, maps: &mut &'a TcMaps) -> Result<(), MapError> {
        let (ifindex, prefixlen, dir) = self.key_parts();
        match self.route.dst.addr {
            IpAddr::V4(a) => maps.rt4.delete(&RouteKey4 { prefixlen, ifindex, dir, dst: a.octets() }),
            IpAddr::V6(a) => maps.rt6.delete(&RouteKey6 { prefixlen, ifindex, dir, dst: a.octets() }),
        }
    }
}

impl ResolvedRoute {
    /// Attach ifindex, LPM prefix length and direction of its trie key.
    fn key_parts(&self) -> (u32, u32, u32) {
        (self.attach_ifindex, ROUTE_KEY_PREFIX_BITS + u32::from(self.route.dst.len), self.route.direction.raw())
    }
}

fn route_value(r: &InterfaceRoute, target: u32, id: u32) -> RouteValue {
    let mut v = RouteValue { id, target_ifindex: target, ..RouteValue::default() };
    v.action = match &r.action {
        RouteAction::Redirect(_) => ACT_REDIRECT,
        RouteAction::RedirectPeer(_) => ACT_REDIRECT_PEER,
        RouteAction::RedirectNeigh { next_hop, .. } => {
            if let Some(nh) = next_hop {
                v.flags |= ROUTE_HAS_NEXTHOP;
                let b = Prefix { addr: *nh, len: 0 }.bytes();
                v.nh_family = if nh.is_ipv4() { AF_INET } else { AF_INET6 };
                v.nh_addr[..b.len()].copy_from_slice(&b);
            }
            ACT_REDIRECT_NEIGH
        }
    };
    if let Some(m) = r.rewrite {
        v.flags |= ROUTE_REWRITE_MAC;
        v.smac = m.src;
        v.dmac = m.dst;
    }
    if let Some(s) = r.src {
        v.flags |= ROUTE_HAS_SRC;
        v.src_prefixlen = u32::from(s.len);
        let b = s.bytes();
        v.src[..b.len()].copy_from_slice(&b);
    }
    v
}

/// A route as installed, with its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledRoute {
    pub route: InterfaceRoute,
    pub attach_ifindex: u32,
    pub target_ifindex: u32,
    pub attach_name: String,
    pub target_name: String,
    pub owner: String,
    id: u32,
}

impl InstalledRoute {
    /// The id the data path knows the route by (counters, latency).
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl From<&Entry<ResolvedRoute>> for InstalledRoute {
    fn from(e: &Entry<ResolvedRoute>) -> Self {
        let r = e.rule.clone();
        Self {
            route: r.route,
            attach_ifindex: r.attach_ifindex,
            target_ifindex: r.target_ifindex,
            attach_name: r.attach_name,
            target_name: r.target_name,
            owner: e.owner.clone(),
            id: e.id,
        }
    }
}

/// A route taken out of the data path because an interface it names is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleRoute {
    pub route: InstalledRoute,
    /// Why: which interface disappeared or changed.
    pub reason: String,
    /// Its counters when it was taken out.
    pub last_stats: RouteStats,
}

type RouteId = (u32, Direction, Prefix);

#[derive(Debug, Default)]
struct TcState {
    routes: Table<ResolvedRoute>,
    slots: Slots,
    stale: Vec<StaleRoute>,
}

/// What [`TcDataplane::replace_owner_routes`] changed.
#[derive(Debug, Clone)]
pub struct RouteSync {
    pub created: Vec<InstalledRoute>,
    /// As they are now.
    pub updated: Vec<InstalledRoute>,
    /// As they were.
    pub deleted: Vec<InstalledRoute>,
    pub unchanged: usize,
}

/// The tc redirection data path of one node.
#[derive(Debug)]
pub struct TcDataplane {
    pins: FamilyPins,
    /// This process holds the pins (released when the data path is dropped).
    _pin_lock: PinLock,
    netns: Option<PathBuf>,
    maps: TcMaps,
    latency: LatencyMonitor,
    att_stats: PerCpu<AttachKey, AttachStats>,
    /// What opening did about programs of another build.
    upgrade: Upgrade,
    state: Mutex<TcState>,
}

/// Detaches (unpins the tcx links) and unpins the tc data path under `pin_root`.
pub fn remove_pinned(pin_root: &Path) -> Result<(), TcError> {
    Ok(FamilyPins::tcredir(pin_root).remove()?)
}

fn load_and_pin(cfg: &TcConfig, pins: &FamilyPins) -> Result<(), TcError> {
    pins.create_dirs()?;
    let mut obj = MaybeUninit::uninit();
    let mut open = TcredirSkelBuilder::default().open(&mut obj).map_err(bpf("opening the tc object"))?;
    let maps = &mut open.maps;
    let sizes = [
        (&mut maps.mw_rt4, cfg.max_routes),
        (&mut maps.mw_rt6, cfg.max_routes),
        (&mut maps.mw_rt_stats, cfg.max_routes),
        (&mut maps.mw_rt_owner, cfg.max_routes),
        (&mut maps.mw_lat_rule, cfg.max_routes),
        (&mut maps.mw_lat_hist, cfg.max_routes),
        (&mut maps.mw_lat_rows, cfg.max_routes.min(LAT_ROWS) * LAT_RT_ROW_METRICS),
    ];
    for (m, n) in sizes {
        m.set_max_entries(n).map_err(bpf("sizing route maps"))?;
    }
    let (loaded, log) = crate::loader::with_libbpf_log(|| open.load());
    let skel = loaded.map_err(|source| TcError::Load { source, log })?;
    let maps = [
        (names::MAP_RT4, &skel.maps.mw_rt4),
        (names::MAP_RT6, &skel.maps.mw_rt6),
        (names::MAP_RT_STATS, &skel.maps.mw_rt_stats),
        (names::MAP_ATT_STATS, &skel.maps.mw_att_stats),
        (names::MAP_RT_OWNER, &skel.maps.mw_rt_owner),
        (names::MAP_CH_PKT, &skel.maps.mw_ch_pkt),
        (names::MAP_CHAIN, &skel.maps.mw_chain),
        (names::MAP_CHAIN_GEN, &skel.maps.mw_chain_gen),
        (names::MAP_PLUG_CFG, &skel.maps.mw_plug_cfg),
        (names::MAP_PLUG_STATS, &skel.maps.mw_plug_stats),
        (names::MAP_PLUG_META, &skel.maps.mw_plug_meta),
        (names::MAP_GRACE, &skel.maps.mw_grace),
        (names::MAP_BUILD, &skel.maps.mw_build),
        (names::MAP_PKT_DIR, &skel.maps.mw_pkt_dir),
        (names::MAP_CONFIG, &skel.maps.mw_config),
        (names::MAP_LAT_RULE, &skel.maps.mw_lat_rule),
        (names::MAP_LAT_ROWS, &skel.maps.mw_lat_rows),
        (names::MAP_LAT_HIST, &skel.maps.mw_lat_hist),
        (names::MAP_LAT_ZERO, &skel.maps.mw_lat_zero),
    ];
    skel.maps
        .mw_build
        .update(&0u32.to_ne_bytes(), crate::upgrade::this_build().as_bytes(), MapFlags::ANY)
        .map_err(bpf("writing mw_build"))?;
    skel.maps
        .mw_config
        .update(&0u32.to_ne_bytes(), RuleLatency::FRESH_CONFIG.as_bytes(), MapFlags::ANY)
        .map_err(bpf("writing mw_config"))?;
    // The on_packet chain ends in the host's own decision.
    let fd = skel.progs.mw_pkt_fin.as_fd().as_raw_fd().to_ne_bytes();
    skel.maps
        .mw_ch_pkt
        .update(&CHAIN_FIN.to_ne_bytes(), &fd, MapFlags::ANY)
        .map_err(bpf(format!("installing {}", names::PROG_PKT_FIN)))?;
    for (name, map) in maps {
        let mut h = MapHandle::try_from(map).map_err(bpf(format!("handle of {name}")))?;
        h.pin(pins.map(name)).map_err(bpf(format!("pinning {name}")))?;
    }
    for (name, prog) in tc_progs(&skel.progs) {
        let h = ProgramHandle::try_from(prog).map_err(bpf(format!("handle of {name}")))?;
        h.pin(pins.prog(name)).map_err(bpf(format!("pinning {name}")))?;
    }
    Ok(())
}

/// meshwarp's cls_bpf filter (clsact, kernels without tcx).
const FILTER_HANDLE: u32 = 0x6d77;
const FILTER_PRIORITY: u32 = 1;

fn filter_hook(prog: std::os::fd::BorrowedFd<'_>, ifindex: u32, dir: Direction) -> libbpf_rs::TcHook {
    let point = match dir {
        Direction::Ingress => libbpf_rs::TC_INGRESS,
        Direction::Egress => libbpf_rs::TC_EGRESS,
    };
    libbpf_rs::TcHookBuilder::new(prog)
        .ifindex(ifindex as i32)
        .replace(true)
        .handle(FILTER_HANDLE)
        .priority(FILTER_PRIORITY)
        .hook(point)
}

/// meshwarp's cls_bpf filters on the interfaces of the node's namespace:
/// (ifindex, direction, program id).
fn clsact_filters(netns: Option<&Path>) -> Result<Vec<(u32, Direction, u32)>, UpgradeError> {
    let err = |source: std::io::Error| UpgradeError::Step { step: "listing tc filters".into(), source };
    let links = netlink::in_netns(netns, async |h| netlink::links(&h).await)
        .map_err(|e| err(std::io::Error::other(e.to_string())))?;
    let found = crate::sys::run_in_netns(netns, || {
        let mut out = Vec::new();
        // The query needs some program fd in the hook; the filter's is read back.
        let any = std::fs::File::open("/dev/null")?;
        for l in &links {
            for dir in [Direction::Ingress, Direction::Egress] {
                if let Ok(id) = filter_hook(any.as_fd(), l.index, dir).query() {
                    out.push((l.index, dir, id));
                }
            }
        }
        Ok::<_, std::io::Error>(out)
    })
    .map_err(|e| err(std::io::Error::other(e.to_string())))?
    .map_err(err)?;
    Ok(found)
}

/// Points meshwarp's filter on `ifindex` at `prog` (an atomic tc filter replace).
fn replace_filter(
    netns: Option<&Path>,
    step: &str,
    ifindex: u32,
    dir: Direction,
    prog: std::os::fd::BorrowedFd<'_>,
) -> Result<(), UpgradeError> {
    let fd = prog.as_raw_fd();
    let r = crate::sys::run_in_netns(netns, || {
        // SAFETY: the caller's fd outlives this call.
        let prog = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        filter_hook(prog, ifindex, dir).attach().map(|_| ())
    });
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(source)) => Err(UpgradeError::Bpf { what: step.to_string(), source }),
        Err(e) => Err(UpgradeError::Step { step: step.to_string(), source: std::io::Error::other(e.to_string()) }),
    }
}

/// The pinned tcx links (`links/if<ifindex>-<in|out>`): path, ifindex, direction.
fn pinned_attachments(pins: &FamilyPins) -> Vec<(PathBuf, u32, Direction)> {
    let mut out = Vec::new();
    for e in fs::read_dir(pins.links_dir()).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((idx, d)) = name.strip_prefix("if").and_then(|r| r.split_once('-')) else { continue };
        let dir = match d {
            _ if d == Direction::Ingress.short() => Direction::Ingress,
            _ if d == Direction::Egress.short() => Direction::Egress,
            _ => continue,
        };
        if let Ok(idx) = idx.parse() {
            out.push((e.path(), idx, dir));
        }
    }
    out
}

/// The tc family's pinned programs, by pin name.
fn tc_progs<'a>(p: &'a TcredirProgs<'a>) -> [(&'static str, &'a libbpf_rs::ProgramMut<'a>); 2] {
    [(names::PROG_TC_INGRESS, &p.mw_tc_ingress), (names::PROG_TC_EGRESS, &p.mw_tc_egress)]
}

/// Replaces the programs of the tc family pinned in `pins` with this build's,
/// over its maps ([`crate::upgrade`]): the chain's end, each pinned tcx link
/// (an interface's attachment, updated in place), the program pins, then the
/// build id. Attachments made through clsact (kernels without tcx) are not
/// pinned: they are found by meshwarp's filter handle on the node's
/// interfaces and replaced in place (tc filter replace).
fn upgrade_programs(pins: &FamilyPins, netns: Option<&Path>) -> Result<Vec<String>, UpgradeError> {
    let mut obj = MaybeUninit::uninit();
    let mut open = TcredirSkelBuilder::default()
        .open(&mut obj)
        .map_err(|source| UpgradeError::Bpf { what: "opening the tc object".into(), source })?;
    upgrade::reuse_pinned_maps(open.open_object_mut().maps_mut(), &pins.maps_dir(), pins.added_maps())?;
    let (loaded, log) = crate::loader::with_libbpf_log(|| open.load());
    let skel = loaded.map_err(|source| UpgradeError::Load { source, log })?;
    let p = &skel.progs;
    let links: Vec<(PathBuf, Direction)> =
        pinned_attachments(pins).into_iter().map(|(path, _, dir)| (path, dir)).collect();
    let filters = clsact_filters(netns)?;
    let prog_of = |dir: Direction| match dir {
        Direction::Ingress => &p.mw_tc_ingress,
        Direction::Egress => &p.mw_tc_egress,
    };
    upgrade::run(&pins.maps_dir(), |swap| {
        swap.prog_array(&pins.map(names::MAP_CH_PKT), CHAIN_FIN, p.mw_pkt_fin.as_fd())?;
        for (path, dir) in &links {
            swap.link_prog(path, prog_of(*dir).as_fd())?;
        }
        for &(ifindex, dir, old_id) in &filters {
            let name = format!("clsact if{ifindex}-{}", dir.short());
            let old = upgrade::prog_fd_by_id(&name, old_id)?;
            let new = prog_of(dir).as_fd();
            let ns = netns.map(Path::to_path_buf);
            let (n1, n2) = (name.clone(), name.clone());
            swap.step(
                name,
                || replace_filter(netns, &n1, ifindex, dir, new),
                move || replace_filter(ns.as_deref(), &n2, ifindex, dir, old.as_fd()),
            )?;
        }
        for (name, prog) in tc_progs(p) {
            swap.prog_pin(&pins.prog(name), prog.as_fd())?;
        }
        Ok(())
    })
}

impl TcDataplane {
    /// Adopts the tc data path pinned under `cfg.pin_root`, or loads and pins it.
    pub fn open(cfg: &TcConfig) -> Result<Self, TcError> {
        crate::sys::ensure_bpffs(&cfg.pin_root)?;
        let pins = FamilyPins::tcredir(&cfg.pin_root);
        let pin_lock = pins.lock()?;
        let (missing, none_pinned) = pins.missing();
        if none_pinned {
            if let Err(e) = load_and_pin(cfg, &pins) {
                // Leave neither partial pins nor empty directories.
                let _ = remove_pinned(&cfg.pin_root);
                return Err(e);
            }
        } else if !missing.is_empty() {
            return Err(TcError::Partial { dir: pins.dir().to_path_buf(), missing });
        } else {
            pins.clear_stray();
        }
        let dir = pins.maps_dir();
        let upgrade = upgrade::apply("tc", &dir, || upgrade_programs(&pins, cfg.netns.as_deref()))?;
        if !matches!(upgrade, Upgrade::None) {
            RuleLatency::mark_used(&dir)?;
        }
        let dp = Self {
            maps: TcMaps {
                rt4: TypedMap::pinned(&dir, names::MAP_RT4)?,
                rt6: TypedMap::pinned(&dir, names::MAP_RT6)?,
                rt_stats: PerCpu::pinned(&dir, names::MAP_RT_STATS)?,
                rt_owner: TypedMap::pinned(&dir, names::MAP_RT_OWNER)?,
                lat: RuleLatency::open(&dir, crate::maps::RowShape::ROUTES)?,
            },
            latency: LatencyMonitor::routes(&pins)?,
            att_stats: PerCpu::pinned(&dir, names::MAP_ATT_STATS)?,
            netns: cfg.netns.clone(),
            upgrade,
            state: Mutex::new(TcState::default()),
            pins,
            _pin_lock: pin_lock,
        };
        dp.reconcile()?;
        Ok(dp)
    }

    /// The latency monitor of the routes (transit per route id).
    pub fn latency(&self) -> &LatencyMonitor {
        &self.latency
    }

    /// Whether opening replaced another build's programs (or failed to).
    pub fn upgrade(&self) -> &Upgrade {
        &self.upgrade
    }

    /// The build id of the programs that run.
    pub fn programs_build(&self) -> Result<String, TcError> {
        Ok(upgrade::programs_build(&self.pins.maps_dir())?)
    }

    /// The tc data path's pin directory.
    pub fn pin_dir(&self) -> &Path {
        self.pins.dir()
    }

    /// Rebuilds the route table from the LPM maps (adoption).
    fn reconcile(&self) -> Result<(), TcError> {
        let links = netlink::in_netns(self.netns.as_deref(), async |h| netlink::links(&h).await)?;
        let name_of = |i: u32| links.iter().find(|l| l.index == i).map(|l| l.name.clone()).unwrap_or_default();
        let owner_of = |id: u32| self.maps.rt_owner.get(&id).ok().flatten().map(|o| o.as_string()).unwrap_or_default();
        let capacity = (&self.maps).slot_capacity();
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        let mut adopt_one = |ifindex: u32, dir: u32, dst: IpAddr, prefixlen: u32, val: &RouteValue| {
            let direction = if dir == DIR_INGRESS { Direction::Ingress } else { Direction::Egress };
            let len = prefixlen.saturating_sub(ROUTE_KEY_PREFIX_BITS);
            let dst = Prefix::new("dst", dst, u8::try_from(len).unwrap_or(u8::MAX))?;
            let route = route_from_value(IfaceRef::Index(ifindex), direction, dst, val, dst.addr.is_ipv6())?;
            let resolved = ResolvedRoute {
                route,
                attach_ifindex: ifindex,
                target_ifindex: val.target_ifindex,
                attach_name: name_of(ifindex),
                target_name: name_of(val.target_ifindex),
            };
            st.routes.adopt(&mut st.slots, capacity, resolved, val.id, owner_of(val.id)).map_err(TcError::from)
        };
        // An entry this build cannot take back (damaged, or a slot held
        // twice) leaves the data path: its packets take the normal path, and
        // the rest of the routes are adopted.
        let drop_bad =
            |what: String, e: TcError| tracing::warn!(route = %what, "dropped a route meshwarp cannot adopt: {e}");
        for (k, v) in self.maps.rt4.entries()? {
            if let Err(e) = adopt_one(k.ifindex, k.dir, IpAddr::from(k.dst), k.prefixlen, &v) {
                drop_bad(format!("{} on if{}", IpAddr::from(k.dst), k.ifindex), e);
                self.maps.rt4.delete(&k)?;
            }
        }
        for (k, v) in self.maps.rt6.entries()? {
            if let Err(e) = adopt_one(k.ifindex, k.dir, IpAddr::from(k.dst), k.prefixlen, &v) {
                drop_bad(format!("{} on if{}", IpAddr::from(k.dst), k.ifindex), e);
                self.maps.rt6.delete(&k)?;
            }
        }
        st.slots.rebuild_free();
        Ok(())
    }

    fn prog_fd(&self, dir: Direction) -> Result<ProgramHandle, TcError> {
        let name = match dir {
            Direction::Ingress => names::PROG_TC_INGRESS,
            Direction::Egress => names::PROG_TC_EGRESS,
        };
        ProgramHandle::from_pinned_path(self.pins.prog(name)).map_err(bpf(format!("opening {name}")))
    }

    fn link_path(&self, ifindex: u32, dir: Direction) -> PathBuf {
        self.pins.link(&format!("if{ifindex}-{}", dir.short()))
    }

    /// Attaches the tc program to `iface` in `dir`: a tcx link where the
    /// kernel has tcx, else clsact + cls_bpf. Idempotent for tcx.
    pub fn attach(&self, iface: &IfaceRef, dir: Direction) -> Result<(u32, AttachMode), TcError> {
        let prog = self.prog_fd(dir)?;
        let link = netlink::in_netns(self.netns.as_deref(), async |h| netlink::link(&h, iface).await)?;
        let path = self.link_path(link.index, dir);
        if path.exists() {
            return Ok((link.index, AttachMode::Tcx));
        }
        let mode = self.in_ns(|| attach_in_ns(prog.as_fd().as_raw_fd(), link.index, dir, &path))?;
        Ok((link.index, mode))
    }

    /// Runs `f` on a thread inside the dataplane's namespace.
    fn in_ns<T: Send>(&self, f: impl FnOnce() -> Result<T, TcError> + Send) -> Result<T, TcError> {
        crate::sys::run_in_netns(self.netns.as_deref(), f)?
    }

    /// Removes the tcx attachment of `ifindex` in `dir`.
    pub fn detach(&self, ifindex: u32, dir: Direction) -> Result<(), TcError> {
        let path = self.link_path(ifindex, dir);
        fs::remove_file(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                TcError::Rule(RuleError::NotFound(format!("attachment if{ifindex} {dir:?}")))
            } else {
                TcError::Io(IoError::new(format!("unpinning {}", path.display()), e))
            }
        })
    }

    /// Tcx attachments, as (ifindex, direction).
    pub fn attachments(&self) -> Vec<(u32, Direction)> {
        let mut out: Vec<_> = pinned_attachments(&self.pins).into_iter().map(|(_, i, d)| (i, d)).collect();
        out.sort();
        out
    }

    /// Checks a route against the node: interfaces exist, RedirectPeer targets a veth.
    fn resolve(&self, route: &InterfaceRoute) -> Result<ResolvedRoute, TcError> {
        route.validate()?;
        let target = route.action.target().clone();
        let attach = route.attach.clone();
        let (a, t) = netlink::in_netns(self.netns.as_deref(), async |h| {
            Ok((netlink::link(&h, &attach).await?, netlink::link(&h, &target).await?))
        })
        .map_err(unknown_iface)?;
        if matches!(route.action, RouteAction::RedirectPeer(_)) && !t.is_veth() {
            return Err(RouteError::NotVeth(t.name).into());
        }
        Ok(ResolvedRoute {
            route: route.clone(),
            attach_ifindex: a.index,
            target_ifindex: t.index,
            attach_name: a.name,
            target_name: t.name,
        })
    }

    /// The ifindex of an attach point named in a route key.
    pub fn resolve_iface(&self, iface: &IfaceRef) -> Result<u32, TcError> {
        let iface = iface.clone();
        Ok(netlink::in_netns(self.netns.as_deref(), async |h| netlink::link(&h, &iface).await)
            .map_err(unknown_iface)?
            .index)
    }

    /// Installs a new route; interfaces are resolved in the node's namespace.
    pub fn insert_route(&self, route: &InterfaceRoute, owner: &str) -> Result<InstalledRoute, TcError> {
        let resolved = self.resolve(route)?;
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        st.routes.create(&mut &self.maps, &mut st.slots, &resolved, owner)?;
        Ok(st.routes.get(&resolved)?.into())
    }

    /// Whether [`TcDataplane::replace_owner_routes`] would be refused for
    /// what the routes say (an interface that does not exist, a key twice,
    /// another owner's route, no room), without changing anything: a sync
    /// that also changes rules checks its routes before it touches them.
    pub fn check_replace(&self, owner: &str, routes: &[InterfaceRoute]) -> Result<(), TcError> {
        let resolved = routes.iter().map(|r| self.resolve(r)).collect::<Result<Vec<_>, _>>()?;
        let st = crate::sys::lock(&self.state);
        let (_, new) = st.routes.plan_replace(&resolved, owner)?;
        Ok(st.slots.room_for(new, (&self.maps).slot_capacity())?)
    }

    /// Makes the routes `owner` registered exactly `routes` (a controller's
    /// full desired state): routes left out are removed, new ones created,
    /// changed ones updated; all or nothing. Every route is checked against
    /// the node's interfaces before anything changes.
    pub fn replace_owner_routes(&self, owner: &str, routes: &[InterfaceRoute]) -> Result<RouteSync, TcError> {
        let resolved = routes.iter().map(|r| self.resolve(r)).collect::<Result<Vec<_>, _>>()?;
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        let done = st.routes.replace_owner(&mut &self.maps, &mut st.slots, &resolved, owner)?;
        let now = |r: &ResolvedRoute| st.routes.get(r).ok().map(InstalledRoute::from);
        Ok(RouteSync {
            created: done.created.iter().filter_map(now).collect(),
            updated: done.updated.iter().filter_map(|(r, _)| now(r)).collect(),
            deleted: done.deleted.iter().map(InstalledRoute::from).collect(),
            unchanged: done.unchanged,
        })
    }

    /// Creates the route, or replaces the one with the same attach point,
    /// direction and destination (keeping its counters) if `owner` owns it.
    pub fn upsert_route(&self, route: &InterfaceRoute, owner: &str) -> Result<(InstalledRoute, Outcome), TcError> {
        let resolved = self.resolve(route)?;
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        let outcome = st.routes.upsert(&mut &self.maps, &mut st.slots, &resolved, owner)?;
        Ok((st.routes.get(&resolved)?.into(), outcome))
    }

    /// Removes the route of (attach point, direction, destination), checking
    /// the owner when given.
    pub fn delete_route(
        &self,
        attach: &IfaceRef,
        dir: Direction,
        dst: Prefix,
        owner: Option<&str>,
    ) -> Result<InstalledRoute, TcError> {
        let ifindex = self.resolve_iface(attach)?;
        self.delete_key((ifindex, dir, dst), owner, attach)
    }

    fn delete_key(&self, key: RouteId, owner: Option<&str>, attach: &IfaceRef) -> Result<InstalledRoute, TcError> {
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        let rule = st.routes.get_key(&key).map(|e| e.rule.clone()).ok_or_else(|| not_found(attach, &key))?;
        Ok((&st.routes.delete(&mut &self.maps, &mut st.slots, &rule, owner)?).into())
    }

    /// All or nothing: every route is resolved and checked before any is
    /// written; a failure while writing restores what was written.
    pub fn batch_upsert_routes(
        &self,
        routes: &[InterfaceRoute],
        owner: &str,
    ) -> Result<Vec<(InstalledRoute, Outcome)>, TcError> {
        table::owner_name(owner)?;
        let resolved = routes.iter().map(|r| self.resolve(r)).collect::<Result<Vec<_>, _>>()?;
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        let outcomes = st.routes.batch_upsert(&mut &self.maps, &mut st.slots, &resolved, owner)?;
        resolved.iter().zip(outcomes).map(|(r, o)| Ok((st.routes.get(r)?.into(), o))).collect()
    }

    /// All or nothing; with `allow_missing` absent routes are skipped (`None`).
    pub fn batch_delete_routes(
        &self,
        keys: &[(IfaceRef, Direction, Prefix)],
        owner: &str,
        allow_missing: bool,
    ) -> Result<Vec<Option<InstalledRoute>>, TcError> {
        let ids = keys
            .iter()
            .map(|(iface, dir, dst)| Ok((self.resolve_iface(iface)?, *dir, *dst)))
            .collect::<Result<Vec<RouteId>, TcError>>()?;
        table::owner_name(owner)?;
        let mut guard = crate::sys::lock(&self.state);
        let st = &mut *guard;
        // The table deletes rules; a key names the installed one (or none).
        // Checked in order, so the first bad key is the one reported.
        let mut seen = BTreeSet::new();
        let mut present = Vec::new();
        let mut found = Vec::with_capacity(ids.len());
        for ((iface, _, _), id) in keys.iter().zip(&ids) {
            if !seen.insert(*id) {
                return Err(RuleError::DuplicateInBatch(format!("route {} on {iface} {:?}", id.2, id.1)).into());
            }
            match st.routes.get_key(id) {
                Some(e) => {
                    e.check_owner(owner)?;
                    present.push(e.rule.clone());
                    found.push(true);
                }
                None if allow_missing => found.push(false),
                None => return Err(not_found(iface, id).into()),
            }
        }
        let mut removed = st.routes.batch_delete(&mut &self.maps, &mut st.slots, &present, owner, false)?.into_iter();
        Ok(found.into_iter().map(|f| f.then(|| removed.next().flatten().map(|e| (&e).into())).flatten()).collect())
    }

    /// Removes the route of (attach ifindex, direction, dst) whoever owns it.
    pub fn remove_route(&self, attach_ifindex: u32, dir: Direction, dst: Prefix) -> Result<(), TcError> {
        self.delete_key((attach_ifindex, dir, dst), None, &IfaceRef::Index(attach_ifindex)).map(|_| ())
    }

    pub fn routes(&self) -> Vec<InstalledRoute> {
        crate::sys::lock(&self.state).routes.entries().map(InstalledRoute::from).collect()
    }

    /// Routes taken out because an interface they name disappeared.
    pub fn stale_routes(&self) -> Vec<StaleRoute> {
        crate::sys::lock(&self.state).stale.clone()
    }

    /// Forgets a stale route (the controller has seen it).
    pub fn forget_stale(&self, attach_ifindex: u32, dir: Direction, dst: Prefix) -> Result<(), TcError> {
        let mut st = crate::sys::lock(&self.state);
        let before = st.stale.len();
        st.stale.retain(|s| {
            !(s.route.attach_ifindex == attach_ifindex && s.route.route.direction == dir && s.route.route.dst == dst)
        });
        if st.stale.len() == before {
            return Err(RuleError::NotFound(format!("stale route {dst} on if{attach_ifindex}")).into());
        }
        Ok(())
    }

    /// Compares routes and attachments with the interfaces that exist now:
    /// a route whose attach or target interface is gone, or whose index now
    /// belongs to another interface, leaves the data path (so nothing
    /// redirects to a reused ifindex) and is listed as stale; attachments of
    /// vanished interfaces are released. Returns the routes that became stale.
    pub fn refresh(&self) -> Result<Vec<StaleRoute>, TcError> {
        let links = netlink::in_netns(self.netns.as_deref(), async |h| netlink::links(&h).await)?;
        let alive = |i: u32, name: &str| links.iter().any(|l| l.index == i && l.name == name);
        for (ifindex, dir) in self.attachments() {
            if !links.iter().any(|l| l.index == ifindex) {
                let _ = self.detach(ifindex, dir);
                tracing::info!(ifindex, ?dir, "released the attachment of a vanished interface");
            }
        }
        let gone: Vec<(RouteId, String)> = crate::sys::lock(&self.state)
            .routes
            .entries()
            .map(|e| (table::Rule::rule_key(&e.rule), &e.rule))
            .filter_map(|(k, r)| {
                if !alive(r.attach_ifindex, &r.attach_name) {
                    Some((k, format!("attach interface {} (ifindex {}) is gone", r.attach_name, r.attach_ifindex)))
                } else if !alive(r.target_ifindex, &r.target_name) {
                    Some((k, format!("target interface {} (ifindex {}) is gone", r.target_name, r.target_ifindex)))
                } else {
                    None
                }
            })
            .collect();
        let mut out = Vec::new();
        for ((ifindex, dir, dst), reason) in gone {
            let Some(r) = crate::sys::lock(&self.state).routes.get_key(&(ifindex, dir, dst)).map(InstalledRoute::from)
            else {
                continue;
            };
            let last_stats = self.route_stats(&r).unwrap_or_default();
            self.remove_route(ifindex, dir, dst)?;
            tracing::warn!(route = %r.route, %reason, "route is stale");
            let s = StaleRoute { route: r, reason, last_stats };
            crate::sys::lock(&self.state).stale.push(s.clone());
            out.push(s);
        }
        Ok(out)
    }

    /// Packets and bytes a route redirected, and redirects the kernel refused.
    pub fn route_stats(&self, r: &InstalledRoute) -> Result<RouteStats, TcError> {
        Ok(self.maps.rt_stats.sum(&r.id, |a, b| {
            a.packets += b.packets;
            a.bytes += b.bytes;
            a.redirect_err += b.redirect_err;
        })?)
    }

    /// Packets seen and misses of one attach point.
    pub fn attach_stats(&self, ifindex: u32, dir: Direction) -> Result<AttachStats, TcError> {
        let k = AttachKey { ifindex, dir: dir.raw() };
        Ok(self.att_stats.sum(&k, |a, b| {
            a.packets += b.packets;
            a.misses += b.misses;
        })?)
    }

    /// Detaches and unpins everything.
    pub fn teardown(self) -> Result<(), TcError> {
        let pins = self.pins.clone();
        drop(self);
        Ok(pins.remove()?)
    }
}

fn unknown_iface(e: NetlinkError) -> TcError {
    match e {
        NetlinkError::NoSuchInterface(n) => TcError::Invalid(RouteError::UnknownInterface(n)),
        other => TcError::Netlink(other),
    }
}

/// A route key that names no route, with the interface as the caller named it.
fn not_found(attach: &IfaceRef, (_, dir, dst): &RouteId) -> RuleError {
    RuleError::NotFound(format!("route {dst} on {attach} {dir:?}"))
}

fn route_from_value(
    attach: IfaceRef,
    direction: Direction,
    dst: Prefix,
    v: &RouteValue,
    v6: bool,
) -> Result<InterfaceRoute, TcError> {
    let target = IfaceRef::Index(v.target_ifindex);
    let addr = |b: &[u8; 16]| -> IpAddr {
        if v6 {
            IpAddr::from(*b)
        } else {
            IpAddr::from([b[0], b[1], b[2], b[3]])
        }
    };
    let action = match v.action {
        ACT_REDIRECT_PEER => RouteAction::RedirectPeer(target),
        ACT_REDIRECT_NEIGH => RouteAction::RedirectNeigh {
            to: target,
            next_hop: (v.flags & ROUTE_HAS_NEXTHOP != 0).then(|| {
                if v.nh_family == AF_INET6 {
                    IpAddr::from(v.nh_addr)
                } else {
                    addr(&v.nh_addr)
                }
            }),
        },
        _ => RouteAction::Redirect(target),
    };
    let src = if v.flags & ROUTE_HAS_SRC != 0 {
        Some(Prefix::new("src", addr(&v.src), u8::try_from(v.src_prefixlen).unwrap_or(0))?)
    } else {
        None
    };
    let rewrite = (v.flags & ROUTE_REWRITE_MAC != 0).then_some(MacRewrite { src: v.smac, dst: v.dmac });
    Ok(InterfaceRoute { attach, direction, dst, src, action, rewrite })
}

/// In the node's namespace: a tcx link (pinned at `path`), or clsact.
fn attach_in_ns(prog_fd: i32, ifindex: u32, dir: Direction, path: &Path) -> Result<AttachMode, TcError> {
    let attach_type = match dir {
        Direction::Ingress => libbpf_sys::BPF_TCX_INGRESS,
        Direction::Egress => libbpf_sys::BPF_TCX_EGRESS,
    };
    // SAFETY: zeroed opts with the right size are valid input.
    let mut opts: libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
    opts.sz = size_of::<libbpf_sys::bpf_link_create_opts>() as _;
    // SAFETY: valid program fd and options.
    let fd = unsafe { libbpf_sys::bpf_link_create(prog_fd, ifindex as i32, attach_type, &opts) };
    if fd >= 0 {
        // SAFETY: a new link fd we own; the pin keeps the link.
        let link = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        crate::pins::pin_fd(link.as_fd(), path)?;
        return Ok(AttachMode::Tcx);
    }
    if -fd != libc::EINVAL && -fd != libc::EOPNOTSUPP {
        return Err(TcError::Io(IoError::new(
            format!("tcx attach to ifindex {ifindex}"),
            std::io::Error::from_raw_os_error(-fd),
        )));
    }
    // No tcx: clsact + cls_bpf (direct action).
    // SAFETY: prog_fd stays open for the duration of this call.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(prog_fd) };
    let mut hook = filter_hook(borrowed, ifindex, dir);
    hook.create().map_err(bpf(format!("clsact on ifindex {ifindex}")))?;
    hook.attach().map_err(bpf(format!("cls_bpf on ifindex {ifindex}")))?;
    Ok(AttachMode::Clsact)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn prefixes_are_masked_and_bounded() {
        let p = Prefix::new("dst", ip("198.18.2.77"), 24).unwrap();
        assert_eq!(p.to_string(), "198.18.2.0/24");
        assert_eq!(Prefix::new("dst", ip("2001:db8:b::9"), 64).unwrap().to_string(), "2001:db8:b::/64");
        assert_eq!(Prefix::new("dst", ip("1.2.3.4"), 0).unwrap().to_string(), "0.0.0.0/0");
        assert!(matches!(Prefix::new("dst", ip("1.2.3.4"), 33), Err(RouteError::PrefixLen { max: 32, .. })));
        assert!(matches!(Prefix::new("src", ip("::1"), 129), Err(RouteError::PrefixLen { max: 128, .. })));
    }

    #[test]
    fn validation() {
        let base = InterfaceRoute {
            attach: IfaceRef::Name("vpod0".into()),
            direction: Direction::Ingress,
            dst: Prefix::new("dst", ip("198.18.2.0"), 24).unwrap(),
            src: None,
            action: RouteAction::Redirect(IfaceRef::Name("vxlan0".into())),
            rewrite: None,
        };
        base.validate().unwrap();
        let mixed = InterfaceRoute { src: Some(Prefix::new("src", ip("2001:db8::"), 64).unwrap()), ..base.clone() };
        assert!(matches!(mixed.validate(), Err(RouteError::MixedFamilies(_))));
        let nh = InterfaceRoute {
            action: RouteAction::RedirectNeigh { to: IfaceRef::Index(3), next_hop: Some(ip("2001:db8::1")) },
            ..base.clone()
        };
        assert!(matches!(nh.validate(), Err(RouteError::MixedFamilies(_))));
        let peer_out = InterfaceRoute {
            direction: Direction::Egress,
            action: RouteAction::RedirectPeer(IfaceRef::Index(3)),
            ..base
        };
        assert_eq!(peer_out.validate(), Err(RouteError::PeerOnEgress));
    }
}
