//! The attempt loop: plan → execute → relay, again until the client has its whole response or
//! the failure budget is spent.
//!
//! The rules, in the order they apply:
//!
//! - **A policy fault** (a trap, deadline or memory cap, an `internal` error, an invalid plan)
//!   is reported to the planner ([`Planner::fallback`](switchyard_contract::Planner::fallback)), which may name a fallback planner for
//!   the attempt (the policy registry's fallback policy); with none, it ends the request.
//!   The policy's own answers `unavailable` and `rejected` end the request (no retry): the
//!   policy is deterministic enough that asking again gives the same answer.
//! - **A failed attempt** re-invokes the policy with `attempt + 1` and the failure in its
//!   context, after an exponential backoff with jitter, when its [`ExecError`] says another
//!   attempt may help (the engine unreachable, slow, 5xx/429, a broken stream; or ours: an
//!   endpoint gone since the plan was validated, a misconfigured one). The loop reads that
//!   classification, made where the failure was detected, and never a message. A 4xx answer
//!   is the request's fault and ends it.
//! - **Preemption** (`finish_reason == "preempt"`) and a stream that broke after text reached
//!   the client both **continue**: the next attempt's prompt is the original prompt plus the
//!   token ids of the text already delivered (re-tokenized with the serving tokenizer), its
//!   `max_tokens` is what is left, and the client sees one seamless stream whose final usage
//!   counts the original prompt and every delivered token. Its `cached_tokens`, where the
//!   generating engine reported one, is the last attempt's: what that engine found cached of
//!   its prompt (the original and the continuation), bounded by the original prompt's length.
//! - **The attempt cap** counts attempts that made no progress; an attempt that delivered text
//!   resets the backoff and does not count, so the loop is bounded by
//!   `max_attempts + max_tokens` attempts. Reached by failures, it ends the request with the
//!   last one ([`RouteError::Exhausted`]); by preemptions alone, with
//!   [`RouteError::Preempted`].
//! - **The retry budget** ([`budget`]) is the router's, not the request's: every attempt after
//!   an engine failure (with or without progress) draws on it, and a request that finds it
//!   spent fails at once. Continuations after a preemption never draw on it.
//! - **The request deadline** (`request_timeout`, from arrival) bounds all attempts together:
//!   an engine that streams one token a minute cannot keep a request alive for hours.
//! - Every attempt has its own upstream id (`<request id>-<attempt>`) on all of its legs.
//! - The client going away drops the attempt in flight, which closes every upstream
//!   connection (engines abort a request whose connection closes).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use backon::BackoffBuilder;
use futures::Stream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument as _;

use switchyard_contract::{
    EndpointId, EndpointSnapshot, Failure, FailureKind, Health, Outcome, OutcomeStatus, PlanError,
    Planner, PlanningError, PolicyContext, PolicyRequest, Protocol, RequestFlow, TranslateError,
    ValidPlan, validate,
};
use switchyard_wire::client::ClientBody;
use switchyard_wire::completion::{CompletionRequest, FinishReason, Prompt, Usage};

use crate::plan::{
    AttemptBody, AttemptId, CachedPrefixes, ClientGone, Delivered, ExecError, Execute, Executor,
    Origin, RelayEnd, TextSink, relay,
};

mod budget;
mod prompt;

pub use budget::{RetryBudget, RetryBudgetConfig};
pub use prompt::{PromptError, RoutePrompt, tokenizations};
pub(crate) use prompt::{TOKENIZE_INLINE_BYTES, tokenize};

/// How requests are retried and bounded, router-wide.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    pub retry: RetryPolicy,
    pub retry_budget: RetryBudgetConfig,
    /// From arrival to the end of the response, over every attempt.
    pub request_timeout: Duration,
}

/// `request_timeout`'s default: long enough for thousands of tokens on a slow engine, short
/// enough that a stuck request is gone within minutes.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            retry: RetryPolicy::default(),
            retry_budget: RetryBudgetConfig::default(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// Why a retry policy is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetryPolicyError {
    #[error("max attempts must be at least 1")]
    ZeroAttempts,
    #[error("the minimum backoff {min:?} is above the maximum {max:?}")]
    MinAboveMax { min: Duration, max: Duration },
}

/// How many failed attempts a request may make, and how long to wait between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    min_delay: Duration,
    max_delay: Duration,
}

