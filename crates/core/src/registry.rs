//! The registry of rules: which endpoint pairs and capture rules are installed,
//! which counter slot each owns, and how they are written to the data path.
//!
//! Its state is derived from the maps themselves ([`Registry::reconcile`]), so
//! an agent that adopts a pinned data path knows exactly what is installed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use meshwarp_bpf::shared::{
    ip_from_raw, raw_addr, CaptureKey, OwnerName, PairKey, Rule, OWNER_LEN, RULE_MODE_ALWAYS, RULE_MODE_NEVER,
    RULE_NO_TARGET_CLIENT, RULE_NO_TARGET_SERVER,
};

use crate::endpoint::{CaptureRule, Endpoint, EndpointPair, FastPathMode, NeverRedirectInto, ValidationError};
use crate::maps::{MapError, RuleMaps};
use crate::stats::{GlobalCounters, RuleCounters};

/// Why a registry operation failed; on error nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0} is already registered")]
    AlreadyExists(String),
    #[error("{0} is not registered")]
    NotFound(String),
    /// No room for another rule: existing entries are intact.
    #[error("rule capacity exhausted ({capacity} rules); nothing was changed")]
    Full { capacity: u32 },
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("{what} is owned by {owner:?}, not {requested:?}")]
    OwnerMismatch { what: String, owner: String, requested: String },
    #[error("invalid owner {0}")]
    InvalidOwner(String),
    #[error("{0} appears twice in one batch")]
    DuplicateInBatch(String),
    #[error("data path holds an entry meshwarp cannot read back: {0}")]
    Inconsistent(String),
    #[error(transparent)]
    Map(MapError),
}

impl From<MapError> for RegistryError {
    fn from(e: MapError) -> Self {
        match e {
            MapError::Full { capacity, .. } => Self::Full { capacity },
            other => Self::Map(other),
        }
    }
}

/// The map key of a mirror pair.
pub fn pair_key(pair: &EndpointPair) -> PairKey {
    let (client_ip, family) = raw_addr(pair.client());
    let (server_ip, _) = raw_addr(pair.server().addr);
    PairKey { client_ip, server_ip, server_port: u32::from(pair.server().port), family }
}

/// The map key of a capture rule (all-zero client: any client).
pub fn capture_key(rule: &CaptureRule) -> CaptureKey {
    let (dst_ip, family) = raw_addr(rule.original_dst().addr);
    let client_ip = rule.client().map(|c| raw_addr(c).0).unwrap_or_default();
    CaptureKey { client_ip, dst_ip, dst_port: u32::from(rule.original_dst().port), family }
}

fn rule_flags(n: NeverRedirectInto, mode: FastPathMode) -> u32 {
    let mode = match mode {
        FastPathMode::Adaptive => 0,
        FastPathMode::Always => RULE_MODE_ALWAYS,
        FastPathMode::Never => RULE_MODE_NEVER,
    };
    (if n.client { RULE_NO_TARGET_CLIENT } else { 0 }) | (if n.server { RULE_NO_TARGET_SERVER } else { 0 }) | mode
}

fn mode_of(flags: u32) -> FastPathMode {
    if flags & RULE_MODE_NEVER != 0 {
        FastPathMode::Never
    } else if flags & RULE_MODE_ALWAYS != 0 {
        FastPathMode::Always
    } else {
        FastPathMode::Adaptive
    }
}

fn never_into(flags: u32) -> NeverRedirectInto {
    NeverRedirectInto { client: flags & RULE_NO_TARGET_CLIENT != 0, server: flags & RULE_NO_TARGET_SERVER != 0 }
}

fn pair_value(pair: &EndpointPair, id: u32) -> Rule {
    Rule { id, flags: rule_flags(pair.never_into(), pair.mode()), ..Rule::default() }
}

fn capture_value(rule: &CaptureRule, id: u32) -> Rule {
    let (listener_ip, _) = raw_addr(rule.listener().addr);
    Rule {
        id,
        listener_port: u32::from(rule.listener().port),
        listener_ip,
        flags: rule_flags(rule.never_into(), rule.mode()),
        ..Rule::default()
    }
}

