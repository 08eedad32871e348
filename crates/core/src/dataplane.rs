//! The [`Dataplane`]: loads the socket-redirection programs, attaches sockops to
//! a cgroup v2 and sk_msg to the SOCKHASH, pins everything under a bpffs root,
//! adopts an instance that is already pinned, and removes exactly what it made.
//!
//! Pinned layout (the directory name carries the schema version, so an agent
//! never adopts maps of another layout):
//! ```text
//! <pin_root>/v<SCHEMA>/maps/<map name>
//! <pin_root>/v<SCHEMA>/progs/mw_sockops, mw_sk_msg
//! <pin_root>/v<SCHEMA>/links/mw_sockops      (the cgroup attachment)
//! ```

use std::fs;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, Once};

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, PrintLevel, ProgramHandle};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{Pod, SockKey, CHAIN_FIN};
use meshwarp_bpf::sockredir::SockredirSkelBuilder;

use crate::endpoint::{CaptureRule, EndpointPair};
use crate::maps::{KernelMaps, MapError};
use crate::registry::{Outcome, Registry, RegistryError};
use crate::stats::{GlobalCounters, RuleCounters};
use crate::sys::{self, SysError};

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
    /// Sockets the SOCKHASH can hold; beyond that, connections fall back.
    pub max_sockets: u32,
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        Self { pin_root: DEFAULT_PIN_ROOT.into(), cgroup: None, max_rules: 16384, max_sockets: 65536 }
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
    #[error("{what}: {source}")]
    Bpf {
        what: String,
        #[source]
        source: libbpf_rs::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("max_rules and max_sockets must be at least 1 (got {max_rules}, {max_sockets})")]
    BadConfig { max_rules: u32, max_sockets: u32 },
    #[error("{dir} holds a partial meshwarp instance (missing {missing:?}); run `meshwarp uninstall` to clear it")]
    Partial { dir: PathBuf, missing: Vec<String> },
    #[error("{dir} holds pins of schema {found}, this build uses {SCHEMA_VERSION}; run `meshwarp uninstall` first")]
    Schema { dir: PathBuf, found: String },
    #[error(transparent)]
    Map(#[from] MapError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Tc(#[from] crate::tc::TcError),
}

