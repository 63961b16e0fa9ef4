//! The reference engine as separate processes on loopback: the disaggregated flow yields exactly
//! the tokens of a single engine over both KV transports, preemption and reservation expiry free
//! their pages, protocol violations are 4xx, and golden request/response pairs hold.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_kv::KvAddrInfo;
use switchyard_tests::EngineProcess;

use crate::http::{client, post, post_json, sse_payloads};

/// A decode engine (device rank 1) and a prefill engine (rank 0) that can push KV into it.
struct Pair {
    p: EngineProcess,
    d: EngineProcess,
}

impl Pair {
    fn spawn(transport: &str, extra: &[&str]) -> Pair {
        let mut d_args = vec!["--device-rank", "1", "--kv-transport", transport];
        d_args.extend(extra);
        let d = EngineProcess::spawn(&d_args);
        let peer = format!("1={}", d.kv_addr);
        let mut p_args = vec![
            "--device-rank",
            "0",
            "--kv-transport",
            transport,
            "--kv-peer",
            &peer,
        ];
        p_args.extend(extra);
        let p = EngineProcess::spawn(&p_args);
        Pair { p, d }
    }
}

/// Text and finish reason of a streamed completion.
fn streamed_text(body: &str) -> (String, String) {
    let payloads = sse_payloads(body);
    assert_eq!(
        payloads.last().map(String::as_str),
        Some("[DONE]"),
        "{body}"
    );
    let mut text = String::new();
    let mut finish = String::new();
    for payload in &payloads[..payloads.len() - 1] {
        let chunk: Value = serde_json::from_str(payload).expect("chunk JSON");
        for choice in chunk["choices"].as_array().expect("choices") {
            text.push_str(choice["text"].as_str().expect("text"));
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = reason.to_owned();
            }
        }
    }
    (text, finish)
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

