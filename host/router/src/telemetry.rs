//! OpenTelemetry traces: where they go, the subscriber layer that exports them, and the W3C
//! trace context that joins a request's spans to its client's and to its engines'.
//!
//! Off unless an OTLP endpoint is given (`--otlp-endpoint`, the file's `otlp_endpoint`, or the
//! standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`). Off costs
//! nothing a request would notice: no exporter, no layer, no request span ([`request_span`] is
//! `Span::none()`), no `traceparent` formatted; the attempt, policy and leg spans are `debug`
//! spans that nothing is interested in unless `RUST_LOG` asks for them.
//!
//! On, one span per client request (`gen_ai.*` attributes of the GenAI semantic conventions
//! where they apply), a child per attempt, and under it one per policy call and per engine leg;
//! each engine call carries a `traceparent` naming its leg span, so the engines' own spans join
//! the trace. A client's `traceparent` makes the request span its child; sampling is
//! parent-based (a sampled client trace is always kept), else `OTEL_TRACES_SAMPLER_ARG`'s ratio.
//! A request whose trace is not sampled keeps its own span (its `trace_id` for the logs, and the
//! unsampled `traceparent` its engine calls carry) and nothing under it is made for the
//! exporter ([`SampledRequests`]): at a ratio of 1% the other 99% do not pay for spans no one
//! will see.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing::field::Empty;
use tracing::subscriber::Interest;
use tracing::{Metadata, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{FilterExt as _, LevelFilter, Targets};
use tracing_subscriber::layer::{Context, Filter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use crate::Summary;

/// The service name spans are exported under unless `OTEL_SERVICE_NAME` says otherwise.
pub const DEFAULT_SERVICE_NAME: &str = "switchyard";

/// Where and how traces are exported.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The full URL spans are sent to (`…/v1/traces` for OTLP/HTTP).
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    pub service_name: String,
    /// The share of root traces kept; a client's sampled trace is always kept.
    pub ratio: f64,
}

/// `OTEL_EXPORTER_OTLP_PROTOCOL`: the two switchyard speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `http/protobuf`, the OpenTelemetry default.
    HttpProtobuf,
    Grpc,
}

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "OTEL_EXPORTER_OTLP_PROTOCOL: {0:?} is not a protocol switchyard exports with (http/protobuf or grpc)"
    )]
    Protocol(String),
    #[error("OTEL_TRACES_SAMPLER_ARG: {0:?} is not a ratio from 0 to 1")]
    Ratio(String),
    #[error("cannot read the system's root certificates for the OTLP endpoint: {0}")]
    Roots(std::io::Error),
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
const PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
const SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
const SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";

impl TraceSettings {
    /// The settings `configured` (the flag's or the file's endpoint, a collector's base URL as
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is) and the process environment give; `None`: tracing off.
    pub fn resolve(configured: Option<&str>) -> Result<Option<TraceSettings>, TelemetryError> {
        Self::from_env(configured, |name| {
            std::env::var(name).ok().filter(|v| !v.is_empty())
        })
    }

    fn from_env(
        configured: Option<&str>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TraceSettings>, TelemetryError> {
        let protocol = match env(PROTOCOL).as_deref() {
            None | Some("http/protobuf") => OtlpProtocol::HttpProtobuf,
            Some("grpc") => OtlpProtocol::Grpc,
            Some(other) => return Err(TelemetryError::Protocol(other.to_owned())),
        };
        // The OpenTelemetry rule: a signal's own endpoint is used as is; the base endpoint
        // gets the signal's path over HTTP (gRPC names the service in the request instead).
        let base = |url: &str| match protocol {
            OtlpProtocol::HttpProtobuf => format!("{}/v1/traces", url.trim_end_matches('/')),
            OtlpProtocol::Grpc => url.to_owned(),
        };
        let endpoint = match (configured, env(TRACES_ENDPOINT)) {
            (Some(url), _) => base(url),
            (None, Some(url)) => url,
            (None, None) => match env(ENDPOINT) {
                Some(url) => base(&url),
                None => return Ok(None),
            },
        };
        let ratio = match env(SAMPLER_ARG) {
            None => 1.0,
            Some(arg) => arg
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or(TelemetryError::Ratio(arg))?,
        };
        Ok(Some(TraceSettings {
            endpoint,
            protocol,
            service_name: env(SERVICE_NAME).unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned()),
            ratio,
        }))
    }
}

/// Whether spans are exported: set once, when [`Tracing::start`] runs.
static ON: AtomicBool = AtomicBool::new(false);

