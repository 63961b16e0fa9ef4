//! Whole runs: the same seed gives the same JSON byte for byte, and the command runs the
//! built-in components side by side on the same arrivals.

use std::path::Path;

use clap::Parser;
use serde_json::Value;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    lab: LabArgs,
}

/// `switchyard lab` with `flags` after `--trace TRACE --plugins <the built-in policies>`.
fn config(trace: &Path, flags: &[&str]) -> LabConfig {
    let plugins = switchyard_tests::plugins_dir();
    let mut argv = vec![
        "lab".to_owned(),
        "--trace".to_owned(),
        trace.display().to_string(),
        "--plugins".to_owned(),
        plugins.display().to_string(),
    ];
    argv.extend(flags.iter().map(|f| (*f).to_owned()));
    Cli::try_parse_from(argv)
        .expect("valid flags")
        .lab
        .validate()
        .expect("a valid run")
}

/// The JSON of a run, its one wall-clock figure set to zero.
fn json_without_wall(config: &LabConfig) -> String {
    let mut report = execute(config, indicatif::ProgressDrawTarget::hidden()).expect("runs");
    report.wall = Duration::ZERO;
    serde_json::to_string_pretty(&to_json(config, &report)).expect("serialises")
}

fn trace_file(dir: &Path, trace: &Trace) -> std::path::PathBuf {
    let path = dir.join("trace.jsonl");
    let mut file = std::fs::File::create(&path).expect("creates the trace");
    trace.write_jsonl(&mut file).expect("writes the trace");
    path
}

/// Seed 11 re-draws the arrivals (and seeds the rest): twice, alike.
#[test]
fn the_same_seed_gives_byte_identical_json() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(5, 80, 8.0));
    let flags = [
        "--policy",
        "round-robin",
        "--policy",
        "disagg",
        "--prefill",
        "1",
        "--decode",
        "3",
        "--kv-pages",
        "600",
        "--seed",
        "11",
        "--slo",
        "400,40",
    ];
    let first = json_without_wall(&config(&trace, &flags));
    let second = json_without_wall(&config(&trace, &flags));
    assert!(first == second, "two runs differ:\n{first}\n---\n{second}");
    // And the JSON says what users and checks rely on.
    let json: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(json["simulated_requests"], 80);
    assert_eq!(json["seed"], 11);
    assert!(json["wall_seconds"].is_number());
    for name in ["round-robin", "disagg"] {
        let policy = &json["policies"][name];
        for field in [
            "completed",
            "failed",
            "request_goodput",
            "mean_ttft_ms",
            "p50_ttft_ms",
            "p99_ttft_ms",
            "p50_tpot_ms",
            "p99_tpot_ms",
            "mean_e2el_ms",
            "p50_e2el_ms",
            "p99_e2el_ms",
            "prefix_hit_rate",
            "preemptions",
            "prefix_prediction_accuracy",
        ] {
            assert!(policy[field].is_number(), "{name}.{field}: {policy}");
        }
        for share in ["prefix_hit_rate", "prefix_prediction_accuracy"] {
            let share = policy[share].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&share), "{share}");
        }
        assert_eq!(policy["prefix_predictions"], 80, "{policy}");
        assert_eq!(policy["completed"], 80, "{policy}");
    }
    // round-robin forwards (no KV moves), disagg hands every prompt over.
    assert_eq!(json["policies"]["round-robin"]["kv_transfers"], 0);
    assert!(json["policies"]["disagg"]["kv_transfers"].as_u64().unwrap() > 0);
    assert_eq!(
        json["policies"]["round-robin"]["vs_first"]["p50_ttft_ms"],
        0.0
    );
}

