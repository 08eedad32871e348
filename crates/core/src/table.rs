//! One rule table for every family that registers rules with owners and
//! counter slots: socket rules (pairs, capture rules) and tc routes.
//!
//! It owns what those families share: the owner of each rule, the counter
//! slot each holds ([`Slots`]), creation, replacement and removal with their
//! map writes, all-or-nothing batches (checked before any write, rolled back
//! on a failed write) and adoption of what the maps already hold. A family
//! says how one of its rules is keyed ([`Rule`]) and written to its maps
//! ([`Stored`]); its maps say how a slot is owned and zeroed
//! ([`SlotMaps`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use meshwarp_bpf::shared::{OwnerName, OWNER_LEN};

use crate::maps::{MapError, SlotMaps};

/// Why a rule operation failed; on error nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    #[error("{0} is already registered")]
    AlreadyExists(String),
    #[error("{0} is not registered")]
    NotFound(String),
    /// No room for another rule: existing entries are intact.
    #[error("rule capacity exhausted ({capacity} rules); nothing was changed")]
    Full { capacity: u32 },
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

impl From<MapError> for RuleError {
    fn from(e: MapError) -> Self {
        match e {
            MapError::Full { capacity, .. } => Self::Full { capacity },
            other => Self::Map(other),
        }
    }
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Created,
    /// The rule existed and its value changed (a capture rule's listener, a
    /// route's action).
    Updated,
    /// The rule existed exactly as given.
    Unchanged,
}

/// A registered rule with its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered<R> {
    pub rule: R,
    pub owner: String,
}

/// A rule a table holds: what identifies it (two rules with one key cover
/// the same traffic) and how it is named in errors.
pub trait Rule: Clone + Eq + fmt::Display {
    type Key: Ord + Clone + fmt::Debug;
    const WHAT: &'static str;
    fn rule_key(&self) -> Self::Key;
}

/// How a rule is written to (and erased from) the maps `M` of its family.
pub trait Stored<M>: Rule {
    fn write(&self, maps: &mut M, id: u32) -> Result<(), MapError>;
    fn erase(&self, maps: &mut M) -> Result<(), MapError>;
}

/// Counter-slot allocation of one family (shared by its tables): the lowest
/// released slot first, else the next never-used one. O(log n) each.
#[derive(Debug, Default)]
pub struct Slots {
    used: BTreeSet<u32>,
    released: BTreeSet<u32>,
    next_fresh: u32,
}

impl Slots {
    fn allocate(&mut self, capacity: u32) -> Option<u32> {
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

    fn release(&mut self, id: u32) {
        if self.used.remove(&id) {
            self.released.insert(id);
        }
    }

    /// Marks `id` in use: a slot found in the maps (adoption), or one given
    /// back by a rollback. False if it already was in use.
    fn claim(&mut self, id: u32) -> bool {
        self.released.remove(&id);
        self.used.insert(id)
    }

    /// Slots in use.
    pub fn used(&self) -> usize {
        self.used.len()
    }

    /// [`RuleError::Full`] unless `new` more rules fit beside the slots in
    /// use (reserved ones included) among `capacity`.
    pub fn room_for(&self, new: usize, capacity: u32) -> Result<(), RuleError> {
        if self.used() + new > capacity as usize {
            return Err(RuleError::Full { capacity });
        }
        Ok(())
    }

    /// After adoption: every slot below the highest used one that is not in
    /// use is free.
    pub fn rebuild_free(&mut self) {
        self.next_fresh = self.used.last().map_or(0, |m| m + 1);
        self.released = (0..self.next_fresh).filter(|i| !self.used.contains(i)).collect();
    }
}

/// One installed rule.
#[derive(Debug, Clone)]
pub struct Entry<R> {
    pub rule: R,
    /// Its counter slot (the `id` the programs count under).
    pub id: u32,
    pub owner: String,
}

impl<R: Clone> Entry<R> {
    pub fn registered(&self) -> Registered<R> {
        Registered { rule: self.rule.clone(), owner: self.owner.clone() }
    }
}

/// The rules of one kind, by key.
#[derive(Debug)]
pub struct Table<R: Rule> {
    entries: BTreeMap<R::Key, Entry<R>>,
}

impl<R: Rule> Default for Table<R> {
    fn default() -> Self {
        Self { entries: BTreeMap::new() }
    }
}

/// The owner as the maps store it, or why it cannot be one.
pub fn owner_name(owner: &str) -> Result<OwnerName, RuleError> {
    OwnerName::new(owner)
        .ok_or_else(|| RuleError::InvalidOwner(format!("{owner:?}: at most {} bytes, no NUL", OWNER_LEN - 1)))
}

impl<R: Rule> Entry<R> {
    /// [`RuleError::OwnerMismatch`] unless `owner` owns this rule.
    pub fn check_owner(&self, owner: &str) -> Result<(), RuleError> {
        if self.owner != owner {
            return Err(RuleError::OwnerMismatch {
                what: format!("{} {}", R::WHAT, self.rule),
                owner: self.owner.clone(),
                requested: owner.to_string(),
            });
        }
        Ok(())
    }
}

impl<R: Rule> Table<R> {
    /// The entry of the rule with `rule`'s key.
    pub fn get(&self, rule: &R) -> Result<&Entry<R>, RuleError> {
        self.get_key(&rule.rule_key()).ok_or_else(|| RuleError::NotFound(format!("{} {rule}", R::WHAT)))
    }

