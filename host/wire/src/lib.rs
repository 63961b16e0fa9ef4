//! The JSON both sides of switchyard's engine wire speak, and nothing else: no HTTP client, no
//! server. The router writes these bodies and reads these answers, the reference engine reads
//! and writes the same types, and the load generator uses them for its direct arm, so a field
//! is never spelled twice.
//!
//! - [`completion`]: the OpenAI completion body every call carries, chunks, usage, finish
//!   reasons.
//! - [`microserving`]: MLC-LLM's `prep_recv` / `remote_send` / `start_generate` bodies.
//! - [`sse`]: server-sent events: parsing a stream into data and chunks, framing values.
//! - [`error`]: OpenAI's error body.
//! - [`metrics`]: the engine gauges a router reads.
//! - [`tokenizer`]: the reference model's byte-level tokenizer assets, and [`tokenizer::PromptTokenizer`]
//!   (tokenizer plus chat template), which router and engine share so a chat prompt is rendered
//!   and tokenized the same on both.
//! - [`gguf`]: a GGUF model's metadata and the tokenizer built from it (router and engine share it).
//! - [`kv_events`]: the KV-cache events vLLM and SGLang publish (msgpack over ZeroMQ frames).
//! - [`ReadyLine`]: the line an engine prints once it serves, which its launcher reads.
//!
//! This crate must never depend on another switchyard crate, nor on an HTTP stack.
//!
//! ```
//! use switchyard_wire::completion::CompletionRequest;
//! use switchyard_wire::microserving::PrepRecvRequest;
//!
//! let body = PrepRecvRequest {
//!     common: CompletionRequest::new(vec![1, 2, 3], 8, "cmpl-abc-1".into()),
//!     end: -1,
//! };
//! let json = serde_json::to_value(&body).expect("serializes");
//! assert_eq!(json["end"], -1);
//! assert_eq!(json["debug_config"], serde_json::json!({}));
//! ```
#![forbid(unsafe_code)]

pub mod client;
pub mod completion;
pub mod error;
pub mod gguf;
pub mod kv_events;
pub mod metrics;
pub mod microserving;
mod ready;
pub mod sglang;
pub mod sse;
pub mod tokenizer;
pub mod vllm;

pub use ready::{ReadyLine, ReadyLineError};

/// An error and every `source()` under it, joined with `: ` (an HTTP client's own message
/// rarely says what actually failed). For log lines and error bodies about calls on this wire.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