impl RetryPolicy {
    pub fn try_new(
        max_attempts: u32,
        min_delay: Duration,
        max_delay: Duration,
    ) -> Result<Self, RetryPolicyError> {
        if max_attempts == 0 {
            return Err(RetryPolicyError::ZeroAttempts);
        }
        if min_delay > max_delay {
            return Err(RetryPolicyError::MinAboveMax {
                min: min_delay,
                max: max_delay,
            });
        }
        Ok(RetryPolicy {
            max_attempts,
            min_delay,
            max_delay,
        })
    }

    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Exponential delays with jitter, capped at `max_delay`.
    fn backoff(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        let max = self.max_delay;
        backon::ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
            .chain(std::iter::repeat(max))
    }
}

impl Default for RetryPolicy {
    /// The defaults the router's configuration declares, `--max-attempts`'s among them.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: crate::config::DEFAULT_MAX_ATTEMPTS,
            min_delay: crate::config::RETRY_MIN_DELAY,
            max_delay: crate::config::RETRY_MAX_DELAY,
        }
    }
}

/// Why a request failed, as the client hears about it.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Policy(TranslateError),
    #[error("the policy returned an invalid plan: {0}")]
    InvalidPlan(PlanError),
    #[error("gave up after {attempts} failed attempts; last: {last}")]
    Exhausted { attempts: u32, last: ExecError },
    /// Every attempt the cap allows was preempted before it delivered anything.
    #[error(
        "gave up after {attempts} attempts preempted before delivering any text; last on endpoint {endpoint}"
    )]
    Preempted { attempts: u32, endpoint: EndpointId },
    #[error(
        "not retried: the router's retry budget is spent (too many engine failures); last: {last}"
    )]
    RetryBudget { last: ExecError },
    #[error("the request did not finish within {0:?} (request timeout)")]
    Deadline(Duration),
    #[error(transparent)]
    Engine(ExecError),
    /// The prompt or the text delivered so far could not be tokenized (the prompt is
    /// tokenized when first needed, which may be after the request was admitted).
    #[error("cannot tokenize {0}")]
    Tokenize(String),
}

impl RouteError {
    /// The error's kind, a trace's `error.type`.
    fn kind(&self) -> &'static str {
        match self {
            RouteError::Policy(_) => "policy",
            RouteError::InvalidPlan(_) => "invalid_plan",
            RouteError::Exhausted { .. } => "exhausted",
            RouteError::Preempted { .. } => "preempted",
            RouteError::RetryBudget { .. } => "retry_budget",
            RouteError::Deadline(_) => "deadline",
            RouteError::Engine(_) => "engine",
            RouteError::Tokenize(_) => "tokenize",
        }
    }

    /// The engine failure behind this error, if an engine failed.
    pub fn engine_failure(&self) -> Option<&ExecError> {
        match self {
            RouteError::Exhausted { last, .. } | RouteError::RetryBudget { last } => Some(last),
            RouteError::Engine(e) => Some(e),
            _ => None,
        }
    }

    /// Whether the request itself is at fault: an engine refused it (4xx) or the policy
    /// rejected it.
    pub fn is_clients(&self) -> bool {
        match self {
            RouteError::Policy(TranslateError::Rejected { .. }) => true,
            RouteError::Engine(e) => e.origin() == Origin::Downstream,
            _ => false,
        }
    }
}

impl From<PlanningError> for RouteError {
    fn from(error: PlanningError) -> Self {
        match error {
            PlanningError::Translate(e) => RouteError::Policy(e),
            PlanningError::InvalidPlan(e) => RouteError::InvalidPlan(e),
        }
    }
}

/// What happened to one request, for metrics and the policy's `on-complete`.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Attempts started.
    pub attempts: u32,
    /// Attempts started after an engine failure.
    pub retries: u32,
    pub preemptions: u32,
    pub remote_sends_skipped: u32,
    /// Time spent in each `translate-request` call.
    pub policy_calls: Vec<Duration>,
    pub generator: Option<u32>,
    pub prefix_matched: u32,
    /// The generating endpoint's cached prefix in the last attempt's snapshot, from its KV
    /// events; `None` when it publishes none or its index was stale.
    pub predicted_prefix: Option<u32>,
    /// The generating engine's `cached_tokens` for the last attempt's prompt, as it reported.
    pub cached_tokens: Option<u32>,
    /// Whether `predicted_prefix` equalled `cached_tokens` rounded down to the endpoint's block
    /// size (a prediction capped at the whole blocks before the prompt's last token, which
    /// engines always compute): the index predicted what the engine found.
    pub prediction_hit: bool,
    pub completion_tokens: u32,
    /// Arrival to first text handed to the client.
    pub ttft: Option<Duration>,
}

/// What the client side of a request receives, in order: text deltas, then exactly one
/// `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// New text for the client.
    Text(String),
    /// The response is complete.
    Done(Box<Done>),
    /// The router gave up; whatever text was sent stays sent.
    Failed(Box<Failed>),
}

