//! The lab's invariants as properties of runs over seeded synthetic traces (every protocol,
//! with and without handoffs, KV pools small enough to preempt), its determinism, and the
//! whole command on a real policy component.
//!
//! Most runs plan with native planners (below), which implement the same [`Planner`] trait the
//! components are called through: the invariants are the simulation's, and a native planner
//! keeps each run to milliseconds. The command itself runs the built-in round-robin component.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::ProgressBar;
use switchyard_bench::trace::{ReplayOptions, SynthConfig, Trace};
use switchyard_bench::{Arrivals, LenRange};
use switchyard_contract::{
    EndpointSnapshot, Outcome, OutcomeStatus, Plan, Planner, PolicyContext, PolicyRequest,
    Protocol, Role, SendBegin, Step, TranslateError,
};
use switchyard_engine::ModelShape;
use switchyard_engine::latency::{Latency, Profile};

use super::*;

mod invariants;
mod runs;

/// Forwards each request to the endpoint serving alone with the fewest legs in flight.
#[derive(Debug, Default)]
pub(crate) struct LeastLoaded {
    outcomes: Mutex<Vec<Outcome>>,
}

/// Prefills on one endpoint and decodes on another, each the least loaded that may: MLC's
/// microserving steps (sending from the prefix the decode engine matched), or a handoff.
#[derive(Debug, Default)]
struct Split {
    outcomes: Mutex<Vec<Outcome>>,
}

fn least<'a>(
    endpoints: impl Iterator<Item = &'a EndpointSnapshot>,
) -> Result<&'a EndpointSnapshot, TranslateError> {
    endpoints
        .min_by_key(|e| (e.in_flight, e.id))
        .ok_or_else(|| TranslateError::Unavailable {
            policy: "test".into(),
            message: "no endpoint".into(),
        })
}

impl Planner for LeastLoaded {
    fn translate(
        &self,
        _: &PolicyRequest<'_>,
        context: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let endpoint = least(context.endpoints.iter().filter(|e| e.serves_alone()))?;
        Ok(Plan {
            steps: vec![Step::Forward {
                endpoint: endpoint.id,
            }],
        })
    }

    fn on_complete(&self, outcome: &Outcome) {
        self.outcomes.lock().unwrap().push(*outcome);
    }
}

impl Planner for Split {
    fn translate(
        &self,
        _: &PolicyRequest<'_>,
        context: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let endpoints = &context.endpoints;
        let prefill = least(endpoints.iter().filter(|e| e.can_prefill()))?;
        let decode = least(
            endpoints
                .iter()
                .filter(|e| e.can_decode() && e.id != prefill.id),
        )?;
        let (p, d) = (prefill.id, decode.id);
        let steps = match prefill.protocol {
            Protocol::Mlc => vec![
                Step::PrepRecv { decode: d, end: -1 },
                Step::RemoteSend {
                    prefill: p,
                    decode: d,
                    begin: SendBegin::PrefixMatched,
                    end: -1,
                },
                Step::StartGenerate {
                    decode: d,
                    begin: -1,
                },
            ],
            _ => vec![Step::Handoff {
                prefill: p,
                decode: d,
            }],
        };
        Ok(Plan { steps })
    }

    fn on_complete(&self, outcome: &Outcome) {
        self.outcomes.lock().unwrap().push(*outcome);
    }
}

/// A seeded conversation trace: sessions of 3 turns sharing group prefixes, `requests` of
/// them at `rate` per second.
pub(crate) fn synthetic(seed: u64, requests: usize, rate: f64) -> Trace {
    Trace::synthetic(&SynthConfig {
        seed,
        requests,
        rate,
        arrivals: Arrivals::Poisson,
        input_len: LenRange {
            min: 600,
            max: 1500,
        },
        output_len: LenRange { min: 4, max: 64 },
        prefix_groups: 3,
        prefix_len: 512,
        turns: 3,
        think_time_s: 2.0,
    })
    .expect("a valid synthetic trace")
}

/// A cluster of `roles` speaking `protocol` on the llama3-8b-h100 profile, `kv_pages` pages of
/// 16 per engine.
pub(crate) fn cluster(protocol: Protocol, roles: Vec<Role>, kv_pages: u32) -> ClusterSpec {
    let latency = Latency {
        profile: Profile::LLAMA3_8B_H100,
        time_scale: 1.0,
    };
    let engine = engine_defaults();
    ClusterSpec {
        roles,
        protocol,
        latency,
        step_table: None,
        transfer: TransferModel::new(latency, ModelShape::Llama3_8b, None),
        page_size: engine.page_size as usize,
        kv_pages,
        prefix_cache: true,
        prefill_chunk: engine.prefill_chunk,
        max_batch: engine.max_batch,
        reservation_ttl: Duration::from_millis(engine.reservation_ttl_ms),
        probe_interval: config::ROUTER_PROBE_INTERVAL,
        kv_events_delay: Duration::ZERO,
        retry: config::ROUTER_RETRY,
        request_timeout: config::ROUTER_REQUEST_TIMEOUT,
    }
}

/// One simulation of `trace` on `cluster` planned by `planner`.
fn run(cluster: &ClusterSpec, trace: &Trace, planner: Arc<dyn Planner>, seed: u64) -> SimResult {
    let replay = trace.replay(&ReplayOptions::default());
    let planners = Planners {
        policy: planner,
        fallback: None,
    };
    simulate(
        cluster,
        replay.requests(),
        planners,
        Arc::new(SimClock::default()),
        seed,
        &ProgressBar::hidden(),
    )
}

/// How many of `outcomes` the policy heard with each status.
fn heard(outcomes: &Mutex<Vec<Outcome>>) -> (usize, usize) {
    let outcomes = outcomes.lock().unwrap();
    let ok = outcomes
        .iter()
        .filter(|o| o.status == OutcomeStatus::Ok)
        .count();
    (ok, outcomes.len() - ok)
}
