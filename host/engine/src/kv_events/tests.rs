//! The publisher of an engine started in-process, read as a router reads it: the live stream
//! on a SUB socket, the buffered batches through a DEALER, decoded by the wire crate and fed
//! to the router's index.
//!
//! Each wait is on an answer: a replay request is answered only after every batch the step
//! loop had delivered, so a replay sent after a completion's answer holds what that
//! completion's steps did to the cache.

use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_kv_index::{Adapter, KvIndex, MediumSet};
use switchyard_wire::kv_events::frames::{PubMessage, ReplayReply, replay_request_frames};
use switchyard_wire::kv_events::{Encoding, Event, decode_batch, encode_batch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::{EngineArgs, RunningEngine, start};

/// The page size the engines here run with.
const PAGE: usize = 4;

/// Bounds every socket wait: a publisher that never answers fails the test instead of
/// hanging it.
const WAIT: Duration = Duration::from_secs(10);

async fn engine(flags: &[&str]) -> RunningEngine {
    let base = [
        "--port",
        "0",
        "--prefix-cache",
        "--page-size",
        "4",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--kv-events-replay",
        "tcp://127.0.0.1:0",
    ];
    let args = EngineArgs::from_flags(base.iter().chain(flags)).expect("valid flags");
    start(&args).await.expect("engine starts")
}

fn endpoint(addr: Option<std::net::SocketAddr>) -> String {
    format!("tcp://{}", addr.expect("bound"))
}

/// One whole completion of `prompt`; the prompt tokens its prefix cache served.
async fn complete(engine: &RunningEngine, path: &str, prompt: &[u32], max_tokens: u32) -> usize {
    let response = reqwest::Client::new()
        .post(format!("http://{}{path}", engine.http_addr()))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .expect("engine reachable");
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("JSON body");
    let cached = &body["usage"]["prompt_tokens_details"]["cached_tokens"];
    usize::try_from(cached.as_u64().expect("cached_tokens")).expect("fits")
}

/// Every message of a replay answer from `start` on, as a DEALER receives them, the end
/// marker last.
async fn replay(engine: &RunningEngine, start: u64) -> Vec<Vec<Bytes>> {
    let mut socket = DealerSocket::new();
    socket
        .connect(&endpoint(engine.kv_events_replay_addr()))
        .await
        .expect("connects");
    let request: Vec<Bytes> = replay_request_frames(start)
        .into_iter()
        .map(Bytes::from)
        .collect();
    socket
        .send(ZmqMessage::try_from(request).expect("two frames"))
        .await
        .expect("sent");
    let mut messages = Vec::new();
    loop {
        let message = tokio::time::timeout(WAIT, socket.recv())
            .await
            .expect("the replay answer goes on")
            .expect("received");
        let frames = message.into_vec();
        let end = ReplayReply::parse(&frames) == Ok(ReplayReply::End);
        messages.push(frames);
        if end {
            return messages;
        }
    }
}

/// The events of the batches a replay answer carries, with their sequence numbers.
fn batches(messages: &[Vec<Bytes>]) -> Vec<(u64, Vec<Event>)> {
    messages
        .iter()
        .filter_map(
            |frames| match ReplayReply::parse(frames).expect("a reply") {
                ReplayReply::Batch { seq, payload, .. } => {
                    let batch = decode_batch(payload).expect("decodes");
                    assert!(batch.skipped.is_empty(), "{:?}", batch.skipped);
                    Some((seq, batch.batch.events))
                }
                ReplayReply::End => None,
            },
        )
        .collect()
}

/// An index of one engine's cache, fed from its replay socket.
struct Follower {
    index: KvIndex,
    next_seq: u64,
    stored: usize,
    removed: usize,
}

impl Follower {
    fn new() -> Self {
        Follower {
            index: KvIndex::default(),
            next_seq: 0,
            stored: 0,
            removed: 0,
        }
    }

    /// Applies every batch the engine published since the last call.
    async fn catch_up(&mut self, engine: &RunningEngine) {
        for (seq, events) in batches(&replay(engine, self.next_seq).await) {
            assert_eq!(seq, self.next_seq, "batches numbered without a gap");
            self.next_seq += 1;
            for event in &events {
                match event {
                    Event::BlockStored(s) => self.stored += s.block_hashes.len(),
                    Event::BlockRemoved(r) => self.removed += r.block_hashes.len(),
                    Event::AllBlocksCleared => {}
                }
                self.index.apply(0, event);
            }
        }
    }

    /// What the engine will serve of `prompt` from its cache, by the index: the prefix it
    /// holds, short of the last prompt token, which a generation computes itself.
    fn predicted(&self, prompt: &[u32]) -> usize {
        let held = self
            .index
            .lookup(prompt, Adapter::Base, MediumSet::GPU)
            .first()
            .map_or(0, |m| m.tokens);
        held.min((prompt.len() - 1) / PAGE * PAGE)
    }
}

/// Prompts from a few shared documents, in every protocol's completion route, with a pool
/// small enough that pages are evicted: before each request, the index fed with what the
/// engine published predicts exactly the `cached_tokens` the engine then reports.
async fn the_index_predicts_every_hit(protocol: &str, path: &str) {
    let engine = engine(&["--kv-pages", "24", "--protocol", protocol]).await;
    let mut rng = StdRng::seed_from_u64(4);
    let documents: Vec<Vec<u32>> = (0..3)
        .map(|_| (0..36).map(|_| rng.random_range(1..200u32)).collect())
        .collect();
    let mut follower = Follower::new();
    let mut hit_tokens = 0;
    for round in 0..40 {
        let document = &documents[rng.random_range(0..documents.len())];
        let mut prompt = document[..rng.random_range(6..=document.len())].to_vec();
        prompt.extend((0..rng.random_range(0..4)).map(|_| rng.random_range(1..200u32)));
        follower.catch_up(&engine).await;
        let predicted = follower.predicted(&prompt);
        let cached = complete(&engine, path, &prompt, rng.random_range(1..6)).await;
        assert_eq!(cached, predicted, "{protocol} round {round}: {prompt:?}");
        hit_tokens += cached;
    }
    follower.catch_up(&engine).await;
    assert!(
        hit_tokens > 200,
        "{hit_tokens} tokens served from the cache"
    );
    assert!(
        follower.removed > 0 && follower.stored > follower.removed,
        "stored {} blocks, evicted {}",
        follower.stored,
        follower.removed
    );
    let stats = follower.index.stats(0).expect("events came");
    assert_eq!(stats.unplaced, 0, "every stored block named a known parent");
}

#[tokio::test]
async fn an_index_fed_the_events_predicts_the_mlc_engines_cached_tokens() {
    the_index_predicts_every_hit("mlc", "/v1/completions").await;
}

#[tokio::test]
async fn an_index_fed_the_events_predicts_the_vllm_engines_cached_tokens() {
    the_index_predicts_every_hit("vllm", "/v1/completions").await;
}

#[tokio::test]
async fn an_index_fed_the_events_predicts_the_sglang_engines_cached_tokens() {
    the_index_predicts_every_hit("sglang", "/v1/completions").await;
}

/// The live stream carries the batches the replay socket buffers, `[topic "", seq,
/// payload]` with the same payloads; a subscriber that joined late gets the rest by replay.
#[tokio::test]
async fn the_live_stream_and_the_replay_carry_the_same_batches() {
    let engine = engine(&[]).await;
    let mut sub = SubSocket::new();
    sub.subscribe("").await.expect("subscribes");
    sub.connect(&endpoint(engine.kv_events_addr()))
        .await
        .expect("connects");
    let prompt: Vec<u32> = (1..=20).collect();
    for n in 0..4 {
        complete(&engine, "/v1/completions", &prompt[..8 + 4 * n], 2).await;
    }
    let replayed = replay(&engine, 0).await;
    let last = replayed.len() as u64 - 2;
    assert_eq!(
        batches(&replayed).len(),
        4,
        "one batch per prefill that stored pages"
    );
    // A SUB socket may miss what was sent before its subscription reached the publisher,
    // never a batch in the middle.
    let mut live = Vec::new();
    loop {
        let message = tokio::time::timeout(WAIT, sub.recv())
            .await
            .expect("the live stream reaches the last batch")
            .expect("received")
            .into_vec();
        let parsed = PubMessage::parse(&message).expect("[topic, seq, payload]");
        assert_eq!(parsed.topic, b"");
        if let Some(&(previous, _)) = live.last() {
            assert_eq!(parsed.seq, previous + 1, "no gap in the live stream");
        }
        live.push((parsed.seq, Bytes::copy_from_slice(parsed.payload)));
        if parsed.seq == last {
            break;
        }
    }
    for (seq, payload) in live {
        assert_eq!(replayed[seq as usize].last(), Some(&payload), "batch {seq}");
    }
}

/// `map` replies in vLLM ≥ 0.26's shape with the topic frame and map events; `array` in the
/// older shape without it and with positional events; both end with the end marker, and a
/// replay from a later sequence number starts there.
#[tokio::test]
async fn replay_answers_take_the_shape_of_the_encodings_era() {
    for (encoding, frames_per_batch, end) in [
        ("map", 4, vec![&b""[..], b"", &[0xff; 8], b""]),
        ("array", 3, vec![&b""[..], &[0xff; 8], b""]),
    ] {
        let engine = engine(&["--kv-events-encoding", encoding]).await;
        let prompt: Vec<u32> = (1..=20).collect();
        complete(&engine, "/v1/completions", &prompt[..9], 1).await;
        complete(&engine, "/v1/completions", &prompt, 1).await;
        let messages = replay(&engine, 0).await;
        assert_eq!(messages.len(), 3, "{encoding}: two batches and the end");
        assert_eq!(messages[2], end, "{encoding}: the end marker");
        for (seq, frames) in messages[..2].iter().enumerate() {
            assert_eq!(frames.len(), frames_per_batch, "{encoding}");
            assert_eq!(
                frames[frames.len() - 2],
                seq.to_be_bytes()[..],
                "{encoding}"
            );
            // Written in the encoding asked for: re-encoding what was read gives the bytes
            // back in that encoding only.
            let payload = frames.last().expect("payload");
            let batch = decode_batch(payload).expect("decodes").batch;
            for (other, same) in [
                (Encoding::Map, encoding == "map"),
                (Encoding::Array, encoding == "array"),
            ] {
                assert_eq!(
                    encode_batch(&batch, other) == payload[..],
                    same,
                    "{encoding} as {other:?}"
                );
            }
        }
        let stored = batches(&messages);
        let [(0, first), (1, second)] = &stored[..] else {
            panic!("{encoding}: {stored:?}");
        };
        let (Event::BlockStored(first), Event::BlockStored(second)) = (&first[0], &second[0])
        else {
            panic!("{encoding}: {first:?} {second:?}");
        };
        assert_eq!(
            first.token_ids,
            prompt[..8],
            "{encoding}: the two full pages"
        );
        assert_eq!(
            second.token_ids,
            prompt[8..20],
            "{encoding}: the next three"
        );
        assert_eq!(second.parent_block_hash.as_ref(), first.block_hashes.last());
        assert_eq!(batches(&replay(&engine, 1).await).len(), 1, "{encoding}");
        assert_eq!(
            replay(&engine, 2).await.len(),
            1,
            "{encoding}: only the end"
        );
    }
}

/// Only the latest --kv-events-buffer-steps batches are replayed.
#[tokio::test]
async fn the_replay_buffer_keeps_the_latest_batches() {
    let engine = engine(&["--kv-events-buffer-steps", "2"]).await;
    for first in 0..3 {
        let prompt: Vec<u32> = (first * 100..first * 100 + 9).collect();
        complete(&engine, "/v1/completions", &prompt, 1).await;
    }
    let seqs: Vec<u64> = batches(&replay(&engine, 0).await)
        .into_iter()
        .map(|(seq, _)| seq)
        .collect();
    assert_eq!(seqs, [1, 2]);
}

/// A new engine numbers its batches from 0 again and names the same tokens with other
/// hashes (its own seed, as vLLM's NONE_HASH), so an index cannot mistake its blocks for
/// the last one's.
#[tokio::test]
async fn a_restarted_engine_starts_at_seq_0_with_its_own_hashes() {
    let prompt: Vec<u32> = (1..=9).collect();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let engine = engine(&[]).await;
        complete(&engine, "/v1/completions", &prompt, 1).await;
        complete(&engine, "/v1/completions", &[7; 9], 1).await;
        let stored = batches(&replay(&engine, 0).await);
        assert_eq!(
            stored.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(),
            [0, 1]
        );
        let Event::BlockStored(first) = &stored[0].1[0] else {
            panic!("{stored:?}");
        };
        runs.push(first.block_hashes.clone());
    }
    assert_ne!(runs[0], runs[1]);
}

#[test]
fn kv_events_flags_are_checked() {
    for flags in [
        &["--kv-events", "ipc:///tmp/events"][..],
        &["--kv-events", "tcp://localhost:5557"],
        &["--kv-events", "tcp://*:port"],
        &["--kv-events-encoding", "json"],
        &["--kv-events-buffer-steps", "0"],
    ] {
        assert!(
            EngineArgs::from_flags(["--port", "0"].iter().chain(flags)).is_err(),
            "{flags:?}"
        );
    }
    let args = EngineArgs::from_flags(["--port", "0", "--kv-events", "tcp://*:5557"])
        .expect("every interface");
    assert_eq!(
        args.kv_events,
        Some("0.0.0.0:5557".parse().expect("an address"))
    );
}

#[tokio::test]
async fn kv_events_need_the_prefix_cache_and_a_replay_needs_kv_events() {
    for flags in [
        &["--kv-events", "tcp://127.0.0.1:0"][..],
        &["--prefix-cache", "--kv-events-replay", "tcp://127.0.0.1:0"],
    ] {
        let args = EngineArgs::from_flags(["--port", "0"].iter().chain(flags)).expect("parses");
        let error = start(&args).await.err().expect("refused");
        assert!(error.is_usage(), "{error}");
    }
}
