//! The policy driven natively through the SDK's harness; every plan is also checked with the
//! router's plan rules.

use switchyard_policy::testing::{Cluster, Harness, check_plan, endpoints, request};
use switchyard_policy::types::{FailureKind, Request, Role, State, Step};
use switchyard_policy::{Plan, PolicyError};

use super::Affinity;

fn policy(config: &str) -> Harness<Affinity> {
    Harness::init(config).expect("valid config")
}

/// A prompt of `len` tokens drawn from `seed` (xorshift: reproducible, no dependency).
fn prompt(seed: u64, len: u32) -> Request {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let tokens = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 49_152) as u32
        })
        .collect();
    Request {
        prompt_prefix: tokens,
        ..request(len)
    }
}

/// Plan `req` on `cluster`, check the plan as the router would, and return it.
fn plan(policy: &mut Harness<Affinity>, req: &Request, cluster: &Cluster) -> Plan {
    let ctx = cluster.context();
    let plan = policy.translate(req, &ctx).expect("a plan");
    check_plan(&plan, req.prompt_length(), &ctx.endpoints).expect("plan passes the router's rules");
    plan
}

fn decode_of(plan: &Plan) -> u32 {
    plan.generator().expect("a generating step")
}

fn prefill_of(plan: &Plan) -> Option<u32> {
    plan.steps.iter().find_map(|s| match s {
        Step::RemoteSend(send) => Some(send.prefill),
        _ => None,
    })
}

/// Endpoint 0 prefills, 1..n decode.
fn split(n: u32) -> Cluster {
    (1..n).fold(endpoints(n).role(0, Role::Prefill), |c, id| {
        c.role(id, Role::Decode)
    })
}

#[test]
fn describes_itself_as_stateless() {
    assert_eq!(policy("{}").describe().state, State::Stateless);
}

#[test]
fn replicas_that_number_endpoints_differently_agree() {
    // Two replicas learned of the same four decode engines in different orders: the same
    // engine has another id on each, and the same address hash.
    let hashes = [11, 22, 33, 44].map(|h: u64| h.wrapping_mul(0x0123_4567_89ab_cdef));
    let order = [2, 0, 3, 1];
    let one = endpoints(4).address_hashes(&hashes);
    let other = endpoints(4).address_hashes(&order.map(|i| hashes[i]));
    let mut p = policy("{}");
    for seed in 0..200 {
        let req = prompt(seed, 100);
        let here = decode_of(&plan(&mut p, &req, &one.clone().role(0, Role::Prefill)));
        let there_prefill = order.iter().position(|&i| i == 0).expect("in order") as u32;
        let there = decode_of(&plan(
            &mut p,
            &req,
            &other.clone().role(there_prefill, Role::Prefill),
        ));
        assert_eq!(
            hashes[here as usize], hashes[order[there as usize]],
            "seed {seed}"
        );
    }
}

