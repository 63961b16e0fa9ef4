//! The attempt loop against a scripted planner and executor on a paused clock: backoff bounds
//! and jitter, attempt numbering and upstream ids, the failure the policy hears about, the
//! attempt cap, the retry budget, the request deadline, preemption continuation arithmetic,
//! outlier accounting and cancellation.
//!
//! The byte-level tokenizer makes one token per byte, so token arithmetic reads as string
//! lengths.

use std::collections::VecDeque;

use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use switchyard_contract::{Plan, Step};
use switchyard_wire::completion::{Choice, EngineChunk, Logprobs};
use switchyard_wire::sse::{ChunkStream, SseError};

use super::*;
use crate::cluster::{Cluster, EndpointSpec, OutlierConfig};
use crate::engine_client::CallError;
use crate::plan::{AttemptBody, Generation, StepKind};

/// How an engine says it preempted a request.
const PREEMPT: &str = "preempt";

const REQUEST_ID: &str = "cmpl-0123456789abcdef0123456789abcdef";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// === the scripted planner ===

/// What the planner was asked, per attempt.
#[derive(Debug, Clone)]
struct Asked {
    attempt: u32,
    last_failure: Option<Failure>,
    prompt: Vec<u32>,
    max_tokens: u32,
}

/// Plans a forward to endpoint `(attempt - 1) % 2`, so consecutive attempts alternate
/// endpoints and the failed one is visible in the next context.
struct FakePlanner {
    asked: Mutex<Vec<Asked>>,
    outcomes: mpsc::UnboundedSender<Outcome>,
}

impl Planner for FakePlanner {
    fn translate(
        &self,
        req: &PolicyRequest<'_>,
        ctx: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        self.asked.lock().push(Asked {
            attempt: ctx.attempt,
            last_failure: ctx.last_failure,
            prompt: req.prompt.unwrap_or_default().to_vec(),
            max_tokens: req.max_tokens,
        });
        Ok(Plan {
            steps: vec![Step::Forward {
                endpoint: (ctx.attempt - 1) % 2,
            }],
        })
    }

    fn on_complete(&self, outcome: &Outcome) {
        let _ = self.outcomes.send(*outcome);
    }
}

// === the scripted executor ===

/// What one attempt's execution does.
enum Script {
    /// The plan fails before a stream exists.
    Fail(CallError),
    /// The generating engine answers with these chunks.
    Stream(Vec<Result<EngineChunk, SseError>>),
    /// One text chunk, then nothing until dropped; dropping answers on the sender.
    Hang(oneshot::Sender<()>),
}

/// What the executor was asked to run, per attempt.
#[derive(Debug, Clone)]
struct Ran {
    at: Instant,
    endpoint: EndpointId,
    upstream_id: String,
    attempt: u32,
    body: CompletionRequest,
}

struct FakeExecutor {
    cluster: Arc<Cluster>,
    script: Mutex<VecDeque<Script>>,
    ran: Mutex<Vec<Ran>>,
}

impl Execute for FakeExecutor {
    fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    async fn execute(
        &self,
        plan: &ValidPlan,
        body: AttemptBody,
        id: &AttemptId,
    ) -> Result<Generation, ExecError> {
        let body = body.tokens;
        let ValidPlan::Forward { endpoint } = *plan else {
            panic!("the fake planner only forwards: {plan:?}");
        };
        self.ran.lock().push(Ran {
            at: Instant::now(),
            endpoint,
            upstream_id: id.upstream_id.clone(),
            attempt: id.attempt,
            body,
        });
        let script = self.script.lock().pop_front();
        let chunks: ChunkStream = match script {
            Some(Script::Fail(source)) => {
                return Err(ExecError::new(
                    source,
                    endpoint,
                    StepKind::Forward,
                    id.attempt,
                ));
            }
            Some(Script::Stream(chunks)) => Box::pin(futures::stream::iter(chunks)),
            Some(Script::Hang(dropped)) => hanging_stream(dropped),
            None => panic!("attempt {} was not scripted", id.attempt),
        };
        let in_flight = self.cluster.in_flight(endpoint).expect("endpoint exists");
        Ok(Generation::new(chunks, endpoint, 0, false, in_flight))
    }
}

