//! Flow control under overload, on a reference engine with a real engine's step times
//! (`llama3-8b-h100` stretched twice: a 10.6 ms decode step) behind a router that serves one
//! request at a time:
//! the order in which the queue dispatches is then the order in which answers come back.
//!
//! Each scenario first admits a *blocker* (a 336-token completion, about 3.6 s), fills the queue
//! behind it while it runs, then lets the queue drain and checks the order and every answer:
//!
//! - priorities: high-priority requests sent after low ones are all served before any of them;
//!   at a full queue they displace the newest low ones (429), and sheddable arrivals are
//!   refused (429), never displacing; nothing else is lost;
//! - tenants: a tenant with 30 queued requests and one (weight 2) with 6 behind them share by
//!   weight while both wait (Jain's index of their weighted shares ≥ 0.95; first come, first
//!   served would give 0.60);
//! - deadlines: earliest first; a deadline that passes while queued gets 504 then, not before;
//!   a deadline already past gets 429 on arrival, a malformed one 400.
//!
//! Every request ends as a full answer, a 429 with `Retry-After`, a 504 or a 400, the metrics
//! count what the clients saw, and the engine holds no KV pages afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, Guest, RouterProcess, free_port, guest};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::http::client;
use crate::router::{eventually, metric};

/// How one request ended, and when (its place among the answers).
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    name: String,
    status: u16,
    /// The OpenAI error code of a refusal.
    code: Option<String>,
    retry_after: Option<u64>,
    /// 0 for the first answer to come back.
    position: usize,
    took: Duration,
}

/// A reference engine with the Llama-3-8B profile, and a router serving one request at a time
/// with `queued` places to wait in.
struct Stage {
    engine: EngineProcess,
    router: RouterProcess,
    answered: Arc<AtomicUsize>,
}

