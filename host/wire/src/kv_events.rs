//! KV-cache events as vLLM and SGLang publish them (shared/spec/kv-events.md): the event and
//! batch types, their msgpack payloads in both encodings, and the ZeroMQ frame layouts of the
//! live stream and of replay. Only bytes here; the sockets are the router's.
//!
//! - [`decode_batch`] reads a payload whatever wrote it: a batch `[ts, events]`,
//!   `[ts, events, dp_rank]` or a map; events as positional arrays tagged by name (vLLM < 0.26,
//!   older SGLang) or maps with a `"type"` key (vLLM ≥ 0.26, newer SGLang), even mixed; block
//!   hashes as ints (signed or not) or bytes. Unknown keys are ignored; an event of an unknown
//!   type or one that breaks a length guard is skipped and reported, the rest of its batch kept.
//! - [`encode_batch`] writes what msgspec writes for vLLM's newest declaration, map events by
//!   default, positional with [`Encoding::Array`] (the reference engine publishes with it).
//! - [`frames`]: the PUB message `[topic, seq, payload]`, the replay request and both replay
//!   reply shapes with their end marker.
//!
//! ```
//! use switchyard_wire::kv_events::{
//!     BlockHash, BlockStored, Encoding, Event, EventBatch, decode_batch, encode_batch,
//! };
//!
//! let batch = EventBatch {
//!     ts: 1.5,
//!     events: vec![Event::BlockStored(BlockStored::new(
//!         vec![BlockHash::Int(7)],
//!         None,
//!         vec![1, 2, 3, 4],
//!         4,
//!     ))],
//!     data_parallel_rank: Some(0),
//! };
//! for encoding in [Encoding::Map, Encoding::Array] {
//!     let decoded = decode_batch(&encode_batch(&batch, encoding)).expect("decodes");
//!     assert_eq!(decoded.batch, batch);
//!     assert!(decoded.skipped.is_empty());
//! }
//! ```

mod decode;
mod encode;
pub mod frames;
#[cfg(test)]
mod tests;

pub use decode::{DecodeError, DecodedBatch, EventError, SkippedEvent, decode_batch};
pub use encode::{Encoding, encode_batch};
/// Any msgpack value: what `extra_keys` entries hold (multimodal hashes, a LoRA name, a
/// `cache_salt`, prompt-embedding digests), kept as published.
pub use rmpv::Value;

/// What one engine step published: its events in order, when, and from which DP rank.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Seconds since the epoch, as the engine's clock read it.
    pub ts: f64,
    pub events: Vec<Event>,
    /// vLLM's `data_parallel_rank` / SGLang's `attn_dp_rank`; absent from the first layouts.
    pub data_parallel_rank: Option<i64>,
}

/// One change to an engine's prefix cache.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole prefix cache (e.g. `/reset_prefix_cache`).
    AllBlocksCleared,
}

/// An engine's name for a block: opaque, seeded per process, and (SGLang) not always chained,
/// so it only ever identifies a block within one engine's own events.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// A msgpack integer. vLLM publishes the low 64 bits of its digest unsigned; SGLang
    /// publishes Python's signed `hash()`, kept here as its two's-complement bits: an
    /// identifier, never a number.
    Int(u64),
    /// The raw digest (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes(Vec<u8>),
}

/// Blocks that became full and cached in one step, in prefix order.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    /// The block right before the first one; `None`: the first block starts the prompt.
    pub parent_block_hash: Option<BlockHash>,
    /// The blocks' tokens, concatenated: `block_size × block_hashes.len()` of them.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    /// Deprecated by vLLM in favour of `lora_name`.
    pub lora_id: Option<i64>,
    /// Where the blocks live: `None` (versions before the field) and `"GPU"` are the engine's
    /// own cache; offloading connectors publish `"CPU"`, `"STORAGE"`, SGLang `"CPU_TIER1"`...
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block: what else the block's cache identity depends on.
    pub extra_keys: Option<Vec<Option<Vec<Value>>>>,
    /// The KV-cache group of a hybrid model; prefix matching is about group 0.
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<u32>,
}

impl BlockStored {
    /// Blocks of the engine's own (GPU) cache with nothing but the required fields set.
    pub fn new(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_owned()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    }
}

/// Blocks the engine evicted.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<BlockHash>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

/// The `medium` of an engine's own cache.
pub const MEDIUM_GPU: &str = "GPU";
