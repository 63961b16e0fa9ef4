//! `switchyard sidecar` in a decode "pod": a real Envoy asks `switchyard epp` (policy disagg)
//! where each request goes; the EPP names the pod's sidecar as the destination and the prefill
//! engine in `x-prefiller-host-port`; the sidecar runs the handoff with its decode engine.
//! Reference engines of each protocol with KV moving over tcp; loopback only.
//!
//! Each protocol's scenario: answers equal a single engine's; a client that hangs up
//! mid-stream leaves nothing held on either engine; the prefill engine killed, the decode
//! engine prefills itself (MLC, vLLM), or the request is refused 503 (SGLang, whose decode
//! engine cannot). The allowlist: what the sidecar refuses, and that it called nobody.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, EppProcess, Gateway, Pool, RouterProcess, free_port};

use crate::epp::open_stream;
use crate::http::{client, sse_payloads};
use crate::router::{eventually, metric};

const PREFILLER: &str = "x-prefiller-host-port";
const FALLBACKS: &str = "switchyard_sidecar_prefill_fallbacks";
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

/// A decode pod (its engine and sidecar), a prefill engine, the EPP and Envoy; and a single
/// engine of the protocol, the truth the answers are compared with.
struct Pod {
    protocol: Protocol,
    truth: EngineProcess,
    prefill: EngineProcess,
    decode: EngineProcess,
    sidecar: RouterProcess,
    _epp: EppProcess,
    envoy: Gateway,
}

impl Pod {
    async fn start(protocol: Protocol) -> Pod {
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
        let p_addr = prefill.http_addr.to_string();
        let mut sidecar_args = vec!["--decode", &decode.url, "--protocol", name];
        sidecar_args.extend(["--prefill-allow", &p_addr]);
        match protocol {
            Protocol::Mlc => sidecar_args.extend(["--device-rank", "1"]),
            Protocol::Vllm => {}
            Protocol::Sglang => sidecar_args.extend(["--bootstrap-port", &bootstrap]),
        }
        let sidecar = RouterProcess::sidecar(&sidecar_args, &[]);
        // The EPP's pool: the decode pod at its sidecar's port, and the prefill engine.
        let mut p_endpoint = format!("{name}+{},role=prefill", prefill.url);
        if protocol == Protocol::Sglang {
            p_endpoint.push_str(&format!(",bootstrap_port={bootstrap}"));
        }
        let d_endpoint = format!("{name}+{},role=decode", sidecar.url);
        let epp = EppProcess::start(&[&p_endpoint, &d_endpoint], &["--policy", "disagg"]);
        let envoy = Gateway::start(epp.grpc, &Pool::OriginalDst, None);
        Pod {
            protocol,
            truth,
            prefill,
            decode,
            sidecar,
            _epp: epp,
            envoy,
        }
    }

    fn engines(&self) -> [&EngineProcess; 2] {
        [&self.prefill, &self.decode]
    }

    /// Polls until neither engine holds anything (bounded), then returns.
    async fn settle(&self, what: &str) {
        eventually(SETTLE_BOUND, || async {
            for engine in self.engines() {
                let metrics = engine.endpoint("/metrics");
                for gauge in IDLE.iter().chain(self.protocol.held()) {
                    let value = metric(&metrics, gauge).await;
                    if value != 0.0 {
                        return Some(format!("{what}: {} {gauge} = {value}", engine.url));
                    }
                }
            }
            None
        })
        .await;
    }

    async fn fallbacks(&self) -> f64 {
        metric(&self.sidecar.endpoint("/metrics"), FALLBACKS).await
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
    let engine = &pod.decode;
    let metrics = engine.endpoint("/metrics");
    eventually(SETTLE_BOUND, || async {
        for gauge in IDLE.iter().chain(protocol.held()) {
            let value = metric(&metrics, gauge).await;
            if value != 0.0 {
                return Some(format!("the decode engine: {gauge} = {value}"));
            }
        }
        None
    })
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
    let last = calls().await;
    assert_eq!(
        [last[0] - after[0], last[1] - after[1], last[2] - after[2]],
        [1.0, 0.0, 0.0],
        "one call, to the decode engine"
    );
    assert_eq!(last[2], before[2], "the stranger was never called");
}
