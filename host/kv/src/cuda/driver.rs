//! A small safe wrapper over the CUDA driver calls the KV path needs.
//!
//! cudarc loads libcuda at run time and panics on the first driver call if it is missing, so
//! [`init`] checks for the library before anything else touches the driver and every other
//! entry point goes through it: no driver means an error, never a panic.
//!
//! Every call runs with the device's primary context current on the calling thread
//! ([`Device::bind`]); the driver API is thread-safe, so the values here are `Send + Sync` and
//! are used from tokio's blocking pool and the engine's step thread alike.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};

use crate::CudaError;

/// A driver error with the call that failed and the device it failed on.
pub(crate) fn driver_err(
    call: &'static str,
    ordinal: u32,
) -> impl Fn(result::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        ordinal,
        error: e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0)),
    }
}

/// Loads libcuda and runs `cuInit` once per process; later calls return the first outcome.
pub(crate) fn init() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_library_present() {
            return Err(CudaError::DriverMissing {
                reason: "libcuda.so.1 not found (no NVIDIA driver on this machine)".into(),
            });
        }
        result::init().map_err(driver_err("cuInit", 0))
    })
    .clone()
}

#[allow(unsafe_code, reason = "probing for libcuda with dlopen")]
fn driver_library_present() -> bool {
    // SAFETY: dlopen of the NVIDIA driver library; its initialisers are the vendor's and touch
    // no Rust state. The handle is dropped again (cudarc opens its own on first use).
    unsafe { sys::is_culib_present() }
}

/// One CUDA device and a reference to its primary context (released on drop).
pub(crate) struct Device {
    ordinal: u32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext is an opaque handle the driver allows any thread to make current; this
// type never hands out anything tied to one thread.
#[allow(unsafe_code, reason = "driver handles are thread-agnostic")]
unsafe impl Send for Device {}
// SAFETY: as for Send; every method only passes the handle to thread-safe driver calls.
#[allow(unsafe_code, reason = "driver handles are thread-agnostic")]
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

impl Device {
    /// Opens device `ordinal`, initialising the driver on first use.
    pub(crate) fn open(ordinal: u32) -> Result<Arc<Device>, CudaError> {
        init()?;
        let count = result::device::get_count().map_err(driver_err("cuDeviceGetCount", ordinal))?;
        let count = u32::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let dev =
            result::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet", ordinal))?;
        let ctx =
            retain_primary_context(dev).map_err(driver_err("cuDevicePrimaryCtxRetain", ordinal))?;
        Ok(Arc::new(Device { ordinal, dev, ctx }))
    }

    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    pub(crate) fn name(&self) -> Result<String, CudaError> {
        result::device::get_name(self.dev).map_err(self.err("cuDeviceGetName"))
    }

    /// Makes this device's context current on the calling thread: driver calls act on it.
    #[allow(unsafe_code, reason = "cuCtxSetCurrent with our own retained context")]
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is the primary context we retained and hold until drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(self.err("cuCtxSetCurrent"))
    }

    pub(crate) fn err(&self, call: &'static str) -> impl Fn(result::DriverError) -> CudaError {
        driver_err(call, self.ordinal)
    }
}

#[allow(unsafe_code, reason = "cuDevicePrimaryCtxRetain")]
fn retain_primary_context(dev: sys::CUdevice) -> Result<sys::CUcontext, result::DriverError> {
    // SAFETY: `dev` came from cuDeviceGet on an initialised driver.
    unsafe { result::primary_ctx::retain(dev) }
}

impl Drop for Device {
    #[allow(unsafe_code, reason = "releasing the primary context we retained")]
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; nothing of ours uses the context after this.
        if let Err(e) = unsafe { result::primary_ctx::release(self.dev) } {
            tracing::warn!(device = self.ordinal, error = ?e, "releasing a CUDA context failed");
        }
    }
}

