//! Shard failures fail only the requests they touch; the scheduler serves on.

pub mod scheduler_support;

use std::time::Duration;

use scheduler_support::*;
use sluice_router::infer::{InferError, SchedulerFailure};
use sluice_router::scheduler::StepDeadline;

#[tokio::test]
async fn a_failing_step_fails_its_requests_and_the_scheduler_keeps_serving() {
    let mut fake = fake_config(64, 4);
    fake.latency = Duration::from_millis(2);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));

    let mut a = infer.generate(request(vec![1, 2, 3, 4, 5], 50)).await.unwrap();
    let mut b = infer.generate(request(vec![6, 7, 8], 50)).await.unwrap();
    let mut a_out = read(&mut a, Some(2)).await;
    handle.fail_next_steps(1);
    read_into(&mut a, &mut a_out, None).await;
    let b_out = read(&mut b, None).await;
    for out in [&a_out, &b_out] {
        // Not the gRPC status the shard answered with: that is for the log.
        assert!(
            matches!(out.error, Some(InferError::Generation(ref m)) if m.contains("the server log has the details") && !m.contains("injected")),
            "{out:?}"
        );
    }

    let stats = wait_idle(&infer).await;
    assert_eq!(stats.blocks_free, 64, "failed requests' blocks are back and the cache was dropped");
    let c = generate(&infer, vec![1, 2, 3, 4, 5], 4).await;
    assert_eq!(c.tokens, expected_tokens(&fake, &[1, 2, 3, 4, 5], 4));
    assert_eq!(c.cached_tokens, 0, "nothing cached survives a failed step");
    // The failed requests were dropped on the shard with the next step.
    let last = handle.steps().into_iter().find(|s| s.new_requests.iter().any(|n| n.id == 2)).unwrap();
    assert!(last.finished_ids.contains(&0) && last.finished_ids.contains(&1), "{last:?}");
    assert_no_leak(&infer, &handle).await;
}

#[tokio::test]
async fn a_request_error_fails_only_that_request() {
    let mut fake = fake_config(64, 4);
    fake.latency = Duration::from_millis(2);
    let (infer, handle) = start(fake.clone(), scheduler_config(&fake));

    let mut a = infer.generate(request(vec![1, 2, 3], 20)).await.unwrap();
    let mut b = infer.generate(request(vec![4, 5, 6], 20)).await.unwrap();
    let mut a_out = read(&mut a, Some(1)).await;
    handle.fail_request(0);
    read_into(&mut a, &mut a_out, None).await;
    let b_out = read(&mut b, None).await;
    // The client reads a stable text with the request's id, never what the
    // shard said (Python exception text): that goes to the log.
    assert!(
        matches!(a_out.error, Some(InferError::Generation(ref m)) if m.contains("request 0") && !m.contains("injected")),
        "{a_out:?}"
    );
    assert_eq!(b_out.error, None);
    assert_eq!(b_out.tokens, expected_tokens(&fake, &[4, 5, 6], 20));
    assert_no_leak(&infer, &handle).await;
}

#[test]
fn the_first_steps_get_the_longer_deadline_only_while_kernels_may_compile() {
    let compiling = StepDeadline { steady: Duration::from_secs(10), first_steps: Some(Duration::from_secs(100)) };
    assert_eq!(compiling.for_step(0), Duration::from_secs(100));
    assert_eq!(compiling.for_step(StepDeadline::FIRST_STEPS - 1), Duration::from_secs(100));
    assert_eq!(compiling.for_step(StepDeadline::FIRST_STEPS), Duration::from_secs(10));
    // Nothing compiles after warmup (CPU): the steady limit from the first step.
    let compiled = StepDeadline { steady: Duration::from_secs(10), first_steps: None };
    assert_eq!(compiled.for_step(0), Duration::from_secs(10));
    // A first-steps limit below the steady one never shortens a step.
    let odd = StepDeadline { steady: Duration::from_secs(10), first_steps: Some(Duration::from_secs(1)) };
    assert_eq!(odd.for_step(0), Duration::from_secs(10));
}

/// A shard that stops answering (SIGSTOP, a deadlocked collective): at the
/// step deadline every request in flight fails with an error that says what
/// happened, the scheduler reports its failure (the router then exits), and
/// nothing new is accepted.
#[tokio::test]
async fn a_step_past_its_deadline_fails_every_request_and_stops_the_scheduler() {
    let mut fake = fake_config(64, 4);
    // Steps take a moment, so `a` is still running when the hang is set.
    fake.latency = Duration::from_millis(20);
    let mut config = scheduler_config(&fake);
    config.step_deadline = StepDeadline { steady: Duration::from_secs(1), first_steps: None };
    let (infer, handle) = start(fake.clone(), config);

    let mut a = infer.generate(request(vec![1, 2, 3, 4, 5], 50)).await.unwrap();
    let mut a_out = read(&mut a, Some(2)).await;
    handle.hang_next_steps(1);
    let mut b = infer.generate(request(vec![6, 7, 8], 50)).await.unwrap();
    read_into(&mut a, &mut a_out, None).await;
    let b_out = read(&mut b, None).await;
    for out in [&a_out, &b_out] {
        match &out.error {
            Some(InferError::Unavailable(message)) => {
                assert!(message.contains("did not finish a step within 1s"), "{message}")
            }
            other => panic!("expected the server to be unavailable, got {other:?} ({out:?})"),
        }
    }
    let failure = tokio::time::timeout(Duration::from_secs(30), infer.failed()).await.expect("failure reported");
    assert_eq!(failure, SchedulerFailure::StepDeadline(Duration::from_secs(1)));
    assert_eq!(infer.failure(), Some(failure));
    let refused = infer.generate(request(vec![1, 2], 2)).await.err();
    assert_eq!(refused, Some(InferError::ShuttingDown));
}

/// A bug in the scheduler must not leave a router that answers 503 forever
/// while looking alive: the panic is reported (the router exits on it).
#[tokio::test]
async fn a_scheduler_panic_is_reported() {
    let fake = fake_config(64, 4);
    let mut config = scheduler_config(&fake);
    config.panic_at_step = Some(3);
    let (infer, _handle) = start(fake.clone(), config);
    let mut a = infer.generate(request(vec![1, 2, 3], 50)).await.unwrap();
    let out = read(&mut a, None).await;
    assert!(out.end.is_none() && out.tokens.len() < 50, "{out:?}");
    let failure = tokio::time::timeout(Duration::from_secs(30), infer.failed()).await.expect("failure reported");
    assert!(matches!(&failure, SchedulerFailure::Panicked(m) if m.contains("injected scheduler panic")), "{failure:?}");
    assert_eq!(infer.generate(request(vec![1, 2], 2)).await.err(), Some(InferError::ShuttingDown));
}
