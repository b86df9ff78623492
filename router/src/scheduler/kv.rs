//! The scheduler's view of the KV cache: the allocator plus, with prefix
//! caching on, the radix tree. Allocation evicts cached blocks before it
//! gives up.
//!
//! A request's blocks are its [`BlockTable`], and they go back by ownership:
//! dropping (or clearing) the table returns every block it holds, whatever
//! path the request leaves by (finished, cancelled, failed, preempted, not
//! admitted after all), so no exit path can leak one. Caching a request's
//! full blocks in the tree is the separate, explicit decision
//! [`KvCache::cache_full_blocks`] (the tree takes its own references).
//!
//! ```text
//!  drop(table) ──► returns (shared list) ──► reclaim(): one release per block,
//!                                            first thing in every KvCache call
//!                                            that allocates, caches or counts
//! ```

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use super::blocks::{BlockAllocator, BlockId};
use super::radix::{Namespace, RadixTree};

/// Blocks given back by dropped or cleared tables, not yet released.
type Returns = Arc<Mutex<Vec<BlockId>>>;

/// One request's blocks, in order: block i holds the KV of its tokens
/// `[i * block_size, (i + 1) * block_size)`. Each holds one reference, given
/// back when the table is dropped or cleared. Filled only by the
/// [`KvCache`] that made it.
pub(crate) struct BlockTable {
    blocks: Vec<BlockId>,
    returns: Returns,
}

impl BlockTable {
    /// Gives every block back (the table stays usable, empty).
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `len` blocks and gives the rest back.
    pub fn truncate(&mut self, len: usize) {
        if self.blocks.len() > len {
            let mut tail = self.blocks.split_off(len);
            self.returns.lock().unwrap_or_else(|e| e.into_inner()).append(&mut tail);
        }
    }
}

impl Deref for BlockTable {
    type Target = [BlockId];

    fn deref(&self) -> &[BlockId] {
        &self.blocks
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.clear();
    }
}

pub(crate) struct KvCache {
    alloc: BlockAllocator,
    /// `None` with prefix caching off: no tree at all.
    tree: Option<RadixTree>,
    block_size: usize,
    returns: Returns,
    pub evicted: u64,
}

impl KvCache {
    pub fn new(num_blocks: u32, block_size: u32, prefix_caching: bool) -> Self {
        Self {
            alloc: BlockAllocator::new(num_blocks),
            tree: prefix_caching.then(|| RadixTree::new(block_size)),
            block_size: block_size as usize,
            returns: Returns::default(),
            evicted: 0,
        }
    }

    /// An empty table whose blocks will come back to this cache.
    pub fn new_table(&self) -> BlockTable {
        BlockTable { blocks: Vec::new(), returns: self.returns.clone() }
    }

    /// Releases the blocks of dropped or cleared tables. Counts read after
    /// it are exact.
    pub fn reclaim(&mut self) {
        let returned = std::mem::take(&mut *self.returns.lock().unwrap_or_else(|e| e.into_inner()));
        for b in returned {
            self.alloc.release(b);
        }
    }

    pub fn caching(&self) -> bool {
        self.tree.is_some()
    }

    pub fn num_free(&self) -> u32 {
        self.alloc.num_free()
    }

    /// Blocks only the tree holds (evictable).
    pub fn num_cached(&self) -> u32 {
        self.tree.as_ref().map_or(0, |t| t.num_evictable(&self.alloc) as u32)
    }

    pub fn tree_blocks(&self) -> usize {
        self.tree.as_ref().map_or(0, |t| t.num_blocks())
    }

