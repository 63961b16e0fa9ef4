//! The engine's KV-event publisher (`--kv-events`, `--kv-events-replay`): what its prefix cache
//! stores and evicts, published as vLLM publishes it, so a router can keep an exact index of
//! this engine's cache.
//!
//! The step loop hands over one batch per step that changed the cache
//! ([`Output::KvEvents`](crate::scheduler::Output::KvEvents)) when the step's outputs are due,
//! after its modelled time, as its tokens are. A task of its own then:
//!
//! - numbers the batches from 0 (a new process starts at 0 again) and encodes them
//!   (`--kv-events-encoding`: vLLM's map events, or the older positional ones), each batch
//!   `[ts, events, 0]` (data-parallel rank 0);
//! - sends each on the PUB socket as `[topic, seq, payload]`, the topic empty (vLLM's
//!   default). PUB drops what a subscriber is too slow to take, as ZeroMQ does at its
//!   high-water mark; subscribers fill the gap by replay;
//! - keeps the latest `--kv-events-buffer-steps` batches for the ROUTER replay socket, which
//!   answers a request `[identity, "", start]` with every buffered batch from `start` on, then
//!   the end marker, in the reply shape of the encoding's era: with the topic frame for `map`
//!   (vLLM ≥ 0.26), without it for `array`. A request of any other layout is ignored, as the
//!   engines ignore it. Batches the step loop delivered before a request arrived are in its
//!   answer, so a caller that got an answer from the engine and then asks for a replay sees
//!   what that answer's steps did to the cache.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use switchyard_wire::kv_events::frames::{
    ReplyShape, end_frames, parse_replay_request, reply_frames, seq_frame,
};
use switchyard_wire::kv_events::{Encoding, Event, EventBatch, encode_batch};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::args::KvEventsEncoding;
use crate::error::EngineError;

/// vLLM's default topic: subscribers filtering on "" take everything.
const TOPIC: &[u8] = b"";

/// How long one replay answer may take to send. A client that stops reading holds up the
/// publisher (one task sends both), so it is given up on after this long.
const REPLY_BOUND: Duration = Duration::from_secs(10);

/// Where and how the engine publishes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PublisherConfig {
    pub events: SocketAddr,
    pub replay: Option<SocketAddr>,
    pub encoding: KvEventsEncoding,
    pub buffer_steps: usize,
    /// The data-parallel rank stamped in every batch.
    pub dp_rank: u32,
}

/// The publishing task, with the addresses its sockets are bound to; dropping it stops the
/// task and closes them.
pub(crate) struct Publisher {
    events: SocketAddr,
    replay: Option<SocketAddr>,
    task: tokio::task::JoinHandle<()>,
}

/// The step loop's side: where it sends each step's events.
#[derive(Debug)]
pub(crate) struct Batches(mpsc::UnboundedSender<Vec<Event>>);

impl Batches {
    pub(crate) fn send(&self, events: Vec<Event>) {
        // The publisher is gone only when the engine is.
        let _ = self.0.send(events);
    }
}

impl Publisher {
    /// Binds the sockets and starts the task inside the current tokio runtime.
    pub(crate) async fn start(
        config: PublisherConfig,
    ) -> Result<(Publisher, Batches), EngineError> {
        let mut socket = PubSocket::new();
        let events = bind(&mut socket, "PUB", config.events).await?;
        let (replay, replay_addr) = match config.replay {
            Some(addr) => {
                let mut socket = RouterSocket::new();
                let bound = bind(&mut socket, "replay", addr).await?;
                let shape = match config.encoding {
                    KvEventsEncoding::Map => ReplyShape::WithTopic,
                    KvEventsEncoding::Array => ReplyShape::Legacy,
                };
                (Some(Replay { socket, shape }), Some(bound))
            }
            None => (None, None),
        };
        let stream = Stream {
            socket,
            encoding: match config.encoding {
                KvEventsEncoding::Map => Encoding::Map,
                KvEventsEncoding::Array => Encoding::Array,
            },
            next_seq: 0,
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps,
            dp_rank: config.dp_rank,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(stream, rx, replay));
        let publisher = Publisher {
            events,
            replay: replay_addr,
            task,
        };
        Ok((publisher, Batches(tx)))
    }

    /// Where the PUB socket is bound (the port chosen when the flag said 0).
    pub(crate) fn events_addr(&self) -> SocketAddr {
        self.events
    }

