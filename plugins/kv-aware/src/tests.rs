//! The policy's cost (uncached tokens against queue), its fallback to least-loaded without
//! events, and its disaggregated plans, on snapshots built with the SDK's testing builders.

use switchyard_policy::select::{least_loaded, serves_alone};
use switchyard_policy::testing::{Harness, check_plan, endpoints, load_patterns, request};
use switchyard_policy::types::{FailureKind, Protocol, Role, SendBegin, State};
use switchyard_policy::{Plan, PolicyError, Step};

use super::KvAware;

/// Seeds `testing::load_patterns`, so the pseudo-random loads are the same on every run.
const LOAD_SEED: u32 = 0x9E37_79B9;

/// The default weights: one uncached token costs 1, one queued request 512.
fn kv_aware() -> Harness<KvAware> {
    Harness::init("{}").expect("the defaults are valid")
}

#[test]
fn without_events_it_is_least_loaded() {
    let mut policy = kv_aware();
    let mut checked = 0;
    for n in 1..=8 {
        for loads in load_patterns(n, LOAD_SEED) {
            let ctx = endpoints(n).with_in_flight(&loads).context();
            let least = least_loaded(&ctx.endpoints, serves_alone).expect("n >= 1");
            for len in [1, 17, 3000] {
                let plan = policy.translate(&request(len), &ctx);
                assert_eq!(
                    plan,
                    Ok(Plan::forward(least.id)),
                    "loads={loads:?} len={len}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 8 * 8 * 3);
}

#[test]
fn the_endpoint_holding_the_prefix_wins_at_equal_load() {
    let mut policy = kv_aware();
    let ctx = endpoints(4)
        .with_cached_prefixes(&[0, 256, 1024, 512])
        .context();
    assert_eq!(policy.translate(&request(2048), &ctx), Ok(Plan::forward(2)));
}

#[test]
fn load_outweighs_a_cached_prefix_past_the_weights_break_even() {
    let mut policy = kv_aware();
    // 2048-token prompt. Endpoint 0 holds 1024 tokens behind 2 requests: 1024 + 2 × 512 =
    // 2048, the same as idle endpoint 1 holding nothing; the tie goes to the shorter queue.
    let at = |cached: u32| {
        endpoints(2)
            .with_in_flight(&[2, 0])
            .with_cached_prefixes(&[cached, 0])
            .context()
    };
    assert_eq!(
        policy.translate(&request(2048), &at(1024)),
        Ok(Plan::forward(1))
    );
    // One block more cached and the cache pays for the wait.
    assert_eq!(
        policy.translate(&request(2048), &at(1040)),
        Ok(Plan::forward(0))
    );
}

#[test]
fn the_weights_move_the_break_even() {
    // Only the cache counts: the busiest endpoint holding the most still wins.
    let mut cache_only = Harness::<KvAware>::init(r#"{"load_weight": 0}"#).expect("valid");
    let ctx = endpoints(3)
        .with_in_flight(&[0, 50, 0])
        .with_cached_prefixes(&[16, 32, 0])
        .context();
    assert_eq!(
        cache_only.translate(&request(64), &ctx),
        Ok(Plan::forward(1))
    );
    // Only load counts: least-loaded whatever is cached.
    let mut load_only = Harness::<KvAware>::init(r#"{"overlap_weight": 0}"#).expect("valid");
    assert_eq!(
        load_only.translate(&request(64), &ctx),
        Ok(Plan::forward(0))
    );
    // A cheap queue (8 tokens a request): 16 cached tokens are worth waiting behind 1 request.
    let mut cheap_queue = Harness::<KvAware>::init(r#"{"load_weight": 8}"#).expect("valid");
    let ctx = endpoints(2)
        .with_in_flight(&[1, 0])
        .with_cached_prefixes(&[16, 0])
        .context();
    assert_eq!(
        cheap_queue.translate(&request(64), &ctx),
        Ok(Plan::forward(0))
    );
    assert_eq!(
        kv_aware().translate(&request(64), &ctx),
        Ok(Plan::forward(1))
    );
}

#[test]
fn pending_prefill_decides_between_endpoints_holding_as_much() {
    let mut policy = kv_aware();
    // Both hold 1024 of the 4096-token prompt and have as many requests in flight; endpoint 0
    // has a new 8k-token conversation still to prefill ahead of this one, endpoint 1 only
    // decoding requests.
    let ctx = endpoints(2)
        .with_in_flight(&[2, 2])
        .with_cached_prefixes(&[1024, 1024])
        .pending_prefill(0, 8192)
        .context();
    assert_eq!(policy.translate(&request(4096), &ctx), Ok(Plan::forward(1)));
}

#[test]
fn decoding_requests_weigh_less_than_a_prefill_backlog() {
    let mut policy = kv_aware();
    // Endpoint 0 decodes four requests, all prefilled; endpoint 1 has one request in flight,
    // an 8k-token prompt it has not prefilled yet. By requests in flight alone 1 looked idler;
    // the new prompt's first token comes sooner on 0.
    let ctx = endpoints(2)
        .with_in_flight(&[4, 1])
        .with_pending_prefill(&[0, 8192])
        .context();
    assert_eq!(policy.translate(&request(2048), &ctx), Ok(Plan::forward(0)));
}

#[test]
fn a_cache_hit_wins_over_an_empty_engine_with_a_backlog() {
    let mut policy = kv_aware();
    // Endpoint 0 holds 6144 of the 8192-token prompt and decodes 2 requests; endpoint 1 holds
    // nothing and has 2048 tokens pending: 2048 to prefill on 0 against 10240 on 1.
    let ctx = endpoints(2)
        .with_in_flight(&[2, 1])
        .with_cached_prefixes(&[6144, 0])
        .pending_prefill(1, 2048)
        .context();
    assert_eq!(policy.translate(&request(8192), &ctx), Ok(Plan::forward(0)));
}

#[test]
fn a_backlog_outweighs_a_cache_hit_when_waiting_costs_more_than_the_hit_saves() {
    let mut policy = kv_aware();
    // Endpoint 0 holds half the prompt but has 8192 tokens to prefill first: 2048 + 8192
    // against idle endpoint 1's 4096.
    let ctx = endpoints(2)
        .with_in_flight(&[1, 0])
        .with_cached_prefixes(&[2048, 0])
        .pending_prefill(0, 8192)
        .context();
    assert_eq!(policy.translate(&request(4096), &ctx), Ok(Plan::forward(1)));
}

#[test]
fn the_prefill_partner_is_the_prefill_engine_with_the_least_pending() {
    let mut policy = kv_aware();
    // 0 and 1 prefill; 0 has fewer requests in flight but a long prompt to prefill.
    let ctx = endpoints(3)
        .role(0, Role::Prefill)
        .role(1, Role::Prefill)
        .role(2, Role::Decode)
        .with_in_flight(&[1, 2, 0])
        .with_pending_prefill(&[6000, 300, 0])
        .context();
    assert_eq!(
        policy.translate(&request(1024), &ctx),
        Ok(Plan::disagg(1, 2, -1))
    );
}

#[test]
fn ties_go_to_the_shorter_queue_then_the_lowest_id() {
    let mut policy = Harness::<KvAware>::init(r#"{"load_weight": 16}"#).expect("valid");
    // Costs 64 - 32 + 16 = 48 (queue 1) and 64 - 16 + 0 = 48 (queue 0) and 48 (queue 0).
    let ctx = endpoints(3)
        .with_in_flight(&[1, 0, 0])
        .with_cached_prefixes(&[32, 16, 16])
        .context();
    assert_eq!(policy.translate(&request(64), &ctx), Ok(Plan::forward(1)));
}

#[test]
fn an_endpoint_without_an_index_counts_as_holding_nothing() {
    let mut policy = kv_aware();
    // Endpoint 1 publishes no events (or its index is stale): it is not assumed to hold the
    // prefix, but it stays in the running on load.
    let ctx = endpoints(3)
        .cached_prefix(0, 0)
        .cached_prefix(2, 512)
        .context();
    assert_eq!(policy.translate(&request(1024), &ctx), Ok(Plan::forward(2)));
    let ctx = endpoints(3)
        .with_in_flight(&[1, 0, 3])
        .cached_prefix(0, 0)
        .cached_prefix(2, 512)
        .context();
    assert_eq!(policy.translate(&request(1024), &ctx), Ok(Plan::forward(1)));
}

#[test]
fn a_cached_prefix_longer_than_the_prompt_counts_as_the_whole_prompt() {
    let mut policy = kv_aware();
    // The host never reports more than the prompt; if it did, no cost may underflow.
    let ctx = endpoints(2)
        .with_in_flight(&[0, 1])
        .with_cached_prefixes(&[0, 4096])
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(0)));
}

#[test]
fn the_queue_is_this_routers_in_flight_or_the_engines_waiting_whichever_is_larger() {
    let mut policy = kv_aware();
    // Endpoint 0's engine has 4 requests waiting (other replicas'), this router 1 in flight
    // there; endpoint 1 runs 9 (a probe interval ago: not counted) and this router has 2 there.
    let ctx = endpoints(3)
        .with_in_flight(&[1, 2, 3])
        .engine_load(0, 0, 4)
        .engine_load(1, 9, 0)
        .context();
    assert_eq!(policy.translate(&request(64), &ctx), Ok(Plan::forward(1)));
    // This router just sent endpoint 1 five: more than the engine said was waiting at 0.
    let ctx = endpoints(2)
        .with_in_flight(&[1, 5])
        .engine_load(0, 0, 4)
        .engine_load(1, 0, 0)
        .context();
    assert_eq!(policy.translate(&request(64), &ctx), Ok(Plan::forward(0)));
}

#[test]
fn on_mlc_with_roles_it_decodes_where_the_prefix_is_and_prefills_by_load() {
    let mut policy = kv_aware();
    // 0 and 1 prefill (1 less queued), 2 and 3 decode (3 holds the prefix).
    let ctx = endpoints(4)
        .role(0, Role::Prefill)
        .role(1, Role::Prefill)
        .role(2, Role::Decode)
        .role(3, Role::Decode)
        .with_in_flight(&[2, 1, 0, 1])
        .with_cached_prefixes(&[2048, 0, 0, 1024])
        .context();
    let plan = policy.translate(&request(2048), &ctx).expect("a plan");
    assert_eq!(plan, Plan::disagg(1, 3, -1));
    check_plan(&plan, 2048, &ctx.endpoints).expect("valid");
    // The remote-send starts at what D's prep-recv says it holds, so D's prefix never moves
    // (and the router skips the send when D holds the whole window).
    let sends: Vec<_> = plan
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::RemoteSend(r) => Some(r.begin),
            _ => None,
        })
        .collect();
    assert_eq!(sends, [SendBegin::PrefixMatched]);
}

#[test]
fn without_events_a_disaggregated_plan_decodes_on_the_least_loaded() {
    let mut policy = kv_aware();
    let ctx = endpoints(4)
        .role(0, Role::Prefill)
        .with_in_flight(&[5, 3, 1, 2])
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 2, -1))
    );
}

#[test]
fn on_vllm_and_sglang_it_hands_off_to_the_decode_endpoint_holding_the_prefix() {
    for protocol in [Protocol::Vllm, Protocol::Sglang] {
        let mut policy = kv_aware();
        // 0: prefill, 1 and 2: decode (2 holds the prefix), 3: an idle MLC engine beside them.
        let ctx = endpoints(4)
            .protocol(0, protocol, Role::Prefill)
            .protocol(1, protocol, Role::Decode)
            .protocol(2, protocol, Role::Decode)
            .with_cached_prefixes(&[0, 0, 960, 0])
            .with_in_flight(&[0, 0, 1, 0])
            .context();
        let plan = policy.translate(&request(1024), &ctx);
        assert_eq!(plan, Ok(Plan::handoff(0, 2)), "{protocol:?}");
        check_plan(&Plan::handoff(0, 2), 1024, &ctx.endpoints).expect("valid");
    }
}

#[test]
fn retries_avoid_the_failed_endpoint_even_when_it_holds_the_prefix() {
    let mut policy = kv_aware();
    let ctx = endpoints(3)
        .with_cached_prefixes(&[0, 1024, 512])
        .retry(2, FailureKind::EndpointError, 1)
        .context();
    assert_eq!(policy.translate(&request(1024), &ctx), Ok(Plan::forward(2)));
    // Nothing else is healthy: the failed endpoint is the last resort.
    let ctx = endpoints(2)
        .unhealthy(0)
        .retry(2, FailureKind::Preempted, 1)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(1)));
}

