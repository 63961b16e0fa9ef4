//! The executor on real components: a stateless policy's calls run in parallel on a pool, a
//! stateful one's one at a time on one instance, and a fault under load costs the other calls
//! nothing but the faulted call's own time.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use switchyard_contract::{Plan, Step, validate};
use switchyard_tests::{Guest, guest_bytes};

use crate::tests::{host, load_misbehave, snapshot, translate, translate_with_headers};
use crate::{Contract, Policy};

/// Callers calling at once: more than the router's worker threads on any CI machine.
const CALLERS: usize = 8;

fn load(guest: Guest, name: &str) -> Policy {
    let policy = host()
        .load(name, &guest_bytes(guest), None)
        .unwrap_or_else(|e| panic!("{name} loads: {e}"));
    assert!(policy.settle(), "{name}: its spare is built");
    policy
}

/// `CALLERS` threads, released together, each making `calls` calls with `call`.
fn from_threads(calls: usize, call: impl Fn(usize) + Sync) {
    let start = Barrier::new(CALLERS);
    std::thread::scope(|s| {
        for thread in 0..CALLERS {
            let (start, call) = (&start, &call);
            s.spawn(move || {
                start.wait();
                for i in 0..calls {
                    call(thread * calls + i);
                }
            });
        }
    });
}

#[test]
fn a_stateless_policys_calls_overlap_on_a_pool_of_instances() {
    let policy = load(Guest::DISAGG, "disagg");
    assert!(policy.info().stateless, "{:?}", policy.info());
    assert_eq!(policy.info().contract, Contract::V0_2_0);
    from_threads(300, |_| {
        let plan = translate(&policy, 17, 4).expect("a plan");
        validate(&plan, 17, &snapshot(4)).expect("the plan is valid");
    });
    let view = policy.executor();
    eprintln!(
        "{CALLERS} callers on a stateless policy: {} instances, at most {} calls at once",
        view.instances, view.peak_concurrent_calls
    );
    assert!(
        view.peak_concurrent_calls >= 2,
        "calls never overlapped: {view:?}"
    );
    assert!(view.instances >= 2, "{view:?}");
    assert!(view.instances <= crate::default_pool_size(), "{view:?}");
}

#[test]
fn a_stateful_policys_calls_run_one_at_a_time_on_one_instance() {
    // The 0.1.0 guest forwards to endpoint `n % 3` on its n-th call: with every call on one
    // instance, in turn, the endpoints are used equally, whatever the interleaving.
    let policy = load(Guest::V0_1_0, "v0.1.0");
    assert!(!policy.info().stateless);
    const CALLS: usize = 99;
    let per_endpoint = parking_lot::Mutex::new([0usize; 3]);
    from_threads(CALLS, |_| {
        let plan = translate(&policy, 17, 3).expect("a plan");
        let [Step::Forward { endpoint }] = plan.steps[..] else {
            panic!("a forward: {plan:?}");
        };
        per_endpoint.lock()[endpoint as usize] += 1;
    });
    let view = policy.executor();
    assert_eq!(view.peak_concurrent_calls, 1, "{view:?}");
    assert_eq!(view.instances, 1, "{view:?}");
    let each = CALLERS * CALLS / 3;
    assert_eq!(*per_endpoint.lock(), [each; 3]);
}

#[test]
fn a_fault_under_load_does_not_hold_up_the_other_calls() {
    // The same load twice, in one run: `CALLERS - 1` threads planning, and one more that plans
    // too, then one that makes the policy loop to its deadline again and again. The others'
    // latency is reported, not asserted (a shared CI machine decides it); that every one of
    // them is served is asserted.
    let policy = load_misbehave(&host(), "ok");
    let deadline = host().limits().deadline;
    let (_, calm) = under_load(&policy, false);
    let (faults, faulting) = under_load(&policy, true);
    let summary = |latencies: &[Duration]| {
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
        format!(
            "{} calls, p50 {:?}, p99 {:?}, max {:?}",
            latencies.len(),
            at(0.5),
            at(0.99),
            at(1.0)
        )
    };
    eprintln!(
        "{} other callers of a stateless policy, 2 s each: with no fault: {}; with {faults} \
         faults of {deadline:?} each beside them: {}",
        CALLERS - 1,
        summary(&calm),
        summary(&faulting)
    );
    assert!(faults > 0);
}

/// `CALLERS` threads calling `policy` for 2 s; thread 0 makes its calls loop to the deadline
/// when `faulting`. Returns thread 0's faults and the other threads' latencies, sorted.
fn under_load(policy: &Policy, faulting: bool) -> (usize, Vec<Duration>) {
    let faults = parking_lot::Mutex::new(0usize);
    let latencies = parking_lot::Mutex::new(Vec::new());
    let busy_until = Instant::now() + Duration::from_secs(2);
    from_threads(1, |thread| {
        if thread == 0 && faulting {
            let header = [("x-misbehave".to_owned(), "loop".to_owned())];
            while Instant::now() < busy_until {
                let e = translate_with_headers(policy, 17, 4, &header).expect_err("loops");
                assert!(e.is_fault(), "{e}");
                *faults.lock() += 1;
            }
            return;
        }
        while Instant::now() < busy_until {
            let started = Instant::now();
            let plan = translate(policy, 17, 4);
            let took = started.elapsed();
            let plan: Plan = plan.unwrap_or_else(|e| panic!("a well-behaved call failed: {e}"));
            validate(&plan, 17, &snapshot(4)).expect("the plan is valid");
            if thread != 0 {
                latencies.lock().push(took);
            }
        }
    });
    let mut latencies = latencies.into_inner();
    latencies.sort_unstable();
    (faults.into_inner(), latencies)
}

#[test]
fn a_stateful_policy_faulting_under_load_serves_every_other_call_from_its_spare() {
    // One instance, so the other calls wait for the faulted one; but the spare takes over at
    // once, so none of them is refused. The faulting thread lets each new spare be built
    // before the next fault: faults faster than builds are refused, by design.
    let policy = load(Guest::V0_1_0, "v0.1.0");
    let faults = 20;
    from_threads(100, |i| {
        if i == 0 {
            let header = [("x-trap".to_owned(), "1".to_owned())];
            for _ in 0..faults {
                let e = translate_with_headers(&policy, 17, 3, &header).expect_err("traps");
                assert!(e.is_fault(), "{e}");
                assert!(policy.settle(), "a new spare is built");
            }
            return;
        }
        translate(&policy, 17, 3).unwrap_or_else(|e| panic!("a well-behaved call failed: {e}"));
    });
    assert_eq!(policy.executor().instances, 1);
}
