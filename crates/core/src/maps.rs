//! The thin layer between the registry's logic and the kernel's maps.
//!
//! [`RuleMaps`] is what the registry needs from the data path; [`KernelMaps`]
//! implements it over pinned BPF maps, [`MemoryMaps`] over plain collections so
//! that validation and reconciliation are unit-tested without root. The kernel
//! path itself is covered by the integration tests.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::path::Path;

use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle};
use meshwarp_bpf::names;
use meshwarp_bpf::shared::{CaptureKey, GlobalStats, OwnerName, PairKey, Pod, Rule, RuleStats};

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
}

/// The pinned maps of a loaded data path.
#[derive(Debug)]
pub struct KernelMaps {
    pairs: MapHandle,
    capture: MapHandle,
    stats: PerCpu<RuleStats>,
    global: PerCpu<GlobalStats>,
    owners: MapHandle,
}

pub(crate) fn kernel(op: &'static str, map: &'static str) -> impl FnOnce(libbpf_rs::Error) -> MapError {
    move |source| MapError::Kernel { op, map, source }
}

fn decode<T: Pod>(map: &'static str, bytes: &[u8]) -> Result<T, MapError> {
    T::from_bytes(bytes).ok_or(MapError::BadValue { map, got: bytes.len(), want: size_of::<T>() })
}

fn entries<K: Pod, V: Pod>(map: &MapHandle, name: &'static str) -> Result<Vec<(K, V)>, MapError> {
    let mut out = Vec::new();
    for key in map.keys() {
        // An entry deleted between keys() and lookup() is simply gone.
        if let Some(val) = map.lookup(&key, MapFlags::ANY).map_err(kernel("lookup", name))? {
            out.push((decode::<K>(name, &key)?, decode::<V>(name, &val)?));
        }
    }
    Ok(out)
}

pub(crate) fn put(map: &MapHandle, name: &'static str, key: &[u8], val: &[u8]) -> Result<(), MapError> {
    map.update(key, val, MapFlags::ANY).map_err(|e| {
        if e.kind() == ErrorKind::TooBig {
            MapError::Full { map: name, capacity: map.max_entries() }
        } else {
            MapError::Kernel { op: "update", map: name, source: e }
        }
    })
}

pub(crate) fn delete(map: &MapHandle, name: &'static str, key: &[u8]) -> Result<(), MapError> {
    match map.delete(key) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(MapError::Kernel { op: "delete", map: name, source: e }),
    }
}

impl KernelMaps {
    /// Opens the maps pinned in `maps_dir`.
    pub fn open(maps_dir: &Path) -> Result<Self, MapError> {
        let open =
            |name: &'static str| MapHandle::from_pinned_path(maps_dir.join(name)).map_err(kernel("open pinned", name));
        Ok(Self {
            pairs: open(names::MAP_PAIRS)?,
            capture: open(names::MAP_CAPTURE)?,
            stats: PerCpu::new(open(names::MAP_STATS)?).map_err(kernel("count cpus", names::MAP_STATS))?,
            global: PerCpu::new(open(names::MAP_GLOBAL)?).map_err(kernel("count cpus", names::MAP_GLOBAL))?,
            owners: open(names::MAP_OWNERS)?,
        })
    }
}

/// A per-CPU map (array or hash) whose values are `T`: entries summed over
/// CPUs, or set to zero on every CPU. A value of another size than `T` is an
/// error (a map of another layout).
#[derive(Debug)]
pub(crate) struct PerCpu<T> {
    map: MapHandle,
    ncpus: usize,
    value: PhantomData<T>,
}

impl<T: Pod> PerCpu<T> {
    pub(crate) fn new(map: MapHandle) -> Result<Self, libbpf_rs::Error> {
        Ok(Self { map, ncpus: libbpf_rs::num_possible_cpus()?, value: PhantomData })
    }

    /// Its size (max entries).
    pub(crate) fn capacity(&self) -> u32 {
        self.map.max_entries()
    }

    /// The entry at `key`, summed over CPUs with `add`.
    pub(crate) fn sum(&self, key: &[u8], add: impl Fn(&mut T, &T)) -> Result<T, libbpf_rs::Error> {
        let mut total = T::default();
        for v in self.map.lookup_percpu(key, MapFlags::ANY)?.unwrap_or_default() {
            let x = T::from_bytes(&v).ok_or_else(|| {
                libbpf_rs::Error::from(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("per-CPU value of {} bytes, expected {}", v.len(), size_of::<T>()),
                ))
            })?;
            add(&mut total, &x);
        }
        Ok(total)
    }

    /// Sets the entry at `key` to `T::default()` on every CPU.
    pub(crate) fn zero(&self, key: &[u8]) -> Result<(), libbpf_rs::Error> {
        let zeros = vec![T::default().as_bytes().to_vec(); self.ncpus];
        self.map.update_percpu(key, &zeros, MapFlags::ANY)
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
        self.stats.zero(&id.to_ne_bytes()).map_err(kernel("update", names::MAP_STATS))
    }

    fn put_owner(&mut self, id: u32, owner: &OwnerName) -> Result<(), MapError> {
        put(&self.owners, names::MAP_OWNERS, &id.to_ne_bytes(), owner.as_bytes())
    }

    fn delete_owner(&mut self, id: u32) -> Result<(), MapError> {
        delete(&self.owners, names::MAP_OWNERS, &id.to_ne_bytes())
    }
}

impl RuleMaps for KernelMaps {
    fn pairs(&self) -> Result<Vec<(PairKey, Rule)>, MapError> {
        entries(&self.pairs, names::MAP_PAIRS)
    }

    fn captures(&self) -> Result<Vec<(CaptureKey, Rule)>, MapError> {
        entries(&self.capture, names::MAP_CAPTURE)
    }

    fn put_pair(&mut self, key: &PairKey, rule: &Rule) -> Result<(), MapError> {
        put(&self.pairs, names::MAP_PAIRS, key.as_bytes(), rule.as_bytes())
    }

    fn delete_pair(&mut self, key: &PairKey) -> Result<(), MapError> {
        delete(&self.pairs, names::MAP_PAIRS, key.as_bytes())
    }

    fn put_capture(&mut self, key: &CaptureKey, rule: &Rule) -> Result<(), MapError> {
        put(&self.capture, names::MAP_CAPTURE, key.as_bytes(), rule.as_bytes())
    }

    fn delete_capture(&mut self, key: &CaptureKey) -> Result<(), MapError> {
        delete(&self.capture, names::MAP_CAPTURE, key.as_bytes())
    }

    fn rule_stats(&self, id: u32) -> Result<RuleStats, MapError> {
        self.stats.sum(&id.to_ne_bytes(), add_rule_stats).map_err(kernel("lookup", names::MAP_STATS))
    }

    fn global_stats(&self) -> Result<GlobalStats, MapError> {
        self.global.sum(&0u32.to_ne_bytes(), add_global_stats).map_err(kernel("lookup", names::MAP_GLOBAL))
    }

    fn owners(&self) -> Result<Vec<(u32, OwnerName)>, MapError> {
        entries(&self.owners, names::MAP_OWNERS)
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
