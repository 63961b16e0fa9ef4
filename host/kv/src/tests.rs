//! Transfers between two pools inside one process, over real sockets on loopback.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};

use super::*;

pub(super) const SLOTS: u32 = 512;

fn store(shape: KvShape) -> Arc<KvStore> {
    Arc::new(KvStore::new(shape, SLOTS).unwrap())
}

/// Fills every slot with random bytes and returns a copy of the pool's contents per slot.
pub(super) fn fill_random(store: &KvStore, rng: &mut StdRng) -> Vec<Vec<u8>> {
    (0..store.num_slots())
        .map(|slot| {
            let mut bytes = vec![0u8; store.shape().bytes_per_token()];
            rng.fill_bytes(&mut bytes);
            store.write_slot(slot, &bytes);
            bytes
        })
        .collect()
}

/// `n` distinct slots laid out as shuffled pages of `page` slots: runs of random lengths.
pub(super) fn scattered_slots(rng: &mut StdRng, n: usize, page: u32) -> Vec<u32> {
    let mut pages: Vec<u32> = (0..SLOTS / page).collect();
    pages.shuffle(rng);
    pages
        .into_iter()
        .flat_map(|p| p * page..(p + 1) * page)
        .take(n)
        .collect()
}

fn config(kind: TransportKind, rank: u32, peers: HashMap<u32, PeerAddr>) -> TransportConfig {
    TransportConfig {
        rank: Some(rank),
        peers,
        connect_timeout: Duration::from_secs(2),
        transfer_timeout: Duration::from_secs(10),
        ..TransportConfig::new(kind)
    }
}

/// A receiving engine with rank 1 and a sending engine with rank 0 that knows it.
pub(super) async fn pair(
    kind: TransportKind,
    p_store: Arc<KvStore>,
    d_store: Arc<KvStore>,
) -> (KvTransport, KvTransport) {
    let d = KvTransport::start_with(config(kind, 1, HashMap::new()), d_store)
        .await
        .unwrap();
    let peers = HashMap::from([(1, d.listen_addr())]);
    let p = KvTransport::start_with(config(kind, 0, peers), p_store)
        .await
        .unwrap();
    (p, d)
}

