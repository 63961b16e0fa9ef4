//! vLLM and SGLang handoffs through the real router, against recording engines: every leg the
//! router sends is compared with the golden fixtures in `tests/fixtures/handoffs/` (written
//! from the specs), and retries are checked for fresh request ids and rooms.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use serde_json::{Value, json};
use switchyard_tests::RouterProcess;

use crate::http::{client, json_body, post, serve_loopback};
use crate::router::eventually;

/// One request an engine received.
#[derive(Debug, Clone)]
struct Leg {
    to: &'static str,
    path: String,
    request_id: Option<String>,
    body: Value,
}

type Legs = Arc<Mutex<Vec<Leg>>>;

/// What a recording engine does besides recording.
struct Behaviour {
    /// Its role in the pair: `prefill` or `decode`.
    role: &'static str,
    owned_by: &'static str,
    /// The model `/v1/models` lists.
    model: &'static str,
    /// A vLLM prefill's answer (with the `kv_transfer_params` D must get).
    prefill_answer: Mutex<Value>,
    /// Answer this many more generation requests with HTTP 500.
    fail_next: AtomicU32,
}

/// The text every recording engine generates.
const TEXT: &str = "ok, done";

async fn recording_engine(legs: Legs, behaviour: Arc<Behaviour>) -> String {
    serve_loopback(move |req| {
        let (legs, behaviour) = (legs.clone(), behaviour.clone());
        async move { answer(req, &legs, &behaviour).await }
    })
    .await
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    legs: &Legs,
    behaviour: &Behaviour,
) -> hyper::Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let respond = |status: u16, content_type: &str, body: String| {
        hyper::Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .expect("response")
    };
    match path.as_str() {
        "/health" => return respond(200, "text/plain", String::new()),
        "/v1/models" => {
            let models = json!({"object": "list", "data": [{"id": behaviour.model, "owned_by": behaviour.owned_by}]});
            return respond(200, "application/json", models.to_string());
        }
        "/metrics" => return respond(404, "text/plain", String::new()),
        _ => {}
    }
    let body = json_body(req).await;
    legs.lock().expect("legs").push(Leg {
        to: behaviour.role,
        path: path.clone(),
        request_id,
        body: body.clone(),
    });
    if behaviour
        .fail_next
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
    {
        let error = json!({"error": {"message": "injected failure", "type": "server_error"}});
        return respond(500, "application/json", error.to_string());
    }
    if body["kv_transfer_params"]["do_remote_decode"] == json!(true) {
        let answer = behaviour.prefill_answer.lock().expect("answer").clone();
        return respond(200, "application/json", answer.to_string());
    }
    let chat = path == "/v1/chat/completions";
    let choice = |text: &str, finish: Option<&str>| {
        if chat {
            json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish})
        }
    };
    if body["stream"] == json!(true) {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut sse = String::new();
        for (text, finish) in [(&TEXT[..3], None), (&TEXT[3..], Some("stop"))] {
            let chunk = json!({"id": "x", "object": object, "created": 0, "model": "m",
                "choices": [choice(text, finish)]});
            sse.push_str(&format!("data: {chunk}\n\n"));
        }
        sse.push_str("data: [DONE]\n\n");
        return respond(200, "text/event-stream", sse);
    }
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": TEXT}, "finish_reason": "stop"})
    } else {
        json!({"index": 0, "text": TEXT, "finish_reason": "stop"})
    };
    let whole = json!({"id": "x", "object": if chat { "chat.completion" } else { "text_completion" },
        "created": 0, "model": "m", "choices": [choice],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}});
    respond(200, "application/json", whole.to_string())
}

/// A recording P/D pair of `protocol` behind a router started with the built-in policy.
struct Pair {
    legs: Legs,
    prefill: Arc<Behaviour>,
    decode: Arc<Behaviour>,
    router: RouterProcess,
    _dir: tempfile::TempDir,
}

const BOOTSTRAP_PORT: u16 = 8998;

