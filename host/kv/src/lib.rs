//! The KV-cache transfer data path between engines. It depends on no other switchyard crate:
//! engines use it, and nothing of the router's or the policy host's belongs here.
//!
//! A decode engine (D) reserves slots in its paged KV pool and describes them to the router as
//! `kv_append_metadata` ([`KvAddrInfo`], MLC's encoding, see `spec/microserving.md`). The router
//! forwards that blob verbatim to the prefill engine (P) as `kv_addr_info`, and P pushes the K/V
//! bytes of the prompt positions into those slots with a [`KvTransport`]. MLC does this with
//! one-sided NVSHMEM writes; here two transports do the same job without a GPU:
//!
//! - **shm** (same host): D's pool lives in a sealed memfd ([`KvStore`]); D hands the fd to P over
//!   a Unix socket (`SCM_RIGHTS`), P maps it once and copies slot runs straight into it.
//! - **tcp** (any host): P streams one framed request per transfer (run list, then the bytes of
//!   every run, pipelined); D writes them into its pool and acks once all are in place.
//! - **cuda** (same node, feature `cuda`): D's pool is device memory exported with CUDA IPC; P
//!   opens it once and copies merged runs on its own stream (see [`cuda`]).
//!
//! # API
//!
//! ```text
//! KvShape { layers, kv_heads, head_dim, dtype_bytes }   SMALL, LLAMA3_8B, bytes_per_token()
//! SlotRun { begin, len }                                 a run of consecutive slot ids; slots()
//! KvAddrInfo { models: Vec<Vec<SlotRun>> }               encode() / decode() / slots() / total_len()
//!     from_slots(iter)                                   one model, adjacent slots merged
//! KvStore::new(shape, num_slots)                         memfd-backed pool, Send + Sync, zeroed
//!     shape() / num_slots()
//!     write_slot(slot, &[u8]) / read_slot(slot, &mut [u8]) / read_slot_to_vec(slot)
//!     with_guarded_slots() / gate()                      receivers write only open slots
//! SlotGate   open(slots) / close(slots) / close_unless_claimed(&slots) / any_claimed(slots)
//! PeerAddr   "unix:/path/sock" | "unix:@abstract" | "tcp:127.0.0.1:7001"   (FromStr, Display, serde)
//!     kind() / PeerAddr::ephemeral(kind)
//! parse_rank_addr("1=tcp:127.0.0.1:7001") -> (u32, PeerAddr)   for `--kv-peer RANK=ADDR`
//! TransportKind   Shm | Tcp | Cuda   ("shm" / "tcp" / "cuda", clap::ValueEnum, Display)
//! KvDevice        Cpu | Cuda(n)      ("cpu" / "cuda:N"); KvStore::new_on(device, shape, slots)
//! cuda_probe(n) -> device name, or why CUDA device n cannot be used   (gates GPU tests)
//! KvTransport::start(kind, store, listen: Option<PeerAddr>, peers: HashMap<u32, PeerAddr>)
//! KvTransport::start_with(TransportConfig { kind, rank, listen, peers, timeouts }, store)
//!     send(dst_rank, src_slots, &dst_info) -> TransferStats   returns once the bytes are in D's pool
//!     listen_addr() / add_peer(rank, addr) / kind() / store()
//! KvError      one variant per failure, each naming the rank/address/slot involved
//! ```
//!
//! `send` transfers model 0 of `dst_info` (a pool holds one model; several models are an
//! error), checks that `src_slots.len()` equals the destination's slot count, that every slot
//! is inside its pool, and that both pools have the same [`KvShape`]. Failures never panic and
//! never hang: connecting is bounded by `connect_timeout`, the whole send by
//! `transfer_timeout` (see [`TransportConfig::new`] for the defaults).
//!
//! A pool's memory is allocated on first write, so a large, mostly idle pool costs little.
//!
//! # Concurrency invariant
//!
//! Slots are owned by whoever the engine's bookkeeping says owns them, and the pool's
//! [`SlotGate`] enforces the part a remote peer could break. A slot reserved for a transfer
//! (named in a `kv_append_metadata` that D handed out) is *open* from prep_recv until
//! start_generate or expiry closes it; a receiving transport (tcp) writes only open slots, under
//! an exclusive claim, and D neither reads nor writes a claimed slot (`read_slot`/`write_slot`
//! panic on one; the engine never reuses pages that are still claimed). P reads its own source
//! slots only while it holds their lease. One-sided transports (shm, cuda) write into D's pool
//! without D's involvement, so the engine cannot gate them: it keeps an expired reservation's
//! pages out of use for longer than a router waits on remote_send instead. Breaking these rules
//! in-process would race the step loop against a `&mut` view of the pool: undefined behaviour,
//! not merely wrong bytes.
//!
//! # Example
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::{collections::HashMap, sync::Arc};
//! use switchyard_kv::{KvAddrInfo, KvShape, KvStore, KvTransport, SlotRun, TransportKind};
//!
//! let (p_pool, d_pool) = (KvStore::new(KvShape::SMALL, 64)?, KvStore::new(KvShape::SMALL, 64)?);
//! let (p_pool, d_pool) = (Arc::new(p_pool), Arc::new(d_pool));
//! p_pool.write_slot(3, &vec![7u8; KvShape::SMALL.bytes_per_token()]);
//!
//! let d = KvTransport::start(TransportKind::Tcp, d_pool.clone(), None, HashMap::new()).await?;
//! let peers = HashMap::from([(1, d.listen_addr())]);
//! let p = KvTransport::start(TransportKind::Tcp, p_pool, None, peers).await?;
//!
//! // D's prep_recv answer, as the router forwards it.
//! let meta = KvAddrInfo { models: vec![vec![SlotRun { begin: 40, len: 1 }]] }.encode();
//! p.send(1, &[3], &KvAddrInfo::decode(&meta)?).await?;
//! assert_eq!(d_pool.read_slot_to_vec(40), vec![7u8; KvShape::SMALL.bytes_per_token()]);
//! # Ok::<(), switchyard_kv::KvError>(())
//! # }).unwrap();
//! ```

