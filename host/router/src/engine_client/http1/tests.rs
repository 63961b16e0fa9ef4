//! Framing on scripted bytes: heads and bodies fed as reads would deliver them, and a
//! connection over an in-memory pipe for what needs a socket (a close, a head too big).

use http::HeaderValue;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};

use super::*;
use crate::http1::framing::{MAX_CHUNK_LINE, MAX_TRAILERS};

/// What a whole answer read through `pieces` (each as one read delivers it) came to: its head
/// (informational ones skipped, as [`Conn::read_head`] does), its body, and where the body's
/// reading stopped.
fn feed(pieces: &[&[u8]]) -> Result<(Head, Vec<u8>, Framing), Http1Error> {
    let mut buf = BytesMut::new();
    let mut head: Option<Head> = None;
    let mut body = Vec::new();
    let mut framing = Framing::Done;
    for piece in pieces {
        buf.extend_from_slice(piece);
        while head.is_none() {
            match parse_head(&mut buf)? {
                Some(h) if h.status.is_informational() => continue,
                Some(h) => {
                    framing = h.body;
                    head = Some(h);
                }
                None => break,
            }
        }
        if head.is_some() {
            while let Some(data) = decode(&mut framing, &mut buf)? {
                body.extend_from_slice(&data);
            }
        }
    }
    let head = head.expect("the whole head came");
    Ok((head, body, framing))
}

fn whole(answer: &[u8]) -> (Head, Vec<u8>, Framing) {
    feed(&[answer]).expect("a valid answer")
}

const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
    transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n";