    // Used by the invariant checks, which run where debug assertions are on.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.alloc.ref_count(block)
    }

    // Used by the invariant checks, which run where debug assertions are on.
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.tree.as_ref().is_some_and(|t| t.contains_block(block))
    }

    /// Cached full blocks of `tokens` (computed in `namespace`: the base
    /// model's or an adapter's), without touching LRU times.
    pub fn peek_cached_blocks(&self, namespace: Namespace, tokens: &[u32]) -> usize {
        self.tree.as_ref().map_or(0, |t| t.peek_match_len(namespace, tokens))
    }

    /// Appends to the (empty) `table` the cached blocks of `tokens`' longest
    /// block-aligned prefix in `namespace`, at most `max_blocks` of them.
    pub fn acquire_prefix(&mut self, table: &mut BlockTable, namespace: Namespace, tokens: &[u32], max_blocks: usize) {
        self.reclaim();
        let Some(tree) = self.tree.as_mut().filter(|_| max_blocks > 0) else { return };
        let mut blocks = tree.match_prefix(namespace, tokens);
        blocks.truncate(max_blocks);
        for &b in &blocks {
            self.alloc.retain(b);
        }
        table.blocks.extend(blocks);
    }

    /// Appends up to `wanted` fresh blocks to `table`, evicting cached ones
    /// for the shortfall; fewer (possibly none) when even eviction cannot
    /// find enough.
    pub fn allocate(&mut self, table: &mut BlockTable, wanted: usize) {
        self.reclaim();
        let short = wanted.saturating_sub(self.alloc.num_free() as usize);
        if short > 0 {
            if let Some(tree) = self.tree.as_mut() {
                let freed = tree.evict(short, &mut self.alloc);
                self.evicted += freed as u64;
                if freed > 0 {
                    crate::metrics::blocks_evicted(freed as u64);
                }
            }
        }
        table.blocks.extend((0..wanted).map_while(|_| self.alloc.allocate()));
    }

    /// Appends up to `wanted` blocks from the free list only: what may be
    /// spent on speculation evicts nothing.
    pub fn allocate_free(&mut self, table: &mut BlockTable, wanted: usize) {
        self.reclaim();
        table.blocks.extend((0..wanted).map_while(|_| self.alloc.allocate()));
    }

    /// Caches the full blocks among a running request's computed tokens
    /// (`tokens`: the tokens whose KV is in `blocks`, computed in
    /// `namespace`). The request keeps its references; the tree adds its
    /// own. A block whose tokens the tree already holds under another block
    /// stays the request's alone.
    pub fn cache_full_blocks(&mut self, blocks: &[BlockId], namespace: Namespace, tokens: &[u32]) {
        self.reclaim();
        if let Some(tree) = self.tree.as_mut() {
            let full = (tokens.len() / self.block_size).min(blocks.len());
            tree.insert(namespace, &tokens[..full * self.block_size], &blocks[..full], &mut self.alloc);
        }
    }

    /// Forgets every cached block (the shard's KV is no longer trusted).
    pub fn clear_cache(&mut self) {
        self.reclaim();
        if let Some(tree) = self.tree.as_mut() {
            tree.clear(&mut self.alloc);
        }
    }

    /// `tables`: the block table of every running request. Call after
    /// [`Self::reclaim`]. Runs where debug assertions are on.
    pub fn check_invariants<'a>(&self, tables: impl Iterator<Item = &'a [BlockId]>) {
        assert!(self.returns.lock().unwrap_or_else(|e| e.into_inner()).is_empty(), "returned blocks not reclaimed");
        self.alloc.check_invariants();
        let mut expected: HashMap<BlockId, u32> = HashMap::new();
        for table in tables {
            let mut sorted = table.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), table.len(), "a block table lists a block twice: {table:?}");
            for &b in table {
                *expected.entry(b).or_default() += 1;
            }
        }
        if let Some(tree) = &self.tree {
            tree.check_invariants(&self.alloc);
            for b in tree.blocks() {
                *expected.entry(b).or_default() += 1;
            }
        }
        for b in 0..self.alloc.num_blocks() {
            let want = expected.get(&b).copied().unwrap_or(0);
            assert_eq!(self.alloc.ref_count(b), want, "block {b}: ref count vs holders");
        }
    }
}
