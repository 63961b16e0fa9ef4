//! Unit tests for the load generator, and end-to-end runs against a mock server on loopback.

use std::time::Duration;

use clap::Parser;

use super::config::{BenchArgs, BenchConfig, LenRange, PromptFormat, WorkloadConfig};
use super::schedule::{ArrivalSchedule, Arrivals};
use super::stats::{Distribution, ReplayMetrics, RequestOutcome, Summary, Timing, percentile};
use super::workload::{Arm, Workload};
use super::{BenchError, BenchReport, procstat, report, server_metrics};

mod mock;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn parse(args: &[&str]) -> Result<BenchConfig, BenchError> {
    let mut argv = vec!["bench"];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(argv).map_err(|e| BenchError::Config(e.to_string()))?;
    cli.bench.validate()
}

fn workload(seed: u64) -> WorkloadConfig {
    WorkloadConfig {
        seed,
        input_len: LenRange { min: 20, max: 60 },
        output_len: LenRange { min: 4, max: 9 },
        shared_prefix: None,
        compare_direct: false,
    }
}

// ---- Poisson schedule -------------------------------------------------------------------

#[test]
fn poisson_mean_gap_is_one_over_rate() {
    let rate = 40.0;
    let draws = 50_000;
    let times: Vec<f64> = ArrivalSchedule::new(rate, Arrivals::Poisson, 7)
        .take(draws + 1)
        .map(|d| d.as_secs_f64())
        .collect();
    assert_eq!(times[0], 0.0, "the first request is due at once");
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    // Standard error of the mean is (1/rate)/sqrt(50_000) ≈ 0.45%; 3% is > 6 sigma.
    assert!(
        (mean * rate - 1.0).abs() < 0.03,
        "mean gap {mean} vs {}",
        1.0 / rate
    );
    // Exponential gaps: the standard deviation equals the mean.
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
    assert!(
        (var.sqrt() / mean - 1.0).abs() < 0.05,
        "std/mean = {}",
        var.sqrt() / mean
    );
    assert!(gaps.iter().all(|&g| g >= 0.0));
}