/// Sends on `dropped` when dropped.
struct DropSignal(Option<oneshot::Sender<()>>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Yields "a", then never another chunk. The stream owns the signal, so it fires exactly when
/// the stream is dropped.
fn hanging_stream(dropped: oneshot::Sender<()>) -> ChunkStream {
    let signal = DropSignal(Some(dropped));
    Box::pin(futures::stream::unfold(
        (signal, true),
        |(signal, first)| async move {
            if first {
                Some((text("a"), (signal, false)))
            } else {
                futures::future::pending().await
            }
        },
    ))
}

// === chunks ===

fn chunk(text: &str, finish_reason: Option<&str>) -> Result<EngineChunk, SseError> {
    Ok(EngineChunk {
        choice: Some(Choice {
            index: 0,
            text: text.into(),
            finish_reason: finish_reason.map(FinishReason::from),
            logprobs: None,
            token_ids: None,
            delta: None,
            message: None,
        }),
        ..EngineChunk::default()
    })
}

fn text(t: &str) -> Result<EngineChunk, SseError> {
    chunk(t, None)
}

/// A chunk carrying the ids the engine generated for its text (`return_token_ids`).
fn text_with_ids(
    t: &str,
    ids: &[u32],
    finish_reason: Option<&str>,
) -> Result<EngineChunk, SseError> {
    let mut c = chunk(t, finish_reason)?;
    c.choice.as_mut().expect("a choice").token_ids = Some(ids.to_vec());
    Ok(c)
}

/// A chunk as MLC's engines send it when asked for `logprobs`: one entry per generated token,
/// and no ids (they ignore `return_token_ids`).
fn text_with_logprobs(
    t: &str,
    tokens: usize,
    finish_reason: Option<&str>,
) -> Result<EngineChunk, SseError> {
    let mut c = chunk(t, finish_reason)?;
    c.choice.as_mut().expect("a choice").logprobs = Some(Logprobs::Counted(Some(tokens)));
    Ok(c)
}

fn finish(reason: &str) -> Result<EngineChunk, SseError> {
    chunk("", Some(reason))
}

fn engine_usage(prompt_tokens: u32, completion_tokens: u32) -> Result<EngineChunk, SseError> {
    Ok(EngineChunk {
        usage: Some(Usage::new(prompt_tokens, completion_tokens)),
        ..EngineChunk::default()
    })
}

fn connect_error() -> CallError {
    CallError::Connect {
        reason: "connection refused".into(),
    }
}

fn status_error(status: u16) -> CallError {
    CallError::Status {
        status,
        body: String::new(),
    }
}

fn timeout_error() -> CallError {
    CallError::Timeout { after: ms(5) }
}

// === harness ===

struct Harness {
    router: Arc<Router<FakeExecutor>>,
    planner: Arc<FakePlanner>,
    outcomes: mpsc::UnboundedReceiver<Outcome>,
}

impl Harness {
    fn new(retry: RetryPolicy, script: Vec<Script>) -> Self {
        Self::with_config(
            RouterConfig {
                retry,
                ..RouterConfig::default()
            },
            script,
        )
    }

    fn with_config(config: RouterConfig, script: Vec<Script>) -> Self {
        let spec = |port: u16| EndpointSpec::new(format!("http://127.0.0.1:{port}"));
        let cluster = Arc::new(Cluster::new(
            vec![spec(1), spec(2)],
            OutlierConfig::default(),
        ));
        cluster.set_health(0, true);
        cluster.set_health(1, true);
        let executor = FakeExecutor {
            cluster,
            script: Mutex::new(script.into()),
            ran: Mutex::default(),
        };
        let (tx, outcomes) = mpsc::unbounded_channel();
        let planner = Arc::new(FakePlanner {
            asked: Mutex::default(),
            outcomes: tx,
        });
        let tokenizer = Arc::new(switchyard_wire::tokenizer::byte_level_tokenizer());
        let router = Arc::new(Router::new(executor, planner.clone(), config, tokenizer));
        Harness {
            router,
            planner,
            outcomes,
        }
    }

    fn request(prompt: &str, max_tokens: u32) -> RouteRequest {
        RouteRequest {
            id: 7,
            request_id: REQUEST_ID.into(),
            prompt: RoutePrompt::from_ids(prompt.bytes().map(u32::from).collect()),
            max_tokens,
            stream: true,
            include_usage: true,
            model: "m".into(),
            user: None,
            headers: Vec::new(),
            template: CompletionRequest::new(Vec::new(), 0, String::new()),
            client: None,
            arrived: Instant::now(),
            flow: Flow::default(),
            span: tracing::Span::none(),
            tokenizer: None,
        }
    }

    /// Route one request and collect its text and last event.
    async fn route(&self, prompt: &str, max_tokens: u32) -> (String, Event) {
        let mut events = self.router.start(Self::request(prompt, max_tokens));
        let mut delivered = String::new();
        loop {
            match events
                .next()
                .await
                .expect("a last event before the stream ends")
            {
                Event::Text(t) => delivered.push_str(&t),
                last => {
                    assert!(
                        events.next().await.is_none(),
                        "nothing after the last event"
                    );
                    return (delivered, last);
                }
            }
        }
    }

    fn ran(&self) -> Vec<Ran> {
        self.router.executor().ran.lock().clone()
    }

    fn asked(&self) -> Vec<Asked> {
        self.planner.asked.lock().clone()
    }

    fn outcome(&mut self) -> Outcome {
        self.outcomes.try_recv().expect("the outcome was reported")
    }
}

fn policy(max_attempts: u32, min: Duration, max: Duration) -> RetryPolicy {
    RetryPolicy::try_new(max_attempts, min, max).expect("valid retry policy")
}

fn tokens(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

fn expect_done(event: Event) -> (FinishReason, Usage, Summary) {
    match event {
        Event::Done(done) => {
            let usage = done.usage.expect("the harness's client asks for the usage");
            (done.finish_reason, usage, done.summary)
        }
        other => panic!("expected Done, got {other:?}"),
    }
}

fn expect_failed(event: Event) -> (RouteError, Summary) {
    match event {
        Event::Failed(failed) => (failed.error, failed.summary),
        other => panic!("expected Failed, got {other:?}"),
    }
}

// === tests ===

#[test]
fn retry_policies_are_checked_when_built() {
    assert_eq!(
        RetryPolicy::try_new(0, ms(1), ms(2)),
        Err(RetryPolicyError::ZeroAttempts)
    );
    assert!(matches!(
        RetryPolicy::try_new(3, ms(5), ms(2)),
        Err(RetryPolicyError::MinAboveMax { .. })
    ));
}

#[test]
fn backoff_doubles_with_jitter_below_the_cap_and_never_runs_dry() {
    let policy = policy(3, ms(10), ms(80));
    // backon's jitter adds up to one whole current delay: attempt k waits in
    // [base_k, 2 * base_k) with base_k = min(10 ms * 2^k, 80 ms).
    let bases = [10, 20, 40, 80, 80, 80];
    let mut firsts = Vec::new();
    for _ in 0..20 {
        let delays: Vec<Duration> = policy.backoff().take(50).collect();
        assert_eq!(delays.len(), 50, "the backoff never runs dry");
        for (k, delay) in delays.iter().enumerate() {
            let base = ms(bases[k.min(bases.len() - 1)]);
            assert!(
                *delay >= base && *delay <= base * 2,
                "delay {k} = {delay:?}, base {base:?}"
            );
        }
        firsts.push(delays[0]);
    }
    firsts.dedup();
    assert!(
        firsts.len() > 1,
        "20 backoffs all started with the same delay: no jitter"
    );
}

#[tokio::test(start_paused = true)]
async fn engine_failures_re_plan_with_backoff_and_the_failure_in_context() {
    let h = Harness::new(
        policy(3, ms(10), ms(1000)),
        vec![
            Script::Fail(connect_error()),
            Script::Fail(status_error(503)),
            Script::Stream(vec![text("hi"), finish("stop")]),
        ],
    );
    let (delivered, last) = h.route("hello", 10).await;
    assert_eq!(delivered, "hi");
    let (finish_reason, usage, summary) = expect_done(last);
    assert_eq!(finish_reason, FinishReason::Stop);
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (5, 2, 7)
    );
    assert_eq!((summary.attempts, summary.retries), (3, 2));

    let ran = h.ran();
    let ids: Vec<&str> = ran.iter().map(|r| r.upstream_id.as_str()).collect();
    assert_eq!(
        ids,
        [
            format!("{REQUEST_ID}-1"),
            format!("{REQUEST_ID}-2"),
            format!("{REQUEST_ID}-3")
        ]
    );
    for r in &ran {
        assert_eq!(
            r.body.prompt,
            Prompt::Tokens(tokens("hello")),
            "a retry resends the request"
        );
        assert_eq!(r.body.max_tokens, Some(10));
    }
    let attempts: Vec<(u32, EndpointId)> = ran.iter().map(|r| (r.attempt, r.endpoint)).collect();
    assert_eq!(
        attempts,
        [(1, 0), (2, 1), (3, 0)],
        "each attempt runs its own plan"
    );

    let asked = h.asked();
    let contexts: Vec<_> = asked.iter().map(|a| (a.attempt, a.last_failure)).collect();
    let endpoint_error = |endpoint| Failure {
        kind: FailureKind::EndpointError,
        endpoint,
    };
    assert_eq!(
        contexts,
        [
            (1, None),
            (2, Some(endpoint_error(0))),
            (3, Some(endpoint_error(1)))
        ]
    );

    // Exponential backoff with jitter: [10, 20) ms, then [20, 40) ms.
    let gaps: Vec<Duration> = ran.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert!(gaps[0] >= ms(10) && gaps[0] <= ms(20), "{gaps:?}");
    assert!(gaps[1] >= ms(20) && gaps[1] <= ms(40), "{gaps:?}");
}

#[tokio::test(start_paused = true)]
async fn the_attempt_cap_ends_the_request_with_the_last_failure() {
    let mut h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![
            Script::Fail(timeout_error()),
            Script::Fail(timeout_error()),
            Script::Fail(timeout_error()),
        ],
    );
    let (delivered, last) = h.route("hello", 10).await;
    assert_eq!(delivered, "");
    let (error, summary) = expect_failed(last);
    match error {
        RouteError::Exhausted { attempts, last } => {
            assert_eq!(attempts, 3);
            assert_eq!((last.attempt, last.endpoint), (3, 0));
            assert!(last.timed_out(), "{last}");
        }
        other => panic!("expected Exhausted, got {other}"),
    }
    assert_eq!((summary.attempts, summary.retries), (3, 2));
    assert_eq!(h.ran().len(), 3, "no attempt past the cap");
    let kinds: Vec<_> = h
        .asked()
        .iter()
        .map(|a| a.last_failure.map(|f| f.kind))
        .collect();
    assert_eq!(
        kinds,
        [None, Some(FailureKind::Timeout), Some(FailureKind::Timeout)]
    );
    let outcome = h.outcome();
    assert_eq!(
        (outcome.status, outcome.attempts),
        (OutcomeStatus::Failed, 3)
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_error_from_the_engine_is_not_retried() {
    let h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![Script::Fail(status_error(400))],
    );
    let (_, last) = h.route("hello", 10).await;
    let (error, summary) = expect_failed(last);
    assert!(matches!(error, RouteError::Engine(_)), "{error}");
    assert_eq!((summary.attempts, summary.retries), (1, 0));
    assert_eq!(h.ran().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn preemption_continues_from_the_delivered_text_with_one_usage() {
    let mut h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![
            Script::Stream(vec![text("ab"), text("c"), finish(PREEMPT)]),
            Script::Stream(vec![text("defg"), finish("length"), engine_usage(8, 4)]),
        ],
    );
    let (delivered, last) = h.route("hello", 7).await;
    assert_eq!(delivered, "abcdefg", "no repeated text, no gap");
    let (finish_reason, usage, summary) = expect_done(last);
    assert_eq!(finish_reason, FinishReason::Length);
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (5, 7, 12),
        "the original prompt and every delivered token"
    );
    assert_eq!(
        (summary.attempts, summary.preemptions, summary.retries),
        (2, 1, 0)
    );

    let ran = h.ran();
    assert_eq!(
        ran[1].body.prompt,
        Prompt::Tokens(tokens("helloabc")),
        "prompt + delivered"
    );
    assert_eq!(ran[1].body.max_tokens, Some(4), "7 - 3 delivered");
    assert_eq!(ran[1].upstream_id, format!("{REQUEST_ID}-2"));
    let asked = h.asked();
    assert_eq!((asked[1].prompt.len(), asked[1].max_tokens), (8, 4));
    assert_eq!(
        asked[1].last_failure,
        Some(Failure {
            kind: FailureKind::Preempted,
            endpoint: 0
        })
    );
    let outcome = h.outcome();
    assert_eq!(
        (outcome.status, outcome.completion_tokens),
        (OutcomeStatus::Ok, 7)
    );
}

/// The generating engine's `cached_tokens` reaches the client; over a continuation it is the
/// last attempt's, bounded by the client's prompt (that engine's prompt was longer).
#[tokio::test(start_paused = true)]
async fn the_client_sees_the_last_engines_cached_tokens_within_its_prompt() {
    let cached = |prompt_tokens, completion_tokens, cached| {
        engine_usage(prompt_tokens, completion_tokens).map(|mut chunk| {
            chunk.usage = chunk.usage.map(|u| u.with_cached_tokens(cached));
            chunk
        })
    };
    let h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![Script::Stream(vec![
            text("ab"),
            finish("length"),
            cached(5, 2, 4),
        ])],
    );
    let (_, last) = h.route("hello", 2).await;
    let (_, usage, summary) = expect_done(last);
    assert_eq!(
        (usage.cached_tokens(), summary.cached_tokens),
        (Some(4), Some(4))
    );
    assert!(!summary.prediction_hit, "no KV events: nothing predicted");

    let h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![
            Script::Stream(vec![text("abc"), finish(PREEMPT), cached(5, 3, 0)]),
            Script::Stream(vec![text("d"), finish("length"), cached(8, 1, 8)]),
        ],
    );
    let (_, last) = h.route("hello", 4).await;
    let (_, usage, summary) = expect_done(last);
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.cached_tokens(),
            summary.cached_tokens
        ),
        (5, Some(5), Some(8)),
        "the engine held all of hello+abc; the client sent five tokens"
    );

    let h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![Script::Stream(vec![
            text("ab"),
            finish("length"),
            engine_usage(5, 2),
        ])],
    );
    let (_, last) = h.route("hello", 2).await;
    let (_, usage, _) = expect_done(last);
    assert_eq!(usage.cached_tokens(), None, "not reported, not invented");
}