fn bpf_err(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> DataplaneError {
    let what = what.into();
    move |source| DataplaneError::Bpf { what, source }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataplaneError + '_ {
    move |source| DataplaneError::Io { path: path.to_path_buf(), source }
}

/// Pin paths of one schema version.
#[derive(Debug, Clone)]
struct Layout {
    dir: PathBuf,
}

impl Layout {
    fn new(pin_root: &Path) -> Self {
        Self { dir: pin_root.join(format!("v{SCHEMA_VERSION}")) }
    }
    fn maps(&self) -> PathBuf {
        self.dir.join("maps")
    }
    fn map(&self, name: &str) -> PathBuf {
        self.maps().join(name)
    }
    fn prog(&self, name: &str) -> PathBuf {
        self.dir.join("progs").join(name)
    }
    fn link(&self, name: &str) -> PathBuf {
        self.dir.join("links").join(name)
    }
    /// Every pin an instance has, links first (unpinned first on teardown).
    fn all_pins(&self) -> Vec<PathBuf> {
        let mut v = vec![self.link(names::PROG_SOCKOPS), self.prog(names::PROG_SOCKOPS), self.prog(names::PROG_SK_MSG)];
        v.extend(names::SOCKREDIR_MAPS.iter().map(|m| self.map(m)));
        v
    }
    fn subdirs(&self) -> [PathBuf; 3] {
        [self.dir.join("links"), self.dir.join("progs"), self.maps()]
    }
}

/// libbpf messages of warning level and above, collected while loading so a
/// verifier rejection carries its log.
static LOAD_LOG: Mutex<Option<String>> = Mutex::new(None);
static PRINT_INIT: Once = Once::new();
/// One load at a time per process, so the collected log is this load's.
static LOAD_LOCK: Mutex<()> = Mutex::new(());

fn libbpf_print(level: PrintLevel, msg: String) {
    match level {
        PrintLevel::Debug => tracing::trace!(target: "libbpf", "{}", msg.trim_end()),
        PrintLevel::Info => tracing::debug!(target: "libbpf", "{}", msg.trim_end()),
        PrintLevel::Warn => {
            if let Ok(mut log) = LOAD_LOG.lock() {
                if let Some(buf) = log.as_mut() {
                    buf.push_str(&msg);
                    return;
                }
            }
            tracing::warn!(target: "libbpf", "{}", msg.trim_end());
        }
    }
}

/// Runs a libbpf load with its warnings collected (where the verifier log of a
/// rejected program ends up), one load at a time.
pub(crate) fn with_libbpf_log<T>(f: impl FnOnce() -> T) -> (T, String) {
    PRINT_INIT.call_once(|| {
        libbpf_rs::set_print(Some((PrintLevel::Debug, libbpf_print)));
    });
    let _load = lock(&LOAD_LOCK);
    *lock(&LOAD_LOG) = Some(String::new());
    let r = f();
    let log = lock(&LOAD_LOG).take().unwrap_or_default();
    (r, log)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
    layout: Layout,
    pin_root: PathBuf,
    origin: Origin,
    sockhash: MapHandle,
    registry: Mutex<Registry<KernelMaps>>,
}

impl Dataplane {
    /// Adopts the instance pinned under `cfg.pin_root`, or loads and pins a new
    /// one. Never loads a second copy next to a pinned one.
    pub fn open(cfg: &DataplaneConfig) -> Result<Self, DataplaneError> {
        if cfg.max_rules == 0 || cfg.max_sockets == 0 {
            return Err(DataplaneError::BadConfig { max_rules: cfg.max_rules, max_sockets: cfg.max_sockets });
        }
        sys::ensure_bpffs(&cfg.pin_root)?;
        let layout = Layout::new(&cfg.pin_root);
        check_schema(&cfg.pin_root)?;
        let pins = layout.all_pins();
        let missing: Vec<String> = pins.iter().filter(|p| !p.exists()).map(|p| p.display().to_string()).collect();
        let origin = if missing.is_empty() {
            tracing::info!(dir = %layout.dir.display(), "adopting pinned data path");
            Origin::Adopted
        } else if missing.len() == pins.len() {
            if let Err(e) = load_and_pin(cfg, &layout) {
                // Nothing is pinned (PinGuard); leave no empty directories either.
                let _ = remove_pinned(&cfg.pin_root);
                return Err(e);
            }
            Origin::Loaded
        } else {
            return Err(DataplaneError::Partial { dir: layout.dir, missing });
        };
        let maps = KernelMaps::open(&layout.maps())?;
        let sockhash =
            MapHandle::from_pinned_path(layout.map(names::MAP_SOCKHASH)).map_err(bpf_err("opening pinned SOCKHASH"))?;
        let registry = Registry::reconcile(maps)?;
        Ok(Self { layout, pin_root: cfg.pin_root.clone(), origin, sockhash, registry: Mutex::new(registry) })
    }

    /// Whether this instance loaded the programs or adopted pinned ones.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// The versioned pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.layout.dir
    }

    /// Kernel id of the attached sockops program.
    pub fn sockops_prog_id(&self) -> Result<u32, DataplaneError> {
        self.prog_id(names::PROG_SOCKOPS)
    }

    /// Kernel id of the sk_msg program.
    pub fn sk_msg_prog_id(&self) -> Result<u32, DataplaneError> {
        self.prog_id(names::PROG_SK_MSG)
    }

    fn prog_id(&self, name: &str) -> Result<u32, DataplaneError> {
        let p = ProgramHandle::from_pinned_path(self.layout.prog(name))
            .map_err(bpf_err(format!("opening pinned program {name}")))?;
        Ok(p.id())
    }

    /// The registry, locked: a caller may apply several changes atomically.
    pub fn registry(&self) -> MutexGuard<'_, Registry<KernelMaps>> {
        lock(&self.registry)
    }

    pub fn insert_pair(&self, pair: &EndpointPair, owner: &str) -> Result<(), RegistryError> {
        self.registry().insert_pair(pair, owner)
    }

    pub fn upsert_pair(&self, pair: &EndpointPair, owner: &str) -> Result<Outcome, RegistryError> {
        self.registry().upsert_pair(pair, owner)
    }

    /// Removes a pair whoever owns it.
    pub fn remove_pair(&self, pair: &EndpointPair) -> Result<(), RegistryError> {
        self.registry().remove_pair(pair, None)
    }

    pub fn pairs(&self) -> Vec<EndpointPair> {
        self.registry().pairs().into_iter().map(|r| r.rule).collect()
    }

    pub fn pair_stats(&self, pair: &EndpointPair) -> Result<RuleCounters, RegistryError> {
        self.registry().pair_stats(pair)
    }

    pub fn insert_capture(&self, rule: &CaptureRule, owner: &str) -> Result<(), RegistryError> {
        self.registry().insert_capture(rule, owner)
    }

    pub fn upsert_capture(&self, rule: &CaptureRule, owner: &str) -> Result<Outcome, RegistryError> {
        self.registry().upsert_capture(rule, owner)
    }

    /// Removes the capture rule with `rule`'s key whoever owns it.
    pub fn remove_capture(&self, rule: &CaptureRule) -> Result<(), RegistryError> {
        self.registry().remove_capture(rule, None)
    }

    pub fn captures(&self) -> Vec<CaptureRule> {
        self.registry().captures().into_iter().map(|r| r.rule).collect()
    }

    pub fn capture_stats(&self, rule: &CaptureRule) -> Result<RuleCounters, RegistryError> {
        self.registry().capture_stats(rule)
    }

    pub fn global_stats(&self) -> Result<GlobalCounters, RegistryError> {
        self.registry().global_stats()
    }

    /// The socket cookie stored in the SOCKHASH under `key`, if any.
    pub fn sockhash_lookup(&self, key: &SockKey) -> Result<Option<u64>, DataplaneError> {
        let v = self.sockhash.lookup(key.as_bytes(), MapFlags::ANY).map_err(bpf_err("looking up the SOCKHASH"))?;
        Ok(v.and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok()).map(u64::from_ne_bytes))
    }

    /// Detaches and unpins everything this data path consists of. Accelerated
    /// connections continue on the normal TCP path.
    pub fn teardown(self) -> Result<(), DataplaneError> {
        let Self { pin_root, sockhash, registry, .. } = self;
        drop((sockhash, registry));
        remove_pinned(&pin_root)
    }
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

