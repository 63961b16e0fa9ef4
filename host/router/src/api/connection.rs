//! The server side of client connections: how many may be open, how long one may sit idle or
//! take to send a request's header, and how the accept loop behaves when the process runs out
//! of file descriptors.
//!
//! Every connection has a watchdog over its [`Activity`]:
//!
//! | phase | from | ends when | closed after |
//! |---|---|---|---|
//! | idle | accept, or the end of its last response | a byte arrives | `keep_alive_timeout` |
//! | header | the first byte of a request | the handler is called (the header is complete) | `header_read_timeout` |
//! | busy | the handler is called | every response started on it has ended | never: the body read deadline and the request timeout bound it |
//!
//! hyper's own `header_read_timeout` is not used: it also counts the idle time before a
//! request on a kept-alive connection (so an idle timeout longer than the header deadline is
//! impossible, and load balancers that keep connections idle for a minute see them closed
//! under their feet), it does not run while hyper-util's automatic protocol detection reads
//! the first bytes, and HTTP/2 has none. The watchdog covers both protocols the same way: on
//! HTTP/2 any frame on an idle connection starts the header deadline.
//!
//! Phase changes wake nobody: a request moves its connection through three phases, and a
//! wake-up per change made the connection's task wake itself three times a request, each of
//! which the multi-thread runtime answered by unparking another worker to steal it (with the
//! request queue's self-wakes, see `Routing`: 3.4 voluntary context switches per request at 32
//! connections, 0.3 to 1.6 without either). Instead the watchdog looks at the phase at least
//! once per `ConnectionLimits::watch_period`, the soonest any change can bring a deadline, so
//! it still closes a connection at its exact deadline.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::either::Either;

use super::tls::{ClientIo, TlsAcceptor};

pub mod http1;

/// Limits on client connections, per listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// From a request's first byte to its complete header.
    pub header_read_timeout: Duration,
    /// From a complete header to the complete body.
    pub body_read_timeout: Duration,
    /// The longest a connection stays open with no request on it.
    pub keep_alive_timeout: Duration,
    /// Connections open at once; the listener stops accepting at the limit.
    pub max_connections: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            // Above the 60 s idle timeout of common load balancers (AWS ALB's default), which
            // must close a kept-alive connection before the server does, or they race it.
            keep_alive_timeout: Duration::from_secs(75),
            max_connections: 4096,
        }
    }
}

impl ConnectionLimits {
    /// The longest the watchdog sleeps without looking at the phase: no phase change brings a
    /// deadline sooner than this after it, so a look this often never misses one.
    fn watch_period(&self) -> Duration {
        // Validated configs have no zero timeout; the floor keeps a hand-built one from
        // spinning.
        self.header_read_timeout
            .min(self.keep_alive_timeout)
            .max(Duration::from_millis(1))
    }
}

/// Why the watchdog closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// A request's header was still incomplete at the header deadline.
    Header,
    /// No request came within the keep-alive timeout.
    Idle,
}

impl Expired {
    /// The `reason` label of `switchyard_connections_closed`.
    pub fn reason(self) -> &'static str {
        match self {
            Expired::Header => "header_timeout",
            Expired::Idle => "idle_timeout",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle { since: Instant },
    Header { since: Instant },
    Busy { requests: u32 },
}

/// What one connection is doing, as its reads and its requests report it.
#[derive(Debug)]
pub struct Activity {
    phase: Mutex<Phase>,
}

impl Activity {
    /// A connection just accepted: idle.
    pub fn new() -> Arc<Self> {
        Arc::new(Activity {
            phase: Mutex::new(Phase::Idle {
                since: Instant::now(),
            }),
        })
    }

    /// Bytes arrived: on an idle connection, a request's header has begun.
    fn read_bytes(&self) {
        let mut phase = self.phase.lock();
        if let Phase::Idle { .. } = *phase {
            *phase = Phase::Header {
                since: Instant::now(),
            };
        }
    }

    /// A request's header is complete and its handler runs; the returned guard is held until
    /// its response has ended.
    pub fn request_started(self: &Arc<Self>) -> InRequest {
        let mut phase = self.phase.lock();
        *phase = match *phase {
            Phase::Busy { requests } => Phase::Busy {
                requests: requests + 1,
            },
            Phase::Idle { .. } | Phase::Header { .. } => Phase::Busy { requests: 1 },
        };
        InRequest(Arc::clone(self))
    }

    fn request_ended(&self) {
        let mut phase = self.phase.lock();
        *phase = match *phase {
            Phase::Busy { requests } if requests > 1 => Phase::Busy {
                requests: requests - 1,
            },
            _ => Phase::Idle {
                since: Instant::now(),
            },
        };
    }

