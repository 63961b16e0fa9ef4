//! Which prompt prefixes each engine's KV cache holds, kept from the KV-cache events engines
//! publish (`switchyard_wire::kv_events`): events in, per-endpoint prefix lengths out. Pure
//! data, no I/O: the router's subscribers write it, its request path reads it.
//!
//! - [`KvIndex`]: per endpoint, the blocks its engine cached, keyed by [`BlockKey`]
//!   (the parent's key and the block's tokens, chained as the engine chains its own hashes,
//!   so the router's tokenization of a prompt finds the same keys), the engine's hashes kept
//!   only to place children and apply removals; a cap per endpoint, oldest dropped first.
//! - [`KvIndex::lookup`]: for a prompt's tokens, every endpoint's cached prefix length: the
//!   prompt's keys chained, then a bisection for where each endpoint's prefix ends (a few
//!   dozen probes of the index, not one per block).
//! - [`Medium`] / [`MediumSet`]: only blocks in the engine's own (GPU) cache count unless a
//!   caller asks for offloaded tiers too. [`Adapter`]: LoRA blocks never match base prompts.
//!
//! This crate must never depend on an HTTP stack, wasmtime, or the router.
//!
//! ```
//! use switchyard_kv_index::{Adapter, KvIndex, MediumSet, PrefixMatch};
//! use switchyard_wire::kv_events::{BlockHash, BlockStored, Event};
//!
//! let mut index = KvIndex::default();
//! // Engine 3 cached two blocks of 4 tokens; its hashes mean nothing outside it.
//! let stored = BlockStored::new(
//!     vec![BlockHash::Int(0xaaaa), BlockHash::Int(0xbbbb)],
//!     None,
//!     vec![1, 2, 3, 4, 5, 6, 7, 8],
//!     4,
//! );
//! index.apply(3, &Event::BlockStored(stored));
//!
//! let prompt = [1, 2, 3, 4, 5, 6, 0, 0, 9];
//! assert_eq!(
//!     index.lookup(&prompt, Adapter::Base, MediumSet::GPU),
//!     [PrefixMatch { endpoint: 3, tokens: 4 }],
//! );
//! ```
// One audited exception: `madvise` asking for huge pages (index/huge_pages.rs).
#![deny(unsafe_code)]

mod index;
mod key;
mod medium;
mod prediction;
mod stats;

pub use index::{BatchProgress, DEFAULT_BLOCKS_PER_ENDPOINT, KvIndex, PrefixMatch};
pub use key::{Adapter, BlockKey, prompt_keys};
pub use medium::{Medium, MediumSet};
pub use prediction::prediction_hit;
pub use stats::EndpointStats;
