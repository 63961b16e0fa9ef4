//! How long an engine step and a KV transfer would take on real hardware, scaled by
//! `--time-scale`: the [`TimingModel`] the scheduler core costs its steps with.
//!
//! Profiles are named so benchmarks can say what they simulate. `null` costs nothing (the default:
//! tests and functional runs should not wait). `llama3-8b-h100` is Llama-3-8B in bf16 on one
//! H100 SXM, built from public figures:
//! - prefill is compute-bound: 2 × 8.0e9 FLOP per token at ~400 TFLOP/s sustained (≈40% of the
//!   989 TFLOP/s dense bf16 peak) ≈ 40 µs per token, plus ~1 µs per token of attention per
//!   thousand tokens of context (quadratic term, FlashAttention-2 rates);
//! - a decode step is memory-bound: it streams 16 GB of weights at ~3.0 TB/s of the 3.35 TB/s
//!   HBM3 peak ≈ 5.3 ms, plus the KV it attends to (128 KiB per context token for Llama-3-8B
//!   ≈ 0.044 µs per token) and ~15 µs per sequence of sampling/launch overhead; these match the
//!   ~6–8 ms inter-token latencies vLLM and MLC report for small batches;
//! - KV moves over NVLink 4 at ~150 GB/s achieved with one-sided NVSHMEM puts (of 450 GB/s per
//!   direction), plus 10 µs per transfer.
//!
//! A [`TimingTable`] costs steps from measurements instead of a formula: a CSV of prefill
//! lengths and decode batches × contexts, each with the milliseconds a step took.

use std::time::Duration;

/// A cost model. All figures are in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profile {
    pub name: &'static str,
    /// Fixed cost of any step that does work (kernel launches, scheduling).
    pub step_base_us: f64,
    pub prefill_us_per_token: f64,
    /// Extra prefill cost per token per 1000 tokens of context before it.
    pub prefill_us_per_token_per_kctx: f64,
    /// Cost of a step with at least one decoding sequence (the weights are read once).
    pub decode_step_us: f64,
    pub decode_us_per_seq: f64,
    pub decode_us_per_ctx_token: f64,
    pub transfer_us_per_byte: f64,
    pub transfer_us_base: f64,
}

impl Profile {
    pub const NULL: Profile = Profile {
        name: "null",
        step_base_us: 0.0,
        prefill_us_per_token: 0.0,
        prefill_us_per_token_per_kctx: 0.0,
        decode_step_us: 0.0,
        decode_us_per_seq: 0.0,
        decode_us_per_ctx_token: 0.0,
        transfer_us_per_byte: 0.0,
        transfer_us_base: 0.0,
    };

    pub const LLAMA3_8B_H100: Profile = Profile {
        name: "llama3-8b-h100",
        step_base_us: 100.0,
        prefill_us_per_token: 40.0,
        prefill_us_per_token_per_kctx: 1.0,
        decode_step_us: 5300.0,
        decode_us_per_seq: 15.0,
        decode_us_per_ctx_token: 0.044,
        transfer_us_per_byte: 1.0 / 150_000.0,
        transfer_us_base: 10.0,
    };

    pub const ALL: [Profile; 2] = [Profile::NULL, Profile::LLAMA3_8B_H100];

    pub fn by_name(name: &str) -> Option<Profile> {
        Self::ALL.into_iter().find(|p| p.name == name)
    }
}

/// What one step did, for costing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWork {
    /// (tokens prefilled, context length before them), summed over prefill chunks.
    pub prefill_tokens: usize,
    pub prefill_token_ctx: usize,
    pub decode_seqs: usize,
    pub decode_ctx_tokens: usize,
}

/// How long work takes on the hardware an engine stands in for. The core costs each step with
/// it and makes the step's outputs visible only when that time has passed; KV pushes wait out
/// their transfer time. [`Latency`] computes both from a [`Profile`]'s formula; a table
/// measured on real hardware can take its place.
pub trait TimingModel: std::fmt::Debug + Send + Sync {
    /// One engine step that did `work`.
    fn step(&self, work: &StepWork) -> Duration;
    /// Moving `bytes` of KV from one engine to another.
    fn transfer(&self, bytes: usize) -> Duration;
}

/// A profile and the factor by which its times are stretched (0 = no waiting at all).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    pub profile: Profile,
    pub time_scale: f64,
}