/// With ids on the wire (the generating leg asks for `return_token_ids`), a preempted stream
/// continues from the ids the engine generated, not from its text re-tokenized, and counts
/// them: here the engine's ids for "abc" are two tokens that re-tokenizing "abc" (byte-level:
/// three) would never give.
#[tokio::test(start_paused = true)]
async fn preemption_continues_from_the_engines_token_ids() {
    let mut h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![
            Script::Stream(vec![
                text_with_ids("ab", &[300], None),
                text_with_ids("c", &[301], None),
                finish(PREEMPT),
            ]),
            Script::Stream(vec![
                text_with_ids("de", &[302], None),
                text_with_ids("", &[303], Some("length")),
            ]),
        ],
    );
    let (delivered, last) = h.route("hello", 4).await;
    assert_eq!(delivered, "abcde");
    let (finish_reason, usage, _) = expect_done(last);
    assert_eq!(finish_reason, FinishReason::Length);
    assert_eq!(
        usage.completion_tokens, 4,
        "the engine's ids, not the text re-tokenized"
    );
    let ran = h.ran();
    assert_eq!(
        ran[1].body.prompt,
        Prompt::Tokens([tokens("hello"), vec![300, 301]].concat()),
        "prompt + the ids generated"
    );
    assert_eq!(ran[1].body.max_tokens, Some(2), "4 - 2 generated");
    assert_eq!(h.outcome().completion_tokens, 4);
}

