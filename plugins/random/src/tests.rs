//! The policy's draws: uniform over the endpoints that may take the request, the same for the
//! same seed, never an unhealthy endpoint, a leg-only engine or (when another is left) the one
//! a retry failed on.

use switchyard_policy::testing::{Harness, check_plan, endpoints, request};
use switchyard_policy::types::{FailureKind, Protocol, Role, State};
use switchyard_policy::{Plan, PolicyError};

use super::Random;

fn seeded(seed: u32) -> Harness<Random> {
    Harness::init(&format!(r#"{{"seed": {seed}}}"#)).expect("a seed")
}

/// The endpoint each of `n` requests went to.
fn picks(
    policy: &mut Harness<Random>,
    ctx: &switchyard_policy::types::Context,
    n: usize,
) -> Vec<u32> {
    (0..n)
        .map(|_| match policy.translate(&request(17), ctx) {
            Ok(plan) => {
                check_plan(&plan, 17, &ctx.endpoints).expect("a valid plan");
                match plan.steps.as_slice() {
                    [switchyard_policy::Step::Forward(id)] => *id,
                    other => panic!("not a forward: {other:?}"),
                }
            }
            Err(e) => panic!("no plan: {e:?}"),
        })
        .collect()
}

#[test]
fn draws_every_endpoint_about_equally_and_ignores_load() {
    let ctx = endpoints(4).with_in_flight(&[9, 0, 0, 0]).context();
    let drawn = picks(&mut seeded(1), &ctx, 8000);
    for id in 0..4 {
        let share = drawn.iter().filter(|&&d| d == id).count();
        // 2000 expected; 5 standard deviations are 194.
        assert!(
            (1800..2200).contains(&share),
            "endpoint {id}: {share} of 8000"
        );
    }
}

#[test]
fn the_same_seed_draws_the_same_endpoints() {
    let ctx = endpoints(8).context();
    let first = picks(&mut seeded(7), &ctx, 64);
    assert_eq!(first, picks(&mut seeded(7), &ctx, 64));
    assert_ne!(first, picks(&mut seeded(8), &ctx, 64));
}

#[test]
fn never_draws_an_endpoint_that_may_not_take_the_request() {
    let ctx = endpoints(5)
        .unhealthy(0)
        .protocol(1, Protocol::Sglang, Role::Prefill)
        .protocol(2, Protocol::Vllm, Role::Prefill)
        .retry(2, FailureKind::Preempted, 3)
        .context();
    assert!(picks(&mut seeded(3), &ctx, 50).iter().all(|&id| id == 4));
    // The endpoint a retry failed on is the last resort.
    let ctx = endpoints(2)
        .unhealthy(0)
        .retry(2, FailureKind::Timeout, 1)
        .context();
    assert_eq!(
        seeded(3).translate(&request(17), &ctx),
        Ok(Plan::forward(1))
    );
    let none = endpoints(2).unhealthy(0).unhealthy(1).context();
    assert!(matches!(
        seeded(3).translate(&request(17), &none),
        Err(PolicyError::Unavailable(_))
    ));
}

#[test]
fn takes_a_seed_and_nothing_else() {
    let err = Harness::<Random>::init(r#"{"pd_balance_factor": 0.1}"#).unwrap_err();
    assert!(err.contains("pd_balance_factor"), "{err}");
    assert!(Harness::<Random>::init(r#"{"seed": -1}"#).is_err());
    assert_eq!(seeded(0).describe().state, State::Stateless);
}
