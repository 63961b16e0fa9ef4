//! [`KvTransport`]: one engine's sending and receiving side of the KV data path.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::time::Instant;

use super::runs::{CopyRun, common_runs, first_out_of_range};
use super::wire::Hello;
use super::{
    KvAddrInfo, KvDevice, KvError, KvShape, KvStore, PeerAddr, SlotRun, TransportKind, shm, tcp,
};

/// Everything a transport is built from. [`TransportConfig::new`] fills in sensible timeouts.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub kind: TransportKind,
    /// This engine's device rank. When set, peers check it against the rank they dialled, which
    /// catches swapped entries in a peer map.
    pub rank: Option<u32>,
    /// Where to receive transfers; `None` picks [`PeerAddr::ephemeral`].
    pub listen: Option<PeerAddr>,
    /// Device rank → address of every engine we may send to.
    pub peers: HashMap<u32, PeerAddr>,
    /// Bound on connecting to a peer and reading its hello.
    pub connect_timeout: Duration,
    /// Bound on one whole `send`, connection set-up included.
    pub transfer_timeout: Duration,
}

impl TransportConfig {
    pub fn new(kind: TransportKind) -> Self {
        TransportConfig {
            kind,
            rank: None,
            listen: None,
            peers: HashMap::new(),
            connect_timeout: Duration::from_secs(5),
            transfer_timeout: Duration::from_secs(60),
        }
    }
}

/// What one `send` moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferStats {
    pub bytes: u64,
    pub slots: u32,
    /// Contiguous copies (shm) or streamed runs (tcp) after merging adjacent slots.
    pub runs: u32,
    pub elapsed: Duration,
}

/// One transfer, checked against our own pool and ready for a transport.
pub(crate) struct Transfer<'a> {
    pub rank: u32,
    pub addr: &'a PeerAddr,
    pub copies: Vec<CopyRun>,
    pub dst_runs: &'a [SlotRun],
}

/// Moves KV from this engine's pool into peers' pools, and receives theirs into ours.
///
/// Dropping it stops the receiving side (the listener and every connection it accepted).
pub struct KvTransport {
    kind: TransportKind,
    store: Arc<KvStore>,
    listen_addr: PeerAddr,
    peers: RwLock<HashMap<u32, PeerAddr>>,
    transfer_timeout: Duration,
    sender: Sender,
    _receiver: ReceiverHandle,
}

enum Sender {
    Shm(shm::ShmSender),
    Tcp(tcp::TcpSender),
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::transport::CudaSender),
}

impl std::fmt::Debug for KvTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvTransport")
            .field("kind", &self.kind)
            .field("listen_addr", &self.listen_addr)
            .field("peers", &*self.peers.read())
            .finish_non_exhaustive()
    }
}

impl KvTransport {
    /// Starts the receiving side on `listen` (or an ephemeral address) and returns a transport
    /// that can send to `peers` (device rank → address).
    pub async fn start(
        kind: TransportKind,
        store: Arc<KvStore>,
        listen: Option<PeerAddr>,
        peers: HashMap<u32, PeerAddr>,
    ) -> Result<Self, KvError> {
        let config = TransportConfig {
            listen,
            peers,
            ..TransportConfig::new(kind)
        };
        Self::start_with(config, store).await
    }

    /// [`KvTransport::start`] with every knob.
    pub async fn start_with(config: TransportConfig, store: Arc<KvStore>) -> Result<Self, KvError> {
        let kind = config.kind;
        let listen = config.listen.unwrap_or_else(|| PeerAddr::ephemeral(kind));
        for addr in std::iter::once(&listen).chain(config.peers.values()) {
            check_addr_kind(kind, addr)?;
        }
        check_pool_device(kind, &store)?;
        let hello = Hello {
            rank: config.rank,
            shape: store.shape(),
            num_slots: store.num_slots(),
        };
        let (listen_addr, receiver, sender) = match kind {
            TransportKind::Shm => {
                let (addr, task, cleanup) = shm::start_receiver(&listen, store.clone(), hello)?;
                let sender = shm::ShmSender::new(store.clone(), config.connect_timeout);
                (addr, ReceiverHandle { task, cleanup }, Sender::Shm(sender))
            }
            TransportKind::Tcp => {
                let (addr, task) = tcp::start_receiver(&listen, store.clone(), hello).await?;
                let sender = tcp::TcpSender::new(store.clone(), config.connect_timeout);
                (
                    addr,
                    ReceiverHandle {
                        task,
                        cleanup: None,
                    },
                    Sender::Tcp(sender),
                )
            }
            #[cfg(feature = "cuda")]
            TransportKind::Cuda => {
                use super::cuda::transport::{CudaSender, HandleGreeting, PoolHandle, device_pool};
                let greeting = HandleGreeting {
                    hello,
                    handle: PoolHandle::of(device_pool(&store)?),
                };
                let (addr, task, cleanup) = shm::start_unix_receiver(&listen, greeting)?;
                let sender = CudaSender::new(store.clone(), config.connect_timeout)?;
                (addr, ReceiverHandle { task, cleanup }, Sender::Cuda(sender))
            }
            // Unreachable: without the feature no pool is on a GPU, so the device check above
            // refused already; kept as an error rather than a panic.
            #[cfg(not(feature = "cuda"))]
            TransportKind::Cuda => return Err(super::CudaError::NotBuilt.into()),
        };
        tracing::info!(%kind, listen = %listen_addr, shape = %store.shape(), "KV transport started");
        Ok(KvTransport {
            kind,
            store,
            listen_addr,
            peers: RwLock::new(config.peers),
            transfer_timeout: config.transfer_timeout,
            sender,
            _receiver: receiver,
        })
    }

