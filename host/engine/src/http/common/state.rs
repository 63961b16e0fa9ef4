//! What every handler shares: the engine's configuration, its tokenizers, the step loop's
//! command queue, the KV transport and the metrics.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::time::Duration;

use switchyard_kv::KvTransport;
use switchyard_wire::tokenizer::PromptTokenizer;

use crate::args::{DisaggregationMode, Protocol};
use crate::latency::TimingModel;
use crate::metrics::Metrics;
use crate::step_loop::Command;

/// What every handler of the engine's HTTP surface shares.
pub(crate) struct EngineState {
    /// Which routes the engine serves (`--protocol`).
    pub protocol: Protocol,
    /// SGLang's role for this engine (`null` in every other mode).
    pub disaggregation_mode: DisaggregationMode,
    /// Chat rendering and text tokenization for the OpenAI routes.
    pub prompts: PromptTokenizer,
    /// Engine-to-engine calls: the vLLM pull, the SGLang registration.
    pub client: reqwest::Client,
    /// `--kv-transfer-timeout-ms`: bounds a pull (which is one push).
    pub kv_transfer_timeout: Duration,
    /// This engine's rank in the KV-transfer world: where a prefill engine pushes to us.
    pub device_rank: u32,
    /// The step loop's queue.
    pub commands: Sender<Command>,
    /// False once the step loop's thread has ended (it panicked): nothing will be served again.
    pub alive: Arc<AtomicBool>,
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    /// Whether a request's `return_token_ids` is honoured (not with `--ignore-return-token-ids`).
    pub answers_token_ids: bool,
    /// Token ids a prompt may hold: `0..vocab_size`.
    pub vocab_size: u32,
    /// Shared with remote_send's transfer tasks, which may outlive their request.
    pub transport: Arc<KvTransport>,
    pub metrics: Metrics,
    /// What a KV push costs on the modelled hardware.
    pub timing: Arc<dyn TimingModel>,
    pub model_name: String,
    /// The real model's context length (none for the synthetic model, which has no limit).
    pub max_model_len: Option<usize>,
    pub num_pages: u32,
    pub page_size: usize,
    /// `--fail-rate`: the share of calls answered 500 on purpose.
    pub fail_rate: f64,
}
