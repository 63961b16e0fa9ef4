//! A mock server on 127.0.0.1:0 that plays both the router and its engines: `/v1/completions`
//! and `/microserving/start_generate` stream `max_tokens` one-byte chunks (1 ms apart, like
//! decode steps), `/admin/endpoints` lists two engines at its own address, and every call is
//! counted and its JSON body kept for inspection.
//!
//! Like a server with a prefix cache, it reports `usage.prompt_tokens_details.cached_tokens`:
//! the prompt's leading whole 512-token blocks that an earlier prompt had (each prompt is
//! cached as it arrives). Its `/metrics` counts every completion as a preemption in
//! `switchyard_preemptions_total`, so a run's share of the counter is its completions.

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Barrier;

/// Gap between two streamed chunks.
pub const CHUNK_GAP: Duration = Duration::from_millis(1);

/// Tokens per cached block, as trace blocks.
const CACHE_BLOCK: usize = 512;

type Body = BoxBody<Bytes, Infallible>;

#[derive(Debug, Default)]
pub struct Calls {
    /// Request bodies by path, in arrival order.
    pub bodies: BTreeMap<String, Vec<Value>>,
    /// Generations being streamed now, and the most there ever were at once.
    pub generating: usize,
    pub max_generating: usize,
    /// Connections accepted so far.
    pub connections: usize,
    /// Completions served on each connection, by the connection's order of acceptance.
    pub completions_by_connection: BTreeMap<usize, usize>,
    /// Every whole-block prefix of every prompt so far.
    cached_prefixes: HashSet<Vec<u8>>,
}

/// Counts a generation from its request until its body is dropped (sent or abandoned).
struct Generating(Arc<Mutex<Calls>>);

impl Generating {
    fn start(calls: Arc<Mutex<Calls>>) -> Self {
        let mut c = calls.lock();
        c.generating += 1;
        c.max_generating = c.max_generating.max(c.generating);
        drop(c);
        Self(calls)
    }
}

impl Drop for Generating {
    fn drop(&mut self) {
        self.0.lock().generating -= 1;
    }
}

impl Calls {
    pub fn count(&self, path: &str) -> usize {
        self.bodies.get(path).map_or(0, Vec::len)
    }

    /// Tokens of `prompt`'s leading whole blocks seen in an earlier prompt; then caches it.
    fn cache(&mut self, prompt: &[u8]) -> usize {
        let prefixes: Vec<&[u8]> = (1..=prompt.len() / CACHE_BLOCK)
            .map(|blocks| &prompt[..blocks * CACHE_BLOCK])
            .collect();
        let hits = prefixes
            .iter()
            .take_while(|p| self.cached_prefixes.contains(**p))
            .count();
        self.cached_prefixes
            .extend(prefixes.into_iter().map(<[u8]>::to_vec));
        hits * CACHE_BLOCK
    }
}