async fn pair(protocol: &str) -> Pair {
    let legs = Legs::default();
    let behaviour = |role| {
        Arc::new(Behaviour {
            role,
            owned_by: if protocol == "sglang" {
                "sglang"
            } else {
                "vllm"
            },
            model: "m",
            prefill_answer: Mutex::new(Value::Null),
            fail_next: AtomicU32::new(0),
        })
    };
    let (prefill, decode) = (behaviour("prefill"), behaviour("decode"));
    let p = recording_engine(legs.clone(), prefill.clone()).await;
    let d = recording_engine(legs.clone(), decode.clone()).await;
    let bootstrap = if protocol == "sglang" {
        format!("bootstrap_port = {BOOTSTRAP_PORT}\n")
    } else {
        String::new()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("router.toml");
    std::fs::write(
        &config,
        format!(
            "model = \"m\"\n\
             [[endpoints]]\nurl = \"{p}\"\nprotocol = \"{protocol}\"\nrole = \"prefill\"\n{bootstrap}\
             [[endpoints]]\nurl = \"{d}\"\nprotocol = \"{protocol}\"\nrole = \"decode\"\n"
        ),
    )
    .expect("write the config");
    let router = tokio::task::spawn_blocking(move || {
        let config = config.display().to_string();
        RouterProcess::serve(&[], &["--config", &config])
    })
    .await
    .expect("router starts");
    Pair {
        legs,
        prefill,
        decode,
        router,
        _dir: dir,
    }
}

impl Pair {
    fn take_legs(&self) -> Vec<Leg> {
        std::mem::take(&mut *self.legs.lock().expect("legs"))
    }
}

fn fixtures(prefix: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/handoffs");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the fixtures directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "json")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort();
    assert!(
        !found.is_empty(),
        "no {prefix}* fixtures in {}",
        dir.display()
    );
    found
}

/// Compare `actual` with `expected`, binding `"$NAME"` placeholders on first use.
fn matches(expected: &Value, actual: &Value, bound: &mut BTreeMap<String, Value>, at: &str) {
    if let Some(name) = expected.as_str().filter(|s| s.starts_with('$')) {
        let value = bound
            .entry(name.to_owned())
            .or_insert_with(|| actual.clone());
        assert_eq!(value, actual, "{at}: {name} differs from its first use");
        return;
    }
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            let (ek, ak): (Vec<_>, Vec<_>) = (e.keys().collect(), a.keys().collect());
            assert_eq!(ek, ak, "{at}: the fields differ");
            for (key, value) in e {
                matches(value, &a[key], bound, &format!("{at}.{key}"));
            }
        }
        _ => assert_eq!(expected, actual, "{at}"),
    }
}