#[test]
fn poisson_schedule_is_deterministic_per_seed() {
    let schedule = |seed| ArrivalSchedule::new(10.0, Arrivals::Poisson, seed).take(100);
    let a: Vec<Duration> = schedule(42).collect();
    let b: Vec<Duration> = schedule(42).collect();
    let c: Vec<Duration> = schedule(43).collect();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

// ---- statistics -------------------------------------------------------------------------

#[test]
fn percentiles_interpolate_like_numpy() {
    let data: Vec<f64> = (1..=10).map(f64::from).collect();
    let at = |p| percentile(&data, p).expect("in range");
    assert_eq!(at(0.0), 1.0);
    assert_eq!(at(100.0), 10.0);
    assert!((at(50.0) - 5.5).abs() < 1e-12);
    assert!((at(90.0) - 9.1).abs() < 1e-12);
    assert!((at(99.0) - 9.91).abs() < 1e-12);
    assert_eq!(percentile(&[], 50.0), None);
    assert_eq!(percentile(&data, 101.0), None);
    assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
}

#[test]
fn distribution_of_known_samples() {
    let d = Distribution::of(vec![4.0, 2.0, 8.0, 6.0, f64::NAN]);
    assert_eq!(d.count, 4, "NaN is dropped");
    assert_eq!(d.mean, 5.0);
    assert_eq!(d.median, 5.0);
    assert_eq!(d.min, 2.0);
    assert_eq!(d.max, 8.0);
    assert!((d.std - 5.0f64.sqrt()).abs() < 1e-12);
    assert_eq!(Distribution::of(Vec::new()), Distribution::default());
}

fn ok(index: u64, arm: Arm, ttft_ms: u64, e2e_ms: u64, tokens: u32) -> RequestOutcome {
    let gaps = tokens.saturating_sub(1).max(1);
    RequestOutcome {
        index,
        arm,
        input_tokens: 10,
        result: Ok(Timing {
            ttft: Duration::from_millis(ttft_ms),
            e2e: Duration::from_millis(e2e_ms),
            itl: vec![
                Duration::from_millis((e2e_ms - ttft_ms) / u64::from(gaps));
                tokens as usize - 1
            ],
            output_tokens: tokens,
            cached_tokens: None,
        }),
    }
}

fn failed(index: u64, arm: Arm) -> RequestOutcome {
    RequestOutcome {
        index,
        arm,
        input_tokens: 10,
        result: Err("completions: HTTP 503: busy".into()),
    }
}

#[test]
fn tpot_excludes_the_first_token() {
    let outcome = ok(0, Arm::Routed, 10, 50, 5);
    let timing = outcome.result.as_ref().expect("ok");
    assert_eq!(timing.tpot(), Some(Duration::from_millis(10)));
    let single = ok(1, Arm::Routed, 10, 10, 1);
    assert_eq!(single.result.as_ref().expect("ok").tpot(), None);
}

#[test]
fn summary_counts_throughput_and_goodput() {
    let outcomes = vec![
        ok(0, Arm::Routed, 10, 50, 5),  // tpot 10 ms: good
        ok(1, Arm::Routed, 30, 70, 5),  // ttft 30 ms: too slow
        ok(2, Arm::Routed, 10, 170, 5), // tpot 40 ms: too slow
        failed(3, Arm::Routed),
    ];
    let slo = Some(super::Slo {
        ttft_ms: 20.0,
        tpot_ms: 20.0,
    });
    let s = Summary::of(&outcomes, Duration::from_secs(2), slo);
    assert_eq!((s.completed, s.failed), (3, 1));
    assert_eq!(s.total_output_tokens, 15);
    assert_eq!(s.total_input_tokens, 30);
    assert_eq!(s.request_throughput, 1.5);
    assert_eq!(s.output_throughput, 7.5);
    assert_eq!(s.request_goodput, Some(0.5));
    assert_eq!(s.ttft_ms.median, 10.0);
    assert_eq!(s.itl_ms.count, 12);
    assert_eq!(
        s.errors,
        vec![("completions: HTTP 503: busy".to_owned(), 1)]
    );
    assert_eq!(
        Summary::of(&outcomes, Duration::from_secs(2), None).request_goodput,
        None
    );
}

// ---- prompts ----------------------------------------------------------------------------

#[test]
fn prompts_are_deterministic_printable_and_in_range() {
    let a = Workload::new(workload(5));
    let b = Workload::new(workload(5));
    let c = Workload::new(workload(6));
    let mut differs = false;
    for i in 0..200 {
        let (ra, rb) = (a.request(i), b.request(i));
        assert_eq!(ra, rb);
        assert!(
            (20..=60).contains(&ra.prompt.len()),
            "input length {}",
            ra.prompt.len()
        );
        assert!((4..=9).contains(&ra.max_tokens));
        assert!(ra.prompt.bytes().all(|b| (0x20..=0x7e).contains(&b)));
        assert_eq!(
            ra.token_ids().len(),
            ra.prompt.len(),
            "one byte is one token"
        );
        assert_eq!(ra.arm, Arm::Routed);
        differs |= ra.prompt != c.request(i).prompt;
    }
    assert!(differs, "another seed gives other prompts");
}

#[test]
fn comparing_arms_does_not_change_prompts_and_splits_requests() {
    let plain = Workload::new(workload(9));
    let compared = Workload::new(WorkloadConfig {
        compare_direct: true,
        ..workload(9)
    });
    let mut direct = 0;
    for i in 0..1000 {
        let (p, c) = (plain.request(i), compared.request(i));
        assert_eq!((p.prompt, p.max_tokens), (c.prompt, c.max_tokens));
        direct += usize::from(c.arm == Arm::Direct);
        assert_eq!(c.arm, compared.request(i).arm, "the arm is seeded");
    }
    assert!((400..=600).contains(&direct), "{direct} of 1000 direct");
}

fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

#[test]
fn shared_prefix_groups_share_exactly_the_prefix() {
    let (groups, len) = (3u64, 16usize);
    let w = Workload::new(WorkloadConfig {
        shared_prefix: Some((groups as u32, len as u32)),
        input_len: LenRange { min: 17, max: 40 },
        ..workload(11)
    });
    let requests: Vec<_> = (0..60).map(|i| w.request(i)).collect();
    for (i, a) in requests.iter().enumerate() {
        for (j, b) in requests.iter().enumerate().skip(i + 1) {
            let shared = common_prefix(&a.prompt, &b.prompt);
            if i as u64 % groups == j as u64 % groups {
                assert_eq!(shared, len, "requests {i} and {j} of one group");
            } else {
                assert_eq!(shared, 0, "requests {i} and {j} of different groups");
            }
        }
    }
}

// ---- configuration ----------------------------------------------------------------------

#[test]
fn bad_options_are_errors_not_panics() {
    let url = ["--url", "http://127.0.0.1:9"];
    let bad: &[&[&str]] = &[
        &["--num-requests", "0"],
        &["--duration", "0"],
        &["--duration", "inf"],
        &["--rate", "-1"],
        &["--concurrency", "0"],
        &["--input-len-range", "9:3"],
        &["--input-len-range", "x"],
        &["--output-len", "0"],
        &["--shared-prefix-groups", "2", "--shared-prefix-len", "128"],
        &["--slo", "5"],
        &["--rate", "2", "--concurrency", "2"],
        &["--max-concurrency", "2"],
        &["--router-idle-sample", "1"],
        &["--router-pid", "1", "--router-idle-sample", "-1"],
        &["--endpoint", "http://127.0.0.1:9"],
        &["--plan", "forward"],
        &["--compare-direct", "--endpoint", "nope"],
        &["--connection-per-client", "--rate", "2"],
        &["--connection-per-client", "--compare-direct"],
    ];
    for args in bad {
        let mut all = url.to_vec();
        all.extend_from_slice(args);
        assert!(parse(&all).is_err(), "{args:?} should be rejected");
    }
    assert!(parse(&["--url", "ftp://host"]).is_err());
    assert!(parse(&["--url", "https://host", "--connection-per-client"]).is_err());
    assert!(parse(&["--url", "HTTP://host", "--connection-per-client"]).is_ok());
    assert!(parse(&["--url", "not a url"]).is_err());
}

#[test]
fn defaults_are_bounded_and_streaming() {
    let config = parse(&["--url", "http://127.0.0.1:9/"]).expect("valid");
    assert_eq!(config.url, "http://127.0.0.1:9");
    assert!(config.stream);
    assert_eq!(config.load, super::LoadShape::Closed { concurrency: 1 });
    assert!(config.num_requests > 0 && config.duration > Duration::ZERO);
    let config = parse(&["--url", "http://h:1", "--no-stream", "--stream"]).expect("valid");
    assert!(config.stream, "the last of --stream/--no-stream wins");
    let config = parse(&["--url", "http://h:1", "--no-stream", "--rate", "3"]).expect("valid");
    assert!(!config.stream);
    assert_eq!(
        config.load,
        super::LoadShape::Open {
            rate: 3.0,
            arrivals: Arrivals::Poisson,
            max_concurrency: None
        }
    );
}

// ---- /proc ------------------------------------------------------------------------------

#[test]
fn proc_stat_fields_count_from_the_last_parenthesis() {
    let stat = "1234 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 250 75 0 0 20 0 4 0 100 0 0";
    assert_eq!(procstat::parse_cpu_ticks(stat), Some(325));
    assert_eq!(procstat::parse_cpu_ticks("garbage"), None);
    let status = "Name:\tswitchyard\nVmPeak:\t  200 kB\nVmHWM:\t   5120 kB\nVmRSS:\t 4000 kB\n";
    assert_eq!(procstat::parse_status_kib(status, "VmHWM"), Some(5120));
    assert_eq!(procstat::parse_status_kib(status, "VmSwap"), None);
}

#[test]
fn own_process_can_be_measured() {
    let pid = std::process::id();
    assert!(procstat::peak_rss_kib(pid).expect("VmHWM") > 0);
    procstat::cpu_time(pid).expect("stat parses");
    assert!(procstat::cpu_time(u32::MAX).is_err());
}

// ---- JSON -------------------------------------------------------------------------------

fn sample_report(with_arms: bool) -> BenchReport {
    let outcomes = vec![
        ok(0, Arm::Routed, 10, 50, 5),
        ok(1, Arm::Direct, 8, 45, 5),
        failed(2, Arm::Routed),
    ];
    let duration = Duration::from_secs(1);
    let arms = if with_arms {
        [Arm::Routed, Arm::Direct]
            .into_iter()
            .map(|arm| {
                let mine = outcomes.iter().filter(|o| o.arm == arm);
                (arm, Summary::of(mine, duration, None))
            })
            .collect()
    } else {
        Vec::new()
    };
    BenchReport {
        duration,
        overall: Summary::of(&outcomes, duration, None),
        outcomes,
        arms,
        direct_plan: with_arms.then_some(super::DirectPlan::Disagg),
        router: None,
        trace: None,
    }
}

#[test]
fn json_has_vllm_names_with_the_right_types() {
    let config = parse(&["--url", "http://127.0.0.1:9"]).expect("valid");
    let json = report::to_json(&config, &sample_report(false));
    let obj = json.as_object().expect("an object");
    for key in [
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
    ] {
        assert!(obj[key].is_u64(), "{key} is an integer: {}", obj[key]);
    }
    assert_eq!(obj["completed"], 2);
    assert_eq!(obj["failed"], 1);
    for key in ["duration", "request_throughput", "output_throughput"] {
        assert!(obj[key].is_f64(), "{key} is a number");
    }
    assert!(obj["request_goodput"].is_null(), "no SLO, no goodput");
    for metric in ["ttft", "tpot", "itl", "e2el"] {
        for stat in ["mean", "median", "std", "p50", "p90", "p99"] {
            let key = format!("{stat}_{metric}_ms");
            assert!(
                obj.get(&key).is_some_and(|v| v.is_f64()),
                "{key} missing or not a number"
            );
        }
    }
    assert_eq!(obj["median_ttft_ms"], 9.0);
    for key in ["input_lens", "output_lens", "ttfts", "errors"] {
        assert_eq!(
            obj[key].as_array().map(Vec::len),
            Some(3),
            "{key} has one per request"
        );
    }
    assert!(obj.get("arms").is_none());
    assert_eq!(obj["request_rate"], "inf");
}

#[test]
fn json_compares_arms() {
    let config = parse(&[
        "--url",
        "http://127.0.0.1:9",
        "--compare-direct",
        "--slo",
        "20,20",
    ])
    .expect("valid");
    let json = report::to_json(&config, &sample_report(true));
    assert!(json["arms"]["routed"]["p50_ttft_ms"].is_f64());
    assert_eq!(json["arms"]["direct"]["completed"], 1);
    let cmp = &json["comparison"];
    assert_eq!(cmp["direct_plan"], "disagg");
    assert!((cmp["p50_ttft_diff_us"].as_f64().expect("number") - 2000.0).abs() < 1e-6);
    assert!((cmp["p50_ttft_ratio"].as_f64().expect("number") - 1.25).abs() < 1e-9);
    assert!(cmp["p50_e2el_diff_us"].is_f64());
    assert!(json["router"].is_null());

    let mut with_router = sample_report(true);
    with_router.router = Some(super::RouterUsage {
        pid: 7,
        cpu: Duration::from_millis(30),
        cpu_per_request_us: 30_000.0,
        idle_cpu_rate: 0.01,
        net_cpu_per_request_us: 20_000.0,
        peak_rss_kib: 2048,
    });
    let json = report::to_json(&config, &with_router);
    let router = &json["router"];
    assert_eq!(router["pid"], 7);
    assert_eq!(router["peak_rss_kib"], 2048);
    for key in [
        "cpu_seconds",
        "cpu_us_per_request",
        "idle_cpu_rate",
        "net_cpu_us_per_request",
    ] {
        assert!(router[key].is_f64(), "router.{key} is a number");
    }
}

#[test]
fn table_names_every_section() {
    let config = parse(&["--url", "http://127.0.0.1:9", "--compare-direct"]).expect("valid");
    let mut out = Vec::new();
    report::write_table(&mut out, &config, &sample_report(true)).expect("writes");
    let text = String::from_utf8(out).expect("utf-8");
    for needle in [
        "Successful requests:",
        "Median TTFT (ms):",
        "P99 E2EL (ms):",
        "Routed vs direct (disagg)",
        "HTTP 503",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn plot_writes_an_svg_with_both_arms() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("cdf.svg");
    super::plot::write_cdfs(&path, &sample_report(true)).expect("plots");
    let svg = std::fs::read_to_string(&path).expect("written");
    assert!(svg.starts_with("<svg"));
    assert!(svg.contains("routed (n=1)") && svg.contains("direct (n=1)"));
}

// ---- end to end against the mock server ---------------------------------------------------

async fn run_against(server: &mock::MockServer, extra: &[&str]) -> Result<BenchReport, BenchError> {
    let mut args = vec!["--url", server.url.as_str()];
    args.extend_from_slice(extra);
    let config = parse(&args)?;
    super::execute(&config, indicatif::ProgressBar::hidden()).await
}

#[tokio::test]
async fn closed_loop_counts_every_token() {
    let server = mock::MockServer::start().await;
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "20",
            "--concurrency",
            "4",
            "--output-len",
            "8",
            "--input-len",
            "32",
        ],
    )
    .await
    .expect("runs");
    let s = &report.overall;
    assert_eq!((s.completed, s.failed), (20, 0), "errors: {:?}", s.errors);
    assert_eq!(s.total_output_tokens, 160);
    assert_eq!(s.total_input_tokens, 20 * 32);
    assert_eq!(server.calls.lock().count("/v1/completions"), 20);
    // Throughput is exactly what was counted over the measured wall time.
    let secs = report.duration.as_secs_f64();
    assert!((s.output_throughput - 160.0 / secs).abs() < 1e-9);
    assert!((s.request_throughput - 20.0 / secs).abs() < 1e-9);
    // 8 chunks: 7 gaps each. (Single gaps have no lower bound here: a busy client may read
    // two chunks at once. Only the whole response is bounded below, by the server's pacing.)
    assert_eq!(s.itl_ms.count, 20 * 7);
    assert_eq!(s.tpot_ms.count, 20);
    let itl_sum: f64 = report
        .outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok())
        .flat_map(|t| t.itl.iter().map(|d| d.as_secs_f64() * 1e3))
        .sum();
    assert!((s.itl_ms.mean * 140.0 - itl_sum).abs() < 1e-6);
    for outcome in &report.outcomes {
        let t = outcome.result.as_ref().expect("ok");
        assert!(t.ttft <= t.e2e);
        assert!(
            t.e2e >= mock::CHUNK_GAP * 9,
            "8 chunks + usage chunk each wait a gap"
        );
    }
    // Each prompt went out as the generated text.
    let calls = server.calls.lock();
    let first = &calls.bodies["/v1/completions"][0];
    assert!(first["prompt"].as_str().is_some_and(|p| p.len() == 32));
    assert_eq!(first["stream"], true);
    assert_eq!(first["max_tokens"], 8);
}

