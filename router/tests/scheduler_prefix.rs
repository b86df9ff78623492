//! Prefix caching: admission reuses exactly the cached blocks of a prompt.

pub mod scheduler_support;

use scheduler_support::*;
use sluice_router::pb::NewRequest;

fn new_request(handle: &sluice_router::testing::fake_shard::FakeShardHandle, id: u64) -> NewRequest {
    handle
        .steps()
        .iter()
        .flat_map(|s| s.new_requests.clone())
        .find(|n| n.id == id)
        .expect("request was sent")
}

#[tokio::test]
async fn prefix_hits_reuse_the_exact_cached_blocks() {
    let fake = fake_config(64, 4);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));

    // A: 10 tokens = 2 full blocks + 2. Its KV at the end covers the prompt
    // (the one sampled token has none), so blocks 0 and 1 are cached.
    let a_prompt: Vec<u32> = (1..=10).collect();
    let a = generate(&infer, a_prompt.clone(), 1).await;
    assert_eq!(a.cached_tokens, 0);
    let a_blocks = new_request(&handle, 0).block_ids;
    assert_eq!(a_blocks.len(), 3);

    // B shares A's first 9 tokens: two full blocks are reused, as is.
    let mut b_prompt: Vec<u32> = (1..=9).collect();
    b_prompt.extend([50, 51, 52]);
    let b = generate(&infer, b_prompt.clone(), 3).await;
    let b_new = new_request(&handle, 1);
    assert_eq!(b_new.num_computed_tokens, 8);
    assert_eq!(&b_new.block_ids[..2], &a_blocks[..2]);
    assert!(!a_blocks[..2].contains(&b_new.block_ids[2]), "the block B writes is not a cached one");
    assert_eq!(b.cached_tokens, 8);
    assert_eq!(b.tokens, expected_tokens(&fake, &b_prompt, 3));

    // C is exactly A's first 8 tokens: fully cached, but its last block is
    // recomputed (a token must be computed, and a shared block never written).
    let c_prompt: Vec<u32> = (1..=8).collect();
    let c = generate(&infer, c_prompt.clone(), 2).await;
    let c_new = new_request(&handle, 2);
    assert_eq!(c_new.num_computed_tokens, 4);
    assert_eq!(c_new.block_ids[0], a_blocks[0]);
    assert_ne!(c_new.block_ids[1], a_blocks[1]);
    assert_eq!(c.cached_tokens, 4);
    assert_eq!(c.tokens, expected_tokens(&fake, &c_prompt, 2));

    // A prompt differing inside the first block shares nothing.
    let mut d_prompt = a_prompt.clone();
    d_prompt[2] = 999;
    generate(&infer, d_prompt, 1).await;
    assert_eq!(new_request(&handle, 3).num_computed_tokens, 0);

    let stats = assert_no_leak(&infer, &handle).await;
    assert_eq!(stats.prefix_hit_tokens, 8 + 4);
    assert!(stats.blocks_cached > 0);
}

