//! vLLM's and SGLang's handoffs end to end, every engine and the router a separate process on
//! loopback: the router's answers equal a single engine's, and once the last response has
//! ended nothing is held on any engine (no lease, no room, no reservation), whatever ended the
//! requests: legs failing on either side, clients hanging up, a decode engine killed mid-stream.
//!
//! The engines keep the books that prove it (`host/engine/src/metrics.rs`): vLLM mode counts
//! leases issued, pulled, released and expired, SGLang mode rooms transferred, orphaned and
//! cancelled, and both count protocol violations, among them a reused `X-Request-Id` or room,
//! so none after retries proves every attempt got fresh ones. Each test prints how long the
//! engines took to get back to their baseline after the last response.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use futures::future::join_all;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess, free_port};
use tokio::time::Instant;

use crate::http::{client, sse_payloads};
use crate::router::{eventually, metric, post_or_get};

/// The longest any one request of these tests may take: past it, the router hung.
const REQUEST_BOUND: Duration = Duration::from_secs(30);

/// The longest the engines may take to get back to their baseline after the last response.
const SETTLE_BOUND: Duration = Duration::from_secs(30);

/// A vLLM lease short enough that a leaked one expires well within [`SETTLE_BOUND`].
const SHORT_LEASE: &str = "--kv-lease-ms=3000";

/// An SGLang bootstrap timeout short enough that an orphaned leg shows within
/// [`SETTLE_BOUND`], long enough that nothing legitimate hits it.
const SHORT_BOOTSTRAP_TIMEOUT: &str = "--bootstrap-timeout-ms=20000";

/// A real decode step (~5 ms), so generations last long enough to be interrupted.
const SLOW: [&str; 2] = ["--profile", "llama3-8b-h100"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Vllm,
    Sglang,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }

    /// The gauges that count what an engine holds for a handoff, and its idle baseline: no KV
    /// page in use, nothing running or waiting.
    fn held(self) -> &'static [&'static str] {
        match self {
            Protocol::Vllm => &[
                "switchyard_engine_vllm_leases_held",
                "switchyard_engine_reservations",
                "switchyard_engine_kv_pages_used",
                "switchyard_engine_running_requests",
                "switchyard_engine_waiting_requests",
            ],
            Protocol::Sglang => &[
                "switchyard_engine_sglang_rooms_pending",
                "switchyard_engine_sglang_registrations",
                "switchyard_engine_reservations",
                "switchyard_engine_kv_pages_used",
                "switchyard_engine_running_requests",
                "switchyard_engine_waiting_requests",
            ],
        }
    }

    /// The flag that makes a leftover show within the test: a short lease, a short bootstrap
    /// timeout.
    fn short_bound(self) -> &'static str {
        match self {
            Protocol::Vllm => SHORT_LEASE,
            Protocol::Sglang => SHORT_BOOTSTRAP_TIMEOUT,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Prefill,
    Decode,
}

// === requests and answers ===

/// Seeded random bodies: half completions, half chats, prompts of random words (some of them
/// multi-byte or JSON-ish) and printable bytes, `max_tokens` in 1..=24.
fn bodies(seed: u64, n: usize) -> Vec<Value> {
    const WORDS: [&str; 16] = [
        "kv",
        "cache",
        "prefill",
        "decode",
        "lease",
        "room",
        "bootstrap",
        "nixl",
        "page",
        "token",
        "café",
        "字节",
        "🙂",
        "{\"a\":1}",
        "\\n",
        "  ",
    ];
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let len = rng.random_range(1..40);
            let mut text: Vec<String> = (0..len)
                .map(|_| WORDS[rng.random_range(0..WORDS.len())].to_owned())
                .collect();
            let bytes: String = (0..rng.random_range(0..8))
                .map(|_| char::from(rng.random_range(b' '..=b'~')))
                .collect();
            text.push(bytes);
            let text = text.join(" ");
            let max_tokens = rng.random_range(1..=24u32);
            if i % 2 == 0 {
                json!({"prompt": text, "max_tokens": max_tokens})
            } else if rng.random_bool(0.5) {
                json!({
                    "messages": [
                        {"role": "system", "content": "Answer in kind."},
                        {"role": "user", "content": text},
                    ],
                    "max_tokens": max_tokens,
                })
            } else {
                json!({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
            }
        })
        .collect()
}

/// `body` asking to be streamed (with a usage chunk), or not.
fn streamed(body: &Value, stream: bool) -> Value {
    let mut body = body.clone();
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// The route a body is for.
fn path_of(body: &Value) -> &'static str {
    match body.get("messages") {
        Some(_) => "/v1/chat/completions",
        None => "/v1/completions",
    }
}

fn is_stream(body: &Value) -> bool {
    body["stream"] == json!(true)
}

/// A whole answer.
#[derive(Debug, Clone)]
struct Said {
    text: String,
    finish: Value,
    /// `Null` for a stream the engine sent no usage chunk for.
    usage: Value,
}

/// How a request ended.
#[derive(Debug)]
enum Ended {
    Whole(Said),
    /// An OpenAI-style error: a non-200 answer with an `error` object, or a stream whose last
    /// event before `[DONE]` is one.
    Error(String),
}

