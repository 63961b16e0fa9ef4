//! The bindings of each contract version: what crosses into a guest, and components of both
//! versions loading and behaving as their version says.

use switchyard_contract::{Plan, PolicyRequest, RequestFlow, Step};
use switchyard_tests::{Guest, guest_bytes};

use super::{v0_1_0, v0_2_0};
use crate::tests::{host, outcome, request, translate, translate_with_headers};
use crate::{Contract, Policy, check};

#[test]
fn only_the_requested_prompt_prefix_crosses_into_the_guest() {
    let prompt: Vec<u32> = (0..100).collect();
    let request = request(&prompt, &[]);
    let wit = v0_2_0::request(&request, 8);
    assert_eq!(wit.prompt_len, Some(100));
    assert_eq!(wit.prompt_prefix, (0..8).collect::<Vec<u32>>());
    assert_eq!(v0_2_0::request(&request, u32::MAX).prompt_prefix.len(), 100);
    assert!(v0_2_0::request(&request, 0).prompt_prefix.is_empty());
}

#[test]
fn a_prompt_the_router_did_not_tokenize_has_no_length() {
    let untokenized = PolicyRequest {
        prompt: None,
        ..request(&[], &[])
    };
    let wit = v0_2_0::request(&untokenized, u32::MAX);
    assert_eq!((wit.prompt_len, wit.prompt_prefix.len()), (None, 0));
}

#[test]
fn flow_control_reaches_0_2_0_guests() {
    let prompt = [1, 2, 3];
    let plain = v0_2_0::request(&request(&prompt, &[]), 8);
    assert_eq!(
        (plain.priority, plain.tenant, plain.deadline_ms),
        (0, None, None)
    );
    let request = PolicyRequest {
        flow: RequestFlow {
            priority: -3,
            tenant: Some("acme"),
            deadline_ms: Some(1_500),
        },
        ..request(&prompt, &[])
    };
    let wit = v0_2_0::request(&request, 8);
    assert_eq!(wit.priority, -3);
    assert_eq!(wit.tenant.as_deref(), Some("acme"));
    assert_eq!(wit.deadline_ms, Some(1_500));
}

#[test]
fn an_adapters_base_model_reaches_0_2_0_guests() {
    let prompt = [1, 2, 3];
    assert_eq!(v0_2_0::request(&request(&prompt, &[]), 8).base_model, None);
    let request = PolicyRequest {
        model: "sql-lora",
        base_model: Some("llama-3-8b"),
        ..request(&prompt, &[])
    };
    let wit = v0_2_0::request(&request, 8);
    assert_eq!(
        (wit.model.as_str(), wit.base_model.as_deref()),
        ("sql-lora", Some("llama-3-8b"))
    );
}

#[test]
fn removed_endpoints_reach_0_1_0_guests_only() {
    use switchyard_contract::{EndpointSnapshot, Health, PolicyContext};
    let health = [
        Health::Removed,
        Health::Healthy,
        Health::Draining,
        Health::Removed,
    ];
    let ctx = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: (0u32..)
            .zip(health)
            .map(|(id, health)| EndpointSnapshot {
                health,
                ..EndpointSnapshot::synthetic(id)
            })
            .collect(),
    };
    // 0.1.0 keeps its promise, `endpoints[id].id == id`: removed ones stay, unhealthy.
    let old: Vec<_> = v0_1_0::context(&ctx)
        .endpoints
        .iter()
        .map(|e| (e.id, e.healthy))
        .collect();
    assert_eq!(old, [(0, false), (1, true), (2, false), (3, false)]);
    // 0.2.0 lists what is still there, by id.
    let new: Vec<_> = v0_2_0::context(&ctx)
        .endpoints
        .iter()
        .map(|e| (e.id, e.healthy))
        .collect();
    assert_eq!(new, [(1, true), (2, false)]);
}

#[test]
fn protocols_reach_0_2_0_guests_and_0_1_0_guests_see_only_mlc_endpoints() {
    use switchyard_contract::{EndpointSnapshot, PolicyContext, Protocol};
    let ctx = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: (0u32..)
            .zip(Protocol::ALL)
            .map(|(id, protocol)| EndpointSnapshot {
                protocol,
                ..EndpointSnapshot::synthetic(id)
            })
            .collect(),
    };
    // A 0.1.0 policy plans microserving only: the others are listed, unhealthy, so its
    // `endpoints[id].id == id` holds and it never plans on them.
    let old: Vec<_> = v0_1_0::context(&ctx)
        .endpoints
        .iter()
        .map(|e| (e.id, e.healthy))
        .collect();
    assert_eq!(old, [(0, true), (1, false), (2, false), (3, false)]);
    let new: Vec<_> = v0_2_0::context(&ctx)
        .endpoints
        .iter()
        .map(|e| (e.id, e.healthy, format!("{:?}", e.protocol)))
        .collect();
    assert_eq!(
        new,
        [
            (0, true, "Protocol::Mlc".to_owned()),
            (1, true, "Protocol::Vllm".to_owned()),
            (2, true, "Protocol::Sglang".to_owned()),
            (3, true, "Protocol::Openai".to_owned()),
        ]
    );
}

// === components of both contract versions ===

