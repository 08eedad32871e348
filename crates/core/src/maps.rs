//! The typed layer between the library and the kernel's maps.
//!
//! [`TypedMap<K, V>`] and [`PerCpu<K, V>`] are the one way core reads and
//! writes a BPF map: keys and values are the `#[repr(C)]` mirrors (or
//! integers), errors name the map, a full map and an entry of another layout
//! are typed. [`RuleMaps`] is what the socket registry needs from the data
//! path; [`KernelMaps`] implements it over the pinned maps, [`MemoryMaps`]
//! over plain collections so that validation and reconciliation are
//! unit-tested without root. The kernel path itself is covered by the
//! integration tests. [`RuleLatency`] is the latency monitor's maps per rule
//! id in one family (switch, indexed rows, hash), which `crate::latency`
//! switches and reads and the registries clear when they reuse an id.

use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use std::os::fd::{AsFd, AsRawFd};

use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle, MapType};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{
    CaptureKey, Config, GlobalStats, LatHist, LatKey, OwnerName, PairKey, Pod, Ports, Rule, RuleStats, Short,
    CFG_LAT_CLEAN, LAT_FAST, LAT_ROW_METRICS, LAT_RT_ROW_METRICS, LAT_TRANSIT,
};

/// A failed map operation.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The map holds max_entries already; nothing was changed.
    #[error("map {map} is full ({capacity} entries)")]
    Full { map: &'static str, capacity: u32 },
    #[error("{op} on map {map}: {source}")]
    Kernel {
        op: &'static str,
        map: &'static str,
        #[source]
        source: libbpf_rs::Error,
    },
    #[error("map {map}: entry of {got} bytes, expected {want}")]
    BadValue { map: &'static str, got: usize, want: usize },
}

/// How [`RuleMaps`] writes an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    /// Create; fails if present.
    Create,
    /// Create or replace.
    Upsert,
}

/// The per-slot maps of a family: its counters and its owners.
pub trait SlotMaps {
    /// How many counter slots (rules) there are.
    fn slot_capacity(&self) -> u32;
    /// Zeroes a slot's counters before it is given to a new rule.
    fn reset_slot(&mut self, id: u32) -> Result<(), MapError>;
    fn put_owner(&mut self, id: u32, owner: &OwnerName) -> Result<(), MapError>;
    fn delete_owner(&mut self, id: u32) -> Result<(), MapError>;
}

/// What the registry reads and writes in the data path, beyond the slot
/// maps every family has (the stats array has a slot per pair or capture rule).
pub trait RuleMaps: SlotMaps {
    fn pairs(&self) -> Result<Vec<(PairKey, Rule)>, MapError>;
    fn captures(&self) -> Result<Vec<(CaptureKey, Rule)>, MapError>;
    fn put_pair(&mut self, key: &PairKey, rule: &Rule) -> Result<(), MapError>;
    fn delete_pair(&mut self, key: &PairKey) -> Result<(), MapError>;
    fn put_capture(&mut self, key: &CaptureKey, rule: &Rule) -> Result<(), MapError>;
    fn delete_capture(&mut self, key: &CaptureKey) -> Result<(), MapError>;
    /// Counters of one rule slot, summed over CPUs.
    fn rule_stats(&self, id: u32) -> Result<RuleStats, MapError>;
    fn global_stats(&self) -> Result<GlobalStats, MapError>;
    /// Owner of every rule slot that has one.
    fn owners(&self) -> Result<Vec<(u32, OwnerName)>, MapError>;
    /// Writes the set of server ports the rules name (`mw_ports`) from the
    /// rule maps, and keeps it from then on; a data path without the map
    /// (and the in-memory maps) filters nothing.
    fn sync_ports(&mut self) -> Result<(), MapError> {
        Ok(())
    }
}

/// The server ports of a rule: a pair's server port; a capture rule's
/// destination and its listener (what its server end sees).
fn pair_ports(k: &PairKey) -> [u16; 1] {
    [k.server_port as u16]
}

fn capture_ports(k: &CaptureKey, r: &Rule) -> [u16; 2] {
    [k.dst_port as u16, r.listener_port as u16]
}

/// `mw_ports`, counted per rule: a port several rules name stays set until
/// the last of them goes. A port is set before its rule is written and
/// cleared after it is deleted, so no handshake finds a rule whose port is
/// filtered out; a failed clear leaves it set (a lookup more, never a
/// connection missed).
#[derive(Debug)]
struct PortSet {
    map: TypedMap<u32, Ports>,
    counts: BTreeMap<u16, u32>,
}

