//! vLLM and SGLang P/D between in-process engines on loopback: what a router would send, leg
//! by leg, checked against a single engine's answer (the KV moved right only if they are
//! equal), and the engines' handoff metrics after each. Waits are bounded: a metric is polled
//! until it reaches its value or a deadline passes.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_wire::ReadyLine;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use super::*;

async fn engine(flags: &[&str]) -> RunningEngine {
    let args = EngineArgs::from_flags(["--port", "0"].iter().chain(flags)).expect("valid flags");
    start(&args).await.expect("engine starts")
}

fn url(engine: &RunningEngine, path: &str) -> String {
    format!("http://{}{path}", engine.http_addr())
}

/// Status and body (JSON, or the SSE text as a string) of one call.
async fn call(engine: &RunningEngine, path: &str, body: &Value, id: Option<&str>) -> (u16, Value) {
    let mut request = reqwest::Client::new().post(url(engine, path)).json(body);
    if let Some(id) = id {
        request = request.header("X-Request-Id", id);
    }
    let response = request.send().await.expect("engine reachable");
    let status = response.status().as_u16();
    let sse = response
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let text = response.text().await.expect("body");
    let body = if sse {
        Value::String(text)
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    (status, body)
}

async fn metrics_text(engine: &RunningEngine) -> String {
    reqwest::get(url(engine, "/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

/// The value of the sample `name` (with its labels, as written), 0 when absent.
async fn metric(engine: &RunningEngine, name: &str) -> f64 {
    let text = metrics_text(engine).await;
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Polls `name` until it equals `want`, for at most 10 s.
async fn wait_metric(engine: &RunningEngine, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = metric(engine, name).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} is {got}, want {want}\n{}",
            metrics_text(engine).await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What a client sees of an answer: text, generated ids, finish reason, usage counts, and
/// how many prompt tokens the answering engine's prefix cache served (which depends on that
/// engine's history, not on the answer: equal answers may differ in it).
#[derive(Debug)]
struct Output {
    text: String,
    ids: Vec<u64>,
    finish: String,
    usage: Value,
    cached_tokens: u64,
}

impl PartialEq for Output {
    fn eq(&self, other: &Output) -> bool {
        (&self.text, &self.ids, &self.finish, &self.usage)
            == (&other.text, &other.ids, &other.finish, &other.usage)
    }
}

/// Usage without its `prompt_tokens_details`, and the cached tokens they report.
fn split_usage(mut usage: Value) -> (Value, u64) {
    let details = usage
        .as_object_mut()
        .and_then(|u| u.remove("prompt_tokens_details"))
        .expect("every answer says what its prefix cache served");
    let cached = details["cached_tokens"].as_u64().expect("cached_tokens");
    (usage, cached)
}

fn choice_text(choice: &Value) -> &str {
    choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .or_else(|| choice["delta"]["content"].as_str())
        .unwrap_or("")
}

fn output(body: &Value) -> Output {
    let Value::String(sse) = body else {
        let choice = &body["choices"][0];
        let (usage, cached_tokens) = split_usage(body["usage"].clone());
        return Output {
            text: choice_text(choice).to_owned(),
            ids: ids(choice),
            finish: choice["finish_reason"].as_str().unwrap_or("").to_owned(),
            usage,
            cached_tokens,
        };
    };
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    let mut out = Output {
        text: String::new(),
        ids: Vec::new(),
        finish: String::new(),
        usage: Value::Null,
        cached_tokens: 0,
    };
    for event in sse.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("a data event");
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).expect("a JSON chunk");
        assert!(chunk.get("error").is_none(), "{chunk}");
        if let Some(choice) = chunk["choices"].get(0) {
            out.text.push_str(choice_text(choice));
            out.ids.extend(ids(choice));
            if let Some(f) = choice["finish_reason"].as_str() {
                out.finish = f.to_owned();
            }
        } else {
            (out.usage, out.cached_tokens) = split_usage(chunk["usage"].clone());
        }
    }
    out
}

/// What a decode engine's prefix cache can serve of a prompt it has seen whole: the pages
/// before its last token, which D computes itself (prep_recv's `end = -1`).
fn whole_pages_before_last(output: &Output, page_size: u64) -> u64 {
    let prompt = output.usage["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");
    (prompt - 1) / page_size * page_size
}

fn ids(choice: &Value) -> Vec<u64> {
    choice["token_ids"]
        .as_array()
        .expect("token_ids (return_token_ids)")
        .iter()
        .map(|v| v.as_u64().expect("an id"))
        .collect()
}

fn random_prompt(rng: &mut StdRng) -> String {
    const WORDS: [&str; 12] = [
        "the", "router", "moves", "pages", "between", "engines", "while", "tokens", "stream", "kv",
        "prefill", "decode",
    ];
    let n = rng.random_range(4..24);
    (0..n)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// A client body of `shape` (`/v1/completions` or `/v1/chat/completions`).
fn client_body(path: &str, prompt: &str, stream: bool, max_tokens: u32) -> Value {
    let mut body = if path == "/v1/completions" {
        json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens})
    } else {
        json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": prompt}], "max_completion_tokens": max_tokens})
    };
    body["return_token_ids"] = true.into();
    body["temperature"] = 0.7.into();
    body["seed"] = 11.into();
    if stream {
        body["stream"] = true.into();
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

const ROUTES: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// The load gauges under the protocol's own names alone parse with the router's reader, and
/// settle at an idle engine's values (the step loop publishes them after each step).
async fn assert_protocol_load(engine: &RunningEngine, prefix: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(engine).await;
        let own: String = text
            .lines()
            .filter(|l| l.contains(prefix))
            .map(|l| format!("{l}\n"))
            .collect();
        let load = switchyard_wire::metrics::EngineLoad::from_prometheus(&own);
        assert!(load.kv_usage.is_some(), "{own}");
        if (load.running, load.waiting, load.kv_usage) == (Some(0), Some(0), Some(0.0)) {
            return;
        }
        assert!(Instant::now() < deadline, "{own}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// === vLLM ===

/// The P leg of spec §3: the client's body with the NIXL stanza and a one-token limit.
fn vllm_p_body(client: &Value) -> Value {
    let mut p = client.clone();
    let obj = p.as_object_mut().expect("an object");
    obj.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    obj.insert("stream".into(), false.into());
    obj.remove("stream_options");
    obj.insert("max_tokens".into(), 1.into());
    if obj.contains_key("max_completion_tokens") {
        obj.insert("max_completion_tokens".into(), 1.into());
    }
    p
}

fn with_params(client: &Value, params: &Value) -> Value {
    let mut d = client.clone();
    d["kv_transfer_params"] = params.clone();
    d
}

async fn vllm_pair_matches_single_engine(transport: &str, seed: u64) {
    let p = engine(&[
        "--protocol",
        "vllm",
        "--kv-transport",
        transport,
        "--device-rank",
        "0",
    ])
    .await;
    // D keeps a prefix cache: a repeated prompt then pulls only the pages it lacks.
    let d = engine(&[
        "--protocol",
        "vllm",
        "--kv-transport",
        transport,
        "--device-rank",
        "1",
        "--prefix-cache",
    ])
    .await;
    let single = engine(&["--protocol", "vllm", "--kv-transport", transport]).await;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pulled = 0.0;
    for round in 0..3 {
        let prompt = random_prompt(&mut rng);
        for path in ROUTES {
            for stream in [false, true] {
                let client = client_body(path, &prompt, stream, 24);
                let (status, direct) = call(&single, path, &client, None).await;
                assert_eq!(status, 200, "{direct}");
                let id = format!("req-{seed}-{round}-{path}-{stream}");
                let (status, answer) = call(&p, path, &vllm_p_body(&client), Some(&id)).await;
                assert_eq!(status, 200, "{answer}");
                assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
                assert_eq!(answer["usage"]["completion_tokens"], 1, "{answer}");
                let prefix = if path == ROUTES[0] {
                    "cmpl"
                } else {
                    "chatcmpl"
                };
                assert_eq!(answer["id"], format!("{prefix}-{id}"));
                let params = answer["kv_transfer_params"].clone();
                assert_eq!(params["do_remote_prefill"], true, "{answer}");
                assert_eq!(params["remote_port"], p.side_channel_addr().unwrap().port());
                assert_eq!(metric(&p, "switchyard_engine_vllm_leases_held").await, 1.0);
                let (status, decoded) =
                    call(&d, path, &with_params(&client, &params), Some(&id)).await;
                assert_eq!(status, 200, "{decoded}");
                let (decoded, direct) = (output(&decoded), output(&direct));
                assert_eq!(decoded, direct, "{path} stream={stream}");
                assert_eq!(direct.cached_tokens, 0, "the single engine caches nothing");
                // The streamed request repeats the one before it: D's own cache serves every
                // whole page of it, however much of it P pushed.
                if stream {
                    let served = whole_pages_before_last(&decoded, 16);
                    assert_eq!(decoded.cached_tokens, served, "{path}");
                }
                pulled += 1.0;
                assert_eq!(metric(&p, "switchyard_engine_vllm_leases_held").await, 0.0);
                assert_eq!(
                    metric(&p, "switchyard_engine_vllm_leases_pulled_total").await,
                    pulled
                );
            }
        }
    }
    assert_eq!(
        metric(&d, "switchyard_engine_vllm_kv_load_failures_total").await,
        0.0
    );
    assert_eq!(metric(&d, "switchyard_engine_reservations").await, 0.0);
    for e in [&p, &d] {
        assert_eq!(
            metric(e, "switchyard_engine_vllm_protocol_violations_total").await,
            0.0
        );
    }
}

#[tokio::test]
async fn vllm_pd_over_tcp_gives_the_single_engine_output() {
    vllm_pair_matches_single_engine("tcp", 1).await;
}

#[tokio::test]
async fn vllm_pd_over_shm_gives_the_single_engine_output() {
    vllm_pair_matches_single_engine("shm", 2).await;
}

#[tokio::test]
async fn vllm_surface_and_checks() {
    let e = engine(&["--protocol", "vllm"]).await;
    let health = reqwest::get(url(&e, "/health")).await.unwrap();
    assert_eq!(health.status(), 200);
    let models: Value = reqwest::get(url(&e, "/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    // The microserving calls are not part of this protocol.
    let (status, _) = call(&e, "/microserving/prep_recv", &json!({"prompt": [1]}), None).await;
    assert_eq!(status, 404);
    let plain = json!({"prompt": "hello", "max_tokens": 3});
    let mut bad = plain.clone();
    bad["stream_options"] = json!({"include_usage": true});
    assert_eq!(call(&e, "/v1/completions", &bad, None).await.0, 400);
    bad = plain.clone();
    bad["n"] = 2.into();
    assert_eq!(call(&e, "/v1/completions", &bad, None).await.0, 400);
    let (status, answer) = call(&e, "/v1/completions", &plain, Some("abc")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["id"], "cmpl-abc");
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    // The load gauges parse with the router's reader, under vLLM's names alone.
    assert_protocol_load(&e, "vllm:").await;

    // A P leg must follow §3: each broken rule is a counted violation.
    let client = client_body(ROUTES[0], "some prompt here", false, 8);
    let good = vllm_p_body(&client);
    let mut violations = 0.0;
    for (field, value) in [
        ("max_tokens", json!(2)),
        ("stream", json!(true)),
        ("stream_options", json!({"include_usage": true})),
        ("min_tokens", json!(2)),
        ("n", json!(2)),
    ] {
        let mut body = good.clone();
        body[field] = value;
        let (status, error) = call(&e, ROUTES[0], &body, Some(&format!("bad-{field}"))).await;
        assert_eq!(status, 400, "{field}: {error}");
        violations += 1.0;
    }
    assert_eq!(
        call(&e, ROUTES[0], &good, None).await.0,
        400,
        "no X-Request-Id"
    );
    violations += 1.0;
    assert_eq!(call(&e, ROUTES[0], &good, Some("once")).await.0, 200);
    let (status, error) = call(&e, ROUTES[0], &good, Some("once")).await;
    assert_eq!(status, 400, "a reused X-Request-Id: {error}");
    violations += 1.0;
    assert_eq!(
        metric(&e, "switchyard_engine_vllm_protocol_violations_total").await,
        violations
    );
}

#[tokio::test]
async fn vllm_bad_params_fail_the_load_and_unpulled_leases_expire() {
    let p = engine(&["--protocol", "vllm", "--kv-lease-ms", "300"]).await;
    let d = engine(&["--protocol", "vllm", "--device-rank", "1"]).await;
    let client = client_body(ROUTES[0], "a prompt that will be leased", false, 8);
    let (status, answer) = call(&p, ROUTES[0], &vllm_p_body(&client), Some("x1")).await;
    assert_eq!(status, 200, "{answer}");
    let params = answer["kv_transfer_params"].clone();

    // Unknown params: P never issued this request id.
    let mut unknown = params.clone();
    unknown["remote_request_id"] = "cmpl-nobody-0".into();
    let (status, error) = call(&d, ROUTES[0], &with_params(&client, &unknown), Some("x1")).await;
    assert_eq!(status, 500, "{error}");
    // The client's body with another sampling field than the P leg had.
    let mut changed = with_params(&client, &params);
    changed["temperature"] = 0.1.into();
    let (status, error) = call(&d, ROUTES[0], &changed, Some("x1")).await;
    assert_eq!(status, 500, "{error}");
    // Another prompt than the one leased.
    let other = client_body(ROUTES[0], "another prompt entirely", false, 8);
    let (status, error) = call(&d, ROUTES[0], &with_params(&other, &params), Some("x1")).await;
    assert_eq!(status, 500, "{error}");
    assert_eq!(
        metric(&d, "switchyard_engine_vllm_kv_load_failures_total").await,
        3.0
    );
    wait_metric(&d, "switchyard_engine_reservations", 0.0).await;
    // The failed loads told P to drop the lease (the empty-read notification)...
    wait_metric(&p, "switchyard_engine_vllm_leases_released_total", 1.0).await;
    wait_metric(&p, "switchyard_engine_vllm_leases_held", 0.0).await;

    // ... and a lease nobody pulls expires.
    let (status, answer) = call(&p, ROUTES[0], &vllm_p_body(&client), Some("x2")).await;
    assert_eq!(status, 200, "{answer}");
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(metric(&p, "switchyard_engine_vllm_leases_held").await, 1.0);
    wait_metric(&p, "switchyard_engine_vllm_leases_expired_total", 1.0).await;
    assert_eq!(metric(&p, "switchyard_engine_vllm_leases_held").await, 0.0);
    // The dropped lease hands its pages back to the step loop, which frees them.
    wait_metric(&p, "switchyard_engine_kv_pages_used", 0.0).await;
    // Pulling it now is a load failure on D.
    let (status, error) = call(&d, ROUTES[0], &with_params(&client, &params), Some("x2")).await;
    assert_eq!(status, 500, "{error}");
    assert_eq!(
        metric(&p, "switchyard_engine_vllm_leases_pulled_total").await,
        0.0
    );
}

/// Writes one POST by hand and returns the open connection: closing it is how a router
/// cancels a leg.
async fn open_leg(addr: SocketAddr, path: &str, body: &Value) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nX-Request-Id: leg-{}\r\nContent-Length: {}\r\n\r\n",
        rand::random::<u32>(),
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("writes");
    stream.write_all(body.as_bytes()).await.expect("writes");
    stream
}

/// Reads one HTTP request (head and Content-Length body) from `stream`.
async fn read_request_text(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("the request comes")
            .expect("reads");
        assert!(n > 0, "the peer closed before a whole request");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .and_then(|l| l.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return text;
            }
        }
    }
}

#[tokio::test]
async fn a_vllm_decode_leg_cancelled_during_its_pull_frees_its_pages_and_releases_the_lease() {
    let d = engine(&["--protocol", "vllm", "--device-rank", "1"]).await;
    // A side channel that takes the pull and never answers it.
    let side = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [[0, 1]], "remote_engine_id": "e-1", "remote_request_id": "cmpl-q-1",
        "remote_host": "127.0.0.1", "remote_port": side.local_addr().unwrap().port(), "tp_size": 1});
    for stream in [false, true] {
        let client = client_body(
            ROUTES[1],
            "a prompt long enough to span two pages of KV",
            stream,
            8,
        );
        let leg = open_leg(d.http_addr(), ROUTES[1], &with_params(&client, &params)).await;
        let (mut pull, _) = side.accept().await.unwrap();
        let request = read_request_text(&mut pull).await;
        assert!(request.starts_with("POST /pull "), "{request}");
        assert_eq!(metric(&d, "switchyard_engine_reservations").await, 1.0);
        drop(leg);
        // The handler is dropped with its connection: the reservation goes, and P is told.
        let (mut release, _) = tokio::time::timeout(Duration::from_secs(10), side.accept())
            .await
            .expect("D tells P to release")
            .unwrap();
        let request = read_request_text(&mut release).await;
        assert!(request.starts_with("POST /release "), "{request}");
        assert!(request.contains("cmpl-q-1"), "{request}");
        wait_metric(&d, "switchyard_engine_reservations", 0.0).await;
        drop(pull);
    }
    wait_metric(&d, "switchyard_engine_kv_pages_used", 0.0).await;
}

#[tokio::test]
async fn a_released_lease_frees_the_prefill_pages() {
    let p = engine(&["--protocol", "vllm"]).await;
    let client = client_body(ROUTES[0], "lease me", false, 8);
    let (_, answer) = call(&p, ROUTES[0], &vllm_p_body(&client), Some("r1")).await;
    let params = &answer["kv_transfer_params"];
    assert!(metric(&p, "switchyard_engine_kv_pages_used").await > 0.0);
    let side = format!("http://{}/release", p.side_channel_addr().unwrap());
    let released = reqwest::Client::new()
        .post(side)
        .json(&json!({"remote_request_id": params["remote_request_id"],
            "remote_engine_id": params["remote_engine_id"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), 200);
    assert_eq!(
        metric(&p, "switchyard_engine_vllm_leases_released_total").await,
        1.0
    );
    assert_eq!(metric(&p, "switchyard_engine_vllm_leases_held").await, 0.0);
    wait_metric(&p, "switchyard_engine_kv_pages_used", 0.0).await;
}

// === SGLang ===

async fn sglang_prefill(extra: &[&str]) -> RunningEngine {
    let mut flags = vec![
        "--protocol",
        "sglang",
        "--disaggregation-mode",
        "prefill",
        "--bootstrap-port",
        "0",
    ];
    flags.extend(extra);
    engine(&flags).await
}

fn with_room(client: &Value, p: &RunningEngine, room: u64) -> Value {
    let mut b = client.clone();
    b["bootstrap_host"] = "127.0.0.1".into();
    b["bootstrap_port"] = p
        .bootstrap_addr()
        .expect("a bootstrap server")
        .port()
        .into();
    b["bootstrap_room"] = room.into();
    b
}

const PENDING_P: &str = "switchyard_engine_sglang_rooms_pending{side=\"prefill\"}";
const PENDING_D: &str = "switchyard_engine_sglang_rooms_pending{side=\"decode\"}";
const REGISTRATIONS: &str = "switchyard_engine_sglang_registrations";

async fn sglang_pair_matches_single_engine(transport: &str, seed: u64) {
    let p = sglang_prefill(&["--kv-transport", transport]).await;
    let d = engine(&[
        "--protocol",
        "sglang",
        "--disaggregation-mode",
        "decode",
        "--kv-transport",
        transport,
        "--device-rank",
        "1",
        "--prefix-cache",
    ])
    .await;
    let single = engine(&["--protocol", "sglang", "--kv-transport", transport]).await;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut transferred = 0.0;
    for _ in 0..3 {
        let prompt = random_prompt(&mut rng);
        for path in ROUTES {
            for stream in [false, true] {
                let client = client_body(path, &prompt, stream, 24);
                let (status, direct) = call(&single, path, &client, None).await;
                assert_eq!(status, 200, "{direct}");
                let body = with_room(&client, &p, rng.random_range(0..=i64::MAX as u64));
                let (prefilled, decoded) =
                    tokio::join!(call(&p, path, &body, None), call(&d, path, &body, None));
                assert_eq!(prefilled.0, 200, "{}", prefilled.1);
                assert_eq!(decoded.0, 200, "{}", decoded.1);
                let one = output(&prefilled.1);
                assert_eq!(
                    (one.finish.as_str(), one.ids.len()),
                    ("length", 1),
                    "{one:?}"
                );
                let (decoded, direct) = (output(&decoded.1), output(&direct));
                assert_eq!(decoded, direct, "{path} stream={stream}");
                if stream {
                    let served = whole_pages_before_last(&decoded, 16);
                    assert_eq!(decoded.cached_tokens, served, "{path}");
                }
                transferred += 1.0;
                assert_eq!(
                    metric(&p, "switchyard_engine_sglang_rooms_transferred_total").await,
                    transferred
                );
                assert_eq!(metric(&p, PENDING_P).await, 0.0);
                assert_eq!(metric(&d, PENDING_D).await, 0.0);
            }
        }
    }
    assert_eq!(metric(&d, "switchyard_engine_reservations").await, 0.0);
    for e in [&p, &d] {
        assert_eq!(
            metric(e, "switchyard_engine_sglang_protocol_violations_total").await,
            0.0
        );
    }
}

#[tokio::test]
async fn sglang_pd_over_tcp_gives_the_single_engine_output() {
    sglang_pair_matches_single_engine("tcp", 3).await;
}

#[tokio::test]
async fn sglang_pd_over_shm_gives_the_single_engine_output() {
    sglang_pair_matches_single_engine("shm", 4).await;
}

#[tokio::test]
async fn sglang_surface_and_checks() {
    let p = sglang_prefill(&[]).await;
    let d = engine(&[
        "--protocol",
        "sglang",
        "--disaggregation-mode",
        "decode",
        "--device-rank",
        "1",
    ])
    .await;
    assert_eq!(
        p.ready_line().bootstrap_port,
        Some(p.bootstrap_addr().unwrap().port())
    );
    assert_eq!(d.ready_line().bootstrap_port, None);
    let parsed: ReadyLine = p.ready_line().to_string().parse().expect("parses");
    assert_eq!(parsed, p.ready_line());
    let health = reqwest::get(format!("http://{}/health", p.bootstrap_addr().unwrap()))
        .await
        .unwrap();
    assert_eq!(health.text().await.unwrap(), "OK");
    let models: Value = reqwest::get(url(&d, "/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["owned_by"], "sglang");
    let info: Value = reqwest::get(url(&p, "/get_server_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["disaggregation_mode"], "prefill");
    assert_protocol_load(&d, "sglang:").await;

    // Plain requests are refused by a prefill or a decode engine.
    let client = client_body(ROUTES[0], "hello there", false, 4);
    assert_eq!(call(&p, ROUTES[0], &client, None).await.0, 400);
    assert_eq!(call(&d, ROUTES[0], &client, None).await.0, 400);
    // A P leg naming another bootstrap server, or an out-of-range room.
    let mut wrong = with_room(&client, &p, 5);
    wrong["bootstrap_port"] = 1.into();
    assert_eq!(call(&p, ROUTES[0], &wrong, None).await.0, 400);
    let mut wrong = with_room(&client, &p, 5);
    wrong["bootstrap_room"] = json!(u64::MAX);
    assert_eq!(call(&p, ROUTES[0], &wrong, None).await.0, 400);
    assert_eq!(
        metric(&p, "switchyard_engine_sglang_protocol_violations_total").await,
        3.0
    );
    assert_eq!(
        metric(&d, "switchyard_engine_sglang_protocol_violations_total").await,
        1.0
    );

    // One pair, then its room again: a reuse.
    let body = with_room(&client, &p, 77);
    let (a, b) = tokio::join!(
        call(&p, ROUTES[0], &body, None),
        call(&d, ROUTES[0], &body, None)
    );
    assert_eq!((a.0, b.0), (200, 200), "{} {}", a.1, b.1);
    let (status, error) = call(&p, ROUTES[0], &body, None).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(
        metric(&p, "switchyard_engine_sglang_protocol_violations_total").await,
        4.0
    );

    // Legs whose bodies differ (beyond the DP fields) do not pair.
    let body = with_room(&client, &p, 78);
    let mut other = body.clone();
    other["max_tokens"] = 5.into();
    other["routed_dp_rank"] = 0.into();
    let (a, b) = tokio::join!(
        call(&p, ROUTES[0], &body, None),
        call(&d, ROUTES[0], &other, None)
    );
    assert_eq!((a.0, b.0), (400, 500), "{} {}", a.1, b.1);
    wait_metric(&d, "switchyard_engine_reservations", 0.0).await;
    assert_eq!(metric(&p, PENDING_P).await, 0.0);
    assert_eq!(metric(&d, PENDING_D).await, 0.0);
}

#[tokio::test]
async fn sglang_legs_without_a_counterpart_become_orphans() {
    let p = sglang_prefill(&["--bootstrap-timeout-ms", "200"]).await;
    let d = engine(&[
        "--protocol",
        "sglang",
        "--disaggregation-mode",
        "decode",
        "--device-rank",
        "1",
        "--bootstrap-timeout-ms",
        "5000",
    ])
    .await;
    let client = client_body(ROUTES[0], "nobody will decode this", false, 4);
    let (status, error) = call(&p, ROUTES[0], &with_room(&client, &p, 1), None).await;
    assert_eq!(status, 500, "{error}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("timed out") && message.contains("Bootstrapping"),
        "{message}"
    );
    assert_eq!(
        metric(
            &p,
            "switchyard_engine_sglang_orphans_total{side=\"prefill\"}"
        )
        .await,
        1.0
    );
    // Streaming: the head is out at once, so the timeout is an error event.
    let mut streaming = with_room(&client_body(ROUTES[1], "again nobody", true, 4), &p, 2);
    streaming["stream"] = true.into();
    let (status, body) = call(&p, ROUTES[1], &streaming, None).await;
    assert_eq!(status, 200);
    let text = body.as_str().expect("SSE");
    assert!(
        text.contains("\"error\"") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    assert_eq!(
        metric(
            &p,
            "switchyard_engine_sglang_orphans_total{side=\"prefill\"}"
        )
        .await,
        2.0
    );

    // A D leg whose P never comes: P's bootstrap server gives up after P's bound.
    let (status, error) = call(&d, ROUTES[0], &with_room(&client, &p, 3), None).await;
    assert_eq!(status, 500, "{error}");
    assert_eq!(
        metric(
            &d,
            "switchyard_engine_sglang_orphans_total{side=\"decode\"}"
        )
        .await,
        1.0
    );
    wait_metric(&d, "switchyard_engine_reservations", 0.0).await;
    assert_eq!(metric(&d, PENDING_D).await, 0.0);
    assert_eq!(metric(&p, PENDING_P).await, 0.0);
}

#[tokio::test]
async fn closing_a_waiting_sglang_leg_cancels_it_and_leaves_nothing_pending() {
    let p = sglang_prefill(&[]).await;
    let d = engine(&[
        "--protocol",
        "sglang",
        "--disaggregation-mode",
        "decode",
        "--device-rank",
        "1",
    ])
    .await;
    let cancelled_p = "switchyard_engine_sglang_cancelled_total{side=\"prefill\"}";
    let cancelled_d = "switchyard_engine_sglang_cancelled_total{side=\"decode\"}";
    let mut room = 100;
    for (n, stream) in [false, true].into_iter().enumerate() {
        let client = client_body(
            ROUTES[0],
            "a leg that will be cancelled while it waits",
            stream,
            4,
        );
        // P waits for D's registration; its router hangs up.
        room += 1;
        let leg = open_leg(p.http_addr(), ROUTES[0], &with_room(&client, &p, room)).await;
        wait_metric(&p, PENDING_P, 1.0).await;
        drop(leg);
        wait_metric(&p, cancelled_p, n as f64 + 1.0).await;
        wait_metric(&p, PENDING_P, 0.0).await;
        // A D that registers for that room now fails at once instead of waiting.
        let started = Instant::now();
        let (status, error) = call(&d, ROUTES[0], &with_room(&client, &p, room), None).await;
        if stream {
            assert!(
                error.as_str().is_some_and(|t| t.contains("\"error\"")),
                "{error}"
            );
        } else {
            assert_eq!(status, 500, "{error}");
        }
        assert!(started.elapsed() < Duration::from_secs(5));

        // D registered and waits for P's push; its router hangs up.
        room += 1;
        let leg = open_leg(d.http_addr(), ROUTES[0], &with_room(&client, &p, room)).await;
        wait_metric(&p, REGISTRATIONS, 1.0).await;
        assert_eq!(metric(&d, PENDING_D).await, 1.0);
        assert_eq!(metric(&d, "switchyard_engine_reservations").await, 1.0);
        drop(leg);
        wait_metric(&d, cancelled_d, n as f64 + 1.0).await;
        wait_metric(&d, PENDING_D, 0.0).await;
        wait_metric(&d, "switchyard_engine_reservations", 0.0).await;
        // The long poll closed with D's handler, and P's bootstrap server let the room go.
        wait_metric(&p, REGISTRATIONS, 0.0).await;
    }
    wait_metric(&d, "switchyard_engine_kv_pages_used", 0.0).await;
    wait_metric(&p, "switchyard_engine_kv_pages_used", 0.0).await;
}

#[test]
fn protocol_flags_must_fit_together() {
    for flags in [
        &["--disaggregation-mode", "prefill"][..],
        &["--protocol", "sglang", "--disaggregation-mode", "prefill"],
        &["--protocol", "vllm", "--bootstrap-port", "1"],
        &[
            "--protocol",
            "sglang",
            "--disaggregation-mode",
            "decode",
            "--bootstrap-port",
            "1",
        ],
    ] {
        let args = EngineArgs::from_flags(["--port", "0"].iter().chain(flags)).expect("parses");
        let err = args.check_protocol().expect_err(&format!("{flags:?}"));
        assert!(err.is_usage());
    }
}

/// The real model (SmolLM2, from the cache `make model` fills): its K/V per layer moves
/// between the engines, and its chat template renders the messages; the batch-invariant
/// forward pass makes a disaggregated answer bit-identical to a single engine's only if every
/// moved slot is right.
#[tokio::test]
async fn smollm2_pd_over_both_protocols_gives_the_single_engine_output() {
    let model = ["--model", "smollm2", "--threads", "1"];
    let flags = |extra: &[&'static str]| -> Vec<&'static str> {
        model.iter().chain(extra).copied().collect()
    };
    let vp = engine(&flags(&["--protocol", "vllm"])).await;
    let vd = engine(&flags(&["--protocol", "vllm", "--device-rank", "1"])).await;
    let cases = [
        (ROUTES[0], "The capital of France is", false),
        (ROUTES[1], "Name three colours of the rainbow.", true),
    ];
    let mut expected = Vec::new();
    for (i, (path, prompt, stream)) in cases.into_iter().enumerate() {
        let client = client_body(path, prompt, stream, 8);
        // P serves a plain request whole: the single-engine answer.
        let (status, direct) = call(&vp, path, &client, None).await;
        assert_eq!(status, 200, "{direct}");
        let direct = output(&direct);
        assert_eq!(direct.ids.len(), 8, "{direct:?}");
        let id = format!("smol-{i}");
        let (status, answer) = call(&vp, path, &vllm_p_body(&client), Some(&id)).await;
        assert_eq!(status, 200, "{answer}");
        let params = &answer["kv_transfer_params"];
        let (status, decoded) = call(&vd, path, &with_params(&client, params), Some(&id)).await;
        assert_eq!(status, 200, "{decoded}");
        assert_eq!(output(&decoded), direct, "vllm {path}");
        expected.push((client, direct));
    }
    drop((vp, vd));
    let sp = sglang_prefill(&flags(&[])).await;
    let sd = engine(&flags(&[
        "--protocol",
        "sglang",
        "--disaggregation-mode",
        "decode",
        "--device-rank",
        "1",
    ]))
    .await;
    for (room, ((client, direct), (path, ..))) in expected.iter().zip(cases).enumerate() {
        let body = with_room(client, &sp, room as u64);
        let (prefilled, decoded) =
            tokio::join!(call(&sp, path, &body, None), call(&sd, path, &body, None));
        assert_eq!(
            (prefilled.0, decoded.0),
            (200, 200),
            "{} {}",
            prefilled.1,
            decoded.1
        );
        assert_eq!(&output(&decoded.1), direct, "sglang {path}");
    }
}
