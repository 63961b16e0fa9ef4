//! Parsing, token expansion, selection, summaries and the synthetic generator.

use std::time::Duration;

use super::tokens::{self, BLOCK_TOKENS};
use super::{
    ReplayOptions, SynthConfig, Trace, TraceError, TraceRequest, TraceSummary, Window, parse_window,
};
use crate::config::LenRange;
use crate::schedule::Arrivals;

fn parse(text: &str) -> Result<Trace, TraceError> {
    Trace::parse(text.as_bytes(), "test.jsonl")
}

fn request(timestamp_ms: u64, input_length: u32, hash_ids: &[u64]) -> String {
    format!(
        r#"{{"timestamp": {timestamp_ms}, "input_length": {input_length}, "output_length": 7, "hash_ids": {hash_ids:?}}}"#
    )
}

/// Requests one second apart, each of its own two blocks, except that all share block 0.
fn evenly_spaced(count: u64) -> Trace {
    let lines: Vec<String> = (0..count)
        .map(|i| request(i * 1000, 1000, &[0, i + 1]))
        .collect();
    parse(&lines.join("\n")).expect("valid")
}

// ---- parsing ----------------------------------------------------------------------------

#[test]
fn parses_mooncake_lines_and_skips_blank_ones() {
    let text = format!(
        "{}\n\n{}\n",
        r#"{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}"#,
        r#"{"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [0], "extra": "ignored"}"#,
    );
    let trace = parse(&text).expect("valid");
    assert_eq!(trace.requests().len(), 2);
    assert_eq!(
        trace.requests()[1],
        TraceRequest {
            timestamp_ms: 3000,
            input_length: 512,
            output_length: 1,
            hash_ids: vec![0],
        }
    );
    let mut written = Vec::new();
    trace.write_jsonl(&mut written).expect("writes");
    let reread = Trace::parse(written.as_slice(), "again").expect("what it writes parses");
    assert_eq!(reread, trace);
    let first = std::str::from_utf8(&written).expect("utf-8").lines().next();
    assert!(
        first.is_some_and(|l| l.starts_with(r#"{"timestamp":0,"input_length":6758,"#)),
        "Mooncake's field names and order: {first:?}"
    );
}

#[test]
fn bad_lines_are_errors_naming_the_line() {
    let good = request(0, 600, &[0, 1]);
    let cases: &[(&str, &str)] = &[
        ("{not json", "column"),
        (
            r#"{"timestamp": 5, "input_length": 10, "output_length": 2}"#,
            "hash_ids",
        ),
        (
            r#"{"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": [0]}"#,
            "column",
        ),
        (
            r#"{"timestamp": 5, "input_length": 0, "output_length": 2, "hash_ids": []}"#,
            "input_length",
        ),
        (
            r#"{"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [0]}"#,
            "output_length",
        ),
        (
            r#"{"timestamp": 5, "input_length": 1025, "output_length": 2, "hash_ids": [0, 1]}"#,
            "needs 3 hash ids",
        ),
        (
            r#"{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [0, 1]}"#,
            "needs 1 hash ids",
        ),
        (
            r#"{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [0.5]}"#,
            "column",
        ),
    ];
    for (bad, says) in cases {
        let text = format!("{good}\n\n{bad}\n{good}");
        match parse(&text) {
            Err(TraceError::Line { line, reason, .. }) => {
                assert_eq!(line, 3, "{bad}: blank lines count");
                assert!(
                    reason.contains(says),
                    "{bad}: {reason:?} should mention {says:?}"
                );
                assert!(
                    !reason.contains("at line"),
                    "no JSON-internal line: {reason}"
                );
            }
            other => panic!("{bad}: expected a line error, got {other:?}"),
        }
    }
    let late = format!("{}\n{}", request(2000, 10, &[0]), request(1000, 10, &[0]));
    let err = parse(&late).expect_err("out of order");
    assert!(
        matches!(&err, TraceError::Line { line: 2, reason, .. } if reason.contains("arrival order")),
        "{err}"
    );
    assert!(err.to_string().starts_with("test.jsonl, line 2: "), "{err}");
    assert!(matches!(parse("\n  \n"), Err(TraceError::Empty { .. })));
    let missing = Trace::read("/nonexistent/trace.jsonl").expect_err("no such file");
    assert!(
        missing.to_string().contains("/nonexistent/trace.jsonl"),
        "{missing}"
    );
}

// ---- token ids --------------------------------------------------------------------------

#[test]
fn blocks_follow_splitmix64_from_the_hash_id() {
    // Vigna's splitmix64 seeded with 1234567 gives 6457827717110365317, 3203168211198807973.
    let block = tokens::block(1_234_567);
    assert_eq!(block[0], 0x20 + (6_457_827_717_110_365_317u64 % 95) as u8);
    assert_eq!(block[1], 0x20 + (3_203_168_211_198_807_973u64 % 95) as u8);
    assert!(block.iter().all(|b| (0x20..=0x7e).contains(b)));
    assert_eq!(tokens::block(7), tokens::block(7), "the id alone decides");
    assert_ne!(tokens::block(7), tokens::block(8));
}

#[test]
fn equal_hash_id_prefixes_are_equal_token_prefixes() {
    let a = TraceRequest {
        timestamp_ms: 0,
        input_length: 1300,
        output_length: 1,
        hash_ids: vec![4, 5, 6],
    };
    let b = TraceRequest {
        input_length: 1100,
        hash_ids: vec![4, 5, 9],
        ..a.clone()
    };
    let c = TraceRequest {
        input_length: 1100,
        hash_ids: vec![5, 4, 9],
        ..a.clone()
    };
    let (ta, tb, tc) = (a.token_ids(), b.token_ids(), c.token_ids());
    assert_eq!((ta.len(), tb.len()), (1300, 1100), "cut at input_length");
    assert_eq!(ta[..2 * BLOCK_TOKENS], tb[..2 * BLOCK_TOKENS]);
    assert_ne!(
        ta[2 * BLOCK_TOKENS..1100],
        tb[2 * BLOCK_TOKENS..1100],
        "the third block differs"
    );
    let shared = |x: &[u32], y: &[u32]| x.iter().zip(y).take_while(|(p, q)| p == q).count();
    assert!(
        shared(&ta, &tc) < BLOCK_TOKENS,
        "same ids, other order: no shared block"
    );
    assert_eq!(
        a.prompt().bytes().map(u32::from).collect::<Vec<_>>(),
        ta,
        "text and ids are the same tokens"
    );
    assert_eq!(a.token_ids(), ta, "deterministic");
}

#[test]
fn caps_keep_the_leading_blocks() {
    let r = TraceRequest {
        timestamp_ms: 9,
        input_length: 1500,
        output_length: 300,
        hash_ids: vec![1, 2, 3],
    };
    let cut = r.capped(Some(600), Some(100));
    assert_eq!((cut.input_length, cut.output_length), (600, 100));
    assert_eq!(cut.hash_ids, vec![1, 2], "600 tokens are two blocks");
    assert_eq!(cut.prompt().as_bytes(), &r.prompt().as_bytes()[..600]);
    assert_eq!(
        r.capped(Some(5000), None),
        r,
        "caps above the lengths change nothing"
    );
}

// ---- selection --------------------------------------------------------------------------

#[test]
fn window_limit_and_speedup_select_and_time_requests() {
    let trace = evenly_spaced(6);
    let at = |options: ReplayOptions| -> Vec<(Duration, u64)> {
        trace
            .replay(&options)
            .requests()
            .iter()
            .map(|r| (r.at, r.request.timestamp_ms))
            .collect()
    };
    let secs = Duration::from_secs;
    assert_eq!(at(ReplayOptions::default()).len(), 6);
    let window = parse_window("1..4").expect("valid");
    assert_eq!(
        at(ReplayOptions {
            window,
            ..ReplayOptions::default()
        }),
        vec![(secs(0), 1000), (secs(1), 2000), (secs(2), 3000)],
        "[start, end), timed from the first selected"
    );
    assert_eq!(
        at(ReplayOptions {
            window,
            limit: Some(2),
            speedup: 2.0,
            ..ReplayOptions::default()
        }),
        vec![(secs(0), 1000), (Duration::from_millis(500), 2000)]
    );
    let open_start = parse_window("..2").expect("valid");
    assert_eq!(
        at(ReplayOptions {
            window: open_start,
            ..ReplayOptions::default()
        })
        .len(),
        2
    );
    let open_end = parse_window("4.5..").expect("valid");
    assert_eq!(
        at(ReplayOptions {
            window: open_end,
            ..ReplayOptions::default()
        }),
        vec![(secs(0), 5000)]
    );
    let late = parse_window("100..200").expect("valid");
    assert!(
        trace
            .replay(&ReplayOptions {
                window: late,
                ..ReplayOptions::default()
            })
            .is_empty()
    );
}

#[test]
fn windows_parse_in_seconds() {
    assert_eq!(
        parse_window("1.5..3"),
        Ok(Window {
            start_ms: Some(1500),
            end_ms: Some(3000)
        })
    );
    assert_eq!(parse_window(".."), Ok(Window::default()));
    for bad in ["3..1", "2..2", "1-3", "a..b", "-1..3", "1..inf"] {
        assert!(parse_window(bad).is_err(), "{bad} should be rejected");
    }
}

#[test]
fn replay_counts_what_the_caps_changed() {
    let text = [
        r#"{"timestamp": 0, "input_length": 2000, "output_length": 50, "hash_ids": [0, 1, 2, 3]}"#,
        r#"{"timestamp": 10, "input_length": 300, "output_length": 500, "hash_ids": [0]}"#,
        r#"{"timestamp": 20, "input_length": 900, "output_length": 900, "hash_ids": [0, 4]}"#,
    ]
    .join("\n");
    let replay = parse(&text).expect("valid").replay(&ReplayOptions {
        max_input_len: Some(1000),
        max_output_len: Some(100),
        ..ReplayOptions::default()
    });
    assert_eq!((replay.capped_inputs(), replay.capped_outputs()), (1, 2));
    let lengths: Vec<(u32, u32)> = replay
        .requests()
        .iter()
        .map(|r| (r.request.input_length, r.request.output_length))
        .collect();
    assert_eq!(lengths, vec![(1000, 50), (300, 100), (900, 100)]);
    assert_eq!(
        replay.summary().total_input_tokens,
        2200,
        "summarised as sent"
    );
}

// ---- summary ----------------------------------------------------------------------------

#[test]
fn ceiling_counts_leading_blocks_seen_before() {
    let requests = vec![
        // Nothing seen yet.
        TraceRequest {
            timestamp_ms: 0,
            input_length: 1024,
            output_length: 10,
            hash_ids: vec![1, 2],
        },
        // Block 1 seen (512 tokens), then a new block: 3 is not counted though seen later.
        TraceRequest {
            timestamp_ms: 1000,
            input_length: 1500,
            output_length: 20,
            hash_ids: vec![1, 3, 2],
        },
        // All seen; the partial last block counts its own 100 tokens.
        TraceRequest {
            timestamp_ms: 4000,
            input_length: 612,
            output_length: 30,
            hash_ids: vec![1, 3],
        },
    ];
    let s = TraceSummary::of(&requests);
    assert_eq!(s.requests, 3);
    assert_eq!(s.duration_s, 4.0);
    assert_eq!(s.request_rate, 0.75);
    assert_eq!(s.total_input_tokens, 3136);
    assert_eq!((s.median_input_len, s.max_input_len), (1024.0, 1500));
    assert_eq!((s.mean_output_len, s.max_output_len), (20.0, 30));
    assert_eq!(s.unique_blocks, 3);
    assert_eq!(s.prefix_sharing_ceiling, (512.0 + 612.0) / 3136.0);
}

#[test]
fn the_vendored_conversation_trace_parses() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/traces/mooncake_conversation_trace.jsonl"
    );
    let trace = Trace::read(path).expect("the vendored trace parses");
    let s = trace.summary();
    assert_eq!(s.requests, 12_031, "as its README says");
    assert!(
        (3500.0..3600.0).contains(&s.duration_s),
        "about an hour: {}",
        s.duration_s
    );
    assert!(
        (0.0..1.0).contains(&s.prefix_sharing_ceiling) && s.prefix_sharing_ceiling > 0.2,
        "conversations share prefixes: {}",
        s.prefix_sharing_ceiling
    );
}

