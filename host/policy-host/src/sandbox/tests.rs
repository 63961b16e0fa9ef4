//! The sandbox's bounds on real components: resource counts and memory in all (refused at
//! load), answers past their bounds, the `log` budget, and a guest that sleeps or spins in
//! `on-complete` (stopped at its deadline).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use switchyard_contract::TranslateError;
use switchyard_tests::with_extra_core_instances;

use super::*;
use crate::tests::{
    host, load_misbehave, misbehave, outcome, short_deadline_host, translate,
    translate_with_headers,
};
use crate::{LoadError, Policy};

/// What `f` wrote to the log on this thread (a policy call runs on its caller's thread).
fn logged_while<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .finish();
    let result = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&capture.0.lock()).into_owned();
    (result, text)
}

fn header(mode: &str) -> [(String, String); 1] {
    [("x-misbehave".to_owned(), mode.to_owned())]
}

// === resource counts and memory, at load ===

/// The misbehaving guest (a Rust component: one memory) with `copies` instances of `module`.
fn load_augmented(module: &str, copies: u32) -> Result<Policy, LoadError> {
    let bytes = with_extra_core_instances(&misbehave(), module, copies);
    host().load("augmented", &bytes, None)
}

fn memories(count: usize, pages: u32) -> String {
    format!("(module {})", format!("(memory {pages}) ").repeat(count))
}

fn refused(result: Result<Policy, LoadError>, what: &str) -> String {
    match result {
        Ok(policy) => panic!("{what}: loaded as {:?}", policy.info()),
        Err(e @ LoadError::Instantiate { .. }) => {
            eprintln!("{what}: {e}");
            e.to_string()
        }
        Err(e) => panic!("{what}: refused for another reason: {e}"),
    }
}

#[test]
fn a_component_within_every_count_loads_and_plans() {
    // The control: appending modules keeps a component valid, and the bounds leave room.
    let policy = load_augmented(&memories(MAX_MEMORIES - 1, 1), 1).expect("loads");
    translate(&policy, 17, 4).expect("plans");
    let policy = load_augmented("(module (table 100 funcref))", 2).expect("loads");
    translate(&policy, 17, 4).expect("plans");
}

#[test]
fn a_component_with_too_many_memories_is_refused() {
    refused(
        load_augmented(&memories(MAX_MEMORIES, 1), 1),
        "too many memories",
    );
}

#[test]
fn a_component_with_too_many_tables_is_refused() {
    let tables = "(table 1 funcref) ".repeat(MAX_TABLES);
    refused(
        load_augmented(&format!("(module {tables})"), 1),
        "too many tables",
    );
}

#[test]
fn a_component_with_too_many_core_instances_is_refused() {
    let copies = u32::try_from(MAX_INSTANCES).expect("small");
    refused(load_augmented("(module)", copies), "too many instances");
}

#[test]
fn a_component_with_a_table_too_large_is_refused() {
    let elements = MAX_TABLE_ELEMENTS + 1;
    refused(
        load_augmented(&format!("(module (table {elements} funcref))"), 1),
        "a table too large",
    );
}

#[test]
fn memories_are_capped_together_not_one_by_one() {
    // The test host caps memory at 16 MiB. Three memories of 6 MiB are each under the cap,
    // and allowed by count, but not together; one of them is fine.
    const PAGES_6_MIB: u32 = 96;
    let cap = host().limits().memory_bytes;
    let six_mib = (PAGES_6_MIB as usize) << 16;
    assert!(3 * six_mib > cap && six_mib < cap / 2, "cap {cap}");
    let policy = load_augmented(&memories(1, PAGES_6_MIB), 1).expect("one memory loads");
    translate(&policy, 17, 4).expect("plans");
    let message = refused(
        load_augmented(&memories(3, PAGES_6_MIB), 1),
        "memories over the cap together",
    );
    assert!(message.contains("memory"), "{message}");
}

// === answers ===

