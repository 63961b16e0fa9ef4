//! `switchyard sidecar` in a decode "pod": a real Envoy asks `switchyard epp` (policy disagg)
//! where each request goes; the EPP names the pod's sidecar as the destination and the prefill
//! engine in `x-prefiller-host-port`; the sidecar runs the handoff with its decode engine.
//! Reference engines of each protocol with KV moving over tcp; loopback only.
//!
//! Each protocol's scenario: answers equal a single engine's; a client that hangs up
//! mid-stream leaves nothing held on either engine; the prefill engine killed, the decode
//! engine prefills itself (MLC, vLLM), or the request is refused 503 (SGLang, whose decode
//! engine cannot). Killed mid-run, with requests streaming through Envoy and legs running on
//! it: every request still answers as the single engine does (MLC and vLLM on the decode
//! engine, SGLang on a second prefill engine) and the decode engine is left holding nothing.
//! The allowlist: what the sidecar refuses, and that it called nobody.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, EppProcess, Gateway, Pool, RouterProcess, free_port};

use crate::epp::open_stream;
use crate::http::{client, sse_payloads};
use crate::router::{eventually, metric};

const PREFILLER: &str = "x-prefiller-host-port";
const FALLBACKS: &str = "switchyard_sidecar_prefill_fallbacks";
const REROUTES: &str = "switchyard_sidecar_prefill_reroutes";
const CALLS: &str = "switchyard_engine_calls_received";
const ABORTED: &str = "switchyard_engine_requests_aborted";
/// How long engines may take to free what an ended request held.
const SETTLE_BOUND: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Mlc,
    Vllm,
    Sglang,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Mlc => "mlc",
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }

    /// The gauges that count what an engine holds for a request.
    fn held(self) -> &'static [&'static str] {
        match self {
            Protocol::Mlc => &["switchyard_engine_reservations"],
            Protocol::Vllm => &["switchyard_engine_vllm_leases_held"],
            Protocol::Sglang => &[
                "switchyard_engine_sglang_rooms_pending",
                "switchyard_engine_sglang_registrations",
            ],
        }
    }
}

/// Gauges every engine must be back to zero on once nothing runs.
const IDLE: [&str; 4] = [
    "switchyard_engine_reservations",
    "switchyard_engine_kv_pages_used",
    "switchyard_engine_running_requests",
    "switchyard_engine_waiting_requests",
];

/// A decode pod (its engine and sidecar), a prefill engine (and for SGLang perhaps a spare), the
/// EPP and Envoy; and a single engine of the protocol, the truth the answers are compared with.
struct Pod {
    protocol: Protocol,
    truth: EngineProcess,
    prefill: EngineProcess,
    /// A second SGLang prefill engine, on 127.0.0.2 (the bootstrap port is the same for every
    /// prefill engine of a sidecar, so the two need two addresses).
    spare: Option<EngineProcess>,
    decode: EngineProcess,
    sidecar: RouterProcess,
    _epp: EppProcess,
    envoy: Gateway,
}

impl Pod {
    async fn start(protocol: Protocol) -> Pod {
        Pod::start_with(protocol, false).await
    }

