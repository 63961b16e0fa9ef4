//! The registry on real components in a temporary plugins directory: swaps, refused versions,
//! requests keeping their version, state carry-over, fallback and quarantine, selection,
//! deletion, and the watcher end to end.
//!
//! Guests are built from source on first use (`switchyard_tests::guest`).

use std::path::Path;
use std::time::{Duration, Instant};

use switchyard_contract::{PlanError, PlanningError, Step};
use switchyard_tests::{Guest, guest_bytes};

use super::*;
use crate::tests::{host, outcome, snapshot};
use crate::{DEFAULT_DEBOUNCE, watch};

fn disagg() -> Vec<u8> {
    guest_bytes(Guest::DISAGG)
}

fn round_robin() -> Vec<u8> {
    guest_bytes(Guest::ROUND_ROBIN)
}

fn test_guest(name: &str) -> Vec<u8> {
    guest_bytes(match name {
        "misbehave" => Guest::MISBEHAVE,
        "other-world" => Guest::OTHER_WORLD,
        "stateful" => Guest::STATEFUL,
        "init-fails" => Guest::INIT_FAILS,
        other => panic!("no test guest {other}"),
    })
}

/// Write `bytes` to `dir/file` the recommended way: a hidden temporary file, then a rename.
fn install(dir: &Path, file: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, bytes).expect("write the temporary file");
    std::fs::rename(&tmp, dir.join(file)).expect("rename into place");
}

fn config(dir: &Path, default: &str, fallback: Option<&str>) -> RegistryConfig {
    RegistryConfig {
        plugins: dir.to_owned(),
        default: default.to_owned(),
        default_config: None,
        fallback: fallback.map(str::to_owned),
        models: BTreeMap::new(),
        header: true,
        quarantine: QuarantineRule {
            faults: 2,
            window: Duration::from_secs(60),
        },
    }
}

async fn open(dir: &Path, default: &str, fallback: Option<&str>) -> Arc<PolicyRegistry> {
    PolicyRegistry::open(host(), config(dir, default, fallback))
        .await
        .expect("the registry opens")
}

fn view(registry: &PolicyRegistry, name: &str) -> PolicyView {
    registry
        .view_one(name)
        .unwrap_or_else(|| panic!("no policy {name}"))
}

fn sha(bytes: &[u8]) -> String {
    crate::load::sha256_hex(bytes)
}

/// A first attempt for a 17-token prompt on `endpoints` role-split endpoints, with headers.
fn plan_with(
    planner: &dyn Planner,
    endpoints: u32,
    headers: &[(String, String)],
) -> Result<Plan, TranslateError> {
    let prompt: Vec<u32> = (0..17).collect();
    let request = PolicyRequest {
        id: 1,
        prompt: Some(&prompt),
        max_tokens: 8,
        stream: false,
        model: "m",
        user: None,
        headers,
        flow: Default::default(),
        base_model: None,
    };
    let context = PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: snapshot(endpoints),
    };
    planner.translate(&request, &context)
}

fn plan(planner: &dyn Planner, endpoints: u32) -> Plan {
    plan_with(planner, endpoints, &[]).expect("a plan")
}

fn is_forward(plan: &Plan) -> bool {
    matches!(plan.steps.as_slice(), [Step::Forward { .. }])
}

#[tokio::test]
async fn a_valid_file_swaps_in_and_a_bad_one_leaves_the_old_version_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "p.wasm", &disagg());
    let registry = open(dir.path(), "p", None).await;
    assert_eq!(view(&registry, "p").sha256, Some(sha(&disagg())));

    let garbage = b"\0asm\x0d\0\x01\0 definitely not a component".to_vec();
    for bad in [garbage, disagg()[..1000].to_vec(), test_guest("init-fails")] {
        install(dir.path(), "p.wasm", &bad);
        let error = registry.reload("p", Instant::now(), false).await;
        assert!(error.is_err(), "{error:?}");
        let v = view(&registry, "p");
        assert_eq!(
            v.sha256,
            Some(sha(&disagg())),
            "the old version still serves"
        );
        assert_eq!(v.state, PolicyState::Active);
        let last = v.last_reload.expect("the attempt is recorded");
        assert_eq!(
            (last.result, last.sha256),
            (ReloadResult::Failed, Some(sha(&bad)))
        );
        assert!(v.last_error.is_some());
    }
    assert_eq!(view(&registry, "p").reload_failures, 3);

    install(dir.path(), "p.wasm", &round_robin());
    let swapped = registry.reload("p", Instant::now(), false).await;
    assert!(
        matches!(swapped, Ok(ReloadOutcome::Swapped { .. })),
        "{swapped:?}"
    );
    let v = view(&registry, "p");
    assert_eq!(v.sha256, Some(sha(&round_robin())));
    assert_eq!(v.last_error, None, "a successful swap clears the error");
    assert!(v.last_reload_ms.is_some());
    let again = registry.reload("p", Instant::now(), false).await;
    assert!(matches!(again, Ok(ReloadOutcome::Unchanged)), "{again:?}");
}