    /// Resolves when the connection has been idle, or reading one header, for too long.
    pub async fn expired(&self, limits: &ConnectionLimits) -> Expired {
        loop {
            let phase = *self.phase.lock();
            let look_again = Instant::now() + limits.watch_period();
            let (deadline, why) = match phase {
                Phase::Idle { since } => (since + limits.keep_alive_timeout, Expired::Idle),
                Phase::Header { since } => (since + limits.header_read_timeout, Expired::Header),
                Phase::Busy { .. } => {
                    tokio::time::sleep_until(look_again).await;
                    continue;
                }
            };
            tokio::time::sleep_until(deadline.min(look_again)).await;
            // Still the phase the deadline came from (same start), and the deadline is here.
            if deadline <= Instant::now() && *self.phase.lock() == phase {
                return why;
            }
        }
    }
}

/// A request in progress on its connection; dropped when its response ends or is abandoned.
#[derive(Debug)]
pub struct InRequest(Arc<Activity>);

impl Drop for InRequest {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// A connection's byte stream, reporting reads to its [`Activity`].
#[derive(Debug)]
pub struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T> Watched<T> {
    pub fn new(io: T, activity: Arc<Activity>) -> Self {
        Watched { io, activity }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read_bytes();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The HTTP servers a connection may get: the router's own HTTP/1 one ([`http1`]) when the
/// connection has said it speaks HTTP/1 (its first bytes, or the protocol its TLS handshake
/// settled on), else hyper-util's automatic one, which reads the first bytes to choose between
/// HTTP/1 and HTTP/2.
///
/// Why not always the automatic one: it reads up to 24 bytes to look for HTTP/2's preface and
/// hands them to hyper's HTTP/1 parser as a read of their own; the parser, short of a whole
/// header, reserves its 8 KiB again for the next read, and its buffer doubled to 16 KiB for the
/// connection's life (heaptrack at 1,024 open streams: 16 KiB of each). Peeked instead, the
/// first bytes are read once, by the server. And its connection, inline in the connection's
/// task, keeps room for an HTTP/2 connection's state; HTTP/1's alone does not.
#[derive(Clone)]
pub struct Servers {
    auto: auto::Builder<TokioExecutor>,
}

/// The server a connection gets.
pub enum Server<'a> {
    Http1,
    Auto(&'a auto::Builder<TokioExecutor>),
}

/// HTTP/2's connection preface (RFC 9113, section 3.4): what an HTTP/2 client sends first.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl Servers {
    /// The automatic one with hyper's defaults.
    pub fn new() -> Servers {
        Servers {
            auto: auto::Builder::new(TokioExecutor::new()),
        }
    }

    /// The server for `io`, once its first bytes have arrived (without taking them).
    pub async fn for_connection(&self, io: &ClientIo) -> Server<'_> {
        let http1 = match io {
            Either::Left(tcp) => starts_http1(tcp).await,
            Either::Right(tls) => TlsAcceptor::settled_http1(tls),
        };
        if http1 {
            Server::Http1
        } else {
            Server::Auto(&self.auto)
        }
    }
}

/// Whether the first bytes on `stream` are not HTTP/2's preface, peeked when they arrive:
/// `false` when unsure (the connection closed, or what came so far is the preface's start),
/// for the automatic server to decide.
async fn starts_http1(stream: &TcpStream) -> bool {
    let mut first = [0u8; H2_PREFACE.len()];
    match stream.peek(&mut first).await {
        Ok(n) => n > 0 && first[..n] != H2_PREFACE[..n],
        Err(_) => false,
    }
}

/// How long the accept loop pauses after a failed accept.
///
/// A connection that failed on its own (reset or aborted before it was accepted) costs no
/// pause: the next one may be fine. Anything else (out of file descriptors, EMFILE/ENFILE, or
/// memory) fails again at once while the cause lasts, and the pending connection stays in the
/// backlog, so retrying at once would spin a core: pause 5 ms, doubling while failures
/// continue, up to 1 s; the open connections are served meanwhile.
#[derive(Debug)]
pub struct AcceptBackoff {
    next: Duration,
}

const FIRST_PAUSE: Duration = Duration::from_millis(5);
const LONGEST_PAUSE: Duration = Duration::from_secs(1);

impl Default for AcceptBackoff {
    fn default() -> Self {
        AcceptBackoff { next: FIRST_PAUSE }
    }
}

impl AcceptBackoff {
    /// The pause before the next accept, if any.
    pub fn failed(&mut self, error: &io::Error) -> Option<Duration> {
        if matches!(
            error.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted
        ) {
            return None;
        }
        let pause = self.next;
        self.next = (self.next * 2).min(LONGEST_PAUSE);
        Some(pause)
    }

    /// A connection was accepted: the cause has passed.
    pub fn accepted(&mut self) {
        self.next = FIRST_PAUSE;
    }
}

#[cfg(test)]
mod tests;