/// One request at a time keeps its connection although the server ends each body in a write of
/// its own after `[DONE]` (as uvicorn does): dropped at `[DONE]`, each body's connection was
/// closed and every request opened a new one (50 of 50). Two, not one: hyper-util's pool
/// returns a connection from another task once its body is read, so the next request finds none
/// idle, races a new connect against the return, and the two then take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_streams_keep_their_connection() {
    let server = mock::MockServer::start().await;
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "50",
            "--concurrency",
            "1",
            "--output-len",
            "2",
            "--input-len",
            "8",
        ],
    )
    .await
    .expect("runs");
    assert_eq!(
        report.overall.completed, 50,
        "errors: {:?}",
        report.overall.errors
    );
    let by_connection = server.calls.lock().completions_by_connection.clone();
    assert!(by_connection.len() <= 2, "{by_connection:?}");
}

/// With --connection-per-client each closed-loop client keeps a connection of its own, as wrk
/// does: 4 clients, 40 requests, exactly 4 connections carrying them all (through the pool the
/// same load takes up to 8; see `sequential_streams_keep_their_connection`). Streamed and whole
/// answers alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_client_keeps_a_connection_of_its_own() {
    for stream in ["--stream", "--no-stream"] {
        // Held until each of the 4 clients has a request in flight: otherwise a client that
        // starts first may serve all 40 before the others connect (seen on a busy box).
        let server = mock::MockServer::holding_first(4).await;
        let report = run_against(
            &server,
            &[
                "--num-requests",
                "40",
                "--concurrency",
                "4",
                "--output-len",
                "3",
                "--input-len",
                "8",
                "--connection-per-client",
                stream,
            ],
        )
        .await
        .expect("runs");
        let s = &report.overall;
        assert_eq!((s.completed, s.failed), (40, 0), "{stream}: {:?}", s.errors);
        assert_eq!(s.total_output_tokens, 40 * 3, "{stream}");
        let by_connection = server.calls.lock().completions_by_connection.clone();
        assert_eq!(by_connection.len(), 4, "{stream}: {by_connection:?}");
        assert_eq!(by_connection.values().sum::<usize>(), 40, "{stream}");
    }
}