#[test]
fn an_answer_past_its_bounds_is_a_fault_and_the_next_call_is_served() {
    let policy = load_misbehave(&host(), "ok");
    for mode in ["huge-plan", "huge-error"] {
        let e = translate_with_headers(&policy, 17, 4, &header(mode)).expect_err(mode);
        assert!(
            matches!(e, TranslateError::Oversized { .. }),
            "{mode}: {e:?}"
        );
        assert!(e.is_fault(), "{mode}: {e}");
        eprintln!("{mode}: {e}");
        translate(&policy, 17, 4).unwrap_or_else(|e| panic!("after {mode}: {e}"));
        assert!(policy.settle());
    }
}

// === the log budget ===

#[test]
fn a_log_flood_is_cut_at_the_call_budget_and_the_cut_is_marked() {
    let policy = load_misbehave(&host(), "ok");
    let (plan, log) = logged_while(|| translate_with_headers(&policy, 17, 4, &header("log-flood")));
    plan.expect("a policy flooding its log still plans");
    let flood = log.lines().filter(|l| l.contains("flood line")).count();
    // The guest writes one line of its own before the flood.
    assert_eq!(flood, LOG_LINES_PER_CALL - 1, "{log}");
    // The guest's `FLOOD_LINES` (tests/guests/misbehave).
    let dropped = 20_000 - flood;
    assert!(
        log.contains(&format!("policy log truncated: {dropped} lines")),
        "{log}"
    );
    // The next call has a budget of its own.
    let (plan, log) = logged_while(|| translate(&policy, 17, 4));
    plan.expect("plans");
    assert!(log.contains("misbehave Ok"), "{log}");
    assert!(!log.contains("truncated"), "{log}");
}

fn store() -> StoreState {
    StoreState::new(
        Arc::from("p"),
        1 << 20,
        1 << 10,
        (&GuestEnvironment::default(), 0),
    )
}

#[test]
fn a_long_line_is_cut_and_says_so() {
    let mut store = store();
    let line = "é".repeat(MAX_LOG_LINE); // 2 bytes each: cut at a char boundary
    let ((), log) = logged_while(|| store.log(Level::Info, &line));
    let kept = "é".repeat(MAX_LOG_LINE / 2);
    assert!(
        log.contains(&format!("{kept} [{} bytes cut]", MAX_LOG_LINE)),
        "{log}"
    );
}

#[test]
fn the_byte_budget_binds_before_the_line_budget() {
    let mut store = store();
    store.begin_call(Duration::from_secs(1));
    let line = "x".repeat(MAX_LOG_LINE);
    let ((), log) = logged_while(|| {
        for _ in 0..LOG_BYTES_PER_CALL / MAX_LOG_LINE + 5 {
            store.log(Level::Warn, &line);
        }
        store.end_call();
    });
    let written = log.lines().filter(|l| l.contains(&line)).count();
    assert_eq!(written, LOG_BYTES_PER_CALL / MAX_LOG_LINE, "{log}");
    assert!(log.contains("policy log truncated: 5 lines"), "{log}");
}

// === deadlines that wall-clock time alone would not catch ===

#[test]
fn a_policy_that_sleeps_is_stopped_at_its_deadline() {
    stopped_at_its_deadline_while_sleeping();
}

/// The same from a router connection worker (a current-thread runtime), where the guest's
/// wait runs on a thread of its own, outside the runtime.
#[tokio::test]
async fn a_policy_sleeping_on_a_current_thread_runtime_is_stopped_at_its_deadline() {
    stopped_at_its_deadline_while_sleeping();
}

fn stopped_at_its_deadline_while_sleeping() {
    let host = short_deadline_host();
    let policy = load_misbehave(&host, "ok");
    let started = Instant::now();
    let e = translate_with_headers(&policy, 17, 4, &header("sleep")).expect_err("sleeps");
    let took = started.elapsed();
    assert!(matches!(e, TranslateError::Deadline { .. }), "{e:?}");
    // It asked to sleep two minutes; the wait is charged to its budget and cut there.
    eprintln!(
        "a policy sleeping under a {:?} deadline was stopped after {took:?}",
        host.limits().deadline
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn spinning_in_on_complete_is_a_deadline_fault() {
    let policy = load_misbehave(&short_deadline_host(), "spin-on-complete");
    translate(&policy, 17, 4).expect("plans");
    let e = policy.on_complete(&outcome(7)).expect_err("spins");
    assert!(matches!(e, TranslateError::Deadline { .. }), "{e:?}");
    translate(&policy, 17, 4).expect("the spare plans");
}
