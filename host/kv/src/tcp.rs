//! Any-host transport: framed, pipelined byte streams over TCP.
//!
//! The receiver sends its hello on accept, then serves requests one after another on the
//! connection: run list, then the bytes of every run, read straight into its pool; one ack per
//! request once every byte is written. The sender keeps a few idle connections per peer, writes
//! the whole request without waiting (straight from its pool), and returns after the ack.
//!
//! Trust: anyone who reaches the listener can write the slots an engine has open (the pool's
//! [`SlotGate`](super::SlotGate) refuses every other slot), so it belongs on a trusted network.
//! The receiver bounds what one peer can hold: [`MAX_CONNECTIONS`] connections, and
//! [`IDLE_TIMEOUT`] / [`REQUEST_TIMEOUT`] on reads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::gate::WriteClaim;
use super::runs::CopyRun;
use super::store::Mapping;
use super::transport::{Transfer, check_destination, check_hello};
use super::wire::{self, Hello};
use super::{KvError, KvStore, PeerAddr, SlotRun};

/// Idle connections kept per peer; more concurrent sends than this open and close extras.
const MAX_IDLE_PER_PEER: usize = 4;
/// Socket buffering on each side: enough to batch small runs, and large runs bypass it.
const IO_BUFFER_BYTES: usize = 256 << 10;
/// Connections a receiver serves at once; more wait in the listen backlog. Senders keep at most
/// [`MAX_IDLE_PER_PEER`] idle ones per peer, so this allows dozens of busy peers.
const MAX_CONNECTIONS: usize = 256;
/// An idle connection (no request started) is closed after this: senders reconnect on demand.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest one request may take from its first byte to its last (twice a sender's default
/// transfer bound), so a peer that stops sending cannot hold a claim on open slots forever.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

// === receiver ===

pub(crate) async fn start_receiver(
    listen: &PeerAddr,
    store: Arc<KvStore>,
    hello: Hello,
) -> Result<(PeerAddr, tokio::task::JoinHandle<()>), KvError> {
    let listen_err = |source| KvError::Listen {
        addr: listen.clone(),
        source,
    };
    let PeerAddr::Tcp(sock_addr) = listen else {
        return Err(listen_err(std::io::ErrorKind::InvalidInput.into()));
    };
    let listener = TcpListener::bind(sock_addr).await.map_err(listen_err)?;
    let bound = PeerAddr::Tcp(listener.local_addr().map_err(listen_err)?);
    if !sock_addr.ip().is_loopback() {
        tracing::warn!(listen = %bound, "KV tcp receiver is not on loopback: anyone who reaches it can write this engine's reserved KV slots; keep it on a trusted network");
    }
    let task = tokio::spawn(accept_loop(listener, store, hello));
    Ok((bound, task))
}

