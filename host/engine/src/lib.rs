//! The reference engine behind `switchyard engine`: it speaks MLC-LLM's microserving API, or
//! (`--protocol vllm|sglang`) vLLM's NIXL pull or SGLang's bootstrap-room P/D protocol, with
//! real KV moving between engine processes in every case.
//!
//! Real MLC engines need GPUs and NVSHMEM; this one needs neither but behaves like an engine: a
//! paged KV pool with finite pages ([`kv_pool`]), continuous batching with a prefix cache,
//! prep_recv reservations that expire, and MLC's preemption under KV pressure, in a scheduler
//! core that is a pure state machine ([`scheduler`]: the engine's step loop drives it in real
//! time, a simulator can drive it in virtual time), a latency model that says when each step's
//! tokens come out ([`latency`]), and a deterministic model that writes real KV bytes and reads
//! them back to choose each token ([`model`]), or, with `--model`, a real LLM (a llama-family
//! GGUF such as SmolLM2-135M) on CPU whose batch-invariant forward pass reads and writes its K/V
//! in the same pool ([`llama`]). KV moves between engines through [`switchyard_kv`], so a
//! disaggregated run yields exactly the tokens of a single-engine run only if every transferred
//! slot is right.
//!
//! `--protocol vllm|sglang` swaps the microserving calls (404 then) for the OpenAI routes
//! (`/v1/completions`, `/v1/chat/completions`, chat rendered with the model's template as the
//! router renders it) and that engine's P/D handoff, so a router's vLLM and SGLang backends are
//! tested end to end with real KV movement:
//! - vLLM (`http/vllm.rs`): a prefill leg answers `kv_transfer_params` and holds its KV under a
//!   lease (`--kv-lease-ms`); the decode leg pulls it over P's side channel
//!   (`--side-channel-port`), and cancelling it tells P to release the lease.
//! - SGLang (`http/sglang.rs`): `--disaggregation-mode prefill|decode`; both legs meet at the
//!   prefill engine's bootstrap server (`--bootstrap-port`, in the ready line), keyed by
//!   `bootstrap_room`, and P pushes the KV into D's reserved slots.
//!
//! Both check the router's side of the contract (counted as protocol violations on
//! `/metrics`, beside vLLM's or SGLang's own load gauges) and notice a leg whose connection
//! the router closed: hyper drops its handler, and guards give back what it held.
//!
//! This crate depends on the wire types (`switchyard-wire`) and the KV data path
//! (`switchyard-kv`) only: never on the router or the policy host, which are its clients.
//!
//! ```no_run
//! # async fn demo() -> Result<(), switchyard_engine::EngineError> {
//! let args = switchyard_engine::EngineArgs::from_flags(["--port", "0", "--prefix-cache"])
//!     .expect("valid flags");
//! let engine = switchyard_engine::start(&args).await?;
//! println!("{}", engine.ready_line());
//! # Ok(()) }
//! ```
#![deny(unsafe_code)]

mod args;
mod error;
mod http;
mod kv_events;
pub mod kv_pool;
pub mod latency;
pub mod llama;
mod load;
pub mod metrics;
pub mod model;
pub mod scheduler;
mod start;
mod step_loop;

pub use args::{DisaggregationMode, EngineArgs, KvEventsEncoding, ModelShape, Protocol};
pub use error::EngineError;
pub use load::{fetch_hint, model_path};
pub use start::{RunningEngine, run, start};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod pd_tests;
