//! What a guest can reach, and how much of it: the data of its `Store` (the resource caps, the
//! call's CPU-time clock, a closed WASI context, the log sink with its per-call budget) and the
//! linkers that give it exactly two things, its contract version's `log` import and WASI p2
//! with no files, environment, arguments, network or stdin.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime::component::{Linker, ResourceTable};
use wasmtime::{Engine, ResourceLimiter, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::LoadError;
use super::bindings::{self, Contract};
use super::blocking_io::{self, BlockingIo};
use super::deadline::CallClock;
use super::environment::GuestEnvironment;

/// Longest single log line a policy may write; longer ones are cut (at a char boundary) and
/// marked as cut.
pub const MAX_LOG_LINE: usize = 1024;
/// Lines a policy may write through `log` in one call; the rest are dropped and counted.
pub const LOG_LINES_PER_CALL: usize = 64;
/// Bytes a policy may write through `log` in one call; the rest are dropped and counted.
pub const LOG_BYTES_PER_CALL: usize = 16 << 10;
/// Steps a plan may have: the longest valid plan today has 3. A longer one is a fault, refused
/// before it is validated (or written into a log or an error body).
pub const MAX_PLAN_STEPS: usize = 16;
/// Bytes of a policy's error message (`policy-error`, `init`'s error): a longer
/// `policy-error` is a fault, a longer `init` error is cut.
pub const MAX_ERROR_BYTES: usize = 4096;
/// Core instances one policy instance may create (a Rust component has 3, componentize-js 4,
/// componentize-py 14): a component that instantiates thousands is refused at load.
pub const MAX_INSTANCES: usize = 100;
/// Linear memories one policy instance may create (Rust, Python and JavaScript components have
/// one).
pub const MAX_MEMORIES: usize = 4;
/// Tables one policy instance may create (Rust, Python and JavaScript components have two).
pub const MAX_TABLES: usize = 20;
/// Elements one table may hold; this bounds a guest that grows tables in a loop.
pub const MAX_TABLE_ELEMENTS: usize = 1 << 20;

/// The data of one policy instance's `Store`.
pub(super) struct StoreState {
    policy: Arc<str>,
    pub(super) limiter: StoreCap,
    pub(super) clock: CallClock,
    log: LogBudget,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl StoreState {
    /// The store of instance number `instance` of `policy`, whose clocks and randomness come
    /// from `environment`.
    pub(super) fn new(
        policy: Arc<str>,
        memory_bytes: usize,
        output_bytes: usize,
        (environment, instance): (&GuestEnvironment, u64),
    ) -> Self {
        let stdout = LogPipe::new(Arc::clone(&policy), "stdout", output_bytes);
        let stderr = LogPipe::new(Arc::clone(&policy), "stderr", output_bytes);
        // Everything denied: no preopens, env, args, sockets or name lookup; stdin is empty.
        // Clocks and random stay (a policy may want jitter), they reveal nothing about the host;
        // an embedder may give its own of both (a simulation's virtual clock and seed).
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(stdout)
            .stderr(stderr)
            .allow_ip_name_lookup(false)
            .allow_tcp(false)
            .allow_udp(false)
            .socket_addr_check(|_, _| Box::pin(async { false }));
        environment.configure(&mut wasi, &policy, instance);
        let wasi = wasi.build();
        StoreState {
            policy,
            limiter: StoreCap::new(memory_bytes),
            clock: CallClock::default(),
            log: LogBudget::default(),
            wasi,
            table: ResourceTable::new(),
        }
    }

    /// A guest call begins: the clock starts on this thread with `budget`, the log budget is
    /// refilled. Returns the epoch deadline to set, in ticks.
    pub(super) fn begin_call(&mut self, budget: std::time::Duration) -> u64 {
        self.log = LogBudget::default();
        self.clock.start(budget)
    }

    /// The guest call ended: say how much of its log was dropped, if any.
    pub(super) fn end_call(&mut self) {
        let LogBudget {
            dropped_lines,
            dropped_bytes,
            ..
        } = self.log;
        if dropped_lines > 0 {
            tracing::warn!(policy = %self.policy, dropped_lines, dropped_bytes,
                "policy log truncated: {dropped_lines} lines ({dropped_bytes} bytes) over the \
                 budget of {LOG_LINES_PER_CALL} lines and {LOG_BYTES_PER_CALL} bytes per call \
                 were dropped");
        }
    }

    /// The `log` import of every contract version: within the call's budget, a line to the
    /// router's log tagged with the policy's name.
    pub(super) fn log(&mut self, level: Level, message: &str) {
        if !self.log.take(message.len()) {
            return;
        }
        let line = truncate(message, MAX_LOG_LINE);
        let cut = message.len() - line.len();
        if cut == 0 {
            emit(&self.policy, level, line);
        } else {
            emit(&self.policy, level, &format!("{line} [{cut} bytes cut]"));
        }
    }

    /// The store's resource table and call clock, for the blocking WASI functions.
    pub(super) fn blocking_io(&mut self) -> BlockingIo<'_> {
        BlockingIo::new(&mut self.table, &mut self.clock)
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

/// Severity of a policy's log line, whatever its contract version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// What is left of one call's `log` budget, and what was dropped past it.
#[derive(Debug, Clone, Copy)]
struct LogBudget {
    lines: usize,
    bytes: usize,
    dropped_lines: usize,
    dropped_bytes: usize,
}

impl Default for LogBudget {
    fn default() -> Self {
        LogBudget {
            lines: LOG_LINES_PER_CALL,
            bytes: LOG_BYTES_PER_CALL,
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }
}

impl LogBudget {
    /// Whether a line of `len` bytes fits (a line cut at [`MAX_LOG_LINE`] costs what is kept).
    fn take(&mut self, len: usize) -> bool {
        let cost = len.min(MAX_LOG_LINE);
        if self.lines == 0 || self.bytes < cost {
            self.dropped_lines += 1;
            self.dropped_bytes += len;
            return false;
        }
        self.lines -= 1;
        self.bytes -= cost;
        true
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

/// One linker per contract version, each with that version's world imports plus WASI p2
/// (sync), which Rust std, componentize-py and componentize-js guests import even when they
/// never use it. Separate linkers because every version's world imports a function named `log`.
pub(super) struct Linkers {
    v0_1_0: Linker<StoreState>,
    v0_2_0: Linker<StoreState>,
}

impl Linkers {
    pub(super) fn new(engine: &Engine) -> Result<Self, LoadError> {
        Ok(Linkers {
            v0_1_0: linker(engine, Contract::V0_1_0)?,
            v0_2_0: linker(engine, Contract::V0_2_0)?,
        })
    }

    pub(super) fn get(&self, contract: Contract) -> &Linker<StoreState> {
        match contract {
            Contract::V0_1_0 => &self.v0_1_0,
            Contract::V0_2_0 => &self.v0_2_0,
        }
    }
}

fn linker(engine: &Engine, contract: Contract) -> Result<Linker<StoreState>, LoadError> {
    let mut linker = Linker::new(engine);
    let link_error = |e: wasmtime::Error| LoadError::Engine {
        reason: format!("cannot build the {contract} policy linker: {e:#}"),
    };
    bindings::add_to_linker(contract, &mut linker).map_err(link_error)?;
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(link_error)?;
    blocking_io::shadow_in(&mut linker, StoreState::blocking_io).map_err(link_error)?;
    Ok(linker)
}

// === impl StoreCap ===

/// The store's resource limits: wasmtime's `StoreLimits` for the counts (instances, memories,
/// tables, table elements), plus a cap on the bytes of all linear memories together, which
/// `StoreLimits` only applies to each memory alone. Any growth past a limit traps the guest
/// (rather than letting `memory.grow` return -1, which guests handle in unpredictable ways),
/// and the cap remembers when it was the memory, so the host can tell a memory error from any
/// other trap.
pub(super) struct StoreCap {
    counts: StoreLimits,
    memory_cap: usize,
    /// Bytes of every memory of the store, as granted so far.
    memory_bytes: usize,
    exceeded: bool,
}

impl StoreCap {
    fn new(memory_cap: usize) -> Self {
        StoreCap {
            counts: StoreLimitsBuilder::new()
                .memory_size(memory_cap)
                .table_elements(MAX_TABLE_ELEMENTS)
                .instances(MAX_INSTANCES)
                .memories(MAX_MEMORIES)
                .tables(MAX_TABLES)
                .trap_on_grow_failure(true)
                .build(),
            memory_cap,
            memory_bytes: 0,
            exceeded: false,
        }
    }

    pub(super) fn exceeded(&self) -> bool {
        self.exceeded
    }

    pub(super) fn memory_cap(&self) -> usize {
        self.memory_cap
    }
}

impl ResourceLimiter for StoreCap {
    /// Also called when a memory is created (`current` = 0), so the sum covers every memory.
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.memory_bytes - current + desired;
        if total > self.memory_cap {
            self.exceeded = true;
            return Err(wasmtime::format_err!(
                "policy memory would grow to {total} bytes in all, over its cap of {} bytes",
                self.memory_cap
            ));
        }
        let granted = self.counts.memory_growing(current, desired, maximum)?;
        if granted {
            self.memory_bytes = total;
        }
        Ok(granted)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.counts.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.counts.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.counts.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.counts.instances()
    }

    fn tables(&self) -> usize {
        self.counts.tables()
    }

    fn memories(&self) -> usize {
        self.counts.memories()
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

#[cfg(test)]
mod tests;
