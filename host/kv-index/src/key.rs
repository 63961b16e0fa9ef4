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

use xxhash_rust::const_xxh3;
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
        const PREFIX: &[u8] = b"switchyard-kv-index/root\0";
        // Every base-model event and lookup starts here: computed once, by the compiler.
        const BASE: u64 = const_xxh3::xxh3_64(b"switchyard-kv-index/root\0\0");
        let bytes = match adapter {
            Adapter::Base => return Self(BASE),
            Adapter::Lora(name) => [PREFIX, &[1], name.as_bytes()].concat(),
            Adapter::LoraId(id) => [PREFIX, &[2], &id.to_le_bytes()].concat(),
        };
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

/// Chains keys block after block from a root.
pub(crate) struct KeyChain {
    parent: BlockKey,
    /// `parent ‖ tokens` for block sizes without a path of their own.
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
    // Into the walk and the stores, which call it once a block.
    #[inline]
    pub(crate) fn next(&mut self, tokens: &[u32]) -> BlockKey {
        let bits = match <&[u32; 16]>::try_from(tokens) {
            // vLLM's default block size, and a lookup's whole cost: no copy, no call.
            Ok(block) => xxh3_of_block(self.parent.0, block),
            Err(_) => self.xxh3_of_copy(tokens),
        };
        self.parent = BlockKey(bits);
        self.parent
    }

    fn xxh3_of_copy(&mut self, tokens: &[u32]) -> u64 {
        // Same length block after block: `resize` only sets the length, and the copy below
        // compiles to a plain copy on little-endian machines.
        self.bytes.resize(8 + 4 * tokens.len(), 0);
        let (parent, rest) = self.bytes.split_at_mut(8);
        parent.copy_from_slice(&self.parent.0.to_le_bytes());
        for (bytes, token) in rest.chunks_exact_mut(4).zip(tokens) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        xxh3_64(&self.bytes)
    }
}

/// `xxh3_64(parent ‖ tokens)`, both little-endian, for inputs of 17 to 128 bytes (3 to 30
/// tokens), read from the words themselves instead of a copy of their bytes: XXH3's
/// mid-size path (`XXH3_len_17to128_64b` in the reference), default secret, seed 0.
#[inline(always)]
fn xxh3_of_block<const TOKENS: usize>(parent: u64, tokens: &[u32; TOKENS]) -> u64 {
    const { assert!(TOKENS >= 3 && TOKENS <= 30, "17 to 128 bytes") };
    const SECRET: [u8; 192] = const_xxh3::const_custom_default_secret(0);
    /// XXH64's first prime, which XXH3 starts from.
    const PRIME64_1: u64 = 0x9e37_79b1_85eb_ca87;
    let len = 8 + 4 * TOKENS;
    // The input's 32-bit word at byte `at` (inputs are whole words here).
    let half = |at: usize| match at {
        0 => parent & 0xffff_ffff,
        4 => parent >> 32,
        _ => u64::from(tokens[(at - 8) / 4]),
    };
    let word = |at: usize| half(at) | half(at + 4) << 32;
    let secret = |at: usize| {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(&SECRET[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    let mix16 = |at: usize, secret_at: usize| {
        let product = u128::from(word(at) ^ secret(secret_at))
            * u128::from(word(at + 8) ^ secret(secret_at + 8));
        product as u64 ^ (product >> 64) as u64
    };
    // Pairs of 16-byte stripes from both ends inwards, one pair per started 32 bytes.
    let mut acc = (len as u64).wrapping_mul(PRIME64_1);
    for pair in 0..(len - 1) / 32 + 1 {
        acc = acc
            .wrapping_add(mix16(16 * pair, 32 * pair))
            .wrapping_add(mix16(len - 16 * (pair + 1), 32 * pair + 16));
    }
    // XXH3's avalanche.
    acc ^= acc >> 37;
    acc = acc.wrapping_mul(0x1656_6791_9e37_79f9);
    acc ^ (acc >> 32)
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
        assert_eq!(
            BlockKey::root(Adapter::Lora("sql")).bits(),
            xxh3_64(b"switchyard-kv-index/root\0\x01sql")
        );
        assert_eq!(
            BlockKey::root(Adapter::LoraId(3)).bits(),
            xxh3_64(b"switchyard-kv-index/root\0\x02\x03\0\0\0\0\0\0\0")
        );
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

    /// The 16-token blocks' own path against the crate's XXH3 on the bytes, for tokens over
    /// the whole `u32` range and parents over the whole `u64` range.
    #[test]
    fn sixteen_token_blocks_hash_as_their_bytes_do() {
        let mut state = 0x5eed_u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1442695040888963407);
            state
        };
        for _ in 0..1_000 {
            let parent = BlockKey(next());
            let tokens: Vec<u32> = (0..16).map(|_| (next() >> 32) as u32).collect();
            let mut bytes = parent.bits().to_le_bytes().to_vec();
            for token in &tokens {
                bytes.extend_from_slice(&token.to_le_bytes());
            }
            assert_eq!(KeyChain::from(parent).next(&tokens).bits(), xxh3_64(&bytes));
        }
        // The generic path too, for a block size without a path of its own.
        for tokens in [&[7u32; 15][..], &[7; 17]] {
            let mut bytes = 9u64.to_le_bytes().to_vec();
            for token in tokens {
                bytes.extend_from_slice(&token.to_le_bytes());
            }
            assert_eq!(
                KeyChain::from(BlockKey(9)).next(tokens).bits(),
                xxh3_64(&bytes)
            );
        }
    }
}
