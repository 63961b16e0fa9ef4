//! What a trace holds: its size, pace, lengths, and how much of it a prefix cache could serve.

use std::collections::HashSet;
use std::io::{self, Write};

use serde::Serialize;

use super::{BLOCK_TOKENS, TraceRequest};
use crate::stats::percentile;

/// A trace's shape, for choosing a window and speed-up and for judging a hit rate.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TraceSummary {
    pub requests: usize,
    /// From the first arrival to the last, in seconds of trace time.
    pub duration_s: f64,
    /// Requests per second over `duration_s` (0 for a trace of one instant).
    pub request_rate: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub mean_input_len: f64,
    pub median_input_len: f64,
    pub max_input_len: u32,
    pub mean_output_len: f64,
    pub median_output_len: f64,
    pub max_output_len: u32,
    /// Distinct block ids.
    pub unique_blocks: usize,
    /// The share of prompt tokens (0..1) in leading blocks some earlier request already had:
    /// the prefix-hit rate of a cache that never forgets and sees every request, the best any
    /// placement of requests can reach.
    pub prefix_sharing_ceiling: f64,
}

impl TraceSummary {
    /// Summarises `requests`, taken in arrival order.
    pub fn of<'a>(requests: impl IntoIterator<Item = &'a TraceRequest>) -> Self {
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        let mut seen = HashSet::new();
        let (mut first_ms, mut last_ms) = (None, 0);
        let mut shared_tokens = 0u64;
        for r in requests {
            first_ms.get_or_insert(r.timestamp_ms);
            last_ms = r.timestamp_ms;
            inputs.push(f64::from(r.input_length));
            outputs.push(f64::from(r.output_length));
            shared_tokens += seen_prefix_tokens(r, &seen);
            seen.extend(r.hash_ids.iter().copied());
        }
        let total_input: f64 = inputs.iter().sum();
        let total_output: f64 = outputs.iter().sum();
        inputs.sort_by(f64::total_cmp);
        outputs.sort_by(f64::total_cmp);
        let duration_s = (last_ms - first_ms.unwrap_or(last_ms)) as f64 / 1e3;
        Self {
            requests: inputs.len(),
            duration_s,
            request_rate: if duration_s > 0.0 {
                inputs.len() as f64 / duration_s
            } else {
                0.0
            },
            total_input_tokens: total_input as u64,
            total_output_tokens: total_output as u64,
            mean_input_len: mean(total_input, inputs.len()),
            median_input_len: median(&inputs),
            max_input_len: inputs.last().map_or(0, |&m| m as u32),
            mean_output_len: mean(total_output, outputs.len()),
            median_output_len: median(&outputs),
            max_output_len: outputs.last().map_or(0, |&m| m as u32),
            unique_blocks: seen.len(),
            prefix_sharing_ceiling: if total_input > 0.0 {
                shared_tokens as f64 / total_input
            } else {
                0.0
            },
        }
    }

    /// The summary as a table, one figure a row.
    pub fn write_table(&self, out: &mut impl Write) -> io::Result<()> {
        let rows: [(&str, String); 9] = [
            ("Requests:", self.requests.to_string()),
            ("Duration (s):", format!("{:.1}", self.duration_s)),
            ("Request rate (req/s):", format!("{:.2}", self.request_rate)),
            (
                "Input length mean / median / max:",
                format!(
                    "{:.0} / {:.0} / {}",
                    self.mean_input_len, self.median_input_len, self.max_input_len
                ),
            ),
            (
                "Output length mean / median / max:",
                format!(
                    "{:.0} / {:.0} / {}",
                    self.mean_output_len, self.median_output_len, self.max_output_len
                ),
            ),
            ("Total input tokens:", self.total_input_tokens.to_string()),
            ("Total output tokens:", self.total_output_tokens.to_string()),
            ("Distinct blocks:", self.unique_blocks.to_string()),
            (
                "Prefix-sharing ceiling:",
                format!("{:.1}%", self.prefix_sharing_ceiling * 100.0),
            ),
        ];
        for (label, value) in rows {
            writeln!(out, "{label:<40}{value}")?;
        }
        Ok(())
    }
}

/// Tokens of `r`'s prompt in its leading run of blocks already in `seen` (a partial last block
/// counts its own length).
fn seen_prefix_tokens(r: &TraceRequest, seen: &HashSet<u64>) -> u64 {
    let blocks = r.hash_ids.iter().take_while(|id| seen.contains(id)).count();
    (blocks * BLOCK_TOKENS).min(r.input_length as usize) as u64
}

fn mean(total: f64, count: usize) -> f64 {
    if count == 0 {
        0.0
    } else {
        total / count as f64
    }
}

/// The median of ascending `sorted` (0 for none).
fn median(sorted: &[f64]) -> f64 {
    percentile(sorted, 50.0).unwrap_or(0.0)
}
