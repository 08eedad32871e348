//! The registry of socket rules: which endpoint pairs and capture rules are
//! installed, and how each is keyed and written to the socket maps. Owners,
//! counter slots and batches are the generic [`crate::table`]'s.
//!
//! Its state is derived from the maps themselves ([`Registry::reconcile`]), so
//! an agent that adopts a pinned data path knows exactly what is installed.

use std::collections::BTreeMap;
use std::net::IpAddr;

use meshwarp_bpf::shared::{
    ip_from_raw, raw_addr, CaptureKey, PairKey, Rule, RULE_MODE_ALWAYS, RULE_MODE_NEVER, RULE_NO_TARGET_CLIENT,
    RULE_NO_TARGET_SERVER,
};

use crate::endpoint::{CaptureRule, Endpoint, EndpointPair, FastPathMode, NeverRedirectInto};
use crate::maps::{MapError, RuleMaps};
use crate::stats::{GlobalCounters, RuleCounters};
use crate::table::{self, Outcome, Registered, Replaced, RuleError, Slots, Stored, Table};

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

fn port(raw: u32, what: &str) -> Result<u16, RuleError> {
    u16::try_from(raw).map_err(|_| RuleError::Inconsistent(format!("{what} port {raw}")))
}

fn ip(raw: [u32; 4], family: u32, what: &str) -> Result<IpAddr, RuleError> {
    ip_from_raw(raw, family).ok_or_else(|| RuleError::Inconsistent(format!("{what} family {family}")))
}

/// A map entry that is no valid rule (written by another build, or damaged).
fn unreadable(e: crate::endpoint::ValidationError) -> RuleError {
    RuleError::Inconsistent(e.to_string())
}

/// Reads a mirror pair back from its map entry.
pub fn pair_from_entry(k: &PairKey, v: &Rule) -> Result<EndpointPair, RuleError> {
    let server = Endpoint::new(ip(k.server_ip, k.family, "pair server")?, port(k.server_port, "pair server")?);
    Ok(EndpointPair::new(ip(k.client_ip, k.family, "pair client")?, server)
        .map_err(unreadable)?
        .never_redirect_into(never_into(v.flags))
        .with_mode(mode_of(v.flags)))
}

/// Reads a capture rule back from its map entry.
pub fn capture_from_entry(k: &CaptureKey, v: &Rule) -> Result<CaptureRule, RuleError> {
    let client = if k.client_ip == [0; 4] { None } else { Some(ip(k.client_ip, k.family, "capture client")?) };
    let dst = Endpoint::new(ip(k.dst_ip, k.family, "capture dst")?, port(k.dst_port, "capture dst")?);
    let listener = Endpoint::new(ip(v.listener_ip, k.family, "capture listener")?, port(v.listener_port, "listener")?);
    Ok(CaptureRule::new(client, dst, listener)
        .map_err(unreadable)?
        .never_redirect_into(never_into(v.flags))
        .with_mode(mode_of(v.flags)))
}

/// A rule of either kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleRef {
    Pair(EndpointPair),
    Capture(CaptureRule),
}

impl table::Rule for EndpointPair {
    type Key = (IpAddr, Endpoint);
    const WHAT: &'static str = "pair";
    fn rule_key(&self) -> Self::Key {
        self.key()
    }
}

impl<M: RuleMaps> Stored<M> for EndpointPair {
    fn write(&self, maps: &mut M, id: u32) -> Result<(), MapError> {
        maps.put_pair(&pair_key(self), &pair_value(self, id))
    }
    fn erase(&self, maps: &mut M) -> Result<(), MapError> {
        maps.delete_pair(&pair_key(self))
    }
}

impl table::Rule for CaptureRule {
    type Key = (Option<IpAddr>, Endpoint);
    const WHAT: &'static str = "capture rule";
    fn rule_key(&self) -> Self::Key {
        self.key()
    }
}

impl<M: RuleMaps> Stored<M> for CaptureRule {
    fn write(&self, maps: &mut M, id: u32) -> Result<(), MapError> {
        maps.put_capture(&capture_key(self), &capture_value(self, id))
    }
    fn erase(&self, maps: &mut M) -> Result<(), MapError> {
        maps.delete_capture(&capture_key(self))
    }
}

