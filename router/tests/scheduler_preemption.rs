//! Preemption under a KV budget far too small for the load.

pub mod scheduler_support;

use scheduler_support::*;
use sluice_router::infer::FinishReason;

#[tokio::test]
async fn every_request_completes_with_its_solo_tokens_under_a_tiny_block_budget() {
    // 12 blocks of 4 = 48 slots; each request needs 8 + 24 = 32 at its end,
    // so at most one full-length request fits at a time, and 8 come at once.
    let fake = fake_config(12, 4);
    let mut config = scheduler_config(&fake);
    config.max_batch_prefill_tokens = 16;
    let (infer, handle) = start(fake.clone(), config);

    let prompts: Vec<Vec<u32>> =
        (0..8u32).map(|i| if i % 2 == 0 { vec![1, 2, 3, 4, 5, 6, 7, i + 10] } else { (20 * i..20 * i + 8).collect() }).collect();
    let outs = futures::future::join_all(prompts.iter().map(|p| generate(&infer, p.clone(), 24))).await;
    for (p, o) in prompts.iter().zip(&outs) {
        assert_eq!(o.error, None);
        assert_eq!(o.prefills, 1, "a resumed request must not announce its prefill again");
        assert_eq!(o.tokens, expected_tokens(&fake, p, 24), "tokens differ from a solo run");
        assert_eq!(o.end, Some((FinishReason::Length, 24)));
    }
    let stats = assert_no_leak(&infer, &handle).await;
    assert!(stats.preemptions > 0, "the budget was meant to force preemption");
    // Resumption is a NewRequest whose num_prompt_tokens marks the boundary.
    let resumed = handle
        .steps()
        .iter()
        .flat_map(|s| s.new_requests.clone())
        .find(|n| n.token_ids.len() > n.num_prompt_tokens as usize)
        .expect("a resumed request");
    assert_eq!(resumed.num_prompt_tokens, 8);
}