impl TimingModel for Latency {
    fn step(&self, work: &StepWork) -> Duration {
        if work.prefill_tokens == 0 && work.decode_seqs == 0 {
            return Duration::ZERO;
        }
        let p = &self.profile;
        let prefill = work.prefill_tokens as f64 * p.prefill_us_per_token
            + work.prefill_token_ctx as f64 / 1000.0 * p.prefill_us_per_token_per_kctx;
        let decode = if work.decode_seqs == 0 {
            0.0
        } else {
            p.decode_step_us
                + work.decode_seqs as f64 * p.decode_us_per_seq
                + work.decode_ctx_tokens as f64 * p.decode_us_per_ctx_token
        };
        self.scaled(p.step_base_us + prefill + decode)
    }

    fn transfer(&self, bytes: usize) -> Duration {
        if bytes == 0 {
            return Duration::ZERO;
        }
        let p = &self.profile;
        self.scaled(p.transfer_us_base + bytes as f64 * p.transfer_us_per_byte)
    }
}

impl Latency {
    fn scaled(&self, us: f64) -> Duration {
        scaled(us, self.time_scale)
    }
}

/// `us` microseconds stretched by `time_scale`; nothing for what is not a positive time.
fn scaled(us: f64, time_scale: f64) -> Duration {
    let us = us * time_scale;
    if us.is_finite() && us > 0.0 {
        Duration::from_secs_f64(us / 1e6)
    } else {
        Duration::ZERO
    }
}

/// Step times measured on real hardware: a prefill's milliseconds by its length, a decode
/// step's by its batch and its sequences' mean context, each interpolated linearly between the
/// measured points (bilinearly on the decode grid) and extended along the last segment beyond
/// them. A step that both prefills and decodes costs the sum. Transfers cost what `transfer`
/// says (a table measures no link).
///
/// The CSV (`#` starts a comment line):
///
/// ```text
/// kind,tokens,batch,context,ms
/// prefill,512,,,41.2        # a 512-token prompt, from an empty context
/// decode,,8,1024,7.9        # 8 sequences of 1,024 tokens of context each, one token each
/// ```
///
/// Decode rows must fill a grid: every measured batch at every measured context.
#[derive(Debug, Clone, PartialEq)]
pub struct TimingTable {
    /// (tokens, µs), by tokens.
    prefill: Vec<(f64, f64)>,
    batches: Vec<f64>,
    contexts: Vec<f64>,
    /// µs, `decode[b][c]` for `batches[b]` and `contexts[c]`.
    decode: Vec<Vec<f64>>,
    pub time_scale: f64,
    pub transfer: Latency,
}

/// Why a timing table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("reading the timing table {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("timing table line {line}: {reason}")]
    Line { line: usize, reason: String },
    #[error("timing table: {0}")]
    Table(String),
}

const TABLE_HEADER: &str = "kind,tokens,batch,context,ms";

impl TimingTable {
    /// Reads the CSV at `path`.
    pub fn read(
        path: &std::path::Path,
        time_scale: f64,
        transfer: Latency,
    ) -> Result<Self, TableError> {
        let text = std::fs::read_to_string(path).map_err(|source| TableError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, time_scale, transfer)
    }

    /// Parses the CSV `text`.
    pub fn parse(text: &str, time_scale: f64, transfer: Latency) -> Result<Self, TableError> {
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        let mut header = false;
        for (n, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| TableError::Line {
                line: n + 1,
                reason,
            };
            if !header {
                if line.replace(' ', "") != TABLE_HEADER {
                    return Err(bad(format!("expected the header {TABLE_HEADER:?}")));
                }
                header = true;
                continue;
            }
            let cells: Vec<&str> = line.split(',').map(str::trim).collect();
            let [kind, tokens, batch, context, ms] = cells[..] else {
                return Err(bad(format!("expected 5 cells, got {}", cells.len())));
            };
            let number = |name: &str, cell: &str| {
                cell.parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .ok_or_else(|| bad(format!("{name} {cell:?} is no number >= 0")))
            };
            let us = number("ms", ms)? * 1e3;
            match kind {
                "prefill" if batch.is_empty() && context.is_empty() => {
                    prefill.push((number("tokens", tokens)?, us));
                }
                "decode" if tokens.is_empty() => {
                    decode.push((number("batch", batch)?, number("context", context)?, us));
                }
                "prefill" | "decode" => {
                    return Err(bad(format!(
                        "a {kind} row gives {} only",
                        if kind == "prefill" {
                            "tokens"
                        } else {
                            "batch and context"
                        }
                    )));
                }
                other => return Err(bad(format!("unknown kind {other:?}"))),
            }
        }
        Self::from_points(prefill, decode, time_scale, transfer)
    }

