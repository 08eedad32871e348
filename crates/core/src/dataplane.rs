//! The [`Dataplane`]: loads the socket-redirection programs, attaches sockops to
//! a cgroup v2 and sk_msg to the SOCKMAP, pins everything under a bpffs root,
//! adopts an instance that is already pinned, and removes exactly what it made.
//!
//! Pinned layout ([`FamilyPins::sockredir`]):
//! ```text
//! <pin_root>/v<SCHEMA>/maps/<map name>
//! <pin_root>/v<SCHEMA>/progs/mw_sockops, mw_sk_msg, mw_recv_len, mw_sys_enter, mw_setsockopt, mw_connect4, mw_connect6,
//!                           mw_destroy, mw_park,
//!                           mw_unlink
//! <pin_root>/v<SCHEMA>/links/mw_sockops, mw_setsockopt, mw_connect4, mw_connect6   (the cgroup attachments)
//! <pin_root>/v<SCHEMA>/links/mw_recv_len, mw_sys_enter   (reads of covered sockets; system calls, when the guard watches them)
//! ```
//!
//! On every open the kernel is probed ([`KernelProbe`]) and the reader guard
//! ([`GuardMode`]) configured from the answers: `mw_config` tells the programs
//! which kernel gaps to avoid, the guard's tracepoints are attached or
//! detached, and a guard thread ([`crate::guard`]) serves the programs.

use std::fs;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

use libbpf_rs::skel::OpenSkel;
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, ProgramHandle};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    Config, CookieVal, Exe, ExeKey, Link as LinkValue, Pod, CFG_BLOCKING_EAGAIN, CFG_FIONREAD_PSOCK, CFG_GUARD,
    CFG_LATENCY, CFG_LAT_ALL, CFG_LAT_CLEAN, CFG_LAT_EVERY, CFG_SPLICE_BLIND, CFG_SYSCALL_WATCH, CHAIN_FIN,
    EXE_SEEN_SPLICE, LAT_ROWS, LAT_ROW_METRICS,
};

use crate::conns::{ConnFilter, ConnLister, ConnSource, Connection, ConnsError};
use crate::endpoint::{CaptureRule, EndpointPair};
use crate::error::{BpfError, IoError};
use crate::guard::{GuardMode, GuardThread, Incident, Subscribers};
use crate::latency::{LatencyError, LatencyMonitor};
use crate::loader;
use crate::maps::{KernelMaps, MapError, RuleLatency, TypedMap};
use crate::pins::{FamilyPins, PinLock};
use crate::probe::KernelProbe;
use crate::registry::{Registry, SockRule};
use crate::stats::{GlobalCounters, RuleCounters};
use crate::sys::{self, SysError};
use crate::table::{Outcome, RuleError, Stored};
use crate::upgrade::{self, Upgrade, UpgradeError};

pub use meshwarp_bpf::shared::SCHEMA_VERSION;

/// Default bpffs directory for meshwarp's pins.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/meshwarp";

/// How to load or find the data path.
#[derive(Debug, Clone)]
pub struct DataplaneConfig {
    /// bpffs directory holding the pins.
    pub pin_root: PathBuf,
    /// cgroup v2 directory sockops is attached to; `None`: the root of the
    /// first cgroup2 mount (one is mounted if the host has none).
    pub cgroup: Option<PathBuf>,
    /// Pairs + capture rules the data path has room for.
    pub max_rules: u32,
    /// Sockets the SOCKMAP can hold (as `max_sockets / 2` link slots, each
    /// with an entry per end); beyond that, connections fall back. A new link
    /// probes 16 slots from its hash, so a nearly full map may turn
    /// connections away a little earlier.
    pub max_sockets: u32,
    /// Whether the reader guard decides which sockets may receive redirected bytes.
    pub guard: GuardMode,
    /// Executables the operator vouches never splice the sockets they read
    /// (e.g. a proxy whose configuration has no splice option).
    pub trusted_readers: Vec<PathBuf>,
    /// With the reader guard: watch splice(), FIONREAD and sends of urgent
    /// data (MSG_OOB) at system call entry, so that a program nothing in its
    /// ELF said could splice fails loudly (reset) instead of losing bytes,
    /// and urgent data takes the TCP path. Costs about 50-70 ns on every
    /// system call of the node (benches/README.md); off, such a program's
    /// first spliced connection can lose bytes silently, and urgent data is
    /// redirected in-band.
    pub syscall_watch: bool,
    /// Run the guard thread at real-time priority (SCHED_FIFO 1) while it
    /// waits for and serves the programs' unlink requests, so that a
    /// demoted connection leaves the SOCKMAP within microseconds on a busy
    /// node rather than after the applications' time slices; walks and
    /// classifications still run at normal priority. Needs CAP_SYS_NICE
    /// (without it: normal priority, with a warning).
    pub guard_realtime: bool,
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        Self {
            pin_root: DEFAULT_PIN_ROOT.into(),
            cgroup: None,
            max_rules: 16384,
            max_sockets: 65536,
            guard: GuardMode::Auto,
            trusted_readers: Vec::new(),
            syscall_watch: true,
            guard_realtime: true,
        }
    }
}

