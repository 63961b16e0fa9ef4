//! What computes the tokens, behind one face the core drives: the synthetic model or a real
//! GGUF model, which keep every position's K/V in the engine's pool (so the transports move
//! what the model actually reads), or a model that costs nothing, for a simulator.

use std::collections::HashMap;
use std::sync::Arc;

use switchyard_kv::{KvStore, SlotGate};

use super::request::RequestId;
use super::seq::Seq;
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

/// What computes a core's tokens, and where their K/V lives.
pub struct Backend(Kind);

enum Kind {
    Synthetic {
        store: Arc<KvStore>,
        model: Model,
        /// Digest of every slot's bytes, kept in step with the pool: what decode steps read.
        slot_digest: Vec<u64>,
        scratch: Vec<u8>,
        /// Each running sequence's hash chain, and after how many of its tokens.
        chains: HashMap<RequestId, (usize, u64)>,
    },
    Llama {
        store: Arc<KvStore>,
        model: Arc<LlamaModel>,
        /// The last position's logits of each sequence whose pass ended its known tokens.
        logits: HashMap<RequestId, Vec<f32>>,
        /// Each running sequence's K/V of positions `0..computed`, as last read or written, so
        /// a decode step does not copy the whole context out of the pool again. Sound because
        /// a sequence's computed positions never change while it runs: they are its own pages
        /// or shared prefix-cache pages, and transfers land before its start_generate.
        kv: HashMap<RequestId, Vec<f32>>,
    },
    /// Writes and reads no K/V and picks tokens from their positions alone: what a simulator
    /// drives when only the scheduling and its modelled time matter.
    Costless,
}

impl Backend {
    /// `spec`'s model, keeping its K/V in `store`, whose gate guards the reserved windows.
    pub fn new(spec: &ModelSpec, store: Arc<KvStore>) -> Self {
        Backend(match spec {
            ModelSpec::Synthetic => Kind::Synthetic {
                model: Model::new(store.shape()),
                slot_digest: vec![0; store.num_slots() as usize],
                scratch: vec![0; store.shape().bytes_per_token()],
                chains: HashMap::new(),
                store,
            },
            ModelSpec::Llama(model) => Kind::Llama {
                store,
                model: model.clone(),
                logits: HashMap::new(),
                kv: HashMap::new(),
            },
        })
    }

    /// A model that costs nothing per token: no K/V is written or read, so a transfer moves
    /// nothing, and the token after position `p` is the byte `b'a' + p % 26` (never EOS: a
    /// generation runs to its `max_tokens` or a stop string).
    pub fn costless() -> Self {
        Backend(Kind::Costless)
    }

    /// Where receivers may write: the pool's gate, which a costless model has none of.
    pub(super) fn gate(&self) -> Option<&SlotGate> {
        match &self.0 {
            Kind::Synthetic { store, .. } | Kind::Llama { store, .. } => Some(store.gate()),
            Kind::Costless => None,
        }
    }

    /// A transport wrote `slot` behind the core's back: take note of its bytes.
    pub(super) fn received(&mut self, slot: u32) {
        if let Kind::Synthetic {
            store,
            slot_digest,
            scratch,
            ..
        } = &mut self.0
        {
            store.read_slot(slot, scratch);
            slot_digest[slot as usize] = Model::slot_digest(scratch);
        }
    }

    /// Runs the model over every planned sequence's next positions, writing their K/V into
    /// the pool, and advances each `computed`. A real model runs them all in one batch.
    pub(super) fn compute(&mut self, pool: &PagePool, plan: &mut [Planned<'_>]) {
        match &mut self.0 {
            Kind::Synthetic {
                store,
                model,
                slot_digest,
                scratch,
                chains,
            } => {
                for Planned { seq, n } in plan.iter_mut() {
                    // The chain carries on from the sequence's last step; after a jump (a
                    // prefix-cache match, received KV) it is recomputed from the tokens.
                    let mut chain = match chains.get(&seq.id) {
                        Some(&(at, chain)) if at == seq.computed => chain,
                        _ => model.chain_at(&seq.tokens, seq.computed),
                    };
                    for pos in seq.computed..seq.computed + *n {
                        chain = Model::chain_step(chain, seq.tokens[pos], pos);
                        model.fill_kv(chain, scratch);
                        let slot = pool.slot(&seq.pages, pos);
                        store.write_slot(slot, scratch);
                        slot_digest[slot as usize] = Model::slot_digest(scratch);
                    }
                    seq.computed += *n;
                    chains.insert(seq.id, (seq.computed, chain));
                }
            }
            Kind::Costless => {
                for Planned { seq, n } in plan.iter_mut() {
                    seq.computed += *n;
                }
            }
            Kind::Llama {
                store,
                model,
                logits,
                kv,
            } => {
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
    pub(super) fn next_token(
        &mut self,
        pool: &PagePool,
        seq: &Seq,
        sampling: &Sampling,
        with_logprob: bool,
    ) -> Sampled {
        let position = seq.computed - 1;
        match &mut self.0 {
            Kind::Synthetic {
                model, slot_digest, ..
            } => {
                let digests =
                    (0..seq.computed).map(|pos| slot_digest[pool.slot(&seq.pages, pos) as usize]);
                model.next_token(digests, position, sampling)
            }
            Kind::Llama { logits, .. } => {
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
            Kind::Costless => Sampled {
                token: u32::from(b'a') + (position % 26) as u32,
                // Certain of its choice.
                logprob: with_logprob.then_some(0.0),
            },
        }
    }

    pub(super) fn is_eos(&self, token: u32) -> bool {
        match &self.0 {
            Kind::Synthetic { .. } => token == Model::EOS,
            Kind::Llama { model, .. } => model.eos.contains(&token),
            Kind::Costless => false,
        }
    }

    /// The bytes a token stands for in the output text.
    pub(super) fn token_bytes(&self, token: u32) -> &[u8] {
        match &self.0 {
            Kind::Synthetic { .. } | Kind::Costless => SYNTHETIC_BYTES
                .get(token as usize..token as usize + 1)
                .unwrap_or_default(),
            Kind::Llama { model, .. } => model
                .token_bytes
                .get(token as usize)
                .map_or(&[][..], Vec::as_slice),
        }
    }

    /// A sequence left the batch: forget what was kept for it.
    pub(super) fn forget(&mut self, id: RequestId) {
        match &mut self.0 {
            Kind::Synthetic { chains, .. } => {
                chains.remove(&id);
            }
            Kind::Llama { logits, kv, .. } => {
                logits.remove(&id);
                kv.remove(&id);
            }
            Kind::Costless => {}
        }
    }
}

/// The synthetic (and costless) model's ids below 256 are the bytes themselves.
const SYNTHETIC_BYTES: [u8; 256] = {
    let mut b = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        b[i] = i as u8;
        i += 1;
    }
    b
};