/// A socket rule kind: pairs and capture rules, which share the registry's
/// counter slots. Every registry operation is written once, for both.
pub trait SockRule: table::Rule + Copy {
    fn table<M>(reg: &Registry<M>) -> &Table<Self>;
    /// The kind's table with the maps and slots it writes through.
    fn parts<M>(reg: &mut Registry<M>) -> (&mut Table<Self>, &mut M, &mut Slots);
}

impl SockRule for EndpointPair {
    fn table<M>(reg: &Registry<M>) -> &Table<Self> {
        &reg.pairs
    }
    fn parts<M>(reg: &mut Registry<M>) -> (&mut Table<Self>, &mut M, &mut Slots) {
        (&mut reg.pairs, &mut reg.maps, &mut reg.slots)
    }
}

impl SockRule for CaptureRule {
    fn table<M>(reg: &Registry<M>) -> &Table<Self> {
        &reg.captures
    }
    fn parts<M>(reg: &mut Registry<M>) -> (&mut Table<Self>, &mut M, &mut Slots) {
        (&mut reg.captures, &mut reg.maps, &mut reg.slots)
    }
}

/// Socket rules installed in one data path, their owners and counter slots.
#[derive(Debug)]
pub struct Registry<M> {
    maps: M,
    slots: Slots,
    pairs: Table<EndpointPair>,
    captures: Table<CaptureRule>,
}

