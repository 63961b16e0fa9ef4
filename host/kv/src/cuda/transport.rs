//! The cuda transport: one-sided device copies into a peer's pool exported with CUDA IPC.
//!
//! The handshake is the shm transport's (a Unix socket, same user only, held open as a liveness
//! signal); instead of a memfd the receiver's hello is followed by a [`PoolHandle`]: its pid,
//! its pool's id in that process, and the pool's IPC memory handle. The sender opens the handle
//! once per peer (`cuIpcOpenMemHandle`) and copies merged runs straight into it on its own
//! stream, synchronised before `send` returns. A peer in the same process (CUDA refuses to open
//! a handle where it was made) is found by id in this process's pool registry instead.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

use super::copy::{CopyMethod, RunCopier};
use super::driver::{DeviceBuffer, IPC_HANDLE_LEN, ImportedBuffer};
use super::pool::{DevicePool, local_pool};
use crate::runs::CopyRun;
use crate::shm::{self, Greeting, HeldPeer, HeldPeers};
use crate::transport::{Transfer, check_destination, check_hello};
use crate::wire::Hello;
use crate::{CudaError, KvError, KvStore, PeerAddr};

/// What follows the hello on a cuda connection: `pid:u32 ordinal:u32 pool_id:u64 handle:[u8;64]`
/// (little-endian, 80 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolHandle {
    pub pid: u32,
    pub ordinal: u32,
    pub pool_id: u64,
    pub ipc: [u8; IPC_HANDLE_LEN],
}

impl PoolHandle {
    pub const LEN: usize = 16 + IPC_HANDLE_LEN;

    pub fn of(pool: &DevicePool) -> Self {
        PoolHandle {
            pid: std::process::id(),
            ordinal: pool.ordinal(),
            pool_id: pool.id(),
            ipc: pool.ipc_handle(),
        }
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.ordinal.to_le_bytes());
        out[8..16].copy_from_slice(&self.pool_id.to_le_bytes());
        out[16..].copy_from_slice(&self.ipc);
        out
    }

    pub fn decode(bytes: &[u8; Self::LEN]) -> Self {
        let word = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut pool_id = [0u8; 8];
        pool_id.copy_from_slice(&bytes[8..16]);
        let mut ipc = [0u8; IPC_HANDLE_LEN];
        ipc.copy_from_slice(&bytes[16..]);
        PoolHandle {
            pid: word(0),
            ordinal: word(4),
            pool_id: u64::from_le_bytes(pool_id),
            ipc,
        }
    }
}

// === receiver ===

/// The greeting of a cuda receiver: hello, then the pool handle.
pub(crate) struct HandleGreeting {
    pub hello: Hello,
    pub handle: PoolHandle,
}

impl Greeting for HandleGreeting {
    async fn send(&self, stream: &mut UnixStream) -> std::io::Result<()> {
        let mut bytes = self.hello.encode().to_vec();
        bytes.extend_from_slice(&self.handle.encode());
        stream.write_all(&bytes).await
    }
}

// === sender ===

/// The sending side: the peer pools it has opened, and one copier on our pool's device.
pub(crate) struct CudaSender {
    store: Arc<KvStore>,
    connect_timeout: Duration,
    copier: Arc<Mutex<RunCopier>>,
    method: CopyMethod,
    peers: HeldPeers<OpenedPeer>,
}

/// A peer's pool, reachable from our device.
struct OpenedPeer {
    addr: PeerAddr,
    num_slots: u32,
    memory: PeerMemory,
    method: CopyMethod,
    /// Kept open only to notice the peer going away (EOF).
    conn: UnixStream,
}

enum PeerMemory {
    /// Another process's pool, mapped with CUDA IPC.
    Imported(ImportedBuffer),
    /// A pool of this process; held weakly so a dropped pool is noticed, not kept alive.
    Local(std::sync::Weak<DeviceBuffer>),
}

impl CudaSender {
    pub(crate) fn new(store: Arc<KvStore>, connect_timeout: Duration) -> Result<Self, KvError> {
        let pool = device_pool(&store)?;
        let copier = RunCopier::new(pool.buffer().device().clone())?;
        Ok(CudaSender {
            method: copier.default_method(),
            copier: Arc::new(Mutex::new(copier)),
            store,
            connect_timeout,
            peers: HeldPeers::new(),
        })
    }

    pub(crate) async fn send(&self, transfer: &Transfer<'_>) -> Result<(), KvError> {
        let (rank, addr) = (transfer.rank, transfer.addr);
        let peer = self
            .peers
            .get_or_set_up(rank, addr, self.open_peer(rank, addr))
            .await?;
        check_destination(transfer.dst_runs, peer.num_slots)?;
        let dst = match &peer.memory {
            PeerMemory::Imported(imported) => Destination::Imported {
                ptr: imported.ptr(),
                _mapping: peer.clone(),
            },
            PeerMemory::Local(weak) => {
                Destination::Local(weak.upgrade().ok_or_else(|| KvError::Protocol {
                    rank,
                    addr: addr.clone(),
                    reason: "the peer's pool was dropped".into(),
                })?)
            }
        };
        let (store, copies, copier, method) = (
            self.store.clone(),
            transfer.copies.clone(),
            self.copier.clone(),
            peer.method,
        );
        // The copy blocks on the stream; the blocking pool keeps the runtime free meanwhile.
        // `dst` and `store` travel with the task, so a timed-out send cannot free them early.
        tokio::task::spawn_blocking(move || copy_to_peer(&copier, method, &store, &dst, &copies))
            .await
            .map_err(|e| KvError::PeerIo {
                rank,
                addr: addr.clone(),
                what: "copy task",
                source: std::io::Error::other(e.to_string()),
            })?
    }

