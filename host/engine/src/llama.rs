//! A real LLM for the reference engine: a llama-family GGUF (SmolLM2-135M-Instruct by default)
//! on CPU, with a forward pass of our own over K/V the engine's paged pool holds.
//!
//! Why not candle's `quantized_llama`: it keeps its KV private, and it is not batch-invariant
//! (its f32 Q·Kᵀ matmul changes summation order above 16 rows and its softmax sums a padded
//! row differently), so a position's logits would depend on how the prompt was chunked, and a
//! disaggregated run (prefill on P, decode on D) would not reproduce a single engine's tokens.
//! Here every step is row-independent and sums in a fixed order:
//!
//! - weight matmuls are Q8_0 ([`q8`]: each output value depends only on its input row and its
//!   weight row, computed by one sequence of operations on every CPU; weights of other types
//!   are requantized to Q8_0 at load, which is also 2–5× faster on CPU than a Q4_1 kernel);
//! - RMS norm, SiLU, the interleaved (GGUF) rope and attention are plain loops here; attention
//!   runs per (row, head) over positions `0..=pos` in order, reading K/V from [`SeqChunk::kv`].
//!
//! So a position's logits are bit-identical whether it was computed in one batch, in chunks,
//! one token at a time, beside other sequences, or from K/V another process computed, on this
//! CPU or another: the Q8_0 kernel's AVX2 and portable paths give the same bits (candle's own
//! kernels did not: it picked scalar, AVX2 or AVX512-VNNI code by CPU, each summing otherwise).
//!
//! One slot of the pool holds one position's K and V of every layer as f32, laid out
//! `[layer][k, v][kv_head][head_dim]` (46 080 bytes for SmolLM2-135M).

use std::path::Path;
use std::sync::Mutex;

use candle_core::Device;
use candle_core::quantized::{QTensor, gguf_file};
use switchyard_kv::KvShape;

use q8::Q8Rows;
use switchyard_wire::gguf::GgufMetadata;

/// Why a GGUF model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Metadata(#[from] switchyard_wire::gguf::GgufError),
    #[error("{what}: {reason}")]
    Unsupported { what: String, reason: String },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// The hyper-parameters the forward pass needs, from the GGUF metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub context: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
}

impl LlamaConfig {
    fn from_metadata(meta: &GgufMetadata) -> Result<Self, LlamaError> {
        let arch = meta.architecture()?;
        if arch != "llama" {
            return Err(LlamaError::Unsupported {
                what: format!("architecture {arch:?}"),
                reason: "only llama-family GGUF models run here".into(),
            });
        }
        let hidden = meta.arch_uint("embedding_length")? as usize;
        let heads = meta.arch_uint("attention.head_count")? as usize;
        let kv_heads = meta
            .arch_uint("attention.head_count_kv")
            .map_or(heads, |v| v as usize);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LlamaError::Unsupported {
                what: format!("{heads} heads over {kv_heads} KV heads"),
                reason: "heads must be a multiple of KV heads".into(),
            });
        }
        let head_dim = meta
            .arch_uint("rope.dimension_count")
            .map_or(hidden / heads, |v| v as usize);
        Ok(LlamaConfig {
            layers: meta.arch_uint("block_count")? as usize,
            heads,
            kv_heads,
            head_dim,
            hidden,
            vocab: meta.strings("tokenizer.ggml.tokens")?.len(),
            context: meta.arch_uint("context_length")? as usize,
            rms_eps: meta.arch_float("attention.layer_norm_rms_epsilon")? as f32,
            rope_theta: meta.arch_float("rope.freq_base").unwrap_or(10_000.0) as f32,
        })
    }

    /// The pool slot shape: one position's K and V of every layer, f32.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.layers as u32,
            kv_heads: self.kv_heads as u32,
            head_dim: self.head_dim as u32,
            dtype_bytes: 4,
        }
    }

    /// f32 values in one slot.
    pub fn slot_floats(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Q8Rows,
    wk: Q8Rows,
    wv: Q8Rows,
    wo: Q8Rows,
    ffn_norm: Vec<f32>,
    w_gate: Q8Rows,
    w_up: Q8Rows,
    w_down: Q8Rows,
}