#[test]
fn the_command_writes_the_table_the_json_and_the_plot() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(3, 40, 8.0));
    let json = dir.path().join("lab.json");
    let out = dir.path().join("out");
    let plugins = switchyard_tests::plugins_dir();
    let args = Cli::try_parse_from([
        "lab",
        "--trace",
        trace.to_str().unwrap(),
        "--plugins",
        plugins.to_str().unwrap(),
        "--policy",
        "round-robin",
        "--engines",
        "2",
        "--json",
        json.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap()
    .lab;
    crate::run(args).expect("runs");
    let written: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(written["policies"]["round-robin"]["completed"], 40);
    let table = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    assert!(table.contains("TTFT p50 (ms)"), "{table}");
    assert!(table.contains("simulated requests/s"), "{table}");
    let svg = std::fs::read_to_string(out.join("latency_cdf.svg")).unwrap();
    assert!(svg.contains("round-robin (n=40)"), "{svg}");
}

#[test]
fn a_missing_policy_is_named_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(3, 4, 8.0));
    let error = Cli::try_parse_from([
        "lab",
        "--trace",
        trace.to_str().unwrap(),
        "--plugins",
        dir.path().to_str().unwrap(),
        "--policy",
        "nope",
        "--engines",
        "1",
        "--fallback-policy",
        "none",
    ])
    .unwrap()
    .lab
    .validate()
    .expect_err("no such policy");
    assert!(error.to_string().contains("nope.wasm"), "{error}");
}

/// Forwards every request to endpoint 0, recording the `cached-prefix` each endpoint showed
/// and the prompt's length.
#[derive(Debug, Default)]
struct Sticky {
    seen: Mutex<Vec<(usize, Vec<Option<u32>>)>>,
}

impl Planner for Sticky {
    fn translate(
        &self,
        request: &PolicyRequest<'_>,
        context: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let cached = context.endpoints.iter().map(|e| e.cached_prefix).collect();
        self.seen
            .lock()
            .unwrap()
            .push((request.prompt.map_or(0, <[u32]>::len), cached));
        Ok(Plan {
            steps: vec![Step::Forward { endpoint: 0 }],
        })
    }

    // It learns nothing.
    fn on_complete(&self, _: &Outcome) {}
}

/// Policies see how much of each prompt every engine's cache holds: the engine that served a
/// conversation's earlier turns holds some of its later prompts, the idle one nothing; without
/// prefix caches, nobody knows.
#[test]
fn snapshots_carry_each_engines_cached_prefix_of_the_prompt() {
    let trace = synthetic(7, 30, 3.0);
    for prefix_cache in [true, false] {
        let cluster = ClusterSpec {
            prefix_cache,
            ..cluster(Protocol::Mlc, vec![Role::Any; 2], 2048)
        };
        let planner = Arc::new(Sticky::default());
        let result = run(&cluster, &trace, planner.clone(), 7);
        assert!(result.violations.is_empty(), "{:?}", result.violations);
        let seen = planner.seen.lock().unwrap();
        assert_eq!(seen.len(), 30);
        if !prefix_cache {
            assert!(seen.iter().all(|(_, c)| c == &[None, None]), "{seen:?}");
            continue;
        }
        for (len, cached) in seen.iter() {
            assert_eq!(cached[1], Some(0), "endpoint 1 never served");
            let on_0 = cached[0].expect("known") as usize;
            assert!(on_0 <= *len && on_0.is_multiple_of(16), "{on_0} of {len}");
        }
        let hits = seen.iter().filter(|(_, c)| c[0] > Some(0)).count();
        assert!(hits > 0, "later turns find their earlier ones: {seen:?}");
    }
}

/// Forwards every request to endpoint 0, recording each endpoint's in-flight count and pending
/// prefill, and the longest prompt planned.
#[derive(Debug, Default)]
struct Loads {
    seen: Mutex<Vec<Vec<(u32, u32)>>>,
    longest: Mutex<usize>,
}

impl Planner for Loads {
    fn translate(
        &self,
        request: &PolicyRequest<'_>,
        context: &PolicyContext,
    ) -> Result<Plan, TranslateError> {
        let loads = context
            .endpoints
            .iter()
            .map(|e| (e.in_flight, e.pending_prefill))
            .collect();
        self.seen.lock().unwrap().push(loads);
        let mut longest = self.longest.lock().unwrap();
        *longest = (*longest).max(request.prompt.map_or(0, <[u32]>::len));
        Ok(Plan {
            steps: vec![Step::Forward { endpoint: 0 }],
        })
    }

    fn on_complete(&self, _: &Outcome) {}
}

