//! Which requests of a trace are replayed, and when: a time window, a cap on their number,
//! a speed-up, and caps on their lengths.

use std::time::Duration;

use super::{Trace, TraceRequest, TraceSummary};

/// A span of trace time, `[start, end)` in milliseconds; an open side is unbounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    pub start_ms: Option<u64>,
    pub end_ms: Option<u64>,
}

impl Window {
    pub fn contains(&self, timestamp_ms: u64) -> bool {
        self.start_ms.is_none_or(|start| timestamp_ms >= start)
            && self.end_ms.is_none_or(|end| timestamp_ms < end)
    }
}

/// Parses `START..END` in seconds of trace time; either side may be left out (`600..`, `..900`).
pub fn parse_window(raw: &str) -> Result<Window, String> {
    let (start, end) = raw
        .split_once("..")
        .ok_or_else(|| format!("expected START..END in seconds, got {raw:?}"))?;
    let bound = |s: &str| -> Result<Option<u64>, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(None);
        }
        let secs = s
            .parse::<f64>()
            .map_err(|e| format!("bad number {s:?} in {raw:?}: {e}"))?;
        if !(secs.is_finite() && secs >= 0.0) {
            return Err(format!("window bounds are seconds from 0, got {s:?}"));
        }
        Ok(Some((secs * 1e3).round() as u64))
    };
    let window = Window {
        start_ms: bound(start)?,
        end_ms: bound(end)?,
    };
    if let (Some(start), Some(end)) = (window.start_ms, window.end_ms)
        && start >= end
    {
        return Err(format!(
            "the window {raw:?} is empty: START must be before END"
        ));
    }
    Ok(window)
}

/// What to replay of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayOptions {
    /// Only requests arriving in this window.
    pub window: Window,
    /// Only the first N requests in the window.
    pub limit: Option<usize>,
    /// Arrivals this many times faster than recorded (2 doubles the load). Must be positive.
    pub speedup: f64,
    /// Prompts longer than this are cut to it.
    pub max_input_len: Option<u32>,
    /// `output_length`s above this are lowered to it.
    pub max_output_len: Option<u32>,
}

impl Default for ReplayOptions {
    /// The whole trace at its recorded pace.
    fn default() -> Self {
        Self {
            window: Window::default(),
            limit: None,
            speedup: 1.0,
            max_input_len: None,
            max_output_len: None,
        }
    }
}

/// One request of a replay and when it is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// Send time from the start of the replay: the first selected request is due at once.
    pub at: Duration,
    /// The request with the caps applied.
    pub request: TraceRequest,
}

/// The requests a replay sends, in order, and how many the caps changed.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    requests: Vec<ScheduledRequest>,
    capped_inputs: usize,
    capped_outputs: usize,
}

impl Replay {
    pub fn requests(&self) -> &[ScheduledRequest] {
        &self.requests
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Prompts cut by `max_input_len`.
    pub fn capped_inputs(&self) -> usize {
        self.capped_inputs
    }

    /// Requests whose `output_length` was lowered by `max_output_len`.
    pub fn capped_outputs(&self) -> usize {
        self.capped_outputs
    }

    /// The summary of what is replayed (capped lengths, recorded times).
    pub fn summary(&self) -> TraceSummary {
        TraceSummary::of(self.requests.iter().map(|r| &r.request))
    }
}

impl Trace {
    /// The requests `options` select, timed from the first of them and scaled by the speed-up.
    pub fn replay(&self, options: &ReplayOptions) -> Replay {
        let selected = self
            .requests
            .iter()
            .filter(|r| options.window.contains(r.timestamp_ms))
            .take(options.limit.unwrap_or(usize::MAX));
        let mut replay = Replay {
            requests: Vec::new(),
            capped_inputs: 0,
            capped_outputs: 0,
        };
        let mut first_ms = None;
        for request in selected {
            let zero = *first_ms.get_or_insert(request.timestamp_ms);
            let capped = request.capped(options.max_input_len, options.max_output_len);
            replay.capped_inputs += usize::from(capped.input_length < request.input_length);
            replay.capped_outputs += usize::from(capped.output_length < request.output_length);
            let trace_secs = (request.timestamp_ms - zero) as f64 / 1e3;
            replay.requests.push(ScheduledRequest {
                // A zero or negative speed-up would never send: the request is then due never.
                at: Duration::try_from_secs_f64(trace_secs / options.speedup)
                    .unwrap_or(Duration::MAX),
                request: capped,
            });
        }
        replay
    }
}
