//! The engine started in-process: its HTTP surface over loopback, and what dropping it stops.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_kv::PeerAddr;

use super::*;
use crate::latency::{Latency, Profile, StepWork, TimingModel};

async fn engine(flags: &[&str]) -> RunningEngine {
    let args = EngineArgs::from_flags(["--port", "0"].iter().chain(flags)).expect("valid flags");
    start(&args).await.expect("engine starts")
}

async fn post(engine: &RunningEngine, path: &str, body: &Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("http://{}{path}", engine.http_addr()))
        .json(body)
        .send()
        .await
        .expect("engine reachable");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON body"))
}

#[tokio::test]
async fn dropping_the_engine_ends_its_connections_and_kv_receiver() {
    let engine = engine(&[]).await;
    let PeerAddr::Tcp(kv) = engine.kv_addr().clone() else {
        panic!("tcp is the default transport");
    };
    // A keep-alive connection stays open in the client's pool across the drop.
    let client = reqwest::Client::new();
    let models = format!("http://{}/v1/models", engine.http_addr());
    assert_eq!(client.get(&models).send().await.expect("up").status(), 200);
    drop(engine);
    // That connection held the engine's state (and with it the KV transport) until its task
    // was aborted; the receiver stops once the state is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(kv).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "the KV receiver still accepts after the engine was dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(client);
}

#[tokio::test]
async fn an_unknown_recv_rank_is_this_engines_configuration_not_the_callers() {
    let engine = engine(&[]).await;
    let body = json!({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "begin": 0, "end": 5, "recv_rank": 5,
        "kv_addr_info": switchyard_kv::KvAddrInfo::from_slots(0..5).encode(), "debug_config": {}});
    let (status, error) = post(&engine, "/microserving/remote_send", &body).await;
    assert_eq!(status, 500, "{error}");
    assert_eq!(error["error"]["param"], "recv_rank", "{error}");
    let message = error["error"]["message"].as_str().expect("message");
    assert!(message.contains("--kv-peer 5="), "{message}");
}

#[tokio::test]
async fn a_push_into_slots_nobody_reserved_is_refused() {
    // P pushes into D's pool (here: itself) at slots no prep_recv handed out.
    let engine = engine(&[]).await;
    let body = json!({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "begin": 0, "end": 5,
        "recv_rank": engine.device_rank(),
        "kv_addr_info": switchyard_kv::KvAddrInfo::from_slots(100..105).encode(), "debug_config": {}});
    let (status, error) = post(&engine, "/microserving/remote_send", &body).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "kv_addr_info", "{error}");
    let message = error["error"]["message"].as_str().expect("message");
    assert!(message.contains("not reserved"), "{message}");
}

#[test]
fn bad_flags_are_refused_when_parsed() {
    for flags in [
        ["--prefill-chunk", "0"],
        ["--max-batch", "0"],
        ["--reservation-ttl-ms", "0"],
        ["--page-size", "0"],
        ["--profile", "fast"],
        ["--time-scale", "-1"],
        ["--time-scale", "NaN"],
        ["--kv-transport", "udp"],
    ] {
        assert!(
            EngineArgs::from_flags(["--port", "0"].into_iter().chain(flags)).is_err(),
            "{flags:?}"
        );
    }
}

#[tokio::test]
async fn a_reservation_shorter_than_a_transfer_is_a_usage_error() {
    let args = EngineArgs::from_flags([
        "--port",
        "0",
        "--reservation-ttl-ms",
        "1000",
        "--kv-transfer-timeout-ms",
        "1000",
    ])
    .expect("each flag is valid alone");
    let err = start(&args).await.err().expect("refused");
    assert!(err.is_usage(), "{err}");
}

/// `switchyard engine --kv-device cuda:0 --kv-transport cuda` starts on a GPU and fails with
/// the probe's reason without one; a device that is not `cpu` or `cuda:N` is a flag error.
#[cfg(feature = "cuda")]
#[tokio::test]
async fn the_engine_keeps_its_pool_where_kv_device_says() {
    assert!(EngineArgs::from_flags(["--port", "0", "--kv-device", "gpu0"]).is_err());
    let args = EngineArgs::from_flags([
        "--port",
        "0",
        "--kv-device",
        "cuda:0",
        "--kv-transport",
        "cuda",
        "--kv-pages",
        "8",
    ])
    .unwrap();
    assert_eq!(args.kv_device, switchyard_kv::KvDevice::Cuda(0));
    let started = start(&args).await;
    match switchyard_kv::cuda_probe(0) {
        Ok(_) => drop(started.expect("an engine with its pool on cuda:0")),
        Err(probe) => assert!(
            matches!(&started, Err(EngineError::Kv(switchyard_kv::KvError::Cuda(e))) if *e == probe),
            "{:?}",
            started.err()
        ),
    }
}

/// A step's tokens leave when its modelled time has passed, as a real engine's do: a lone
/// request's first token reaches the client no sooner than the profile says its prefill takes
/// (it used to leave before the step's wait, a few ms in whatever the profile), and not much
/// later either.
#[tokio::test]
async fn the_first_token_arrives_when_the_prefill_would_end() {
    // llama3-8b-h100 prefills 100 tokens in 4.1 ms; stretched 75 times, ~300 ms.
    let engine = engine(&["--profile", "llama3-8b-h100", "--time-scale", "75"]).await;
    let latency = Latency {
        profile: Profile::LLAMA3_8B_H100,
        time_scale: 75.0,
    };
    let prefill = latency.step(&StepWork {
        prefill_tokens: 100,
        ..StepWork::default()
    });
    let prompt: Vec<u32> = (0..100).map(|i| 97 + i % 26).collect();
    let started = Instant::now();
    let mut response = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", engine.http_addr()))
        .json(&json!({"prompt": prompt, "max_tokens": 2, "stream": true}))
        .send()
        .await
        .expect("engine reachable");
    assert_eq!(response.status(), 200);
    let first = response
        .chunk()
        .await
        .expect("body")
        .expect("a first chunk");
    let ttft = started.elapsed();
    assert!(
        String::from_utf8_lossy(&first).starts_with("data: {"),
        "{first:?}"
    );
    assert!(
        ttft >= prefill,
        "TTFT {ttft:?} before the prefill's {prefill:?}"
    );
    // Slack for a busy machine, short of a second prefill.
    assert!(
        ttft < prefill + prefill * 3 / 4,
        "TTFT {ttft:?} for a prefill of {prefill:?}"
    );
}
