//! What computes the tokens: the synthetic model or a real GGUF model, behind one face the step
//! loop drives. Both keep every position's K/V in the engine's pool, so the transports move
//! what the model actually reads.

use std::collections::HashMap;
use std::sync::Arc;

use switchyard_kv::KvStore;

use super::Seq;
use crate::kv_pool::PagePool;
use crate::llama::{Llama, SeqChunk};
use crate::model::{self, Model, Sampled, Sampling};

/// The model an engine runs, with the token vocabulary as bytes for detokenizing.
#[derive(Debug, Clone)]
pub enum ModelSpec {
    Synthetic,
    Llama(Arc<LlamaModel>),
}

/// A loaded GGUF model and what the step loop needs to turn its ids into text and stop.
#[derive(Debug)]
pub struct LlamaModel {
    pub llama: Llama,
    /// The bytes each token id stands for (empty for control tokens, never streamed).
    pub token_bytes: Vec<Vec<u8>>,
    /// Ids that end a generation (`finish_reason: "stop"`).
    pub eos: Vec<u32>,
}

/// One sequence's share of a step: `n` positions from `seq.computed`.
pub(super) struct Planned<'a> {
    pub seq: &'a mut Seq,
    pub n: usize,
}

pub(super) enum Backend {
    Synthetic {
        model: Model,
        /// Digest of every slot's bytes, kept in step with the pool: what decode steps read.
        slot_digest: Vec<u64>,
        scratch: Vec<u8>,
    },
    Llama {
        model: Arc<LlamaModel>,
        /// The last position's logits of each sequence whose pass ended its known tokens.
        logits: HashMap<u64, Vec<f32>>,
        /// Each running sequence's K/V of positions `0..computed`, as last read or written, so
        /// a decode step does not copy the whole context out of the pool again. Sound because
        /// a sequence's computed positions never change while it runs: they are its own pages
        /// or shared prefix-cache pages, and transfers land before its start_generate.
        kv: HashMap<u64, Vec<f32>>,
    },
}

impl Backend {
    pub fn new(spec: &ModelSpec, store: &KvStore) -> Self {
        match spec {
            ModelSpec::Synthetic => Backend::Synthetic {
                model: Model::new(store.shape()),
                slot_digest: vec![0; store.num_slots() as usize],
                scratch: vec![0; store.shape().bytes_per_token()],
            },
            ModelSpec::Llama(model) => Backend::Llama {
                model: model.clone(),
                logits: HashMap::new(),
                kv: HashMap::new(),
            },
        }
    }

    /// The synthetic model's hash chain after `len` tokens (unused by a real model).
    pub fn chain_at(&self, tokens: &[u32], len: usize) -> u64 {
        match self {
            Backend::Synthetic { model, .. } => model.chain_at(tokens, len),
            Backend::Llama { .. } => 0,
        }
    }

    /// A transport wrote `slot` behind the loop's back: take note of its bytes.
    pub fn received(&mut self, store: &KvStore, slot: u32) {
        if let Backend::Synthetic {
            slot_digest,
            scratch,
            ..
        } = self
        {
            store.read_slot(slot, scratch);
            slot_digest[slot as usize] = Model::slot_digest(scratch);
        }
    }