fn port(raw: u32, what: &str) -> Result<u16, RegistryError> {
    u16::try_from(raw).map_err(|_| RegistryError::Inconsistent(format!("{what} port {raw}")))
}

fn ip(raw: [u32; 4], family: u32, what: &str) -> Result<IpAddr, RegistryError> {
    ip_from_raw(raw, family).ok_or_else(|| RegistryError::Inconsistent(format!("{what} family {family}")))
}

/// Reads a mirror pair back from its map entry.
pub fn pair_from_entry(k: &PairKey, v: &Rule) -> Result<EndpointPair, RegistryError> {
    let server = Endpoint::new(ip(k.server_ip, k.family, "pair server")?, port(k.server_port, "pair server")?);
    Ok(EndpointPair::new(ip(k.client_ip, k.family, "pair client")?, server)?
        .never_redirect_into(never_into(v.flags))
        .with_mode(mode_of(v.flags)))
}

/// Reads a capture rule back from its map entry.
pub fn capture_from_entry(k: &CaptureKey, v: &Rule) -> Result<CaptureRule, RegistryError> {
    let client = if k.client_ip == [0; 4] { None } else { Some(ip(k.client_ip, k.family, "capture client")?) };
    let dst = Endpoint::new(ip(k.dst_ip, k.family, "capture dst")?, port(k.dst_port, "capture dst")?);
    let listener = Endpoint::new(ip(v.listener_ip, k.family, "capture listener")?, port(v.listener_port, "listener")?);
    Ok(CaptureRule::new(client, dst, listener)?.never_redirect_into(never_into(v.flags)).with_mode(mode_of(v.flags)))
}

/// A rule of either kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleRef {
    Pair(EndpointPair),
    Capture(CaptureRule),
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Created,
    /// The rule existed and its value changed (a capture rule's listener).
    Updated,
    /// The rule existed exactly as given.
    Unchanged,
}

/// A rule kind the registry stores: pairs and capture rules.
pub trait RuleKind: Copy + Eq + fmt::Display {
    /// What identifies the rule (two rules with one key cover the same connections).
    type Key: Ord + Copy + fmt::Debug;
    const WHAT: &'static str;
    fn rule_key(&self) -> Self::Key;
    fn write<M: RuleMaps>(&self, maps: &mut M, id: u32) -> Result<(), MapError>;
    fn erase<M: RuleMaps>(&self, maps: &mut M) -> Result<(), MapError>;
}

impl RuleKind for EndpointPair {
    type Key = (IpAddr, Endpoint);
    const WHAT: &'static str = "pair";
    fn rule_key(&self) -> Self::Key {
        self.key()
    }
    fn write<M: RuleMaps>(&self, maps: &mut M, id: u32) -> Result<(), MapError> {
        maps.put_pair(&pair_key(self), &pair_value(self, id))
    }
    fn erase<M: RuleMaps>(&self, maps: &mut M) -> Result<(), MapError> {
        maps.delete_pair(&pair_key(self))
    }
}

impl RuleKind for CaptureRule {
    type Key = (Option<IpAddr>, Endpoint);
    const WHAT: &'static str = "capture rule";
    fn rule_key(&self) -> Self::Key {
        self.key()
    }
    fn write<M: RuleMaps>(&self, maps: &mut M, id: u32) -> Result<(), MapError> {
        maps.put_capture(&capture_key(self), &capture_value(self, id))
    }
    fn erase<M: RuleMaps>(&self, maps: &mut M) -> Result<(), MapError> {
        maps.delete_capture(&capture_key(self))
    }
}

/// A registered rule with its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered<R> {
    pub rule: R,
    pub owner: String,
}

#[derive(Debug, Clone)]
struct Entry<R> {
    rule: R,
    id: u32,
    owner: String,
}

#[derive(Debug)]
struct Table<R: RuleKind> {
    entries: BTreeMap<R::Key, Entry<R>>,
}

impl<R: RuleKind> Default for Table<R> {
    fn default() -> Self {
        Self { entries: BTreeMap::new() }
    }
}

/// Counter-slot allocation, shared by pairs, capture rules and interface
/// routes: the lowest released slot first, else the next never-used one.
/// O(log n) per allocation.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    used: BTreeSet<u32>,
    released: BTreeSet<u32>,
    next_fresh: u32,
}