mod addr;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod gate;
mod peer;
mod runs;
mod shm;
mod store;
mod tcp;
#[cfg(test)]
mod tests;
mod transport;
mod wire;

pub use addr::{KvAddrInfo, SlotRun};
pub use device::{CudaError, KvDevice, cuda_probe};
pub use gate::{GateError, SlotGate, WriteClaim};
pub use peer::{PeerAddr, TransportKind, parse_rank_addr};
pub use store::KvStore;
pub use transport::{KvTransport, TransferStats, TransportConfig};

use std::time::Duration;

/// The shape of one token's K and V across all layers: what one slot of a pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvShape {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
}

impl KvShape {
    /// A small default for tests and the reference engine: 256 bytes per token.
    pub const SMALL: KvShape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        dtype_bytes: 2,
    };

    /// Llama-3-8B in fp16: 32 layers × 8 KV heads × 128 dims × 2 bytes, 128 KiB per token.
    pub const LLAMA3_8B: KvShape = KvShape {
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    };

    /// Bytes of one slot: `layers * 2 (K and V) * kv_heads * head_dim * dtype_bytes`.
    /// Saturates instead of overflowing, so an absurd shape fails [`KvStore::new`] cleanly.
    pub fn bytes_per_token(&self) -> usize {
        [self.kv_heads, self.head_dim, self.dtype_bytes]
            .into_iter()
            .fold((self.layers as usize).saturating_mul(2), |acc, x| {
                acc.saturating_mul(x as usize)
            })
    }
}

impl std::fmt::Display for KvShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers × {} kv heads × {} dims × {} B",
            self.layers, self.kv_heads, self.head_dim, self.dtype_bytes
        )
    }
}

/// Everything that can go wrong on the KV data path. Each variant names what it is about.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("malformed kv_append_metadata: {reason}")]
    Metadata { reason: String },

    #[error("cannot create a KV pool of {num_slots} slots × {bytes_per_token} B: {reason}")]
    PoolSize {
        num_slots: u32,
        bytes_per_token: usize,
        reason: &'static str,
    },

    #[error("cannot set up shared memory for the KV pool: {0}")]
    SharedMemory(#[source] std::io::Error),

    #[error("KV shape mismatch with peer rank {rank}: ours is {ours}, theirs is {theirs}")]
    ShapeMismatch {
        rank: u32,
        ours: KvShape,
        theirs: KvShape,
    },

    #[error("{side} slot {slot} is out of range: the pool has {num_slots} slots")]
    SlotOutOfRange {
        side: &'static str,
        slot: u32,
        num_slots: u32,
    },

    #[error("{src} source slots but kv_addr_info names {dst} destination slots")]
    LengthMismatch { src: usize, dst: u64 },

    #[error("kv_addr_info names {models} models; the KV pool holds one")]
    ModelCount { models: usize },

    #[error(
        "no KV peer with rank {rank} is configured (start this engine with --kv-peer {rank}=ADDR)"
    )]
    UnknownRank { rank: u32 },

    #[error("invalid KV peer address {addr:?}: {reason}")]
    BadPeerAddr { addr: String, reason: String },

    #[error("a {kind} transport cannot use address {addr}")]
    WrongAddrKind { kind: TransportKind, addr: PeerAddr },

    #[error("cannot listen for KV transfers on {addr}: {source}")]
    Listen {
        addr: PeerAddr,
        source: std::io::Error,
    },

    #[error("KV peer rank {rank} at {addr}: {what}: {source}")]
    PeerIo {
        rank: u32,
        addr: PeerAddr,
        what: &'static str,
        source: std::io::Error,
    },

    #[error("KV peer rank {rank} at {addr}: {what} timed out after {after:?}")]
    Timeout {
        rank: u32,
        addr: PeerAddr,
        what: &'static str,
        after: Duration,
    },

    #[error("KV peer rank {rank} at {addr} broke the protocol: {reason}")]
    Protocol {
        rank: u32,
        addr: PeerAddr,
        reason: String,
    },

    #[error("KV peer rank {rank} at {addr} rejected the transfer: {reason}")]
    Rejected {
        rank: u32,
        addr: PeerAddr,
        reason: String,
    },

    #[error("invalid KV device {device:?}: expected \"cpu\" or \"cuda:N\"")]
    BadDevice { device: String },

    #[error(
        "the {kind} transport cannot move a KV pool on {device} (cuda needs a GPU pool, shm and tcp a CPU one)"
    )]
    TransportDevice {
        kind: TransportKind,
        device: KvDevice,
    },

    #[error(transparent)]
    Cuda(#[from] CudaError),
}

impl KvError {
    /// A `map_err` adapter: an I/O failure with peer `rank` at `addr` while doing `what`.
    pub(crate) fn peer_io<'a>(
        rank: u32,
        addr: &'a PeerAddr,
        what: &'static str,
    ) -> impl FnOnce(std::io::Error) -> KvError + 'a {
        move |source| KvError::PeerIo {
            rank,
            addr: addr.clone(),
            what,
            source,
        }
    }
}