/// A loaded llama-family model. Immutable: one instance serves every sequence.
pub struct Llama {
    cfg: LlamaConfig,
    /// `vocab × hidden`, dequantized once (lookups are per row, so any dtype is exact).
    embedding: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: Q8Rows,
    /// `1 / theta^(2i / head_dim)` for each rotated pair.
    inv_freq: Vec<f32>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// One sequence's share of a forward pass: positions `start .. start + tokens.len()`.
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    /// K/V of positions `0..start`, one slot ([`LlamaConfig::slot_floats`]) per position; the
    /// pass appends the slots of the new positions.
    pub kv: &'a mut Vec<f32>,
    /// Whether to return the logits of the chunk's last position.
    pub logits: bool,
}

impl Llama {
    /// Loads `path`, requantizing every quantized weight to Q8_0 (see the module docs). The
    /// matmuls and attention run on candle's thread pool (`CANDLE_NUM_THREADS`).
    pub fn load(path: &Path, meta: &GgufMetadata) -> Result<Self, LlamaError> {
        let cfg = LlamaConfig::from_metadata(meta)?;
        let open_err = |source| LlamaError::Open {
            path: path.display().to_string(),
            source,
        };
        let mut file = std::io::BufReader::new(std::fs::File::open(path).map_err(open_err)?);
        let content = gguf_file::Content::read(&mut file)?;
        let device = Device::Cpu;
        let mut tensor = |name: &str| -> Result<QTensor, LlamaError> {
            Ok(content.tensor(&mut file, name, &device)?)
        };
        let embedding_q = tensor("token_embd.weight")?;
        let embedding = embedding_q.dequantize(&device)?.flatten_all()?.to_vec1()?;
        if embedding.len() != cfg.vocab * cfg.hidden {
            return Err(LlamaError::Unsupported {
                what: "token_embd.weight".into(),
                reason: format!(
                    "{} values for a {} × {} table",
                    embedding.len(),
                    cfg.vocab,
                    cfg.hidden
                ),
            });
        }
        let output = if content.tensor_infos.contains_key("output.weight") {
            Q8Rows::from_weight(tensor("output.weight")?)?
        } else {
            // Tied embeddings (SmolLM2): the embedding table is also the output layer.
            Q8Rows::from_weight(embedding_q)?
        };
        let norm = vector(tensor("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let mut t = |name: &str| tensor(&format!("blk.{l}.{name}.weight"));
            layers.push(Layer {
                attn_norm: vector(t("attn_norm")?)?,
                wq: Q8Rows::from_weight(t("attn_q")?)?,
                wk: Q8Rows::from_weight(t("attn_k")?)?,
                wv: Q8Rows::from_weight(t("attn_v")?)?,
                wo: Q8Rows::from_weight(t("attn_output")?)?,
                ffn_norm: vector(t("ffn_norm")?)?,
                w_gate: Q8Rows::from_weight(t("ffn_gate")?)?,
                w_up: Q8Rows::from_weight(t("ffn_up")?)?,
                w_down: Q8Rows::from_weight(t("ffn_down")?)?,
            });
        }
        let pairs = cfg.head_dim / 2;
        let inv_freq = (0..pairs)
            .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f32 / cfg.head_dim as f32))
            .collect();
        Ok(Llama {
            cfg,
            embedding,
            layers,
            norm,
            output,
            inv_freq,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Runs every chunk's new positions through the model, appending their K/V to each
    /// chunk's `kv`; returns, per chunk, the logits of its last position if it asked for them.
    pub fn forward(
        &self,
        chunks: &mut [SeqChunk<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>, LlamaError> {
        let cfg = &self.cfg;
        let (hidden, hd, kv_dim) = (cfg.hidden, cfg.head_dim, cfg.kv_dim());
        let slot = cfg.slot_floats();
        // Rows of the batch: (chunk, position), chunk by chunk.
        let rows: Vec<(usize, usize)> = chunks
            .iter()
            .enumerate()
            .flat_map(|(c, ch)| (ch.start..ch.start + ch.tokens.len()).map(move |p| (c, p)))
            .collect();
        let n = rows.len();
        if n == 0 {
            return Ok(chunks.iter().map(|_| None).collect());
        }
        for ch in chunks.iter_mut() {
            if ch.kv.len() != ch.start * slot {
                return Err(LlamaError::Unsupported {
                    what: "a chunk's KV".into(),
                    reason: format!("{} values for {} positions", ch.kv.len(), ch.start),
                });
            }
            ch.kv.resize((ch.start + ch.tokens.len()) * slot, 0.0);
        }
        let mut x = Vec::with_capacity(n * hidden);
        for ch in chunks.iter() {
            for &t in ch.tokens {
                let t = t as usize;
                let row = self
                    .embedding
                    .get(t * hidden..(t + 1) * hidden)
                    .ok_or_else(|| LlamaError::Unsupported {
                        what: format!("token id {t}"),
                        reason: format!("past the vocabulary ({})", cfg.vocab),
                    })?;
                x.extend_from_slice(row);
            }
        }
        let mut attn = vec![0.0f32; n * cfg.heads * hd];
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, cfg.rms_eps);
            let mut q = layer.wq.matmul(&h, n);
            let mut k = layer.wk.matmul(&h, n);
            let v = layer.wv.matmul(&h, n);
            for (r, &(c, pos)) in rows.iter().enumerate() {
                self.rope(&mut q[r * cfg.heads * hd..(r + 1) * cfg.heads * hd], pos);
                self.rope(&mut k[r * kv_dim..(r + 1) * kv_dim], pos);
                let base = pos * slot + l * 2 * kv_dim;
                let kv = &mut chunks[c].kv;
                kv[base..base + kv_dim].copy_from_slice(&k[r * kv_dim..(r + 1) * kv_dim]);
                kv[base + kv_dim..base + 2 * kv_dim]
                    .copy_from_slice(&v[r * kv_dim..(r + 1) * kv_dim]);
            }
            let kvs: Vec<&[f32]> = chunks.iter().map(|ch| ch.kv.as_slice()).collect();
            // The query heads that share a KV head (grouped-query attention) attend together.
            // One work item per (row, KV head): its query heads' outputs, a part of `attn` of
            // its own (the lock is never contended). Items split over the matmul threads (each
            // item's sums stay on one thread, in order, so the split changes no bit), which
            // also puts a decode step's attention on both cores.
            let group_width = cfg.heads / cfg.kv_heads * hd;
            let parts: Vec<Mutex<&mut [f32]>> =
                attn.chunks_mut(group_width).map(Mutex::new).collect();
            let attend_item = |item: usize| {
                let (r, kvh) = (item / cfg.kv_heads, item % cfg.kv_heads);
                let (c, pos) = rows[r];
                let at = Window {
                    pos,
                    offset: l * 2 * kv_dim + kvh * hd,
                    kv_dim,
                    slot,
                    head_dim: hd,
                };
                let q = &q[item * group_width..(item + 1) * group_width];
                let mut out = parts[item].lock().unwrap_or_else(|e| e.into_inner());
                attend(q, kvs[c], at, &mut out);
            };
            candle_core::utils::barrier_pool()
                .execute_chunked(parts.len(), |items| items.for_each(attend_item));
            drop(parts);
            let o = layer.wo.matmul(&attn, n);
            add(&mut x, &o);
            let h = rms_norm(&x, &layer.ffn_norm, cfg.rms_eps);
            let gate = layer.w_gate.matmul(&h, n);
            let up = layer.w_up.matmul(&h, n);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
            let down = layer.w_down.matmul(&act, n);
            add(&mut x, &down);
        }
        // Logits only for the last row of each chunk that asks: rows are independent, so
        // leaving the others out changes nothing but the cost.
        let mut last = 0;
        let mut wanted = Vec::new();
        for (c, ch) in chunks.iter().enumerate() {
            last += ch.tokens.len();
            if ch.logits && !ch.tokens.is_empty() {
                wanted.push((c, last - 1));
            }
        }
        let mut out: Vec<Option<Vec<f32>>> = chunks.iter().map(|_| None).collect();
        if wanted.is_empty() {
            return Ok(out);
        }
        let mut sel = Vec::with_capacity(wanted.len() * hidden);
        for &(_, r) in &wanted {
            sel.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let sel = rms_norm(&sel, &self.norm, cfg.rms_eps);
        let logits = self.output.matmul(&sel, wanted.len());
        let vocab = logits.len() / wanted.len();
        for (i, &(c, _)) in wanted.iter().enumerate() {
            out[c] = Some(logits[i * vocab..(i + 1) * vocab].to_vec());
        }
        Ok(out)
    }

    /// GGUF's rope: llama.cpp stores Q and K permuted so that the rotated pairs are adjacent
    /// values (`rope_i`), each head rotated alike.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let hd = self.cfg.head_dim;
        for head in x.chunks_exact_mut(hd) {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = pos as f32 * f;
                let (sin, cos) = angle.sin_cos();
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos - b * sin;
                head[2 * i + 1] = a * sin + b * cos;
            }
        }
    }
}

fn vector(t: QTensor) -> Result<Vec<f32>, LlamaError> {
    Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
}

/// A dot product with eight accumulators combined in a fixed order: vectorizes, and gives the
/// same bits on every call (the order never depends on the batch).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let mean = dot(row, row) / dim as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(&v, &w)| v * scale * w));
    }
    out
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Where one head's K and V sit in a sequence's slots: `offset` is where this layer's K for
/// this KV head starts in a slot (its V is `kv_dim` further), for positions `0..=pos`.
#[derive(Clone, Copy)]
struct Window {
    pos: usize,
    offset: usize,
    kv_dim: usize,
    slot: usize,
    head_dim: usize,
}