#[test]
fn repeated_prompts_and_shared_prefixes_go_to_one_engine() {
    let mut p = policy(r#"{"prefix_tokens": 32}"#);
    let cluster = split(5);
    for seed in 0..50 {
        let first = prompt(seed, 200);
        let decode = decode_of(&plan(&mut p, &first, &cluster));
        assert_eq!(decode_of(&plan(&mut p, &first, &cluster)), decode);
        // Another prompt with the same first 32 tokens: the same engine.
        let mut shared = prompt(seed + 1000, 120);
        shared.prompt_prefix[..32].copy_from_slice(&first.prompt_prefix[..32]);
        assert_eq!(
            decode_of(&plan(&mut p, &shared, &cluster)),
            decode,
            "seed {seed}"
        );
    }
}

#[test]
fn prefixes_spread_over_the_engines() {
    let mut p = policy("{}");
    let cluster = split(5);
    let mut counts = [0u32; 5];
    for seed in 0..2000 {
        counts[decode_of(&plan(&mut p, &prompt(seed, 80), &cluster)) as usize] += 1;
    }
    assert_eq!(counts[0], 0, "endpoint 0 only prefills");
    // 500 expected on each decode engine; 4 standard deviations is about ±80.
    for (id, &n) in counts.iter().enumerate().skip(1) {
        assert!(
            (400..=600).contains(&n),
            "engine {id} got {n} of 2000: {counts:?}"
        );
    }
}

#[test]
fn an_engine_leaving_moves_only_its_own_prefixes() {
    let mut p = policy("{}");
    let all = split(5);
    let without_3 = split(5).unhealthy(3);
    let mut moved = 0;
    for seed in 0..500 {
        let req = prompt(seed, 64);
        let before = decode_of(&plan(&mut p, &req, &all));
        let after = decode_of(&plan(&mut p, &req, &without_3));
        if before == 3 {
            assert_ne!(after, 3);
            moved += 1;
        } else {
            assert_eq!(
                after, before,
                "seed {seed} moved although its engine stayed"
            );
        }
    }
    assert!(moved > 0, "some prefixes lived on engine 3");
}

#[test]
fn affinity_gives_way_to_an_engine_that_queues() {
    let mut p = policy(r#"{"max_waiting": 2}"#);
    let req = prompt(7, 100);
    let favourite = decode_of(&plan(&mut p, &req, &split(4)));
    // At the limit it keeps the request; above it the request goes elsewhere.
    let at_limit = split(4).engine_load(favourite, 8, 2);
    assert_eq!(decode_of(&plan(&mut p, &req, &at_limit)), favourite);
    let queueing = split(4).engine_load(favourite, 8, 3);
    let second = decode_of(&plan(&mut p, &req, &queueing));
    assert_ne!(second, favourite);
    // Every engine queueing: affinity is all that is left.
    let all_queueing = (1..4).fold(split(4), |c, id| c.engine_load(id, 8, 9));
    assert_eq!(decode_of(&plan(&mut p, &req, &all_queueing)), favourite);
}

#[test]
fn prefill_goes_to_the_least_loaded_engine_by_its_own_count() {
    let mut p = policy("{}");
    // Endpoints 0-2 prefill, 3 decodes.
    let cluster = endpoints(4)
        .role(0, Role::Prefill)
        .role(1, Role::Prefill)
        .role(2, Role::Prefill)
        .role(3, Role::Decode);
    // This replica sends most to 1, but engine 1 reports the least load of all (other
    // replicas' requests are on 0 and 2).
    let loaded = cluster
        .clone()
        .with_in_flight(&[0, 5, 0, 0])
        .engine_load(0, 4, 0)
        .engine_load(1, 2, 0)
        .engine_load(2, 3, 1);
    let got = plan(&mut p, &prompt(1, 50), &loaded);
    assert_eq!((prefill_of(&got), decode_of(&got)), (Some(1), 3));
    // Engines that report nothing: this replica's in-flight count decides.
    let local = cluster.with_in_flight(&[3, 1, 2, 0]);
    assert_eq!(prefill_of(&plan(&mut p, &prompt(1, 50), &local)), Some(1));
}

#[test]
fn role_less_endpoints_disaggregate_among_themselves_and_one_alone_forwards() {
    let mut p = policy("{}");
    let got = plan(&mut p, &prompt(3, 40), &endpoints(2));
    let decode = decode_of(&got);
    assert_eq!(prefill_of(&got), Some(1 - decode));
    assert_eq!(
        plan(&mut p, &prompt(3, 40), &endpoints(1)),
        Plan::forward(0)
    );
    let none = endpoints(2).unhealthy(0).unhealthy(1).context();
    assert!(matches!(
        p.translate(&prompt(3, 40), &none),
        Err(PolicyError::Unavailable(_))
    ));
}

#[test]
fn a_retry_avoids_the_engine_that_failed() {
    let mut p = policy("{}");
    let req = prompt(11, 64);
    let favourite = decode_of(&plan(&mut p, &req, &split(4)));
    let retry = split(4).retry(2, FailureKind::EndpointError, favourite);
    assert_ne!(decode_of(&plan(&mut p, &req, &retry)), favourite);
}

#[test]
fn bad_configs_are_refused() {
    for config in [
        r#"{"prefix_tokens": 0}"#,
        r#"{"prefix_tokens": 5000}"#,
        r#"{"max_waiting": -1}"#,
        r#"{"prefix": 3}"#,
    ] {
        assert!(Harness::<Affinity>::init(config).is_err(), "{config}");
    }
}