    pub fn get_key(&self, key: &R::Key) -> Option<&Entry<R>> {
        self.entries.get(key)
    }

    pub fn entries(&self) -> impl Iterator<Item = &Entry<R>> {
        self.entries.values()
    }

    pub fn list(&self) -> Vec<Registered<R>> {
        self.entries.values().map(Entry::registered).collect()
    }

    /// Takes in a rule found in the maps with slot `id` (adoption after a
    /// restart); a slot out of range or held twice is [`RuleError::Inconsistent`].
    pub fn adopt(
        &mut self,
        slots: &mut Slots,
        capacity: u32,
        rule: R,
        id: u32,
        owner: String,
    ) -> Result<(), RuleError> {
        if id >= capacity || !slots.claim(id) {
            return Err(RuleError::Inconsistent(format!(
                "{} {rule} holds counter slot {id} twice or out of range",
                R::WHAT
            )));
        }
        self.entries.insert(rule.rule_key(), Entry { rule, id, owner });
        Ok(())
    }

    /// Registers a new rule; [`RuleError::AlreadyExists`] if its key is taken.
    pub fn create<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rule: &R,
        owner: &str,
    ) -> Result<(), RuleError>
    where
        R: Stored<M>,
    {
        if let Some(e) = self.entries.get(&rule.rule_key()) {
            return Err(RuleError::AlreadyExists(format!("{} {} (owner {:?})", R::WHAT, e.rule, e.owner)));
        }
        let name = owner_name(owner)?;
        let capacity = maps.slot_capacity();
        let id = slots.allocate(capacity).ok_or(RuleError::Full { capacity })?;
        let written = maps.reset_slot(id).and_then(|()| maps.put_owner(id, &name)).and_then(|()| rule.write(maps, id));
        if let Err(e) = written {
            let _ = maps.delete_owner(id);
            slots.release(id);
            return Err(e.into());
        }
        self.entries.insert(rule.rule_key(), Entry { rule: rule.clone(), id, owner: owner.to_string() });
        Ok(())
    }