impl PortSet {
    fn write(&self) -> Result<(), MapError> {
        self.map.put(&0, &Ports::of(self.counts.keys().copied()))
    }

    /// Counts `ports` once more; whether one of them is new.
    fn count(&mut self, ports: &[u16]) -> bool {
        let mut new = false;
        for &p in ports {
            let n = self.counts.entry(p).or_insert(0);
            *n += 1;
            new |= *n == 1;
        }
        new
    }

    fn add(&mut self, ports: &[u16]) -> Result<(), MapError> {
        if self.count(ports) {
            if let Err(e) = self.write() {
                self.forget(ports);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Takes `ports` off the counts; whether one of them is set no more.
    fn forget(&mut self, ports: &[u16]) -> bool {
        let mut gone = false;
        for p in ports {
            if let Some(n) = self.counts.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    self.counts.remove(p);
                    gone = true;
                }
            }
        }
        gone
    }

    /// Forgets `ports` after their rule was deleted or changed. A failed
    /// write leaves the bits set and is only logged: the rule maps changed
    /// already, and a bit too many costs a lookup, never a connection.
    fn remove(&mut self, ports: &[u16]) {
        if self.forget(ports) {
            if let Err(e) = self.write() {
                tracing::warn!(?ports, "clearing server ports in mw_ports (left set): {e}");
            }
        }
    }
}

/// The pinned maps of a loaded data path.
#[derive(Debug)]
pub struct KernelMaps {
    pairs: TypedMap<PairKey, Rule>,
    capture: TypedMap<CaptureKey, Rule>,
    stats: PerCpu<u32, RuleStats>,
    global: PerCpu<u32, GlobalStats>,
    /// Whether each rule's connections are short: reset with every write
    /// of a rule (`forget_short`), its creation included.
    short: TypedMap<u32, Short>,
    owners: TypedMap<u32, OwnerName>,
    /// The latency monitor's switch and histograms, per rule id: a slot given
    /// to a new rule starts with the monitor off and no histograms.
    lat: RuleLatency,
    /// Kept once [`RuleMaps::sync_ports`] wrote it.
    ports: Option<PortSet>,
    maps_dir: PathBuf,
}

fn kernel(op: &'static str, map: &'static str) -> impl FnOnce(libbpf_rs::Error) -> MapError {
    move |source| MapError::Kernel { op, map, source }
}

fn decode<T: Pod>(map: &'static str, bytes: &[u8]) -> Result<T, MapError> {
    T::from_bytes(bytes).ok_or(MapError::BadValue { map, got: bytes.len(), want: size_of::<T>() })
}

/// A BPF map whose keys are `K` and values `V` (integers or the `#[repr(C)]`
/// mirrors of `shared.h`), named in its errors. An entry of another size
/// than `K`/`V` is [`MapError::BadValue`] (a map of another layout).
#[derive(Debug)]
pub struct TypedMap<K, V> {
    map: MapHandle,
    name: &'static str,
    kv: PhantomData<(K, V)>,
}

impl<K: Pod, V: Pod> TypedMap<K, V> {
    pub fn new(map: MapHandle, name: &'static str) -> Self {
        Self { map, name, kv: PhantomData }
    }