async fn metrics(engine: &EngineProcess) -> String {
    client()
        .get(engine.endpoint("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

/// Polls `/metrics` until `cond` holds on the named metric, for at most 20 s.
async fn wait_for_metric(engine: &EngineProcess, name: &str, cond: impl Fn(f64) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = metrics(engine).await;
        if metric(&text, name).is_some_and(&cond) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} never reached the expected value:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// === token identity ===

struct Case {
    prompt: Vec<u32>,
    end: i64,
    body: Value,
}

/// The model a token-identity run drives, and the cases it gets.
struct Shape {
    /// Engine flags naming the model.
    model: &'static [&'static str],
    cases: usize,
    /// Longest random prompt, and the token ids prompts are drawn from.
    max_prompt: usize,
    ids: std::ops::Range<u32>,
    /// Most ids a shared-prefix prompt adds to the one before it.
    max_extra: usize,
    max_tokens: u32,
    /// At least this many cases must move more than `big_move` positions.
    big_moves: usize,
    big_move: i64,
}

/// The synthetic model: long prompts (many pages and slot runs per transfer).
const SYNTHETIC: Shape = Shape {
    model: &[],
    cases: 30,
    max_prompt: 2000,
    ids: 0..256,
    max_extra: 299,
    max_tokens: 40,
    big_moves: 5,
    big_move: 256,
};

/// SmolLM2 on CPU: short prompts of ordinary ids (past its control tokens) and short outputs,
/// so both engines (one core each) finish in seconds; small pages, so short prompts still
/// share cached prefixes and span several pages.
const SMOLLM2: Shape = Shape {
    model: &["--model", "smollm2", "--threads", "1", "--page-size", "4"],
    cases: 8,
    max_prompt: 64,
    ids: 17..49152,
    max_extra: 24,
    max_tokens: 8,
    big_moves: 2,
    big_move: 8,
};

/// Random prompts, balance windows, sampling settings, and repeated or shared-prefix prompts
/// so prefix-cache hits occur.
fn cases(seed: u64, shape: &Shape) -> Vec<Case> {
    let n = shape.cases;
    let ids = || shape.ids.clone();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut previous: Vec<Vec<u32>> = Vec::new();
    (0..n)
        .map(|_| {
            let prompt: Vec<u32> = match (rng.random_range(0..4), previous.last()) {
                (0, Some(p)) => p.clone(),
                (1, Some(p)) => {
                    let keep = rng.random_range(1..=p.len());
                    let extra = rng.random_range(1..=shape.max_extra);
                    p[..keep].iter().copied().chain((0..extra).map(|_| rng.random_range(ids()))).collect()
                }
                _ => {
                    let len = if rng.random_bool(0.2) { rng.random_range(1..8) } else { rng.random_range(1..=shape.max_prompt) };
                    (0..len).map(|_| rng.random_range(ids())).collect()
                }
            };
            previous.push(prompt.clone());
            let len = prompt.len() as f64;
            let end = if rng.random_bool(0.4) { -1 } else { ((1.0 - rng.random_range(0.01..1.0)) * len) as i64 };
            let mut body = json!({"model": null, "prompt": prompt, "max_tokens": rng.random_range(1..shape.max_tokens),
                "n": 1, "stream": false, "debug_config": {}});
            if rng.random_bool(0.5) {
                body["temperature"] = json!(rng.random_range(0.3..1.5));
                body["top_p"] = json!(rng.random_range(0.5..1.0));
                body["seed"] = json!(rng.random_range(0..1000));
            }
            Case { prompt, end, body }
        })
        .collect()
}

/// MLC's disaggregated sequence against a pair; returns the streamed text and finish reason,
/// and how many positions remote_send moved.
async fn disaggregated(pair: &Pair, case: &Case, id: &str) -> ((String, String), i64) {
    let mut body = case.body.clone();
    body["user"] = json!(id);
    body["end"] = json!(case.end);
    let prep = post_json(&pair.d.endpoint("/microserving/prep_recv"), &body).await;
    let matched = prep["prefix_matched_length"]
        .as_i64()
        .expect("prefix_matched_length");
    let len = case.prompt.len() as i64;
    let end = if case.end < 0 {
        len + case.end
    } else {
        case.end
    };
    assert!((0..=end).contains(&matched), "matched {matched}, end {end}");
    if matched < end {
        let mut send = case.body.clone();
        send["user"] = json!(id);
        send["begin"] = json!(matched);
        send["end"] = json!(end);
        send["kv_addr_info"] = prep["kv_append_metadata"].clone();
        send["recv_rank"] = json!(pair.d.device_rank);
        assert_eq!(
            post_json(&pair.p.endpoint("/microserving/remote_send"), &send).await,
            json!({})
        );
    }
    let mut start = case.body.clone();
    start["user"] = json!(id);
    start["begin"] = json!(end);
    start["stream"] = json!(true);
    let (status, text) = post(&pair.d.endpoint("/microserving/start_generate"), &start).await;
    assert_eq!(status, 200, "{text}");
    (streamed_text(&text), end - matched)
}

async fn token_identity(transport: &str, extra: &[&str], seed: u64, shape: &Shape) {
    let mut args = vec!["--prefix-cache"];
    args.extend(extra);
    args.extend(shape.model);
    let pair = Pair::spawn(transport, &args);
    let mut moved = Vec::new();
    for (i, case) in cases(seed, shape).iter().enumerate() {
        // The single-engine baseline runs on P: on D it would fill D's prefix cache with the
        // very prompt, and the disaggregated run would then move almost nothing.
        let alone = post_json(&pair.p.endpoint("/v1/completions"), &case.body).await;
        let expected = (
            alone["choices"][0]["text"]
                .as_str()
                .expect("text")
                .to_owned(),
            alone["choices"][0]["finish_reason"]
                .as_str()
                .expect("finish_reason")
                .to_owned(),
        );
        let id = format!("cmpl-{seed:016x}{i:016x}");
        let (got, positions) = disaggregated(&pair, case, &id).await;
        moved.push(positions);
        assert_eq!(
            got,
            expected,
            "case {i}: {} tokens, end {}",
            case.prompt.len(),
            case.end
        );
    }
    // Multi-page, multi-run transfers were exercised, not only prefix-cache hits.
    assert!(
        moved.iter().filter(|&&n| n > shape.big_move).count() >= shape.big_moves,
        "positions moved per case: {moved:?}"
    );
    let d = metrics(&pair.d).await;
    assert!(
        metric(&d, "switchyard_engine_prefix_matched_tokens_total").unwrap_or(0.0) > 0.0,
        "{d}"
    );
    let p = metrics(&pair.p).await;
    assert!(
        metric(&p, "switchyard_engine_remote_send_received_total").unwrap_or(0.0) > 0.0,
        "{p}"
    );
}

#[tokio::test]
async fn disaggregated_tokens_match_a_single_engine_over_tcp() {
    token_identity("tcp", &[], 0x7cb, &SYNTHETIC).await;
}

#[tokio::test]
async fn disaggregated_tokens_match_a_single_engine_over_shm() {
    token_identity("shm", &[], 0x5e3, &SYNTHETIC).await;
}

/// The real model (SmolLM2-135M, `make model`): the logits D computes from the K/V P pushed are
/// the bits P would have computed itself, so greedy and seeded runs give the same tokens.
#[tokio::test]
async fn real_model_disaggregated_tokens_match_a_single_engine_over_tcp() {
    token_identity("tcp", &[], 0x51a, &SMOLLM2).await;
}

#[tokio::test]
async fn real_model_disaggregated_tokens_match_a_single_engine_over_shm() {
    token_identity("shm", &[], 0x5a0, &SMOLLM2).await;
}

/// Both engines keep their KV pool on GPU 0 and P pushes into D's over CUDA IPC. Needs a build
/// with `--features switchyard/cuda` and a GPU; otherwise reported skipped by name.
#[tokio::test]
async fn disaggregated_tokens_match_a_single_engine_over_cuda() {
    if let Err(e) = switchyard_kv::cuda_probe(0) {
        // Uncaptured, so the skip shows in the run's output.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIPPED disaggregated_tokens_match_a_single_engine_over_cuda: {e}"
        );
        return;
    }
    token_identity("cuda", &["--kv-device", "cuda:0"], 0xc0d, &SYNTHETIC).await;
}

/// `logprobs: true` answers one entry per generated token (MLC's shape), streamed or not, with
/// or without the ids; `--ignore-return-token-ids` drops the ids as MLC's engines do (they do
/// not know the field), which is what a router's no-ids continuation is tested against.
#[tokio::test]
async fn logprobs_count_every_generated_token_and_ids_can_be_ignored_as_mlc_does() {
    for (flags, ids) in [(&[][..], true), (&["--ignore-return-token-ids"][..], false)] {
        let engine = EngineProcess::spawn(flags);
        let url = engine.endpoint("/v1/completions");
        let body = json!({"prompt": "logprobs", "max_tokens": 12, "logprobs": true,
            "return_token_ids": true});
        let answer = post_json(&url, &body).await;
        let choice = &answer["choices"][0];
        let entries = choice["logprobs"]["content"].as_array().expect("entries");
        assert_eq!(
            entries.len() as u64,
            answer["usage"]["completion_tokens"]
                .as_u64()
                .expect("usage"),
            "{answer}"
        );
        assert!(
            entries
                .iter()
                .all(|e| e["logprob"].as_f64().is_some_and(|l| l <= 0.0))
        );
        let spelled: String = entries
            .iter()
            .map(|e| e["token"].as_str().expect("token"))
            .collect();
        assert_eq!(
            choice["text"],
            spelled.as_str(),
            "the entries spell the text"
        );
        assert_eq!(choice.get("token_ids").is_some(), ids, "{answer}");

        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (status, text) = post(&url, &streamed).await;
        assert_eq!(status, 200);
        let mut counted = 0;
        for payload in sse_payloads(&text).iter().filter(|p| *p != "[DONE]") {
            let chunk: Value = serde_json::from_str(payload).expect("chunk");
            let choice = &chunk["choices"][0];
            let n = choice["logprobs"]["content"].as_array().map_or(0, Vec::len);
            if ids {
                let sent = choice["token_ids"].as_array().map(Vec::len);
                assert_eq!(sent, Some(n), "{chunk}");
            } else {
                assert!(choice.get("token_ids").is_none(), "{chunk}");
            }
            counted += n;
        }
        assert_eq!(
            counted,
            entries.len(),
            "the stream counts as the answer does"
        );
    }
}

#[tokio::test]
async fn a_wrong_slot_changes_the_output() {
    // Decoding on D with KV for the wrong positions must not silently give the right tokens:
    // push prompt[0:end) KV shifted by one slot (one position short, one slot too late).
    let pair = Pair::spawn("tcp", &[]);
    let prompt: Vec<u32> = (0..64).map(|i| (i * 37 % 95 + 32) as u32).collect();
    let body = json!({"prompt": prompt, "max_tokens": 16});
    let alone = post_json(&pair.d.endpoint("/v1/completions"), &body).await;
    let mut prep = body.clone();
    prep["user"] = json!("cmpl-shifted");
    prep["end"] = json!(-1);
    let meta = post_json(&pair.d.endpoint("/microserving/prep_recv"), &prep).await;
    let mut send = body.clone();
    send["begin"] = json!(0);
    send["end"] = json!(62);
    send["recv_rank"] = json!(1);
    // Positions 0..62 go one slot late: into the reservation's slots 1..=62.
    let meta = meta["kv_append_metadata"].as_str().expect("metadata");
    let reserved = KvAddrInfo::decode(meta).expect("valid metadata");
    send["kv_addr_info"] = json!(KvAddrInfo::from_slots(reserved.slots().skip(1)).encode());
    assert_eq!(
        post_json(&pair.p.endpoint("/microserving/remote_send"), &send).await,
        json!({})
    );
    let mut start = body.clone();
    start["user"] = json!("cmpl-shifted");
    start["begin"] = json!(63);
    let shifted = post_json(&pair.d.endpoint("/microserving/start_generate"), &start).await;
    assert_ne!(shifted["choices"][0]["text"], alone["choices"][0]["text"]);
}

// === preemption, expiry, violations ===

#[tokio::test]
async fn kv_pressure_preempts_the_last_request_and_frees_its_pages() {
    // 20 pages of 16. Three requests for one prompt whose greedy run takes all 200 tokens
    // (50 + 200 positions: 16 pages at the end) first reserve their prompts with prep_recv (4
    // pages each). Whichever order and pace the engine then runs them in, the first to grow
    // finds at most 12 pages: pressure does not depend on timing. Once two are gone the last
    // has 16 free pages, so at least one finishes.
    let d = EngineProcess::spawn(&["--kv-pages", "20"]);
    let prompt: Vec<u32> = (0..50).map(|j| ((50 + j) % 95 + 32) as u32).collect();
    let bodies: Vec<Value> = (0..3)
        .map(|i| {
            json!({"prompt": prompt, "max_tokens": 200, "stream": true,
                "user": format!("cmpl-pressure-{i}"), "debug_config": {}})
        })
        .collect();
    for body in &bodies {
        let mut prep = body.clone();
        prep["end"] = json!(-1);
        post_json(&d.endpoint("/microserving/prep_recv"), &prep).await;
    }
    let text = metrics(&d).await;
    assert_eq!(
        metric(&text, "switchyard_engine_kv_pages_used"),
        Some(12.0),
        "{text}"
    );
    let starts = bodies.iter().map(|body| {
        let mut start = body.clone();
        // D computes the whole prompt itself (nothing was pushed).
        start["begin"] = json!(0);
        let url = d.endpoint("/microserving/start_generate");
        async move { post(&url, &start).await }
    });
    let outcomes: Vec<(String, String)> = futures_join_all(starts)
        .await
        .into_iter()
        .map(|(status, body)| {
            assert_eq!(status, 200, "{body}");
            streamed_text(&body)
        })
        .collect();
    let preempted: Vec<_> = outcomes.iter().filter(|o| o.1 == "preempt").collect();
    assert!(!preempted.is_empty(), "{outcomes:?}");
    assert!(outcomes.iter().any(|o| o.1 == "length"), "{outcomes:?}");
    wait_for_metric(&d, "switchyard_engine_kv_pages_used", |v| v == 0.0).await;
    let text = metrics(&d).await;
    assert_eq!(
        metric(&text, "switchyard_engine_preemptions_total"),
        Some(preempted.len() as f64)
    );
}

async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}

