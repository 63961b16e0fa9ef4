//! The server's framing on scripted bytes over an in-memory pipe: what a client writes, what the
//! handler sees, what comes back on the wire.

use std::convert::Infallible;

use http_body_util::{BodyExt, Full, StreamBody};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio::sync::{mpsc, oneshot};

use super::*;

type Answer = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

fn full(text: impl Into<Bytes>) -> Answer {
    Full::new(text.into()).boxed_unsync()
}

/// Answers "METHOD PATH BODY", the body read whole.
async fn echo(request: Request<Body>) -> Response<Answer> {
    let (parts, body) = request.into_parts();
    let text = match body.collect().await {
        Ok(read) => String::from_utf8_lossy(&read.to_bytes()).into_owned(),
        Err(e) => format!("unreadable: {e}"),
    };
    Response::new(full(format!("{} {} {text}", parts.method, parts.uri)))
}

/// A server on one end of a pipe of `capacity` bytes (1: every read delivers one byte),
/// answering with `handler`, draining when `drain` fires; the client's end.
fn server<H, F>(
    capacity: usize,
    handler: H,
    drain: oneshot::Receiver<()>,
) -> (
    DuplexStream,
    tokio::task::JoinHandle<Result<(), ServeError>>,
)
where
    H: FnMut(Request<Body>) -> F + Send + 'static,
    F: Future<Output = Response<Answer>> + Send + 'static,
{
    let (client, ours) = tokio::io::duplex(capacity);
    let draining = async move {
        if drain.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    (client, tokio::spawn(serve(ours, handler, draining)))
}

/// What the server wrote for `script` until it closed the connection.
async fn exchange(capacity: usize, script: &[u8]) -> (String, Result<(), ServeError>) {
    let (_drain, drain) = oneshot::channel();
    let (mut client, served) = server(capacity, echo, drain);
    // A server refusing a head closes the connection before it has read all of the script.
    let _ = client.write_all(script).await;
    let mut answer = Vec::new();
    client.read_to_end(&mut answer).await.expect("read");
    let served = served.await.expect("the server ran");
    (String::from_utf8(answer).expect("text"), served)
}

/// What the client reads until `done` says the text so far is enough.
async fn read_until(client: &mut DuplexStream, done: impl Fn(&str) -> bool) -> Vec<u8> {
    let mut seen = Vec::new();
    while !done(&String::from_utf8_lossy(&seen)) {
        let mut piece = [0u8; 256];
        let n = client.read(&mut piece).await.expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&piece[..n]);
    }
    seen
}

/// The bodies of the responses in `answer`, in order, after checking each head has `date`.
fn bodies(answer: &str) -> Vec<&str> {
    answer
        .split("HTTP/1.1 ")
        .skip(1)
        .map(|response| {
            let (head, body) = response.split_once("\r\n\r\n").expect("a whole head");
            assert!(head.contains("\r\ndate: "), "{head}");
            body
        })
        .collect()
}

#[tokio::test]
async fn a_content_length_body_reaches_the_handler_and_the_answer_has_its_length() {
    let (answer, served) = exchange(
        1 << 16,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
    )
    .await;
    assert!(served.is_ok(), "{served:?}");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("content-length: 26\r\n"), "{answer}");
    assert!(answer.contains("connection: close\r\n"), "{answer}");
    assert_eq!(bodies(&answer), ["POST /v1/completions hello"]);
}

#[tokio::test]
async fn a_chunked_body_is_read_whatever_the_reads_split() {
    // A pipe of one byte: every read the server makes delivers a single byte, so the body is
    // split at every byte boundary, chunk extensions and trailers included.
    let (answer, served) = exchange(
        1,
        b"POST /p HTTP/1.1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
          5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: t\r\n\r\n",
    )
    .await;
    assert!(served.is_ok(), "{served:?}");
    assert_eq!(bodies(&answer), ["POST /p hello, world"]);
}

