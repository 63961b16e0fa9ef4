//! Many models behind one router: each model reaches only the engines that serve it (those
//! listing it on `/v1/models`), measured by its own tokenizer; an unknown model is a 404, a
//! configured one no healthy engine serves a 503; `/v1/models` lists the union, a LoRA
//! adapter with its `parent`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};

use crate::http::{client, json_body, post, post_json, serve_loopback};
use crate::router::{eventually, metric};

/// The `POST` calls engine `engine` has received, every leg of every request counted.
async fn calls(engine: &EngineProcess) -> f64 {
    metric(
        &engine.endpoint("/metrics"),
        "switchyard_engine_calls_received",
    )
    .await
}

/// What the router's `/v1/models` lists.
async fn listed(router: &RouterProcess) -> Vec<Value> {
    let Ok(response) = client().get(router.endpoint("/v1/models")).send().await else {
        return Vec::new();
    };
    let body: Value = response.json().await.unwrap_or_default();
    body["data"].as_array().cloned().unwrap_or_default()
}

/// Waits until `/v1/models` lists every one of `ids` (the probes have read the engines).
async fn until_listed(router: &RouterProcess, ids: &[&str]) {
    eventually(Duration::from_secs(30), || async {
        let models = listed(router).await;
        let missing: Vec<_> = ids
            .iter()
            .filter(|id| !models.iter().any(|m| m["id"] == **id))
            .collect();
        (!missing.is_empty()).then(|| format!("{missing:?} not in {models:?}"))
    })
    .await;
}

/// `(status, error.code)` of a request for `model`.
async fn refused(router: &RouterProcess, model: &str) -> (u16, Value) {
    let body = json!({"model": model, "prompt": "Hi", "max_tokens": 2});
    let (status, text) = post(&router.endpoint("/v1/completions"), &body).await;
    let error: Value = serde_json::from_str(&text).expect("an OpenAI error body");
    (status, error["error"]["code"].clone())
}

/// Two reference engines serving different models, and a third model configured that none
/// serves. A request reaches only the engine serving its model (its own calls counter moves,
/// the other's does not), a request naming none gets the default model, the model with the
/// SmolLM2 tokenizer counts fewer prompt tokens than the byte-level one for the same text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_reaches_only_its_engines_measured_by_its_own_tokenizer() {
    let gguf = switchyard_wire::gguf::smollm2_path().expect("the model is fetched: make model");
    let alpha = EngineProcess::spawn(&["--served-model-name", "alpha"]);
    let beta = EngineProcess::spawn(&[
        "--model",
        "smollm2",
        "--threads",
        "1",
        "--served-model-name",
        "beta",
    ]);
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("router.toml");
    std::fs::write(
        &config,
        format!(
            "[[models]]\nname = \"alpha\"\n\n[[models]]\nname = \"beta\"\nmodel_dir = {gguf:?}\n\n\
             [[models]]\nname = \"gamma\"\n"
        ),
    )
    .expect("write the config");
    let config = config.display().to_string();
    let urls = [alpha.url.clone(), beta.url.clone()];
    let router = tokio::task::spawn_blocking(move || {
        RouterProcess::serve(
            &[&urls[0], &urls[1]],
            &["--config", &config, "--policy", "round-robin"],
        )
    })
    .await
    .expect("router starts");
    until_listed(&router, &["alpha", "beta", "gamma"]).await;
    assert!(
        listed(&router)
            .await
            .iter()
            .all(|m| m["owned_by"].is_string()),
        "{:?}",
        listed(&router).await
    );

    let prompt = "Tokenizers differ on this sentence.";
    let url = router.endpoint("/v1/completions");
    let mut prompt_tokens = Vec::new();
    for (model, serving, idle) in [("alpha", &alpha, &beta), ("beta", &beta, &alpha)] {
        let before = (calls(serving).await, calls(idle).await);
        for _ in 0..2 {
            let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
            let answer = post_json(&url, &body).await;
            assert_eq!(answer["model"], model, "{answer}");
            prompt_tokens.push(answer["usage"]["prompt_tokens"].as_u64().expect("usage"));
        }
        assert!(
            calls(serving).await > before.0,
            "{model} reached its engine"
        );
        assert_eq!(
            calls(idle).await,
            before.1,
            "{model} reached another engine"
        );
    }
    assert_eq!(prompt_tokens[0], prompt.len() as u64, "alpha is byte-level");
    assert!(
        prompt_tokens[2] < prompt_tokens[0],
        "beta is measured by SmolLM2's tokenizer: {prompt_tokens:?}"
    );

    // No model: the default, the first [[models]] entry.
    let before = calls(&beta).await;
    post_json(&url, &json!({"prompt": prompt, "max_tokens": 2})).await;
    assert_eq!(calls(&beta).await, before, "the default model is alpha");

    assert_eq!(
        refused(&router, "nope").await,
        (404, json!("model_not_found"))
    );
    assert_eq!(
        refused(&router, "gamma").await,
        (503, json!("model_not_available")),
        "configured, but no engine serves it"
    );
}