// ---- synthetic traces -------------------------------------------------------------------

fn synth(seed: u64) -> SynthConfig {
    SynthConfig {
        seed,
        requests: 400,
        rate: 5.0,
        arrivals: Arrivals::Poisson,
        input_len: LenRange {
            min: 600,
            max: 1400,
        },
        output_len: LenRange { min: 10, max: 30 },
        prefix_groups: 0,
        prefix_len: 0,
        turns: 1,
        think_time_s: 5.0,
    }
}

fn jsonl(trace: &Trace) -> Vec<u8> {
    let mut out = Vec::new();
    trace.write_jsonl(&mut out).expect("writes");
    out
}

#[test]
fn same_seed_same_bytes() {
    let config = SynthConfig {
        prefix_groups: 3,
        prefix_len: 512,
        turns: 3,
        arrivals: Arrivals::gamma(2.0).expect("valid"),
        ..synth(11)
    };
    let a = jsonl(&Trace::synthetic(&config).expect("valid"));
    let b = jsonl(&Trace::synthetic(&config).expect("valid"));
    assert_eq!(a, b);
    let other = jsonl(&Trace::synthetic(&SynthConfig { seed: 12, ..config }).expect("valid"));
    assert_ne!(a, other);
    let reread = Trace::parse(a.as_slice(), "synthetic").expect("a valid trace");
    assert_eq!(reread.requests().len(), 400);
}

