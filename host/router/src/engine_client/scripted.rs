//! Engines for tests, in-process and reached over in-memory pipes: no sockets, and on a paused
//! clock only real waits (a call timeout, an idle stream, a backoff) move time forward, since
//! in-memory I/O wakes its reader at once.
//!
//! An engine is named by its URL's authority (`http://d0` is `d0`). The client connects to it
//! through [`Connector`]; a name no engine answers to refuses the connection, as a port nothing
//! listens on does. Each request reaches the test as a [`Call`], which the test answers as the
//! scenario needs: JSON or an error status, an SSE stream it feeds chunk by chunk and may break
//! off, or nothing at all (while the test holds the call; dropped unanswered, it closes the
//! connection). A call also says when the router hung up on its connection
//! ([`Call::hung_up`]), which is how an engine learns that its client is gone.
//!
//! ```text
//! let engines = Engines::default();
//! let mut d = engines.engine("d0");
//! let client = EngineClient::scripted(Timeouts::default(), engines.connector());
//! // ... the code under test calls http://d0 ...
//! let call = d.next().await;           // the request as the engine got it
//! call.json(200, json!({...}));        // or .status(409, ""), .stream(), hold it, drop it
//! ```

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::{mpsc, oneshot, watch};

/// Bytes each direction of a pipe buffers: far above any test body.
const PIPE_BYTES: usize = 1 << 20;

/// How long an engine waits for its next call: above every timeout and backoff the router
/// has (the call timeout, a release's patience).
const PATIENCE: Duration = Duration::from_secs(3600);

/// The engines of one test, by name.
#[derive(Debug, Default, Clone)]
pub(crate) struct Engines {
    engines: Arc<Mutex<HashMap<String, mpsc::UnboundedSender<Call>>>>,
}

impl Engines {
    /// The engine named `name` (`http://{name}` reaches it): its calls arrive on the handle.
    pub(crate) fn engine(&self, name: &str) -> Engine {
        let (tx, calls) = mpsc::unbounded_channel();
        self.engines.lock().insert(name.to_owned(), tx);
        Engine { calls }
    }

    /// What the client connects through.
    pub(crate) fn connector(&self) -> Connector {
        Connector {
            engines: self.clone(),
        }
    }

    fn route(&self, name: &str) -> Option<mpsc::UnboundedSender<Call>> {
        self.engines.lock().get(name).cloned()
    }
}

/// One engine's calls, in the order they arrived.
#[derive(Debug)]
pub(crate) struct Engine {
    calls: mpsc::UnboundedReceiver<Call>,
}

impl Engine {
    /// The next call. On a paused clock, waiting here lets time run to the next timer when
    /// nothing else can happen; a call that has not come within [`PATIENCE`] (of paused time,
    /// so at once when nothing else can happen) never will, and fails the test.
    pub(crate) async fn next(&mut self) -> Call {
        tokio::time::timeout(PATIENCE, self.calls.recv())
            .await
            .unwrap_or_else(|_| panic!("no call within {PATIENCE:?}"))
            .expect("the engines outlive the test")
    }

    /// A call that has already arrived, if any.
    pub(crate) fn try_next(&mut self) -> Option<Call> {
        self.calls.try_recv().ok()
    }
}

/// One request as the engine got it, to be answered.
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) path: String,
    pub(crate) headers: http::HeaderMap,
    /// The body as JSON (`null` when empty).
    pub(crate) body: Value,
    answer: oneshot::Sender<Answer>,
    connection: watch::Receiver<()>,
}

/// How the engine answers a call.
#[derive(Debug)]
enum Answer {
    Whole(http::Response<Full<Bytes>>),
    /// 200 with this content type, the body written as the test goes.
    Parts(
        &'static str,
        mpsc::UnboundedReceiver<io::Result<Frame<Bytes>>>,
    ),
}

impl Call {
    /// Answer `status` with `body` as JSON.
    pub(crate) fn json(self, status: u16, body: Value) {
        let response = http::Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a valid response");
        let _ = self.answer.send(Answer::Whole(response));
    }

    /// Answer `status` with a plain-text `body`.
    pub(crate) fn status(self, status: u16, body: &str) {
        let response = http::Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("a valid response");
        let _ = self.answer.send(Answer::Whole(response));
    }

    /// Answer 200 with an SSE stream, fed through the returned handle.
    pub(crate) fn stream(self) -> Body {
        self.in_parts("text/event-stream")
    }

    /// Answer 200 with JSON whose bytes the returned handle writes: the head goes out now.
    pub(crate) fn json_in_parts(self) -> Body {
        self.in_parts("application/json")
    }

    fn in_parts(self, content_type: &'static str) -> Body {
        let (tx, frames) = mpsc::unbounded_channel();
        let _ = self.answer.send(Answer::Parts(content_type, frames));
        Body {
            frames: tx,
            connection: self.connection,
        }
    }

