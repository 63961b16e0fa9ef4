//! The example policies (`examples/`: Rust, Python, JavaScript) loaded through the policy host
//! as the router loads them, checked against chosen endpoint snapshots. Every plan must also
//! pass the host's plan validation, and every example must pass `policy check`.
//!
//! Build the components first: `make examples` (writes `target/examples/*.wasm`).

use std::path::PathBuf;
use std::sync::OnceLock;

use switchyard_contract::{EndpointId, Plan, SendBegin, Step, validate};
use switchyard_contract::{EndpointSnapshot, Health, Role};
use switchyard_contract::{Outcome, OutcomeStatus, PolicyContext, PolicyRequest, TranslateError};
use switchyard_policy_host::{Contract, LoadError, Policy, PolicyHost, PolicyLimits, check};

// === fixtures ===

fn example(name: &str) -> PathBuf {
    let path = switchyard_tests::checkout()
        .join("target/examples")
        .join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: run `make examples` first",
        path.display()
    );
    path
}

/// One host for the whole test binary: its in-memory compile cache compiles each example once,
/// while every `load` still gets a fresh instance, so stateful policies do not leak state
/// between tests. Compiling the Python and JavaScript components takes tens of seconds, so
/// compiled code is also kept on disk, under `target/` (never the user's cache directory).
/// The router's own limits: the deadlines count CPU time, so the other tests' compiles
/// holding both CI cores cost these calls nothing.
fn host() -> &'static PolicyHost {
    static HOST: OnceLock<PolicyHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let cache = switchyard_tests::checkout().join("target/examples/compiled");
        PolicyHost::new(PolicyLimits {
            cache_dir: Some(cache),
            ..PolicyLimits::default()
        })
        .expect("policy host")
    })
}

fn load(name: &str, config: &str) -> Result<Policy, LoadError> {
    host().load_file(&example(name), Some(config))
}

/// Healthy, role-less endpoints with the given in-flight counts, one GPU each.
fn endpoints(loads: &[u32]) -> Vec<EndpointSnapshot> {
    (0u32..)
        .zip(loads)
        .map(|(id, &in_flight)| EndpointSnapshot {
            in_flight,
            ..EndpointSnapshot::synthetic(id)
        })
        .collect()
}

fn unhealthy(mut endpoints: Vec<EndpointSnapshot>, id: EndpointId) -> Vec<EndpointSnapshot> {
    endpoints[id as usize].health = Health::NotReady;
    endpoints
}

fn first_attempt(endpoints: Vec<EndpointSnapshot>) -> PolicyContext {
    PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints,
    }
}

/// What varies between the requests of these tests.
#[derive(Default)]
struct Req<'a> {
    id: u64,
    prompt: &'a [u32],
    user: Option<&'a str>,
    headers: &'a [(String, String)],
}

/// Ask `policy` for a plan and check it as the router would.
fn translate(
    policy: &Policy,
    req: &Req<'_>,
    loads: Vec<EndpointSnapshot>,
) -> Result<Plan, TranslateError> {
    let ctx = first_attempt(loads);
    let request = PolicyRequest {
        id: req.id,
        prompt: Some(req.prompt),
        max_tokens: 16,
        stream: false,
        model: "m",
        user: req.user,
        headers: req.headers,
        flow: Default::default(),
        base_model: None,
    };
    let plan = policy.translate(&request, &ctx)?;
    let prompt_len = u32::try_from(req.prompt.len()).expect("test prompt fits u32");
    if let Err(e) = validate(&plan, prompt_len, &ctx.endpoints) {
        panic!("invalid plan {plan:?} for a {prompt_len}-token prompt: {e}");
    }
    Ok(plan)
}