/// Replay each fixture through `pair`; return the legs of each, bound placeholders included.
async fn replay(pair: &Pair, protocol: &str) {
    for path in fixtures(protocol) {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let fixture: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("readable"))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        *pair.prefill.prefill_answer.lock().expect("answer") = fixture["prefill_answer"].clone();
        let client_path = fixture["client"]["path"].as_str().expect("client path");
        let (status, text) = post(
            &pair.router.endpoint(client_path),
            &fixture["client"]["body"],
        )
        .await;
        assert_eq!(status, 200, "{name}: {text}");
        let delivered = if fixture["client"]["body"]["stream"] == json!(true) {
            crate::http::sse_payloads(&text)
                .iter()
                .filter(|p| *p != "[DONE]")
                .map(|p| {
                    let chunk: Value = serde_json::from_str(p).expect("chunk JSON");
                    let choice = &chunk["choices"][0];
                    choice["text"]
                        .as_str()
                        .or_else(|| choice["delta"]["content"].as_str())
                        .unwrap_or_default()
                        .to_owned()
                })
                .collect::<String>()
        } else {
            let whole: Value = serde_json::from_str(&text).expect("JSON answer");
            let choice = &whole["choices"][0];
            choice["text"]
                .as_str()
                .or_else(|| choice["message"]["content"].as_str())
                .expect("the answer's text")
                .to_owned()
        };
        assert_eq!(
            delivered, TEXT,
            "{name}: the client gets the decode leg's text"
        );
        let mut legs = pair.take_legs();
        let expected = fixture["legs"].as_array().expect("legs");
        assert_eq!(legs.len(), expected.len(), "{name}: {legs:#?}");
        if protocol == "sglang" {
            // Sent at once: either may arrive first.
            legs.sort_by_key(|l| l.to != "prefill");
        }
        let mut bound = BTreeMap::new();
        bound.insert("$BOOTSTRAP_HOST".to_owned(), json!("127.0.0.1"));
        bound.insert("$BOOTSTRAP_PORT".to_owned(), json!(BOOTSTRAP_PORT));
        for (i, (leg, want)) in legs.iter().zip(expected).enumerate() {
            let at = format!("{name} leg {i} ({})", leg.to);
            assert_eq!(leg.to, want["to"], "{at}");
            assert_eq!(leg.path, want["path"], "{at}");
            matches(
                &want["x-request-id"],
                &json!(leg.request_id),
                &mut bound,
                &format!("{at} x-request-id"),
            );
            matches(&want["body"], &leg.body, &mut bound, &format!("{at} body"));
        }
        if let Some(room) = bound.get("$ROOM") {
            let room = room.as_u64().expect("an integer room");
            assert!(
                room <= i64::MAX as u64,
                "{name}: room {room} is out of range"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_legs_are_the_specs_golden_fixtures() {
    let pair = pair("vllm").await;
    replay(&pair, "vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_legs_are_the_specs_golden_fixtures() {
    let pair = pair("sglang").await;
    replay(&pair, "sglang").await;
}

/// A decode leg that fails is retried as a new attempt: a new request id on both legs (and a
/// new room), the prefill leg sent again; the client sees one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pair_is_retried_with_fresh_ids_and_rooms() {
    for protocol in ["vllm", "sglang"] {
        let pair = pair(protocol).await;
        *pair.prefill.prefill_answer.lock().expect("answer") = json!({"choices": [],
            "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [[1]]}});
        pair.decode.fail_next.store(1, Ordering::Release);
        let body = json!({"model": "m", "prompt": "Hello", "max_tokens": 8, "stream": true});
        let (status, text) = post(&pair.router.endpoint("/v1/completions"), &body).await;
        assert_eq!(status, 200, "{protocol}: {text}");
        assert!(text.contains("done"), "{protocol}: {text}");
        let legs = pair.take_legs();
        // An attempt's legs carry its id: the attempts, in the order they began.
        let mut ids: Vec<String> = Vec::new();
        for leg in &legs {
            let id = leg.request_id.clone().expect("an X-Request-Id");
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        assert_eq!(
            ids.len(),
            2,
            "{protocol}: two attempts, a fresh id each: {legs:#?}"
        );
        let attempt = |id: &String| -> Vec<&Leg> {
            legs.iter()
                .filter(|l| l.request_id.as_ref() == Some(id))
                .collect()
        };
        let (first, second) = (attempt(&ids[0]), attempt(&ids[1]));
        let to = |legs: &[&Leg]| {
            let mut to: Vec<_> = legs.iter().map(|l| l.to).collect();
            to.sort_unstable();
            to
        };
        assert_eq!(to(&second), ["decode", "prefill"], "{protocol}: {legs:#?}");
        if protocol == "vllm" {
            // D is sent only once P has answered.
            assert_eq!(to(&first), ["decode", "prefill"], "{legs:#?}");
        } else {
            // Both legs leave at once, and the failing D leg drops P's, which may not have been
            // written yet (a connection still opening).
            assert!(to(&first).contains(&"decode"), "{legs:#?}");
            let room = |legs: &[&Leg]| legs[0].body["bootstrap_room"].clone();
            assert_ne!(room(&first), room(&second), "a fresh room per attempt");
        }
    }
}

/// A prefill leg that fails ends the attempt before any decode leg (vLLM: D is sent only after
/// P's 2xx); the retry avoids the prefill that failed, and the decode engine (a vLLM decode
/// endpoint may serve alone) gets the plain request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_vllm_decode_leg_follows_a_failed_prefill() {
    let pair = pair("vllm").await;
    *pair.prefill.prefill_answer.lock().expect("answer") = json!({"choices": [],
        "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [[1]]}});
    pair.prefill.fail_next.store(1, Ordering::Release);
    let body = json!({"model": "m", "prompt": "Hello", "max_tokens": 8});
    let (status, text) = post(&pair.router.endpoint("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{text}");
    let legs = pair.take_legs();
    let to: Vec<_> = legs.iter().map(|l| l.to).collect();
    assert_eq!(to, ["prefill", "decode"]);
    assert!(
        legs[1].body.get("kv_transfer_params").is_none(),
        "{:?}",
        legs[1]
    );
    assert_ne!(legs[0].request_id, legs[1].request_id);
}

/// An OpenAI-compatible server beside a vLLM P/D pair, one policy routing on the request's
/// model (`examples/model-route-rust`): the server's model goes to it whole, with the client's
/// body untouched; the other model is disaggregated on the pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_cluster_routes_on_the_model() {
    let example = switchyard_tests::checkout().join("target/examples/model-route-rust.wasm");
    assert!(
        example.exists(),
        "{} is missing: build the example policies first: make examples",
        example.display()
    );
    let plugins = tempfile::tempdir().expect("plugins dir");
    std::fs::copy(&example, plugins.path().join("model-route-rust.wasm")).expect("copy");
    std::fs::write(
        plugins.path().join("model-route-rust.json"),
        r#"{"forward": {"gpt-4o-mini": "openai"}}"#,
    )
    .expect("policy config");
    let legs = Legs::default();
    let behaviour = |role, owned_by, model| {
        Arc::new(Behaviour {
            role,
            owned_by,
            model,
            prefill_answer: Mutex::new(json!({"choices": [],
                "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [[1]]}})),
            fail_next: AtomicU32::new(0),
        })
    };
    let openai = recording_engine(legs.clone(), behaviour("openai", "openai", "gpt-4o-mini")).await;
    let p = recording_engine(legs.clone(), behaviour("prefill", "vllm", "m")).await;
    let d = recording_engine(legs.clone(), behaviour("decode", "vllm", "m")).await;
    let endpoints = [
        format!("openai+{openai}"),
        format!("vllm+{p},role=prefill"),
        format!("vllm+{d},role=decode"),
    ];
    let plugins_path = plugins.path().display().to_string();
    let router = tokio::task::spawn_blocking(move || {
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        RouterProcess::serve(
            &endpoints,
            &[
                "--plugins",
                &plugins_path,
                "--policy",
                "model-route-rust",
                "--model",
                "m",
            ],
        )
    })
    .await
    .expect("router starts");
    // Serving starts with the first healthy endpoint; the model is served once its server's
    // probe has listed it.
    eventually(Duration::from_secs(30), || async {
        let models = match client().get(router.endpoint("/v1/models")).send().await {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(e) => return Some(e.to_string()),
        };
        (!models.contains("gpt-4o-mini")).then(|| format!("/v1/models: {models}"))
    })
    .await;
    let to_openai = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
        "stream": true, "temperature": 0.5, "logit_bias": {"50256": -100}});
    let (status, text) = post(&router.endpoint("/v1/chat/completions"), &to_openai).await;
    assert_eq!(status, 200, "{text}");
    let got = std::mem::take(&mut *legs.lock().expect("legs"));
    assert_eq!(got.len(), 1, "{got:#?}");
    assert_eq!(
        (got[0].to, got[0].path.as_str()),
        ("openai", "/v1/chat/completions")
    );
    assert_eq!(
        got[0].body, to_openai,
        "an OpenAI server gets the client's body as it came"
    );
    let to_pair = json!({"model": "m", "prompt": "Hello", "max_tokens": 4});
    let (status, text) = post(&router.endpoint("/v1/completions"), &to_pair).await;
    assert_eq!(status, 200, "{text}");
    let got = std::mem::take(&mut *legs.lock().expect("legs"));
    let to: Vec<_> = got.iter().map(|l| l.to).collect();
    assert_eq!(to, ["prefill", "decode"], "{got:#?}");
    assert!(got[1].body["kv_transfer_params"].is_object());
}
