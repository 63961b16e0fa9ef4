//! The reference engines speak vLLM's and SGLang's P/D protocols as the peers' own routers
//! expect: vllm-router 0.1.17 (`--vllm-pd-disaggregation`) and sglang-router 0.3.2
//! (`--pd-disaggregation`), from PyPI (`make venv`), each in front of a prefill and a decode
//! reference engine, give a single engine's output, and leave no lease or room behind. The
//! router's own legs are checked against the specs in `backends.rs`; this checks the engines
//! the router is tested against with implementations of the protocols that are not ours.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, free_port, venv_tool};

use crate::http::{client, post, post_json, sse_payloads};
use crate::router::{eventually, metric, prompts};

/// The reference engine's model name.
const MODEL: &str = "switchyard-reference";

/// A peer router process, killed when dropped.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A prefill and a decode reference engine speaking `protocol` (tcp KV): (P, D, P's bootstrap
/// port for SGLang).
fn pair(protocol: &str) -> (EngineProcess, EngineProcess, u16) {
    let mode = |m: &'static str| -> Vec<&'static str> {
        match protocol {
            "sglang" => vec!["--disaggregation-mode", m],
            _ => Vec::new(),
        }
    };
    let mut d_args = vec![
        "--protocol",
        protocol,
        "--kv-transport",
        "tcp",
        "--device-rank",
        "1",
    ];
    d_args.extend(mode("decode"));
    let d = EngineProcess::spawn(&d_args);
    let peer = format!("1={}", d.kv_addr);
    let bootstrap = free_port();
    let bootstrap_arg = bootstrap.to_string();
    let mut p_args = vec![
        "--protocol",
        protocol,
        "--kv-transport",
        "tcp",
        "--device-rank",
        "0",
    ];
    p_args.extend(["--kv-peer", &peer]);
    p_args.extend(mode("prefill"));
    if protocol == "sglang" {
        p_args.extend(["--bootstrap-port", &bootstrap_arg]);
    }
    let p = EngineProcess::spawn(&p_args);
    (p, d, bootstrap)
}

/// The peer's P/D router in front of `p` and `d`; its base URL once it answers a completion.
async fn peer_router(
    protocol: &str,
    p: &EngineProcess,
    d: &EngineProcess,
    bootstrap: u16,
) -> (Peer, String) {
    let (port, metrics_port) = (free_port(), free_port());
    let mut cmd = match protocol {
        "vllm" => {
            let mut cmd = Command::new(venv_tool("vllm-router"));
            cmd.args(["--vllm-pd-disaggregation", "--prefill", &p.url]);
            cmd
        }
        _ => {
            let mut cmd = Command::new(venv_tool("python"));
            cmd.args(["-m", "sglang_router.launch_router", "--pd-disaggregation"]);
            cmd.args(["--prefill", &p.url, &bootstrap.to_string()]);
            cmd
        }
    };
    cmd.args([
        "--decode",
        &d.url,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
    ])
    .args([
        "--port",
        &port.to_string(),
        "--prometheus-host",
        "127.0.0.1",
    ])
    .args(["--prometheus-port", &metrics_port.to_string()])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::inherit());
    let peer = Peer(cmd.spawn().expect("the peer router starts"));
    let url = format!("http://127.0.0.1:{port}");
    // SGLang's router refuses a request without a model (422).
    let probe = json!({"model": MODEL, "prompt": "ready?", "max_tokens": 1});
    eventually(Duration::from_secs(60), || async {
        match client()
            .post(format!("{url}/v1/completions"))
            .json(&probe)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("{protocol} router answered {}", r.status())),
            Err(e) => Some(format!("{protocol} router: {e}")),
        }
    })
    .await;
    (peer, url)
}

/// The text of a completion answer, streamed or whole.
fn text_of(body: &str, stream: bool) -> String {
    if !stream {
        let whole: Value = serde_json::from_str(body).expect("JSON answer");
        return whole["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_owned();
    }
    let payloads = sse_payloads(body);
    assert_eq!(
        payloads.last().map(String::as_str),
        Some("[DONE]"),
        "{body}"
    );
    payloads[..payloads.len() - 1]
        .iter()
        .map(|p| {
            let chunk: Value = serde_json::from_str(p).expect("chunk JSON");
            chunk["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

async fn a_peer_router_drives_the_reference_engines(protocol: &str) {
    let truth = EngineProcess::spawn(&["--protocol", protocol]);
    let (p, d, bootstrap) = pair(protocol);
    let (_peer, url) = peer_router(protocol, &p, &d, bootstrap).await;
    let mut handoffs = 1.0; // the readiness probe's
    for (i, (prompt, max_tokens)) in prompts(77, 8).into_iter().enumerate() {
        let stream = i % 2 == 1;
        let body =
            json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream});
        let expected = post_json(
            &truth.endpoint("/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": max_tokens}),
        )
        .await;
        let (status, answer) = post(&format!("{url}/v1/completions"), &body).await;
        assert_eq!(status, 200, "{protocol}: {answer}");
        assert_eq!(
            text_of(&answer, stream),
            expected["choices"][0]["text"].as_str().expect("text"),
            "{protocol} through its own router, stream {stream}: {prompt:?}"
        );
        handoffs += 1.0;
    }
    // Nothing held once the last answer is in, and every handoff went through the engines'
    // protocol, not around it.
    let (p_metrics, d_metrics) = (p.endpoint("/metrics"), d.endpoint("/metrics"));
    let (held, done) = match protocol {
        "vllm" => (
            "switchyard_engine_vllm_leases_held",
            "switchyard_engine_vllm_leases_pulled",
        ),
        _ => (
            "switchyard_engine_sglang_rooms_pending",
            "switchyard_engine_sglang_rooms_transferred",
        ),
    };
    eventually(Duration::from_secs(30), || async {
        let held = metric(&p_metrics, held).await + metric(&d_metrics, held).await;
        (held > 0.0).then(|| format!("{protocol}: {held} still held"))
    })
    .await;
    assert_eq!(metric(&p_metrics, done).await, handoffs, "{protocol}");
    let violations = format!("switchyard_engine_{protocol}_protocol_violations");
    assert_eq!(
        metric(&p_metrics, &violations).await + metric(&d_metrics, &violations).await,
        0.0
    );
    if protocol == "sglang" {
        let orphans = "switchyard_engine_sglang_orphans";
        assert_eq!(
            metric(&p_metrics, orphans).await + metric(&d_metrics, orphans).await,
            0.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_drives_the_reference_vllm_engines() {
    a_peer_router_drives_the_reference_engines("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_router_drives_the_reference_sglang_engines() {
    a_peer_router_drives_the_reference_engines("sglang").await;
}
