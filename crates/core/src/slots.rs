//! Frees SOCKMAP slots the programs could not free themselves.
//!
//! Each accelerated link owns a slot of `mw_slots`; its ends sit in the
//! SOCKMAP at `2 * slot + end`. The programs free a slot when its link goes
//! away, unless an end closed with redirected bytes still unread: that socket
//! stays in the SOCKMAP until its file is closed (dropping it earlier would
//! lose the bytes), and no program runs then. Such slots are marked stale
//! (`MW_EV_SLOT_STALE`); this module frees each once both of its SOCKMAP
//! entries are empty, in `mw_sockmap` and in `mw_tgtmap` (the same positions
//! for targets whose own sends are never redirected). It also picks up the stale slots it finds at start (an
//! event lost to a full ring buffer, or a restart of the agent).

use std::collections::BTreeSet;
use std::path::Path;

use meshwarp_bpf::names;
use meshwarp_bpf::shared::{sockmap_index, Event, Slot, END_CLIENT, END_SERVER, EV_SLOT_STALE};

// SOCKMAP membership, as parking: the same error type.
use crate::maps::TypedMap;
use crate::park::ParkError;

/// The stale slots waiting for their sockets to close.
pub(crate) struct SlotSweeper {
    slots: TypedMap<u32, Slot>,
    sockmaps: [TypedMap<u32, u64>; 2],
    stale: BTreeSet<u32>,
}

impl SlotSweeper {
    pub(crate) fn open(pin_dir: &Path) -> Result<Self, ParkError> {
        let maps = pin_dir.join("maps");
        let slots: TypedMap<u32, Slot> = TypedMap::pinned(&maps, names::MAP_SLOTS)?;
        let sockmaps = [TypedMap::pinned(&maps, names::MAP_SOCKMAP)?, TypedMap::pinned(&maps, names::MAP_TGTMAP)?];
        let mut stale = BTreeSet::new();
        for i in 0..slots.capacity() {
            if slots.get(&i)?.is_some_and(|s| s.stale != 0) {
                stale.insert(i);
            }
        }
        let mut s = Self { slots, sockmaps, stale };
        s.sweep();
        Ok(s)
    }

    /// Takes a stale slot from an event; false if `ev` is not one.
    pub(crate) fn accept(&mut self, ev: &Event) -> bool {
        if ev.kind != EV_SLOT_STALE {
            return false;
        }
        self.stale.insert(ev.slot);
        true
    }

    /// Frees every stale slot whose SOCKMAP entries are both empty.
    pub(crate) fn sweep(&mut self) {
        let stale = std::mem::take(&mut self.stale);
        for slot in stale {
            match self.try_free(slot) {
                Ok(true) => tracing::debug!(slot, "freed a stale SOCKMAP slot"),
                Ok(false) => {
                    self.stale.insert(slot);
                }
                Err(e) => {
                    tracing::warn!(slot, "stale SOCKMAP slot: {e}");
                    self.stale.insert(slot);
                }
            }
        }
    }

    fn try_free(&self, slot: u32) -> Result<bool, ParkError> {
        for end in [END_CLIENT, END_SERVER] {
            let index = sockmap_index(slot, end);
            for map in &self.sockmaps {
                if map.get(&index)?.is_some() {
                    return Ok(false);
                }
            }
        }
        // Only user space writes a stale slot (programs claim free ones only),
        // and its entries can only empty further: no race to lose.
        if self.slots.get(&slot)?.is_none_or(|s| s.stale == 0) {
            return Ok(true);
        }
        self.slots.put(&slot, &Slot::default())?;
        Ok(true)
    }
}
