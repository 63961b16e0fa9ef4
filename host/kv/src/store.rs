//! The KV pool's bytes: a sealed memfd mapped shared, so a same-host peer can map it too.
//!
//! Not a file in `/dev/shm`: containers cap that at 64 MiB and a Llama-3-8B pool is hundreds of
//! MiB. The memfd is sealed against shrinking and growing right after it is sized, so a peer that
//! maps it (shm transport) can check it will never be truncated under its mapping (SIGBUS).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::gate::SlotGate;
use super::{KvDevice, KvError, KvShape};

/// An engine's KV pool: `num_slots` slots of `shape.bytes_per_token()` bytes, zeroed at start,
/// in host memory or (feature `cuda`) on a GPU.
///
/// Shared by the engine and its transports (`Arc<KvStore>`); its [`SlotGate`] says which slots a
/// receiver may write (see the module docs of [`crate`] for who may touch which slot when).
pub struct KvStore {
    shape: KvShape,
    num_slots: u32,
    memory: Memory,
    gate: SlotGate,
}

enum Memory {
    Host {
        memfd: OwnedFd,
        map: Mapping,
    },
    #[cfg(feature = "cuda")]
    Device(super::cuda::DevicePool),
}

impl std::fmt::Debug for KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStore")
            .field("shape", &self.shape)
            .field("num_slots", &self.num_slots)
            .finish_non_exhaustive()
    }
}

impl KvStore {
    /// Creates a zeroed pool of `num_slots` slots in a fresh sealed memfd.
    pub fn new(shape: KvShape, num_slots: u32) -> Result<Self, KvError> {
        let bytes = pool_bytes(shape, num_slots)?;
        let memfd = rustix::fs::memfd_create(
            "switchyard-kv-pool",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| KvError::SharedMemory(e.into()))?;
        rustix::fs::ftruncate(&memfd, bytes as u64).map_err(|e| KvError::SharedMemory(e.into()))?;
        rustix::fs::fcntl_add_seals(
            &memfd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )
        .map_err(|e| KvError::SharedMemory(e.into()))?;
        let map = Mapping::map_shared(memfd.as_fd(), bytes).map_err(KvError::SharedMemory)?;
        Ok(KvStore {
            shape,
            num_slots,
            memory: Memory::Host { memfd, map },
            gate: SlotGate::new(num_slots, false),
        })
    }

    /// Creates a zeroed pool on `device`: [`KvStore::new`] for the CPU, one device allocation
    /// for a GPU (an error without the `cuda` feature or a driver, never a panic).
    pub fn new_on(device: KvDevice, shape: KvShape, num_slots: u32) -> Result<Self, KvError> {
        match device {
            KvDevice::Cpu => Self::new(shape, num_slots),
            #[cfg(feature = "cuda")]
            KvDevice::Cuda(ordinal) => {
                let bytes = pool_bytes(shape, num_slots)?;
                Ok(KvStore {
                    shape,
                    num_slots,
                    memory: Memory::Device(super::cuda::DevicePool::new(ordinal, bytes)?),
                    gate: SlotGate::new(num_slots, false),
                })
            }
            #[cfg(not(feature = "cuda"))]
            KvDevice::Cuda(_) => Err(super::CudaError::NotBuilt.into()),
        }
    }

    /// The same pool with a guarded [`SlotGate`]: receivers may write only the slots the
    /// engine opens. What an engine uses; a fresh pool accepts transfers into any slot.
    pub fn with_guarded_slots(self) -> Self {
        KvStore {
            gate: SlotGate::new(self.num_slots, true),
            ..self
        }
    }

    /// Which slots receivers may write now.
    pub fn gate(&self) -> &SlotGate {
        &self.gate
    }

