//! Any-host transport: framed, pipelined byte streams over TCP.
//!
//! The receiver sends its hello on accept, then serves requests one after another on the
//! connection: run list, then the bytes of every run, read straight into its pool; one ack per
//! request once every byte is written. The sender keeps a few idle connections per peer, writes
//! the whole request without waiting (straight from its pool), and returns after the ack.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::runs::CopyRun;
use super::store::Mapping;
use super::transport::{Transfer, check_destination, check_hello};
use super::wire::{self, Hello};
use super::{KvError, KvStore, PeerAddr, SlotRun};

/// Idle connections kept per peer; more concurrent sends than this open and close extras.
const MAX_IDLE_PER_PEER: usize = 4;
/// Socket buffering on each side: enough to batch small runs, and large runs bypass it.
const IO_BUFFER_BYTES: usize = 256 << 10;

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
    let task = tokio::spawn(accept_loop(listener, store, hello));
    Ok((bound, task))
}

async fn accept_loop(listener: TcpListener, store: Arc<KvStore>, hello: Hello) {
    // Owned here so aborting this task also ends every connection it accepted.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
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
        match reader.read_exact(&mut head).await {
            Ok(_) => {}
            // The sender closed an idle connection: the normal way out.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let runs = match read_runs(&mut reader, &head, store.num_slots()).await? {
            Ok(runs) => runs,
            Err(reason) => {
                // The payload's length cannot be trusted, so the stream cannot be resynchronised:
                // say why and close.
                write_half
                    .write_all(&wire::encode_ack(Err(&reason)))
                    .await?;
                return Err(std::io::Error::other(reason));
            }
        };
        let written = receive_payload(&mut reader, &store, &runs).await?;
        write_half.write_all(&wire::encode_ack(Ok(written))).await?;
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

/// Reads every run's bytes straight into the pool; returns the byte count.
async fn receive_payload(
    reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    store: &KvStore,
    runs: &[SlotRun],
) -> std::io::Result<u64> {
    let bpt = store.shape().bytes_per_token();
    let mut written = 0u64;
    for run in runs {
        let len = run.len as usize * bpt;
        reader
            .read_exact(reserved_slots_mut(
                store.mapping(),
                store.slot_offset(run.begin),
                len,
            ))
            .await?;
        written += len as u64;
    }
    Ok(written)
}

/// The destination bytes of a transfer, borrowed for the socket read.
#[expect(
    unsafe_code,
    reason = "reading the socket straight into the shared pool"
)]
#[expect(
    clippy::mut_from_ref,
    reason = "exclusivity comes from the slot reservation"
)]
fn reserved_slots_mut(map: &Mapping, offset: usize, len: usize) -> &mut [u8] {
    // SAFETY: these slots were reserved for this transfer by the engine (prep_recv); by the
    // pool's ownership invariant only the transport writes them and nobody reads them until
    // start_generate, which the router sends only after this transfer is acked.
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
        let io = |what| {
            move |source| KvError::PeerIo {
                rank,
                addr: addr.clone(),
                what,
                source,
            }
        };
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
        let io = |what| {
            move |source| KvError::PeerIo {
                rank,
                addr: addr.clone(),
                what,
                source,
            }
        };
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
