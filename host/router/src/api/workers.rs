//! The threads that serve client connections: one thread per core, each running a Tokio
//! current-thread runtime that owns the connections handed to it, as Envoy's and nginx's
//! workers do.
//!
//! Why not one runtime with a worker per core: its idle workers are woken to steal each newly
//! ready task, so a request that hops between a client connection, its handler and an engine
//! connection wakes a second thread (a futex and an inter-processor interrupt) again and again.
//! On 2 vCPUs that cost about a fifth of the router's CPU per request (57 against 44 µs at 32
//! connections: the README's "What a request costs"), and the wake-ups multiply with the
//! cores. Here a connection, its requests, the engine connections they use (the engine client
//! pools per thread) and their timers stay on one thread: nothing on the request path wakes
//! another thread.
//!
//! Why a current-thread runtime rather than a multi-thread one of one worker thread: with
//! nothing to steal from, the multi-thread scheduler's bookkeeping is pure cost; at 32
//! connections on 2 vCPUs the current-thread workers took 36 µs of CPU per request against 42
//! and served 22% more requests. A policy's blocking WASI I/O, which the multi-thread flavour
//! would move aside with `block_in_place`, runs on a thread of its own instead (the policy
//! host's `blocking_io`).
//!
//! Why a worker spins before it sleeps ([`DEFAULT_WORKER_SPIN`], `--worker-spin`): a request
//! alone sleeps twice (waiting for the engine, then for the client's next request), and on a
//! VM the core it slept on went idle, whose wake-up is an interrupt and a re-entry into the
//! guest. At one connection on a 2-vCPU VM (wrk, the null engine) a worker that went straight to
//! sleep answered at a p50 of 198–213 µs, against vllm-router's 164–181 (its runtime's
//! hand-offs keep a core busy); spinning 20 µs first: 124–129 µs, for the same CPU per request
//! (132–140 µs: the spin costs what the wake-ups did). The spin yields, so a process with work
//! for the core gets it; still, where the client and the engine share the router's two cores
//! (32 connections, the same VM) the rate was 6% lower (28.6–29.0k against 30.1–31.0k req/s,
//! 45.5 against 42.6 µs of CPU per request). A 60 µs spin was worse than none (what arrives
//! during it waits for its end), 10 µs half as good as 20.
//!
//! The price of pinning: a request's own CPU work (parsing, tokenizing, its policy call, which
//! its deadline bounds) delays the other connections of its worker, not of the process. New
//! connections go to the worker with the fewest open, so long-lived ones spread evenly.

use std::future::Future;
use std::io;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// The connection workers. Dropping them ends their threads and every connection still on
/// them.
pub struct Workers {
    workers: Vec<Worker>,
}

struct Worker {
    runtime: Handle,
    /// Dropped with the worker, which ends its thread: the sender is never used otherwise.
    _stop: oneshot::Sender<()>,
    /// Connections on this worker now.
    open: Arc<AtomicUsize>,
}

/// How long a worker busy-waits before it sleeps, unless told otherwise (see the module's
/// comment).
pub const DEFAULT_WORKER_SPIN: Duration = Duration::from_micros(20);

/// The longest spin `--worker-spin` takes.
pub const MAX_WORKER_SPIN: Duration = Duration::from_millis(1);

impl Workers {
    /// Start `count` workers, each a thread named `switchyard-worker-N` that busy-waits `spin`
    /// before it sleeps (zero: it sleeps at once).
    pub fn start(count: NonZeroUsize, spin: Duration) -> io::Result<Workers> {
        let workers = (0..count.get())
            .map(|index| Worker::start(index, spin))
            .collect::<io::Result<_>>()?;
        Ok(Workers { workers })
    }

