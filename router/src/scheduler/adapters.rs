//! LoRA adapters: the registry of names and the shards' adapter slots.
//!
//! The scheduler owns both. A request names an adapter when it is
//! submitted and is tied to that adapter (by id: a name unloaded and loaded
//! again is another adapter, with its own prefix cache) until it leaves. Its
//! adapter's weights must be in one of the shards' `max_loras` slots for it
//! to run:
//!
//! ```text
//!  slot      1: adapter 3, running requests use it     -> pinned
//!            2: adapter 5, idle since tick 17          -> may be evicted
//!            3: empty                                  -> taken first
//!  waiting   r9 wants adapter 7 (in no slot)
//!  => before the next step: adapter 7 into slot 3; a fourth adapter would
//!     go into slot 2 (least recently used among those no running request
//!     uses), never into slot 1
//! ```
//!
//! Loading and emptying slots are RPCs; the scheduler makes them between
//! steps (`adapter_work.rs`), so no step ever sees a slot change. This file
//! is the bookkeeping only: which adapter is where, which slot to use, and
//! the catalog of names published to the HTTP side.
//!
//! Invariants (`check_invariants`):
//! - a slot holds at most one adapter, and an adapter is in at most one
//!   slot, the same one both sides record;
//! - every registered name maps to a registered adapter, and back.
//!
//! An adapter is kept while it is registered or a request uses it; one that
//! is neither is dropped at the next point between steps (`collect`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::{oneshot, watch};

use super::radix::Namespace;
use crate::infer::{AdapterCatalog, AdapterError, AdapterInfo, AdapterLoaded, AdapterStats};

/// An adapter's identity for the life of the router; never 0 (the prefix
/// cache's namespace of the base model).
pub(crate) type AdapterId = Namespace;

#[derive(Debug)]
struct Adapter {
    name: String,
    path: String,
    /// Requests may name it (false once unloaded: it stays while in use).
    registered: bool,
    /// The slot (1..=max_loras) its weights are in.
    slot: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    adapter: Option<AdapterId>,
    /// Logical time of its last use (a load, an admission).
    last_used: u64,
}

/// A load command waiting for the point between two steps (adapter_work.rs
/// runs it).
#[derive(Debug)]
pub(crate) struct PendingLoad {
    pub name: String,
    pub path: String,
    pub reply: oneshot::Sender<Result<AdapterLoaded, AdapterError>>,
}

pub(crate) struct Adapters {
    slots: Vec<Slot>,
    adapters: HashMap<AdapterId, Adapter>,
    by_name: BTreeMap<String, AdapterId>,
    next_id: AdapterId,
    clock: u64,
    catalog: watch::Sender<Arc<Vec<AdapterInfo>>>,
    loads: u64,
    evictions: u64,
}