// Every slot of a request's event queue is as large as its largest event, and all but the last
// event are text: the last one's records are boxed, so that text sets the size (with them
// inline an event took about 200 bytes, and each block of 32 slots the queue keeps 6 KiB of
// every open stream).
const _: () = assert!(size_of::<Event>() <= size_of::<String>() + 8);

/// How a response completed: [`Event::Done`].
#[derive(Debug)]
pub struct Done {
    pub finish_reason: FinishReason,
    /// What the client is told it used; `None` when nothing reads it
    /// ([`RouteRequest::reads_usage`]).
    pub usage: Option<Usage>,
    pub summary: Summary,
}

/// Why the router gave up: [`Event::Failed`].
#[derive(Debug)]
pub struct Failed {
    pub error: RouteError,
    pub summary: Summary,
}

/// The relay's text goes to the client as [`Event::Text`]s.
impl TextSink for mpsc::Sender<Event> {
    async fn text(&self, text: String) -> Result<(), ClientGone> {
        self.send(Event::Text(text)).await.map_err(|_| ClientGone)
    }
}

/// One client request as the router routes it.
#[derive(Debug, Clone)]
pub struct RouteRequest {
    /// Numeric id given to the policy.
    pub id: u64,
    /// The client-visible id (`cmpl-<32 hex>`); upstream ids derive from it.
    pub request_id: String,
    /// Its prompt, tokenized when something first needs the ids (see [`RoutePrompt`]).
    pub prompt: RoutePrompt,
    pub max_tokens: u32,
    pub stream: bool,
    /// The client asked for a stream's usage (`stream_options.include_usage`); the engines are
    /// always asked for theirs.
    pub include_usage: bool,
    pub model: String,
    /// The client's OpenAI `user`, for the policy (the wire `user` is the upstream id).
    pub user: Option<String>,
    /// The request's `x-*` headers, lower-case names.
    pub headers: Vec<(String, String)>,
    /// Sampling parameters; prompt, max_tokens and user are set per attempt.
    pub template: CompletionRequest,
    /// The client's own body, for engines that take it as it came (vLLM, SGLang, OpenAI).
    pub client: Option<Arc<ClientBody>>,
    pub arrived: Instant,
    /// Its priority, tenant and deadline, as flow control read them.
    pub flow: Flow,
    /// Its trace span (see [`crate::telemetry`]); `Span::none()` with tracing off.
    pub span: tracing::Span,
    /// Its model's tokenizer when that is not the router's (another `[[models]]` entry's):
    /// what delivered text is re-tokenized with.
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
}

impl RouteRequest {
    /// Whether anything reads the request's final usage: a whole answer carries it, a stream
    /// only when its client asked for it, and a traced request records the prompt's length.
    /// When nothing does, a prompt no engine counted is not tokenized only to be counted.
    pub fn reads_usage(&self) -> bool {
        !self.stream || self.include_usage || !self.span.is_none()
    }
}

/// A request's priority, tenant and deadline, which the policy sees too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flow {
    /// Higher is more important; negative is sheddable.
    pub priority: i32,
    /// `None`: the shared tenant.
    pub tenant: Option<Arc<str>>,
    /// When the request must have started by.
    pub deadline: Option<Instant>,
}

impl Flow {
    /// What the policy is told, now.
    fn for_policy(&self) -> RequestFlow<'_> {
        RequestFlow {
            priority: self.priority,
            tenant: self.tenant.as_deref(),
            deadline_ms: self.deadline.map(|deadline| {
                let left = deadline.saturating_duration_since(Instant::now());
                u32::try_from(left.as_millis()).unwrap_or(u32::MAX)
            }),
        }
    }
}

/// Plans, executes and relays requests. Shared by every connection. `E` is a test seam: the
/// retry loop's unit tests run it against a scripted executor.
pub struct Router<E = Executor> {
    executor: E,
    planner: Arc<dyn Planner>,
    config: RouterConfig,
    budget: RetryBudget,
    tokenizer: Arc<tokenizers::Tokenizer>,
}

/// Per-request state that outlives a cancelled attempt (for the outcome report).
struct State {
    /// Plans every attempt of this request and hears its outcome.
    planner: Arc<dyn Planner>,
    summary: Summary,
    delivered: Delivered,
}

impl State {
    fn new(planner: Arc<dyn Planner>) -> Self {
        State {
            planner,
            summary: Summary::default(),
            delivered: Delivered::default(),
        }
    }
}