    /// Where the pool's bytes live.
    pub fn device(&self) -> KvDevice {
        match &self.memory {
            Memory::Host { .. } => KvDevice::Cpu,
            #[cfg(feature = "cuda")]
            Memory::Device(pool) => KvDevice::Cuda(pool.ordinal()),
        }
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// Copies one token's K/V into `slot`.
    ///
    /// # Panics
    /// If `slot >= num_slots()`, `bytes.len() != shape().bytes_per_token()` or a receiving
    /// transport is writing `slot` now (see [`SlotGate`]): all bugs in the caller's bookkeeping,
    /// like an out-of-range slice index. On a GPU pool, also if the device fails (it is lost:
    /// the engine cannot go on).
    pub fn write_slot(&self, slot: u32, bytes: &[u8]) {
        self.check_slot_access(slot, bytes.len());
        self.gate.with_unclaimed(slot, || match &self.memory {
            Memory::Host { map, .. } => map.copy_from_slice(self.slot_offset(slot), bytes),
            #[cfg(feature = "cuda")]
            Memory::Device(pool) => pool.write(self.slot_offset(slot), bytes),
        })
    }

    /// Copies one token's K/V out of `slot`.
    ///
    /// # Panics
    /// As [`KvStore::write_slot`].
    pub fn read_slot(&self, slot: u32, out: &mut [u8]) {
        self.check_slot_access(slot, out.len());
        self.gate.with_unclaimed(slot, || match &self.memory {
            Memory::Host { map, .. } => map.copy_to_slice(self.slot_offset(slot), out),
            #[cfg(feature = "cuda")]
            Memory::Device(pool) => pool.read(self.slot_offset(slot), out),
        })
    }

    /// [`KvStore::read_slot`] into a fresh buffer.
    pub fn read_slot_to_vec(&self, slot: u32) -> Vec<u8> {
        let mut out = vec![0; self.shape.bytes_per_token()];
        self.read_slot(slot, &mut out);
        out
    }

    fn check_slot_access(&self, slot: u32, len: usize) {
        assert!(
            slot < self.num_slots,
            "slot {slot} out of range (pool has {})",
            self.num_slots
        );
        assert_eq!(
            len,
            self.shape.bytes_per_token(),
            "slot buffer has the wrong length"
        );
    }

    pub(crate) fn slot_offset(&self, slot: u32) -> usize {
        slot as usize * self.shape.bytes_per_token()
    }

    /// The host pool's memfd.
    ///
    /// # Panics
    /// On a GPU pool: the shm and tcp transports that call this are never started on one
    /// (`KvTransport::start_with` refuses with [`KvError::TransportDevice`]).
    pub(crate) fn memfd(&self) -> BorrowedFd<'_> {
        self.host_memory().0.as_fd()
    }

    /// The host pool's mapping; panics as [`KvStore::memfd`].
    pub(crate) fn mapping(&self) -> &Mapping {
        self.host_memory().1
    }

    fn host_memory(&self) -> (&OwnedFd, &Mapping) {
        match &self.memory {
            Memory::Host { memfd, map } => (memfd, map),
            #[cfg(feature = "cuda")]
            Memory::Device(pool) => panic!(
                "the KV pool on cuda:{} was handed to a host transport",
                pool.ordinal()
            ),
        }
    }

    /// The GPU pool, for the cuda transport.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_pool(&self) -> Option<&super::cuda::DevicePool> {
        match &self.memory {
            Memory::Device(pool) => Some(pool),
            Memory::Host { .. } => None,
        }
    }
}

/// Size in bytes of a pool, rejecting empty and unaddressable ones.
pub(crate) fn pool_bytes(shape: KvShape, num_slots: u32) -> Result<usize, KvError> {
    let bytes_per_token = shape.bytes_per_token();
    let err = |reason| KvError::PoolSize {
        num_slots,
        bytes_per_token,
        reason,
    };
    if num_slots == 0 || bytes_per_token == 0 {
        return Err(err("the pool would be empty"));
    }
    (num_slots as usize)
        .checked_mul(bytes_per_token)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| err("the size overflows the address space"))
}

/// A `MAP_SHARED` read-write mapping of a whole memfd, unmapped on drop.
///
/// Bytes are moved in and out only with raw copies (never handed out as long-lived references
/// except through the `unsafe` slice accessors), because another process may map the same pages.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value until drop, with no thread affinity.
// Bounds checks alone would not prevent races; what does is slot ownership: the raw copies
// (`copy_from_slice`, `copy_to_slice`) go through `KvStore::read_slot`/`write_slot`, which hold
// the pool's `SlotGate` and refuse a slot a receiver has claimed, and the only long-lived views
// (`slice`, `slice_mut`) are `unsafe fn`s whose callers hold a `WriteClaim` (receiver) or a
// lease the engine does not write while it lives (sender).
#[expect(
    unsafe_code,
    reason = "a raw shared mapping is safe to move between threads"
)]
unsafe impl Send for Mapping {}