/// Mean and coefficient of variation of the gaps between arrivals, in seconds.
fn gap_stats(trace: &Trace) -> (f64, f64) {
    let times: Vec<f64> = trace
        .requests()
        .iter()
        .map(|r| r.timestamp_ms as f64 / 1e3)
        .collect();
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
    (mean, var.sqrt() / mean)
}

#[test]
fn generated_rates_and_lengths_match_the_config() {
    for (arrivals, cv) in [
        (Arrivals::Poisson, 1.0),
        (Arrivals::gamma(3.0).expect("valid"), 3.0),
        (Arrivals::gamma(0.5).expect("valid"), 0.5),
    ] {
        let config = SynthConfig {
            requests: 20_000,
            rate: 4.0,
            arrivals,
            ..synth(3)
        };
        let trace = Trace::synthetic(&config).expect("valid");
        let (mean_gap, gap_cv) = gap_stats(&trace);
        // 20,000 gaps: the mean's standard error is CV/sqrt(20000) < 2.2% of it even at CV 3.
        assert!(
            (mean_gap * 4.0 - 1.0).abs() < 0.08,
            "{arrivals:?}: mean gap {mean_gap} s at 4 req/s"
        );
        assert!(
            (gap_cv / cv - 1.0).abs() < 0.15,
            "{arrivals:?}: gap CV {gap_cv}, asked {cv}"
        );
        let s = trace.summary();
        assert!(
            (s.mean_input_len - 1000.0).abs() < 15.0,
            "{}",
            s.mean_input_len
        );
        assert!(
            (s.mean_output_len - 20.0).abs() < 0.5,
            "{}",
            s.mean_output_len
        );
        assert!(trace.requests().iter().all(
            |r| (600..=1400).contains(&r.input_length) && (10..=30).contains(&r.output_length)
        ));
        assert_eq!(
            s.prefix_sharing_ceiling, 0.0,
            "one turn, no groups: nothing shared"
        );
    }
}

