//! Tests of the GPU data path. Those that need CUDA device 0 check for it first and, without
//! one, print `SKIPPED <test>: <why>` to stderr (uncaptured) and return: they are never
//! `#[ignore]`d, so on a GPU machine `cargo test -p switchyard-kv --features cuda --lib` runs
//! them for real.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::tests::{SLOTS, fill_random, pair, scattered_slots};
use crate::{
    CudaError, KvAddrInfo, KvDevice, KvError, KvShape, KvStore, KvTransport, TransportKind,
    cuda_probe,
};

use super::{CopyMethod, SlotCopier};

const GPU: KvDevice = KvDevice::Cuda(0);

/// True if device 0 is usable; otherwise reports `test` as skipped.
fn gpu_available(test: &str) -> bool {
    match cuda_probe(0) {
        Ok(_) => true,
        Err(e) => {
            skipped(test, &e);
            false
        }
    }
}

fn skipped(test: &str, why: &dyn std::fmt::Display) {
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests, and a
    // skip must show in the run's output.
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED kv::cuda::tests::{test}: {why}"
    );
}

fn out_of_range(err: &KvError, which: &str) -> bool {
    matches!(err, KvError::SlotOutOfRange { side, .. } if *side == which)
}

fn gpu_pool(shape: KvShape) -> Arc<KvStore> {
    Arc::new(KvStore::new_on(GPU, shape, SLOTS).expect("a pool on cuda:0"))
}

/// 16 KiB slots: large enough for multi-block kernel rows, small enough to fill quickly.
const SHAPE_16K: KvShape = KvShape {
    layers: 4,
    kv_heads: 8,
    head_dim: 128,
    dtype_bytes: 2,
};

// === without a GPU too ===

#[test]
fn a_gpu_pool_without_a_usable_device_is_an_error_not_a_panic() {
    let created = KvStore::new_on(GPU, KvShape::SMALL, 16);
    match cuda_probe(0) {
        Ok(_) => assert_eq!(created.expect("device 0 works").device(), GPU),
        Err(probe) => {
            let Err(KvError::Cuda(err)) = created else {
                panic!("expected a CUDA error, got {created:?}");
            };
            assert_eq!(err, probe, "pool creation and the probe disagree");
            assert!(
                matches!(
                    err,
                    CudaError::DriverMissing { .. }
                        | CudaError::NoDevice { .. }
                        | CudaError::Driver { .. }
                ),
                "{err}"
            );
        }
    }
}

#[tokio::test]
async fn transports_refuse_pools_on_the_wrong_device() {
    let cpu = Arc::new(KvStore::new(KvShape::SMALL, 16).unwrap());
    let err = KvTransport::start(TransportKind::Cuda, cpu, None, HashMap::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            KvError::TransportDevice {
                kind: TransportKind::Cuda,
                device: KvDevice::Cpu
            }
        ),
        "{err}"
    );
    if !gpu_available("transports_refuse_pools_on_the_wrong_device (GPU half)") {
        return;
    }
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let err = KvTransport::start(kind, gpu_pool(KvShape::SMALL), None, HashMap::new())
            .await
            .unwrap_err();
        assert!(
            matches!(err, KvError::TransportDevice { device: GPU, .. }),
            "{kind}: {err}"
        );
    }
}

// === on a GPU ===

#[test]
fn device_slots_round_trip_and_start_zeroed() {
    if !gpu_available("device_slots_round_trip_and_start_zeroed") {
        return;
    }
    let pool = gpu_pool(KvShape::SMALL);
    let bytes: Vec<u8> = (0..KvShape::SMALL.bytes_per_token())
        .map(|i| i as u8)
        .collect();
    pool.write_slot(SLOTS - 1, &bytes);
    assert_eq!(pool.read_slot_to_vec(SLOTS - 1), bytes);
    assert_eq!(pool.read_slot_to_vec(0), vec![0; bytes.len()]);
}

#[test]
fn a_missing_device_is_named() {
    if !gpu_available("a_missing_device_is_named") {
        return;
    }
    let err = KvStore::new_on(KvDevice::Cuda(4096), KvShape::SMALL, 16).unwrap_err();
    assert!(
        matches!(
            err,
            KvError::Cuda(CudaError::NoDevice { ordinal: 4096, .. })
        ),
        "{err}"
    );
}

