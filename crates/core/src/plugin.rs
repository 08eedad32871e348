//! Plugins: verified eBPF programs hot-loaded into the data path's hook chains,
//! in the model of proxy-wasm (versioned ABI, configuration blob, callbacks at
//! fixed hooks, a verdict that says whether the chain continues).
//!
//! [`PluginChain`] owns the chains of both data-path families: on_connection
//! and on_message live with the socket redirection ([`Dataplane`]), on_packet
//! with the tc redirection ([`TcDataplane`]). A chain is a row of tail-call
//! positions in a PROG_ARRAY, ordered by (phase, priority). Every change
//! rebuilds the inactive generation, flips the active one and waits for an RCU
//! grace period before clearing the old one, so each message sees one whole
//! chain and traffic never stops. A plugin the kernel refuses changes nothing.
//!
//! Pinned layout, under each family's pin directory:
//! ```text
//! plugins/<id>/prog         the plugin's program
//! plugins/<id>/maps/<name>  its own maps (e.g. the sampler's counters)
//! ```
//! and its manifest in the family's `mw_plug_meta` map, so a restarted agent
//! adopts loaded plugins.
//!
//! [`Dataplane`]: crate::Dataplane
//! [`TcDataplane`]: crate::tc::TcDataplane

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, ObjectBuilder, ProgramHandle, ProgramType};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    chain_index, fixed_str, str_of, ChainPos, OwnerName, PluginAbi, PluginConfig, PluginMeta, PluginStats, Pod,
    ABI_MAJOR, ABI_MINOR, CHAIN_MAX, HOOK_CONNECTION, HOOK_MESSAGE, HOOK_PACKET, MAX_PLUGINS, OWNER_LEN,
    PLUGIN_ABI_SECTION, PLUGIN_CFG_MAX, PLUGIN_FAIL_CLOSED, PLUGIN_NAME_LEN, PLUGIN_VERSION_LEN,
};
use sha2::{Digest, Sha256};

use crate::error::{BpfError, IoError};
use crate::loader::with_libbpf_log;
use crate::maps::{MapError, PerCpu, TypedMap};
use crate::pins::remove_plugin_dir;

/// Where a plugin runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// sockops: a connection a rule covers reached ESTABLISHED.
    Connection,
    /// sk_msg: a message on an accelerated socket.
    Message,
    /// tc: a packet on an attached interface.
    Packet,
}

impl Hook {
    pub const ALL: [Hook; 3] = [Hook::Connection, Hook::Message, Hook::Packet];

    pub fn raw(self) -> u32 {
        match self {
            Hook::Connection => HOOK_CONNECTION,
            Hook::Message => HOOK_MESSAGE,
            Hook::Packet => HOOK_PACKET,
        }
    }

    pub fn from_raw(raw: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.raw() == raw)
    }

    /// The callback's name in the ABI.
    pub fn callback(self) -> &'static str {
        match self {
            Hook::Connection => "on_connection",
            Hook::Message => "on_message",
            Hook::Packet => "on_packet",
        }
    }

    fn prog_type(self) -> ProgramType {
        match self {
            Hook::Connection => ProgramType::SockOps,
            Hook::Message => ProgramType::SkMsg,
            Hook::Packet => ProgramType::SchedCls,
        }
    }

    fn prog_array(self) -> &'static str {
        match self {
            Hook::Connection => names::MAP_CH_CONN,
            Hook::Message => names::MAP_CH_MSG,
            Hook::Packet => names::MAP_CH_PKT,
        }
    }

    fn family(self) -> Family {
        match self {
            Hook::Connection | Hook::Message => Family::Sock,
            Hook::Packet => Family::Tc,
        }
    }

    /// What the hook's verdict 1 means (counter label).
    pub fn verdict1(self) -> &'static str {
        match self {
            Hook::Connection => "decline",
            Hook::Message => "bypass",
            Hook::Packet => "pass",
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.callback())
    }
}

/// Coarse position in a chain, as Istio's WasmPlugin phases: authentication
/// first, then authorization, then statistics, then plugins without a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Phase {
    Authn,
    Authz,
    Stats,
    #[default]
    Unspecified,
}

impl Phase {
    fn raw(self) -> u32 {
        match self {
            Phase::Authn => 1,
            Phase::Authz => 2,
            Phase::Stats => 3,
            Phase::Unspecified => 4,
        }
    }

    fn from_raw(raw: u32) -> Self {
        match raw {
            1 => Phase::Authn,
            2 => Phase::Authz,
            3 => Phase::Stats,
            _ => Phase::Unspecified,
        }
    }
}

/// What happens when a plugin cannot decide (its program is missing from its
/// chain slot, or it returns a verdict the hook does not know).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// The chain continues.
    #[default]
    Open,
    /// The connection is declined / the message or packet dropped.
    Closed,
}

/// What a plugin is, given with its object (proxy-wasm's plugin configuration
/// plus Istio WasmPlugin's ordering).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginManifest {
    /// Unique on the node: `[a-z0-9][a-z0-9._-]*`, under 64 bytes.
    pub name: String,
    /// Free text under 32 bytes, reported back.
    pub version: String,
    pub hook: Hook,
    pub phase: Phase,
    /// Within a phase, higher runs first.
    pub priority: i32,
    pub failure: FailurePolicy,
    /// If given, the object's SHA-256 must equal it.
    pub sha256: Option<[u8; 32]>,
}

impl PluginManifest {
    /// A manifest with default phase, priority and failure policy.
    pub fn new(name: &str, hook: Hook) -> Self {
        Self {
            name: name.into(),
            version: String::new(),
            hook,
            phase: Phase::Unspecified,
            priority: 0,
            failure: FailurePolicy::Open,
            sha256: None,
        }
    }