/// A request being routed: the routed request's `run` future plus the events it queued. The
/// routing has no task of its own: whoever polls it (the response body of a stream, the
/// handler of a non-streaming request) drives the whole request, so an engine's chunk is
/// read, reframed and written to the client in one task, and chunks that arrive together
/// leave together. Dropping it drops every upstream leg and reports the request to its
/// policy as cancelled.
///
/// The queue is read without registering a waker: only `run`, polled from here, fills it, so
/// whatever it queued is found right after. A registered waker would be the polling task's
/// own, and each event queued would wake that task while it runs, which the multi-thread
/// runtime answers by unparking another worker to steal it.
pub struct Routing {
    /// `None` once the request is over (its sender is then gone: the queue ends).
    run: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    events: mpsc::Receiver<Event>,
}

/// Events a request may queue before its run waits for the consumer: the client's socket sets
/// the pace, and a slow client holds back the engine's stream rather than the router's memory.
const EVENT_QUEUE: usize = 64;

impl Routing {
    /// The next queued event, `Ready(None)` once the run is over and the queue drained, else
    /// `Pending` (with no waker registered).
    fn queued(&mut self) -> Poll<Option<Event>> {
        match self.events.try_recv() {
            Ok(event) => Poll::Ready(Some(event)),
            Err(mpsc::error::TryRecvError::Disconnected) => Poll::Ready(None),
            Err(mpsc::error::TryRecvError::Empty) => Poll::Pending,
        }
    }
}

impl Stream for Routing {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let this = self.get_mut();
        loop {
            if let Poll::Ready(event) = this.queued() {
                return Poll::Ready(event);
            }
            // Nothing queued: drive the request until it queues an event or waits.
            let Some(run) = this.run.as_mut() else {
                // Unreachable: a finished run dropped its sender, so the queue said so above.
                return Poll::Ready(None);
            };
            if run.as_mut().poll(cx).is_ready() {
                this.run = None;
            } else {
                // The run waits on an engine or a timer, whose wakers are `cx`'s.
                return this.queued();
            }
        }
    }
}

impl std::fmt::Debug for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routing")
            .field("over", &self.run.is_none())
            .finish_non_exhaustive()
    }
}

/// A request and its state inside its run, which may be dropped at any await: the policy hears
/// the outcome either way.
struct Request {
    req: RouteRequest,
    state: State,
    /// The run finished (and reported the outcome) rather than being dropped.
    over: bool,
}

impl Drop for Request {
    fn drop(&mut self) {
        if !self.over {
            // The attempt in flight was dropped before this (it is a later local of the run),
            // so its upstream connections are closed by now.
            tracing::debug!(request = %self.req.request_id, "client went away; upstream legs dropped");
            report(&self.req, &self.state, OutcomeStatus::Cancelled);
        }
    }
}

/// How one attempt ended.
enum AttemptEnd {
    /// The request is over (done, failed or the client left).
    Over,
    /// Try again with this failure in the policy's context.
    Again {
        failure: Failure,
        progressed: bool,
        error: Option<ExecError>,
    },
}

impl<E: Execute> Router<E> {
    pub fn new(
        executor: E,
        planner: Arc<dyn Planner>,
        config: RouterConfig,
        tokenizer: Arc<tokenizers::Tokenizer>,
    ) -> Self {
        Router {
            executor,
            planner,
            budget: RetryBudget::new(config.retry_budget),
            config,
            tokenizer,
        }
    }

    pub fn executor(&self) -> &E {
        &self.executor
    }

    /// Route `req` with the router's planner; see [`Router::start_with`].
    pub fn start(self: &Arc<Self>, req: RouteRequest) -> Routing {
        self.start_with(req, Arc::clone(&self.planner))
    }

    /// Route `req` with a planner chosen for this request (the policy it selected); every
    /// attempt of the request is planned by it. Nothing runs until the returned [`Routing`] is
    /// polled; dropping it cancels the request and every upstream leg.
    pub fn start_with(self: &Arc<Self>, req: RouteRequest, planner: Arc<dyn Planner>) -> Routing {
        let (tx, events) = mpsc::channel(EVENT_QUEUE);
        let router = Arc::clone(self);
        let span = req.span.clone();
        let run = async move {
            let mut request = Request {
                req,
                state: State::new(planner),
                over: false,
            };
            router.budget.deposit();
            let timeout = router.config.request_timeout;
            let deadline = request.req.arrived + timeout;
            let run = router.run(&request.req, &tx, &mut request.state);
            if tokio::time::timeout_at(deadline, run).await.is_err() {
                // The attempt in flight was dropped with the run: its legs are closed.
                let (req, st) = (&request.req, &mut request.state);
                router
                    .fail(req, &tx, st, RouteError::Deadline(timeout))
                    .await;
            }
            request.over = true;
        };
        Routing {
            run: Some(Box::pin(run.instrument(span))),
            events,
        }
    }