impl Stage {
    fn start(queued: u32, extra: &[&str]) -> Stage {
        let engine = EngineProcess::spawn(&["--profile", "llama3-8b-h100", "--time-scale", "2"]);
        let queued = queued.to_string();
        let mut args = vec![
            "--policy",
            "round-robin",
            "--max-concurrent-requests",
            "1",
            "--max-queued-requests",
            &queued,
            "--queue-timeout",
            "60s",
        ];
        args.extend_from_slice(extra);
        let router = RouterProcess::serve(&[engine.url.as_str()], &args);
        Stage {
            engine,
            router,
            answered: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Sends a completion with `headers` and `body` fields, answered in the background.
    fn send(&self, name: &str, headers: &[(&str, &str)], body: Value) -> JoinHandle<Answer> {
        let mut request = client().post(self.router.endpoint("/v1/completions"));
        for &(header, value) in headers {
            request = request.header(header, value);
        }
        let mut json = json!({"prompt": format!("{name}: flow control"), "max_tokens": 16});
        for (key, value) in body.as_object().into_iter().flatten() {
            json[key] = value.clone();
        }
        let (name, answered) = (name.to_owned(), Arc::clone(&self.answered));
        tokio::spawn(async move {
            let sent = Instant::now();
            let response = request
                .json(&json)
                .send()
                .await
                .expect("the router answers");
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse().ok());
            let text = response.text().await.expect("a whole body");
            let position = answered.fetch_add(1, Ordering::SeqCst);
            let body: Value = serde_json::from_str(&text).expect("a JSON body");
            if status == 200 {
                let finished = &body["choices"][0]["finish_reason"];
                assert!(finished == "length" || finished == "stop", "{name}: {text}");
            }
            Answer {
                name,
                status,
                code: body["error"]["code"].as_str().map(str::to_owned),
                retry_after,
                position,
                took: sent.elapsed(),
            }
        })
    }

    /// Admits a long completion (its prompt's text ends after 336 tokens: ~3.6 s) and waits
    /// until it runs.
    async fn block(&self) -> JoinHandle<Answer> {
        let blocker = self.send("blocker", &[], json!({"max_tokens": 1000}));
        self.wait_for("switchyard_admission_in_flight", 1.0).await;
        blocker
    }

    async fn wait_for(&self, name: &str, value: f64) {
        let metrics = self.router.endpoint("/metrics");
        eventually(Duration::from_secs(10), || async {
            let now = metric(&metrics, name).await;
            (now != value).then(|| format!("{name} is {now}, not {value}"))
        })
        .await;
    }

    async fn metric(&self, name: &str) -> f64 {
        metric(&self.router.endpoint("/metrics"), name).await
    }

    /// Every request's answer, in the order they came back.
    async fn answers(&self, requests: Vec<JoinHandle<Answer>>) -> Vec<Answer> {
        let mut answers = Vec::new();
        for request in requests {
            answers.push(request.await.expect("no client panicked"));
        }
        answers.sort_by_key(|a| a.position);
        answers
    }

    /// The engine holds no KV once every request is answered.
    async fn assert_no_kv_left(&self) {
        let metrics = self.engine.endpoint("/metrics");
        eventually(Duration::from_secs(10), || async {
            let used = metric(&metrics, "switchyard_engine_kv_pages_used").await;
            (used > 0.0).then(|| format!("{used} KV pages still used"))
        })
        .await;
        self.wait_for("switchyard_admission_in_flight", 0.0).await;
        assert_eq!(self.metric("switchyard_queue_depth").await, 0.0);
    }
}

fn names(answers: &[Answer], status: u16) -> Vec<&str> {
    answers
        .iter()
        .filter(|a| a.status == status)
        .map(|a| a.name.as_str())
        .collect()
}

const DISPLACED: &str = "switchyard_admission_rejected_total{reason=\"displaced\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_priority_requests_never_wait_behind_queued_low_ones() {
    let stage = Stage::start(8, &[]);
    let mut requests = vec![stage.block().await];
    // Six low (sheddable) requests queue, then four high ones: two fit, two displace the
    // newest low ones; then two more low ones find the queue full and are refused.
    for i in 0..6 {
        requests.push(stage.send(&format!("low{i}"), &[("x-priority", "-1")], json!({})));
        stage
            .wait_for("switchyard_queue_depth", f64::from(i + 1))
            .await;
    }
    for i in 0..4 {
        // The body's vLLM priority (lower first) is negated: -10 in vLLM's sense is 10 here.
        requests.push(stage.send(&format!("high{i}"), &[], json!({"priority": -10})));
        match i {
            0 | 1 => {
                stage
                    .wait_for("switchyard_queue_depth", f64::from(7 + i))
                    .await
            }
            _ => stage.wait_for(DISPLACED, f64::from(i - 1)).await,
        }
    }
    for i in 6..8 {
        requests.push(stage.send(&format!("low{i}"), &[("x-priority", "-1")], json!({})));
    }
    let answers = stage.answers(requests).await;
    let order = names(&answers, 200);
    assert_eq!(
        order,
        [
            "blocker", "high0", "high1", "high2", "high3", "low0", "low1", "low2", "low3"
        ],
        "{answers:#?}"
    );
    let mut refused = names(&answers, 429);
    refused.sort_unstable();
    assert_eq!(refused, ["low4", "low5", "low6", "low7"], "{answers:#?}");
    for a in answers.iter().filter(|a| a.status == 429) {
        assert_eq!(
            (a.code.as_deref(), a.retry_after),
            (Some("overloaded"), Some(60))
        );
    }
    assert_eq!(answers.len(), 13, "every request is answered once");
    assert_eq!(
        stage
            .metric("switchyard_queue_shed_total{model=\"switchyard-reference\",priority=\"-1\"}")
            .await,
        4.0
    );
    assert_eq!(stage.metric(DISPLACED).await, 2.0);
    assert_eq!(
        stage.metric("switchyard_queue_wait_seconds_count").await,
        9.0
    );
    stage.assert_no_kv_left().await;
}

/// Jain's fairness index of `shares`: 1 when all are equal, 1/n when one has everything.
fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    sum * sum / (shares.len() as f64 * squares)
}

