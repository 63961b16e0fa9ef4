//! Seeded synthetic traces for hermetic tests and what-if load: sessions arrive as a Poisson or
//! gamma process, each a conversation of one or more turns; the first prompt of a session may
//! start with its group's shared prefix, and each later turn's prompt is the previous prompt,
//! its answer and a new message, so its leading blocks repeat the previous turn's (the pattern
//! Mooncake's conversation trace shows as growing `hash_ids` lists).
//!
//! The same config and seed give the same trace, request for request.

use super::{BLOCK_TOKENS, Trace, TraceRequest, blocks_for};
use crate::config::LenRange;
use crate::schedule::{ArrivalSchedule, Arrivals, exponential};
use crate::workload::{draw_len, stream_rng};

/// Bounds that keep a generated trace finite and its lengths in `u32`.
const MAX_REQUESTS: usize = 1_000_000;
const MAX_TOKENS: u32 = 1 << 20;
const MAX_TURNS: u32 = 256;
/// Block ids a trace may hold at most, all requests together (8 bytes each in memory).
const MAX_BLOCK_IDS: u64 = 1 << 26;

/// Draws of session `s` (lengths, think times) come from their own stream.
const SESSION_STREAM: u64 = 0x7365_7373_696f_6e00;

/// A synthetic trace's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    pub seed: u64,
    /// Requests in the trace, all turns counted.
    pub requests: usize,
    /// Mean requests per second, all turns counted (sessions start at `rate / turns`).
    pub rate: f64,
    /// How session starts are spaced (request arrivals, with one turn).
    pub arrivals: Arrivals,
    /// A session's first prompt; each later turn adds the previous answer and a new message of
    /// this length.
    pub input_len: LenRange,
    pub output_len: LenRange,
    /// Groups of sessions whose first prompts share a prefix (0: none); session `s` is in group
    /// `s mod prefix_groups`.
    pub prefix_groups: u32,
    /// The shared prefix's tokens: whole blocks, shorter than every first prompt.
    pub prefix_len: u32,
    /// Requests per session.
    pub turns: u32,
    /// Mean seconds between a session's turns (exponential).
    pub think_time_s: f64,
}

/// A [`SynthConfig`] no trace can be made from.
#[derive(Debug, thiserror::Error)]
#[error("synthetic trace: {0}")]
pub struct SynthError(String);

fn check(ok: bool, message: impl FnOnce() -> String) -> Result<(), SynthError> {
    if ok {
        Ok(())
    } else {
        Err(SynthError(message()))
    }
}

impl SynthConfig {
    fn validate(&self) -> Result<(), SynthError> {
        check((1..=MAX_REQUESTS).contains(&self.requests), || {
            format!("requests must be in 1..={MAX_REQUESTS}")
        })?;
        check(self.rate.is_finite() && self.rate > 0.0, || {
            "rate must be a positive number of requests per second".into()
        })?;
        for (what, range) in [("input", self.input_len), ("output", self.output_len)] {
            check(
                range.min >= 1 && range.min <= range.max && range.max <= MAX_TOKENS,
                || format!("{what} lengths must satisfy 1 <= A <= B <= {MAX_TOKENS}"),
            )?;
        }
        check((1..=MAX_TURNS).contains(&self.turns), || {
            format!("turns must be in 1..={MAX_TURNS}")
        })?;
        // The longest prompt is a last turn with every message and answer at their longest.
        let longest = u64::from(self.turns) * u64::from(self.input_len.max + self.output_len.max);
        let most_ids = self.requests as u64 * longest.div_ceil(BLOCK_TOKENS as u64);
        check(most_ids <= MAX_BLOCK_IDS, || {
            format!(
                "up to {most_ids} blocks in all (requests x turns x lengths) is more than {MAX_BLOCK_IDS}: fewer or shorter requests"
            )
        })?;
        check(
            self.think_time_s.is_finite() && self.think_time_s >= 0.0,
            || "the think time must be a non-negative number of seconds".into(),
        )?;
        if self.prefix_groups == 0 && self.prefix_len == 0 {
            return Ok(());
        }
        check(self.prefix_groups >= 1 && self.prefix_len >= 1, || {
            "prefix groups and prefix length must both be positive, or both 0".into()
        })?;
        check(
            (self.prefix_len as usize).is_multiple_of(BLOCK_TOKENS),
            || {
                format!(
                    "the shared prefix ({} tokens) must be whole blocks of {BLOCK_TOKENS}: trace blocks are shared whole",
                    self.prefix_len
                )
            },
        )?;
        // A first prompt needs a token of its own, or a group's sessions would all start alike.
        check(self.input_len.min > self.prefix_len, || {
            format!(
                "first prompts ({} tokens at least) must be longer than the shared prefix ({})",
                self.input_len.min, self.prefix_len
            )
        })
    }

