//! The router in front of reference engines, all separate processes on loopback: routed
//! output equals a single engine's, for every policy and knob; preempted streams continue
//! seamlessly; a dead decode engine is routed around; bad input gets OpenAI errors; and the
//! bodies the router sends carry exactly the spec's fields.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};

use crate::http::{client, json_body, post, post_json, serve_loopback, sse_payloads};

/// What a client read from an SSE response.
struct Streamed {
    text: String,
    finish: String,
    usage: Option<Value>,
    /// Every chunk, `[DONE]` excluded.
    chunks: Vec<Value>,
}

/// Stream `body` from `url`: the stream must end with `[DONE]`, carry no error event, and every
/// chunk must be an `object`; each choice's text is at the JSON pointer `text_at`.
async fn stream_text(url: &str, body: &Value, object: &str, text_at: &str) -> Streamed {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = post(url, &body).await;
    assert_eq!(status, 200, "{text}");
    let payloads = sse_payloads(&text);
    assert_eq!(
        payloads.last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    let mut streamed = Streamed {
        text: String::new(),
        finish: String::new(),
        usage: None,
        chunks: Vec::new(),
    };
    for p in &payloads[..payloads.len() - 1] {
        let chunk: Value = serde_json::from_str(p).expect("chunk JSON");
        assert!(chunk.get("error").is_none(), "error event: {chunk}");
        assert_eq!(chunk["object"], object);
        if let Some(choice) = chunk["choices"].get(0) {
            let delta = choice.pointer(text_at).and_then(Value::as_str);
            streamed.text.push_str(delta.unwrap_or_default());
            if let Some(f) = choice["finish_reason"].as_str() {
                streamed.finish = f.to_owned();
            }
        }
        if !chunk["usage"].is_null() {
            streamed.usage = Some(chunk["usage"].clone());
        }
        streamed.chunks.push(chunk);
    }
    streamed
}

/// Streamed text, finish reason and usage of a completion.
async fn stream_completion(url: &str, body: &Value) -> (String, String, Option<Value>) {
    let s = stream_text(url, body, "text_completion", "/text").await;
    (s.text, s.finish, s.usage)
}

/// Random ASCII prompts and lengths from a fixed seed.
pub(crate) fn prompts(seed: u64, n: usize) -> Vec<(String, u32)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let words = [
        "kv", "cache", "prefill", "decode", "router", "token", "engine", "page", "slot", "wasm",
    ];
    (0..n)
        .map(|_| {
            let len = rng.random_range(1..60);
            let prompt: Vec<&str> = (0..len)
                .map(|_| words[rng.random_range(0..words.len())])
                .collect();
            (prompt.join(" "), rng.random_range(1..40))
        })
        .collect()
}

/// A single engine's own `/v1/completions` answer: the ground truth.
pub(crate) async fn reference(
    engine: &EngineProcess,
    prompt: &str,
    max_tokens: u32,
) -> (String, String) {
    let r = post_json(
        &engine.endpoint("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": max_tokens}),
    )
    .await;
    let choice = &r["choices"][0];
    (
        choice["text"].as_str().expect("text").to_owned(),
        choice["finish_reason"].as_str().expect("finish").to_owned(),
    )
}

/// Every prompt, streamed and not, through the router equals the reference engine's output,
/// and the usage adds up.
async fn assert_router_matches(router: &str, truth: &EngineProcess, seed: u64, n: usize) {
    let url = format!("{router}/v1/completions");
    for (prompt, max_tokens) in prompts(seed, n) {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens});
        assert_completion_matches(&url, truth, &body).await;
    }
}