/// Policies see the prompt tokens each engine was sent and has not prefilled yet, as the
/// router counts them: a burst on engine 0 queues prefills there, requests past their first
/// token count in flight only, and the idle engine shows nothing.
#[test]
fn snapshots_carry_the_prompt_tokens_each_engine_has_not_prefilled_yet() {
    let trace = synthetic(7, 60, 200.0);
    let cluster = cluster(Protocol::Mlc, vec![Role::Any; 2], 2048);
    let planner = Arc::new(Loads::default());
    let result = run(&cluster, &trace, planner.clone(), 7);
    assert!(result.violations.is_empty(), "{:?}", result.violations);
    let seen = planner.seen.lock().unwrap();
    let longest = *planner.longest.lock().unwrap() as u32;
    assert!(seen.len() >= 60);
    for loads in seen.iter() {
        assert_eq!(loads[1], (0, 0), "endpoint 1 never served");
        let (in_flight, pending) = loads[0];
        assert!(pending <= in_flight * longest, "{loads:?}");
    }
    assert!(
        seen.iter().any(|l| l[0].1 > 0),
        "a burst queues prefills on endpoint 0: {seen:?}"
    );
    assert!(
        seen.iter().any(|l| l[0].0 > 0 && l[0].1 == 0),
        "prefilled requests count in flight only: {seen:?}"
    );
}

/// A figure of a policy in a JSON object of policies.
fn figure(policies: &Value, policy: &str, key: &str) -> f64 {
    policies[policy][key]
        .as_f64()
        .unwrap_or_else(|| panic!("{policy}.{key}: {}", policies[policy]))
}

