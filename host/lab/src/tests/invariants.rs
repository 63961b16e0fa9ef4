//! The simulation's invariants, over seeds and every way a plan runs: every request ends
//! exactly once (and its policy hears it once), arrival ≤ first token ≤ end, every engine's
//! pages add up at every step and are all back at the end, every transfer started finishes.
//! The audit checks the engine-side ones as the run goes; these tests check the run's records
//! on top, and that the scenarios really exercise what they claim (preemptions, transfers).

use super::*;
use crate::sim::Ended;

/// The shapes a cluster takes: (protocol, roles, planner that splits prefill from decode).
fn scenarios() -> Vec<(&'static str, Protocol, Vec<Role>, bool)> {
    let roles = || {
        let mut roles = vec![Role::Prefill; 2];
        roles.extend([Role::Decode; 2]);
        roles
    };
    vec![
        ("mlc forward", Protocol::Mlc, vec![Role::Any; 4], false),
        ("mlc prep_recv/remote_send", Protocol::Mlc, roles(), true),
        ("vllm handoff", Protocol::Vllm, roles(), true),
        ("sglang handoff", Protocol::Sglang, roles(), true),
    ]
}

const SEEDS: [u64; 4] = [1, 2, 3, 4];

/// What every run of `trace` must show, whatever its scenario: a completed request got every
/// token it asked for, however its attempts and legs split it.
fn check_run(what: &str, result: &SimResult, trace: &Trace, heard: (usize, usize)) {
    let requests = trace.requests().len();
    assert!(
        result.violations.is_empty(),
        "{what}: {:?}",
        result.violations
    );
    assert_eq!(
        result.outcomes.len(),
        requests,
        "{what}: every request ends"
    );
    let mut indexes: Vec<u64> = result.outcomes.iter().map(|o| o.index).collect();
    indexes.sort_unstable();
    indexes.dedup();
    assert_eq!(indexes.len(), requests, "{what}: each exactly once");
    let failed = result.outcomes.iter().filter(|o| o.result.is_err()).count();
    assert_eq!(
        heard,
        (requests - failed, failed),
        "{what}: the policy hears each outcome once"
    );
    for (
        outcome,
        Ended {
            arrived,
            first_token,
            at,
            ..
        },
    ) in result.outcomes.iter().zip(&result.ended)
    {
        if let Some(first) = first_token {
            assert!(arrived <= first && first <= at, "{what}: {outcome:?}");
        }
        assert!(arrived <= at, "{what}: {outcome:?}");
        if let Ok(timing) = &outcome.result {
            assert!(timing.ttft <= timing.e2e, "{what}: {outcome:?}");
            let asked = trace.requests()[outcome.index as usize].output_length;
            assert_eq!(timing.output_tokens, asked, "{what}: {outcome:?}");
        }
    }
    assert_eq!(
        result.transfers.started, result.transfers.completed,
        "{what}: every transfer finishes"
    );
}

/// A roomy pool: nothing is preempted and everything completes.
#[test]
fn every_request_completes_once_on_a_roomy_cluster() {
    for (name, protocol, roles, split) in scenarios() {
        for seed in SEEDS {
            let what = format!("{name}, seed {seed}");
            let trace = synthetic(seed, 60, 6.0);
            let cluster = cluster(protocol, roles.clone(), 2048);
            let (result, heard) = run_with(&cluster, &trace, split, seed);
            check_run(&what, &result, &trace, heard);
            assert!(
                result.outcomes.iter().all(|o| o.result.is_ok()),
                "{what}: {:?}",
                result.outcomes.iter().find(|o| o.result.is_err())
            );
            let moved = result.transfers.completed > 0;
            assert_eq!(
                moved, split,
                "{what}: KV moves exactly when prefill is split off"
            );
            let hits: u64 = result
                .engines
                .iter()
                .map(|e| e.counters.prefix_matched_tokens)
                .sum();
            assert!(hits > 0, "{what}: shared prefixes hit the caches");
        }
    }
}

/// Pools too small for the load: generations are preempted and continued, some prompts wait
/// for pages, and still every request ends once and every page comes back.
#[test]
fn under_kv_pressure_preempted_requests_continue_and_nothing_leaks() {
    let mut preempted = 0;
    for (name, protocol, roles, split) in scenarios() {
        for seed in SEEDS {
            let what = format!("{name}, seed {seed}, tight pools");
            let trace = synthetic(seed, 60, 20.0);
            // 400 positions more than the longest prompt: a few requests at a time.
            let cluster = cluster(protocol, roles.clone(), 340);
            let (result, heard) = run_with(&cluster, &trace, split, seed);
            check_run(&what, &result, &trace, heard);
            preempted += result
                .engines
                .iter()
                .map(|e| e.counters.preemptions)
                .sum::<u64>();
        }
    }
    assert!(preempted > 0, "the scenarios preempt");
}

fn run_with(
    cluster: &ClusterSpec,
    trace: &Trace,
    split: bool,
    seed: u64,
) -> (SimResult, (usize, usize)) {
    if split {
        let planner = Arc::new(Split::default());
        let result = run(cluster, trace, planner.clone(), seed);
        (result, heard(&planner.outcomes))
    } else {
        let planner = Arc::new(LeastLoaded::default());
        let result = run(cluster, trace, planner.clone(), seed);
        (result, heard(&planner.outcomes))
    }
}

/// A prompt no engine's pool could hold fails at once, as the engines refuse it, and the rest
/// are served.
#[test]
fn a_prompt_larger_than_any_pool_fails_and_the_rest_complete() {
    let trace = synthetic(9, 30, 6.0);
    let longest = trace
        .requests()
        .iter()
        .map(|r| r.input_length)
        .max()
        .unwrap();
    // Room for every prompt but the longest.
    let pages = longest / 16;
    let cluster = cluster(Protocol::Mlc, vec![Role::Any; 2], pages);
    let (result, heard) = run_with(&cluster, &trace, false, 9);
    check_run("tiny pools", &result, &trace, heard);
    let failed: Vec<_> = result
        .outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err())
        .collect();
    assert!(!failed.is_empty());
    assert!(failed.iter().all(|e| e.contains("KV pages")), "{failed:?}");
}
