//! Helpers shared by the scheduler tests: a scheduler on a `FakeShard`, and
//! a client that reads a request's whole event stream.
//!
//! Each test binary declares this module `pub` (`pub mod scheduler_support`):
//! it is a small library of which every binary uses a part, and every helper
//! is used by at least one of them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use sluice_router::testing::fake_shard::{next_token, FakeShard, FakeShardConfig, FakeShardHandle};
use sluice_router::infer::{
    FinishReason, Infer, InferError, InferEvent, InferStream, RequestClass, SamplingParameters, SchedulerStats, ShardInfo,
    ValidRequest,
};
use sluice_router::scheduler::{spawn, SchedulerConfig};

pub fn fake_config(num_blocks: u32, block_size: u32) -> FakeShardConfig {
    FakeShardConfig { num_blocks, block_size, ..Default::default() }
}

pub fn scheduler_config(fake: &FakeShardConfig) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_prefill_tokens: 64,
        max_batch_total_tokens: fake.num_blocks * fake.block_size,
        max_batch_size: 32,
        max_concurrent_requests: 128,
        block_size: fake.block_size,
        num_blocks: fake.num_blocks,
        prefix_caching: true,
        eos_token_ids: vec![fake.eos_token_id],
        metrics_window: Duration::from_secs(60),
        step_deadline: Default::default(),
        panic_at_step: None,
        speculation: None,
        batch_min_share: 0.1,
        batch_step_slack: 0.1,
        hourly_cost: None,
        decode_steps: 1,
        decode_stall: None,
    }
}

pub fn shard_info(config: &SchedulerConfig) -> ShardInfo {
    ShardInfo {
        max_loras: 0,
        model_type: "fake".into(),
        dtype: "float32".into(),
        device_type: "cpu".into(),
        world_size: 1,
        block_size: config.block_size,
        vocab_size: 1000,
        eos_token_ids: config.eos_token_ids.clone(),
        max_position_embeddings: 1 << 16,
        num_blocks: config.num_blocks,
        attention_backend: "torch".into(),
        total_parameters: 0,
        active_parameters: 0,
    }
}

pub fn start(fake: FakeShardConfig, config: SchedulerConfig) -> (Infer, FakeShardHandle) {
    let info = shard_info(&config);
    let (shard, handle) = FakeShard::new(fake);
    (spawn(shard, config, info), handle)
}

pub fn request(prompt: Vec<u32>, max_new_tokens: u32) -> ValidRequest {
    ValidRequest {
        input_ids: prompt,
        max_new_tokens,
        params: SamplingParameters::default(),
        ignore_eos: false,
        min_tokens: 0,
        logprobs: false,
        top_n_tokens: 0,
        prompt_logprobs: false,
        grammar: None,
        adapter: None,
        arrived: Instant::now(),
        priority: 0,
        class: RequestClass::Interactive,
    }
}

/// Everything one request's stream said.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub prefills: usize,
    pub cached_tokens: u32,
    pub prompt_logprobs: usize,
    pub tokens: Vec<u32>,
    pub end: Option<(FinishReason, u32)>,
    pub error: Option<InferError>,
}

/// Reads a stream to its end (or the first `limit` tokens).
pub async fn read(stream: &mut InferStream, limit: Option<usize>) -> Outcome {
    let mut out = Outcome::default();
    read_into(stream, &mut out, limit).await;
    out
}

/// Continues reading into `out`, until the stream ends or `out` holds
/// `limit` tokens.
pub async fn read_into(stream: &mut InferStream, out: &mut Outcome, limit: Option<usize>) {
    while limit.is_none_or(|l| out.tokens.len() < l) {
        let event = tokio::time::timeout(Duration::from_secs(30), stream.recv()).await.expect("stream stalled");
        match event {
            None => break,
            Some(Ok(InferEvent::Prefill { cached_tokens, prompt_logprobs, .. })) => {
                assert_eq!(out.tokens.len(), 0, "Prefill after a token");
                out.prefills += 1;
                out.cached_tokens = cached_tokens;
                out.prompt_logprobs = prompt_logprobs.len();
            }
            Some(Ok(InferEvent::Token(t))) => {
                assert_eq!(out.prefills, 1, "Token before Prefill");
                assert!(out.end.is_none(), "Token after End");
                out.tokens.push(t.token_id);
            }
            Some(Ok(InferEvent::End { reason, generated_tokens, .. })) => {
                assert!(out.end.is_none(), "two Ends");
                out.end = Some((reason, generated_tokens));
            }
            Some(Err(e)) => {
                out.error = Some(e);
                break;
            }
        }
    }
}

pub async fn generate(infer: &Infer, prompt: Vec<u32>, max_new_tokens: u32) -> Outcome {
    let mut stream = infer.generate(request(prompt, max_new_tokens)).await.expect("accepted");
    read(&mut stream, None).await
}

/// What the fake shard generates for `prompt` run alone: the reference
/// every scheduled run must reproduce.
pub fn expected_tokens(fake: &FakeShardConfig, prompt: &[u32], max_new_tokens: u32) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new_tokens as usize {
        let (t, _) = next_token(fake, &seq, true);
        seq.push(t);
        out.push(t);
        if t == fake.eos_token_id {
            break;
        }
    }
    out
}

/// Polls until no request is waiting or running.
pub async fn wait_idle(infer: &Infer) -> SchedulerStats {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = infer.stats().await.expect("scheduler alive");
        if stats.waiting == 0 && stats.running == 0 {
            return stats;
        }
        assert!(Instant::now() < deadline, "scheduler never went idle: {stats:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// After every request ended, every block is free or cached.
pub async fn assert_no_leak(infer: &Infer, handle: &FakeShardHandle) -> SchedulerStats {
    let stats = wait_idle(infer).await;
    assert_eq!(stats.blocks_free + stats.blocks_cached, stats.blocks_total, "leaked blocks: {stats:?}");
    assert_eq!(handle.violations(), Vec::<String>::new());
    stats
}

/// `n` random requests, 40 in flight: each prompt is a random prefix of one
/// of `bases` (shared "system prompts", so the tree matters) plus up to 11
/// random tokens, with 1..=`max_new` new tokens; a quarter are cancelled part
/// way. Every one must read what the fake generates for it alone. Returns
/// the prompt tokens served from the prefix cache.
pub async fn random_requests(infer: &Infer, fake: &FakeShardConfig, bases: &[Vec<u32>], n: u64, max_new: u32) -> u64 {
    let gate = Arc::new(tokio::sync::Semaphore::new(40));
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut rng = StdRng::seed_from_u64(i);
        let base = &bases[rng.gen_range(0..bases.len())];
        let mut prompt = base[..rng.gen_range(1..=base.len())].to_vec();
        for _ in 0..rng.gen_range(0..12) {
            prompt.push(rng.gen_range(1..900));
        }
        let max_new = rng.gen_range(1..=max_new);
        let cancel_after = rng.gen_bool(0.25).then(|| rng.gen_range(0..max_new as usize));
        let infer = infer.clone();
        let fake = fake.clone();
        let permit = gate.clone().acquire_owned().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let mut stream = loop {
                match infer.generate(request(prompt.clone(), max_new)).await {
                    Ok(s) => break s,
                    Err(InferError::Overloaded(_)) => tokio::time::sleep(Duration::from_millis(1)).await,
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
    cached
}
