//! Same-host transport: one-sided copies into a peer's mapped pool.
//!
//! The receiver listens on a Unix socket and, on every connection, sends its hello with its
//! pool's memfd attached (`SCM_RIGHTS`), then keeps the connection open until the sender closes
//! it. The sender maps the pool once per peer and copies merged slot runs straight into it, like
//! an NVSHMEM put. The open connection doubles as a liveness signal: when it reads EOF the peer
//! has restarted, so the cached mapping (of a pool nobody reads any more) is replaced.
//!
//! Trust: the pool fd is handed only to processes of the receiver's own user (`SO_PEERCRED`).

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::SealFlags;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

use super::store::{Mapping, pool_bytes};
use super::transport::{Transfer, check_destination, check_hello};
use super::wire::Hello;
use super::{KvError, KvStore, PeerAddr};

/// A copy is cut into pieces of about this size with a yield between them, so a large transfer
/// neither stalls the async worker nor runs anywhere but inside the `send` future: when that
/// future is dropped (timeout, cancelled remote_send) the copy stops, and the caller may
/// release the source slots at once. (A copy on the blocking pool would go on reading them.)
const COPY_PIECE_BYTES: usize = 1 << 20;

// === receiver ===

/// What a Unix-socket receiver sends first on every connection it accepts (after checking the
/// peer runs as our user): shm sends the hello with the pool's memfd, cuda the hello and the
/// pool's IPC handle.
pub(crate) trait Greeting: Send + Sync + 'static {
    fn send(
        &self,
        stream: &mut UnixStream,
    ) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

/// The shm greeting: the hello with the pool's memfd attached.
struct PoolFd {
    store: Arc<KvStore>,
    hello: Hello,
}

impl Greeting for PoolFd {
    async fn send(&self, stream: &mut UnixStream) -> std::io::Result<()> {
        send_hello_with_fd(stream, &self.store, self.hello).await
    }
}

/// Binds `listen` and spawns the accept loop. Returns the address, the task and a socket file
/// to unlink on shutdown.
pub(crate) fn start_receiver(
    listen: &PeerAddr,
    store: Arc<KvStore>,
    hello: Hello,
) -> Result<
    (
        PeerAddr,
        tokio::task::JoinHandle<()>,
        Option<std::path::PathBuf>,
    ),
    KvError,
> {
    start_unix_receiver(listen, PoolFd { store, hello })
}

/// [`start_receiver`] with any [`Greeting`].
pub(crate) fn start_unix_receiver(
    listen: &PeerAddr,
    greeting: impl Greeting,
) -> Result<
    (
        PeerAddr,
        tokio::task::JoinHandle<()>,
        Option<std::path::PathBuf>,
    ),
    KvError,
> {
    let listener = bind(listen).map_err(|source| KvError::Listen {
        addr: listen.clone(),
        source,
    })?;
    let cleanup = match listen {
        PeerAddr::Unix(path) => Some(path.clone()),
        _ => None,
    };
    let task = tokio::spawn(accept_loop(listener, Arc::new(greeting)));
    Ok((listen.clone(), task, cleanup))
}

fn bind(addr: &PeerAddr) -> std::io::Result<UnixListener> {
    let std_listener = match addr {
        PeerAddr::Unix(path) => bind_path(path)?,
        PeerAddr::UnixAbstract(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            let sa = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            std::os::unix::net::UnixListener::bind_addr(&sa)?
        }
        PeerAddr::Tcp(_) => return Err(std::io::ErrorKind::InvalidInput.into()),
    };
    std_listener.set_nonblocking(true)?;
    UnixListener::from_std(std_listener)
}

/// Binds a socket path, replacing a stale socket file left by a dead process (nobody accepts
/// on it) but never one that a live engine is using.
fn bind_path(path: &std::path::Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    match std::os::unix::net::UnixListener::bind(path) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            match std::os::unix::net::UnixStream::connect(path) {
                Err(c) if c.kind() == std::io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path)?;
                    std::os::unix::net::UnixListener::bind(path)
                }
                _ => Err(e),
            }
        }
        other => other,
    }
}

