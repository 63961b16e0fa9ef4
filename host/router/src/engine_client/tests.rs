//! The client against canned engines on loopback: raw HTTP answers that are too big, stall, or
//! break off.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

use switchyard_wire::completion::CompletionRequest;
use switchyard_wire::microserving::PrepRecvRequest;

use super::*;

/// Serves one connection: reads the request, writes `answer`, then closes, or with `hold` keeps
/// the connection open until the test ends.
async fn canned_engine(answer: Vec<u8>, hold: bool) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut request = vec![0u8; 64 << 10];
        let _ = stream.read(&mut request).await;
        stream.write_all(&answer).await.expect("write");
        if hold {
            // Held until the client gives up and closes.
            let _ = stream.read(&mut request).await;
        }
    });
    engine_at(addr)
}

/// An engine at `addr` that wants no credentials.
fn engine_at(addr: std::net::SocketAddr) -> Upstream {
    Upstream::new(format!("http://{addr}").into(), None)
}

fn head(status: &str, content_type: &str, content_length: usize) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {content_length}\r\n\r\n"
    )
    .into_bytes()
}

fn client(call: Duration) -> EngineClient {
    EngineClient::new(Timeouts {
        call,
        ..Timeouts::default()
    })
}

fn prep_body() -> PrepRecvRequest {
    PrepRecvRequest {
        common: CompletionRequest::new(vec![1, 2, 3], 4, "cmpl-t".into()),
        end: -1,
    }
}

#[tokio::test]
async fn an_oversized_answer_is_refused_not_buffered() {
    let len = MAX_ANSWER_BYTES + 1;
    let mut answer = head("200 OK", "application/json", len);
    answer.extend(std::iter::repeat_n(b' ', len));
    let engine = canned_engine(answer, false).await;
    let err = client(Duration::from_secs(20))
        .prep_recv(&engine, &prep_body())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CallError::Decode { reason, .. } if reason.contains("over")),
        "{err}"
    );
}

#[tokio::test]
async fn a_stalled_completion_body_times_out() {
    let mut answer = head("200 OK", "application/json", 100);
    answer.extend_from_slice(b"{\"id\":");
    let engine = canned_engine(answer, true).await;
    let request = CompletionRequest::new(vec![1], 1, "cmpl-t".into());
    let err = client(Duration::from_millis(300))
        .forward(&engine, &request)
        .await
        .err()
        .expect("no answer");
    assert!(err.is_timeout(), "{err}");
}

#[tokio::test]
async fn a_body_cut_mid_way_is_a_broken_call_not_a_dead_engine() {
    let mut answer = head("200 OK", "application/json", 100);
    answer.extend_from_slice(b"{\"kv_append_metadata\":");
    let engine = canned_engine(answer, false).await;
    let err = client(Duration::from_secs(20))
        .prep_recv(&engine, &prep_body())
        .await
        .unwrap_err();
    assert!(matches!(err, CallError::Stream { .. }), "{err}");
    assert!(!err.is_unreachable());
}

#[tokio::test]
async fn an_error_status_keeps_the_start_of_its_body() {
    let body = br#"{"error":{"message":"no"}}"#;
    let mut answer = head("409 Conflict", "application/json", body.len());
    answer.extend_from_slice(body);
    let engine = canned_engine(answer, false).await;
    let err = client(Duration::from_secs(20))
        .prep_recv(&engine, &prep_body())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CallError::Status { status: 409, body: b, .. } if b.contains("no")),
        "{err}"
    );
}

#[tokio::test]
async fn a_connection_closed_before_any_answer_is_tried_once_more_on_a_fresh_one() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answer = br#"{"kv_append_metadata":"AwAAAAAAAABbMF0=","prefix_matched_length":0}"#;
    let served = tokio::spawn(async move {
        let mut request = vec![0u8; 64 << 10];
        // The first connection reads the request and closes: a keep-alive that ran out.
        let (mut first, _) = listener.accept().await.expect("accept");
        let _ = first.read(&mut request).await;
        drop(first);
        let (mut second, _) = listener.accept().await.expect("accept again");
        let _ = second.read(&mut request).await;
        let mut reply = head("200 OK", "application/json", answer.len());
        reply.extend_from_slice(answer);
        second.write_all(&reply).await.expect("write");
    });
    let engine = engine_at(addr);
    let prep = client(Duration::from_secs(20))
        .prep_recv(&engine, &prep_body())
        .await
        .expect("answered on the second connection");
    assert_eq!(prep.prefix_matched_length, 0);
    served.await.expect("both connections served");
}