#[tokio::test]
async fn a_request_keeps_the_version_it_started_with() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "p.wasm", &disagg());
    let registry = open(dir.path(), "p", None).await;
    let before = registry.select(None, "m").expect("selected");
    install(dir.path(), "p.wasm", &round_robin());
    registry
        .reload("p", Instant::now(), false)
        .await
        .expect("swapped");
    let after = registry.select(None, "m").expect("selected");
    assert!(
        !is_forward(&plan(&before, 4)),
        "disagg still plans the old request"
    );
    assert!(
        is_forward(&plan(&after, 4)),
        "round-robin plans new requests"
    );
}

#[tokio::test]
async fn state_carries_over_to_the_next_version() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "s.wasm", &test_guest("stateful"));
    let registry = open(dir.path(), "s", None).await;
    let forward_to = |plan: Plan| match plan.steps.as_slice() {
        [Step::Forward { endpoint }] => *endpoint,
        other => panic!("expected a forward, got {other:?}"),
    };
    let v1 = registry.select(None, "m").expect("selected");
    let first: Vec<u32> = (0..2).map(|_| forward_to(plan(&v1, 4))).collect();
    // A new config makes a new version of the same bytes.
    install(dir.path(), "s.json", br#"{"generation": 2}"#);
    registry
        .reload("s", Instant::now(), false)
        .await
        .expect("swapped");
    let v2 = registry.select(None, "m").expect("selected");
    let next = forward_to(plan(&v2, 4));
    assert_eq!(
        (first.len(), next),
        (2, (first[1] + 1) % 4),
        "the turn continues: {first:?} then {next}"
    );
}

#[tokio::test]
async fn faults_fall_back_and_quarantine_until_a_new_version_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "m.wasm", &test_guest("misbehave"));
    install(dir.path(), "round-robin.wasm", &round_robin());
    let registry = open(dir.path(), "m", Some("round-robin")).await;
    let trap = [("x-misbehave".to_owned(), "trap".to_owned())];
    for fault in 1..=2 {
        let selection = registry.select(None, "m").expect("selected");
        let error = plan_with(&selection, 4, &trap).expect_err("the guest traps");
        let fallback = selection
            .fallback(&PlanningError::Translate(error))
            .expect("a fallback");
        assert!(is_forward(&plan(fallback.as_ref(), 4)), "fault {fault}");
        let invalid = PlanError {
            step: None,
            step_name: "",
            reason: "test".into(),
        };
        assert!(
            selection
                .fallback(&PlanningError::InvalidPlan(invalid))
                .is_none(),
            "the fallback's own faults have nowhere to go"
        );
    }
    let v = view(&registry, "m");
    assert_eq!(v.state, PolicyState::Quarantined);
    assert!(
        v.last_error
            .as_deref()
            .is_some_and(|e| e.contains("quarantined")),
        "{v:?}"
    );
    let quarantined = registry.select(None, "m").expect("selected");
    assert!(
        is_forward(&plan(&quarantined, 4)),
        "the fallback plans everything now"
    );
    assert!(view(&registry, "round-robin").calls.calls >= 3);

    registry
        .reload("m", Instant::now(), true)
        .await
        .expect("a forced reload loads a fresh version");
    assert_eq!(view(&registry, "m").state, PolicyState::Active);
    let fresh = registry.select(None, "m").expect("selected");
    assert!(!is_forward(&plan(&fresh, 4)), "misbehave plans again");
}

