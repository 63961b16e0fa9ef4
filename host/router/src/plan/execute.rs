//! Runs a [`ValidPlan`] against the engines: prep-recv → remote-send → start-generate, or one
//! forward. Each step is one named function in its own tracing span (request id, attempt,
//! endpoint). The generation is returned as a stream and never buffered: the relay hands each
//! chunk to the client as it arrives.
//!
//! Errors are classified here, once: [`ExecError`] names the endpoint, the step and the
//! attempt, and says whether another attempt may help ([`ExecError::retryable`]), whether the
//! endpoint is to blame ([`ExecError::blames_endpoint`]) and how the policy should hear about
//! it ([`ExecError::failure_kind`]).
//!
//! No KV is left reserved: once prep_recv has answered, D holds pages for the request until
//! start_generate takes them over. An attempt that ends before that (remote_send failed or
//! timed out, start_generate was refused, the client left) drops its [`Reservation`], which
//! frees them in the background ([`release`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use switchyard_contract::{EndpointId, FailureKind, ValidPlan};
use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};
use switchyard_wire::sse::{ChunkStream, SseError};

use crate::cluster::{Cluster, InFlight};
use crate::microserving::{CallError, EngineClient, Release};

/// The microserving step an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    PrepRecv,
    RemoteSend,
    StartGenerate,
    Forward,
    /// Reading the generation stream after it started.
    Relay,
}

impl std::fmt::Display for StepKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StepKind::PrepRecv => "prep_recv",
            StepKind::RemoteSend => "remote_send",
            StepKind::StartGenerate => "start_generate",
            StepKind::Forward => "forward",
            StepKind::Relay => "relay",
        })
    }
}

/// A failed step of one attempt.
#[derive(Debug, thiserror::Error)]
#[error("attempt {attempt}: {step} on endpoint {endpoint} failed: {source}")]
pub struct ExecError {
    pub endpoint: EndpointId,
    pub step: StepKind,
    pub attempt: u32,
    #[source]
    pub source: CallError,
}

impl ExecError {
    /// Whether another attempt (through the policy) may succeed: the engine was unreachable,
    /// slow, overloaded or failed internally, or its stream broke. A 4xx answer means the
    /// request itself is wrong and is not retried.
    pub fn retryable(&self) -> bool {
        match &self.source {
            CallError::Connect { .. } | CallError::Timeout { .. } | CallError::Stream { .. } => {
                true
            }
            CallError::Status { status, .. } => *status >= 500 || *status == 429,
            CallError::Decode { .. } | CallError::Build { .. } => false,
        }
    }

    /// Whether the endpoint itself is to blame, so the failure counts toward ejecting it: it
    /// could not be reached, was too slow, failed internally (5xx), sent something unreadable,
    /// or its stream broke or stalled. A 4xx is the request's fault (and 429 is the engine
    /// pacing its load, not failing), so neither counts.
    pub fn blames_endpoint(&self) -> bool {
        match &self.source {
            CallError::Connect { .. }
            | CallError::Timeout { .. }
            | CallError::Stream { .. }
            | CallError::Decode { .. } => true,
            CallError::Status { status, .. } => *status >= 500,
            CallError::Build { .. } => false,
        }
    }

    /// Count this failure against its endpoint, when the endpoint is to blame.
    pub fn record(&self, cluster: &Cluster) {
        if self.blames_endpoint() {
            cluster.record_failure(self.endpoint, self);
        }
    }

    /// How the policy hears about this failure on the next attempt.
    pub fn failure_kind(&self) -> FailureKind {
        match &self.source {
            CallError::Timeout { .. } => FailureKind::Timeout,
            CallError::Stream {
                source: SseError::Idle(_),
                ..
            } => FailureKind::Timeout,
            _ => FailureKind::EndpointError,
        }
    }
}

/// The upstream identity of one attempt: every leg carries `upstream_id` in `user`.
#[derive(Debug, Clone)]
pub struct AttemptId {
    pub upstream_id: String,
    pub attempt: u32,
}

impl AttemptId {
    /// `<request id>-<attempt>`: engines reject an id that is already in flight, and an
    /// abandoned attempt may still be in flight on its engine.
    pub fn new(request_id: &str, attempt: u32) -> Self {
        AttemptId {
            upstream_id: format!("{request_id}-{attempt}"),
            attempt,
        }
    }
}

