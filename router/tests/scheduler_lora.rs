//! LoRA adapters in the scheduler: requests for several adapters and the
//! base model share steps; adapters take turns in too few slots; a slot is
//! never reloaded under a running request; the prefix cache never hands one
//! adapter's KV to another; unloading under load fails nothing; an adapter
//! whose files broke fails only its own requests; batch lines and
//! priorities share the slots. The fake shard generates
//! other tokens (and other KV) for every adapter path, and reports a slot
//! changed under a live request as a violation.

pub mod scheduler_support;

use std::time::Duration;

use scheduler_support::*;
use sluice_router::infer::{AdapterError, Infer, InferError, RequestClass, ValidRequest};
use sluice_router::scheduler::SchedulerConfig;
use sluice_router::testing::fake_shard::{adapter_seed, next_token_from, FakeShardConfig, FakeShardHandle};

fn start_lora(max_loras: u32, latency_ms: u64) -> (Infer, FakeShardHandle, FakeShardConfig) {
    let fake = FakeShardConfig {
        max_loras,
        latency: Duration::from_millis(latency_ms),
        ..fake_config(256, 4)
    };
    let config = SchedulerConfig { max_batch_size: 16, ..scheduler_config(&fake) };
    let mut info = shard_info(&config);
    info.max_loras = max_loras;
    let (shard, handle) = sluice_router::testing::fake_shard::FakeShard::new(fake.clone());
    (sluice_router::scheduler::spawn(shard, config, info), handle, fake)
}

fn path(name: &str) -> String {
    format!("/adapters/{name}")
}

fn adapter_request(prompt: Vec<u32>, max_new_tokens: u32, adapter: Option<&str>) -> ValidRequest {
    ValidRequest { adapter: adapter.map(str::to_string), ..request(prompt, max_new_tokens) }
}

/// What the fake generates for `prompt` alone with `adapter` (None: base).
fn expected(fake: &FakeShardConfig, adapter: Option<&str>, prompt: &[u32], n: u32) -> Vec<u32> {
    let seed = adapter_seed(adapter.map(path).as_deref());
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < n as usize {
        let (t, _) = next_token_from(fake, seed, &tokens, true);
        tokens.push(t);
        out.push(t);
        if t == fake.eos_token_id {
            break;
        }
    }
    out
}

async fn run(infer: &Infer, prompt: Vec<u32>, n: u32, adapter: Option<&str>) -> Outcome {
    let mut stream = infer.generate(adapter_request(prompt, n, adapter)).await.expect("accepted");
    read(&mut stream, None).await
}