/// Whether [`Dataplane::open`] loaded programs or found them pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Loaded,
    Adopted,
}

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("loading the BPF programs: {source}\n--- verifier/libbpf log ---\n{log}")]
    Load {
        #[source]
        source: libbpf_rs::Error,
        log: String,
    },
    #[error(transparent)]
    Bpf(#[from] crate::error::BpfError),
    #[error(transparent)]
    Io(#[from] crate::error::IoError),
    #[error("max_rules and max_sockets must be at least 1 (got {max_rules}, {max_sockets})")]
    BadConfig { max_rules: u32, max_sockets: u32 },
    #[error("{dir} holds a partial meshwarp instance (missing {missing:?}); run `meshwarp uninstall` to clear it")]
    Partial { dir: PathBuf, missing: Vec<String> },
    #[error(
        "{dir} holds pins of schema {found}, this build uses {SCHEMA_VERSION} and cannot read their rules; \
         `meshwarp uninstall` first (open connections stay accelerated until they close; rules must be registered again)"
    )]
    Schema { dir: PathBuf, found: String },
    #[error(transparent)]
    Map(#[from] MapError),
    #[error(transparent)]
    Registry(#[from] RuleError),
    #[error(transparent)]
    Guard(#[from] crate::guard::GuardError),
    #[error(transparent)]
    Upgrade(#[from] UpgradeError),
    #[error(transparent)]
    Latency(#[from] LatencyError),
    #[error(transparent)]
    Conns(#[from] ConnsError),
}

fn bpf_err(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> DataplaneError {
    let what = what.into();
    move |source| DataplaneError::Bpf(BpfError::new(what, source))
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataplaneError + '_ {
    move |source| DataplaneError::Io(IoError::new(path.display().to_string(), source))
}

/// Removes pins made so far unless the load completes.
struct PinGuard {
    paths: Vec<PathBuf>,
    done: bool,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if !self.done {
            for p in self.paths.iter().rev() {
                let _ = fs::remove_file(p);
            }
        }
    }
}

/// A loaded (or adopted) socket-redirection data path.
#[derive(Debug)]
pub struct Dataplane {
    layout: FamilyPins,
    /// This process holds the pins (released when the data path is dropped).
    _pin_lock: PinLock,
    pin_root: PathBuf,
    origin: Origin,
    /// Which build loaded the pinned programs.
    programs_build: String,
    /// What opening did about programs of another build.
    upgrade: Upgrade,
    sockmap: TypedMap<u32, u64>,
    tgtmap: TypedMap<u32, u64>,
    links: TypedMap<u32, LinkValue>,
    cookies: TypedMap<u64, CookieVal>,
    registry: Mutex<Registry<KernelMaps>>,
    kernel: KernelProbe,
    /// What mw_config says (`CFG_*`).
    guard_flags: u32,
    trusted_readers: Vec<PathBuf>,
    subscribers: Arc<Subscribers>,
    latency: LatencyMonitor,
    conns: ConnLister,
    /// Dropped first: stops the guard thread.
    guard: Option<GuardThread>,
}

impl Dataplane {
    /// Adopts the instance pinned under `cfg.pin_root`, or loads and pins a new
    /// one. Never loads a second copy next to a pinned one.
    pub fn open(cfg: &DataplaneConfig) -> Result<Self, DataplaneError> {
        if cfg.max_rules == 0 || cfg.max_sockets == 0 {
            return Err(DataplaneError::BadConfig { max_rules: cfg.max_rules, max_sockets: cfg.max_sockets });
        }
        sys::ensure_bpffs(&cfg.pin_root)?;
        let layout = FamilyPins::sockredir(&cfg.pin_root);
        check_schema(&cfg.pin_root)?;
        let pin_lock = layout.lock()?;
        let (missing, none_pinned) = layout.missing();
        let origin = if missing.is_empty() {
            tracing::info!(dir = %layout.dir().display(), "adopting pinned data path");
            Origin::Adopted
        } else if none_pinned {
            if let Err(e) = load_and_pin(cfg, &layout) {
                // Nothing is pinned (PinGuard); leave no empty directories either.
                let _ = remove_pinned(&cfg.pin_root);
                return Err(e);
            }
            Origin::Loaded
        } else {
            return Err(DataplaneError::Partial { dir: layout.dir().to_path_buf(), missing });
        };
        let dir = layout.maps_dir();
        let maps = KernelMaps::open(&dir)?;
        let (sockmap, tgtmap, links, cookies) = (
            TypedMap::pinned(&dir, names::MAP_SOCKMAP)?,
            TypedMap::pinned(&dir, names::MAP_TGTMAP)?,
            TypedMap::pinned(&dir, names::MAP_LINKS)?,
            TypedMap::pinned(&dir, names::MAP_COOKIES)?,
        );
        let mut registry = Registry::reconcile(maps)?;
        if origin == Origin::Adopted {
            layout.clear_stray();
        }
        // The server ports are written from the rule maps at every open,
        // before the programs may change (an older build may have changed
        // the rules since, without it) and again after (an upgrade from a
        // build without the map creates it empty, which filters nothing).
        registry.sync_ports()?;
        let upgrade = upgrade::apply("socket", &dir, || upgrade_programs(&layout))?;
        if !matches!(upgrade, Upgrade::None) {
            RuleLatency::mark_used(&dir)?;
        }
        registry.sync_ports()?;
        let programs_build = upgrade::programs_build(&dir)?;

        let kernel = probe_unmarked(&dir);
        let guard_flags = guard_flags(cfg.guard, &kernel, cfg.syscall_watch);
        // The latency monitor's switch outlives the process that set it.
        let config_map = TypedMap::<u32, Config>::pinned(&dir, names::MAP_CONFIG)?;
        let before = config_map.get(&0)?.unwrap_or_default();
        let kept = before.flags & (CFG_LATENCY | CFG_LAT_ALL | CFG_LAT_EVERY | CFG_LAT_CLEAN);
        config_map.put(&0, &Config { flags: guard_flags | kept, pad: 0, lat_since: before.lat_since })?;
        set_guard_links(&layout, guard_flags)?;
        let latency = LatencyMonitor::sockets(&layout)?;
        let conns = ConnLister::open(&layout)?;
        let subscribers = Arc::new(Subscribers::default());
        // Its thread also serves the policy's unlink requests: it runs with
        // the guard off too, without classifying anything.
        let guard = crate::guard::start(
            layout.dir(),
            &cfg.trusted_readers,
            Arc::clone(&subscribers),
            guard_flags & CFG_GUARD != 0,
            cfg.guard_realtime,
        )?;
        tracing::info!(
            guard = guard_flags & CFG_GUARD != 0,
            splice_blind = guard_flags & CFG_SPLICE_BLIND != 0,
            blocking_eagain = guard_flags & CFG_BLOCKING_EAGAIN != 0,
            fionread_psock_only = guard_flags & CFG_FIONREAD_PSOCK != 0,
            "reader guard configured"
        );
        Ok(Self {
            layout,
            _pin_lock: pin_lock,
            pin_root: cfg.pin_root.clone(),
            origin,
            programs_build,
            upgrade,
            sockmap,
            tgtmap,
            links,
            cookies,
            registry: Mutex::new(registry),
            kernel,
            guard_flags,
            trusted_readers: cfg.trusted_readers.clone(),
            subscribers,
            latency,
            conns,
            guard,
        })
    }

    /// The latency monitor of this data path.
    pub fn latency(&self) -> &LatencyMonitor {
        &self.latency
    }

    /// Every socket this data path holds state for that matches `filter`.
    pub fn connections(&self, filter: &ConnFilter) -> Result<Vec<Connection>, ConnsError> {
        self.conns.list(filter)
    }

    /// Which iterator the connection list is read from on this kernel
    /// (`None`: an older build's programs run without one).
    pub fn connection_source(&self) -> Option<ConnSource> {
        self.conns.source()
    }

    /// The kernel behaviours the reader guard works around on this node
    /// (names of [`KernelProbe::facts`]); empty when it is off.
    pub fn guard_gaps(&self) -> Vec<&'static str> {
        const HANDLED: [&str; 4] =
            ["splice_sees_redirected", "fionread_counts_tcp_with_psock", "rcvlowat_honoured", "blocked_read_eagain"];
        if !self.guard_enabled() {
            return Vec::new();
        }
        self.kernel.facts().into_iter().filter(|f| !f.safe && HANDLED.contains(&f.name)).map(|f| f.name).collect()
    }

    /// Executables the operator vouched for.
    pub fn trusted_readers(&self) -> &[PathBuf] {
        &self.trusted_readers
    }

    /// What the kernel probe found.
    pub fn kernel(&self) -> &KernelProbe {
        &self.kernel
    }

    /// Whether the reader guard is on (see [`GuardMode`]).
    pub fn guard_enabled(&self) -> bool {
        self.guard_flags & CFG_GUARD != 0
    }

    /// Whether the guard watches splice()/FIONREAD at system call entry.
    pub fn syscall_watch(&self) -> bool {
        self.guard_flags & CFG_SYSCALL_WATCH != 0
    }

    /// Whether this instance runs the guard thread (another process may).
    pub fn guard_running_here(&self) -> bool {
        self.guard.is_some()
    }

    /// The thread id of the guard thread this process runs (see
    /// [`DataplaneConfig::guard_realtime`]), once it started.
    pub fn guard_thread_id(&self) -> Option<i32> {
        self.guard.as_ref().and_then(GuardThread::tid)
    }

    /// Incidents from now on (connections reset by the reader guard, programs
    /// seen splicing), as the guard thread reports them.
    pub fn incidents(&self) -> mpsc::Receiver<Incident> {
        self.subscribers.subscribe()
    }

    /// The link and end a socket (by cookie) is accelerated under.
    pub fn socket_link(&self, cookie: u64) -> Result<Option<CookieVal>, DataplaneError> {
        Ok(self.cookies.get(&cookie)?)
    }

    /// The link a socket's entry (from [`Dataplane::socket_link`]) names,
    /// if it still holds that link.
    pub fn link(&self, at: &CookieVal) -> Result<Option<LinkValue>, DataplaneError> {
        Ok(self.links.get(&at.slot)?.filter(|l| l.id != 0 && l.id == at.link))
    }

    /// Whether this instance loaded the programs or adopted pinned ones.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// The build id of the programs that run ([`meshwarp_bpf::BUILD_ID`] of
    /// the build that loaded them).
    pub fn programs_build(&self) -> &str {
        &self.programs_build
    }

    /// Whether opening replaced another build's programs (or failed to).
    pub fn upgrade(&self) -> &Upgrade {
        &self.upgrade
    }

    /// The versioned pin directory.
    pub fn pin_dir(&self) -> &Path {
        self.layout.dir()
    }

    /// Kernel id of the attached sockops program.
    pub fn sockops_prog_id(&self) -> Result<u32, DataplaneError> {
        self.prog_id(names::PROG_SOCKOPS)
    }

    /// Kernel id of the sk_msg program.
    pub fn sk_msg_prog_id(&self) -> Result<u32, DataplaneError> {
        self.prog_id(names::PROG_SK_MSG)
    }

    /// The id of this instance's pinned program `name` (`names::PROG_*`).
    pub fn prog_id(&self, name: &str) -> Result<u32, DataplaneError> {
        let p = ProgramHandle::from_pinned_path(self.layout.prog(name))
            .map_err(bpf_err(format!("opening pinned program {name}")))?;
        Ok(p.id())
    }

    /// The registry, locked: a caller may apply several changes atomically.
    pub fn registry(&self) -> MutexGuard<'_, Registry<KernelMaps>> {
        crate::sys::lock(&self.registry)
    }

    /// Registers a pair or capture rule (see [`Registry::insert`]).
    pub fn insert<R: SockRule + Stored<KernelMaps>>(&self, rule: &R, owner: &str) -> Result<(), RuleError> {
        self.registry().insert(rule, owner)
    }

    pub fn upsert<R: SockRule + Stored<KernelMaps>>(&self, rule: &R, owner: &str) -> Result<Outcome, RuleError> {
        self.registry().upsert(rule, owner)
    }

    /// Removes the rule with `rule`'s key whoever owns it.
    pub fn remove<R: SockRule + Stored<KernelMaps>>(&self, rule: &R) -> Result<(), RuleError> {
        self.registry().remove(rule, None)
    }

    /// Counters of the rule with `rule`'s key.
    pub fn stats<R: SockRule>(&self, rule: &R) -> Result<RuleCounters, RuleError> {
        self.registry().stats(rule)
    }

    /// The id the data path knows a registered rule by (latency, connections).
    pub fn rule_id<R: SockRule>(&self, rule: &R) -> Result<u32, RuleError> {
        self.registry().id_of(rule)
    }

    pub fn pairs(&self) -> Vec<EndpointPair> {
        self.registry().pairs().into_iter().map(|r| r.rule).collect()
    }

    pub fn captures(&self) -> Vec<CaptureRule> {
        self.registry().captures().into_iter().map(|r| r.rule).collect()
    }

    pub fn global_stats(&self) -> Result<GlobalCounters, RuleError> {
        self.registry().global_stats()
    }

    /// The cookie of the socket in the SOCKMAP at `index` (see
    /// [`sockmap_index`](meshwarp_bpf::shared::sockmap_index)), if any: in
    /// `mw_sockmap`, or in `mw_tgtmap` for a target whose own sends are never
    /// redirected.
    pub fn sockmap_lookup(&self, index: u32) -> Result<Option<u64>, DataplaneError> {
        Ok(match self.sockmap.get(&index)? {
            Some(c) => Some(c),
            None => self.tgtmap.get(&index)?,
        })
    }

    /// Detaches and unpins the socket family (this data path and its
    /// plugins; [`crate::node::uninstall`] removes every family). New
    /// connections take the normal TCP path; accelerated ones stay on their
    /// fast path until they close.
    pub fn teardown(self) -> Result<(), DataplaneError> {
        let Self { pin_root, guard, sockmap, tgtmap, links, cookies, registry, .. } = self;
        drop(guard);
        drop((sockmap, tgtmap, links, cookies, registry));
        remove_pinned(&pin_root)
    }
}

/// Replaces the programs of the socket family pinned in `layout` with this
/// build's, over its maps ([`crate::upgrade`]); the build id is written
/// last, so an upgrade cut short is redone by the next opener.
fn upgrade_programs(layout: &FamilyPins) -> Result<Vec<String>, UpgradeError> {
    let bpf = |what: &str| {
        let what = what.to_string();
        move |source| UpgradeError::Bpf { what, source }
    };
    let mut obj = MaybeUninit::uninit();
    // The instance's size, not this process's configuration.
    let nr_slots = upgrade::pinned_max_entries(&layout.map(names::MAP_LINKS))?;
    let mut open = loader::open_sockredir(&mut obj, nr_slots).map_err(bpf("opening BPF object"))?;
    let created =
        upgrade::reuse_pinned_maps(open.open_object_mut().maps_mut(), &layout.maps_dir(), layout.added_maps())?;
    let (loaded, log) = crate::loader::with_libbpf_log(|| open.load());
    let skel = loaded.map_err(|source| UpgradeError::Load { source, log })?;
    let p = &skel.progs;
    upgrade::run(&layout.maps_dir(), |swap| {
        for name in &created {
            let (_, map) = sockredir_maps(&skel.maps)
                .into_iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| UpgradeError::MissingMap(format!("{name} (not in this build's object)")))?;
            swap.map_pin(&layout.map(name), map.as_fd())?;
        }
        swap.prog_array(&layout.map(names::MAP_CH_CONN), CHAIN_FIN, p.mw_conn_fin.as_fd())?;
        swap.prog_array(&layout.map(names::MAP_CH_MSG), CHAIN_FIN, p.mw_msg_fin.as_fd())?;
        swap.sockmap_verdict(&layout.map(names::MAP_SOCKMAP), p.mw_sk_msg.as_fd())?;
        swap.link_prog(&layout.link(names::PROG_SOCKOPS), p.mw_sockops.as_fd())?;
        swap.link_prog(&layout.link(names::PROG_SETSOCKOPT), p.mw_setsockopt.as_fd())?;
        swap.link_prog(&layout.link(names::PROG_CONNECT4), p.mw_connect4.as_fd())?;
        swap.link_prog(&layout.link(names::PROG_CONNECT6), p.mw_connect6.as_fd())?;
        swap.tp_link(&layout.link(names::PROG_RECV_LEN), p.mw_recv_len.as_fd())?;
        swap.tp_link(&layout.link(names::PROG_SYS_ENTER), p.mw_sys_enter.as_fd())?;
        swap.tp_link(&layout.link(names::PROG_LAT_SEND), p.mw_lat_send.as_fd())?;
        for (name, prog) in sockredir_progs(p) {
            swap.prog_pin(&layout.prog(name), prog.as_fd())?;
        }
        let loaded = optional_progs(p);
        for &(name, prog) in &loaded {
            // The send side's program goes with its tracepoint link, which
            // the latency monitor makes; the others are pinned even where
            // the older build had none.
            if name != names::PROG_LAT_SEND {
                swap.prog_pin_optional(&layout.prog(name), prog.as_fd())?;
            } else if layout.prog(name).exists() {
                swap.prog_pin(&layout.prog(name), prog.as_fd())?;
            }
        }
        // The connection list's program over every namespace, pinned by a
        // build this kernel loaded it for once: it would be read instead of
        // this build's.
        if !loaded.iter().any(|(n, _)| *n == names::PROG_CONNS) && layout.prog(names::PROG_CONNS).exists() {
            swap.prog_unpin(&layout.prog(names::PROG_CONNS))?;
        }
        Ok(())
    })
}

/// The socket family's maps, by pin name: every one a load pins.
fn sockredir_maps<'a>(
    maps: &'a meshwarp_bpf::sockredir::SockredirMaps<'a>,
) -> [(&'static str, &'a libbpf_rs::Map<'a>); 44] {
    [
        (names::MAP_SOCKMAP, &maps.mw_sockmap),
        (names::MAP_TGTMAP, &maps.mw_tgtmap),
        (names::MAP_SLOTS, &maps.mw_slots),
        (names::MAP_PAIRS, &maps.mw_pairs),
        (names::MAP_CAPTURE, &maps.mw_capture),
        (names::MAP_LINKS, &maps.mw_links),
        (names::MAP_OBSERVE, &maps.mw_observe),
        (names::MAP_COOKIES, &maps.mw_cookies),
        (names::MAP_SK_STATE, &maps.mw_sk_state),
        (names::MAP_SK_CHAIN, &maps.mw_sk_chain),
        (names::MAP_EXES, &maps.mw_exes),
        (names::MAP_EXE_CLASS, &maps.mw_exe_class),
        (names::MAP_SERVICES, &maps.mw_services),
        (names::MAP_READERS, &maps.mw_readers),
        (names::MAP_PORTS, &maps.mw_ports),
        (names::MAP_JOINS, &maps.mw_joins),
        (names::MAP_SRV_HINT, &maps.mw_srv_hint),
        (names::MAP_CONFIG, &maps.mw_config),
        (names::MAP_DOOMED, &maps.mw_doomed),
        (names::MAP_PARK_REQ, &maps.mw_park_req),
        (names::MAP_EVENTS, &maps.mw_events),
        (names::MAP_SCRATCH, &maps.mw_scratch),
        (names::MAP_STATS, &maps.mw_stats),
        (names::MAP_SHORT, &maps.mw_short),
        (names::MAP_GLOBAL, &maps.mw_global),
        (names::MAP_OWNERS, &maps.mw_owners),
        (names::MAP_BUILD, &maps.mw_build),
        (names::MAP_CH_CONN, &maps.mw_ch_conn),
        (names::MAP_CH_MSG, &maps.mw_ch_msg),
        (names::MAP_LAT_RULE, &maps.mw_lat_rule),
        (names::MAP_LAT_HIST, &maps.mw_lat_hist),
        (names::MAP_LAT_ROWS, &maps.mw_lat_rows),
        (names::MAP_LAT_ZERO, &maps.mw_lat_zero),
        (names::MAP_LAT_PEND, &maps.mw_lat_pend),
        (names::MAP_LAT_SLOT, &maps.mw_lat_slot),
        (names::MAP_LAT_THR, &maps.mw_lat_thr),
        (names::MAP_LAT_THRH, &maps.mw_lat_thrh),
        (names::MAP_SK_CONN, &maps.mw_sk_conn),
        (names::MAP_CHAIN, &maps.mw_chain),
        (names::MAP_CHAIN_GEN, &maps.mw_chain_gen),
        (names::MAP_PLUG_CFG, &maps.mw_plug_cfg),
        (names::MAP_PLUG_STATS, &maps.mw_plug_stats),
        (names::MAP_PLUG_META, &maps.mw_plug_meta),
        (names::MAP_GRACE, &maps.mw_grace),
    ]
}

/// The programs of the socket family that are pinned, by pin name.
fn sockredir_progs<'a>(
    p: &'a meshwarp_bpf::sockredir::SockredirProgs<'a>,
) -> [(&'static str, &'a libbpf_rs::ProgramMut<'a>); 10] {
    [
        (names::PROG_SOCKOPS, &p.mw_sockops),
        (names::PROG_SK_MSG, &p.mw_sk_msg),
        (names::PROG_RECV_LEN, &p.mw_recv_len),
        (names::PROG_SYS_ENTER, &p.mw_sys_enter),
        (names::PROG_SETSOCKOPT, &p.mw_setsockopt),
        (names::PROG_CONNECT4, &p.mw_connect4),
        (names::PROG_CONNECT6, &p.mw_connect6),
        (names::PROG_DESTROY, &p.mw_destroy),
        (names::PROG_PARK, &p.mw_park),
        (names::PROG_UNLINK, &p.mw_unlink),
    ]
}

/// The socket family's optional programs this kernel loaded, by pin name
/// (see [`names::SOCKREDIR_OPTIONAL_PROGS`]).
fn optional_progs<'a>(
    p: &'a meshwarp_bpf::sockredir::SockredirProgs<'a>,
) -> Vec<(&'static str, &'a libbpf_rs::ProgramMut<'a>)> {
    let mut v = vec![(names::PROG_CONNS_TCP, &p.mw_conns_tcp)];
    if loader::has_tcp_sendmsg_tracepoint() {
        v.push((names::PROG_LAT_SEND, &p.mw_lat_send));
    }
    if loader::map_elem_iter_loads() {
        v.push((names::PROG_CONNS, &p.mw_conns));
    }
    v
}

/// The kernel probe's answers (run once per process). The probe splices its
/// own sockets, and a pinned data path that watches system calls marks
/// whichever executable splices as a splicer, which would keep this
/// process's own sockets (an embedding controller's) off the fast path: a
/// mark the probe made is taken back.
fn probe_unmarked(maps_dir: &Path) -> KernelProbe {
    let exes = TypedMap::<ExeKey, Exe>::pinned(maps_dir, names::MAP_EXES).ok();
    let me = std::env::current_exe().ok().and_then(|p| crate::execlass::exe_key(&p).ok());
    let before = exes.as_ref().zip(me.as_ref()).and_then(|(m, k)| m.get(k).ok()).flatten();
    let kernel = match KernelProbe::cached() {
        Ok(k) => k.clone(),
        Err(e) => {
            tracing::warn!("kernel probe failed, assuming every gap: {e}");
            KernelProbe::unknown()
        }
    };
    let (Some(exes), Some(me)) = (exes, me) else { return kernel };
    let was_marked = before.is_some_and(|e| e.flags & EXE_SEEN_SPLICE != 0);
    if let Ok(Some(mut now)) = exes.get(&me) {
        if now.flags & EXE_SEEN_SPLICE != 0 && !was_marked {
            now.flags &= !EXE_SEEN_SPLICE;
            let undone = match before {
                Some(_) => exes.put(&me, &now),
                None if now.flags == 0 => exes.delete(&me).map(|_| ()),
                None => exes.put(&me, &now),
            };
            if let Err(e) = undone {
                tracing::warn!("taking back the splice mark of the kernel probe: {e}");
            }
        }
    }
    kernel
}

/// Slots (links, two SOCKMAP entries each) for `max_sockets` sockets.
fn slots(max_sockets: u32) -> u32 {
    (max_sockets / 2).max(1)
}

/// `mw_config` flags for a guard mode on a kernel.
fn guard_flags(mode: GuardMode, k: &KernelProbe, syscall_watch: bool) -> u32 {
    if mode == GuardMode::Off || !k.needs_guard() {
        return 0;
    }
    let mut f = CFG_GUARD;
    // Urgent data (MSG_OOB) needs the watch on every kernel: tcp_bpf
    // ignores MSG_OOB on reads while a psock holds bytes.
    if syscall_watch {
        f |= CFG_SYSCALL_WATCH;
    }
    if !k.splice_sees_redirected {
        f |= CFG_SPLICE_BLIND;
    }
    if !k.fionread_counts_tcp_with_psock {
        f |= CFG_FIONREAD_PSOCK;
    }
    if k.blocked_read_eagain {
        f |= CFG_BLOCKING_EAGAIN;
    }
    f
}

/// Attaches the tracepoints (pinned links) `flags` need and unpins
/// (detaches) the others. sock_recv_length is always on: covered readers
/// publish how far they read, which the adaptive policy needs to promote a
/// direction again (and the guard observes readers there). sys_enter runs on
/// every system call of the node, so it is attached only with the guard and
/// the watch on.
fn set_guard_links(layout: &FamilyPins, flags: u32) -> Result<(), DataplaneError> {
    let want_recv = true;
    let want_sys = flags & CFG_GUARD != 0 && flags & CFG_SYSCALL_WATCH != 0;
    for (name, want) in [(names::PROG_RECV_LEN, want_recv), (names::PROG_SYS_ENTER, want_sys)] {
        let path = layout.link(name);
        match (want, path.exists()) {
            (true, false) => {
                let prog = ProgramHandle::from_pinned_path(layout.prog(name))
                    .map_err(bpf_err(format!("opening pinned program {name}")))?;
                let step = format!("attaching {name}");
                let link = upgrade::raw_tp_open(&step, prog.as_fd())?;
                upgrade::obj_pin(&step, link.as_fd(), &path)?;
                tracing::debug!(link = %path.display(), "attached");
            }
            (false, true) => fs::remove_file(&path).map_err(io_err(&path))?,
            _ => {}
        }
    }
    Ok(())
}

fn check_schema(pin_root: &Path) -> Result<(), DataplaneError> {
    let Ok(entries) = fs::read_dir(pin_root) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('v') && name != format!("v{SCHEMA_VERSION}") {
            return Err(DataplaneError::Schema { dir: pin_root.to_path_buf(), found: name });
        }
    }
    Ok(())
}