    /// Checks names and lengths.
    pub fn validate(&self) -> Result<(), PluginError> {
        let n = &self.name;
        let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-');
        if n.is_empty()
            || n.len() >= PLUGIN_NAME_LEN
            || !n.chars().all(ok_char)
            || !n.starts_with(|c: char| c.is_ascii_alphanumeric())
        {
            return Err(PluginError::Invalid {
                field: "name",
                reason: format!("{n:?}: want [a-z0-9][a-z0-9._-]*, at most {} bytes", PLUGIN_NAME_LEN - 1),
            });
        }
        if self.version.len() >= PLUGIN_VERSION_LEN || self.version.contains('\0') {
            return Err(PluginError::Invalid {
                field: "version",
                reason: format!("at most {} bytes, no NUL", PLUGIN_VERSION_LEN - 1),
            });
        }
        Ok(())
    }
}

/// A plugin's counters, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PluginCounters {
    pub runs: u64,
    pub continued: u64,
    /// Declined (on_connection), bypassed (on_message) or passed (on_packet).
    pub verdict1: u64,
    pub dropped: u64,
    /// Verdicts the hook does not know (handled by the failure policy).
    pub invalid: u64,
    /// Times its chain slot was reached empty (handled by the failure policy).
    pub missing: u64,
}

/// One of a plugin's own maps, pinned for tools to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginMap {
    pub name: String,
    pub pin: PathBuf,
}