    fn prefix_blocks(&self) -> u64 {
        (self.prefix_len as usize / BLOCK_TOKENS) as u64
    }
}

impl Trace {
    /// The trace `config` describes.
    pub fn synthetic(config: &SynthConfig) -> Result<Trace, SynthError> {
        config.validate()?;
        let turns = config.turns as usize;
        let sessions = config.requests.div_ceil(turns);
        let starts = ArrivalSchedule::new(
            config.rate / f64::from(config.turns),
            config.arrivals,
            config.seed,
        );
        // Ids below this are the groups' prefixes: group g's are g*P..(g+1)*P.
        let mut ids = BlockIds {
            next: u64::from(config.prefix_groups) * config.prefix_blocks(),
        };
        let mut requests = Vec::with_capacity(sessions * turns);
        for (session, start) in (0..sessions as u64).zip(starts) {
            session_requests(
                config,
                session,
                start.as_secs_f64(),
                &mut ids,
                &mut requests,
            );
        }
        // Stable: turns of one session at the same millisecond stay in order.
        requests.sort_by_key(|r| r.timestamp_ms);
        requests.truncate(config.requests);
        Ok(Trace { requests })
    }
}

/// Fresh block ids, never used before in the trace.
struct BlockIds {
    next: u64,
}

impl BlockIds {
    /// Appends fresh ids to `hash_ids` until it holds `input_length`'s blocks.
    fn fill(&mut self, hash_ids: &mut Vec<u64>, input_length: u32) {
        while hash_ids.len() < blocks_for(input_length) {
            hash_ids.push(self.next);
            self.next += 1;
        }
    }
}

/// The turns of session `session`, starting `start_s` seconds into the trace.
fn session_requests(
    config: &SynthConfig,
    session: u64,
    start_s: f64,
    ids: &mut BlockIds,
    out: &mut Vec<TraceRequest>,
) {
    let mut rng = stream_rng(config.seed, SESSION_STREAM, session);
    let mut at_s = start_s;
    let mut previous: Option<TraceRequest> = None;
    for turn in 0..config.turns {
        let message = draw_len(&mut rng, config.input_len);
        let output_length = draw_len(&mut rng, config.output_len);
        let (input_length, mut hash_ids) = match &previous {
            None => (message, group_prefix(config, session)),
            // The previous prompt's whole blocks stay; its partial last block changes once the
            // answer and the new message extend it, so it gets a fresh id.
            Some(p) => (
                p.input_length + p.output_length + message,
                p.hash_ids[..p.input_length as usize / BLOCK_TOKENS].to_vec(),
            ),
        };
        ids.fill(&mut hash_ids, input_length);
        if turn > 0 {
            at_s += exponential(&mut rng, config.think_time_s);
        }
        let request = TraceRequest {
            timestamp_ms: (at_s * 1e3) as u64,
            input_length,
            output_length,
            hash_ids,
        };
        out.push(request.clone());
        previous = Some(request);
    }
}

/// The prefix block ids of `session`'s group (none without groups).
fn group_prefix(config: &SynthConfig, session: u64) -> Vec<u64> {
    if config.prefix_groups == 0 {
        return Vec::new();
    }
    let blocks = config.prefix_blocks();
    let first = session % u64::from(config.prefix_groups) * blocks;
    (first..first + blocks).collect()
}