/// A sweep replays each load, lowest first, as that multiple of the replayed rate: its first
/// load (1) is the configured run, field for field; the rate grows with the load and SLO
/// attainment falls. The per-request paired difference to the first policy is, with every
/// request completed by both, the difference of their means.
#[test]
fn a_sweep_replays_each_load_lowest_first_at_that_multiple_of_the_rate() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(3, 60, 6.0));
    let out = dir.path().join("out");
    let config = config(
        &trace,
        &[
            "--policy",
            "round-robin",
            "--policy",
            "kv-aware",
            "--engines",
            "2",
            "--slo",
            "250,12",
            "--load-sweep",
            "1..4:4",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let json: Value = serde_json::from_str(&json_without_wall(&config)).unwrap();
    let sweep = json["sweep"].as_array().expect("a sweep");
    let loads: Vec<f64> = sweep.iter().map(|p| p["load"].as_f64().unwrap()).collect();
    assert_eq!(loads, [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(
        sweep[0]["policies"], json["policies"],
        "load 1 is the run itself"
    );
    let rate = sweep[0]["request_rate"].as_f64().unwrap();
    for point in sweep {
        let expected = rate * point["load"].as_f64().unwrap();
        let rate = point["request_rate"].as_f64().unwrap();
        assert!(
            (rate - expected).abs() < 1e-9 * expected,
            "{rate} vs {expected}"
        );
    }
    for policy in ["round-robin", "kv-aware"] {
        let span = |p: &Value| figure(&p["policies"], policy, "duration");
        assert!(
            span(&sweep[3]) < span(&sweep[0]) / 2.0,
            "4x the rate, a shorter run"
        );
        let attainment: Vec<f64> = sweep
            .iter()
            .map(|p| figure(&p["policies"], policy, "slo_attainment"))
            .collect();
        assert!(attainment.iter().all(|a| (0.0..=1.0).contains(a)));
        assert!(
            attainment[3] < attainment[0],
            "{policy}: 4x the load, fewer requests in the SLO: {attainment:?}"
        );
    }
    for point in sweep {
        let policies = &point["policies"];
        assert_eq!(figure(policies, "kv-aware", "failed"), 0.0);
        let paired = &policies["kv-aware"]["paired_vs_first"];
        assert_eq!(paired["pairs"], 60);
        for key in ["mean_ttft_ms", "mean_e2el_ms"] {
            let of_means = figure(policies, "kv-aware", key) - figure(policies, "round-robin", key);
            let paired = paired[key].as_f64().unwrap();
            assert!(
                (paired - of_means).abs() < 1e-6,
                "{key}: {paired} vs {of_means}"
            );
        }
    }
    // The plots: attainment against load, and each policy's engines over time.
    let report = execute(&config, indicatif::ProgressDrawTarget::hidden()).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    crate::report::write_plots(&out, &report).unwrap();
    let svg = std::fs::read_to_string(out.join("attainment_vs_load.svg")).unwrap();
    assert!(
        svg.contains("SLO attainment") && svg.contains("kv-aware"),
        "{svg}"
    );
    let engines = std::fs::read_to_string(out.join("engines_1_kv-aware.svg")).unwrap();
    assert!(engines.contains("engine 1"), "{engines}");
}

/// `--seeds K` reports each figure as the mean of the K seeds' runs, with Student's 95%
/// interval around it: the same numbers as K runs with one seed each, taken together. Each
/// seed draws its own arrivals, so the intervals have a width; every policy of a seed replays
/// the same ones, so the paired difference pairs every request.
#[test]
fn seeds_give_each_figure_the_mean_and_interval_of_the_seeds_runs() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(5, 60, 30.0));
    let run = |seed: &str, seeds: &str| {
        let flags = [
            "--policy",
            "round-robin",
            "--policy",
            "kv-aware",
            "--engines",
            "2",
            "--slo",
            "800,40",
            "--seed",
            seed,
            "--seeds",
            seeds,
        ];
        let json: Value =
            serde_json::from_str(&json_without_wall(&config(&trace, &flags))).unwrap();
        json
    };
    let together = run("1", "3");
    let alone: Vec<Value> = ["1", "2", "3"].map(|seed| run(seed, "1")).into();
    assert_eq!(together["seeds"], 3);
    for (policy, key) in [
        ("round-robin", "mean_e2el_ms"),
        ("round-robin", "p90_ttft_ms"),
        ("round-robin", "slo_attainment"),
        ("kv-aware", "mean_ttft_ms"),
        ("kv-aware", "prefix_hit_rate"),
    ] {
        let values: Vec<f64> = alone
            .iter()
            .map(|j| figure(&j["policies"], policy, key))
            .collect();
        let (mean, ci) = crate::confidence::mean_ci95(&values);
        let [low, high] = ci.unwrap();
        let reported = &together["policies"][policy][format!("{key}_ci95")];
        assert!((figure(&together["policies"], policy, key) - mean).abs() < 1e-9);
        assert!(
            (reported[0].as_f64().unwrap() - low).abs() < 1e-9
                && (reported[1].as_f64().unwrap() - high).abs() < 1e-9,
            "{policy}.{key}: {reported} vs [{low}, {high}]"
        );
        assert!(low <= mean && mean <= high);
        assert!(
            alone[0]["policies"][policy]
                .get(format!("{key}_ci95"))
                .is_none()
        );
    }
    // The seeds' arrivals differ, and so do the latencies.
    for (policy, key) in [("round-robin", "mean_e2el_ms"), ("kv-aware", "p90_ttft_ms")] {
        let [low, high] = together["policies"][policy][format!("{key}_ci95")]
            .as_array()
            .map(|ci| [ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap()])
            .unwrap();
        assert!(high > low, "{policy}.{key}: [{low}, {high}]");
    }
    // Paired per seed: every request of a seed's arrivals ran under both policies.
    for one in &alone {
        let policies = &one["policies"];
        assert_eq!(policies["kv-aware"]["paired_vs_first"]["pairs"], 60);
        let of_means = figure(policies, "kv-aware", "mean_ttft_ms")
            - figure(policies, "round-robin", "mean_ttft_ms");
        let paired = policies["kv-aware"]["paired_vs_first"]["mean_ttft_ms"]
            .as_f64()
            .unwrap();
        assert!((paired - of_means).abs() < 1e-6, "{paired} vs {of_means}");
    }
}

#[test]
fn a_sweep_needs_an_slo_and_rising_loads() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(3, 4, 8.0));
    let plugins = switchyard_tests::plugins_dir();
    let parse = |extra: &[&str]| {
        let mut argv = vec![
            "lab",
            "--trace",
            trace.to_str().unwrap(),
            "--plugins",
            plugins.to_str().unwrap(),
            "--policy",
            "round-robin",
            "--engines",
            "1",
        ];
        argv.extend(extra);
        Cli::try_parse_from(argv).map(|c| c.lab)
    };
    for bad in [
        &["--load-sweep", "0.5..2:4"][..],
        &["--slo", "1,1", "--load-sweep", "2..1:4"],
        &["--slo", "1,1", "--load-sweep", "0..1:4"],
        &["--slo", "1,1", "--load-sweep", "1..2:1"],
        &["--slo", "1,1", "--load-sweep", "1..2"],
        &["--slo", "1,1", "--seeds", "0"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?} parses");
    }
    let config = parse(&["--slo", "1,1", "--load-sweep", "0.5..2:4"])
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(config.sweep.unwrap().loads(), [0.5, 1.0, 1.5, 2.0]);
}