/// A plain `cuMemAlloc` allocation, zeroed, freed on drop.
///
/// Not the stream-ordered allocator (`cuMemAllocAsync`): memory from its pools cannot be
/// exported with `cuIpcGetMemHandle`, and exporting is the point of a KV pool.
pub(crate) struct DeviceBuffer {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    #[allow(unsafe_code, reason = "cuMemAlloc and cuMemsetD8")]
    pub(crate) fn zeroed(device: Arc<Device>, len: usize) -> Result<Self, CudaError> {
        device.bind()?;
        // SAFETY: a fresh allocation on the bound context; nothing else refers to it yet.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(device.err("cuMemAlloc"))?;
        let buffer = DeviceBuffer { device, ptr, len };
        // SAFETY: `ptr..ptr+len` is the allocation just made (freed by our drop on error).
        unsafe { result::memset_d8_sync(buffer.ptr, 0, len) }
            .map_err(buffer.device.err("cuMemsetD8"))?;
        Ok(buffer)
    }

    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The handle another process opens with [`ImportedBuffer::open`].
    #[allow(unsafe_code, reason = "cuIpcGetMemHandle")]
    pub(crate) fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN], CudaError> {
        self.device.bind()?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: `ptr` is the base of a live cuMemAlloc allocation; `handle` is writable.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.ptr) }
            .result()
            .map_err(self.device.err("cuIpcGetMemHandle"))?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    /// Copies `src` into the buffer at `offset` and waits for it.
    ///
    /// # Panics
    /// If the range is outside the buffer: a bug in the caller's slot arithmetic.
    #[allow(unsafe_code, reason = "cuMemcpyHtoD")]
    pub(crate) fn write(&self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        check_range(offset, src.len(), self.len);
        self.device.bind()?;
        // SAFETY: the range is inside our live allocation (checked above); the copy is
        // synchronous, so `src` outlives it.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) }
            .map_err(self.device.err("cuMemcpyHtoD"))
    }

    /// Copies bytes at `offset` out into `dst` and waits for it.
    ///
    /// # Panics
    /// As [`DeviceBuffer::write`].
    #[allow(unsafe_code, reason = "cuMemcpyDtoH")]
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        check_range(offset, dst.len(), self.len);
        self.device.bind()?;
        // SAFETY: as for `write`; `dst` is an exclusive borrow for the whole synchronous copy.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }
            .map_err(self.device.err("cuMemcpyDtoH"))
    }
}

fn check_range(offset: usize, len: usize, size: usize) {
    assert!(
        offset.checked_add(len).is_some_and(|end| end <= size),
        "range {offset}+{len} outside a device buffer of {size} bytes"
    );
}

impl Drop for DeviceBuffer {
    #[allow(unsafe_code, reason = "cuMemFree of our own allocation")]
    fn drop(&mut self) {
        let freed = self.device.bind().and_then(|()| {
            // SAFETY: `ptr` is our allocation; every copy that used it was synchronised before
            // the `Arc`s that keep this buffer alive were dropped.
            unsafe { result::free_sync(self.ptr) }.map_err(self.device.err("cuMemFree"))
        });
        if let Err(e) = freed {
            tracing::warn!(error = %e, "freeing a KV device buffer failed");
        }
    }
}

// SAFETY: a device address and a thread-safe device handle; see the module docs.
#[allow(unsafe_code, reason = "device memory is not tied to a host thread")]
unsafe impl Send for DeviceBuffer {}
// SAFETY: as for Send; `&DeviceBuffer` only allows bounds-checked synchronous copies.
#[allow(unsafe_code, reason = "device memory is not tied to a host thread")]
unsafe impl Sync for DeviceBuffer {}

/// Bytes in a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub(crate) const IPC_HANDLE_LEN: usize = sys::CU_IPC_HANDLE_SIZE as usize;

/// Another process's allocation mapped into ours with `cuIpcOpenMemHandle`, closed on drop.
pub(crate) struct ImportedBuffer {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
}

