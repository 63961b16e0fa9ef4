//! Policy call costs: one `translate-request` on the built-in disagg policy (8 endpoints, a
//! 1000-token prompt), and a fresh instance from the policy's `InstancePre`.
//!
//! Needs `plugins/disagg.wasm`: run `make plugins` first (`make bench` does).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use switchyard_contract::{EndpointSnapshot, Role};
use switchyard_contract::{PolicyContext, PolicyRequest};
use switchyard_policy_host::{Policy, PolicyHost, PolicyLimits};

fn disagg() -> Policy {
    let path = switchyard_tests::guest(switchyard_tests::Guest::DISAGG);
    let host = PolicyHost::new(PolicyLimits {
        cache_dir: None,
        ..PolicyLimits::default()
    })
    .expect("policy engine");
    let policy = host
        .load_file(&path, None)
        .unwrap_or_else(|e| panic!("{e} ({}; run `make plugins`)", path.display()));
    // Its spare is built in the background: let that finish before timing calls.
    assert!(policy.settle(), "the spare is built");
    policy
}

/// 4 prefill + 4 decode endpoints with some load, as a busy cluster looks to a policy.
fn endpoints() -> Vec<EndpointSnapshot> {
    (0..8u32)
        .map(|id| EndpointSnapshot {
            role: if id < 4 { Role::Prefill } else { Role::Decode },
            in_flight: (id * 7) % 5,
            kv_usage: Some(0.1 * id as f32),
            running: Some(id % 3),
            waiting: Some(id % 2),
            ..EndpointSnapshot::synthetic(id)
        })
        .collect()
}

fn translate(c: &mut Criterion) {
    let policy = disagg();
    let prompt: Vec<u32> = (0..1000).collect();
    let headers = vec![("x-priority".to_owned(), "high".to_owned())];
    let context = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: endpoints(),
    };
    let mut id = 0;
    c.bench_function("policy/translate disagg 8 endpoints 1000 tokens", |b| {
        b.iter(|| {
            id += 1;
            let request = PolicyRequest {
                id,
                prompt: Some(&prompt),
                max_tokens: 128,
                stream: true,
                model: "model",
                user: None,
                headers: &headers,
                flow: Default::default(),
                base_model: None,
            };
            black_box(policy.translate(&request, &context).expect("a plan"))
        })
    });
}

fn instantiate(c: &mut Criterion) {
    let policy = disagg();
    c.bench_function("policy/instantiate disagg from InstancePre", |b| {
        b.iter(|| policy.bench_instantiate().expect("instantiates"))
    });
}

criterion_group!(benches, translate, instantiate);
criterion_main!(benches);
