//! Continuation on vLLM and SGLang pairs: a decode engine killed mid-stream, and the stream
//! goes on through another pair from exactly the tokens already delivered (the router asks the
//! streamed legs for `return_token_ids` and continues with the prompt plus those ids as a
//! token-id prompt on `/v1/completions`), so the client gets the uninterrupted single-engine
//! text. SGLang refuses `return_token_ids` on streamed chat: there the router re-tokenizes the
//! delivered text, exact with a tokenizer for which that is the identity (the reference
//! engine's byte-level one) and bounded otherwise (see the book: docs/src/engines.md,
//! "Continuation"). The same holds for a plain forward through a policy that reads nothing
//! (round-robin), whose prompt the router tokenizes only when it must continue it.

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, free_port};

use crate::faults::{SLOW, wait_health};
use crate::http::{post_json, sse_payloads};
use crate::router::{generating_decode, generating_engine, metric, open_stream};

/// A prefill engine and two decode engines speaking `protocol` (tcp KV, P able to push to
/// both), behind a router. Engines in router order: P, D1, D2.
fn pair_with_spare(protocol: &str) -> (Vec<EngineProcess>, RouterProcess) {
    let common = ["--protocol", protocol, "--kv-transport", "tcp"];
    let decode_mode: &[&str] = match protocol {
        "sglang" => &["--disaggregation-mode", "decode"],
        _ => &[],
    };
    let mut decodes = Vec::new();
    for rank in [1u32, 2] {
        let rank = rank.to_string();
        let mut args: Vec<&str> = vec!["--device-rank", &rank];
        args.extend(common);
        args.extend(decode_mode);
        args.extend(SLOW);
        decodes.push(EngineProcess::spawn(&args));
    }
    let bootstrap = free_port().to_string();
    let peers: Vec<String> = decodes
        .iter()
        .map(|d| format!("{}={}", d.device_rank, d.kv_addr))
        .collect();
    let mut args: Vec<&str> = vec!["--device-rank", "0"];
    args.extend(common);
    for peer in &peers {
        args.extend(["--kv-peer", peer]);
    }
    if protocol == "sglang" {
        args.extend([
            "--disaggregation-mode",
            "prefill",
            "--bootstrap-port",
            &bootstrap,
        ]);
    }
    args.extend(SLOW);
    let prefill = EngineProcess::spawn(&args);
    let mut flags = vec![match protocol {
        "sglang" => format!(
            "sglang+{},role=prefill,bootstrap_port={bootstrap}",
            prefill.url
        ),
        _ => format!("{protocol}+{},role=prefill", prefill.url),
    }];
    flags.extend(
        decodes
            .iter()
            .map(|d| format!("{protocol}+{},role=decode", d.url)),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let router = RouterProcess::serve(&flags, &[]);
    let mut engines = vec![prefill];
    engines.extend(decodes);
    (engines, router)
}

/// The text and usage of a streamed answer, which must end with `[DONE]` and no error event.
fn streamed_text(sse: &str, chat: bool) -> (String, Value) {
    let payloads = sse_payloads(sse);
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"), "{sse}");
    let mut text = String::new();
    let mut usage = Value::Null;
    for p in &payloads[..payloads.len() - 1] {
        let chunk: Value = serde_json::from_str(p).expect("chunk JSON");
        assert!(
            chunk.get("error").is_none(),
            "the stream continued: {chunk}"
        );
        let choice = &chunk["choices"][0];
        let piece = if chat {
            choice["delta"]["content"].as_str()
        } else {
            choice["text"].as_str()
        };
        text.push_str(piece.unwrap_or_default());
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    (text, usage)
}

/// Whether the complete events in `sse` carry any text.
fn has_text(sse: &[u8], chat: bool) -> bool {
    let sse = String::from_utf8_lossy(sse);
    let complete = &sse[..sse.rfind("\n\n").map_or(0, |i| i + 2)];
    sse_payloads(complete)
        .iter()
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .any(|chunk| {
            let choice = &chunk["choices"][0];
            let text = if chat {
                &choice["delta"]["content"]
            } else {
                &choice["text"]
            };
            text.as_str().is_some_and(|t| !t.is_empty())
        })
}

/// Two plain engines speaking `protocol` behind round-robin, which reads nothing: a forward
/// sends the client's body, and nothing tokenizes the prompt until a stream must be continued.
fn two_behind_round_robin(protocol: &str) -> (Vec<EngineProcess>, RouterProcess) {
    let mut args = vec!["--protocol", protocol];
    args.extend(SLOW);
    let engines = vec![EngineProcess::spawn(&args), EngineProcess::spawn(&args)];
    let endpoints: Vec<String> = engines
        .iter()
        .map(|e| format!("{protocol}+{}", e.url))
        .collect();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let router = RouterProcess::serve(&endpoints, &["--policy", "round-robin"]);
    (engines, router)
}

/// How the engines are set up behind the router, and so which one generates a stream.
#[derive(Clone, Copy)]
enum Setup {
    /// A prefill engine and two decode engines ([`pair_with_spare`]).
    Disaggregated,
    /// Two plain engines ([`two_behind_round_robin`]).
    RoundRobin,
}

async fn a_killed_engine_is_continued_exactly(protocol: &str, setup: Setup) {
    let plain: &[&str] = &["--protocol", protocol];
    let truth = EngineProcess::spawn(plain);
    let (mut engines, router) = match setup {
        Setup::Disaggregated => pair_with_spare(protocol),
        Setup::RoundRobin => two_behind_round_robin(protocol),
    };
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "Disaggregated serving splits prefill from decode, and", "max_tokens": 300}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me about lighthouses."}], "max_tokens": 300}),
        ),
    ];
    for (path, body) in cases {
        let chat = path.contains("chat");
        let expected = post_json(&truth.endpoint(path), &body).await;
        let expected_text = if chat {
            expected["choices"][0]["message"]["content"].as_str()
        } else {
            expected["choices"][0]["text"].as_str()
        }
        .expect("the single engine's text")
        .to_owned();
        let mut stream_body = body.clone();
        stream_body["stream"] = json!(true);
        stream_body["stream_options"] = json!({"include_usage": true});
        let (mut response, first) = open_stream(&router.endpoint(path), &stream_body).await;
        let mut received = first.to_vec();
        // Text has reached the client (the stream is continued, not restarted)...
        while !has_text(&received, chat) {
            let chunk = response.chunk().await.expect("the stream goes on");
            received.extend_from_slice(&chunk.expect("more than the opening"));
        }
        // ...when whichever engine generates it is killed (P is engine 0 when there is one).
        let generating = match setup {
            Setup::Disaggregated => generating_decode(&router).await,
            Setup::RoundRobin => generating_engine(&router).await,
        };
        engines[generating].kill();
        while let Some(chunk) = response.chunk().await.expect("the stream ends cleanly") {
            received.extend_from_slice(&chunk);
        }
        let (text, usage) = streamed_text(&String::from_utf8(received).expect("UTF-8"), chat);
        assert_eq!(text, expected_text, "{protocol} {path}");
        assert_eq!(
            usage["completion_tokens"], expected["usage"]["completion_tokens"],
            "{protocol} {path}: {usage}"
        );
        // Back for the next case: it may be the only decode engine left to continue on.
        engines[generating].restart();
        wait_health(&router, generating, true).await;
    }
    let metrics = router.endpoint("/metrics");
    let retried = metric(&metrics, "switchyard_retries").await;
    assert!(
        retried >= 2.0,
        "{protocol}: both streams were continued ({retried})"
    );
    if let Setup::RoundRobin = setup {
        // Each prompt was tokenized once, to continue it: never to forward it.
        let tokenized = metric(&metrics, "switchyard_prompt_tokenizations").await;
        assert_eq!(
            tokenized, 2.0,
            "{protocol}: one tokenization per continued stream"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_streams_continue_exactly_when_their_decode_engine_is_killed() {
    a_killed_engine_is_continued_exactly("vllm", Setup::Disaggregated).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_streams_continue_exactly_when_their_decode_engine_is_killed() {
    a_killed_engine_is_continued_exactly("sglang", Setup::Disaggregated).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_through_a_policy_that_reads_nothing_continues_exactly() {
    a_killed_engine_is_continued_exactly("vllm", Setup::RoundRobin).await;
}