async fn accept_loop<G: Greeting>(listener: UnixListener, greeting: Arc<G>) {
    // Owned here so aborting this task also ends every connection it accepted.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, greeting.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV shm accept failed");
                    // Typically EMFILE: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

async fn serve_connection<G: Greeting>(mut stream: UnixStream, greeting: Arc<G>) {
    if let Err(reason) = check_same_user(&stream) {
        tracing::warn!(%reason, "KV shm connection refused");
        return;
    }
    if let Err(e) = greeting.send(&mut stream).await {
        tracing::debug!(error = %e, "KV shm peer went away before the hello");
        return;
    }
    // Hold the connection until the sender closes it: its EOF is how each side learns the
    // other restarted. Senders never write here, so anything read is discarded.
    let mut sink = [0u8; 64];
    while let Ok(n) = stream.read(&mut sink).await {
        if n == 0 {
            break;
        }
    }
}

/// The pool fd grants write access to our KV, so only processes of our own user get it (an
/// abstract socket is reachable from the whole network namespace).
fn check_same_user(stream: &UnixStream) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(stream)
        .map_err(|e| format!("cannot read peer credentials: {e}"))?;
    let ours = rustix::process::geteuid();
    if cred.uid != ours {
        return Err(format!(
            "peer pid {:?} runs as uid {:?}, we run as {ours:?}",
            cred.pid, cred.uid
        ));
    }
    Ok(())
}

async fn send_hello_with_fd(
    stream: &UnixStream,
    store: &KvStore,
    hello: Hello,
) -> std::io::Result<()> {
    let bytes = hello.encode();
    let sent = stream
        .async_io(Interest::WRITABLE, || {
            let fds = [store.memfd()];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(std::io::Error::other("no room for SCM_RIGHTS"));
            }
            let iov = [IoSlice::new(&bytes)];
            Ok(rustix::net::sendmsg(
                stream,
                &iov,
                &mut control,
                SendFlags::NOSIGNAL,
            )?)
        })
        .await?;
    if sent != bytes.len() {
        return Err(std::io::Error::other(format!(
            "short hello write ({sent} bytes)"
        )));
    }
    Ok(())
}

// === sender ===

/// The sending side: one cached mapping per peer rank.
pub(crate) struct ShmSender {
    store: Arc<KvStore>,
    connect_timeout: Duration,
    /// An async mutex: connecting awaits, and two first sends to one peer should map it once.
    peers: HeldPeers<MappedPeer>,
}

/// A peer's pool, mapped into our address space.
struct MappedPeer {
    addr: PeerAddr,
    num_slots: u32,
    map: Mapping,
    /// Kept open only to notice the peer going away (EOF).
    conn: UnixStream,
}

