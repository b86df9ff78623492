//! Continuous batching against the fake shard: joining a running batch,
//! budgets, chunked prefill, cancellation, overload, drain.

pub mod scheduler_support;

use std::collections::HashSet;
use std::time::Duration;

use scheduler_support::*;
use sluice_router::infer::{FinishReason, InferError};
use sluice_router::pb::StepRequest;

/// Tokens a step computes: its new requests' and its scheduled ones'.
fn step_tokens(step: &StepRequest) -> u32 {
    step.new_requests.iter().map(|n| n.num_new_tokens).sum::<u32>() + step.scheduled.iter().map(|s| s.num_new_tokens).sum::<u32>()
}

#[tokio::test]
async fn a_request_joins_a_running_batch() {
    let mut fake = fake_config(64, 4);
    fake.latency = Duration::from_millis(2);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));

    let mut a = infer.generate(request(vec![1, 2, 3], 30)).await.unwrap();
    let mut a_out = read(&mut a, Some(3)).await;
    assert_eq!(a_out.tokens.len(), 3);
    let b = generate(&infer, vec![7, 8, 9, 10, 11], 5).await;
    read_into(&mut a, &mut a_out, None).await;
    assert_eq!(a_out.tokens, expected_tokens(&fake, &[1, 2, 3], 30));
    assert_eq!(b.tokens, expected_tokens(&fake, &[7, 8, 9, 10, 11], 5));
    assert_eq!(b.end, Some((FinishReason::Length, 5)));

    // B (id 1) arrived as a new request in a step that also decoded A (id 0).
    let joined = handle.steps().iter().any(|s| {
        s.new_requests.iter().any(|n| n.id == 1) && s.scheduled.iter().any(|r| r.id == 0 && r.num_new_tokens == 1)
    });
    assert!(joined, "B never joined A's batch");
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn every_step_honours_the_token_budget_and_batch_size() {
    let fake = fake_config(256, 4);
    let mut config = scheduler_config(&fake);
    config.max_batch_prefill_tokens = 16;
    config.max_batch_size = 5;
    let (infer, handle) = start(fake.clone(), config);

    let prompts: Vec<Vec<u32>> = (0..12u32).map(|i| (0..(5 + 3 * i)).map(|t| 100 * i + t + 1).collect()).collect();
    let outcomes = futures::future::join_all(prompts.iter().map(|p| generate(&infer, p.clone(), 6))).await;
    for (p, o) in prompts.iter().zip(&outcomes) {
        assert_eq!(o.tokens, expected_tokens(&fake, p, 6));
    }
    for step in handle.steps() {
        let tokens = step_tokens(&step);
        assert!(tokens <= 16, "step computes {tokens} tokens");
        assert!(step.new_requests.len() + step.scheduled.len() <= 5);
    }
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn a_long_prompt_is_chunked_between_decodes() {
    let mut fake = fake_config(128, 4);
    fake.latency = Duration::from_millis(1);
    let mut config = scheduler_config(&fake);
    config.max_batch_prefill_tokens = 8;
    let (infer, handle) = start(fake.clone(), config);

    let mut decoders = Vec::new();
    for i in 0..2u32 {
        let mut s = infer.generate(request(vec![10 + i, 20, 30], 40)).await.unwrap();
        let out = read(&mut s, Some(1)).await; // decoding now
        decoders.push((s, out));
    }
    let long: Vec<u32> = (1..=64).collect();
    let long_out = generate(&infer, long.clone(), 2).await;
    assert_eq!(long_out.tokens, expected_tokens(&fake, &long, 2));

    let steps = handle.steps();
    let long_id = 2;
    let chunk_steps: Vec<_> = steps
        .iter()
        .filter(|s| {
            s.new_requests.iter().any(|n| n.id == long_id && n.num_new_tokens > 1)
                || s.scheduled.iter().any(|r| r.id == long_id && r.num_new_tokens > 1)
        })
        .collect();
    // 64 tokens, 8 per step minus the two decodes: at least 11 chunks.
    assert!(chunk_steps.len() >= 64 / 6, "only {} chunks", chunk_steps.len());
    for s in &chunk_steps {
        let decoded: HashSet<u64> = s.scheduled.iter().filter(|r| r.num_new_tokens == 1).map(|r| r.id).collect();
        assert!(decoded.contains(&0) && decoded.contains(&1), "a chunk step starved the decodes: {s:?}");
    }
    for (i, (mut s, mut out)) in decoders.into_iter().enumerate() {
        read_into(&mut s, &mut out, None).await;
        assert_eq!(out.tokens, expected_tokens(&fake, &[10 + i as u32, 20, 30], 40));
    }
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn while_requests_decode_prompt_chunks_fit_the_stall_limit() {
    // A step costs 1 ms per token: with a 20 ms stall limit a step next to
    // a decoding request reads about 20 prompt tokens, though the budget
    // (64) would take the whole 60-token prompt at once.
    let mut fake = fake_config(128, 4);
    fake.latency_per_token = Duration::from_millis(1);
    let mut config = scheduler_config(&fake);
    config.max_batch_prefill_tokens = 64;
    config.decode_stall = Some(Duration::from_millis(20));
    let (infer, handle) = start(fake.clone(), config);

    // A 40-token prompt alone (nothing decodes): one step of 40.
    let first: Vec<u32> = (100..140).collect();
    let mut decoding = infer.generate(request(first.clone(), 60)).await.unwrap();
    let mut out = read(&mut decoding, Some(2)).await;
    let long: Vec<u32> = (1..=60).collect();
    let long_out = generate(&infer, long.clone(), 2).await;
    assert_eq!(long_out.tokens, expected_tokens(&fake, &long, 2));
    read_into(&mut decoding, &mut out, None).await;
    assert_eq!(out.tokens, expected_tokens(&fake, &first, 60));
    assert_no_leak(&infer, &handle).await;

    let steps = handle.steps();
    assert_eq!(step_tokens(&steps[0]), 40, "nothing decoded yet: the whole prompt at once");
    let chunks: Vec<_> = steps
        .iter()
        .filter(|s| {
            s.new_requests.iter().any(|n| n.id == 1) || s.scheduled.iter().any(|r| r.id == 1 && r.num_new_tokens > 1)
        })
        .collect();
    assert!(chunks.len() >= 3, "the 60-token prompt took {} steps", chunks.len());
    for s in &chunks {
        assert!(step_tokens(s) <= 21, "a step of {} tokens next to a decode: {s:?}", step_tokens(s));
        assert!(s.scheduled.iter().any(|r| r.id == 0 && r.num_new_tokens == 1), "the decode starved: {s:?}");
    }
}

#[tokio::test]
async fn a_cancelled_request_frees_its_blocks_by_the_next_step() {
    let mut fake = fake_config(32, 4);
    fake.latency = Duration::from_millis(2);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));

    let mut a = infer.generate(request((1..=10).collect(), 100)).await.unwrap();
    read(&mut a, Some(2)).await;
    drop(a);
    let stats = wait_idle(&infer).await;
    assert_eq!(stats.blocks_free + stats.blocks_cached, 32);
    // The next step tells the shard to drop it.
    generate(&infer, vec![5, 6], 1).await;
    assert!(handle.steps().iter().any(|s| s.finished_ids.contains(&0)), "never listed in finished_ids");
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn over_max_concurrent_requests_is_overloaded() {
    let mut fake = fake_config(64, 4);
    fake.latency = Duration::from_millis(2);
    let mut config = scheduler_config(&fake);
    config.max_concurrent_requests = 2;
    let (infer, handle) = start(fake.clone(), config);

    let mut a = infer.generate(request(vec![1, 2], 20)).await.unwrap();
    let mut b = infer.generate(request(vec![3, 4], 20)).await.unwrap();
    match infer.generate(request(vec![5, 6], 20)).await {
        Err(InferError::Overloaded(_)) => {}
        other => panic!("expected Overloaded, got {:?}", other.map(|_| ())),
    }
    read(&mut a, None).await;
    read(&mut b, None).await;
    wait_idle(&infer).await;
    assert_eq!(generate(&infer, vec![5, 6], 3).await.tokens.len(), 3);
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn a_request_larger_than_the_cache_is_unschedulable() {
    let fake = fake_config(4, 4); // 16 slots
    let (infer, _handle) = start(fake.clone(), scheduler_config(&fake));
    assert!(matches!(infer.generate(request((1..=10).collect(), 7)).await, Err(InferError::Unschedulable(_))));
    assert!(matches!(infer.generate(request(vec![], 1)).await, Err(InferError::Unschedulable(_))));
    assert_eq!(generate(&infer, (1..=10).collect(), 6).await.tokens.len(), 6);
}

#[tokio::test]
async fn drain_finishes_running_requests_and_refuses_new_ones() {
    let mut fake = fake_config(64, 4);
    fake.latency = Duration::from_millis(2);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));

    let mut a = infer.generate(request(vec![1, 2, 3], 10)).await.unwrap();
    let drained = {
        let infer = infer.clone();
        tokio::spawn(async move { infer.drain().await })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(matches!(infer.generate(request(vec![1], 2)).await, Err(InferError::ShuttingDown)));
    let out = read(&mut a, None).await;
    assert_eq!(out.end, Some((FinishReason::Length, 10)));
    tokio::time::timeout(Duration::from_secs(5), drained).await.unwrap().unwrap();
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn eos_ends_a_request_unless_ignored() {
    let mut fake = fake_config(64, 4);
    fake.eos_probability = 0.3;
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));
    let prompts: Vec<Vec<u32>> = (0..20u32).map(|i| vec![i + 1, 2 * i + 3]).collect();
    let mut saw_eos = false;
    for p in &prompts {
        let out = generate(&infer, p.clone(), 12).await;
        assert_eq!(out.tokens, expected_tokens(&fake, p, 12));
        if out.tokens.last() == Some(&fake.eos_token_id) {
            saw_eos = true;
            assert_eq!(out.end.unwrap().0, FinishReason::Eos);
        }
        // With ignore_eos it runs to max_new_tokens whatever it samples.
        let mut r = request(p.clone(), 12);
        r.ignore_eos = true;
        let mut s = infer.generate(r).await.unwrap();
        let out = read(&mut s, None).await;
        assert_eq!(out.end, Some((FinishReason::Length, 12)));
    }
    assert!(saw_eos);
    assert_no_leak(&infer, &handle).await;
}
