//! The prefix cache: a radix tree over token ids at block granularity.
//!
//! Every edge is exactly one full block of tokens, and every node (but the
//! root) owns the KV block that holds those tokens, computed with the whole
//! path from the root as context:
//!
//! ```text
//!   root ──[t0..t15]──► n1 (block 7) ──[t16..t31]──► n2 (block 3)
//!                                    └─[u16..u31]──► n3 (block 9)
//! ```
//!
//! A prompt `t0..t40` (block_size 16) matches n1 and n2: blocks [7, 3] hold
//! its first 32 tokens. Tokens 32..40 fill only part of a block and are never
//! cached: only full blocks enter the tree, so a cached block is never
//! written again.
//!
//! One block per edge (rather than splitting long edges) keeps eviction at
//! the unit the allocator hands out, and a lookup is one hash probe per block.
//!
//! KV depends on the weights that computed it, so every LoRA adapter has its
//! own tree: a namespace, whose root hangs nowhere. The base model is
//! namespace 0 (the root above); an adapter's root exists while it has
//! children. The same tokens under two namespaces are two nodes, two blocks:
//!
//! ```text
//!   ns 0 (base):  root ──[t0..t15]──► n1 (block 7)
//!   ns 4:         root4 ──[t0..t15]──► n5 (block 2)     same tokens, other KV
//! ```
//!
//! The tree holds one reference (in [`BlockAllocator`]) on each of its
//! blocks. A block whose only reference is the tree's is "cached": it can be
//! evicted, leaves first, least recently used first.
//!
//! Invariants (checked by [`RadixTree::check_invariants`]):
//! - every live node but the roots has exactly `block_size` tokens, and is
//!   listed in its parent's children under those tokens;
//! - a namespace's root is listed in `roots`, holds no block, and (but the
//!   base's) has at least one child;
//! - a block belongs to at most one node, and `by_block` maps it there;
//! - every block in the tree has ref count >= 1.

use std::collections::HashMap;

use super::blocks::{BlockAllocator, BlockId};

/// The base model's root.
const ROOT: usize = 0;

/// Whose weights computed a tree's KV: 0 for the base model, else the
/// adapter's id (see scheduler/adapters.rs).
pub type Namespace = u64;

#[derive(Debug, Clone)]
struct Node {
    tokens: Vec<u32>,
    /// Unused for a root.
    block: BlockId,
    /// A root's is itself.
    parent: usize,
    children: HashMap<Vec<u32>, usize>,
    last_access: u64,
    /// Set on roots only: the namespace they start.
    root_of: Option<Namespace>,
}

#[derive(Debug, Clone)]
pub struct RadixTree {
    block_size: usize,
    /// Slab of nodes; `None` marks a free slot. Index 0 is the root.
    nodes: Vec<Option<Node>>,
    free_slots: Vec<usize>,
    by_block: HashMap<BlockId, usize>,
    /// Each namespace's root; 0 -> ROOT always.
    roots: HashMap<Namespace, usize>,
    /// Logical time for LRU; bumped on every lookup and insertion.
    clock: u64,
}

impl RadixTree {
    pub fn new(block_size: u32) -> Self {
        assert!(block_size > 0);
        Self {
            block_size: block_size as usize,
            nodes: vec![Some(Self::root_node(ROOT, 0))],
            free_slots: Vec::new(),
            by_block: HashMap::new(),
            roots: HashMap::from([(0, ROOT)]),
            clock: 0,
        }
    }

    fn root_node(index: usize, namespace: Namespace) -> Node {
        Node {
            tokens: Vec::new(),
            block: BlockId::MAX,
            parent: index,
            children: HashMap::new(),
            last_access: 0,
            root_of: Some(namespace),
        }
    }

