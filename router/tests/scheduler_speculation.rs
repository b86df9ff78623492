//! Speculative decoding in the scheduler, against the fake shard (which
//! verifies drafts as a real one does and checks every slot it reads):
//! the same tokens as without drafts, drafts clamped to max_new_tokens and
//! to the step budget, rejected slots never trusted or cached, no block
//! leaked through cancellations and preemptions, no drafts in big batches.

pub mod scheduler_support;

use scheduler_support::*;
use sluice_router::infer::FinishReason;
use sluice_router::scheduler::{SchedulerConfig, SpeculationConfig};
use sluice_router::testing::fake_shard::FakeShardConfig;

/// A fake model whose output repeats itself: n-gram drafts get accepted.
fn echoing(num_blocks: u32) -> FakeShardConfig {
    let mut fake = fake_config(num_blocks, 4);
    fake.echo_probability = 0.7;
    fake.echo_period = 6;
    fake
}

fn speculating(fake: &FakeShardConfig, max_tokens: usize) -> SchedulerConfig {
    let mut config = scheduler_config(fake);
    config.speculation = Some(SpeculationConfig {
        max_tokens,
        ngram_min: 1,
        ngram_max: 3,
        max_batch_size: 64,
        max_step_tokens: usize::MAX,
    });
    config
}

fn drafts_in_steps(handle: &sluice_router::testing::fake_shard::FakeShardHandle) -> (usize, usize) {
    let steps = handle.steps();
    let with = steps.iter().filter(|s| s.scheduled.iter().any(|r| !r.draft_token_ids.is_empty())).count();
    let tokens = steps.iter().flat_map(|s| &s.scheduled).map(|r| r.draft_token_ids.len()).sum();
    (with, tokens)
}