    async fn run(&self, req: &RouteRequest, tx: &mpsc::Sender<Event>, st: &mut State) {
        let retry = &self.config.retry;
        let mut backoff = retry.backoff();
        let mut failures = 0u32;
        let mut last_failure = None;
        loop {
            // An i64: tracing-opentelemetry exports other integers as text.
            let number = i64::from(st.summary.attempts) + 1;
            let attempt = tracing::debug_span!("attempt", switchyard.attempt = number);
            match self
                .attempt(req, tx, st, last_failure)
                .instrument(attempt)
                .await
            {
                Ok(AttemptEnd::Over) => return,
                Ok(AttemptEnd::Again {
                    failure,
                    progressed,
                    error,
                }) => {
                    if progressed {
                        backoff = retry.backoff();
                    } else {
                        failures += 1;
                    }
                    if let Some(error) = error {
                        if !error.retryable() {
                            return self.fail(req, tx, st, RouteError::Engine(error)).await;
                        }
                        if failures >= retry.max_attempts {
                            let attempts = st.summary.attempts;
                            let e = RouteError::Exhausted {
                                attempts,
                                last: error,
                            };
                            return self.fail(req, tx, st, e).await;
                        }
                        if !self.budget.try_withdraw() {
                            let e = RouteError::RetryBudget { last: error };
                            return self.fail(req, tx, st, e).await;
                        }
                        tracing::info!(request = %req.request_id, %error, "retrying");
                        st.summary.retries += 1;
                    } else if failures >= retry.max_attempts {
                        // Preempted again and again without delivering anything.
                        let e = RouteError::Preempted {
                            attempts: st.summary.attempts,
                            endpoint: failure.endpoint,
                        };
                        return self.fail(req, tx, st, e).await;
                    }
                    last_failure = Some(failure);
                    if let Some(delay) = backoff.next() {
                        tokio::time::sleep(delay).await;
                    }
                }
                Err(error) => return self.fail(req, tx, st, error).await,
            }
        }
    }

