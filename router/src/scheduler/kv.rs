//! The scheduler's view of the KV cache: the allocator plus, with prefix
//! caching on, the radix tree. Allocation evicts cached blocks before it
//! gives up; releasing a finished or preempted request's blocks caches the
//! full ones.

use std::collections::HashMap;

use crate::blocks::{BlockAllocator, BlockId};
use crate::radix::RadixTree;

pub(crate) struct KvCache {
    alloc: BlockAllocator,
    /// `None` with prefix caching off: no tree at all.
    tree: Option<RadixTree>,
    block_size: usize,
    pub evicted: u64,
}

impl KvCache {
    pub fn new(num_blocks: u32, block_size: u32, prefix_caching: bool) -> Self {
        Self {
            alloc: BlockAllocator::new(num_blocks),
            tree: prefix_caching.then(|| RadixTree::new(block_size)),
            block_size: block_size as usize,
            evicted: 0,
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

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.alloc.ref_count(block)
    }

    pub fn is_cached(&self, block: BlockId) -> bool {
        self.tree.as_ref().is_some_and(|t| t.contains_block(block))
    }

    /// Cached full blocks of `tokens`, without touching LRU times.
    pub fn peek_cached_blocks(&self, tokens: &[u32]) -> usize {
        self.tree.as_ref().map_or(0, |t| t.peek_match_len(tokens))
    }

    /// The cached blocks of `tokens`' longest block-aligned prefix, at most
    /// `max_blocks` of them, each retained for the caller.
    pub fn acquire_prefix(&mut self, tokens: &[u32], max_blocks: usize) -> Vec<BlockId> {
        let Some(tree) = self.tree.as_mut().filter(|_| max_blocks > 0) else { return Vec::new() };
        let mut blocks = tree.match_prefix(tokens);
        blocks.truncate(max_blocks);
        for &b in &blocks {
            self.alloc.retain(b);
        }
        blocks
    }

    /// Up to `wanted` fresh blocks, evicting cached ones for the shortfall.
    /// Fewer (possibly none) when even eviction cannot find enough.
    pub fn allocate(&mut self, wanted: usize) -> Vec<BlockId> {
        let short = wanted.saturating_sub(self.alloc.num_free() as usize);
        if short > 0 {
            if let Some(tree) = self.tree.as_mut() {
                let freed = tree.evict(short, &mut self.alloc);
                self.evicted += freed as u64;
                if freed > 0 {
                    metrics::counter!("sluice_prefix_cache_evicted_blocks_total").increment(freed as u64);
                }
            }
        }
        (0..wanted).map_while(|_| self.alloc.allocate()).collect()
    }

    /// Caches the full blocks among a running request's computed tokens
    /// (`tokens`: the tokens whose KV is in `blocks`). The request keeps its
    /// references; the tree adds its own. A block whose tokens the tree
    /// already holds under another block stays the request's alone.
    pub fn cache_full_blocks(&mut self, blocks: &[BlockId], tokens: &[u32]) {
        if let Some(tree) = self.tree.as_mut() {
            let full = (tokens.len() / self.block_size).min(blocks.len());
            tree.insert(&tokens[..full * self.block_size], &blocks[..full], &mut self.alloc);
        }
    }

    /// Gives back a request's blocks. With `cache_tokens`, the tokens whose
    /// KV is in the blocks: the full blocks among them enter the tree first.
    pub fn release(&mut self, blocks: &[BlockId], cache_tokens: Option<&[u32]>) {
        if let (Some(tree), Some(tokens)) = (self.tree.as_mut(), cache_tokens) {
            let full = (tokens.len() / self.block_size).min(blocks.len());
            tree.insert(&tokens[..full * self.block_size], &blocks[..full], &mut self.alloc);
        }
        for &b in blocks {
            self.alloc.release(b);
        }
    }

    /// Forgets every cached block (the shard's KV is no longer trusted).
    pub fn clear_cache(&mut self) {
        if let Some(tree) = self.tree.as_mut() {
            tree.clear(&mut self.alloc);
        }
    }

    /// `tables`: the block table of every running request.
    pub fn check_invariants<'a>(&self, tables: impl Iterator<Item = &'a [BlockId]>) {
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