#[tokio::test]
async fn smuggling_shapes_are_refused_with_400_and_the_connection_closed() {
    let heads = [
        "content-length: 3\r\ntransfer-encoding: chunked\r\n",
        "transfer-encoding: chunked\r\ncontent-length: 3\r\n",
        "transfer-encoding: gzip\r\n",
        "content-length: 3\r\ncontent-length: 4\r\n",
        "content-length: 3, 4\r\n",
        "content-length: +3\r\n",
        "content-length: three\r\n",
        // Obsolete line folding.
        "x-folded: a\r\n  b\r\n",
    ];
    for head in heads {
        let script =
            format!("POST /p HTTP/1.1\r\n{head}\r\nabc0\r\n\r\nGET /next HTTP/1.1\r\n\r\n");
        let (answer, served) = exchange(1 << 16, script.as_bytes()).await;
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{head:?}: {answer}"
        );
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert_eq!(
            answer.matches("HTTP/1.1").count(),
            1,
            "nothing after: {answer}"
        );
        assert!(matches!(served, Err(ServeError::Head(_))), "{served:?}");
    }
    // Repeats of one length are one length.
    let (answer, _) = exchange(
        1 << 16,
        b"POST /p HTTP/1.1\r\ncontent-length: 3, 3\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc",
    )
    .await;
    assert_eq!(bodies(&answer), ["POST /p abc"]);
}