#[tokio::test]
async fn a_reservation_without_start_generate_expires() {
    // The TTL must exceed the transfer bound; a few seconds leave ample time for the one read
    // below, which the engine's gauges answer as of the reply.
    let d = EngineProcess::spawn(&[
        "--reservation-ttl-ms",
        "3000",
        "--kv-transfer-timeout-ms",
        "1000",
    ]);
    let body =
        json!({"prompt": vec![65; 100], "user": "cmpl-abandoned", "end": -1, "debug_config": {}});
    post_json(&d.endpoint("/microserving/prep_recv"), &body).await;
    // 100 - 1 positions = 7 pages of 16, held until the TTL passes.
    let text = metrics(&d).await;
    assert_eq!(
        metric(&text, "switchyard_engine_kv_pages_used"),
        Some(7.0),
        "{text}"
    );
    wait_for_metric(&d, "switchyard_engine_reservations_expired_total", |v| {
        v == 1.0
    })
    .await;
    wait_for_metric(&d, "switchyard_engine_kv_pages_used", |v| v == 0.0).await;
    // start_generate for the expired reservation is now a protocol violation.
    let mut start = body.clone();
    start["begin"] = json!(99);
    assert_eq!(
        post(&d.endpoint("/microserving/start_generate"), &start)
            .await
            .0,
        400
    );
}