/// A generation in progress: the engine's chunks plus what the relay and metrics need.
pub struct Generation {
    pub chunks: ChunkStream,
    /// The endpoint producing the tokens.
    pub generator: EndpointId,
    /// Prompt tokens the decode endpoint already held (0 for forward).
    pub prefix_matched: u32,
    /// True when the plan had a remote-send and the decode endpoint's prefix cache made it
    /// unnecessary.
    pub remote_send_skipped: bool,
    /// Counts the generation on its endpoint until the stream is dropped.
    _in_flight: InFlight,
}

impl Generation {
    /// `in_flight` must count `generator`: it is released when the generation is dropped.
    pub fn new(
        chunks: ChunkStream,
        generator: EndpointId,
        prefix_matched: u32,
        remote_send_skipped: bool,
        in_flight: InFlight,
    ) -> Self {
        Generation {
            chunks,
            generator,
            prefix_matched,
            remote_send_skipped,
            _in_flight: in_flight,
        }
    }
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("generator", &self.generator)
            .field("prefix_matched", &self.prefix_matched)
            .field("remote_send_skipped", &self.remote_send_skipped)
            .finish_non_exhaustive()
    }
}

/// Runs one attempt's validated plan: the [`Executor`] against real engines, or a scripted fake
/// in the retry loop's tests (the loop's rules are easier to pin down without HTTP in the way).
pub trait Execute: Send + Sync + 'static {
    /// The endpoints plans are validated against and run on.
    fn cluster(&self) -> &Arc<Cluster>;

    /// Run `plan` for `body`; see [`Executor::execute`].
    fn execute(
        &self,
        plan: &ValidPlan,
        body: CompletionRequest,
        id: &AttemptId,
    ) -> impl Future<Output = Result<Generation, ExecError>> + Send;
}

impl Execute for Executor {
    fn cluster(&self) -> &Arc<Cluster> {
        Executor::cluster(self)
    }

    fn execute(
        &self,
        plan: &ValidPlan,
        body: CompletionRequest,
        id: &AttemptId,
    ) -> impl Future<Output = Result<Generation, ExecError>> + Send {
        Executor::execute(self, plan, body, id)
    }
}

/// Runs plans. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Executor {
    cluster: Arc<Cluster>,
    client: EngineClient,
}

impl Executor {
    pub fn new(cluster: Arc<Cluster>, client: EngineClient) -> Self {
        Executor { cluster, client }
    }

    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Run `plan` for `body` (prompt, sampling, max_tokens; `user` is set here). Returns once
    /// the generating engine has answered with its response headers.
    pub async fn execute(
        &self,
        plan: &ValidPlan,
        mut body: CompletionRequest,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        body.user = Some(id.upstream_id.clone());
        match *plan {
            ValidPlan::Forward { endpoint } => self.forward(endpoint, body, id).await,
            ValidPlan::Disagg {
                decode,
                end,
                remote_send,
            } => {
                let guard = self.guard(decode, StepKind::PrepRecv, id)?;
                let prep = self.prep_recv(decode, end, &body, id).await?;
                // From here until start_generate answers, D holds pages for this attempt.
                let start = StartGenerateRequest {
                    common: body,
                    begin: i64::from(end),
                };
                let reservation = Reservation::new(self, decode, start);
                let body = &reservation.request().common;
                let mut remote_send_skipped = false;
                if let Some(send) = remote_send {
                    let begin = send.begin.unwrap_or(prep.prefix_matched_length);
                    if begin < end {
                        self.remote_send(send.prefill, decode, begin, end, &prep, body, id)
                            .await?;
                    } else {
                        // D's prefix cache already holds [0, end): nothing to move.
                        remote_send_skipped = true;
                        tracing::debug!(request = %id.upstream_id, decode, end, "remote_send skipped");
                    }
                }
                // Whatever happens to the call now, the engine frees the pages itself: it
                // aborts a generation whose client is gone. Only a refusal leaves them
                // reserved (and a second start_generate for an id an MLC engine no longer
                // holds would crash it, so nothing is sent again after an unread answer).
                let start = reservation.hand_over();
                let chunks = match self.start_generate(decode, &start, id).await {
                    Ok(chunks) => chunks,
                    Err(e) => {
                        if matches!(e.source, CallError::Status { .. }) {
                            drop(Reservation::new(self, decode, start));
                        }
                        return Err(e);
                    }
                };
                Ok(Generation::new(
                    chunks,
                    decode,
                    prep.prefix_matched_length,
                    remote_send_skipped,
                    guard,
                ))
            }
        }
    }