#[test]
fn groups_share_their_prefix_and_turns_extend_the_last_prompt() {
    // First prompts of at least 1600 tokens hold 3 whole blocks: the group's 2, then one of
    // their own that every later turn of the session keeps at position 2.
    let config = SynthConfig {
        requests: 300,
        prefix_groups: 4,
        prefix_len: 1024,
        input_len: LenRange {
            min: 1600,
            max: 2000,
        },
        turns: 3,
        think_time_s: 2.0,
        ..synth(5)
    };
    let trace = Trace::synthetic(&config).expect("valid");
    let requests = trace.requests();
    assert_eq!(requests.len(), 300);
    let mut seen = std::collections::HashSet::new();
    let mut first_turns = 0;
    for (i, r) in requests.iter().enumerate() {
        let previous_turn = requests[..i]
            .iter()
            .rev()
            .find(|p| p.hash_ids[2] == r.hash_ids[2]);
        let fresh_from = match previous_turn {
            None => {
                // Group g's prefix is blocks 2g and 2g+1.
                first_turns += 1;
                let group = r.hash_ids[0] / 2;
                assert!(
                    group < 4,
                    "request {i} starts with a prefix: {:?}",
                    r.hash_ids
                );
                assert_eq!(r.hash_ids[..2], [2 * group, 2 * group + 1], "request {i}");
                2
            }
            Some(p) => {
                // The previous prompt, its answer and a new message; its whole blocks kept.
                let kept = p.input_length as usize / BLOCK_TOKENS;
                assert!(
                    r.input_length > p.input_length + p.output_length,
                    "request {i}"
                );
                assert_eq!(r.hash_ids[..kept], p.hash_ids[..kept], "request {i}");
                assert!(r.timestamp_ms >= p.timestamp_ms);
                kept
            }
        };
        assert!(
            r.hash_ids[fresh_from..].iter().all(|id| !seen.contains(id)),
            "request {i}: the rest is new"
        );
        seen.extend(r.hash_ids.iter().copied());
    }
    assert_eq!(first_turns, 100, "300 requests of 3 turns: 100 sessions");
    let s = trace.summary();
    assert!(
        s.prefix_sharing_ceiling > 0.4,
        "prefixes and earlier turns repeat: {}",
        s.prefix_sharing_ceiling
    );
}