fn prompt(len: u32, seed: u32) -> Vec<u32> {
    (0..len)
        .map(|i| i.wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn forward(endpoint: EndpointId) -> Plan {
    Plan {
        steps: vec![Step::Forward { endpoint }],
    }
}

fn disagg(prefill: EndpointId, decode: EndpointId) -> Plan {
    let end = -1;
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

fn decode_endpoint(plan: &Plan) -> EndpointId {
    match plan.steps.last() {
        Some(Step::StartGenerate { decode, .. }) => *decode,
        other => panic!("expected a disaggregated plan, got last step {other:?}"),
    }
}

fn assert_passes_check(name: &str) {
    let policy = load(name, "{}").unwrap_or_else(|e| panic!("{name} loads: {e}"));
    let report = check(&policy).unwrap_or_else(|e| panic!("{name} fails policy check: {e}"));
    assert!(report.plans > 0, "{name} made no plan");
}

// === every example ===

#[test]
fn every_example_passes_policy_check_and_describes_itself() {
    // (name, language, prompt tokens, stateless): the Python policy remembers prefixes.
    for (name, language, prompt_tokens, stateless) in [
        ("priority-rust", "rust", 0, true),
        ("affinity-rust", "rust", 1024, true),
        ("model-route-rust", "rust", 0, true),
        ("prefix-aware-python", "python", 64, false),
        ("slo-js", "javascript", 0, true),
    ] {
        assert_passes_check(name);
        let info = load(name, "{}").expect("loads").info().clone();
        assert_eq!(
            (info.language.as_str(), info.prompt_tokens, info.stateless),
            (language, prompt_tokens, stateless),
            "{name}"
        );
        assert_eq!(info.contract, Contract::V0_2_0, "{name}");
    }
}

#[test]
fn every_example_refuses_an_unknown_config_key() {
    for name in [
        "priority-rust",
        "affinity-rust",
        "model-route-rust",
        "prefix-aware-python",
        "slo-js",
    ] {
        match load(name, r#"{"no_such_key": 1}"#) {
            Err(LoadError::Init { message, .. }) => {
                assert!(message.contains("no_such_key"), "{name}: {message}")
            }
            other => panic!("{name}: expected an init error, got {other:?}"),
        }
    }
}

// === priority-rust ===

#[test]
fn priority_rust_forwards_priority_requests_and_disaggregates_the_rest() {
    let policy = load("priority-rust", "{}").expect("loads");
    let p = prompt(40, 0);
    let loads = || endpoints(&[1, 4, 2, 3]);
    let by_user = Req {
        prompt: &p,
        user: Some("priority-alice"),
        ..Req::default()
    };
    assert_eq!(translate(&policy, &by_user, loads()), Ok(forward(0)));
    let header = [("x-priority".to_owned(), "high".to_owned())];
    let by_header = Req {
        prompt: &p,
        headers: &header,
        ..Req::default()
    };
    assert_eq!(
        translate(&policy, &by_header, endpoints(&[5, 4, 2, 3])),
        Ok(forward(2))
    );
    let plain = Req {
        prompt: &p,
        user: Some("alice"),
        ..Req::default()
    };
    // MLC's disaggregated plan: P = endpoint 0, D = least in-flight among the rest.
    assert_eq!(translate(&policy, &plain, loads()), Ok(disagg(0, 2)));
}

// === affinity-rust ===

/// Endpoint 0 prefills, the rest decode; endpoint `i` has address hash `hashes[i]`.
fn addressed(hashes: &[u64]) -> Vec<EndpointSnapshot> {
    let mut snapshot = endpoints(&vec![0; hashes.len()]);
    for (e, &hash) in snapshot.iter_mut().zip(hashes) {
        e.role = if e.id == 0 {
            Role::Prefill
        } else {
            Role::Decode
        };
        e.address_hash = hash;
    }
    snapshot
}

#[test]
fn affinity_rust_agrees_across_replicas_through_the_component() {
    let policy = load("affinity-rust", "{}").expect("loads");
    // What two replicas see: the same prefill engine (hash 1) and three decode engines, in
    // another id order.
    let here = [1, 0xaaaa, 0xbbbb, 0xcccc];
    let there = [1, 0xcccc, 0xaaaa, 0xbbbb];
    let mut chosen = std::collections::BTreeSet::new();
    for seed in 0..60 {
        let p = prompt(200, seed);
        let req = Req {
            prompt: &p,
            ..Req::default()
        };
        let d_here = decode_endpoint(&translate(&policy, &req, addressed(&here)).expect("plan"));
        let d_there = decode_endpoint(&translate(&policy, &req, addressed(&there)).expect("plan"));
        assert_eq!(
            here[d_here as usize], there[d_there as usize],
            "seed {seed}"
        );
        chosen.insert(here[d_here as usize]);
    }
    assert_eq!(chosen.len(), 3, "prefixes spread over every decode engine");
}

#[test]
fn affinity_rust_reads_the_load_engines_report() {
    let policy = load("affinity-rust", r#"{"max_waiting": 1}"#).expect("loads");
    let p = prompt(100, 7);
    let req = Req {
        prompt: &p,
        ..Req::default()
    };
    let hashes = [1, 0xaaaa, 0xbbbb];
    let favourite = decode_endpoint(&translate(&policy, &req, addressed(&hashes)).expect("plan"));
    let mut queueing = addressed(&hashes);
    queueing[favourite as usize].running = Some(4);
    queueing[favourite as usize].waiting = Some(2);
    let other = decode_endpoint(&translate(&policy, &req, queueing).expect("plan"));
    assert_ne!(
        other, favourite,
        "an engine queueing past max_waiting is passed over"
    );
}

// === slo-js ===

#[test]
fn slo_js_disaggregates_long_prompts_only() {
    let policy = load("slo-js", "{}").expect("loads");
    let loads = || endpoints(&[1, 4, 0, 3]);
    let short = prompt(255, 0);
    let long = prompt(256, 0);
    let req = |p| Req {
        prompt: p,
        ..Req::default()
    };
    assert_eq!(translate(&policy, &req(&short), loads()), Ok(forward(2)));
    assert_eq!(translate(&policy, &req(&long), loads()), Ok(disagg(0, 2)));
}

#[test]
fn slo_js_reads_its_threshold_and_skips_unhealthy_endpoints() {
    let policy = load("slo-js", r#"{"long_prompt_tokens": 8}"#).expect("loads");
    let p = prompt(10, 0);
    let req = Req {
        prompt: &p,
        ..Req::default()
    };
    assert_eq!(
        translate(&policy, &req, unhealthy(endpoints(&[0, 4, 1]), 0)),
        Ok(disagg(1, 2))
    );
    let none = unhealthy(unhealthy(endpoints(&[0, 0]), 0), 1);
    assert!(matches!(
        translate(&policy, &req, none),
        Err(TranslateError::Unavailable { .. })
    ));
    assert!(matches!(
        load("slo-js", r#"{"long_prompt_tokens": 0}"#),
        Err(LoadError::Init { .. })
    ));
}

// === prefix-aware-python ===

#[test]
fn prefix_aware_python_sends_a_repeated_prefix_to_the_same_decode_endpoint() {
    let policy = load("prefix-aware-python", "{}").expect("loads");
    let a = prompt(100, 1);
    let b = prompt(100, 2);
    let req = |id, p| Req {
        id,
        prompt: p,
        ..Req::default()
    };
    // First sight of prefix A: the least-loaded decode endpoint (prefill stays on 0).
    let first = translate(&policy, &req(1, &a), endpoints(&[0, 0, 0, 0])).expect("plan");
    assert_eq!(first, disagg(0, 1));
    // A again while endpoint 1 is busier (within the default margin of 4): still endpoint 1,
    // whose prefix cache holds A.
    let again = translate(&policy, &req(2, &a), endpoints(&[0, 3, 0, 1])).expect("plan");
    assert_eq!(decode_endpoint(&again), 1);
    // A different prefix under the same load: the least-loaded endpoint.
    let other = translate(&policy, &req(3, &b), endpoints(&[0, 3, 0, 1])).expect("plan");
    assert_eq!(decode_endpoint(&other), 2);
    // A once endpoint 1 is more than the margin busier than the least loaded: least loaded.
    let busy = translate(&policy, &req(4, &a), endpoints(&[0, 9, 2, 1])).expect("plan");
    assert_eq!(decode_endpoint(&busy), 3);
    // ... and B stays where it went, as long as that endpoint is healthy.
    let b_again = translate(&policy, &req(5, &b), endpoints(&[0, 0, 2, 0])).expect("plan");
    assert_eq!(decode_endpoint(&b_again), 2);
    let b_down = translate(&policy, &req(6, &b), unhealthy(endpoints(&[0, 0, 2, 0]), 2));
    assert_eq!(b_down.map(|p| decode_endpoint(&p)), Ok(1));
}

#[test]
fn prefix_aware_python_learns_the_generator_from_on_complete() {
    let policy = load("prefix-aware-python", r#"{"load_margin": 0}"#).expect("loads");
    let a = prompt(64, 7);
    let req = |id| Req {
        id,
        prompt: &a,
        ..Req::default()
    };
    let first = translate(&policy, &req(10), endpoints(&[0, 0, 0])).expect("plan");
    assert_eq!(decode_endpoint(&first), 1);
    // The router retried request 10 elsewhere and endpoint 2 generated it.
    policy
        .on_complete(&Outcome {
            request_id: 10,
            status: OutcomeStatus::Ok,
            attempts: 2,
            generator: Some(2),
            prefix_matched: 0,
            completion_tokens: 16,
            ttft_us: 1_000,
            e2e_us: 9_000,
        })
        .expect("on-complete is heard");
    let repeat = translate(&policy, &req(11), endpoints(&[0, 0, 0])).expect("plan");
    assert_eq!(decode_endpoint(&repeat), 2);
}

#[test]
fn prefix_aware_python_routes_short_prompts_by_load() {
    // Shorter than one 16-token page: nothing to reuse, so no affinity.
    let policy = load("prefix-aware-python", "{}").expect("loads");
    let p = prompt(10, 3);
    let req = |id| Req {
        id,
        prompt: &p,
        ..Req::default()
    };
    let first = translate(&policy, &req(1), endpoints(&[0, 0, 0])).expect("plan");
    assert_eq!(decode_endpoint(&first), 1);
    let second = translate(&policy, &req(2), endpoints(&[0, 1, 0])).expect("plan");
    assert_eq!(decode_endpoint(&second), 2);
}