#[tokio::test]
async fn a_finished_conversation_turn_is_cached_with_its_generated_tokens() {
    let fake = fake_config(64, 4);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));
    let prompt: Vec<u32> = (1..=6).collect();
    let first = generate(&infer, prompt.clone(), 6).await;
    // Next turn: prompt + answer + more. KV existed for 6 + 5 = 11 tokens
    // (the last sampled token had none): 2 full blocks.
    let mut next = prompt.clone();
    next.extend(&first.tokens);
    next.extend([77, 78, 79]);
    let out = generate(&infer, next.clone(), 2).await;
    assert_eq!(out.cached_tokens, 8);
    assert_eq!(out.tokens, expected_tokens(&fake, &next, 2));
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn no_reuse_without_prefix_caching_or_with_prompt_logprobs() {
    let fake = fake_config(64, 4);
    let mut config = scheduler_config(&fake);
    config.prefix_caching = false;
    let (infer, handle) = start(fake.clone(), config);
    let prompt: Vec<u32> = (1..=12).collect();
    generate(&infer, prompt.clone(), 2).await;
    let again = generate(&infer, prompt.clone(), 2).await;
    assert_eq!(again.cached_tokens, 0);
    assert_eq!(new_request(&handle, 1).num_computed_tokens, 0);
    let stats = assert_no_leak(&infer, &handle).await;
    assert_eq!(stats.blocks_free, 64);
    assert_eq!(stats.blocks_cached, 0);

    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));
    generate(&infer, prompt.clone(), 2).await;
    let mut r = request(prompt.clone(), 2);
    r.prompt_logprobs = true;
    let mut s = infer.generate(r).await.unwrap();
    let out = read(&mut s, None).await;
    assert_eq!(out.cached_tokens, 0);
    assert_eq!(out.prompt_logprobs, prompt.len() - 1);
    assert!(new_request(&handle, 1).params.unwrap().prompt_logprobs);
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn cache_on_and_off_generate_the_same_tokens() {
    let fake = fake_config(48, 4);
    let system: Vec<u32> = (100..137).collect(); // 37 tokens: ends mid-block
    let mut prompts = Vec::new();
    for i in 0..10u32 {
        let mut p = system[..(5 + 3 * i as usize).min(system.len())].to_vec();
        p.extend([i + 1, i + 2]);
        prompts.push(p);
    }
    prompts.push(system[..8].to_vec()); // exactly two blocks
    let mut results = Vec::new();
    for caching in [true, false] {
        let mut config = scheduler_config(&fake);
        config.prefix_caching = caching;
        let (infer, handle) = start(fake.clone(), config);
        let outs = futures::future::join_all(prompts.iter().map(|p| generate(&infer, p.clone(), 5))).await;
        assert_no_leak(&infer, &handle).await;
        results.push(outs.into_iter().map(|o| o.tokens).collect::<Vec<_>>());
    }
    assert_eq!(results[0], results[1]);
    for (p, t) in prompts.iter().zip(&results[0]) {
        assert_eq!(t, &expected_tokens(&fake, p, 5));
    }
}

#[tokio::test]
async fn cached_prompts_go_first_but_nobody_is_passed_over_more_than_the_bound() {
    let mut fake = fake_config(128, 4);
    fake.latency = std::time::Duration::from_millis(2);
    let mut config = scheduler_config(&fake);
    config.max_batch_size = 1; // one request at a time: admission order is visible
    let (infer, handle) = start(fake.clone(), config);

    let shared: Vec<u32> = (1..=16).collect();
    generate(&infer, shared.clone(), 1).await; // id 0: caches 4 blocks
    let mut busy = infer.generate(request(vec![500, 501], 40)).await.unwrap(); // id 1
    read(&mut busy, Some(1)).await;
    // While id 1 runs: an uncached request (id 2), then 12 cached ones (3..15).
    let mut streams = vec![infer.generate(request(vec![900, 901, 902], 2)).await.unwrap()];
    for i in 0..12u32 {
        let mut p = shared.clone();
        p.push(600 + i);
        streams.push(infer.generate(request(p, 2)).await.unwrap());
    }
    for mut s in streams {
        let out = read(&mut s, None).await;
        assert_eq!(out.error, None);
    }
    let admitted: Vec<u64> =
        handle.steps().iter().flat_map(|s| s.new_requests.iter().map(|n| n.id).collect::<Vec<_>>()).collect();
    // Cached ones overtake id 2 until it was passed over 8 times.
    assert_eq!(admitted, vec![0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 2, 11, 12, 13, 14]);
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn blocks_are_cached_as_soon_as_they_are_filled_not_when_the_request_ends() {
    let fake = fake_config(64, 4);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));
    // A keeps decoding; its prompt's 2 full blocks were computed by its
    // first step and are cached from then on.
    let a_prompt: Vec<u32> = (1..=10).collect();
    let mut a_request = request(a_prompt.clone(), 40);
    a_request.ignore_eos = true;
    let mut a_stream = infer.generate(a_request).await.expect("accepted");
    let mut a = read(&mut a_stream, Some(2)).await;

    let mut b_prompt: Vec<u32> = (1..=9).collect();
    b_prompt.extend([60, 61]);
    let b = generate(&infer, b_prompt.clone(), 3).await;
    assert_eq!(b.cached_tokens, 8, "B reuses A's blocks while A still runs");
    assert_eq!(&new_request(&handle, 1).block_ids[..2], &new_request(&handle, 0).block_ids[..2]);
    assert_eq!(b.tokens, expected_tokens(&fake, &b_prompt, 3));

    read_into(&mut a_stream, &mut a, None).await;
    assert_eq!(a.tokens.len(), 40);
    assert!(a.error.is_none());
    assert_no_leak(&infer, &handle).await;
}
