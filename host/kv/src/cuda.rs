//! The GPU KV data path (feature `cuda`): pools in device memory, exported to peer engines on
//! the node with CUDA IPC, and transfers of merged slot runs as device copies.
//!
//! MLC moves KV with NVSHMEM puts from inside its kernels; NIXL and Mooncake use transfer
//! engines. Here it is a transport like shm, with device memory where shm has a memfd:
//!
//! - a pool is one plain `cuMemAlloc` allocation ([`KvStore::new_on`] with
//!   [`KvDevice::Cuda`](super::KvDevice)), because memory from the stream-ordered allocator's
//!   pools cannot be exported;
//! - the receiver hands its pool's IPC handle to senders over a Unix socket (same user only);
//!   each sender opens it once and copies into it directly, a one-sided put;
//! - a transfer's slots are merged into runs (adjacent on both sides) and copied on the
//!   sender's own stream either by one `cuMemcpyDtoDAsync` per run or by one launch of a
//!   gather/scatter kernel compiled at run time with NVRTC ([`CopyMethod`]); `send` returns
//!   after the stream is synchronised, so the bytes are in place when remote_send answers.
//!
//! libcuda is loaded at run time: without a driver every entry point returns
//! [`CudaError::DriverMissing`](super::CudaError) and nothing panics. [`SlotCopier`] exposes the
//! copy path to the `kv_transfer` benchmark's GPU group, which compares both methods with a
//! plain copy.

mod copy;
mod driver;
mod kernel;
mod pool;
#[cfg(test)]
mod tests;
pub(crate) mod transport;

pub use copy::CopyMethod;
pub(crate) use pool::DevicePool;

use parking_lot::Mutex;

use super::runs::{CopyRun, common_runs};
use super::{CudaError, KvError, KvStore};
use copy::RunCopier;
use transport::device_pool;

/// Opens device `ordinal` and returns its name; see [`super::cuda_probe`].
pub(crate) fn probe(ordinal: u32) -> Result<String, CudaError> {
    driver::Device::open(ordinal)?.name()
}

/// Copies slots between two device pools of this process with a chosen [`CopyMethod`], and
/// plain contiguous copies as the bandwidth baseline. What the cuda transport does per send,
/// minus the handshake, for benchmarks and tests.
pub struct SlotCopier {
    copier: Mutex<RunCopier>,
}

impl SlotCopier {
    /// A copier on the device of `src`, which must be a device pool.
    pub fn new(src: &KvStore) -> Result<Self, KvError> {
        let device = device_pool(src)?.buffer().device().clone();
        Ok(SlotCopier {
            copier: Mutex::new(RunCopier::new(device)?),
        })
    }

    /// The method the cuda transport uses: the kernel where NVRTC is available.
    pub fn default_method(&self) -> CopyMethod {
        self.copier.lock().default_method()
    }

    /// Copies `src_slots[i]` of `src` into `dst_slots[i]` of `dst` (merged into runs), and
    /// returns once the bytes are in place; returns the number of runs.
    pub fn copy_slots(
        &self,
        method: CopyMethod,
        src: &KvStore,
        src_slots: &[u32],
        dst: &KvStore,
        dst_slots: &[u32],
    ) -> Result<usize, KvError> {
        check_slots(src, dst, src_slots, dst_slots)?;
        let runs = common_runs(src_slots, dst_slots.iter().copied());
        self.copy_checked_runs(method, src, dst, &runs)?;
        Ok(runs.len())
    }

    /// Copies the first `slots` slots of `src` to the start of `dst` as one contiguous copy:
    /// the device-to-device roofline a scattered transfer is measured against. It takes no
    /// slot list, so none is built, checked or merged on the clock (for 65536 small slots that
    /// host work took longer than the copy).
    pub fn copy_prefix(&self, src: &KvStore, dst: &KvStore, slots: u32) -> Result<(), KvError> {
        let Some(last) = slots.checked_sub(1) else {
            return Ok(());
        };
        check_slots(src, dst, &[last], &[last])?;
        let run = CopyRun {
            src: 0,
            dst: 0,
            len: slots,
        };
        self.copy_checked_runs(CopyMethod::Batched, src, dst, &[run])
    }

    /// Copies `runs`, already checked against both pools by [`check_slots`].
    #[allow(unsafe_code, reason = "copying between two checked pools")]
    fn copy_checked_runs(
        &self,
        method: CopyMethod,
        src: &KvStore,
        dst: &KvStore,
        runs: &[CopyRun],
    ) -> Result<(), KvError> {
        let (src_pool, dst_pool) = (device_pool(src)?, device_pool(dst)?);
        // SAFETY: the caller checked every run's slots against its pool, both pools are
        // borrowed for the whole (synchronous) copy, and they share a shape, so runs stay
        // inside them.
        unsafe {
            self.copier.lock().copy_runs(
                method,
                src_pool.buffer().ptr(),
                dst_pool.buffer().ptr(),
                runs,
                src.shape().bytes_per_token(),
            )
        }
    }
}

/// The checks `KvTransport::send` makes, for two local pools.
fn check_slots(
    src: &KvStore,
    dst: &KvStore,
    src_slots: &[u32],
    dst_slots: &[u32],
) -> Result<(), KvError> {
    if src.shape() != dst.shape() {
        return Err(KvError::ShapeMismatch {
            rank: 0,
            ours: src.shape(),
            theirs: dst.shape(),
        });
    }
    if src_slots.len() != dst_slots.len() {
        return Err(KvError::LengthMismatch {
            src: src_slots.len(),
            dst: dst_slots.len() as u64,
        });
    }
    for (side, slots, pool) in [("source", src_slots, src), ("destination", dst_slots, dst)] {
        if let Some(&slot) = slots.iter().find(|&&s| s >= pool.num_slots()) {
            return Err(KvError::SlotOutOfRange {
                side,
                slot,
                num_slots: pool.num_slots(),
            });
        }
    }
    Ok(())
}
