//! Engine connections: made (TCP, TLS over it, or in tests an in-memory pipe), kept idle
//! between calls, and handed to the next call to the same engine.
//!
//! Each thread has its idle connections of its own ([`Shard`]): a connection is registered
//! with the runtime of the thread that opened it, so a request on the connection workers
//! (`api::Workers`) uses connections its own thread's reactor drives, and a body that ends on
//! another thread gives its connection back to the thread it came from. A connection idle for
//! [`POOL_IDLE_TIMEOUT`] is closed (a reaper task per thread, while any is idle); one whose body
//! was dropped before its end is closed, never pooled.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use hyper::body::{Frame, SizeHint};
use parking_lot::Mutex;
use thread_local::ThreadLocal;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Delivery;
use super::http1::{Conn, Head, Http1Error};
use super::tls::{EngineTls, TlsFiles};
use crate::http1::framing::Framing;

/// How long an idle connection to an engine is kept: below common engine keep-alive timeouts
/// (uvicorn, which serves vLLM and SGLang, and nginx close idle connections after 5 s), so a
/// request is not sent on a connection the engine is closing.
pub(super) const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Why a connection for a call could not be had, or the call on it failed before its answer's
/// body.
#[derive(Debug, thiserror::Error)]
pub(super) enum SendError {
    #[error("cannot connect")]
    Connect(#[source] io::Error),
    #[error("no connection within {0:?}")]
    ConnectTimeout(Duration),
    #[error("the TLS handshake failed")]
    Handshake(#[source] io::Error),
    /// A pooled connection closed before any byte of an answer: the engine closed it as the
    /// request went out, and the request may go once more on a fresh one.
    #[error("a reused connection closed before an answer")]
    Stale(#[source] Http1Error),
    #[error(transparent)]
    Http1(#[from] Http1Error),
}

impl SendError {
    /// Whether no connection was made: the request never left.
    pub(super) fn is_connect(&self) -> bool {
        matches!(
            self,
            SendError::Connect(_) | SendError::ConnectTimeout(_) | SendError::Handshake(_)
        )
    }

    /// Whether the connect timed out (rather than being refused).
    pub(super) fn connect_timed_out(&self) -> bool {
        match self {
            SendError::ConnectTimeout(_) => true,
            SendError::Connect(e) => e.kind() == io::ErrorKind::TimedOut,
            _ => false,
        }
    }

    /// Whether nothing of an answer came, on a fresh connection or a reused one.
    pub(super) fn is_closed(&self) -> bool {
        matches!(
            self,
            SendError::Stale(_) | SendError::Http1(Http1Error::Closed(_))
        )
    }
}

/// Where a call's connection goes: the engine's authority and how its connections are made.
pub(super) struct Route<'a> {
    pub(super) authority: &'a Authority,
    /// The port when the authority names none (the scheme's).
    pub(super) default_port: u16,
    pub(super) tls: Option<&'a EngineTls>,
}

/// Idle connections are told apart by engine and, for TLS, by the files they trust and
/// present (few sets: usually one).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    authority: Authority,
    tls: Option<TlsFiles>,
}

/// Every thread's idle connections, and how new ones are made.
#[derive(Debug)]
pub(super) struct Pool {
    shards: ThreadLocal<Arc<Shard>>,
    connector: Connector,
    connect_timeout: Duration,
}

/// How connections are made. An enum rather than a type parameter, so the executor and
/// everything holding a client stay one concrete type; outside tests it has one variant.
#[derive(Debug)]
enum Connector {
    Tcp,
    /// In-process engines over in-memory pipes ([`super::scripted`]).
    #[cfg(test)]
    Scripted(super::scripted::Connector),
}

/// One thread's idle connections.
#[derive(Debug, Default)]
struct Shard {
    idle: Mutex<Idle>,
}

#[derive(Debug, Default)]
struct Idle {
    /// By engine, the most recently used last. Hashed with foldhash: every call looks its
    /// engine up twice (taking a connection and giving it back), an authority is hashed a byte
    /// at a time, and SipHash showed in the forward path's profile. The keys are the router's
    /// own engines, not a client's input.
    conns: HashMap<Key, Vec<(Conn<Io>, Instant)>, foldhash::fast::RandomState>,
    /// Whether a reaper task is running for this shard.
    reaping: bool,
}

impl Pool {
    pub(super) fn tcp(connect_timeout: Duration) -> Pool {
        Pool {
            shards: ThreadLocal::new(),
            connector: Connector::Tcp,
            connect_timeout,
        }
    }

    #[cfg(test)]
    pub(super) fn scripted(connector: super::scripted::Connector) -> Pool {
        Pool {
            shards: ThreadLocal::new(),
            connector: Connector::Scripted(connector),
            connect_timeout: Duration::from_secs(2),
        }
    }

    /// `request` (as written) on an idle connection to `route` when `reuse` and there is one,
    /// else on a new one; its answer's head. `delivery` is signalled once the request is
    /// written.
    pub(super) async fn send(
        &self,
        route: &Route<'_>,
        request: &[u8],
        reuse: bool,
        delivery: Option<&Delivery>,
    ) -> Result<(Head, EngineBody), SendError> {
        let shard = Arc::clone(self.shards.get_or_default());
        let key = Key {
            authority: route.authority.clone(),
            tls: route.tls.map(|tls| tls.files().clone()),
        };
        let pooled = match reuse {
            true => shard.checkout(&key),
            false => None,
        };
        let reused = pooled.is_some();
        let mut conn = match pooled {
            Some(conn) => conn,
            None => Conn::new(self.connect(route).await?),
        };
        let stale = |e: Http1Error| match (reused, e) {
            (true, e @ Http1Error::Closed(_)) => SendError::Stale(e),
            (_, e) => SendError::Http1(e),
        };
        // Written after the tasks ready in this turn of the scheduler, as hyper's connection
        // tasks wrote theirs: the engine then takes the turn's requests in one wake-up. Written
        // at once, each woke it on its own (wrk c=32, one interleaved run: 48-56 µs of CPU per
        // request written at once, 41-44 after the turn, 48-52 with hyper's client; at c=1 the
        // turn costs about what it saved).
        tokio::task::yield_now().await;
        conn.write(request).await.map_err(stale)?;
        if let Some(delivery) = delivery {
            delivery.delivered();
        }
        let head = conn.read_head().await.map_err(stale)?;
        let body = EngineBody {
            conn: Some(conn),
            framing: head.body,
            keep_alive: head.keep_alive,
            home: Arc::downgrade(&shard),
            key,
        };
        Ok((head, body))
    }

    async fn connect(&self, route: &Route<'_>) -> Result<Io, SendError> {
        match &self.connector {
            Connector::Tcp => {}
            #[cfg(test)]
            Connector::Scripted(connector) => {
                return connector
                    .connect(route.authority.as_str())
                    .map(Io::Pipe)
                    .map_err(SendError::Connect);
            }
        }
        let host = route.authority.host();
        let port = route.authority.port_u16().unwrap_or(route.default_port);
        // An IPv6 literal comes bracketed in a URI, bare to the resolver and to TLS.
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| SendError::ConnectTimeout(self.connect_timeout))?
            .map_err(SendError::Connect)?;
        tcp.set_nodelay(true).map_err(SendError::Connect)?;
        let Some(tls) = route.tls else {
            return Ok(Io::Tcp(tcp));
        };
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| SendError::Handshake(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(tls.config()));
        let stream = connector
            .connect(name, tcp)
            .await
            .map_err(SendError::Handshake)?;
        Ok(Io::Tls(Box::new(stream)))
    }
}

impl Shard {
    /// The most recently used idle connection to `key` that still looks open.
    fn checkout(&self, key: &Key) -> Option<Conn<Io>> {
        let mut idle = self.idle.lock();
        let conns = idle.conns.get_mut(key)?;
        while let Some((mut conn, since)) = conns.pop() {
            if since.elapsed() >= POOL_IDLE_TIMEOUT {
                // Older ones lie below it: all expired.
                conns.clear();
                return None;
            }
            if conn.is_open() {
                return Some(conn);
            }
        }
        None
    }