    fn from_points(
        mut prefill: Vec<(f64, f64)>,
        decode: Vec<(f64, f64, f64)>,
        time_scale: f64,
        transfer: Latency,
    ) -> Result<Self, TableError> {
        if prefill.is_empty() || decode.is_empty() {
            return Err(TableError::Table(
                "it needs a prefill row and a decode row at least".into(),
            ));
        }
        prefill.sort_by(|a, b| a.0.total_cmp(&b.0));
        if prefill.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(TableError::Table(
                "a prefill length is measured twice".into(),
            ));
        }
        let axis = |values: Vec<f64>| {
            let mut values = values;
            values.sort_by(f64::total_cmp);
            values.dedup();
            values
        };
        let batches = axis(decode.iter().map(|d| d.0).collect());
        let contexts = axis(decode.iter().map(|d| d.1).collect());
        if batches.contains(&0.0) {
            return Err(TableError::Table("a decode batch of 0".into()));
        }
        if decode.len() != batches.len() * contexts.len() {
            return Err(TableError::Table(format!(
                "the decode rows must measure every batch ({}) at every context ({}) once",
                batches.len(),
                contexts.len()
            )));
        }
        let mut grid = vec![vec![f64::NAN; contexts.len()]; batches.len()];
        for (batch, context, us) in decode {
            let b = batches.partition_point(|&v| v < batch);
            let c = contexts.partition_point(|&v| v < context);
            if !grid[b][c].is_nan() {
                return Err(TableError::Table(format!(
                    "batch {batch} at context {context} is measured twice"
                )));
            }
            grid[b][c] = us;
        }
        Ok(TimingTable {
            prefill,
            batches,
            contexts,
            decode: grid,
            time_scale,
            transfer,
        })
    }

    /// A prefill of `tokens`, in µs.
    fn prefill_us(&self, tokens: f64) -> f64 {
        let (xs, ys): (Vec<f64>, Vec<f64>) = self.prefill.iter().copied().unzip();
        interpolate(&xs, &ys, tokens)
    }

    /// A decode step of `batch` sequences of `context` tokens each, in µs.
    fn decode_us(&self, batch: f64, context: f64) -> f64 {
        let at_batch: Vec<f64> = self
            .decode
            .iter()
            .map(|row| interpolate(&self.contexts, row, context))
            .collect();
        interpolate(&self.batches, &at_batch, batch)
    }
}

