//! OpenTelemetry traces through the real router: an OTLP/HTTP receiver in the test decodes the
//! spans the router exports, and a tap in front of each engine of an MLC P/D pair (reference
//! engines) records the `traceparent` of every call the engine receives. The span tree, its
//! attributes, the client's trace continued, each engine call's parent, sampling and "off"
//! are checked against what was received; spans are flushed by the router's drain on SIGTERM.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

use crate::http::{client, serve_loopback};

/// The spans an OTLP/HTTP receiver got, with the `service.name` each was exported under.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(String, Span)>>>);

impl Received {
    fn spans(&self) -> Vec<(String, Span)> {
        self.0.lock().expect("spans").clone()
    }
}

/// An OTLP/HTTP trace receiver on loopback: `POST /v1/traces` with an
/// `ExportTraceServiceRequest` in protobuf; its base URL (what `OTEL_EXPORTER_OTLP_ENDPOINT`
/// names) and what it received.
async fn otlp_receiver() -> (String, Received) {
    let received = Received::default();
    let spans = received.clone();
    let url = serve_loopback(move |req: hyper::Request<hyper::body::Incoming>| {
        let spans = spans.clone();
        async move {
            assert_eq!(req.uri().path(), "/v1/traces", "the OTLP/HTTP traces path");
            let body = req.into_body().collect().await.expect("body").to_bytes();
            let export = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
            let mut spans = spans.0.lock().expect("spans");
            for resource in export.resource_spans {
                let service = resource
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
                    .unwrap_or_default();
                for scope in resource.scope_spans {
                    spans.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
                }
            }
            // An empty ExportTraceServiceResponse: everything accepted.
            hyper::Response::builder()
                .header("content-type", "application/x-protobuf")
                .body(Full::new(Bytes::new()))
                .expect("response")
        }
    })
    .await;
    (url, received)
}

fn text(value: &AnyValue) -> Option<String> {
    match value {
        AnyValue::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// A span's attributes, each as JSON (strings, integers, floats, booleans).
fn attributes(span: &Span) -> HashMap<String, Value> {
    span.attributes
        .iter()
        .filter_map(|kv| {
            let value = match kv.value.as_ref()?.value.as_ref()? {
                AnyValue::StringValue(s) => json!(s),
                AnyValue::IntValue(i) => json!(i),
                AnyValue::DoubleValue(d) => json!(d),
                AnyValue::BoolValue(b) => json!(b),
                _ => return None,
            };
            Some((kv.key.clone(), value))
        })
        .collect()
}

/// One HTTP request an engine received through its tap: its path and `traceparent`, if any.
#[derive(Debug, Clone)]
struct Call {
    path: String,
    traceparent: Option<String>,
}

/// The bytes one connection sent toward the engine.
type Sent = Arc<Mutex<Vec<u8>>>;

/// What a tap saw: what each connection sent.
#[derive(Clone, Default)]
struct Tap(Arc<Mutex<Vec<Sent>>>);

impl Tap {
    /// The calls in the requests' heads: a request line starts a call, its `traceparent`
    /// header (if any) belongs to it. The router's calls are HTTP/1.1 with JSON bodies, which
    /// hold no CRLF, so a body runs into the next request line on the same line.
    fn calls(&self) -> Vec<Call> {
        let mut calls = Vec::new();
        for connection in self.0.lock().expect("tap").iter() {
            let bytes = connection.lock().expect("connection").clone();
            let text = String::from_utf8_lossy(&bytes);
            let mut current: Option<Call> = None;
            for line in text.split("\r\n") {
                let request = ["GET /", "POST /"]
                    .iter()
                    .filter_map(|method| line.find(method).map(|at| &line[at..]))
                    .find(|l| l.ends_with(" HTTP/1.1"));
                if let Some(request) = request {
                    calls.extend(current.take());
                    let path = request.split(' ').nth(1).unwrap_or_default().to_owned();
                    current = Some(Call {
                        path,
                        traceparent: None,
                    });
                } else if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("traceparent")
                    && let Some(call) = current.as_mut()
                {
                    call.traceparent = Some(value.trim().to_owned());
                }
            }
            calls.extend(current);
        }
        calls
    }
}

/// A TCP proxy in front of `engine` that records what each connection sends it; its URL.
async fn tapped(engine: SocketAddr) -> (String, Tap) {
    let tap = Tap::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = tap.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let seen = Arc::new(Mutex::new(Vec::new()));
            connections.0.lock().expect("tap").push(seen.clone());
            tokio::spawn(async move {
                let Ok(upstream) = TcpStream::connect(engine).await else {
                    return;
                };
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_engine, mut to_engine) = upstream.into_split();
                let requests = async move {
                    let mut buf = vec![0u8; 16 << 10];
                    loop {
                        match from_client.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                seen.lock().expect("seen").extend_from_slice(&buf[..n]);
                                if to_engine.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to_engine.shutdown().await;
                };
                let answers = tokio::io::copy(&mut from_engine, &mut to_client);
                let _ = tokio::join!(requests, answers);
            });
        }
    });
    (format!("http://{addr}"), tap)
}