#[test]
fn a_content_length_body_ends_at_its_length() {
    let (head, body, framing) =
        whole(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\n\r\nhello");
    assert_eq!(head.status, StatusCode::OK);
    assert!(!head.event_stream);
    assert_eq!(body, b"hello");
    assert_eq!(framing, Framing::Done);
    assert!(head.keep_alive);
}

#[test]
fn a_chunked_body_is_read_whatever_the_reads_split() {
    for cut in 0..=CHUNKED.len() {
        let (head, body, framing) =
            feed(&[&CHUNKED[..cut], &CHUNKED[cut..]]).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        assert_eq!(body, b"hello, world", "cut at {cut}");
        assert_eq!(framing, Framing::Done, "cut at {cut}");
        assert!(head.keep_alive);
    }
    let bytes: Vec<&[u8]> = CHUNKED.chunks(1).collect();
    let (_, body, framing) = feed(&bytes).expect("byte by byte");
    assert_eq!(
        (body.as_slice(), framing),
        (&b"hello, world"[..], Framing::Done)
    );
}

#[test]
fn chunk_extensions_are_ignored_and_trailers_dropped() {
    let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n\
        5;name=value ; other\r\nhello\r\n0;last\r\nx-trailer: 1\r\nx-other: 2\r\n\r\n";
    let (head, body, framing) = whole(answer);
    assert_eq!(body, b"hello");
    assert_eq!(framing, Framing::Done);
    assert!(head.keep_alive);
}

/// An answer is an event stream when its (first) `Content-Type` says so, parameters and all.
#[test]
fn an_event_stream_is_told_by_its_first_content_type() {
    for (content_type, event_stream) in [
        ("text/event-stream", true),
        ("text/event-stream; charset=utf-8", true),
        ("application/json", false),
        ("application/json\r\ncontent-type: text/event-stream", false),
    ] {
        let answer = format!("HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\n\r\n");
        let (head, ..) = whole(answer.as_bytes());
        assert_eq!(head.event_stream, event_stream, "{content_type}");
    }
    let (head, ..) = whole(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
    assert!(!head.event_stream, "none");
}

#[test]
fn a_body_without_length_or_chunks_runs_to_the_close_and_ends_the_connection() {
    let (head, body, framing) = whole(b"HTTP/1.1 200 OK\r\n\r\nall of it");
    assert_eq!(body, b"all of it");
    assert_eq!(framing, Framing::Close, "until the connection closes");
    assert!(!head.keep_alive);
    // A coding other than chunked last: the same.
    let (head, _, framing) = whole(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nzz");
    assert_eq!((framing, head.keep_alive), (Framing::Close, false));
}

#[test]
fn informational_heads_are_skipped_and_some_statuses_have_no_body() {
    let (head, body, framing) = whole(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n\
          HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    );
    assert_eq!((head.status, body.as_slice()), (StatusCode::OK, &b"ok"[..]));
    assert_eq!(framing, Framing::Done);
    for status in ["204 No Content", "304 Not Modified"] {
        let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 9\r\n\r\n");
        let (head, body, framing) = whole(answer.as_bytes());
        assert!(body.is_empty(), "{status}");
        assert_eq!(framing, Framing::Done, "{status}");
        assert!(head.keep_alive, "{status}");
    }
    assert!(matches!(
        feed(&[b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n"]),
        Err(Http1Error::HeadField(_))
    ));
}

#[test]
fn keep_alive_is_http11s_default_and_http10s_exception() {
    let keep = |answer: &str| whole(answer.as_bytes()).0.keep_alive;
    assert!(keep("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
    assert!(!keep(
        "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    ));
    assert!(!keep(
        "HTTP/1.1 200 OK\r\nConnection: Upgrade, Close\r\ncontent-length: 0\r\n\r\n"
    ));
    assert!(!keep("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"));
    assert!(keep(
        "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n"
    ));
    // Both framings given: read chunked, never reused.
    assert!(!keep(
        "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    ));
}

#[test]
fn malformed_heads_and_chunk_sizes_are_typed_errors() {
    for head in [
        &b"HTTP/1.1 2x0 OK\r\n\r\n"[..],
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
    ] {
        let err = feed(&[head]).expect_err("refused");
        assert!(matches!(err, Http1Error::Head(_)), "{err:?}");
    }
    for length in ["x", "-1", "1, 2", "99999999999999999999"] {
        let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {length}\r\n\r\n");
        let err = feed(&[answer.as_bytes()]).expect_err("refused");
        assert!(matches!(err, Http1Error::HeadField(_)), "{length}: {err:?}");
    }
    // The same length twice is one length.
    let (_, body, _) = whole(b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok");
    assert_eq!(body, b"ok");
    let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
    for bad in ["zz\r\n", "\r\n", "11111111111111111\r\n", "5\r\nhelloXX"] {
        let answer = format!("{chunked}{bad}");
        let err = feed(&[answer.as_bytes()]).expect_err("refused");
        assert!(matches!(err, Http1Error::Framing(_)), "{bad:?}: {err:?}");
    }
    // Trailers are bounded, their CRLFs counted: a line filling the bound to the byte, then
    // another, is refused rather than read on.
    for fill in [MAX_TRAILERS - 2, MAX_TRAILERS - 1, MAX_TRAILERS] {
        let trailer = format!("x-t: {}", "y".repeat(fill - 5));
        let answer = format!("{chunked}0\r\n{trailer}\r\nx-u: 1\r\n\r\n");
        let err = feed(&[answer.as_bytes()]).expect_err("refused");
        assert!(matches!(err, Http1Error::Framing(_)), "{fill}: {err:?}");
    }
    // A size line that never ends is refused once it is over its bound, not buffered.
    let endless = format!("{chunked}5;{}", "x".repeat(MAX_CHUNK_LINE));
    assert!(matches!(
        feed(&[endless.as_bytes()]),
        Err(Http1Error::Framing(_))
    ));
}

/// A connection over a pipe whose engine end the test writes and closes.
fn pipe() -> (Conn<DuplexStream>, DuplexStream) {
    let (ours, theirs) = tokio::io::duplex(1 << 20);
    (Conn::new(ours), theirs)
}

async fn body_of(
    conn: &mut Conn<DuplexStream>,
    mut framing: Framing,
) -> Result<Vec<u8>, Http1Error> {
    let mut body = Vec::new();
    while let Some(data) = std::future::poll_fn(|cx| conn.poll_body(&mut framing, cx)).await {
        body.extend_from_slice(&data?);
    }
    Ok(body)
}

#[tokio::test]
async fn a_head_over_its_bound_is_an_error_not_a_wait() {
    let (mut conn, mut engine) = pipe();
    let answer = format!("HTTP/1.1 200 OK\r\nx-padding: {}\r\n", "a".repeat(MAX_HEAD));
    // The engine keeps the connection open: only the bound ends the read.
    engine.write_all(answer.as_bytes()).await.expect("written");
    let err = conn.read_head().await.expect_err("too large");
    assert!(matches!(err, Http1Error::HeadTooLarge), "{err:?}");
    // More headers than the bound on their number: refused too.
    let (mut conn, mut engine) = pipe();
    let mut answer = b"HTTP/1.1 200 OK\r\n".to_vec();
    for i in 0..=MAX_HEADERS {
        answer.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
    }
    answer.extend_from_slice(b"\r\n");
    engine.write_all(&answer).await.expect("written");
    let err = conn.read_head().await.expect_err("too many");
    assert!(matches!(err, Http1Error::Head(_)), "{err:?}");
}

/// A connection whose engine wrote `answer` and then closed it.
async fn closed_after(answer: &[u8]) -> Conn<DuplexStream> {
    let (conn, mut engine) = pipe();
    engine.write_all(answer).await.expect("written");
    drop(engine);
    conn
}

#[tokio::test]
async fn a_close_before_any_answer_byte_is_closed_and_after_one_is_broken() {
    let (mut conn, engine) = pipe();
    conn.write(b"GET / HTTP/1.1\r\n\r\n")
        .await
        .expect("written");
    drop(engine);
    let err = conn.read_head().await.expect_err("closed");
    assert!(matches!(err, Http1Error::Closed(_)), "{err:?}");

    let mut conn = closed_after(b"HTTP/1.1 200").await;
    let err = conn.read_head().await.expect_err("broken");
    assert!(matches!(err, Http1Error::Broken(_)), "{err:?}");

    // A body cut short of its length: broken; a close-delimited one: ended.
    let mut conn = closed_after(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort").await;
    let head = conn.read_head().await.expect("a head");
    let err = body_of(&mut conn, head.body).await.expect_err("cut");
    assert!(matches!(err, Http1Error::Broken(_)), "{err:?}");

    let mut conn = closed_after(b"HTTP/1.1 200 OK\r\n\r\nto the end").await;
    let head = conn.read_head().await.expect("a head");
    assert_eq!(
        body_of(&mut conn, head.body).await.expect("whole"),
        b"to the end"
    );
}

#[tokio::test]
async fn a_request_is_written_with_its_length_and_an_idle_close_is_seen() {
    let (mut conn, mut engine) = pipe();
    let host = HeaderValue::from_static("e:1");
    let mut post = Request::start(&http::Method::POST, "/engine", "/v1/completions", 2);
    post.header(&http::header::HOST, host.as_bytes());
    let wire = post.finish(Some(b"{}"));
    conn.write(&wire).await.expect("written");
    let mut got = vec![0; wire.len()];
    engine.read_exact(&mut got).await.expect("read");
    assert_eq!(
        got,
        b"POST /engine/v1/completions HTTP/1.1\r\nhost: e:1\r\ncontent-length: 2\r\n\r\n{}"
    );
    let mut get = Request::start(&http::Method::GET, "", "/health", 0);
    let mut headers = HeaderMap::new();
    headers.insert(http::header::HOST, host);
    get.headers(&headers);
    assert_eq!(
        get.finish(None),
        b"GET /health HTTP/1.1\r\nhost: e:1\r\n\r\n"
    );
    assert!(conn.is_open(), "nothing to read: open");
    engine.write_all(b"x").await.expect("written");
    assert!(!conn.is_open(), "a stray byte: unusable");
    let (mut conn, engine) = pipe();
    drop(engine);
    assert!(!conn.is_open(), "closed");
}
