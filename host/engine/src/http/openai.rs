//! The OpenAI surface of the vLLM and SGLang modes: `/v1/completions` and
//! `/v1/chat/completions` (parsed here, handed to [`super::vllm`] or [`super::sglang`] when they
//! carry that protocol's handoff fields, else served whole), `/v1/models`, `/health` and
//! `/metrics`. The microserving routes answer 404 in these modes: a router that speaks vLLM or
//! SGLang must not need them.
//!
//! Responses take the shapes vLLM and SGLang give them: completions carry `text`; a chat answer
//! `choices[0].message`, a chat chunk `choices[0].delta`; a stream ends with a usage-only chunk
//! (`"choices": []`) when `stream_options.include_usage`, then `data: [DONE]`. With
//! `return_token_ids` every choice carries the generated ids it completes, which is what a
//! router continues a broken stream from.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, oneshot};

use switchyard_wire::completion::{FinishReason as WireFinish, Prompt, Stop, StreamOptions};
use switchyard_wire::error::ErrorBody;
use switchyard_wire::sse;
use switchyard_wire::tokenizer::ChatMessage;

use super::{
    Body, BodyError, DEFAULT_MAX_TOKENS, EngineState, HttpError, check_fits, full, invalid, json,
    prompt_tokens, read_request, send,
};
use crate::metrics::Exported;
use crate::model::Sampling;
use crate::scheduler::{Command, Event, FinishReason, GenRequest, PrepRecvReply, SendLease, Usage};
use crate::{EngineArgs, Metrics, Protocol};

/// The handoff state of the engine's protocol.
pub(crate) enum Pd {
    /// MLC mode: the microserving calls need no state here.
    None,
    Vllm(Arc<super::vllm::Vllm>),
    Sglang(Arc<super::sglang::Sglang>),
}

impl Pd {
    /// The state for `args.protocol`; `aux` is the bound side channel (vLLM) or bootstrap
    /// server (SGLang prefill).
    pub(crate) fn new(args: &EngineArgs, aux: Option<SocketAddr>, metrics: &Metrics) -> Pd {
        match args.protocol {
            Protocol::Mlc => Pd::None,
            Protocol::Vllm => Pd::Vllm(Arc::new(super::vllm::Vllm::new(
                args,
                aux,
                metrics.pd.clone(),
            ))),
            Protocol::Sglang => Pd::Sglang(Arc::new(super::sglang::Sglang::new(
                args,
                aux,
                metrics.pd.clone(),
            ))),
        }
    }
}

/// Which OpenAI route a request came in on: it decides the prompt field and the answer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Completion,
    Chat,
}

/// Routes of the vLLM and SGLang modes.
pub(super) async fn route(
    req: Request<Incoming>,
    state: Arc<EngineState>,
    alive: bool,
) -> Result<Response<Body>, HttpError> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models" | "/health") if !alive => Err(HttpError::CoreGone),
        // vLLM answers an empty 200; SGLang too.
        (&Method::GET, "/health") => Ok(empty(StatusCode::OK)),
        (&Method::GET, "/v1/models") => Ok(models(&state)),
        (&Method::GET, "/metrics") => Ok(metrics(&state)),
        // What routers probe at registration (SMG: server and model info, falling back to the
        // `get_` spellings; vLLM: its version).
        (&Method::GET, "/health_generate") if state.protocol == Protocol::Sglang => {
            Ok(empty(StatusCode::OK))
        }
        (&Method::GET, "/server_info" | "/get_server_info")
            if state.protocol == Protocol::Sglang =>
        {
            Ok(server_info(&state))
        }
        (&Method::GET, "/model_info" | "/get_model_info") if state.protocol == Protocol::Sglang => {
            Ok(json(
                StatusCode::OK,
                &json!({"model_path": state.model_name, "is_generation": true}),
            ))
        }
        (&Method::GET, "/version") if state.protocol == Protocol::Vllm => Ok(json(
            StatusCode::OK,
            &json!({"version": concat!("switchyard-", env!("CARGO_PKG_VERSION"))}),
        )),
        (&Method::POST, "/v1/completions") => generate(req, state, Shape::Completion).await,
        (&Method::POST, "/v1/chat/completions") => generate(req, state, Shape::Chat).await,
        (_, "/v1/models" | "/health" | "/metrics" | "/v1/completions" | "/v1/chat/completions") => {
            Err(HttpError::MethodNotAllowed)
        }
        // The microserving routes included: this engine does not speak MLC now.
        _ => Err(HttpError::NotFound { path }),
    }
}