impl Adapters {
    pub fn new(max_loras: u32) -> Self {
        Self {
            slots: vec![Slot::default(); max_loras as usize],
            adapters: HashMap::new(),
            by_name: BTreeMap::new(),
            next_id: 1,
            clock: 0,
            catalog: watch::channel(Arc::new(Vec::new())).0,
            loads: 0,
            evictions: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        !self.slots.is_empty()
    }

    /// The names requests may use, kept current.
    pub fn catalog(&self) -> AdapterCatalog {
        self.catalog.subscribe()
    }

    fn publish(&self) {
        let list = self
            .by_name
            .iter()
            .map(|(name, id)| AdapterInfo { name: name.clone(), path: self.adapters[id].path.clone() })
            .collect();
        self.catalog.send_replace(Arc::new(list));
    }

    /// Registered names, in order (for error messages).
    pub fn names(&self) -> Vec<String> {
        self.by_name.keys().cloned().collect()
    }

    /// The adapter a new request named.
    pub fn resolve(&self, name: &str) -> Result<AdapterId, AdapterError> {
        self.by_name.get(name).copied().ok_or_else(|| AdapterError::Unknown { name: name.into(), known: self.names() })
    }

    pub fn is_registered(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    pub fn name(&self, id: AdapterId) -> &str {
        &self.adapters[&id].name
    }

    pub fn path(&self, id: AdapterId) -> &str {
        &self.adapters[&id].path
    }

    pub fn slot_of(&self, id: AdapterId) -> Option<u32> {
        self.adapters.get(&id).and_then(|a| a.slot)
    }

    /// Marks `id`'s slot used now (an admission): it is evicted last.
    pub fn touch(&mut self, id: AdapterId) {
        if let Some(slot) = self.slot_of(id) {
            self.clock += 1;
            self.slots[slot as usize - 1].last_used = self.clock;
        }
    }

    /// The slot to load a new adapter into: a free one, else the least
    /// recently used one that holds no adapter in `pinned` (used by running
    /// requests), preferring adapters no waiting request wants (`wanted`).
    /// None when every slot is pinned.
    pub fn pick_slot(&self, pinned: &HashSet<AdapterId>, wanted: &HashSet<AdapterId>) -> Option<u32> {
        if let Some(free) = self.slots.iter().position(|s| s.adapter.is_none()) {
            return Some(free as u32 + 1);
        }
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.adapter.is_some_and(|a| !pinned.contains(&a)))
            .min_by_key(|(_, s)| (s.adapter.is_some_and(|a| wanted.contains(&a)), s.last_used))
            .map(|(i, _)| i as u32 + 1)
    }

    /// Takes `slot` away from the adapter in it, if any (the RPC that
    /// replaces or empties it follows).
    pub fn vacate(&mut self, slot: u32) {
        if let Some(previous) = self.slots[slot as usize - 1].adapter.take() {
            self.adapters.get_mut(&previous).expect("a slot's adapter is held").slot = None;
            self.evictions += 1;
            crate::metrics::adapter_evicted();
        }
    }

    /// Records that `id`'s weights are now in `slot` (vacated before).
    pub fn placed(&mut self, id: AdapterId, slot: u32) {
        debug_assert!(self.slots[slot as usize - 1].adapter.is_none(), "slot {slot} was not vacated");
        self.clock += 1;
        self.slots[slot as usize - 1] = Slot { adapter: Some(id), last_used: self.clock };
        self.adapters.get_mut(&id).expect("placing a held adapter").slot = Some(slot);
        self.loads += 1;
    }

    /// Registers a new adapter under `name` (checked to be free).
    pub fn register(&mut self, name: String, path: String) -> AdapterId {
        let id = self.next_id;
        self.next_id += 1;
        self.by_name.insert(name.clone(), id);
        self.adapters.insert(id, Adapter { name, path, registered: true, slot: None });
        self.publish();
        id
    }

    /// Forgets `name`: new requests cannot use it; the adapter itself stays
    /// while requests use it (`collect`).
    pub fn unregister(&mut self, name: &str) -> Result<(), AdapterError> {
        let id = self.resolve(name)?;
        self.retire(id);
        Ok(())
    }

    /// Takes adapter `id`'s name away, if it still has it.
    pub fn retire(&mut self, id: AdapterId) {
        let Some(adapter) = self.adapters.get_mut(&id).filter(|a| a.registered) else { return };
        adapter.registered = false;
        self.by_name.remove(&adapter.name);
        self.publish();
    }

    /// Drops the adapters that are no longer registered and that no request
    /// in `used` needs; returns the slots they leave (to empty on the shards).
    pub fn collect(&mut self, used: &HashSet<AdapterId>) -> Vec<u32> {
        let gone: Vec<AdapterId> =
            self.adapters.iter().filter(|(id, a)| !a.registered && !used.contains(id)).map(|(&id, _)| id).collect();
        let mut freed = Vec::new();
        for id in gone {
            if let Some(slot) = self.adapters.remove(&id).and_then(|a| a.slot) {
                self.slots[slot as usize - 1].adapter = None;
                freed.push(slot);
            }
        }
        freed
    }

    pub fn stats(&self) -> AdapterStats {
        AdapterStats {
            slots: self.slots.len() as u32,
            loaded: self.slots.iter().filter(|s| s.adapter.is_some()).count() as u32,
            registered: self.by_name.len(),
            held: self.adapters.len(),
            loads: self.loads,
            evictions: self.evictions,
        }
    }

    /// The slots the adapters in `ids` are in.
    pub fn slots_of<'a>(&'a self, ids: impl Iterator<Item = AdapterId> + 'a) -> impl Iterator<Item = u32> + 'a {
        ids.filter_map(|id| self.slot_of(id))
    }

    /// Panics with the first broken invariant (see the module comment).
    /// `used`: the adapters of every waiting and running request.
    pub fn check_invariants(&self, used: &HashSet<AdapterId>) {
        for (i, slot) in self.slots.iter().enumerate() {
            if let Some(id) = slot.adapter {
                let adapter = self.adapters.get(&id).unwrap_or_else(|| panic!("slot {} holds a dropped adapter", i + 1));
                assert_eq!(adapter.slot, Some(i as u32 + 1), "adapter {id} and slot {} disagree", i + 1);
            }
        }
        for (&id, adapter) in &self.adapters {
            if let Some(slot) = adapter.slot {
                assert_eq!(self.slots[slot as usize - 1].adapter, Some(id), "adapter {id} is not in its slot {slot}");
            }
            assert_eq!(adapter.registered, self.by_name.get(&adapter.name) == Some(&id), "adapter {id}: name map");
        }
        for id in used {
            assert!(self.adapters.contains_key(id), "a request uses adapter {id}, which was dropped");
        }
        assert!(self.by_name.values().all(|id| self.adapters.contains_key(id)), "a name maps to no adapter");
    }
}
