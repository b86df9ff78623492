//! The KV block allocator: a free list plus one reference count per block.
//!
//! A block is `block_size` consecutive token slots of the shard's paged KV
//! cache. The router decides which block holds which tokens; the shard only
//! writes where it is told.
//!
//! Who holds a reference:
//! - every running request whose block table lists the block (one each);
//! - the prefix tree (`radix`), once, for every block it caches.
//!
//! Invariants (checked by [`BlockAllocator::check_invariants`]):
//! - a block is free (ref count 0, on the free list exactly once) or
//!   referenced (ref count > 0, not on the free list);
//! - a ref count never goes below zero: releasing a free block is a bug and
//!   panics rather than wrapping.

pub type BlockId = u32;

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    ref_counts: Vec<u32>,
    /// LIFO: a block freed last is handed out first (its cache lines are warm
    /// on the shard, and tests see small, predictable ids).
    free: Vec<BlockId>,
}

impl BlockAllocator {
    pub fn new(num_blocks: u32) -> Self {
        Self {
            ref_counts: vec![0; num_blocks as usize],
            // Reversed so that block 0 is handed out first.
            free: (0..num_blocks).rev().collect(),
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.ref_counts.len() as u32
    }

    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Takes a free block; its ref count becomes 1 (the caller's reference).
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = self.free.pop()?;
        debug_assert_eq!(self.ref_counts[block as usize], 0);
        self.ref_counts[block as usize] = 1;
        Some(block)
    }

    /// One more holder of a block that is already referenced (a prefix-cache
    /// hit, or the tree adopting a request's block).
    pub fn retain(&mut self, block: BlockId) {
        let count = &mut self.ref_counts[block as usize];
        assert!(*count > 0, "retain of free block {block}");
        *count += 1;
    }

    /// Drops one reference; the block goes back to the free list at zero.
    /// Returns the remaining count.
    pub fn release(&mut self, block: BlockId) -> u32 {
        let count = &mut self.ref_counts[block as usize];
        assert!(*count > 0, "release of free block {block}");
        *count -= 1;
        if *count == 0 {
            self.free.push(block);
        }
        *count
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Panics with a description of the first broken invariant.
    pub fn check_invariants(&self) {
        let mut on_free_list = vec![false; self.ref_counts.len()];
        for &block in &self.free {
            let seen = &mut on_free_list[block as usize];
            assert!(!*seen, "block {block} is on the free list twice");
            *seen = true;
        }
        for (block, (&count, &free)) in self.ref_counts.iter().zip(&on_free_list).enumerate() {
            assert_eq!(
                count == 0,
                free,
                "block {block}: ref count {count} but on free list = {free}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_round_trip() {
        let mut a = BlockAllocator::new(3);
        assert_eq!(a.allocate(), Some(0));
        assert_eq!(a.allocate(), Some(1));
        assert_eq!(a.allocate(), Some(2));
        assert_eq!(a.allocate(), None);
        a.retain(1);
        assert_eq!(a.release(1), 1);
        assert_eq!(a.num_free(), 0);
        assert_eq!(a.release(1), 0);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.allocate(), Some(1));
        a.check_invariants();
    }

    #[test]
    #[should_panic(expected = "release of free block")]
    fn double_release_panics() {
        let mut a = BlockAllocator::new(1);
        let b = a.allocate().unwrap();
        a.release(b);
        a.release(b);
    }
}