fn owned_by(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Vllm => "vllm",
        Protocol::Sglang => "sglang",
        Protocol::Mlc => "switchyard",
    }
}

fn models(state: &EngineState) -> Response<Body> {
    let mut model = json!({
        "id": state.model_name, "object": "model", "created": 0,
        "owned_by": owned_by(state.protocol), "root": state.model_name,
    });
    if let Some(len) = state.max_model_len {
        model["max_model_len"] = len.into();
    }
    json(StatusCode::OK, &json!({"object": "list", "data": [model]}))
}

/// SGLang's `/server_info`, the fields a router reads.
fn server_info(state: &EngineState) -> Response<Body> {
    let mode = match &state.pd {
        Pd::Sglang(s) => match s.mode {
            crate::DisaggregationMode::Null => "null",
            crate::DisaggregationMode::Prefill => "prefill",
            crate::DisaggregationMode::Decode => "decode",
        },
        _ => "null",
    };
    json(
        StatusCode::OK,
        &json!({"model_path": state.model_name, "served_model_name": state.model_name,
            "disaggregation_mode": mode, "dp_size": 1, "tp_size": 1,
            "page_size": state.page_size, "max_total_num_tokens":
                state.num_pages as usize * state.page_size}),
    )
}

fn metrics(state: &EngineState) -> Response<Body> {
    let model = state.model_name.as_str();
    let exported = match state.protocol {
        Protocol::Vllm => Exported::Vllm { model },
        Protocol::Sglang => Exported::Sglang { model },
        Protocol::Mlc => Exported::Mlc,
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
        .body(full(state.metrics.render_as(exported)))
        .unwrap_or_else(|_| Response::new(full("")))
}

pub(super) fn empty(status: StatusCode) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(full(""))
        .unwrap_or_else(|_| Response::new(full("")))
}

/// A completion or chat request: parsed, then served by the protocol's handoff or whole.
async fn generate(
    req: Request<Incoming>,
    state: Arc<EngineState>,
    shape: Shape,
) -> Result<Response<Body>, HttpError> {
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_owned);
    let body: Value = match &state.pd {
        Pd::Vllm(_) => super::vllm::read_body_or_release(&state, req).await?,
        _ => read_request(req).await?,
    };
    let Value::Object(raw) = body else {
        return Err(invalid("body", "the request body must be a JSON object"));
    };
    let fields: Fields =
        serde_json::from_value(Value::Object(raw.clone())).map_err(|e| HttpError::Invalid {
            message: format!("invalid request body: {e}"),
            param: None,
        })?;
    let incoming = Arrived {
        shape,
        raw,
        fields,
        request_id,
    };
    match &state.pd {
        Pd::Vllm(v) => super::vllm::serve(state.clone(), v.clone(), incoming).await,
        Pd::Sglang(s) => super::sglang::serve(state.clone(), s.clone(), incoming).await,
        Pd::None => {
            let request = parse(&state, incoming)?;
            serve_whole(&state, request).await
        }
    }
}

/// A request as it arrived, before the protocol decides what it is.
pub(super) struct Arrived {
    pub shape: Shape,
    /// The body as sent: SGLang compares P's and D's; unknown fields are kept (and ignored).
    pub raw: Map<String, Value>,
    pub fields: Fields,
    /// `X-Request-Id`: vLLM builds the response id from it, and its P/D checks need it.
    pub request_id: Option<String>,
}

/// The fields of a completion or chat body the engine reads; every other one is ignored.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Fields {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub messages: Option<Value>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub min_tokens: Option<u32>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub return_token_ids: Option<bool>,
    /// vLLM's handoff stanza: `do_remote_decode` on P, P's answer on D.
    pub kv_transfer_params: Option<Value>,
    /// SGLang's rendezvous, the same on both legs.
    pub bootstrap_host: Option<Value>,
    pub bootstrap_port: Option<Value>,
    pub bootstrap_room: Option<Value>,
}