/// A call's target is the endpoint's base path with the call's path appended, as the two
/// strings would concatenate, including for a base behind a path prefix.
#[test]
fn a_calls_target_is_the_base_path_followed_by_the_path() {
    for (base, path, line) in [
        (
            "http://127.0.0.1:8000",
            "/v1/completions",
            "/v1/completions",
        ),
        (
            "http://127.0.0.1:8000/engine",
            "/v1/models",
            "/engine/v1/models",
        ),
        ("http://[::1]:9/a/b/", "/metrics", "/a/b/metrics"),
    ] {
        let wire = get(&Upstream::new(base.into(), None), path);
        let expected = format!("GET {line} HTTP/1.1\r\n");
        assert!(wire.starts_with(expected.as_bytes()), "{base}");
    }
    assert!(Target::parse("127.0.0.1:8000").is_none(), "no scheme");
}

/// The header lines of a request as written.
fn header_lines(wire: &[u8]) -> Vec<String> {
    let head = String::from_utf8_lossy(wire);
    let head = head.split("\r\n\r\n").next().unwrap_or_default();
    head.split("\r\n").skip(1).map(str::to_owned).collect()
}

/// Every call carries the `Host` header the HTTP client would have written: the host, and the
/// port unless it is the scheme's default, never the user info.
#[test]
fn a_call_names_its_host_as_the_http_client_would() {
    for (base, host) in [
        ("http://127.0.0.1:8000", "127.0.0.1:8000"),
        ("http://engine.local/prefix/", "engine.local"),
        ("http://engine.local:80", "engine.local"),
        ("https://engine.local:443", "engine.local"),
        ("https://engine.local:80", "engine.local:80"),
        ("http://user:secret@[::1]:9/a", "[::1]:9"),
    ] {
        let wire = get(&Upstream::new(base.into(), None), "/v1/models");
        assert_eq!(header_lines(&wire), [format!("host: {host}")], "{base}");
    }
}

/// A call pinned to a DP rank carries vLLM's `X-data-parallel-rank`; others carry none.
#[test]
fn a_pinned_upstream_names_its_dp_rank_on_every_call() {
    let engine = Upstream::new("http://127.0.0.1:8000".into(), None);
    let rank = |upstream: &Upstream| {
        let wire = get(upstream, "/v1/completions");
        header_lines(&wire).into_iter().find_map(|line| {
            line.strip_prefix("x-data-parallel-rank: ")
                .map(str::to_owned)
        })
    };
    assert_eq!(rank(&engine), None);
    let pinned = engine.clone().pinned_to_rank(3);
    assert_eq!(rank(&pinned).as_deref(), Some("3"));
    assert_ne!(pinned, engine, "called another way");
}

/// A request id that is no header value (a line break in it could add headers of its own) is
/// refused before anything is sent.
#[tokio::test]
async fn a_request_id_that_is_no_header_value_is_refused() {
    let engine = Upstream::new("http://127.0.0.1:9".into(), None);
    let sent = client(Duration::from_secs(2))
        .answer_leg(&engine, "/v1/completions", &(), "id\r\nx-injected: 1")
        .await;
    assert!(matches!(sent, Err(CallError::Build { .. })), "{sent:?}");
}

/// The connections an engine accepted, and those of them the client closed.
#[derive(Debug, Default)]
struct Connections {
    accepted: std::sync::atomic::AtomicUsize,
    closed: std::sync::atomic::AtomicUsize,
}

