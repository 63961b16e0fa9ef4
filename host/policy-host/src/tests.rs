//! Host-level policy tests: load errors, the sandbox (deadline, memory cap, traps) on the
//! misbehaving test guest, the compile cache, and `check`.
//!
//! Guests are built from source on first use (`switchyard_tests::guest`).

use std::path::Path;
use std::time::Duration;

use switchyard_contract::{
    EndpointSnapshot, Outcome, OutcomeStatus, Plan, PolicyContext, PolicyRequest, Role,
    TranslateError, ValidPlan, validate,
};
use switchyard_tests::Guest;

use super::deadline::{START_READING_REUSE, thread_cpu_time};
use super::wasm::EPOCH_TICK;
use super::*;

pub(super) fn misbehave() -> Vec<u8> {
    switchyard_tests::guest_bytes(Guest::MISBEHAVE)
}

/// The deadline of ordinary calls in these tests: the router's own. The deadline counts the
/// CPU time a call uses, so calls that must succeed pass it even while they share two cores
/// with the compiles of every other test. Only the deadline tests use [`SHORT_DEADLINE`].
const TEST_DEADLINE: Duration = Duration::from_millis(50);

/// The deadline of tests whose guest must be stopped by it (it only ever ends a loop).
const SHORT_DEADLINE: Duration = Duration::from_millis(20);

/// A host with a generous deadline, a small memory cap and no disk cache.
pub(super) fn host() -> PolicyHost {
    host_with_deadline(TEST_DEADLINE)
}

/// A host whose deadline stops looping guests quickly; see [`SHORT_DEADLINE`].
pub(super) fn short_deadline_host() -> PolicyHost {
    host_with_deadline(SHORT_DEADLINE)
}

pub(super) fn host_with_deadline(deadline: Duration) -> PolicyHost {
    PolicyHost::new(PolicyLimits {
        deadline,
        memory_bytes: 16 << 20,
        output_bytes: 4096,
        cache_dir: None,
        ..PolicyLimits::default()
    })
    .expect("the policy engine starts")
}

/// The misbehaving guest in `mode`, with its spare built: a test that faults it must not race
/// the builder thread (requests do not wait for it; tests check what happens once it is done).
pub(super) fn load_misbehave(host: &PolicyHost, mode: &str) -> Policy {
    let config = format!(r#"{{"mode": "{mode}"}}"#);
    let policy = host
        .load(&format!("misbehave-{mode}"), &misbehave(), Some(&config))
        .unwrap_or_else(|e| panic!("misbehave in mode {mode} loads: {e}"));
    assert!(
        policy.settle(),
        "misbehave in mode {mode}: its spare is built"
    );
    policy
}

/// Request `request_id` ended well on endpoint 1 after one attempt.
pub(super) fn outcome(request_id: u64) -> Outcome {
    Outcome {
        request_id,
        status: OutcomeStatus::Ok,
        attempts: 1,
        generator: Some(1),
        prefix_matched: 0,
        completion_tokens: 3,
        ttft_us: 10,
        e2e_us: 20,
    }
}

pub(super) fn snapshot(n: u32) -> Vec<EndpointSnapshot> {
    check::split_roles(n, &[], &[])
}

pub(super) fn translate(
    policy: &Policy,
    prompt_len: u32,
    endpoints: u32,
) -> Result<Plan, TranslateError> {
    translate_with_headers(
        policy,
        prompt_len,
        endpoints,
        &[("x-priority".to_owned(), "high".to_owned())],
    )
}

/// Request 7 for `prompt`, with `headers`.
pub(super) fn request<'a>(prompt: &'a [u32], headers: &'a [(String, String)]) -> PolicyRequest<'a> {
    PolicyRequest {
        id: 7,
        prompt: Some(prompt),
        max_tokens: 16,
        stream: false,
        model: "test",
        user: Some("u"),
        headers,
        flow: Default::default(),
        base_model: None,
    }
}

pub(super) fn translate_with_headers(
    policy: &Policy,
    prompt_len: u32,
    endpoints: u32,
    headers: &[(String, String)],
) -> Result<Plan, TranslateError> {
    let prompt = check::synthetic_prompt(prompt_len);
    let request = request(&prompt, headers);
    let context = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: snapshot(endpoints),
    };
    policy.translate(&request, &context)
}

fn load_error(bytes: &[u8]) -> LoadError {
    match host().load("bad", bytes, None) {
        Ok(policy) => panic!("loading {} bytes should fail, got {policy:?}", bytes.len()),
        Err(e) => e,
    }
}