/// Whether traces are on in this process.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The exporting pipeline. [`Tracing::shutdown`] sends what is still batched.
pub struct Tracing {
    provider: SdkTracerProvider,
}

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

impl Tracing {
    /// Build the exporter and its batch processor. The exports run on `runtime` (the batch
    /// processor's thread hands each to it): the HTTP client and tonic need a Tokio runtime.
    pub fn start(
        settings: &TraceSettings,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Tracing, TelemetryError> {
        let _entered = runtime.enter();
        let exporter = opentelemetry_otlp::SpanExporter::builder();
        let exporter = match settings.protocol {
            OtlpProtocol::HttpProtobuf => exporter
                .with_http()
                .with_http_client(OnRuntime::new(runtime.clone())?)
                .with_endpoint(&settings.endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()?,
            OtlpProtocol::Grpc => exporter
                .with_tonic()
                .with_endpoint(&settings.endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()?,
        };
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(settings.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(sampler(settings.ratio))
            .with_resource(resource)
            .build();
        ON.store(true, Ordering::Relaxed);
        Ok(Tracing { provider })
    }

    /// The subscriber layer that turns the router's spans into OpenTelemetry spans, from
    /// `debug` up (the attempt, policy and leg spans are `debug`), and its events into span
    /// events; none under a request whose trace is not sampled ([`SampledRequests`]). Nothing
    /// else: dependencies' spans stay out of the trace, and their callsites are judged once (a
    /// target filter), not at every hit. A streamed answer's spans are entered at every poll,
    /// so entering one does no work: no busy/idle clock reads (two attributes nobody asked
    /// for) and no OpenTelemetry context attached (engine calls read their leg span's context
    /// from the span itself, [`inject`]).
    pub fn layer<S>(&self) -> impl Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    {
        export_layer(&self.provider)
    }

    /// Export what is still batched, then stop: on the way out, after the drain.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "traces not all exported");
        }
    }
}

/// Parent-based: a client's sampled trace is kept and its unsampled one is not; a new trace is
/// kept at `ratio`.
fn sampler(ratio: f64) -> Sampler {
    Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
}

/// [`Tracing::layer`]: `provider`'s spans from the router's.
fn export_layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + use<S>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("switchyard"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_filter(
            Targets::new()
                .with_target("switchyard_router", tracing::Level::DEBUG)
                .and(SampledRequests),
        )
}

/// On a request span whose trace is not sampled, its OpenTelemetry context: what the engine
/// calls under it carry, as none of the spans under it has one of its own
/// ([`SampledRequests`]).
struct Unsampled(opentelemetry::Context);

/// The exporter's filter for what happens under a request span: nothing under one marked
/// [`Unsampled`]. The sampler would drop those spans at their start anyway (parent-based), but
/// only after each was given an OpenTelemetry builder, its attributes and its events.
struct SampledRequests;

impl<S> Filter<S> for SampledRequests
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn enabled(&self, meta: &Metadata<'_>, cx: &Context<'_, S>) -> bool {
        meta.is_event()
            || cx.lookup_current().is_none_or(|current| {
                current
                    .scope()
                    .all(|span| span.extensions().get::<Unsampled>().is_none())
            })
    }

    /// Spans are judged where they are made; events, as the target filter judges them. A
    /// callsite judged at every hit is judged by every layer's filter at every hit (the log's
    /// too): events, many more than spans, keep their interest cached.
    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.is_span() {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }

    /// No level is left out: the target filter's hint stands (and `log` records below it are
    /// not turned into events only to be dropped).
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::TRACE)
    }
}

/// Marks `span` [`Unsampled`] with its `context`, in the registry that holds it (none in a
/// process whose subscriber has no registry: then nothing is marked, and every span is made).
fn mark_unsampled(span: &Span, context: opentelemetry::Context) {
    span.with_subscriber(|(id, dispatch)| {
        if let Some(span) = dispatch
            .downcast_ref::<Registry>()
            .and_then(|registry| registry.span(id))
        {
            span.extensions_mut().insert(Unsampled(context));
        }
    });
}

/// The context of the unsampled request `span` is part of, if it is part of one.
fn unsampled_context(span: &Span) -> Option<opentelemetry::Context> {
    span.with_subscriber(|(id, dispatch)| {
        let registry = dispatch.downcast_ref::<Registry>()?;
        registry.span(id)?.scope().find_map(|span| {
            let extensions = span.extensions();
            extensions.get::<Unsampled>().map(|u| u.0.clone())
        })
    })
    .flatten()
}

