//! The router protecting itself and the cluster, as separate processes on loopback: it starts
//! and serves with an engine down, refuses what it should refuse before any engine sees it,
//! takes endpoints in and out while serving, and stays up through a fuzz run of malformed
//! requests.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, free_port};

use crate::faults::{
    Load, Truth, assert_engines_idle, assert_no_wrong, endpoint_row, let_run, stream_one,
};
use crate::http::client;
use crate::router::{eventually, metric, post_or_get, reference};

/// The router's view of endpoint `id` (`/admin/endpoints`).
async fn endpoint_health(router: &RouterProcess, id: usize) -> Value {
    post_or_get(&router.endpoint("/admin/endpoints")).await["endpoints"][id]["health"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_with_an_engine_down_serves_from_the_first_request() {
    let truth = EngineProcess::spawn(&[]);
    let (a, b) = (EngineProcess::spawn(&[]), EngineProcess::spawn(&[]));
    // The third engine's address, where nothing listens yet.
    let late_port = free_port();
    let late_url = format!("http://127.0.0.1:{late_port}");
    // Engines without KV peers: the round-robin policy forwards whole requests.
    let router =
        RouterProcess::serve_ready(&[&a.url, &b.url, &late_url], &["--policy", "round-robin"]);
    // Ready with two of three: /health says which one is down.
    let health = post_or_get(&router.endpoint("/health")).await;
    assert_eq!(health["status"], "ready", "{health}");
    assert!(
        health["down"]
            .as_array()
            .is_some_and(|down| down.iter().any(|d| d["id"] == 2)),
        "{health}"
    );
    let url = router.endpoint("/v1/completions");
    for (i, prompt) in ["first", "second request", "a third one"]
        .iter()
        .enumerate()
    {
        let (expected, _) = reference(&truth, prompt, 12).await;
        let response = client()
            .post(&url)
            .header("x-request-id", format!("trace-{i}"))
            .json(&json!({"prompt": prompt, "max_tokens": 12}))
            .send()
            .await
            .expect("router reachable");
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["x-request-id"],
            format!("trace-{i}").as_str()
        );
        let body: Value = response.json().await.expect("JSON");
        assert_eq!(body["choices"][0]["text"], expected.as_str());
    }
    // Every response carries an id, errors included, made up when the client sent none.
    let missing = client()
        .post(&url)
        .json(&json!({"max_tokens": 4}))
        .send()
        .await
        .expect("reachable");
    assert_eq!(missing.status(), 400);
    assert_eq!(missing.headers()["x-request-id"].len(), 32);

    // The late engine joins when it starts.
    let late = EngineProcess::spawn_on(late_port, &[]);
    assert_eq!(late.url, late_url);
    eventually(Duration::from_secs(30), || async {
        let health = endpoint_health(&router, 2).await;
        (health != "healthy").then(|| format!("endpoint 2 is {health}"))
    })
    .await;
    let health = post_or_get(&router.endpoint("/health")).await;
    assert_eq!(health["down"], json!([]), "{health}");
}

/// P (rank 0) with KV peers for decode engines of ranks 1 and 2, over tcp.
fn prefill_and_two_decodes() -> (EngineProcess, EngineProcess, EngineProcess) {
    let slow = ["--profile", "llama3-8b-h100", "--time-scale", "0.3"];
    let decode = |rank: &str| {
        let mut args = vec!["--device-rank", rank, "--kv-transport", "tcp"];
        args.extend(slow);
        EngineProcess::spawn(&args)
    };
    let (d1, d2) = (decode("1"), decode("2"));
    let (peer1, peer2) = (format!("1={}", d1.kv_addr), format!("2={}", d2.kv_addr));
    let mut args = vec![
        "--kv-transport",
        "tcp",
        "--kv-peer",
        &peer1,
        "--kv-peer",
        &peer2,
    ];
    args.extend(slow);
    (EngineProcess::spawn(&args), d1, d2)
}

async fn admin(method: reqwest::Method, url: String, body: Option<Value>) -> (u16, Value) {
    let mut request = client().request(method, url);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("router reachable");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

async fn calls_received(engine: &EngineProcess) -> f64 {
    metric(
        &engine.endpoint("/metrics"),
        "switchyard_engine_calls_received",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_added_drained_and_removed_under_load_fail_no_request() {
    let truth = Arc::new(Truth::new(31, 16).await);
    let (p, d1, d2) = prefill_and_two_decodes();
    let router = RouterProcess::serve(&[&p.url, &d1.url], &[]);
    let load = Load::start(&router, &truth, 4);
    let_run(&load, 8).await;

    // A third engine joins: it gets the next id and device rank, and soon its share of work.
    let base = router.endpoint("/admin/endpoints");
    let (status, row) = admin(
        reqwest::Method::POST,
        base.clone(),
        Some(json!({"url": d2.url, "role": "decode"})),
    )
    .await;
    assert_eq!(status, 201, "{row}");
    assert_eq!(
        (row["id"].as_u64(), row["device_rank"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(row["owner"], "admin");
    eventually(Duration::from_secs(30), || async {
        let calls = calls_received(&d2).await;
        (calls < 10.0).then(|| format!("the new engine served {calls} calls"))
    })
    .await;

    // D1 drains: nothing new reaches it once its last legs are done, and then it leaves.
    let (status, row) = admin(reqwest::Method::POST, format!("{base}/1/drain"), None).await;
    assert_eq!(status, 200, "{row}");
    assert_eq!(row["health"], "draining");
    eventually(Duration::from_secs(30), || async {
        let in_flight = endpoint_row(&router, 1).await["in_flight"].as_u64();
        (in_flight != Some(0)).then(|| format!("{in_flight:?} legs still in flight on it"))
    })
    .await;
    let drained_at = calls_received(&d1).await;
    let_run(&load, 16).await;
    assert_eq!(
        calls_received(&d1).await,
        drained_at,
        "a drained endpoint receives no new request"
    );
    let (status, row) = admin(reqwest::Method::DELETE, format!("{base}/1"), None).await;
    assert_eq!(status, 200, "{row}");
    assert_eq!(row["health"], "removed");
    let (status, _) = admin(reqwest::Method::DELETE, format!("{base}/1"), None).await;
    assert_eq!(status, 409, "removed twice");
    let_run(&load, 8).await;
    let tally = load.stop().await;
    eprintln!(
        "endpoints changed under load: {} streams exact, {} ended with an error event",
        tally.exact, tally.error_events
    );
    assert_no_wrong(&tally);
    assert_eq!(tally.error_events, 0, "nothing failed: no engine failed");
    assert_engines_idle(&[&p, &d1, &d2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_files_endpoints_and_leaves_admin_ones() {
    let (p, d1, d2) = prefill_and_two_decodes();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("router.toml");
    let write = |urls: &[&str]| {
        let endpoints: String = urls
            .iter()
            .map(|url| format!("[[endpoints]]\nurl = \"{url}\"\n"))
            .collect();
        std::fs::write(&file, endpoints).expect("write the config")
    };
    write(&[&p.url, &d1.url]);
    let config = file.display().to_string();
    // Round-robin: a re-added engine gets a new device rank that P has no KV peer for.
    let router = RouterProcess::serve(&[], &["--config", &config, "--policy", "round-robin"]);
    // d2 comes in through the admin API; a reload must leave it alone.
    let base = router.endpoint("/admin/endpoints");
    let (status, _) = admin(
        reqwest::Method::POST,
        base.clone(),
        Some(json!({"url": d2.url})),
    )
    .await;
    assert_eq!(status, 201);

    // The file now lists P only: D1 drains and goes, d2 (admin's) stays.
    write(&[&p.url]);
    router.hang_up();
    eventually(Duration::from_secs(30), || async {
        let health = endpoint_row(&router, 1).await["health"].clone();
        (health != "removed").then(|| format!("endpoint 1 is {health}"))
    })
    .await;
    assert_eq!(endpoint_row(&router, 2).await["health"], "healthy");
    // And back: the file's endpoint returns under a new id.
    write(&[&p.url, &d1.url]);
    router.hang_up();
    eventually(Duration::from_secs(30), || async {
        let row = endpoint_row(&router, 3).await;
        (row["health"] != "healthy" || row["url"] != d1.url.as_str())
            .then(|| format!("endpoint 3 is {row}"))
    })
    .await;
    let (prompt, max_tokens) = ("back again", 8);
    let (expected, _) = reference(&p, prompt, max_tokens).await;
    let url = router.endpoint("/v1/completions");
    assert_eq!(
        stream_one(&url, prompt, max_tokens, &expected).await,
        Ok(true)
    );
}