    /// Puts `node` in a free slot of the slab; returns its index.
    fn add_node(&mut self, node: Node) -> usize {
        match self.free_slots.pop() {
            Some(slot) => {
                self.nodes[slot] = Some(node);
                slot
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// The root of `namespace`, made if it has none yet.
    fn root(&mut self, namespace: Namespace) -> usize {
        if let Some(&root) = self.roots.get(&namespace) {
            return root;
        }
        let index = self.add_node(Self::root_node(0, namespace));
        self.node_mut(index).parent = index;
        self.roots.insert(namespace, index);
        index
    }

    /// Removes an adapter namespace's root once its last child is gone.
    fn drop_root_if_empty(&mut self, index: usize) {
        let node = self.node(index);
        if let Some(namespace) = node.root_of.filter(|&ns| ns != 0) {
            if node.children.is_empty() {
                self.nodes[index] = None;
                self.free_slots.push(index);
                self.roots.remove(&namespace);
            }
        }
    }

    /// Blocks held by the tree (referenced or not).
    pub fn num_blocks(&self) -> usize {
        self.by_block.len()
    }

    pub fn contains_block(&self, block: BlockId) -> bool {
        self.by_block.contains_key(&block)
    }

    pub fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.by_block.keys().copied()
    }

    /// Blocks whose only reference is the tree's: free to evict.
    pub fn num_evictable(&self, alloc: &BlockAllocator) -> usize {
        self.by_block.keys().filter(|&&b| alloc.ref_count(b) == 1).count()
    }

    fn node(&self, index: usize) -> &Node {
        self.nodes[index].as_ref().expect("live node")
    }

    fn node_mut(&mut self, index: usize) -> &mut Node {
        self.nodes[index].as_mut().expect("live node")
    }

    /// The node path matching the longest block-aligned prefix of `tokens`
    /// in `namespace`.
    fn walk(&self, namespace: Namespace, tokens: &[u32]) -> Vec<usize> {
        let mut path = Vec::new();
        let Some(&root) = self.roots.get(&namespace) else { return path };
        let mut at = root;
        for chunk in tokens.chunks_exact(self.block_size) {
            match self.node(at).children.get(chunk) {
                Some(&child) => {
                    path.push(child);
                    at = child;
                }
                None => break,
            }
        }
        path
    }

    /// How many leading full blocks of `tokens` are cached in `namespace`,
    /// without touching LRU times (admission ordering peeks at many requests).
    pub fn peek_match_len(&self, namespace: Namespace, tokens: &[u32]) -> usize {
        self.walk(namespace, tokens).len()
    }

    /// The blocks holding the longest block-aligned cached prefix of
    /// `tokens` in `namespace`, in order; marks them used now. The caller
    /// takes its own references (`BlockAllocator::retain`).
    pub fn match_prefix(&mut self, namespace: Namespace, tokens: &[u32]) -> Vec<BlockId> {
        let path = self.walk(namespace, tokens);
        self.clock += 1;
        let now = self.clock;
        path.iter()
            .map(|&index| {
                let node = self.node_mut(index);
                node.last_access = now;
                node.block
            })
            .collect()
    }

    /// Caches the full blocks of a sequence computed in `namespace`:
    /// `blocks[i]` holds the KV of `tokens[i * block_size .. (i + 1) *
    /// block_size]`. Only `min(tokens.len() / block_size, blocks.len())`
    /// blocks are considered. Where the tree already has a node for a block's
    /// tokens, the tree keeps its own block and the caller's stays the
    /// caller's (and is freed when the caller releases it). Returns the
    /// number of blocks adopted.
    pub fn insert(
        &mut self,
        namespace: Namespace,
        tokens: &[u32],
        blocks: &[BlockId],
        alloc: &mut BlockAllocator,
    ) -> usize {
        if tokens.len() < self.block_size || blocks.is_empty() {
            return 0;
        }
        self.clock += 1;
        let now = self.clock;
        let root = self.root(namespace);
        let mut at = root;
        let mut adopted = 0;
        for (chunk, &block) in tokens.chunks_exact(self.block_size).zip(blocks) {
            if let Some(&child) = self.node(at).children.get(chunk) {
                self.node_mut(child).last_access = now;
                at = child;
                continue;
            }
            if self.by_block.contains_key(&block) {
                // The block is cached under another path: it cannot hold these
                // tokens too. Only a bug gets here; stop rather than corrupt.
                debug_assert!(false, "block {block} already cached elsewhere");
                break;
            }
            alloc.retain(block);
            let node = Node {
                tokens: chunk.to_vec(),
                block,
                parent: at,
                children: HashMap::new(),
                last_access: now,
                root_of: None,
            };
            let index = self.add_node(node);
            self.node_mut(at).children.insert(chunk.to_vec(), index);
            self.by_block.insert(block, index);
            adopted += 1;
            at = index;
        }
        self.drop_root_if_empty(root);
        adopted
    }

    fn remove_leaf(&mut self, index: usize, alloc: &mut BlockAllocator) {
        let node = self.nodes[index].take().expect("live node");
        debug_assert!(node.children.is_empty());
        self.node_mut(node.parent).children.remove(&node.tokens);
        self.by_block.remove(&node.block);
        self.free_slots.push(index);
        alloc.release(node.block);
        self.drop_root_if_empty(node.parent);
    }

    /// Frees up to `wanted` blocks that only the tree references, least
    /// recently used leaves first (a parent becomes a candidate once its
    /// last child is gone). Returns how many were freed.
    pub fn evict(&mut self, wanted: usize, alloc: &mut BlockAllocator) -> usize {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;

        fn evictable(tree: &RadixTree, alloc: &BlockAllocator, index: usize) -> bool {
            // A parent may be gone (an adapter's emptied root).
            let Some(node) = tree.nodes[index].as_ref() else { return false };
            node.root_of.is_none() && node.children.is_empty() && alloc.ref_count(node.block) == 1
        }
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = self
            .by_block
            .values()
            .filter(|&&index| evictable(self, alloc, index))
            .map(|&index| Reverse((self.node(index).last_access, index)))
            .collect();
        let mut freed = 0;
        while freed < wanted {
            let Some(Reverse((_, index))) = heap.pop() else { break };
            let parent = self.node(index).parent;
            self.remove_leaf(index, alloc);
            freed += 1;
            if evictable(self, alloc, parent) {
                heap.push(Reverse((self.node(parent).last_access, parent)));
            }
        }
        freed
    }

    /// Drops every cached block (after a failed step the shard's KV can no
    /// longer be trusted). Blocks that running requests still reference stay
    /// theirs.
    pub fn clear(&mut self, alloc: &mut BlockAllocator) {
        for (&block, _) in self.by_block.iter() {
            alloc.release(block);
        }
        *self = Self::new(self.block_size as u32);
    }

    /// Panics with a description of the first broken invariant.
    pub fn check_invariants(&self, alloc: &BlockAllocator) {
        let mut live = 0;
        for (index, slot) in self.nodes.iter().enumerate() {
            let Some(node) = slot else { continue };
            for (tokens, &child) in &node.children {
                let c = self.node(child);
                assert_eq!(&c.tokens, tokens, "child {child} listed under other tokens");
                assert_eq!(c.parent, index, "child {child} has another parent");
            }
            if let Some(namespace) = node.root_of {
                assert_eq!(self.roots.get(&namespace), Some(&index), "root {index} not listed for namespace {namespace}");
                assert!(node.tokens.is_empty() && node.parent == index, "root {index} is not a root");
                assert!(namespace == 0 || !node.children.is_empty(), "namespace {namespace} has an empty root");
                continue;
            }
            live += 1;
            assert_eq!(node.tokens.len(), self.block_size, "node {index} is not one full block");
            assert_eq!(self.by_block.get(&node.block), Some(&index), "block {} not mapped to node {index}", node.block);
            assert!(alloc.ref_count(node.block) >= 1, "cached block {} has ref count 0", node.block);
            assert!(self.node(node.parent).children.get(&node.tokens) == Some(&index));
        }
        assert_eq!(live, self.by_block.len(), "by_block lists dead nodes");
        for (&namespace, &root) in &self.roots {
            assert_eq!(self.node(root).root_of, Some(namespace), "roots lists {root} for namespace {namespace}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn lookup_returns_exact_blocks_of_full_matches() {
        let mut alloc = BlockAllocator::new(8);
        let mut tree = RadixTree::new(4);
        let blocks: Vec<_> = (0..3).map(|_| alloc.allocate().unwrap()).collect();
        // 10 tokens: two full blocks and a partial one; only two are cached.
        assert_eq!(tree.insert(0, &seq(0..10), &blocks, &mut alloc), 2);
        assert_eq!(tree.match_prefix(0, &seq(0..8)), vec![0, 1]);
        assert_eq!(tree.match_prefix(0, &seq(0..7)), vec![0]);
        let mut other = seq(0..8);
        other[5] = 99;
        assert_eq!(tree.match_prefix(0, &other), vec![0]);
        assert_eq!(tree.match_prefix(0, &[1, 2, 3, 4]), Vec::<BlockId>::new());
        tree.check_invariants(&alloc);
    }

    #[test]
    fn evicts_unreferenced_leaves_lru_first() {
        let mut alloc = BlockAllocator::new(8);
        let mut tree = RadixTree::new(2);
        let a: Vec<_> = (0..2).map(|_| alloc.allocate().unwrap()).collect(); // 0, 1
        tree.insert(0, &[1, 2, 3, 4], &a, &mut alloc);
        let b = vec![alloc.allocate().unwrap()]; // 2
        tree.insert(0, &[7, 7], &b, &mut alloc);
        // The requests are done with their blocks: only the tree holds them.
        for &x in a.iter().chain(&b) {
            alloc.release(x);
        }
        tree.match_prefix(0, &[1, 2, 3, 4]); // [1,2,3,4] path is now newest
        assert_eq!(tree.evict(1, &mut alloc), 1);
        assert!(!tree.contains_block(2), "the LRU leaf goes first");
        // A referenced leaf is not evictable; its parent is not a leaf.
        alloc.retain(1);
        assert_eq!(tree.evict(5, &mut alloc), 0);
        alloc.release(1);
        assert_eq!(tree.evict(5, &mut alloc), 2);
        assert_eq!(alloc.num_free(), 8);
        tree.check_invariants(&alloc);
        alloc.check_invariants();
    }

    #[test]
    fn namespaces_never_share_blocks_and_their_roots_go_with_their_last_leaf() {
        let mut alloc = BlockAllocator::new(8);
        let mut tree = RadixTree::new(2);
        let base: Vec<_> = (0..2).map(|_| alloc.allocate().unwrap()).collect(); // 0, 1
        let adapter: Vec<_> = (0..2).map(|_| alloc.allocate().unwrap()).collect(); // 2, 3
        assert_eq!(tree.insert(0, &[1, 2, 3, 4], &base, &mut alloc), 2);
        // The same tokens under adapter 5: its own blocks, not the base's.
        assert_eq!(tree.match_prefix(5, &[1, 2, 3, 4]), Vec::<BlockId>::new());
        assert_eq!(tree.insert(5, &[1, 2, 3, 4], &adapter, &mut alloc), 2);
        assert_eq!(tree.match_prefix(5, &[1, 2, 3, 4]), vec![2, 3]);
        assert_eq!(tree.match_prefix(0, &[1, 2, 3, 4]), vec![0, 1]);
        assert_eq!(tree.peek_match_len(9, &[1, 2, 3, 4]), 0);
        tree.check_invariants(&alloc);
        for &b in base.iter().chain(&adapter) {
            alloc.release(b);
        }
        tree.match_prefix(0, &[1, 2, 3, 4]); // the adapter's blocks are older
        assert_eq!(tree.evict(2, &mut alloc), 2);
        assert!(!tree.contains_block(2) && !tree.contains_block(3) && tree.contains_block(0));
        assert!(!tree.roots.contains_key(&5), "an adapter's empty root stays behind");
        tree.check_invariants(&alloc);
        assert_eq!(tree.evict(8, &mut alloc), 2);
        assert_eq!(alloc.num_free(), 8);
        tree.check_invariants(&alloc);
    }
}
