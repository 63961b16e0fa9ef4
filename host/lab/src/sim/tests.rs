//! The router's index as the simulation feeds it, against the caches it stands for.

use std::sync::Arc;
use std::time::Duration;

use indicatif::ProgressBar;
use switchyard_bench::trace::ReplayOptions;
use switchyard_contract::{Protocol, Role};

use super::{Event, Simulation};
use crate::config::ClusterSpec;
use crate::policies::{Planners, SimClock};
use crate::tests::{LeastLoaded, cluster, synthetic};

/// How the index's answers compared with the caches over one run.
#[derive(Debug, Default)]
struct Comparison {
    agreed: usize,
    /// Agreements on a prefix of at least a page.
    agreed_cached: usize,
    differed: usize,
    /// Times an engine's cached prefix of a prompt shrank: evictions the index followed.
    shrank: usize,
}

/// Runs 40 requests on 3 engines whose pools churn, and after every step's end compares, for
/// each prompt arrived so far, the index's cached prefix on every engine between steps with
/// what its cache holds (an engine mid-step has changed its cache already and published
/// nothing yet).
fn compare(kv_events_delay: Duration) -> Comparison {
    let trace = synthetic(3, 40, 8.0);
    // Room for about four prompts per engine: evictions all along.
    let cluster = ClusterSpec {
        kv_events_delay,
        ..cluster(Protocol::Mlc, vec![Role::Any; 3], 300)
    };
    let replay = trace.replay(&ReplayOptions::default());
    let prompts: Vec<Vec<u32>> = replay
        .requests()
        .iter()
        .map(|r| r.request.token_ids())
        .collect();
    let planners = Planners {
        policy: Arc::new(LeastLoaded::default()),
        fallback: None,
    };
    let progress = ProgressBar::hidden();
    let clock = Arc::new(SimClock::default());
    let mut sim = Simulation::new(&cluster, replay.requests(), planners, clock, 3, &progress);
    let mut last = vec![vec![0; cluster.engines()]; prompts.len()];
    let mut seen = Comparison::default();
    sim.start();
    while !sim.all_ended() {
        let Some(event) = sim.next_event() else {
            break;
        };
        if !matches!(event, Event::StepEnd(_) | Event::KvEventsArrive) {
            continue;
        }
        let kv = sim.kv.as_ref().expect("prefix caches are on");
        for (p, prompt) in prompts.iter().enumerate().take(sim.arrived) {
            let predicted = kv.cached_prefixes(prompt);
            for (e, engine) in sim.engines.iter().enumerate() {
                if engine.busy {
                    continue;
                }
                let cached = engine.core.cached_prefix(prompt);
                if predicted[e] as usize == cached {
                    seen.agreed += 1;
                    seen.agreed_cached += usize::from(cached > 0);
                } else {
                    seen.differed += 1;
                }
                seen.shrank += usize::from(cached < last[p][e]);
                last[p][e] = cached;
            }
        }
    }
    seen
}

#[test]
fn without_a_delay_the_index_holds_what_every_engine_between_steps_caches() {
    let seen = compare(Duration::ZERO);
    assert_eq!(seen.differed, 0, "{seen:?}");
    assert!(seen.agreed_cached > 0, "prefixes were cached: {seen:?}");
    assert!(seen.shrank > 0, "and evicted: {seen:?}");
}

#[test]
fn with_a_delay_the_index_lags_the_caches() {
    let seen = compare(Duration::from_millis(50));
    assert!(seen.differed > 0, "{seen:?}");
    assert!(seen.agreed_cached > 0, "it catches up: {seen:?}");
}