/// A loaded plugin, as listed.
#[derive(Debug, Clone)]
pub struct PluginInfo {
    pub manifest: PluginManifest,
    /// Node-wide plugin id (counter slot).
    pub id: u32,
    /// Kernel id of its program.
    pub prog_id: u32,
    /// ABI it was built against.
    pub abi: (u16, u16),
    /// SHA-256 of its object.
    pub sha256: [u8; 32],
    pub config: Vec<u8>,
    /// Position in its hook's chain (0 runs first).
    pub position: u32,
    /// The controller that loaded it.
    pub owner: String,
    pub counters: PluginCounters,
    pub maps: Vec<PluginMap>,
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    Injected(#[from] crate::fault::Injected),
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("config is {len} bytes, at most {PLUGIN_CFG_MAX} are allowed")]
    ConfigTooLarge { len: usize },
    #[error("sha256 mismatch: manifest says {expected}, the object is {actual}")]
    Sha256Mismatch { expected: String, actual: String },
    #[error("not a meshwarp plugin object: {reason}")]
    NotAPlugin { reason: String },
    #[error(
        "plugin built for ABI {}.{}, this node offers {ABI_MAJOR}.{ABI_MINOR} (same major, minor up to {ABI_MINOR})",
        plugin.0, plugin.1
    )]
    AbiMismatch { plugin: (u16, u16) },
    #[error("the manifest says {manifest}, the object implements {object}")]
    HookMismatch { manifest: Hook, object: String },
    #[error("{hook} plugins need the {what} data path, which this node does not run")]
    HookUnavailable { hook: Hook, what: &'static str },
    #[error("the kernel refused plugin {name}: {source}\n--- verifier/libbpf log ---\n{log}")]
    Rejected {
        name: String,
        #[source]
        source: libbpf_rs::Error,
        log: String,
    },
    #[error("plugin {name} is already loaded (replace it explicitly)")]
    AlreadyExists { name: String },
    #[error("no plugin named {name}")]
    NotFound { name: String },
    #[error("plugin {name} is an {loaded} plugin; the new object is {requested} (unload it first)")]
    HookChange { name: String, loaded: Hook, requested: Hook },
    #[error("the {hook} chain is full ({CHAIN_MAX} plugins)")]
    ChainFull { hook: Hook },
    #[error("no free plugin slot ({MAX_PLUGINS} plugins per node)")]
    NoSlot,
    #[error("plugin {name} is owned by {owner:?}, not {requested:?}")]
    OwnerMismatch { name: String, owner: String, requested: String },
    #[error(transparent)]
    Bpf(#[from] crate::error::BpfError),
    #[error(transparent)]
    Io(#[from] crate::error::IoError),
    #[error(transparent)]
    Map(#[from] MapError),
}

fn bpf(what: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> PluginError {
    let what = what.into();
    move |source| PluginError::Bpf(BpfError::new(what, source))
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PluginError + '_ {
    move |source| PluginError::Io(IoError::new(path.display().to_string(), source))
}

/// Lowercase hex, as sha256 digests are shown.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The ABI a plugin object declares in its `.mw_abi` section.
pub fn object_abi(object: &[u8]) -> Result<PluginAbi, PluginError> {
    use object::{Object, ObjectSection};
    // ELF headers are read in place and must be aligned: a fresh heap copy is
    // (an include_bytes! slice need not be).
    let object = object.to_vec();
    let file = object::File::parse(object.as_slice())
        .map_err(|e| PluginError::NotAPlugin { reason: format!("not ELF: {e}") })?;
    let section = file.section_by_name(PLUGIN_ABI_SECTION).ok_or_else(|| PluginError::NotAPlugin {
        reason: format!("no {PLUGIN_ABI_SECTION} section (build it with meshwarp/plugin.h)"),
    })?;
    let data = section.data().map_err(|e| PluginError::NotAPlugin { reason: e.to_string() })?;
    PluginAbi::from_bytes(data).ok_or_else(|| PluginError::NotAPlugin {
        reason: format!("{PLUGIN_ABI_SECTION} is {} bytes, expected {}", data.len(), size_of::<PluginAbi>()),
    })
}

/// Whether this host runs a plugin built for `abi`: same major, minor not newer.
pub fn abi_compatible(major: u16, minor: u16) -> bool {
    // Written as a range so it stays right when ABI_MINOR grows past 0.
    major == ABI_MAJOR && (0..=ABI_MINOR).contains(&minor)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Sock,
    Tc,
}

/// The pinned chain maps of one family.
#[derive(Debug)]
struct FamilyMaps {
    dir: PathBuf,
    chain: TypedMap<u32, ChainPos>,
    gen: TypedMap<u32, u32>,
    cfg: TypedMap<u32, PluginConfig>,
    stats: PerCpu<u32, PluginStats>,
    meta: TypedMap<u32, PluginMeta>,
    grace: MapHandle,
    /// Updated into `grace` to make the kernel wait for a grace period.
    grace_inner: MapHandle,
    /// Maps plugin objects reuse, by name (prog arrays included).
    shared: HashMap<&'static str, MapHandle>,
}

impl FamilyMaps {
    fn open(dir: &Path, family: Family) -> Result<Self, PluginError> {
        let maps = dir.join("maps");
        let open = |name: &str| {
            MapHandle::from_pinned_path(maps.join(name)).map_err(bpf(format!("opening pinned map {name}")))
        };
        let mut shared = HashMap::new();
        let mut names_: Vec<&'static str> = names::PLUGIN_SHARED_MAPS.to_vec();
        match family {
            Family::Sock => names_.extend([names::MAP_CH_CONN, names::MAP_CH_MSG]),
            Family::Tc => {
                names_.retain(|n| *n != names::MAP_SK_CHAIN);
                names_.push(names::MAP_CH_PKT);
            }
        }
        for n in names_ {
            shared.insert(n, open(n)?);
        }
        let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
            sz: size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
            ..Default::default()
        };
        let grace_inner = MapHandle::create(MapType::Array, Some("mw_grace_in"), 4, 4, 1, &opts)
            .map_err(bpf("creating the grace-period map"))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            chain: TypedMap::pinned(&maps, names::MAP_CHAIN)?,
            gen: TypedMap::pinned(&maps, names::MAP_CHAIN_GEN)?,
            cfg: TypedMap::pinned(&maps, names::MAP_PLUG_CFG)?,
            stats: PerCpu::pinned(&maps, names::MAP_PLUG_STATS)?,
            meta: TypedMap::pinned(&maps, names::MAP_PLUG_META)?,
            grace: open(names::MAP_GRACE)?,
            grace_inner,
            shared,
        })
    }

    fn prog_array(&self, hook: Hook) -> Result<&MapHandle, PluginError> {
        self.shared.get(hook.prog_array()).ok_or_else(|| {
            PluginError::Bpf(BpfError::new(
                format!("{} has no {}", self.dir.display(), hook.prog_array()),
                libbpf_rs::Error::from(io::Error::from(io::ErrorKind::NotFound)),
            ))
        })
    }

    fn plugin_dir(&self, id: u32) -> PathBuf {
        crate::pins::plugin_dir(&self.dir, id)
    }

    /// Returns once no BPF program still runs with what it read before.
    fn grace_period(&self) -> Result<(), PluginError> {
        let fd = self.grace_inner.as_fd().as_raw_fd();
        self.grace
            .update(&0u32.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .map_err(bpf("waiting for a grace period"))
    }

    fn active_gen(&self, hook: Hook) -> Result<u32, PluginError> {
        Ok(self.gen.get(&hook.raw())?.unwrap_or(0) & 1)
    }

    /// What the active chain of `hook` runs: plugin id -> the config slot
    /// its position reads. The kernel's view, so it wins over the metadata.
    fn active_members(&self, hook: Hook) -> Result<BTreeMap<u32, u32>, PluginError> {
        let active = self.gen.get(&hook.raw())?.unwrap_or(0);
        let (gen, len) = (active & 1, (active >> 8).min(CHAIN_MAX));
        let mut out = BTreeMap::new();
        for pos in 0..len {
            if let Some(at) = self.chain.get(&chain_index(gen, hook.raw(), pos))? {
                if at.plugin_id != 0 {
                    out.insert(at.plugin_id, at.cfg_slot);
                }
            }
        }
        Ok(out)
    }

    /// Empties one generation of a hook's chain.
    fn clear_gen(&self, hook: Hook, gen: u32) -> Result<(), PluginError> {
        let progs = self.prog_array(hook)?;
        for pos in 0..CHAIN_MAX {
            match progs.delete(&(gen * CHAIN_MAX + pos).to_ne_bytes()) {
                Ok(()) => {}
                Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => {}
                Err(e) => return Err(bpf("clearing a chain slot")(e)),
            }
            self.chain.put(&chain_index(gen, hook.raw(), pos), &ChainPos::default())?;
        }
        Ok(())
    }

    /// Makes `members` (in order) the hook's chain: fills the inactive
    /// generation, flips to it, waits a grace period, clears the old one.
    fn install_chain(&self, hook: Hook, members: &[&Plugin]) -> Result<(), PluginError> {
        let cur = self.active_gen(hook)?;
        let next = 1 - cur;
        let progs = self.prog_array(hook)?;
        let fill = || -> Result<(), PluginError> {
            for (pos, p) in (0..CHAIN_MAX).zip(members) {
                let fd = p.prog.as_fd().as_raw_fd();
                progs
                    .update(&(next * CHAIN_MAX + pos).to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
                    .map_err(bpf(format!("placing plugin {} in the {hook} chain", p.manifest.name)))?;
                let at = ChainPos { plugin_id: p.id, cfg_slot: p.cfg_slot, flags: p.flags(), pad: 0 };
                self.chain.put(&chain_index(next, hook.raw(), pos), &at)?;
            }
            Ok(())
        };
        if let Err(e) = self.clear_gen(hook, next).and_then(|()| fill()) {
            let _ = self.clear_gen(hook, next);
            return Err(e);
        }
        crate::fault::point("chain filled")?;
        // Generation in bit 0, length from bit 8 (chain.h, mw_active_chain).
        let active = next | ((members.len().min(CHAIN_MAX as usize) as u32) << 8);
        self.gen.put(&hook.raw(), &active)?;
        crate::fault::point("chain flipped")?;
        self.grace_period()?;
        self.clear_gen(hook, cur)?;
        crate::fault::point("chain cleared")?;
        Ok(())
    }

    /// A plugin's counters: runs and verdicts from its own map (each plugin
    /// counts only itself), `missing` from the host's.
    fn counters(&self, id: u32) -> Result<PluginCounters, PluginError> {
        let sum = |a: &mut PluginStats, b: &PluginStats| {
            a.runs += b.runs;
            a.cont += b.cont;
            a.verdict1 += b.verdict1;
            a.drop += b.drop;
            a.invalid += b.invalid;
            a.missing += b.missing;
        };
        let host = self.stats.sum(&id, sum)?;
        let own = match PerCpu::<u32, PluginStats>::pinned(&self.plugin_dir(id).join("maps"), names::MAP_OWN_STATS) {
            Ok(m) => m.sum(&0, sum)?,
            Err(_) => PluginStats::default(),
        };
        Ok(PluginCounters {
            runs: own.runs,
            continued: own.cont,
            verdict1: own.verdict1,
            dropped: own.drop,
            invalid: own.invalid,
            missing: host.missing,
        })
    }

    fn reset_counters(&self, id: u32) -> Result<(), PluginError> {
        Ok(self.stats.zero(&id)?)
    }

    fn write_config(&self, slot: u32, config: &[u8]) -> Result<(), PluginError> {
        let c = PluginConfig::new(config).ok_or(PluginError::ConfigTooLarge { len: config.len() })?;
        Ok(self.cfg.put(&slot, &c)?)
    }
}

/// A plugin in a chain.
#[derive(Debug)]
struct Plugin {
    id: u32,
    manifest: PluginManifest,
    /// The controller that loaded it: only it may replace, configure or
    /// unload it (or a caller that acts for every owner).
    owner: String,
    abi: (u16, u16),
    cfg_slot: u32,
    config: Vec<u8>,
    prog: ProgramHandle,
    maps: Vec<PluginMap>,
}

impl Plugin {
    fn flags(&self) -> u32 {
        match self.manifest.failure {
            FailurePolicy::Open => 0,
            FailurePolicy::Closed => PLUGIN_FAIL_CLOSED,
        }
    }

    fn meta(&self) -> PluginMeta {
        PluginMeta {
            name: fixed_str(&self.manifest.name).unwrap_or([0; PLUGIN_NAME_LEN]),
            version: fixed_str(&self.manifest.version).unwrap_or([0; PLUGIN_VERSION_LEN]),
            hook: self.manifest.hook.raw(),
            phase: self.manifest.phase.raw(),
            priority: self.manifest.priority,
            flags: self.flags(),
            cfg_slot: self.cfg_slot,
            abi: (u32::from(self.abi.0) << 16) | u32::from(self.abi.1),
            sha256: self.sha256(),
            owner: OwnerName::new(&self.owner).unwrap_or_default(),
        }
    }

    /// The object's digest: the manifest carries it once loaded.
    fn sha256(&self) -> [u8; 32] {
        self.manifest.sha256.unwrap_or_default()
    }

    fn order(&self) -> (Phase, Reverse<i32>, &str) {
        (self.manifest.phase, Reverse(self.manifest.priority), &self.manifest.name)
    }
}

#[derive(Debug, Default)]
struct State {
    plugins: BTreeMap<String, Plugin>,
}

impl State {
    /// The hook's chain in run order, with `swap` = (name, replacement or
    /// none) applied.
    fn members<'a>(&'a self, hook: Hook, swap: Option<(&str, Option<&'a Plugin>)>) -> Vec<&'a Plugin> {
        let mut v: Vec<&Plugin> = self
            .plugins
            .values()
            .filter(|p| p.manifest.hook == hook && swap.is_none_or(|(n, _)| p.manifest.name != n))
            .collect();
        if let Some((_, Some(p))) = swap {
            v.push(p);
        }
        v.sort_by(|a, b| a.order().cmp(&b.order()));
        v
    }

    fn free_id(&self) -> Option<u32> {
        (1..MAX_PLUGINS).find(|id| self.plugins.values().all(|p| p.id != *id))
    }
}

/// The plugin chains of a node's data paths.
#[derive(Debug)]
pub struct PluginChain {
    sock: Option<FamilyMaps>,
    tc: Option<FamilyMaps>,
    state: Mutex<State>,
}

impl PluginChain {
    /// Opens the chains of the given data paths (either may be absent) and
    /// adopts the plugins pinned there.
    pub fn open(dp: Option<&crate::Dataplane>, tc: Option<&crate::tc::TcDataplane>) -> Result<Self, PluginError> {
        Self::open_dirs(dp.map(|d| d.pin_dir()), tc.map(|t| t.pin_dir()))
    }

    /// As [`PluginChain::open`], from the families' pin directories.
    ///
    /// Adoption drops plugins their chain does not run (a change cut short),
    /// so only the process that holds the families' pins
    /// ([`FamilyPins::lock`](crate::pins::FamilyPins::lock)) may open them.
    pub(crate) fn open_dirs(sock_dir: Option<&Path>, tc_dir: Option<&Path>) -> Result<Self, PluginError> {
        let sock = sock_dir.map(|d| FamilyMaps::open(d, Family::Sock)).transpose()?;
        let tc = tc_dir.map(|d| FamilyMaps::open(d, Family::Tc)).transpose()?;
        let chain = Self { sock, tc, state: Mutex::new(State::default()) };
        chain.adopt()?;
        Ok(chain)
    }

    fn family(&self, hook: Hook) -> Result<&FamilyMaps, PluginError> {
        match hook.family() {
            Family::Sock => self.sock.as_ref().ok_or(PluginError::HookUnavailable { hook, what: "socket" }),
            Family::Tc => self.tc.as_ref().ok_or(PluginError::HookUnavailable { hook, what: "tc" }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        crate::sys::lock(&self.state)
    }

    /// Rebuilds the plugin table from the pinned manifests and programs,
    /// as the active chains say: a plugin whose manifest was written but
    /// which never made it into (or already left) its chain — a load or an
    /// unload cut short by a crash — is dropped, and a config update cut
    /// short is taken back to the config slot the chain reads.
    fn adopt(&self) -> Result<(), PluginError> {
        let mut st = self.lock();
        for fam in [&self.sock, &self.tc].into_iter().flatten() {
            let mut running = BTreeMap::new();
            for hook in [Hook::Connection, Hook::Message, Hook::Packet] {
                if fam.shared.contains_key(hook.prog_array()) {
                    running.insert(hook, fam.active_members(hook)?);
                }
            }
            let mut kept = std::collections::BTreeSet::new();
            for (id, mut meta) in fam.meta.entries()? {
                let Some(hook) = Hook::from_raw(meta.hook) else { continue };
                let Some(&cfg_slot) = running.get(&hook).and_then(|m| m.get(&id)) else {
                    tracing::warn!(plugin = %str_of(&meta.name), id, "a plugin not in its chain (a load or unload cut short); dropped");
                    let _ = fam.meta.delete(&id);
                    let _ = remove_plugin_dir(&fam.plugin_dir(id));
                    continue;
                };
                if cfg_slot != meta.cfg_slot {
                    tracing::info!(plugin = %str_of(&meta.name), "a config update was cut short; the chain's config stands");
                    meta.cfg_slot = cfg_slot;
                    let _ = fam.meta.put(&id, &meta);
                }
                let dir = fam.plugin_dir(id);
                let prog = match ProgramHandle::from_pinned_path(dir.join("prog")) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(plugin = %str_of(&meta.name), error = %e, "pinned plugin without its program; ignored");
                        continue;
                    }
                };
                let config = fam.cfg.get(&meta.cfg_slot)?.map(|c| c.bytes().to_vec()).unwrap_or_default();
                let manifest = PluginManifest {
                    name: str_of(&meta.name),
                    version: str_of(&meta.version),
                    hook,
                    phase: Phase::from_raw(meta.phase),
                    priority: meta.priority,
                    failure: if meta.flags & PLUGIN_FAIL_CLOSED != 0 {
                        FailurePolicy::Closed
                    } else {
                        FailurePolicy::Open
                    },
                    sha256: Some(meta.sha256),
                };
                let plugin = Plugin {
                    id,
                    owner: meta.owner.as_string(),
                    abi: ((meta.abi >> 16) as u16, meta.abi as u16),
                    cfg_slot: meta.cfg_slot,
                    config,
                    prog,
                    maps: pinned_maps(&dir),
                    manifest,
                };
                kept.insert(id);
                st.plugins.insert(plugin.manifest.name.clone(), plugin);
            }
            // Pins of a plugin with no metadata: a load cut short before it,
            // or an unload cut short after it.
            let root = fam.plugin_dir(0).parent().map(Path::to_path_buf).unwrap_or_default();
            for e in fs::read_dir(&root).into_iter().flatten().flatten() {
                let id = e.file_name().to_string_lossy().parse::<u32>().ok();
                if id.is_some_and(|id| !kept.contains(&id)) {
                    tracing::warn!(dir = %e.path().display(), "pins of a plugin that is in no chain; removed");
                    let _ = remove_plugin_dir(&e.path());
                }
            }
        }
        if !st.plugins.is_empty() {
            tracing::info!(plugins = st.plugins.len(), "adopted pinned plugins");
        }
        Ok(())
    }

    /// Loads a plugin object from a file.
    pub fn load_path(
        &self,
        manifest: &PluginManifest,
        path: &Path,
        config: &[u8],
        replace: bool,
        owner: &str,
    ) -> Result<PluginInfo, PluginError> {
        let object = fs::read(path).map_err(io_err(path))?;
        self.load(manifest, &object, config, replace, owner)
    }

    /// Verifies and loads a plugin object and puts it in its hook's chain
    /// (replacing the plugin of the same name if `replace`), atomically.
    /// On any error nothing changed.
    pub fn load(
        &self,
        manifest: &PluginManifest,
        object: &[u8],
        config: &[u8],
        replace: bool,
        owner: &str,
    ) -> Result<PluginInfo, PluginError> {
        manifest.validate()?;
        if OwnerName::new(owner).is_none() || owner.is_empty() {
            return Err(PluginError::Invalid {
                field: "owner",
                reason: format!("{owner:?}: 1 to {} bytes, no NUL", OWNER_LEN - 1),
            });
        }
        if config.len() > PLUGIN_CFG_MAX {
            return Err(PluginError::ConfigTooLarge { len: config.len() });
        }
        let sha256: [u8; 32] = Sha256::digest(object).into();
        if let Some(want) = manifest.sha256 {
            if want != sha256 {
                return Err(PluginError::Sha256Mismatch { expected: hex(&want), actual: hex(&sha256) });
            }
        }
        let abi = object_abi(object)?;
        if !abi_compatible(abi.major, abi.minor) {
            return Err(PluginError::AbiMismatch { plugin: (abi.major, abi.minor) });
        }
        if abi.hook != manifest.hook.raw() {
            let object =
                Hook::from_raw(abi.hook).map_or_else(|| format!("unknown hook {}", abi.hook), |h| h.to_string());
            return Err(PluginError::HookMismatch { manifest: manifest.hook, object });
        }
        let hook = manifest.hook;
        let fam = self.family(hook)?;

        let mut st = self.lock();
        if let Some(old) = st.plugins.get(&manifest.name) {
            if !replace {
                return Err(PluginError::AlreadyExists { name: manifest.name.clone() });
            }
            check_owner(old, Some(owner))?;
            if old.manifest.hook != hook {
                return Err(PluginError::HookChange {
                    name: manifest.name.clone(),
                    loaded: old.manifest.hook,
                    requested: hook,
                });
            }
        }
        let others = st.members(hook, Some((&manifest.name, None))).len();
        if others >= CHAIN_MAX as usize {
            return Err(PluginError::ChainFull { hook });
        }
        let id = st.free_id().ok_or(PluginError::NoSlot)?;
        let cfg_slot = id * 2;
        fam.write_config(cfg_slot, config)?;
        fam.reset_counters(id)?;
        crate::fault::point("plugin config")?;

        let dir = fam.plugin_dir(id);
        // A leftover of a crashed load under this id is not in any chain.
        let _ = remove_plugin_dir(&dir);
        let (prog, maps) = load_object(fam, manifest, object, &dir)?;
        if let Err(e) = crate::fault::point("plugin pinned") {
            let _ = remove_plugin_dir(&dir);
            return Err(e.into());
        }
        let mut manifest = manifest.clone();
        manifest.sha256 = Some(sha256);
        let plugin = Plugin {
            id,
            manifest,
            owner: owner.to_string(),
            abi: (abi.major, abi.minor),
            cfg_slot,
            config: config.to_vec(),
            prog,
            maps,
        };
        let installed = fam.meta.put(&id, &plugin.meta()).map_err(PluginError::from).and_then(|()| {
            crate::fault::point("plugin meta")?;
            fam.install_chain(hook, &st.members(hook, Some((&plugin.manifest.name, Some(&plugin)))))
        });
        if let Err(e) = installed {
            let _ = fam.meta.delete(&id);
            let _ = remove_plugin_dir(&dir);
            return Err(e);
        }
        let name = plugin.manifest.name.clone();
        if let Some(old) = st.plugins.insert(name.clone(), plugin) {
            forget(fam, &old);
            tracing::info!(plugin = %name, old_id = old.id, "replaced plugin");
        }
        let p = &st.plugins[&name];
        tracing::info!(plugin = %name, id = p.id, %hook, "loaded plugin");
        self.info(&st, p)
    }

    /// Takes a plugin out of its chain and unloads it.
    /// With `owner`, only that owner's plugin.
    pub fn unload(&self, name: &str, owner: Option<&str>) -> Result<(), PluginError> {
        let mut st = self.lock();
        let p = st.plugins.get(name).ok_or_else(|| PluginError::NotFound { name: name.into() })?;
        check_owner(p, owner)?;
        let hook = p.manifest.hook;
        let fam = self.family(hook)?;
        fam.install_chain(hook, &st.members(hook, Some((name, None))))?;
        if let Some(p) = st.plugins.remove(name) {
            forget(fam, &p);
        }
        tracing::info!(plugin = %name, "unloaded plugin");
        Ok(())
    }

    /// Gives a plugin new configuration bytes; messages see the old or the new
    /// config, never a mix.
    pub fn update_config(&self, name: &str, config: &[u8], owner: Option<&str>) -> Result<PluginInfo, PluginError> {
        if config.len() > PLUGIN_CFG_MAX {
            return Err(PluginError::ConfigTooLarge { len: config.len() });
        }
        let mut st = self.lock();
        let p = st.plugins.get(name).ok_or_else(|| PluginError::NotFound { name: name.into() })?;
        check_owner(p, owner)?;
        let hook = p.manifest.hook;
        let fam = self.family(hook)?;
        // The other of the plugin's two slots: nothing reads it (cleared
        // generations only referred to it before a grace period).
        let slot = p.cfg_slot ^ 1;
        fam.write_config(slot, config)?;
        crate::fault::point("plugin config")?;
        let mut members = st.members(hook, None);
        let updated = Plugin {
            cfg_slot: slot,
            config: config.to_vec(),
            prog: ProgramHandle::try_from(&p.prog).map_err(bpf("duplicating the program handle"))?,
            maps: p.maps.clone(),
            manifest: p.manifest.clone(),
            owner: p.owner.clone(),
            ..*p
        };
        for m in members.iter_mut() {
            if m.manifest.name == name {
                *m = &updated;
            }
        }
        fam.install_chain(hook, &members)?;
        // The chain reads the new slot now: the table follows it even if the
        // metadata write fails (adoption takes the chain's word over it).
        if let Err(e) = fam.meta.put(&updated.id, &updated.meta()) {
            tracing::warn!(plugin = %name, error = %e, "writing plugin metadata; the chain's config stands");
        }
        st.plugins.insert(name.to_string(), updated);
        self.info(&st, &st.plugins[name])
    }

    /// Every loaded plugin, in chain order per hook.
    pub fn list(&self) -> Result<Vec<PluginInfo>, PluginError> {
        let st = self.lock();
        let mut out = Vec::new();
        for hook in Hook::ALL {
            for p in st.members(hook, None) {
                out.push(self.info(&st, p)?);
            }
        }
        Ok(out)
    }

    /// One plugin.
    pub fn get(&self, name: &str) -> Result<PluginInfo, PluginError> {
        let st = self.lock();
        let p = st.plugins.get(name).ok_or_else(|| PluginError::NotFound { name: name.into() })?;
        self.info(&st, p)
    }

    fn info(&self, st: &State, p: &Plugin) -> Result<PluginInfo, PluginError> {
        let hook = p.manifest.hook;
        let fam = self.family(hook)?;
        let position = st.members(hook, None).iter().position(|m| m.id == p.id).unwrap_or(0) as u32;
        let prog_id = p.prog.id();
        Ok(PluginInfo {
            manifest: p.manifest.clone(),
            id: p.id,
            prog_id,
            abi: p.abi,
            sha256: p.sha256(),
            config: p.config.clone(),
            position,
            counters: fam.counters(p.id)?,
            maps: p.maps.iter().filter(|m| m.name != names::MAP_OWN_STATS).cloned().collect(),
            owner: p.owner.clone(),
        })
    }
}

/// [`PluginError::OwnerMismatch`] unless `owner` (when given) loaded `p`.
fn check_owner(p: &Plugin, owner: Option<&str>) -> Result<(), PluginError> {
    match owner {
        Some(o) if o != p.owner => Err(PluginError::OwnerMismatch {
            name: p.manifest.name.clone(),
            owner: p.owner.clone(),
            requested: o.into(),
        }),
        _ => Ok(()),
    }
}

/// Drops a plugin that is no longer in any chain: its manifest and pins.
fn forget(fam: &FamilyMaps, p: &Plugin) {
    if let Err(e) = fam.meta.delete(&p.id) {
        tracing::warn!(plugin = %p.manifest.name, error = %e, "removing plugin metadata");
    }
    // Killed here, the next opener finds pins without metadata: adoption
    // removes them.
    let _ = crate::fault::point("plugin forgetting");
    if let Err(e) = remove_plugin_dir(&fam.plugin_dir(p.id)) {
        tracing::warn!(plugin = %p.manifest.name, error = %e, "removing plugin pins");
    }
}

fn pinned_maps(dir: &Path) -> Vec<PluginMap> {
    let mut v: Vec<PluginMap> = fs::read_dir(dir.join("maps"))
        .map(|rd| {
            rd.flatten()
                .map(|e| PluginMap { name: e.file_name().to_string_lossy().into_owned(), pin: e.path() })
                .collect()
        })
        .unwrap_or_default();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// Everything the host checks in a plugin object before the kernel sees it —
/// an ELF with the ABI section, libbpf's reading of it, one program named
/// `mw_plugin` of the hook's type, no map asking for pinning of its own —
/// without the kernel or privileges (the fuzz target `plugin_object` drives
/// it with arbitrary bytes).
pub fn inspect_object(hook: Hook, object: &[u8]) -> Result<PluginAbi, PluginError> {
    let abi = object_abi(object)?;
    let object = object.to_vec(); // aligned, see object_abi
    let mut builder = ObjectBuilder::default();
    let open = builder.open_memory(&object).map_err(|e| PluginError::NotAPlugin { reason: e.to_string() })?;
    check_open(&open, hook)?;
    Ok(abi)
}

/// The shape checks of an opened plugin object.
fn check_open(open: &libbpf_rs::OpenObject, hook: Hook) -> Result<(), PluginError> {
    let progs: Vec<(String, ProgramType)> =
        open.progs().map(|p| (p.name().to_string_lossy().into_owned(), p.prog_type())).collect();
    match progs.as_slice() {
        [(n, t)] if n == names::PROG_PLUGIN && *t == hook.prog_type() => {}
        [(n, t)] if n == names::PROG_PLUGIN => {
            return Err(PluginError::HookMismatch { manifest: hook, object: format!("a {t:?} program") })
        }
        _ => {
            return Err(PluginError::NotAPlugin {
                reason: format!("want exactly one program named {}, found {progs:?}", names::PROG_PLUGIN),
            })
        }
    }
    for m in open.maps() {
        let mname = m.name().to_string_lossy();
        if is_host_only_map(&mname) {
            return Err(PluginError::NotAPlugin {
                reason: format!(
                    "map {mname} is a map of meshwarp's data path that plugins may not use: a plugin reaches the \
                     host only through its context, its config and the chain (plugin.h)"
                ),
            });
        }
        // SAFETY: a map of the open object, alive for the call.
        let pin =
            unsafe { libbpf_rs::libbpf_sys::bpf_map__pin_path(libbpf_rs::AsRawLibbpf::as_libbpf_object(&m).as_ptr()) };
        if !pin.is_null() {
            return Err(PluginError::NotAPlugin {
                reason: format!(
                    "map {} asks to be pinned (a pinning attribute): meshwarp pins a plugin's maps under its own directory",
                    m.name().to_string_lossy()
                ),
            });
        }
    }
    Ok(())
}

/// A map name of a host family that plugin objects do not share (their
/// sockets' state, links, rules, ...): an object declaring one is refused
/// rather than given a private copy that would look like the host's.
fn is_host_only_map(name: &str) -> bool {
    let shared = names::PLUGIN_SHARED_MAPS.iter().chain(&[names::MAP_CH_CONN, names::MAP_CH_MSG, names::MAP_CH_PKT]);
    let host = names::SOCKREDIR_MAPS
        .iter()
        .chain(&names::SOCKREDIR_ADDED_MAPS)
        .chain(&names::TCREDIR_MAPS)
        .chain(&names::PLUGIN_HOST_MAPS);
    host.into_iter().any(|h| *h == name) && !shared.into_iter().any(|h| *h == name)
}

/// Opens the object, makes it share the family's chain maps, loads it through
/// the verifier and pins its program and own maps under `dir`.
fn load_object(
    fam: &FamilyMaps,
    manifest: &PluginManifest,
    object: &[u8],
    dir: &Path,
) -> Result<(ProgramHandle, Vec<PluginMap>), PluginError> {
    let name = &manifest.name;
    let object = object.to_vec(); // aligned, see object_abi
    let mut builder = ObjectBuilder::default();
    let mut open = builder.open_memory(&object).map_err(|e| PluginError::NotAPlugin { reason: e.to_string() })?;
    check_open(&open, manifest.hook)?;
    for mut m in open.maps_mut() {
        let mname = m.name().to_string_lossy().into_owned();
        if let Some(h) = fam.shared.get(mname.as_str()) {
            m.reuse_fd(h.as_fd()).map_err(bpf(format!("sharing map {mname}")))?;
        }
    }
    let (loaded, log) = with_libbpf_log(|| open.load());
    let obj = loaded.map_err(|source| PluginError::Rejected { name: name.clone(), source, log })?;
    let prog = obj
        .progs_mut()
        .next()
        .ok_or_else(|| PluginError::NotAPlugin { reason: "no program after load".into() })
        .and_then(|p| ProgramHandle::try_from(&p).map_err(bpf("program handle")))?;

    let maps_dir = dir.join("maps");
    fs::create_dir_all(&maps_dir).map_err(io_err(&maps_dir))?;
    let pin_all = || -> Result<Vec<PluginMap>, PluginError> {
        prog.pin(dir.join("prog")).map_err(bpf("pinning the plugin program"))?;
        let mut maps = Vec::new();
        for m in obj.maps() {
            let mname = m.name().to_string_lossy().into_owned();
            if fam.shared.contains_key(mname.as_str())
                || mname.starts_with('.')
                || mname.contains(".rodata")
                || mname.contains(".bss")
                || mname.contains(".data")
            {
                continue;
            }
            let pin = maps_dir.join(&mname);
            let mut h = MapHandle::try_from(&m).map_err(bpf(format!("handle of map {mname}")))?;
            h.pin(&pin).map_err(bpf(format!("pinning {}", pin.display())))?;
            maps.push(PluginMap { name: mname, pin });
        }
        maps.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(maps)
    };
    match pin_all() {
        Ok(maps) => Ok((prog, maps)),
        Err(e) => {
            let _ = remove_plugin_dir(dir);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_inspected_without_the_kernel() {
        use meshwarp_bpf::plugins::{BYTE_SAMPLER, PINNED_MAP, PORT_ALLOW};
        assert_eq!(inspect_object(Hook::Connection, PORT_ALLOW).unwrap().major, ABI_MAJOR);
        assert!(matches!(inspect_object(Hook::Message, PORT_ALLOW), Err(PluginError::HookMismatch { .. })));
        assert!(inspect_object(Hook::Message, BYTE_SAMPLER).is_ok());
        let pinned = inspect_object(Hook::Message, PINNED_MAP).unwrap_err();
        assert!(pinned.to_string().contains("pinned"), "{pinned}");
        for junk in [&b""[..], b"\x7fELF", &PORT_ALLOW[..64]] {
            assert!(matches!(inspect_object(Hook::Connection, junk), Err(PluginError::NotAPlugin { .. })));
        }
    }

    #[test]
    fn abi_rules() {
        assert!(abi_compatible(ABI_MAJOR, ABI_MINOR));
        assert!(abi_compatible(ABI_MAJOR, 0));
        assert!(!abi_compatible(ABI_MAJOR, ABI_MINOR + 1));
        assert!(!abi_compatible(ABI_MAJOR + 1, 0));
        assert!(!abi_compatible(0, 0));
    }

    #[test]
    fn built_objects_declare_their_abi_and_hook() {
        use meshwarp_bpf::plugins;
        let cases = [
            (plugins::PORT_ALLOW, HOOK_CONNECTION),
            (plugins::BYTE_SAMPLER, HOOK_MESSAGE),
            (plugins::RATE_LIMIT, HOOK_MESSAGE),
            (plugins::PKT_PORT, HOOK_PACKET),
        ];
        for (obj, hook) in cases {
            let abi = object_abi(obj).unwrap();
            assert_eq!((abi.major, abi.minor, abi.hook), (ABI_MAJOR, ABI_MINOR, hook));
        }
        assert_eq!(object_abi(plugins::ABI_MAJOR).unwrap().major, ABI_MAJOR + 1);
        assert!(matches!(object_abi(b"not an elf"), Err(PluginError::NotAPlugin { .. })));
    }

    #[test]
    fn manifest_validation() {
        let ok = PluginManifest::new("port-allow_v1.2", Hook::Connection);
        ok.validate().unwrap();
        for bad in ["", "Upper", "-lead", "sp ace", &"x".repeat(64)] {
            let m = PluginManifest { name: bad.into(), ..ok.clone() };
            assert!(matches!(m.validate(), Err(PluginError::Invalid { field: "name", .. })), "{bad:?}");
        }
        let m = PluginManifest { version: "v".repeat(32), ..ok };
        assert!(matches!(m.validate(), Err(PluginError::Invalid { field: "version", .. })));
    }

    #[test]
    fn chain_order_is_phase_then_priority_desc_then_name() {
        let mk = |name: &str, phase, priority| PluginManifest {
            phase,
            priority,
            ..PluginManifest::new(name, Hook::Message)
        };
        let mut v = [
            mk("stats", Phase::Stats, 100),
            mk("later", Phase::Unspecified, 1000),
            mk("authz-lo", Phase::Authz, 1),
            mk("authz-hi", Phase::Authz, 9),
            mk("b", Phase::Authn, 0),
            mk("a", Phase::Authn, 0),
        ];
        v.sort_by(|x, y| (x.phase, Reverse(x.priority), &x.name).cmp(&(y.phase, Reverse(y.priority), &y.name)));
        let names: Vec<&str> = v.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "authz-hi", "authz-lo", "stats", "later"]);
    }
}
