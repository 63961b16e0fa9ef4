//! The policy lab against the real thing: one short trace replayed by `switchyard bench
//! --trace` on `switchyard up` (reference engines on the `llama3-8b-h100` profile, stretched so
//! that modelled time dwarfs the cost of loopback HTTP on a busy machine) and simulated by
//! `switchyard lab` with the same engines, profile, scale and policies. The simulation must rank
//! the policies as the real run does, and put each one's TTFT and end-to-end medians within
//! ±35% of the real ones.

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;
use switchyard_tests::{RouterProcess, plugins_dir, switchyard_bin};

/// Policies compared: round-robin spreads whole requests over the three engines; disagg
/// prefills every prompt on the one prefill engine, where they queue.
const POLICIES: [&str; 2] = ["round-robin", "disagg"];
/// Every modelled time ×2 (the engines' `--time-scale`, the lab's too).
const TIME_SCALE: &str = "2";
/// How far the simulated medians may be from the real ones.
const TOLERANCE: f64 = 0.35;

/// A seeded trace: 16 requests of 1500 to 2500 tokens at 4 per second (with the scale, a
/// prefill engine busy about 80% of the time when it serves them all), 8 to 24 tokens out.
fn write_trace(dir: &Path) -> std::path::PathBuf {
    let trace = dir.join("trace.jsonl");
    let status = Command::new(switchyard_bin())
        .args([
            "trace",
            "gen",
            "--num-requests",
            "16",
            "--rate",
            "4",
            "--seed",
            "3",
        ])
        .args([
            "--input-len-range",
            "1500:2500",
            "--output-len-range",
            "8:24",
            "--out",
        ])
        .arg(&trace)
        .stdout(Stdio::null())
        .status()
        .expect("switchyard trace gen runs");
    assert!(status.success());
    trace
}

/// `switchyard bench --trace` against `switchyard up` planning with `policy`: its JSON.
fn real(policy: &str, trace: &Path, dir: &Path) -> Value {
    let engine_args = [
        "--engine-arg=--profile=llama3-8b-h100".to_owned(),
        format!("--engine-arg=--time-scale={TIME_SCALE}"),
    ];
    let mut args = vec![
        "--prefill",
        "1",
        "--decode",
        "2",
        "--prefix-cache",
        "--policy",
        policy,
    ];
    args.extend(engine_args.iter().map(String::as_str));
    let router = RouterProcess::up(&args);
    let json = dir.join(format!("real-{policy}.json"));
    let status = Command::new(switchyard_bin())
        .args([
            "bench",
            "--url",
            &router.url,
            "--request-timeout",
            "60",
            "--trace",
        ])
        .arg(trace)
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::null())
        .status()
        .expect("switchyard bench runs");
    assert!(status.success(), "switchyard bench failed");
    serde_json::from_slice(&std::fs::read(&json).expect("bench JSON")).expect("JSON")
}

/// `switchyard lab` on the same cluster (`up`'s engines: 2048 pages, the small KV shape) with
/// every policy: its JSON.
fn simulated(trace: &Path, dir: &Path) -> Value {
    let json = dir.join("lab.json");
    let plugins = plugins_dir();
    let mut lab = Command::new(switchyard_bin());
    lab.args(["lab", "--trace"])
        .arg(trace)
        .arg("--plugins")
        .arg(&plugins)
        .args(["--prefill", "1", "--decode", "2", "--protocol", "mlc"])
        .args(["--profile", "llama3-8b-h100", "--time-scale", TIME_SCALE])
        .args(["--model-shape", "small", "--kv-pages", "2048", "--json"])
        .arg(&json);
    for policy in POLICIES {
        lab.args(["--policy", policy]);
    }
    let status = lab
        .stdout(Stdio::null())
        .status()
        .expect("switchyard lab runs");
    assert!(status.success(), "switchyard lab failed");
    serde_json::from_slice(&std::fs::read(&json).expect("lab JSON")).expect("JSON")
}

#[test]
fn the_lab_ranks_policies_as_the_real_cluster_does_with_medians_within_35_percent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = write_trace(dir.path());
    let sim = simulated(&trace, dir.path());
    let mut ttft = Vec::new();
    for policy in POLICIES {
        let real = real(policy, &trace, dir.path());
        let simulated = &sim["policies"][policy];
        assert_eq!(real["failed"], 0, "{policy}: {real}");
        assert_eq!(simulated["failed"], 0, "{policy}: {simulated}");
        for metric in ["p50_ttft_ms", "p50_e2el_ms"] {
            let (r, s) = (
                real[metric].as_f64().expect("a real median"),
                simulated[metric].as_f64().expect("a simulated median"),
            );
            let error = (s - r) / r;
            eprintln!(
                "{policy} {metric}: real {r:.1} ms, simulated {s:.1} ms ({:+.1}%)",
                error * 100.0
            );
            assert!(
                error.abs() <= TOLERANCE,
                "{policy} {metric}: simulated {s:.1} ms is {:+.1}% off the real {r:.1} ms",
                error * 100.0
            );
        }
        ttft.push((
            real["p50_ttft_ms"].as_f64().expect("a real median"),
            simulated["p50_ttft_ms"]
                .as_f64()
                .expect("a simulated median"),
        ));
    }
    // Whether the first policy answers first, on the real cluster and in the lab.
    assert_eq!(
        ttft[0].0 < ttft[1].0,
        ttft[0].1 < ttft[1].1,
        "the lab ranks {POLICIES:?} by median TTFT otherwise than the real run: {ttft:?}"
    );
}