// === load errors ===

#[test]
fn garbage_is_not_a_component() {
    let e = load_error(b"this is not webassembly at all");
    assert!(matches!(e, LoadError::NotAComponent { .. }), "{e:?}");
    assert!(e.to_string().contains("not WebAssembly"), "{e}");
}

#[test]
fn a_too_short_file_says_so() {
    let e = load_error(b"\0as");
    assert!(e.to_string().contains("too short"), "{e}");
}

#[test]
fn a_core_module_is_named_as_such() {
    let module = wat::parse_str("(module (func (export \"f\")))").expect("valid wat");
    let e = load_error(&module);
    assert!(matches!(e, LoadError::NotAComponent { .. }), "{e:?}");
    assert!(e.to_string().contains("core WebAssembly module"), "{e}");
}

#[test]
fn a_truncated_component_fails_to_compile() {
    let component =
        wat::parse_str("(component (core module (func (export \"f\") (result i32) i32.const 42)))")
            .expect("valid wat");
    let e = load_error(&component[..component.len() - 3]);
    assert!(matches!(e, LoadError::Compile { .. }), "{e:?}");
}

#[test]
fn an_empty_component_names_the_missing_export() {
    let component = wat::parse_str("(component)").expect("valid wat");
    let e = load_error(&component);
    assert!(matches!(e, LoadError::WrongWorld { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("init") || text.contains("describe") || text.contains("translate"),
        "the reason should name a missing export: {text}"
    );
}

#[test]
fn a_component_of_another_world_is_rejected() {
    let bytes = switchyard_tests::guest_bytes(Guest::OTHER_WORLD);
    let e = load_error(&bytes);
    assert!(matches!(e, LoadError::WrongWorld { .. }), "{e:?}");
    eprintln!("other world: {e}");
}

#[test]
fn config_that_is_not_json_is_rejected_before_init() {
    let e = host()
        .load("m", &misbehave(), Some("{mode: ok"))
        .expect_err("bad JSON");
    assert!(matches!(e, LoadError::Config { .. }), "{e:?}");
}

#[test]
fn init_failure_is_a_load_error_with_the_policy_message() {
    let e = host()
        .load("m", &misbehave(), Some(r#"{"mode": "init-fails"}"#))
        .expect_err("init fails");
    assert!(matches!(e, LoadError::Init { .. }), "{e:?}");
    assert!(e.to_string().contains("refusing to start"), "{e}");
}

#[test]
fn a_missing_file_names_the_path() {
    let e = host()
        .load_file(Path::new("/nonexistent/policy.wasm"), None)
        .expect_err("no such file");
    assert!(e.to_string().contains("/nonexistent/policy.wasm"), "{e}");
}

// === the sandbox ===

#[test]
fn a_good_policy_plans_and_keeps_its_instance() {
    let host = host();
    let policy = load_misbehave(&host, "ok");
    assert_eq!(policy.info().name, "misbehave-ok");
    assert_eq!(policy.info().sha256.len(), 64);
    for _ in 0..3 {
        let plan = translate(&policy, 17, 4).expect("a plan");
        validate(&plan, 17, &snapshot(4)).expect("the plan is valid");
    }
    policy
        .on_complete(&outcome(7))
        .expect("on-complete is heard");
    translate(&policy, 1, 1).expect("still planning after on-complete");
}

/// Asserts that a fault is followed by a fresh instance: the next call behaves like the first
/// one on a fresh instance (the same fault, reached by running the guest again), not like a call
/// into a poisoned instance (which wasmtime refuses) or a missing one. (The spare takes the
/// faulted instance's place at once; waiting for the builder first makes the next fault find
/// a spare too.)
fn assert_rebuilt(policy: &Policy, first: &TranslateError) {
    assert!(policy.settle(), "a new spare is built");
    let second = translate(policy, 17, 4).expect_err("the mode misbehaves on every call");
    assert_eq!(
        std::mem::discriminant(first),
        std::mem::discriminant(&second),
        "second call: {second}"
    );
}

/// Calls the looping guest and asserts what its deadline promises, in the CPU time of this
/// thread, which the call never leaves: the call ends with the deadline error, having used its
/// whole budget (less what the start of the call may be charged from before it, see
/// `deadline`), and not much more. The check that stops it comes at most two ticks after the
/// budget could have been spent, if the ticker thread keeps time; on a loaded machine it wakes
/// late and the guest runs on meanwhile (measured on two cores at load 14: up to 18 ms past a
/// 20 ms budget, once in 50 calls), hence [`LATE_TICKS`] more. Wall time is not looked at: a
/// busy machine stretches it without bound.
fn assert_stopped_at_deadline(policy: &Policy, deadline: Duration) -> TranslateError {
    let before = thread_cpu_time();
    let e = translate(policy, 17, 4).expect_err("loops");
    let used = thread_cpu_time() - before;
    assert!(
        matches!(e, TranslateError::Deadline { deadline: d, .. } if d == deadline),
        "{e:?}"
    );
    eprintln!("deadline {deadline:?}: stopped after {used:?} of CPU time");
    assert!(
        used + START_READING_REUSE >= deadline,
        "stopped after {used:?} of CPU time, before its {deadline:?} deadline"
    );
    assert!(
        used <= deadline + (2 + LATE_TICKS) * EPOCH_TICK,
        "stopped after {used:?} of CPU time for a {deadline:?} deadline"
    );
    e
}

/// Ticks the epoch ticker may wake late on a loaded machine; see [`assert_stopped_at_deadline`].
const LATE_TICKS: u32 = 4;

#[test]
fn an_infinite_loop_hits_the_deadline_and_the_instance_is_rebuilt() {
    let host = short_deadline_host();
    let policy = load_misbehave(&host, "loop");
    let e = assert_stopped_at_deadline(&policy, host.limits().deadline);
    assert_rebuilt(&policy, &e);
}

#[test]
fn the_deadline_still_fires_after_the_host_is_dropped() {
    // The policy keeps the epoch ticker alive; without it a loop would never be stopped.
    let policy = load_misbehave(&short_deadline_host(), "loop");
    let e = translate(&policy, 17, 4).expect_err("loops");
    assert!(matches!(e, TranslateError::Deadline { .. }), "{e:?}");
}

#[test]
fn a_loop_started_while_the_epoch_ticker_sleeps_still_hits_the_deadline() {
    let host = short_deadline_host();
    let deadline = host.limits().deadline;
    let policy = load_misbehave(&host, "loop");
    // Idle since the load: the ticker goes to sleep by itself after IDLE_TICKS. No event
    // announces it, so look every tick, for at most 10 s. Were the call not to wake it, the
    // loop would never be interrupted.
    let ticker = host.inner.engine.ticker();
    let mut looks = 0;
    while !ticker.is_asleep() {
        looks += 1;
        assert!(looks < 2000, "the idle ticker never went to sleep");
        std::thread::sleep(EPOCH_TICK);
    }
    assert_stopped_at_deadline(&policy, deadline);
}

#[test]
fn allocating_past_the_cap_is_a_memory_error_and_the_instance_is_rebuilt() {
    let host = host();
    let policy = load_misbehave(&host, "alloc");
    let e = translate(&policy, 17, 4).expect_err("allocates forever");
    assert!(matches!(e, TranslateError::MemoryExceeded { .. }), "{e:?}");
    assert_rebuilt(&policy, &e);
}

#[test]
fn a_trap_is_a_trap_error_and_the_instance_is_rebuilt() {
    let host = host();
    let policy = load_misbehave(&host, "trap");
    let e = translate(&policy, 17, 4).expect_err("traps");
    assert!(matches!(e, TranslateError::Trap { .. }), "{e:?}");
    assert!(e.is_fault(), "{e}");
    assert_rebuilt(&policy, &e);
}

#[test]
fn one_misbehaving_policy_does_not_disturb_another() {
    let host = host();
    let good = load_misbehave(&host, "ok");
    let bad = load_misbehave(&host, "trap");
    for _ in 0..3 {
        translate(&bad, 17, 4).expect_err("traps");
        translate(&good, 17, 4).expect("the good policy still plans");
    }
}

#[test]
fn an_invalid_plan_is_returned_raw_and_fails_validation() {
    let policy = load_misbehave(&host(), "invalid-plan");
    let plan = translate(&policy, 17, 4).expect("a plan, although invalid");
    assert!(validate(&plan, 17, &snapshot(4)).is_err(), "{plan:?}");
}

/// One policy shared by threads: every call of every thread gets a valid plan. (Whether calls
/// overlap is checked by the executor's tests.)
#[test]
fn calls_from_several_threads_all_get_valid_plans() {
    let policy = load_misbehave(&host(), "ok");
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..25 {
                    let plan = translate(&policy, 17, 4).expect("a plan");
                    validate(&plan, 17, &snapshot(4)).expect("the plan is valid");
                }
            });
        }
    });
}

