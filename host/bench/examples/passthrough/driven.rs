//! Engine connections driven by the request's own task: idle HTTP/1 connections to each engine
//! are pooled (a `hyper::client::conn::http1` pair: the handle that sends a request and the
//! connection future that does the I/O). A request takes one (or makes one), polls the
//! connection beside its answer's head inside its own task, and then inside its response body
//! ([`Driven`]) while the client reads; a body that ended gives its connection back to the
//! pool, if the connection can take another request.
//!
//! hyper-util's pooled client spawns a task per connection instead, and hands each request to
//! it through a channel and the answer back through a oneshot: two task wake-ups per call.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::task::AtomicWaker;
use http::uri::{Authority, PathAndQuery};
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Idle connections older than this are dropped, before uvicorn's (5 s) closes them.
const IDLE_EXPIRY: Duration = Duration::from_secs(4);

/// Idle connections kept per engine.
const MAX_IDLE: usize = 256;

type Conn = Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One engine connection.
struct Pair {
    send: SendRequest<Full<Bytes>>,
    conn: Conn,
    relay: Relay,
}

/// The waker a connection and its answer are polled with. The two halves wake each other
/// (the connection hands the body a chunk; the body asks the connection for more): inside
/// one poll those wake-ups are only noted and the halves polled again, since a task woken
/// while it runs is scheduled once more (on a multi-thread runtime, where an idle worker is
/// woken to steal it). Outside a poll (the socket is ready), a wake-up wakes the task.
#[derive(Clone)]
struct Relay {
    shared: Arc<RelayState>,
    waker: Waker,
}

struct RelayState {
    /// IDLE, POLLING or WOKEN (a wake-up during a poll).
    state: AtomicU8,
    task: AtomicWaker,
}

const IDLE_STATE: u8 = 0;
const POLLING: u8 = 1;
const WOKEN: u8 = 2;

impl Wake for RelayState {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self
            .state
            .compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            self.task.wake();
        }
    }
}

impl Relay {
    fn new() -> Relay {
        let shared = Arc::new(RelayState {
            state: AtomicU8::new(IDLE_STATE),
            task: AtomicWaker::new(),
        });
        Relay {
            waker: Waker::from(Arc::clone(&shared)),
            shared,
        }
    }

    /// `step` polled with the relay's waker until it is ready, or pending with no wake-up
    /// noted meanwhile (at most a few rounds; then the task is woken to come back).
    fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        mut step: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.shared.task.register(cx.waker());
        let mut inner = Context::from_waker(&self.waker);
        for _ in 0..8 {
            self.shared.state.store(POLLING, Ordering::Release);
            if let Poll::Ready(done) = step(&mut inner) {
                self.shared.state.store(IDLE_STATE, Ordering::Release);
                return Poll::Ready(done);
            }
            if self
                .shared
                .state
                .compare_exchange(POLLING, IDLE_STATE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Poll::Pending;
            }
        }
        self.shared.state.store(IDLE_STATE, Ordering::Release);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The idle connections by engine, the most recently used last. One pool for all threads: on
/// a multi-thread runtime a request's task moves between threads, and per-thread pools then
/// fill on the threads where bodies end and run dry where requests start (4.4% of the requests
/// opened a connection at wrk c=32 and c=1; with one pool, 67 in 469,207).
#[derive(Default)]
pub struct Pools {
    idle: Mutex<HashMap<Authority, Vec<Idle>>>,
}

/// A connection back in the pool, and since when.
struct Idle {
    pair: Pair,
    since: Instant,
}

impl Pools {
    /// `request` (an absolute URI) on a pooled connection to its engine, or a new one; sent
    /// once more on a new connection when a reused one closes before the answer.
    pub async fn request(
        self: &Arc<Self>,
        request: Request<Full<Bytes>>,
    ) -> anyhow::Result<Response<Driven>> {
        let (mut parts, body) = request.into_parts();
        let authority = parts
            .uri
            .authority()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no authority"))?;
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        parts.uri = path.into();
        parts.headers.insert(
            http::header::HOST,
            http::HeaderValue::from_str(authority.as_str())?,
        );
        let again = (
            parts.method.clone(),
            parts.uri.clone(),
            parts.headers.clone(),
        );
        if let Some(pair) = self.checkout(&authority).await {
            match exchange(pair, Request::from_parts(parts, body.clone())).await {
                Ok((answer, pair)) => return Ok(self.driven(answer, pair, authority)),
                Err(e) if e.is_canceled() || e.is_closed() || e.is_incomplete_message() => {}
                Err(e) => return Err(e.into()),
            }
        }
        let (method, uri, headers) = again;
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        let (answer, pair) = exchange(connect(&authority).await?, request).await?;
        Ok(self.driven(answer, pair, authority))
    }

