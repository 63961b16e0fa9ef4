//! The policy against a transcription of MLC's router over a table of clusters, plus the cases
//! MLC does not have (roles, unhealthy endpoints, retries).

use switchyard_policy::testing::{Harness, check_plan, endpoints, load_patterns, request};
use switchyard_policy::types::{FailureKind, Role, State};
use switchyard_policy::{Plan, PolicyError};

use super::Disagg;

const FACTORS: [f64; 3] = [0.0, 0.1, 0.5];
const PROMPT_LENS: [u32; 4] = [1, 2, 17, 3000];

/// MLC's `_handle_completion_disagg`, transcribed: prefill on server 0, decode on
/// `min(range(1, n), key=num_running)`, `kv_window_end = -1 if f == 0 else int((1-f)*len)`.
fn mlc_reference(loads: &[u32], prompt_len: u32, factor: f64) -> Plan {
    let decode = (1..loads.len()).min_by_key(|&i| loads[i]).expect("n >= 2") as u32;
    let end = if factor == 0.0 {
        -1
    } else {
        ((1.0 - factor) * f64::from(prompt_len)).floor() as i32
    };
    Plan::disagg(0, decode, end)
}

/// Seeds `testing::load_patterns`, so the pseudo-random loads are the same on every run.
const LOAD_SEED: u32 = 0x9E37_79B9;

fn disagg(factor: f64) -> Harness<Disagg> {
    Harness::init(&format!(r#"{{"pd_balance_factor": {factor}}}"#)).expect("valid factor")
}

#[test]
fn matches_mlc_on_healthy_roleless_clusters() {
    let mut checked = 0;
    for factor in FACTORS {
        let mut policy = disagg(factor);
        for n in 2..=8 {
            for loads in load_patterns(n, LOAD_SEED) {
                let ctx = endpoints(n).with_in_flight(&loads).context();
                for len in PROMPT_LENS {
                    let plan = policy.translate(&request(len), &ctx);
                    let expected = mlc_reference(&loads, len, factor);
                    check_plan(&expected, len, &ctx.endpoints).expect("MLC's plan is valid");
                    assert_eq!(
                        plan,
                        Ok(expected),
                        "n={n} loads={loads:?} len={len} f={factor}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 3 * 7 * 8 * 4);
}

#[test]
fn one_endpoint_gets_the_whole_request() {
    let mut policy = disagg(0.1);
    for len in PROMPT_LENS {
        assert_eq!(
            policy.translate(&request(len), &endpoints(1).context()),
            Ok(Plan::forward(0))
        );
    }
    // Only one healthy endpoint left in a larger cluster: the same.
    let ctx = endpoints(3).unhealthy(0).unhealthy(1).context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(2)));
}

#[test]
fn no_healthy_endpoint_is_unavailable() {
    let mut policy = disagg(0.0);
    let ctx = endpoints(2).unhealthy(0).unhealthy(1).context();
    assert!(matches!(
        policy.translate(&request(17), &ctx),
        Err(PolicyError::Unavailable(_))
    ));
    let empty = endpoints(0).context();
    assert!(matches!(
        policy.translate(&request(17), &empty),
        Err(PolicyError::Unavailable(_))
    ));
}

#[test]
fn unhealthy_endpoints_are_skipped() {
    let mut policy = disagg(0.0);
    // Endpoint 0 down: the lowest healthy id prefills, the least loaded other one decodes.
    let ctx = endpoints(4)
        .with_in_flight(&[0, 5, 3, 1])
        .unhealthy(0)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(1, 3, -1))
    );
    // The least loaded decode candidate is down: the next one.
    let ctx = endpoints(4)
        .with_in_flight(&[0, 5, 0, 1])
        .unhealthy(2)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 3, -1))
    );
}