// === the compile cache ===

#[test]
fn loading_the_same_bytes_twice_compiles_once() {
    let host = host();
    let bytes = misbehave();
    host.load("a", &bytes, None).expect("loads");
    host.load("b", &bytes, None).expect("loads again");
    assert_eq!(host.compiles(), 1);
}

#[test]
fn a_restarted_host_reads_the_disk_cache() {
    let dir = tempfile::tempdir().expect("temp dir");
    let limits = PolicyLimits {
        cache_dir: Some(dir.path().to_owned()),
        ..PolicyLimits::default()
    };
    let bytes = misbehave();

    let first = PolicyHost::new(limits.clone()).expect("engine");
    let policy = first.load("m", &bytes, None).expect("loads");
    assert_eq!(first.compiles(), 1);
    let sha = policy.info().sha256.clone();
    let files = cached_artifacts(dir.path());
    assert!(
        files.iter().any(|f| f
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(&sha))),
        "{files:?}"
    );
    drop(policy);
    drop(first);

    let second = PolicyHost::new(limits).expect("engine");
    let policy = second.load("m", &bytes, None).expect("loads from cache");
    assert_eq!(second.compiles(), 0, "served from the disk cache");
    translate(&policy, 17, 4).expect("the cached component plans");
}

/// An artifact read from the cache counts as used (its time is renewed); one unused for over
/// a week is removed when the next host starts, which then compiles the policy again.
#[test]
fn artifacts_in_use_stay_cached_and_those_unused_for_a_week_are_removed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let limits = PolicyLimits {
        cache_dir: Some(dir.path().to_owned()),
        ..PolicyLimits::default()
    };
    let bytes = misbehave();
    let artifact = || {
        let files = cached_artifacts(dir.path());
        assert!(files.len() <= 1, "{files:?}");
        files.into_iter().next()
    };
    let age = |days: u64| {
        let path = artifact().expect("an artifact");
        let then = std::time::SystemTime::now() - Duration::from_secs(days * 24 * 60 * 60);
        super::wasm::set_last_used(&path, then).expect("sets its time");
    };
    let used_within = |limit: Duration| {
        let path = artifact().expect("an artifact");
        let used = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .expect("a time");
        used.elapsed().unwrap_or_default() < limit
    };

    let first = PolicyHost::new(limits.clone()).expect("engine");
    first.load("m", &bytes, None).expect("loads");
    assert_eq!(first.compiles(), 1);

    age(3);
    let second = PolicyHost::new(limits.clone()).expect("engine");
    second.load("m", &bytes, None).expect("loads from cache");
    assert_eq!(
        second.compiles(),
        0,
        "a 3-day-old artifact is kept and read"
    );
    assert!(
        used_within(Duration::from_secs(600)),
        "reading it renewed its time"
    );

    age(8);
    let third = PolicyHost::new(limits).expect("engine");
    assert!(
        artifact().is_none(),
        "an 8-day-old artifact is removed at start"
    );
    third.load("m", &bytes, None).expect("compiles again");
    assert_eq!(third.compiles(), 1);
    assert!(artifact().is_some(), "and is cached again");
}