    /// One attempt: plan, execute, relay.
    async fn attempt(
        &self,
        req: &RouteRequest,
        tx: &mpsc::Sender<Event>,
        st: &mut State,
        last_failure: Option<Failure>,
    ) -> Result<AttemptEnd, RouteError> {
        st.summary.attempts += 1;
        let attempt = st.summary.attempts;
        let continued = match &st.delivered.token_ids {
            Some(ids) => ids.clone(),
            None => self.continuation_tokens(req, &st.delivered.text)?,
        };
        // The engines' own count when they gave one: the re-tokenized text may count otherwise.
        let already = st
            .delivered
            .generated
            .unwrap_or_else(|| u32::try_from(continued.len()).unwrap_or(u32::MAX));
        let remaining = req.max_tokens.saturating_sub(already);
        if remaining == 0 {
            // Preempted right after the last token: the response is complete.
            let usage = self.client_usage(req, None, already, None).await?;
            self.finish(req, tx, st, FinishReason::Length, already, usage)
                .await;
            return Ok(AttemptEnd::Over);
        }
        let cluster = self.executor.cluster();
        // The readers known before the snapshot, a continuation among them.
        if self.reads_prompt_up_front(st.planner.as_ref()) || !continued.is_empty() {
            self.prompt_ids(req).await?;
        }
        let mut prompt = req.prompt.known().map(|ids| [ids, &continued].concat());
        // The whole prompt, so each endpoint's cached prefix counts what a continuation
        // re-sends too. Without ids no endpoint publishes KV events: there is nothing to look up.
        let (endpoints, pins) =
            cluster.snapshot_pinned(&req.model, prompt.as_deref().unwrap_or_default());
        // MLC engines take token ids, and an MLC plan's positions are checked against the
        // prompt's length: a snapshot with an MLC endpoint the policy may choose needs them.
        if prompt.is_none() && endpoints.iter().any(takes_token_ids) {
            prompt = Some(self.prompt_ids(req).await?.to_vec());
        }
        let context = PolicyContext {
            attempt,
            last_failure,
            endpoints,
        };
        let (plan, cached) = self.plan(req, prompt.as_deref(), remaining, context, st)?;
        let cached = cached.pinned(pins.clone());
        let prompt_len = prompt.as_ref().map_or(0, Vec::len);
        let mut tokens = req.template.clone();
        // No ids: the plan forwards the client's own body, which is what such engines get.
        tokens.prompt = Prompt::Tokens(prompt.unwrap_or_default());
        tokens.max_tokens = Some(remaining);
        let body = AttemptBody {
            tokens,
            // Once the client has text, only the token-id prompt continues it exactly.
            client: req.client.clone().filter(|_| continued.is_empty()),
            cached,
        };
        let id = AttemptId::new(&req.request_id, attempt);
        // Boxed: what running the plan holds until the generation starts (the attempt's body,
        // and the box `Executor::execute` puts its flow's legs in) is not kept by every open
        // stream's run for its whole life. Inline, the legs' requests, connects and timeouts
        // were the run's largest state by far (heaptrack: 10.7 KiB per open stream, release
        // build); since each flow is boxed on its own, this box holds only the rest.
        let executed = Box::pin(self.executor.execute(&plan, body, &id)).await;
        let mut generation = match executed {
            Ok(g) => {
                self.executor
                    .cluster()
                    .note_served(served_by(&plan), prompt_len, &pins);
                g
            }
            Err(error) => {
                return Ok(AttemptEnd::Again {
                    failure: failure_of(&error),
                    progressed: false,
                    error: Some(error),
                });
            }
        };
        st.summary.generator = Some(generation.generator);
        st.summary.prefix_matched = generation.prefix_matched;
        st.summary.remote_sends_skipped += u32::from(generation.remote_send_skipped);
        let before = st.delivered.text.len();
        let generated_before = st.delivered.generated;
        let end = relay(&mut generation, tx, attempt, &mut st.delivered).await;
        match &end {
            RelayEnd::Finished { .. } => {
                self.executor.cluster().record_success(generation.generator)
            }
            RelayEnd::Failed(error) => error.record(self.executor.cluster()),
            RelayEnd::Preempted | RelayEnd::ClientGone => {}
        }
        let progressed = st.delivered.text.len() > before;
        if st.summary.ttft.is_none() {
            st.summary.ttft = st.delivered.first_at.map(|t| t - req.arrived);
        }
        match end {
            RelayEnd::Finished {
                finish_reason,
                usage,
            } => {
                let this_attempt = match (usage, generated_before, st.delivered.generated) {
                    (Some(u), ..) => u.completion_tokens,
                    (None, Some(from), Some(now)) => now - from,
                    _ => self.count_tokens(req, &st.delivered.text[before..])?,
                };
                let cached = usage.and_then(|u| u.cached_tokens());
                self.check_prediction(generation.generator, prompt_len, cached, st);
                let completion = already.saturating_add(this_attempt);
                let usage = self
                    .client_usage(req, usage.map(|u| u.prompt_tokens), completion, cached)
                    .await?;
                self.finish(req, tx, st, finish_reason, completion, usage)
                    .await;
                Ok(AttemptEnd::Over)
            }
            RelayEnd::ClientGone => Ok(AttemptEnd::Over),
            RelayEnd::Preempted => {
                st.summary.preemptions += 1;
                tracing::debug!(request = %req.request_id, attempt, endpoint = generation.generator, "preempted; continuing");
                Ok(AttemptEnd::Again {
                    failure: Failure {
                        kind: FailureKind::Preempted,
                        endpoint: generation.generator,
                    },
                    progressed,
                    error: None,
                })
            }
            RelayEnd::Failed(error) => Ok(AttemptEnd::Again {
                failure: failure_of(&error),
                progressed,
                error: Some(error),
            }),
        }
    }

    /// The plan an attempt of `req` in `context` would run (the first: attempt 1 over this
    /// router's snapshot for the prompt, which the caller may narrow by marking endpoints
    /// unhealthy), validated, with the fallback planner asked on a policy fault; nothing runs
    /// and no outcome is reported. `switchyard epp` answers a gateway with the plan's
    /// endpoints (and asks again, with the endpoint marked failed, for fallbacks), and reports
    /// the outcome itself once the gateway's response ends.
    pub fn plan_only(
        &self,
        req: &RouteRequest,
        planner: Arc<dyn Planner>,
        context: PolicyContext,
    ) -> Result<ValidPlan, RouteError> {
        let mut st = State::new(planner);
        self.plan(req, req.prompt.known(), req.max_tokens, context, &mut st)
            .map(|(plan, _)| plan)
    }

    /// Whether `planner`'s requests need their prompt ids before the policy is asked: the
    /// policy reads them, or an endpoint publishes KV events (`cached-prefix` is computed from
    /// them). The later readers (an MLC endpoint in the snapshot, a continuation, the usage)
    /// ask for the ids when they need them.
    pub(crate) fn reads_prompt_up_front(&self, planner: &dyn Planner) -> bool {
        planner.reads().prompt || self.executor.cluster().indexes_kv()
    }

