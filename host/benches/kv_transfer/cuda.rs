//! The GPU group of the KV transfer benchmark (feature `cuda`).
//!
//! Same transfer as the host group (Llama-3-8B, 4096 tokens = 512 MiB, pages of 16 slots
//! shuffled on both sides: 256 scattered 2 MiB runs), between two pools on CUDA device 0:
//!
//! - `d2d (contiguous)`: one `cuMemcpyDtoDAsync` of all 512 MiB, the roofline;
//! - `batched` / `kernel`: the scattered transfer with each [`CopyMethod`];
//! - `cuda transport (in-process)`: `KvTransport::send` end to end (handshake cached);
//! - `cuda transport (2 processes)`: the same into a pool of a child process, over CUDA IPC.
//!
//! Every method runs in the same interleaved rounds, and every ratio is to the contiguous copy
//! measured in those rounds. Without a usable device it prints `SKIPPED` and why.

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use switchyard::kv::cuda::{CopyMethod, SlotCopier};
use switchyard::kv::{
    KvAddrInfo, KvDevice, KvShape, KvStore, KvTransport, PeerAddr, TransportKind, cuda_probe,
};

use super::{PAGE, Setup, median, scattered_pages};

const DEVICE: KvDevice = KvDevice::Cuda(0);
/// Set in the child of the two-process run: the number of slots of its pool.
const CHILD_ENV: &str = "SWITCHYARD_KV_CUDA_BENCH_CHILD";

/// In the two-process run's child: serve a GPU pool until stdin closes. Returns false in the
/// parent (no such role).
pub(super) fn serve_as_child() -> bool {
    let Some(slots) = std::env::var(CHILD_ENV).ok().and_then(|s| s.parse().ok()) else {
        return false;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let pool =
            Arc::new(KvStore::new_on(DEVICE, KvShape::LLAMA3_8B, slots).expect("child pool"));
        let d = KvTransport::start(TransportKind::Cuda, pool, None, HashMap::new())
            .await
            .expect("child receiver");
        println!("READY {}", d.listen_addr());
        std::io::stdout().flush().expect("stdout");
        // Serve until the parent closes our stdin (or dies).
        tokio::task::spawn_blocking(|| std::io::stdin().lines().count())
            .await
            .expect("stdin reader");
    });
    true
}

