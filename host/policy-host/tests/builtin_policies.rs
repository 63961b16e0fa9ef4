//! The compiled built-in policies (`plugins/disagg.wasm`, `plugins/round-robin.wasm`) loaded
//! through the policy host, against a transcription of MLC's router over a table of clusters.
//! Every plan they return must also pass the host's plan validation.
//!
//! Build the components first: `make plugins`.

use std::path::PathBuf;

use switchyard_contract::{EndpointId, Plan, SendBegin, Step, validate};
use switchyard_contract::{EndpointSnapshot, Health, Role};
use switchyard_contract::{Failure, FailureKind, PolicyContext, PolicyRequest, TranslateError};
use switchyard_policy::testing::load_patterns;
use switchyard_policy_host::{LoadError, Policy, PolicyHost, PolicyLimits};

const FACTORS: [f64; 3] = [0.0, 0.1, 0.5];
const PROMPT_LENS: [u32; 4] = [1, 2, 17, 3000];

// === fixtures ===

/// A built-in policy's component in `plugins/`, built from source and installed on first use.
fn plugin(file: &str) -> PathBuf {
    switchyard_tests::plugins_dir().join(file)
}

fn host() -> PolicyHost {
    // No disk cache: a test must not write into the user's cache directory.
    PolicyHost::new(PolicyLimits {
        cache_dir: None,
        ..PolicyLimits::default()
    })
    .expect("policy host")
}

fn load(host: &PolicyHost, file: &str, config: &str) -> Result<Policy, LoadError> {
    host.load_file(&plugin(file), Some(config))
}

fn disagg(host: &PolicyHost, factor: f64) -> Policy {
    load(
        host,
        "disagg.wasm",
        &format!(r#"{{"pd_balance_factor": {factor}}}"#),
    )
    .expect("disagg loads")
}

/// `n` healthy, role-less endpoints with the given in-flight counts, one GPU each.
fn endpoints(loads: &[u32]) -> Vec<EndpointSnapshot> {
    (0u32..)
        .zip(loads)
        .map(|(id, &in_flight)| EndpointSnapshot {
            in_flight,
            ..EndpointSnapshot::synthetic(id)
        })
        .collect()
}

fn first_attempt(endpoints: Vec<EndpointSnapshot>) -> PolicyContext {
    PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints,
    }
}

fn retry(endpoints: Vec<EndpointSnapshot>, kind: FailureKind, failed: EndpointId) -> PolicyContext {
    PolicyContext {
        attempt: 2,
        last_failure: Some(Failure {
            kind,
            endpoint: failed,
        }),
        endpoints,
    }
}

/// Ask `policy` for a plan for a `prompt_len`-token prompt and check it as the router would.
fn translate(
    policy: &Policy,
    prompt_len: u32,
    ctx: &PolicyContext,
) -> Result<Plan, TranslateError> {
    let prompt: Vec<u32> = (0..prompt_len).collect();
    let request = PolicyRequest {
        id: u64::from(prompt_len),
        prompt: Some(&prompt),
        max_tokens: 16,
        stream: false,
        model: "m",
        user: None,
        headers: &[],
        flow: Default::default(),
        base_model: None,
    };
    let plan = policy.translate(&request, ctx)?;
    if let Err(e) = validate(&plan, prompt_len, &ctx.endpoints) {
        panic!("invalid plan {plan:?} for a {prompt_len}-token prompt: {e}");
    }
    Ok(plan)
}

fn disagg_plan(prefill: EndpointId, decode: EndpointId, end: i32) -> Plan {
    Plan {
        steps: vec![
            Step::PrepRecv { decode, end },
            Step::RemoteSend {
                prefill,
                decode,
                begin: SendBegin::PrefixMatched,
                end,
            },
            Step::StartGenerate { decode, begin: end },
        ],
    }
}

fn forward(endpoint: EndpointId) -> Plan {
    Plan {
        steps: vec![Step::Forward { endpoint }],
    }
}

/// Seeds `switchyard_policy::testing::load_patterns` (the table the built-in policies' own
/// tests use), so the pseudo-random loads are the same on every run.
const LOAD_SEED: u32 = 0x2545_F491;

// === MLC's router, transcribed ===

/// `_handle_completion_disagg`: prefill on server 0, decode on
/// `min(range(1, n), key=num_running)`, `kv_window_end = -1 if f == 0 else int((1-f)*len)`.
fn mlc_disagg(loads: &[u32], prompt_len: u32, factor: f64) -> Plan {
    let decode = (1..loads.len()).min_by_key(|&i| loads[i]).expect("n >= 2") as u32;
    let end = if factor == 0.0 {
        -1
    } else {
        ((1.0 - factor) * f64::from(prompt_len)).floor() as i32
    };
    disagg_plan(0, decode, end)
}

/// `_handle_completion_round_robin`: `min(range(n), key=num_running)`.
fn mlc_round_robin(loads: &[u32]) -> Plan {
    forward((0..loads.len()).min_by_key(|&i| loads[i]).expect("n >= 1") as u32)
}

// === disagg ===