    pub(crate) fn replay_addr(&self) -> Option<SocketAddr> {
        self.replay
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn bind(
    socket: &mut impl Socket,
    what: &'static str,
    addr: SocketAddr,
) -> Result<SocketAddr, EngineError> {
    let error = |source| EngineError::KvEvents { what, addr, source };
    let port = match socket.bind(&format!("tcp://{addr}")).await.map_err(error)? {
        zeromq::Endpoint::Tcp(_, port) => port,
        _ => addr.port(),
    };
    Ok(SocketAddr::new(addr.ip(), port))
}

/// What the task waits on next.
enum Next {
    Batch(Option<Vec<Event>>),
    Replay(ZmqMessage),
}

async fn run(
    mut stream: Stream,
    mut batches: mpsc::UnboundedReceiver<Vec<Event>>,
    mut replay: Option<Replay>,
) {
    loop {
        let next = tokio::select! {
            batch = batches.recv() => Next::Batch(batch),
            request = next_request(replay.as_mut()) => Next::Replay(request),
        };
        match next {
            Next::Batch(Some(events)) => stream.publish(events).await,
            // The step loop has ended, and with it the engine.
            Next::Batch(None) => return,
            Next::Replay(request) => {
                while let Ok(events) = batches.try_recv() {
                    stream.publish(events).await;
                }
                if let Some(replay) = replay.as_mut() {
                    replay.answer(request, &stream).await;
                }
            }
        }
    }
}

/// The next replay request; never, without a replay socket.
async fn next_request(replay: Option<&mut Replay>) -> ZmqMessage {
    if let Some(replay) = replay {
        match replay.socket.recv().await {
            Ok(request) => return request,
            // A ROUTER waits for peers rather than fail; this one cannot serve any more.
            Err(error) => tracing::error!(%error, "KV events: the replay socket failed"),
        }
    }
    std::future::pending().await
}

/// The live stream: the PUB socket, the sequence, and the batches kept for replay.
struct Stream {
    socket: PubSocket,
    encoding: Encoding,
    next_seq: u64,
    /// `(seq, payload)` of the latest batches, oldest first.
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    dp_rank: u32,
}

impl Stream {
    async fn publish(&mut self, events: Vec<Event>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let batch = EventBatch {
            ts: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            events,
            data_parallel_rank: Some(i64::from(self.dp_rank)),
        };
        let payload = Bytes::from(encode_batch(&batch, self.encoding));
        let frames = [
            Bytes::from_static(TOPIC),
            Bytes::copy_from_slice(&seq_frame(seq)),
            payload.clone(),
        ];
        if let Err(error) = self.socket.send(message(frames)).await {
            tracing::debug!(seq, %error, "KV events: a batch was not published");
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }
}

/// The replay socket and the answer shape it speaks.
struct Replay {
    socket: RouterSocket,
    shape: ReplyShape,
}

impl Replay {
    async fn answer(&mut self, request: ZmqMessage, stream: &Stream) {
        let frames = request.into_vec();
        let Some((identity, rest)) = frames.split_first() else {
            return;
        };
        let start = match parse_replay_request(rest) {
            Ok(start) => start,
            Err(error) => {
                tracing::warn!(%error, "KV events: a replay request of another layout, ignored");
                return;
            }
        };
        let batches = stream.buffer.iter().filter(|(seq, _)| *seq >= start);
        let replies = batches
            .map(|(seq, payload)| reply_frames(self.shape, TOPIC, *seq, payload))
            .chain(std::iter::once(end_frames(self.shape)));
        let socket = &mut self.socket;
        let send_all = async {
            for reply in replies {
                let frames =
                    std::iter::once(identity.clone()).chain(reply.into_iter().map(Bytes::from));
                socket.send(message(frames)).await?;
            }
            Ok::<_, zeromq::ZmqError>(())
        };
        match tokio::time::timeout(REPLY_BOUND, send_all).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::debug!(start, %error, "KV events: a replay answer broke off")
            }
            Err(_) => tracing::warn!(
                start,
                "KV events: a replay client stopped reading; answer abandoned"
            ),
        }
    }
}

/// A multipart message of `frames` (at least one).
fn message(frames: impl IntoIterator<Item = Bytes>) -> ZmqMessage {
    let mut frames = frames.into_iter();
    let mut message = ZmqMessage::from(frames.next().unwrap_or_default());
    for frame in frames {
        message.push_back(frame);
    }
    message
}

#[cfg(test)]
mod tests;