    /// Resolves when the router closes the connection this call came on.
    pub(crate) fn hung_up(&self) -> impl Future<Output = ()> + use<> {
        hung_up(self.connection.clone())
    }
}

/// An answer whose body is being written. Dropped, it ends the body where it is (an SSE
/// stream without `[DONE]`).
#[derive(Debug)]
pub(crate) struct Body {
    frames: mpsc::UnboundedSender<io::Result<Frame<Bytes>>>,
    connection: watch::Receiver<()>,
}

impl Body {
    /// One SSE `data:` event.
    pub(crate) fn event(&self, data: &Value) {
        self.bytes(format!("data: {data}\n\n").as_bytes());
    }

    /// `bytes`, as they are.
    pub(crate) fn bytes(&self, bytes: &[u8]) {
        let frame = Frame::data(Bytes::copy_from_slice(bytes));
        let _ = self.frames.send(Ok(frame));
    }

    /// `data: [DONE]`, and the end of the answer.
    pub(crate) fn done(self) {
        let frame = Frame::data(Bytes::from_static(switchyard_wire::sse::DONE_EVENT));
        let _ = self.frames.send(Ok(frame));
    }

    /// Break the answer off mid-stream, as an engine that dies does.
    pub(crate) fn break_off(self) {
        let _ = self.frames.send(Err(io::Error::other("the engine died")));
    }

    /// Resolves when the router closes the connection this answer streams on.
    pub(crate) fn hung_up(&self) -> impl Future<Output = ()> + use<> {
        hung_up(self.connection.clone())
    }
}

/// Resolves when the router's end of the connection is dropped: nothing ever sends on the
/// channel, so the wait ends only when its sender (the router's end) is gone.
async fn hung_up(mut connection: watch::Receiver<()>) {
    while connection.changed().await.is_ok() {}
}

// === impl Connector ===

/// Connects the client to the engines by name, over an in-memory pipe; an unknown name is
/// refused.
#[derive(Debug, Clone)]
pub(crate) struct Connector {
    engines: Engines,
}

impl Connector {
    /// A connection to the engine named `name`; refused when no engine answers to it.
    pub(crate) fn connect(&self, name: &str) -> io::Result<Pipe> {
        let Some(engine) = self.engines.route(name) else {
            return Err(io::ErrorKind::ConnectionRefused.into());
        };
        let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
        let (open, connection) = watch::channel(());
        tokio::spawn(serve(theirs, engine, connection));
        Ok(Pipe {
            io: ours,
            _open: open,
        })
    }
}

/// Serves one connection: every request becomes a [`Call`] on the engine's channel.
async fn serve(
    io: DuplexStream,
    engine: mpsc::UnboundedSender<Call>,
    connection: watch::Receiver<()>,
) {
    let service = service_fn(move |request: http::Request<Incoming>| {
        let engine = engine.clone();
        let connection = connection.clone();
        async move {
            let (head, body) = request.into_parts();
            let bytes = body.collect().await.map_err(io::Error::other)?.to_bytes();
            let body = match bytes.is_empty() {
                true => Value::Null,
                false => serde_json::from_slice(&bytes).expect("the router sends JSON"),
            };
            let (answer, answered) = oneshot::channel();
            let call = Call {
                path: head.uri.path().to_owned(),
                headers: head.headers,
                body,
                answer,
                connection,
            };
            if engine.send(call).is_err() {
                return Err(io::Error::other("the test is over"));
            }
            // A call dropped unanswered closes the connection without an answer.
            let answer = answered.await.map_err(|_| io::Error::other("no answer"))?;
            Ok(respond(answer))
        }
    });
    // The connection ends when the router closes it or an answer breaks off. A request the
    // router wrote whole and then hung up on is still served, as an engine's server reads
    // what came before the close (hyper's default drops the request at the close instead).
    let _ = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(io), service)
        .await;
}

fn respond(answer: Answer) -> http::Response<UnsyncBoxBody<Bytes, io::Error>> {
    match answer {
        Answer::Whole(response) => {
            response.map(|body| body.map_err(|never| match never {}).boxed_unsync())
        }
        Answer::Parts(content_type, frames) => {
            let frames = futures::stream::unfold(frames, |mut frames| async move {
                let frame = frames.recv().await?;
                if frame.is_err() {
                    // Let the connection write what came before: a server aborts at once on a
                    // body error, and an engine that dies mid-stream has sent what it sent.
                    tokio::task::yield_now().await;
                }
                Some((frame, frames))
            });
            http::Response::builder()
                .header(http::header::CONTENT_TYPE, content_type)
                .body(StreamBody::new(frames).boxed_unsync())
                .expect("a valid response")
        }
    }
}

// === impl Pipe ===

/// The client's end of a connection; dropping it is the router hanging up.
#[derive(Debug)]
pub(crate) struct Pipe {
    io: DuplexStream,
    /// Dropped with the connection, which ends every [`hung_up`] wait on it.
    _open: watch::Sender<()>,
}

impl AsyncRead for Pipe {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