    /// With `spare` (SGLang only), a second prefill engine the sidecar and the EPP may use.
    async fn start_with(protocol: Protocol, spare: bool) -> Pod {
        // A decode step of ~16 ms: a stream lasts long enough to hang up on mid-way.
        let paced = ["--profile", "llama3-8b-h100", "--time-scale", "3"];
        let name = protocol.name();
        let mut truth_args = vec!["--protocol", name];
        truth_args.extend(paced);
        let truth = EngineProcess::spawn(&truth_args);
        let transport = |rank: &'static str| {
            let mut args = vec!["--protocol", name, "--device-rank", rank];
            args.extend(["--kv-transport", "tcp", "--kv-listen", "tcp:127.0.0.1:0"]);
            args.extend(paced);
            args
        };
        let mut d_args = transport("1");
        if protocol == Protocol::Sglang {
            d_args.extend(["--disaggregation-mode", "decode"]);
        }
        let decode = EngineProcess::spawn(&d_args);
        let peer = format!("{}={}", decode.device_rank, decode.kv_addr);
        let bootstrap = free_port().to_string();
        let mut p_args = transport("0");
        p_args.extend(["--kv-peer", &peer]);
        if protocol == Protocol::Sglang {
            p_args.extend([
                "--disaggregation-mode",
                "prefill",
                "--bootstrap-port",
                &bootstrap,
            ]);
        }
        let prefill = EngineProcess::spawn(&p_args);
        let spare = spare.then(|| {
            assert_eq!(
                protocol,
                Protocol::Sglang,
                "a spare prefill engine is SGLang's"
            );
            let mut args = vec!["--protocol", name, "--device-rank", "2"];
            args.extend(["--host", "127.0.0.2", "--kv-transport", "tcp"]);
            args.extend(["--kv-listen", "tcp:127.0.0.2:0", "--kv-peer", &peer]);
            args.extend(["--disaggregation-mode", "prefill"]);
            args.extend(["--bootstrap-port", &bootstrap]);
            args.extend(paced);
            EngineProcess::spawn(&args)
        });
        let prefills: Vec<&EngineProcess> = std::iter::once(&prefill).chain(&spare).collect();
        let p_addrs: Vec<String> = prefills.iter().map(|p| p.http_addr.to_string()).collect();
        let mut sidecar_args = vec!["--decode", &decode.url, "--protocol", name];
        for p_addr in &p_addrs {
            sidecar_args.extend(["--prefill-allow", p_addr]);
        }
        match protocol {
            Protocol::Mlc => sidecar_args.extend(["--device-rank", "1"]),
            Protocol::Vllm => {}
            Protocol::Sglang => sidecar_args.extend(["--bootstrap-port", &bootstrap]),
        }
        let sidecar = RouterProcess::sidecar(&sidecar_args, &[]);
        // The EPP's pool: the decode pod at its sidecar's port, and the prefill engines.
        let mut pool: Vec<String> = prefills
            .iter()
            .map(|p| {
                let mut endpoint = format!("{name}+{},role=prefill", p.url);
                if protocol == Protocol::Sglang {
                    endpoint.push_str(&format!(",bootstrap_port={bootstrap}"));
                }
                endpoint
            })
            .collect();
        pool.push(format!("{name}+{},role=decode", sidecar.url));
        let pool: Vec<&str> = pool.iter().map(String::as_str).collect();
        let epp = EppProcess::start(&pool, &["--policy", "disagg"]);
        let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
        Pod {
            protocol,
            truth,
            prefill,
            spare,
            decode,
            sidecar,
            _epp: epp,
            envoy,
        }
    }

    /// The engines still running once the prefill engine is killed.
    fn survivors(&self) -> Vec<&EngineProcess> {
        std::iter::once(&self.decode).chain(&self.spare).collect()
    }

    /// Polls until neither engine holds anything (bounded), then returns.
    async fn settle(&self, what: &str) {
        let mut engines = self.survivors();
        engines.push(&self.prefill);
        self.settle_on(&engines, what).await;
    }

    /// Polls until none of `engines` holds anything (bounded), then returns.
    async fn settle_on(&self, engines: &[&EngineProcess], what: &str) {
        eventually(SETTLE_BOUND, || async {
            for engine in engines {
                if let Some((gauge, value)) = self.held_by(engine).await {
                    return Some(format!("{what}: {} {gauge} = {value}", engine.url));
                }
            }
            None
        })
        .await;
    }

    /// A gauge on which `engine` still holds something for a request, if any.
    async fn held_by(&self, engine: &EngineProcess) -> Option<(&'static str, f64)> {
        let metrics = engine.endpoint("/metrics");
        for gauge in IDLE.iter().chain(self.protocol.held()) {
            let value = metric(&metrics, gauge).await;
            if value != 0.0 {
                return Some((gauge, value));
            }
        }
        None
    }

    async fn fallbacks(&self) -> f64 {
        metric(&self.sidecar.endpoint("/metrics"), FALLBACKS).await
    }

    async fn reroutes(&self) -> f64 {
        metric(&self.sidecar.endpoint("/metrics"), REROUTES).await
    }
}

/// Completions and chats (an MLC engine serves no chat: completions only), streamed and not.
fn bodies(protocol: Protocol) -> Vec<Value> {
    let mut bodies = Vec::new();
    for (i, prompt) in [
        "The decode pod's sidecar runs the handoff",
        "Prefill over there, decode over here, the same tokens either way: a longer prompt that spans several KV pages of sixteen positions each",
    ]
    .into_iter()
    .enumerate()
    {
        for stream in [false, true] {
            let max_tokens = 8 + 4 * i;
            bodies.push(json!({"prompt": prompt, "max_tokens": max_tokens, "stream": stream}));
            if protocol == Protocol::Mlc {
                continue;
            }
            bodies.push(json!({
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "stream": stream,
            }));
        }
    }
    bodies
}