    async fn open_peer(&self, rank: u32, addr: &PeerAddr) -> Result<OpenedPeer, KvError> {
        let after = self.connect_timeout;
        let io = |what| KvError::peer_io(rank, addr, what);
        let (conn, bytes) = tokio::time::timeout(after, async {
            let mut conn = shm::connect(addr).await.map_err(io("connect"))?;
            let mut bytes = [0u8; Hello::LEN + PoolHandle::LEN];
            tokio::io::AsyncReadExt::read_exact(&mut conn, &mut bytes)
                .await
                .map_err(io("read hello"))?;
            Ok::<_, KvError>((conn, bytes))
        })
        .await
        .map_err(|_| KvError::Timeout {
            rank,
            addr: addr.clone(),
            what: "connect and hello",
            after,
        })??;
        let (hello, handle) = bytes.split_at(Hello::LEN);
        let hello = Hello::decode(hello).map_err(|reason| KvError::Protocol {
            rank,
            addr: addr.clone(),
            reason,
        })?;
        check_hello(&hello, self.store.shape(), rank, addr)?;
        let handle = PoolHandle::decode(handle.try_into().map_err(|_| KvError::Protocol {
            rank,
            addr: addr.clone(),
            reason: "short pool handle".into(),
        })?);
        let (memory, method) = self.open_memory(&handle)?;
        tracing::info!(rank, %addr, device = handle.ordinal, num_slots = hello.num_slots, "opened KV cuda peer pool");
        Ok(OpenedPeer {
            addr: addr.clone(),
            num_slots: hello.num_slots,
            memory,
            method,
            conn,
        })
    }

    /// Maps the peer's pool, and picks how to copy into it: the kernel needs peer access to
    /// the destination, which IPC mappings enable (lazily) and same-process pools on another
    /// device do not have, so those get batched copies (unified addressing routes them).
    fn open_memory(&self, handle: &PoolHandle) -> Result<(PeerMemory, CopyMethod), KvError> {
        let ours = device_pool(&self.store)?;
        if handle.pid != std::process::id() {
            let device = ours.buffer().device().clone();
            let imported = ImportedBuffer::open(device, handle.ipc)?;
            return Ok((PeerMemory::Imported(imported), self.method));
        }
        let buffer = local_pool(handle.pool_id).ok_or_else(|| CudaError::Peer {
            reason: format!("pool {} of this process no longer exists", handle.pool_id),
        })?;
        let method = if handle.ordinal == ours.ordinal() {
            self.method
        } else {
            CopyMethod::Batched
        };
        Ok((PeerMemory::Local(Arc::downgrade(&buffer)), method))
    }
}

/// Copies checked runs from our pool into the peer's and waits for them.
#[allow(unsafe_code, reason = "copying between two checked pools")]
fn copy_to_peer(
    copier: &Mutex<RunCopier>,
    method: CopyMethod,
    store: &KvStore,
    dst: &Destination,
    copies: &[CopyRun],
) -> Result<(), KvError> {
    let src = device_pool(store)?.buffer().ptr();
    let bytes_per_slot = store.shape().bytes_per_token();
    // SAFETY: source runs were checked against our pool (`KvTransport::send`) and destination
    // runs against the peer's (`check_destination` in `send`); `store` and `dst` keep both
    // pools alive until this returns, after the copy is synchronised.
    unsafe {
        copier
            .lock()
            .copy_runs(method, src, dst.ptr(), copies, bytes_per_slot)
    }
}

impl HeldPeer for OpenedPeer {
    fn addr(&self) -> &PeerAddr {
        &self.addr
    }

    fn conn(&self) -> &UnixStream {
        &self.conn
    }
}

/// Where one send writes, kept alive for the copy.
enum Destination {
    Imported {
        ptr: CUdeviceptr,
        /// Holds the IPC mapping open until the copy is done.
        _mapping: Arc<OpenedPeer>,
    },
    Local(Arc<DeviceBuffer>),
}

impl Destination {
    fn ptr(&self) -> CUdeviceptr {
        match self {
            Destination::Imported { ptr, .. } => *ptr,
            Destination::Local(buffer) => buffer.ptr(),
        }
    }
}

/// The device pool of a store the cuda transport was started with.
pub(crate) fn device_pool(store: &KvStore) -> Result<&DevicePool, KvError> {
    store.device_pool().ok_or(KvError::TransportDevice {
        kind: crate::TransportKind::Cuda,
        device: store.device(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_handle_round_trips() {
        let handle = PoolHandle {
            pid: 4242,
            ordinal: 3,
            pool_id: u64::MAX - 7,
            ipc: std::array::from_fn(|i| i as u8),
        };
        assert_eq!(PoolHandle::decode(&handle.encode()), handle);
    }
}
