//! The shared core of the engine's HTTP surface: what every protocol's routes build on, and
//! nothing that belongs to one protocol. The protocol modules ([`super::mlc`],
//! [`super::openai`], [`super::vllm`], [`super::sglang`]) depend on this module and never on
//! one another; it depends on none of them.

mod answer;
mod error;
mod generation;
mod request;
mod respond;
mod sse;
mod state;

pub(crate) use answer::{Collected, Meta, Tokens, collect, replay, respond};
pub(crate) use error::{HttpError, invalid, violation};
pub(crate) use generation::{Reserved, prefill_and_hold, push_kv, send, serve_whole};
pub(crate) use request::{
    Arrived, DEFAULT_MAX_TOKENS, Fields, OpenAiRequest, Shape, body_digest, check_fits, parse,
    prompt_tokens, read_request, request_id, resolve_end,
};
pub(crate) use respond::{Body, empty, full, json, openmetrics};
pub(crate) use sse::{Chunks, stream, stream_after};
pub(crate) use state::EngineState;