/// The OTLP/HTTP client: hyper's, over rustls with the system's roots for `https://`
/// collectors. The batch processor calls it from its own thread, off any runtime, so each
/// export is spawned on the router's.
#[derive(Debug)]
struct OnRuntime {
    client: opentelemetry_http::hyper::HyperClient<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    >,
    runtime: tokio::runtime::Handle,
}

impl OnRuntime {
    fn new(runtime: tokio::runtime::Handle) -> Result<OnRuntime, TelemetryError> {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_native_roots()
            .map_err(TelemetryError::Roots)?
            .https_or_http()
            .enable_http1()
            .build();
        Ok(OnRuntime {
            client: opentelemetry_http::hyper::HyperClient::new(connector, EXPORT_TIMEOUT, None),
            runtime,
        })
    }
}

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let client = self.client.clone();
        self.runtime
            .spawn(async move { client.send_bytes(request).await })
            .await?
    }
}

/// The span of one client request, continuing the trace of the client's `traceparent` if it
/// sent one: `Span::none()` with tracing off. `operation` is the GenAI operation (`chat`,
/// `text_completion`); the span's outcome fields are filled by [`record_outcome`].
pub(crate) fn request_span(
    headers: &http::HeaderMap,
    operation: &'static str,
    model: &str,
) -> Span {
    if !is_on() {
        return Span::none();
    }
    traced_request_span(headers, operation, model)
}

/// [`request_span`] with tracing on.
fn traced_request_span(headers: &http::HeaderMap, operation: &'static str, model: &str) -> Span {
    let span = tracing::info_span!(
        "request",
        otel.name = %format_args!("{operation} {model}"),
        otel.kind = "server",
        otel.status_code = Empty,
        trace_id = Empty,
        gen_ai.operation.name = operation,
        gen_ai.request.model = %model,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        switchyard.policy = Empty,
        switchyard.attempts = Empty,
        switchyard.ttft_ms = Empty,
        error.type = Empty,
    );
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if parent.span().span_context().is_valid() {
        // The only error is a span that has started already; this one has not.
        let _ = span.set_parent(parent);
    }
    // Starting the span's context runs the sampler: its decision is known from here on.
    let context = span.context();
    let trace = context.span().span_context().clone();
    span.record("trace_id", tracing::field::display(trace.trace_id()));
    if !trace.is_sampled() {
        mark_unsampled(&span, context);
    }
    span
}

/// The prompt's length in tokens, on the request's span, when the router tokenized it.
pub(crate) fn record_input_tokens(span: &Span, tokens: usize) {
    if !span.is_none() {
        let tokens = i64::try_from(tokens).unwrap_or(i64::MAX);
        span.record("gen_ai.usage.input_tokens", tokens);
    }
}

/// The policy that plans the request, on its span (nothing with tracing off).
pub(crate) fn record_policy(span: &Span, policy: &str) {
    if !span.is_none() {
        span.record("switchyard.policy", policy);
    }
}

/// What the request came to, on its span: attempts, completion tokens, time to first token,
/// and `error` (the error's kind) when it failed.
pub(crate) fn record_outcome(span: &Span, summary: &Summary, error: Option<&'static str>) {
    if span.is_none() {
        return;
    }
    // Integers as i64: tracing-opentelemetry exports other integers as text.
    span.record("switchyard.attempts", i64::from(summary.attempts));
    span.record(
        "gen_ai.usage.output_tokens",
        i64::from(summary.completion_tokens),
    );
    if let Some(ttft) = summary.ttft {
        span.record("switchyard.ttft_ms", ttft.as_secs_f64() * 1e3);
    }
    if let Some(kind) = error {
        span.record("otel.status_code", "error");
        span.record("error.type", kind);
    }
}

