//! Hash ids → token ids. A trace names each 512-token block of a prompt by an id; block `h` is
//! always the same 512 printable ASCII bytes, byte `j` being `0x20 + (x_j mod 95)` where `x_0,
//! x_1, …` are splitmix64's outputs seeded with `h`. Nothing else goes in (no run seed), so
//! bench, the lab and any other tool that follows this rule make the same prompts, and equal ids
//! are equal tokens for every prefix cache.
//!
//! The bytes are the token ids under the reference engine's byte-level tokenizer, and printable
//! ASCII is a valid prompt for any other server.

use crate::workload::{printable_byte, splitmix64};

/// Tokens per block of a trace's `hash_ids` (Mooncake's block size).
pub const BLOCK_TOKENS: usize = 512;

/// Block `hash_id`'s tokens.
pub fn block(hash_id: u64) -> [u8; BLOCK_TOKENS] {
    let mut state = hash_id;
    std::array::from_fn(|_| printable_byte(splitmix64(&mut state)))
}

/// The first `input_length` tokens of the blocks `hash_ids`, in order. A trace line has enough
/// blocks for its length (parsing checks it); were it short, the prompt would be too.
pub fn prompt_bytes(hash_ids: &[u64], input_length: usize) -> Vec<u8> {
    let mut prompt = Vec::with_capacity(input_length);
    for &id in hash_ids {
        let left = input_length - prompt.len();
        if left == 0 {
            break;
        }
        prompt.extend_from_slice(&block(id)[..left.min(BLOCK_TOKENS)]);
    }
    prompt
}

/// [`prompt_bytes`] as text (printable ASCII is UTF-8).
pub fn prompt_text(hash_ids: &[u64], input_length: usize) -> String {
    prompt_bytes(hash_ids, input_length)
        .into_iter()
        .map(char::from)
        .collect()
}