    /// Creates the rule unless its key is taken; replaces the value of a rule
    /// of the same owner (keeping its slot and counters).
    pub fn upsert<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rule: &R,
        owner: &str,
    ) -> Result<Outcome, RuleError>
    where
        R: Stored<M>,
    {
        let Some(e) = self.entries.get_mut(&rule.rule_key()) else {
            self.create(maps, slots, rule, owner)?;
            return Ok(Outcome::Created);
        };
        e.check_owner(owner)?;
        if e.rule == *rule {
            return Ok(Outcome::Unchanged);
        }
        rule.write(maps, e.id)?;
        e.rule = rule.clone();
        Ok(Outcome::Updated)
    }

    /// Removes the rule with `rule`'s key (checking the owner when given) and
    /// returns what was removed.
    pub fn delete<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rule: &R,
        owner: Option<&str>,
    ) -> Result<Entry<R>, RuleError>
    where
        R: Stored<M>,
    {
        let e = self.get(rule)?;
        if let Some(o) = owner {
            e.check_owner(o)?;
        }
        e.rule.erase(maps)?;
        let _ = maps.delete_owner(e.id);
        slots.release(e.id);
        self.entries.remove(&rule.rule_key()).ok_or_else(|| RuleError::NotFound(format!("{} {rule}", R::WHAT)))
    }

    /// Puts a removed entry back with its own slot and counters (rollback).
    fn reinstate<M: SlotMaps>(&mut self, maps: &mut M, slots: &mut Slots, e: Entry<R>) -> Result<(), RuleError>
    where
        R: Stored<M>,
    {
        let name = owner_name(&e.owner)?;
        if !slots.claim(e.id) {
            return Err(RuleError::Inconsistent(format!("counter slot {} of {} {} is taken", e.id, R::WHAT, e.rule)));
        }
        let written = maps.put_owner(e.id, &name).and_then(|()| e.rule.write(maps, e.id));
        if let Err(err) = written {
            let _ = maps.delete_owner(e.id);
            slots.release(e.id);
            return Err(err.into());
        }
        self.entries.insert(e.rule.rule_key(), e);
        Ok(())
    }

    /// Checks a batch before anything is written: no key twice, owners match.
    /// Returns how many rules are new.
    fn precheck(&self, rules: &[R], owner: &str) -> Result<usize, RuleError> {
        owner_name(owner)?;
        let mut seen = BTreeSet::new();
        let mut new = 0;
        for r in rules {
            if !seen.insert(r.rule_key()) {
                return Err(RuleError::DuplicateInBatch(format!("{} {r}", R::WHAT)));
            }
            match self.entries.get(&r.rule_key()) {
                Some(e) => e.check_owner(owner)?,
                None => new += 1,
            }
        }
        Ok(new)
    }

    /// All or nothing: on any failure the rules written so far are restored.
    pub fn batch_upsert<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rules: &[R],
        owner: &str,
    ) -> Result<Vec<Outcome>, RuleError>
    where
        R: Stored<M>,
    {
        let new = self.precheck(rules, owner)?;
        slots.room_for(new, maps.slot_capacity())?;
        let mut done: Vec<(&R, Outcome, Option<R>)> = Vec::with_capacity(rules.len());
        for r in rules {
            let previous = self.entries.get(&r.rule_key()).map(|e| e.rule.clone());
            match self.upsert(maps, slots, r, owner) {
                Ok(o) => done.push((r, o, previous)),
                Err(err) => {
                    for (r, o, prev) in done.into_iter().rev() {
                        let _ = match (o, prev) {
                            (Outcome::Created, _) => self.delete(maps, slots, r, None).map(|_| ()),
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

    /// All or nothing. With `allow_missing`, absent rules are skipped
    /// (`None`); returns what was removed.
    pub fn batch_delete<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        rules: &[R],
        owner: &str,
        allow_missing: bool,
    ) -> Result<Vec<Option<Entry<R>>>, RuleError>
    where
        R: Stored<M>,
    {
        self.precheck(rules, owner)?;
        if !allow_missing {
            for r in rules {
                self.get(r)?;
            }
        }
        let mut deleted = Vec::with_capacity(rules.len());
        for r in rules {
            if self.get(r).is_err() {
                deleted.push(None);
                continue;
            }
            match self.delete(maps, slots, r, Some(owner)) {
                Ok(e) => deleted.push(Some(e)),
                Err(err) => {
                    for e in deleted.into_iter().rev().flatten() {
                        let _ = self.reinstate(maps, slots, e);
                    }
                    return Err(err);
                }
            }
        }
        Ok(deleted)
    }
}

/// What making one owner's rules of a kind equal a desired set changed
/// ([`Table::replace_owner`]), with what it takes to put it back.
#[derive(Debug, Clone)]
pub struct Replaced<R> {
    /// Rules that did not exist.
    pub created: Vec<R>,
    /// Rules whose value changed: (now, before).
    pub updated: Vec<(R, R)>,
    /// The owner's rules not in the desired set, as they were.
    pub deleted: Vec<Entry<R>>,
    pub unchanged: usize,
}

impl<R> Default for Replaced<R> {
    fn default() -> Self {
        Self { created: Vec::new(), updated: Vec::new(), deleted: Vec::new(), unchanged: 0 }
    }
}

impl<R> Replaced<R> {
    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.created.is_empty() && self.updated.is_empty() && self.deleted.is_empty()
    }
}

impl<R: Rule> Table<R> {
    /// The owner's rules a desired set leaves out, and how many of the set
    /// are new; refuses a set naming a key twice or a rule another owner has.
    pub fn plan_replace(&self, desired: &[R], owner: &str) -> Result<(Vec<R>, usize), RuleError> {
        let new = self.precheck(desired, owner)?;
        let keep: BTreeSet<R::Key> = desired.iter().map(Rule::rule_key).collect();
        let stale = self
            .entries
            .values()
            .filter(|e| e.owner == owner && !keep.contains(&e.rule.rule_key()))
            .map(|e| e.rule.clone());
        Ok((stale.collect(), new))
    }

    /// Removes `stale` (from [`Table::plan_replace`]): the first half of a
    /// replace, all or nothing. Their slots stay reserved (neither free nor
    /// zeroed) until [`Table::commit`], so an undo gives each rule back its
    /// own counters.
    pub fn remove_stale<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        stale: &[R],
        owner: &str,
    ) -> Result<Replaced<R>, RuleError>
    where
        R: Stored<M>,
    {
        let deleted: Vec<Entry<R>> =
            self.batch_delete(maps, slots, stale, owner, false)?.into_iter().flatten().collect();
        for e in &deleted {
            slots.claim(e.id);
        }
        Ok(Replaced { deleted, ..Replaced::default() })
    }

    /// Ends a replace that will not be undone: the removed rules' slots
    /// become free.
    pub fn commit(slots: &mut Slots, done: &Replaced<R>) {
        for e in &done.deleted {
            slots.release(e.id);
        }
    }

    /// Upserts `desired` into a replace whose stale rules `done` removed: the
    /// second half, all or nothing (on failure the upserts are undone; the
    /// caller puts `done` back with [`Table::revert`]).
    pub fn upsert_desired<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        desired: &[R],
        owner: &str,
        done: &mut Replaced<R>,
    ) -> Result<(), RuleError>
    where
        R: Stored<M>,
    {
        let before: Vec<Option<R>> =
            desired.iter().map(|r| self.get_key(&r.rule_key()).map(|e| e.rule.clone())).collect();
        let outcomes = self.batch_upsert(maps, slots, desired, owner)?;
        for ((r, o), prev) in desired.iter().zip(outcomes).zip(before) {
            match (o, prev) {
                (Outcome::Created, _) => done.created.push(r.clone()),
                (Outcome::Updated, Some(p)) => done.updated.push((r.clone(), p)),
                _ => done.unchanged += 1,
            }
        }
        Ok(())
    }

    /// Makes `owner`'s rules of this kind exactly `desired`: the ones left out
    /// are removed, new ones created, changed ones updated. All or nothing;
    /// committed when it returns.
    pub fn replace_owner<M: SlotMaps>(
        &mut self,
        maps: &mut M,
        slots: &mut Slots,
        desired: &[R],
        owner: &str,
    ) -> Result<Replaced<R>, RuleError>
    where
        R: Stored<M>,
    {
        let (stale, new) = self.plan_replace(desired, owner)?;
        // The removed rules' slots are reused only after the replace (see
        // remove_stale): the new rules need room beside them.
        slots.room_for(new, maps.slot_capacity())?;
        let mut done = self.remove_stale(maps, slots, &stale, owner)?;
        if let Err(e) = self.upsert_desired(maps, slots, desired, owner, &mut done) {
            self.revert(maps, slots, done);
            return Err(e);
        }
        Self::commit(slots, &done);
        Ok(done)
    }

    /// Puts back what a replace changed (a later step of the same sync
    /// failed): created rules go, updated ones get their old value, deleted
    /// ones return with their slots and counters. Tables sharing slots undo
    /// phase by phase ([`Table::undo_created`], then
    /// [`Table::undo_updated`], then [`Table::undo_deleted`]), so a slot
    /// one kind freed and another took is free again before it is claimed.
    pub fn revert<M: SlotMaps>(&mut self, maps: &mut M, slots: &mut Slots, done: Replaced<R>)
    where
        R: Stored<M>,
    {
        self.undo_created(maps, slots, &done);
        self.undo_updated(maps, slots, &done);
        self.undo_deleted(maps, slots, done);
    }

    pub fn undo_created<M: SlotMaps>(&mut self, maps: &mut M, slots: &mut Slots, done: &Replaced<R>)
    where
        R: Stored<M>,
    {
        for r in done.created.iter().rev() {
            let _ = self.delete(maps, slots, r, None);
        }
    }

    pub fn undo_updated<M: SlotMaps>(&mut self, maps: &mut M, slots: &mut Slots, done: &Replaced<R>)
    where
        R: Stored<M>,
    {
        for (_, before) in done.updated.iter().rev() {
            if let Some(owner) = self.get_key(&before.rule_key()).map(|e| e.owner.clone()) {
                let _ = self.upsert(maps, slots, before, &owner);
            }
        }
    }

    pub fn undo_deleted<M: SlotMaps>(&mut self, maps: &mut M, slots: &mut Slots, done: Replaced<R>)
    where
        R: Stored<M>,
    {
        for e in done.deleted.into_iter().rev() {
            // Its slot was kept for it (remove_stale).
            slots.release(e.id);
            if let Err(err) = self.reinstate(maps, slots, e) {
                tracing::error!("putting back a rule a failed replace removed: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_reuse_the_lowest_released_first() {
        let mut s = Slots::default();
        assert_eq!((s.allocate(3), s.allocate(3), s.allocate(3), s.allocate(3)), (Some(0), Some(1), Some(2), None));
        s.release(1);
        s.release(0);
        assert_eq!(s.allocate(3), Some(0));
        assert!(!s.claim(0), "already in use");
        assert!(s.claim(1));
        assert_eq!(s.used(), 3);
    }

    #[test]
    fn adoption_rebuilds_the_free_list() {
        let mut s = Slots::default();
        assert!(s.claim(4) && s.claim(1));
        s.rebuild_free();
        let got: Vec<_> = (0..4).map_while(|_| s.allocate(6)).collect();
        assert_eq!(got, vec![0, 2, 3, 5]);
    }
}
