//! The multipart layouts around a payload: the PUB message, the replay request, the two reply
//! shapes and their end marker. Frames are byte slices; the sockets are someone else's.
//!
//! ```
//! use switchyard_wire::kv_events::frames::{ReplayReply, ReplyShape, reply_frames, end_frames};
//!
//! // vLLM ≥ 0.26 puts the topic before the sequence number; a DEALER sees the delimiter.
//! let batch = reply_frames(ReplyShape::WithTopic, b"kv", 7, b"payload");
//! assert_eq!(
//!     ReplayReply::parse(&batch),
//!     Ok(ReplayReply::Batch { topic: Some(&b"kv"[..]), seq: 7, payload: &b"payload"[..] }),
//! );
//! assert_eq!(ReplayReply::parse(&end_frames(ReplyShape::Legacy)), Ok(ReplayReply::End));
//! ```

/// The sequence number of the replay end marker: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: u64 = u64::MAX;

/// A multipart message that does not have the layout it should.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("{got} frames where {expected} were expected")]
    FrameCount { expected: &'static str, got: usize },
    #[error("a sequence frame of {0} bytes (8 expected)")]
    SeqLength(usize),
    #[error("the first frame is not the empty delimiter")]
    NoDelimiter,
}

/// A sequence number frame: 8 bytes, big-endian, unsigned.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Reads a sequence number frame.
pub fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// One message of the live stream: `[topic, seq, payload]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PubMessage<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

impl<'a> PubMessage<'a> {
    pub fn parse<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, FrameError> {
        match frames {
            [topic, seq, payload] => Ok(Self {
                topic: topic.as_ref(),
                seq: parse_seq(seq.as_ref())?,
                payload: payload.as_ref(),
            }),
            _ => Err(FrameError::FrameCount {
                expected: "3 (topic, seq, payload)",
                got: frames.len(),
            }),
        }
    }

    pub fn frames(&self) -> [Vec<u8>; 3] {
        [
            self.topic.to_vec(),
            seq_frame(self.seq).to_vec(),
            self.payload.to_vec(),
        ]
    }
}

/// What a DEALER sends to ask for every buffered batch from `start` on: the empty delimiter,
/// then the start. (A REQ sends the start alone, and would read only the first reply.)
pub fn replay_request_frames(start: u64) -> [Vec<u8>; 2] {
    [Vec::new(), seq_frame(start).to_vec()]
}

/// The start a replay request asks for, from the frames a ROUTER reads after the client's
/// identity. Anything but `[delimiter, start]` is refused, as the engines do.
pub fn parse_replay_request<F: AsRef<[u8]>>(frames: &[F]) -> Result<u64, FrameError> {
    match frames {
        [delimiter, start] if delimiter.as_ref().is_empty() => parse_seq(start.as_ref()),
        [_, _] => Err(FrameError::NoDelimiter),
        _ => Err(FrameError::FrameCount {
            expected: "2 (delimiter, start)",
            got: frames.len(),
        }),
    }
}

/// The two layouts of a replay reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyShape {
    /// vLLM < 0.26 and SGLang: `[delimiter, seq, payload]`, end `[delimiter, END, ""]`.
    Legacy,
    /// vLLM ≥ 0.26 (PR #45177): `[delimiter, topic, seq, payload]`, end
    /// `[delimiter, "", END, ""]`.
    WithTopic,
}

/// One message of a replay answer as a DEALER receives it (delimiter first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    Batch {
        /// `None` in the legacy shape.
        topic: Option<&'a [u8]>,
        seq: u64,
        payload: &'a [u8],
    },
    /// No more buffered batches.
    End,
}

impl<'a> ReplayReply<'a> {
    /// Tells the shapes apart by frame count.
    pub fn parse<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, FrameError> {
        let (topic, seq, payload) = match frames {
            [delimiter, ..] if !delimiter.as_ref().is_empty() => {
                return Err(FrameError::NoDelimiter);
            }
            [_, seq, payload] => (None, seq, payload),
            [_, topic, seq, payload] => (Some(topic.as_ref()), seq, payload),
            _ => {
                return Err(FrameError::FrameCount {
                    expected: "3 or 4 (delimiter, [topic,] seq, payload)",
                    got: frames.len(),
                });
            }
        };
        Ok(match parse_seq(seq.as_ref())? {
            END_SEQ => Self::End,
            seq => Self::Batch {
                topic,
                seq,
                payload: payload.as_ref(),
            },
        })
    }
}

/// One buffered batch as the engine's ROUTER sends it, less the client identity.
pub fn reply_frames(shape: ReplyShape, topic: &[u8], seq: u64, payload: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = vec![Vec::new()];
    if shape == ReplyShape::WithTopic {
        frames.push(topic.to_vec());
    }
    frames.push(seq_frame(seq).to_vec());
    frames.push(payload.to_vec());
    frames
}

/// The end marker, less the client identity.
pub fn end_frames(shape: ReplyShape) -> Vec<Vec<u8>> {
    reply_frames(shape, b"", END_SEQ, b"")
}
