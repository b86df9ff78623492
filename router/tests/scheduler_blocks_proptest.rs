//! Property tests of the block allocator and the prefix tree under random
//! admit / grow / finish / preempt / evict sequences, driven the way the
//! scheduler drives them. After every operation:
//! - a block is free or referenced, and its ref count equals its holders
//!   (requests listing it + 1 if the tree caches it): never negative;
//! - no block has two writers: the block a request writes next is held by
//!   it alone and is not in the tree;
//! - a lookup returns only blocks whose KV is of exactly the prompt's tokens,
//!   computed in the same namespace (the base model, or one LoRA adapter).
//!
//! When everything has finished, free + cached = total.

use std::collections::HashMap;

use proptest::prelude::*;
use sluice_router::scheduler::blocks::{BlockAllocator, BlockId};
use sluice_router::scheduler::radix::RadixTree;

const BS: usize = 4;
const NUM_BLOCKS: u32 = 24;

#[derive(Debug, Clone)]
enum Op {
    /// Admit a prompt: `base` picks a shared prefix, `len` its length,
    /// `tail` a private suffix, `ns` the adapter (0: the base model).
    Admit { base: usize, len: usize, tail: Vec<u32>, ns: u64 },
    /// A running request computes `n` more tokens.
    Grow { req: usize, n: usize },
    Finish { req: usize },
    /// Release (caching full blocks) and re-queue for later admission.
    Preempt { req: usize },
    Resume { which: usize },
    Evict { n: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, 1..20usize, prop::collection::vec(1..6u32, 0..6), 0..3u64)
            .prop_map(|(base, len, tail, ns)| Op::Admit { base, len, tail, ns }),
        4 => (0..8usize, 1..6usize).prop_map(|(req, n)| Op::Grow { req, n }),
        2 => (0..8usize).prop_map(|req| Op::Finish { req }),
        1 => (0..8usize).prop_map(|req| Op::Preempt { req }),
        1 => (0..4usize).prop_map(|which| Op::Resume { which }),
        1 => (1..6usize).prop_map(|n| Op::Evict { n }),
    ]
}

struct Req {
    ns: u64,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
}

struct World {
    alloc: BlockAllocator,
    tree: RadixTree,
    running: Vec<Req>,
    waiting: Vec<(u64, Vec<u32>)>,
    /// Ground truth: the namespace and token prefix whose KV a full block holds.
    content: HashMap<BlockId, (u64, Vec<u32>)>,
    next_token: u32,
}

impl World {
    fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        let short = n.saturating_sub(self.alloc.num_free() as usize);
        self.tree.evict(short, &mut self.alloc);
        if (self.alloc.num_free() as usize) < n {
            return None;
        }
        Some((0..n).map(|_| self.alloc.allocate().unwrap()).collect())
    }

    /// Records the KV of every full block among `tokens[..upto]`.
    fn fill(&mut self, req: usize, from: usize) {
        let r = &self.running[req];
        for i in from / BS..r.tokens.len() / BS {
            self.content.insert(r.blocks[i], (r.ns, r.tokens[..(i + 1) * BS].to_vec()));
        }
    }

    fn admit(&mut self, ns: u64, prompt: Vec<u32>) {
        let mut matched = self.tree.match_prefix(ns, &prompt);
        for (i, b) in matched.iter().enumerate() {
            let want = (ns, prompt[..(i + 1) * BS].to_vec());
            assert_eq!(self.content.get(b), Some(&want), "lookup returned a block of other tokens or another namespace");
        }
        matched.truncate((prompt.len() - 1) / BS);
        for &b in &matched {
            self.alloc.retain(b);
        }
        let needed = prompt.len().div_ceil(BS) - matched.len();
        match self.allocate(needed) {
            Some(fresh) => {
                let computed_from = matched.len() * BS;
                matched.extend(fresh);
                self.running.push(Req { ns, tokens: prompt, blocks: matched });
                self.fill(self.running.len() - 1, computed_from);
            }
            None => {
                for b in matched {
                    self.alloc.release(b);
                }
            }
        }
    }

    fn grow(&mut self, req: usize, n: usize) {
        let r = &self.running[req];
        let from = r.tokens.len();
        let needed = (from + n).div_ceil(BS).saturating_sub(r.blocks.len());
        let Some(fresh) = self.allocate(needed) else { return };
        let new: Vec<u32> = (0..n as u32).map(|i| self.next_token + i).collect();
        self.next_token += n as u32;
        let r = &mut self.running[req];
        r.blocks.extend(fresh);
        r.tokens.extend(new);
        self.fill(req, from);
    }

    fn release(&mut self, req: usize) -> (u64, Vec<u32>) {
        let r = self.running.swap_remove(req);
        self.tree.insert(r.ns, &r.tokens, &r.blocks, &mut self.alloc);
        for &b in &r.blocks {
            self.alloc.release(b);
        }
        (r.ns, r.tokens)
    }

    fn check(&self) {
        self.alloc.check_invariants();
        self.tree.check_invariants(&self.alloc);
        let mut holders: HashMap<BlockId, u32> = HashMap::new();
        for r in &self.running {
            assert!(r.blocks.len() * BS >= r.tokens.len());
            for &b in &r.blocks {
                *holders.entry(b).or_default() += 1;
            }
        }
        for b in self.tree.blocks() {
            *holders.entry(b).or_default() += 1;
        }
        for b in 0..NUM_BLOCKS {
            assert_eq!(self.alloc.ref_count(b), holders.get(&b).copied().unwrap_or(0), "block {b}");
        }
        // The block each request writes next (its partial or next block).
        for r in &self.running {
            for &b in &r.blocks[r.tokens.len() / BS..] {
                assert_eq!(self.alloc.ref_count(b), 1, "block {b} has two writers");
                assert!(!self.tree.contains_block(b));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn allocator_and_tree_keep_their_invariants(ops in prop::collection::vec(op(), 1..120)) {
        let bases: Vec<Vec<u32>> = (0..3u32).map(|b| (0..24).map(|t| 100 * (b + 1) + t).collect()).collect();
        let mut w = World {
            alloc: BlockAllocator::new(NUM_BLOCKS),
            tree: RadixTree::new(BS as u32),
            running: Vec::new(),
            waiting: Vec::new(),
            content: HashMap::new(),
            next_token: 10_000,
        };
        for op in ops {
            match op {
                Op::Admit { base, len, tail, ns } => {
                    let mut prompt = bases[base][..len.min(24)].to_vec();
                    prompt.extend(tail);
                    w.admit(ns, prompt);
                }
                Op::Grow { req, n } if req < w.running.len() => w.grow(req, n),
                Op::Finish { req } if req < w.running.len() => { w.release(req); }
                Op::Preempt { req } if req < w.running.len() => {
                    let released = w.release(req);
                    w.waiting.push(released);
                }
                Op::Resume { which } if which < w.waiting.len() => {
                    let (ns, tokens) = w.waiting.remove(which);
                    w.admit(ns, tokens);
                }
                Op::Evict { n } => { w.tree.evict(n, &mut w.alloc); }
                _ => {}
            }
            w.check();
        }
        while !w.running.is_empty() {
            w.release(0);
            w.check();
        }
        prop_assert_eq!(w.alloc.num_free() as usize + w.tree.num_evictable(&w.alloc), NUM_BLOCKS as usize);
        prop_assert_eq!(w.tree.num_evictable(&w.alloc), w.tree.num_blocks());
    }
}