pub struct MockServer {
    pub url: String,
    pub calls: Arc<Mutex<Calls>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MockServer {
    pub async fn start() -> Self {
        Self::start_gated(None).await
    }

    /// A server that holds its first `n` completions until all `n` have arrived: a closed-loop
    /// client of concurrency `n` must then have one request in flight from each of its clients
    /// at once, however its tasks are scheduled.
    pub async fn holding_first(n: usize) -> Self {
        Self::start_gated(Some(Gate {
            first: n,
            barrier: Arc::new(Barrier::new(n)),
        }))
        .await
    }

    async fn start_gated(gate: Option<Gate>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("bound address"));
        let calls = Arc::new(Mutex::new(Calls::default()));
        let (base, shared) = (url.clone(), calls.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let connection = {
                    let mut calls = shared.lock();
                    calls.connections += 1;
                    calls.connections
                };
                // Without it Nagle holds small SSE chunks back until the client's delayed ACK.
                let _ = stream.set_nodelay(true);
                let (base, calls, gate) = (base.clone(), shared.clone(), gate.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        handle(req, connection, base.clone(), calls.clone(), gate.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { url, calls, task }
    }
}

/// Completions held until a number of them have arrived (see [`MockServer::holding_first`]).
#[derive(Clone)]
struct Gate {
    first: usize,
    barrier: Arc<Barrier>,
}

async fn handle(
    req: Request<Incoming>,
    connection: usize,
    base: String,
    calls: Arc<Mutex<Calls>>,
    gate: Option<Gate>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    calls
        .lock()
        .bodies
        .entry(path.clone())
        .or_default()
        .push(body.clone());
    Ok(match path.as_str() {
        "/v1/models" => json_response(json!({"object": "list", "data": []})),
        "/metrics" => {
            let completions = calls.lock().count("/v1/completions");
            Response::builder()
                .header("content-type", "text/plain; version=0.0.4")
                .body(Full::new(Bytes::from(format!(
                    "# TYPE switchyard_preemptions counter\nswitchyard_preemptions_total {completions}\n"
                ))).boxed())
                .unwrap_or_default()
        }
        "/admin/endpoints" => json_response(json!([
            {"id": 1, "url": base, "role": "any", "device_rank": 4, "healthy": true, "in_flight": 0},
            {"id": 0, "url": format!("{base}/"), "role": "any", "device_rank": 0, "healthy": true, "in_flight": 0},
        ])),
        "/microserving/prep_recv" => json_response(json!({
            "kv_append_metadata": "AwAAAAAAAABbMF0=",
            "prefix_matched_length": 0,
        })),
        "/microserving/remote_send" => json_response(json!({})),
        "/v1/completions" | "/microserving/start_generate" => {
            let arrived = {
                let mut c = calls.lock();
                *c.completions_by_connection.entry(connection).or_default() += 1;
                c.completions_by_connection.values().sum::<usize>()
            };
            if let Some(gate) = gate.filter(|g| arrived <= g.first) {
                gate.barrier.wait().await;
            }
            let cached = calls.lock().cache(&prompt_bytes(&body["prompt"]));
            completion(&body, cached, Generating::start(calls))
        }
        _ => Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Full::new(Bytes::from_static(b"not found")).boxed())
            .unwrap_or_default(),
    })
}

fn json_response(value: Value) -> Response<Body> {
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .unwrap_or_default()
}

/// A prompt's tokens as bytes: a text's bytes, or its ids (byte values in these tests).
fn prompt_bytes(prompt: &Value) -> Vec<u8> {
    match prompt {
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Array(ids) => ids
            .iter()
            .map(|id| id.as_u64().map_or(0, |id| id as u8))
            .collect(),
        _ => Vec::new(),
    }
}

fn completion(body: &Value, cached_tokens: usize, generating: Generating) -> Response<Body> {
    let tokens = body["max_tokens"].as_u64().unwrap_or(1);
    let prompt_tokens = prompt_bytes(&body["prompt"]).len();
    if body["stream"] != Value::Bool(true) {
        return json_response(json!({
            "id": "cmpl-mock", "object": "text_completion", "created": 0, "model": "mock",
            "choices": [{"index": 0, "text": "x".repeat(tokens as usize), "finish_reason": "length", "logprobs": null}],
            "usage": null,
        }));
    }
    let mut events: Vec<Bytes> = (0..tokens)
        .map(|i| {
            let finish = if i + 1 == tokens {
                json!("length")
            } else {
                Value::Null
            };
            sse(json!({
                "id": "cmpl-mock", "object": "text_completion", "created": 0, "model": "mock",
                "choices": [{"index": 0, "text": "x", "finish_reason": finish, "logprobs": null}],
                "usage": null,
            }))
        })
        .collect();
    if body["stream_options"]["include_usage"] == Value::Bool(true) {
        events.push(sse(json!({
            "id": "cmpl-mock", "object": "text_completion", "created": 0, "model": "mock",
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                      "total_tokens": prompt_tokens as u64 + tokens,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens}},
        })));
    }
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let frames = futures::stream::iter(events.into_iter().map(Some))
        // The body ends a gap after `[DONE]`, in a write of its own, as uvicorn (vLLM's and
        // SGLang's server) ends it.
        .chain(futures::stream::once(async { None }))
        .then(move |event| {
            // Held by the body stream: released when the last chunk went out.
            let _ = &generating;
            async move {
                tokio::time::sleep(CHUNK_GAP).await;
                event
            }
        })
        .filter_map(|event| async move { event.map(|e| Ok::<_, Infallible>(Frame::data(e))) });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(StreamBody::new(frames)))
        .unwrap_or_default()
}

fn sse(value: Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}
