//! MLC-LLM's routes (`--protocol mlc`): the microserving calls `/microserving/prep_recv`,
//! `remote_send` and `start_generate`, and `/v1/completions`, `/v1/models`, `/health` and
//! `/metrics`, answering in MLC's shapes ([`response`]).

mod response;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::sync::{mpsc, oneshot};

use switchyard_kv::KvAddrInfo;
use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::microserving::{
    PrepRecvRequest, PrepRecvResponse, RemoteSendRequest, StartGenerateRequest,
};

use super::common::{
    Body, DEFAULT_MAX_TOKENS, EngineState, HttpError, check_fits, collect, invalid, json,
    openmetrics, prompt_tokens, push_kv, read_request, resolve_end, send, stream,
};
use crate::model::Sampling;
use crate::scheduler::{Event, GenRequest};
use crate::step_loop::Command;
use response::ResponseMeta;

/// Routes of an MLC-mode engine; `alive` is whether its step loop runs.
pub(super) async fn route(
    req: Request<Incoming>,
    state: &EngineState,
    alive: bool,
) -> Result<Response<Body>, HttpError> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        // Readiness and health follow the step loop: an engine whose loop died must not look
        // ready to a router.
        (&Method::GET, "/v1/models" | "/health") if !alive => Err(HttpError::CoreGone),
        (&Method::GET, "/v1/models") => Ok(models(state)),
        (&Method::GET, "/health") => Ok(json(StatusCode::OK, &serde_json::json!({"status": "ok"}))),
        (&Method::GET, "/metrics") => Ok(metrics(state)),
        (&Method::POST, "/v1/completions") => completions(req, state).await,
        (&Method::POST, "/microserving/prep_recv") => prep_recv(req, state).await,
        (&Method::POST, "/microserving/remote_send") => remote_send(req, state).await,
        (&Method::POST, "/microserving/start_generate") => start_generate(req, state).await,
        (_, "/v1/models" | "/health" | "/metrics") => Err(HttpError::MethodNotAllowed),
        (_, p) if p.starts_with("/microserving/") || p == "/v1/completions" => {
            Err(HttpError::MethodNotAllowed)
        }
        _ => Err(HttpError::NotFound { path }),
    }
}

fn models(state: &EngineState) -> Response<Body> {
    let mut model = serde_json::json!({
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "switchyard"
    });
    if let Some(len) = state.max_model_len {
        // vLLM's name for the context length.
        model["max_model_len"] = len.into();
    }
    json(
        StatusCode::OK,
        &serde_json::json!({"object": "list", "data": [model]}),
    )
}

fn metrics(state: &EngineState) -> Response<Body> {
    openmetrics(state.metrics.render())
}

// === completions and the microserving calls ===

async fn completions(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let body: CompletionRequest = read_request(req).await?;
    let request = generation_request(state, &body)?;
    check_fits(state, request.tokens.len() + 1, "prompt")?;
    let (events, rx) = mpsc::unbounded_channel();
    send(state, Command::Generate { request, events })?;
    let meta = response_meta(
        state,
        &body,
        format!("cmpl-{:032x}", rand::random::<u128>()),
    );
    Ok(respond(&body, meta, rx).await)
}

async fn prep_recv(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let PrepRecvRequest { common: body, end } = read_request(req).await?;
    let request = generation_request(state, &body)?;
    let user = required_user(&body)?;
    let len = request.tokens.len();
    let end = resolve_end(end, len)?;
    check_fits(state, len + 1, "prompt")?;
    let (reply, answer) = oneshot::channel();
    send(
        state,
        Command::PrepRecv {
            user,
            request,
            end,
            reply,
        },
    )?;
    let reply = answer.await.map_err(|_| HttpError::CoreGone)??;
    let response = PrepRecvResponse {
        kv_append_metadata: reply.kv_addr_info.encode(),
        prefix_matched_length: u32::try_from(reply.prefix_matched_length).unwrap_or(u32::MAX),
    };
    Ok(json(StatusCode::OK, &response))
}