impl Slots {
    pub(crate) fn allocate(&mut self, capacity: u32) -> Option<u32> {
        let id = match self.released.pop_first() {
            Some(id) => id,
            None if self.next_fresh < capacity => {
                self.next_fresh += 1;
                self.next_fresh - 1
            }
            None => return None,
        };
        self.used.insert(id);
        Some(id)
    }

    pub(crate) fn release(&mut self, id: u32) {
        if self.used.remove(&id) {
            self.released.insert(id);
        }
    }

    /// Marks `id` in use: a slot found in the maps (reconciliation), or one
    /// given back by a rollback. False if it already was in use.
    pub(crate) fn claim(&mut self, id: u32) -> bool {
        self.released.remove(&id);
        self.used.insert(id)
    }

    /// How many more slots can be allocated.
    pub(crate) fn available(&self, capacity: u32) -> usize {
        self.released.len() + capacity.saturating_sub(self.next_fresh) as usize
    }

    /// After reconciliation: every slot below the highest used one that is
    /// not in use is free.
    pub(crate) fn rebuild_free(&mut self) {
        self.next_fresh = self.used.last().map_or(0, |m| m + 1);
        self.released = (0..self.next_fresh).filter(|i| !self.used.contains(i)).collect();
    }
}

fn owner_name(owner: &str) -> Result<OwnerName, RegistryError> {
    OwnerName::new(owner)
        .ok_or_else(|| RegistryError::InvalidOwner(format!("{owner:?}: at most {} bytes, no NUL", OWNER_LEN - 1)))
}

fn check_owner<R: RuleKind>(e: &Entry<R>, owner: &str) -> Result<(), RegistryError> {
    if e.owner != owner {
        return Err(RegistryError::OwnerMismatch {
            what: format!("{} {}", R::WHAT, e.rule),
            owner: e.owner.clone(),
            requested: owner.to_string(),
        });
    }
    Ok(())
}

impl<R: RuleKind> Table<R> {
    fn get(&self, rule: &R) -> Result<&Entry<R>, RegistryError> {
        self.entries.get(&rule.rule_key()).ok_or_else(|| RegistryError::NotFound(format!("{} {rule}", R::WHAT)))
    }

    fn list(&self) -> Vec<Registered<R>> {
        self.entries.values().map(|e| Registered { rule: e.rule, owner: e.owner.clone() }).collect()
    }