#[tokio::test]
async fn protocol_violations_are_4xx_and_the_engine_stays_up() {
    let d = EngineProcess::spawn(&[]);
    let base = json!({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "debug_config": {}, "user": "cmpl-v"});
    let with = |fields: Value| {
        let mut b = base.clone();
        for (k, v) in fields.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    let violations = [
        ("/microserving/prep_recv", with(json!({"end": 8}))),
        ("/microserving/prep_recv", with(json!({"end": -9}))),
        ("/microserving/prep_recv", with(json!({}))),
        (
            "/microserving/remote_send",
            with(json!({"begin": 3, "end": 3, "kv_addr_info": "AwAAAAAAAABbMF0=", "recv_rank": 0})),
        ),
        (
            "/microserving/remote_send",
            with(json!({"begin": 0, "end": 8, "kv_addr_info": "AwAAAAAAAABbMF0=", "recv_rank": 0})),
        ),
        (
            "/microserving/remote_send",
            with(
                json!({"begin": 0, "end": 5, "kv_addr_info": "CwAAAAAAAABbMSw0MDk2LDYzXQ==", "recv_rank": 0}),
            ),
        ),
        (
            "/microserving/remote_send",
            with(json!({"begin": 0, "end": 5, "kv_addr_info": "not base64!", "recv_rank": 0})),
        ),
        ("/microserving/start_generate", with(json!({"begin": 2}))),
        ("/v1/completions", json!({"prompt": []})),
        ("/v1/completions", json!({"prompt": [1, 999]})),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0})),
        ("/v1/completions", json!({"prompt": "x", "n": 2})),
        ("/v1/completions", json!({"max_tokens": 3})),
    ];
    for (path, body) in &violations {
        let (status, text) = post(&d.endpoint(path), body).await;
        assert_eq!(status, 400, "{path} {body} -> {text}");
        let error: Value = serde_json::from_str(&text).expect("error JSON");
        assert!(
            error["error"]["message"].is_string() && error["error"]["type"].is_string(),
            "{text}"
        );
    }
    let (status, _) = post_raw(&d.endpoint("/v1/completions"), "{not json").await;
    assert_eq!(status, 400);

    // Duplicate id in flight: a conflict with the engine's state.
    post_json(
        &d.endpoint("/microserving/prep_recv"),
        &with(json!({"end": -1})),
    )
    .await;
    let (status, text) = post(
        &d.endpoint("/microserving/prep_recv"),
        &with(json!({"end": -1})),
    )
    .await;
    assert_eq!(status, 409, "{text}");
    let error: Value = serde_json::from_str(&text).expect("error JSON");
    assert_eq!(error["error"]["param"], "user", "{text}");
    // begin past the prepared window.
    assert_eq!(
        post(
            &d.endpoint("/microserving/start_generate"),
            &with(json!({"begin": 9}))
        )
        .await
        .0,
        400
    );
    // The engine is up and the reservation still works.
    let (status, text) = post(
        &d.endpoint("/microserving/start_generate"),
        &with(json!({"begin": 7})),
    )
    .await;
    assert_eq!(status, 200, "{text}");
}