    pub fn kind(&self) -> TransportKind {
        self.kind
    }

    /// The pool this transport sends from and receives into.
    pub fn store(&self) -> &Arc<KvStore> {
        &self.store
    }

    /// Where peers reach this engine's receiving side (the bound port when listening on port 0).
    pub fn listen_addr(&self) -> PeerAddr {
        self.listen_addr.clone()
    }

    /// Adds or replaces a peer; later sends to `rank` use the new address.
    pub fn add_peer(&self, rank: u32, addr: PeerAddr) -> Result<(), KvError> {
        check_addr_kind(self.kind, &addr)?;
        self.peers.write().insert(rank, addr);
        Ok(())
    }

    /// Copies `src_slots[i]` of our pool into `dst.slots()[i]` of the pool of the engine with
    /// device rank `dst_rank`. Returns once the bytes are in the destination pool.
    pub async fn send(
        &self,
        dst_rank: u32,
        src_slots: &[u32],
        dst: &KvAddrInfo,
    ) -> Result<TransferStats, KvError> {
        let started = Instant::now();
        let addr = self.peers.read().get(&dst_rank).cloned();
        let addr = addr.ok_or(KvError::UnknownRank { rank: dst_rank })?;
        let dst_runs = single_model(dst)?;
        check_lengths(src_slots, dst_runs)?;
        check_source_slots(src_slots, self.store.num_slots())?;
        let transfer = Transfer {
            rank: dst_rank,
            addr: &addr,
            copies: common_runs(src_slots, dst.slots()),
            dst_runs,
        };
        let runs = transfer.copies.len() as u32;
        if src_slots.is_empty() {
            return Ok(TransferStats {
                elapsed: started.elapsed(),
                ..TransferStats::default()
            });
        }
        let moving = async {
            match &self.sender {
                Sender::Shm(s) => s.send(&transfer).await,
                Sender::Tcp(s) => s.send(&transfer).await,
                #[cfg(feature = "cuda")]
                Sender::Cuda(s) => s.send(&transfer).await,
            }
        };
        let timeout = self.transfer_timeout;
        tokio::time::timeout(timeout, moving)
            .await
            .map_err(|_| KvError::Timeout {
                rank: dst_rank,
                addr: addr.clone(),
                what: "transfer",
                after: timeout,
            })??;
        let stats = TransferStats {
            bytes: src_slots.len() as u64 * self.store.shape().bytes_per_token() as u64,
            slots: src_slots.len() as u32,
            runs,
            elapsed: started.elapsed(),
        };
        tracing::debug!(rank = dst_rank, %addr, ?stats, "KV transfer done");
        Ok(stats)
    }
}

fn check_addr_kind(kind: TransportKind, addr: &PeerAddr) -> Result<(), KvError> {
    if kind.accepts(addr) {
        Ok(())
    } else {
        Err(KvError::WrongAddrKind {
            kind,
            addr: addr.clone(),
        })
    }
}

/// The cuda transport moves GPU pools only, shm and tcp host pools only.
fn check_pool_device(kind: TransportKind, store: &KvStore) -> Result<(), KvError> {
    let device = store.device();
    let on_gpu = matches!(device, KvDevice::Cuda(_));
    if on_gpu == (kind == TransportKind::Cuda) {
        Ok(())
    } else {
        Err(KvError::TransportDevice { kind, device })
    }
}

fn single_model(dst: &KvAddrInfo) -> Result<&[SlotRun], KvError> {
    match dst.models.as_slice() {
        [runs] => Ok(runs),
        models => Err(KvError::ModelCount {
            models: models.len(),
        }),
    }
}

fn check_lengths(src_slots: &[u32], dst_runs: &[SlotRun]) -> Result<(), KvError> {
    let dst: u64 = dst_runs.iter().map(|r| u64::from(r.len)).sum();
    if dst == src_slots.len() as u64 {
        Ok(())
    } else {
        Err(KvError::LengthMismatch {
            src: src_slots.len(),
            dst,
        })
    }
}

fn check_source_slots(src_slots: &[u32], num_slots: u32) -> Result<(), KvError> {
    match src_slots.iter().find(|&&s| s >= num_slots) {
        Some(&slot) => Err(KvError::SlotOutOfRange {
            side: "source",
            slot,
            num_slots,
        }),
        None => Ok(()),
    }
}

/// Checks a peer's hello against what we are about to send it.
pub(crate) fn check_hello(
    hello: &Hello,
    ours: KvShape,
    rank: u32,
    addr: &PeerAddr,
) -> Result<(), KvError> {
    if hello.shape != ours {
        return Err(KvError::ShapeMismatch {
            rank,
            ours,
            theirs: hello.shape,
        });
    }
    match hello.rank {
        Some(theirs) if theirs != rank => Err(KvError::Protocol {
            rank,
            addr: addr.clone(),
            reason: format!("the engine there says it is rank {theirs}"),
        }),
        _ => Ok(()),
    }
}

/// Checks destination runs against the peer's pool size.
pub(crate) fn check_destination(dst_runs: &[SlotRun], num_slots: u32) -> Result<(), KvError> {
    match first_out_of_range(dst_runs, num_slots) {
        Some(slot) => Err(KvError::SlotOutOfRange {
            side: "destination",
            slot,
            num_slots,
        }),
        None => Ok(()),
    }
}

/// Stops the receiving side when the transport is dropped.
struct ReceiverHandle {
    task: tokio::task::JoinHandle<()>,
    /// A socket file to unlink.
    cleanup: Option<std::path::PathBuf>,
}

impl Drop for ReceiverHandle {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(path) = &self.cleanup {
            let _ = std::fs::remove_file(path);
        }
    }
}