/// The answers given while both tenants waited: after the blocking request's, until chat's
/// last. Every request is served.
fn while_both_waited(answers: &[Answer]) -> &[Answer] {
    assert!(answers.iter().all(|a| a.status == 200), "{answers:#?}");
    let last_chat = answers
        .iter()
        .rposition(|a| a.name.starts_with("chat"))
        .expect("chat was served");
    &answers[1..=last_chat]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_burst_does_not_take_more_than_its_weighted_share() {
    let stage = Stage::start(40, &["--tenant-weight", "chat=2"]);
    let mut requests = vec![stage.block().await];
    // The bulk tenant (named by the body's `user`) queues 30, then chat (x-tenant) queues 6.
    for i in 0..30 {
        requests.push(stage.send(&format!("bulk{i}"), &[], json!({"user": "bulk"})));
    }
    stage.wait_for("switchyard_queue_depth", 30.0).await;
    for i in 0..6 {
        requests.push(stage.send(&format!("chat{i}"), &[("x-tenant", "chat")], json!({})));
    }
    stage.wait_for("switchyard_queue_depth", 36.0).await;
    let answers = stage.answers(requests).await;
    // While both tenants waited, what each got over its weight.
    let window = while_both_waited(&answers);
    let served = |tenant| window.iter().filter(|a| a.name.starts_with(tenant)).count() as f64;
    let shares = [served("chat") / 2.0, served("bulk") / 1.0];
    let index = jain(&shares);
    println!(
        "tenants: chat {} and bulk {} served while both waited; weighted shares {shares:?}, \
         Jain's index {index:.3}",
        served("chat"),
        served("bulk")
    );
    assert!(
        index >= 0.95,
        "Jain's index {index} over {shares:?}: {window:#?}"
    );
    stage.assert_no_kv_left().await;
}

/// What `least-service` charges a request, in tokens: its `max_tokens` plus its body's bytes
/// / 4 (the router's estimate of its prompt, as the flow-control page says).
fn charged(name: &str, max_tokens: u64) -> f64 {
    let body = json!({"prompt": format!("{name}: flow control"), "max_tokens": max_tokens});
    (max_tokens + body.to_string().len() as u64 / 4) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_service_shares_tokens_by_weight_when_one_tenant_sends_ten_times_more() {
    let stage = Stage::start(
        48,
        &["--fairness", "least-service", "--tenant-weight", "chat=2"],
    );
    let mut requests = vec![stage.block().await];
    // Bulk sends ten small requests for each large one of chat's, four times over.
    let (bulk_tokens, chat_tokens) = (4, 64);
    let mut cost = std::collections::HashMap::new();
    for round in 0..4 {
        for i in 0..10 {
            let name = format!("bulk{}", round * 10 + i);
            cost.insert(name.clone(), charged(&name, bulk_tokens));
            requests.push(stage.send(
                &name,
                &[("x-tenant", "bulk")],
                json!({"max_tokens": bulk_tokens}),
            ));
        }
        let name = format!("chat{round}");
        cost.insert(name.clone(), charged(&name, chat_tokens));
        requests.push(stage.send(
            &name,
            &[("x-tenant", "chat")],
            json!({"max_tokens": chat_tokens}),
        ));
        stage
            .wait_for("switchyard_queue_depth", f64::from(11 * (round + 1)))
            .await;
    }
    let answers = stage.answers(requests).await;
    let window = while_both_waited(&answers);
    let service = |tenant: &str| -> f64 {
        window
            .iter()
            .filter(|a| a.name.starts_with(tenant))
            .map(|a| cost[&a.name])
            .sum()
    };
    // Tokens served while both waited, over each tenant's weight.
    let shares = [service("chat") / 2.0, service("bulk") / 1.0];
    let index = jain(&shares);
    // Round-robin (two of chat's turns per bulk's, by weight) would give chat about five
    // times bulk's weighted share: Jain's index about 0.70.
    println!("least-service: weighted token shares {shares:?}, Jain's index {index:.3}");
    assert!(
        index >= 0.95,
        "Jain's index {index} over {shares:?}: {window:#?}"
    );
    stage.assert_no_kv_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_order_the_queue_and_expire_at_their_moment() {
    let stage = Stage::start(8, &[]);
    let mut requests = vec![stage.block().await];
    let deadlines = [("in20s", "20000"), ("in8s", "8000"), ("in12s", "12000")];
    for (i, (name, ms)) in deadlines.iter().enumerate() {
        requests.push(stage.send(name, &[("x-request-deadline-ms", ms)], json!({})));
        stage
            .wait_for("switchyard_queue_depth", (i + 1) as f64)
            .await;
    }
    requests.push(stage.send("none", &[], json!({})));
    // Due long before the blocker ends: it leaves the queue with 504 at its deadline.
    let expiring = stage.send("in300ms", &[("x-request-deadline-ms", "300")], json!({}));
    let past = stage.send("past", &[("x-request-deadline-ms", "0")], json!({}));
    let malformed = stage.send("malformed", &[("x-request-deadline-ms", "soon")], json!({}));
    let (expiring, past, malformed) = (
        expiring.await.expect("answered"),
        past.await.expect("answered"),
        malformed.await.expect("answered"),
    );
    assert_eq!(
        (expiring.status, expiring.code.as_deref()),
        (504, Some("deadline_exceeded"))
    );
    assert!(
        expiring.took >= Duration::from_millis(300),
        "504 before the deadline: {expiring:?}"
    );
    assert_eq!(expiring.retry_after, None);
    assert_eq!((past.status, past.retry_after), (429, Some(60)), "{past:?}");
    assert_eq!(malformed.status, 400, "{malformed:?}");
    let answers = stage.answers(requests).await;
    assert_eq!(
        names(&answers, 200),
        ["blocker", "in8s", "in12s", "in20s", "none"],
        "{answers:#?}"
    );
    assert_eq!(
        stage
            .metric("switchyard_queue_expired_total{model=\"switchyard-reference\",priority=\"0\"}")
            .await,
        1.0
    );
    assert_eq!(
        stage
            .metric("switchyard_admission_rejected_total{reason=\"deadline_unmeetable\"}")
            .await,
        1.0
    );
    stage.assert_no_kv_left().await;
}

/// Sends a short completion to `router`; its status and how long the answer took.
fn complete(router: &RouterProcess, name: &str) -> JoinHandle<(u16, Duration)> {
    let request = client()
        .post(router.endpoint("/v1/completions"))
        .json(&json!({"prompt": format!("{name}: scale from zero"), "max_tokens": 8}));
    tokio::spawn(async move {
        let sent = Instant::now();
        let response = request.send().await.expect("the router answers");
        let status = response.status().as_u16();
        response.text().await.expect("a whole body");
        (status, sent.elapsed())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_from_zero_holds_requests_until_an_engine_is_ready() {
    // The engine's port, reserved: nothing listens there until the engine starts.
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let router = RouterProcess::serve_listening(
        &[url.as_str()],
        &["--scale-from-zero-timeout-ms", "60000"],
        &[],
    );
    let metrics = router.endpoint("/metrics");
    let requests: Vec<_> = (0..3)
        .map(|i| complete(&router, &format!("held{i}")))
        .collect();
    // Held, and counted where an autoscaler looks for demand on a model with no replica.
    eventually(Duration::from_secs(10), || async {
        let depth = metric(&metrics, "switchyard_queue_depth").await;
        (depth != 3.0).then(|| format!("queue depth {depth}, not 3"))
    })
    .await;
    assert!(requests.iter().all(|r| !r.is_finished()));
    let engine = EngineProcess::spawn_on(port, &[]);
    for request in requests {
        let (status, _) = request.await.expect("no client panicked");
        assert_eq!(status, 200, "released once the engine is ready");
    }
    assert_eq!(metric(&metrics, "switchyard_queue_depth").await, 0.0);
    drop(engine);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_from_zero_answers_503_when_no_engine_is_ready_in_time() {
    let url = format!("http://127.0.0.1:{}", free_port());
    let held = RouterProcess::serve_listening(
        &[url.as_str()],
        &["--scale-from-zero-timeout-ms", "700"],
        &[],
    );
    let (status, took) = complete(&held, "late").await.expect("no client panicked");
    assert_eq!(status, 503);
    assert!(
        took >= Duration::from_millis(700),
        "503 before the timeout: {took:?}"
    );
    assert!(
        took < Duration::from_secs(30),
        "not left to a later timeout: {took:?}"
    );
    // Off (the default): 503 without waiting for anything.
    let off = RouterProcess::serve_listening(&[url.as_str()], &[], &[]);
    let (status, _) = complete(&off, "off").await.expect("no client panicked");
    assert_eq!(status, 503);
    assert_eq!(
        metric(&off.endpoint("/metrics"), "switchyard_queue_depth").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_routes_by_the_priority_tenant_and_deadline_flow_control_read() {
    let plugins = tempfile::tempdir().expect("a temporary plugins directory");
    std::fs::copy(
        guest(Guest::FLOW_ROUTE),
        plugins.path().join("flow-route.wasm"),
    )
    .expect("install the test policy");
    let (reserved, other) = (EngineProcess::spawn(&[]), EngineProcess::spawn(&[]));
    let plugins_arg = plugins.path().display().to_string();
    let router = RouterProcess::serve(
        &[reserved.url.as_str(), other.url.as_str()],
        &[
            "--plugins",
            &plugins_arg,
            "--policy",
            "flow-route",
            "--policy-config",
            r#"{"tenant": "vip", "deadline_ms": 2000}"#,
            "--fallback-policy",
            "none",
        ],
    );
    let urgent: [(&[(&str, &str)], Value); 5] = [
        (&[("x-priority", "3")], json!({})),
        // vLLM's priority, lower first: -2 is priority 2 here.
        (&[], json!({"priority": -2})),
        (&[("x-tenant", "vip")], json!({})),
        (&[], json!({"user": "vip"})),
        (&[("x-request-deadline-ms", "1500")], json!({})),
    ];
    let plain: [(&[(&str, &str)], Value); 4] = [
        (&[], json!({})),
        (&[("x-tenant", "batch")], json!({})),
        (&[("x-priority", "-1")], json!({})),
        (&[("x-request-deadline-ms", "60000")], json!({})),
    ];
    for (i, (headers, body)) in urgent.iter().chain(&plain).enumerate() {
        let mut request = client().post(router.endpoint("/v1/completions"));
        for &(name, value) in *headers {
            request = request.header(name, value);
        }
        let mut json = json!({"prompt": format!("request {i}"), "max_tokens": 4});
        for (key, value) in body.as_object().into_iter().flatten() {
            json[key] = value.clone();
        }
        let response = request
            .json(&json)
            .send()
            .await
            .expect("the router answers");
        assert_eq!(response.status().as_u16(), 200, "request {i}");
    }
    let calls = |engine: &EngineProcess| {
        let url = engine.endpoint("/metrics");
        async move { metric(&url, "switchyard_engine_calls_received").await }
    };
    assert_eq!(
        (calls(&reserved).await, calls(&other).await),
        (5.0, 4.0),
        "urgent work on the reserved engine, the rest on the other"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_engine_is_left_out_while_another_has_room() {
    // One request at a time, each ~6 s: requests sent to it directly queue in the engine.
    let busy = EngineProcess::spawn(&[
        "--max-batch",
        "1",
        "--profile",
        "llama3-8b-h100",
        "--time-scale",
        "4",
    ]);
    let idle = EngineProcess::spawn(&[]);
    let router = RouterProcess::serve(
        &[busy.url.as_str(), idle.url.as_str()],
        &["--policy", "round-robin"],
    );
    let prompt = "saturation ".repeat(40);
    let direct: Vec<_> = (0..7)
        .map(|_| {
            let request = client()
                .post(busy.endpoint("/v1/completions"))
                .json(&json!({"prompt": prompt, "max_tokens": 300}));
            tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    // The router reads the engine's queue from its /metrics (every probe interval, 2 s).
    let admin = router.endpoint("/admin/endpoints");
    eventually(Duration::from_secs(10), || async {
        let endpoints: Value = client()
            .get(&admin)
            .send()
            .await
            .expect("admin reachable")
            .json()
            .await
            .expect("a JSON list");
        let waiting = endpoints["endpoints"][0]["waiting"].as_u64().unwrap_or(0);
        (waiting < 5).then(|| format!("the busy engine reports {waiting} waiting, not 5 or more"))
    })
    .await;
    let calls = |engine: &EngineProcess| {
        let url = engine.endpoint("/metrics");
        async move { metric(&url, "switchyard_engine_calls_received").await }
    };
    let before = (calls(&busy).await, calls(&idle).await);
    for i in 0..6 {
        let response = client()
            .post(router.endpoint("/v1/completions"))
            .json(&json!({"prompt": format!("routed {i}"), "max_tokens": 4}))
            .send()
            .await
            .expect("the router answers");
        assert_eq!(response.status().as_u16(), 200);
    }
    let after = (calls(&busy).await, calls(&idle).await);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (0.0, 6.0),
        "every routed request on the engine with room"
    );
    let metrics = router.endpoint("/metrics");
    let desired = metric(
        &metrics,
        r#"switchyard_desired_replicas{model="switchyard-reference",role="any"}"#,
    )
    .await;
    assert!(
        desired >= 2.0,
        "one engine's backlog asks for more: {desired}"
    );
    for request in direct {
        request.abort();
    }
}