/// The compiled artifacts (`*.cwasm`) in a cache directory.
fn cached_artifacts(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .expect("cache dir exists")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect()
}

#[test]
fn a_corrupt_cache_entry_is_recompiled() {
    let dir = tempfile::tempdir().expect("temp dir");
    let limits = PolicyLimits {
        cache_dir: Some(dir.path().to_owned()),
        ..PolicyLimits::default()
    };
    let bytes = misbehave();
    let first = PolicyHost::new(limits.clone()).expect("engine");
    first.load("m", &bytes, None).expect("loads");
    for entry in std::fs::read_dir(dir.path()).expect("cache dir") {
        let path = entry.expect("entry").path();
        std::fs::write(&path, b"garbage").expect("overwrite");
    }
    let second = PolicyHost::new(limits).expect("engine");
    let policy = second.load("m", &bytes, None).expect("recompiles");
    assert_eq!(second.compiles(), 1);
    translate(&policy, 17, 4).expect("plans");
}

// === check ===

#[test]
fn check_accepts_a_good_policy() {
    let policy = load_misbehave(&host(), "ok");
    let report = check(&policy).expect("passes");
    assert_eq!(report.cases.len(), check::cases().len());
    assert!(report.plans > 0);
    eprintln!("{report}");
}

#[test]
fn check_fails_an_invalid_plan_naming_the_case() {
    let policy = load_misbehave(&host(), "invalid-plan");
    let e = check(&policy).expect_err("invalid plan");
    assert!(matches!(e, CheckError::InvalidPlan { .. }), "{e:?}");
    assert!(e.to_string().contains("endpoints"), "{e}");
}

