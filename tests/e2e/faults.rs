//! Faults, as separate processes on loopback under steady streaming load: engines killed
//! (SIGKILL) and restarted, frozen (SIGSTOP) and thawed, answering 500 to everything, refusing
//! requests they cannot hold with 400; every engine failing at once (the retry budget); and
//! 1,000 clients hanging up at random points of the disaggregated flow.
//!
//! What the router promises, and each test checks: no request fails before its first byte
//! while an engine that can serve it is up; every stream equals a single engine's output or
//! ends with an error event then `[DONE]`; failing endpoints are ejected (never for a client's
//! 4xx) and readmitted; retries stay within the budget; and once the last response has ended,
//! every engine's running requests, KV pages and reservations are back at their idle baseline,
//! with no reservation freed by its TTL.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};
use tokio::time::Instant;

use crate::http::{client, post, sse_payloads};
use crate::router::{disagg_over, eventually, metric, post_or_get, prompts, reference};

/// A single engine's answer for every prompt the load sends.
pub(crate) struct Truth {
    prompts: Vec<(String, u32)>,
    answers: HashMap<(String, u32), String>,
}

impl Truth {
    pub(crate) async fn new(seed: u64, n: usize) -> Truth {
        let engine = EngineProcess::spawn(&[]);
        let prompts = prompts(seed, n);
        let mut answers = HashMap::new();
        for (prompt, max_tokens) in &prompts {
            let (text, _) = reference(&engine, prompt, *max_tokens).await;
            answers.insert((prompt.clone(), *max_tokens), text);
        }
        Truth { prompts, answers }
    }

    /// A random prompt of the set: its text, `max_tokens`, and the single engine's answer.
    pub(crate) fn sample(&self, rng: &mut StdRng) -> (&str, u32, &str) {
        let (prompt, max_tokens) = &self.prompts[rng.random_range(0..self.prompts.len())];
        let answer = &self.answers[&(prompt.clone(), *max_tokens)];
        (prompt, *max_tokens, answer)
    }
}

/// How the streams of a load ended.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// The whole text, equal to the single engine's.
    pub(crate) exact: u32,
    /// Text then an error event then `[DONE]`: the router could not continue.
    pub(crate) error_events: u32,
    /// What went wrong in the others: a wrong text, a cut stream, or no 200.
    pub(crate) wrong: Vec<String>,
}

/// Clients sending prompts through a router until stopped.
pub(crate) struct Load {
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    clients: Vec<tokio::task::JoinHandle<()>>,
}

/// Requests one load client sends at most: the loops end by themselves.
const MAX_REQUESTS_PER_CLIENT: usize = 2_000;

/// How a load's clients ask: streamed, or for the whole answer at once.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Answer {
    Streamed,
    Whole,
}

impl Load {
    /// `clients` clients streaming completions from the router (or load balancer) at `base`.
    pub(crate) fn start(base: &str, truth: &Arc<Truth>, clients: u64) -> Load {
        Self::start_asking(base, truth, clients, Answer::Streamed)
    }