#[tokio::test]
async fn open_loop_compare_direct_runs_the_microserving_sequence() {
    let server = mock::MockServer::start().await;
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "40",
            "--rate",
            "400",
            "--seed",
            "3",
            "--compare-direct",
            "--output-len-range",
            "2:5",
            "--prompt-format",
            "tokens",
            "--router-pid",
            &std::process::id().to_string(),
            "--router-idle-sample",
            "0.05",
        ],
    )
    .await
    .expect("runs");
    let (routed, direct) = (
        report.arm(Arm::Routed).expect("routed arm"),
        report.arm(Arm::Direct).expect("direct arm"),
    );
    assert_eq!(
        routed.failed + direct.failed,
        0,
        "{:?} {:?}",
        routed.errors,
        direct.errors
    );
    assert_eq!(routed.completed + direct.completed, 40);
    assert!(
        routed.completed > 5 && direct.completed > 5,
        "both arms ran"
    );
    assert_eq!(report.direct_plan, Some(super::DirectPlan::Disagg));
    let calls = server.calls.lock();
    assert_eq!(calls.count("/v1/completions"), routed.completed);
    assert_eq!(calls.count("/microserving/prep_recv"), direct.completed);
    assert_eq!(
        calls.count("/microserving/remote_send"),
        direct.completed,
        "nothing matched"
    );
    assert_eq!(
        calls.count("/microserving/start_generate"),
        direct.completed
    );

    let prep = &calls.bodies["/microserving/prep_recv"][0];
    let user = prep["user"].as_str().expect("user is a string");
    let hex = user.strip_prefix("cmpl-").expect("cmpl- prefix");
    assert!(
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(prep["end"], -1);
    assert_eq!(prep["debug_config"], serde_json::json!({}));
    assert_eq!(prep["stream"], false);
    let len = prep["prompt"].as_array().expect("token ids").len() as i64;
    // Requests overlap, so find this request's other legs by its id.
    let leg = |path: &str| {
        calls.bodies[path]
            .iter()
            .find(|b| b["user"] == user)
            .unwrap_or_else(|| panic!("no {path} with user {user}"))
    };
    let send = leg("/microserving/remote_send");
    assert_eq!(send["kv_addr_info"], "AwAAAAAAAABbMF0=");
    assert_eq!(
        send["recv_rank"], 4,
        "D is endpoint 1, whose device rank is 4"
    );
    assert_eq!(
        (send["begin"].as_i64(), send["end"].as_i64()),
        (Some(0), Some(len - 1))
    );
    let generate = leg("/microserving/start_generate");
    assert_eq!(generate["begin"].as_i64(), Some(len - 1));
    assert_eq!(generate["stream"], true);
    drop(calls);

    let router = report.router.as_ref().expect("router usage");
    assert!(router.peak_rss_kib > 0);
    assert!(router.cpu_per_request_us >= router.net_cpu_per_request_us);
    assert!(router.net_cpu_per_request_us >= 0.0);
}