// SAFETY: as for Send: `&Mapping` allows only bounds-checked raw copies, whose exclusion comes
// from the `SlotGate` claims and leases described there, and the `unsafe` views.
#[expect(
    unsafe_code,
    reason = "a raw shared mapping is safe to share between threads"
)]
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` shared and read-write. `len` must be > 0.
    #[expect(unsafe_code, reason = "mmap of a memfd")]
    pub(crate) fn map_shared(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<Self> {
        // SAFETY: a null hint lets the kernel pick fresh address space, so no existing Rust
        // object is affected; the caller checked the fd is at least `len` bytes and sealed
        // against shrinking, so every mapped page stays backed.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(std::io::ErrorKind::InvalidData)?;
        let map = Mapping { ptr, len };
        map.advise_huge_pages();
        Ok(map)
    }

    /// Transparent huge pages cut TLB misses on large copies; shmem may not allow them, which is
    /// fine, so failure is ignored.
    #[expect(unsafe_code, reason = "madvise on our own mapping")]
    fn advise_huge_pages(&self) {
        // SAFETY: the range is exactly our live mapping; MADV_HUGEPAGE changes no contents.
        let _ = unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                rustix::mm::Advice::LinuxHugepage,
            )
        };
    }

    fn check_range(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} outside a mapping of {} bytes",
            self.len
        );
    }

    #[expect(unsafe_code, reason = "raw copy into shared memory")]
    pub(crate) fn copy_from_slice(&self, offset: usize, src: &[u8]) {
        self.check_range(offset, src.len());
        // SAFETY: the range is inside the mapping (checked above) and `src` is ordinary memory,
        // which cannot overlap a mapping we never hand out mutably.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len());
        }
    }

    #[expect(unsafe_code, reason = "raw copy out of shared memory")]
    pub(crate) fn copy_to_slice(&self, offset: usize, dst: &mut [u8]) {
        self.check_range(offset, dst.len());
        // SAFETY: the range is inside the mapping (checked above); `dst` is an exclusive borrow
        // of other memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
    }

    /// Copies `len` bytes from `self[src_offset..]` to `dst[dst_offset..]`.
    ///
    /// Two mappings of one memfd alias the same pages (a transfer to ourselves), which no
    /// address check can see; overlapping slot ranges then get unspecified bytes, as they would
    /// from racing writers, but nothing outside the ranges is touched.
    #[expect(unsafe_code, reason = "raw copy between two shared mappings")]
    pub(crate) fn copy_to(&self, src_offset: usize, dst: &Mapping, dst_offset: usize, len: usize) {
        self.check_range(src_offset, len);
        dst.check_range(dst_offset, len);
        // SAFETY: both ranges are inside their live mappings (checked above), and only raw
        // pointers touch them (no Rust reference to either range exists here).
        unsafe {
            copy_bytes(
                self.ptr.as_ptr().add(src_offset),
                dst.ptr.as_ptr().add(dst_offset),
                len,
            );
        }
    }

    /// A shared view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// Nobody (in this or another process) may write those bytes while the slice lives: the
    /// caller holds the slots per the pool's ownership invariant.
    #[expect(
        unsafe_code,
        reason = "borrowing shared memory as a slice for socket I/O"
    )]
    pub(crate) unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        self.check_range(offset, len);
        // SAFETY: in bounds (checked above); no concurrent writers per this fn's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// An exclusive view of `len` bytes at `offset`.
    ///
    /// # Safety
    /// Nobody (in this or another process) may read or write those bytes while the slice lives:
    /// the caller owns the slots per the pool's ownership invariant.
    #[expect(
        unsafe_code,
        reason = "borrowing shared memory as a slice for socket I/O"
    )]
    #[expect(
        clippy::mut_from_ref,
        reason = "exclusivity is this fn's safety contract"
    )]
    pub(crate) unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        self.check_range(offset, len);
        // SAFETY: in bounds (checked above); exclusive per this fn's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

/// Runs at least this long are copied with non-temporal stores: they would evict the whole
/// cache anyway, and skipping the read-for-ownership of every destination line is what makes
/// glibc's memcpy fast on huge contiguous copies (its own threshold is a fraction of L3, above
/// the 2 MiB runs of a paged KV transfer).
const STREAMING_COPY_BYTES: usize = 256 << 10;

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// `src..src+len` must be readable and `dst..dst+len` writable, with no Rust reference to
/// either range alive.
#[expect(unsafe_code, reason = "raw memory copy")]
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAMING_COPY_BYTES {
        // SAFETY: forwarded from this fn's contract.
        unsafe { stream_copy_x86_64(src, dst, len) };
        return;
    }
    // SAFETY: forwarded from this fn's contract; `copy` tolerates overlap within one mapping.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// A forward copy with SSE2 (baseline on x86_64) streaming stores, 64 bytes per step, then a
/// store fence so the stores are ordered before whatever publishes the transfer.
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
#[expect(unsafe_code, reason = "SIMD streaming stores into shared memory")]
unsafe fn stream_copy_x86_64(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Streaming stores need a 16-byte-aligned destination: copy the head plainly.
    let head = dst.align_offset(16).min(len);
    // SAFETY (whole block): every access is inside `src..src+len` / `dst..dst+len`, which the
    // caller guarantees valid; `d` is 16-byte aligned after the head; loads are unaligned.
    unsafe {
        std::ptr::copy(src, dst, head);
        let (src, dst, len) = (src.add(head), dst.add(head), len - head);
        let blocks = len / 64;
        for i in 0..blocks {
            let s = src.add(i * 64).cast::<__m128i>();
            let d = dst.add(i * 64).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        let done = blocks * 64;
        std::ptr::copy(src.add(done), dst.add(done), len - done);
        _mm_sfence();
    }
}

impl Drop for Mapping {
    #[expect(unsafe_code, reason = "munmap of our own mapping")]
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping created in `map_shared`, and no borrow
        // of it can outlive `self`.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a KV pool mapping failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip_and_start_zeroed() {
        let store = KvStore::new(KvShape::SMALL, 8).unwrap();
        let bpt = KvShape::SMALL.bytes_per_token();
        assert_eq!(bpt, 256);
        let data: Vec<u8> = (0..bpt).map(|i| i as u8).collect();
        store.write_slot(7, &data);
        assert_eq!(store.read_slot_to_vec(7), data);
        assert_eq!(store.read_slot_to_vec(6), vec![0; bpt]);
    }

    #[test]
    fn memfd_is_sealed_against_resizing() {
        let store = KvStore::new(KvShape::SMALL, 4).unwrap();
        let seals = rustix::fs::fcntl_get_seals(store.memfd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW));
        assert!(rustix::fs::ftruncate(store.memfd(), 0).is_err());
    }

    #[test]
    fn rejects_empty_and_huge_pools() {
        assert!(matches!(
            KvStore::new(KvShape::SMALL, 0),
            Err(KvError::PoolSize { .. })
        ));
        let zero = KvShape {
            dtype_bytes: 0,
            ..KvShape::SMALL
        };
        assert!(matches!(
            KvStore::new(zero, 4),
            Err(KvError::PoolSize { .. })
        ));
        let huge = KvShape {
            layers: u32::MAX,
            kv_heads: u32::MAX,
            ..KvShape::SMALL
        };
        assert!(matches!(
            KvStore::new(huge, u32::MAX),
            Err(KvError::PoolSize { .. })
        ));
    }

    #[test]
    fn llama3_8b_is_128_kib_per_token() {
        assert_eq!(KvShape::LLAMA3_8B.bytes_per_token(), 128 << 10);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn out_of_range_slot_panics() {
        let store = KvStore::new(KvShape::SMALL, 4).unwrap();
        store.write_slot(4, &[0; 256]);
    }
}