/// The choice's text at this point of an answer (`None` where a chunk has none).
fn choice_text(choice: &Value, chat: bool, stream: bool) -> Option<&str> {
    match (chat, stream) {
        (false, _) => choice["text"].as_str(),
        (true, false) => choice["message"]["content"].as_str(),
        (true, true) => choice["delta"]["content"].as_str(),
    }
}

/// POST `body` to `base` (its route from the body) and read the whole answer, bounded by
/// [`REQUEST_BOUND`]. `Err` says how the answer broke the contract: no answer in time, a
/// transport error, a body that is neither an answer nor an OpenAI error, a stream without
/// `[DONE]` or with an error event anywhere but last.
async fn ask(base: &str, body: &Value) -> Result<Ended, String> {
    let url = format!("{base}{}", path_of(body));
    tokio::time::timeout(REQUEST_BOUND, ask_unbounded(&url, body))
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {REQUEST_BOUND:?}")))
        .map_err(|e| format!("POST {url} {body}: {e}"))
}

async fn ask_unbounded(url: &str, body: &Value) -> Result<Ended, String> {
    let response = client()
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| format!("no answer: {e}"))?;
    let status = response.status().as_u16();
    let text = response
        .text()
        .await
        .map_err(|e| format!("{status}: the body broke off: {e}"))?;
    if status != 200 {
        return openai_error(&text).map(|m| Ended::Error(format!("{status} {m}")));
    }
    let chat = body.get("messages").is_some();
    if !is_stream(body) {
        let answer: Value =
            serde_json::from_str(&text).map_err(|e| format!("200 but not JSON ({e}): {text}"))?;
        let choice = &answer["choices"][0];
        let said = choice_text(choice, chat, false)
            .map(|t| Said {
                text: t.to_owned(),
                finish: choice["finish_reason"].clone(),
                usage: answer["usage"].clone(),
            })
            .ok_or_else(|| format!("200 without a text: {answer}"))?;
        return Ok(Ended::Whole(said));
    }
    sse_ended(&text, chat)
}

/// The message of an OpenAI-style error body, or why it is none.
fn openai_error(text: &str) -> Result<String, String> {
    let error: Value = serde_json::from_str(text)
        .map_err(|e| format!("an error that is not JSON ({e}): {text}"))?;
    error["error"]["message"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("an error without error.message: {text}"))
}

/// [`ask`], expecting a whole answer.
async fn said(base: &str, body: &Value) -> Said {
    match ask(base, body).await {
        Ok(Ended::Whole(said)) => said,
        other => panic!("POST {base} {body}: {other:?}"),
    }
}

/// What a single engine says to every body (non-streamed): the ground truth.
async fn truths(engine: &EngineProcess, bodies: &[Value]) -> Vec<Said> {
    let mut truths = Vec::with_capacity(bodies.len());
    for body in bodies {
        truths.push(said(&engine.url, &streamed(body, false)).await);
    }
    truths
}

/// How a batch of requests through faults ended.
#[derive(Debug, Default)]
struct Tally {
    /// Whole answers equal to a single engine's.
    whole: u32,
    /// OpenAI-style errors, first few kept.
    errors: u32,
    error_samples: Vec<String>,
}

impl Tally {
    /// Count `ended`; panics on a broken contract or an answer unlike the single engine's.
    fn add(&mut self, body: &Value, ended: Result<Ended, String>, truth: &Said) {
        match ended {
            Ok(Ended::Whole(said)) => {
                assert_eq!(
                    said.text, truth.text,
                    "{body}: not the single engine's text"
                );
                self.whole += 1;
            }
            Ok(Ended::Error(message)) => {
                self.errors += 1;
                if self.error_samples.len() < 3 {
                    self.error_samples.push(message);
                }
            }
            Err(broken) => panic!("{broken}"),
        }
    }
}

// === clusters ===

/// A prefill engine and decode engines of one protocol behind `switchyard serve`, KV moving
/// over tcp (wired as `switchyard up` wires its engines: every decode engine is a KV peer of
/// the prefill engine).
struct Pd {
    p: EngineProcess,
    ds: Vec<EngineProcess>,
    router: RouterProcess,
}