#[tokio::test]
async fn adapters_and_the_base_model_share_steps_and_take_turns_in_the_slots() {
    let (infer, handle, fake) = start_lora(2, 1);
    let names = ["a", "b", "c", "d"];
    for name in names {
        infer.load_adapter(name.into(), path(name)).await.unwrap();
    }
    let mut tasks = Vec::new();
    for i in 0..48u32 {
        let adapter = (i % 5 != 4).then(|| names[(i % 5) as usize]);
        let prompt: Vec<u32> = (0..(5 + i % 7)).map(|t| 10 + t + 20 * (i % 3)).collect();
        let infer = infer.clone();
        let want = expected(&fake, adapter, &prompt, 6);
        tasks.push(tokio::spawn(async move {
            let out = run(&infer, prompt, 6, adapter).await;
            assert_eq!((out.error, out.tokens), (None, want), "request {i} on {adapter:?}");
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let stats = assert_no_leak(&infer, &handle).await;
    assert_eq!((stats.adapters.slots, stats.adapters.registered), (2, 4));
    assert!(stats.adapters.loaded <= 2 && stats.adapters.evictions >= 2, "{:?}", stats.adapters);
    // Every step's new requests named a slot that held their adapter then;
    // the fake checked it (its KV and tokens depend on the slot's path).
    let on_adapters = handle.steps().iter().flat_map(|s| s.new_requests.clone()).filter(|r| r.adapter_slot > 0).count();
    assert!(on_adapters >= 36, "{on_adapters}");
}

#[tokio::test]
async fn the_prefix_cache_is_per_adapter() {
    let (infer, handle, fake) = start_lora(2, 0);
    infer.load_adapter("a".into(), path("a")).await.unwrap();
    infer.load_adapter("b".into(), path("b")).await.unwrap();
    let prompt: Vec<u32> = (1..=13).collect();
    let first = run(&infer, prompt.clone(), 2, Some("a")).await;
    assert_eq!(first.cached_tokens, 0);
    // The same prompt on another adapter, or the base model: nothing cached.
    let other = run(&infer, prompt.clone(), 2, Some("b")).await;
    let base = run(&infer, prompt.clone(), 2, None).await;
    assert_eq!((other.cached_tokens, base.cached_tokens), (0, 0));
    // On the same adapter again: its own blocks.
    let again = run(&infer, prompt.clone(), 2, Some("a")).await;
    assert_eq!(again.cached_tokens, 12);
    assert_eq!(again.tokens, expected(&fake, Some("a"), &prompt, 2));
    assert_eq!(other.tokens, expected(&fake, Some("b"), &prompt, 2));
    assert_ne!(again.tokens, other.tokens);
    // An adapter unloaded and loaded again (maybe from new files) starts a
    // new cache.
    infer.unload_adapter("a".into()).await.unwrap();
    infer.load_adapter("a".into(), path("a")).await.unwrap();
    assert_eq!(run(&infer, prompt, 2, Some("a")).await.cached_tokens, 0);
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn unloading_under_load_fails_no_request_and_frees_the_slot() {
    let (infer, handle, fake) = start_lora(2, 2);
    infer.load_adapter("a".into(), path("a")).await.unwrap();
    infer.load_adapter("b".into(), path("b")).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..20u32 {
        let adapter = if i % 2 == 0 { "a" } else { "b" };
        let prompt = vec![3 + i, 4, 5, 6, 7];
        let infer = infer.clone();
        let want = expected(&fake, Some(adapter), &prompt, 12);
        tasks.push(tokio::spawn(async move {
            let out = run(&infer, prompt, 12, Some(adapter)).await;
            assert_eq!((out.error, out.tokens), (None, want));
        }));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    infer.unload_adapter("a".into()).await.unwrap();
    // New requests may no longer name it; those in flight finish with it.
    let refused = infer.generate(adapter_request(vec![1, 2], 2, Some("a"))).await.unwrap_err();
    assert_eq!(refused, InferError::UnknownAdapter(AdapterError::Unknown { name: "a".into(), known: vec!["b".into()] }));
    for task in tasks {
        task.await.unwrap();
    }
    let stats = assert_no_leak(&infer, &handle).await;
    // `a`'s slot is emptied on the shard at the next point between steps.
    run(&infer, vec![9, 9, 9], 1, None).await;
    let stats_after = wait_idle(&infer).await;
    assert_eq!((stats_after.adapters.registered, stats_after.adapters.held, stats_after.adapters.loaded), (1, 1, 1));
    assert!(handle.adapter_calls().iter().any(|(_, p)| p.is_empty()), "no UnloadAdapter: {:?}", handle.adapter_calls());
    assert_eq!(handle.adapter_slots().iter().flatten().collect::<Vec<_>>(), [&path("b")]);
    assert_eq!(stats.blocks_free + stats.blocks_cached, stats.blocks_total);
}

#[tokio::test]
async fn an_adapter_that_breaks_fails_only_its_own_requests() {
    let (infer, handle, fake) = start_lora(1, 1);
    infer.load_adapter("a".into(), path("a")).await.unwrap();
    infer.load_adapter("b".into(), path("b")).await.unwrap(); // checked, then evicts `a`
    handle.break_adapter(&path("a"));
    let broken = run(&infer, vec![5, 6, 7], 3, Some("a")).await;
    match broken.error {
        Some(InferError::Generation(message)) => {
            assert!(message.contains("`a` cannot be loaded"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Its name is gone; the others serve on.
    assert!(matches!(infer.generate(adapter_request(vec![1], 1, Some("a"))).await, Err(InferError::UnknownAdapter(_))));
    assert_eq!(run(&infer, vec![5, 6, 7], 3, Some("b")).await.tokens, expected(&fake, Some("b"), &[5, 6, 7], 3));
    assert_eq!(run(&infer, vec![5, 6, 7], 3, None).await.tokens, expected(&fake, None, &[5, 6, 7], 3));
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn a_request_for_a_cold_adapter_is_not_starved_by_busy_ones() {
    // One slot; `hot` requests keep arriving, each admitted as soon as
    // there is room: the one `cold` request must still get the slot.
    let (infer, handle, _) = start_lora(1, 1);
    infer.load_adapter("hot".into(), path("hot")).await.unwrap();
    infer.load_adapter("cold".into(), path("cold")).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hot = Vec::new();
    for i in 0..8u32 {
        let (infer, stop) = (infer.clone(), stop.clone());
        hot.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = run(&infer, vec![1 + i, 2, 3], 4, Some("hot")).await;
                assert_eq!(out.error, None);
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let cold = tokio::time::timeout(Duration::from_secs(20), run(&infer, vec![7, 8, 9], 4, Some("cold"))).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(cold.expect("the cold adapter's request was starved").error, None);
    for task in hot {
        task.await.unwrap();
    }
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn loads_name_the_problem() {
    let (infer, _, _) = start_lora(1, 0);
    let refused = infer.load_adapter("x".into(), "/adapters/bad".into()).await.unwrap_err();
    assert_eq!(
        refused,
        AdapterError::Refused { name: "x".into(), message: "/adapters/bad is not a PEFT folder".into() }
    );
    infer.load_adapter("x".into(), path("x")).await.unwrap();
    assert!(matches!(
        infer.load_adapter("x".into(), path("y")).await,
        Err(AdapterError::Invalid { field: "lora_name", .. })
    ));
    assert_eq!(
        infer.unload_adapter("nope".into()).await,
        Err(AdapterError::Unknown { name: "nope".into(), known: vec!["x".into()] })
    );
    let (off, _, _) = start_lora(0, 0);
    assert_eq!(off.load_adapter("x".into(), path("x")).await, Err(AdapterError::Disabled));
}

#[tokio::test]
async fn batch_lines_and_priorities_share_the_slots_with_interactive_requests() {
    // Three adapters in two slots; batch lines fill the batch, interactive
    // requests of every priority arrive among them and preempt them: every
    // request gets its own adapter's tokens, nothing leaks, no slot changes
    // under a request that uses it.
    let (infer, handle, fake) = start_lora(2, 1);
    let names = ["a", "b", "c"];
    for name in names {
        infer.load_adapter(name.into(), path(name)).await.unwrap();
    }
    let mut tasks = Vec::new();
    for i in 0..40u32 {
        let batch = i % 3 != 0;
        let adapter = (i % 4 != 3).then(|| names[(i % 3) as usize]);
        let prompt: Vec<u32> = (0..(6 + i % 5)).map(|t| 30 + t + 17 * (i % 4)).collect();
        let want = expected(&fake, adapter, &prompt, 5);
        let mut request = adapter_request(prompt, 5, adapter);
        request.class = if batch { RequestClass::Batch } else { RequestClass::Interactive };
        request.priority = (i % 3) as i32 - 1;
        let infer = infer.clone();
        tasks.push(tokio::spawn(async move {
            let mut stream = infer.generate(request).await.expect("accepted");
            let out = read(&mut stream, None).await;
            assert_eq!((out.error, out.tokens), (None, want), "request {i} (batch: {batch}) on {adapter:?}");
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let stats = assert_no_leak(&infer, &handle).await;
    assert_eq!((stats.adapters.slots, stats.adapters.registered), (2, 3));
    assert!(handle.violations().is_empty(), "{:?}", handle.violations());
}
