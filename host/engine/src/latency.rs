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
        let us = us * self.time_scale;
        if us.is_finite() && us > 0.0 {
            Duration::from_secs_f64(us / 1e6)
        } else {
            Duration::ZERO
        }
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