/// `ys` at `x` along the polyline through `(xs, ys)` (`xs` rising), extended along its first
/// or last segment beyond it; never below zero.
fn interpolate(xs: &[f64], ys: &[f64], x: f64) -> f64 {
    if xs.len() == 1 {
        return ys[0];
    }
    let i = xs.partition_point(|&v| v < x).clamp(1, xs.len() - 1);
    let (x0, x1, y0, y1) = (xs[i - 1], xs[i], ys[i - 1], ys[i]);
    (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
}

impl TimingModel for TimingTable {
    fn step(&self, work: &StepWork) -> Duration {
        let prefill = if work.prefill_tokens > 0 {
            self.prefill_us(work.prefill_tokens as f64)
        } else {
            0.0
        };
        let decode = if work.decode_seqs > 0 {
            let seqs = work.decode_seqs as f64;
            self.decode_us(seqs, work.decode_ctx_tokens as f64 / seqs)
        } else {
            0.0
        };
        scaled(prefill + decode, self.time_scale)
    }

    fn transfer(&self, bytes: usize) -> Duration {
        self.transfer.transfer(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_profile_and_zero_scale_cost_nothing() {
        let work = StepWork {
            prefill_tokens: 1000,
            prefill_token_ctx: 0,
            decode_seqs: 8,
            decode_ctx_tokens: 8000,
        };
        assert_eq!(
            Latency {
                profile: Profile::NULL,
                time_scale: 1.0
            }
            .step(&work),
            Duration::ZERO
        );
        let real = Profile::by_name("llama3-8b-h100").unwrap();
        assert_eq!(
            Latency {
                profile: real,
                time_scale: 0.0
            }
            .step(&work),
            Duration::ZERO
        );
    }

    #[test]
    fn realistic_profile_is_in_the_published_range() {
        let lat = Latency {
            profile: Profile::LLAMA3_8B_H100,
            time_scale: 1.0,
        };
        let decode = lat.step(&StepWork {
            decode_seqs: 1,
            decode_ctx_tokens: 1000,
            ..StepWork::default()
        });
        assert!(
            (5.0..8.0).contains(&(decode.as_secs_f64() * 1e3)),
            "{decode:?}"
        );
        let prefill = lat.step(&StepWork {
            prefill_tokens: 3000,
            ..StepWork::default()
        });
        assert!((0.08..0.2).contains(&prefill.as_secs_f64()), "{prefill:?}");
        let half = Latency {
            time_scale: 0.5,
            ..lat
        };
        let ratio = lat.transfer(1 << 30).as_secs_f64() / half.transfer(1 << 30).as_secs_f64();
        assert!((ratio - 2.0).abs() < 1e-6, "{ratio}");
        assert_eq!(lat.transfer(0), Duration::ZERO);
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    const NULL: Latency = Latency {
        profile: Profile::NULL,
        time_scale: 1.0,
    };

    const TABLE: &str = "\
# measured somewhere
kind,tokens,batch,context,ms
prefill,100,,,10
prefill,300,,,40   # a comment
decode,,1,100,5
decode,,1,300,7
decode,,4,100,6
decode,,4,300,10
";

    /// In ms; a duration holds whole nanoseconds, so figures compare to 1e-5 ms.
    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn a_table_interpolates_between_its_measurements_and_extends_beyond_them() {
        let table = TimingTable::parse(TABLE, 1.0, NULL).unwrap();
        let prefill = |tokens| {
            ms(table.step(&StepWork {
                prefill_tokens: tokens,
                ..StepWork::default()
            }))
        };
        assert!((prefill(100) - 10.0).abs() < 1e-5);
        assert!((prefill(200) - 25.0).abs() < 1e-5);
        // Beyond the last point along the last segment; before the first, the same way.
        assert!((prefill(500) - 70.0).abs() < 1e-5);
        assert!((prefill(50) - 2.5).abs() < 1e-5);
        let decode = |seqs: usize, ctx_each: usize| {
            ms(table.step(&StepWork {
                decode_seqs: seqs,
                decode_ctx_tokens: seqs * ctx_each,
                ..StepWork::default()
            }))
        };
        assert!((decode(1, 300) - 7.0).abs() < 1e-5);
        // Bilinear: at context 200, batch 1 takes 6 ms and batch 4 8 ms; batch 2 a third of
        // the way.
        let expected = 6.0 + (8.0 - 6.0) / 3.0;
        assert!(
            (decode(2, 200) - expected).abs() < 1e-5,
            "{}",
            decode(2, 200)
        );
        // A mixed step pays both; an empty one nothing; the time scale stretches the table.
        let mixed = table.step(&StepWork {
            prefill_tokens: 100,
            decode_seqs: 1,
            decode_ctx_tokens: 100,
            ..StepWork::default()
        });
        assert!((ms(mixed) - 15.0).abs() < 1e-5);
        assert_eq!(table.step(&StepWork::default()), Duration::ZERO);
        let half = TimingTable::parse(TABLE, 0.5, NULL).unwrap();
        assert!(
            (ms(half.step(&StepWork {
                prefill_tokens: 300,
                ..StepWork::default()
            })) - 20.0)
                .abs()
                < 1e-9
        );
    }

    #[test]
    fn a_table_that_is_no_table_is_named_by_line() {
        let cases = [
            ("kind,tokens\nprefill,1,,,1\n", "header"),
            (
                "kind,tokens,batch,context,ms\nprefill,1,2,,1\ndecode,,1,1,1\n",
                "line 2",
            ),
            (
                "kind,tokens,batch,context,ms\nprefill,1,,,x\ndecode,,1,1,1\n",
                "line 2",
            ),
            ("kind,tokens,batch,context,ms\nwarmup,1,,,1\n", "line 2"),
            (
                "kind,tokens,batch,context,ms\nprefill,1,,,1\n",
                "decode row",
            ),
            (
                "kind,tokens,batch,context,ms\nprefill,1,,,1\ndecode,,1,1,1\ndecode,,2,2,1\n",
                "every batch",
            ),
        ];
        for (text, expected) in cases {
            let error = TimingTable::parse(text, 1.0, NULL).unwrap_err().to_string();
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }
}
