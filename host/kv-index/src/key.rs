//! Block keys: what the index calls a cached block, computed the same from an engine's events
//! and from the router's own tokenization of a prompt.
//!
//! Engines name blocks with hashes seeded per process (SGLang's are not even chained), so the
//! index never compares them across engines. A block's key is instead
//! `XXH3-64(key(parent) ‖ tokens)`, the tokens as little-endian `u32`s and the first parent a
//! root that names the adapter, with XXH3's default (fixed) seed: any process computes the
//! same key for the same tokens, block boundaries and adapter.
//!
//! 64 bits, not 128: 64 endpoints × 100k blocks is 6.4M keys, and the chance that any two of
//! them collide is about n²/2⁶⁵ ≈ 10⁻⁶; a collision only misreports one prefix length (a
//! routing hint, never a correctness matter), while 128-bit keys would double the bytes of
//! the index's largest map and of every probe.

use xxhash_rust::xxh3::xxh3_64;

/// A cached block: its tokens, everything before them, and the adapter that computed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey(u64);

impl BlockKey {
    /// The bits, for logs and for callers keeping their own maps.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// The parent of a prompt's first block.
    pub fn root(adapter: Adapter<'_>) -> Self {
        let mut bytes = b"switchyard-kv-index/root\0".to_vec();
        match adapter {
            Adapter::Base => bytes.push(0),
            Adapter::Lora(name) => {
                bytes.push(1);
                bytes.extend_from_slice(name.as_bytes());
            }
            Adapter::LoraId(id) => {
                bytes.push(2);
                bytes.extend_from_slice(&id.to_le_bytes());
            }
        }
        Self(xxh3_64(&bytes))
    }
}

/// Which weights computed a block's KV: blocks of different adapters never match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Adapter<'a> {
    #[default]
    Base,
    /// A LoRA adapter by name (vLLM's `lora_name`, what a request names).
    Lora(&'a str),
    /// A LoRA adapter known only by the id older vLLM published (`lora_id`): kept apart from
    /// the base model, matched by no request (requests name adapters).
    LoraId(i64),
}

/// Chains keys block after block from a root, reusing one buffer.
pub(crate) struct KeyChain {
    parent: BlockKey,
    bytes: Vec<u8>,
}

impl KeyChain {
    pub(crate) fn from(parent: BlockKey) -> Self {
        Self {
            parent,
            bytes: Vec::new(),
        }
    }

    /// The key of the block of `tokens` after the last one, which it becomes.
    pub(crate) fn next(&mut self, tokens: &[u32]) -> BlockKey {
        // Same length block after block: `resize` only sets the length, and the copy below
        // compiles to a plain copy on little-endian machines.
        self.bytes.resize(8 + 4 * tokens.len(), 0);
        let (parent, rest) = self.bytes.split_at_mut(8);
        parent.copy_from_slice(&self.parent.0.to_le_bytes());
        for (bytes, token) in rest.chunks_exact_mut(4).zip(tokens) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        self.parent = BlockKey(xxh3_64(&self.bytes));
        self.parent
    }
}

/// The keys of a prompt's full blocks of `block_size` tokens, in order; a partial last block
/// has none (engines cache only full blocks), and so has every block of size 0.
pub fn prompt_keys(tokens: &[u32], block_size: usize, adapter: Adapter<'_>) -> Vec<BlockKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut chain = KeyChain::from(BlockKey::root(adapter));
    tokens
        .chunks_exact(block_size)
        .map(|block| chain.next(block))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition in the module doc, spelled out: router replicas and other tools may
    /// compute keys themselves, so it must not drift.
    #[test]
    fn keys_are_xxh3_of_the_parent_and_the_tokens_little_endian() {
        let root = xxh3_64(b"switchyard-kv-index/root\0\0");
        assert_eq!(BlockKey::root(Adapter::Base).bits(), root);
        let mut bytes = root.to_le_bytes().to_vec();
        for token in [1u32, 70_000, 3, 4] {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        let first = xxh3_64(&bytes);
        let keys = prompt_keys(&[1, 70_000, 3, 4, 5, 6, 7, 8, 9], 4, Adapter::Base);
        assert_eq!(keys.len(), 2, "the partial tail has no key");
        assert_eq!(keys[0].bits(), first);
        assert_ne!(
            prompt_keys(&[1, 70_000, 3, 4], 4, Adapter::Lora("a"))[0],
            keys[0]
        );
        assert_eq!(prompt_keys(&[1, 2], 0, Adapter::Base), []);
    }
}