/// Serves streamed completions on every connection it accepts, as uvicorn (vLLM's and SGLang's
/// server) ends them: `[DONE]` in one write, the chunked body's end in another, a moment later.
async fn uvicorn_like_engine() -> (Upstream, Arc<Connections>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = Arc::new(Connections::default());
    let counts = connections.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counts.accepted.fetch_add(1, Ordering::SeqCst);
            let counts = counts.clone();
            tokio::spawn(async move {
                serve_streams(stream).await;
                counts.closed.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (engine_at(addr), connections)
}

/// Answers each request on `stream` until the client closes it.
async fn serve_streams(mut stream: tokio::net::TcpStream) {
    let events = "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"x\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let first = format!("{head}{:x}\r\n{events}\r\n", events.len());
    let mut pending = Vec::new();
    while read_request(&mut stream, &mut pending).await {
        let answer = async {
            stream.write_all(first.as_bytes()).await?;
            tokio::time::sleep(Duration::from_millis(1)).await;
            stream.write_all(b"0\r\n\r\n").await
        };
        if answer.await.is_err() {
            return;
        }
    }
}

/// Reads one request (head and `content-length` body); false once the client closed. Bytes
/// past it stay in `pending`.
async fn read_request(stream: &mut tokio::net::TcpStream, pending: &mut Vec<u8>) -> bool {
    loop {
        if let Some(head_end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&pending[..head_end]).to_ascii_lowercase();
            let body: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if pending.len() >= head_end + 4 + body {
                pending.drain(..head_end + 4 + body);
                return true;
            }
        }
        let mut buf = [0u8; 16 << 10];
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
    }
}

/// Streams read to `[DONE]` one after another reuse their engine connections: the body's end,
/// written apart after `[DONE]`, is read in the background. Dropped unread at `[DONE]`, each
/// connection was closed: 100 streams, 100 connections. Not one connection: a stream asked
/// for before the last body's end came finds none idle and opens one (here about half of
/// them, as the end comes 1 ms late; on loopback with uvicorn it comes at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_streams_keep_their_engine_connections() {
    let (engine, connections) = uvicorn_like_engine().await;
    let client = client(Duration::from_secs(20));
    let request = CompletionRequest::new(vec![1], 1, "cmpl-t".into());
    for _ in 0..100 {
        let mut chunks = client
            .generate_leg(&engine, "/v1/completions", &request, "cmpl-t", true, None)
            .await
            .expect("streams");
        let mut texts = 0;
        while let Some(chunk) = chunks.next().await {
            chunk.expect("a chunk");
            texts += 1;
        }
        assert_eq!(texts, 1);
    }
    assert!(
        connections.accepted.load(Ordering::SeqCst) < 100,
        "{connections:?}"
    );
}

/// An engine that keeps the body open after `[DONE]` does not hold the stream: it ends at
/// `[DONE]`, long before the 60 s a silent stream is given, and only the background read of
/// the body's end waits on the engine.
#[tokio::test]
async fn a_stream_ends_at_done_although_the_engine_keeps_its_body_open() {
    let events = "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"x\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{events}\r\n",
        events.len()
    );
    let engine = canned_engine(answer.into_bytes(), true).await;
    let client = client(Duration::from_secs(20));
    assert_eq!(client.timeouts().stream_idle, Duration::from_secs(60));
    let request = CompletionRequest::new(vec![1], 1, "cmpl-t".into());
    let mut chunks = client
        .generate_leg(&engine, "/v1/completions", &request, "cmpl-t", true, None)
        .await
        .expect("streams");
    let read = async {
        let mut texts = 0;
        while let Some(chunk) = chunks.next().await {
            chunk.expect("a chunk");
            texts += 1;
        }
        texts
    };
    let texts = tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("ended at [DONE], not at the idle timeout");
    assert_eq!(texts, 1);
}

