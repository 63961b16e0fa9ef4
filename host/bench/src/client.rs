//! Sends completion requests and times their responses.
//!
//! The same timing code reads the routed arm's `/v1/completions` and the direct arm's
//! `start_generate` (which answers exactly like `/v1/completions`), so both arms are measured
//! identically.

use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use tokio::time::Instant;

use super::config::PromptFormat;
use super::stats::Timing;
use super::workload::RequestSpec;
use switchyard_wire::completion::FinishReason;
use switchyard_wire::error_chain;

/// Bytes of an error body kept in the error message.
const ERROR_BODY_EXCERPT: usize = 200;

/// How long a stream's body may stay open after `[DONE]` before it is dropped unread. Servers
/// end it in the same write as `[DONE]` (switchyard, the reference engine) or in the next one
/// (uvicorn: vLLM, SGLang), so this is only reached by a server that holds the body open, and
/// it bounds what that costs each request of a closed loop.
const BODY_END_AFTER_DONE: Duration = Duration::from_millis(50);

/// Why one request failed. Messages are grouped and counted in the report, so they carry the
/// kind of failure and not per-request details like ids.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{call}: connection failed: {reason}")]
    Connect { call: &'static str, reason: String },
    #[error("{call}: HTTP {status}: {body}")]
    Status {
        call: &'static str,
        status: u16,
        body: String,
    },
    #[error("{call}: bad response: {reason}")]
    Protocol { call: &'static str, reason: String },
    #[error("engine preempted the request")]
    Preempted,
    #[error("server reported an error: {0}")]
    Server(String),
    #[error("response had no choices")]
    NoOutput,
    #[error("timed out")]
    Timeout,
}

/// The OpenAI completion body the load generator sends as a client.
pub fn completion_body(
    spec: &RequestSpec,
    model: Option<&str>,
    format: PromptFormat,
    stream: bool,
) -> serde_json::Value {
    let prompt = match format {
        PromptFormat::Text => serde_json::Value::from(spec.prompt.as_str()),
        PromptFormat::Tokens => serde_json::Value::from(spec.token_ids()),
    };
    let mut body = serde_json::json!({
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "stream": stream,
    });
    if stream {
        // Usage gives the exact token count; without it tokens are counted as chunks.
        body["stream_options"] = serde_json::json!({ "include_usage": true });
    }
    if let Some(model) = model {
        body["model"] = serde_json::Value::from(model);
    }
    body
}

/// POSTs `body` as JSON to `url`.
pub async fn post_json<B: serde::Serialize + ?Sized>(
    client: &reqwest::Client,
    call: &'static str,
    url: &str,
    body: &B,
) -> Result<reqwest::Response, RequestError> {
    let response = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| RequestError::Connect {
            call,
            reason: error_chain(&e),
        })?;
    if response.status().is_success() {
        return Ok(response);
    }
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    Err(RequestError::Status {
        call,
        status,
        body: excerpt(&body),
    })
}