/// A vLLM-style server lists a LoRA adapter beside its base model: `/v1/models` shows the
/// adapter with its `parent`, and the adapter's requests go to that server alone, never to
/// the reference engine beside it that serves another model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_is_listed_with_its_parent_and_served_where_it_is_loaded() {
    let received: Arc<Mutex<Vec<Value>>> = Arc::default();
    let record = received.clone();
    let stub = serve_loopback(move |req| {
        let record = record.clone();
        async move {
            let respond = |body: Value| {
                hyper::Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .expect("response")
            };
            match req.uri().path() {
                "/v1/models" => respond(json!({"object": "list", "data": [
                    {"id": "qwen", "object": "model", "owned_by": "vllm", "parent": null},
                    {"id": "sql-lora", "object": "model", "owned_by": "vllm", "parent": "qwen"},
                ]})),
                "/v1/completions" => {
                    let body = json_body(req).await;
                    record.lock().expect("received").push(body);
                    respond(json!({"id": "x", "object": "text_completion", "created": 0,
                        "model": "sql-lora",
                        "choices": [{"index": 0, "text": "SELECT 1", "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}))
                }
                _ => hyper::Response::builder()
                    .status(404)
                    .body(Full::new(Bytes::new()))
                    .expect("response"),
            }
        }
    })
    .await;
    let llama = EngineProcess::spawn(&["--served-model-name", "llama"]);
    let endpoints = [llama.url.clone(), format!("openai+{stub}")];
    let router = tokio::task::spawn_blocking(move || {
        RouterProcess::serve(
            &[&endpoints[0], &endpoints[1]],
            &["--policy", "round-robin"],
        )
    })
    .await
    .expect("router starts");
    until_listed(&router, &["llama", "qwen", "sql-lora"]).await;
    let models = listed(&router).await;
    let adapter = models
        .iter()
        .find(|m| m["id"] == "sql-lora")
        .expect("listed");
    assert_eq!(adapter["parent"], "qwen", "{models:?}");
    let base = models.iter().find(|m| m["id"] == "qwen").expect("listed");
    assert!(base.get("parent").is_none(), "{models:?}");
    let admin: Value = client()
        .get(router.endpoint("/admin/endpoints"))
        .send()
        .await
        .expect("/admin/endpoints")
        .json()
        .await
        .expect("JSON");
    assert_eq!(
        admin["endpoints"][1]["models"],
        json!([{"id": "qwen"}, {"id": "sql-lora", "parent": "qwen"}]),
        "{admin}"
    );

    let before = calls(&llama).await;
    let url = router.endpoint("/v1/completions");
    for _ in 0..3 {
        let body = json!({"model": "sql-lora", "prompt": "Count the rows", "max_tokens": 8});
        let answer = post_json(&url, &body).await;
        assert_eq!(answer["choices"][0]["text"], "SELECT 1", "{answer}");
    }
    let received = received.lock().expect("received").clone();
    assert_eq!(received.len(), 3, "{received:?}");
    assert!(received.iter().all(|body| body["model"] == "sql-lora"));
    assert_eq!(
        calls(&llama).await,
        before,
        "the adapter is not on the llama engine"
    );
}