/// A request ready to run: its prompt in tokens and what to generate.
pub(super) struct OpenAiRequest {
    pub shape: Shape,
    pub fields: Fields,
    pub request_id: Option<String>,
    pub tokens: Vec<u32>,
    /// What the client asked for (`max_tokens` as the client set it).
    pub generation: GenRequest,
    pub stream: bool,
    pub include_usage: bool,
}

/// Checks a body as vLLM does and tokenizes its prompt (chat: rendered with the template).
pub(super) fn parse(state: &EngineState, incoming: Arrived) -> Result<OpenAiRequest, HttpError> {
    let Arrived {
        shape,
        raw: _,
        fields: f,
        request_id,
    } = incoming;
    if f.n.is_some_and(|n| n != 1) {
        return Err(invalid("n", "only n = 1 is supported"));
    }
    let stream = f.stream.unwrap_or(false);
    if f.stream_options.is_some() && !stream {
        // vLLM's check, word for word.
        return Err(invalid(
            "stream_options",
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let tokens = match shape {
        Shape::Completion => {
            let prompt = f
                .prompt
                .as_ref()
                .ok_or_else(|| invalid("prompt", "a completion needs a prompt"))?;
            prompt_tokens(state, prompt)?
        }
        Shape::Chat => {
            let messages = f
                .messages
                .as_ref()
                .ok_or_else(|| invalid("messages", "a chat completion needs messages"))?;
            let text = state
                .prompts
                .render_chat(&chat_messages(messages)?)
                .map_err(|e| invalid("messages", format!("cannot render the chat: {e}")))?;
            prompt_tokens(state, &Prompt::Text(text))?
        }
    };
    // Chat prefers max_completion_tokens, as vLLM does.
    let (limit, param) = match shape {
        Shape::Chat if f.max_completion_tokens.is_some() => {
            (f.max_completion_tokens, "max_completion_tokens")
        }
        _ => (f.max_tokens, "max_tokens"),
    };
    let max_tokens = match limit {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => return Err(invalid(param, format!("{param} must be positive"))),
        Some(m) => m as usize,
    };
    if f.min_tokens.is_some_and(|m| m as usize > max_tokens) {
        return Err(invalid(
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens",
        ));
    }
    let temperature = f.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", "temperature must be in [0, 2]"));
    }
    let top_p = f.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", "top_p must be in (0, 1]"));
    }
    check_fits(state, tokens.len() + 1, "prompt")?;
    let generation = GenRequest {
        tokens: tokens.clone(),
        sampling: Sampling {
            temperature,
            top_p,
            // Unseeded sampling is seeded with 0: a direct and a disaggregated request agree.
            seed: f.seed.unwrap_or(0) as u64,
        },
        max_tokens,
        stop: f.stop.clone().map(Stop::into_vec).unwrap_or_default(),
        // The OpenAI routes do not serve logprobs.
        logprobs: false,
    };
    Ok(OpenAiRequest {
        shape,
        request_id,
        tokens,
        generation,
        stream,
        include_usage: f.stream_options.is_some_and(|o| o.include_usage),
        fields: f,
    })
}

/// `messages` flattened as the router flattens them, so both render the same prompt.
fn chat_messages(messages: &Value) -> Result<Vec<ChatMessage>, HttpError> {
    ChatMessage::read_all(messages).map_err(|reason| invalid("messages", reason))
}

/// A request served by this engine alone (no handoff).
pub(super) async fn serve_whole(
    state: &Arc<EngineState>,
    request: OpenAiRequest,
) -> Result<Response<Body>, HttpError> {
    let meta = Meta::new(state, &request);
    let (events, rx) = mpsc::unbounded_channel();
    send(
        state,
        Command::Generate {
            request: request.generation,
            events,
        },
    )?;
    if request.stream {
        Ok(sse_response(event_stream(meta, request.include_usage, rx)))
    } else {
        let done = collect(rx).await?;
        Ok(json(StatusCode::OK, &meta.full(&done, None)))
    }
}

// === the pieces the handoffs share ===

/// Runs the prompt with `max_tokens` 1 and keeps its KV: a prefill leg's work. Returns the
/// one-token answer and the lease on the prompt's slots (none when it was preempted).
pub(super) async fn prefill_and_hold(
    state: &EngineState,
    request: &OpenAiRequest,
) -> Result<(Collected, Option<SendLease>), HttpError> {
    let mut generation = request.generation.clone();
    generation.max_tokens = 1;
    let (events, rx) = mpsc::unbounded_channel();
    let (hold, held) = oneshot::channel();
    send(
        state,
        Command::GenerateAndHold {
            request: generation,
            events,
            hold,
        },
    )?;
    let done = collect(rx).await?;
    // The lease is sent in the same step as the finish event; a preempted generation has none.
    let lease = match done.finish {
        FinishReason::Preempt => None,
        FinishReason::Length | FinishReason::Stop => held.await.ok(),
    };
    Ok((done, lease))
}

/// A decode leg's reservation of the prompt positions it will not compute: all but the last
/// (MLC's prep_recv with `end = -1`). Dropping it before [`Reserved::start`] hands the pages
/// back at once (through the expiry quarantine), so a cancelled or failed leg leaks nothing.
pub(super) struct Reserved {
    cancel: CancelReservation,
    pub reply: PrepRecvReply,
    /// Positions `[reply.prefix_matched_length, end)` are the window P writes.
    pub end: usize,
}

/// Cancels `user`'s reservation when dropped while armed. Commands are handled in order, so a
/// cancel sent after the reservation's command never overtakes it, and one for a reservation
/// that never came to be (or was taken over by a generation) is ignored.
struct CancelReservation {
    state: Arc<EngineState>,
    user: String,
    armed: bool,
}

impl Drop for CancelReservation {
    fn drop(&mut self) {
        if self.armed {
            let user = std::mem::take(&mut self.user);
            let _ = self
                .state
                .commands
                .send(Command::CancelReservation { user });
        }
    }
}

impl Reserved {
    pub(super) async fn new(
        state: &Arc<EngineState>,
        request: &OpenAiRequest,
    ) -> Result<Reserved, HttpError> {
        let user = format!("pd-{:032x}", rand::random::<u128>());
        let end = request.tokens.len() - 1;
        let (reply, answer) = oneshot::channel();
        // Armed before the command leaves: dropped anywhere from here (the leg's connection
        // closed), the reservation is cancelled, even one the core made and answered just as
        // the answer's reader went away.
        let cancel = CancelReservation {
            state: state.clone(),
            user: user.clone(),
            armed: true,
        };
        send(
            state,
            Command::PrepRecv {
                user,
                request: request.generation.clone(),
                end,
                reply,
            },
        )?;
        let reply = answer.await.map_err(|_| HttpError::CoreGone)??;
        Ok(Reserved { cancel, reply, end })
    }

    /// Where P must write: the encoded slots of the window.
    pub(super) fn kv_addr_info(&self) -> String {
        self.reply.kv_addr_info.encode()
    }

    pub(super) fn begin(&self) -> usize {
        self.reply.prefix_matched_length
    }

    /// Generates from the reservation once the KV is in: the last prompt token is computed
    /// here, as a single engine would, so the output matches only if the KV moved right.
    pub(super) async fn start(mut self) -> Result<mpsc::UnboundedReceiver<Event>, HttpError> {
        let (events, rx) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        send(
            &self.cancel.state,
            Command::StartGenerate {
                user: self.cancel.user.clone(),
                begin: self.end,
                events,
                reply,
            },
        )?;
        let started = answer.await.map_err(|_| HttpError::CoreGone)?;
        if started.is_ok() {
            // The generation owns the pages now (and frees them when its events go unread).
            self.cancel.armed = false;
        }
        started?;
        Ok(rx)
    }
}

/// A finished generation, gathered.
pub(super) struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish: FinishReason,
    pub usage: Usage,
    /// The events as they came, for a prefill leg that answers only after its push (SGLang).
    pub events: Vec<Event>,
}