    /// The request's prompt ids, tokenizing it now if nothing did before.
    async fn prompt_ids<'r>(&self, req: &'r RouteRequest) -> Result<&'r [u32], RouteError> {
        let ids = req
            .prompt
            .ids()
            .await
            .map_err(|e| RouteError::Tokenize(format!("the prompt: {e}")))?;
        crate::telemetry::record_input_tokens(&req.span, ids.len());
        Ok(ids)
    }

    /// The usage the client is told, when something reads it ([`RouteRequest::reads_usage`]):
    /// `engine_prompt` is the engine's count of the prompt, if it gave one.
    async fn client_usage(
        &self,
        req: &RouteRequest,
        engine_prompt: Option<u32>,
        completion_tokens: u32,
        cached: Option<u32>,
    ) -> Result<Option<Usage>, RouteError> {
        if !req.reads_usage() {
            return Ok(None);
        }
        let prompt_tokens = self.prompt_tokens(req, engine_prompt).await?;
        Ok(Some(final_usage(prompt_tokens, completion_tokens, cached)))
    }

    /// The prompt's length in tokens for the client's usage: the router's count when it has
    /// one, else the engine's (`engine`), else the router tokenizes the prompt now.
    async fn prompt_tokens(
        &self,
        req: &RouteRequest,
        engine: Option<u32>,
    ) -> Result<u32, RouteError> {
        let len = match (req.prompt.known_len(), engine) {
            (Some(len), _) => len,
            (None, Some(engine)) => {
                crate::telemetry::record_input_tokens(&req.span, engine as usize);
                return Ok(engine);
            }
            (None, None) => self.prompt_ids(req).await?.len(),
        };
        Ok(u32::try_from(len).unwrap_or(u32::MAX))
    }

    /// Ask the request's planner for a plan in `context` and validate it against the snapshot
    /// it saw; on a policy fault, ask the fallback the planner names. With the plan, what each
    /// endpoint was predicted to hold of `prompt` (its legs count the rest as pending prefill).
    fn plan(
        &self,
        req: &RouteRequest,
        prompt: Option<&[u32]>,
        max_tokens: u32,
        context: PolicyContext,
        st: &mut State,
    ) -> Result<(ValidPlan, CachedPrefixes), RouteError> {
        // An adapter's base model, from what its engines list (a lookup; a copy for adapters only).
        let base_model = self.executor.cluster().base_model(&req.model);
        let request = PolicyRequest {
            id: req.id,
            prompt,
            max_tokens,
            stream: req.stream,
            model: &req.model,
            user: req.user.as_deref(),
            headers: &req.headers,
            flow: req.flow.for_policy(),
            base_model: base_model.as_deref(),
        };
        let planner = Arc::clone(&st.planner);
        let planned = match Self::ask(planner.as_ref(), &request, &context, st) {
            Err(error) if error.is_fault() => match planner.fallback(&error) {
                Some(fallback) => Self::ask(fallback.as_ref(), &request, &context, st),
                None => Err(error),
            },
            planned => planned,
        };
        let plan = planned?;
        // What the index predicts the generating engine holds of this attempt's prompt.
        // Ids are not positions: a removed endpoint leaves the snapshot.
        st.summary.predicted_prefix = context
            .endpoints
            .iter()
            .find(|e| e.id == plan.generator())
            .and_then(|e| e.cached_prefix);
        // Without ids the prompt counts nothing toward any endpoint's pending prefill.
        let prompt_len = prompt.map_or(0, |p| u32::try_from(p.len()).unwrap_or(u32::MAX));
        Ok((plan, CachedPrefixes::new(prompt_len, &context.endpoints)))
    }

    /// One `translate-request` call, timed, and its plan validated against the snapshot the
    /// planner saw.
    fn ask(
        planner: &dyn Planner,
        request: &PolicyRequest<'_>,
        context: &PolicyContext,
        st: &mut State,
    ) -> Result<ValidPlan, PlanningError> {
        let endpoints = i64::try_from(context.endpoints.len()).unwrap_or(i64::MAX);
        let _span = tracing::debug_span!("policy", switchyard.endpoints = endpoints).entered();
        let started = std::time::Instant::now();
        let plan = planner.translate(request, context);
        st.summary.policy_calls.push(started.elapsed());
        let plan = plan.map_err(PlanningError::Translate)?;
        // Only MLC plans read the length, and a snapshot with an MLC endpoint has the ids.
        let prompt_len = request.prompt.map_or(0, |p| p.len() as u32);
        validate(&plan, prompt_len, &context.endpoints).map_err(PlanningError::InvalidPlan)
    }

    /// Compares the index's prediction for the generating endpoint with what its engine
    /// reported having cached.
    fn check_prediction(
        &self,
        generator: u32,
        prompt_len: usize,
        cached: Option<u32>,
        st: &mut State,
    ) {
        st.summary.cached_tokens = cached;
        if let (Some(predicted), Some(cached)) = (st.summary.predicted_prefix, cached) {
            let prompt_len = u32::try_from(prompt_len).unwrap_or(u32::MAX);
            st.summary.prediction_hit = self
                .executor
                .cluster()
                .kv_prediction_hit(generator, predicted, cached, prompt_len);
        }
    }

    fn continuation_tokens(
        &self,
        req: &RouteRequest,
        delivered: &str,
    ) -> Result<Vec<u32>, RouteError> {
        if delivered.is_empty() {
            return Ok(Vec::new());
        }
        req.tokenizer
            .as_ref()
            .unwrap_or(&self.tokenizer)
            .encode(delivered, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| RouteError::Tokenize(format!("the delivered text to continue: {e}")))
    }

    fn count_tokens(&self, req: &RouteRequest, text: &str) -> Result<u32, RouteError> {
        Ok(self.continuation_tokens(req, text)?.len() as u32)
    }

    async fn finish(
        &self,
        req: &RouteRequest,
        tx: &mpsc::Sender<Event>,
        st: &mut State,
        finish_reason: FinishReason,
        completion_tokens: u32,
        usage: Option<Usage>,
    ) {
        st.summary.completion_tokens = completion_tokens;
        crate::telemetry::record_outcome(&req.span, &st.summary, None);
        report(req, st, OutcomeStatus::Ok);
        let summary = st.summary.clone();
        let done = Done {
            finish_reason,
            usage,
            summary,
        };
        let _ = tx.send(Event::Done(Box::new(done))).await;
    }

    async fn fail(
        &self,
        req: &RouteRequest,
        tx: &mpsc::Sender<Event>,
        st: &mut State,
        error: RouteError,
    ) {
        // Client bodies name endpoints by id; the log names the URL too.
        let url = error
            .engine_failure()
            .and_then(|e| self.executor.cluster().url(e.endpoint));
        let url = url.as_deref();
        if error.is_clients() {
            tracing::info!(request = %req.request_id, %error, url, "request refused");
        } else {
            tracing::warn!(request = %req.request_id, %error, url, "request failed");
        }
        let tokens = match st.delivered.generated {
            Some(n) => Ok(n),
            None => self.count_tokens(req, &st.delivered.text),
        };
        if let Ok(tokens) = tokens {
            st.summary.completion_tokens = tokens;
        }
        crate::telemetry::record_outcome(&req.span, &st.summary, Some(error.kind()));
        report(req, st, OutcomeStatus::Failed);
        let summary = st.summary.clone();
        let _ = tx
            .send(Event::Failed(Box::new(Failed { error, summary })))
            .await;
    }
}