#[tokio::test]
async fn a_head_over_its_bound_is_answered_431() {
    let big = format!(
        "GET / HTTP/1.1\r\nx-padding: {}\r\n\r\n",
        "a".repeat(MAX_HEAD)
    );
    let (answer, served) = exchange(1 << 16, big.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{answer}"
    );
    assert!(matches!(served, Err(ServeError::Head(_))), "{served:?}");
    let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: v\r\n")).collect();
    let (answer, _) = exchange(1 << 16, format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
}

#[tokio::test]
async fn http10_keeps_the_connection_only_when_asked() {
    let (answer, _) = exchange(1 << 16, b"GET /a HTTP/1.0\r\n\r\nGET /b HTTP/1.0\r\n\r\n").await;
    assert_eq!(bodies(&answer), ["GET /a "], "closed after the first");
    assert!(answer.contains("connection: close\r\n"), "{answer}");
    let (answer, _) = exchange(
        1 << 16,
        b"GET /a HTTP/1.0\r\nconnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n",
    )
    .await;
    assert_eq!(bodies(&answer), ["GET /a ", "GET /b "]);
    assert!(answer.contains("connection: keep-alive\r\n"), "{answer}");
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_and_connection_close_ends_it() {
    let (answer, served) = exchange(
        1 << 16,
        b"POST /1 HTTP/1.1\r\ncontent-length: 1\r\n\r\naGET /2 HTTP/1.1\r\nconnection: close\r\n\r\n\
          GET /never HTTP/1.1\r\n\r\n",
    )
    .await;
    assert!(served.is_ok(), "{served:?}");
    assert_eq!(bodies(&answer), ["POST /1 a", "GET /2 "]);
    assert_eq!(answer.matches("connection: close").count(), 1, "{answer}");
}

#[tokio::test]
async fn a_head_request_gets_the_length_and_no_body() {
    let (answer, _) = exchange(1 << 16, b"HEAD /h HTTP/1.1\r\nconnection: close\r\n\r\n").await;
    assert!(answer.contains("content-length: 8\r\n"), "{answer}");
    assert!(answer.ends_with("\r\n\r\n"), "no body: {answer}");
}

#[tokio::test]
async fn expect_100_continue_is_answered_when_the_body_is_first_read() {
    let (_drain, drain) = oneshot::channel();
    let (mut client, served) = server(1 << 16, echo, drain);
    client
        .write_all(b"POST /c HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\nconnection: close\r\n\r\n")
        .await
        .expect("written");
    let mut interim = [0u8; CONTINUE.len()];
    client.read_exact(&mut interim).await.expect("100");
    assert_eq!(&interim[..], CONTINUE);
    client.write_all(b"ok").await.expect("written");
    let mut answer = String::new();
    client.read_to_string(&mut answer).await.expect("read");
    assert_eq!(bodies(&answer), ["POST /c ok"]);
    assert!(served.await.expect("ran").is_ok());
}

#[tokio::test]
async fn a_body_the_handler_did_not_read_is_skipped_when_buffered_else_the_connection_closes() {
    let ignore = |_request: Request<Body>| async { Response::new(full("ignored")) };
    let (_drain, drain) = oneshot::channel();
    let (mut client, served) = server(1 << 16, ignore, drain);
    client
        .write_all(b"POST /1 HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcGET /2 HTTP/1.1\r\n\r\n")
        .await
        .expect("written");
    // Then a body that is not all there: the answer closes the connection.
    client
        .write_all(b"POST /3 HTTP/1.1\r\ncontent-length: 100\r\n\r\nabc")
        .await
        .expect("written");
    let mut answer = String::new();
    client.read_to_string(&mut answer).await.expect("read");
    assert_eq!(bodies(&answer), ["ignored", "ignored", "ignored"]);
    assert_eq!(answer.matches("connection: close").count(), 1, "{answer}");
    assert!(served.await.expect("ran").is_ok());
}

/// A handler whose response streams what the test sends on the channel it hands over, and
/// which reports its body dropped.
fn streaming(
    frames: oneshot::Sender<(mpsc::Sender<Bytes>, oneshot::Receiver<()>)>,
) -> impl FnMut(Request<Body>) -> std::future::Ready<Response<Answer>> {
    let mut frames = Some(frames);
    move |_request| {
        let (send, receive) = mpsc::channel::<Bytes>(4);
        let (dropped, watch) = oneshot::channel::<()>();
        if let Some(frames) = frames.take() {
            let _ = frames.send((send, watch));
        }
        let stream = futures::stream::unfold((receive, dropped), |(mut receive, dropped)| async {
            let data = receive.recv().await?;
            Some((Ok::<_, Infallible>(Frame::data(data)), (receive, dropped)))
        });
        std::future::ready(Response::new(StreamBody::new(stream).boxed_unsync()))
    }
}

/// A response streaming to a client: the client's end, the server, the handler's sender of
/// frames, and what errs when the response's body is dropped.
struct Streaming {
    client: DuplexStream,
    served: tokio::task::JoinHandle<Result<(), ServeError>>,
    send: mpsc::Sender<Bytes>,
    watch: oneshot::Receiver<()>,
}

/// `request` answered by [`streaming`], its first frame (`data: 1`) sent.
async fn stream_started(request: &[u8]) -> Streaming {
    let (handed, frames) = oneshot::channel();
    // Never fired: a dropped sender leaves the server undrained.
    let (_, drain) = oneshot::channel();
    let (mut client, served) = server(1 << 16, streaming(handed), drain);
    client.write_all(request).await.expect("written");
    let (send, watch) = frames.await.expect("handler ran");
    send.send(Bytes::from_static(b"data: 1\n\n"))
        .await
        .expect("sent");
    Streaming {
        client,
        served,
        send,
        watch,
    }
}

#[tokio::test]
async fn a_streamed_response_is_chunked_and_each_frame_goes_out_as_it_comes() {
    let Streaming {
        mut client,
        served,
        send,
        watch: _watch,
    } = stream_started(b"GET /s HTTP/1.1\r\nconnection: close\r\n\r\n").await;
    // The first frame arrives before the second is sent.
    let seen = read_until(&mut client, |seen| seen.ends_with("9\r\ndata: 1\n\n\r\n")).await;
    send.send(Bytes::from_static(b"data: [DONE]\n\n"))
        .await
        .expect("sent");
    drop(send);
    let mut rest = String::new();
    client.read_to_string(&mut rest).await.expect("read");
    let answer = String::from_utf8(seen).expect("text") + &rest;
    assert!(
        answer.contains("transfer-encoding: chunked\r\n"),
        "{answer}"
    );
    assert_eq!(
        bodies(&answer),
        ["9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]
    );
    assert!(served.await.expect("ran").is_ok());
}

#[tokio::test]
async fn a_client_gone_mid_stream_ends_the_response_body() {
    let Streaming {
        mut client,
        served,
        send,
        watch,
    } = stream_started(b"GET /s HTTP/1.1\r\n\r\n").await;
    // Everything sent so far is read, so the server is waiting for the next frame.
    read_until(&mut client, |seen| seen.contains("data: 1")).await;
    drop(client);
    // The body is dropped (its guard fires) while the handler's sender is still open.
    assert!(watch.await.is_err(), "dropped, never sent");
    assert!(matches!(
        served.await.expect("ran"),
        Err(ServeError::ClientGone)
    ));
    drop(send);
}

#[tokio::test]
async fn draining_closes_an_idle_connection_at_once() {
    let (start_drain, drain) = oneshot::channel();
    let (mut client, served) = server(1 << 16, echo, drain);
    client
        .write_all(b"GET /1 HTTP/1.1\r\n\r\n")
        .await
        .expect("written");
    let mut first = [0u8; 64];
    assert!(client.read(&mut first).await.expect("read") > 0);
    start_drain.send(()).expect("serving");
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await.expect("closed");
    assert!(served.await.expect("ran").is_ok());
}

#[tokio::test]
async fn draining_lets_a_busy_connection_finish_its_response_then_closes_it() {
    let (start_drain, drain) = oneshot::channel();
    let (release, released) = oneshot::channel::<()>();
    let (started, running) = oneshot::channel::<()>();
    let mut waits = Some((started, released));
    let slow = move |_request: Request<Body>| {
        let waits = waits.take();
        async move {
            if let Some((started, released)) = waits {
                let _ = started.send(());
                let _ = released.await;
            }
            Response::new(full("finished"))
        }
    };
    let (mut client, served) = server(1 << 16, slow, drain);
    client
        .write_all(b"GET /busy HTTP/1.1\r\n\r\n")
        .await
        .expect("written");
    running.await.expect("the handler started");
    start_drain.send(()).expect("serving");
    release.send(()).expect("handler waiting");
    let mut answer = String::new();
    client.read_to_string(&mut answer).await.expect("read");
    assert_eq!(bodies(&answer), ["finished"]);
    assert!(answer.contains("connection: close\r\n"), "{answer}");
    assert!(served.await.expect("ran").is_ok());
}

/// A body of `data` whose size hint says it is `said` bytes long.
struct Sized {
    data: Option<Bytes>,
    said: u64,
}

impl HttpBody for Sized {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.data.take().map(|data| Ok(Frame::data(data))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.said)
    }
}

/// A handler that answers every request the same, whatever it asked.
type Handler = fn() -> Response<Answer>;

/// What the server wrote for two pipelined GETs answered with `answer`'s responses, until it
/// closed the connection, and how serving ended.
async fn two_gets_answered(answer: fn() -> Response<Answer>) -> (String, Result<(), ServeError>) {
    let (_drain, drain) = oneshot::channel();
    let handler = move |_: Request<Body>| std::future::ready(answer());
    let (mut client, served) = server(1 << 16, handler, drain);
    client
        .write_all(b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\nconnection: close\r\n\r\n")
        .await
        .expect("written");
    let mut written = Vec::new();
    client.read_to_end(&mut written).await.expect("read");
    let served = served.await.expect("the server ran");
    (String::from_utf8(written).expect("text"), served)
}

#[tokio::test]
async fn a_handlers_own_length_or_coding_is_replaced_by_the_bodys() {
    let (written, served) = two_gets_answered(|| {
        let mut response = Response::new(full("four"));
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_LENGTH,
            HeaderValue::from_static("999"),
        );
        headers.insert(
            http::header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        response
    })
    .await;
    assert!(served.is_ok(), "{served:?}");
    assert_eq!(bodies(&written), ["four", "four"], "{written}");
    assert_eq!(
        written.matches("content-length: 4\r\n").count(),
        2,
        "{written}"
    );
    assert!(!written.contains("999"), "{written}");
    assert!(!written.contains("transfer-encoding"), "{written}");
}

fn ten_bytes_said_four() -> Response<Answer> {
    let data = Some(Bytes::from_static(b"0123456789"));
    Response::new(Sized { data, said: 4 }.boxed_unsync())
}

fn two_bytes_said_four() -> Response<Answer> {
    let data = Some(Bytes::from_static(b"01"));
    Response::new(Sized { data, said: 4 }.boxed_unsync())
}

#[tokio::test]
async fn a_body_longer_or_shorter_than_its_size_ends_the_connection_before_it_is_misread() {
    let answers: [(&str, Handler); 2] = [
        ("longer", ten_bytes_said_four),
        ("shorter", two_bytes_said_four),
    ];
    for (what, answer) in answers {
        let (written, served) = two_gets_answered(answer).await;
        assert!(
            matches!(served, Err(ServeError::BodyLength)),
            "{what}: {served:?}"
        );
        // Never more body than the head announced, and no second answer.
        assert!(!written.contains("456789"), "{what}: {written}");
        assert!(
            written.matches("HTTP/1.1 ").count() <= 1,
            "{what}: {written}"
        );
    }
}