/// The text and finish reason an answer carried, or its status and body when it failed.
async fn answer(
    base: &str,
    body: &Value,
    prefiller: Option<&str>,
) -> Result<(String, Value), String> {
    let chat = body.get("messages").is_some();
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let mut request = client().post(format!("{base}{path}")).json(body);
    if let Some(prefiller) = prefiller {
        request = request.header(PREFILLER, prefiller);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let text = response.text().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status} {text}"));
    }
    let choices: Vec<Value> = if body["stream"] == json!(true) {
        sse_payloads(&text)
            .iter()
            .filter(|p| *p != "[DONE]")
            .map(|p| serde_json::from_str::<Value>(p).expect("JSON events"))
            .map(|event| event["choices"][0].clone())
            .collect()
    } else {
        let answer: Value = serde_json::from_str(&text).expect("a JSON answer");
        vec![answer["choices"][0].clone()]
    };
    let said = choices
        .iter()
        .filter_map(|c| {
            if chat {
                c["delta"]["content"]
                    .as_str()
                    .or(c["message"]["content"].as_str())
            } else {
                c["text"].as_str()
            }
        })
        .collect();
    let finish = choices
        .iter()
        .map(|c| c["finish_reason"].clone())
        .rfind(|f| !f.is_null())
        .unwrap_or(Value::Null);
    Ok((said, finish))
}

/// Every body through `base` answers as the single engine does.
async fn answers_equal_the_truth(pod: &Pod, base: &str, prefiller: Option<&str>, what: &str) {
    for body in bodies(pod.protocol) {
        let expected = answer(&pod.truth.url, &body, None)
            .await
            .expect("the truth answers");
        let got = answer(base, &body, prefiller).await;
        assert_eq!(
            got.as_ref(),
            Ok(&expected),
            "{} {what}: {body}",
            pod.protocol.name()
        );
        assert!(!expected.0.is_empty(), "{body}");
    }
}

/// A long stream through Envoy, dropped after its first chunk.
async fn hang_up_mid_stream(pod: &Pod) {
    let body = json!({"prompt": "Tell the whole story, slowly", "max_tokens": 400, "stream": true});
    let mut response = open_stream(&pod.envoy.url, &body).await;
    let first = response.chunk().await.expect("a chunk");
    assert!(first.is_some(), "the stream started");
    drop(response);
}

