//! `wasi:io/streams` and `wasi:io/poll` for policies called from Tokio runtimes, with the time
//! a guest spends blocked charged to its call.
//!
//! WASI's synchronous bindings run the blocking functions of these interfaces (a guest writing
//! to stdout or stderr with `blocking-write-and-flush`, dropping a stream, polling) through
//! `Handle::block_on`, which panics on a thread that runs a Tokio runtime unless the runtime
//! lets it: a multi-thread worker first hands its other tasks to another thread
//! (`block_in_place`); a current-thread runtime (each of the router's connection workers) cannot,
//! so the function runs on a thread of its own, outside any runtime, while the caller waits.
//! Doing either around every policy call would cost a thread hand-off per request; doing it
//! only around those functions costs nothing for the calls that never print. So the linker
//! shadows wasmtime-wasi's versions of both interfaces with these, which delegate to
//! wasmtime-wasi and wrap exactly its blocking functions in [`off_runtime`].
//!
//! Waiting in `poll` (a guest's sleep) uses no CPU, so the CPU-time deadline (see `deadline`)
//! would never see it: the wait is charged to the call, and cut off where the call's budget
//! ends, so a guest that sleeps is stopped like one that spins.

use std::time::Instant;

use tokio::runtime::{Handle, RuntimeFlavor};
use wasmtime::Trap;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::io::poll as async_poll;
use wasmtime_wasi::p2::bindings::sync::io::poll::{self, Pollable};
use wasmtime_wasi::p2::bindings::sync::io::streams::{self, InputStream, OutputStream};
use wasmtime_wasi::p2::{StreamError, StreamResult};
use wasmtime_wasi::runtime::in_tokio;

use super::deadline::CallClock;

/// Add both interfaces to `linker` in place of wasmtime-wasi's (which must be added first);
/// `project` gives them a store's resource table and call clock.
pub(super) fn shadow_in<T: 'static>(
    linker: &mut Linker<T>,
    project: fn(&mut T) -> BlockingIo<'_>,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let linked = poll::add_to_linker::<T, HasBlockingIo>(linker, project)
        .and_then(|()| streams::add_to_linker::<T, HasBlockingIo>(linker, project));
    linker.allow_shadowing(false);
    linked
}

/// Run `f`, which may block the thread, from wherever the caller is: on a multi-thread Tokio
/// worker the worker's other tasks move to another thread first. A current-thread runtime
/// cannot hand its tasks elsewhere, so there `f` runs as is (and holds them up).
pub(super) fn allow_blocking<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Run `f`, which may call wasmtime-wasi's `in_tokio` (a `block_on`), where that may block: on
/// a multi-thread worker as [`allow_blocking`] does; on a current-thread runtime on a thread of
/// its own, which no runtime runs on (`in_tokio` then uses wasmtime-wasi's runtime), while the
/// caller's thread waits for it. Without a thread for it `f` does not run; every caller
/// returns the error to the guest as a trap (`?` converts it into both WASI error types), so
/// the call faults and the request is planned by the fallback policy.
pub(super) fn off_runtime<R: Send>(f: impl FnOnce() -> R + Send) -> Result<R, NoIoThread> {
    match Handle::try_current().map(|handle| handle.runtime_flavor()) {
        Ok(RuntimeFlavor::CurrentThread) => on_thread_of_its_own(
            std::thread::Builder::new().name("policy-wasi-io".to_owned()),
            f,
        ),
        _ => Ok(allow_blocking(f)),
    }
}

/// Run `f` on a thread that `thread` starts, and wait for it; a panic in `f` goes on in the
/// caller.
fn on_thread_of_its_own<R: Send>(
    thread: std::thread::Builder,
    f: impl FnOnce() -> R + Send,
) -> Result<R, NoIoThread> {
    std::thread::scope(|scope| {
        let running = thread.spawn_scoped(scope, f).map_err(NoIoThread)?;
        Ok(running
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    })
}

/// No thread could be started for a guest's blocking I/O (the process is at its thread limit,
/// or out of memory).
#[derive(Debug, thiserror::Error)]
#[error("no thread for the policy's blocking I/O: {0}")]
pub(super) struct NoIoThread(std::io::Error);

/// The stream functions' errors: a trap, as `wasmtime::Error`'s conversion makes it for the
/// others.
impl From<NoIoThread> for StreamError {
    fn from(e: NoIoThread) -> Self {
        StreamError::Trap(e.into())
    }
}

struct HasBlockingIo;

impl HasData for HasBlockingIo {
    type Data<'a> = BlockingIo<'a>;
}

/// A store's resource table and the clock of the call running in it, serving the two
/// interfaces.
pub(super) struct BlockingIo<'a> {
    table: &'a mut ResourceTable,
    clock: &'a mut CallClock,
}

impl<'a> BlockingIo<'a> {
    pub(super) fn new(table: &'a mut ResourceTable, clock: &'a mut CallClock) -> Self {
        BlockingIo { table, clock }
    }