/// Four clients at once, each with its own 12-token prompt (token t of
/// client i is 1 + (t * a + i * b) % 30), 40 tokens each: every one gets
/// its solo tokens.
async fn four_clients(infer: &sluice_router::infer::Infer, fake: &FakeShardConfig, a: u32, b: u32) {
    let tasks: Vec<_> = (0..4u32)
        .map(|i| {
            let infer = infer.clone();
            let fake = fake.clone();
            tokio::spawn(async move {
                let prompt: Vec<u32> = (0..12).map(|t| 1 + (t * a + i * b) % 30).collect();
                let out = generate(&infer, prompt.clone(), 40).await;
                assert_eq!(out.tokens, expected_tokens(&fake, &prompt, 40));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn one_request_gets_its_solo_tokens_in_fewer_steps() {
    let fake = echoing(64);
    let prompt: Vec<u32> = (1..=13).collect();
    let expected = expected_tokens(&fake, &prompt, 60);

    let (plain, plain_handle) = start(fake.clone(), scheduler_config(&fake));
    let off = generate(&plain, prompt.clone(), 60).await;
    assert_eq!(off.tokens, expected);
    assert_eq!(drafts_in_steps(&plain_handle), (0, 0), "no drafts with speculation off");

    let (infer, handle) = start(fake.clone(), speculating(&fake, 4));
    let on = generate(&infer, prompt.clone(), 60).await;
    assert_eq!(on.tokens, expected);
    assert_eq!(on.end, Some((FinishReason::Length, 60)), "never past max_new_tokens");
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(stats.speculative_accepted_tokens > 0, "{stats:?}");
    assert!(stats.speculative_accepted_tokens < stats.speculative_proposed_tokens, "{stats:?}");
    assert!(
        handle.steps().len() < plain_handle.steps().len(),
        "speculation saved no step: {} vs {}",
        handle.steps().len(),
        plain_handle.steps().len()
    );
    for step in handle.steps() {
        for s in &step.scheduled {
            assert!(s.draft_token_ids.len() <= 4);
        }
    }
}

#[tokio::test]
async fn drafts_stop_at_max_new_tokens_and_eos() {
    // Every max_new_tokens from 1 to 12, with EOS now and then: the stream
    // ends exactly where it ends without speculation.
    let mut fake = echoing(128);
    fake.eos_probability = 0.08;
    let (infer, handle) = start(fake.clone(), speculating(&fake, 6));
    for max_new in 1..=12u32 {
        for p in 0..6u32 {
            let prompt: Vec<u32> = (0..9).map(|t| 1 + (t * 7 + p * 13) % 40).collect();
            let out = generate(&infer, prompt.clone(), max_new).await;
            let expected = expected_tokens(&fake, &prompt, max_new);
            assert_eq!(out.tokens, expected, "max_new {max_new}, prompt {p}");
            let reason = if expected.last() == Some(&fake.eos_token_id) { FinishReason::Eos } else { FinishReason::Length };
            assert_eq!(out.end, Some((reason, expected.len() as u32)));
        }
    }
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(stats.speculative_accepted_tokens > 0, "{stats:?}");
}

#[tokio::test]
async fn no_drafts_while_the_batch_is_large() {
    let fake = echoing(256);
    let mut config = speculating(&fake, 4);
    config.speculation.as_mut().unwrap().max_batch_size = 3;
    let (infer, handle) = start(fake.clone(), config);
    let tasks: Vec<_> = (0..8u32)
        .map(|i| {
            let infer = infer.clone();
            let fake = fake.clone();
            tokio::spawn(async move {
                // Different lengths: the batch shrinks as they end.
                let max_new = 8 + i * 8;
                let prompt: Vec<u32> = (0..10).map(|t| 1 + (t * 3 + i * 11) % 50).collect();
                let out = generate(&infer, prompt.clone(), max_new).await;
                assert_eq!(out.tokens, expected_tokens(&fake, &prompt, max_new));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_no_leak(&infer, &handle).await;
    let steps = handle.steps();
    for step in &steps {
        let size = step.scheduled.len() + step.new_requests.len();
        if size > 3 {
            assert!(step.scheduled.iter().all(|s| s.draft_token_ids.is_empty()), "drafts in a batch of {size}");
        }
    }
    // Once most requests ended, the last ones speculate.
    assert!(drafts_in_steps(&handle).0 > 0);
}

#[tokio::test]
async fn drafts_respect_the_step_budget() {
    let fake = echoing(256);
    let mut config = speculating(&fake, 8);
    config.max_batch_prefill_tokens = 6;
    let (infer, handle) = start(fake.clone(), config);
    four_clients(&infer, &fake, 5, 7).await;
    assert_no_leak(&infer, &handle).await;
    for step in handle.steps() {
        let tokens: usize = step.new_requests.iter().map(|r| r.num_new_tokens as usize).sum::<usize>()
            + step.scheduled.iter().map(|r| r.num_new_tokens as usize + r.draft_token_ids.len()).sum::<usize>();
        assert!(tokens <= 6, "a step of {tokens} tokens");
    }
    assert!(drafts_in_steps(&handle).0 > 0);
}

#[tokio::test]
async fn drafts_fill_a_step_up_to_max_step_tokens() {
    let fake = echoing(256);
    let mut config = speculating(&fake, 8);
    if let Some(spec) = config.speculation.as_mut() {
        spec.max_step_tokens = 10;
    }
    let (infer, handle) = start(fake.clone(), config);
    four_clients(&infer, &fake, 3, 11).await;
    assert_no_leak(&infer, &handle).await;
    let mut full = 0;
    for step in handle.steps() {
        let drafts: usize = step.scheduled.iter().map(|r| r.draft_token_ids.len()).sum();
        let tokens = drafts + step.scheduled.iter().map(|r| r.num_new_tokens as usize).sum::<usize>();
        if drafts > 0 {
            assert!(tokens <= 10, "a step of {tokens} tokens with {drafts} drafts");
            full += usize::from(tokens == 10);
        }
    }
    assert!(full > 0, "no step was filled to the limit");
}

/// 600 random requests with speculation, random cancellations, shared
/// prefixes and a KV cache small enough to preempt: every completed request
/// has its solo tokens, the fake shard sees no invalid step (a rejected
/// draft's slot trusted, or cached, would show as wrong KV), no block leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_block_leaks_with_speculation_cancellations_and_preemption() {
    let mut fake = echoing(64);
    fake.eos_probability = 0.03;
    let mut config = speculating(&fake, 5);
    config.max_batch_prefill_tokens = 48;
    config.max_batch_size = 16;
    config.max_concurrent_requests = 48;
    let (infer, handle) = start(fake.clone(), config);

    let bases: Vec<Vec<u32>> = (0..4u32).map(|b| (0..40).map(|t| b * 1000 + (t % 9) + 1).collect()).collect();
    random_requests(&infer, &fake, &bases, 600, 24).await;
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(stats.preemptions > 0, "{stats:?}");
    assert!(stats.speculative_accepted_tokens > 0, "{stats:?}");
    assert!(stats.speculative_accepted_tokens < stats.speculative_proposed_tokens, "{stats:?}");
}