/// The idle limit bounds each wait for a chunk, not the stream: chunks 6 s apart run past the
/// 10 s limit in all; a reader slow to ask for the next chunk (a slow client) does not count as
/// the engine's silence; a wait past the limit fails exactly at it, and the stream then ends.
#[tokio::test(start_paused = true)]
async fn the_idle_limit_counts_each_wait_for_a_chunk_not_the_stream() {
    let idle = Duration::from_secs(10);
    let gap = Duration::from_secs(6);
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut chunks = with_idle_timeout(Box::pin(rx), idle);
    let chunk = || Ok(EngineChunk::default());
    let engine = tokio::spawn(async move {
        for _ in 0..4 {
            tokio::time::sleep(gap).await;
            tx.unbounded_send(chunk()).expect("the reader is there");
        }
        // Quiet from here on, the body still open.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(tx);
    });
    let started = tokio::time::Instant::now();
    for _ in 0..3 {
        assert!(matches!(chunks.next().await, Some(Ok(_))));
    }
    assert_eq!(started.elapsed(), 3 * gap, "chunks within the limit pass");
    // The reader comes back 25 s later: the fourth chunk waits for it, ready.
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert!(matches!(chunks.next().await, Some(Ok(_))));
    let waiting = tokio::time::Instant::now();
    assert!(matches!(chunks.next().await, Some(Err(SseError::Idle(d))) if d == idle));
    assert_eq!(waiting.elapsed(), idle, "fails exactly at the limit");
    assert!(chunks.next().await.is_none(), "and ends");
    engine.abort();
}

/// A `GET` of `path` on `engine`, as the client writes its calls.
fn get(engine: &Upstream, path: &str) -> Vec<u8> {
    engine
        .request(&http::Method::GET, path, 0)
        .expect("a request")
        .finish(None)
}

/// The whole body of an exchange's answer.
async fn whole_body(response: EngineResponse) -> Bytes {
    response
        .into_body()
        .collect()
        .await
        .expect("a whole body")
        .to_bytes()
}

/// Whether a connection waits on `listener` unaccepted: a client's connect returns once the
/// kernel has completed it, so one made before this call is there.
fn connection_waiting(listener: TcpListener) -> bool {
    let listener = listener.into_std().expect("a std listener");
    match listener.accept() {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) => panic!("accept: {e}"),
    }
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

/// `path` called on `engine` (on a pooled connection if there is one), answered.
async fn answered(client: &EngineClient, engine: &Upstream, path: &str) -> EngineResponse {
    client
        .exchange(engine, &get(engine, path), None, true)
        .await
        .expect("answered")
}

/// The engine's side of a first connection: accepted, its request read and answered `ok`;
/// the connection and the bytes read past that request.
async fn first_answered(listener: &TcpListener) -> (tokio::net::TcpStream, Vec<u8>) {
    let mut pending = Vec::new();
    let (mut first, _) = listener.accept().await.expect("accept");
    assert!(read_request(&mut first, &mut pending).await);
    first.write_all(OK).await.expect("write");
    (first, pending)
}

/// A chunked body read to its end leaves its connection to the next call: three calls, one
/// connection, none closed.
#[tokio::test]
async fn a_connection_is_reused_once_its_streamed_body_was_read_to_its_end() {
    let (engine, connections) = uvicorn_like_engine().await;
    let client = client(Duration::from_secs(20));
    for _ in 0..3 {
        let response = answered(&client, &engine, "/v1/completions").await;
        assert!(whole_body(response).await.ends_with(b"data: [DONE]\n\n"));
    }
    assert_eq!(connections.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(connections.closed.load(Ordering::SeqCst), 0);
}

/// A pooled connection the engine closes as the next request arrives on it (its keep-alive
/// ran out) costs the call nothing: the request goes once more, on a fresh connection, and is
/// delivered.
#[tokio::test]
async fn a_request_on_a_connection_closed_under_it_goes_once_more_on_a_fresh_one() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let engine = engine_at(listener.local_addr().expect("addr"));
    let served = tokio::spawn(async move {
        let (mut first, mut pending) = first_answered(&listener).await;
        // The second request arrives, and the engine closes instead of answering.
        assert!(read_request(&mut first, &mut pending).await);
        drop(first);
        let (mut second, _) = listener.accept().await.expect("accept again");
        assert!(read_request(&mut second, &mut Vec::new()).await);
        second.write_all(OK).await.expect("write");
    });
    let client = client(Duration::from_secs(20));
    assert_eq!(
        whole_body(answered(&client, &engine, "/a").await).await,
        "ok"
    );
    let (delivery, delivered) = Delivery::new();
    let second = client
        .exchange(&engine, &get(&engine, "/b"), Some(&delivery), true)
        .await
        .expect("answered on a fresh connection");
    assert_eq!(whole_body(second).await, "ok");
    delivered.await.expect("delivered");
    served.await.expect("both connections served");
}

