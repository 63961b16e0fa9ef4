//! Runs a [`ValidPlan`] against the engines: MLC's prep-recv → remote-send → start-generate,
//! vLLM's and SGLang's handoffs (in [`super::handoff`]), or one forward. Each step is one named function in its own tracing span (request id, attempt,
//! endpoint). The generation is returned as a stream and never buffered: the relay hands each
//! chunk to the client as it arrives.
//!
//! MLC legs ask for the generated token ids (`return_token_ids`), which a broken or preempted
//! stream is continued from exactly, and for `logprobs`. MLC's engines ignore the field they do
//! not know (their request models ignore unknown fields) but send one `logprobs` entry per
//! generated token: the router then continues from the delivered text re-tokenized, counting
//! the tokens as the engine did (see [`super::relay::Delivered`]).
//!
//! Errors are classified here, once: [`ExecError`] names the endpoint, the step and the
//! attempt, and says whether another attempt may help ([`ExecError::retryable`]), whether the
//! endpoint is to blame ([`ExecError::blames_endpoint`]) and how the policy should hear about
//! it ([`ExecError::failure_kind`]).
//!
//! No KV is left reserved. prep_recv and start_generate run on tasks of their own
//! ([`detached`]): once such a call may have reached D, only its answer says whether D holds
//! pages for the request, so the answer is always read, even when the attempt was dropped
//! meanwhile. Between a successful prep_recv and start_generate, D's pages belong to a
//! [`Reservation`]; an attempt that ends in between (remote_send failed or timed out,
//! start_generate was refused, the client left) frees them in the background ([`release`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use serde_json::{Map, Value};
use switchyard_contract::{EndpointId, FailureKind, Protocol, ValidPlan};
use switchyard_wire::client::{ClientBody, Route};
use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};
use switchyard_wire::sse::{ChunkStream, SseError};

use crate::cluster::{
    Cluster, EndpointError, EndpointSpec, InFlight, Owner, ProbeConfig, spawn_probe,
};
use crate::engine_client::{CallError, EngineClient, Release, Upstream};