impl Pd {
    fn start(
        protocol: Protocol,
        p_args: &[&str],
        d_args: &[&str],
        decodes: u32,
        router_args: &[&str],
    ) -> Pd {
        let transport = |rank: u32| -> Vec<String> {
            [
                "--protocol",
                protocol.name(),
                "--device-rank",
                &rank.to_string(),
                "--kv-transport",
                "tcp",
                "--kv-listen",
                "tcp:127.0.0.1:0",
            ]
            .map(str::to_owned)
            .to_vec()
        };
        let spawn = |args: Vec<String>| {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            EngineProcess::spawn(&refs)
        };
        let ds: Vec<EngineProcess> = (1..=decodes)
            .map(|rank| {
                let mut args = transport(rank);
                if protocol == Protocol::Sglang {
                    args.extend(["--disaggregation-mode".into(), "decode".into()]);
                }
                args.extend(d_args.iter().map(|a| (*a).to_owned()));
                spawn(args)
            })
            .collect();
        let mut args = transport(0);
        for d in &ds {
            args.push("--kv-peer".into());
            args.push(format!("{}={}", d.device_rank, d.kv_addr));
        }
        let bootstrap = free_port();
        if protocol == Protocol::Sglang {
            args.extend(
                ["--disaggregation-mode", "prefill", "--bootstrap-port"].map(str::to_owned),
            );
            args.push(bootstrap.to_string());
        }
        args.extend(p_args.iter().map(|a| (*a).to_owned()));
        let p = spawn(args);
        let mut endpoints = vec![match protocol {
            Protocol::Vllm => format!("vllm+{},role=prefill", p.url),
            Protocol::Sglang => format!("sglang+{},role=prefill,bootstrap_port={bootstrap}", p.url),
        }];
        endpoints.extend(
            ds.iter()
                .map(|d| format!("{}+{},role=decode", protocol.name(), d.url)),
        );
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        let router = RouterProcess::serve(&endpoints, router_args);
        Pd { p, ds, router }
    }
}

/// Every endpoint of `router` (`/admin/endpoints`): its role and URL.
async fn endpoints(router: &RouterProcess) -> Vec<(String, String)> {
    let listed = post_or_get(&router.endpoint("/admin/endpoints")).await;
    listed["endpoints"]
        .as_array()
        .expect("a list of endpoints")
        .iter()
        .map(|e| {
            let field = |name: &str| e[name].as_str().expect("role and url").to_owned();
            (field("role"), field("url"))
        })
        .collect()
}

/// The router's in-flight count per endpoint.
async fn in_flight(router: &RouterProcess) -> Vec<u64> {
    let listed = post_or_get(&router.endpoint("/admin/endpoints")).await;
    listed["endpoints"]
        .as_array()
        .expect("a list of endpoints")
        .iter()
        .map(|e| e["in_flight"].as_u64().expect("in_flight"))
        .collect()
}

// === engine books ===

/// One scrape of an engine's `/metrics`: every sample, and each metric summed over its label
/// sets.
struct Scrape {
    url: String,
    sums: HashMap<String, f64>,
    text: String,
}

impl Scrape {
    async fn of(url: &str) -> Result<Scrape, String> {
        let text = client()
            .get(format!("{url}/metrics"))
            .send()
            .await
            .map_err(|e| format!("{url}/metrics: {e}"))?
            .text()
            .await
            .map_err(|e| format!("{url}/metrics: {e}"))?;
        let mut sums = HashMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((sample, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let name = sample.split('{').next().unwrap_or_default();
            *sums.entry(name.to_owned()).or_insert(0.0) += value;
        }
        Ok(Scrape {
            url: url.to_owned(),
            sums,
            text,
        })
    }

    /// `name` summed over its label sets; the engine must export it.
    fn get(&self, name: &str) -> f64 {
        *self
            .sums
            .get(name)
            .unwrap_or_else(|| panic!("{} exports no {name}:\n{}", self.url, self.text))
    }
}

/// Every engine's books once they hold nothing.
struct Books {
    scrapes: Vec<Scrape>,
}

impl Books {
    /// `name` summed over every engine.
    fn total(&self, name: &str) -> f64 {
        self.scrapes.iter().map(|s| s.get(name)).sum()
    }

    /// `name` on the engine at `url`.
    fn at(&self, url: &str, name: &str) -> f64 {
        self.scrapes
            .iter()
            .find(|s| s.url == url)
            .unwrap_or_else(|| panic!("no books for {url}"))
            .get(name)
    }

    /// No engine counted a protocol violation (a reused request id or room among them), and
    /// none freed a reservation by its TTL rather than at once.
    fn assert_no_violations(&self, protocol: Protocol) {
        let name = format!("switchyard_engine_{protocol}_protocol_violations_total");
        for s in &self.scrapes {
            assert_eq!(s.get(&name), 0.0, "{}: violations\n{}", s.url, s.text);
            let expired = s.get("switchyard_engine_reservations_expired_total");
            assert_eq!(
                expired, 0.0,
                "{}: reservations freed by their TTL\n{}",
                s.url, s.text
            );
        }
    }

    /// vLLM: every lease issued was pulled, released or expired, and none is held.
    fn assert_leases_accounted(&self) -> Leases {
        let leases = Leases {
            issued: self.total("switchyard_engine_vllm_leases_issued_total"),
            pulled: self.total("switchyard_engine_vllm_leases_pulled_total"),
            released: self.total("switchyard_engine_vllm_leases_released_total"),
            expired: self.total("switchyard_engine_vllm_leases_expired_total"),
            failed: self.total("switchyard_engine_vllm_pull_failures_total"),
        };
        assert_eq!(
            leases.issued,
            leases.pulled + leases.failed + leases.released + leases.expired,
            "every lease issued is pulled (or taken by a failed pull), released or expired: {leases:?}"
        );
        leases
    }

