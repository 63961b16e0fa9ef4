//! A KV pool in device memory, and the registry that lets a transport in the same process find
//! it (CUDA IPC handles cannot be opened by the process that exported them).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;

use super::driver::{Device, DeviceBuffer, IPC_HANDLE_LEN};
use crate::CudaError;

/// Live pools of this process by id, for same-process transfers.
static LOCAL_POOLS: LazyLock<Mutex<HashMap<u64, Weak<DeviceBuffer>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// `num_slots` slots of `shape.bytes_per_token()` bytes on one device, zeroed at start.
pub(crate) struct DevicePool {
    id: u64,
    buffer: Arc<DeviceBuffer>,
    ipc_handle: [u8; IPC_HANDLE_LEN],
}

impl DevicePool {
    /// Allocates `bytes` (the caller sized it from the shape) on device `ordinal` and exports it.
    pub(crate) fn new(ordinal: u32, bytes: usize) -> Result<Self, CudaError> {
        let device = Device::open(ordinal)?;
        let buffer = Arc::new(DeviceBuffer::zeroed(device, bytes)?);
        let ipc_handle = buffer.ipc_handle()?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        LOCAL_POOLS.lock().insert(id, Arc::downgrade(&buffer));
        Ok(DevicePool {
            id,
            buffer,
            ipc_handle,
        })
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn ordinal(&self) -> u32 {
        self.buffer.device().ordinal()
    }

    pub(crate) fn buffer(&self) -> &Arc<DeviceBuffer> {
        &self.buffer
    }

    pub(crate) fn ipc_handle(&self) -> [u8; IPC_HANDLE_LEN] {
        self.ipc_handle
    }

    /// Writes one slot's bytes at `offset`. A driver failure here means the GPU is gone (the
    /// engine cannot go on), so it panics like the host pool's bounds checks.
    pub(crate) fn write(&self, offset: usize, bytes: &[u8]) {
        if let Err(e) = self.buffer.write(offset, bytes) {
            panic!("writing the KV pool on cuda:{} failed: {e}", self.ordinal());
        }
    }

    /// Reads one slot's bytes at `offset`; panics as [`DevicePool::write`].
    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) {
        if let Err(e) = self.buffer.read(offset, out) {
            panic!("reading the KV pool on cuda:{} failed: {e}", self.ordinal());
        }
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        LOCAL_POOLS.lock().remove(&self.id);
    }
}

/// The buffer of pool `id` of this process, if it is still alive.
pub(crate) fn local_pool(id: u64) -> Option<Arc<DeviceBuffer>> {
    LOCAL_POOLS.lock().get(&id).and_then(Weak::upgrade)
}