    fn driven(
        self: &Arc<Self>,
        answer: Response<Incoming>,
        pair: Option<Pair>,
        authority: Authority,
    ) -> Response<Driven> {
        answer.map(|body| Driven {
            body,
            ended: false,
            pair,
            authority,
            pools: Arc::clone(self),
        })
    }

    /// The most recent idle connection to `authority` that is still open and ready.
    async fn checkout(&self, authority: &Authority) -> Option<Pair> {
        loop {
            let Idle { mut pair, since } =
                self.with_idle(|idle| idle.get_mut(authority).and_then(Vec::pop))?;
            if since.elapsed() >= IDLE_EXPIRY {
                // Older ones lie below it: all expired.
                self.with_idle(|idle| idle.remove(authority));
                return None;
            }
            // One poll: a connection the engine closed while idle reads its end here.
            let usable = poll_fn(|cx| {
                Poll::Ready(
                    Pin::new(&mut pair.conn).poll(cx).is_pending()
                        && matches!(pair.send.poll_ready(cx), Poll::Ready(Ok(()))),
                )
            })
            .await;
            if usable {
                return Some(pair);
            }
        }
    }

    fn with_idle<R>(&self, f: impl FnOnce(&mut HashMap<Authority, Vec<Idle>>) -> R) -> R {
        f(&mut self.idle.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

async fn connect(authority: &Authority) -> anyhow::Result<Pair> {
    let stream = TcpStream::connect(authority.as_str()).await?;
    stream.set_nodelay(true)?;
    let (send, conn) = http1::handshake(TokioIo::new(stream)).await?;
    Ok(Pair {
        send,
        conn,
        relay: Relay::new(),
    })
}

/// `request` on `pair`, the connection polled in this task until the answer's head; the pair
/// back unless the connection ended meanwhile (`Connection: close`: the body is whole).
async fn exchange(
    pair: Pair,
    request: Request<Full<Bytes>>,
) -> hyper::Result<(Response<Incoming>, Option<Pair>)> {
    let Pair {
        mut send,
        conn,
        relay,
    } = pair;
    let mut answer = pin!(send.send_request(request));
    let mut conn = Some(conn);
    let answer = poll_fn(|cx| {
        relay.poll(cx, |cx| {
            if let Some(c) = conn.as_mut()
                && Pin::new(c).poll(cx).is_ready()
            {
                // Dropped, so that an answer still awaited fails rather than waits.
                conn = None;
            }
            answer.as_mut().poll(cx)
        })
    })
    .await?;
    Ok((answer, conn.map(|conn| Pair { send, conn, relay })))
}

/// An engine's answer body that drives its connection while it is read, and gives the
/// connection back to the pool once it has ended.
pub struct Driven {
    body: Incoming,
    /// Read to its end: a chunked body never says so through `is_end_stream`.
    ended: bool,
    pair: Option<Pair>,
    authority: Authority,
    pools: Arc<Pools>,
}

impl Body for Driven {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        let frame = match this.pair.as_ref().map(|pair| pair.relay.clone()) {
            Some(relay) => ready!(relay.poll(cx, |cx| {
                if let Some(pair) = this.pair.as_mut()
                    && Pin::new(&mut pair.conn).poll(cx).is_ready()
                {
                    this.pair = None;
                }
                Pin::new(&mut this.body).poll_frame(cx)
            })),
            None => ready!(Pin::new(&mut this.body).poll_frame(cx)),
        };
        this.ended = frame.is_none();
        Poll::Ready(frame.map(|frame| frame.map_err(std::io::Error::other)))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Driven {
    /// A body read to its end leaves its connection to the pool; one dropped before (the
    /// client went away) closes it.
    fn drop(&mut self) {
        if !self.is_end_stream() {
            return;
        }
        if let Some(pair) = self.pair.take() {
            let authority = self.authority.clone();
            self.pools.with_idle(|idle| {
                let idle = idle.entry(authority).or_default();
                if idle.len() < MAX_IDLE {
                    idle.push(Idle {
                        pair,
                        since: Instant::now(),
                    });
                }
            });
        }
    }
}