async fn accept_loop(listener: TcpListener, store: Arc<KvStore>, hello: Hello) {
    // Owned here so aborting this task also ends every connection it accepted.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept(), if connections.len() < MAX_CONNECTIONS => match accepted {
                Ok((stream, peer)) => {
                    let store = store.clone();
                    connections.spawn(async move {
                        if let Err(e) = serve_connection(stream, store, hello).await {
                            tracing::debug!(%peer, error = %e, "KV tcp connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV tcp accept failed");
                    // Typically EMFILE: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    store: Arc<KvStore>,
    hello: Hello,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let (read_half, mut write_half) = stream.into_split();
    let mut reader = BufReader::with_capacity(IO_BUFFER_BYTES, read_half);
    write_half.write_all(&hello.encode()).await?;
    loop {
        let mut head = [0u8; wire::REQUEST_HEAD_LEN];
        match tokio::time::timeout(IDLE_TIMEOUT, reader.read_exact(&mut head)).await {
            Ok(Ok(_)) => {}
            // The sender closed an idle connection, or left it idle too long: the normal ways out.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(_) => return Ok(()),
            Ok(Err(e)) => return Err(e),
        }
        let answer =
            tokio::time::timeout(REQUEST_TIMEOUT, serve_request(&mut reader, &head, &store))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "request stalled")
                })??;
        match answer {
            Answer::Written(bytes) => write_half.write_all(&wire::encode_ack(Ok(bytes))).await?,
            Answer::Refused(reason) => {
                write_half
                    .write_all(&wire::encode_ack(Err(&reason)))
                    .await?;
            }
            Answer::Malformed(reason) => {
                // The payload's length cannot be trusted, so the stream cannot be resynchronised:
                // say why and close.
                write_half
                    .write_all(&wire::encode_ack(Err(&reason)))
                    .await?;
                return Err(std::io::Error::other(reason));
            }
        }
    }
}

/// How one request ended, short of an I/O error.
enum Answer {
    /// Every byte is in the pool.
    Written(u64),
    /// Well-formed but not allowed (slots not open); its payload was skipped.
    Refused(String),
    /// Malformed run list.
    Malformed(String),
}

/// Reads one request after its head: the run list, then its payload into the claimed slots (or
/// past them, when the gate refuses the slots).
async fn serve_request(
    reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    head: &[u8; wire::REQUEST_HEAD_LEN],
    store: &KvStore,
) -> std::io::Result<Answer> {
    let runs = match read_runs(reader, head, store.num_slots()).await? {
        Ok(runs) => runs,
        Err(reason) => return Ok(Answer::Malformed(reason)),
    };
    match store.gate().claim(&runs) {
        Ok(claim) => receive_payload(reader, store, &claim)
            .await
            .map(Answer::Written),
        Err(refused) => {
            let bytes: u64 = runs.iter().map(|r| u64::from(r.len)).sum::<u64>()
                * store.shape().bytes_per_token() as u64;
            tokio::io::copy(&mut (&mut *reader).take(bytes), &mut tokio::io::sink()).await?;
            Ok(Answer::Refused(refused.to_string()))
        }
    }
}

/// Reads and checks the run list. The outer error is I/O, the inner a rejected request.
async fn read_runs(
    reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    head: &[u8; wire::REQUEST_HEAD_LEN],
    num_slots: u32,
) -> std::io::Result<Result<Vec<SlotRun>, String>> {
    let num_runs = match wire::decode_request_head(head) {
        Ok(n) => n,
        Err(reason) => return Ok(Err(reason)),
    };
    // Runs are non-empty and in range, so a valid request never has more runs than slots.
    if num_runs > num_slots {
        return Ok(Err(format!(
            "{num_runs} runs for a pool of {num_slots} slots"
        )));
    }
    let mut bytes = vec![0u8; num_runs as usize * 8];
    reader.read_exact(&mut bytes).await?;
    let runs = wire::decode_runs(&bytes);
    if let Some(run) = runs.iter().find(|r| r.len == 0) {
        return Ok(Err(format!("empty run at slot {}", run.begin)));
    }
    if let Some(slot) = super::runs::first_out_of_range(&runs, num_slots) {
        return Ok(Err(format!(
            "slot {slot} is out of range: the pool has {num_slots} slots"
        )));
    }
    Ok(Ok(runs))
}

/// Reads every claimed run's bytes straight into the pool; returns the byte count.
async fn receive_payload(
    reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    store: &KvStore,
    claim: &WriteClaim<'_>,
) -> std::io::Result<u64> {
    let bpt = store.shape().bytes_per_token();
    let mut written = 0u64;
    for run in claim.runs() {
        let len = run.len as usize * bpt;
        #[expect(
            unsafe_code,
            reason = "reading the socket straight into the shared pool"
        )]
        // SAFETY: `run` is one of `claim`'s runs and `claim` outlives the borrow (it is held
        // across this await).
        let bytes =
            unsafe { claimed_slots_mut(store.mapping(), store.slot_offset(run.begin), len) };
        reader.read_exact(bytes).await?;
        written += len as u64;
    }
    Ok(written)
}

