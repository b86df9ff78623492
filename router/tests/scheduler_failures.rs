//! Shard failures fail only the requests they touch; the scheduler serves on.

mod scheduler_support;

use std::time::Duration;

use scheduler_support::*;
use sluice_router::infer::InferError;

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
    assert!(matches!(a_out.error, Some(InferError::Generation(_))), "{a_out:?}");
    assert!(matches!(b_out.error, Some(InferError::Generation(_))), "{b_out:?}");

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
    assert!(matches!(a_out.error, Some(InferError::Generation(ref m)) if m.contains("injected")), "{a_out:?}");
    assert_eq!(b_out.error, None);
    assert_eq!(b_out.tokens, expected_tokens(&fake, &[4, 5, 6], 20));
    assert_no_leak(&infer, &handle).await;
}