#[tokio::test]
async fn faults_in_on_complete_count_toward_quarantine() {
    // A policy that plans well but spins in `on-complete` would cost every request its
    // deadline forever if only `translate-request` faults counted.
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "m.wasm", &test_guest("misbehave"));
    std::fs::write(dir.path().join("m.json"), r#"{"mode": "spin-on-complete"}"#)
        .expect("write the config");
    install(dir.path(), "round-robin.wasm", &round_robin());
    let registry = open(dir.path(), "m", Some("round-robin")).await;
    for request in 1..=2 {
        let selection = registry.select(None, "m").expect("selected");
        assert!(
            !is_forward(&plan(&selection, 4)),
            "request {request}: misbehave plans"
        );
        selection.on_complete(&outcome(request));
    }
    let v = view(&registry, "m");
    assert_eq!(v.state, PolicyState::Quarantined, "{v:?}");
    assert!(
        v.last_error
            .as_deref()
            .is_some_and(|e| e.contains("deadline")),
        "{v:?}"
    );
    let quarantined = registry.select(None, "m").expect("selected");
    assert!(is_forward(&plan(&quarantined, 4)), "the fallback plans now");
}

#[tokio::test]
async fn the_header_the_model_and_the_default_select_in_that_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "disagg.wasm", &disagg());
    install(dir.path(), "round-robin.wasm", &round_robin());
    let mut cfg = config(dir.path(), "disagg", None);
    cfg.models.insert("small".into(), "round-robin".into());
    let registry = PolicyRegistry::open(host(), cfg.clone())
        .await
        .expect("opens");
    let selected = |header: Option<&str>, model: &str| {
        registry
            .select(header, model)
            .map(|s| s.policy().to_owned())
    };
    assert_eq!(selected(None, "big").as_deref(), Ok("disagg"));
    assert_eq!(selected(None, "small").as_deref(), Ok("round-robin"));
    assert_eq!(selected(Some("disagg"), "small").as_deref(), Ok("disagg"));
    let unknown = selected(Some("nope"), "big");
    assert!(matches!(unknown, Err(SelectError::Unknown { .. })));
    let message = unknown.unwrap_err().to_string();
    assert!(
        !message.contains("disagg") && !message.contains("round-robin"),
        "the client learns nothing of what is loaded: {message}"
    );

    cfg.header = false;
    let registry = PolicyRegistry::open(host(), cfg).await.expect("opens");
    let selected = registry
        .select(Some("nope"), "big")
        .expect("the header is ignored");
    assert_eq!(selected.policy(), "disagg");
}

#[tokio::test]
async fn deleting_a_file_unloads_its_policy_unless_it_is_the_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "disagg.wasm", &disagg());
    install(dir.path(), "extra.wasm", &round_robin());
    let registry = open(dir.path(), "disagg", None).await;
    std::fs::remove_file(dir.path().join("extra.wasm")).expect("rm");
    let outcome = registry.reload("extra", Instant::now(), false).await;
    assert!(
        matches!(outcome, Ok(ReloadOutcome::Unloaded)),
        "{outcome:?}"
    );
    assert!(registry.view_one("extra").is_none());
    std::fs::remove_file(dir.path().join("disagg.wasm")).expect("rm");
    let outcome = registry.reload("disagg", Instant::now(), false).await;
    assert!(matches!(outcome, Ok(ReloadOutcome::Kept)), "{outcome:?}");
    assert!(
        registry.select(None, "m").is_ok(),
        "the default keeps serving"
    );
}

#[tokio::test]
async fn the_default_policy_must_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "p.wasm", &test_guest("other-world"));
    let error = PolicyRegistry::open(host(), config(dir.path(), "p", None))
        .await
        .err()
        .expect("the registry refuses to start");
    assert!(matches!(error, RegistryError::Default { .. }), "{error}");
}

#[tokio::test]
async fn the_watcher_swaps_a_renamed_file_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    install(dir.path(), "p.wasm", &disagg());
    let registry = open(dir.path(), "p", None).await;
    let _watcher = watch(Arc::clone(&registry), DEFAULT_DEBOUNCE).expect("watching");
    install(dir.path(), "p.wasm", &round_robin());
    let want = Some(sha(&round_robin()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while view(&registry, "p").sha256 != want {
        assert!(
            Instant::now() < deadline,
            "no swap within 20 s: {:?}",
            view(&registry, "p")
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let v = view(&registry, "p");
    assert_eq!(v.reloads, 2, "one load at start, one swap: {v:?}");
}
