//! Byte layouts shared by the transports. All integers are little-endian.
//!
//! - hello (receiver → sender, first thing on every connection; the shm transport attaches the
//!   pool's memfd to it): `"SYKV" version:u32 rank:u32 layers:u32 kv_heads:u32 head_dim:u32
//!   dtype_bytes:u32 num_slots:u32` (32 bytes; rank `u32::MAX` = not configured).
//! - tcp request: `"SYKR" num_runs:u32 (begin:u32 len:u32)*num_runs`, then the bytes of every
//!   destination run in order (`len * bytes_per_token` each).
//! - tcp ack: `status:u8 (0 ok, 1 rejected) pad:[u8;3] bytes_written:u64 msg_len:u32 msg`.

use super::{KvShape, SlotRun};

const HELLO_MAGIC: [u8; 4] = *b"SYKV";
const REQUEST_MAGIC: [u8; 4] = *b"SYKR";
const VERSION: u32 = 1;
const NO_RANK: u32 = u32::MAX;

/// What a receiver tells a sender about its pool before anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: Option<u32>,
    pub shape: KvShape,
    pub num_slots: u32,
}

impl Hello {
    pub const LEN: usize = 32;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let words = [
            VERSION,
            self.rank.unwrap_or(NO_RANK),
            self.shape.layers,
            self.shape.kv_heads,
            self.shape.head_dim,
            self.shape.dtype_bytes,
            self.num_slots,
        ];
        let mut out = [0u8; Self::LEN];
        out[..4].copy_from_slice(&HELLO_MAGIC);
        for (chunk, word) in out[4..].chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() != Self::LEN {
            return Err(format!(
                "hello is {} bytes, expected {}",
                bytes.len(),
                Self::LEN
            ));
        }
        if bytes[..4] != HELLO_MAGIC {
            return Err("hello has the wrong magic: not a switchyard KV endpoint".into());
        }
        let w: Vec<u32> = bytes[4..].chunks_exact(4).map(le_u32).collect();
        if w[0] != VERSION {
            return Err(format!("protocol version {} (we speak {VERSION})", w[0]));
        }
        Ok(Hello {
            rank: (w[1] != NO_RANK).then_some(w[1]),
            shape: KvShape {
                layers: w[2],
                kv_heads: w[3],
                head_dim: w[4],
                dtype_bytes: w[5],
            },
            num_slots: w[6],
        })
    }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The fixed part of a tcp request; the run list follows.
pub(crate) const REQUEST_HEAD_LEN: usize = 8;

pub(crate) fn encode_request_head(runs: &[SlotRun]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REQUEST_HEAD_LEN + runs.len() * 8);
    out.extend_from_slice(&REQUEST_MAGIC);
    out.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for run in runs {
        out.extend_from_slice(&run.begin.to_le_bytes());
        out.extend_from_slice(&run.len.to_le_bytes());
    }
    out
}

/// Returns the number of runs that follow.
pub(crate) fn decode_request_head(head: &[u8; REQUEST_HEAD_LEN]) -> Result<u32, String> {
    if head[..4] != REQUEST_MAGIC {
        return Err("request has the wrong magic".into());
    }
    Ok(le_u32(&head[4..]))
}

pub(crate) fn decode_runs(bytes: &[u8]) -> Vec<SlotRun> {
    bytes
        .chunks_exact(8)
        .map(|c| SlotRun {
            begin: le_u32(&c[..4]),
            len: le_u32(&c[4..]),
        })
        .collect()
}

pub(crate) const ACK_HEAD_LEN: usize = 16;
/// Longest rejection message a sender reads.
pub(crate) const MAX_ACK_MSG: u32 = 4096;

pub(crate) fn encode_ack(result: Result<u64, &str>) -> Vec<u8> {
    let (status, bytes, msg) = match result {
        Ok(bytes) => (0u8, bytes, ""),
        Err(msg) => (1u8, 0, msg),
    };
    let msg = &msg.as_bytes()[..msg.len().min(MAX_ACK_MSG as usize)];
    let mut out = Vec::with_capacity(ACK_HEAD_LEN + msg.len());
    out.extend_from_slice(&[status, 0, 0, 0]);
    out.extend_from_slice(&bytes.to_le_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
    out
}

/// `(ok, bytes_written, msg_len)` from an ack head.
pub(crate) fn decode_ack_head(head: &[u8; ACK_HEAD_LEN]) -> Result<(bool, u64, u32), String> {
    let ok = match head[0] {
        0 => true,
        1 => false,
        other => return Err(format!("ack status {other}")),
    };
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&head[4..12]);
    let msg_len = le_u32(&head[12..]);
    if msg_len > MAX_ACK_MSG {
        return Err(format!("ack message of {msg_len} bytes"));
    }
    Ok((ok, u64::from_le_bytes(bytes), msg_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips() {
        for rank in [None, Some(0), Some(7)] {
            let hello = Hello {
                rank,
                shape: KvShape::LLAMA3_8B,
                num_slots: 4096,
            };
            assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        }
    }

    #[test]
    fn hello_rejects_garbage() {
        assert!(
            Hello::decode(b"HTTP/1.1 400 Bad Request\r\n\r\n1234")
                .unwrap_err()
                .contains("magic")
        );
        assert!(Hello::decode(b"SYKV").unwrap_err().contains("bytes"));
        let mut v2 = Hello {
            rank: None,
            shape: KvShape::SMALL,
            num_slots: 1,
        }
        .encode();
        v2[4] = 2;
        assert!(Hello::decode(&v2).unwrap_err().contains("version"));
    }

    #[test]
    fn request_and_ack_round_trip() {
        let runs = vec![SlotRun { begin: 3, len: 16 }, SlotRun { begin: 64, len: 1 }];
        let encoded = encode_request_head(&runs);
        let head: [u8; REQUEST_HEAD_LEN] = encoded[..REQUEST_HEAD_LEN].try_into().unwrap();
        assert_eq!(decode_request_head(&head), Ok(2));
        assert_eq!(decode_runs(&encoded[REQUEST_HEAD_LEN..]), runs);

        let ack = encode_ack(Ok(4096));
        let head: [u8; ACK_HEAD_LEN] = ack[..].try_into().unwrap();
        assert_eq!(decode_ack_head(&head), Ok((true, 4096, 0)));
        let nack = encode_ack(Err("slot 9 out of range"));
        let head: [u8; ACK_HEAD_LEN] = nack[..ACK_HEAD_LEN].try_into().unwrap();
        assert_eq!(decode_ack_head(&head), Ok((false, 0, 19)));
        assert_eq!(&nack[ACK_HEAD_LEN..], b"slot 9 out of range");
    }
}