/// Without ids (MLC's engines ignore `return_token_ids`), a preempted stream continues from
/// the delivered text re-tokenized, but counts the tokens as the engine did, from its
/// `logprobs` entries: here "abc" is two tokens to the engine and three re-tokenized
/// (byte-level), so the continuation may generate two more, not one, and the usage says 4.
#[tokio::test(start_paused = true)]
async fn without_ids_a_preempted_stream_counts_the_engines_tokens_not_the_retokenized_text() {
    let mut h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![
            Script::Stream(vec![
                text_with_logprobs("ab", 1, None),
                text_with_logprobs("c", 1, None),
                finish(PREEMPT),
            ]),
            Script::Stream(vec![
                text_with_logprobs("de", 1, None),
                text_with_logprobs("f", 1, Some("length")),
            ]),
        ],
    );
    let (delivered, last) = h.route("hello", 4).await;
    assert_eq!(delivered, "abcdef");
    let (finish_reason, usage, _) = expect_done(last);
    assert_eq!(finish_reason, FinishReason::Length);
    assert_eq!(
        usage.completion_tokens, 4,
        "the engine's count, not the text re-tokenized (6)"
    );
    let ran = h.ran();
    assert_eq!(
        ran[1].body.prompt,
        Prompt::Tokens(tokens("helloabc")),
        "without ids, prompt + the delivered text re-tokenized"
    );
    assert_eq!(ran[1].body.max_tokens, Some(2), "4 - 2 generated");
    assert_eq!(h.outcome().completion_tokens, 4);
}