    fn create<M: RuleMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rule: &R,
        owner: &str,
    ) -> Result<(), RegistryError> {
        if let Some(e) = self.entries.get(&rule.rule_key()) {
            return Err(RegistryError::AlreadyExists(format!("{} {} (owner {:?})", R::WHAT, e.rule, e.owner)));
        }
        let name = owner_name(owner)?;
        let capacity = maps.rule_capacity();
        let id = slots.allocate(capacity).ok_or(RegistryError::Full { capacity })?;
        let written =
            maps.reset_rule_stats(id).and_then(|()| maps.put_owner(id, &name)).and_then(|()| rule.write(maps, id));
        if let Err(e) = written {
            let _ = maps.delete_owner(id);
            slots.release(id);
            return Err(e.into());
        }
        self.entries.insert(rule.rule_key(), Entry { rule: *rule, id, owner: owner.to_string() });
        Ok(())
    }

    fn upsert<M: RuleMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rule: &R,
        owner: &str,
    ) -> Result<Outcome, RegistryError> {
        let Some(e) = self.entries.get_mut(&rule.rule_key()) else {
            self.create(maps, slots, rule, owner)?;
            return Ok(Outcome::Created);
        };
        check_owner(e, owner)?;
        if e.rule == *rule {
            return Ok(Outcome::Unchanged);
        }
        rule.write(maps, e.id)?;
        e.rule = *rule;
        Ok(Outcome::Updated)
    }

    fn delete<M: RuleMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rule: &R,
        owner: Option<&str>,
    ) -> Result<(), RegistryError> {
        let e = self.get(rule)?;
        if let Some(o) = owner {
            check_owner(e, o)?;
        }
        let (stored, id) = (e.rule, e.id);
        stored.erase(maps)?;
        let _ = maps.delete_owner(id);
        slots.release(id);
        self.entries.remove(&rule.rule_key());
        Ok(())
    }

    /// Checks a batch before anything is written: no key twice, owners match.
    fn precheck(&self, rules: &[R], owner: &str) -> Result<usize, RegistryError> {
        owner_name(owner)?;
        let mut seen = BTreeSet::new();
        let mut new = 0;
        for r in rules {
            if !seen.insert(r.rule_key()) {
                return Err(RegistryError::DuplicateInBatch(format!("{} {r}", R::WHAT)));
            }
            match self.entries.get(&r.rule_key()) {
                Some(e) => check_owner(e, owner)?,
                None => new += 1,
            }
        }
        Ok(new)
    }

    /// All or nothing: on any failure the rules written so far are restored.
    fn batch_upsert<M: RuleMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rules: &[R],
        owner: &str,
    ) -> Result<Vec<Outcome>, RegistryError> {
        let new = self.precheck(rules, owner)?;
        let capacity = maps.rule_capacity();
        if slots.used.len() + new > capacity as usize {
            return Err(RegistryError::Full { capacity });
        }
        let mut done: Vec<(R, Outcome, Option<R>)> = Vec::with_capacity(rules.len());
        for r in rules {
            let previous = self.entries.get(&r.rule_key()).map(|e| e.rule);
            match self.upsert(maps, slots, r, owner) {
                Ok(o) => done.push((*r, o, previous)),
                Err(err) => {
                    for (r, o, prev) in done.into_iter().rev() {
                        let _ = match (o, prev) {
                            (Outcome::Created, _) => self.delete(maps, slots, &r, None),
                            (Outcome::Updated, Some(p)) => self.upsert(maps, slots, &p, owner).map(|_| ()),
                            _ => Ok(()),
                        };
                    }
                    return Err(err);
                }
            }
        }
        Ok(done.into_iter().map(|(_, o, _)| o).collect())
    }

    /// All or nothing. With `allow_missing`, absent rules are skipped;
    /// returns which rules were deleted.
    fn batch_delete<M: RuleMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rules: &[R],
        owner: &str,
        allow_missing: bool,
    ) -> Result<Vec<bool>, RegistryError> {
        self.precheck(rules, owner)?;
        if !allow_missing {
            for r in rules {
                self.get(r)?;
            }
        }
        let mut done: Vec<Entry<R>> = Vec::new();
        let mut deleted = Vec::with_capacity(rules.len());
        for r in rules {
            let Ok(e) = self.get(r).cloned() else {
                deleted.push(false);
                continue;
            };
            if let Err(err) = self.delete(maps, slots, r, Some(owner)) {
                for e in done.into_iter().rev() {
                    let _ = self.create(maps, slots, &e.rule, &e.owner);
                }
                return Err(err);
            }
            done.push(e);
            deleted.push(true);
        }
        Ok(deleted)
    }
}

/// Rules installed in one data path, their owners and counter slots.
#[derive(Debug)]
pub struct Registry<M> {
    maps: M,
    slots: Slots,
    pairs: Table<EndpointPair>,
    captures: Table<CaptureRule>,
}