/// A P/D pair of reference engines speaking `protocol` (`mlc` or `vllm`; KV over TCP), each
/// behind a tap: the router's `--endpoint` values, P's tap and D's tap.
async fn tapped_pair(protocol: &'static str) -> (Vec<EngineProcess>, [String; 2], Tap, Tap) {
    let engines = tokio::task::spawn_blocking(move || {
        let common = ["--protocol", protocol, "--kv-transport", "tcp"];
        let decode = EngineProcess::spawn(&[&["--device-rank", "1"][..], &common].concat());
        let peer = format!("{}={}", decode.device_rank, decode.kv_addr);
        let prefill = EngineProcess::spawn(
            &[&["--device-rank", "0", "--kv-peer", &peer][..], &common].concat(),
        );
        vec![prefill, decode]
    })
    .await
    .expect("engines start");
    let (p_url, p_tap) = tapped(engines[0].http_addr).await;
    let (d_url, d_tap) = tapped(engines[1].http_addr).await;
    let endpoints = [
        format!("{protocol}+{p_url},role=prefill"),
        format!("{protocol}+{d_url},role=decode"),
    ];
    (engines, endpoints, p_tap, d_tap)
}

/// `switchyard serve` in front of `endpoints` with `args` and `env`, healthy (started off
/// the runtime: the taps and the receiver run on it).
async fn router(endpoints: &[String], args: &[&str], env: &[(&str, &str)]) -> RouterProcess {
    let endpoints = endpoints.to_vec();
    let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    // SIGTERM drains at once: the test waits for the exit, which flushes the spans.
    args.extend(["--drain-delay", "1ms"].map(str::to_owned));
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &Path)> = env
            .iter()
            .map(|(k, v)| (k.as_str(), Path::new(v.as_str())))
            .collect();
        RouterProcess::serve_with_env(&endpoints, &args, &env)
    })
    .await
    .expect("router starts")
}

/// SIGTERM, and the clean exit that follows the drain and the last export.
async fn stop(router: RouterProcess) {
    let status = tokio::task::spawn_blocking(move || router.terminate())
        .await
        .expect("router stops");
    assert!(
        status.is_some_and(|s| s.success()),
        "the router exits cleanly on SIGTERM: {status:?}"
    );
}

/// A completion through the router, with `traceparent` if given; its JSON answer.
async fn complete(router: &RouterProcess, traceparent: Option<&str>) -> Value {
    let mut request = client()
        .post(router.endpoint("/v1/completions"))
        .json(&json!({"prompt": "Tracing a disaggregated request end to end", "max_tokens": 8}));
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let response = request.send().await.expect("the router answers");
    assert_eq!(response.status(), 200);
    response.json().await.expect("a JSON completion")
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The one span named `name`.
fn named<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one {name:?} span among {:?}", names(spans));
    found[0]
}

fn names(spans: &[Span]) -> Vec<&str> {
    spans.iter().map(|s| s.name.as_str()).collect()
}

/// A client's traced request through an MLC P/D pair is one trace: the request span (a child
/// of the client's span) with the GenAI attributes, an attempt under it, and under the
/// attempt the policy call and the three MLC legs; each engine call carried a `traceparent`
/// of the client's trace whose parent is its leg's span, and the probes carried none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_from_the_client_through_every_engine_leg() {
    let (otlp, received) = otlp_receiver().await;
    let (_engines, endpoints, p_tap, d_tap) = tapped_pair("mlc").await;
    let router = router(&endpoints, &["--otlp-endpoint", &otlp], &[]).await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let answer = complete(&router, Some(&traceparent)).await;
    stop(router).await;

    let spans: Vec<Span> = received.spans().into_iter().map(|(_, s)| s).collect();
    assert!(
        spans.iter().all(|s| hex(&s.trace_id) == CLIENT_TRACE),
        "every span in the client's trace: {:?}",
        names(&spans)
    );
    let request = named(&spans, "text_completion switchyard-reference");
    assert_eq!(hex(&request.parent_span_id), CLIENT_SPAN);
    let attrs = attributes(request);
    assert_eq!(attrs["gen_ai.operation.name"], "text_completion");
    assert_eq!(attrs["gen_ai.request.model"], "switchyard-reference");
    assert_eq!(
        attrs["gen_ai.usage.output_tokens"],
        answer["usage"]["completion_tokens"]
    );
    assert_eq!(
        attrs["gen_ai.usage.input_tokens"],
        answer["usage"]["prompt_tokens"]
    );
    assert_eq!(attrs["switchyard.attempts"], 1);
    assert_eq!(
        attrs["switchyard.policy"], "disagg",
        "the default policy planned it"
    );
    assert!(
        attrs["switchyard.ttft_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0)
    );
    assert_eq!(attrs["trace_id"], CLIENT_TRACE);

    let attempt = named(&spans, "attempt");
    assert_eq!(attempt.parent_span_id, request.span_id);
    assert_eq!(attributes(attempt)["switchyard.attempt"], 1);
    for leg in ["policy", "prep_recv", "remote_send", "start_generate"] {
        assert_eq!(
            named(&spans, leg).parent_span_id,
            attempt.span_id,
            "{leg} is a step of the attempt"
        );
    }

    // Each engine call names its leg's span as its parent, in the client's trace.
    let calls: Vec<(&str, Call)> = p_tap
        .calls()
        .into_iter()
        .map(|c| ("P", c))
        .chain(d_tap.calls().into_iter().map(|c| ("D", c)))
        .collect();
    let traced: Vec<&(&str, Call)> = calls
        .iter()
        .filter(|(_, c)| c.traceparent.is_some())
        .collect();
    let mut seen: Vec<(&str, String)> = traced
        .iter()
        .map(|(engine, c)| (*engine, c.path.clone()))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("D", "/microserving/prep_recv".to_owned()),
            ("D", "/microserving/start_generate".to_owned()),
            ("P", "/microserving/remote_send".to_owned()),
        ],
        "the legs, and only they, carry a traceparent: {calls:?}"
    );
    for (engine, call) in traced {
        let leg = call.path.trim_start_matches("/microserving/");
        let expected = format!("00-{CLIENT_TRACE}-{}-01", hex(&named(&spans, leg).span_id));
        assert_eq!(
            call.traceparent.as_deref(),
            Some(expected.as_str()),
            "{engine} {leg}"
        );
    }
    assert!(
        calls
            .iter()
            .any(|(_, c)| c.path == "/v1/models" && c.traceparent.is_none()),
        "the probes went through the taps, untraced: {calls:?}"
    );
}

