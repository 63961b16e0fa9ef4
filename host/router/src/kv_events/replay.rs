//! Asking an engine's replay socket for every batch it still buffers from a sequence number.
//!
//! A DEALER, not a REQ: the engine answers one request with many messages and a REQ reads
//! only the first (vLLM PR #45177). A fresh socket per replay: replays are rare, and a reply
//! left over from one that timed out can then never be read as part of the next.

use std::time::Duration;

use bytes::Bytes;
use switchyard_wire::kv_events::frames::{FrameError, ReplayReply, replay_request_frames};
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// More batches than any engine buffers (vLLM and SGLang keep 10,000 by default).
const MAX_BATCHES: usize = 1_000_000;

/// Why a replay gave nothing usable.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay from {endpoint}: {source}")]
    Socket {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("replay from {endpoint}: no end marker within {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
    #[error("replay from {endpoint}: a reply with a bad layout: {source}")]
    Frames {
        endpoint: String,
        source: FrameError,
    },
    #[error("replay from {endpoint}: more than {MAX_BATCHES} batches")]
    TooLong { endpoint: String },
}

/// One replayed batch.
pub(super) struct Replayed {
    pub(super) seq: u64,
    pub(super) payload: Bytes,
}

/// Every batch `endpoint` buffers with a sequence number from `start` on, in order, within
/// `timeout` (connecting included).
pub(super) async fn replay(
    endpoint: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<Replayed>, ReplayError> {
    let deadline = Instant::now() + timeout;
    let timed_out = || ReplayError::Timeout {
        endpoint: endpoint.to_owned(),
        timeout,
    };
    let socket_error = |source| ReplayError::Socket {
        endpoint: endpoint.to_owned(),
        source,
    };
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut socket = DealerSocket::with_options(options);
    tokio::time::timeout_at(deadline, socket.connect(endpoint))
        .await
        .map_err(|_| timed_out())?
        .map_err(socket_error)?;
    let request = ZmqMessage::try_from(
        replay_request_frames(start)
            .into_iter()
            .map(Bytes::from)
            .collect::<Vec<_>>(),
    )
    .expect("a replay request has two frames");
    socket.send(request).await.map_err(socket_error)?;
    let mut batches = Vec::new();
    loop {
        let message = tokio::time::timeout_at(deadline, socket.recv())
            .await
            .map_err(|_| timed_out())?
            .map_err(socket_error)?;
        let frames = message.into_vec();
        match ReplayReply::parse(&frames) {
            Ok(ReplayReply::End) => return Ok(batches),
            Ok(ReplayReply::Batch { seq, .. }) => {
                if batches.len() == MAX_BATCHES {
                    return Err(ReplayError::TooLong {
                        endpoint: endpoint.to_owned(),
                    });
                }
                // The payload is the last frame in both shapes.
                let payload = frames.last().cloned().unwrap_or_default();
                batches.push(Replayed { seq, payload });
            }
            Err(source) => {
                return Err(ReplayError::Frames {
                    endpoint: endpoint.to_owned(),
                    source,
                });
            }
        }
    }
}