    /// Serve `stream` with `serve` on the worker with the fewest open connections. The
    /// stream moves to that worker's I/O driver, so its readiness wakes that thread only.
    pub fn serve<S, F>(&self, stream: TcpStream, serve: S) -> io::Result<()>
    where
        S: FnOnce(TcpStream) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let worker = self
            .workers
            .iter()
            .min_by_key(|w| w.open.load(Ordering::Relaxed))
            .expect("Workers::start makes at least one");
        let stream = stream.into_std()?;
        let open = Open::count(&worker.open);
        worker.runtime.spawn(async move {
            let _open = open;
            match TcpStream::from_std(stream) {
                Ok(stream) => serve(stream).await,
                Err(e) => tracing::warn!(error = %e, "cannot serve an accepted connection"),
            }
        });
        Ok(())
    }
}

impl Worker {
    /// A thread named `switchyard-worker-N` running its runtime until the worker is dropped.
    fn start(index: usize, spin: Duration) -> io::Result<Worker> {
        let mut builder = Builder::new_current_thread();
        // The threads that parse large bodies (`spawn_blocking`).
        builder
            .thread_name(format!("switchyard-blocking-{index}"))
            .enable_all();
        if !spin.is_zero() {
            // Run before the runtime sleeps; what became ready meanwhile is then found at once.
            builder.on_thread_park(move || busy_wait(spin));
        }
        let runtime = builder.build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("switchyard-worker-{index}"))
            .spawn(move || {
                // Ready (with an error) once the worker, and with it the sender, is dropped.
                let _ = runtime.block_on(stopped);
                // Without waiting for its blocking threads (a large body's parse may be
                // running): the connections are over, and the process may be exiting.
                runtime.shutdown_background();
            })?;
        Ok(Worker {
            runtime: handle,
            _stop: stop,
            open: Arc::default(),
        })
    }
}

/// One open connection on a worker, counted until dropped.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn count(open: &Arc<AtomicUsize>) -> Open {
        open.fetch_add(1, Ordering::Relaxed);
        Open(Arc::clone(open))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Spins for `spin`, keeping the core awake; yielding, so that a process that has work for the
/// core (the engine, the client, another worker) gets it rather than waiting for the spin.
fn busy_wait(spin: Duration) {
    let until = Instant::now() + spin;
    while Instant::now() < until {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    /// Connections accepted here are served on the workers, spread by how many each has open,
    /// and each worker serves its connections on its own one thread.
    #[tokio::test]
    async fn connections_spread_over_the_workers_and_stay_on_one_thread_each() {
        let workers = Workers::start(NonZeroUsize::new(2).unwrap(), DEFAULT_WORKER_SPIN).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (threads, mut served) = mpsc::unbounded_channel();
        let mut clients = Vec::new();
        for _ in 0..4 {
            let client = TcpStream::connect(addr).await.unwrap();
            let (stream, _) = listener.accept().await.unwrap();
            let threads = threads.clone();
            workers
                .serve(stream, move |mut stream| async move {
                    let mut byte = [0u8; 1];
                    stream.read_exact(&mut byte).await.unwrap();
                    let before = std::thread::current().id();
                    tokio::task::yield_now().await;
                    stream.write_all(&byte).await.unwrap();
                    let name = std::thread::current().name().map(str::to_owned);
                    threads
                        .send((name, before == std::thread::current().id()))
                        .unwrap();
                })
                .unwrap();
            clients.push(client);
        }
        // Four kept open while handed out: two on each worker.
        let open: Vec<_> = workers
            .workers
            .iter()
            .map(|w| w.open.load(Ordering::Relaxed))
            .collect();
        assert_eq!(open, [2, 2]);
        let mut names = Vec::new();
        for client in &mut clients {
            client.write_all(b"x").await.unwrap();
            let mut echo = [0u8; 1];
            client.read_exact(&mut echo).await.unwrap();
            assert_eq!(&echo, b"x");
            let (name, same_thread) = served.recv().await.unwrap();
            assert!(same_thread, "a worker's task moved threads");
            names.push(name.unwrap());
        }
        names.sort();
        assert_eq!(
            names,
            [
                "switchyard-worker-0",
                "switchyard-worker-0",
                "switchyard-worker-1",
                "switchyard-worker-1"
            ]
        );
    }
}