/// The microserving step an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    PrepRecv,
    RemoteSend,
    StartGenerate,
    Forward,
    /// The prefill leg of a vLLM or SGLang handoff.
    PrefillLeg,
    /// The decode leg of a vLLM or SGLang handoff, up to its answer's head.
    DecodeLeg,
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
            StepKind::PrefillLeg => "prefill leg",
            StepKind::DecodeLeg => "decode leg",
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
            CallError::Connect { .. }
            | CallError::Closed { .. }
            | CallError::Timeout { .. }
            | CallError::Stream(_) => true,
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
            | CallError::Closed { .. }
            | CallError::Timeout { .. }
            | CallError::Stream(_)
            | CallError::Decode { .. } => true,
            CallError::Status { status, .. } => *status >= 500,
            CallError::Build { .. } => false,
        }
    }

    /// Whether the engine refused the request itself (4xx other than 429): retrying cannot help
    /// and the client hears the 4xx.
    pub fn is_clients(&self) -> bool {
        matches!(self.source, CallError::Status { status, .. } if (400..500).contains(&status) && status != 429)
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
            CallError::Stream(SseError::Idle(_)) => FailureKind::Timeout,
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

/// What one attempt sends.
#[derive(Debug, Clone)]
pub struct AttemptBody {
    /// The request as token ids, with the router's sampling fields: what MLC engines get, and
    /// what every engine gets once a stream is continued (prompt plus the tokens delivered).
    pub tokens: CompletionRequest,
    /// The client's own body, until the client has seen a token: what vLLM, SGLang and OpenAI
    /// engines get (their protocols change it per leg; chat stays chat).
    pub client: Option<Arc<ClientBody>>,
}

impl AttemptBody {
    /// The route and body of a leg to an engine speaking `protocol` (not MLC): the client's
    /// body, or, for a continuation, the token-id prompt on `/v1/completions`. A streaming leg
    /// asks for the generated ids (`return_token_ids`, on every leg of the handoff: the specs
    /// want both legs' bodies alike) so that a broken stream is continued from exactly what
    /// was delivered; SGLang refuses the field on streamed chat, and a plain OpenAI server may
    /// refuse any field it does not know, so those are continued from the re-tokenized text.
    pub(super) fn leg(&self, protocol: Protocol) -> (&'static str, Map<String, Value>) {
        let (route, mut fields) = match &self.client {
            Some(client) => (client.route, client.fields().clone()),
            None => (Route::Completions, continuation_fields(&self.tokens)),
        };
        let streamed = streams(&fields);
        let wants_ids = match protocol {
            Protocol::Vllm => true,
            Protocol::Sglang => route == Route::Completions,
            Protocol::Mlc | Protocol::Openai => false,
        };
        if streamed && wants_ids {
            fields.insert("return_token_ids".into(), Value::Bool(true));
        }
        (route.path(), fields)
    }
}

/// An MLC call's request, asking for the generated ids (`return_token_ids`) and, since MLC's
/// engines ignore that field, for `logprobs`, which they answer with one entry per generated
/// token. Every call of a disaggregated request carries both: MLC's engines keep the
/// parameters prep_recv brought.
fn counted(mut tokens: CompletionRequest) -> CompletionRequest {
    tokens.return_token_ids = true;
    tokens.logprobs = true;
    tokens
}

/// Whether a leg's body asks for a stream.
pub(super) fn streams(fields: &Map<String, Value>) -> bool {
    fields.get("stream").and_then(Value::as_bool) == Some(true)
}

/// A continuation's body for a non-MLC engine: the token-id prompt and the router's sampling
/// fields, without the nulls and MLC-only fields an MLC body spells out.
fn continuation_fields(tokens: &CompletionRequest) -> Map<String, Value> {
    let Ok(Value::Object(mut fields)) = serde_json::to_value(tokens) else {
        unreachable!("a CompletionRequest serializes to an object");
    };
    fields.retain(|name, value| !value.is_null() && name != "debug_config" && name != "user");
    fields
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
        body: AttemptBody,
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
        body: AttemptBody,
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

    pub(super) fn client(&self) -> &EngineClient {
        &self.client
    }

    /// Add an endpoint to the live list and start probing it: it serves once its probe
    /// answers.
    pub fn add_endpoint(&self, spec: &EndpointSpec, owner: Owner) -> Result<u32, EndpointError> {
        let id = self.cluster.add(spec, owner)?;
        spawn_probe(&self.cluster, &self.client, ProbeConfig::default(), id);
        Ok(id)
    }

    /// Run `plan` for `body` (on MLC legs, `user` is set to the attempt's upstream id here).
    /// Returns once the generating engine has answered with its response headers.
    pub async fn execute(
        &self,
        plan: &ValidPlan,
        mut body: AttemptBody,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        body.tokens.user = Some(id.upstream_id.clone());
        match *plan {
            ValidPlan::Forward { endpoint } => {
                match self.cluster.protocol(endpoint).unwrap_or_default() {
                    Protocol::Mlc => self.forward(endpoint, counted(body.tokens), id).await,
                    protocol => self.forward_leg(endpoint, protocol, &body, id).await,
                }
            }
            ValidPlan::Vllm { prefill, decode } => {
                self.vllm_handoff(prefill, decode, &body, id).await
            }
            ValidPlan::Sglang { prefill, decode } => {
                self.sglang_handoff(prefill, decode, &body, id).await
            }
            ValidPlan::Disagg {
                decode,
                end,
                remote_send,
            } => {
                let guard = self.guard(decode, StepKind::PrepRecv, id)?;
                let (prep, reservation) = self
                    .prep_recv(decode, end, counted(body.tokens), id)
                    .await?;
                let mut remote_send_skipped = false;
                if let Some(send) = remote_send {
                    let begin = send.begin.unwrap_or(prep.prefix_matched_length);
                    if begin < end {
                        let body = &reservation.request().common;
                        self.remote_send(send.prefill, decode, begin, end, &prep, body, id)
                            .await?;
                    } else {
                        // D's prefix cache already holds [0, end): nothing to move.
                        remote_send_skipped = true;
                        tracing::debug!(request = %id.upstream_id, decode, end, "remote_send skipped");
                    }
                }
                let chunks = self.start_generate(decode, reservation, id).await?;
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

    /// prep_recv on D; on success, D's pages for `[0, end)` are the returned [`Reservation`]'s.
    async fn prep_recv(
        &self,
        decode: EndpointId,
        end: u32,
        body: CompletionRequest,
        id: &AttemptId,
    ) -> Result<(PrepRecvResponse, Reservation), ExecError> {
        let span = tracing::debug_span!("prep_recv", request = %id.upstream_id, attempt = id.attempt, endpoint = decode, end);
        let engine = self.upstream(decode, StepKind::PrepRecv, id)?;
        let mut pending = Reservation {
            client: self.client.clone(),
            engine,
            decode,
            request: Some(StartGenerateRequest {
                common: body,
                begin: i64::from(end),
            }),
            armed: false,
        };
        let request = PrepRecvRequest {
            common: pending.request().common.clone(),
            end: i64::from(end),
        };
        let call = async move {
            let answer = pending.client.prep_recv(&pending.engine, &request).await;
            // Armed before anyone may see it: dropped anywhere from here (with the attempt,
            // or unread in the channel), it frees D's pages.
            if answer.is_ok() {
                pending.arm();
            }
            (answer, pending)
        };
        let (answer, reservation) = detached(call.instrument(span))
            .await
            .ok_or_else(|| self.lost(decode, StepKind::PrepRecv, id))?;
        let prep = self.check(answer, decode, StepKind::PrepRecv, id)?;
        Ok((prep, reservation))
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
        let engine = self.upstream(prefill, StepKind::RemoteSend, id)?;
        let result = self
            .client
            .remote_send(&engine, &request)
            .instrument(span)
            .await;
        self.check(result, prefill, StepKind::RemoteSend, id)
    }

    /// start_generate on D, which takes the reservation's pages over: from the moment the call
    /// may reach D, D frees them itself (it aborts a generation whose client is gone), so the
    /// answer is read even if the attempt is dropped, and a stream nobody wants is hung up on.
    /// Only a refusal leaves the pages reserved, and frees them like any other dropped
    /// reservation.
    async fn start_generate(
        &self,
        decode: EndpointId,
        mut reservation: Reservation,
        id: &AttemptId,
    ) -> Result<ChunkStream, ExecError> {
        let span = tracing::debug_span!("start_generate", request = %id.upstream_id, attempt = id.attempt, endpoint = decode);
        let mut taken = reservation.disarm();
        let call = async move {
            let answer = taken
                .client
                .start_generate(&taken.engine, taken.request())
                .await;
            if matches!(answer, Err(CallError::Status { .. })) {
                taken.arm();
            }
            answer
        };
        let answer = detached(call.instrument(span))
            .await
            .ok_or_else(|| self.lost(decode, StepKind::StartGenerate, id))?;
        self.check(answer, decode, StepKind::StartGenerate, id)
    }

    async fn forward(
        &self,
        endpoint: EndpointId,
        body: CompletionRequest,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let span = tracing::debug_span!("forward", request = %id.upstream_id, attempt = id.attempt, endpoint);
        let guard = self.guard(endpoint, StepKind::Forward, id)?;
        let engine = self.upstream(endpoint, StepKind::Forward, id)?;
        let result = self.client.forward(&engine, &body).instrument(span).await;
        let chunks = self.check(result, endpoint, StepKind::Forward, id)?;
        Ok(Generation::new(chunks, endpoint, 0, false, guard))
    }

    /// Wrap a call result and tell the cluster how the endpoint did: a success, a failure
    /// that counts toward ejecting it, or, when it could not be reached at all, a sign it is
    /// down until its probe answers again.
    pub(super) fn check<T>(
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
            Err(source) => Err(self.failed(source, endpoint, step, id)),
        }
    }

    /// A failed call, told to the cluster (see [`Executor::check`]).
    pub(super) fn failed(
        &self,
        source: CallError,
        endpoint: EndpointId,
        step: StepKind,
        id: &AttemptId,
    ) -> ExecError {
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
        error
    }

    pub(super) fn upstream(
        &self,
        endpoint: EndpointId,
        step: StepKind,
        id: &AttemptId,
    ) -> Result<Upstream, ExecError> {
        self.cluster
            .upstream(endpoint)
            .ok_or_else(|| self.unknown(endpoint, step, id))
    }

    pub(super) fn guard(
        &self,
        endpoint: EndpointId,
        step: StepKind,
        id: &AttemptId,
    ) -> Result<InFlight, ExecError> {
        self.cluster
            .in_flight(endpoint)
            .ok_or_else(|| self.unknown(endpoint, step, id))
    }

    /// A detached call's task ended without an answer (it panicked, or the runtime is going).
    pub(super) fn lost(&self, endpoint: EndpointId, step: StepKind, id: &AttemptId) -> ExecError {
        ExecError {
            endpoint,
            step,
            attempt: id.attempt,
            source: CallError::Stream(SseError::Transport(
                "the call ended without an answer".into(),
            )),
        }
    }

    /// Unreachable after validation (ids are checked against the same cluster), but a plan
    /// must never panic the router.
    fn unknown(&self, endpoint: EndpointId, step: StepKind, id: &AttemptId) -> ExecError {
        ExecError {
            endpoint,
            step,
            attempt: id.attempt,
            source: CallError::Connect {
                reason: format!("endpoint {endpoint} does not exist"),
            },
        }
    }
}

// === impl Reservation ===

/// D's pages for one attempt, from a successful prep_recv until start_generate takes them
/// over. Dropped while armed, whatever the reason, it frees them in the background
/// ([`release`]).
struct Reservation {
    client: EngineClient,
    /// D.
    engine: Upstream,
    decode: EndpointId,
    /// The start_generate that takes the pages over, and the one a release sends.
    request: Option<StartGenerateRequest>,
    armed: bool,
}

impl Reservation {
    fn request(&self) -> &StartGenerateRequest {
        // Taken only by `drop`.
        self.request
            .as_ref()
            .expect("the request lives as long as the reservation")
    }

    /// This reservation, unarmed (a call in flight decides what it becomes), leaving an
    /// empty, unarmed one behind.
    fn disarm(&mut self) -> Reservation {
        self.armed = false;
        Reservation {
            client: self.client.clone(),
            engine: self.engine.clone(),
            decode: self.decode,
            request: self.request.take(),
            armed: false,
        }
    }

    /// D holds the pages: free them if this is dropped.
    fn arm(&mut self) {
        self.armed = true;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let (true, Some(request)) = (self.armed, self.request.take()) else {
            return;
        };
        // Drop runs on the runtime; one that is shutting down has no engines left to call.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            runtime.spawn(release(self.client.clone(), engine, self.decode, request));
        }
    }
}

/// Runs `call` on a task of its own, so it runs to its answer even if the caller is dropped.
/// An answer nobody reads is dropped: answers clean up after themselves when dropped (an armed
/// [`Reservation`] frees its pages, a stream hangs up). `None`: the task ended without an
/// answer.
pub(super) async fn detached<T: Send + 'static>(
    call: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        // Nobody listening: the answer is dropped here.
        let _ = tx.send(call.await);
    });
    rx.await.ok()
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
    engine: Upstream,
    decode: EndpointId,
    request: StartGenerateRequest,
) {
    let user = request.common.user.clone().unwrap_or_default();
    let give_up = Instant::now() + RELEASE_PATIENCE;
    let mut backoff = RELEASE_BACKOFF_MIN;
    loop {
        match client.release(&engine, &request).await {
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
