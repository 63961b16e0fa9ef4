//! The policy against a transcription of MLC's router over a table of clusters, plus health
//! and retries.

use switchyard_policy::testing::{Harness, check_plan, endpoints, load_patterns, request};
use switchyard_policy::types::{FailureKind, Role};
use switchyard_policy::{Plan, PolicyError};

use super::RoundRobin;

const PROMPT_LENS: [u32; 4] = [1, 2, 17, 3000];

/// MLC's `_handle_completion_round_robin`, transcribed: `min(range(n), key=num_running)`.
fn mlc_reference(loads: &[u32]) -> Plan {
    let target = (0..loads.len()).min_by_key(|&i| loads[i]).expect("n >= 1") as u32;
    Plan::forward(target)
}

/// Seeds `testing::load_patterns`, so the pseudo-random loads are the same on every run.
const LOAD_SEED: u32 = 0x85EB_CA6B;

fn round_robin() -> Harness<RoundRobin> {
    Harness::init("{}").expect("empty config")
}

#[test]
fn matches_mlc_on_healthy_clusters() {
    let mut policy = round_robin();
    let mut checked = 0;
    for n in 1..=8 {
        for loads in load_patterns(n, LOAD_SEED) {
            // Roles are hints for disaggregation; MLC's round-robin has none and ignores them.
            let ctx = endpoints(n)
                .with_in_flight(&loads)
                .role(0, Role::Prefill)
                .context();
            for len in PROMPT_LENS {
                let expected = mlc_reference(&loads);
                assert_eq!(
                    policy.translate(&request(len), &ctx),
                    Ok(expected.clone()),
                    "{loads:?}"
                );
                check_plan(&expected, len, &ctx.endpoints).expect("MLC's plan is valid");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 8 * 8 * 4);
}

#[test]
fn unhealthy_endpoints_are_skipped() {
    let mut policy = round_robin();
    let ctx = endpoints(4)
        .with_in_flight(&[3, 0, 0, 1])
        .unhealthy(1)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(2)));
    let ctx = endpoints(2).unhealthy(0).unhealthy(1).context();
    assert!(matches!(
        policy.translate(&request(17), &ctx),
        Err(PolicyError::Unavailable(_))
    ));
}

#[test]
fn retries_avoid_the_failed_endpoint() {
    let mut policy = round_robin();
    let ctx = endpoints(3)
        .with_in_flight(&[2, 0, 1])
        .retry(2, FailureKind::Preempted, 1)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(2)));
    // The failed endpoint is the only healthy one: it is the last resort.
    let ctx = endpoints(2)
        .unhealthy(0)
        .retry(2, FailureKind::Timeout, 1)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(1)));
    let ctx = endpoints(1)
        .retry(4, FailureKind::EndpointError, 0)
        .context();
    assert_eq!(policy.translate(&request(17), &ctx), Ok(Plan::forward(0)));
}

#[test]
fn takes_no_options() {
    assert!(Harness::<RoundRobin>::init("").is_ok());
    let err = Harness::<RoundRobin>::init(r#"{"pd_balance_factor": 0.1}"#).unwrap_err();
    assert!(err.contains("takes no options"), "{err}");
}

#[test]
fn describes_itself_as_stateless() {
    let info = Harness::<RoundRobin>::init("{}")
        .expect("empty config")
        .describe();
    assert_eq!(info.state, switchyard_policy::types::State::Stateless);
}

#[test]
fn skips_engines_that_serve_only_a_leg_of_a_handoff() {
    use switchyard_policy::types::Protocol;
    let mut policy = round_robin();
    // 0: SGLang prefill, 1: SGLang decode, 2: vLLM prefill (all idle), 3: an OpenAI server.
    let ctx = endpoints(4)
        .protocol(0, Protocol::Sglang, Role::Prefill)
        .protocol(1, Protocol::Sglang, Role::Decode)
        .protocol(2, Protocol::Vllm, Role::Prefill)
        .protocol(3, Protocol::Openai, Role::Any)
        .with_in_flight(&[0, 0, 0, 9])
        .context();
    assert_eq!(policy.translate(&request(5), &ctx), Ok(Plan::forward(3)));
    let none = endpoints(2)
        .protocol(0, Protocol::Sglang, Role::Prefill)
        .protocol(1, Protocol::Sglang, Role::Decode)
        .context();
    assert!(matches!(
        policy.translate(&request(5), &none),
        Err(PolicyError::Unavailable(_))
    ));
}
