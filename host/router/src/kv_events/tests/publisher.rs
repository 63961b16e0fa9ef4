//! An engine's publishing side on loopback, written with the same ZeroMQ crate: a PUB socket
//! numbering batches from 0, and a ROUTER answering replay requests from a buffer.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use switchyard_wire::kv_events::frames::{
    PubMessage, ReplyShape, end_frames, parse_replay_request, reply_frames,
};
use switchyard_wire::kv_events::{Encoding, EventBatch, encode_batch};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// (seq, payload) of the batches a replay can still serve.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

pub(super) struct Publisher {
    socket: PubSocket,
    events: String,
    replay: Option<(String, tokio::task::JoinHandle<()>)>,
    buffer: Buffer,
    next_seq: u64,
    topic: Vec<u8>,
}

impl Publisher {
    /// Binds on loopback ports of its own; with `replay`, a replay socket answering in `shape`.
    pub(super) async fn bind(replay: Option<ReplyShape>) -> Self {
        Self::bind_at(
            "tcp://127.0.0.1:0",
            replay.map(|shape| ("tcp://127.0.0.1:0", shape)),
        )
        .await
    }

    /// A new process at the same addresses: sequence numbers from 0, an empty buffer.
    pub(super) async fn restart(self, replay: Option<ReplyShape>) -> Self {
        let events = self.events.clone();
        let replay_at = self.replay.as_ref().map(|(at, _)| at.clone());
        self.shut_down().await;
        match (replay_at, replay) {
            (Some(at), Some(shape)) => Self::bind_at(&events, Some((&at, shape))).await,
            _ => Self::bind_at(&events, None).await,
        }
    }

    async fn bind_at(events: &str, replay: Option<(&str, ReplyShape)>) -> Self {
        let mut socket = PubSocket::new();
        let events = socket.bind(events).await.expect("PUB binds").to_string();
        let buffer = Buffer::default();
        let replay = match replay {
            Some((at, shape)) => {
                let mut router = RouterSocket::new();
                let at = router.bind(at).await.expect("ROUTER binds").to_string();
                let task = tokio::spawn(serve_replays(router, buffer.clone(), shape));
                Some((at, task))
            }
            None => None,
        };
        Self {
            socket,
            events,
            replay,
            buffer,
            next_seq: 0,
            topic: b"kv@127.0.0.1@test".to_vec(),
        }
    }

    pub(super) fn events_url(&self) -> &str {
        &self.events
    }

    pub(super) fn replay_url(&self) -> Option<&str> {
        self.replay.as_ref().map(|(at, _)| at.as_str())
    }

    /// Publishes a batch; returns its sequence number.
    pub(super) async fn publish(&mut self, batch: &EventBatch) -> u64 {
        let (seq, payload) = self.record(batch);
        self.send(seq, payload).await;
        seq
    }

    /// Numbers and buffers a batch the subscriber never gets live (a PUB drop at the HWM).
    pub(super) fn publish_dropped(&mut self, batch: &EventBatch) -> u64 {
        self.record(batch).0
    }

    /// Sends raw frames, whatever they are.
    pub(super) async fn send_frames(&mut self, frames: Vec<Vec<u8>>) {
        let message = ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>())
            .expect("frames");
        self.socket.send(message).await.expect("PUB sends");
    }

    /// The replay buffer keeps only batches from `seq` on (the engine's window moved).
    pub(super) fn forget_before(&mut self, seq: u64) {
        self.buffer.lock().retain(|(buffered, _)| *buffered >= seq);
    }

    /// Numbers from 0 again with an empty buffer, as a new process would.
    pub(super) fn renumber_from_zero(&mut self) {
        self.next_seq = 0;
        self.buffer.lock().clear();
    }

    pub(super) async fn shut_down(mut self) {
        // Unbinding first frees the ports for a restart at the same addresses.
        self.socket.unbind_all().await;
        if let Some((_, task)) = self.replay.take() {
            task.abort();
            let _ = task.await;
        }
    }

    fn record(&mut self, batch: &EventBatch) -> (u64, Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = encode_batch(batch, Encoding::Map);
        self.buffer.lock().push((seq, payload.clone()));
        (seq, payload)
    }

    async fn send(&mut self, seq: u64, payload: Vec<u8>) {
        let frames = PubMessage {
            topic: &self.topic,
            seq,
            payload: &payload,
        }
        .frames();
        self.send_frames(frames.to_vec()).await;
    }
}

/// The engine's replay loop: each request answered with every buffered batch from its start
/// on, then the end marker; anything else ignored.
async fn serve_replays(mut router: RouterSocket, buffer: Buffer, shape: ReplyShape) {
    let topic = b"kv@127.0.0.1@test";
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let Some((identity, rest)) = frames.split_first() else {
            continue;
        };
        let Ok(start) = parse_replay_request(rest) else {
            continue;
        };
        let batches: Vec<(u64, Vec<u8>)> = buffer
            .lock()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let replies = batches
            .iter()
            .map(|(seq, payload)| reply_frames(shape, topic, *seq, payload))
            .chain([end_frames(shape)]);
        for reply in replies {
            let mut frames = vec![identity.clone()];
            frames.extend(reply.into_iter().map(Bytes::from));
            let message = ZmqMessage::try_from(frames).expect("frames");
            if router.send(message).await.is_err() {
                break;
            }
        }
    }
}