/// `--timing-table` costs the engines' steps from the table, not the profile: requests far
/// apart decode at the table's step time, and a table twice as slow is `--time-scale 2`.
#[test]
fn a_timing_table_costs_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(3, 6, 0.05));
    let table = |factor: f64| {
        let path = dir.path().join(format!("steps-{factor}.csv"));
        let rows = format!(
            "kind,tokens,batch,context,ms\nprefill,100,,,{}\nprefill,1000,,,{}\n\
             decode,,1,100,{}\ndecode,,1,2000,{}\ndecode,,8,100,{}\ndecode,,8,2000,{}\n",
            10.0 * factor,
            100.0 * factor,
            5.0 * factor,
            5.0 * factor,
            9.0 * factor,
            9.0 * factor,
        );
        std::fs::write(&path, rows).unwrap();
        path
    };
    let run = |table: &Path, scale: &str| {
        let flags = [
            "--policy",
            "round-robin",
            "--engines",
            "1",
            "--timing-table",
            table.to_str().unwrap(),
            "--time-scale",
            scale,
        ];
        let json: Value =
            serde_json::from_str(&json_without_wall(&config(&trace, &flags))).unwrap();
        json
    };
    let one = run(&table(1.0), "1");
    let policies = &one["policies"];
    assert_eq!(one["cluster"]["timing_table"], table(1.0).to_str().unwrap());
    // Alone on the engine, each request decodes one token a step: 5 ms.
    for key in ["p50_tpot_ms", "p99_tpot_ms"] {
        assert!(
            (figure(policies, "round-robin", key) - 5.0).abs() < 1e-3,
            "{key}"
        );
    }
    // Twice the table's times is --time-scale 2, to the nanosecond; latencies about double
    // (not exactly: a conversation's turns overlap others a little differently).
    let twice = run(&table(2.0), "1");
    let scaled = run(&table(1.0), "2");
    for key in ["mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "p50_tpot_ms"] {
        let base = figure(policies, "round-robin", key);
        let doubled = figure(&twice["policies"], "round-robin", key);
        let by_scale = figure(&scaled["policies"], "round-robin", key);
        assert!(
            (doubled - by_scale).abs() < 1e-3,
            "{key}: {doubled} vs {by_scale}"
        );
        let ratio = doubled / base;
        assert!(
            (1.8..2.3).contains(&ratio),
            "{key}: {doubled} vs 2 × {base}"
        );
    }
}

/// The built-in random policy (`plugins/random`, built here from source) loads as the router
/// loads it and seeds its generator from the run's `wasi:random`: the same seed gives the same
/// JSON, byte for byte, and it places requests on every engine.
#[test]
fn the_random_policy_draws_alike_for_one_seed() {
    let random = switchyard_tests::guest(switchyard_tests::Guest {
        package: "random-policy",
        artifact: "random_policy.wasm",
    });
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), &synthetic(4, 60, 10.0));
    let run = |seed: &str| {
        let flags = [
            "--policy",
            "round-robin",
            "--policy",
            random.to_str().unwrap(),
            "--engines",
            "4",
            "--seed",
            seed,
        ];
        json_without_wall(&config(&trace, &flags))
    };
    let first = run("0");
    assert!(first == run("0"), "one seed, one run");
    let json: Value = serde_json::from_str(&first).unwrap();
    let policy = &json["policies"][random.to_str().unwrap()];
    assert_eq!(policy["completed"], 60, "{policy}");
    assert_eq!(policy["policy_faults"], 0, "{policy}");
    let steps: Vec<u64> = policy["engine_steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    assert!(
        steps.iter().all(|&s| s > 0),
        "every engine served: {steps:?}"
    );
}