#[tokio::test]
async fn forward_plan_and_non_streaming() {
    let server = mock::MockServer::start().await;
    let endpoint = server.url.clone();
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "12",
            "--concurrency",
            "3",
            "--no-stream",
            "--compare-direct",
            "--endpoint",
            &endpoint,
            "--output-len",
            "6",
        ],
    )
    .await
    .expect("runs");
    assert_eq!(
        report.direct_plan,
        Some(super::DirectPlan::Forward),
        "one engine: forward"
    );
    let s = &report.overall;
    assert_eq!((s.completed, s.failed), (12, 0), "{:?}", s.errors);
    assert_eq!(s.total_output_tokens, 72);
    assert_eq!(s.itl_ms.count, 0, "no stream, no inter-token gaps");
    assert!(
        report
            .outcomes
            .iter()
            .all(|o| o.result.as_ref().is_ok_and(|t| t.ttft == t.e2e))
    );
    let calls = server.calls.lock();
    assert_eq!(
        calls.count("/v1/completions"),
        12,
        "routed and direct both use completions"
    );
    assert_eq!(
        calls.count("/admin/endpoints"),
        0,
        "--endpoint skips discovery"
    );
}

#[tokio::test]
async fn duration_bounds_the_run() {
    let server = mock::MockServer::start().await;
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "1000000",
            "--duration",
            "0.2",
            "--concurrency",
            "2",
            "--output-len",
            "2",
        ],
    )
    .await
    .expect("runs");
    let sent = report.outcomes.len();
    assert!(sent > 0 && sent < 1_000_000, "sent {sent}");
    assert_eq!(report.overall.failed, 0);
}

#[tokio::test]
async fn unreachable_url_is_a_clear_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    drop(listener);
    let config = parse(&["--url", &url]).expect("valid");
    let err = super::execute(&config, indicatif::ProgressBar::hidden())
        .await
        .expect_err("nothing listens there");
    assert!(matches!(err, BenchError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains(&url), "{err}");
}