pub(super) async fn run(setup: &Setup) {
    let name = match cuda_probe(0) {
        Ok(name) => name,
        Err(e) => {
            println!("\nSKIPPED kv_transfer cuda group: {e}");
            return;
        }
    };
    let shape = KvShape::LLAMA3_8B;
    let bpt = shape.bytes_per_token();
    let total = setup.tokens as usize * bpt;
    let mut rng = StdRng::seed_from_u64(42);
    let new_pool = || Arc::new(KvStore::new_on(DEVICE, shape, setup.tokens).expect("device pool"));
    let (src, dst) = (new_pool(), new_pool());
    let mut slot = vec![0u8; bpt];
    for s in 0..setup.tokens {
        rng.fill_bytes(&mut slot);
        src.write_slot(s, &slot);
    }
    let src_slots = scattered_pages(&mut rng, setup.tokens);
    let dst_slots = scattered_pages(&mut rng, setup.tokens);
    let dst_info = KvAddrInfo::from_slots(dst_slots.iter().copied());
    let copier = SlotCopier::new(&src).expect("copier");

    // Warm up and check every method once (the kernel is compiled here, not in the rounds).
    for method in CopyMethod::ALL {
        copier
            .copy_slots(method, &src, &src_slots, &dst, &dst_slots)
            .unwrap_or_else(|e| panic!("{method} copy: {e}"));
        verify(&src, &dst, &src_slots, &dst_slots, &method.to_string());
    }
    let d = KvTransport::start(TransportKind::Cuda, dst.clone(), None, HashMap::new())
        .await
        .expect("receiver");
    let p = KvTransport::start(
        TransportKind::Cuda,
        src.clone(),
        None,
        HashMap::from([(1, d.listen_addr())]),
    )
    .await
    .expect("sender");
    p.send(1, &src_slots, &dst_info)
        .await
        .expect("warm-up send");
    verify(&src, &dst, &src_slots, &dst_slots, "transport");
    let child = ChildPool::spawn(setup.tokens);
    p.add_peer(2, child.addr.clone()).expect("child peer");
    p.send(2, &src_slots, &dst_info)
        .await
        .expect("warm-up IPC send");

    let mut times: Vec<(String, Vec<Duration>)> = [
        "d2d (contiguous)",
        "batched (scattered)",
        "kernel (scattered)",
        "transport in-process",
        "transport 2 processes",
    ]
    .into_iter()
    .map(|n| (n.to_owned(), Vec::new()))
    .collect();
    for _ in 0..setup.rounds {
        let started = Instant::now();
        copier.copy_prefix(&src, &dst, setup.tokens).expect("d2d");
        times[0].1.push(started.elapsed());
        for (i, method) in CopyMethod::ALL.into_iter().enumerate() {
            let started = Instant::now();
            copier
                .copy_slots(method, &src, &src_slots, &dst, &dst_slots)
                .expect("copy");
            times[1 + i].1.push(started.elapsed());
        }
        for (i, rank) in [1u32, 2].into_iter().enumerate() {
            let started = Instant::now();
            p.send(rank, &src_slots, &dst_info).await.expect("send");
            times[3 + i].1.push(started.elapsed());
        }
    }

    println!(
        "\nKV transfer on {name} (cuda:0): {} tokens × {bpt} B = {} MiB, {} runs of {PAGE} slots, {} rounds, default method {}",
        setup.tokens,
        total >> 20,
        setup.tokens / PAGE,
        setup.rounds,
        copier.default_method()
    );
    println!("| method | median | GB/s | ÷ d2d |");
    println!("|---|---:|---:|---:|");
    let d2d = median(&mut times[0].1);
    for (name, samples) in &mut times {
        let t = median(samples);
        println!(
            "| {name} | {t:.2?} | {:.1} | {:.2} |",
            total as f64 / t.as_secs_f64() / 1e9,
            d2d.as_secs_f64() / t.as_secs_f64()
        );
    }

    println!(
        "\nsmall transfer: {PAGE} tokens ({} KiB), {} sends",
        (PAGE as usize * bpt) >> 10,
        setup.small_rounds
    );
    println!("| path | median | p99 |");
    println!("|---|---:|---:|");
    let small_src = &src_slots[..PAGE as usize];
    let small_dst = KvAddrInfo::from_slots(dst_slots[..PAGE as usize].iter().copied());
    for (label, rank) in [("transport in-process", 1u32), ("transport 2 processes", 2)] {
        let mut lat: Vec<Duration> = Vec::with_capacity(setup.small_rounds);
        for _ in 0..setup.small_rounds {
            let started = Instant::now();
            p.send(rank, small_src, &small_dst)
                .await
                .expect("small send");
            lat.push(started.elapsed());
        }
        lat.sort();
        let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
        println!("| {label} | {:.2?} | {p99:.2?} |", median(&mut lat));
    }
}

fn verify(src: &KvStore, dst: &KvStore, src_slots: &[u32], dst_slots: &[u32], what: &str) {
    for (&s, &d) in src_slots.iter().zip(dst_slots) {
        assert!(
            src.read_slot_to_vec(s) == dst.read_slot_to_vec(d),
            "{what}: slot {s} → {d} differs"
        );
    }
}

/// This benchmark binary re-run as a receiver with its own GPU pool; stopped on drop.
struct ChildPool {
    child: Child,
    addr: PeerAddr,
}

impl ChildPool {
    fn spawn(slots: u32) -> ChildPool {
        let mut child = Command::new(std::env::current_exe().expect("bench binary path"))
            .env(CHILD_ENV, slots.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the IPC child");
        let stdout = child.stdout.take().expect("piped stdout");
        let line = BufReader::new(stdout)
            .lines()
            .next()
            .and_then(Result::ok)
            .expect("the child's READY line");
        let addr = line
            .strip_prefix("READY ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected line from the child: {line:?}"));
        ChildPool { child, addr }
    }
}

impl Drop for ChildPool {
    fn drop(&mut self) {
        drop(self.child.stdin.take()); // EOF: the child exits
        let _ = self.child.wait();
    }
}