async fn transfers_random_runs_exactly(kind: TransportKind) {
    let mut rng = StdRng::seed_from_u64(7);
    let (p_store, d_store) = (store(KvShape::SMALL), store(KvShape::SMALL));
    let src_bytes = fill_random(&p_store, &mut rng);
    let (p, _d) = pair(kind, p_store.clone(), d_store.clone()).await;

    let mut expected: Vec<Option<&[u8]>> = vec![None; SLOTS as usize];
    // Several transfers over one cached mapping / pooled connection, disjoint destinations.
    let dst_all = scattered_slots(&mut rng, 3 * 100, 4);
    for (i, (n, page)) in [(100usize, 16u32), (37, 1), (100, 4)]
        .into_iter()
        .enumerate()
    {
        let src = scattered_slots(&mut rng, n, page);
        let dst_slots = &dst_all[i * 100..i * 100 + n];
        let dst = KvAddrInfo::decode(&KvAddrInfo::from_slots(dst_slots.iter().copied()).encode())
            .unwrap();
        let stats = p.send(1, &src, &dst).await.unwrap();
        assert_eq!(stats.slots as usize, n);
        assert_eq!(stats.bytes, (n * KvShape::SMALL.bytes_per_token()) as u64);
        assert!(stats.runs >= 1 && stats.runs as usize <= n);
        for (&s, &d) in src.iter().zip(dst_slots) {
            expected[d as usize] = Some(&src_bytes[s as usize]);
        }
    }
    let zeros = vec![0u8; KvShape::SMALL.bytes_per_token()];
    for (slot, want) in expected.iter().enumerate() {
        let got = d_store.read_slot_to_vec(slot as u32);
        assert_eq!(got, want.unwrap_or(&zeros), "destination slot {slot}");
    }
    // The sender's pool is read, never written.
    for (slot, want) in src_bytes.iter().enumerate() {
        assert_eq!(
            &p_store.read_slot_to_vec(slot as u32),
            want,
            "source slot {slot}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_transfers_random_runs_exactly() {
    transfers_random_runs_exactly(TransportKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_transfers_random_runs_exactly() {
    transfers_random_runs_exactly(TransportKind::Tcp).await;
}

/// Large enough for shm's blocking-pool path and for tcp writes that exceed socket buffers.
async fn transfers_large_runs(kind: TransportKind) {
    let mut rng = StdRng::seed_from_u64(11);
    let shape = KvShape {
        layers: 4,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    }; // 16 KiB
    let (p_store, d_store) = (store(shape), store(shape));
    let src_bytes = fill_random(&p_store, &mut rng);
    let (p, _d) = pair(kind, p_store, d_store.clone()).await;
    let src = scattered_slots(&mut rng, 400, 16);
    let dst_slots = scattered_slots(&mut rng, 400, 16);
    p.send(1, &src, &KvAddrInfo::from_slots(dst_slots.iter().copied()))
        .await
        .unwrap();
    for (&s, &d) in src.iter().zip(&dst_slots) {
        assert!(
            d_store.read_slot_to_vec(d) == src_bytes[s as usize],
            "slot {s} → {d}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_transfers_large_runs() {
    transfers_large_runs(TransportKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_transfers_large_runs() {
    transfers_large_runs(TransportKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_concurrent_sends_to_one_peer() {
    let mut rng = StdRng::seed_from_u64(3);
    let (p_store, d_store) = (store(KvShape::SMALL), store(KvShape::SMALL));
    let src_bytes = fill_random(&p_store, &mut rng);
    let (p, _d) = pair(TransportKind::Tcp, p_store, d_store.clone()).await;
    let p = Arc::new(p);
    let dst_all = scattered_slots(&mut rng, 8 * 32, 8);
    let mut tasks = tokio::task::JoinSet::new();
    for chunk in dst_all.chunks(32) {
        let (p, dst) = (p.clone(), chunk.to_vec());
        // Each task sends slot d of our pool to slot d of theirs.
        tasks.spawn(async move {
            p.send(1, &dst, &KvAddrInfo::from_slots(dst.iter().copied()))
                .await
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.unwrap().unwrap();
    }
    for &d in &dst_all {
        assert!(
            d_store.read_slot_to_vec(d) == src_bytes[d as usize],
            "slot {d}"
        );
    }
}

async fn peer_restart_is_noticed(kind: TransportKind) {
    let listen = match kind {
        TransportKind::Shm | TransportKind::Cuda => PeerAddr::ephemeral(kind),
        TransportKind::Tcp => {
            // Reserve a concrete port so the restarted peer listens where the old one did.
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            PeerAddr::Tcp(probe.local_addr().unwrap())
        }
    };
    let d_config = || TransportConfig {
        listen: Some(listen.clone()),
        ..config(kind, 1, HashMap::new())
    };
    let p_store = store(KvShape::SMALL);
    p_store.write_slot(0, &[0xAB; 256]);
    let peers = HashMap::from([(1, listen.clone())]);
    let p = KvTransport::start_with(config(kind, 0, peers), p_store)
        .await
        .unwrap();

    let old_store = store(KvShape::SMALL);
    let old = KvTransport::start_with(d_config(), old_store.clone())
        .await
        .unwrap();
    p.send(1, &[0], &KvAddrInfo::from_slots([5])).await.unwrap();
    assert_eq!(old_store.read_slot_to_vec(5), vec![0xAB; 256]);
    drop(old);
    // As when a process exits: sends fail once the sender has seen the old peer go away (the
    // dropped transport closes its sockets asynchronously, so a few may still land in the old
    // pool, at slot 7 only).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while p.send(1, &[0], &KvAddrInfo::from_slots([7])).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the old peer never went away"
        );
        tokio::task::yield_now().await;
    }

    let new_store = store(KvShape::SMALL);
    let _new = bind_with_retries(d_config, new_store.clone()).await;
    p.send(1, &[0], &KvAddrInfo::from_slots([6])).await.unwrap();
    assert_eq!(new_store.read_slot_to_vec(6), vec![0xAB; 256]);
    assert_eq!(old_store.read_slot_to_vec(6), vec![0; 256]);
}

/// The old listener's socket closes asynchronously (its task is aborted), so binding the same
/// address may briefly fail.
async fn bind_with_retries(
    config: impl Fn() -> TransportConfig,
    store: Arc<KvStore>,
) -> KvTransport {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match KvTransport::start_with(config(), store.clone()).await {
            Ok(t) => return t,
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "cannot rebind: {e}"),
        }
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_peer_restart_is_noticed() {
    peer_restart_is_noticed(TransportKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_peer_restart_is_noticed() {
    peer_restart_is_noticed(TransportKind::Tcp).await;
}

async fn shape_mismatch_is_an_error(kind: TransportKind) {
    let other = KvShape {
        head_dim: 32,
        ..KvShape::SMALL
    };
    let (p, d) = pair(kind, store(KvShape::SMALL), store(other)).await;
    let err = p
        .send(1, &[0], &KvAddrInfo::from_slots([0]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, KvError::ShapeMismatch { rank: 1, ours, theirs } if ours == KvShape::SMALL && theirs == other),
        "{err}"
    );
    drop(d);
}

#[tokio::test]
async fn shm_shape_mismatch_is_an_error() {
    shape_mismatch_is_an_error(TransportKind::Shm).await;
}

#[tokio::test]
async fn tcp_shape_mismatch_is_an_error() {
    shape_mismatch_is_an_error(TransportKind::Tcp).await;
}

async fn bad_requests_are_errors(kind: TransportKind) {
    let (p, _d) = pair(kind, store(KvShape::SMALL), store(KvShape::SMALL)).await;
    let one = KvAddrInfo::from_slots([0]);
    assert!(matches!(
        p.send(9, &[0], &one).await,
        Err(KvError::UnknownRank { rank: 9 })
    ));
    assert!(matches!(
        p.send(1, &[0, 1], &one).await,
        Err(KvError::LengthMismatch { src: 2, dst: 1 })
    ));
    assert!(matches!(
        p.send(1, &[SLOTS], &one).await,
        Err(KvError::SlotOutOfRange {
            side: "source",
            slot: SLOTS,
            ..
        })
    ));
    assert!(matches!(
        p.send(1, &[0], &KvAddrInfo::from_slots([SLOTS + 3])).await,
        Err(KvError::SlotOutOfRange { side: "destination", slot, .. }) if slot == SLOTS + 3
    ));
    let two_models = KvAddrInfo {
        models: vec![one.models[0].clone(), one.models[0].clone()],
    };
    assert!(matches!(
        p.send(1, &[0], &two_models).await,
        Err(KvError::ModelCount { models: 2 })
    ));
    // The transport still works after all that.
    p.send(1, &[0], &one).await.unwrap();
}

#[tokio::test]
async fn shm_bad_requests_are_errors() {
    bad_requests_are_errors(TransportKind::Shm).await;
}

#[tokio::test]
async fn tcp_bad_requests_are_errors() {
    bad_requests_are_errors(TransportKind::Tcp).await;
}

#[tokio::test]
async fn rank_mismatch_is_an_error() {
    let d = KvTransport::start_with(
        config(TransportKind::Tcp, 5, HashMap::new()),
        store(KvShape::SMALL),
    )
    .await
    .unwrap();
    let peers = HashMap::from([(1, d.listen_addr())]);
    let p = KvTransport::start_with(config(TransportKind::Tcp, 0, peers), store(KvShape::SMALL))
        .await
        .unwrap();
    let err = p
        .send(1, &[0], &KvAddrInfo::from_slots([0]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, KvError::Protocol { reason, .. } if reason.contains("rank 5")),
        "{err}"
    );
}

#[tokio::test]
async fn tcp_receiver_rejects_out_of_range_runs() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = KvTransport::start(
        TransportKind::Tcp,
        store(KvShape::SMALL),
        None,
        HashMap::new(),
    )
    .await
    .unwrap();
    let PeerAddr::Tcp(addr) = d.listen_addr() else {
        unreachable!("tcp transport")
    };
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut hello = [0u8; wire::Hello::LEN];
    raw.read_exact(&mut hello).await.unwrap();
    raw.write_all(&wire::encode_request_head(&[SlotRun {
        begin: SLOTS,
        len: 1,
    }]))
    .await
    .unwrap();
    let mut ack = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut ack))
        .await
        .unwrap()
        .unwrap();
    let head: [u8; wire::ACK_HEAD_LEN] = ack[..wire::ACK_HEAD_LEN].try_into().unwrap();
    assert!(matches!(wire::decode_ack_head(&head), Ok((false, 0, _))));
    assert!(String::from_utf8_lossy(&ack[wire::ACK_HEAD_LEN..]).contains("out of range"));
}

#[tokio::test]
async fn unreachable_peers_fail_fast() {
    // Nothing listens on these.
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    for (kind, addr) in [
        (TransportKind::Tcp, PeerAddr::Tcp(dead_port)),
        (TransportKind::Shm, PeerAddr::ephemeral(TransportKind::Shm)),
        (
            TransportKind::Shm,
            PeerAddr::Unix(std::env::temp_dir().join("switchyard-kv-nobody.sock")),
        ),
    ] {
        let p = KvTransport::start_with(
            config(kind, 0, HashMap::from([(1, addr)])),
            store(KvShape::SMALL),
        )
        .await
        .unwrap();
        let err = p
            .send(1, &[0], &KvAddrInfo::from_slots([0]))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                KvError::PeerIo {
                    what: "connect",
                    ..
                }
            ),
            "{kind}: {err}"
        );
    }
}

#[tokio::test]
async fn silent_peers_time_out() {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = PeerAddr::Tcp(tcp.local_addr().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let unix_path = dir.path().join("silent.sock");
    let _unix = tokio::net::UnixListener::bind(&unix_path).unwrap();
    // Both listeners complete handshakes in the kernel but never send a hello.
    for (kind, addr) in [
        (TransportKind::Tcp, tcp_addr),
        (TransportKind::Shm, PeerAddr::Unix(unix_path)),
    ] {
        let config = TransportConfig {
            connect_timeout: Duration::from_millis(200),
            ..config(kind, 0, HashMap::from([(1, addr)]))
        };
        let p = KvTransport::start_with(config, store(KvShape::SMALL))
            .await
            .unwrap();
        let err = p
            .send(1, &[0], &KvAddrInfo::from_slots([0]))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                KvError::Timeout {
                    what: "connect and hello",
                    ..
                }
            ),
            "{kind}: {err}"
        );
    }
}

#[tokio::test]
async fn wrong_address_kinds_are_rejected() {
    let tcp: PeerAddr = "tcp:127.0.0.1:1".parse().unwrap();
    let err = KvTransport::start(
        TransportKind::Shm,
        store(KvShape::SMALL),
        Some(tcp.clone()),
        HashMap::new(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, KvError::WrongAddrKind { .. }), "{err}");
    let p = KvTransport::start(
        TransportKind::Shm,
        store(KvShape::SMALL),
        None,
        HashMap::new(),
    )
    .await
    .unwrap();
    assert!(matches!(
        p.add_peer(1, tcp),
        Err(KvError::WrongAddrKind { .. })
    ));
}

#[tokio::test]
async fn unix_path_socket_is_removed_on_drop_and_stale_files_are_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.sock");
    // A stale socket file, as a crashed engine leaves behind.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let addr = PeerAddr::Unix(path.clone());
    let t = KvTransport::start(
        TransportKind::Shm,
        store(KvShape::SMALL),
        Some(addr.clone()),
        HashMap::new(),
    )
    .await
    .unwrap();
    // A live one is not stolen.
    let err = KvTransport::start(
        TransportKind::Shm,
        store(KvShape::SMALL),
        Some(addr),
        HashMap::new(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, KvError::Listen { .. }), "{err}");
    drop(t);
    assert!(!path.exists());
}

#[tokio::test]
async fn empty_transfer_is_a_no_op() {
    let (p, _d) = pair(
        TransportKind::Tcp,
        store(KvShape::SMALL),
        store(KvShape::SMALL),
    )
    .await;
    let stats = p
        .send(1, &[], &KvAddrInfo::decode("AwAAAAAAAABbMF0=").unwrap())
        .await
        .unwrap();
    assert_eq!((stats.bytes, stats.slots), (0, 0));
}
