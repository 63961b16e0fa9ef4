//! The gather/scatter kernel: every merged run of a transfer in one launch.
//!
//! Compiled at run time with NVRTC (PTX, JIT-compiled by the driver for whatever GPU is there),
//! so nothing needs nvcc at build time. One block row per run (`blockIdx.y`), blocks along x
//! stride over the run in 16-byte words, so a few hundred 2 MiB runs become one launch instead
//! of a few hundred `cuMemcpyDtoDAsync` calls, each with its own launch gap.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::driver::{Device, Stream, kernel_arg};
use crate::CudaError;

const SOURCE: &str = r#"
extern "C" __global__ void copy_runs(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                     const unsigned long long* __restrict__ runs) {
    // runs[3*i .. 3*i+3] = source word, destination word, words, for run i = blockIdx.y.
    const unsigned long long* run = runs + 3ull * blockIdx.y;
    const uint4* s = src + run[0];
    uint4* d = dst + run[1];
    const unsigned long long words = run[2];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < words; i += stride) {
        d[i] = s[i];
    }
}
"#;

/// Bytes each thread moves per step.
pub(crate) const WORD: usize = 16;
const THREADS: u32 = 256;
/// Most runs in one launch: the grid's y dimension limit.
pub(crate) const MAX_RUNS_PER_LAUNCH: usize = 65_535;
/// Blocks along a run, at most: enough to keep every SM busy on a single long run.
const MAX_BLOCKS_PER_RUN: u64 = 1024;

/// The compiled kernel, loaded into one device's context.
pub(crate) struct CopyKernel {
    device: Arc<Device>,
    module: sys::CUmodule,
    function: sys::CUfunction,
}

impl CopyKernel {
    /// Compiles and loads the kernel; an error when NVRTC (the CUDA toolkit's libnvrtc) is
    /// missing, so callers fall back to batched copies.
    #[allow(unsafe_code, reason = "loading a module and looking up its function")]
    pub(crate) fn load(device: Arc<Device>) -> Result<Self, CudaError> {
        if !nvrtc_present() {
            return Err(CudaError::Kernel {
                reason: "libnvrtc not found (install the CUDA toolkit's NVRTC)".into(),
            });
        }
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| CudaError::Kernel {
            reason: e.to_string(),
        })?;
        let image = CString::new(ptx.to_src()).map_err(|e| CudaError::Kernel {
            reason: e.to_string(),
        })?;
        device.bind()?;
        // SAFETY: `image` is NUL-terminated PTX text, which cuModuleLoadData accepts.
        let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(device.err("cuModuleLoadData"))?;
        let name = CString::from(c"copy_runs");
        // SAFETY: `module` is the module just loaded.
        let function = match unsafe { result::module::get_function(module, name) } {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: unloading the module we loaded and nobody else uses.
                let _ = unsafe { result::module::unload(module) };
                return Err(device.err("cuModuleGetFunction")(e));
            }
        };
        Ok(CopyKernel {
            device,
            module,
            function,
        })
    }

    /// Enqueues one launch over `runs` (`[src_word, dst_word, words]` each, already on the
    /// device at `runs_ptr`); `max_words` is the longest run.
    ///
    /// # Safety
    /// `src`/`dst` plus every run's word range must be allocated device memory, 16-byte
    /// aligned, until `stream` is synchronised; `runs_ptr` holds `num_runs` triples.
    #[allow(unsafe_code, reason = "cuLaunchKernel")]
    pub(crate) unsafe fn launch(
        &self,
        stream: &Stream,
        src: sys::CUdeviceptr,
        dst: sys::CUdeviceptr,
        runs_ptr: sys::CUdeviceptr,
        num_runs: usize,
        max_words: u64,
    ) -> Result<(), CudaError> {
        debug_assert!(num_runs > 0 && num_runs <= MAX_RUNS_PER_LAUNCH);
        let blocks = max_words
            .div_ceil(u64::from(THREADS) * 4)
            .clamp(1, MAX_BLOCKS_PER_RUN) as u32;
        let mut args: [*mut c_void; 3] =
            [kernel_arg(&src), kernel_arg(&dst), kernel_arg(&runs_ptr)];
        // SAFETY: the function is live in this device's module; the argument pointers point
        // at locals that outlive the call (the driver copies them at launch); the memory the
        // kernel touches is valid per this fn's contract.
        unsafe {
            result::launch_kernel(
                self.function,
                (blocks, num_runs as u32, 1),
                (THREADS, 1, 1),
                0,
                stream.raw(),
                &mut args,
            )
        }
        .map_err(self.device.err("cuLaunchKernel"))
    }
}

#[allow(unsafe_code, reason = "probing for libnvrtc with dlopen")]
fn nvrtc_present() -> bool {
    // SAFETY: dlopen of NVIDIA's NVRTC library; it touches no Rust state.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

impl Drop for CopyKernel {
    #[allow(unsafe_code, reason = "unloading our own module")]
    fn drop(&mut self) {
        let unloaded = self.device.bind().and_then(|()| {
            // SAFETY: our module; launches on it were synchronised by the copier.
            unsafe { result::module::unload(self.module) }
                .map_err(self.device.err("cuModuleUnload"))
        });
        if let Err(e) = unloaded {
            tracing::warn!(error = %e, "unloading the KV copy kernel failed");
        }
    }
}

// SAFETY: module and function handles are context-wide, usable from any thread.
#[allow(unsafe_code, reason = "driver handles are thread-agnostic")]
unsafe impl Send for CopyKernel {}
// SAFETY: as for Send; launching is serialised by the copier's mutex.
#[allow(unsafe_code, reason = "driver handles are thread-agnostic")]
unsafe impl Sync for CopyKernel {}
