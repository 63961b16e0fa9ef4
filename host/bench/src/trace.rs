//! Request traces in Mooncake's format (Qin et al., FAST '25), and everything a replay does
//! with one, whether it drives real servers (`switchyard bench --trace`) or a simulated cluster
//! (the policy lab): both turn a line into the same token ids at the same send time.
//!
//! ```text
//! JSONL ──Trace::parse/read──▶ Trace ──replay(ReplayOptions)──▶ Replay: (send offset, request)…
//!                                │  ▲                                      │
//!                        summary │  └── Trace::synthetic(SynthConfig)      │ TraceRequest::prompt
//!                                ▼                                         ▼
//!                          TraceSummary                 hash ids ──tokens──▶ token ids (bytes)
//! ```
//!
//! A line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
//! [...]}`, one id per 512-token block of the prompt (the last block may be partial). Block `h`
//! always expands to the same 512 printable bytes ([`tokens::block`]), so two prompts share
//! exactly the tokens of the blocks their ids share: the engines' prefix caches and the
//! policies see the sharing the trace recorded.
//!
//! ```
//! use switchyard_bench::trace::{ReplayOptions, Trace};
//! let jsonl = r#"{"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [0, 1]}
//! {"timestamp": 2000, "input_length": 700, "output_length": 4, "hash_ids": [0, 2]}"#;
//! let trace = Trace::parse(jsonl.as_bytes(), "example.jsonl").unwrap();
//! let replay = trace.replay(&ReplayOptions { speedup: 2.0, ..ReplayOptions::default() });
//! let second = &replay.requests()[1];
//! assert_eq!(second.at, std::time::Duration::from_secs(1));
//! let (a, b) = (replay.requests()[0].request.prompt(), second.request.prompt());
//! assert_eq!(a[..512], b[..512], "block 0 is shared");
//! assert_eq!(trace.summary().prefix_sharing_ceiling, 512.0 / 1300.0);
//! ```

mod replay;
mod summary;
mod synth;
pub mod tokens;

#[cfg(test)]
mod tests;

use std::io::{self, BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use replay::{Replay, ReplayOptions, ScheduledRequest, Window, parse_window};
pub use summary::TraceSummary;
pub use synth::{SynthConfig, SynthError};
pub use tokens::BLOCK_TOKENS;

/// Why a trace could not be read. Line numbers count from 1.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The reason is in the message, not a `source()`: printed with its causes, it would show
    /// twice.
    #[error("cannot read {}: {error}", path.display())]
    Io { path: PathBuf, error: io::Error },
    #[error("{}, line {line}: {reason}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{} holds no request", path.display())]
    Empty { path: PathBuf },
}

/// One request of a trace: one line of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival, in milliseconds from the start of the trace.
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Tokens generated (sent as `max_tokens`).
    pub output_length: u32,
    /// One id per block of [`BLOCK_TOKENS`] prompt tokens, the last one possibly partial.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The prompt as printable ASCII, one byte per token.
    pub fn prompt(&self) -> String {
        tokens::prompt_text(&self.hash_ids, self.input_length as usize)
    }

    /// The prompt's token ids: its bytes.
    pub fn token_ids(&self) -> Vec<u32> {
        tokens::prompt_bytes(&self.hash_ids, self.input_length as usize)
            .into_iter()
            .map(u32::from)
            .collect()
    }

    /// The request cut to at most `max_input` prompt tokens (its leading blocks kept, so a
    /// shared prefix stays shared) and `max_output` generated ones.
    pub fn capped(&self, max_input: Option<u32>, max_output: Option<u32>) -> TraceRequest {
        let input_length = max_input.map_or(self.input_length, |m| self.input_length.min(m));
        let output_length = max_output.map_or(self.output_length, |m| self.output_length.min(m));
        TraceRequest {
            timestamp_ms: self.timestamp_ms,
            input_length,
            output_length,
            hash_ids: self.hash_ids[..blocks_for(input_length)].to_vec(),
        }
    }

    /// What makes a line unusable, if anything.
    fn check(&self) -> Result<(), String> {
        if self.input_length == 0 {
            return Err("input_length must be at least 1".into());
        }
        if self.output_length == 0 {
            return Err("output_length must be at least 1".into());
        }
        let blocks = blocks_for(self.input_length);
        if self.hash_ids.len() != blocks {
            return Err(format!(
                "input_length {} needs {blocks} hash ids (one per {BLOCK_TOKENS}-token block), got {}",
                self.input_length,
                self.hash_ids.len()
            ));
        }
        Ok(())
    }
}

/// Blocks of [`BLOCK_TOKENS`] that hold `tokens` tokens.
fn blocks_for(tokens: u32) -> usize {
    (tokens as usize).div_ceil(BLOCK_TOKENS)
}

/// A whole trace, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    requests: Vec<TraceRequest>,
}

impl Trace {
    /// Reads a trace file.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|error| TraceError::Io {
            path: path.to_owned(),
            error,
        })?;
        Self::parse(io::BufReader::new(file), path)
    }

    /// Parses JSONL from `reader`; `origin` names it in errors. Blank lines are skipped; every
    /// other line must be a request with a timestamp no earlier than the line before's.
    pub fn parse(reader: impl BufRead, origin: impl AsRef<Path>) -> Result<Self, TraceError> {
        let origin = origin.as_ref();
        let line_error = |line: usize, reason: String| TraceError::Line {
            path: origin.to_owned(),
            line,
            reason,
        };
        let mut requests: Vec<TraceRequest> = Vec::new();
        for (index, text) in reader.lines().enumerate() {
            let line = index + 1;
            let text = text.map_err(|error| TraceError::Io {
                path: origin.to_owned(),
                error,
            })?;
            if text.trim().is_empty() {
                continue;
            }
            let request: TraceRequest =
                serde_json::from_str(&text).map_err(|e| line_error(line, json_reason(&e)))?;
            request.check().map_err(|reason| line_error(line, reason))?;
            if let Some(last) = requests.last()
                && request.timestamp_ms < last.timestamp_ms
            {
                return Err(line_error(
                    line,
                    format!(
                        "timestamp {} is earlier than the line before's ({}): a trace is in arrival order",
                        request.timestamp_ms, last.timestamp_ms
                    ),
                ));
            }
            requests.push(request);
        }
        if requests.is_empty() {
            return Err(TraceError::Empty {
                path: origin.to_owned(),
            });
        }
        Ok(Self { requests })
    }

    /// Every request, in arrival order (never empty).
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }

    /// Requests, duration, lengths and the prefix-sharing ceiling of the whole trace.
    pub fn summary(&self) -> TraceSummary {
        TraceSummary::of(&self.requests)
    }

    /// Writes the trace as JSONL, one request a line, in the field order of Mooncake's files.
    pub fn write_jsonl(&self, out: &mut impl Write) -> io::Result<()> {
        for request in &self.requests {
            serde_json::to_writer(&mut *out, request)?;
            out.write_all(b"\n")?;
        }
        Ok(())
    }
}

/// serde_json's message without its position: a line is one line, so only the column helps.
fn json_reason(e: &serde_json::Error) -> String {
    let message = e.to_string();
    let message = message
        .rsplit_once(" at line ")
        .map_or(message.as_str(), |(head, _)| head);
    format!("{message} (column {})", e.column())
}
