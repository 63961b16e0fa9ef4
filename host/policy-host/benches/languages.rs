//! What the guest language of a policy costs the router: component size, cold load (compile),
//! load from the on-disk compile cache, instantiation from the pre-instantiated component, and
//! `translate-request` latency, for the example policies in Rust, Python and JavaScript.
//!
//! `make examples && cargo bench -p switchyard-policy-host --bench languages` prints one table. Not
//! criterion: a cold compile happens once per process by definition, and the Python and
//! JavaScript compiles take tens of seconds each, so each row is one cold load, a few cached
//! loads and many timed calls.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use switchyard_contract::EndpointSnapshot;
use switchyard_contract::{PolicyContext, PolicyRequest};
use switchyard_policy_host::{Policy, PolicyHost, PolicyLimits};

const EXAMPLES: [&str; 3] = ["priority-rust", "prefix-aware-python", "slo-js"];
const CACHED_LOADS: usize = 5;
const INSTANTIATIONS: usize = 50;
const WARMUP_CALLS: usize = 200;
const TIMED_CALLS: usize = 5_000;
/// Long enough that slo-js disaggregates and prefix-aware hashes all its pages.
const PROMPT_LEN: u32 = 512;

struct Row {
    name: &'static str,
    language: String,
    size_bytes: u64,
    cold_load: Duration,
    cached_load: Duration,
    instantiate: Duration,
    translate: Percentiles,
}

struct Percentiles {
    p50: Duration,
    p99: Duration,
}

fn main() {
    let dir = switchyard_tests::checkout().join("target/examples");
    let mut rows = Vec::new();
    for name in EXAMPLES {
        let path = dir.join(format!("{name}.wasm"));
        if !path.is_file() {
            eprintln!("{} is missing: run `make examples` first", path.display());
            std::process::exit(1);
        }
        rows.push(measure(name, &path));
    }
    print_table(&rows);
}

fn measure(name: &'static str, path: &Path) -> Row {
    let size_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let cache = tempfile::tempdir().expect("temporary compile cache");

    // Cold: a fresh host, an empty cache. Compiles, type-checks, instantiates, runs init.
    let (cold_load, policy) = timed(|| load(&host(Some(cache.path().to_owned())), path));
    let language = policy.info().language.clone();
    // A load returns once the first instance serves; its spare is built after, in the
    // background. Let it finish before timing anything else, so that no build competes.
    settle(&policy);

    // Cached: a fresh host each time (empty in-memory cache) over the cache the cold load
    // wrote, as after a router restart.
    let cached_load = median(
        (0..CACHED_LOADS)
            .map(|_| {
                let (took, loaded) = timed(|| load(&host(Some(cache.path().to_owned())), path));
                settle(&loaded);
                took
            })
            .collect(),
    );

    let instantiate = median(
        (0..INSTANTIATIONS)
            .map(|_| timed(|| policy.bench_instantiate().expect("instantiate")).0)
            .collect(),
    );

    Row {
        name,
        language,
        size_bytes,
        cold_load,
        cached_load,
        instantiate,
        translate: translate_latency(&policy),
    }
}

fn host(cache_dir: Option<PathBuf>) -> PolicyHost {
    PolicyHost::new(PolicyLimits {
        cache_dir,
        ..PolicyLimits::default()
    })
    .expect("policy host")
}

fn load(host: &PolicyHost, path: &Path) -> Policy {
    host.load_file(path, None)
        .unwrap_or_else(|e| panic!("{} does not load: {e}", path.display()))
}

fn settle(policy: &Policy) {
    assert!(
        policy.settle(),
        "{}: a background instance build failed",
        policy.info().name
    );
}

/// Per-call latency over a 4-endpoint cluster whose load changes from call to call, with a
/// few distinct prompts so stateful policies see both repeats and new prefixes.
fn translate_latency(policy: &Policy) -> Percentiles {
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|seed| (0..PROMPT_LEN).map(|i| i * 7 + seed * 1_000).collect())
        .collect();
    let mut samples = Vec::with_capacity(TIMED_CALLS);
    for i in 0..WARMUP_CALLS + TIMED_CALLS {
        let ctx = context(i as u32);
        let prompt = &prompts[i % prompts.len()];
        let request = PolicyRequest {
            id: i as u64,
            prompt: Some(prompt),
            max_tokens: 64,
            stream: true,
            model: "bench",
            user: (i % 4 == 0).then_some("priority-bench"),
            headers: &[],
            flow: Default::default(),
            base_model: None,
        };
        let started = Instant::now();
        let plan = policy.translate(&request, &ctx);
        let elapsed = started.elapsed();
        if let Err(e) = plan {
            panic!("{}: translate failed: {e}", policy.info().name);
        }
        if i >= WARMUP_CALLS {
            samples.push(elapsed);
        }
    }
    samples.sort_unstable();
    Percentiles {
        p50: samples[samples.len() / 2],
        p99: samples[samples.len() * 99 / 100],
    }
}

fn context(i: u32) -> PolicyContext {
    PolicyContext {
        attempt: 1,
        last_failure: None,
        endpoints: (0..4)
            .map(|id| EndpointSnapshot {
                in_flight: (i + id * 3) % 5,
                running: Some(id % 3),
                waiting: Some(id % 2),
                ..EndpointSnapshot::synthetic(id)
            })
            .collect(),
    }
}

fn timed<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let started = Instant::now();
    let value = f();
    (started.elapsed(), value)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<20} {:<11} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "policy",
        "language",
        "size",
        "cold load",
        "cached load",
        "instantiate",
        "translate50",
        "translate99"
    );
    for r in rows {
        println!(
            "{:<20} {:<11} {:>8.1}MB {:>12} {:>12} {:>12} {:>12} {:>12}",
            r.name,
            r.language,
            r.size_bytes as f64 / 1e6,
            fmt(r.cold_load),
            fmt(r.cached_load),
            fmt(r.instantiate),
            fmt(r.translate.p50),
            fmt(r.translate.p99),
        );
    }
    println!(
        "cold load = compile + type-check + instantiate + init on a fresh host with an empty \
         cache; cached load = the same with the on-disk compile cache filled; medians of \
         {CACHED_LOADS} loads, {INSTANTIATIONS} instantiations, {TIMED_CALLS} calls ({PROMPT_LEN}-token prompt, 4 endpoints)"
    );
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 1e6 {
        format!("{:.2} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{us:.1} µs")
    }
}