    /// `conn` idle from now, and a reaper to close it once it has been for too long.
    fn checkin(self: &Arc<Self>, key: Key, conn: Conn<Io>) {
        // The reaper runs on this runtime; without one (a body dropped as the runtime
        // shuts down) the connection is not kept.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut idle = self.idle.lock();
        idle.conns
            .entry(key)
            .or_default()
            .push((conn.idle(), Instant::now()));
        if !idle.reaping {
            idle.reaping = true;
            runtime.spawn(reap(Arc::downgrade(self)));
        }
    }

    /// Closes the connections idle for [`POOL_IDLE_TIMEOUT`]; when the next one is due,
    /// or `None` once none is left idle (the reaper then ends).
    fn reap(&self) -> Option<Instant> {
        let mut idle = self.idle.lock();
        idle.conns.retain(|_, conns| {
            conns.retain(|(_, since)| since.elapsed() < POOL_IDLE_TIMEOUT);
            !conns.is_empty()
        });
        let next = idle
            .conns
            .values()
            .filter_map(|conns| conns.first().map(|(_, since)| *since + POOL_IDLE_TIMEOUT))
            .min();
        idle.reaping = next.is_some();
        next
    }
}

/// A shard's reaper: wakes when its oldest idle connection is due, until none is idle or the
/// pool is gone.
async fn reap(shard: Weak<Shard>) {
    let mut due = Instant::now() + POOL_IDLE_TIMEOUT;
    loop {
        tokio::time::sleep_until(due).await;
        let Some(next) = shard.upgrade().and_then(|shard| shard.reap()) else {
            return;
        };
        due = next;
    }
}

/// An engine's answer body, read from its connection by whoever polls it (the request's own
/// task). Read to its end on a connection that stays open, it gives the connection back to
/// the pool of the thread that opened it; dropped before, it closes it.
#[derive(Debug)]
pub(super) struct EngineBody {
    /// `None` once the body ended.
    conn: Option<Conn<Io>>,
    framing: Framing,
    keep_alive: bool,
    home: Weak<Shard>,
    key: Key,
}

impl EngineBody {
    /// The body ended: its connection back to the pool when it can take another request.
    fn finish(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.keep_alive
            && conn.is_reusable()
            && let Some(home) = self.home.upgrade()
        {
            home.checkin(self.key.clone(), conn);
        }
    }
}

impl hyper::body::Body for EngineBody {
    type Data = Bytes;
    type Error = Http1Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Http1Error>>> {
        let this = self.get_mut();
        let Some(conn) = this.conn.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = conn.poll_body(&mut this.framing, cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) if this.framing == Framing::Done => this.finish(),
            Poll::Ready(None) => this.finish(),
            // A broken body's connection is not reused.
            Poll::Ready(Some(Err(_))) => this.conn = None,
            _ => {}
        }
        polled.map(|data| data.map(|data| data.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || self.framing == Framing::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// A connection's transport.
#[derive(Debug)]
enum Io {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    #[cfg(test)]
    Pipe(super::scripted::Pipe),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(io) => Pin::new(io).poll_read(cx, buf),
            Io::Tls(io) => Pin::new(io).poll_read(cx, buf),
            #[cfg(test)]
            Io::Pipe(io) => Pin::new(io).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(io) => Pin::new(io).poll_write(cx, buf),
            Io::Tls(io) => Pin::new(io).poll_write(cx, buf),
            #[cfg(test)]
            Io::Pipe(io) => Pin::new(io).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(io) => Pin::new(io).poll_flush(cx),
            Io::Tls(io) => Pin::new(io).poll_flush(cx),
            #[cfg(test)]
            Io::Pipe(io) => Pin::new(io).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(io) => Pin::new(io).poll_shutdown(cx),
            Io::Tls(io) => Pin::new(io).poll_shutdown(cx),
            #[cfg(test)]
            Io::Pipe(io) => Pin::new(io).poll_shutdown(cx),
        }
    }
}
