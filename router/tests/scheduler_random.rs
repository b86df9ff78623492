//! 1,000 random requests with random cancellations over a small, shared
//! KV cache: every completed request has its solo tokens, the fake shard
//! sees no invalid step, and no block leaks.

mod scheduler_support;

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use scheduler_support::*;
use sluice_router::infer::InferError;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_block_leaks_after_1000_random_requests_with_cancellations() {
    // 64 blocks: blocks are shared while requests still run (cached as soon
    // as filled), so a larger cache would not reliably force preemption.
    let mut fake = fake_config(64, 4);
    fake.eos_probability = 0.05;
    let mut config = scheduler_config(&fake);
    config.max_batch_prefill_tokens = 48;
    config.max_batch_size = 16;
    config.max_concurrent_requests = 48;
    let (infer, handle) = start(fake.clone(), config);

    // Prompts drawn from a few shared "system prompts" so the tree matters.
    let bases: Vec<Vec<u32>> = (0..4u32).map(|b| (0..40).map(|t| b * 1000 + t + 1).collect()).collect();
    let gate = Arc::new(tokio::sync::Semaphore::new(40));
    let mut tasks = Vec::new();
    for i in 0..1000u64 {
        let mut rng = StdRng::seed_from_u64(i);
        let base = &bases[rng.gen_range(0..bases.len())];
        let mut prompt = base[..rng.gen_range(1..=base.len())].to_vec();
        for _ in 0..rng.gen_range(0..12) {
            prompt.push(rng.gen_range(1..900));
        }
        let max_new = rng.gen_range(1..=20);
        let cancel_after = rng.gen_bool(0.25).then(|| rng.gen_range(0..max_new as usize));
        let infer = infer.clone();
        let fake = fake.clone();
        let permit = gate.clone().acquire_owned().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let mut stream = loop {
                match infer.generate(request(prompt.clone(), max_new)).await {
                    Ok(s) => break s,
                    Err(InferError::Overloaded(_)) => tokio::time::sleep(std::time::Duration::from_millis(1)).await,
                    Err(e) => panic!("{e}"),
                }
            };
            let out = read(&mut stream, cancel_after).await;
            let expected = expected_tokens(&fake, &prompt, max_new);
            assert_eq!(out.error, None);
            assert_eq!(out.tokens[..], expected[..out.tokens.len()]);
            if cancel_after.is_none() {
                assert_eq!(out.tokens, expected);
            }
            out.cached_tokens as u64
        }));
    }
    let mut cached = 0;
    for t in tasks {
        cached += t.await.unwrap();
    }
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(cached > 0, "shared prefixes were never served from cache");
    // The load was sized to exercise every path of the allocator.
    assert!(stats.preemptions > 0, "{stats:?}");
    assert!(stats.evicted_blocks > 0, "{stats:?}");
    assert_eq!(stats.blocks_total, 64);
}
