//! A deterministic stand-in for an LLM that really depends on the KV cache it holds.
//!
//! Each token's KV bytes are a pure function of the token ids up to and including it: a rolling
//! 64-bit hash chain `h_i = mix(h_{i-1}, token_i, i)` expanded into the slot with a fast PRNG.
//! Predicting the token after position `n` folds the digests of *every* slot `0..=n` of the
//! sequence, in position order, into one state and derives 96 logits (95 printable ASCII bytes
//! and EOS) from it. A missing, stale or misplaced slot therefore changes the output, which is what
//! makes a disaggregated run a test of the KV data path.
//!
//! The output depends only on the token ids, the sampling parameters and the KV shape: never on
//! slot ids, pages, ranks, timing or which engine wrote a slot.
//!
//! ```
//! use switchyard_engine::model::{Model, Sampling};
//! use switchyard_kv::KvShape;
//!
//! let model = Model::new(KvShape::SMALL);
//! let chain = model.chain(&[104, 105]);
//! let mut slot = vec![0; KvShape::SMALL.bytes_per_token()];
//! model.fill_kv(chain[1], &mut slot);
//! let digests = [model.digest_of(chain[0]), Model::slot_digest(&slot)];
//! let next = model.next_token(digests.iter().copied(), 1, &Sampling::GREEDY).token;
//! assert!(next == Model::EOS || (32..=126).contains(&next));
//! ```

use switchyard_kv::KvShape;

/// Sampling parameters a request carries; all that influences the next token besides the KV.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus mass in `(0, 1]`.
    pub top_p: f64,
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };

    fn is_greedy(&self) -> bool {
        // Tiny temperatures are greedy in every real engine too (the softmax saturates).
        self.temperature.is_nan() || self.temperature <= 1e-5
    }
}

/// The model: stateless apart from the shape it writes KV for.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    shape: KvShape,
    chain_seed: u64,
}

/// Printable ASCII, the only bytes the model emits, so text re-tokenizes to the same ids.
const FIRST_PRINTABLE: u32 = 32;
const PRINTABLE: usize = 95;

/// EOS wins the greedy choice when the fold state hits this residue: rare (1/512 per token) but
/// reachable, so callers see `finish_reason: "stop"` as well as `"length"`.
const EOS_RESIDUE: u64 = 512;

impl Model {
    pub const EOS: u32 = 256;

    pub fn new(shape: KvShape) -> Self {
        let chain_seed = mix(
            0x5157_4954_4348_5944 ^ u64::from(shape.layers),
            (u64::from(shape.kv_heads) << 32)
                | u64::from(shape.head_dim) << 8
                | u64::from(shape.dtype_bytes),
        );
        Model { shape, chain_seed }
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn bytes_per_token(&self) -> usize {
        self.shape.bytes_per_token()
    }

    /// The chain value before position 0.
    pub fn chain_start(&self) -> u64 {
        self.chain_seed
    }

    /// One link of the hash chain: the state after `token` at `position`.
    pub fn chain_step(prev: u64, token: u32, position: usize) -> u64 {
        mix(
            prev ^ u64::from(token).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            position as u64,
        )
    }

    /// The chain value at every position of `tokens`.
    pub fn chain(&self, tokens: &[u32]) -> Vec<u64> {
        let mut h = self.chain_seed;
        tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                h = Self::chain_step(h, t, i);
                h
            })
            .collect()
    }

    /// The chain value after the first `len` tokens (`chain_start` when `len == 0`).
    pub fn chain_at(&self, tokens: &[u32], len: usize) -> u64 {
        tokens[..len]
            .iter()
            .enumerate()
            .fold(self.chain_seed, |h, (i, &t)| Self::chain_step(h, t, i))
    }

    /// Writes the KV bytes of the token whose chain value is `h` into `out` (one slot).
    pub fn fill_kv(&self, h: u64, out: &mut [u8]) {
        let mut state = h;
        let mut words = out.chunks_exact_mut(8);
        for word in &mut words {
            word.copy_from_slice(&splitmix_next(&mut state).to_le_bytes());
        }
        let rest = words.into_remainder();
        let last = splitmix_next(&mut state).to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }

    /// A digest of one slot's bytes: what a decode step "attends" to.
    pub fn slot_digest(bytes: &[u8]) -> u64 {
        let mut acc = 0x243F_6A88_85A3_08D3u64 ^ bytes.len() as u64;
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let w = u64::from_le_bytes(word.try_into().unwrap_or([0; 8]));
            acc = (acc ^ w)
                .wrapping_mul(0x0000_0100_0000_01B3)
                .rotate_left(29);
        }
        for &b in words.remainder() {
            acc = (acc ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3);
        }
        mix(acc, 0)
    }

    /// The digest the slot of a token with chain value `h` has when its bytes are intact.
    pub fn digest_of(&self, h: u64) -> u64 {
        let mut buf = vec![0; self.bytes_per_token()];
        self.fill_kv(h, &mut buf);
        Self::slot_digest(&buf)
    }

    /// The token after `position`, from the digests of the slots at positions `0..=position`
    /// in order.
    pub fn next_token(
        &self,
        digests: impl Iterator<Item = u64>,
        position: usize,
        sampling: &Sampling,
    ) -> Sampled {
        let state = digests
            .enumerate()
            .fold(self.chain_seed, |acc, (i, d)| mix(acc ^ d, i as u64));
        let logits = logits(state);
        let index = pick(&logits, sampling, position);
        let token = if index == PRINTABLE {
            Self::EOS
        } else {
            FIRST_PRINTABLE + index as u32
        };
        // 96 logits: cheap enough to always compute.
        Sampled {
            token,
            logprob: Some(logprob(&logits, index)),
        }
    }
}