    async fn prep_recv(
        &self,
        decode: EndpointId,
        end: u32,
        body: &CompletionRequest,
        id: &AttemptId,
    ) -> Result<PrepRecvResponse, ExecError> {
        let span = tracing::debug_span!("prep_recv", request = %id.upstream_id, attempt = id.attempt, endpoint = decode, end);
        let request = PrepRecvRequest {
            common: body.clone(),
            end: i64::from(end),
        };
        let url = self.url(decode, StepKind::PrepRecv, id)?;
        let result = self.client.prep_recv(url, &request).instrument(span).await;
        self.check(result, decode, StepKind::PrepRecv, id)
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "one call site; the names document the wire fields"
    )]
    async fn remote_send(
        &self,
        prefill: EndpointId,
        decode: EndpointId,
        begin: u32,
        end: u32,
        prep: &PrepRecvResponse,
        body: &CompletionRequest,
        id: &AttemptId,
    ) -> Result<(), ExecError> {
        let span = tracing::debug_span!("remote_send", request = %id.upstream_id, attempt = id.attempt, endpoint = prefill, decode, begin, end);
        let _guard = self.guard(prefill, StepKind::RemoteSend, id)?;
        let recv_rank = self
            .cluster
            .device_rank(decode)
            .ok_or_else(|| self.unknown(decode, StepKind::RemoteSend, id))?;
        let request = RemoteSendRequest {
            common: body.clone(),
            begin: i64::from(begin),
            end: i64::from(end),
            // Opaque to the router: D's metadata goes to P verbatim.
            kv_addr_info: prep.kv_append_metadata.clone(),
            recv_rank,
        };
        let url = self.url(prefill, StepKind::RemoteSend, id)?;
        let result = self
            .client
            .remote_send(url, &request)
            .instrument(span)
            .await;
        self.check(result, prefill, StepKind::RemoteSend, id)
    }

    async fn start_generate(
        &self,
        decode: EndpointId,
        request: &StartGenerateRequest,
        id: &AttemptId,
    ) -> Result<ChunkStream, ExecError> {
        let span = tracing::debug_span!("start_generate", request = %id.upstream_id, attempt = id.attempt, endpoint = decode, begin = request.begin);
        let url = self.url(decode, StepKind::StartGenerate, id)?;
        let result = self
            .client
            .start_generate(url, request)
            .instrument(span)
            .await;
        self.check(result, decode, StepKind::StartGenerate, id)
    }

    async fn forward(
        &self,
        endpoint: EndpointId,
        body: CompletionRequest,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let span = tracing::debug_span!("forward", request = %id.upstream_id, attempt = id.attempt, endpoint);
        let guard = self.guard(endpoint, StepKind::Forward, id)?;
        let url = self.url(endpoint, StepKind::Forward, id)?;
        let result = self.client.forward(url, &body).instrument(span).await;
        let chunks = self.check(result, endpoint, StepKind::Forward, id)?;
        Ok(Generation::new(chunks, endpoint, 0, false, guard))
    }

    /// Wrap a call result and tell the cluster how the endpoint did: a success, a failure
    /// that counts toward ejecting it, or, when it could not be reached at all, a sign it is
    /// down until its probe answers again.
    fn check<T>(
        &self,
        result: Result<T, CallError>,
        endpoint: EndpointId,
        step: StepKind,
        id: &AttemptId,
    ) -> Result<T, ExecError> {
        match result {
            Ok(value) => {
                self.cluster.record_success(endpoint);
                Ok(value)
            }
            Err(source) => {
                if source.is_unreachable() {
                    self.cluster.mark_unhealthy(endpoint);
                }
                let error = ExecError {
                    endpoint,
                    step,
                    attempt: id.attempt,
                    source,
                };
                error.record(&self.cluster);
                Err(error)
            }
        }
    }

    fn url(&self, endpoint: EndpointId, step: StepKind, id: &AttemptId) -> Result<&str, ExecError> {
        self.cluster
            .url(endpoint)
            .ok_or_else(|| self.unknown(endpoint, step, id))
    }

    fn guard(
        &self,
        endpoint: EndpointId,
        step: StepKind,
        id: &AttemptId,
    ) -> Result<InFlight, ExecError> {
        self.cluster
            .in_flight(endpoint)
            .ok_or_else(|| self.unknown(endpoint, step, id))
    }

    /// Unreachable after validation (ids are checked against the same cluster), but a plan
    /// must never panic the router.
    fn unknown(&self, endpoint: EndpointId, step: StepKind, id: &AttemptId) -> ExecError {
        ExecError {
            endpoint,
            step,
            attempt: id.attempt,
            source: CallError::Connect {
                url: String::new(),
                reason: format!("endpoint {endpoint} does not exist"),
            },
        }
    }
}