#[test]
fn unhealthy_endpoints_are_skipped_whatever_they_hold() {
    let mut policy = kv_aware();
    let ctx = endpoints(3)
        .with_cached_prefixes(&[0, 1024, 0])
        .with_in_flight(&[1, 0, 0])
        .unhealthy(1)
        .context();
    assert_eq!(policy.translate(&request(1024), &ctx), Ok(Plan::forward(2)));
    let none = endpoints(2).unhealthy(0).unhealthy(1).context();
    assert!(matches!(
        policy.translate(&request(17), &none),
        Err(PolicyError::Unavailable(_))
    ));
    assert!(matches!(
        policy.translate(&request(17), &endpoints(0).context()),
        Err(PolicyError::Unavailable(_))
    ));
}

#[test]
fn every_plan_passes_the_routers_checks() {
    let mut policy = kv_aware();
    for n in 1..=6 {
        for failed in 0..n {
            for down in 0..n {
                for roles in [false, true] {
                    let mut cluster = endpoints(n)
                        .with_in_flight(&load_patterns(n, LOAD_SEED)[5])
                        .with_cached_prefixes(&[0, 16, 1024, 2048, 512, 64])
                        .unhealthy(down)
                        .retry(2, FailureKind::EndpointError, failed);
                    if roles {
                        cluster = cluster.role(0, Role::Prefill).role(n - 1, Role::Decode);
                    }
                    let ctx = cluster.context();
                    for len in [1, 17, 2048] {
                        match policy.translate(&request(len), &ctx) {
                            Ok(plan) => assert_eq!(
                                check_plan(&plan, len, &ctx.endpoints),
                                Ok(()),
                                "{plan:?} n={n} len={len}"
                            ),
                            Err(e) => assert_eq!(n, 1, "n={n}: {e:?}"),
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn config_is_checked_in_init() {
    assert_eq!(
        Harness::<KvAware>::init("").map(|h| h.policy().clone()),
        Ok(KvAware {
            overlap_weight: 1.0,
            load_weight: 512.0
        })
    );
    assert_eq!(
        Harness::<KvAware>::init(r#"{"overlap_weight": 2, "load_weight": 0.5}"#)
            .map(|h| h.policy().clone()),
        Ok(KvAware {
            overlap_weight: 2.0,
            load_weight: 0.5
        })
    );
    let err = |config: &str| Harness::<KvAware>::init(config).expect_err(config);
    assert_eq!(
        err(r#"{"load_weight": -1}"#),
        "load_weight must be a finite number >= 0, got -1"
    );
    assert!(err(r#"{"overlap_weight": "1"}"#).contains("must be a number"));
    assert!(err(r#"{"queue_weight": 1}"#).contains("unknown config key \"queue_weight\""));
}

#[test]
fn describes_itself_as_stateless_rust_needing_no_tokens() {
    let info = kv_aware().describe();
    assert_eq!((info.language.as_str(), info.prompt_tokens), ("rust", 0));
    assert_eq!(info.state, State::Stateless);
}
