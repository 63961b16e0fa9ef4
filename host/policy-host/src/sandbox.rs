//! What a guest can reach: the data of its `Store` (memory cap, a closed WASI context, the log
//! sink) and the linker that gives it exactly two things, our `log` import and WASI p2 with no
//! files, environment, arguments, network or stdin.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime::component::{HasSelf, Linker, ResourceTable};
use wasmtime::{Engine, ResourceLimiter};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::LoadError;
use super::bindings::{Guest, GuestImports, Level, TypesHost};

/// Longest single log line a policy may write; longer ones are cut (at a char boundary).
const MAX_LOG_LINE: usize = 1024;

/// The data of one policy instance's `Store`.
pub(super) struct StoreState {
    policy: Arc<str>,
    pub(super) limiter: MemoryCap,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl StoreState {
    pub(super) fn new(policy: Arc<str>, memory_bytes: usize, output_bytes: usize) -> Self {
        let stdout = LogPipe::new(Arc::clone(&policy), "stdout", output_bytes);
        let stderr = LogPipe::new(Arc::clone(&policy), "stderr", output_bytes);
        // Everything denied: no preopens, env, args, sockets or name lookup; stdin is empty.
        // Clocks and random stay (a policy may want jitter), they reveal nothing about the host.
        let wasi = WasiCtxBuilder::new()
            .stdout(stdout)
            .stderr(stderr)
            .allow_ip_name_lookup(false)
            .allow_tcp(false)
            .allow_udp(false)
            .socket_addr_check(|_, _| Box::pin(async { false }))
            .build();
        StoreState {
            policy,
            limiter: MemoryCap::new(memory_bytes),
            wasi,
            table: ResourceTable::new(),
        }
    }
}

impl WasiView for StoreState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// The `types` interface has no functions; the generated bindings still want it implemented.
impl TypesHost for StoreState {}

impl GuestImports for StoreState {
    fn log(&mut self, level: Level, message: String) {
        emit(&self.policy, level, truncate(&message, MAX_LOG_LINE));
    }
}

fn emit(policy: &str, level: Level, message: &str) {
    match level {
        Level::Trace => tracing::trace!(policy, "{message}"),
        Level::Debug => tracing::debug!(policy, "{message}"),
        Level::Info => tracing::info!(policy, "{message}"),
        Level::Warn => tracing::warn!(policy, "{message}"),
        Level::Error => tracing::error!(policy, "{message}"),
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The linker every policy is instantiated with: the world's `log` import plus WASI p2 (sync),
/// which Rust std, componentize-py and componentize-js guests import even when they never use it.
pub(super) fn linker(engine: &Engine) -> Result<Linker<StoreState>, LoadError> {
    let mut linker = Linker::new(engine);
    let link_error = |e: wasmtime::Error| LoadError::Engine {
        reason: format!("cannot build the policy linker: {e:#}"),
    };
    Guest::add_to_linker::<StoreState, HasSelf<StoreState>>(&mut linker, |s| s)
        .map_err(link_error)?;
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(link_error)?;
    super::blocking_io::shadow_in(&mut linker).map_err(link_error)?;
    Ok(linker)
}

// === impl MemoryCap ===

/// Caps linear memory and table growth. It traps the guest as soon as a growth would pass the
/// cap (rather than letting `memory.grow` return -1, which guests handle in unpredictable ways)
/// and remembers that it did, so the host can tell a memory error from any other trap.
pub(super) struct MemoryCap {
    limit: usize,
    exceeded: bool,
}

impl MemoryCap {
    fn new(limit: usize) -> Self {
        MemoryCap {
            limit,
            exceeded: false,
        }
    }

    pub(super) fn exceeded(&self) -> bool {
        self.exceeded
    }
}

/// Table elements are small; this bounds a guest that grows tables in a loop.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.exceeded = true;
            return Err(wasmtime::format_err!(
                "policy memory would grow to {desired} bytes, over its cap of {} bytes",
                self.limit
            ));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

// === impl LogPipe ===

/// A guest's stdout or stderr: complete lines go to the log tagged with the policy's name, up to
/// a byte budget per instance; past it, output is dropped silently (never a trap, a chatty policy
/// must not fail requests).
#[derive(Clone)]
struct LogPipe {
    inner: Arc<Mutex<LogPipeState>>,
}

struct LogPipeState {
    policy: Arc<str>,
    stream: &'static str,
    budget: usize,
    line: Vec<u8>,
}

impl LogPipe {
    fn new(policy: Arc<str>, stream: &'static str, budget: usize) -> Self {
        LogPipe {
            inner: Arc::new(Mutex::new(LogPipeState {
                policy,
                stream,
                budget,
                line: Vec::new(),
            })),
        }
    }

    fn write_bytes(&self, bytes: &[u8]) {
        let mut state = self.inner.lock();
        let take = bytes.len().min(state.budget);
        state.budget -= take;
        for &b in &bytes[..take] {
            if b == b'\n' {
                state.flush_line();
            } else if state.line.len() < MAX_LOG_LINE {
                state.line.push(b);
            }
        }
        if state.budget == 0 {
            state.flush_line();
        }
    }
}

impl LogPipeState {
    fn flush_line(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let text = String::from_utf8_lossy(&self.line);
        tracing::info!(policy = %self.policy, stream = self.stream, "{text}");
        self.line.clear();
    }
}

impl IsTerminal for LogPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for LogPipe {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.write_bytes(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 * 1024)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for LogPipe {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for LogPipe {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.write_bytes(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}