/// How many positions ahead attention prefetches K and V: one position's are a slot (45 KiB for
/// SmolLM2) from the next, a stride the hardware prefetcher does not follow.
const KV_AHEAD: usize = 4;

/// The attention of the query heads `qs` (each `head_dim` long) that share the KV head at `at`,
/// for the row at `at.pos`: per head, softmax(q·K[0..=pos] / √d) · V[0..=pos], over positions
/// in order. Each position's K and V are read once for all the heads (they sit a whole slot
/// apart, so reading is what attention costs); each head's sums are the same as alone.
fn attend(qs: &[f32], kv: &[f32], at: Window, out: &mut [f32]) {
    let Window {
        pos,
        offset,
        kv_dim,
        slot,
        head_dim: hd,
    } = at;
    let heads = qs.len() / hd;
    let positions = pos + 1;
    let scale = 1.0 / (hd as f32).sqrt();
    // scores[h * positions + t]: head h's score for position t.
    let mut scores = vec![0.0f32; heads * positions];
    let mut max = vec![f32::NEG_INFINITY; heads];
    for t in 0..positions {
        q8::prefetch(kv, (t + KV_AHEAD) * slot + offset, hd);
        let k = &kv[t * slot + offset..t * slot + offset + hd];
        for (h, q) in qs.chunks_exact(hd).enumerate() {
            let s = dot(q, k) * scale;
            max[h] = max[h].max(s);
            scores[h * positions + t] = s;
        }
    }
    let mut sum = vec![0.0f32; heads];
    for (h, head_scores) in scores.chunks_exact_mut(positions).enumerate() {
        for s in head_scores.iter_mut() {
            *s = (*s - max[h]).exp();
            sum[h] += *s;
        }
    }
    out.fill(0.0);
    for t in 0..positions {
        q8::prefetch(kv, (t + KV_AHEAD) * slot + offset + kv_dim, hd);
        let v = &kv[t * slot + offset + kv_dim..t * slot + offset + kv_dim + hd];
        for (h, head_out) in out.chunks_exact_mut(hd).enumerate() {
            let w = scores[h * positions + t] / sum[h];
            head_out.iter_mut().zip(v).for_each(|(o, &v)| *o += w * v);
        }
    }
}

mod q8;
#[cfg(test)]
mod tests;