#[test]
fn roles_pick_the_prefill_and_steer_decode() {
    let mut policy = disagg(0.0);
    // A prefill-role endpoint prefills, wherever it is.
    let ctx = endpoints(4)
        .with_in_flight(&[2, 4, 9, 3])
        .role(2, Role::Prefill)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(2, 0, -1))
    );
    // Another prefill-role endpoint is not used for decode while a decode/any one exists...
    let ctx = endpoints(4)
        .with_in_flight(&[0, 0, 7, 8])
        .role(0, Role::Prefill)
        .role(1, Role::Prefill)
        .role(2, Role::Decode)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 2, -1))
    );
    // ...but it is when nothing else is healthy.
    let ctx = endpoints(3)
        .role(0, Role::Prefill)
        .role(1, Role::Prefill)
        .unhealthy(2)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 1, -1))
    );
    // A down prefill-role endpoint is skipped; endpoint 0 prefills as in MLC.
    let ctx = endpoints(3).role(1, Role::Prefill).unhealthy(1).context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 2, -1))
    );
    // A decode role on endpoint 0 is only a hint: with no prefill-role endpoint, 0 prefills.
    let ctx = endpoints(3).role(0, Role::Decode).context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 1, -1))
    );
}

#[test]
fn retries_avoid_the_failed_endpoint() {
    let mut policy = disagg(0.0);
    let loads = [0, 0, 1, 2];
    // Decode failed on 1: the next least-loaded endpoint decodes.
    let ctx = endpoints(4)
        .with_in_flight(&loads)
        .retry(2, FailureKind::Preempted, 1)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 2, -1))
    );
    // Prefill failed on 0: the lowest other id prefills.
    let ctx = endpoints(4)
        .with_in_flight(&loads)
        .retry(2, FailureKind::EndpointError, 0)
        .context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(1, 2, -1))
    );
    // Two endpoints: the survivor serves the request alone rather than reuse the failed one.
    let ctx = endpoints(2).retry(3, FailureKind::Timeout, 1).context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(0)));
    // Nothing else is healthy: the failed endpoint is the last resort.
    let ctx = endpoints(2)
        .unhealthy(0)
        .retry(2, FailureKind::Preempted, 1)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(1)));
    // On the first attempt last-failure is ignored (the host never sets it there).
    let ctx = endpoints(3).retry(1, FailureKind::Preempted, 1).context();
    assert_eq!(
        policy.translate(&request(17), &ctx),
        Ok(Plan::disagg(0, 1, -1))
    );
}

#[test]
fn every_plan_passes_the_routers_checks() {
    for factor in FACTORS {
        let mut policy = disagg(factor);
        for n in 1..=8 {
            for failed in 0..n {
                for down in 0..n {
                    let ctx = endpoints(n)
                        .with_in_flight(&load_patterns(n, LOAD_SEED)[5])
                        .role(n - 1, Role::Prefill)
                        .unhealthy(down)
                        .retry(2, FailureKind::EndpointError, failed)
                        .context();
                    for len in PROMPT_LENS {
                        match policy.translate(&request(len), &ctx) {
                            Ok(plan) => {
                                let checked = check_plan(&plan, len, &ctx.endpoints);
                                assert_eq!(checked, Ok(()), "{plan:?} n={n} len={len}");
                                if n > 2 {
                                    assert!(!uses(&plan, failed), "{plan:?} reuses {failed}");
                                }
                            }
                            Err(e) => assert_eq!(n, 1, "n={n}: {e:?}"),
                        }
                    }
                }
            }
        }
    }
}

fn uses(plan: &Plan, id: u32) -> bool {
    use switchyard_policy::Step;
    plan.steps.iter().any(|s| match s {
        Step::PrepRecv(p) => p.decode == id,
        Step::RemoteSend(r) => r.prefill == id || r.decode == id,
        Step::StartGenerate(g) => g.decode == id,
        Step::Forward(e) => *e == id,
        Step::Handoff(h) => h.prefill == id || h.decode == id,
    })
}