#[test]
fn disagg_matches_mlc_through_the_host() {
    let host = host();
    let mut checked = 0;
    for factor in FACTORS {
        let policy = disagg(&host, factor);
        for n in 2..=8 {
            for loads in load_patterns(n, LOAD_SEED) {
                let ctx = first_attempt(endpoints(&loads));
                for len in PROMPT_LENS {
                    let plan = translate(&policy, len, &ctx);
                    let expected = mlc_disagg(&loads, len, factor);
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
fn disagg_handles_small_and_degraded_clusters() {
    let host = host();
    let policy = disagg(&host, 0.1);
    assert_eq!(
        translate(&policy, 17, &first_attempt(endpoints(&[3]))),
        Ok(forward(0))
    );

    let mut eps = endpoints(&[0, 5, 3, 1]);
    eps[0].health = Health::NotReady;
    assert_eq!(
        translate(&policy, 17, &first_attempt(eps)),
        Ok(disagg_plan(1, 3, 15))
    );

    let mut eps = endpoints(&[2, 4, 9, 3]);
    eps[2].role = Role::Prefill;
    assert_eq!(
        translate(&policy, 3000, &first_attempt(eps)),
        Ok(disagg_plan(2, 0, 2700))
    );

    let mut eps = endpoints(&[0, 0]);
    eps.iter_mut().for_each(|e| e.health = Health::NotReady);
    assert!(matches!(
        translate(&policy, 17, &first_attempt(eps)),
        Err(TranslateError::Unavailable { .. })
    ));
}

#[test]
fn disagg_retries_avoid_the_failed_endpoint() {
    let host = host();
    let policy = disagg(&host, 0.0);
    let ctx = retry(endpoints(&[0, 0, 1, 2]), FailureKind::Preempted, 1);
    assert_eq!(translate(&policy, 17, &ctx), Ok(disagg_plan(0, 2, -1)));
    let ctx = retry(endpoints(&[0, 0, 1, 2]), FailureKind::EndpointError, 0);
    assert_eq!(translate(&policy, 17, &ctx), Ok(disagg_plan(1, 2, -1)));
    let ctx = retry(endpoints(&[0, 0]), FailureKind::Timeout, 1);
    assert_eq!(translate(&policy, 17, &ctx), Ok(forward(0)));
}

#[test]
fn disagg_plans_are_valid_on_every_degraded_cluster() {
    let host = host();
    for factor in FACTORS {
        let policy = disagg(&host, factor);
        for n in 1..=8u32 {
            for down in 0..n {
                for failed in 0..n {
                    let mut eps = endpoints(&load_patterns(n, LOAD_SEED)[5]);
                    eps[down as usize].health = Health::NotReady;
                    eps[(n - 1) as usize].role = Role::Prefill;
                    let ctx = retry(eps, FailureKind::EndpointError, failed);
                    for len in PROMPT_LENS {
                        // `translate` validates every plan; n == 1 has nothing healthy left.
                        match translate(&policy, len, &ctx) {
                            Ok(_) => {}
                            Err(TranslateError::Unavailable { .. }) if n == 1 => {}
                            Err(e) => panic!("n={n} down={down} failed={failed}: {e}"),
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn disagg_init_refuses_bad_configs() {
    let host = host();
    for (config, expected) in [
        (
            r#"{"pd_balance_factor": 1}"#,
            "pd_balance_factor must be at least 0 and below 1, got 1",
        ),
        (r#"{"pd_balance_factor": -0.5}"#, "got -0.5"),
        (r#"{"pd_balance_factor": "0.5"}"#, "must be a number"),
        (
            r#"{"pd_balance": 0.5}"#,
            "unknown config key \"pd_balance\"",
        ),
    ] {
        match load(&host, "disagg.wasm", config) {
            Err(LoadError::Init { message, .. }) => {
                assert!(message.contains(expected), "{config}: {message}")
            }
            other => panic!("{config}: expected an init error, got {other:?}"),
        }
    }
}

#[test]
fn builtins_describe_themselves() {
    let host = host();
    for file in ["disagg.wasm", "round-robin.wasm"] {
        let policy = load(&host, file, "{}").expect("loads");
        let info = policy.info();
        assert_eq!(
            (info.language.as_str(), info.prompt_tokens),
            ("rust", 0),
            "{file}"
        );
        assert_eq!(info.name, file.trim_end_matches(".wasm"));
    }
}

// === round-robin ===

#[test]
fn round_robin_matches_mlc_through_the_host() {
    let host = host();
    let policy = load(&host, "round-robin.wasm", "{}").expect("round-robin loads");
    let mut checked = 0;
    for n in 1..=8 {
        for loads in load_patterns(n, LOAD_SEED) {
            let ctx = first_attempt(endpoints(&loads));
            for len in PROMPT_LENS {
                let plan = translate(&policy, len, &ctx);
                assert_eq!(
                    plan,
                    Ok(mlc_round_robin(&loads)),
                    "loads={loads:?} len={len}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 8 * 8 * 4);
}

#[test]
fn round_robin_skips_unhealthy_and_failed_endpoints() {
    let host = host();
    let policy = load(&host, "round-robin.wasm", "{}").expect("round-robin loads");
    let mut eps = endpoints(&[3, 0, 0, 1]);
    eps[1].health = Health::NotReady;
    assert_eq!(translate(&policy, 17, &first_attempt(eps)), Ok(forward(2)));
    let ctx = retry(endpoints(&[2, 0, 1]), FailureKind::Preempted, 1);
    assert_eq!(translate(&policy, 17, &ctx), Ok(forward(2)));
    let mut eps = endpoints(&[0, 0]);
    eps.iter_mut().for_each(|e| e.health = Health::NotReady);
    assert!(matches!(
        translate(&policy, 17, &first_attempt(eps)),
        Err(TranslateError::Unavailable { .. })
    ));
    assert!(matches!(
        load(&host, "round-robin.wasm", r#"{"x": 1}"#),
        Err(LoadError::Init { .. })
    ));
}
