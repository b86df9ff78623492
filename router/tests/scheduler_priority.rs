//! Priorities and the batch class (scheduler/queue.rs, admission.rs,
//! preemption.rs, share.rs): lower `priority` first, interactive requests
//! before batch lines, batch lines preempted first when an interactive
//! request finds no room, and the batch floor (`batch_min_share`) that keeps
//! them from starving, and the step-time slack that bounds batch work
//! beside interactive requests. Every request still gets its solo tokens, and no
//! block leaks.

pub mod scheduler_support;

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use scheduler_support::*;
use sluice_router::infer::{Infer, InferError, RequestClass, ValidRequest};

fn classed(prompt: Vec<u32>, max_new_tokens: u32, class: RequestClass, priority: i32) -> ValidRequest {
    ValidRequest { class, priority, ..request(prompt, max_new_tokens) }
}

async fn submit(infer: &Infer, r: ValidRequest) -> sluice_router::infer::InferStream {
    infer.generate(r).await.expect("accepted")
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..6).map(|t| seed * 50 + t + 1).collect()
}

#[tokio::test]
async fn an_interactive_request_preempts_batch_lines_down_to_their_floor() {
    let mut fake = fake_config(256, 4);
    fake.latency = Duration::from_millis(2);
    let mut config = scheduler_config(&fake);
    config.max_batch_size = 4;
    config.batch_min_share = 0.25; // one slot stays with the batch
    let (infer, handle) = start(fake.clone(), config);

    let mut lines = Vec::new();
    for i in 0..4 {
        lines.push(submit(&infer, classed(prompt(i), 60, RequestClass::Batch, 0)).await);
    }
    let mut started = Vec::new();
    for stream in &mut lines {
        started.push(read(stream, Some(1)).await); // every slot holds a batch line
    }
    let mut interactive = Vec::new();
    for i in 0..3 {
        interactive.push(submit(&infer, classed(prompt(10 + i), 5, RequestClass::Interactive, 0)).await);
    }
    for (i, stream) in interactive.iter_mut().enumerate() {
        let out = read(stream, None).await;
        assert_eq!(out.tokens, expected_tokens(&fake, &prompt(10 + i as u32), 5));
    }
    let stats = infer.stats().await.unwrap();
    assert!(stats.preemptions >= 3, "three batch lines made room: {stats:?}");
    // The floor's line never stopped: it is well past the others.
    let mut outs = Vec::new();
    for (i, (stream, mut out)) in lines.iter_mut().zip(started).enumerate() {
        read_into(stream, &mut out, None).await;
        assert_eq!(out.error, None);
        assert_eq!(out.tokens, expected_tokens(&fake, &prompt(i as u32), 60), "a resumed batch line differs");
        outs.push(out);
    }
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn lower_priority_numbers_are_admitted_first() {
    let mut fake = fake_config(256, 4);
    fake.latency = Duration::from_millis(2);
    let mut config = scheduler_config(&fake);
    config.max_batch_size = 1;
    let (infer, handle) = start(fake.clone(), config);

    let mut holder = submit(&infer, classed(prompt(0), 100, RequestClass::Interactive, 0)).await;
    let mut holder_out = read(&mut holder, Some(1)).await; // it holds the only slot
    // Queued together (one command), so only their rank orders them.
    let queued = [
        ("late", classed(prompt(1), 3, RequestClass::Interactive, 5)),
        ("urgent", classed(prompt(2), 3, RequestClass::Interactive, -1)),
        ("batch", classed(prompt(3), 3, RequestClass::Batch, -100)),
        ("plain", classed(prompt(4), 3, RequestClass::Interactive, 0)),
    ];
    let names: Vec<&str> = queued.iter().map(|(name, _)| *name).collect();
    let streams = infer
        .generate_all(queued.into_iter().map(|(_, r)| (r, tracing::Span::none())).collect())
        .await
        .expect("accepted");
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = names
        .into_iter()
        .zip(streams)
        .map(|(name, mut stream)| {
            let order = order.clone();
            tokio::spawn(async move {
                let out = read(&mut stream, None).await;
                assert_eq!(out.error, None);
                order.lock().unwrap().push(name);
            })
        })
        .collect();
    read_into(&mut holder, &mut holder_out, None).await;
    assert_eq!(holder_out.tokens.len(), 100);
    for task in tasks {
        task.await.unwrap();
    }
    // Class first (a batch line's priority never lifts it above an
    // interactive request), then priority.
    assert_eq!(*order.lock().unwrap(), ["urgent", "plain", "late", "batch"]);
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn the_batch_floor_keeps_batch_lines_running_under_a_flood() {
    let mut fake = fake_config(512, 4);
    fake.latency = Duration::from_millis(1);
    let mut config = scheduler_config(&fake);
    config.max_batch_size = 4;
    config.batch_min_share = 0.5;
    let (infer, handle) = start(fake.clone(), config);

    let mut flood = Vec::new();
    for i in 0..12 {
        flood.push(submit(&infer, classed(prompt(i), 30, RequestClass::Interactive, 0)).await);
    }
    let mut batch = Vec::new();
    for i in 0..2 {
        batch.push(submit(&infer, classed(prompt(20 + i), 10, RequestClass::Batch, 0)).await);
    }
    // The batch lines finish while the interactive flood still waits: they
    // were admitted into their floor, not after everything else.
    for (i, stream) in batch.iter_mut().enumerate() {
        let out = read(stream, None).await;
        assert_eq!(out.tokens, expected_tokens(&fake, &prompt(20 + i as u32), 10));
    }
    let stats = infer.stats().await.unwrap();
    assert!(stats.waiting > 0, "the flood should still be queued: {stats:?}");
    for stream in &mut flood {
        assert_eq!(read(stream, None).await.error, None);
    }
    // Without a floor, the same lines wait for the whole flood.
    let mut config = scheduler_config(&fake);
    config.max_batch_size = 4;
    config.batch_min_share = 0.0;
    let (infer, _handle) = start(fake.clone(), config);
    let mut flood = Vec::new();
    for i in 0..12 {
        flood.push(submit(&infer, classed(prompt(i), 30, RequestClass::Interactive, 0)).await);
    }
    let mut line = submit(&infer, classed(prompt(20), 10, RequestClass::Batch, 0)).await;
    let _ = read(&mut line, Some(1)).await;
    let stats = infer.stats().await.unwrap();
    assert_eq!(stats.waiting + stats.running, 1, "only the batch line is left when it starts: {stats:?}");
    assert_no_leak(&infer, &handle).await;
}

/// While interactive requests run, batch lines add only the tokens that keep
/// a step within `batch_step_slack` of its interactive part's time, as
/// learnt from the steps run (scheduler/cost.rs); with none running they
/// fill the step. Time is paused, so the fake shard's step times (10 ms +
/// 1 ms a token) are what the scheduler measures.
#[tokio::test(start_paused = true)]
async fn batch_work_keeps_interactive_steps_within_the_slack() {
    let mut fake = fake_config(2048, 4);
    fake.latency = Duration::from_millis(10);
    fake.latency_per_token = Duration::from_millis(1);
    let mut config = scheduler_config(&fake);
    config.max_batch_size = 16;
    config.max_batch_prefill_tokens = 128;
    config.batch_step_slack = 0.2;
    let slack = config.batch_step_slack;
    let (infer, handle) = start(fake.clone(), config);

    // Interactive traffic alone, then a batch alone: both sizes are seen.
    let mut warm: Vec<_> = Vec::new();
    for i in 0..2 {
        warm.push(submit(&infer, classed(prompt(i), 20, RequestClass::Interactive, 0)).await);
    }
    for stream in &mut warm {
        assert_eq!(read(stream, None).await.error, None);
    }
    let long = |seed: u32| -> Vec<u32> { (0..60).map(|t| seed * 100 + t + 1).collect() };
    let mut lines = Vec::new();
    for i in 0..8 {
        lines.push(submit(&infer, classed(long(10 + i), 200, RequestClass::Batch, 0)).await);
    }
    let mut started = Vec::new();
    for stream in &mut lines {
        started.push(read(stream, Some(1)).await);
    }
    let first_shared_step = handle.steps().len();
    // Ids follow submission: 0-1 warm-up, 2-9 batch lines, 10-11 interactive.
    let mut interactive = Vec::new();
    for i in 0..2 {
        interactive.push(submit(&infer, classed(prompt(30 + i), 30, RequestClass::Interactive, 0)).await);
    }
    for (i, stream) in interactive.iter_mut().enumerate() {
        let out = read(stream, None).await;
        assert_eq!(out.tokens, expected_tokens(&fake, &prompt(30 + i as u32), 30));
    }

    let (mut shared_steps, mut batch_moved) = (0, 0);
    for step in &handle.steps()[first_shared_step..] {
        let tokens = |interactive: bool| -> u32 {
            let is = |id: u64| (id >= 10) == interactive;
            step.new_requests.iter().filter(|r| is(r.id)).map(|r| r.num_new_tokens).sum::<u32>()
                + step.scheduled.iter().filter(|s| is(s.id)).map(|s| s.num_new_tokens).sum::<u32>()
        };
        // Steps built while interactive requests ran (not the one admitting them).
        if !step.scheduled.iter().any(|s| s.id >= 10) {
            continue;
        }
        shared_steps += 1;
        let (inter, batch) = (tokens(true), tokens(false));
        let allowed = (slack * f64::from(10 + inter)).floor() as u32;
        // One token of rounding (tokio's timer counts whole milliseconds),
        // and at least one batch token a step.
        assert!(batch <= allowed.max(1) + 1, "{batch} batch tokens beside {inter} interactive ones: {step:?}");
        batch_moved += u32::from(batch > 0);
    }
    assert!(shared_steps >= 25, "the interactive requests decoded beside the batch: {shared_steps} steps");
    assert_eq!(batch_moved, shared_steps, "batch lines moved in every step");

    // Alone again, the batch fills its steps: all 8 lines decode together.
    let before = handle.steps().len();
    for (i, (stream, mut out)) in lines.iter_mut().zip(started).enumerate() {
        read_into(stream, &mut out, None).await;
        assert_eq!(out.tokens, expected_tokens(&fake, &long(10 + i as u32), 200), "batch line {i} differs");
    }
    let widest = handle.steps()[before..].iter().map(|s| s.scheduled.len()).max().unwrap_or(0);
    assert_eq!(widest, 8, "the batch alone ran all its lines in one step");
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn batch_lines_do_not_count_toward_the_concurrency_limit() {
    let mut fake = fake_config(256, 4);
    fake.latency = Duration::from_millis(2);
    let mut config = scheduler_config(&fake);
    config.max_concurrent_requests = 2;
    let (infer, handle) = start(fake.clone(), config);
    let mut lines = Vec::new();
    for i in 0..6 {
        lines.push(submit(&infer, classed(prompt(i), 4, RequestClass::Batch, 0)).await);
    }
    let mut a = submit(&infer, classed(prompt(7), 100, RequestClass::Interactive, 0)).await;
    let mut b = submit(&infer, classed(prompt(8), 100, RequestClass::Interactive, 0)).await;
    let refused = infer.generate(classed(prompt(9), 4, RequestClass::Interactive, 0)).await;
    assert!(matches!(refused, Err(InferError::Overloaded(_))), "the third interactive request is over the limit");
    for stream in lines.iter_mut().chain([&mut a, &mut b]) {
        assert_eq!(read(stream, None).await.error, None);
    }
    assert_no_leak(&infer, &handle).await;
}

/// 400 random requests of both classes and random priorities, a quarter
/// cancelled part way, over a KV cache small enough to force preemption:
/// every one gets its solo tokens, the fake shard sees no invalid step, the
/// scheduler's invariants hold after every step (debug assertions), and no
/// block leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_classes_and_priorities_keep_the_invariants() {
    let mut fake = fake_config(48, 4);
    fake.eos_probability = 0.05;
    let mut config = scheduler_config(&fake);
    config.max_batch_prefill_tokens = 32;
    config.max_batch_size = 12;
    config.max_concurrent_requests = 40;
    config.batch_min_share = 0.2;
    let (infer, handle) = start(fake.clone(), config);
    let bases: Vec<Vec<u32>> = (0..3u32).map(|b| (0..24).map(|t| b * 1000 + t + 1).collect()).collect();
    let gate = Arc::new(tokio::sync::Semaphore::new(40));
    let mut tasks = Vec::new();
    for i in 0..400u64 {
        let mut rng = StdRng::seed_from_u64(i);
        let base = &bases[rng.gen_range(0..bases.len())];
        let mut prompt = base[..rng.gen_range(1..=base.len())].to_vec();
        for _ in 0..rng.gen_range(0..8) {
            prompt.push(rng.gen_range(1..900));
        }
        let max_new = rng.gen_range(1..=16);
        let class = if rng.gen_bool(0.5) { RequestClass::Batch } else { RequestClass::Interactive };
        let priority = rng.gen_range(-2..=2);
        let cancel_after = rng.gen_bool(0.25).then(|| rng.gen_range(0..max_new as usize));
        let (infer, fake) = (infer.clone(), fake.clone());
        let permit = gate.clone().acquire_owned().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let mut stream = loop {
                match infer.generate(classed(prompt.clone(), max_new, class, priority)).await {
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
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(stats.preemptions > 0, "the load was meant to force preemption: {stats:?}");
}