/// Waits for a whole generation. A preempted one answers with empty text, as MLC's does.
pub(super) async fn collect(
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Collected, HttpError> {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut events = Vec::new();
    while let Some(event) = rx.recv().await {
        text.push_str(&event.text);
        token_ids.extend(&event.token_ids);
        let finish = event.finish;
        events.push(event);
        if let Some((finish, usage)) = finish {
            if finish == FinishReason::Preempt {
                text.clear();
                token_ids.clear();
            }
            return Ok(Collected {
                text,
                token_ids,
                finish,
                usage,
                events,
            });
        }
    }
    tracing::error!("generation events ended without a finish");
    Err(HttpError::CoreGone)
}

/// Events already gathered, as a receiver again (a prefill leg replays its one token).
pub(super) fn replay(events: Vec<Event>) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    for event in events {
        let _ = tx.send(event);
    }
    rx
}

// === answers ===

/// Identity of one answer: every chunk of a stream repeats it.
#[derive(Debug, Clone)]
pub(super) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub shape: Shape,
    pub token_ids: bool,
}

impl Meta {
    /// vLLM's ids: `cmpl-<X-Request-Id>` / `chatcmpl-<X-Request-Id>`, random without it.
    pub(super) fn new(state: &EngineState, request: &OpenAiRequest) -> Meta {
        let base = request
            .request_id
            .clone()
            .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
        let prefix = match request.shape {
            Shape::Completion => "cmpl",
            Shape::Chat => "chatcmpl",
        };
        Meta {
            id: format!("{prefix}-{base}"),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: request
                .fields
                .model
                .clone()
                .unwrap_or_else(|| state.model_name.clone()),
            shape: request.shape,
            token_ids: request.fields.return_token_ids.unwrap_or(false),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.shape, chunk) {
            (Shape::Completion, _) => "text_completion",
            (Shape::Chat, false) => "chat.completion",
            (Shape::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("id".into(), self.id.clone().into());
        body.insert("object".into(), self.object(chunk).into());
        body.insert("created".into(), self.created.into());
        body.insert("model".into(), self.model.clone().into());
        body.insert("choices".into(), Value::Array(choices));
        body
    }

    fn with_ids(&self, mut choice: Value, ids: &[u32]) -> Value {
        if self.token_ids {
            choice["token_ids"] = json!(ids);
        }
        choice
    }

    /// The one JSON answer; `extra` adds a top-level field (vLLM's `kv_transfer_params`).
    pub(super) fn full(&self, done: &Collected, extra: Option<(&str, Value)>) -> Value {
        let finish = WireFinish::from(done.finish);
        let choice = match self.shape {
            Shape::Completion => json!({"index": 0, "text": done.text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null}),
            Shape::Chat => json!({"index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": null, "finish_reason": finish, "stop_reason": null}),
        };
        let mut body = self.envelope(false, vec![self.with_ids(choice, &done.token_ids)]);
        body.insert("usage".into(), usage_json(done.usage));
        if let Some((key, value)) = extra {
            body.insert(key.into(), value);
        }
        Value::Object(body)
    }

    /// One streamed chunk; the first chat chunk also says the role.
    fn chunk(&self, event: &Event, first: bool) -> Value {
        let finish = event.finish.map(|(f, _)| WireFinish::from(f));
        let choice = match self.shape {
            Shape::Completion => json!({"index": 0, "text": event.text, "logprobs": null,
                "finish_reason": finish}),
            Shape::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": event.text})
                } else {
                    json!({"content": event.text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        Value::Object(self.envelope(true, vec![self.with_ids(choice, &event.token_ids)]))
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        let mut body = self.envelope(true, Vec::new());
        body.insert("usage".into(), usage_json(usage));
        Value::Object(body)
    }
}

fn usage_json(u: Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// Answers `rx` as the request asked: SSE, or one JSON with usage.
pub(super) async fn respond(
    meta: Meta,
    request: &OpenAiRequest,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response<Body>, HttpError> {
    if request.stream {
        Ok(sse_response(event_stream(meta, request.include_usage, rx)))
    } else {
        let done = collect(rx).await?;
        Ok(json(StatusCode::OK, &meta.full(&done, None)))
    }
}

type Frames = BoxStream<'static, Result<Frame<Bytes>, BodyError>>;

enum Phase {
    Tokens { first: bool },
    Usage(Usage),
    Done,
    Over,
}

/// `data: <chunk>\n\n` per event, the usage-only chunk if asked for, then `data: [DONE]\n\n`.
/// Dropping the stream (client gone) drops `rx`, which makes the step loop abort the request.
/// Events that end without a finish (the step loop died) end the body with an error, so hyper
/// cuts the connection instead of faking a complete stream.
fn event_stream(meta: Meta, include_usage: bool, rx: mpsc::UnboundedReceiver<Event>) -> Frames {
    let start = (meta, rx, Phase::Tokens { first: true });
    futures::stream::unfold(start, move |(meta, mut rx, phase)| async move {
        let (frame, next) = match phase {
            Phase::Tokens { first } => match rx.recv().await {
                Some(event) => {
                    let frame = sse::event(&meta.chunk(&event, first));
                    let next = match event.finish {
                        Some((_, usage)) if include_usage => Phase::Usage(usage),
                        Some(_) => Phase::Done,
                        None => Phase::Tokens { first: false },
                    };
                    (frame, next)
                }
                None => {
                    tracing::error!("generation events ended without a finish; cutting the stream");
                    return Some((Err(BodyError), (meta, rx, Phase::Over)));
                }
            },
            Phase::Usage(usage) => (sse::event(&meta.usage_chunk(usage)), Phase::Done),
            Phase::Done => (Bytes::from_static(sse::DONE_EVENT), Phase::Over),
            Phase::Over => return None,
        };
        Some((Ok(Frame::data(frame)), (meta, rx, next)))
    })
    .boxed()
}

/// A stream whose 200 head goes out at once (as SGLang's and vLLM's streaming answers do)
/// while `work` still runs: the rendezvous, the pull. A failure after the head becomes one
/// `data: {"error": …}` event, then `[DONE]`. The work lives in the body, so a client that
/// hangs up drops it, and with it whatever its guards hold.
pub(super) fn sse_after<F>(meta: Meta, include_usage: bool, work: F) -> Response<Body>
where
    F: Future<Output = Result<mpsc::UnboundedReceiver<Event>, HttpError>> + Send + 'static,
{
    let frames = futures::stream::once(work)
        .flat_map(move |outcome| match outcome {
            Ok(rx) => event_stream(meta.clone(), include_usage, rx),
            Err(e) => error_events(e),
        })
        .boxed();
    sse_response(frames)
}

/// An error inside a stream whose head is sent: SGLang's (and SMG's) shape, then `[DONE]`.
fn error_events(e: HttpError) -> Frames {
    let (status, kind, param) = e.parts();
    let mut body = serde_json::to_value(ErrorBody::new(e.to_string(), kind, param, None))
        .unwrap_or_else(|_| json!({"error": {}}));
    body["error"]["code"] = status.as_u16().into();
    let frames = [
        Ok(Frame::data(sse::event(&body))),
        Ok(Frame::data(Bytes::from_static(sse::DONE_EVENT))),
    ];
    futures::stream::iter(frames).boxed()
}

fn sse_response(frames: Frames) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed_unsync(StreamBody::new(frames)))
        .unwrap_or_else(|_| Response::new(full("")))
}

/// A 400 for a request that broke the protocol's contract, counted.
pub(super) fn violation(
    metrics: &Metrics,
    param: &'static str,
    message: impl Into<String>,
) -> HttpError {
    metrics.pd.protocol_violations.inc();
    let message = message.into();
    tracing::debug!(%message, "protocol violation");
    HttpError::Status {
        status: StatusCode::BAD_REQUEST,
        message,
        param: Some(param),
    }
}

/// A digest of the body apart from the top-level fields `skip` (those the protocol lets the
/// legs differ in): FNV-1a over its canonical JSON (keys sorted at every level), so the legs'
/// key order and whitespace do not matter. How an engine checks that a router sent both legs
/// the client's body.
pub(super) fn body_digest(raw: &Map<String, Value>, skip: &[&str]) -> String {
    let mut body = raw.clone();
    for field in skip {
        body.remove(*field);
    }
    let mut text = String::new();
    canonical(&Value::Object(body), &mut text);
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

fn canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical(&map[key], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}