#[tokio::test]
async fn failing_server_counts_failures() {
    let server = mock::MockServer::start().await;
    // The mock answers 404 for an unknown path: point the routed arm at one.
    let url = format!("{}/nowhere", server.url);
    let config = parse(&["--url", &url, "--num-requests", "3"]).expect("valid");
    let report = super::execute(&config, indicatif::ProgressBar::hidden())
        .await
        .expect("runs");
    assert_eq!((report.overall.completed, report.overall.failed), (0, 3));
    assert!(
        report.overall.errors[0].0.contains("HTTP 404"),
        "{:?}",
        report.overall.errors
    );
}

#[tokio::test]
async fn open_loop_respects_max_concurrency() {
    let server = mock::MockServer::start().await;
    // 1000/s against ~10 ms responses would put ~10 in flight without the cap.
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "30",
            "--rate",
            "1000",
            "--max-concurrency",
            "2",
            "--output-len",
            "8",
        ],
    )
    .await
    .expect("runs");
    assert_eq!(report.overall.completed, 30, "{:?}", report.overall.errors);
    let max = server.calls.lock().max_generating;
    assert!((1..=2).contains(&max), "{max} generations at once");
    // Queued requests count their wait: latency is from the schedule, so the last requests,
    // due within ~30 ms but served two at a time, show E2E far above one response's time.
    let e2e = &report.overall.e2el_ms;
    assert!(
        e2e.max > 3.0 * e2e.min,
        "min {} ms, max {} ms",
        e2e.min,
        e2e.max
    );
}

#[test]
fn kv_window_follows_mlc_pd_balance_factor() {
    use super::direct::kv_window_end;
    assert_eq!(kv_window_end(100, 0.0), 99, "all but the last token");
    assert_eq!(kv_window_end(100, 0.1), 90, "D prefills the last 10%");
    assert_eq!(kv_window_end(7, 0.5), 3, "int() truncates");
    assert_eq!(kv_window_end(1, 0.0), 0);
    assert_eq!(kv_window_end(1, 0.9), 0);
}

#[tokio::test]
async fn pd_balance_factor_moves_the_window_end() {
    let server = mock::MockServer::start().await;
    let report = run_against(
        &server,
        &[
            "--num-requests",
            "6",
            "--compare-direct",
            "--plan",
            "disagg",
            "--pd-balance-factor",
            "0.25",
            "--input-len",
            "40",
            "--seed",
            "1",
        ],
    )
    .await
    .expect("runs");
    assert_eq!(report.overall.failed, 0, "{:?}", report.overall.errors);
    let calls = server.calls.lock();
    assert!(
        calls.count("/microserving/prep_recv") > 0,
        "seed 1 sends some direct"
    );
    assert!(
        calls.bodies["/microserving/prep_recv"]
            .iter()
            .all(|b| b["end"] == 30)
    );
    assert!(
        calls.bodies["/microserving/remote_send"]
            .iter()
            .all(|b| b["end"] == 30)
    );
    assert!(
        calls.bodies["/microserving/start_generate"]
            .iter()
            .all(|b| b["begin"] == 30)
    );
}

// ---- trace replay -----------------------------------------------------------------------

#[test]
fn summary_weighs_the_prefix_hit_rate_by_tokens() {
    let with_cache = |index, input_tokens, cached| RequestOutcome {
        input_tokens,
        result: ok(index, Arm::Routed, 10, 50, 5).result.map(|t| Timing {
            cached_tokens: cached,
            ..t
        }),
        ..ok(index, Arm::Routed, 10, 50, 5)
    };
    let outcomes = vec![
        with_cache(0, 1000, Some(900)),
        with_cache(1, 3000, Some(100)),
        // Unreported: left out of the rate rather than counted as a miss.
        with_cache(2, 5000, None),
        failed(3, Arm::Routed),
    ];
    let s = Summary::of(&outcomes, Duration::from_secs(2), None);
    assert_eq!(s.prefix_hit_rate, Some(1000.0 / 4000.0));
    let none = Summary::of(&outcomes[2..], Duration::from_secs(2), None);
    assert_eq!(none.prefix_hit_rate, None, "nothing reported");

    let metrics = ReplayMetrics::of(&s, 7, Some(2));
    assert_eq!((metrics.completed, metrics.failed), (3, 1));
    assert_eq!(
        metrics.request_goodput, 1.5,
        "without an SLO every completed request counts"
    );
    assert_eq!(metrics.p50_ttft_ms, 10.0);
    assert_eq!(
        (metrics.replayed_requests, metrics.preemptions),
        (7, Some(2))
    );
    let slo = Some(super::Slo {
        ttft_ms: 5.0,
        tpot_ms: 100.0,
    });
    let strict = Summary::of(&outcomes, Duration::from_secs(2), slo);
    assert_eq!(ReplayMetrics::of(&strict, 7, None).request_goodput, 0.0);
}

#[test]
fn preemptions_come_from_the_routers_counter() {
    let text = "# HELP switchyard_preemptions Generations preempted\n\
                # TYPE switchyard_preemptions counter\n\
                switchyard_preemptions_total{} 0\n\
                switchyard_preemptions_total 12\n\
                switchyard_retries_total 3\n";
    assert_eq!(
        server_metrics::counter(text, server_metrics::PREEMPTIONS),
        Some(12)
    );
    assert_eq!(
        server_metrics::counter("up 1\n", server_metrics::PREEMPTIONS),
        None
    );
    assert_eq!(server_metrics::growth(Some(3), Some(10)), Some(7));
    assert_eq!(server_metrics::growth(Some(10), Some(3)), None, "a restart");
    assert_eq!(server_metrics::growth(None, Some(3)), None);
}

