//! Hot-swapping policies through `switchyard up` (router + reference engines, separate
//! processes on loopback): a hundred replacements of one policy file under steady load with no
//! failed request, faulting policies served by the fallback, adversarial components refused or
//! quarantined, per-request selection, and the admin routes' token and port.
//!
//! Guests: `make plugins guests`. Every wait polls `/admin/policies` for the awaited state,
//! within a deadline.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use switchyard_tests::{
    Guest, RouterProcess, free_port, guest_bytes, plugins_dir, with_extra_core_instances,
};

/// How long one swap (or refusal) may take to show in `/admin/policies`.
const SWAP_DEADLINE: Duration = Duration::from_secs(15);

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("reqwest client")
}

fn builtin(name: &str) -> Vec<u8> {
    std::fs::read(plugins_dir().join(format!("{name}.wasm"))).expect("a built-in policy")
}

fn test_guest(name: &str) -> Vec<u8> {
    guest_bytes(match name {
        "misbehave" => Guest::MISBEHAVE,
        "other-world" => Guest::OTHER_WORLD,
        "init-fails" => Guest::INIT_FAILS,
        other => panic!("no test guest {other}"),
    })
}

fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The recommended deploy: write a hidden temporary file, then rename it over the policy.
fn install(dir: &Path, file: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, bytes).expect("write the temporary file");
    std::fs::rename(&tmp, dir.join(file)).expect("rename into place");
}

/// `switchyard up` with 1 prefill + 1 decode engine, policies from `plugins`.
async fn up(plugins: &Path, args: &[&str]) -> RouterProcess {
    let mut full: Vec<String> = vec![
        "--plugins".into(),
        plugins.display().to_string(),
        "--prefill".into(),
        "1".into(),
        "--decode".into(),
        "1".into(),
    ];
    full.extend(args.iter().map(|a| (*a).to_owned()));
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = full.iter().map(String::as_str).collect();
        RouterProcess::up(&args)
    })
    .await
    .expect("the router starts")
}

/// A temporary plugins directory holding `files`, and `switchyard up` serving from it.
async fn up_with(files: &[(&str, Vec<u8>)], args: &[&str]) -> (tempfile::TempDir, RouterProcess) {
    let dir = tempfile::tempdir().expect("tempdir");
    for (file, bytes) in files {
        install(dir.path(), file, bytes);
    }
    let router = up(dir.path(), args).await;
    (dir, router)
}