/// A vLLM handoff's legs are spans of their own under the handoff's: P's call names the
/// prefill leg as its parent and D's the decode leg, in the client's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_leg_of_a_vllm_handoff_is_the_parent_of_its_engine_call() {
    let (otlp, received) = otlp_receiver().await;
    let (_engines, endpoints, p_tap, d_tap) = tapped_pair("vllm").await;
    let router = router(&endpoints, &["--otlp-endpoint", &otlp], &[]).await;
    complete(
        &router,
        Some(&format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")),
    )
    .await;
    stop(router).await;

    let spans: Vec<Span> = received.spans().into_iter().map(|(_, s)| s).collect();
    let attempt = named(&spans, "attempt");
    let handoff = named(&spans, "vllm_handoff");
    assert_eq!(handoff.parent_span_id, attempt.span_id);
    for (leg, tap) in [("prefill_leg", &p_tap), ("decode_leg", &d_tap)] {
        let span = named(&spans, leg);
        assert_eq!(
            span.parent_span_id, handoff.span_id,
            "{leg} is a leg of the handoff"
        );
        let traced: Vec<String> = tap
            .calls()
            .into_iter()
            .filter_map(|c| c.traceparent)
            .collect();
        let expected = format!("00-{CLIENT_TRACE}-{}-01", hex(&span.span_id));
        assert_eq!(traced, [expected], "{leg}'s engine call");
    }
}

/// Configured by the environment alone (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`,
/// `OTEL_TRACES_SAMPLER_ARG=0`): a request without a `traceparent` is not sampled (nothing
/// exported, but its engine calls still carry its unsampled context), while a client's sampled
/// trace is always kept (parent-based), under the configured service name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_is_parent_based_and_the_environment_configures_it() {
    let (otlp, received) = otlp_receiver().await;
    let (_engines, endpoints, _p_tap, d_tap) = tapped_pair("mlc").await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_SERVICE_NAME", "edge-router"),
        ("OTEL_TRACES_SAMPLER_ARG", "0"),
    ];
    let router = router(&endpoints, &[], &env).await;
    complete(&router, None).await;
    let unsampled: Vec<String> = d_tap
        .calls()
        .into_iter()
        .filter_map(|c| c.traceparent)
        .collect();
    complete(
        &router,
        Some(&format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")),
    )
    .await;
    stop(router).await;

    assert_eq!(
        unsampled.len(),
        2,
        "prep_recv and start_generate on D: {unsampled:?}"
    );
    for traceparent in &unsampled {
        assert!(
            traceparent.ends_with("-00") && !traceparent.contains(CLIENT_TRACE),
            "an unsampled trace of the router's own: {traceparent}"
        );
    }
    let spans = received.spans();
    assert!(!spans.is_empty(), "the client's sampled trace is exported");
    for (service, span) in &spans {
        assert_eq!(service, "edge-router");
        assert_eq!(hex(&span.trace_id), CLIENT_TRACE, "{}", span.name);
    }
}

/// Without an endpoint nothing is traced: a client's `traceparent` goes no further than the
/// router, and no engine call carries one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_no_engine_call_carries_a_traceparent() {
    let (_engines, endpoints, p_tap, d_tap) = tapped_pair("mlc").await;
    let router = router(&endpoints, &[], &[]).await;
    complete(
        &router,
        Some(&format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")),
    )
    .await;
    stop(router).await;
    let calls: Vec<Call> = p_tap.calls().into_iter().chain(d_tap.calls()).collect();
    assert!(
        calls.iter().any(|c| c.path.starts_with("/microserving/")),
        "the request went through the taps: {calls:?}"
    );
    assert!(
        calls.iter().all(|c| c.traceparent.is_none()),
        "no traceparent: {calls:?}"
    );
}
