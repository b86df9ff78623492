//! Multi-step decode in the scheduler, against the fake shard (which draws
//! one token after another as a real shard does and checks every slot it
//! reads): the same tokens as one token per step, in fewer steps, never
//! past max_new_tokens or an EOS token, one token per step while anything
//! waits, and no block leaked through cancellations and preemptions.

pub mod scheduler_support;

use scheduler_support::*;
use sluice_router::infer::FinishReason;
use sluice_router::scheduler::SchedulerConfig;
use sluice_router::testing::fake_shard::{FakeShardConfig, FakeShardHandle};

fn multi_step(fake: &FakeShardConfig, decode_steps: u32) -> SchedulerConfig {
    SchedulerConfig { decode_steps, ..scheduler_config(fake) }
}

/// The most tokens one step asked a request to draw.
fn most_draws(handle: &FakeShardHandle) -> u32 {
    handle.steps().iter().flat_map(|s| &s.scheduled).map(|r| r.decode_steps).max().unwrap_or(0)
}

#[tokio::test]
async fn one_request_gets_its_solo_tokens_in_fewer_steps() {
    let fake = fake_config(64, 4);
    let prompt: Vec<u32> = (1..=13).collect();
    let expected = expected_tokens(&fake, &prompt, 61);

    let (plain, plain_handle) = start(fake.clone(), scheduler_config(&fake));
    assert_eq!(generate(&plain, prompt.clone(), 61).await.tokens, expected);
    assert_eq!(most_draws(&plain_handle), 0, "decode_steps 1 never asks for more");

    let (infer, handle) = start(fake.clone(), multi_step(&fake, 8));
    let out = generate(&infer, prompt.clone(), 61).await;
    assert_eq!(out.tokens, expected);
    assert_eq!(out.end, Some((FinishReason::Length, 61)), "never past max_new_tokens");
    assert_no_leak(&infer, &handle).await;
    assert_eq!(most_draws(&handle), 8);
    // The prefill draws the first token (and teaches the step cost), then
    // 60 in steps of 8 (the last asks for the 4 left).
    assert_eq!(handle.steps().len(), 1 + 60usize.div_ceil(8), "{} steps", handle.steps().len());
    let last = handle.steps().into_iter().rev().find(|s| !s.scheduled.is_empty()).unwrap();
    assert_eq!(last.scheduled[0].decode_steps, 4, "the last step asks only for what is left");
    assert!(plain_handle.steps().len() > 60);
}

#[tokio::test]
async fn an_eos_token_ends_the_draws_unless_eos_is_ignored() {
    let mut fake = fake_config(64, 4);
    // Tokens 5, 6, 7, EOS, 9, ... whatever the request.
    fake.script = vec![5, 6, 7, fake.eos_token_id, 9, 10, 11, 12, 13, 14];
    let (infer, handle) = start(fake.clone(), multi_step(&fake, 8));
    // Warm the step costs, so the next requests' decodes ask for 8.
    generate(&infer, vec![1, 2, 3], 2).await;

    let out = generate(&infer, vec![1, 2, 3], 10).await;
    assert_eq!(out.tokens, vec![5, 6, 7, fake.eos_token_id]);
    assert_eq!(out.end, Some((FinishReason::Eos, 4)));
    let steps = handle.steps();
    let stops = &steps.last().unwrap().scheduled[0].stop_token_ids;
    assert_eq!(stops, &vec![fake.eos_token_id], "the shard is told where to stop");

    let mut ignoring = request(vec![1, 2, 3], 10);
    ignoring.ignore_eos = true;
    let mut stream = infer.generate(ignoring).await.unwrap();
    let out = read(&mut stream, None).await;
    assert_eq!(out.tokens, fake.script);
    assert_eq!(out.end, Some((FinishReason::Length, 10)));
    // The prefill drew 5; then 8 draws with no stop token, then the 1 left.
    let steps = handle.steps();
    let multi = &steps[steps.len() - 2].scheduled[0];
    assert_eq!((multi.decode_steps, multi.stop_token_ids.len()), (8, 0), "{multi:?}");
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn arrivals_are_admitted_between_multi_steps_and_share_them() {
    let mut fake = fake_config(128, 4);
    // Steps take time, so the first request still runs when the second comes.
    fake.latency = std::time::Duration::from_millis(3);
    let (infer, handle) = start(fake.clone(), multi_step(&fake, 4));
    let first: Vec<u32> = (1..=9).collect();
    let mut stream = infer.generate(request(first.clone(), 40)).await.unwrap();
    let head = read(&mut stream, Some(10)).await;
    // A second request arrives while the first decodes several per step.
    let second: Vec<u32> = (20..=31).collect();
    let other = generate(&infer, second.clone(), 30).await;
    let mut rest = head.clone();
    read_into(&mut stream, &mut rest, None).await;
    assert_eq!(rest.tokens, expected_tokens(&fake, &first, 40));
    assert_eq!(other.tokens, expected_tokens(&fake, &second, 30));
    assert_no_leak(&infer, &handle).await;
    // Its prefill ran in a step of single draws; afterwards both drew 4.
    let steps = handle.steps();
    let admitted = steps.iter().position(|s| s.new_requests.iter().any(|r| r.token_ids == second)).unwrap();
    assert!(steps[admitted].scheduled.iter().all(|r| r.decode_steps == 0), "{:?}", steps[admitted]);
    assert!(steps[admitted..].iter().any(|s| s.scheduled.len() == 2 && s.scheduled.iter().all(|r| r.decode_steps == 4)));
}

#[tokio::test]
async fn draws_fit_the_free_blocks_and_never_preempt() {
    // 6 blocks of 4 slots: two requests of 5 + 7 tokens leave few spare
    // slots; multi-step must draw what fits, never preempting the other.
    let fake = fake_config(6, 4);
    let (infer, handle) = start(fake.clone(), multi_step(&fake, 8));
    let a = tokio::spawn({
        let infer = infer.clone();
        async move { generate(&infer, vec![1, 2, 3, 4, 5], 7).await }
    });
    let b = generate(&infer, vec![9, 8, 7, 6, 5, 4, 3], 5).await;
    let a = a.await.unwrap();
    assert_eq!(a.tokens, expected_tokens(&fake, &[1, 2, 3, 4, 5], 7));
    assert_eq!(b.tokens, expected_tokens(&fake, &[9, 8, 7, 6, 5, 4, 3], 5));
    let stats = assert_no_leak(&infer, &handle).await;
    assert_eq!(stats.preemptions, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_block_leaks_after_500_random_requests_with_cancellations() {
    let mut fake = fake_config(64, 4);
    fake.eos_probability = 0.05;
    let mut config = multi_step(&fake, 6);
    config.max_batch_prefill_tokens = 48;
    config.max_batch_size = 16;
    config.max_concurrent_requests = 48;
    let (infer, handle) = start(fake.clone(), config);
    let bases: Vec<Vec<u32>> = (0..4u32).map(|b| (0..40).map(|t| b * 1000 + t + 1).collect()).collect();
    let cached = random_requests(&infer, &fake, &bases, 500, 24).await;
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(cached > 0, "shared prefixes were never served from cache");
    assert!(most_draws(&handle) > 1, "no step drew several tokens");
    assert!(stats.preemptions > 0, "{stats:?}");
}