/// Both copy methods move scattered runs exactly and touch nothing else; a slot size that is
/// not a multiple of 16 bytes (the kernel's word) falls back to batched copies and still works.
/// Without NVRTC the kernel is not the default, and asking for it is an error that says so.
#[test]
fn both_copy_methods_move_scattered_runs_exactly() {
    if !gpu_available("both_copy_methods_move_scattered_runs_exactly") {
        return;
    }
    let odd = KvShape {
        layers: 1,
        kv_heads: 1,
        head_dim: 9,
        dtype_bytes: 1,
    };
    let mut rng = StdRng::seed_from_u64(5);
    for shape in [SHAPE_16K, odd] {
        for method in CopyMethod::ALL {
            let (src, dst) = (gpu_pool(shape), gpu_pool(shape));
            let src_bytes = fill_random(&src, &mut rng);
            let src_slots = scattered_slots(&mut rng, 300, 16);
            let dst_slots = scattered_slots(&mut rng, 300, 4);
            let copier = SlotCopier::new(&src).unwrap();
            let copied = copier.copy_slots(method, &src, &src_slots, &dst, &dst_slots);
            let kernel_unavailable = method == CopyMethod::Kernel
                && shape.bytes_per_token().is_multiple_of(16)
                && copier.default_method() == CopyMethod::Batched;
            if kernel_unavailable {
                let Err(KvError::Cuda(err @ CudaError::Kernel { .. })) = copied else {
                    panic!("the kernel without NVRTC: {copied:?}");
                };
                skipped(
                    "both_copy_methods_move_scattered_runs_exactly (kernel)",
                    &err,
                );
                continue;
            }
            let runs = copied.unwrap();
            assert!((300 / 16..=300).contains(&runs), "{runs} runs");
            let mut expected = vec![vec![0u8; shape.bytes_per_token()]; SLOTS as usize];
            for (&s, &d) in src_slots.iter().zip(&dst_slots) {
                expected[d as usize] = src_bytes[s as usize].clone();
            }
            for (slot, want) in expected.iter().enumerate() {
                assert!(
                    dst.read_slot_to_vec(slot as u32) == *want,
                    "{method}, {shape}: destination slot {slot}"
                );
            }
        }
    }
}

#[test]
fn copies_check_slots_against_both_pools() {
    if !gpu_available("copies_check_slots_against_both_pools") {
        return;
    }
    let (src, dst) = (gpu_pool(KvShape::SMALL), gpu_pool(KvShape::SMALL));
    let copier = SlotCopier::new(&src).unwrap();
    let err = copier
        .copy_slots(CopyMethod::Kernel, &src, &[0, SLOTS], &dst, &[0, 1])
        .unwrap_err();
    assert!(out_of_range(&err, "source"), "{err}");
    let err = copier
        .copy_slots(CopyMethod::Batched, &src, &[0], &dst, &[SLOTS + 3])
        .unwrap_err();
    assert!(out_of_range(&err, "destination"), "{err}");
    let cpu = KvStore::new(KvShape::SMALL, 4).unwrap();
    assert!(matches!(
        copier.copy_slots(CopyMethod::Batched, &src, &[0], &cpu, &[0]),
        Err(KvError::TransportDevice { .. })
    ));
}

/// The transport end to end between two GPU pools of this process (found through the pool
/// registry, since CUDA cannot open an IPC handle in the process that made it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_transport_sends_scattered_runs_exactly() {
    if !gpu_available("cuda_transport_sends_scattered_runs_exactly") {
        return;
    }
    let mut rng = StdRng::seed_from_u64(9);
    let (p_store, d_store) = (gpu_pool(SHAPE_16K), gpu_pool(SHAPE_16K));
    let src_bytes = fill_random(&p_store, &mut rng);
    let (p, _d) = pair(TransportKind::Cuda, p_store, d_store.clone()).await;
    let src = scattered_slots(&mut rng, 256, 16);
    let dst = scattered_slots(&mut rng, 256, 16);
    let stats = p
        .send(1, &src, &KvAddrInfo::from_slots(dst.iter().copied()))
        .await
        .unwrap();
    assert_eq!(stats.slots, 256);
    for (&s, &d) in src.iter().zip(&dst) {
        assert!(
            d_store.read_slot_to_vec(d) == src_bytes[s as usize],
            "slot {s} → {d}"
        );
    }
    let err = p
        .send(1, &[0], &KvAddrInfo::from_slots([SLOTS]))
        .await
        .unwrap_err();
    assert!(out_of_range(&err, "destination"), "{err}");
}