    /// The map `name` pinned in `maps_dir`.
    pub fn pinned(maps_dir: &Path, name: &'static str) -> Result<Self, MapError> {
        let map = MapHandle::from_pinned_path(maps_dir.join(name)).map_err(kernel("open pinned", name))?;
        Ok(Self::new(map, name))
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its size (max entries).
    pub fn capacity(&self) -> u32 {
        self.map.max_entries()
    }

    pub fn get(&self, key: &K) -> Result<Option<V>, MapError> {
        match self.map.lookup(key.as_bytes(), MapFlags::ANY).map_err(kernel("lookup", self.name))? {
            Some(v) => decode(self.name, &v).map(Some),
            None => Ok(None),
        }
    }

    /// Creates or replaces. A hash map or LPM trie without room is
    /// [`MapError::Full`]; in an array E2BIG means an index past its end
    /// and stays a kernel error.
    pub fn put(&self, key: &K, val: &V) -> Result<(), MapError> {
        let (k, v) = (key.as_bytes(), val.as_bytes());
        for (got, want) in [(k.len(), self.map.key_size()), (v.len(), self.map.value_size())] {
            if got != want as usize {
                return Err(MapError::BadValue { map: self.name, got, want: want as usize });
            }
        }
        // SAFETY: a valid map fd and key/value buffers of the map's sizes
        // (checked above), alive for the call. Called directly for its errno,
        // which says whether the map is full.
        let rc = unsafe {
            libbpf_rs::libbpf_sys::bpf_map_update_elem(
                self.map.as_fd().as_raw_fd(),
                k.as_ptr().cast(),
                v.as_ptr().cast(),
                libbpf_rs::libbpf_sys::BPF_ANY.into(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let hashed = !matches!(
            self.map.map_type(),
            MapType::Array | MapType::PercpuArray | MapType::ProgArray | MapType::Sockmap | MapType::ArrayOfMaps
        );
        match -rc {
            libc::E2BIG if hashed => Err(MapError::Full { map: self.name, capacity: self.capacity() }),
            libc::ENOSPC => Err(MapError::Full { map: self.name, capacity: self.capacity() }),
            errno => Err(MapError::Kernel {
                op: "update",
                map: self.name,
                source: libbpf_rs::Error::from_raw_os_error(errno),
            }),
        }
    }

    /// Removes the entry; an absent one is no error.
    pub fn delete(&self, key: &K) -> Result<(), MapError> {
        match self.map.delete(key.as_bytes()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(MapError::Kernel { op: "delete", map: self.name, source: e }),
        }
    }

    /// The keys present now.
    pub fn keys(&self) -> Result<Vec<K>, MapError> {
        self.map.keys().map(|k| decode(self.name, &k)).collect()
    }

    /// Every entry present now.
    pub fn entries(&self) -> Result<Vec<(K, V)>, MapError> {
        let mut out = Vec::new();
        for key in self.keys()? {
            // An entry deleted between keys() and lookup() is simply gone.
            if let Some(val) = self.get(&key)? {
                out.push((key, val));
            }
        }
        Ok(out)
    }
}

impl KernelMaps {
    /// A rule written anew (created, or its mode or target changed) starts
    /// judging its connections' length afresh: a run of short ones seen
    /// under its old value says nothing of the new; nor do the rates its
    /// timed directions measured (`rate_fast`, `rate_tcp`), wiped with it. Best effort: a failure
    /// only keeps the old run, which ends by itself within a second.
    fn forget_short(&mut self, id: u32) {
        if let Err(e) = self.short.put(&id, &Short::default()) {
            tracing::warn!(id, "resetting the rule's short-connection run (kept): {e}");
        }
    }

    /// Opens the maps pinned in `maps_dir`.
    pub fn open(maps_dir: &Path) -> Result<Self, MapError> {
        Ok(Self {
            pairs: TypedMap::pinned(maps_dir, names::MAP_PAIRS)?,
            capture: TypedMap::pinned(maps_dir, names::MAP_CAPTURE)?,
            stats: PerCpu::pinned(maps_dir, names::MAP_STATS)?,
            global: PerCpu::pinned(maps_dir, names::MAP_GLOBAL)?,
            short: TypedMap::pinned(maps_dir, names::MAP_SHORT)?,
            owners: TypedMap::pinned(maps_dir, names::MAP_OWNERS)?,
            lat: RuleLatency::open(maps_dir, RowShape::SOCKETS)?,
            ports: None,
            maps_dir: maps_dir.to_path_buf(),
        })
    }
}

/// A per-CPU map (array or hash) keyed by `K` whose values are `V`: entries
/// summed over CPUs, or set to zero on every CPU.
#[derive(Debug)]
pub struct PerCpu<K, V> {
    map: TypedMap<K, V>,
    ncpus: usize,
}

impl<K: Pod, V: Pod> PerCpu<K, V> {
    pub fn new(map: MapHandle, name: &'static str) -> Result<Self, MapError> {
        let ncpus = libbpf_rs::num_possible_cpus().map_err(kernel("count cpus", name))?;
        Ok(Self { map: TypedMap::new(map, name), ncpus })
    }

    /// The map `name` pinned in `maps_dir`.
    pub fn pinned(maps_dir: &Path, name: &'static str) -> Result<Self, MapError> {
        let map = MapHandle::from_pinned_path(maps_dir.join(name)).map_err(kernel("open pinned", name))?;
        Self::new(map, name)
    }

    /// Its size (max entries).
    pub fn capacity(&self) -> u32 {
        self.map.capacity()
    }

    /// The entry at `key`, summed over CPUs with `add` (absent: the default).
    pub fn sum(&self, key: &K, add: impl Fn(&mut V, &V)) -> Result<V, MapError> {
        let name = self.map.name;
        let mut total = V::default();
        let per_cpu = self.map.map.lookup_percpu(key.as_bytes(), MapFlags::ANY).map_err(kernel("lookup", name))?;
        for v in per_cpu.unwrap_or_default() {
            add(&mut total, &decode(name, &v)?);
        }
        Ok(total)
    }

    /// Every key present now.
    pub fn keys(&self) -> Result<Vec<K>, MapError> {
        self.map.keys()
    }

    pub fn delete(&self, key: &K) -> Result<(), MapError> {
        self.map.delete(key)
    }

    /// Sets the entry at `key` to `V::default()` on every CPU.
    pub fn zero(&self, key: &K) -> Result<(), MapError> {
        let zeros = vec![V::default().as_bytes().to_vec(); self.ncpus];
        self.map.map.update_percpu(key.as_bytes(), &zeros, MapFlags::ANY).map_err(kernel("update", self.map.name))
    }
}

/// Adds `b` into `a` field by field (wrapping: a socket counted in on one
/// CPU may be counted out on another, leaving one CPU's slot "negative").
pub fn add_rule_stats(a: &mut RuleStats, b: &RuleStats) {
    a.sockets = a.sockets.wrapping_add(b.sockets);
    a.msgs = a.msgs.wrapping_add(b.msgs);
    a.bytes = a.bytes.wrapping_add(b.bytes);
    a.fb_no_peer = a.fb_no_peer.wrapping_add(b.fb_no_peer);
    a.fb_tcp_path = a.fb_tcp_path.wrapping_add(b.fb_tcp_path);
    a.fb_map_full = a.fb_map_full.wrapping_add(b.fb_map_full);
    a.fb_insert_err = a.fb_insert_err.wrapping_add(b.fb_insert_err);
    a.fb_collision = a.fb_collision.wrapping_add(b.fb_collision);
    a.fb_reader = a.fb_reader.wrapping_add(b.fb_reader);
    a.fb_splice = a.fb_splice.wrapping_add(b.fb_splice);
    a.fb_lowat = a.fb_lowat.wrapping_add(b.fb_lowat);
    a.fb_ulp = a.fb_ulp.wrapping_add(b.fb_ulp);
    a.ulp_refused = a.ulp_refused.wrapping_add(b.ulp_refused);
    a.splice_hits = a.splice_hits.wrapping_add(b.splice_hits);
    a.demotions = a.demotions.wrapping_add(b.demotions);
    a.promotions = a.promotions.wrapping_add(b.promotions);
    a.policy_tcp_msgs = a.policy_tcp_msgs.wrapping_add(b.policy_tcp_msgs);
    a.fb_mode_never = a.fb_mode_never.wrapping_add(b.fb_mode_never);
    a.unlinks = a.unlinks.wrapping_add(b.unlinks);
    a.relinks = a.relinks.wrapping_add(b.relinks);
    a.demotions_behind = a.demotions_behind.wrapping_add(b.demotions_behind);
    a.fb_reader_busy = a.fb_reader_busy.wrapping_add(b.fb_reader_busy);
    a.reader_wakeups = a.reader_wakeups.wrapping_add(b.reader_wakeups);
    a.tgtmap_clients = a.tgtmap_clients.wrapping_add(b.tgtmap_clients);
    a.hint_stale = a.hint_stale.wrapping_add(b.hint_stale);
    a.fb_urgent = a.fb_urgent.wrapping_add(b.fb_urgent);
    a.urgent_hits = a.urgent_hits.wrapping_add(b.urgent_hits);
    a.fb_zerocopy = a.fb_zerocopy.wrapping_add(b.fb_zerocopy);
    a.zc_refused = a.zc_refused.wrapping_add(b.zc_refused);
    a.fb_peek_off = a.fb_peek_off.wrapping_add(b.fb_peek_off);
    a.peek_off_refused = a.peek_off_refused.wrapping_add(b.peek_off_refused);
    a.fb_short = a.fb_short.wrapping_add(b.fb_short);
    a.demotions_around = a.demotions_around.wrapping_add(b.demotions_around);
}

fn add_global_stats(a: &mut GlobalStats, b: &GlobalStats) {
    a.established += b.established;
    a.not_covered += b.not_covered;
    a.no_state += b.no_state;
    a.no_link += b.no_link;
    a.no_slot += b.no_slot;
    a.slots_stale += b.slots_stale;
}

impl SlotMaps for KernelMaps {
    fn slot_capacity(&self) -> u32 {
        self.stats.capacity()
    }

    fn reset_slot(&mut self, id: u32) -> Result<(), MapError> {
        self.stats.zero(&id)?;
        self.lat.forget(id)
    }

    fn put_owner(&mut self, id: u32, owner: &OwnerName) -> Result<(), MapError> {
        self.owners.put(&id, owner)
    }

    fn delete_owner(&mut self, id: u32) -> Result<(), MapError> {
        self.owners.delete(&id)
    }
}

impl RuleMaps for KernelMaps {
    fn pairs(&self) -> Result<Vec<(PairKey, Rule)>, MapError> {
        self.pairs.entries()
    }

    fn captures(&self) -> Result<Vec<(CaptureKey, Rule)>, MapError> {
        self.capture.entries()
    }

    fn put_pair(&mut self, key: &PairKey, rule: &Rule) -> Result<(), MapError> {
        self.forget_short(rule.id);
        let Some(ports) = self.ports.as_mut() else { return self.pairs.put(key, rule) };
        // An update of an existing key names the same port.
        let new = self.pairs.get(key)?.is_none();
        if new {
            ports.add(&pair_ports(key))?;
        }
        let put = self.pairs.put(key, rule);
        if put.is_err() && new {
            ports.remove(&pair_ports(key));
        }
        put
    }

    fn delete_pair(&mut self, key: &PairKey) -> Result<(), MapError> {
        // A missing key deletes nothing (and counted nothing).
        let existed = self.ports.is_some() && self.pairs.get(key)?.is_some();
        self.pairs.delete(key)?;
        if let Some(ports) = self.ports.as_mut().filter(|_| existed) {
            ports.remove(&pair_ports(key));
        }
        Ok(())
    }

    fn put_capture(&mut self, key: &CaptureKey, rule: &Rule) -> Result<(), MapError> {
        self.forget_short(rule.id);
        let Some(ports) = self.ports.as_mut() else { return self.capture.put(key, rule) };
        // An update may change the listener: the new ports are counted
        // first, the old ones forgotten once it is written.
        let old = self.capture.get(key)?;
        let now = capture_ports(key, rule);
        ports.add(&now)?;
        let put = self.capture.put(key, rule);
        match (&put, old) {
            (Err(_), _) => ports.remove(&now),
            (Ok(()), Some(old)) => ports.remove(&capture_ports(key, &old)),
            (Ok(()), None) => {}
        }
        put
    }

    fn delete_capture(&mut self, key: &CaptureKey) -> Result<(), MapError> {
        let old = match self.ports.as_ref() {
            Some(_) => self.capture.get(key)?,
            None => None,
        };
        self.capture.delete(key)?;
        if let (Some(ports), Some(old)) = (self.ports.as_mut(), old) {
            ports.remove(&capture_ports(key, &old));
        }
        Ok(())
    }

    fn rule_stats(&self, id: u32) -> Result<RuleStats, MapError> {
        self.stats.sum(&id, add_rule_stats)
    }

    fn global_stats(&self) -> Result<GlobalStats, MapError> {
        self.global.sum(&0, add_global_stats)
    }

    fn owners(&self) -> Result<Vec<(u32, OwnerName)>, MapError> {
        self.owners.entries()
    }

    fn sync_ports(&mut self) -> Result<(), MapError> {
        let map = match TypedMap::pinned(&self.maps_dir, names::MAP_PORTS) {
            Ok(m) => m,
            Err(e) => {
                // An older build's pins, before the upgrade creates it.
                tracing::debug!("no server port filter yet (every port may be covered): {e}");
                self.ports = None;
                return Ok(());
            }
        };
        let mut set = PortSet { map, counts: BTreeMap::new() };
        for (k, _) in self.pairs.entries()? {
            set.count(&pair_ports(&k));
        }
        for (k, r) in self.capture.entries()? {
            set.count(&capture_ports(&k, &r));
        }
        // The ports first, then bit 0: the 8 KiB are copied unlocked, and a
        // reader must not see the set kept before its ports are in.
        let mut ports = Ports::of(set.counts.keys().copied());
        ports.bits[0] &= !1;
        set.map.put(&0, &ports)?;
        ports.bits[0] |= 1;
        set.map.put(&0, &ports)?;
        self.ports = Some(set);
        Ok(())
    }
}

/// An in-memory stand-in with the kernel maps' capacity semantics, for unit
/// tests of the registry logic.
#[derive(Debug, Default)]
pub struct MemoryMaps {
    pub capacity: u32,
    pub pairs: HashMap<PairKey, Rule>,
    pub captures: HashMap<CaptureKey, Rule>,
    pub stats: HashMap<u32, RuleStats>,
    pub global: GlobalStats,
    pub owners: HashMap<u32, OwnerName>,
    /// Fail the n-th map write from now (1 = the next), to test rollback.
    pub fail_write_in: Option<u32>,
    /// Fail the n-th rule deletion from now (1 = the next).
    pub fail_delete_in: Option<u32>,
}

impl MemoryMaps {
    pub fn with_capacity(capacity: u32) -> Self {
        Self { capacity, ..Self::default() }
    }

    fn write(&mut self) -> Result<(), MapError> {
        countdown(&mut self.fail_write_in)
    }

    fn delete(&mut self) -> Result<(), MapError> {
        countdown(&mut self.fail_delete_in)
    }
}

impl SlotMaps for MemoryMaps {
    fn slot_capacity(&self) -> u32 {
        self.capacity
    }

    fn reset_slot(&mut self, id: u32) -> Result<(), MapError> {
        self.stats.remove(&id);
        Ok(())
    }

    fn put_owner(&mut self, id: u32, owner: &OwnerName) -> Result<(), MapError> {
        self.owners.insert(id, *owner);
        Ok(())
    }

    fn delete_owner(&mut self, id: u32) -> Result<(), MapError> {
        self.owners.remove(&id);
        Ok(())
    }
}

fn countdown(fail_in: &mut Option<u32>) -> Result<(), MapError> {
    match *fail_in {
        Some(1) => {
            *fail_in = None;
            Err(MapError::BadValue { map: "injected", got: 0, want: 0 })
        }
        Some(n) => {
            *fail_in = Some(n - 1);
            Ok(())
        }
        None => Ok(()),
    }
}

impl RuleMaps for MemoryMaps {
    fn pairs(&self) -> Result<Vec<(PairKey, Rule)>, MapError> {
        Ok(self.pairs.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn captures(&self) -> Result<Vec<(CaptureKey, Rule)>, MapError> {
        Ok(self.captures.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn put_pair(&mut self, key: &PairKey, rule: &Rule) -> Result<(), MapError> {
        self.write()?;
        if !self.pairs.contains_key(key) && self.pairs.len() as u32 >= self.capacity {
            return Err(MapError::Full { map: names::MAP_PAIRS, capacity: self.capacity });
        }
        self.pairs.insert(*key, *rule);
        Ok(())
    }

    fn delete_pair(&mut self, key: &PairKey) -> Result<(), MapError> {
        self.delete()?;
        self.pairs.remove(key);
        Ok(())
    }

    fn put_capture(&mut self, key: &CaptureKey, rule: &Rule) -> Result<(), MapError> {
        self.write()?;
        if !self.captures.contains_key(key) && self.captures.len() as u32 >= self.capacity {
            return Err(MapError::Full { map: names::MAP_CAPTURE, capacity: self.capacity });
        }
        self.captures.insert(*key, *rule);
        Ok(())
    }

    fn delete_capture(&mut self, key: &CaptureKey) -> Result<(), MapError> {
        self.delete()?;
        self.captures.remove(key);
        Ok(())
    }

    fn rule_stats(&self, id: u32) -> Result<RuleStats, MapError> {
        Ok(self.stats.get(&id).copied().unwrap_or_default())
    }

    fn global_stats(&self) -> Result<GlobalStats, MapError> {
        Ok(self.global)
    }

    fn owners(&self) -> Result<Vec<(u32, OwnerName)>, MapError> {
        Ok(self.owners.iter().map(|(k, v)| (*k, *v)).collect())
    }
}

// ---- the latency monitor's maps per rule id (crate::latency reads and switches them) ----

/// How a family's rows in `mw_lat_rows` are laid out: `metrics` per rule
/// id, from the metric coded `first` on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowShape {
    metrics: u32,
    first: u32,
}

impl RowShape {
    /// Sockets: every metric but the hop.
    pub(crate) const SOCKETS: RowShape = RowShape { metrics: LAT_ROW_METRICS, first: LAT_FAST };
    /// Routes: transit.
    pub(crate) const ROUTES: RowShape = RowShape { metrics: LAT_RT_ROW_METRICS, first: LAT_TRANSIT };
}

/// One family's latency maps per rule id: the switch (`mw_lat_rule`), the
/// rows of the first ids (`mw_lat_rows`) and the hash of the others and of
/// hops (`mw_lat_hist`); and `mw_config`, whose `CFG_LAT_CLEAN` says the
/// monitor never ran on them (set by the loader that created them, taken off
/// when the monitor is switched on or programs of another build ran).
#[derive(Debug)]
pub(crate) struct RuleLatency {
    pub(crate) rules: TypedMap<u32, u64>,
    pub(crate) rows: Rows,
    pub(crate) hists: PerCpu<LatKey, LatHist>,
    config: TypedMap<u32, Config>,
}

impl RuleLatency {
    pub(crate) fn open(maps_dir: &Path, shape: RowShape) -> Result<Self, MapError> {
        Ok(Self {
            rules: TypedMap::pinned(maps_dir, names::MAP_LAT_RULE)?,
            rows: Rows { map: PerCpu::pinned(maps_dir, names::MAP_LAT_ROWS)?, shape },
            hists: PerCpu::pinned(maps_dir, names::MAP_LAT_HIST)?,
            config: TypedMap::pinned(maps_dir, names::MAP_CONFIG)?,
        })
    }

    /// What a loader writes into `mw_config` of maps it creates, before
    /// pinning them: the monitor never ran on them.
    pub(crate) const FRESH_CONFIG: Config = Config { flags: CFG_LAT_CLEAN, pad: 0, lat_since: 0 };

    /// Takes the mark off (programs of another build ran on these maps, and
    /// may have run the monitor without clearing it): new rule ids search
    /// and zero again.
    pub(crate) fn mark_used(maps_dir: &Path) -> Result<(), MapError> {
        let config = TypedMap::<u32, Config>::pinned(maps_dir, names::MAP_CONFIG)?;
        let mut c = config.get(&0)?.unwrap_or_default();
        if c.flags & CFG_LAT_CLEAN != 0 {
            c.flags &= !CFG_LAT_CLEAN;
            config.put(&0, &c)?;
        }
        Ok(())
    }

    /// A rule id given to a new rule starts with the monitor off and no
    /// histograms (its own, or a hop's from it). On maps the monitor never
    /// ran on there is nothing to forget; that saves the walk of
    /// `mw_lat_hist`, which visits every bucket even when the map is empty.
    pub(crate) fn forget(&self, id: u32) -> Result<(), MapError> {
        if self.config.get(&0)?.unwrap_or_default().flags & CFG_LAT_CLEAN != 0 {
            return Ok(());
        }
        self.rules.put(&id, &0)?;
        self.rows.zero(id)?;
        for k in self.hists.keys()? {
            if k.rule_id == id || k.from_rule == id {
                self.hists.delete(&k)?;
            }
        }
        Ok(())
    }
}

/// `mw_lat_rows`: the histograms of the first rule ids, a row of
/// `shape.metrics` per id (metric `m` at `id * metrics + m - first`).
#[derive(Debug)]
pub(crate) struct Rows {
    map: PerCpu<u32, LatHist>,
    shape: RowShape,
}

impl Rows {
    /// How many rule ids have a row.
    fn len(&self) -> u32 {
        self.map.capacity() / self.shape.metrics
    }

    /// The ids of `rules` that have a row (all rows if empty).
    pub(crate) fn ids(&self, rules: &std::collections::BTreeSet<u32>) -> Vec<u32> {
        let n = self.len();
        if rules.is_empty() {
            (0..n).collect()
        } else {
            rules.iter().copied().filter(|&id| id < n).collect()
        }
    }

    /// The metrics rule `id` recorded (code, histogram summed over CPUs).
    pub(crate) fn of(&self, id: u32) -> Result<Vec<(u32, LatHist)>, MapError> {
        let mut out = Vec::new();
        for m in 0..self.shape.metrics {
            let h = self.map.sum(&(id * self.shape.metrics + m), add_hist)?;
            if h.count > 0 {
                out.push((self.shape.first + m, h));
            }
        }
        Ok(out)
    }

    /// Zeroes rule `id`'s row, if it has one.
    pub(crate) fn zero(&self, id: u32) -> Result<(), MapError> {
        if id < self.len() {
            for m in 0..self.shape.metrics {
                self.map.zero(&(id * self.shape.metrics + m))?;
            }
        }
        Ok(())
    }
}

/// Adds latency histogram `b` into `a` (per-CPU sums).
pub(crate) fn add_hist(a: &mut LatHist, b: &LatHist) {
    a.count = a.count.wrapping_add(b.count);
    a.sum_ns = a.sum_ns.wrapping_add(b.sum_ns);
    for (x, y) in a.bucket.iter_mut().zip(b.bucket.iter()) {
        *x = x.wrapping_add(*y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libbpf_rs::libbpf_sys::bpf_map_create_opts;
    use libbpf_rs::MapType;

    fn map(ty: MapType, key: u32, value: u32, max: u32) -> Option<MapHandle> {
        let map_flags = if ty == MapType::LpmTrie { libbpf_rs::libbpf_sys::BPF_F_NO_PREALLOC } else { 0 };
        let opts = bpf_map_create_opts { sz: size_of::<bpf_map_create_opts>() as _, map_flags, ..Default::default() };
        match MapHandle::create(ty, Some("mw_test"), key, value, max, &opts) {
            Ok(m) => Some(m),
            Err(e) => meshwarp_testbed::missing_feature(&format!("creating a BPF {ty:?} map: {e}")),
        }
    }

    #[test]
    fn typed_maps_round_trip_and_report_full_and_bad_sizes() {
        let Some(h) = map(MapType::Hash, 4, 8, 2) else { return };
        let m: TypedMap<u32, u64> = TypedMap::new(h, "mw_test");
        m.put(&1, &10).unwrap();
        m.put(&2, &20).unwrap();
        m.put(&1, &11).unwrap();
        assert!(matches!(m.put(&3, &30), Err(MapError::Full { capacity: 2, .. })));
        let mut e = m.entries().unwrap();
        e.sort();
        assert_eq!(e, vec![(1, 11), (2, 20)]);
        m.delete(&2).unwrap();
        m.delete(&2).unwrap(); // absent: no error
        assert_eq!(m.get(&2).unwrap(), None);
        // A map of another layout is an error, not garbage.
        let Some(h) = map(MapType::Array, 4, 8, 1) else { return };
        let wrong: TypedMap<u32, u32> = TypedMap::new(h, "mw_test");
        assert!(matches!(wrong.get(&0), Err(MapError::BadValue { got: 8, want: 4, .. })));
        assert!(matches!(wrong.put(&0, &1), Err(MapError::BadValue { got: 4, want: 8, .. })));
        // An LPM trie without room says ENOSPC: full too.
        let Some(h) = map(MapType::LpmTrie, 8, 4, 1) else { return };
        let trie: TypedMap<[u32; 2], u32> = TypedMap::new(h, "mw_test");
        trie.put(&[32, 1], &1).unwrap();
        assert!(matches!(trie.put(&[32, 2], &2), Err(MapError::Full { capacity: 1, .. })));
        // An index past an array's end is no "full" map.
        let Some(h) = map(MapType::Array, 4, 4, 1) else { return };
        let array: TypedMap<u32, u32> = TypedMap::new(h, "mw_test");
        assert!(matches!(array.put(&5, &1), Err(MapError::Kernel { .. })));
    }

    #[test]
    fn per_cpu_maps_sum_and_zero() {
        let Some(h) = map(MapType::PercpuArray, 4, 8, 1) else { return };
        let ncpus = libbpf_rs::num_possible_cpus().unwrap();
        let ones: Vec<Vec<u8>> = (0..ncpus).map(|_| 1u64.to_ne_bytes().to_vec()).collect();
        h.update_percpu(&0u32.to_ne_bytes(), &ones, MapFlags::ANY).unwrap();
        let m: PerCpu<u32, u64> = PerCpu::new(h, "mw_test").unwrap();
        assert_eq!(m.sum(&0, |a, b| *a += b).unwrap(), ncpus as u64);
        m.zero(&0).unwrap();
        assert_eq!(m.sum(&0, |a, b| *a += b).unwrap(), 0);
    }
}