#[test]
fn config_is_checked_in_init() {
    assert_eq!(
        Harness::<Disagg>::init("{}").map(|h| h.policy().clone()),
        Ok(Disagg {
            pd_balance_factor: 0.0
        })
    );
    assert!(Harness::<Disagg>::init("").is_ok());
    assert!(Harness::<Disagg>::init(r#"{"pd_balance_factor": 0.99}"#).is_ok());
    let err = |config: &str| Harness::<Disagg>::init(config).expect_err(config);
    assert_eq!(
        err(r#"{"pd_balance_factor": 1}"#),
        "pd_balance_factor must be at least 0 and below 1, got 1"
    );
    assert!(err(r#"{"pd_balance_factor": -0.1}"#).contains("got -0.1"));
    assert!(err(r#"{"pd_balance_factor": "0.5"}"#).contains("must be a number"));
    assert!(err(r#"{"pd_balance": 0.5}"#).contains("unknown config key \"pd_balance\""));
    assert!(err("not json").contains("not valid JSON"));
}

#[test]
fn describes_itself_as_stateless_rust_needing_no_tokens() {
    let info = disagg(0.0).describe();
    assert_eq!((info.language.as_str(), info.prompt_tokens), ("rust", 0));
    assert_eq!(info.state, State::Stateless);
}

#[test]
fn plans_a_handoff_on_vllm_and_sglang_pairs_whatever_the_factor() {
    use switchyard_policy::types::Protocol;
    for protocol in [Protocol::Vllm, Protocol::Sglang] {
        let mut policy = disagg(0.5);
        // 0: prefill, 1 and 2: decode (2 less loaded), 3: an MLC engine beside them.
        let ctx = endpoints(4)
            .protocol(0, protocol, Role::Prefill)
            .protocol(1, protocol, Role::Decode)
            .protocol(2, protocol, Role::Decode)
            .with_in_flight(&[0, 3, 1, 0])
            .context();
        let plan = policy.translate(&request(17), &ctx);
        assert_eq!(plan, Ok(Plan::handoff(0, 2)), "{protocol:?}");
        check_plan(&Plan::handoff(0, 2), 17, &ctx.endpoints).expect("valid");
    }
}

#[test]
fn never_sends_a_plain_request_to_an_sglang_prefill_or_decode_engine() {
    use switchyard_policy::types::Protocol;
    let mut policy = disagg(0.0);
    // Only the prefill engine is healthy: nobody can serve the request.
    let ctx = endpoints(2)
        .protocol(0, Protocol::Sglang, Role::Prefill)
        .protocol(1, Protocol::Sglang, Role::Decode)
        .unhealthy(1)
        .context();
    assert!(matches!(
        policy.translate(&request(17), &ctx),
        Err(PolicyError::Unavailable(_))
    ));
    // A vLLM prefill endpoint alone is not used either; its decode endpoint alone is.
    let ctx = endpoints(2)
        .protocol(0, Protocol::Vllm, Role::Prefill)
        .protocol(1, Protocol::Vllm, Role::Decode)
        .unhealthy(0)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(1)));
}

#[test]
fn pairs_within_one_protocol_in_a_mixed_cluster() {
    use switchyard_policy::types::Protocol;
    let mut policy = disagg(0.0);
    // 0: an openai server, 1: a vLLM prefill, 2: an SGLang decode, 3: a vLLM decode.
    let ctx = endpoints(4)
        .protocol(0, Protocol::Openai, Role::Any)
        .protocol(1, Protocol::Vllm, Role::Prefill)
        .protocol(2, Protocol::Sglang, Role::Decode)
        .protocol(3, Protocol::Vllm, Role::Decode)
        .context();
    assert_eq!(policy.translate(&request(9), &ctx), Ok(Plan::handoff(1, 3)));
}

#[test]
fn a_lone_vllm_or_sglang_pair_is_retried_after_either_leg_failed() {
    use switchyard_policy::types::Protocol;
    for protocol in [Protocol::Vllm, Protocol::Sglang] {
        let mut policy = disagg(0.0);
        for failed in [0, 1] {
            let ctx = endpoints(2)
                .protocol(0, protocol, Role::Prefill)
                .protocol(1, protocol, Role::Decode)
                .retry(2, FailureKind::EndpointError, failed)
                .context();
            let plan = policy.translate(&request(17), &ctx);
            let expected = match (protocol, failed) {
                // A vLLM decode endpoint serves alone when its prefill just failed.
                (Protocol::Vllm, 0) => Plan::forward(1),
                _ => Plan::handoff(0, 1),
            };
            assert_eq!(plan, Ok(expected), "{protocol:?}, failed on {failed}");
        }
    }
}