/// Once any byte of an answer came, a connection that breaks is a broken answer, never sent
/// again: the engine may have acted on it.
#[tokio::test]
async fn a_request_is_not_sent_again_once_its_answer_started() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let engine = engine_at(listener.local_addr().expect("addr"));
    let (client_done, done) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        let (mut first, mut pending) = first_answered(&listener).await;
        assert!(read_request(&mut first, &mut pending).await);
        first.write_all(b"HTTP/1.1 200 O").await.expect("write");
        drop(first);
        done.await.expect("the client is done");
        connection_waiting(listener)
    });
    let client = client(Duration::from_secs(20));
    assert_eq!(
        whole_body(answered(&client, &engine, "/a").await).await,
        "ok"
    );
    let err = client
        .exchange(&engine, &get(&engine, "/b"), None, true)
        .await
        .expect_err("broken");
    let err = err.classify(&engine);
    assert!(matches!(err, CallError::Stream(_)), "{err}");
    client_done.send(()).expect("the engine waits");
    assert!(!served.await.expect("served"), "no second connection");
}

/// A body dropped before its end closes its connection (what is left of it would be read as
/// the next answer's head): the engine sees the close, and the next call opens another.
#[tokio::test]
async fn a_body_dropped_mid_way_closes_its_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let engine = engine_at(listener.local_addr().expect("addr"));
    let served = tokio::spawn(async move {
        let (mut first, _) = listener.accept().await.expect("accept");
        assert!(read_request(&mut first, &mut Vec::new()).await);
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n";
        first.write_all(head).await.expect("write");
        // Read until the client closes: nothing else comes on it.
        let mut rest = Vec::new();
        let _ = first.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "{rest:?}");
        let (mut second, _) = listener.accept().await.expect("accept again");
        assert!(read_request(&mut second, &mut Vec::new()).await);
        second.write_all(OK).await.expect("write");
    });
    let client = client(Duration::from_secs(20));
    let mut body = answered(&client, &engine, "/a").await.into_body();
    let frame = body.frame().await.expect("a frame").expect("data");
    assert_eq!(frame.into_data().expect("data"), "hi");
    drop(body);
    let second = client
        .exchange(&engine, &get(&engine, "/b"), None, true)
        .await
        .expect("answered on a new connection");
    assert_eq!(whole_body(second).await, "ok");
    served.await.expect("served");
}

/// An idle connection is closed after `POOL_IDLE_TIMEOUT`, before an engine's own keep-alive
/// (5 s for uvicorn and nginx) would close it under a request: not a moment before.
#[tokio::test(start_paused = true)]
#[expect(
    clippy::async_yields_async,
    reason = "the engine's side hands back the wait for the close, awaited on the paused clock"
)]
async fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let engines = scripted::Engines::default();
    let mut e0 = engines.engine("e0");
    let client = EngineClient::scripted(Timeouts::default(), engines.connector());
    let engine = Upstream::new("http://e0".into(), None);
    let (metrics, closed) = tokio::join!(client.metrics(&engine), async {
        let call = e0.next().await;
        let closed = call.hung_up();
        call.status(200, "m 1\n");
        closed
    });
    assert_eq!(metrics.as_deref(), Some("m 1\n"));
    let idle_since = tokio::time::Instant::now();
    let mut closed = std::pin::pin!(closed);
    let before = pool::POOL_IDLE_TIMEOUT - Duration::from_millis(1);
    assert!(
        tokio::time::timeout(before, &mut closed).await.is_err(),
        "still open just before"
    );
    closed.await;
    assert_eq!(idle_since.elapsed(), pool::POOL_IDLE_TIMEOUT);
}