async fn pd_behind_envoy(protocol: Protocol) {
    let mut pod = Pod::start(protocol).await;
    let p_addr = pod.prefill.http_addr.to_string();
    let p_metrics = pod.prefill.endpoint("/metrics");

    // Through Envoy and the EPP: every request is a handoff the sidecar runs.
    let p_calls = metric(&p_metrics, CALLS).await;
    answers_equal_the_truth(&pod, &pod.envoy.url, None, "behind Envoy").await;
    let handoffs = metric(&p_metrics, CALLS).await - p_calls;
    assert!(
        handoffs >= bodies(protocol).len() as f64,
        "the prefill engine served every request's prefill: {handoffs} calls"
    );
    assert_eq!(pod.fallbacks().await, 0.0);
    pod.settle("after the answers").await;

    // The client hangs up mid-stream: the decode engine aborts each generation, and nothing
    // stays held on either engine.
    let d_metrics = pod.decode.endpoint("/metrics");
    let aborted = metric(&d_metrics, ABORTED).await;
    for _ in 0..3 {
        hang_up_mid_stream(&pod).await;
    }
    eventually(SETTLE_BOUND, || async {
        let now = metric(&d_metrics, ABORTED).await - aborted;
        (now < 3.0).then(|| format!("{now} of 3 generations aborted"))
    })
    .await;
    pod.settle("after the hang-ups").await;

    // The prefill engine killed: what the EPP sends the sidecar still names it.
    pod.prefill.kill();
    if protocol == Protocol::Sglang {
        // An SGLang decode engine cannot prefill by itself: the request is refused.
        let body = json!({"prompt": "No prefill engine", "max_tokens": 4});
        let refused = answer(&pod.sidecar.url, &body, Some(&p_addr)).await;
        let error = refused.expect_err("refused");
        assert!(error.starts_with("503 "), "{error}");
        assert_eq!(pod.fallbacks().await, 0.0);
    } else {
        answers_equal_the_truth(
            &pod,
            &pod.sidecar.url,
            Some(&p_addr),
            "after the prefill died",
        )
        .await;
        let fallbacks = pod.fallbacks().await;
        assert!(
            fallbacks >= bodies(protocol).len() as f64,
            "every request fell back: {fallbacks}"
        );
        // Behind Envoy too, whatever the EPP makes of the dead engine meanwhile.
        answers_equal_the_truth(&pod, &pod.envoy.url, None, "behind Envoy, the prefill dead").await;
    }
    pod.settle_on(&pod.survivors(), "after the prefill died")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlc_pd_behind_envoy_equals_one_engine_cancels_and_falls_back() {
    pd_behind_envoy(Protocol::Mlc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_pd_behind_envoy_equals_one_engine_cancels_and_falls_back() {
    pd_behind_envoy(Protocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pd_behind_envoy_equals_one_engine_and_cancels() {
    pd_behind_envoy(Protocol::Sglang).await;
}

/// Requests in flight at once in the mid-run stream.
const IN_FLIGHT: usize = 4;
/// Requests the stream still sends once the prefill engine is dead.
const AFTER_THE_KILL: usize = 3 * IN_FLIGHT;
/// Requests the stream sends at most while waiting to see a leg running on the prefill engine.
const BEFORE_THE_KILL: usize = 400;

/// A stream of requests through Envoy, `IN_FLIGHT` at a time, the prefill engine killed (`kill
/// -9`) the first time a leg is seen running on it (something held or running there); the
/// stream goes on for `AFTER_THE_KILL` more. Every request answers as the single engine does;
/// the decode engine (and the spare) is left holding nothing. SGLang's spare killed as well,
/// a request is refused 503.
async fn killed_mid_run(protocol: Protocol) {
    let sglang = protocol == Protocol::Sglang;
    // Ejection stays on: an SGLang decode leg that fails because the prefill engine died is
    // blamed on the prefill engine, so the sidecar's only decode engine is never ejected.
    let mut pod = Pod::start_with(protocol, sglang).await;
    let bodies = bodies(protocol);
    let mut truths = Vec::new();
    for body in &bodies {
        truths.push(answer(&pod.truth.url, body, None).await.expect("the truth"));
    }
    let bodies = Arc::new(bodies);
    // The index of the first request sent once the prefill engine is dead (usize::MAX until).
    let killed_at = Arc::new(AtomicUsize::new(usize::MAX));
    let next = Arc::new(AtomicUsize::new(0));
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..IN_FLIGHT {
        let (bodies, killed_at, next) = (bodies.clone(), killed_at.clone(), next.clone());
        let base = pod.envoy.url.clone();
        senders.spawn(async move {
            let mut answers = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let after = killed_at.load(Ordering::SeqCst);
                if i >= BEFORE_THE_KILL || (after != usize::MAX && i >= after + AFTER_THE_KILL) {
                    return answers;
                }
                let body = i % bodies.len();
                answers.push((body, answer(&base, &bodies[body], None).await));
            }
        });
    }
    // Watch the prefill engine until a leg runs on it, then kill it at once.
    let seen = loop {
        if next.load(Ordering::SeqCst) >= BEFORE_THE_KILL {
            break None;
        }
        if let Some(held) = pod.held_by(&pod.prefill).await {
            break Some(held);
        }
    };
    pod.prefill.kill();
    killed_at.store(next.load(Ordering::SeqCst), Ordering::SeqCst);
    let (gauge, value) =
        seen.unwrap_or_else(|| panic!("no leg seen on the prefill engine in {BEFORE_THE_KILL}"));
    let mut answered = 0;
    while let Some(answers) = senders.join_next().await {
        for (body, got) in answers.expect("a sender") {
            assert_eq!(
                got.as_ref(),
                Ok(&truths[body]),
                "{} killed mid-run ({gauge} = {value}): {}",
                protocol.name(),
                bodies[body]
            );
            answered += 1;
        }
    }
    assert!(answered >= AFTER_THE_KILL, "{answered} answers");

    if protocol == Protocol::Sglang {
        // Named by the header, the dead engine hands each request to the spare, once.
        let reroutes = pod.reroutes().await;
        assert!(reroutes >= 1.0, "the spare took the handoffs: {reroutes}");
        let p_addr = pod.prefill.http_addr.to_string();
        answers_equal_the_truth(&pod, &pod.sidecar.url, Some(&p_addr), "to the spare").await;
        let more = pod.reroutes().await - reroutes;
        assert_eq!(more, bodies.len() as f64, "one reroute a request");
        assert_eq!(pod.fallbacks().await, 0.0);
        // The spare dead too: after at most one handoff to it, the request is refused.
        pod.settle_on(&pod.survivors(), "after the kill").await;
        pod.spare.as_mut().expect("the spare").kill();
        let body = json!({"prompt": "No prefill engine left", "max_tokens": 4});
        let refused = answer(&pod.sidecar.url, &body, Some(&p_addr)).await;
        let error = refused.expect_err("refused");
        assert!(error.starts_with("503 "), "{error}");
        pod.settle_on(&[&pod.decode], "after the spare died").await;
    } else {
        let fallbacks = pod.fallbacks().await;
        assert!(fallbacks >= 1.0, "the decode engine prefilled: {fallbacks}");
        assert_eq!(pod.reroutes().await, 0.0);
        pod.settle_on(&pod.survivors(), "after the kill").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlc_prefill_killed_mid_run_the_decode_engine_prefills() {
    killed_mid_run(Protocol::Mlc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_killed_mid_run_the_decode_engine_prefills() {
    killed_mid_run(Protocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_killed_mid_run_another_prefill_engine_takes_over() {
    killed_mid_run(Protocol::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allowlist_refuses_with_400_and_calls_nobody() {
    let decode = EngineProcess::spawn(&["--protocol", "vllm"]);
    let prefill = EngineProcess::spawn(&["--protocol", "vllm"]);
    // A live engine on loopback the sidecar was not told of: it must never be called.
    let stranger = EngineProcess::spawn(&["--protocol", "vllm"]);
    let p_addr = prefill.http_addr.to_string();
    let sidecar = RouterProcess::sidecar(
        &[
            "--decode",
            &decode.url,
            "--protocol",
            "vllm",
            "--prefill-allow",
            &p_addr,
        ],
        &[],
    );
    let engines = [&decode, &prefill, &stranger];
    let calls = || async {
        let mut calls = Vec::new();
        for engine in engines {
            calls.push(metric(&engine.endpoint("/metrics"), CALLS).await);
        }
        calls
    };
    let before = calls().await;
    let own = sidecar.addr.to_string();
    let localhost = format!("localhost:{}", sidecar.addr.port());
    let stranger_addr = stranger.http_addr.to_string();
    let body = json!({"prompt": "Who may I call?", "max_tokens": 4});
    for (value, says) in [
        ("not a host", "is not HOST:PORT"),
        ("http://127.0.0.1:1/v1", "is not HOST:PORT"),
        (own.as_str(), "this sidecar itself"),
        (localhost.as_str(), "this sidecar itself"),
        (stranger_addr.as_str(), "not an allowed prefill engine"),
        ("127.0.0.1:1", "not an allowed prefill engine"),
    ] {
        let refused = answer(&sidecar.url, &body, Some(value))
            .await
            .expect_err(value);
        let (status, text) = refused.split_once(' ').expect("status and body");
        assert_eq!(status, "400", "{value}: {text}");
        let error: Value = serde_json::from_str(text).expect("an OpenAI error");
        let message = error["error"]["message"].as_str().expect("a message");
        assert!(message.contains(says), "{value}: {message}");
    }
    assert_eq!(calls().await, before, "no engine was called");

    // The listed engine is called, and without the header the decode engine alone is.
    answer(&sidecar.url, &body, Some(&p_addr))
        .await
        .expect("a handoff");
    let after = calls().await;
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "{before:?} -> {after:?}"
    );
    answer(&sidecar.url, &body, None).await.expect("a forward");
    // An empty value too: llm-d's EPP clears the header to "" when it does not disaggregate.
    answer(&sidecar.url, &body, Some(""))
        .await
        .expect("a forward");
    let last = calls().await;
    assert_eq!(
        [last[0] - after[0], last[1] - after[1], last[2] - after[2]],
        [2.0, 0.0, 0.0],
        "two calls, to the decode engine"
    );
    assert_eq!(last[2], before[2], "the stranger was never called");
}