async fn remote_send(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let RemoteSendRequest {
        common: body,
        begin,
        end,
        kv_addr_info,
        recv_rank: rank,
    } = read_request(req).await?;
    let tokens = prompt_tokens(state, &body.prompt)?;
    let len = tokens.len();
    let end = resolve_end(end, len)?;
    let begin = usize::try_from(begin)
        .ok()
        .filter(|&b| b < end)
        .ok_or_else(|| {
            invalid(
                "begin",
                format!("need 0 <= begin < end, got begin {begin}, end {end}"),
            )
        })?;
    let info = KvAddrInfo::decode_within(&kv_addr_info, end - begin)
        .map_err(|e| invalid("kv_addr_info", e.to_string()))?;
    if info.models.len() != 1 {
        return Err(invalid(
            "kv_addr_info",
            format!("names {} models; this engine has one", info.models.len()),
        ));
    }
    if info.total_len() as usize != end - begin {
        return Err(invalid(
            "kv_addr_info",
            format!(
                "slot runs cover {} positions but end - begin = {}",
                info.total_len(),
                end - begin
            ),
        ));
    }
    check_fits(state, end, "end")?;

    let (reply, answer) = oneshot::channel();
    send(
        state,
        Command::PrefillForSend {
            tokens: tokens[..end].to_vec(),
            begin,
            reply,
        },
    )?;
    let lease = answer.await.map_err(|_| HttpError::CoreGone)?;
    // The push runs on a task of its own that owns the lease: if this handler is cancelled (the
    // router gave up), a copy already under way (shm's runs on the blocking pool) still reads
    // P's slots, so they must stay held until it ends, not until the handler does.
    let window = 0..lease.slots.len();
    let push = tokio::spawn(push_kv(
        state.transport.clone(),
        state.timing.clone(),
        lease,
        window,
        rank,
        info,
    ));
    push.await.map_err(|_| HttpError::CoreGone)??;
    Ok(json(StatusCode::OK, &serde_json::json!({})))
}

async fn start_generate(
    req: Request<Incoming>,
    state: &EngineState,
) -> Result<Response<Body>, HttpError> {
    let StartGenerateRequest {
        common: body,
        begin,
    } = read_request(req).await?;
    let len = prompt_tokens(state, &body.prompt)?.len();
    let user = required_user(&body)?;
    let begin = usize::try_from(begin)
        .ok()
        .filter(|&b| b < len)
        .ok_or_else(|| {
            invalid(
                "begin",
                format!("begin {begin} is out of range for a prompt of {len} tokens"),
            )
        })?;
    let (events, rx) = mpsc::unbounded_channel();
    let (reply, answer) = oneshot::channel();
    send(
        state,
        Command::StartGenerate {
            user: user.clone(),
            begin,
            events,
            reply,
        },
    )?;
    answer.await.map_err(|_| HttpError::CoreGone)??;
    let meta = response_meta(state, &body, user);
    Ok(respond(&body, meta, rx).await)
}

// === request parsing ===

fn generation_request(
    state: &EngineState,
    body: &CompletionRequest,
) -> Result<GenRequest, HttpError> {
    let tokens = prompt_tokens(state, &body.prompt)?;
    if body.n != 1 {
        return Err(invalid("n", "only n = 1 is supported"));
    }
    let max_tokens = match body.max_tokens {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => return Err(invalid("max_tokens", "max_tokens must be positive")),
        Some(m) => m as usize,
    };
    let temperature = body.temperature.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid("temperature", "temperature must be in [0, 2]"));
    }
    let top_p = body.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", "top_p must be in (0, 1]"));
    }
    // Unseeded sampling is seeded with 0: the reference engine is deterministic by design.
    let seed = body.seed.unwrap_or(0) as u64;
    let stop = body.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    Ok(GenRequest {
        tokens,
        sampling: Sampling {
            temperature,
            top_p,
            seed,
        },
        max_tokens,
        stop,
        logprobs: body.logprobs,
    })
}

fn required_user(body: &CompletionRequest) -> Result<String, HttpError> {
    body.user
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| invalid("user", "microserving calls need the request id in \"user\""))
}

fn response_meta(state: &EngineState, body: &CompletionRequest, id: String) -> ResponseMeta {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = body
        .model
        .clone()
        .unwrap_or_else(|| state.model_name.clone());
    ResponseMeta {
        id,
        created,
        model,
        token_ids: body.return_token_ids && state.answers_token_ids,
        logprobs: body.logprobs.then(|| Arc::clone(&state.tokenizer)),
    }
}

// === responses ===

/// Answers `rx` as the request asked: SSE chunks, or one JSON body. A preempted request answers
/// with empty text and zero usage, as MLC does.
async fn respond(
    body: &CompletionRequest,
    meta: ResponseMeta,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Response<Body> {
    if body.stream {
        return stream(meta, body.include_usage(), rx);
    }
    match collect(rx).await {
        Ok(done) => {
            let choice = meta.choice(done.text, done.tokens, Some(done.finish));
            json(StatusCode::OK, &meta.body(vec![choice], Some(done.usage)))
        }
        Err(e) => e.into_response(),
    }
}