    /// [`Load::start`], with each answer asked for as `answer` says.
    pub(crate) fn start_asking(
        base: &str,
        truth: &Arc<Truth>,
        clients: u64,
        answer: Answer,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let url = format!("{base}/v1/completions");
        let clients = (0..clients)
            .map(|seed| {
                let (stop, tally, truth, url) =
                    (stop.clone(), tally.clone(), truth.clone(), url.clone());
                tokio::spawn(async move {
                    let mut rng = StdRng::seed_from_u64(seed);
                    for _ in 0..MAX_REQUESTS_PER_CLIENT {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        let (prompt, max_tokens, expected) = truth.sample(&mut rng);
                        let ended = match answer {
                            Answer::Streamed => {
                                stream_one(&url, prompt, max_tokens, expected).await
                            }
                            Answer::Whole => post_one(&url, prompt, max_tokens, expected).await,
                        };
                        let mut t = tally.lock();
                        match ended {
                            Ok(true) => t.exact += 1,
                            Ok(false) => t.error_events += 1,
                            Err(wrong) => t.wrong.push(wrong),
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            tally,
            clients,
        }
    }

    /// Stop sending, wait for the streams in flight to end, and say how they all ended.
    pub(crate) async fn stop(self) -> Tally {
        self.stop.store(true, Ordering::Release);
        for client in self.clients {
            tokio::time::timeout(Duration::from_secs(60), client)
                .await
                .expect("every stream ends")
                .expect("no load client panicked");
        }
        std::mem::take(&mut *self.tally.lock())
    }

    /// Streams ended so far.
    fn ended(&self) -> u32 {
        let t = self.tally.lock();
        t.exact + t.error_events + t.wrong.len() as u32
    }
}

/// Stream one completion: `Ok(true)` for the expected text, `Ok(false)` for text then an
/// error event then `[DONE]`, `Err` for anything else.
pub(crate) async fn stream_one(
    url: &str,
    prompt: &str,
    max_tokens: u32,
    expected: &str,
) -> Result<bool, String> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    let response = client()
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("{prompt:?}: no answer: {e}"))?;
    let status = response.status();
    let text = response
        .text()
        .await
        .map_err(|e| format!("{prompt:?}: the stream broke: {e}"))?;
    if status != 200 {
        return Err(format!(
            "{prompt:?}: failed before its first byte: {status} {text}"
        ));
    }
    let payloads = sse_payloads(&text);
    if payloads.last().map(String::as_str) != Some("[DONE]") {
        return Err(format!("{prompt:?}: no [DONE]: {text}"));
    }
    let mut streamed = String::new();
    for p in &payloads[..payloads.len() - 1] {
        let chunk: Value = serde_json::from_str(p).map_err(|e| format!("{p}: {e}"))?;
        if chunk.get("error").is_some() {
            return if p == &payloads[payloads.len() - 2] {
                Ok(false)
            } else {
                Err(format!("{prompt:?}: an error event before the end: {text}"))
            };
        }
        streamed.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
    }
    if streamed == expected {
        Ok(true)
    } else {
        Err(format!(
            "{prompt:?}: got {streamed:?}, a single engine says {expected:?}"
        ))
    }
}

/// Ask for one whole completion: `Ok(true)` for the expected text, `Err` for anything else.
pub(crate) async fn post_one(
    url: &str,
    prompt: &str,
    max_tokens: u32,
    expected: &str,
) -> Result<bool, String> {
    let (status, text) = post(url, &json!({"prompt": prompt, "max_tokens": max_tokens})).await;
    let answer: Option<Value> = serde_json::from_str(&text).ok();
    match answer
        .as_ref()
        .and_then(|a| a["choices"][0]["text"].as_str())
    {
        Some(got) if status == 200 && got == expected => Ok(true),
        _ => Err(format!("{prompt:?}: {status} {text}")),
    }
}

/// Waits until the load has ended `n` more streams (bounded), so each fault lands on a load
/// that is really running.
pub(crate) async fn let_run(load: &Load, n: u32) {
    let target = load.ended() + n;
    eventually(Duration::from_secs(60), || async {
        let ended = load.ended();
        (ended < target).then(|| format!("{ended} of {target} streams ended"))
    })
    .await;
}

/// Every engine's idle baseline: nothing running or waiting, no KV page in use, no
/// reservation, and no reservation ever freed by its TTL. Polls for at most 30 s and returns
/// how long it took.
pub(crate) async fn assert_engines_idle(engines: &[&EngineProcess]) -> Duration {
    let took = wait_engines_idle(engines).await;
    for (i, engine) in engines.iter().enumerate() {
        let expired = reservations_expired(engine).await;
        assert_eq!(expired, 0.0, "engine {i} freed a reservation by its TTL");
    }
    took
}

/// Reservations `engine` freed because no `start_generate` came for them within its TTL.
pub(crate) async fn reservations_expired(engine: &EngineProcess) -> f64 {
    metric(
        &engine.endpoint("/metrics"),
        "switchyard_engine_reservations_expired",
    )
    .await
}

/// Waits (at most 30 s) until every engine has nothing running or waiting, no KV page in use
/// and no reservation; returns how long it took.
pub(crate) async fn wait_engines_idle(engines: &[&EngineProcess]) -> Duration {
    let started = Instant::now();
    eventually(Duration::from_secs(30), || async {
        for (i, engine) in engines.iter().enumerate() {
            let m = engine.endpoint("/metrics");
            for gauge in [
                "switchyard_engine_running_requests",
                "switchyard_engine_waiting_requests",
                "switchyard_engine_kv_pages_used",
                "switchyard_engine_reservations",
            ] {
                let value = metric(&m, gauge).await;
                if value != 0.0 {
                    let all = client().get(&m).send().await.ok()?.text().await.ok()?;
                    return Some(format!("engine {i}: {gauge} = {value}\n{all}"));
                }
            }
        }
        None
    })
    .await;
    started.elapsed()
}

/// `/admin/endpoints`' row for endpoint `id`.
pub(crate) async fn endpoint_row(router: &RouterProcess, id: usize) -> Value {
    post_or_get(&router.endpoint("/admin/endpoints")).await["endpoints"][id].clone()
}

pub(crate) async fn wait_health(router: &RouterProcess, id: usize, healthy: bool) {
    eventually(Duration::from_secs(30), || async {
        let row = endpoint_row(router, id).await;
        (row["healthy"] != healthy).then(|| format!("endpoint {id}: {row}"))
    })
    .await;
}

impl Tally {
    /// Print how the streams of `what` ended, and fail if any went wrong.
    pub(crate) fn report(&self, what: &str) {
        eprintln!(
            "{what}: {} streams exact, {} ended with an error event",
            self.exact, self.error_events
        );
        assert!(
            self.wrong.is_empty(),
            "{} of {} streams went wrong, first: {:?}",
            self.wrong.len(),
            self.exact + self.error_events + self.wrong.len() as u32,
            self.wrong.first()
        );
    }
}

/// A decode step of ~1.6 ms (the Llama-3-8B profile at 0.3): streams last long enough for
/// faults to land in them.
pub(crate) const SLOW: [&str; 4] = ["--profile", "llama3-8b-h100", "--time-scale", "0.3"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_engines_lose_no_request_and_come_back() {
    let truth = Arc::new(Truth::new(21, 24).await);
    let mut c = disagg_over("tcp", &[&[], &[]], &SLOW, &[]);
    let load = Load::start(&c.router.url, &truth, 4);
    // P, a decode engine, both in turn, again and again: 13 kills.
    let rounds: [&[usize]; 9] = [
        &[0],
        &[1],
        &[0, 2],
        &[2],
        &[0],
        &[0, 1],
        &[1],
        &[2],
        &[0, 2],
    ];
    let mut kills = 0;
    for victims in rounds {
        let_run(&load, 4).await;
        for &v in victims {
            c.engines[v].kill();
            kills += 1;
        }
        for &v in victims {
            // Refused connections and broken streams take it out of routing.
            wait_health(&c.router, v, false).await;
        }
        let_run(&load, 4).await;
        for &v in victims {
            c.engines[v].restart();
        }
        for &v in victims {
            wait_health(&c.router, v, true).await;
        }
    }
    let_run(&load, 4).await;
    let tally = load.stop().await;
    tally.report(&format!("{kills} kills"));
    let retried = metric(&c.router.endpoint("/metrics"), "switchyard_retries").await;
    eprintln!("{retried} attempts retried or continued after an engine failure");
    assert!(kills >= 10);
    assert!(retried > 0.0, "the kills landed on requests in flight");
    assert!(tally.exact > 0);
    let engines: Vec<&EngineProcess> = c.engines.iter().collect();
    let took = assert_engines_idle(&engines).await;
    eprintln!("engines idle {took:?} after the last response");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_decode_engine_is_routed_around_and_readmitted() {
    let truth = Arc::new(Truth::new(22, 24).await);
    // Real decode steps (~5 ms): streams of up to 200 ms, several on each decode engine.
    let c = disagg_over(
        "tcp",
        &[&[], &[]],
        &["--profile", "llama3-8b-h100"],
        &[
            "--stream-idle-timeout",
            "1s",
            "--call-timeout",
            "30s",
            "--outlier-failures",
            "2",
        ],
    );
    let load = Load::start(&c.router.url, &truth, 8);
    let_run(&load, 8).await;
    // Freeze it while it serves several streams: each stalls, and two failures in a row
    // eject it.
    eventually(Duration::from_secs(30), || async {
        let in_flight = endpoint_row(&c.router, 1).await["in_flight"].as_u64();
        (in_flight < Some(3)).then(|| format!("{in_flight:?} legs in flight on it"))
    })
    .await;
    c.engines[1].freeze();
    // Its streams stall: after the idle timeout each continues elsewhere, and the failures
    // (or its probe) take it out of routing.
    wait_health(&c.router, 1, false).await;
    let_run(&load, 12).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    c.engines[1].thaw();
    wait_health(&c.router, 1, true).await;
    let_run(&load, 12).await;
    let tally = load.stop().await;
    tally.report("frozen 10 s");
    let row = endpoint_row(&c.router, 1).await;
    assert!(
        row["outlier"]["ejections"].as_u64() >= Some(1),
        "stalled streams ejected it: {row}"
    );
    let engines: Vec<&EngineProcess> = c.engines.iter().collect();
    let took = assert_engines_idle(&engines).await;
    eprintln!("engines idle {took:?} after the last response");
}

/// The router's `switchyard_endpoint_health` for endpoint `id`.
async fn health_metric(router: &RouterProcess, id: usize) -> f64 {
    let name = format!("switchyard_endpoint_health{{endpoint=\"{id}\"");
    metric(&router.endpoint("/metrics"), &name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failing_with_500_is_ejected_and_one_refusing_bad_requests_is_not() {
    let truth = Arc::new(Truth::new(23, 8).await);
    // Decode endpoint 1 answers 500 to everything; endpoint 2 is sound. An ejection lasts
    // longer than the test, so every failure the engine counts is one before it.
    let c = disagg_over(
        "tcp",
        &[&["--fail-rate", "1"], &[]],
        &[],
        &["--outlier-base-ejection", "30s"],
    );
    let url = c.router.endpoint("/v1/completions");
    for (prompt, max_tokens) in truth.prompts.iter().cycle().take(16) {
        let expected = &truth.answers[&(prompt.clone(), *max_tokens)];
        assert_eq!(
            stream_one(&url, prompt, *max_tokens, expected).await,
            Ok(true)
        );
    }
    let failed = metric(
        &c.engines[1].endpoint("/metrics"),
        "switchyard_engine_injected_failures",
    )
    .await;
    assert!(
        (1.0..=3.0).contains(&failed),
        "ejected after 3 failures, got {failed}"
    );
    let row = endpoint_row(&c.router, 1).await;
    assert_eq!(row["health"], "ejected", "{row}");
    assert_eq!(row["outlier"]["ejections"], 1, "{row}");
    assert!(
        row["outlier"]["last_failure"]
            .as_str()
            .is_some_and(|f| f.contains("500")),
        "{row}"
    );
    assert_eq!(health_metric(&c.router, 1).await, -1.0);
    assert_eq!(health_metric(&c.router, 2).await, 1.0);

    // A decode engine whose KV pool cannot hold long prompts refuses them with 400: the
    // client hears 400, and the engine is never blamed for it.
    let small = disagg_over(
        "tcp",
        &[&["--kv-pages", "4", "--page-size", "16"]],
        &[],
        &[],
    );
    let url = small.router.endpoint("/v1/completions");
    let long = "x".repeat(200);
    for _ in 0..10 {
        let (status, text) = post(&url, &json!({"prompt": long, "max_tokens": 4})).await;
        assert_eq!(status, 400, "{text}");
    }
    let (prompt, max_tokens) = &truth.prompts[0];
    let expected = &truth.answers[&(prompt.clone(), *max_tokens)];
    assert_eq!(
        stream_one(&url, prompt, *max_tokens, expected).await,
        Ok(true)
    );
    let row = endpoint_row(&small.router, 1).await;
    assert_eq!(row["health"], "healthy", "{row}");
    assert_eq!(row["outlier"]["ejections"], 0, "{row}");
    assert_eq!(row["outlier"]["consecutive_failures"], 0, "{row}");
    assert_engines_idle(&[&c.engines[0], &c.engines[2]]).await;
    let small_engines: Vec<&EngineProcess> = small.engines.iter().collect();
    assert_engines_idle(&small_engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_engine_failing_retries_stay_within_the_budget() {
    let engines: Vec<EngineProcess> = (0..2)
        .map(|_| EngineProcess::spawn(&["--fail-rate", "1"]))
        .collect();
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    // Ejection off, so only the budget holds retries back; 5 attempts a request without it.
    let router = RouterProcess::serve(
        &urls,
        &[
            "--policy",
            "round-robin",
            "--outlier-failures",
            "0",
            "--max-attempts",
            "5",
            "--retry-budget-ratio",
            "0.2",
            "--retry-budget-min-per-sec",
            "1",
        ],
    );
    let url = router.endpoint("/v1/completions");
    const REQUESTS: usize = 100;
    let answers = futures::future::join_all((0..10).map(|_| {
        let url = url.clone();
        async move {
            let mut statuses = Vec::new();
            for _ in 0..REQUESTS / 10 {
                let started = Instant::now();
                let (status, text) =
                    post(&url, &json!({"prompt": "all down", "max_tokens": 4})).await;
                let body: Value = serde_json::from_str(&text).expect("an OpenAI error body");
                assert!(body["error"]["message"].is_string(), "{body}");
                statuses.push((status, started.elapsed()));
            }
            statuses
        }
    }))
    .await;
    let answers: Vec<(u16, Duration)> = answers.into_iter().flatten().collect();
    assert!(
        answers.iter().all(|(status, _)| *status >= 500),
        "{answers:?}"
    );
    let slowest = answers.iter().map(|(_, took)| *took).max();
    eprintln!("{REQUESTS} requests, all failing; the slowest answered in {slowest:?}");
    let mut calls = 0.0;
    for engine in &engines {
        calls += metric(
            &engine.endpoint("/metrics"),
            "switchyard_engine_calls_received",
        )
        .await;
    }
    // First attempts, plus at most the floor (1/s over the 10 s window) and 20% of requests.
    let budget = REQUESTS as f64 + 10.0 + 0.2 * REQUESTS as f64;
    eprintln!("engines saw {calls} calls for {REQUESTS} requests (budget {budget})");
    assert!(
        (REQUESTS as f64..=budget).contains(&calls),
        "{calls} calls reached the engines"
    );
    let refused = metric(
        &router.endpoint("/metrics"),
        "switchyard_requests_total{route=\"/v1/completions\",status=\"503\"}",
    )
    .await;
    assert!(refused > 0.0, "some requests found the budget spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_hanging_up_at_random_points_leak_no_kv() {
    let c = disagg_over("tcp", &[&[], &[]], &SLOW, &[]);
    let url = c.router.endpoint("/v1/completions");
    let prompts = prompts(24, 32);
    const CLIENTS: u64 = 16;
    const HANG_UPS: usize = 1_000;
    let started = Instant::now();
    futures::future::join_all((0..CLIENTS).map(|seed| {
        let (url, prompts) = (url.clone(), prompts.clone());
        async move {
            let mut rng = StdRng::seed_from_u64(seed);
            for _ in 0..HANG_UPS / CLIENTS as usize {
                let (prompt, max_tokens) = &prompts[rng.random_range(0..prompts.len())];
                let stream = rng.random_bool(0.5);
                let body =
                    json!({"prompt": prompt, "max_tokens": max_tokens + 20, "stream": stream});
                // 0-40 ms: during prep_recv, remote_send (prefill and transfer), the first
                // tokens, or after the end.
                let patience = Duration::from_micros(rng.random_range(0..40_000));
                let request = async {
                    let response = client().post(&url).json(&body).send().await?;
                    response.bytes().await
                };
                let _ = tokio::time::timeout(patience, request).await;
            }
        }
    }))
    .await;
    eprintln!("{HANG_UPS} hang-ups in {:?}", started.elapsed());
    let engines: Vec<&EngineProcess> = c.engines.iter().collect();
    let took = assert_engines_idle(&engines).await;
    eprintln!("engines idle {took:?} after the last hang-up");
    let aborted_on_p = metric(
        &c.engines[0].endpoint("/metrics"),
        "switchyard_engine_requests_aborted",
    )
    .await;
    eprintln!("P aborted {aborted_on_p} prefills whose remote_send was cancelled");
    eventually(Duration::from_secs(10), || async {
        let rows = post_or_get(&c.router.endpoint("/admin/endpoints")).await;
        let busy: Vec<Value> = rows["endpoints"]
            .as_array()
            .expect("list")
            .iter()
            .filter(|e| e["in_flight"] != 0 || e["pending_prefill"] != 0)
            .cloned()
            .collect();
        (!busy.is_empty()).then(|| format!("router in flight or pending prefill: {busy:?}"))
    })
    .await;
}