/// `body` (with a string `prompt` and `max_tokens`, plus whatever else the caller adds), posted
/// to `url` streamed and not, gets the reference engine's output, and the usage adds up.
pub(crate) async fn assert_completion_matches(url: &str, truth: &EngineProcess, body: &Value) {
    let prompt = body["prompt"].as_str().expect("a string prompt");
    let max_tokens = body["max_tokens"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .expect("max_tokens");
    let (expected, expected_finish) = reference(truth, prompt, max_tokens).await;
    let r = post_json(url, body).await;
    let id = r["id"].as_str().expect("id");
    assert!(id.starts_with("cmpl-") && id.len() == 5 + 32, "{id}");
    assert_eq!(
        r["choices"][0]["text"], expected,
        "non-stream, prompt {prompt:?}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], expected_finish);
    let usage = &r["usage"];
    assert_eq!(usage["prompt_tokens"], prompt.len(), "{r}");
    assert_eq!(usage["completion_tokens"], expected.len(), "{r}");
    let (text, finish, usage) = stream_completion(url, body).await;
    assert_eq!(text, expected, "stream, prompt {prompt:?}");
    assert_eq!(finish, expected_finish);
    let usage = usage.expect("a usage chunk");
    assert_eq!(usage["completion_tokens"], expected.len());
    assert_eq!(usage["total_tokens"], prompt.len() + expected.len());
}

/// Prefill engine (rank 0) and `decodes` decode engines (ranks 1..), P able to push KV to each,
/// behind `switchyard serve`.
pub(crate) struct Disagg {
    pub(crate) engines: Vec<EngineProcess>,
    pub(crate) router: RouterProcess,
}

fn disagg(decodes: usize, engine_args: &[&str], router_args: &[&str]) -> Disagg {
    disagg_over("shm", &vec![&[][..]; decodes], engine_args, router_args)
}

/// [`disagg`] with KV moving over `transport` (`shm` or `tcp`), one decode engine per entry of
/// `decodes`, each with those flags added to `engine_args`.
pub(crate) fn disagg_over(
    transport: &str,
    decodes: &[&[&str]],
    engine_args: &[&str],
    router_args: &[&str],
) -> Disagg {
    let engines = engines_over(transport, decodes, engine_args);
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let router = RouterProcess::serve(&urls, router_args);
    Disagg { engines, router }
}

/// A prefill engine (rank 0, first) and one decode engine per entry of `decodes` (ranks 1..),
/// P able to push KV to each over `transport`.
pub(crate) fn engines_over(
    transport: &str,
    decodes: &[&[&str]],
    engine_args: &[&str],
) -> Vec<EngineProcess> {
    let mut engines = Vec::new();
    let mut peers = Vec::new();
    for (rank, own) in (1..).zip(decodes) {
        let mut args = vec![
            "--device-rank".to_owned(),
            rank.to_string(),
            "--kv-transport".into(),
            transport.into(),
        ];
        args.extend(
            engine_args
                .iter()
                .chain(own.iter())
                .map(|a| (*a).to_owned()),
        );
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let d = EngineProcess::spawn(&refs);
        peers.push(format!("{rank}={}", d.kv_addr));
        engines.push(d);
    }
    let mut args = vec![
        "--device-rank".to_owned(),
        "0".into(),
        "--kv-transport".into(),
        transport.into(),
    ];
    for peer in &peers {
        args.push("--kv-peer".into());
        args.push(peer.clone());
    }
    args.extend(engine_args.iter().map(|a| (*a).to_owned()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    engines.insert(0, EngineProcess::spawn(&refs));
    engines
}

pub(crate) async fn metric(url: &str, name: &str) -> f64 {
    let text = client()
        .get(url)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    // `name`'s samples (a counter's carry `_total`) summed over their label sets, or those whose
    // labels start as `name{…` says; never another metric whose name merely starts the same
    // (`…_reservations` vs `…_reservations_expired_total`).
    let total = format!("{name}_total");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| match name.contains('{') {
            true => l.starts_with(name),
            false => {
                let sample = l.split(['{', ' ']).next().unwrap_or_default();
                sample == name || sample == total
            }
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_disaggregated_output_equals_a_single_engine() {
    let truth = EngineProcess::spawn(&[]);
    let up = RouterProcess::up(&[]);
    assert_router_matches(&up.url, &truth, 1, 10).await;
    let endpoints = post_or_get(&up.endpoint("/admin/endpoints")).await;
    let roles: Vec<_> = endpoints["endpoints"]
        .as_array()
        .expect("list")
        .iter()
        .map(|e| e["role"].clone())
        .collect();
    assert_eq!(roles, [json!("prefill"), json!("decode"), json!("decode")]);
    assert_eq!(
        up.terminate().map(|s| s.success()),
        Some(true),
        "clean exit on SIGTERM"
    );
}

/// `make run`'s default: SmolLM2 (`make model`) on 1 prefill + 1 decode engine, with the
/// GGUF's tokenizer and chat template in the router. The chat line `up` prints answers in
/// English, and streaming it gives the same text in chunks that never split a character. (The
/// line sets a system message: under the template's default one, SmolLM2-135M rambles.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_the_real_model_answers_its_banner_question() {
    let up = RouterProcess::up(&["--model", "smollm2", "--prefill", "1", "--decode", "1"]);
    let models = post_or_get(&up.endpoint("/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct", "{models}");
    // The GGUF's context length, which the router now enforces itself.
    assert_eq!(models["data"][0]["max_model_len"], 8192, "{models}");
    let mut body = json!({
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "max_tokens": 32,
    });
    let answer = post_json(&up.endpoint("/v1/chat/completions"), &body).await;
    let text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("{answer}"))
        .to_owned();
    assert!(text.contains("Paris"), "{text:?}");
    body["stream"] = json!(true);
    let (status, streamed) = post(&up.endpoint("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{streamed}");
    let mut joined = String::new();
    for payload in sse_payloads(&streamed) {
        if payload == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&payload).expect("chunk JSON");
        if let Some(delta) = chunk["choices"][0]["delta"]["content"].as_str() {
            assert!(!delta.contains('\u{FFFD}'), "{delta:?}");
            joined.push_str(delta);
        }
    }
    assert_eq!(joined, text);
    // A request over the model's 8192 tokens: refused by the router, OpenAI's way.
    let long = json!({"prompt": vec![504u32; 8100], "max_tokens": 100});
    let (status, refused) = post(&up.endpoint("/v1/completions"), &long).await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused.contains("maximum context length is 8192 tokens"),
        "{refused}"
    );
}

/// Preemption on the real model with its BPE tokenizer: every second decoding request is cut
/// half-way and the router continues it, so the client gets exactly the uninterrupted
/// single-engine text, and a usage counting the engine's tokens. The router continues from the
/// token ids the engine sent with its text (`return_token_ids`), never from the text
/// re-tokenized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_preempted_streams_continue_seamlessly() {
    let texts = real_model_preempted(&[]).await;
    for (prompt, got, expected) in texts {
        assert_eq!(got, expected, "{prompt:?}");
    }
}

/// The same with engines that, like MLC-LLM's, ignore `return_token_ids`: the router can only
/// continue from the delivered text re-tokenized, which on a BPE tokenizer may not be the ids
/// the engine generated, so the text after the cut may differ from the uninterrupted run's.
/// What stays exact is the count: the router counts the engine's `logprobs` entries, so every
/// answer stops at `max_tokens` tokens generated and says so in its usage, and the text before
/// the cut is the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_preempted_streams_without_ids_count_the_engines_tokens() {
    let texts = real_model_preempted(&["--engine-arg=--ignore-return-token-ids"]).await;
    let differ = texts
        .iter()
        .filter(|(_, got, expected)| got != expected)
        .count();
    println!(
        "{differ} of {} continued texts differ from the uninterrupted run",
        texts.len()
    );
}

/// Sends a few prompts (16 tokens each) through `switchyard up` on the real model, 1P + 1D,
/// with every second decoding request preempted half-way, and checks each answer's usage
/// against a single engine's (and that preemptions happened). Returns (prompt, router's
/// text, single engine's text).
async fn real_model_preempted(extra: &[&str]) -> Vec<(&'static str, String, String)> {
    let truth = EngineProcess::spawn(&["--model", "smollm2", "--threads", "1"]);
    let mut args = vec![
        "--model",
        "smollm2",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--engine-arg=--preempt-every=2",
    ];
    args.extend_from_slice(extra);
    let up = RouterProcess::up(&args);
    let mut texts = Vec::new();
    for prompt in [
        "Once upon a time, in a small village by the sea,",
        "The three primary colours are",
        "def fibonacci(n):",
        "Le café de la gare était",
    ] {
        let body = json!({"prompt": prompt, "max_tokens": 16});
        let expected = post_json(&truth.endpoint("/v1/completions"), &body).await;
        let got = post_json(&up.endpoint("/v1/completions"), &body).await;
        assert_eq!(
            got["usage"]["completion_tokens"], expected["usage"]["completion_tokens"],
            "{prompt:?}: {got}"
        );
        assert_eq!(
            got["choices"][0]["finish_reason"], expected["choices"][0]["finish_reason"],
            "{prompt:?}: {got}"
        );
        let text = |v: &Value| v["choices"][0]["text"].as_str().expect("text").to_owned();
        let (got, expected) = (text(&got), text(&expected));
        // Preempted half-way (8 of 16 tokens): the first token's text at least is the engine's.
        let common = got
            .chars()
            .zip(expected.chars())
            .take_while(|(a, b)| a == b)
            .count();
        assert!(common > 0, "{prompt:?}: {got:?} against {expected:?}");
        texts.push((prompt, got, expected));
    }
    let metrics = client()
        .get(up.endpoint("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("preempt") && !l.starts_with('#') && !l.ends_with(" 0")),
        "some request was preempted:\n{metrics}"
    );
    texts
}

/// The real model behind `switchyard serve`: P and two decode engines (tcp KV), the router
/// tokenizing with the GGUF's own tokenizer (`--model-dir` names the GGUF). A decode engine killed mid-stream: the stream
/// continues on the other from the ids already delivered, and the client gets exactly the
/// uninterrupted single-engine text with a usage counting the engine's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_streams_continue_exactly_when_their_decode_engine_is_killed() {
    let gguf = switchyard_wire::gguf::smollm2_path().expect("the model is fetched: make model");
    let real = ["--model", "smollm2", "--threads", "1"];
    let truth = EngineProcess::spawn(&real);
    let gguf = gguf.to_str().expect("UTF-8 cache path");
    let mut c = disagg_over("tcp", &[&[], &[]], &real, &["--model-dir", gguf]);
    let prompt = "Write a short story about a lighthouse keeper who finds a letter:";
    let body = json!({"prompt": prompt, "max_tokens": 48});
    let expected = post_json(&truth.endpoint("/v1/completions"), &body).await;
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let (mut response, first) =
        open_stream(&c.router.endpoint("/v1/completions"), &stream_body).await;
    let mut received = first.to_vec();
    // Kill whichever decode engine is generating it.
    let generating = generating_decode(&c.router).await;
    c.engines[generating].kill();
    while let Some(chunk) = response.chunk().await.expect("the stream ends cleanly") {
        received.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(received).expect("UTF-8 SSE");
    let mut streamed = String::new();
    let mut usage = Value::Null;
    let payloads = sse_payloads(&text);
    assert_eq!(
        payloads.last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    for p in &payloads[..payloads.len() - 1] {
        let chunk: Value = serde_json::from_str(p).expect("chunk JSON");
        assert!(
            chunk.get("error").is_none(),
            "the stream continued: {chunk}"
        );
        if let Some(t) = chunk["choices"][0]["text"].as_str() {
            streamed.push_str(t);
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    assert_eq!(
        streamed,
        expected["choices"][0]["text"].as_str().expect("text")
    );
    assert_eq!(
        usage["completion_tokens"], expected["usage"]["completion_tokens"],
        "{usage}"
    );
    let retried = metric(&c.router.endpoint("/metrics"), "switchyard_retries").await;
    assert!(retried >= 1.0, "the stream was continued after the kill");
}

pub(crate) async fn post_or_get(url: &str) -> Value {
    let response = client().get(url).send().await.expect("reachable");
    assert_eq!(response.status(), 200);
    response.json().await.expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_balance_factor_and_round_robin_match_a_single_engine() {
    let truth = EngineProcess::spawn(&[]);
    let c = disagg(
        2,
        &[],
        &["--policy-config", r#"{"pd_balance_factor": 0.1}"#],
    );
    assert_router_matches(&c.router.url, &truth, 2, 8).await;
    let urls: Vec<&str> = c.engines.iter().map(|e| e.url.as_str()).collect();
    let rr = RouterProcess::serve(&urls, &["--policy", "round-robin"]);
    assert_router_matches(&rr.url, &truth, 3, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hits_skip_remote_send() {
    let truth = EngineProcess::spawn(&[]);
    let c = disagg(1, &["--prefix-cache", "--page-size", "4"], &[]);
    // 301 tokens: the KV window [0, 300) is whole pages, so a cache hit covers all of it.
    let prompt = format!("{}x", "prefill decode ".repeat(20));
    let url = c.router.endpoint("/v1/completions");
    let body = json!({"prompt": prompt, "max_tokens": 8});
    let (expected, _) = reference(&truth, &prompt, 8).await;
    for _ in 0..3 {
        assert_eq!(post_json(&url, &body).await["choices"][0]["text"], expected);
    }
    let p_metrics = c.engines[0].endpoint("/metrics");
    let sends = metric(&p_metrics, "switchyard_engine_remote_send_received").await;
    assert_eq!(sends, 1.0, "only the first request moves KV");
    let skipped = metric(
        &c.router.endpoint("/metrics"),
        "switchyard_remote_sends_skipped",
    )
    .await;
    assert_eq!(skipped, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_streams_continue_seamlessly() {
    let truth = EngineProcess::spawn(&[]);
    let c = disagg(2, &["--preempt-every", "2"], &[]);
    let url = c.router.endpoint("/v1/completions");
    for (prompt, max_tokens) in prompts(4, 12) {
        let max_tokens = max_tokens.max(4);
        let (expected, finish) = reference(&truth, &prompt, max_tokens).await;
        let body = json!({"prompt": prompt, "max_tokens": max_tokens});
        let (text, got_finish, usage) = stream_completion(&url, &body).await;
        assert_eq!(text, expected, "no duplication, no gap: prompt {prompt:?}");
        assert_eq!(got_finish, finish);
        let usage = usage.expect("usage");
        assert_eq!(usage["prompt_tokens"], prompt.len());
        assert_eq!(usage["completion_tokens"], expected.len());
        let r = post_json(&url, &body).await;
        assert_eq!(r["choices"][0]["text"], expected);
        assert_eq!(r["usage"]["completion_tokens"], expected.len());
    }
    let preemptions = metric(&c.router.endpoint("/metrics"), "switchyard_preemptions").await;
    assert!(
        preemptions >= 1.0,
        "the engines preempted something ({preemptions})"
    );
    // Every preempted generation released its in-flight count.
    eventually(Duration::from_secs(10), || async {
        let in_flight = router_in_flight(&c.router).await;
        (in_flight != [0, 0, 0]).then(|| format!("router in-flight {in_flight:?}"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_engine_is_routed_around() {
    let truth = EngineProcess::spawn(&[]);
    let mut c = disagg(2, &[], &[]);
    drop(c.engines.remove(1)); // decode endpoint 1 dies
    let url = c.router.endpoint("/v1/completions");
    for (prompt, max_tokens) in prompts(5, 6) {
        let (expected, _) = reference(&truth, &prompt, max_tokens).await;
        let body = json!({"prompt": prompt, "max_tokens": max_tokens});
        let r = tokio::time::timeout(Duration::from_secs(30), post_json(&url, &body))
            .await
            .expect("nothing hangs");
        assert_eq!(r["choices"][0]["text"], expected);
        let (text, _, _) = stream_completion(&url, &body).await;
        assert_eq!(text, expected);
    }
    let endpoints = post_or_get(&c.router.endpoint("/admin/endpoints")).await;
    assert_eq!(endpoints["endpoints"][1]["healthy"], false);
    assert_eq!(
        endpoints["endpoints"][2]["in_flight"], 0,
        "no leaked in-flight count"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_and_the_router_stays_up() {
    let c = disagg(1, &[], &["--max-body-bytes", "4096"]);
    let url = c.router.endpoint("/v1/completions");
    let chat_url = c.router.endpoint("/v1/chat/completions");
    let completion_cases: &[(&str, Option<&str>)] = &[
        ("{not json", None),
        (r#"{"prompt": 42}"#, Some("prompt")),
        (r#"{"prompt": ""}"#, Some("prompt")),
        (r#"{"prompt": []}"#, Some("prompt")),
        (r#"{"prompt": "hi", "max_tokens": 0}"#, Some("max_tokens")),
        (
            r#"{"prompt": "hi", "max_tokens": "ten"}"#,
            Some("max_tokens"),
        ),
        (r#"{"prompt": "hi", "stream": "yes"}"#, Some("stream")),
        (r#"{"max_tokens": 3}"#, Some("prompt")),
    ];
    let chat_cases: &[(&str, Option<&str>)] = &[
        ("{not json", None),
        (r#"{"messages": "hi"}"#, Some("messages")),
        (r#"{"messages": []}"#, Some("messages")),
        (
            r#"{"messages": [{"content": "no role"}]}"#,
            Some("messages"),
        ),
        (
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#,
            Some("max_tokens"),
        ),
        (
            r#"{"messages": [{"role": "user", "content": "hi"}], "stream": 1}"#,
            Some("stream"),
        ),
    ];
    for (url, cases) in [(&url, completion_cases), (&chat_url, chat_cases)] {
        for (body, param) in cases {
            let (status, error) = post_raw(url, body).await;
            assert_eq!(status, 400, "{url} {body} -> {error}");
            assert_openai_error(&error, "invalid_request_error");
            assert_eq!(error["error"]["param"].as_str(), *param, "{url} {body}");
        }
    }
    let big = json!({"prompt": "x".repeat(8192)}).to_string();
    let (status, error) = post_raw(&url, &big).await;
    assert_eq!(status, 413, "{error}");
    assert_openai_error(&error, "invalid_request_error");
    let r = client()
        .get(c.router.endpoint("/v1/nothing"))
        .send()
        .await
        .expect("reachable");
    assert_eq!(r.status(), 404);
    assert_openai_error(
        &r.json().await.expect("error object"),
        "invalid_request_error",
    );
    // Still serving.
    let ok = post_json(&url, &json!({"prompt": "still here", "max_tokens": 3})).await;
    assert_eq!(ok["object"], "text_completion");
    let models = post_or_get(&c.router.endpoint("/v1/models")).await;
    assert_eq!(models["object"], "list");
}

/// POST `body` verbatim as JSON; the status and the (JSON) answer.
async fn post_raw(url: &str, body: &str) -> (u16, Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("reachable");
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON answer"))
}

/// `{"error": {"message", "type", "param", "code"}}`, every key present.
fn assert_openai_error(body: &Value, kind: &str) {
    let e = &body["error"];
    assert!(e["message"].is_string(), "{body}");
    assert_eq!(e["type"], kind, "{body}");
    assert!(e.get("param").is_some(), "{body}");
    assert!(e["code"].is_string(), "{body}");
}

// === chat ===

/// A model directory's own chat template (`tokenizer_config.json`), and what it renders for
/// [`chat_messages`].
const MODEL_DIR_TEMPLATE: &str = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}";
const MODEL_DIR_RENDERED: &str = "[SYSTEM] Be brief.\n[USER] kv cache prefill decode\n[ASSISTANT] ";
/// The documented default without a template: `<|role|>\ncontent\n` per message, then
/// `<|assistant|>\n`.
const DEFAULT_RENDERED: &str =
    "<|system|>\nBe brief.\n<|user|>\nkv cache prefill decode\n<|assistant|>\n";

fn chat_messages() -> Value {
    json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "kv cache prefill decode"},
    ])
}

/// A model directory with the reference engine's tokenizer and [`MODEL_DIR_TEMPLATE`].
fn model_dir_with_template() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("tokenizer.json"),
        switchyard_wire::tokenizer::BYTE_LEVEL_TOKENIZER_JSON,
    )
    .expect("write tokenizer.json");
    let config = json!({"chat_template": MODEL_DIR_TEMPLATE});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string())
        .expect("write tokenizer_config.json");
    dir
}

/// A chat completion through `router`, streamed and not, equals the reference engine's
/// completion of `rendered`, and the usage counts the rendered prompt.
async fn assert_chat_matches(router: &RouterProcess, truth: &EngineProcess, rendered: &str) {
    let max_tokens = 24;
    let (expected, expected_finish) = reference(truth, rendered, max_tokens).await;
    let url = router.endpoint("/v1/chat/completions");
    let body = json!({"messages": chat_messages(), "max_tokens": max_tokens});
    let r = post_json(&url, &body).await;
    assert!(
        r["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-")),
        "{r}"
    );
    assert_eq!(r["object"], "chat.completion");
    let choice = &r["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(
        choice["message"]["content"], expected,
        "rendered {rendered:?}"
    );
    assert_eq!(choice["finish_reason"], expected_finish);
    assert_eq!(r["usage"]["prompt_tokens"], rendered.len(), "{r}");
    assert_eq!(r["usage"]["completion_tokens"], expected.len(), "{r}");

    let s = stream_text(&url, &body, "chat.completion.chunk", "/delta/content").await;
    assert_eq!(
        s.chunks[0]["choices"][0]["delta"]["role"], "assistant",
        "the role chunk comes first"
    );
    assert_eq!(s.text, expected, "streamed, rendered {rendered:?}");
    assert_eq!(s.finish, expected_finish);
    let usage = s.usage.expect("a usage chunk");
    assert_eq!(usage["prompt_tokens"], rendered.len());
    assert_eq!(usage["completion_tokens"], expected.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_equal_a_single_engine_fed_the_rendered_prompt() {
    let truth = EngineProcess::spawn(&[]);
    let c = disagg(1, &[], &[]);
    assert_chat_matches(&c.router, &truth, DEFAULT_RENDERED).await;
    let model_dir = model_dir_with_template();
    let urls: Vec<&str> = c.engines.iter().map(|e| e.url.as_str()).collect();
    let dir = model_dir.path().to_str().expect("UTF-8 temp path");
    let templated = RouterProcess::serve(&urls, &["--model-dir", dir]);
    assert_chat_matches(&templated, &truth, MODEL_DIR_RENDERED).await;
}

// === cancellation ===

/// Polls `check` (which says what is still wrong, or `None`) until it passes, for at most
/// `within`.
pub(crate) async fn eventually<F, Fut>(within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let Some(wrong) = check().await else { return };
        assert!(
            tokio::time::Instant::now() < deadline,
            "still after {within:?}: {wrong}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The router's in-flight count per endpoint (`/admin/endpoints`).
/// The id of the decode engine generating the one stream in flight (endpoint 0 is P).
pub(crate) async fn generating_decode(router: &RouterProcess) -> usize {
    router_in_flight(router)
        .await
        .iter()
        .skip(1)
        .position(|&n| n > 0)
        .expect("a decode engine generates the stream")
        + 1
}

/// The id of the engine generating the one stream in flight, of engines that serve whole
/// requests.
pub(crate) async fn generating_engine(router: &RouterProcess) -> usize {
    router_in_flight(router)
        .await
        .iter()
        .position(|&n| n > 0)
        .expect("an engine generates the stream")
}

async fn router_in_flight(router: &RouterProcess) -> Vec<u64> {
    let endpoints = post_or_get(&router.endpoint("/admin/endpoints")).await;
    endpoints["endpoints"]
        .as_array()
        .expect("list")
        .iter()
        .map(|e| e["in_flight"].as_u64().expect("in_flight"))
        .collect()
}

const LONG_MAX_TOKENS: u32 = 4000;

/// A prompt whose generation runs at least `min_tokens` before the model stops by itself (the
/// reference model ends with EOS about once in 512 tokens), and how long it runs.
async fn long_running_prompt(truth: &EngineProcess, min_tokens: usize) -> (String, usize) {
    for i in 0..64 {
        let prompt = format!("{i}: prefill decode router");
        let (text, _) = reference(truth, &prompt, LONG_MAX_TOKENS).await;
        if text.len() >= min_tokens {
            return (prompt, text.len());
        }
    }
    panic!("no prompt in 64 generates {min_tokens} tokens before EOS");
}

/// The router's count of completion streams the client hung up on (status 499).
const CLIENT_CLOSED: &str = r#"switchyard_requests_total{route="/v1/completions",status="499"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_every_upstream_leg() {
    let truth = EngineProcess::spawn(&[]);
    let (prompt, natural_length) = long_running_prompt(&truth, 1000).await;
    // A real decode step (~5 ms): the generation would run for 5 s or more by itself.
    let c = disagg(1, &["--profile", "llama3-8b-h100"], &[]);
    let (p, d) = (&c.engines[0], &c.engines[1]);
    let body = json!({"prompt": prompt, "max_tokens": LONG_MAX_TOKENS, "stream": true});
    let (response, first) = open_stream(&c.router.endpoint("/v1/completions"), &body).await;
    assert!(first.starts_with(b"data: "), "{first:?}");

    // The generation is live on D and counted by the router. D's gauges are set at the end of
    // the step that produced the first token, which may be after the client read it.
    let d_metrics = d.endpoint("/metrics");
    eventually(Duration::from_secs(10), || async {
        let running = metric(&d_metrics, "switchyard_engine_running_requests").await;
        let used = metric(&d_metrics, "switchyard_engine_kv_pages_used").await;
        (running != 1.0 || used <= 0.0)
            .then(|| format!("D: {running} running, {used} KV pages used"))
    })
    .await;
    assert_eq!(router_in_flight(&c.router).await, [0, 1]);
    // The health probe reports D's KV usage to policies (one probe interval at most).
    eventually(Duration::from_secs(10), || async {
        let endpoints = post_or_get(&c.router.endpoint("/admin/endpoints")).await;
        let usage = endpoints["endpoints"][1]["kv_usage"].as_f64();
        (!usage.is_some_and(|u| u > 0.0 && u <= 1.0)).then(|| format!("D's kv_usage {usage:?}"))
    })
    .await;

    drop(response);
    eventually(Duration::from_secs(10), || async {
        let in_flight = router_in_flight(&c.router).await;
        if in_flight != [0, 0] {
            return Some(format!("router in-flight {in_flight:?}"));
        }
        let closed = metric(&c.router.endpoint("/metrics"), CLIENT_CLOSED).await;
        if closed != 1.0 {
            return Some(format!("{closed} streams counted as closed by the client"));
        }
        for (name, engine) in [("P", p), ("D", d)] {
            let m = engine.endpoint("/metrics");
            let running = metric(&m, "switchyard_engine_running_requests").await;
            let used = metric(&m, "switchyard_engine_kv_pages_used").await;
            if running != 0.0 || used != 0.0 {
                return Some(format!("{name}: {running} running, {used} KV pages used"));
            }
        }
        None
    })
    .await;
    let aborted = metric(&d_metrics, "switchyard_engine_requests_aborted").await;
    assert_eq!(
        aborted, 1.0,
        "D aborted the generation because the router hung up"
    );
    let generated = metric(&d_metrics, "switchyard_engine_generated_tokens").await;
    assert!(
        generated < natural_length as f64,
        "cancelled early, not run to the end: {generated}"
    );
}

/// A non-streaming client that gives up: the router counts it as 499 and the engine stops
/// generating for it, as for an abandoned stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_client_that_hangs_up_is_counted_and_cancelled() {
    let (prompt, _) = long_running_prompt(&EngineProcess::spawn(&[]), 1000).await;
    // A real decode step (~5 ms): the answer would take 5 s or more.
    let engine = EngineProcess::spawn(&["--profile", "llama3-8b-h100"]);
    let router = RouterProcess::serve(&[&engine.url], &["--policy", "round-robin"]);
    let engine_metrics = engine.endpoint("/metrics");
    let body = json!({"prompt": prompt, "max_tokens": LONG_MAX_TOKENS});
    let request = client()
        .post(router.endpoint("/v1/completions"))
        .json(&body)
        .send();
    // Hang up once the engine is generating for us.
    let hang_up = async {
        eventually(Duration::from_secs(10), || async {
            let running = metric(&engine_metrics, "switchyard_engine_running_requests").await;
            (running != 1.0).then(|| format!("{running} running on the engine"))
        })
        .await;
    };
    tokio::select! {
        answer = request => panic!("answered before the client hung up: {answer:?}"),
        () = hang_up => {}
    }
    eventually(Duration::from_secs(10), || async {
        let closed = metric(&router.endpoint("/metrics"), CLIENT_CLOSED).await;
        let running = metric(&engine_metrics, "switchyard_engine_running_requests").await;
        (closed != 1.0 || running != 0.0)
            .then(|| format!("{closed} counted as closed by the client, {running} running"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_cannot_continue_ends_with_an_error_event_then_done() {
    let (prompt, _) = long_running_prompt(&EngineProcess::spawn(&[]), 1000).await;
    // One engine, so nothing can take over when it dies mid-stream (5 s or more into it).
    let engine = EngineProcess::spawn(&["--profile", "llama3-8b-h100"]);
    let router = RouterProcess::serve(&[&engine.url], &["--policy", "round-robin"]);
    let body = json!({"prompt": prompt, "max_tokens": LONG_MAX_TOKENS, "stream": true});
    let (mut response, first) = open_stream(&router.endpoint("/v1/completions"), &body).await;
    let mut received = first.to_vec();
    drop(engine);
    let rest = tokio::time::timeout(Duration::from_secs(30), async {
        let mut rest = Vec::new();
        while let Some(chunk) = response.chunk().await.expect("the stream ends cleanly") {
            rest.extend_from_slice(&chunk);
        }
        rest
    })
    .await
    .expect("the stream ends: nothing hangs");
    received.extend_from_slice(&rest);
    let text = String::from_utf8(received).expect("UTF-8 SSE");
    let payloads = sse_payloads(&text);
    let n = payloads.len();
    assert!(n >= 3, "{text}");
    assert_eq!(payloads[n - 1], "[DONE]", "{text}");
    let error: Value = serde_json::from_str(&payloads[n - 2]).expect("error event JSON");
    assert_openai_error(&error, "server_error");
    for p in &payloads[..n - 2] {
        let chunk: Value = serde_json::from_str(p).expect("chunk JSON");
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
        assert!(
            chunk["choices"][0]["finish_reason"].is_null(),
            "no finish before the error: {chunk}"
        );
    }
}

/// A stream's response head is not sent ahead of its first token: the router commits the
/// response when the first event arrives (a request failing before any text gets a real
/// status), and the body's first frame leaves with the head. With engine steps of ~100 ms (a
/// real step ×20), a head committed early would reach a raw client alone, a prefill before the
/// token; here the first bytes it reads hold the head and a whole `data:` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_head_and_its_first_token_arrive_in_one_read() {
    use tokio::io::AsyncWriteExt as _;

    let engine = EngineProcess::spawn(&["--profile", "llama3-8b-h100", "--time-scale", "20"]);
    let router = RouterProcess::serve(&[&engine.url], &["--policy", "round-robin"]);
    let body = json!({"prompt": "head and first token", "max_tokens": 3, "stream": true});
    let body = body.to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(router.addr)
        .await
        .expect("router reachable");
    stream.write_all(request.as_bytes()).await.expect("send");

    let mut received = Vec::new();
    read_some(&mut stream, &mut received).await;
    let first = String::from_utf8_lossy(&received).into_owned();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    let (_, after_head) = first.split_once("\r\n\r\n").expect("the whole head");
    let event = after_head
        .find("data: {")
        .expect("a data event with the head");
    assert!(
        after_head[event..].contains("\n\n"),
        "the first read ends inside the first event: {first}"
    );
    // The rest of the stream, to its end: the request finishes rather than being abandoned.
    while !String::from_utf8_lossy(&received).contains("data: [DONE]") {
        let n = read_some(&mut stream, &mut received).await;
        assert!(n > 0, "closed before [DONE]");
    }
}

/// One read of `stream` (within 30 s) appended to `buf`: how many bytes it brought.
async fn read_some(stream: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> usize {
    use tokio::io::AsyncReadExt as _;

    let mut chunk = [0u8; 16 << 10];
    let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut chunk))
        .await
        .expect("bytes within 30 s")
        .expect("read");
    buf.extend_from_slice(&chunk[..n]);
    n
}

// === a recording mock engine ===

type Log = Arc<Mutex<Vec<(String, Value)>>>;

const KV_META: &str = "CwAAAAAAAABbMSw0MDk2LDYzXQ==";

/// A tiny engine that records every body and answers as the spec says.
async fn mock_engine(log: Log) -> String {
    mock_engine_requiring(log, None).await
}

/// [`mock_engine`] started with an API key: every request without `Authorization: Bearer
/// KEY`, probes included, gets 401 and is logged under the path `401 <path>`.
async fn mock_engine_requiring(log: Log, key: Option<&'static str>) -> String {
    serve_loopback(move |req| {
        let log = log.clone();
        async move {
            let path = req.uri().path().to_owned();
            let auth = req.headers().get("authorization").cloned();
            if let Some(key) = key
                && auth.as_ref().and_then(|a| a.to_str().ok())
                    != Some(format!("Bearer {key}").as_str())
            {
                log.lock()
                    .expect("log")
                    .push((format!("401 {path}"), Value::Null));
                return hyper::Response::builder()
                    .status(401)
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .expect("response");
            }
            let body = json_body(req).await;
            let (content_type, answer) = mock_answer(&path, &body);
            // Health and KV-usage probes are not legs of a request.
            if !matches!(path.as_str(), "/v1/models" | "/metrics") {
                log.lock().expect("log").push((path, body));
            }
            hyper::Response::builder()
                .header("content-type", content_type)
                .body(Full::new(Bytes::from(answer)))
                .expect("response")
        }
    })
    .await
}

fn mock_answer(path: &str, body: &Value) -> (&'static str, String) {
    match path {
        "/v1/models" => (
            "application/json",
            json!({"object": "list", "data": []}).to_string(),
        ),
        "/microserving/prep_recv" => (
            "application/json",
            json!({"kv_append_metadata": KV_META, "prefix_matched_length": 0}).to_string(),
        ),
        "/microserving/remote_send" => ("application/json", "{}".to_owned()),
        _ => {
            let user = body["user"].as_str().unwrap_or_default();
            let chunk = json!({"id": user, "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": null}], "usage": null});
            let usage = json!({"id": user, "object": "text_completion", "created": 0, "model": "m", "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "extra": null}});
            (
                "text/event-stream",
                format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n"),
            )
        }
    }
}

/// The request bodies of MLC's disaggregated flow by path
/// (`tests/fixtures/microserving/03_disaggregated_flow.json`, from the spec).
fn mlc_disaggregated_flow() -> std::collections::BTreeMap<String, Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/microserving/03_disaggregated_flow.json");
    let text = std::fs::read_to_string(&path).expect("the golden fixture");
    let fixture: Value = serde_json::from_str(&text).expect("fixture JSON");
    fixture["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|step| {
            let path = step["path"].as_str().expect("path").to_owned();
            (path, step["request"].clone())
        })
        .collect()
}

fn keys(body: &Value) -> BTreeSet<String> {
    body.as_object()
        .expect("object body")
        .keys()
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_with_api_keys_get_theirs_on_every_call_and_nobody_sees_them() {
    let log: Log = Arc::default();
    let p = mock_engine_requiring(log.clone(), Some("sk-prefill")).await;
    let d = mock_engine_requiring(log.clone(), Some("sk-decode")).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("router.toml");
    std::fs::write(
        &config,
        format!(
            "[[endpoints]]\nurl = \"{p}\"\nrole = \"prefill\"\napi_key = \"sk-prefill\"\n\
             [[endpoints]]\nurl = \"{d}\"\nrole = \"decode\"\n\
             api_key = {{ env = \"SWITCHYARD_TEST_DECODE_KEY\" }}\n"
        ),
    )
    .expect("write the config");
    let router = tokio::task::spawn_blocking(move || {
        let config = config.display().to_string();
        let env = [("SWITCHYARD_TEST_DECODE_KEY", Path::new("sk-decode"))];
        RouterProcess::serve_listening(&[], &["--config", &config], &env)
    })
    .await
    .expect("router starts");
    // Ready only once both probes were let in: they carry the keys too.
    eventually(Duration::from_secs(30), || async {
        let status = client()
            .get(router.endpoint("/health"))
            .send()
            .await
            .map(|r| r.status().as_u16());
        (status.as_ref().ok() != Some(&200)).then(|| format!("/health: {status:?}"))
    })
    .await;
    for stream in [false, true] {
        let (status, text) = post(
            &router.endpoint("/v1/completions"),
            &json!({"prompt": "abcdef", "max_tokens": 5, "stream": stream}),
        )
        .await;
        assert_eq!(status, 200, "{text}");
    }
    let log = log.lock().expect("log").clone();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert!(!paths.iter().any(|p| p.starts_with("401")), "{paths:?}");
    assert_eq!(paths.len(), 6, "three legs per request: {paths:?}");
    // The admin API does not show them, and will not read one from the router's environment
    // for an endpoint of the caller's choosing.
    let rows = post_or_get(&router.endpoint("/admin/endpoints")).await;
    assert!(!rows.to_string().contains("sk-"), "{rows}");
    let (status, text) = post(
        &router.endpoint("/admin/endpoints"),
        &json!({"url": "http://127.0.0.1:9", "api_key": {"env": "SWITCHYARD_TEST_DECODE_KEY"}}),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    let (status, text) = post(
        &router.endpoint("/admin/endpoints"),
        &json!({"url": "http://127.0.0.1:9", "api_key": "sk-given"}),
    )
    .await;
    assert_eq!(status, 201, "{text}");
    assert!(!text.contains("sk-"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_leg_carries_exactly_the_spec_fields() {
    let log: Log = Arc::default();
    let p = mock_engine(log.clone()).await;
    let d = mock_engine(log.clone()).await;
    let router = tokio::task::spawn_blocking(move || {
        RouterProcess::serve(
            &[&p, &d],
            &["--endpoint-num-gpus", "2", "--endpoint-num-gpus", "1"],
        )
    })
    .await
    .expect("router starts");
    let r = post_json(
        &router.endpoint("/v1/completions"),
        &json!({"prompt": "abcdef", "max_tokens": 5, "temperature": 0.0}),
    )
    .await;
    assert_eq!(r["choices"][0]["text"], "ok");
    let log = log.lock().expect("log").clone();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/microserving/prep_recv",
            "/microserving/remote_send",
            "/microserving/start_generate"
        ]
    );
    // Exactly the fields MLC's router sends on each leg, as the golden fixture records them.
    let mlc = mlc_disaggregated_flow();
    let (prep, send, generate) = (&log[0].1, &log[1].1, &log[2].1);
    for (path, body) in [
        ("/microserving/prep_recv", prep),
        ("/microserving/remote_send", send),
        ("/microserving/start_generate", generate),
    ] {
        let expected = mlc.get(path).expect("the fixture has every leg");
        let mut expected_keys = keys(expected);
        // Every leg also asks for the generated ids (continuation resumes from them; MLC's
        // pydantic request models ignore unknown fields) and for `logprobs`, which MLC's
        // engines answer with one entry per generated token: the count a continuation keeps
        // exact without ids. Every leg, because MLC keeps the parameters prep_recv brought.
        expected_keys.insert("return_token_ids".into());
        assert_eq!(body["return_token_ids"], true, "{path}");
        assert_eq!(body["logprobs"], true, "{path}");
        assert_eq!(keys(body), expected_keys, "{path}");
        for field in ["n", "echo", "debug_config", "suffix"] {
            assert_eq!(body[field], expected[field], "{path} {field}");
        }
    }
    assert_eq!(
        prep["end"], 5,
        "the resolved KV window end (python -1 on a 6-token prompt)"
    );
    for body in [prep, send, generate] {
        assert_eq!(body["debug_config"], json!({}));
        assert_eq!(body["prompt"], json!([97, 98, 99, 100, 101, 102]));
        assert_eq!(body["user"], prep["user"], "one upstream id on every leg");
        assert_eq!(body["n"], 1);
        assert_eq!(body["temperature"], 0.0);
    }
    let user = prep["user"].as_str().expect("user");
    assert!(
        user.starts_with("cmpl-") && user.ends_with("-1") && user.len() == 5 + 32 + 2,
        "{user}"
    );
    assert_eq!(send["kv_addr_info"], KV_META, "D's metadata, verbatim");
    assert_eq!(
        send["recv_rank"], 2,
        "D's device rank: the prefix sum of GPUs before it"
    );
    assert_eq!(
        (send["begin"].clone(), send["end"].clone()),
        (json!(0), json!(5))
    );
    assert_eq!(generate["begin"], 5);
}

/// POST a streaming `body` to `url`; the 200 response, still open, and its first chunk.
pub(crate) async fn open_stream(url: &str, body: &Value) -> (reqwest::Response, Bytes) {
    let mut response = client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("router reachable");
    assert_eq!(response.status(), 200);
    let first = response
        .chunk()
        .await
        .expect("body")
        .expect("a first chunk");
    (response, first)
}