impl<M: RuleMaps> Registry<M> {
    /// Builds the registry from what the maps hold (adoption after a restart).
    pub fn reconcile(maps: M) -> Result<Self, RuleError> {
        let capacity = maps.slot_capacity();
        let owners: BTreeMap<u32, String> = maps.owners()?.into_iter().map(|(id, o)| (id, o.as_string())).collect();
        let owner = |id: u32| owners.get(&id).cloned().unwrap_or_default();
        let mut slots = Slots::default();
        let mut pairs = Table::default();
        for (k, v) in maps.pairs()? {
            pairs.adopt(&mut slots, capacity, pair_from_entry(&k, &v)?, v.id, owner(v.id))?;
        }
        let mut captures = Table::default();
        for (k, v) in maps.captures()? {
            captures.adopt(&mut slots, capacity, capture_from_entry(&k, &v)?, v.id, owner(v.id))?;
        }
        slots.rebuild_free();
        Ok(Self { maps, slots, pairs, captures })
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// Writes the server ports the rules name (`mw_ports`) from the rule
    /// maps and keeps them from now on (at every open, around the upgrade
    /// step: see `Dataplane::open`).
    pub fn sync_ports(&mut self) -> Result<(), RuleError> {
        Ok(self.maps.sync_ports()?)
    }

    /// Rules of both kinds in use, and the capacity they share.
    pub fn usage(&self) -> (usize, u32) {
        (self.slots.used(), self.maps.slot_capacity())
    }

    /// Registers a new rule; [`RuleError::AlreadyExists`] if one has its key.
    pub fn insert<R: SockRule + Stored<M>>(&mut self, rule: &R, owner: &str) -> Result<(), RuleError> {
        let (table, maps, slots) = R::parts(self);
        table.create(maps, slots, rule, owner)
    }

    /// Creates the rule unless present; an existing rule of another owner is
    /// [`RuleError::OwnerMismatch`]; a capture rule with the same key gets the
    /// new listener (keeping its counters).
    pub fn upsert<R: SockRule + Stored<M>>(&mut self, rule: &R, owner: &str) -> Result<Outcome, RuleError> {
        let (table, maps, slots) = R::parts(self);
        table.upsert(maps, slots, rule, owner)
    }

    /// Removes the rule with `rule`'s key (checking the owner when given): new
    /// connections take the normal path. Connections it already accelerates
    /// stay accelerated until they close, because removing a socket from the
    /// SOCKMAP would drop bytes queued for its reader.
    pub fn remove<R: SockRule + Stored<M>>(&mut self, rule: &R, owner: Option<&str>) -> Result<(), RuleError> {
        let (table, maps, slots) = R::parts(self);
        table.delete(maps, slots, rule, owner).map(|_| ())
    }

    pub fn get<R: SockRule>(&self, rule: &R) -> Result<Registered<R>, RuleError> {
        Ok(R::table(self).get(rule)?.registered())
    }

    /// Every rule of kind `R`.
    pub fn list<R: SockRule>(&self) -> Vec<Registered<R>> {
        R::table(self).list()
    }

    pub fn pairs(&self) -> Vec<Registered<EndpointPair>> {
        self.list()
    }

    pub fn captures(&self) -> Vec<Registered<CaptureRule>> {
        self.list()
    }

    /// Counters of the rule with `rule`'s key.
    pub fn stats<R: SockRule>(&self, rule: &R) -> Result<RuleCounters, RuleError> {
        Ok(self.maps.rule_stats(R::table(self).get(rule)?.id)?.into())
    }

    /// The id (counter slot) the data path knows the rule with `rule`'s key by:
    /// what its latency histograms and connections are keyed with.
    pub fn id_of<R: SockRule>(&self, rule: &R) -> Result<u32, RuleError> {
        Ok(R::table(self).get(rule)?.id)
    }

    /// The rule that owns counter slot `id` (what the data path reports), and its owner.
    pub fn rule_by_id(&self, id: u32) -> Option<(RuleRef, String)> {
        let pair = self.pairs.entries().find(|e| e.id == id).map(|e| (RuleRef::Pair(e.rule), e.owner.clone()));
        pair.or_else(|| {
            self.captures.entries().find(|e| e.id == id).map(|e| (RuleRef::Capture(e.rule), e.owner.clone()))
        })
    }

    /// All-or-nothing upsert of many rules for one owner.
    pub fn batch_upsert<R: SockRule + Stored<M>>(
        &mut self,
        rules: &[R],
        owner: &str,
    ) -> Result<Vec<Outcome>, RuleError> {
        let (table, maps, slots) = R::parts(self);
        table.batch_upsert(maps, slots, rules, owner)
    }

    /// All-or-nothing removal of many rules of one owner; with
    /// `allow_missing` absent ones are skipped. Says which were removed.
    pub fn batch_remove<R: SockRule + Stored<M>>(
        &mut self,
        rules: &[R],
        owner: &str,
        allow_missing: bool,
    ) -> Result<Vec<bool>, RuleError> {
        let (table, maps, slots) = R::parts(self);
        Ok(table.batch_delete(maps, slots, rules, owner, allow_missing)?.iter().map(Option::is_some).collect())
    }

    pub fn global_stats(&self) -> Result<GlobalCounters, RuleError> {
        Ok(self.maps.global_stats()?)
    }

    /// Makes everything `owner` registered here exactly `pairs` and
    /// `captures` (a controller's full desired state): rules it left out are
    /// removed, new ones created, changed ones updated, in one step — all or
    /// nothing, across both kinds.
    pub fn replace_owner(
        &mut self,
        owner: &str,
        pairs: &[EndpointPair],
        captures: &[CaptureRule],
    ) -> Result<OwnerSync, RuleError> {
        let done = self.begin_replace_owner(owner, pairs, captures)?;
        self.commit_owner(&done);
        Ok(done)
    }

    /// [`Registry::replace_owner`] as the first step of a larger change (a
    /// sync that also replaces routes): the removed rules keep their slots
    /// and counters until [`Registry::commit_owner`], or come back whole with
    /// [`Registry::revert_owner`]; one of the two must follow.
    pub fn begin_replace_owner(
        &mut self,
        owner: &str,
        pairs: &[EndpointPair],
        captures: &[CaptureRule],
    ) -> Result<OwnerSync, RuleError> {
        let (stale_p, new_p) = self.pairs.plan_replace(pairs, owner)?;
        let (stale_c, new_c) = self.captures.plan_replace(captures, owner)?;
        // Removed rules keep their slots until the whole sync commits (an
        // undo gives them back their counters): new rules need room beside them.
        self.slots.room_for(new_p + new_c, self.maps.slot_capacity())?;
        let mut done = OwnerSync {
            pairs: self.pairs.remove_stale(&mut self.maps, &mut self.slots, &stale_p, owner)?,
            captures: Replaced::default(),
        };
        let rest = (|| {
            done.captures = self.captures.remove_stale(&mut self.maps, &mut self.slots, &stale_c, owner)?;
            self.pairs.upsert_desired(&mut self.maps, &mut self.slots, pairs, owner, &mut done.pairs)?;
            self.captures.upsert_desired(&mut self.maps, &mut self.slots, captures, owner, &mut done.captures)
        })();
        match rest {
            Ok(()) => Ok(done),
            Err(e) => {
                self.revert_owner(done);
                Err(e)
            }
        }
    }

    /// Ends a [`Registry::begin_replace_owner`] that will not be undone
    /// (every family of the sync succeeded): the removed rules' slots become free.
    pub fn commit_owner(&mut self, done: &OwnerSync) {
        Table::commit(&mut self.slots, &done.pairs);
        Table::commit(&mut self.slots, &done.captures);
    }

    /// Puts back what [`Registry::begin_replace_owner`] changed (a later step
    /// of the same sync, in another family, failed).
    pub fn revert_owner(&mut self, done: OwnerSync) {
        let (maps, slots) = (&mut self.maps, &mut self.slots);
        self.captures.undo_created(maps, slots, &done.captures);
        self.pairs.undo_created(maps, slots, &done.pairs);
        self.captures.undo_updated(maps, slots, &done.captures);
        self.pairs.undo_updated(maps, slots, &done.pairs);
        self.captures.undo_deleted(maps, slots, done.captures);
        self.pairs.undo_deleted(maps, slots, done.pairs);
    }
}

/// What [`Registry::replace_owner`] changed, per kind.
#[derive(Debug, Clone, Default)]
pub struct OwnerSync {
    pub pairs: Replaced<EndpointPair>,
    pub captures: Replaced<CaptureRule>,
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
    fn replace_owner_makes_an_owners_rules_the_desired_set() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(6)).unwrap();
        let (a, b, c) = (
            pair("198.18.0.2", "198.18.0.3", 80),
            pair("198.18.0.2", "198.18.0.3", 81),
            pair("198.18.0.2", "198.18.0.3", 82),
        );
        let cap = capture(None, "10.96.0.10", "127.0.0.1", 15001);
        let theirs = pair("198.18.0.9", "198.18.0.3", 80);
        reg.insert(&a, "ctl").unwrap();
        reg.insert(&b, "ctl").unwrap();
        reg.insert(&cap, "ctl").unwrap();
        reg.insert(&theirs, "other").unwrap();
        let moved = capture(None, "10.96.0.10", "127.0.0.1", 15006);
        let done = reg.replace_owner("ctl", &[b, c], &[moved]).unwrap();
        assert_eq!(done.pairs.created, vec![c]);
        assert_eq!(done.pairs.deleted.iter().map(|e| e.rule).collect::<Vec<_>>(), vec![a]);
        assert_eq!(done.pairs.unchanged, 1);
        assert_eq!(done.captures.updated, vec![(moved, cap)]);
        let mine = |reg: &Registry<MemoryMaps>| {
            reg.pairs().into_iter().filter(|r| r.owner == "ctl").map(|r| r.rule).collect::<Vec<_>>()
        };
        assert_eq!(mine(&reg), vec![b, c]);
        assert_eq!(reg.get(&theirs).unwrap().owner, "other", "another owner's rule is left alone");
        // The same set again changes nothing; an empty set removes everything of the owner.
        let again = reg.replace_owner("ctl", &[b, c], &[moved]).unwrap();
        assert!(again.pairs.is_empty() && again.captures.is_empty());
        let gone = reg.replace_owner("ctl", &[], &[]).unwrap();
        assert_eq!((gone.pairs.deleted.len(), gone.captures.deleted.len()), (2, 1));
        assert_eq!(reg.pairs().len(), 1);
    }

    #[test]
    fn replace_owner_is_all_or_nothing_and_reverts() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(6)).unwrap();
        let p = |port| pair("198.18.0.2", "198.18.0.3", port);
        reg.insert(&p(80), "ctl").unwrap();
        reg.insert(&p(81), "ctl").unwrap();
        reg.insert(&p(90), "other").unwrap();
        let before = snapshot(&reg);
        // Another owner's rule in the set, a key twice, more than fits: refused, nothing changed.
        assert!(matches!(reg.replace_owner("ctl", &[p(90)], &[]), Err(RuleError::OwnerMismatch { .. })));
        assert!(matches!(reg.replace_owner("ctl", &[p(82), p(82)], &[]), Err(RuleError::DuplicateInBatch(_))));
        // The removed rules keep their slots until the sync commits: 4 new
        // beside 3 held do not fit in 6.
        assert!(matches!(reg.replace_owner("ctl", &[p(1), p(2), p(3), p(4)], &[]), Err(RuleError::Full { .. })));
        assert_eq!(snapshot(&reg), before);
        reg.replace_owner("ctl", &[p(1), p(2), p(3)], &[]).unwrap();
        assert_eq!(reg.pairs().len(), 4);
        // Every rule has counted traffic: an undo must give each its own counters back.
        let ids: Vec<u32> = reg.pairs().iter().map(|r| reg.id_of(&r.rule).unwrap()).collect();
        for (i, id) in ids.iter().enumerate() {
            reg.maps.stats.insert(*id, RuleStats { msgs: 100 + i as u64, ..RuleStats::default() });
        }
        // A map write or delete failing half-way puts everything back, slots,
        // owners and counters too.
        let before = snapshot(&reg);
        let want = |reg: &mut Registry<MemoryMaps>| {
            reg.begin_replace_owner("ctl", &[p(1), p(5)], &[capture(None, "10.96.0.10", "127.0.0.1", 15001)])
        };
        for (fail_at, delete) in [(1, false), (2, false), (1, true), (2, true)] {
            if delete {
                reg.maps.fail_delete_in = Some(fail_at);
            } else {
                reg.maps.fail_write_in = Some(fail_at);
            }
            let r = want(&mut reg);
            (reg.maps.fail_write_in, reg.maps.fail_delete_in) = (None, None);
            assert!(r.is_err(), "write {fail_at} failed");
            assert_eq!(snapshot(&reg), before, "after a failed write {fail_at}");
            assert_eq!(format!("{:?}", reg.captures()), "[]");
        }
        // A later step elsewhere failed: revert_owner puts a completed replace back.
        let done = want(&mut reg).unwrap();
        reg.revert_owner(done);
        assert_eq!(snapshot(&reg), before);
        // Committed, the removed rules' slots are free again.
        let done = want(&mut reg).unwrap();
        reg.commit_owner(&done);
        assert_eq!(reg.usage().0, 4, "p(1), p(5), the capture rule and the other owner's");
    }

    #[test]
    fn insert_list_remove_pairs() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let b = pair("2001:db8::2", "2001:db8::3", 80);
        reg.insert(&a, "ctl").unwrap();
        reg.insert(&b, "ctl").unwrap();
        assert!(matches!(reg.insert(&a, "ctl"), Err(RuleError::AlreadyExists(_))));
        assert_eq!(reg.upsert(&a, "ctl").unwrap(), Outcome::Unchanged);
        assert_eq!(reg.pairs().len(), 2);
        reg.remove(&a, None).unwrap();
        assert!(matches!(reg.remove(&a, None), Err(RuleError::NotFound(_))));
        assert_eq!(reg.pairs().iter().map(|r| r.rule).collect::<Vec<_>>(), vec![b]);
        assert_eq!(reg.maps().pairs.len(), 1);
    }

    #[test]
    fn full_is_typed_and_leaves_entries_intact() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(2)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let b = pair("198.18.0.2", "198.18.0.3", 81);
        let c = pair("198.18.0.2", "198.18.0.3", 82);
        reg.insert(&a, "ctl").unwrap();
        reg.insert(&b, "ctl").unwrap();
        assert!(matches!(reg.insert(&c, "ctl"), Err(RuleError::Full { capacity: 2 })));
        assert_eq!(reg.pairs().iter().map(|r| r.rule).collect::<Vec<_>>(), vec![a, b]);
        assert_eq!(reg.maps().pairs.len(), 2);
        // Freed slots are reused, with zeroed counters.
        reg.remove(&a, None).unwrap();
        reg.insert(&c, "ctl").unwrap();
        assert_eq!(reg.stats(&c).unwrap(), RuleCounters::default());
    }

    #[test]
    fn map_full_from_the_map_is_typed_too() {
        // The hash map is smaller than the id space: its own E2BIG must surface as Full.
        let mut maps = MemoryMaps::with_capacity(4);
        maps.pairs.insert(pair_key(&pair("198.18.0.9", "198.18.0.3", 1)), Rule { id: 0, ..Rule::default() });
        maps.capacity = 1;
        let mut reg = Registry::reconcile(maps).unwrap();
        let err = reg.insert(&pair("198.18.0.2", "198.18.0.3", 80), "ctl").unwrap_err();
        assert!(matches!(err, RuleError::Full { .. }), "{err}");
        assert_eq!(reg.pairs().len(), 1);
    }

    #[test]
    fn reconcile_restores_rules_and_ids() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        let r = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15001);
        let any = capture(None, "198.18.0.3", "198.18.0.3", 15006);
        reg.insert(&a, "ctl").unwrap();
        reg.insert(&r, "ctl").unwrap();
        reg.insert(&any, "ctl").unwrap();
        let mut maps = reg.maps;
        maps.stats.insert(maps.pairs[&pair_key(&a)].id, RuleStats { msgs: 5, ..Default::default() });
        let reg = Registry::reconcile(maps).unwrap();
        assert_eq!(reg.pairs(), vec![Registered { rule: a, owner: "ctl".into() }]);
        let mut caps: Vec<_> = reg.captures().into_iter().map(|r| r.rule).collect();
        caps.sort();
        let mut want = vec![r, any];
        want.sort();
        assert_eq!(caps, want);
        assert_eq!(reg.stats(&a).unwrap().redirected_msgs, 5);
    }

    #[test]
    fn reconcile_refuses_duplicate_slots() {
        let mut maps = MemoryMaps::with_capacity(8);
        maps.pairs.insert(pair_key(&pair("198.18.0.2", "198.18.0.3", 80)), Rule { id: 1, ..Rule::default() });
        maps.pairs.insert(pair_key(&pair("198.18.0.2", "198.18.0.3", 81)), Rule { id: 1, ..Rule::default() });
        assert!(matches!(Registry::reconcile(maps), Err(RuleError::Inconsistent(_))));
    }

    #[test]
    fn capture_upsert_replaces_listener_keeping_slot() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let r1 = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15001);
        let r2 = capture(Some("198.18.0.2"), "198.19.0.10", "127.0.0.1", 15002);
        assert_eq!(reg.upsert(&r1, "ctl").unwrap(), Outcome::Created);
        assert!(matches!(reg.insert(&r2, "ctl"), Err(RuleError::AlreadyExists(_))));
        assert_eq!(reg.upsert(&r2, "ctl").unwrap(), Outcome::Updated);
        assert_eq!(reg.captures()[0].rule, r2);
        let v = reg.maps().captures[&capture_key(&r2)];
        assert_eq!(v.listener_port, 15002);
        reg.remove(&r1, None).unwrap(); // same key
        assert!(reg.captures().is_empty());
    }

    #[test]
    fn owners_guard_changes_and_survive_reconcile() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
        let a = pair("198.18.0.2", "198.18.0.3", 80);
        reg.insert(&a, "istio").unwrap();
        let e = reg.upsert(&a, "linkerd").unwrap_err();
        assert!(matches!(e, RuleError::OwnerMismatch { .. }), "{e}");
        assert!(matches!(reg.remove(&a, Some("linkerd")), Err(RuleError::OwnerMismatch { .. })));
        assert!(matches!(
            reg.insert(&pair("198.18.0.2", "198.18.0.3", 81), &"x".repeat(64)),
            Err(RuleError::InvalidOwner(_))
        ));
        let reg2 = Registry::reconcile(reg.maps).unwrap();
        assert_eq!(reg2.get(&a).unwrap().owner, "istio");
    }

    #[test]
    fn reconciled_registry_never_reuses_a_live_slot() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let ps: Vec<_> = (1..=3).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        for p in &ps {
            reg.insert(p, "ctl").unwrap();
        }
        reg.remove(&ps[0], None).unwrap(); // frees slot 0
        let mut reg = Registry::reconcile(reg.maps).unwrap();
        reg.insert(&pair("198.18.0.2", "198.18.0.3", 10), "ctl").unwrap();
        reg.insert(&pair("198.18.0.2", "198.18.0.3", 11), "ctl").unwrap();
        let mut ids: Vec<u32> = reg.maps().pairs.values().map(|r| r.id).collect();
        ids.sort();
        assert_eq!(ids, vec![0, 1, 2, 3], "slot 0 reused, slots 1 and 2 kept, 3 fresh");
        assert!(matches!(reg.insert(&pair("198.18.0.2", "198.18.0.3", 12), "ctl"), Err(RuleError::Full { .. })));
    }

    #[test]
    fn batches_are_all_or_nothing() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let ps: Vec<_> = (1..=3).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        let other = pair("198.18.0.9", "198.18.0.3", 80);
        reg.insert(&other, "someone-else").unwrap();
        // One entry of another owner: nothing of the batch is written.
        let mut bad = ps.clone();
        bad.push(other);
        assert!(matches!(reg.batch_upsert(&bad, "ctl"), Err(RuleError::OwnerMismatch { .. })));
        assert_eq!(reg.pairs().len(), 1);
        // A key twice.
        let dup = vec![ps[0], ps[0]];
        assert!(matches!(reg.batch_upsert(&dup, "ctl"), Err(RuleError::DuplicateInBatch(_))));
        // More than fits.
        let many: Vec<_> = (1..=4).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        assert!(matches!(reg.batch_upsert(&many, "ctl"), Err(RuleError::Full { .. })));
        assert_eq!(reg.pairs().len(), 1);
        // A map write failing half-way rolls back what was written.
        reg.maps.fail_write_in = Some(3);
        assert!(reg.batch_upsert(&ps, "ctl").is_err());
        assert_eq!(reg.pairs().len(), 1);
        assert_eq!(reg.maps().pairs.len(), 1);
        // And the happy path.
        let out = reg.batch_upsert(&ps, "ctl").unwrap();
        assert_eq!(out, vec![Outcome::Created; 3]);
        assert_eq!(reg.batch_upsert(&ps, "ctl").unwrap(), vec![Outcome::Unchanged; 3]);
        // Deletes: a missing one fails the batch unless allowed.
        let gone = pair("198.18.0.2", "198.18.0.3", 99);
        let mut del = ps.clone();
        del.push(gone);
        assert!(matches!(reg.batch_remove(&del, "ctl", false), Err(RuleError::NotFound(_))));
        assert_eq!(reg.pairs().len(), 4);
        assert_eq!(reg.batch_remove(&del, "ctl", true).unwrap(), vec![true, true, true, false]);
        assert_eq!(reg.pairs().len(), 1);
    }

    #[test]
    fn a_failed_batch_removal_puts_rules_back_with_their_slots_and_counters() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let ps: Vec<_> = (1..=3).map(|p| pair("198.18.0.2", "198.18.0.3", p)).collect();
        reg.batch_upsert(&ps, "ctl").unwrap();
        let before = reg.maps().pairs.clone();
        let id = before[&pair_key(&ps[0])].id;
        reg.maps.stats.insert(id, RuleStats { msgs: 7, ..Default::default() });
        reg.maps.fail_delete_in = Some(3);
        assert!(reg.batch_remove(&ps, "ctl", false).is_err());
        assert_eq!(reg.maps().pairs, before, "same entries, same slots");
        assert_eq!(reg.stats(&ps[0]).unwrap().redirected_msgs, 7, "counters kept");
        assert_eq!(reg.get(&ps[1]).unwrap().owner, "ctl");
        assert_eq!(reg.usage().0, 3);
        // And the slots are not handed out twice afterwards.
        reg.insert(&pair("198.18.0.2", "198.18.0.3", 9), "ctl").unwrap();
        let mut ids: Vec<u32> = reg.maps().pairs.values().map(|r| r.id).collect();
        ids.sort();
        assert_eq!(ids, vec![0, 1, 2, 3]);
    }

    #[test]
    fn never_redirect_into_is_in_the_value_not_the_key() {
        let mut reg = Registry::reconcile(MemoryMaps::with_capacity(4)).unwrap();
        let p = pair("198.18.0.2", "198.18.0.3", 80);
        reg.insert(&p, "ctl").unwrap();
        let q = p.never_redirect_into(NeverRedirectInto { client: false, server: true });
        assert_eq!(reg.upsert(&q, "ctl").unwrap(), Outcome::Updated);
        assert_eq!(reg.pairs().len(), 1);
        assert!(reg.get(&p).unwrap().rule.never_into().server);
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

    /// Everything a batch could change: the maps and what the registry says.
    fn snapshot(reg: &Registry<MemoryMaps>) -> impl PartialEq + std::fmt::Debug {
        fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
            v.sort();
            v
        }
        let m = reg.maps();
        (
            sorted(m.pairs.iter().map(|(k, v)| (k.server_port, k.client_ip, v.id, v.flags)).collect()),
            // Owners of live slots (a free slot's owner entry means nothing).
            sorted(m.pairs.values().map(|r| (r.id, m.owners.get(&r.id).map(|o| o.as_string()))).collect()),
            // Counters of live slots (a free slot's are zeroed when it is given out).
            sorted(m.pairs.values().map(|r| (r.id, m.stats.get(&r.id).map(|s| s.msgs))).collect()),
            reg.pairs(),
            reg.usage(),
        )
    }

    #[derive(Debug, Clone)]
    enum Op {
        Upsert(Vec<u16>, bool),
        Remove(Vec<u16>, bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        let ports = proptest::collection::vec(1u16..12, 1..6);
        prop_oneof![
            (ports.clone(), any::<bool>()).prop_map(|(p, m)| Op::Upsert(p, m)),
            (ports, any::<bool>()).prop_map(|(p, a)| Op::Remove(p, a)),
        ]
    }

    proptest! {
        /// Batches with a map operation failing at any point are all or
        /// nothing: a batch whose write (upsert) or delete (removal) fails
        /// leaves maps and registry exactly as they were (slots, owners and
        /// counters included). When the rollback itself fails too (`undo`),
        /// nothing is promised but that maps and registry still agree (a
        /// registry rebuilt from the maps says the same), as after every batch.
        #[test]
        fn batches_with_injected_failures_are_all_or_nothing(
            ops in proptest::collection::vec((op(), 0u32..8, 0u32..3), 1..24)
        ) {
            let mut reg = Registry::reconcile(MemoryMaps::with_capacity(8)).unwrap();
            for (n, (op, fail_at, undo)) in ops.into_iter().enumerate() {
                // Counters to keep: every live slot has some.
                let ids: Vec<u32> = reg.maps().pairs.values().map(|r| r.id).collect();
                for id in ids {
                    reg.maps.stats.insert(id, RuleStats { msgs: u64::from(id) + 100, ..Default::default() });
                }
                // The forward path's operation fails at `fail_at`; with
                // `undo`, the rollback's first operation of the other kind too.
                let (forward, rollback) = (Some(fail_at).filter(|f| *f > 0), Some(undo).filter(|u| *u > 0));
                (reg.maps.fail_write_in, reg.maps.fail_delete_in) = match op {
                    Op::Upsert(..) => (forward, rollback),
                    Op::Remove(..) => (rollback, forward),
                };
                let before = snapshot(&reg);
                let result = match &op {
                    Op::Upsert(ports, never) => {
                        let never = NeverRedirectInto { client: false, server: *never };
                        let rules: Vec<_> =
                            ports.iter().map(|p| pair("198.18.0.2", "198.18.0.3", *p).never_redirect_into(never)).collect();
                        reg.batch_upsert(&rules, "ctl").map(|_| ())
                    }
                    Op::Remove(ports, allow_missing) => {
                        let rules: Vec<_> = ports.iter().map(|p| pair("198.18.0.2", "198.18.0.3", *p)).collect();
                        reg.batch_remove(&rules, "ctl", *allow_missing).map(|_| ())
                    }
                };
                reg.maps.fail_write_in = None;
                reg.maps.fail_delete_in = None;
                if result.is_err() && undo == 0 {
                    prop_assert_eq!(snapshot(&reg), before, "op {} {:?} failed and changed something", n, op);
                }
                let rebuilt = Registry::reconcile(std::mem::take(&mut reg.maps)).unwrap();
                prop_assert_eq!(rebuilt.pairs(), reg.pairs(), "op {}: the maps and the registry agree", n);
                reg = rebuilt;
            }
        }

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