fn load(guest: Guest, name: &str, config: Option<&str>) -> Policy {
    let policy = host()
        .load(name, &guest_bytes(guest), config)
        .unwrap_or_else(|e| panic!("{name} loads: {e}"));
    assert!(policy.settle(), "{name}: its spare is built");
    policy
}

fn forwards_to(policy: &Policy) -> u32 {
    match translate(policy, 17, 3).expect("a plan").steps[..] {
        [Step::Forward { endpoint }] => endpoint,
        ref steps => panic!("a forward: {steps:?}"),
    }
}

#[test]
fn a_0_1_0_component_loads_and_behaves_as_it_did() {
    let policy = load(Guest::V0_1_0, "v0.1.0", None);
    let info = policy.info();
    assert_eq!(info.contract, Contract::V0_1_0);
    assert!(!info.stateless, "0.1.0 promised one instance: {info:?}");
    assert_eq!((info.language.as_str(), info.prompt_tokens), ("rust", 0));
    // Its turn is state kept between calls: 0, 1, 2, then round again.
    let turns: Vec<u32> = (0..4).map(|_| forwards_to(&policy)).collect();
    assert_eq!(turns, [0, 1, 2, 0]);
    policy
        .on_complete(&outcome(1))
        .expect("on-complete is heard");
    // A fault replaces the instance with a fresh one, `init`ed: the turn starts again.
    let trap = [("x-trap".to_owned(), "1".to_owned())];
    let e = translate_with_headers(&policy, 17, 3, &trap).expect_err("traps");
    assert!(e.is_fault(), "{e}");
    assert_eq!(forwards_to(&policy), 0);
    check(&policy).expect("passes the checks every policy passes");
}

#[test]
fn state_carries_over_from_a_0_1_0_version_to_a_0_2_0_one() {
    // Both keep their turn as 8 little-endian bytes: the format is the policies' own, the
    // carrying is the host's, across contract versions.
    let old = load(Guest::V0_1_0, "p", None);
    assert_eq!([forwards_to(&old), forwards_to(&old)], [0, 1]);
    let new = load(Guest::STATEFUL, "p", Some(r#"{"generation": 2}"#));
    assert_eq!(new.info().contract, Contract::V0_2_0);
    assert!(!new.info().stateless);
    assert_eq!(new.carry_state_from(&old), Ok(8));
    assert_eq!(forwards_to(&new), 2);
}

#[test]
fn stateless_policies_take_no_part_in_state_carry_over() {
    let stateful = load(Guest::V0_1_0, "p", None);
    let stateless = load(Guest::DISAGG, "disagg", None);
    assert!(stateless.info().stateless);
    assert_eq!(stateless.carry_state_from(&stateful), Ok(0));
    assert_eq!(stateful.carry_state_from(&stateless), Ok(0));
    let _: Plan = translate(&stateless, 17, 4).expect("plans");
}

/// Each contract the host binds, frozen: its file (the host's bindings are generated from it),
/// and the sha256 it was frozen with. A match, so that a new version cannot be bound without
/// its own entry.
fn frozen(contract: Contract) -> (&'static str, &'static [u8], &'static str) {
    match contract {
        Contract::V0_1_0 => (
            "wit/deps/policy@0.1.0/policy.wit",
            include_bytes!("../../../../wit/deps/policy@0.1.0/policy.wit"),
            "a211512d3376cb6884e12a552ca308ab3881efa6084fc7d91d2f2ad637f880cf",
        ),
        Contract::V0_2_0 => (
            "wit/deps/policy@0.2.0/policy.wit",
            include_bytes!("../../../../wit/deps/policy@0.2.0/policy.wit"),
            "f57c252ce1e17e69860fe35fecccfc55a81cf0c18bdb770481e65b633ced1b2e",
        ),
    }
}

#[test]
fn frozen_contracts_never_change() {
    for contract in Contract::ALL {
        let (path, text, pinned) = frozen(contract);
        assert_eq!(
            crate::load::sha256_hex(text),
            pinned,
            "{path} ({contract}) changed. A frozen contract never changes, not even a comment: \
             components built against it rely on it as released, and the book shows it. Undo \
             the edit; a change belongs in the next version, a copy beside it \
             (wit/deps/policy@0.3.0/policy.wit) with bindings of its own."
        );
    }
}

#[test]
fn a_0_2_0_policy_that_reads_nothing_hears_no_outcome() {
    // The stateful guest reads nothing, and its `on-complete` traps: a call would be a fault.
    let policy = load(Guest::STATEFUL, "stateful", None);
    assert_eq!(policy.info().reads, switchyard_contract::Reads::NOTHING);
    assert!(translate(&policy, 17, 3).is_ok());
    assert_eq!(policy.on_complete(&outcome(1)), Ok(()));
}

#[test]
fn what_each_policy_reads_is_what_it_declares() {
    use switchyard_contract::Reads;
    let reads = |guest: Guest| load(guest, "p", None).info().reads;
    // A 0.1.0 component declares nothing: it reads everything, as it always did.
    assert_eq!(reads(Guest::V0_1_0), Reads::ALL);
    assert_eq!(
        reads(Guest::MISBEHAVE),
        Reads {
            prompt: false,
            outcomes: true
        }
    );
    assert_eq!(
        reads(Guest::DISAGG),
        Reads {
            prompt: true,
            outcomes: false
        }
    );
    assert_eq!(reads(Guest::ROUND_ROBIN), Reads::NOTHING);
}