#[test]
fn check_fails_a_looping_policy() {
    let policy = load_misbehave(&short_deadline_host(), "loop");
    let e = check(&policy).expect_err("deadline");
    assert!(
        matches!(
            e,
            CheckError::Translate {
                error: TranslateError::Deadline { .. },
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn check_passes_the_built_in_policies() {
    let host = host();
    for (name, built) in [
        ("disagg", Guest::DISAGG),
        ("round-robin", Guest::ROUND_ROBIN),
    ] {
        let bytes = switchyard_tests::guest_bytes(built);
        let policy = host.load(name, &bytes, None).expect("loads");
        assert_eq!(policy.info().name, name);
        let report = check(&policy).unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!("{report}");
    }
}

// === conversions ===

#[test]
fn the_disagg_plugin_splits_prefill_and_decode() {
    let host = host();
    let policy = host
        .load(
            "disagg",
            &switchyard_tests::guest_bytes(Guest::DISAGG),
            None,
        )
        .expect("the built-in policy loads");
    let endpoints = check::snapshot(&[Role::Prefill, Role::Decode], &[], &[]);
    let prompt = check::synthetic_prompt(1000);
    let request = request(&prompt, &[]);
    let context = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: endpoints.clone(),
    };
    let plan = policy.translate(&request, &context).expect("a plan");
    let valid = validate(&plan, 1000, &endpoints).expect("valid");
    assert!(
        matches!(valid, ValidPlan::Disagg { decode: 1, .. }),
        "{valid:?}"
    );
}

/// A trapping Rust guest writes its panic message to stderr (through wasmtime-wasi's sync
/// bindings, which block on a Tokio runtime) and then traps: on a current-thread runtime, as
/// each of the router's connection workers is, the write runs off the runtime and the call
/// ends as a `Trap` error, not a host panic; the next policy plans on the same runtime.
#[tokio::test]
async fn a_guest_writing_to_stderr_inside_a_tokio_runtime_is_a_trap_not_a_host_panic() {
    let host = host();
    let bad = load_misbehave(&host, "trap");
    let e = translate(&bad, 17, 4).expect_err("traps");
    assert!(matches!(e, TranslateError::Trap { .. }), "{e:?}");
    let good = load_misbehave(&host, "ok");
    translate(&good, 17, 4).expect("a policy that does no I/O plans inside a runtime");
}

/// The same policy faults on one request and serves the next: after each kind of fault the
/// spare takes the faulted instance's place, so a well-behaved request right after gets a valid
/// plan without waiting for a rebuild.
#[test]
fn after_each_fault_the_next_call_on_the_same_policy_succeeds() {
    let host = host();
    let policy = load_misbehave(&host, "ok");
    for mode in ["trap", "loop", "alloc"] {
        let header = [("x-misbehave".to_owned(), mode.to_owned())];
        let e = translate_with_headers(&policy, 17, 4, &header).expect_err(mode);
        assert!(e.is_fault(), "{mode}: {e:?}");
        // The spare took the faulted instance's place: nothing is waited for here.
        let plan = translate(&policy, 17, 4).unwrap_or_else(|e| panic!("after {mode}: {e}"));
        validate(&plan, 17, &snapshot(4)).expect("the plan is valid");
        assert!(policy.settle(), "after {mode}: a new spare is built");
    }
}

/// A guest that prints on every call, called from a router connection worker (a
/// current-thread runtime; its blocking writes run on a thread of their own): its output goes
/// to the log and its plans are served.
#[tokio::test]
async fn a_guest_printing_on_a_current_thread_runtime_plans_normally() {
    plans_while_printing();
}

/// The same on a multi-thread runtime's worker (the control runtime's kind): there the blocking
/// writes move the worker's other tasks to another thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_guest_printing_on_a_multi_thread_runtime_worker_plans_normally() {
    plans_while_printing();
}

fn plans_while_printing() {
    let host = host();
    let policy = load_misbehave(&host, "print");
    for _ in 0..3 {
        let plan = translate(&policy, 17, 4).expect("a guest that prints still plans");
        validate(&plan, 17, &snapshot(4)).expect("the plan is valid");
    }
}
