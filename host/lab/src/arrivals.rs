//! The arrivals one seed replays: seed 0 the trace's own timestamps, any other seed a re-draw
//! of them, so that `--seeds K` samples what a recorded trace leaves to chance (when each
//! request came) and reports its spread.
//!
//! A re-draw first spreads the requests that share a timestamp evenly over the gap to the next
//! one: a trace's resolution hides when within it they came (Mooncake's traces are quantised
//! to 3-second buckets, a batch of about nine requests each). It then stretches each gap
//! between consecutive requests by its own draw of an exponential of mean 1, and scales every
//! gap by one factor so that the first and last arrivals stay where they were. That is a Poisson process whose rate follows the trace's own: each gap keeps
//! its mean (one arrival expected per recorded gap), bursts and lulls stay where the trace has
//! them, and the mean rate over the replay is the trace's exactly. Request order and contents
//! are untouched, so a conversation's turns come in their order and hit the caches as they
//! would. A Poisson process at the trace's mean rate (Vidur's and BLIS's synthetic arrivals)
//! would instead flatten the bursts a recorded trace is replayed for, and jitter of a fixed
//! width would mean nothing on gaps that range from none to minutes.
//!
//! Every policy of one seed (and load) replays the same draw, so the per-request paired
//! difference stays paired; one seed's draws are the same at every load (a sweep's speed-up
//! scales the drawn times).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use switchyard_bench::trace::ScheduledRequest;

/// Keeps the arrivals' stream apart from the other draws of the same seed (retry jitter,
/// policies' randomness).
const STREAM: u64 = 0x6172_7269_7661_6c73;

/// The arrivals `seed` replays of `recorded`: the same for seed 0, else re-drawn (see the
/// module's doc), in the same order with the same first and last times.
pub fn draw(recorded: &[ScheduledRequest], seed: u64) -> Vec<ScheduledRequest> {
    let mut arrivals = recorded.to_vec();
    let (Some(first), Some(last)) = (recorded.first(), recorded.last()) else {
        return arrivals;
    };
    let span = last.at.saturating_sub(first.at).as_secs_f64();
    if seed == 0 || span == 0.0 {
        return arrivals;
    }
    let mut rng = StdRng::seed_from_u64(seed ^ STREAM);
    let stretched: Vec<f64> = spread_ties(recorded)
        .windows(2)
        .map(|pair| {
            // Inverse transform: 1 − u is in (0, 1], so the logarithm is finite.
            let exponential = -(1.0 - rng.random::<f64>()).ln();
            (pair[1] - pair[0]) * exponential
        })
        .collect();
    let total: f64 = stretched.iter().sum();
    if total <= 0.0 {
        return arrivals;
    }
    let scale = span / total;
    let mut elapsed = 0.0;
    for (arrival, gap) in arrivals[1..].iter_mut().zip(&stretched) {
        elapsed += gap * scale;
        arrival.at = first.at + Duration::from_secs_f64(elapsed.min(span));
    }
    // Rounding leaves the last a nanosecond off at most: it is the recorded one.
    if let Some(end) = arrivals.last_mut() {
        end.at = last.at;
    }
    arrivals
}

/// Each arrival in seconds, those that share a timestamp spread evenly over the gap to the
/// next timestamp (the last ones, with no next, stay together).
fn spread_ties(recorded: &[ScheduledRequest]) -> Vec<f64> {
    let mut times: Vec<f64> = recorded.iter().map(|r| r.at.as_secs_f64()).collect();
    let mut start = 0;
    while start < times.len() {
        let tied = times[start..]
            .iter()
            .take_while(|&&t| t == times[start])
            .count();
        if let Some(&next) = times.get(start + tied) {
            let step = (next - times[start]) / tied as f64;
            for (k, time) in times[start..start + tied].iter_mut().enumerate() {
                *time += step * k as f64;
            }
        }
        start += tied;
    }
    times
}

#[cfg(test)]
mod tests {
    use switchyard_bench::trace::ReplayOptions;

    use super::*;
    use crate::tests::synthetic;

    fn recorded() -> Vec<ScheduledRequest> {
        synthetic(3, 200, 20.0)
            .replay(&ReplayOptions::default())
            .requests()
            .to_vec()
    }

    #[test]
    fn seed_zero_replays_the_trace_as_recorded() {
        let recorded = recorded();
        assert_eq!(draw(&recorded, 0), recorded);
    }

    /// Another seed moves the arrivals but not the requests, their order, the first or the
    /// last: the mean rate is the trace's. The same seed draws the same.
    #[test]
    fn a_seed_redraws_when_requests_arrive_and_nothing_else() {
        let recorded = recorded();
        let drawn = draw(&recorded, 7);
        assert_eq!(drawn, draw(&recorded, 7), "the same seed, the same draw");
        assert_ne!(drawn, draw(&recorded, 8), "another seed, another draw");
        assert_eq!(drawn.len(), recorded.len());
        for (d, r) in drawn.iter().zip(&recorded) {
            assert_eq!(d.request, r.request);
        }
        assert_eq!(drawn[0].at, recorded[0].at);
        assert_eq!(drawn.last().unwrap().at, recorded.last().unwrap().at);
        assert!(drawn.windows(2).all(|p| p[0].at <= p[1].at), "in order");
        let moved = drawn.iter().zip(&recorded).filter(|(d, r)| d.at != r.at);
        assert!(moved.count() > recorded.len() / 2, "most arrivals move");
    }

    /// Requests recorded at one instant (a quantised trace) arrive apart once re-drawn, within
    /// about the gap to the next instant.
    #[test]
    fn a_redraw_spreads_requests_that_share_a_timestamp() {
        let template = recorded()[0].clone();
        // Ten requests every 3 s, as Mooncake's traces are written.
        let recorded: Vec<ScheduledRequest> = (0..100u64)
            .map(|i| ScheduledRequest {
                at: Duration::from_secs(i / 10 * 3),
                ..template.clone()
            })
            .collect();
        let drawn = draw(&recorded, 1);
        let ties = drawn.windows(2).filter(|p| p[0].at == p[1].at).count();
        // The last ten have no next instant to spread over.
        assert_eq!(ties, 9, "{drawn:?}");
    }

    /// The draws keep the trace's own pace where it changes: a burst stays a burst.
    #[test]
    fn a_redraw_keeps_the_traces_bursts_where_they_are() {
        // 100 requests 1 ms apart, then 100 a second apart.
        let template = recorded()[0].clone();
        let recorded: Vec<ScheduledRequest> = (0..200u64)
            .map(|i| ScheduledRequest {
                at: Duration::from_millis(if i < 100 { i } else { 99 + (i - 99) * 1000 }),
                ..template.clone()
            })
            .collect();
        for seed in 1..=5 {
            let drawn = draw(&recorded, seed);
            let burst = drawn[99].at.saturating_sub(drawn[0].at);
            assert!(
                burst < Duration::from_secs(2),
                "seed {seed}: the burst spreads over {burst:?}"
            );
        }
    }
}