/// The destination bytes of a transfer, borrowed for the socket read.
///
/// # Safety
/// `offset..offset + len` must be slots of a [`WriteClaim`] that lives as long as the slice: the
/// claim keeps every other receiver out, and `KvStore::read_slot`/`write_slot` refuse claimed
/// slots, so nothing else reads or writes these bytes in this process. (A one-sided peer
/// writing the same pool from another process is outside the gate; engines never use a tcp
/// receiver's pool for one.)
#[expect(
    unsafe_code,
    reason = "reading the socket straight into the shared pool"
)]
#[expect(
    clippy::mut_from_ref,
    reason = "exclusivity comes from the caller's WriteClaim"
)]
unsafe fn claimed_slots_mut(map: &Mapping, offset: usize, len: usize) -> &mut [u8] {
    // SAFETY: exclusive per this fn's contract; `slice_mut` checks the bounds.
    unsafe { map.slice_mut(offset, len) }
}

// === sender ===

/// The sending side: a small pool of idle connections per peer rank.
pub(crate) struct TcpSender {
    store: Arc<KvStore>,
    connect_timeout: Duration,
    idle: parking_lot::Mutex<HashMap<u32, Vec<Conn>>>,
}

struct Conn {
    addr: PeerAddr,
    num_slots: u32,
    stream: BufWriter<TcpStream>,
}