/// Removes meshwarp's pins (of this schema) under `pin_root` and nothing else;
/// unpinning the cgroup link detaches sockops.
pub fn remove_pinned(pin_root: &Path) -> Result<(), DataplaneError> {
    crate::tc::remove_pinned(pin_root)?;
    let layout = Layout::new(pin_root);
    crate::plugin::remove_plugin_pins(&layout.dir)
        .map_err(|e| DataplaneError::Io { path: layout.dir.clone(), source: e })?;
    for p in layout.all_pins() {
        match fs::remove_file(&p) {
            Ok(()) => tracing::debug!(pin = %p.display(), "unpinned"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(DataplaneError::Io { path: p, source: e }),
        }
    }
    for d in layout.subdirs().iter().chain([&layout.dir, &pin_root.to_path_buf()]) {
        // Only empty directories go: anything else there is not ours.
        let _ = fs::remove_dir(d);
    }
    Ok(())
}

fn load_and_pin(cfg: &DataplaneConfig, layout: &Layout) -> Result<(), DataplaneError> {
    let cgroup = match &cfg.cgroup {
        Some(p) => {
            sys::check_cgroup2(p)?;
            p.clone()
        }
        None => sys::cgroup2_root()?,
    };
    for d in layout.subdirs() {
        fs::create_dir_all(&d).map_err(io_err(&d))?;
    }

    let mut obj = MaybeUninit::uninit();
    let mut open = SockredirSkelBuilder::default().open(&mut obj).map_err(bpf_err("opening BPF object"))?;
    let maps = &mut open.maps;
    let sizes = [
        (&mut maps.mw_sockhash, cfg.max_sockets),
        (&mut maps.mw_origins, cfg.max_sockets),
        (&mut maps.mw_pairs, cfg.max_rules),
        (&mut maps.mw_capture, cfg.max_rules),
        (&mut maps.mw_stats, cfg.max_rules),
        (&mut maps.mw_owners, cfg.max_rules),
    ];
    for (map, n) in sizes {
        map.set_max_entries(n).map_err(bpf_err("sizing maps"))?;
    }
    let (loaded, log) = with_libbpf_log(|| open.load());
    let skel = loaded.map_err(|source| DataplaneError::Load { source, log })?;

    let mut guard = PinGuard { paths: Vec::new(), done: false };
    let maps = &skel.maps;
    let all_maps = [
        (names::MAP_SOCKHASH, &maps.mw_sockhash),
        (names::MAP_PAIRS, &maps.mw_pairs),
        (names::MAP_CAPTURE, &maps.mw_capture),
        (names::MAP_ORIGINS, &maps.mw_origins),
        (names::MAP_SK_STATE, &maps.mw_sk_state),
        (names::MAP_STATS, &maps.mw_stats),
        (names::MAP_GLOBAL, &maps.mw_global),
        (names::MAP_OWNERS, &maps.mw_owners),
        (names::MAP_CH_CONN, &maps.mw_ch_conn),
        (names::MAP_CH_MSG, &maps.mw_ch_msg),
        (names::MAP_CHAIN, &maps.mw_chain),
        (names::MAP_CHAIN_GEN, &maps.mw_chain_gen),
        (names::MAP_PLUG_CFG, &maps.mw_plug_cfg),
        (names::MAP_PLUG_STATS, &maps.mw_plug_stats),
        (names::MAP_PLUG_META, &maps.mw_plug_meta),
        (names::MAP_GRACE, &maps.mw_grace),
    ];
    for (name, map) in all_maps {
        let path = layout.map(name);
        let mut handle = MapHandle::try_from(map).map_err(bpf_err(format!("handle of map {name}")))?;
        handle.pin(&path).map_err(bpf_err(format!("pinning {}", path.display())))?;
        guard.paths.push(path);
    }
    for (name, prog) in [(names::PROG_SOCKOPS, &skel.progs.mw_sockops), (names::PROG_SK_MSG, &skel.progs.mw_sk_msg)] {
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

    // sk_msg hangs off the SOCKHASH: the attachment lives as long as the map.
    skel.progs
        .mw_sk_msg
        .attach_sockmap(maps.mw_sockhash.as_fd().as_raw_fd())
        .map_err(bpf_err("attaching sk_msg to the SOCKHASH"))?;

    let cg = fs::File::open(&cgroup).map_err(io_err(&cgroup))?;
    let mut link: Link = skel
        .progs
        .mw_sockops
        .attach_cgroup(cg.as_raw_fd())
        .map_err(bpf_err(format!("attaching sockops to cgroup {}", cgroup.display())))?;
    let link_path = layout.link(names::PROG_SOCKOPS);
    link.pin(&link_path).map_err(bpf_err(format!("pinning {}", link_path.display())))?;
    guard.done = true;
    tracing::info!(dir = %layout.dir.display(), cgroup = %cgroup.display(), "loaded and pinned data path");
    Ok(())
}