    /// SGLang: no leg waited out its bootstrap timeout for a partner that never came.
    fn assert_no_orphans(&self) {
        for s in &self.scrapes {
            assert_eq!(
                s.get("switchyard_engine_sglang_orphans_total"),
                0.0,
                "{}: an orphaned leg\n{}",
                s.url,
                s.text
            );
        }
    }
}

/// A vLLM cluster's lease counters, summed over its engines.
#[derive(Debug)]
struct Leases {
    issued: f64,
    pulled: f64,
    /// Taken by a pull that failed (the lease is freed with it).
    failed: f64,
    released: f64,
    expired: f64,
}

/// Polls (bounded by [`SETTLE_BOUND`]) every engine at `urls` until none holds anything for a
/// handoff, prints how long that took after the last response, and returns their books.
async fn settle(protocol: Protocol, urls: &[String], what: &str) -> Books {
    let started = Instant::now();
    eventually(SETTLE_BOUND, || async {
        for url in urls {
            let scrape = match Scrape::of(url).await {
                Ok(scrape) => scrape,
                Err(e) => return Some(e),
            };
            for gauge in protocol.held() {
                let value = scrape.get(gauge);
                if value != 0.0 {
                    return Some(format!("{url}: {gauge} = {value}\n{}", scrape.text));
                }
            }
        }
        None
    })
    .await;
    let took = started.elapsed();
    eprintln!(
        "{protocol} {what}: every engine back to its baseline {took:?} after the last response"
    );
    let mut scrapes = Vec::new();
    for url in urls {
        scrapes.push(Scrape::of(url).await.expect("the engine answers /metrics"));
    }
    Books { scrapes }
}

/// Every engine URL `router` lists, but those in `gone`.
async fn engine_urls(router: &RouterProcess, gone: &[&str]) -> Vec<String> {
    endpoints(router)
        .await
        .into_iter()
        .map(|(_, url)| url)
        .filter(|url| !gone.contains(&url.as_str()))
        .collect()
}

// === 1, 2: output equality through `switchyard up`, and nothing held afterwards ===

/// Seeded random completions and chats, streamed and not, through `switchyard up --protocol
/// X --prefill 1 --decode 1` equal a single engine's (text, finish reason, usage); afterwards
/// every engine holds nothing, and the books say each request was one clean handoff.
async fn up_output_equals_a_single_engine(protocol: Protocol, seed: u64) {
    let truth = EngineProcess::spawn(&["--protocol", protocol.name()]);
    let up = RouterProcess::up(&[
        "--protocol",
        protocol.name(),
        "--prefill",
        "1",
        "--decode",
        "1",
    ]);
    let mut handoffs = 0.0;
    for body in bodies(seed, 8) {
        for stream in [false, true] {
            let body = streamed(&body, stream);
            let expected = said(&truth.url, &body).await;
            let got = said(&up.url, &body).await;
            handoffs += 1.0;
            assert_eq!(got.text, expected.text, "{protocol}: {body}");
            assert_eq!(got.finish, expected.finish, "{protocol}: {body}");
            for count in ["prompt_tokens", "completion_tokens"] {
                assert_eq!(
                    got.usage[count], expected.usage[count],
                    "{protocol} {count}: {body}: {:?} vs {:?}",
                    got.usage, expected.usage
                );
            }
            assert!(got.usage["completion_tokens"].is_u64(), "{body}: {got:?}");
        }
    }
    let roles: Vec<String> = endpoints(&up).await.into_iter().map(|(r, _)| r).collect();
    assert_eq!(roles, ["prefill", "decode"]);
    let urls = engine_urls(&up, &[]).await;
    let books = settle(protocol, &urls, "after 32 answers").await;
    books.assert_no_violations(protocol);
    let retries = metric(&up.endpoint("/metrics"), "switchyard_retries").await;
    assert_eq!(retries, 0.0, "no attempt failed");
    match protocol {
        Protocol::Vllm => {
            let leases = books.assert_leases_accounted();
            assert_eq!(leases.issued, handoffs, "one lease per request: {leases:?}");
            assert_eq!(leases.pulled, handoffs, "each pulled: {leases:?}");
            for counter in [
                "switchyard_engine_vllm_pull_failures_total",
                "switchyard_engine_vllm_kv_load_failures_total",
            ] {
                assert_eq!(books.total(counter), 0.0, "{counter}");
            }
        }
        Protocol::Sglang => {
            let transferred = books.total("switchyard_engine_sglang_rooms_transferred_total");
            assert_eq!(transferred, handoffs, "one room transferred per request");
            books.assert_no_orphans();
            for counter in [
                "switchyard_engine_sglang_cancelled_total",
                "switchyard_engine_sglang_transfer_failures_total",
            ] {
                assert_eq!(books.total(counter), 0.0, "{counter}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_up_output_equals_a_single_engine_and_nothing_is_held() {
    up_output_equals_a_single_engine(Protocol::Vllm, 11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_up_output_equals_a_single_engine_and_nothing_is_held() {
    up_output_equals_a_single_engine(Protocol::Sglang, 12).await;
}

// === 3a: failing legs ===

/// `--fail-rate 0.5` on one side's engine: 20 requests at once, streamed and not, each get the
/// single engine's answer or an OpenAI-style error within the bound; afterwards nothing is
/// held, no engine counted a violation (fresh ids and rooms on every retry), every vLLM lease
/// is accounted for, and no SGLang leg was left to time out.
async fn failing_legs(protocol: Protocol, failing: Side, seed: u64) {
    let truth = EngineProcess::spawn(&["--protocol", protocol.name()]);
    let fail = ["--fail-rate", "0.5"];
    let bound = [protocol.short_bound()];
    let with_fail = [&bound[..], &fail[..]].concat();
    let (p_args, d_args) = match failing {
        Side::Prefill => (&with_fail[..], &bound[..]),
        Side::Decode => (&bound[..], &with_fail[..]),
    };
    // Never eject the one engine of a side: every request meets the faults.
    let c = Pd::start(
        protocol,
        p_args,
        d_args,
        1,
        &["--outlier-failures", "0", "--max-attempts", "4"],
    );
    let bodies: Vec<Value> = bodies(seed, 20)
        .iter()
        .enumerate()
        .map(|(i, b)| streamed(b, i % 4 < 2))
        .collect();
    let truths = truths(&truth, &bodies).await;
    let ended = join_all(bodies.iter().map(|b| ask(&c.router.url, b))).await;
    let mut tally = Tally::default();
    for ((body, ended), truth) in bodies.iter().zip(ended).zip(&truths) {
        tally.add(body, ended, truth);
    }
    let what = format!("failing {failing:?} legs");
    eprintln!("{protocol} {what}: {tally:?}");
    assert!(tally.whole > 0, "some request got through: {tally:?}");

    let urls = engine_urls(&c.router, &[]).await;
    let books = settle(protocol, &urls, &what).await;
    let failing_url = match failing {
        Side::Prefill => &c.p.url,
        Side::Decode => &c.ds[0].url,
    };
    let injected = books.at(failing_url, "switchyard_engine_injected_failures_total");
    assert!(injected > 0.0, "the engine failed some legs");
    let retries = metric(&c.router.endpoint("/metrics"), "switchyard_retries").await;
    eprintln!("{protocol} {what}: {injected} legs failed, {retries} retries");
    books.assert_no_violations(protocol);
    match protocol {
        Protocol::Vllm => {
            let leases = books.assert_leases_accounted();
            eprintln!("{protocol} {what}: leases {leases:?}");
            let whole = f64::from(tally.whole);
            match failing {
                Side::Prefill => {
                    // A failed P leg holds nothing, and every lease issued went to a healthy D.
                    // A retry avoids the P that failed it: with no other P, the decode engine
                    // serves the request alone.
                    assert_eq!(leases.expired + leases.released, 0.0, "{leases:?}");
                    assert!(leases.pulled <= whole, "{leases:?}");
                    let d_legs = books.at(&c.ds[0].url, "switchyard_engine_calls_received_total");
                    assert_eq!(d_legs, whole, "one D leg per answer, pulled or alone");
                    eprintln!(
                        "{protocol} {what}: {} answers after a handoff, {} served by the decode engine alone on a retry",
                        leases.pulled,
                        whole - leases.pulled
                    );
                }
                // Each answer is one pull; a D that failed before pulling left its lease to expire.
                Side::Decode => assert_eq!(leases.pulled, whole, "{leases:?}"),
            }
        }
        Protocol::Sglang => {
            books.assert_no_orphans();
            let transferred = books.total("switchyard_engine_sglang_rooms_transferred_total");
            let cancelled = books.total("switchyard_engine_sglang_cancelled_total");
            eprintln!(
                "{protocol} {what}: {transferred} rooms transferred, {cancelled} legs cancelled by the router"
            );
            assert_eq!(
                transferred,
                f64::from(tally.whole),
                "one transfer per answer"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_failing_prefill_legs_leave_nothing_held() {
    failing_legs(Protocol::Vllm, Side::Prefill, 21).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_failing_decode_legs_leave_nothing_held() {
    failing_legs(Protocol::Vllm, Side::Decode, 22).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_failing_prefill_legs_leave_nothing_held() {
    failing_legs(Protocol::Sglang, Side::Prefill, 23).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_failing_decode_legs_leave_nothing_held() {
    failing_legs(Protocol::Sglang, Side::Decode, 24).await;
}

// === 3b: client disconnects ===

/// A prompt of `words` random words and a long enough generation that a client can hang up
/// in the middle of it.
fn long_body(rng: &mut StdRng, stream: bool) -> Value {
    const WORDS: [&str; 6] = ["kv", "cache", "prefill", "decode", "lease", "room"];
    let prompt: Vec<&str> = (0..rng.random_range(20..200))
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    let body = json!({"prompt": prompt.join(" "), "max_tokens": 80});
    streamed(&body, stream)
}

/// Ten streams dropped after their first chunk and ten whole requests dropped after a random
/// delay (in P's prefill, between the legs, or in D's generation): afterwards nothing is held,
/// no lease expired (the router hands the params to D even for a client that left, and D's
/// cancellation releases them), no leg was orphaned, no violation.
async fn client_disconnects(protocol: Protocol, seed: u64) {
    // P's prefill slowed down twentyfold (~1 ms a token), D's decode steps real (~5 ms), so a
    // request spends a few hundred milliseconds in each leg.
    let lease = "--kv-lease-ms=10000";
    let bound = match protocol {
        Protocol::Vllm => lease,
        Protocol::Sglang => SHORT_BOOTSTRAP_TIMEOUT,
    };
    let p_args = [SLOW[0], SLOW[1], "--time-scale", "20", bound];
    let d_args = [SLOW[0], SLOW[1], bound];
    let c = Pd::start(protocol, &p_args, &d_args, 1, &[]);
    let url = c.router.endpoint("/v1/completions");
    let mut rng = StdRng::seed_from_u64(seed);
    let streams: Vec<Value> = (0..10).map(|_| long_body(&mut rng, true)).collect();
    let wholes: Vec<(Value, Duration)> = (0..10)
        .map(|_| {
            let delay = Duration::from_millis(rng.random_range(0..600));
            (long_body(&mut rng, false), delay)
        })
        .collect();
    let first_chunks = join_all(streams.iter().map(|body| async {
        let mut response =
            tokio::time::timeout(REQUEST_BOUND, client().post(&url).json(body).send())
                .await
                .expect("the stream's head within the bound")
                .expect("the router answers");
        assert_eq!(response.status(), 200);
        let first = tokio::time::timeout(REQUEST_BOUND, response.chunk())
            .await
            .expect("a first chunk within the bound")
            .expect("the stream is readable");
        assert!(first.is_some(), "a first chunk");
        // Dropping the response hangs up.
    }));
    let hang_ups = join_all(wholes.iter().map(|(body, delay)| async {
        let request = async {
            let response = client().post(&url).json(body).send().await?;
            response.text().await
        };
        // Dropping the request future at the deadline hangs up.
        tokio::time::timeout(*delay, request).await.is_ok()
    }));
    let ((), answered) = tokio::join!(
        async {
            first_chunks.await;
        },
        hang_ups
    );
    let answered = answered.into_iter().filter(|&a| a).count();
    eprintln!(
        "{protocol} client disconnects: 10 streams dropped after their first chunk, {} whole requests dropped, {answered} answered before their client left",
        10 - answered
    );
    let urls = engine_urls(&c.router, &[]).await;
    let books = settle(protocol, &urls, "after 20 clients hung up").await;
    books.assert_no_violations(protocol);
    for (side, engine) in [("P", &c.p), ("D", &c.ds[0])] {
        let legs = books.at(&engine.url, "switchyard_engine_calls_received_total");
        let aborted = books.at(&engine.url, "switchyard_engine_requests_aborted_total");
        let generated = books.at(&engine.url, "switchyard_engine_generated_tokens_total");
        eprintln!(
            "{protocol} client disconnects: {side} got {legs} legs, aborted {aborted}, generated {generated} tokens (of 20 x 80 asked)"
        );
    }
    match protocol {
        Protocol::Vllm => {
            let leases = books.assert_leases_accounted();
            eprintln!("{protocol} client disconnects: leases {leases:?}");
            // The router hangs up on a prefill whose client left, and hands the params of one
            // that answered to D, which releases them: only a prefill whose answer was on the
            // wire as the router hung up keeps its lease to expiry (vLLM would too). That
            // window is microseconds wide; a router that stopped delivering params (or
            // cancelling prefills) would leave several here.
            assert!(
                leases.expired <= 1.0,
                "at most the one lease of a hang-up that crossed its answer expired: {leases:?}"
            );
        }
        Protocol::Sglang => {
            books.assert_no_orphans();
            let cancelled = books.total("switchyard_engine_sglang_cancelled_total");
            let transferred = books.total("switchyard_engine_sglang_rooms_transferred_total");
            eprintln!(
                "{protocol} client disconnects: {transferred} rooms transferred, {cancelled} legs cancelled"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_client_disconnects_leave_nothing_held() {
    client_disconnects(Protocol::Vllm, 31).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_client_disconnects_leave_nothing_held() {
    client_disconnects(Protocol::Sglang, 32).await;
}

/// A completion prompt the single engine generates at least `min_tokens` for before its model
/// stops by itself (the reference model ends with EOS about once in 512 tokens), and a body
/// asking for up to 4000 tokens of it.
async fn long_running_body(truth: &EngineProcess, min_tokens: usize) -> Value {
    for i in 0..200 {
        let body = json!({"prompt": format!("{i}: prefill decode router"), "max_tokens": 4000});
        if said(&truth.url, &body).await.text.len() >= min_tokens {
            return body;
        }
    }
    panic!("no prompt in 200 generates {min_tokens} tokens before EOS");
}

/// The router's count of completions whose client hung up (status 499).
const CLIENT_CLOSED: &str = r#"switchyard_requests_total{route="/v1/completions",status="499"}"#;

/// A cluster of `protocol` whose one decode engine is generating a long non-streamed answer
/// (10 s of work or more) for a client that has just hung up.
async fn non_streaming_hang_up(protocol: Protocol) -> Pd {
    let truth = EngineProcess::spawn(&["--protocol", protocol.name()]);
    let body = long_running_body(&truth, 1000).await;
    let bound = protocol.short_bound();
    let d_args = [SLOW[0], SLOW[1], "--time-scale", "2", bound];
    let c = Pd::start(protocol, &[bound], &d_args, 1, &[]);
    let d_metrics = c.ds[0].endpoint("/metrics");
    let request = client()
        .post(c.router.endpoint("/v1/completions"))
        .json(&body)
        .send();
    let generating = async {
        eventually(Duration::from_secs(10), || async {
            let running = metric(&d_metrics, "switchyard_engine_running_requests").await;
            (running != 1.0).then(|| format!("{running} running on the decode engine"))
        })
        .await;
    };
    tokio::select! {
        answer = request => panic!("answered before the client hung up: {answer:?}"),
        () = generating => {}
    }
    // The request future is dropped: the client has hung up.
    c
}

/// A non-streaming client that hangs up while the decode engine generates its answer: the
/// router closes the decode leg and the decode engine aborts the generation
/// (`spec/vllm-pd.md` §11.10, `spec/sglang-pd.md` §8.10: client disconnect closes the legs);
/// then nothing is held.
async fn non_streaming_hang_up_cancels_the_decode_leg(protocol: Protocol) {
    let c = non_streaming_hang_up(protocol).await;
    let d_metrics = c.ds[0].endpoint("/metrics");
    let started = Instant::now();
    eventually(Duration::from_secs(5), || async {
        let running = metric(&d_metrics, "switchyard_engine_running_requests").await;
        let aborted = metric(&d_metrics, "switchyard_engine_requests_aborted").await;
        let generated = metric(&d_metrics, "switchyard_engine_generated_tokens").await;
        (running != 0.0 || aborted != 1.0).then(|| {
            format!("decode engine: {running} running, {aborted} aborted, {generated} tokens generated for a client that left")
        })
    })
    .await;
    eprintln!(
        "{protocol} non-streaming hang-up: the decode engine aborted {:?} after the client left",
        started.elapsed()
    );
    let urls = engine_urls(&c.router, &[]).await;
    let books = settle(protocol, &urls, "after a non-streaming client hung up").await;
    books.assert_no_violations(protocol);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_a_non_streaming_client_that_hangs_up_cancels_the_decode_leg() {
    non_streaming_hang_up_cancels_the_decode_leg(Protocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_non_streaming_client_that_hangs_up_cancels_the_decode_leg() {
    non_streaming_hang_up_cancels_the_decode_leg(Protocol::Sglang).await;
}

/// The router counts a non-streaming request whose client hung up as 499, as it does an
/// abandoned stream and a hung-up MLC request (`router::a_non_streaming_client_that_hangs_up_is_counted_and_cancelled`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_client_that_hangs_up_mid_handoff_is_counted_as_499() {
    for protocol in [Protocol::Sglang, Protocol::Vllm] {
        let c = non_streaming_hang_up(protocol).await;
        eventually(Duration::from_secs(5), || async {
            let closed = metric(&c.router.endpoint("/metrics"), CLIENT_CLOSED).await;
            (closed != 1.0)
                .then(|| format!("{protocol}: {closed} requests counted as closed by the client"))
        })
        .await;
    }
}

// === 3c: a decode engine killed mid-stream ===

/// Stream `body` from `url` to its end (bounded at 60 s), telling `started` when the first
/// chunk arrives: the SSE text, or how the stream broke.
fn spawn_stream(
    url: &str,
    body: &Value,
    started: tokio::sync::mpsc::Sender<()>,
) -> tokio::task::JoinHandle<Result<String, String>> {
    let (url, body) = (url.to_owned(), body.clone());
    tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(60), async {
            let mut response = client()
                .post(&url)
                .json(&body)
                .send()
                .await
                .map_err(|e| format!("no answer: {e}"))?;
            if response.status() != 200 {
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                return Err(format!("{status} {text}"));
            }
            let mut received = Vec::new();
            while let Some(chunk) = response
                .chunk()
                .await
                .map_err(|e| format!("the stream broke off: {e}"))?
            {
                if received.is_empty() {
                    let _ = started.send(()).await;
                }
                received.extend_from_slice(&chunk);
            }
            String::from_utf8(received).map_err(|e| format!("not UTF-8: {e}"))
        })
        .await
        .unwrap_or_else(|_| Err("the stream did not end within 60 s".into()))
    })
}

/// Six streams generating on two decode engines and three more in their (slowed) prefill
/// leg; the decode engine with the most of them is SIGKILLed. Every stream completes with the
/// single engine's text or ends with an error event then `[DONE]`; the prefill engine and the
/// surviving decode engine then hold nothing (vLLM: a lease whose D died before pulling comes
/// back within the short lease; the test says whether by expiry or release), with no
/// violation and no orphan.
async fn killed_decode_engine(protocol: Protocol, seed: u64) {
    let truth = EngineProcess::spawn(&["--protocol", protocol.name()]);
    let p_args = [
        SLOW[0],
        SLOW[1],
        "--time-scale",
        "20",
        protocol.short_bound(),
    ];
    let d_args = [SLOW[0], SLOW[1], protocol.short_bound()];
    let mut c = Pd::start(protocol, &p_args, &d_args, 2, &[]);
    let mut rng = StdRng::seed_from_u64(seed);
    let bodies: Vec<Value> = (0..9)
        .map(|_| {
            let mut body = long_body(&mut rng, true);
            body["max_tokens"] = json!(200);
            body
        })
        .collect();
    let truths = truths(&truth, &bodies).await;
    let url = c.router.endpoint("/v1/completions");
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel(bodies.len());
    let (running, late) = bodies.split_at(6);
    let mut streams: Vec<_> = running
        .iter()
        .map(|body| spawn_stream(&url, body, started_tx.clone()))
        .collect();
    for _ in running {
        tokio::time::timeout(REQUEST_BOUND, started_rx.recv())
            .await
            .expect("every stream starts within the bound")
            .expect("a stream started (or its task failed: see below)");
    }
    streams.extend(
        late.iter()
            .map(|body| spawn_stream(&url, body, started_tx.clone())),
    );
    drop(started_tx);
    eventually(Duration::from_secs(10), || async {
        let counts = in_flight(&c.router).await;
        (counts[0] == 0).then(|| format!("no prefill leg in flight yet: {counts:?}"))
    })
    .await;
    // Kill the decode engine that has the most of them, generating or planned.
    let counts = in_flight(&c.router).await;
    let victim = if counts[1] >= counts[2] { 0 } else { 1 };
    eprintln!(
        "{protocol} killed decode engine: in flight per endpoint {counts:?}, killing decode engine {}",
        victim + 1
    );
    let killed_url = c.ds[victim].url.clone();
    c.ds[victim].kill();
    let mut tally = Tally::default();
    for ((stream, body), truth) in streams.into_iter().zip(&bodies).zip(&truths) {
        let text = stream.await.expect("no stream task panicked");
        let ended = text.and_then(|text| sse_ended(&text, false));
        tally.add(body, ended, truth);
    }
    eprintln!("{protocol} killed decode engine: {tally:?}");
    let urls = engine_urls(&c.router, &[&killed_url]).await;
    let p_before = Scrape::of(&c.p.url).await.expect("P's metrics");
    let books = settle(protocol, &urls, "after a decode engine was killed").await;
    books.assert_no_violations(protocol);
    match protocol {
        Protocol::Vllm => {
            let leases = books.assert_leases_accounted();
            let expired_while_settling =
                leases.expired - p_before.get("switchyard_engine_vllm_leases_expired_total");
            eprintln!(
                "{protocol} killed decode engine: P's leases {leases:?}: {} back by expiry ({expired_while_settling} of them after the last response), {} by release",
                leases.expired, leases.released
            );
        }
        Protocol::Sglang => {
            books.assert_no_orphans();
            let cancelled = books.at(&c.p.url, "switchyard_engine_sglang_cancelled_total");
            eprintln!(
                "{protocol} killed decode engine: P's rooms back to 0; {cancelled} P legs cancelled"
            );
        }
    }
    let retries = metric(&c.router.endpoint("/metrics"), "switchyard_retries").await;
    eprintln!("{protocol} killed decode engine: {retries} retries");
}

/// How an SSE body a client read in full ended: `[DONE]` last, an error event only just
/// before it; a chat's text is in `delta.content`.
fn sse_ended(text: &str, chat: bool) -> Result<Ended, String> {
    let payloads = sse_payloads(text);
    let Some((done, events)) = payloads.split_last() else {
        return Err("an empty stream".into());
    };
    if done != "[DONE]" {
        return Err(format!("the stream does not end with [DONE]: {text}"));
    }
    let mut said = Said {
        text: String::new(),
        finish: Value::Null,
        usage: Value::Null,
    };
    for (i, event) in events.iter().enumerate() {
        let chunk: Value =
            serde_json::from_str(event).map_err(|e| format!("chunk not JSON ({e}): {event}"))?;
        if chunk.get("error").is_some() {
            if i + 1 != events.len() {
                return Err(format!("an error event before the end: {text}"));
            }
            return openai_error(event).map(Ended::Error);
        }
        if let Some(choice) = chunk["choices"].get(0) {
            said.text
                .push_str(choice_text(choice, chat, true).unwrap_or_default());
            if !choice["finish_reason"].is_null() {
                said.finish = choice["finish_reason"].clone();
            }
        }
        if !chunk["usage"].is_null() {
            said.usage = chunk["usage"].clone();
        }
    }
    Ok(Ended::Whole(said))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_a_killed_decode_engine_leaves_nothing_held() {
    killed_decode_engine(Protocol::Vllm, 41).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_killed_decode_engine_leaves_nothing_held() {
    killed_decode_engine(Protocol::Sglang, 42).await;
}