#[test]
fn trace_options_are_checked() {
    let url = ["--url", "http://127.0.0.1:9"];
    let bad: &[&[&str]] = &[
        &["--trace", "t.jsonl", "--rate", "2"],
        &["--trace", "t.jsonl", "--num-requests", "5"],
        &["--trace", "t.jsonl", "--compare-direct"],
        &["--trace", "t.jsonl", "--input-len", "5"],
        &["--speedup", "2"],
        &["--limit", "2"],
        &["--trace", "t.jsonl", "--speedup", "0"],
        &["--trace", "t.jsonl", "--speedup", "nan"],
        &["--trace", "t.jsonl", "--limit", "0"],
        &["--trace", "t.jsonl", "--window", "5..2"],
        &["--trace", "t.jsonl", "--max-input-len", "0"],
        &["--trace", "t.jsonl", "--max-concurrency", "0"],
        &["--arrivals", "gamma:2"],
        &["--rate", "2", "--arrivals", "gamma:0"],
        &["--rate", "2", "--arrivals", "uniform"],
    ];
    for args in bad {
        let mut all = url.to_vec();
        all.extend_from_slice(args);
        assert!(parse(&all).is_err(), "{args:?} should be rejected");
    }
    let config = parse(&[
        "--url",
        "http://127.0.0.1:9",
        "--trace",
        "t.jsonl",
        "--speedup",
        "4",
        "--window",
        "10..",
        "--limit",
        "3",
        "--max-concurrency",
        "2",
    ])
    .expect("valid");
    assert_eq!(config.prompt_format, PromptFormat::Tokens, "ids by default");
    let trace = config.trace.expect("a trace run");
    assert_eq!(trace.replay.speedup, 4.0);
    assert_eq!(trace.replay.window.start_ms, Some(10_000));
    assert_eq!(
        (trace.replay.limit, trace.max_concurrency),
        (Some(3), Some(2))
    );
    let text = parse(&[
        "--url",
        "http://127.0.0.1:9",
        "--trace",
        "t.jsonl",
        "--prompt-format",
        "text",
    ])
    .expect("valid");
    assert_eq!(text.prompt_format, PromptFormat::Text);
    let generated = parse(&["--url", "http://127.0.0.1:9"]).expect("valid");
    assert_eq!(generated.prompt_format, PromptFormat::Text);
    let gamma = parse(&[
        "--url",
        "http://h:1",
        "--rate",
        "2",
        "--arrivals",
        "gamma:1.5",
    ])
    .expect("valid");
    assert!(matches!(
        gamma.load,
        super::LoadShape::Open {
            arrivals: Arrivals::Gamma { cv, .. },
            ..
        } if cv == 1.5
    ));
}

/// Three requests of one prompt (two whole blocks), one short one, one outside `..1`.
const TINY_TRACE: &str = r#"{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]}
{"timestamp": 100, "input_length": 1024, "output_length": 40, "hash_ids": [7, 8]}
{"timestamp": 200, "input_length": 300, "output_length": 3, "hash_ids": [9]}
{"timestamp": 300, "input_length": 1024, "output_length": 2, "hash_ids": [7, 8]}
{"timestamp": 5000, "input_length": 1024, "output_length": 2, "hash_ids": [7, 8]}
"#;