/// Tell the request's planner how it ended, when it reads outcomes.
fn report(req: &RouteRequest, st: &State, status: OutcomeStatus) {
    if !st.planner.reads().outcomes {
        return;
    }
    let summary = &st.summary;
    let outcome = Outcome {
        request_id: req.id,
        status,
        attempts: summary.attempts,
        generator: summary.generator,
        prefix_matched: summary.prefix_matched,
        completion_tokens: summary.completion_tokens,
        ttft_us: summary.ttft.map_or(0, |d| d.as_micros() as u64),
        e2e_us: req.arrived.elapsed().as_micros() as u64,
    };
    st.planner.on_complete(&outcome);
}

/// The endpoints a plan sends the prompt to: every one of them caches its blocks.
fn served_by(plan: &ValidPlan) -> impl Iterator<Item = EndpointId> {
    std::iter::once(plan.generator()).chain(plan.prefiller())
}

fn failure_of(error: &ExecError) -> Failure {
    Failure {
        kind: error.failure_kind(),
        endpoint: error.endpoint,
    }
}

/// Whether planning on `endpoint` needs the prompt's token ids: MLC engines take them.
fn takes_token_ids(endpoint: &EndpointSnapshot) -> bool {
    endpoint.protocol == Protocol::Mlc && endpoint.health != Health::Removed
}

/// The usage the client sees: the original prompt (`prompt_tokens`), and every token delivered
/// over all attempts (`completion_tokens`, summed by the caller saturating: an engine's count is
/// not trusted to keep the sum in range). `cached`, the last attempt's engine's count, is
/// bounded by the original prompt: a continuation's engine may hold more of its longer prompt
/// than the client sent.
fn final_usage(prompt_tokens: u32, completion_tokens: u32, cached: Option<u32>) -> Usage {
    let usage = Usage::new(prompt_tokens, completion_tokens);
    match cached {
        Some(cached) => usage.with_cached_tokens(cached.min(prompt_tokens)),
        None => usage,
    }
}

#[cfg(test)]
mod tests;
