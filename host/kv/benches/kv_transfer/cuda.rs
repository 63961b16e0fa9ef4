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
//! measured in those rounds. A second table sweeps the run size at the same total bytes, from
//! one 8 KiB slot per run to 64-slot runs of 8 MiB, which is what `RunCopier::default_method`
//! is chosen from. Without a usable device it prints `SKIPPED` and why.

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use switchyard_kv::cuda::{CopyMethod, SlotCopier};
use switchyard_kv::{
    KvAddrInfo, KvDevice, KvError, KvShape, KvStore, KvTransport, PeerAddr, TransportKind,
    cuda_probe,
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
    let copy = ScatteredCopy::new(&mut rng, shape, setup.tokens, PAGE);
    copy.check_methods();
    let ScatteredCopy {
        src,
        dst,
        src_slots,
        dst_slots,
        copier,
        ..
    } = &copy;
    let dst_info = KvAddrInfo::from_slots(dst_slots.iter().copied());
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
    p.send(1, src_slots, &dst_info).await.expect("warm-up send");
    verify(src, dst, src_slots, dst_slots, "transport");
    let child = ChildPool::spawn(setup.tokens);
    p.add_peer(2, child.addr.clone()).expect("child peer");
    p.send(2, src_slots, &dst_info)
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
        for (i, t) in copy.time_round().into_iter().enumerate() {
            times[i].1.push(t);
        }
        for (i, rank) in [1u32, 2].into_iter().enumerate() {
            let started = Instant::now();
            p.send(rank, src_slots, &dst_info).await.expect("send");
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
    drop((p, d, child, copy));
    sweep_run_sizes(setup, total);
}

/// Two device pools of one shape, the source filled with random bytes, the slots of a transfer
/// between them (pages of `page` slots shuffled on both sides), and a copier.
struct ScatteredCopy {
    src: Arc<KvStore>,
    dst: Arc<KvStore>,
    src_slots: Vec<u32>,
    dst_slots: Vec<u32>,
    copier: SlotCopier,
    tokens: u32,
    page: u32,
}

impl ScatteredCopy {
    fn new(rng: &mut StdRng, shape: KvShape, tokens: u32, page: u32) -> Self {
        let new_pool = || Arc::new(KvStore::new_on(DEVICE, shape, tokens).expect("device pool"));
        let (src, dst) = (new_pool(), new_pool());
        let mut slot = vec![0u8; shape.bytes_per_token()];
        for s in 0..tokens {
            rng.fill_bytes(&mut slot);
            src.write_slot(s, &slot);
        }
        let src_slots = scattered_pages(rng, tokens, page);
        let dst_slots = scattered_pages(rng, tokens, page);
        let copier = SlotCopier::new(&src).expect("copier");
        ScatteredCopy {
            src,
            dst,
            src_slots,
            dst_slots,
            copier,
            tokens,
            page,
        }
    }

    /// The scattered transfer with `method`; the number of runs it made.
    fn copy(&self, method: CopyMethod) -> Result<usize, KvError> {
        self.copier.copy_slots(
            method,
            &self.src,
            &self.src_slots,
            &self.dst,
            &self.dst_slots,
        )
    }

    /// Copies once with every method and checks every byte (this also warms up: the kernel is
    /// compiled here, not in the rounds). Returns the number of runs.
    fn check_methods(&self) -> usize {
        let mut runs = 0;
        for method in CopyMethod::ALL {
            runs = self
                .copy(method)
                .unwrap_or_else(|e| panic!("{method} copy: {e}"));
            let what = format!("{method}, {}-slot runs", self.page);
            verify(
                &self.src,
                &self.dst,
                &self.src_slots,
                &self.dst_slots,
                &what,
            );
        }
        runs
    }

    /// One timed round: the contiguous copy of every slot, then the scattered transfer with
    /// each method, in [`CopyMethod::ALL`] order.
    fn time_round(&self) -> [Duration; 3] {
        let started = Instant::now();
        self.copier
            .copy_prefix(&self.src, &self.dst, self.tokens)
            .expect("d2d");
        let mut times = [started.elapsed(); 3];
        for (i, method) in CopyMethod::ALL.into_iter().enumerate() {
            let started = Instant::now();
            self.copy(method).expect("copy");
            times[1 + i] = started.elapsed();
        }
        times
    }
}

/// A model with small slots (8 KiB: 16 layers × 2 KV heads × 64 dims, fp16), so a run of one
/// slot is a short copy.
const SHAPE_8K: KvShape = KvShape {
    layers: 16,
    kv_heads: 2,
    head_dim: 64,
    dtype_bytes: 2,
};

/// Both copy methods against the contiguous copy, at `total` bytes per transfer, for runs from
/// 8 KiB to 8 MiB: where each method wins decides the default.
fn sweep_run_sizes(setup: &Setup, total: usize) {
    const CASES: [(KvShape, u32); 6] = [
        (SHAPE_8K, 1),
        (SHAPE_8K, 16),
        (KvShape::LLAMA3_8B, 1),
        (KvShape::LLAMA3_8B, 4),
        (KvShape::LLAMA3_8B, 16),
        (KvShape::LLAMA3_8B, 64),
    ];
    println!(
        "\nrun-size sweep: {} MiB per transfer, slots shuffled in runs on both sides, {} rounds",
        total >> 20,
        setup.rounds
    );
    println!(
        "| slot | slots/run | run | runs | d2d | batched | kernel | batched ÷ d2d | kernel ÷ d2d |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut rng = StdRng::seed_from_u64(7);
    for (shape, run) in CASES {
        let bpt = shape.bytes_per_token();
        let tokens = u32::try_from(total / bpt).expect("slot count");
        let copy = ScatteredCopy::new(&mut rng, shape, tokens, run);
        let runs = copy.check_methods();
        let mut times: [Vec<Duration>; 3] = Default::default();
        for _ in 0..setup.rounds {
            for (i, t) in copy.time_round().into_iter().enumerate() {
                times[i].push(t);
            }
        }
        let [d2d, batched, kernel] = times.map(|mut t| median(&mut t));
        let ratio = |t: Duration| d2d.as_secs_f64() / t.as_secs_f64();
        println!(
            "| {} KiB | {run} | {} KiB | {runs} | {d2d:.2?} | {batched:.2?} | {kernel:.2?} | {:.2} | {:.2} |",
            bpt >> 10,
            (bpt * run as usize) >> 10,
            ratio(batched),
            ratio(kernel)
        );
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
