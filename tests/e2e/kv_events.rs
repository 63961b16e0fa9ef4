//! The router's KV-event wiring against a reference engine and a publisher on loopback: an
//! endpoint given `kv_events` is subscribed to, `/admin/endpoints` and `/metrics` show what
//! its index holds, and a request's snapshot carries the cached prefix the events describe
//! (the prediction metrics count it).
//!
//! The publisher is this test's own ZeroMQ PUB socket speaking vLLM's wire format (the
//! reference engine's publisher is another branch's); blocks it announces are keyed by the
//! prompt's token ids exactly as an engine's are.

use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};
use switchyard_wire::kv_events::frames::PubMessage;
use switchyard_wire::kv_events::{
    BlockHash, BlockStored, Encoding, Event, EventBatch, encode_batch,
};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::http::post_json;
use crate::router::{metric, post_or_get};

const BLOCK: u32 = 16;
/// The longest wait for the subscriber to connect and apply a batch.
const WITHIN: Duration = Duration::from_secs(20);

/// Two blocks of 16 tokens, ids 1..=32, as an engine announces them after a prefill.
fn two_blocks() -> EventBatch {
    EventBatch {
        ts: 1.0,
        events: vec![Event::BlockStored(BlockStored::new(
            vec![BlockHash::Int(0x11), BlockHash::Int(0x22)],
            None,
            (1..=2 * BLOCK).collect(),
            BLOCK,
        ))],
        data_parallel_rank: None,
    }
}

async fn publish(socket: &mut PubSocket, seq: u64, batch: &EventBatch) {
    let payload = encode_batch(batch, Encoding::Map);
    let frames = PubMessage {
        topic: b"",
        seq,
        payload: &payload,
    }
    .frames();
    let message = ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>())
        .expect("frames");
    socket.send(message).await.expect("PUB sends");
}

fn kv_state(endpoints: &Value) -> Value {
    endpoints["endpoints"][0]["kv_events"].clone()
}

#[tokio::test]
async fn a_requests_snapshot_carries_the_prefix_the_engines_events_announced() {
    let mut publisher = PubSocket::new();
    let events = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("PUB binds")
        .to_string();
    let engine = EngineProcess::spawn(&[]);
    let endpoint = format!("{},kv_events={events}", engine.url);
    let router = RouterProcess::serve_ready(&[&endpoint], &["--policy", "round-robin"]);
    let admin = router.endpoint("/admin/endpoints");
    let shown = kv_state(&post_or_get(&admin).await);
    assert_eq!(shown["events"], events.as_str(), "{shown}");

    // A PUB socket drops what it sends before the subscriber has joined: announce the same
    // blocks under new sequence numbers until the index holds them (a repeat is a no-op).
    let deadline = tokio::time::Instant::now() + WITHIN;
    for seq in 0.. {
        publish(&mut publisher, seq, &two_blocks()).await;
        let kv = kv_state(&post_or_get(&admin).await);
        if kv["blocks"] == 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not indexed after {WITHIN:?}: {kv}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let kv = kv_state(&post_or_get(&admin).await);
    assert_eq!(
        (kv["block_size"].as_u64(), kv["stale"].as_bool()),
        (Some(16), Some(false)),
        "{kv}"
    );

    // 40 tokens: the first two blocks are cached, the rest is not.
    let prompt: Vec<u32> = (1..=40).collect();
    let body = json!({"model": "switchyard-reference", "prompt": prompt, "max_tokens": 4});
    let answer = post_json(&router.endpoint("/v1/completions"), &body).await;
    assert_eq!(answer["usage"]["prompt_tokens"], 40, "{answer}");
    let metrics = router.endpoint("/metrics");
    assert_eq!(metric(&metrics, "switchyard_kv_predictions").await, 1.0);
    assert_eq!(
        metric(&metrics, "switchyard_kv_predicted_prefix_tokens").await,
        f64::from(2 * BLOCK)
    );
    assert_eq!(metric(&metrics, "switchyard_kv_blocks").await, 2.0);
    assert!(metric(&metrics, "switchyard_kv_events").await >= 1.0);
}