/// Removes the socket family's pins (of this schema) under `pin_root`, its
/// plugins' included, and nothing else; unpinning the cgroup link detaches
/// sockops. The whole node (the tc family too) goes with
/// [`crate::node::uninstall`].
pub fn remove_pinned(pin_root: &Path) -> Result<(), DataplaneError> {
    FamilyPins::sockredir(pin_root).remove()?;
    // Only if empty: anything else there is not ours.
    let _ = fs::remove_dir(pin_root);
    Ok(())
}

fn load_and_pin(cfg: &DataplaneConfig, layout: &FamilyPins) -> Result<(), DataplaneError> {
    let cgroup = match &cfg.cgroup {
        Some(p) => {
            sys::check_cgroup2(p)?;
            p.clone()
        }
        None => sys::cgroup2_root()?,
    };
    layout.create_dirs()?;

    let mut obj = MaybeUninit::uninit();
    let mut open = loader::open_sockredir(&mut obj, slots(cfg.max_sockets)).map_err(bpf_err("opening BPF object"))?;
    let sockmap_entries = slots(cfg.max_sockets) * 2;
    let maps = &mut open.maps;
    let sizes = [
        (&mut maps.mw_sockmap, sockmap_entries),
        (&mut maps.mw_tgtmap, sockmap_entries),
        (&mut maps.mw_lat_slot, sockmap_entries),
        (&mut maps.mw_slots, slots(cfg.max_sockets)),
        (&mut maps.mw_links, slots(cfg.max_sockets)),
        (&mut maps.mw_observe, cfg.max_sockets),
        (&mut maps.mw_cookies, cfg.max_sockets),
        (&mut maps.mw_pairs, cfg.max_rules),
        (&mut maps.mw_capture, cfg.max_rules),
        (&mut maps.mw_stats, cfg.max_rules),
        (&mut maps.mw_short, cfg.max_rules),
        (&mut maps.mw_owners, cfg.max_rules),
        (&mut maps.mw_lat_rule, cfg.max_rules),
        // Room for every metric of every rule, and as many hops.
        (&mut maps.mw_lat_hist, cfg.max_rules.saturating_mul(8)),
        (&mut maps.mw_lat_rows, cfg.max_rules.min(LAT_ROWS) * LAT_ROW_METRICS),
    ];
    for (map, n) in sizes {
        map.set_max_entries(n).map_err(bpf_err("sizing maps"))?;
    }
    let (loaded, log) = crate::loader::with_libbpf_log(|| open.load());
    let skel = loaded.map_err(|source| DataplaneError::Load { source, log })?;

    let mut guard = PinGuard { paths: Vec::new(), done: false };
    let maps = &skel.maps;
    maps.mw_build
        .update(&0u32.to_ne_bytes(), upgrade::this_build().as_bytes(), MapFlags::ANY)
        .map_err(bpf_err("writing mw_build"))?;
    maps.mw_config
        .update(&0u32.to_ne_bytes(), RuleLatency::FRESH_CONFIG.as_bytes(), MapFlags::ANY)
        .map_err(bpf_err("writing mw_config"))?;
    for (name, map) in sockredir_maps(maps) {
        let path = layout.map(name);
        let mut handle = MapHandle::try_from(map).map_err(bpf_err(format!("handle of map {name}")))?;
        handle.pin(&path).map_err(bpf_err(format!("pinning {}", path.display())))?;
        guard.paths.push(path);
    }
    for (name, prog) in sockredir_progs(&skel.progs).into_iter().chain(optional_progs(&skel.progs)) {
        let path = layout.prog(name);
        let handle = ProgramHandle::try_from(prog).map_err(bpf_err(format!("handle of program {name}")))?;
        handle.pin(&path).map_err(bpf_err(format!("pinning {}", path.display())))?;
        guard.paths.push(path);
    }

    // Each chain ends in the host's own decision; the pinned prog arrays keep
    // these entries (and so the programs) alive.
    let fin = CHAIN_FIN.to_ne_bytes();
    for (map, prog, what) in [
        (&maps.mw_ch_conn, &skel.progs.mw_conn_fin, names::PROG_CONN_FIN),
        (&maps.mw_ch_msg, &skel.progs.mw_msg_fin, names::PROG_MSG_FIN),
    ] {
        let fd = prog.as_fd().as_raw_fd().to_ne_bytes();
        map.update(&fin, &fd, MapFlags::ANY).map_err(bpf_err(format!("installing {what}")))?;
    }

    // sk_msg hangs off the SOCKMAP: the attachment lives as long as the map.
    skel.progs
        .mw_sk_msg
        .attach_sockmap(maps.mw_sockmap.as_fd().as_raw_fd())
        .map_err(bpf_err("attaching sk_msg to the SOCKMAP"))?;

    let cg = fs::File::open(&cgroup).map_err(io_err(&cgroup))?;
    let mut link: Link = skel
        .progs
        .mw_sockops
        .attach_cgroup(cg.as_raw_fd())
        .map_err(bpf_err(format!("attaching sockops to cgroup {}", cgroup.display())))?;
    let link_path = layout.link(names::PROG_SOCKOPS);
    link.pin(&link_path).map_err(bpf_err(format!("pinning {}", link_path.display())))?;
    guard.paths.push(link_path);
    // setsockopt(): SO_RCVLOWAT, ULPs (kTLS) and SO_ZEROCOPY on covered sockets.
    let mut link: Link = skel
        .progs
        .mw_setsockopt
        .attach_cgroup(cg.as_raw_fd())
        .map_err(bpf_err(format!("attaching cgroup/setsockopt to {}", cgroup.display())))?;
    let link_path = layout.link(names::PROG_SETSOCKOPT);
    link.pin(&link_path).map_err(bpf_err(format!("pinning {}", link_path.display())))?;
    guard.paths.push(link_path);
    // connect(): a listener of the caller's namespace hints its first client.
    for (prog, name) in
        [(&skel.progs.mw_connect4, names::PROG_CONNECT4), (&skel.progs.mw_connect6, names::PROG_CONNECT6)]
    {
        let mut link: Link =
            prog.attach_cgroup(cg.as_raw_fd()).map_err(bpf_err(format!("attaching {name} to {}", cgroup.display())))?;
        let link_path = layout.link(name);
        link.pin(&link_path).map_err(bpf_err(format!("pinning {}", link_path.display())))?;
        guard.paths.push(link_path);
    }
    guard.done = true;
    tracing::info!(dir = %layout.dir().display(), cgroup = %cgroup.display(), "loaded and pinned data path");
    Ok(())
}
