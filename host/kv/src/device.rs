//! Where a KV pool lives (`--kv-device cpu | cuda:N`) and what can go wrong on a GPU.
//!
//! Both exist whether or not switchyard was built with the `cuda` feature, so flags parse and
//! errors read the same everywhere; without the feature a GPU pool is refused with
//! [`CudaError::NotBuilt`] instead of a missing flag.

use std::str::FromStr;

use super::KvError;

/// The memory a KV pool is allocated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDevice {
    /// A sealed memfd in host memory (the shm and tcp transports).
    #[default]
    Cpu,
    /// Device memory of CUDA device `N` (the cuda transport).
    Cuda(u32),
}

impl std::fmt::Display for KvDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvDevice::Cpu => f.write_str("cpu"),
            KvDevice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for KvDevice {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self, KvError> {
        let bad = || KvError::BadDevice {
            device: s.to_owned(),
        };
        match s {
            "cpu" => Ok(KvDevice::Cpu),
            _ => {
                let ordinal = s.strip_prefix("cuda:").ok_or_else(bad)?;
                ordinal.parse().map(KvDevice::Cuda).map_err(|_| bad())
            }
        }
    }
}

/// What went wrong on the GPU path. Driver failures carry the call and CUDA's error name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error(
        "switchyard was built without the `cuda` feature (cargo build -p switchyard --features cuda)"
    )]
    NotBuilt,

    #[error("no CUDA driver: {reason}")]
    DriverMissing { reason: String },

    #[error("CUDA device {ordinal} does not exist: this machine has {count}")]
    NoDevice { ordinal: u32, count: u32 },

    #[error("{call} failed on CUDA device {ordinal}: {error}")]
    Driver {
        call: &'static str,
        ordinal: u32,
        error: String,
    },

    #[error("cannot build the gather/scatter kernel with NVRTC: {reason}")]
    Kernel { reason: String },

    #[error("KV peer's pool is on another host or process we cannot map: {reason}")]
    Peer { reason: String },
}

/// Checks that CUDA device `ordinal` can be used and returns its name: the gate for GPU tests
/// and benchmarks, which print `SKIPPED <name>: <error>` when it fails.
pub fn cuda_probe(ordinal: u32) -> Result<String, CudaError> {
    #[cfg(feature = "cuda")]
    {
        super::cuda::probe(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(CudaError::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays_devices() {
        for s in ["cpu", "cuda:0", "cuda:7"] {
            assert_eq!(s.parse::<KvDevice>().unwrap().to_string(), s);
        }
        assert_eq!("cuda:3".parse::<KvDevice>().unwrap(), KvDevice::Cuda(3));
        for s in ["", "gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CPU"] {
            assert!(
                matches!(s.parse::<KvDevice>(), Err(KvError::BadDevice { .. })),
                "{s}"
            );
        }
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn probe_without_the_feature_says_how_to_build_it() {
        let err = cuda_probe(0).unwrap_err();
        assert_eq!(err, CudaError::NotBuilt);
        assert!(err.to_string().contains("--features cuda"));
    }
}