impl ImportedBuffer {
    /// Maps the allocation behind `handle` on `device`. Peer access to the exporter's device is
    /// enabled lazily, so a pool on another GPU of the node works too (over NVLink or PCIe).
    #[allow(unsafe_code, reason = "cuIpcOpenMemHandle")]
    pub(crate) fn open(
        device: Arc<Device>,
        handle: [u8; IPC_HANDLE_LEN],
    ) -> Result<Self, CudaError> {
        device.bind()?;
        let handle = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is writable; a bad handle is reported by the driver, not UB.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(device.err("cuIpcOpenMemHandle"))?;
        Ok(ImportedBuffer { device, ptr })
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl Drop for ImportedBuffer {
    #[allow(unsafe_code, reason = "cuIpcCloseMemHandle of our own mapping")]
    fn drop(&mut self) {
        let closed = self.device.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and every copy into it was synchronised.
            unsafe { sys::cuIpcCloseMemHandle(self.ptr) }
                .result()
                .map_err(self.device.err("cuIpcCloseMemHandle"))
        });
        if let Err(e) = closed {
            tracing::warn!(error = %e, "unmapping a peer's KV pool failed");
        }
    }
}

// SAFETY: as for DeviceBuffer.
#[allow(unsafe_code, reason = "device memory is not tied to a host thread")]
unsafe impl Send for ImportedBuffer {}
// SAFETY: as for DeviceBuffer; it exposes only its address.
#[allow(unsafe_code, reason = "device memory is not tied to a host thread")]
unsafe impl Sync for ImportedBuffer {}

/// A non-blocking stream (it never waits on the legacy default stream), destroyed on drop.
pub(crate) struct Stream {
    device: Arc<Device>,
    raw: sys::CUstream,
}

impl Stream {
    pub(crate) fn new(device: Arc<Device>) -> Result<Self, CudaError> {
        device.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(device.err("cuStreamCreate"))?;
        Ok(Stream { device, raw })
    }

    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Enqueues a copy of `len` bytes between two device addresses.
    ///
    /// # Safety
    /// Both ranges must stay allocated until the stream is synchronised.
    #[allow(unsafe_code, reason = "cuMemcpyDtoDAsync")]
    pub(crate) unsafe fn copy_async(
        &self,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        len: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded from this fn's contract.
        unsafe { result::memcpy_dtod_async(dst, src, len, self.raw) }
            .map_err(self.device.err("cuMemcpyDtoDAsync"))
    }

    /// Enqueues a copy of host bytes to a device address.
    ///
    /// # Safety
    /// `src` and the device range must stay alive until the stream is synchronised.
    #[allow(unsafe_code, reason = "cuMemcpyHtoDAsync")]
    pub(crate) unsafe fn upload_async(
        &self,
        dst: sys::CUdeviceptr,
        src: &[u8],
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded from this fn's contract.
        unsafe { result::memcpy_htod_async(dst, src, self.raw) }
            .map_err(self.device.err("cuMemcpyHtoDAsync"))
    }

    /// Waits until everything enqueued so far has finished.
    #[allow(unsafe_code, reason = "cuStreamSynchronize")]
    pub(crate) fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` is our live stream.
        unsafe { result::stream::synchronize(self.raw) }
            .map_err(self.device.err("cuStreamSynchronize"))
    }
}

impl Drop for Stream {
    #[allow(unsafe_code, reason = "cuStreamDestroy of our own stream")]
    fn drop(&mut self) {
        // SAFETY: our stream; the driver finishes pending work before releasing it.
        if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
            tracing::warn!(error = ?e, "destroying a CUDA stream failed");
        }
    }
}

// SAFETY: streams may be used from any thread; the copier serialises use with a mutex.
#[allow(unsafe_code, reason = "driver handles are thread-agnostic")]
unsafe impl Send for Stream {}
// SAFETY: as for Send.
#[allow(unsafe_code, reason = "driver handles are thread-agnostic")]
unsafe impl Sync for Stream {}

/// Raw pointer to a kernel argument, as `cuLaunchKernel` wants them.
pub(crate) fn kernel_arg<T>(value: &T) -> *mut c_void {
    std::ptr::from_ref(value).cast_mut().cast()
}
