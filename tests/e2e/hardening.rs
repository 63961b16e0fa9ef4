//! The router protecting itself and the cluster, as separate processes on loopback: it starts
//! and serves with an engine down, refuses what it should refuse before any engine sees it,
//! takes endpoints in and out while serving, and stays up through a fuzz run of malformed
//! requests.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, free_port};

use crate::http::client;
use crate::router::{eventually, post_or_get, reference};

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