    /// Wait for `wait` to finish, for no longer than what is left of the call's budget, and
    /// charge the wait to the call; past the budget the guest traps, as at its deadline.
    fn wait<R: Send>(
        &mut self,
        wait: impl AsyncFnOnce(&mut ResourceTable) -> wasmtime::Result<R> + Send,
    ) -> wasmtime::Result<R> {
        // A poll that is ready at once returns even with no budget left: `timeout` polls the
        // wait before its timer.
        let budget = self.clock.remaining();
        let started = Instant::now();
        let table = &mut *self.table;
        let waited =
            off_runtime(|| in_tokio(async { tokio::time::timeout(budget, wait(table)).await }));
        self.clock.charge_wait(started.elapsed());
        match waited? {
            Ok(result) => result,
            Err(_elapsed) => {
                self.clock.overrun();
                Err(Trap::Interrupt.into())
            }
        }
    }
}

impl poll::Host for BlockingIo<'_> {
    fn poll(&mut self, pollables: Vec<Resource<Pollable>>) -> wasmtime::Result<Vec<u32>> {
        self.wait(async |table| async_poll::Host::poll(table, pollables).await)
    }
}

impl poll::HostPollable for BlockingIo<'_> {
    fn ready(&mut self, pollable: Resource<Pollable>) -> wasmtime::Result<bool> {
        off_runtime(|| poll::HostPollable::ready(self.table, pollable))?
    }

    fn block(&mut self, pollable: Resource<Pollable>) -> wasmtime::Result<()> {
        self.wait(async |table| async_poll::HostPollable::block(table, pollable).await)
    }

    fn drop(&mut self, pollable: Resource<Pollable>) -> wasmtime::Result<()> {
        poll::HostPollable::drop(self.table, pollable)
    }
}

impl streams::Host for BlockingIo<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        streams::Host::convert_stream_error(self.table, err)
    }
}

impl streams::HostOutputStream for BlockingIo<'_> {
    fn drop(&mut self, stream: Resource<OutputStream>) -> wasmtime::Result<()> {
        off_runtime(|| streams::HostOutputStream::drop(self.table, stream))?
    }

    fn check_write(&mut self, stream: Resource<OutputStream>) -> StreamResult<u64> {
        streams::HostOutputStream::check_write(self.table, stream)
    }

    fn write(&mut self, stream: Resource<OutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        streams::HostOutputStream::write(self.table, stream, bytes)
    }

    fn blocking_write_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        bytes: Vec<u8>,
    ) -> StreamResult<()> {
        off_runtime(|| {
            streams::HostOutputStream::blocking_write_and_flush(self.table, stream, bytes)
        })?
    }

    fn blocking_write_zeroes_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        len: u64,
    ) -> StreamResult<()> {
        off_runtime(|| {
            streams::HostOutputStream::blocking_write_zeroes_and_flush(self.table, stream, len)
        })?
    }

    fn subscribe(
        &mut self,
        stream: Resource<OutputStream>,
    ) -> wasmtime::Result<Resource<Pollable>> {
        streams::HostOutputStream::subscribe(self.table, stream)
    }

    fn write_zeroes(&mut self, stream: Resource<OutputStream>, len: u64) -> StreamResult<()> {
        streams::HostOutputStream::write_zeroes(self.table, stream, len)
    }

    fn flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        streams::HostOutputStream::flush(self.table, stream)
    }

    fn blocking_flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        off_runtime(|| streams::HostOutputStream::blocking_flush(self.table, stream))?
    }

    fn splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        streams::HostOutputStream::splice(self.table, dst, src, len)
    }

    fn blocking_splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        off_runtime(|| streams::HostOutputStream::blocking_splice(self.table, dst, src, len))?
    }
}

impl streams::HostInputStream for BlockingIo<'_> {
    fn drop(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<()> {
        off_runtime(|| streams::HostInputStream::drop(self.table, stream))?
    }

    fn read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        streams::HostInputStream::read(self.table, stream, len)
    }

    fn blocking_read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        off_runtime(|| streams::HostInputStream::blocking_read(self.table, stream, len))?
    }

    fn skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        streams::HostInputStream::skip(self.table, stream, len)
    }

    fn blocking_skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        off_runtime(|| streams::HostInputStream::blocking_skip(self.table, stream, len))?
    }

    fn subscribe(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<Resource<Pollable>> {
        streams::HostInputStream::subscribe(self.table, stream)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A thread whose stack cannot be mapped (an exbibyte) is never started, as when the
    /// process is at its thread limit: the I/O does not run and the guest gets a trap.
    #[test]
    fn no_thread_for_the_io_is_a_trap_not_a_panic() {
        let unstartable = std::thread::Builder::new().stack_size(1 << 60);
        let ran = AtomicBool::new(false);
        let e = on_thread_of_its_own(unstartable, || ran.store(true, Ordering::SeqCst))
            .expect_err("no thread has an exbibyte of stack");
        assert!(!ran.load(Ordering::SeqCst), "the I/O ran without a thread");
        assert!(
            e.to_string()
                .starts_with("no thread for the policy's blocking I/O: "),
            "{e}"
        );
        assert!(matches!(StreamError::from(e), StreamError::Trap(_)));
    }

    #[test]
    fn the_io_runs_on_a_thread_of_its_own() {
        let caller = std::thread::current().id();
        let ran_on =
            on_thread_of_its_own(std::thread::Builder::new(), || std::thread::current().id())
                .expect("a thread starts");
        assert_ne!(ran_on, caller);
    }
}
