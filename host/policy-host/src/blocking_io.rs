//! `wasi:io/streams` and `wasi:io/poll` for policies called from Tokio worker threads.
//!
//! WASI's synchronous bindings run the blocking functions of these interfaces (a guest writing
//! to stdout or stderr with `blocking-write-and-flush`, dropping a stream, polling) through
//! `Handle::block_on`, which panics on a Tokio worker thread unless the worker first hands its
//! other tasks to another thread (`block_in_place`). Doing that around every policy call costs
//! a thread wake-up per request; doing it only around those functions costs nothing for the
//! calls that never print. So the linker shadows wasmtime-wasi's versions of both interfaces
//! with these, which delegate to wasmtime-wasi and wrap exactly its blocking functions in
//! [`allow_blocking`].

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::WasiView;
use wasmtime_wasi::p2::bindings::sync::io::poll::{self, Pollable};
use wasmtime_wasi::p2::bindings::sync::io::streams::{self, InputStream, OutputStream};
use wasmtime_wasi::p2::{StreamError, StreamResult};

/// Add both interfaces to `linker` in place of wasmtime-wasi's (which must be added first).
pub(super) fn shadow_in<T: WasiView + 'static>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let linked = poll::add_to_linker::<T, HasBlockingIo>(linker, |t| BlockingIo(t.ctx().table))
        .and_then(|()| {
            streams::add_to_linker::<T, HasBlockingIo>(linker, |t| BlockingIo(t.ctx().table))
        });
    linker.allow_shadowing(false);
    linked
}

/// Run `f`, which may block, from wherever the caller is: on a multi-thread Tokio worker the
/// worker's other tasks move to another thread first. A current-thread runtime cannot hand its
/// tasks elsewhere, so there `f` runs as is.
pub(super) fn allow_blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

struct HasBlockingIo;

impl HasData for HasBlockingIo {
    type Data<'a> = BlockingIo<'a>;
}

/// A store's resource table, serving the two interfaces.
struct BlockingIo<'a>(&'a mut ResourceTable);

impl poll::Host for BlockingIo<'_> {
    fn poll(&mut self, pollables: Vec<Resource<Pollable>>) -> wasmtime::Result<Vec<u32>> {
        allow_blocking(|| poll::Host::poll(self.0, pollables))
    }
}

impl poll::HostPollable for BlockingIo<'_> {
    fn ready(&mut self, pollable: Resource<Pollable>) -> wasmtime::Result<bool> {
        allow_blocking(|| poll::HostPollable::ready(self.0, pollable))
    }

    fn block(&mut self, pollable: Resource<Pollable>) -> wasmtime::Result<()> {
        allow_blocking(|| poll::HostPollable::block(self.0, pollable))
    }

    fn drop(&mut self, pollable: Resource<Pollable>) -> wasmtime::Result<()> {
        poll::HostPollable::drop(self.0, pollable)
    }
}

impl streams::Host for BlockingIo<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        streams::Host::convert_stream_error(self.0, err)
    }
}

impl streams::HostOutputStream for BlockingIo<'_> {
    fn drop(&mut self, stream: Resource<OutputStream>) -> wasmtime::Result<()> {
        allow_blocking(|| streams::HostOutputStream::drop(self.0, stream))
    }

    fn check_write(&mut self, stream: Resource<OutputStream>) -> StreamResult<u64> {
        streams::HostOutputStream::check_write(self.0, stream)
    }

    fn write(&mut self, stream: Resource<OutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        streams::HostOutputStream::write(self.0, stream, bytes)
    }

    fn blocking_write_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        bytes: Vec<u8>,
    ) -> StreamResult<()> {
        allow_blocking(|| {
            streams::HostOutputStream::blocking_write_and_flush(self.0, stream, bytes)
        })
    }

    fn blocking_write_zeroes_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        len: u64,
    ) -> StreamResult<()> {
        allow_blocking(|| {
            streams::HostOutputStream::blocking_write_zeroes_and_flush(self.0, stream, len)
        })
    }

    fn subscribe(
        &mut self,
        stream: Resource<OutputStream>,
    ) -> wasmtime::Result<Resource<Pollable>> {
        streams::HostOutputStream::subscribe(self.0, stream)
    }

    fn write_zeroes(&mut self, stream: Resource<OutputStream>, len: u64) -> StreamResult<()> {
        streams::HostOutputStream::write_zeroes(self.0, stream, len)
    }

    fn flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        streams::HostOutputStream::flush(self.0, stream)
    }

    fn blocking_flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        allow_blocking(|| streams::HostOutputStream::blocking_flush(self.0, stream))
    }

    fn splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        streams::HostOutputStream::splice(self.0, dst, src, len)
    }

    fn blocking_splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        allow_blocking(|| streams::HostOutputStream::blocking_splice(self.0, dst, src, len))
    }
}

impl streams::HostInputStream for BlockingIo<'_> {
    fn drop(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<()> {
        allow_blocking(|| streams::HostInputStream::drop(self.0, stream))
    }

    fn read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        streams::HostInputStream::read(self.0, stream, len)
    }

    fn blocking_read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        allow_blocking(|| streams::HostInputStream::blocking_read(self.0, stream, len))
    }

    fn skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        streams::HostInputStream::skip(self.0, stream, len)
    }

    fn blocking_skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        allow_blocking(|| streams::HostInputStream::blocking_skip(self.0, stream, len))
    }

    fn subscribe(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<Resource<Pollable>> {
        streams::HostInputStream::subscribe(self.0, stream)
    }
}