impl<M: RuleMaps> Registry<M> {
    /// Builds the registry from what the maps hold (adoption after a restart).
    pub fn reconcile(maps: M) -> Result<Self, RegistryError> {
        let capacity = maps.rule_capacity();
        let owners: BTreeMap<u32, String> = maps.owners()?.into_iter().map(|(id, o)| (id, o.as_string())).collect();
        let mut slots = Slots::default();
        let mut claim = |id: u32, what: &dyn fmt::Display| {
            if id >= capacity || !slots.claim(id) {
                return Err(RegistryError::Inconsistent(format!(
                    "{what} holds counter slot {id} twice or out of range"
                )));
            }
            Ok(Entry { rule: (), id, owner: owners.get(&id).cloned().unwrap_or_default() })
        };
        let mut pairs = Table::default();
        for (k, v) in maps.pairs()? {
            let rule = pair_from_entry(&k, &v)?;
            let e = claim(v.id, &rule)?;
            pairs.entries.insert(rule.rule_key(), Entry { rule, id: e.id, owner: e.owner });
        }
        let mut captures = Table::default();
        for (k, v) in maps.captures()? {
            let rule = capture_from_entry(&k, &v)?;
            let e = claim(v.id, &rule)?;
            captures.entries.insert(rule.rule_key(), Entry { rule, id: e.id, owner: e.owner });
        }
        slots.rebuild_free();
        Ok(Self { maps, slots, pairs, captures })
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// Rules of both kinds in use, and the capacity they share.
    pub fn usage(&self) -> (usize, u32) {
        (self.slots.used.len(), self.maps.rule_capacity())
    }

    /// Registers a new pair; [`RegistryError::AlreadyExists`] if present.
    pub fn insert_pair(&mut self, pair: &EndpointPair, owner: &str) -> Result<(), RegistryError> {
        self.pairs.create(&mut self.maps, &mut self.slots, pair, owner)
    }

    /// Creates the pair unless present; an existing pair of another owner is
    /// [`RegistryError::OwnerMismatch`].
    pub fn upsert_pair(&mut self, pair: &EndpointPair, owner: &str) -> Result<Outcome, RegistryError> {
        self.pairs.upsert(&mut self.maps, &mut self.slots, pair, owner)
    }

    /// Removes a pair (checking the owner when given): new connections take the
    /// normal path. Connections it already accelerates stay accelerated until
    /// they close, because removing a socket from the SOCKMAP would drop bytes
    /// queued for its reader.
    pub fn remove_pair(&mut self, pair: &EndpointPair, owner: Option<&str>) -> Result<(), RegistryError> {
        self.pairs.delete(&mut self.maps, &mut self.slots, pair, owner)
    }

    pub fn get_pair(&self, pair: &EndpointPair) -> Result<Registered<EndpointPair>, RegistryError> {
        let e = self.pairs.get(pair)?;
        Ok(Registered { rule: e.rule, owner: e.owner.clone() })
    }

    pub fn pairs(&self) -> Vec<Registered<EndpointPair>> {
        self.pairs.list()
    }

    /// The rule that owns counter slot `id` (what the data path reports), and its owner.
    pub fn rule_by_id(&self, id: u32) -> Option<(RuleRef, String)> {
        let pair = self.pairs.entries.values().find(|e| e.id == id).map(|e| (RuleRef::Pair(e.rule), e.owner.clone()));
        pair.or_else(|| {
            self.captures.entries.values().find(|e| e.id == id).map(|e| (RuleRef::Capture(e.rule), e.owner.clone()))
        })
    }

    pub fn pair_stats(&self, pair: &EndpointPair) -> Result<RuleCounters, RegistryError> {
        Ok(self.maps.rule_stats(self.pairs.get(pair)?.id)?.into())
    }

    /// All-or-nothing upsert of many pairs for one owner.
    pub fn batch_upsert_pairs(&mut self, pairs: &[EndpointPair], owner: &str) -> Result<Vec<Outcome>, RegistryError> {
        self.pairs.batch_upsert(&mut self.maps, &mut self.slots, pairs, owner)
    }

    /// All-or-nothing removal of many pairs of one owner.
    pub fn batch_remove_pairs(
        &mut self,
        pairs: &[EndpointPair],
        owner: &str,
        allow_missing: bool,
    ) -> Result<Vec<bool>, RegistryError> {
        self.pairs.batch_delete(&mut self.maps, &mut self.slots, pairs, owner, allow_missing)
    }

    /// Registers a new capture rule; [`RegistryError::AlreadyExists`] if one
    /// covers the same client and original destination.
    pub fn insert_capture(&mut self, rule: &CaptureRule, owner: &str) -> Result<(), RegistryError> {
        self.captures.create(&mut self.maps, &mut self.slots, rule, owner)
    }

    /// Creates the rule, or replaces the listener of the rule with the same key
    /// (keeping its counters).
    pub fn upsert_capture(&mut self, rule: &CaptureRule, owner: &str) -> Result<Outcome, RegistryError> {
        self.captures.upsert(&mut self.maps, &mut self.slots, rule, owner)
    }

    /// Removes the capture rule with the same key as `rule`.
    pub fn remove_capture(&mut self, rule: &CaptureRule, owner: Option<&str>) -> Result<(), RegistryError> {
        self.captures.delete(&mut self.maps, &mut self.slots, rule, owner)
    }

    pub fn get_capture(&self, rule: &CaptureRule) -> Result<Registered<CaptureRule>, RegistryError> {
        let e = self.captures.get(rule)?;
        Ok(Registered { rule: e.rule, owner: e.owner.clone() })
    }

    pub fn captures(&self) -> Vec<Registered<CaptureRule>> {
        self.captures.list()
    }

    pub fn capture_stats(&self, rule: &CaptureRule) -> Result<RuleCounters, RegistryError> {
        Ok(self.maps.rule_stats(self.captures.get(rule)?.id)?.into())
    }

    pub fn batch_upsert_captures(&mut self, rules: &[CaptureRule], owner: &str) -> Result<Vec<Outcome>, RegistryError> {
        self.captures.batch_upsert(&mut self.maps, &mut self.slots, rules, owner)
    }

    pub fn batch_remove_captures(
        &mut self,
        rules: &[CaptureRule],
        owner: &str,
        allow_missing: bool,
    ) -> Result<Vec<bool>, RegistryError> {
        self.captures.batch_delete(&mut self.maps, &mut self.slots, rules, owner, allow_missing)
    }

    pub fn global_stats(&self) -> Result<GlobalCounters, RegistryError> {
        Ok(self.maps.global_stats()?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::MemoryMaps;
    use meshwarp_bpf::shared::RuleStats;
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn pair(c: &str, s: &str, p: u16) -> EndpointPair {
        EndpointPair::new(ip(c), Endpoint::new(ip(s), p)).unwrap()
    }

    fn capture(c: Option<&str>, d: &str, l: &str, lp: u16) -> CaptureRule {
        CaptureRule::new(c.map(ip), Endpoint::new(ip(d), 80), Endpoint::new(ip(l), lp)).unwrap()
    }

    #[test]
    fn insert_list_remove_pairs() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let b = pair("2001:db8::2", "2001:db8::3", 80);
        reg.insert_pair(&a, "ctl").unwrap();
        reg.insert_pair(&b, "ctl").unwrap();
        assert!(matches!(reg.insert_pair(&a, "ctl"), Err(RegistryError::AlreadyExists(_))));
        assert_eq!(reg.upsert_pair(&a, "ctl").unwrap(), Outcome::Unchanged);
        assert_eq!(reg.pairs().len(), 2);
        reg.remove_pair(&a, None).unwrap();
        assert!(matches!(reg.remove_pair(&a, None), Err(RegistryError::NotFound(_))));
        assert_eq!(reg.pairs().iter().map(|r| r.rule).collect::<Vec<_>>(), vec![b]);
        assert_eq!(reg.maps().pairs.len(), 1);
    }

    #[test]
    fn full_is_typed_and_leaves_entries_intact() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(2)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let b = pair("198.18.0.2", "198.18.0.3", 81);
        let c = pair("198.18.0.2", "198.18.0.3", 82);
        reg.insert_pair(&a, "ctl").unwrap();
        reg.insert_pair(&b, "ctl").unwrap();
        assert!(matches!(reg.insert_pair(&c, "ctl"), Err(RegistryError::Full { capacity: 2 })));
        assert_eq!(reg.pairs().iter().map(|r| r.rule).collect::<Vec<_>>(), vec![a, b]);
        assert_eq!(reg.maps().pairs.len(), 2);
        // Freed slots are reused, with zeroed counters.
        reg.remove_pair(&a, None).unwrap();
        reg.insert_pair(&c, "ctl").unwrap();
        assert_eq!(reg.pair_stats(&c).unwrap(), RuleCounters::default());
    }

    #[test]
    fn map_full_from_the_map_is_typed_too() {
        // The hash map is smaller than the id space: its own E2BIG must surface as Full.
        let mut maps = MemoryMaps::with_capacity(4);
        maps.pairs.insert(pair_key(&pair("198.18.0.9", "198.18.0.3", 1)), Rule { id: 0, ..Rule::default() });
        maps.capacity = 1;
        let mut reg = Registry::reconcile(maps).unwrap();
        let err = reg.insert_pair(&pair("198.18.0.2", "198.18.0.3", 80), "ctl").unwrap_err();
        assert!(matches!(err, RegistryError::Full { .. }), "{err}");
        assert_eq!(reg.pairs().len(), 1);
    }

    #[test]
    fn reconcile_restores_rules_and_ids() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let r = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15001);
        let any = capture(None, "198.18.0.3", "198.18.0.3", 15006);
        reg.insert_pair(&a, "ctl").unwrap();
        reg.insert_capture(&r, "ctl").unwrap();
        reg.insert_capture(&any, "ctl").unwrap();
        let mut maps = reg.maps;
        maps.stats.insert(maps.pairs[&pair_key(&a)].id, RuleStats { msgs: 5, ..Default::default() });
        let reg = Registry::reconcile(maps).unwrap();
        assert_eq!(reg.pairs(), vec![Registered { rule: a, owner: "ctl".into() }]);
        let mut caps: Vec<_> = reg.captures().into_iter().map(|r| r.rule).collect();
        caps.sort();
        let mut want = vec![r, any];
        want.sort();
        assert_eq!(caps, want);
        assert_eq!(reg.pair_stats(&a).unwrap().redirected_msgs, 5);
    }

    #[test]
    fn reconcile_refuses_duplicate_slots() {
        let mut maps = MemoryMaps::with_capacity(8);
        maps.pairs.insert(pair_key(&pair("198.18.0.2", "198.18.0.3", 80)), Rule { id: 1, ..Rule::default() });
        maps.pairs.insert(pair_key(&pair("198.18.0.2", "198.18.0.3", 81)), Rule { id: 1, ..Rule::default() });
        assert!(matches!(Registry::reconcile(maps), Err(RegistryError::Inconsistent(_))));
    }

    #[test]
    fn capture_upsert_replaces_listener_keeping_slot() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let r1 = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15001);
        let r2 = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15002);
        assert_eq!(reg.upsert_capture(&r1, "ctl").unwrap(), Outcome::Created);
        assert!(matches!(reg.insert_capture(&r2, "ctl"), Err(RegistryError::AlreadyExists(_))));
        assert_eq!(reg.upsert_capture(&r2, "ctl").unwrap(), Outcome::Updated);
        assert_eq!(reg.captures()[0].rule, r2);
        let v = reg.maps().captures[&capture_key(&r2)];
        assert_eq!(v.listener_port, 15002);
        reg.remove_capture(&r1, None).unwrap(); // same key
        assert!(reg.captures().is_empty());
    }

    #[test]
    fn owners_guard_changes_and_survive_reconcile() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        reg.insert_pair(&a, "istio").unwrap();
        let e = reg.upsert_pair(&a, "linkerd").unwrap_err();
        assert!(matches!(e, RegistryError::OwnerMismatch { .. }), "{e}");
        assert!(matches!(reg.remove_pair(&a, Some("linkerd")), Err(RegistryError::OwnerMismatch { .. })));
        assert!(matches!(
            reg.insert_pair(&pair("198.18.0.2", "198.18.0.3", 81), &"x".repeat(64)),
            Err(RegistryError::InvalidOwner(_))
        ));
        let reg2 = Registry::reconcile(reg.maps).unwrap();
        assert_eq!(reg2.get_pair(&a).unwrap().owner, "istio");
    }

    #[test]
    fn reconciled_registry_never_reuses_a_live_slot() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let ps: Vec<_> = (1..=3).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        for p in &ps {
            reg.insert_pair(p, "ctl").unwrap();
        }
        reg.remove_pair(&ps[0], None).unwrap(); // frees slot 0
        let mut reg = Registry::reconcile(reg.maps).unwrap();
        reg.insert_pair(&pair("198.18.0.2", "198.18.0.3", 10), "ctl").unwrap();
        reg.insert_pair(&pair("198.18.0.2", "198.18.0.3", 11), "ctl").unwrap();
        let mut ids: Vec<u32> = reg.maps().pairs.values().map(|r| r.id).collect();
        ids.sort();
        assert_eq!(ids, vec![0, 1, 2, 3], "slot 0 reused, slots 1 and 2 kept, 3 fresh");
        assert!(matches!(
            reg.insert_pair(&pair("198.18.0.2", "198.18.0.3", 12), "ctl"),
            Err(RegistryError::Full { .. })
        ));
    }

    #[test]
    fn batches_are_all_or_nothing() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let ps: Vec<_> = (1..=3).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        let other = pair("198.18.0.9", "198.18.0.3", 80);
        reg.insert_pair(&other, "someone-else").unwrap();
        // One entry of another owner: nothing of the batch is written.
        let mut bad = ps.clone();
        bad.push(other);
        assert!(matches!(reg.batch_upsert_pairs(&bad, "ctl"), Err(RegistryError::OwnerMismatch { .. })));
        assert_eq!(reg.pairs().len(), 1);
        // A key twice.
        let dup = vec![ps[0], ps[0]];
        assert!(matches!(reg.batch_upsert_pairs(&dup, "ctl"), Err(RegistryError::DuplicateInBatch(_))));
        // More than fits.
        let many: Vec<_> = (1..=4).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        assert!(matches!(reg.batch_upsert_pairs(&many, "ctl"), Err(RegistryError::Full { .. })));
        assert_eq!(reg.pairs().len(), 1);
        // A map write failing half-way rolls back what was written.
        reg.maps.fail_write_in = Some(3);
        assert!(reg.batch_upsert_pairs(&ps, "ctl").is_err());
        assert_eq!(reg.pairs().len(), 1);
        assert_eq!(reg.maps().pairs.len(), 1);
        // And the happy path.
        let out = reg.batch_upsert_pairs(&ps, "ctl").unwrap();
        assert_eq!(out, vec![Outcome::Created; 3]);
        assert_eq!(reg.batch_upsert_pairs(&ps, "ctl").unwrap(), vec![Outcome::Unchanged; 3]);
        // Deletes: a missing one fails the batch unless allowed.
        let gone = pair("198.18.0.2", "198.18.0.3", 99);
        let mut del = ps.clone();
        del.push(gone);
        assert!(matches!(reg.batch_remove_pairs(&del, "ctl", false), Err(RegistryError::NotFound(_))));
        assert_eq!(reg.pairs().len(), 4);
        assert_eq!(reg.batch_remove_pairs(&del, "ctl", true).unwrap(), vec![true, true, true, false]);
        assert_eq!(reg.pairs().len(), 1);
    }

    #[test]
    fn never_redirect_into_is_in_the_value_not_the_key() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let p = pair("198.18.0.2", "198.18.0.3", 80);
        reg.insert_pair(&p, "ctl").unwrap();
        let q = p.never_redirect_into(NeverRedirectInto { client: false, server: true });
        assert_eq!(reg.upsert_pair(&q, "ctl").unwrap(), Outcome::Updated);
        assert_eq!(reg.pairs().len(), 1);
        assert!(reg.get_pair(&p).unwrap().rule.never_into().server);
        assert_eq!(reg.maps().pairs.values().next().unwrap().flags, RULE_NO_TARGET_SERVER);
        let again = Registry::reconcile(std::mem::take(&mut reg.maps)).unwrap();
        assert_eq!(again.pairs()[0].rule, q, "read back from the maps");
    }

    fn any_ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<u32>().prop_map(|v| IpAddr::V4(Ipv4Addr::from(v))),
            any::<u128>().prop_map(|v| IpAddr::V6(Ipv6Addr::from(v))),
        ]
    }

    proptest! {
        /// Rules survive the round trip through their map form.
        #[test]
        fn pair_keys_round_trip(a in any_ip(), b in any_ip(), p in 1u16.., c: bool, s: bool) {
            if let Ok(pair) = EndpointPair::new(a, Endpoint::new(b, p)) {
                let pair = pair.never_redirect_into(NeverRedirectInto { client: c, server: s });
                prop_assert_eq!(pair_from_entry(&pair_key(&pair), &pair_value(&pair, 3)).unwrap(), pair);
                prop_assert_eq!(pair_key(&pair).server_port, u32::from(p));
            }
        }
    }
}