/// A bad command line exits with clap's usage code (2), as `serve` and `up` do, before any port
/// is bound: a value clap refuses, and a combination only the engine can check.
#[test]
fn bad_engine_flags_exit_with_the_usage_code() {
    let cases: [&[&str]; 2] = [
        &["--port", "0", "--max-batch", "0"],
        &[
            "--port",
            "0",
            "--reservation-ttl-ms",
            "1000",
            "--kv-transfer-timeout-ms",
            "2000",
        ],
    ];
    for flags in cases {
        let out = std::process::Command::new(switchyard_tests::switchyard_bin())
            .arg("engine")
            .args(flags)
            .output()
            .expect("switchyard runs");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{flags:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

async fn post_raw(url: &str, body: &'static str) -> (u16, String) {
    let response = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("engine reachable");
    (
        response.status().as_u16(),
        response.text().await.expect("body"),
    )
}

// === golden fixtures ===

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/microserving")
}

/// `expected` matches `actual` when objects have the same keys, arrays the same length, and
/// every leaf is equal, except the type patterns `"<string>"`, `"<int>"`, `"<bool>"`, `"<any>"`.
fn matches_shape(expected: &Value, actual: &Value, path: &str) -> Result<(), String> {
    match (expected, actual) {
        (Value::String(p), _) if p == "<any>" => Ok(()),
        (Value::String(p), Value::String(_)) if p == "<string>" => Ok(()),
        (Value::String(p), Value::Number(n)) if p == "<int>" && n.is_i64() => Ok(()),
        (Value::String(p), Value::Bool(_)) if p == "<bool>" => Ok(()),
        (Value::Object(e), Value::Object(a)) => {
            let (ek, ak): (Vec<_>, Vec<_>) = (e.keys().collect(), a.keys().collect());
            if ek != ak {
                return Err(format!("{path}: keys {ak:?}, expected {ek:?}"));
            }
            e.iter()
                .try_for_each(|(k, v)| matches_shape(v, &a[k], &format!("{path}.{k}")))
        }
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => e
            .iter()
            .zip(a)
            .enumerate()
            .try_for_each(|(i, (e, a))| matches_shape(e, a, &format!("{path}[{i}]"))),
        _ if expected == actual => Ok(()),
        _ => Err(format!("{path}: got {actual}, expected {expected}")),
    }
}

#[tokio::test]
async fn golden_fixtures_hold() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 4,
        "fixtures missing in {}",
        fixtures_dir().display()
    );
    for file in files {
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("read"))
            .expect("fixture JSON");
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Each fixture gets a fresh engine, so slot ids in kv_append_metadata are predictable.
        let engine = EngineProcess::spawn(&[]);
        for (i, step) in fixture["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .enumerate()
        {
            let path = step["path"].as_str().expect("path");
            let (status, text) = match step["method"].as_str() {
                Some("GET") => {
                    let r = client()
                        .get(engine.endpoint(path))
                        .send()
                        .await
                        .expect("GET");
                    (r.status().as_u16(), r.text().await.expect("text"))
                }
                _ => post(&engine.endpoint(path), &step["request"]).await,
            };
            let context = format!("{name} step {i} ({path})");
            assert_eq!(
                Some(u64::from(status)),
                step["status"].as_u64(),
                "{context}: {text}"
            );
            let actual = if step.get("sse").is_some() {
                Value::Array(
                    sse_payloads(&text)
                        .into_iter()
                        .map(|p| serde_json::from_str(&p).unwrap_or(Value::String(p)))
                        .collect(),
                )
            } else {
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{context}: {e}: {text}"))
            };
            let expected = step.get("sse").unwrap_or(&step["response"]);
            if let Err(e) = matches_shape(expected, &actual, "$") {
                panic!("{context}: {e}\nfull response: {actual}");
            }
        }
    }
}

#[test]
fn shape_matcher_rejects_mismatches() {
    let expected = json!({"a": "<int>", "b": ["<string>", 1]});
    assert!(matches_shape(&expected, &json!({"a": 3, "b": ["x", 1]}), "$").is_ok());
    assert!(matches_shape(&expected, &json!({"a": "3", "b": ["x", 1]}), "$").is_err());
    assert!(matches_shape(&expected, &json!({"a": 3, "b": ["x", 2]}), "$").is_err());
    assert!(matches_shape(&expected, &json!({"a": 3, "b": ["x"]}), "$").is_err());
    assert!(matches_shape(&expected, &json!({"a": 3, "b": ["x", 1], "c": null}), "$").is_err());
}
