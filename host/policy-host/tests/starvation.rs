//! A healthy policy is never faulted because the machine is busy.
//!
//! The example Python policy (`make examples` builds it) serves thousands of requests while
//! busy-loop threads, started here, keep every core saturated, and the calling thread runs at
//! the lowest priority, so that its calls wait for a CPU far longer than the policy's deadline,
//! again and again. A deadline measured in wall-clock time faults those calls (with the clock
//! swapped for a monotonic one, this test saw 5 deadline faults in the first seconds, then
//! thousands of calls refused while the starved builder rebuilt the Python instance); the
//! policy host measures the CPU time a call uses, and must fault none.
//!
//! One caller: the policy is stateful, so its calls run one at a time anyway, and a single
//! caller's measured wall time is its calls' own (never time queued behind another caller's
//! call), which is what a wall-clock deadline would have counted.
//!
//! It takes over the whole machine, so it is ignored by the ordinary test run and run alone,
//! serially, by `make test-starvation` (part of `make test`):
//!
//! ```sh
//! cargo test -p switchyard-policy-host --test starvation -- --ignored --test-threads=1
//! ```

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use switchyard_contract::{
    EndpointSnapshot, Outcome, OutcomeStatus, PolicyContext, PolicyRequest, Role,
};
use switchyard_policy_host::{PolicyHost, PolicyLimits};

/// Requests to serve; the test ends when they are served or after [`TIME_LIMIT`].
const REQUESTS: usize = 3000;
/// Served at least this many, or the test fails: "thousands".
const AT_LEAST: usize = 2000;
const TIME_LIMIT: Duration = Duration::from_secs(180);
/// Threads asking for plans, as router workers would (see the module docs for why one).
const CALLERS: usize = 1;
/// Busy-loop threads per core.
const HOGS_PER_CORE: usize = 2;
/// The caller's niceness: the lowest priority, so that every hog runs before it.
const CALLER_NICE: i32 = 19;

#[test]
#[ignore = "saturates every core: run alone, by `make test-starvation`"]
fn a_python_policy_on_a_saturated_machine_serves_thousands_of_requests_without_a_fault() {
    let path = switchyard_tests::checkout().join("target/examples/prefix-aware-python.wasm");
    assert!(
        path.is_file(),
        "{} is missing: run `make examples` first",
        path.display()
    );
    // The router's limits, with compiled code kept where the examples' tests keep it.
    let limits = PolicyLimits {
        cache_dir: Some(switchyard_tests::checkout().join("target/examples/compiled")),
        ..PolicyLimits::default()
    };
    let deadline = limits.deadline;
    let host = PolicyHost::new(limits).expect("the policy host starts");
    let policy = host
        .load_file(&path, None)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(policy.settle(), "the spare is built");

    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let stop = AtomicBool::new(false);
    let next = AtomicUsize::new(0);
    let faults = Mutex::new(Vec::new());
    let refusals = AtomicUsize::new(0);
    let served = AtomicUsize::new(0);
    let slow = AtomicUsize::new(0);
    let slowest = Mutex::new(Duration::ZERO);
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..cores * HOGS_PER_CORE {
            s.spawn(|| hog(&stop));
        }
        let callers: Vec<_> = (0..CALLERS)
            .map(|_| {
                s.spawn(|| {
                    lower_this_threads_priority(CALLER_NICE);
                    loop {
                        let id = next.fetch_add(1, Ordering::Relaxed);
                        if id >= REQUESTS || started.elapsed() > TIME_LIMIT {
                            return;
                        }
                        // Each guest call timed on its own: what a wall-clock deadline counts.
                        let timed = |took: Duration| {
                            if took > deadline {
                                slow.fetch_add(1, Ordering::Relaxed);
                            }
                            let mut slowest = slowest.lock();
                            *slowest = (*slowest).max(took);
                        };
                        let result = serve(&policy, id as u64, timed);
                        served.fetch_add(1, Ordering::Relaxed);
                        match result {
                            Ok(()) => {}
                            Err(e) if e.is_fault() => faults.lock().push(e.to_string()),
                            Err(_) => {
                                refusals.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.join().expect("a caller panicked");
        }
        stop.store(true, Ordering::Relaxed);
    });
    let served = served.into_inner();
    let faults = faults.into_inner();
    let slow = slow.into_inner();
    eprintln!(
        "{served} requests in {:?} on {cores} cores, each saturated by {HOGS_PER_CORE} busy \
         threads, from {CALLERS} thread(s) at nice {CALLER_NICE}: {slow} calls took longer \
         than the {deadline:?} deadline in wall-clock time (slowest {:?}), {} faults, {} \
         refusals",
        started.elapsed(),
        slowest.into_inner(),
        faults.len(),
        refusals.into_inner(),
    );
    assert!(faults.is_empty(), "a healthy policy faulted: {faults:?}");
    assert!(
        served >= AT_LEAST,
        "only {served} requests in {TIME_LIMIT:?}"
    );
    // Were no call held up past the deadline, this test would show nothing.
    assert!(
        slow > 0,
        "the machine was not busy enough to hold a call past its deadline"
    );
}

/// One request as the router makes it: a plan, then the outcome; `timed` hears how long each
/// of the two calls took.
fn serve(
    policy: &switchyard_policy_host::Policy,
    id: u64,
    timed: impl Fn(Duration),
) -> Result<(), switchyard_contract::TranslateError> {
    // Prompts that share prefixes in groups, as the policy's prefix memory expects.
    let prompt: Vec<u32> = (0..256)
        .map(|i| (i + (id % 7) as u32 * 1000) % 32_000)
        .collect();
    let request = PolicyRequest {
        id,
        prompt: Some(&prompt),
        max_tokens: 16,
        stream: true,
        model: "m",
        user: None,
        headers: &[],
        flow: Default::default(),
        base_model: None,
    };
    let context = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: endpoints(id),
    };
    let called = Instant::now();
    let plan = policy.translate(&request, &context);
    timed(called.elapsed());
    let plan = plan?;
    let generator = plan.steps.last().map(|step| match step {
        switchyard_contract::Step::StartGenerate { decode, .. } => *decode,
        switchyard_contract::Step::Forward { endpoint } => *endpoint,
        other => panic!("a plan must end with a generating step: {other:?}"),
    });
    let called = Instant::now();
    let heard = policy.on_complete(&Outcome {
        request_id: id,
        status: OutcomeStatus::Ok,
        attempts: 1,
        generator,
        prefix_matched: 0,
        completion_tokens: 16,
        ttft_us: 1000,
        e2e_us: 5000,
    });
    timed(called.elapsed());
    heard
}

/// One prefill and three decode endpoints whose load moves from request to request.
fn endpoints(id: u64) -> Vec<EndpointSnapshot> {
    (0..4u32)
        .map(|e| EndpointSnapshot {
            role: if e == 0 { Role::Prefill } else { Role::Decode },
            in_flight: ((id + u64::from(e) * 3) % 5) as u32,
            kv_usage: Some(0.5),
            ..EndpointSnapshot::synthetic(e)
        })
        .collect()
}

/// Spin until told to stop.
fn hog(stop: &AtomicBool) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n = std::hint::black_box(n.wrapping_add(1));
    }
}

/// Raise this thread's niceness (Linux: a thread is a process for `setpriority`). Lowering a
/// priority needs no privilege.
fn lower_this_threads_priority(nice: i32) {
    let tid = rustix::thread::gettid();
    rustix::process::setpriority_process(Some(tid), nice)
        .unwrap_or_else(|e| panic!("cannot lower this thread's priority: {e}"));
}