/// False once the peer closed the handshake connection: it exited or restarted with a new pool.
fn is_alive(conn: &UnixStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(conn.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// A peer reached over a Unix handshake connection that stays open.
pub(crate) trait HeldPeer {
    /// Where it was reached.
    fn addr(&self) -> &PeerAddr;
    /// The handshake connection, held open only to notice the peer going away (EOF).
    fn conn(&self) -> &UnixStream;
}

impl HeldPeer for MappedPeer {
    fn addr(&self) -> &PeerAddr {
        &self.addr
    }

    fn conn(&self) -> &UnixStream {
        &self.conn
    }
}

/// Peers by rank, each set up once and replaced when the address changes or the peer restarted.
/// An async mutex: setting up awaits, and two first sends to one peer should set it up once.
pub(crate) struct HeldPeers<P> {
    peers: tokio::sync::Mutex<HashMap<u32, Arc<P>>>,
}

impl<P: HeldPeer> HeldPeers<P> {
    pub(crate) fn new() -> Self {
        HeldPeers {
            peers: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The cached peer `rank`, or the one `set_up` yields when there is none, the address
    /// changed, or the peer restarted (`set_up` is not polled otherwise).
    pub(crate) async fn get_or_set_up(
        &self,
        rank: u32,
        addr: &PeerAddr,
        set_up: impl std::future::Future<Output = Result<P, KvError>>,
    ) -> Result<Arc<P>, KvError> {
        let mut peers = self.peers.lock().await;
        if let Some(peer) = peers.get(&rank) {
            if peer.addr() == addr && is_alive(peer.conn()) {
                return Ok(peer.clone());
            }
            tracing::info!(rank, %addr, "KV peer changed or restarted; setting it up again");
            peers.remove(&rank);
        }
        let peer = Arc::new(set_up.await?);
        peers.insert(rank, peer.clone());
        Ok(peer)
    }
}

impl ShmSender {
    pub(crate) fn new(store: Arc<KvStore>, connect_timeout: Duration) -> Self {
        ShmSender {
            store,
            connect_timeout,
            peers: HeldPeers::new(),
        }
    }

    pub(crate) async fn send(&self, transfer: &Transfer<'_>) -> Result<(), KvError> {
        let (rank, addr) = (transfer.rank, transfer.addr);
        let peer = self
            .peers
            .get_or_set_up(rank, addr, self.map_peer(rank, addr))
            .await?;
        check_destination(transfer.dst_runs, peer.num_slots)?;
        copy_runs(&self.store, &peer.map, &transfer.copies).await;
        Ok(())
    }

    async fn map_peer(&self, rank: u32, addr: &PeerAddr) -> Result<MappedPeer, KvError> {
        let after = self.connect_timeout;
        let timeout = || KvError::Timeout {
            rank,
            addr: addr.clone(),
            what: "connect and hello",
            after,
        };
        let io = |what| KvError::peer_io(rank, addr, what);
        let protocol = |reason: String| KvError::Protocol {
            rank,
            addr: addr.clone(),
            reason,
        };

        let (conn, hello, memfd) = tokio::time::timeout(after, async {
            let conn = connect(addr).await.map_err(io("connect"))?;
            let (hello, memfd) = recv_hello_with_fd(&conn).await.map_err(io("read hello"))?;
            Ok::<_, KvError>((conn, hello, memfd))
        })
        .await
        .map_err(|_| timeout())??;

        let hello = Hello::decode(&hello).map_err(protocol)?;
        check_hello(&hello, self.store.shape(), rank, addr)?;
        let memfd = memfd.ok_or_else(|| protocol("the hello carried no pool fd".into()))?;
        let len = pool_bytes(hello.shape, hello.num_slots)
            .map_err(|e| protocol(format!("unusable pool: {e}")))?;
        check_pool_fd(&memfd, len).map_err(protocol)?;
        let map = Mapping::map_shared(memfd.as_fd(), len).map_err(io("map pool"))?;
        tracing::info!(rank, %addr, num_slots = hello.num_slots, "mapped KV shm peer pool");
        Ok(MappedPeer {
            addr: addr.clone(),
            num_slots: hello.num_slots,
            map,
            conn,
        })
    }
}

pub(crate) async fn connect(addr: &PeerAddr) -> std::io::Result<UnixStream> {
    match addr {
        PeerAddr::Unix(path) => UnixStream::connect(path).await,
        PeerAddr::UnixAbstract(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            let sa = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            // A Unix connect never waits on the network; at worst on a full backlog, so it runs
            // on the blocking pool under the caller's timeout.
            let std_stream = tokio::task::spawn_blocking(move || {
                std::os::unix::net::UnixStream::connect_addr(&sa)
            })
            .await
            .map_err(std::io::Error::other)??;
            std_stream.set_nonblocking(true)?;
            UnixStream::from_std(std_stream)
        }
        PeerAddr::Tcp(_) => Err(std::io::ErrorKind::InvalidInput.into()),
    }
}

/// Reads the hello and the fd attached to it.
async fn recv_hello_with_fd(conn: &UnixStream) -> std::io::Result<(Vec<u8>, Option<OwnedFd>)> {
    conn.async_io(Interest::READABLE, || {
        let mut bytes = [0u8; Hello::LEN + 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut bytes)];
        let msg = rustix::net::recvmsg(conn, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
        let mut fd = None;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = message {
                // Extra fds (there should be none) are closed as they drop.
                for received in fds {
                    fd.get_or_insert(received);
                }
            }
        }
        Ok((bytes[..msg.bytes].to_vec(), fd))
    })
    .await
}

/// The fd must be a memfd at least `len` bytes long and sealed against shrinking, so the
/// mapping can never lose its backing (SIGBUS).
fn check_pool_fd(fd: &OwnedFd, len: usize) -> Result<(), String> {
    let seals =
        rustix::fs::fcntl_get_seals(fd).map_err(|e| format!("pool fd has no seals: {e}"))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err("pool fd is not sealed against shrinking".into());
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| format!("fstat of pool fd: {e}"))?
        .st_size;
    if u64::try_from(size).unwrap_or(0) < len as u64 {
        return Err(format!(
            "pool fd holds {size} bytes, the hello promises {len}"
        ));
    }
    Ok(())
}

/// The copies themselves, in pieces of [`COPY_PIECE_BYTES`], then a fence so they are ordered
/// before whatever tells the peer they are done (the HTTP answer to remote_send).
async fn copy_runs(store: &KvStore, dst: &Mapping, copies: &[super::runs::CopyRun]) {
    let bpt = store.shape().bytes_per_token();
    let piece = (COPY_PIECE_BYTES / bpt).max(1) as u32;
    for c in copies {
        let mut done = 0;
        while done < c.len {
            let n = piece.min(c.len - done);
            store.mapping().copy_to(
                store.slot_offset(c.src + done),
                dst,
                (c.dst + done) as usize * bpt,
                n as usize * bpt,
            );
            done += n;
            tokio::task::yield_now().await;
        }
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::Poll;
    use std::time::{Duration, Instant};

    use super::super::tests::{SLOTS, pair};
    use super::*;
    use crate::{KvAddrInfo, KvShape, TransportKind};

    #[tokio::test]
    async fn a_dropped_send_stops_copying() {
        // 16 KiB slots: 400 contiguous slots are one run of ~6 MiB, copied in 1 MiB pieces.
        let shape = KvShape {
            layers: 4,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        };
        let p_store = Arc::new(KvStore::new(shape, SLOTS).unwrap());
        let d_store = Arc::new(KvStore::new(shape, SLOTS).unwrap());
        let ones = vec![1u8; shape.bytes_per_token()];
        for slot in 0..400 {
            p_store.write_slot(slot, &ones);
        }
        let (p, _d) = pair(TransportKind::Shm, p_store, d_store.clone()).await;
        let src: Vec<u32> = (0..400).collect();
        let dst = KvAddrInfo::from_slots(0..400);
        let mut send = Box::pin(p.send(1, &src, &dst));
        // Poll until the first piece has landed, then drop the send mid-copy.
        let deadline = Instant::now() + Duration::from_secs(10);
        while d_store.read_slot_to_vec(0) != ones {
            assert!(Instant::now() < deadline, "the copy never started");
            let polled = futures::poll!(send.as_mut());
            assert!(matches!(polled, Poll::Pending), "one poll copied it all");
            tokio::task::yield_now().await;
        }
        drop(send);
        // Move more bytes than the dropped send had left, elsewhere in the pool: a copy that
        // went on behind the caller's back (on the blocking pool) would be done by then.
        let rest = KvAddrInfo::from_slots(400..SLOTS);
        let some: Vec<u32> = (0..SLOTS - 400).collect();
        for _ in 0..4 {
            p.send(1, &some, &rest).await.expect("a later send");
        }
        // Nothing was copied after the drop: the source slots could be reused at once.
        assert_eq!(d_store.read_slot_to_vec(399), vec![0; ones.len()]);
    }
}