/// The current span's context as a `traceparent` (and `tracestate`) on an engine call's
/// `headers`. Called only with tracing on; the current span is the call's leg span, or, under a
/// request whose trace is not sampled, a span with no context of its own: then the request's
/// (unsampled) context, so the engine does not start a trace of its own either.
pub(crate) fn inject(headers: &mut http::HeaderMap) {
    let current = Span::current();
    let mut context = current.context();
    if !context.span().span_context().is_valid()
        && let Some(request) = unsampled_context(&current)
    {
        context = request;
    }
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        configured: Option<&str>,
        vars: &[(&str, &str)],
    ) -> Result<Option<TraceSettings>, TelemetryError> {
        TraceSettings::from_env(configured, |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn no_endpoint_means_no_tracing() {
        assert_eq!(settings(None, &[(SERVICE_NAME, "r")]).unwrap(), None);
    }

    #[test]
    fn the_base_endpoint_gets_the_traces_path_over_http_only() {
        let http = settings(None, &[(ENDPOINT, "http://collector:4318/")]).unwrap();
        let http = http.unwrap();
        assert_eq!(http.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(http.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(http.service_name, DEFAULT_SERVICE_NAME);
        assert_eq!(http.ratio, 1.0);
        let grpc = settings(
            None,
            &[(ENDPOINT, "http://collector:4317"), (PROTOCOL, "grpc")],
        );
        let grpc = grpc.unwrap().unwrap();
        assert_eq!(grpc.endpoint, "http://collector:4317");
        assert_eq!(grpc.protocol, OtlpProtocol::Grpc);
    }

    #[test]
    fn the_traces_endpoint_is_used_as_is_and_the_flag_wins_over_both() {
        let vars = [
            (ENDPOINT, "http://base:4318"),
            (TRACES_ENDPOINT, "http://traces:4318/custom"),
        ];
        let env = settings(None, &vars).unwrap().unwrap();
        assert_eq!(env.endpoint, "http://traces:4318/custom");
        let flag = settings(Some("http://flag:4318"), &vars).unwrap().unwrap();
        assert_eq!(flag.endpoint, "http://flag:4318/v1/traces");
    }

    #[test]
    fn service_name_and_ratio_come_from_the_environment() {
        let vars = [(SERVICE_NAME, "edge-router"), (SAMPLER_ARG, "0.01")];
        let s = settings(Some("http://c:4318"), &vars).unwrap().unwrap();
        assert_eq!((s.service_name.as_str(), s.ratio), ("edge-router", 0.01));
    }

    #[test]
    fn a_bad_protocol_or_ratio_is_refused() {
        let bad_protocol = settings(Some("http://c"), &[(PROTOCOL, "http/json")]);
        assert!(matches!(bad_protocol, Err(TelemetryError::Protocol(p)) if p == "http/json"));
        for arg in ["1.5", "-0.1", "half"] {
            let bad_ratio = settings(Some("http://c"), &[(SAMPLER_ARG, arg)]);
            assert!(matches!(bad_ratio, Err(TelemetryError::Ratio(a)) if a == arg));
        }
    }

    /// Under a request whose trace is not sampled nothing is made for the exporter (a span
    /// under it has no OpenTelemetry span of its own), and its engine calls still carry its
    /// unsampled trace; under a sampled one, each span is made and a call names its own.
    #[test]
    fn nothing_is_made_under_a_request_whose_trace_is_not_sampled() {
        use tracing_subscriber::layer::SubscriberExt as _;

        let client = |flags: &str| {
            let mut headers = http::HeaderMap::new();
            let traceparent =
                format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}");
            headers.insert("traceparent", traceparent.parse().unwrap());
            headers
        };
        // (ratio, the client's headers, sampled)
        let cases = [
            (0.0, http::HeaderMap::new(), false),
            (1.0, http::HeaderMap::new(), true),
            (1.0, client("00"), false),
            (0.0, client("01"), true),
        ];
        for (ratio, headers, sampled) in cases {
            let provider = SdkTracerProvider::builder()
                .with_sampler(sampler(ratio))
                .build();
            let subscriber = tracing_subscriber::registry().with(export_layer(&provider));
            tracing::subscriber::with_default(subscriber, || {
                let request = traced_request_span(&headers, "text_completion", "m");
                let request_id = request.context().span().span_context().span_id();
                let _in_request = request.enter();
                let leg = tracing::debug_span!("forward");
                let _in_leg = leg.enter();
                let mut call = http::HeaderMap::new();
                inject(&mut call);
                let traceparent = call["traceparent"].to_str().unwrap();
                let (trace, rest) = traceparent[3..].split_once('-').unwrap();
                let (parent, flags) = rest.split_once('-').unwrap();
                let case = format!("ratio {ratio}, client {headers:?}: {traceparent}");
                assert_eq!(
                    parent != request_id.to_string(),
                    sampled,
                    "{case}: the leg's own span made"
                );
                assert_eq!(flags, if sampled { "01" } else { "00" }, "{case}");
                if headers.contains_key("traceparent") {
                    assert_eq!(trace, "4bf92f3577b34da6a3ce929d0e0e4736", "{case}");
                }
            });
        }
    }
}
