//! KV transfer throughput: shm and tcp transports against a plain memcpy of the same bytes.
//!
//! Llama-3-8B KV (128 KiB per token), a 4096-token prompt (512 MiB), pages of 16 slots laid out
//! in a random page order on both the source and the destination pool, so every transfer is 256
//! scattered 2 MiB runs. The baseline is one contiguous `copy_from_slice` of 512 MiB between two
//! pre-faulted buffers. Also: the latency of a small (16-token) transfer.
//!
//! `cargo bench -p switchyard-kv --bench kv_transfer` prints a table. Without `--bench` (as under
//! `cargo test --benches`) it runs one small round as a smoke test. Built with `--features cuda`
//! it adds the GPU group (`kv_transfer/cuda.rs`), which reports itself skipped without a GPU.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use switchyard_kv::{KvAddrInfo, KvShape, KvStore, KvTransport, TransportKind};

// In a subfolder so cargo does not take it for a bench target of its own.
#[cfg(feature = "cuda")]
#[path = "kv_transfer/cuda.rs"]
mod cuda;

const PAGE: u32 = 16;

struct Setup {
    tokens: u32,
    rounds: usize,
    small_rounds: usize,
}

fn main() {
    #[cfg(feature = "cuda")]
    if cuda::serve_as_child() {
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let setup = if full {
        Setup {
            tokens: 4096,
            rounds: 7,
            small_rounds: 300,
        }
    } else {
        Setup {
            tokens: 256,
            rounds: 1,
            small_rounds: 3,
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        run(&setup).await;
        #[cfg(feature = "cuda")]
        cuda::run(&setup).await;
    });
}

/// A prompt's slots in a paged pool: pages of `page` slots in random order.
fn scattered_pages(rng: &mut StdRng, tokens: u32, page: u32) -> Vec<u32> {
    let mut pages: Vec<u32> = (0..tokens / page).collect();
    pages.shuffle(rng);
    pages
        .into_iter()
        .flat_map(|p| p * page..(p + 1) * page)
        .collect()
}

async fn run(setup: &Setup) {
    let shape = KvShape::LLAMA3_8B;
    let bpt = shape.bytes_per_token();
    let total = setup.tokens as usize * bpt;
    let mut rng = StdRng::seed_from_u64(42);

    let src_pool = Arc::new(KvStore::new(shape, setup.tokens).expect("source pool"));
    let dst_pool = Arc::new(KvStore::new(shape, setup.tokens).expect("destination pool"));
    let mut slot = vec![0u8; bpt];
    for s in 0..setup.tokens {
        rng.fill_bytes(&mut slot);
        src_pool.write_slot(s, &slot);
        dst_pool.write_slot(s, &vec![0; bpt]); // fault the pages in before timing
    }
    let src_slots = scattered_pages(&mut rng, setup.tokens, PAGE);
    let dst_slots = scattered_pages(&mut rng, setup.tokens, PAGE);
    let dst_info = KvAddrInfo::from_slots(dst_slots.iter().copied());

    let mut transports = Vec::new();
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let d = KvTransport::start(kind, dst_pool.clone(), None, HashMap::new())
            .await
            .expect("receiver");
        let peers = HashMap::from([(1, d.listen_addr())]);
        let p = KvTransport::start(kind, src_pool.clone(), None, peers)
            .await
            .expect("sender");
        // Warm-up (maps the peer, opens the connection), then check every byte once.
        p.send(1, &src_slots, &dst_info)
            .await
            .expect("warm-up transfer");
        verify(&src_pool, &dst_pool, &src_slots, &dst_slots, kind);
        transports.push((kind, p, d));
    }

    let (src_buf, mut dst_buf) = (vec![1u8; total], vec![0u8; total]);
    dst_buf.copy_from_slice(&src_buf); // warm-up and fault-in

    // Interleaved rounds so drift (other load, frequency) hits every method alike.
    let mut memcpy_times = Vec::new();
    let mut runs_times = Vec::new();
    let mut times: HashMap<TransportKind, Vec<Duration>> = HashMap::new();
    for _ in 0..setup.rounds {
        let started = Instant::now();
        dst_buf.copy_from_slice(std::hint::black_box(&src_buf));
        std::hint::black_box(&mut dst_buf);
        memcpy_times.push(started.elapsed());
        let started = Instant::now();
        copy_runs_between_buffers(&src_buf, &mut dst_buf, &src_slots, &dst_slots, bpt);
        runs_times.push(started.elapsed());
        for (kind, p, _) in &transports {
            let started = Instant::now();
            p.send(1, &src_slots, &dst_info).await.expect("transfer");
            times.entry(*kind).or_default().push(started.elapsed());
        }
    }

    let gbps = |d: Duration| total as f64 / d.as_secs_f64() / 1e9;
    let memcpy = median(&mut memcpy_times);
    println!(
        "KV transfer: {} tokens × {} B = {} MiB, pages of {PAGE} slots shuffled on both sides ({} runs), {} rounds",
        setup.tokens,
        bpt,
        total >> 20,
        setup.tokens / PAGE,
        setup.rounds
    );
    println!(
        "{:<22} {:>12} {:>10} {:>10}",
        "method", "median", "GB/s", "÷ memcpy"
    );
    println!(
        "{:<22} {:>12.2?} {:>10.2} {:>10.2}",
        "memcpy (contiguous)",
        memcpy,
        gbps(memcpy),
        1.0
    );
    let runs = median(&mut runs_times);
    println!(
        "{:<22} {:>12.2?} {:>10.2} {:>10.2}",
        "memcpy (same runs)",
        runs,
        gbps(runs),
        memcpy.as_secs_f64() / runs.as_secs_f64()
    );
    for (kind, _, _) in &transports {
        let t = median(times.get_mut(kind).expect("timed"));
        let name = format!("{kind} (scattered)");
        println!(
            "{:<22} {:>12.2?} {:>10.2} {:>10.2}",
            name,
            t,
            gbps(t),
            memcpy.as_secs_f64() / t.as_secs_f64()
        );
    }

    println!(
        "\nsmall transfer: {PAGE} tokens ({} KiB), {} sends each",
        (PAGE as usize * bpt) >> 10,
        setup.small_rounds
    );
    println!("{:<22} {:>12} {:>12}", "method", "median", "p99");
    let small_src = &src_slots[..PAGE as usize];
    let small_dst = KvAddrInfo::from_slots(dst_slots[..PAGE as usize].iter().copied());
    for (kind, p, _) in &transports {
        let mut lat = Vec::with_capacity(setup.small_rounds);
        for _ in 0..setup.small_rounds {
            let started = Instant::now();
            p.send(1, small_src, &small_dst)
                .await
                .expect("small transfer");
            lat.push(started.elapsed());
        }
        lat.sort();
        let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
        println!(
            "{:<22} {:>12.2?} {:>12.2?}",
            kind.to_string(),
            median(&mut lat),
            p99
        );
    }
}

/// The transfer's scattered layout copied with plain `copy_from_slice` per run, between heap
/// buffers: what the transports would cost with no overhead of their own.
fn copy_runs_between_buffers(
    src: &[u8],
    dst: &mut [u8],
    src_slots: &[u32],
    dst_slots: &[u32],
    bpt: usize,
) {
    for (s, d) in src_slots
        .chunks(PAGE as usize)
        .zip(dst_slots.chunks(PAGE as usize))
    {
        let (s, d) = (s[0] as usize * bpt, d[0] as usize * bpt);
        let len = PAGE as usize * bpt;
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    }
    std::hint::black_box(dst);
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn verify(src: &KvStore, dst: &KvStore, src_slots: &[u32], dst_slots: &[u32], kind: TransportKind) {
    for (&s, &d) in src_slots.iter().zip(dst_slots) {
        assert!(
            src.read_slot_to_vec(s) == dst.read_slot_to_vec(d),
            "{kind}: slot {s} → {d} differs"
        );
    }
}