// === impl Reservation ===

/// D's prep_recv reservation for one attempt, until start_generate takes it over. Dropped
/// before that, whatever the reason, it starts a [`release`] in the background.
struct Reservation {
    client: EngineClient,
    cluster: Arc<Cluster>,
    decode: EndpointId,
    /// The start_generate this attempt will send, and the one a release sends.
    request: Option<StartGenerateRequest>,
}

impl Reservation {
    fn new(executor: &Executor, decode: EndpointId, request: StartGenerateRequest) -> Self {
        Reservation {
            client: executor.client.clone(),
            cluster: Arc::clone(&executor.cluster),
            decode,
            request: Some(request),
        }
    }

    fn request(&self) -> &StartGenerateRequest {
        // Taken only by `hand_over` (which consumes the guard) or `drop`.
        self.request
            .as_ref()
            .expect("the request lives as long as the guard")
    }

    /// The start_generate to send: once it is on its way, the engine owns the pages.
    fn hand_over(mut self) -> StartGenerateRequest {
        self.request
            .take()
            .expect("the request lives as long as the guard")
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let Some(request) = self.request.take() else {
            return;
        };
        let Some(url) = self.cluster.url(self.decode).map(str::to_owned) else {
            return;
        };
        // Drop runs inside the attempt's task, on the runtime; a runtime shutting down has no
        // engines left to call either.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release(self.client.clone(), url, self.decode, request));
        }
    }
}

/// How long a release keeps trying: a decode engine frozen for minutes still gets its pages
/// back when it resumes, and nothing keeps trying forever.
const RELEASE_PATIENCE: Duration = Duration::from_secs(600);
const RELEASE_BACKOFF_MIN: Duration = Duration::from_millis(50);
const RELEASE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Free D's reservation for `request.common.user`: try, and while the engine is busy with it
/// (a transfer still writing it), frozen or failing, try again with backoff, for at most
/// [`RELEASE_PATIENCE`]. An engine whose process is gone took its reservations with it.
async fn release(
    client: EngineClient,
    url: String,
    decode: EndpointId,
    request: StartGenerateRequest,
) {
    let user = request.common.user.clone().unwrap_or_default();
    let give_up = Instant::now() + RELEASE_PATIENCE;
    let mut backoff = RELEASE_BACKOFF_MIN;
    loop {
        match client.release(&url, &request).await {
            Release::Freed => {
                tracing::debug!(request = %user, endpoint = decode, "KV reservation released");
                return;
            }
            Release::Gone(why) => {
                tracing::debug!(request = %user, endpoint = decode, %why, "KV reservation already gone");
                return;
            }
            Release::Later(why) if Instant::now() + backoff < give_up => {
                tracing::debug!(request = %user, endpoint = decode, %why, retry_in = ?backoff, "KV reservation not released yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RELEASE_BACKOFF_MAX);
            }
            Release::Later(why) => {
                tracing::warn!(request = %user, endpoint = decode, %why, "gave up releasing a KV reservation; the engine must expire it");
                return;
            }
        }
    }
}