async fn policies(base: &str, token: Option<&str>) -> Vec<Value> {
    let mut request = client().get(format!("{base}/admin/policies"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("admin reachable");
    assert_eq!(response.status().as_u16(), 200);
    response.json().await.expect("a JSON list")
}

async fn policy(base: &str, name: &str) -> Value {
    policies(base, None)
        .await
        .into_iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no policy {name} in /admin/policies"))
}

/// Poll `name` until `done` holds for its admin entry, within [`SWAP_DEADLINE`].
async fn wait_for(base: &str, name: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + SWAP_DEADLINE;
    loop {
        let entry = policy(base, name).await;
        if done(&entry) {
            return entry;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {SWAP_DEADLINE:?}: {entry:#}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One completion, streamed or not; `Err` describes any failure the client would see.
async fn complete(url: &str, n: u64, headers: &[(&str, &str)]) -> Result<(), String> {
    let stream = n.is_multiple_of(2);
    let body = json!({"prompt": format!("hot swap request {n} kv cache"), "max_tokens": 6,
        "stream": stream});
    let mut request = client().post(url).json(&body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let text = response.text().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    let complete = if stream {
        text.trim_end().ends_with("data: [DONE]") && !text.contains("\"error\"")
    } else {
        serde_json::from_str::<Value>(&text).is_ok_and(|v| v["choices"][0]["text"].is_string())
    };
    if complete {
        Ok(())
    } else {
        Err(format!("incomplete response: {text}"))
    }
}

/// Clients sending requests back to back until `stop`; returns (succeeded, failures).
fn steady_load(
    url: String,
    clients: u64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, Vec<String>)> {
    tokio::spawn(async move {
        let next = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let (url, stop, next) = (url.clone(), stop.clone(), next.clone());
                tokio::spawn(async move {
                    let (mut ok, mut failures) = (0u64, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        match complete(&url, n, &[]).await {
                            Ok(()) => ok += 1,
                            Err(e) => failures.push(e),
                        }
                    }
                    (ok, failures)
                })
            })
            .collect();
        let mut total = (0, Vec::new());
        for task in tasks {
            let (ok, failures) = task.await.expect("client task");
            total.0 += ok;
            total.1.extend(failures);
        }
        total
    })
}

/// What replacement `i` writes, and whether the router must swap it in.
fn replacement(
    i: usize,
    serving_disagg: bool,
    disagg: &[u8],
    rr: &[u8],
) -> (Vec<u8>, &'static str, bool) {
    // Three valid versions between two bad files: the version a bad file must leave serving
    // alternates between disagg and round-robin.
    match i % 4 {
        3 => match (i / 4) % 4 {
            // Cut at a different length each time, so each attempt has its own sha256.
            0 => (disagg[..disagg.len() / 2 + i].to_vec(), "truncated", false),
            1 => {
                let mut garbage = b"\0asm\x0d\0\x01\0".to_vec();
                garbage.extend((0..4096).map(|b| (b * 31 + i) as u8));
                (garbage, "garbage", false)
            }
            2 => (test_guest("other-world"), "other-world", false),
            _ => (test_guest("init-fails"), "init-fails", false),
        },
        _ if serving_disagg => (rr.to_vec(), "round-robin", true),
        _ => (disagg.to_vec(), "disagg", true),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_replacements_under_load_fail_no_request() {
    let (disagg, rr) = (builtin("disagg"), builtin("round-robin"));
    let plugins = [
        ("swap.wasm", disagg.clone()),
        ("round-robin.wasm", rr.clone()),
    ];
    let (dir, router) = up_with(&plugins, &["--policy", "swap"]).await;
    let base = router.url.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let load = steady_load(format!("{base}/v1/completions"), 3, stop.clone());

    let mut serving = sha256(&disagg);
    let mut serving_disagg = true;
    for i in 0..100 {
        let (bytes, kind, valid) = replacement(i, serving_disagg, &disagg, &rr);
        let sha = sha256(&bytes);
        install(dir.path(), "swap.wasm", &bytes);
        let what = format!("replacement {i} ({kind})");
        let entry = wait_for(&base, "swap", &what, |p| {
            p["last_reload"]["sha256"] == sha.as_str()
        })
        .await;
        assert_eq!(entry["state"], "active", "{what}: {entry:#}");
        if valid {
            assert_eq!(entry["sha256"], sha.as_str(), "{what} serves: {entry:#}");
            assert_eq!(entry["last_error"], Value::Null, "{what}: {entry:#}");
            serving = sha;
            serving_disagg = !serving_disagg;
        } else {
            assert_eq!(
                entry["sha256"],
                serving.as_str(),
                "{what}: the previous version serves: {entry:#}"
            );
            assert_eq!(
                entry["last_reload"]["result"], "failed",
                "{what}: {entry:#}"
            );
            assert!(
                entry["last_error"].is_string(),
                "{what}: the error is visible: {entry:#}"
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (ok, failures) = load.await.expect("load task");
    assert!(
        failures.is_empty(),
        "{} of {} requests failed: {failures:?}",
        failures.len(),
        ok + failures.len() as u64
    );
    assert!(ok >= 100, "the load ran through the swaps ({ok} requests)");
    let entry = policy(&base, "swap").await;
    assert_eq!(entry["reload_failures"], 25, "{entry:#}");
    assert!(entry["calls"].as_u64().is_some_and(|c| c > 0), "{entry:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faulting_policies_are_served_by_the_fallback_and_quarantined() {
    let plugins = [
        ("misbehave.wasm", test_guest("misbehave")),
        ("round-robin.wasm", builtin("round-robin")),
    ];
    let (_dir, router) = up_with(
        &plugins,
        &["--policy", "misbehave", "--forward-header", "x-misbehave"],
    )
    .await;
    let base = router.url.clone();
    let url = format!("{base}/v1/completions");
    // The default rule: 5 faults within 30 s quarantine a version.
    for mode in ["trap", "loop", "alloc", "invalid-plan"] {
        for n in 0..7 {
            let result = complete(&url, n, &[("x-misbehave", mode)]).await;
            assert_eq!(
                result,
                Ok(()),
                "{mode} request {n} must succeed via the fallback"
            );
        }
        let entry = policy(&base, "misbehave").await;
        assert_eq!(entry["state"], "quarantined", "{mode}: {entry:#}");
        assert!(
            entry["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("quarantined")),
            "{entry:#}"
        );
        let reloaded = client()
            .post(format!("{base}/admin/policies/misbehave/reload"))
            .send()
            .await
            .expect("admin reachable");
        assert_eq!(
            reloaded.status().as_u16(),
            200,
            "a forced reload gives a fresh version"
        );
        assert_eq!(policy(&base, "misbehave").await["state"], "active");
    }
    let metrics = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains(r#"switchyard_policy_quarantines_total{policy="misbehave"} 4"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"switchyard_policy_fallbacks_total{policy="misbehave"}"#));
    assert!(metrics.trim_end().ends_with("# EOF"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_header_selects_a_policy_and_an_unknown_one_is_refused() {
    let plugins = [
        ("disagg.wasm", builtin("disagg")),
        ("round-robin.wasm", builtin("round-robin")),
    ];
    let (_dir, router) = up_with(&plugins, &["--policy", "disagg"]).await;
    let base = router.url.clone();
    let url = format!("{base}/v1/completions");
    let before = policy(&base, "round-robin").await["calls"]
        .as_u64()
        .unwrap_or(0);
    for n in 0..3 {
        let picked = complete(&url, n, &[("x-switchyard-policy", "round-robin")]).await;
        assert_eq!(picked, Ok(()));
    }
    let after = policy(&base, "round-robin").await["calls"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(after - before, 3, "round-robin planned the three requests");

    let response = client()
        .post(&url)
        .header("x-switchyard-policy", "nope")
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("router reachable");
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().await.expect("an OpenAI error");
    assert_eq!(body["error"]["param"], "x-switchyard-policy", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_token_and_move_to_the_admin_port() {
    let admin_port = free_port();
    let router = up(
        &plugins_dir(),
        &[
            "--admin-token",
            "s3cret",
            "--admin-port",
            &admin_port.to_string(),
        ],
    )
    .await;
    let admin = format!("http://127.0.0.1:{admin_port}");
    let status = |response: reqwest::Response| response.status().as_u16();
    let on_main = client()
        .get(router.endpoint("/admin/policies"))
        .bearer_auth("s3cret")
        .send()
        .await
        .expect("router reachable");
    assert_eq!(status(on_main), 404, "admin routes left the main port");
    for token in [None, Some("wrong")] {
        let mut request = client().get(format!("{admin}/admin/policies"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.expect("admin port reachable");
        assert_eq!(status(response), 401, "token {token:?}");
    }
    let listed = policies(&admin, Some("s3cret")).await;
    assert!(
        listed
            .iter()
            .any(|p| p["name"] == "disagg" && p["default"] == true),
        "{listed:?}"
    );
    let served = complete(&router.endpoint("/v1/completions"), 1, &[]).await;
    assert_eq!(served, Ok(()), "the OpenAI routes need no token");
}

/// Components written to attack the sandbox, served beside well-behaved ones: those that
/// allocate too many memories or tables are refused at load (and their requests go to the
/// fallback), one that spins in `on-complete` is quarantined, one that floods its log plans
/// as usual; every request succeeds and the router keeps serving the default policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adversarial_policies_are_refused_or_quarantined_and_the_router_is_unharmed() {
    let misbehave = test_guest("misbehave");
    let memories = "(memory 1) ".repeat(8);
    let tables = "(table 1 funcref) ".repeat(40);
    let plugins = [
        ("disagg.wasm", builtin("disagg")),
        ("round-robin.wasm", builtin("round-robin")),
        ("flood.wasm", misbehave.clone()),
        ("spin.wasm", misbehave.clone()),
        (
            "memories.wasm",
            with_extra_core_instances(&misbehave, &format!("(module {memories})"), 1),
        ),
        (
            "tables.wasm",
            with_extra_core_instances(&misbehave, &format!("(module {tables})"), 1),
        ),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    for (file, bytes) in &plugins {
        install(dir.path(), file, bytes);
    }
    for (name, mode) in [("flood", "log-flood"), ("spin", "spin-on-complete")] {
        std::fs::write(
            dir.path().join(format!("{name}.json")),
            format!(r#"{{"mode": "{mode}"}}"#),
        )
        .expect("write a config");
    }
    let router = up(dir.path(), &["--policy", "disagg"]).await;
    let base = router.url.clone();
    let url = format!("{base}/v1/completions");

    for (name, count) in [("memories", "memory count"), ("tables", "table count")] {
        let entry = policy(&base, name).await;
        assert_eq!(entry["state"], "failed", "{name}: {entry:#}");
        assert!(
            entry["last_error"]
                .as_str()
                .is_some_and(|e| e.contains(count)),
            "{name}: {entry:#}"
        );
    }
    // The default rule: 5 faults within 30 s quarantine a version.
    for n in 0..8 {
        for name in ["spin", "flood", "memories", "tables"] {
            let result = complete(&url, n, &[("x-switchyard-policy", name)]).await;
            assert_eq!(result, Ok(()), "request {n} to {name}");
        }
    }
    let spin = wait_for(&base, "spin", "quarantined", |p| {
        p["state"] == "quarantined"
    })
    .await;
    assert!(
        spin["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("deadline")),
        "{spin:#}"
    );
    let flood = policy(&base, "flood").await;
    assert_eq!(
        flood["state"], "active",
        "a chatty policy is not a faulty one: {flood:#}"
    );
    assert_eq!(flood["errors"], 0, "{flood:#}");
    for n in 0..4 {
        complete(&url, n, &[])
            .await
            .expect("the default policy serves");
    }
    assert_eq!(policy(&base, "disagg").await["state"], "active");
}