/// A chunk with text that says nothing of its tokens stops the count: from then on the text
/// re-tokenized is all the router has.
#[tokio::test(start_paused = true)]
async fn a_chunk_without_ids_or_logprobs_falls_back_to_the_retokenized_text() {
    let h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![
            Script::Stream(vec![
                text_with_logprobs("ab", 1, None),
                text("c"),
                finish(PREEMPT),
            ]),
            Script::Stream(vec![text("d"), finish("length")]),
        ],
    );
    let (delivered, last) = h.route("hello", 4).await;
    assert_eq!(delivered, "abcd");
    let (_, usage, _) = expect_done(last);
    assert_eq!(usage.completion_tokens, 4, "re-tokenized: one per byte");
    assert_eq!(h.ran()[1].body.max_tokens, Some(1), "4 - 3 re-tokenized");
}

#[tokio::test(start_paused = true)]
async fn preempted_after_the_last_token_finishes_without_another_attempt() {
    let h = Harness::new(
        policy(3, ms(10), ms(100)),
        vec![Script::Stream(vec![text("abc"), finish(PREEMPT)])],
    );
    let (delivered, last) = h.route("hello", 3).await;
    assert_eq!(delivered, "abc");
    let (finish_reason, usage, _) = expect_done(last);
    assert_eq!(finish_reason, FinishReason::Length);
    assert_eq!((usage.completion_tokens, usage.total_tokens), (3, 8));
    assert_eq!(h.ran().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn preemptions_without_progress_count_toward_the_attempt_cap() {
    let h = Harness::new(
        policy(2, ms(10), ms(100)),
        vec![
            Script::Stream(vec![finish(PREEMPT)]),
            Script::Stream(vec![finish(PREEMPT)]),
        ],
    );
    let (_, last) = h.route("hello", 5).await;
    let (error, summary) = expect_failed(last);
    assert!(
        matches!(
            error,
            RouteError::Preempted {
                attempts: 2,
                endpoint: 1
            }
        ),
        "{error}"
    );
    assert_eq!(summary.preemptions, 2);
    assert_eq!(h.ran().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_stream_broken_after_text_continues_without_counting_toward_the_attempt_cap() {
    // A cap of one attempt: only an attempt that made no progress would count toward it.
    let h = Harness::new(
        policy(1, ms(10), ms(100)),
        vec![
            Script::Stream(vec![text("ab"), Err(SseError::Truncated)]),
            Script::Stream(vec![text("cd"), finish("stop")]),
        ],
    );
    let (delivered, last) = h.route("hello", 10).await;
    assert_eq!(delivered, "abcd");
    let (_, usage, summary) = expect_done(last);
    assert_eq!(
        usage.completion_tokens, 4,
        "counted from the text: no engine usage"
    );
    assert_eq!((summary.attempts, summary.retries), (2, 1));
    let ran = h.ran();
    assert_eq!(ran[1].body.prompt, Prompt::Tokens(tokens("helloab")));
    assert_eq!(ran[1].body.max_tokens, Some(8));
}

#[tokio::test(start_paused = true)]
async fn dropping_the_routing_cancels_the_upstream_and_releases_in_flight() {
    let (dropped_tx, dropped) = oneshot::channel();
    let mut h = Harness::new(policy(3, ms(10), ms(100)), vec![Script::Hang(dropped_tx)]);
    let mut events = h.router.start(Harness::request("hello", 100));
    assert!(matches!(events.next().await, Some(Event::Text(t)) if t == "a"));
    let cluster = h.router.executor().cluster().clone();
    assert_eq!(
        cluster.snapshot()[0].in_flight,
        1,
        "the generation is counted"
    );
    drop(events);
    let outcome = h.outcomes.recv().await.expect("the outcome is reported");
    assert_eq!(outcome.status, OutcomeStatus::Cancelled);
    // The outcome is reported after the attempt was dropped: the stream is gone by now.
    assert_eq!(dropped.await, Ok(()), "the upstream stream was dropped");
    assert_eq!(
        cluster.snapshot()[0].in_flight,
        0,
        "no leaked in-flight count"
    );
}

fn config(retry_budget: RetryBudgetConfig, request_timeout: Duration) -> RouterConfig {
    RouterConfig {
        retry: policy(100, ms(10), ms(100)),
        retry_budget,
        request_timeout,
    }
}

#[tokio::test(start_paused = true)]
async fn a_spent_retry_budget_fails_the_request_at_once_with_the_last_failure() {
    let spent = RetryBudgetConfig {
        ratio: 0.0,
        min_per_sec: 0,
    };
    let h = Harness::with_config(
        config(spent, ms(60_000)),
        vec![Script::Fail(status_error(500))],
    );
    let started = Instant::now();
    let (delivered, last) = h.route("hello", 10).await;
    assert_eq!(delivered, "");
    let (error, summary) = expect_failed(last);
    assert!(
        matches!(&error, RouteError::RetryBudget { last } if last.attempt == 1),
        "{error}"
    );
    assert_eq!((summary.attempts, summary.retries), (1, 0));
    assert_eq!(Instant::now(), started, "no backoff before failing");
}

#[tokio::test(start_paused = true)]
async fn retries_after_progress_draw_on_the_budget_but_preemptions_do_not() {
    // One request in the window and a ratio of 0.5: exactly one retry is allowed.
    let half = RetryBudgetConfig {
        ratio: 0.5,
        min_per_sec: 0,
    };
    let broken = || Script::Stream(vec![text("a"), Err(SseError::Truncated)]);
    let preempted = || Script::Stream(vec![text("p"), finish(PREEMPT)]);
    let h = Harness::with_config(
        config(half, ms(60_000)),
        vec![preempted(), preempted(), broken(), broken(), broken()],
    );
    let (delivered, last) = h.route("hello", 10).await;
    assert_eq!(delivered, "ppaa");
    let (error, summary) = expect_failed(last);
    assert!(matches!(error, RouteError::RetryBudget { .. }), "{error}");
    assert_eq!(
        (summary.attempts, summary.preemptions, summary.retries),
        (4, 2, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn the_request_deadline_ends_a_stream_that_stalls_after_its_first_token() {
    let (dropped_tx, dropped) = oneshot::channel();
    let h = Harness::with_config(
        config(RetryBudgetConfig::default(), ms(1_500)),
        vec![Script::Hang(dropped_tx)],
    );
    let started = Instant::now();
    let (delivered, last) = h.route("hello", 10).await;
    assert_eq!(delivered, "a");
    let (error, _) = expect_failed(last);
    assert!(
        matches!(error, RouteError::Deadline(d) if d == ms(1_500)),
        "{error}"
    );
    assert_eq!(Instant::now() - started, ms(1_500));
    assert_eq!(dropped.await, Ok(()), "the stalled upstream was dropped");
}

#[tokio::test(start_paused = true)]
async fn broken_streams_count_against_their_endpoint_and_a_finish_clears_it() {
    let broken = || Script::Stream(vec![Err(SseError::Truncated)]);
    let h = Harness::new(
        policy(5, ms(10), ms(100)),
        // Attempts alternate endpoints: the stream breaks on 0, then finishes on 1.
        vec![broken(), Script::Stream(vec![text("x"), finish("stop")])],
    );
    let (_, last) = h.route("hello", 10).await;
    expect_done(last);
    let status = h.router.executor().cluster().status();
    assert_eq!(status[0].outlier.consecutive_failures, 1);
    assert!(
        status[0]
            .outlier
            .last_failure
            .as_deref()
            .is_some_and(|f| f.contains("relay on endpoint 0")),
        "{:?}",
        status[0].outlier
    );
    assert_eq!(status[1].outlier.consecutive_failures, 0);
}

#[tokio::test(start_paused = true)]
async fn the_policy_is_told_the_time_left_before_the_deadline_when_it_plans() {
    let flow = Flow {
        priority: 3,
        tenant: Some("acme".into()),
        deadline: Some(Instant::now() + Duration::from_millis(1_500)),
    };
    tokio::time::advance(Duration::from_millis(500)).await;
    let told = flow.for_policy();
    assert_eq!(
        (told.priority, told.tenant, told.deadline_ms),
        (3, Some("acme"), Some(1_000))
    );
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(flow.for_policy().deadline_ms, Some(0), "past: none left");
    assert_eq!(Flow::default().for_policy(), RequestFlow::default());
}