    /// Runs the model over every planned sequence's next positions, writing their K/V into
    /// the pool, and advances each `computed`. A real model runs them all in one batch.
    pub fn compute(&mut self, store: &KvStore, pool: &PagePool, plan: &mut [Planned<'_>]) {
        match self {
            Backend::Synthetic {
                model,
                slot_digest,
                scratch,
            } => {
                for Planned { seq, n } in plan.iter_mut() {
                    for pos in seq.computed..seq.computed + *n {
                        seq.chain = Model::chain_step(seq.chain, seq.tokens[pos], pos);
                        model.fill_kv(seq.chain, scratch);
                        let slot = pool.slot(&seq.pages, pos);
                        store.write_slot(slot, scratch);
                        slot_digest[slot as usize] = Model::slot_digest(scratch);
                    }
                    seq.computed += *n;
                }
            }
            Backend::Llama { model, logits, kv } => {
                let floats = model.llama.config().slot_floats();
                // What each sequence runs: positions `[from, to)`. A generation whose every
                // position is in the pool already (start_generate at the window's end) reruns
                // its last position for the logits, without writing its K/V again (it may sit
                // in a shared prefix-cache page); a prefill with nothing left runs nothing.
                let runs: Vec<(usize, usize)> = plan
                    .iter()
                    .map(|p| match p.n {
                        0 if p.seq.generates() && p.seq.computed > 0 => {
                            (p.seq.computed - 1, p.seq.computed)
                        }
                        n => (p.seq.computed, p.seq.computed + n),
                    })
                    .collect();
                // Each sequence's earlier K/V: kept from its last step, else read from the
                // pool (where a transfer or the prefix cache may have put it).
                let mut kvs: Vec<Vec<f32>> = plan
                    .iter()
                    .zip(&runs)
                    .map(|(p, &(from, _))| match kv.remove(&p.seq.id) {
                        Some(mut kept) if kept.len() >= from * floats => {
                            kept.truncate(from * floats);
                            kept
                        }
                        _ => {
                            let mut read = vec![0.0f32; from * floats];
                            for (pos, slot) in read.chunks_exact_mut(floats).enumerate() {
                                let s = pool.slot(&p.seq.pages, pos);
                                store.read_slot(s, bytemuck::cast_slice_mut(slot));
                            }
                            read
                        }
                    })
                    .collect();
                let mut chunks: Vec<SeqChunk<'_>> = plan
                    .iter()
                    .zip(&runs)
                    .zip(kvs.iter_mut())
                    .map(|((p, &(from, to)), kv)| SeqChunk {
                        tokens: &p.seq.tokens[from..to],
                        start: from,
                        kv,
                        logits: to == p.seq.target() && p.seq.generates(),
                    })
                    .collect();
                // A forward pass fails only on a token id past the vocabulary or a candle
                // error on weights that loaded: bugs, like an out-of-range slot.
                let out = model
                    .llama
                    .forward(&mut chunks)
                    .unwrap_or_else(|e| panic!("the model's forward pass failed: {e}"));
                drop(chunks);
                for (((p, seq_kv), l), &(from, to)) in plan.iter_mut().zip(kvs).zip(out).zip(&runs)
                {
                    let seq = &mut *p.seq;
                    for pos in from.max(seq.computed)..to {
                        let slot = pool.slot(&seq.pages, pos);
                        let bytes = &seq_kv[pos * floats..(pos + 1) * floats];
                        store.write_slot(slot, bytemuck::cast_slice(bytes));
                    }
                    seq.computed += p.n;
                    if let Some(l) = l {
                        logits.insert(seq.id, l);
                    }
                    kv.insert(seq.id, seq_kv);
                }
            }
        }
    }

    /// The token after the last computed position of `seq`, per its sampling parameters, and
    /// its log-probability if `with_logprob` (a pass over the vocabulary's logits, which the
    /// real model does only when asked).
    pub fn next_token(
        &mut self,
        pool: &PagePool,
        seq: &Seq,
        sampling: &Sampling,
        with_logprob: bool,
    ) -> Sampled {
        let position = seq.computed - 1;
        match self {
            Backend::Synthetic {
                model, slot_digest, ..
            } => {
                let digests =
                    (0..seq.computed).map(|pos| slot_digest[pool.slot(&seq.pages, pos) as usize]);
                model.next_token(digests, position, sampling)
            }
            Backend::Llama { logits, .. } => {
                let l = logits
                    .remove(&seq.id)
                    .expect("the pass that ended a sequence's tokens kept its logits");
                let l: Vec<f64> = l.into_iter().map(f64::from).collect();
                let index = model::pick(&l, sampling, position);
                Sampled {
                    token: index as u32,
                    logprob: with_logprob.then(|| model::logprob(&l, index)),
                }
            }
        }
    }

    pub fn is_eos(&self, token: u32) -> bool {
        match self {
            Backend::Synthetic { .. } => token == Model::EOS,
            Backend::Llama { model, .. } => model.eos.contains(&token),
        }
    }

    /// The bytes a token stands for in the output text.
    pub fn token_bytes(&self, token: u32) -> &[u8] {
        match self {
            Backend::Synthetic { .. } => SYNTHETIC_BYTES
                .get(token as usize..token as usize + 1)
                .unwrap_or_default(),
            Backend::Llama { model, .. } => model
                .token_bytes
                .get(token as usize)
                .map_or(&[][..], Vec::as_slice),
        }
    }

    /// A sequence left the loop: forget what was kept for it.
    pub fn forget(&mut self, id: u64) {
        if let Backend::Llama { logits, kv, .. } = self {
            logits.remove(&id);
            kv.remove(&id);
        }
    }
}

/// The synthetic model's ids below 256 are the bytes themselves.
const SYNTHETIC_BYTES: [u8; 256] = {
    let mut b = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        b[i] = i as u8;
        i += 1;
    }
    b
};