#[test]
fn bad_synthetic_configs_are_errors() {
    let bad = [
        SynthConfig {
            requests: 0,
            ..synth(0)
        },
        SynthConfig {
            rate: 0.0,
            ..synth(0)
        },
        SynthConfig {
            rate: f64::NAN,
            ..synth(0)
        },
        SynthConfig {
            turns: 0,
            ..synth(0)
        },
        SynthConfig {
            think_time_s: -1.0,
            ..synth(0)
        },
        SynthConfig {
            input_len: LenRange { min: 9, max: 3 },
            ..synth(0)
        },
        SynthConfig {
            prefix_groups: 2,
            ..synth(0)
        },
        SynthConfig {
            prefix_groups: 2,
            prefix_len: 500,
            ..synth(0)
        },
        SynthConfig {
            prefix_groups: 2,
            prefix_len: 1024,
            ..synth(0)
        },
        SynthConfig {
            requests: 1_000_000,
            input_len: LenRange::fixed(1 << 20),
            ..synth(0)
        },
    ];
    for config in bad {
        assert!(
            Trace::synthetic(&config).is_err(),
            "{config:?} should be rejected"
        );
    }
    assert!(Arrivals::gamma(0.0).is_err());
    assert!(Arrivals::gamma(f64::INFINITY).is_err());
}