impl TcpSender {
    pub(crate) fn new(store: Arc<KvStore>, connect_timeout: Duration) -> Self {
        TcpSender {
            store,
            connect_timeout,
            idle: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    pub(crate) async fn send(&self, transfer: &Transfer<'_>) -> Result<(), KvError> {
        if let Some(mut conn) = self.checkout(transfer.rank, transfer.addr) {
            match self.transfer_on(&mut conn, transfer).await {
                Ok(()) => {
                    self.checkin(transfer.rank, conn);
                    return Ok(());
                }
                // A pooled connection may have died while idle (peer restarted). Rewriting the
                // same bytes into the same slots is harmless, so retry once on a fresh one.
                Err(e @ KvError::PeerIo { .. }) => {
                    tracing::debug!(error = %e, "pooled KV tcp connection failed; reconnecting");
                }
                Err(e) => return Err(e),
            }
        }
        let mut conn = self.connect(transfer.rank, transfer.addr).await?;
        self.transfer_on(&mut conn, transfer).await?;
        self.checkin(transfer.rank, conn);
        Ok(())
    }

    fn checkout(&self, rank: u32, addr: &PeerAddr) -> Option<Conn> {
        let mut idle = self.idle.lock();
        let conns = idle.get_mut(&rank)?;
        // Connections to an address the peer map no longer names are dropped.
        conns.retain(|c| c.addr == *addr);
        conns.pop()
    }

    fn checkin(&self, rank: u32, conn: Conn) {
        let mut idle = self.idle.lock();
        let conns = idle.entry(rank).or_default();
        if conns.len() < MAX_IDLE_PER_PEER {
            conns.push(conn);
        }
    }

    async fn connect(&self, rank: u32, addr: &PeerAddr) -> Result<Conn, KvError> {
        let after = self.connect_timeout;
        let io = |what| KvError::peer_io(rank, addr, what);
        let PeerAddr::Tcp(sock_addr) = addr else {
            return Err(io("connect")(std::io::ErrorKind::InvalidInput.into()));
        };
        let (stream, hello) = tokio::time::timeout(after, async {
            let mut stream = TcpStream::connect(sock_addr).await.map_err(io("connect"))?;
            stream.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
            let mut hello = [0u8; Hello::LEN];
            stream
                .read_exact(&mut hello)
                .await
                .map_err(io("read hello"))?;
            Ok::<_, KvError>((stream, hello))
        })
        .await
        .map_err(|_| KvError::Timeout {
            rank,
            addr: addr.clone(),
            what: "connect and hello",
            after,
        })??;
        let hello = Hello::decode(&hello).map_err(|reason| KvError::Protocol {
            rank,
            addr: addr.clone(),
            reason,
        })?;
        check_hello(&hello, self.store.shape(), rank, addr)?;
        Ok(Conn {
            addr: addr.clone(),
            num_slots: hello.num_slots,
            stream: BufWriter::with_capacity(IO_BUFFER_BYTES, stream),
        })
    }

    /// Writes the whole request, then waits for the ack.
    async fn transfer_on(&self, conn: &mut Conn, transfer: &Transfer<'_>) -> Result<(), KvError> {
        let (rank, addr) = (transfer.rank, transfer.addr);
        check_destination(transfer.dst_runs, conn.num_slots)?;
        let io = |what| KvError::peer_io(rank, addr, what);
        let dst_runs = super::runs::merge_slots(transfer.dst_runs.iter().flat_map(SlotRun::slots));
        let stream = &mut conn.stream;
        stream
            .write_all(&wire::encode_request_head(&dst_runs))
            .await
            .map_err(io("write request"))?;
        for copy in &transfer.copies {
            stream
                .write_all(self.source_bytes(copy))
                .await
                .map_err(io("write payload"))?;
        }
        stream.flush().await.map_err(io("write payload"))?;

        let mut head = [0u8; wire::ACK_HEAD_LEN];
        stream.read_exact(&mut head).await.map_err(io("read ack"))?;
        let protocol = |reason| KvError::Protocol {
            rank,
            addr: addr.clone(),
            reason,
        };
        let (ok, written, msg_len) = wire::decode_ack_head(&head).map_err(protocol)?;
        let mut msg = vec![0u8; msg_len as usize];
        stream.read_exact(&mut msg).await.map_err(io("read ack"))?;
        if !ok {
            let reason = String::from_utf8_lossy(&msg).into_owned();
            return Err(KvError::Rejected {
                rank,
                addr: addr.clone(),
                reason,
            });
        }
        let expected: u64 = transfer
            .copies
            .iter()
            .map(|c| u64::from(c.len))
            .sum::<u64>()
            * self.store.shape().bytes_per_token() as u64;
        if written != expected {
            return Err(protocol(format!(
                "acked {written} bytes, we sent {expected}"
            )));
        }
        Ok(())
    }

    /// Our pool's bytes for one copy, borrowed for the socket write.
    #[expect(
        unsafe_code,
        reason = "writing straight from the shared pool to the socket"
    )]
    fn source_bytes(&self, copy: &CopyRun) -> &[u8] {
        let len = copy.len as usize * self.store.shape().bytes_per_token();
        // SAFETY: the engine holds these source slots for the duration of remote_send (the
        // pool's ownership invariant), so nobody writes them while the slice lives.
        unsafe {
            self.store
                .mapping()
                .slice(self.store.slot_offset(copy.src), len)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::tests::{SLOTS, pair};
    use super::*;
    use crate::{KvAddrInfo, KvShape, TransportKind};

    fn guarded_pool() -> Arc<KvStore> {
        Arc::new(
            KvStore::new(KvShape::SMALL, SLOTS)
                .unwrap()
                .with_guarded_slots(),
        )
    }

    fn rejection(result: Result<crate::TransferStats, KvError>) -> String {
        match result {
            Err(KvError::Rejected { reason, .. }) => reason,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_guarded_receiver_writes_only_open_unclaimed_slots() {
        let p_store = Arc::new(KvStore::new(KvShape::SMALL, SLOTS).unwrap());
        let d_store = guarded_pool();
        let bytes = vec![9u8; KvShape::SMALL.bytes_per_token()];
        p_store.write_slot(0, &bytes);
        let (p, _d) = pair(TransportKind::Tcp, p_store, d_store.clone()).await;
        let dst = KvAddrInfo::from_slots([40]);

        // Nothing reserved yet: refused, and the slot is untouched.
        let reason = rejection(p.send(1, &[0], &dst).await);
        assert!(reason.contains("not reserved"), "{reason}");
        assert_eq!(d_store.read_slot_to_vec(40), vec![0; bytes.len()]);

        // Reserved: written, on the same pooled connection (the refusal kept it in sync).
        d_store.gate().open([40]);
        p.send(1, &[0], &dst).await.expect("open slot");
        assert_eq!(d_store.read_slot_to_vec(40), bytes);

        // Another transfer writing it: refused.
        let claim = d_store.gate().claim(&dst.models[0]).unwrap();
        let reason = rejection(p.send(1, &[0], &dst).await);
        assert!(reason.contains("already being written"), "{reason}");
        drop(claim);

        // Closed again (start_generate or expiry): a late push is refused.
        d_store.gate().close([40]);
        rejection(p.send(1, &[0], &dst).await);
    }
}
