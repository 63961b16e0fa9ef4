//! What a policy reads decides the work the router does for it (contract 0.2.0's
//! `policy-info.reads`): a prompt is tokenized only when something reads its length or tokens,
//! counted by `switchyard_prompt_tokenizations_total`. Behind engines that take the client's own
//! body (vLLM's protocol), a policy that reads nothing (round-robin) has no prompt tokenized, and
//! the client's usage still counts the prompt (the engine's count); one that reads the prompt's
//! length (kv-aware, chosen per request) has it tokenized; an engine publishing KV events is a
//! reader too (`cached-prefix`), whatever the policy; a stream's usage its client did not ask
//! for is not. A stream continued after a failure through round-robin is in `continuation`.

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};

use crate::http::client;
use crate::kv_events::{PUBLISHING, kv_sockets};
use crate::router::metric;

const TOKENIZATIONS: &str = "switchyard_prompt_tokenizations";

/// A text prompt whose length in the reference engine's byte-level tokens is its length in
/// bytes.
const PROMPT: &str = "Nothing here needs this prompt counted by the router.";

/// `body` to `path` through `router`, planned by `policy` when given (`x-switchyard-policy`).
async fn ask(router: &RouterProcess, path: &str, policy: Option<&str>, body: &Value) -> Value {
    let mut request = client().post(router.endpoint(path)).json(body);
    if let Some(policy) = policy {
        request = request.header("x-switchyard-policy", policy);
    }
    let response = request.send().await.expect("the router answers");
    let status = response.status();
    let text = response.text().await.expect("a body");
    assert_eq!(status, 200, "{path} {body} -> {text}");
    serde_json::from_str(&text).expect("JSON")
}

fn completion() -> Value {
    json!({"prompt": PROMPT, "max_tokens": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_is_tokenized_only_for_a_policy_that_reads_it() {
    let engines = [
        EngineProcess::spawn(&["--protocol", "vllm"]),
        EngineProcess::spawn(&["--protocol", "vllm"]),
    ];
    let endpoints: Vec<String> = engines.iter().map(|e| format!("vllm+{}", e.url)).collect();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let router = RouterProcess::serve(&endpoints, &["--policy", "round-robin"]);
    let metrics = router.endpoint("/metrics");

    for _ in 0..3 {
        let answer = ask(&router, "/v1/completions", None, &completion()).await;
        assert_eq!(answer["usage"]["prompt_tokens"], PROMPT.len(), "{answer}");
    }
    let chat = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4});
    let answer = ask(&router, "/v1/chat/completions", None, &chat).await;
    assert!(
        answer["usage"]["prompt_tokens"].as_u64() > Some(PROMPT.len() as u64),
        "the engine counts the rendered chat: {answer}"
    );
    assert_eq!(
        metric(&metrics, TOKENIZATIONS).await,
        0.0,
        "round-robin reads nothing"
    );

    // kv-aware weighs each endpoint's uncached prompt tokens: it reads the prompt's length.
    let answer = ask(&router, "/v1/completions", Some("kv-aware"), &completion()).await;
    assert_eq!(answer["usage"]["prompt_tokens"], PROMPT.len(), "{answer}");
    assert_eq!(metric(&metrics, TOKENIZATIONS).await, 1.0);
}

/// A stream whose client did not ask for its usage (`stream_options.include_usage`) ends
/// without one, and a prompt no engine counted is not tokenized only to be counted (the engine,
/// given the client's body, counts nothing); asked, the usage is the engine's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_its_usage_has_no_prompt_tokenized_to_count_it() {
    let engine = EngineProcess::spawn(&["--protocol", "vllm"]);
    let endpoint = format!("vllm+{}", engine.url);
    let router = RouterProcess::serve(&[&endpoint], &["--policy", "round-robin"]);
    let metrics = router.endpoint("/metrics");
    let stream = |usage: bool| {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 4, "stream": true});
        if usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };
    let chunks = |text: &str| -> Vec<Value> {
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
            .collect()
    };
    let send = |body: Value| {
        let request = client()
            .post(router.endpoint("/v1/completions"))
            .json(&body);
        async move {
            let response = request.send().await.expect("the router answers");
            assert_eq!(response.status(), 200);
            response.text().await.expect("a stream")
        }
    };

    let without = chunks(&send(stream(false)).await);
    assert!(
        without
            .iter()
            .all(|c| c.get("usage").is_none_or(Value::is_null)),
        "no usage asked, none sent: {without:?}"
    );
    assert_eq!(
        metric(&metrics, TOKENIZATIONS).await,
        0.0,
        "nothing reads the prompt's length"
    );

    let with = chunks(&send(stream(true)).await);
    let usage = &with.last().expect("a usage chunk")["usage"];
    assert_eq!(usage["prompt_tokens"], PROMPT.len(), "{with:?}");
    assert_eq!(usage["completion_tokens"], 4, "{with:?}");
    assert_eq!(
        metric(&metrics, TOKENIZATIONS).await,
        0.0,
        "the engine counted it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_publishing_kv_events_has_every_prompt_tokenized() {
    let mut args = vec!["--protocol", "vllm"];
    args.extend(PUBLISHING);
    let engine = EngineProcess::spawn(&args);
    let (events, replay) = kv_sockets(&engine);
    let endpoint = format!(
        "vllm+{},kv_events={events},kv_events_replay={replay}",
        engine.url
    );
    let router = RouterProcess::serve_ready(&[&endpoint], &["--policy", "round-robin"]);
    let answer = ask(&router, "/v1/completions", None, &completion()).await;
    assert_eq!(answer["usage"]["prompt_tokens"], PROMPT.len(), "{answer}");
    // `cached-prefix` is computed from the prompt's tokens for every policy, round-robin too.
    assert_eq!(
        metric(&router.endpoint("/metrics"), TOKENIZATIONS).await,
        1.0
    );
}