/// 95 printable logits in `[0, 4)` and an EOS logit that is the maximum exactly when the state
/// hits [`EOS_RESIDUE`], and otherwise far below the rest.
fn logits(state: u64) -> [f64; PRINTABLE + 1] {
    let mut out = [0.0; PRINTABLE + 1];
    let mut s = state;
    for logit in out.iter_mut().take(PRINTABLE) {
        *logit = unit(splitmix_next(&mut s)) * 4.0;
    }
    out[PRINTABLE] = if state.is_multiple_of(EOS_RESIDUE) {
        5.0
    } else {
        -4.0
    };
    out
}

/// The index `sampling` chooses among `logits` for the token after `position`: the first
/// maximum when greedy, else a draw seeded by the request's seed and the position only (so a
/// seeded run gives the same tokens on any engine, however it was batched or split).
/// A sampled token and, when computed, its log-probability under the model's raw logits
/// (before temperature and top-p, as vLLM reports it by default): what a `logprobs` answer
/// carries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<f32>,
}

/// `log softmax(logits)[index]`, computed stably.
pub(crate) fn logprob(logits: &[f64], index: usize) -> f32 {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|&l| (l - max).exp()).sum();
    (logits[index] - max - sum.ln()) as f32
}

pub(crate) fn pick(logits: &[f64], sampling: &Sampling, position: usize) -> usize {
    if sampling.is_greedy() {
        argmax(logits)
    } else {
        let draw = unit(mix(sampling.seed ^ 0xA076_1D64_78BD_642F, position as u64));
        sample(logits, sampling, draw)
    }
}

fn argmax(logits: &[f64]) -> usize {
    logits
        .iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |best, (i, &l)| {
            if l > best.1 { (i, l) } else { best }
        })
        .0
}

/// Softmax with temperature, then nucleus (top-p) truncation, then inverse-CDF with `draw`.
fn sample(logits: &[f64], sampling: &Sampling, draw: f64) -> usize {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l - max) / sampling.temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let top_p = if sampling.top_p > 0.0 && sampling.top_p <= 1.0 {
        sampling.top_p
    } else {
        1.0
    };
    let mut kept = 0;
    let mut mass = 0.0;
    for p in &probs {
        kept += 1;
        mass += p.1;
        if mass >= top_p {
            break;
        }
    }
    let target = draw * mass;
    let mut acc = 0.0;
    for p in &probs[..kept] {
        acc += p.1;
        if acc > target {
            return p.0;
        }
    }
    probs[kept - 1].0
}

/// A strong 64-bit mixer (splitmix64's finaliser over a combined input).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b
        .wrapping_mul(0xD6E8_FEB8_6659_FD93)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn splitmix_next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A u64 as a float in `[0, 1)`.
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests;