#[tokio::test]
async fn replays_a_trace_and_reports_the_lab_fields() {
    let server = mock::MockServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tiny.jsonl");
    std::fs::write(&path, TINY_TRACE).expect("written");
    let path = path.to_str().expect("utf-8 path");
    let args = [
        "--trace",
        path,
        "--window",
        "..1",
        "--speedup",
        "10",
        "--max-output-len",
        "4",
    ];
    let config = parse(&[&["--url", server.url.as_str()][..], &args[..]].concat()).expect("valid");
    let report = super::execute(&config, indicatif::ProgressBar::hidden())
        .await
        .expect("runs");
    let json = report::to_json(&config, &report);
    assert_eq!(json["completed"], 4, "{}", json["error_counts"]);
    assert_eq!(json["failed"], 0);
    assert_eq!(json["replayed_requests"], 4, "the window leaves 4 of 5");
    let goodput = json["request_goodput"]
        .as_f64()
        .expect("a number without --slo");
    assert!((goodput - 4.0 / report.duration.as_secs_f64()).abs() < 1e-9);
    for key in [
        "mean_ttft_ms",
        "p50_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p99_tpot_ms",
        "mean_e2el_ms",
        "p50_e2el_ms",
        "p99_e2el_ms",
    ] {
        assert!(
            json[key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {}",
            json[key]
        );
    }
    // Whatever order they arrived in, one of the three equal prompts missed and two hit both
    // blocks; the 300-token prompt has no whole block.
    let hit_rate = json["prefix_hit_rate"]
        .as_f64()
        .expect("the mock reports it");
    assert!((hit_rate - 2048.0 / 3372.0).abs() < 1e-12, "{hit_rate}");
    assert_eq!(json["preemptions"], 4, "the mock counts each completion");
    assert_eq!(
        json["total_output_tokens"],
        4 + 4 + 3 + 2,
        "5 and 40 capped to 4"
    );
    let trace = &json["trace"];
    assert_eq!(trace["capped_outputs"], 2);
    assert_eq!(trace["capped_inputs"], 0);
    assert_eq!(trace["summary"]["requests"], 5);
    assert_eq!(trace["replayed"]["requests"], 4);
    assert_eq!(trace["replayed"]["prefix_sharing_ceiling"], 2048.0 / 3372.0);
    assert!(
        json.get("num_prompts").is_none(),
        "no generated-load settings"
    );

    {
        let calls = server.calls.lock();
        let bodies = &calls.bodies["/v1/completions"];
        assert_eq!(bodies.len(), 4);
        let ids = bodies
            .iter()
            .find(|b| b["prompt"].as_array().is_some_and(|p| p.len() == 300))
            .expect("the short prompt went as token ids");
        assert_eq!(ids["max_tokens"], 3);
        let sent: Vec<u8> = ids["prompt"]
            .as_array()
            .expect("ids")
            .iter()
            .filter_map(|id| id.as_u64().map(|id| id as u8))
            .collect();
        assert_eq!(sent, super::trace::tokens::block(9)[..300], "block 9, cut");
        assert!(bodies.iter().all(|b| b["max_tokens"].as_u64() <= Some(4)));
    }

    let mut table = Vec::new();
    report::write_table(&mut table, &config, &report).expect("writes");
    let table = String::from_utf8(table).expect("utf-8");
    for needle in [
        "Trace replay",
        "Requests in trace / replayed:",
        "Prefix hit rate:",
    ] {
        assert!(table.contains(needle), "missing {needle:?} in\n{table}");
    }

    // A second run on the same server counts its own preemptions, not the server's total.
    let again = super::execute(&config, indicatif::ProgressBar::hidden())
        .await
        .expect("runs");
    let again = again.trace.expect("a trace run");
    assert_eq!(again.metrics.preemptions, Some(4));
    let rate = again.metrics.prefix_hit_rate.expect("reported");
    assert!(
        (rate - 3072.0 / 3372.0).abs() < 1e-12,
        "now all cached: {rate}"
    );
}

#[tokio::test]
async fn trace_errors_are_clear() {
    let server = mock::MockServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("t.jsonl");
    std::fs::write(&path, TINY_TRACE).expect("written");
    let path = path.to_str().expect("utf-8 path");
    let run = |extra: &[&str]| {
        let mut args = vec!["--url", server.url.as_str(), "--trace"];
        args.extend_from_slice(extra);
        let config = parse(&args).expect("valid options");
        async move { super::execute(&config, indicatif::ProgressBar::hidden()).await }
    };
    let err = run(&[path, "--window", "6.."])
        .await
        .expect_err("nothing selected");
    assert!(matches!(err, BenchError::Config(_)), "{err}");
    let missing = dir.path().join("missing.jsonl");
    let err = run(&[missing.to_str().expect("utf-8")])
        .await
        .expect_err("no file");
    assert!(matches!(err, BenchError::Trace(_)), "{err}");
    assert!(err.to_string().contains("missing.jsonl"), "{err}");
    assert_eq!(server.calls.lock().count("/v1/completions"), 0);
}

#[derive(Parser)]
struct TraceCli {
    #[command(subcommand)]
    command: super::TraceCommand,
}

#[test]
fn trace_gen_writes_the_same_file_for_the_same_flags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let generate = |name: &str, seed: &str| {
        let out = dir.path().join(name);
        let cli = TraceCli::try_parse_from([
            "trace",
            "gen",
            "--out",
            out.to_str().expect("utf-8"),
            "--num-requests",
            "60",
            "--rate",
            "5",
            "--arrivals",
            "gamma:0.5",
            "--input-len-range",
            "600:900",
            "--shared-prefix-groups",
            "2",
            "--shared-prefix-len",
            "512",
            "--turns",
            "2",
            "--seed",
            seed,
        ])
        .expect("valid flags");
        super::run_trace_command(cli.command).expect("generates");
        std::fs::read(&out).expect("written")
    };
    let (a, b, c) = (generate("a", "1"), generate("b", "1"), generate("c", "2"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    let trace = super::trace::Trace::parse(a.as_slice(), "a").expect("a trace");
    assert_eq!(trace.requests().len(), 60);
    assert!(trace.requests().iter().all(|r| r.input_length >= 600));

    let summary = TraceCli::try_parse_from([
        "trace",
        "summary",
        dir.path().join("a").to_str().expect("utf-8"),
        "--json",
    ])
    .expect("valid flags");
    super::run_trace_command(summary.command).expect("summarises");
    let bad = TraceCli::try_parse_from([
        "trace",
        "gen",
        "--out",
        dir.path().join("d").to_str().expect("utf-8"),
        "--shared-prefix-groups",
        "2",
        "--shared-prefix-len",
        "100",
    ])
    .expect("parses");
    let err = super::run_trace_command(bad.command).expect_err("100 is not whole blocks");
    assert!(matches!(err, BenchError::Synth(_)), "{err}");
    assert!(!dir.path().join("d").exists(), "nothing written");
}