/// POSTs `body` and decodes a non-streaming JSON answer.
pub async fn call_json<B, T>(
    client: &reqwest::Client,
    call: &'static str,
    url: &str,
    body: &B,
) -> Result<T, RequestError>
where
    B: serde::Serialize + ?Sized,
    T: serde::de::DeserializeOwned,
{
    let response = post_json(client, call, url, body).await?;
    let bytes = response.bytes().await.map_err(|e| RequestError::Protocol {
        call,
        reason: error_chain(&e),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| RequestError::Protocol {
        call,
        reason: format!("{e}"),
    })
}

/// The parts of a `CompletionResponse` (or an OpenAI error body) the timer needs.
#[derive(Debug, Default, Deserialize)]
struct ChunkView {
    #[serde(default)]
    choices: Vec<ChoiceView>,
    #[serde(default)]
    usage: Option<UsageView>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct ChoiceView {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct UsageView {
    #[serde(default)]
    completion_tokens: Option<u32>,
    /// vLLM (with `--enable-prompt-tokens-details`), SGLang and OpenAI report prefix-cache
    /// hits here.
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensView>,
}

#[derive(Debug, Default, Deserialize)]
struct PromptTokensView {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl UsageView {
    fn cached_tokens(&self) -> Option<u32> {
        self.prompt_tokens_details.as_ref()?.cached_tokens
    }
}

/// Reads a completion response to its end and times it from `start`.
pub async fn time_completion(
    call: &'static str,
    response: reqwest::Response,
    start: Instant,
    stream: bool,
) -> Result<Timing, RequestError> {
    if stream {
        time_stream(call, response.bytes_stream(), start).await
    } else {
        let bytes = response.bytes().await.map_err(|e| RequestError::Protocol {
            call,
            reason: error_chain(&e),
        })?;
        time_whole(call, &bytes, start)
    }
}

/// Follows the SSE stream of a response `body`: TTFT at the first chunk with a choice, one ITL
/// gap per later one.
pub async fn time_stream<S, E>(
    call: &'static str,
    body: S,
    start: Instant,
) -> Result<Timing, RequestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let mut events = switchyard_wire::sse::data_events(body);
    let mut timing = Timing::default();
    let mut last_chunk: Option<Instant> = None;
    let mut chunks = 0u32;
    let mut usage = None;
    while let Some(event) = events.next().await {
        let data = event.map_err(|e| RequestError::Protocol {
            call,
            reason: format!("SSE: {e}"),
        })?;
        let now = Instant::now();
        let chunk = parse_chunk(call, &data)?;
        if chunk.usage.is_some() {
            usage = chunk.usage;
        }
        if chunk.choices.is_empty() {
            continue;
        }
        match last_chunk {
            None => timing.ttft = now - start,
            Some(prev) => timing.itl.push(now - prev),
        }
        last_chunk = Some(now);
        chunks += 1;
    }
    timing.e2e = start.elapsed();
    // Read to the body's end: dropped before it, the connection is closed unless its end was
    // already read with `[DONE]`, and the next request opens a new one.
    let _ = tokio::time::timeout(BODY_END_AFTER_DONE, events.finish()).await;
    // A stream that ends at once with EOS is a complete answer of zero tokens; one that never
    // carried a choice is not an answer at all.
    if last_chunk.is_none() {
        return Err(RequestError::NoOutput);
    }
    timing.output_tokens = usage
        .as_ref()
        .and_then(|u| u.completion_tokens)
        .unwrap_or(chunks);
    timing.cached_tokens = usage.as_ref().and_then(UsageView::cached_tokens);
    Ok(timing)
}

/// A whole response, its `bytes` read: the first token reaches the client with the last, so
/// TTFT = E2E.
pub fn time_whole(
    call: &'static str,
    bytes: &[u8],
    start: Instant,
) -> Result<Timing, RequestError> {
    let e2e = start.elapsed();
    let body = std::str::from_utf8(bytes).map_err(|e| RequestError::Protocol {
        call,
        reason: format!("body is not UTF-8: {e}"),
    })?;
    let chunk = parse_chunk(call, body)?;
    // MLC answers `usage: null` here; the text's length in bytes is then the token count,
    // exact for the reference engine's byte-level tokenizer.
    let text_len: usize = chunk
        .choices
        .iter()
        .filter_map(|c| c.text.as_ref())
        .map(String::len)
        .sum();
    let usage = chunk.usage.unwrap_or_default();
    let output_tokens = usage
        .completion_tokens
        .unwrap_or(u32::try_from(text_len).unwrap_or(u32::MAX));
    if chunk.choices.is_empty() {
        return Err(RequestError::NoOutput);
    }
    Ok(Timing {
        ttft: e2e,
        e2e,
        itl: Vec::new(),
        output_tokens,
        cached_tokens: usage.cached_tokens(),
    })
}

fn parse_chunk(call: &'static str, data: &str) -> Result<ChunkView, RequestError> {
    let chunk: ChunkView = serde_json::from_str(data).map_err(|e| RequestError::Protocol {
        call,
        reason: format!("{e} in {}", excerpt(data)),
    })?;
    if let Some(error) = &chunk.error {
        let message = error
            .get("message")
            .and_then(|m| m.as_str())
            .map_or_else(|| error.to_string(), str::to_owned);
        return Err(RequestError::Server(excerpt(&message)));
    }
    if chunk
        .choices
        .iter()
        .any(|c| c.finish_reason.as_deref() == Some(FinishReason::Preempt.as_str()))
    {
        return Err(RequestError::Preempted);
    }
    Ok(chunk)
}

/// Converts a request that ran past `limit` into [`RequestError::Timeout`].
pub async fn with_timeout<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, RequestError>>,
) -> Result<T, RequestError> {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or(Err(RequestError::Timeout))
}

pub fn excerpt(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(ERROR_BODY_EXCERPT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}
