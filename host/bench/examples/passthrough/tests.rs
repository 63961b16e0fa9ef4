//! The engine clients that drive their connections in the request's task (`--own-task`,
//! `--raw`), against an engine on loopback that answers as each test scripts it: a connection
//! is reused after a streamed body, a request the engine closes its connection under goes
//! again on a fresh one, and a body dropped mid-stream closes its connection rather than
//! leaving it to the pool.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::{Body, Engines};

/// Long enough for any loopback exchange here; bounds a test that would otherwise hang.
const PATIENCE: Duration = Duration::from_secs(10);

/// What the engine does with its next request.
enum Answer {
    /// A chunked 200 of these chunks, the connection kept open.
    Chunked(&'static [&'static str]),
    /// The first chunk of a chunked 200, then nothing until the client hangs up.
    Hold(&'static str),
    /// The request read, the connection closed without an answer.
    Close,
}

struct Engine {
    url: String,
    /// Connections accepted.
    connections: Arc<AtomicUsize>,
    /// Notified when a client hangs up on a held answer.
    hung_up: Arc<Notify>,
}

async fn engine(script: Vec<Answer>) -> Engine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    let connections = Arc::new(AtomicUsize::new(0));
    let hung_up = Arc::new(Notify::new());
    let (accepted, notify) = (Arc::clone(&connections), Arc::clone(&hung_up));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream, Arc::clone(&script), Arc::clone(&notify)));
        }
    });
    Engine {
        url,
        connections,
        hung_up,
    }
}

async fn serve(mut stream: TcpStream, script: Arc<Mutex<VecDeque<Answer>>>, hung_up: Arc<Notify>) {
    let mut buf = Vec::new();
    while read_request(&mut stream, &mut buf).await {
        let answer = script.lock().unwrap().pop_front();
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        match answer {
            Some(Answer::Chunked(chunks)) => {
                let mut out = head.to_owned();
                for chunk in chunks {
                    out += &format!("{:x}\r\n{chunk}\r\n", chunk.len());
                }
                out += "0\r\n\r\n";
                stream.write_all(out.as_bytes()).await.unwrap();
            }
            Some(Answer::Hold(first)) => {
                let out = format!("{head}{:x}\r\n{first}\r\n", first.len());
                stream.write_all(out.as_bytes()).await.unwrap();
                if matches!(stream.read(&mut [0; 1]).await, Ok(0) | Err(_)) {
                    hung_up.notify_one();
                }
                return;
            }
            Some(Answer::Close) | None => return,
        }
    }
}

/// One request's head and `Content-Length` body read off `stream` (false: the client closed).
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + length {
                buf.drain(..end + 4 + length);
                return true;
            }
        }
        let mut chunk = [0; 1024];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The two clients under test, each with pools of its own.
fn clients() -> [(&'static str, Engines); 2] {
    [
        ("own-task", Engines::OwnTask(Arc::default())),
        ("raw", Engines::Raw(Arc::default())),
    ]
}

async fn call(client: &Engines, engine: &Engine) -> Response<Body> {
    let request = Request::post(format!("{}/v1/completions", engine.url))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("an answer in time")
        .expect("an answer")
}

async fn text(answer: Response<Body>) -> String {
    let bytes = tokio::time::timeout(PATIENCE, answer.into_body().collect())
        .await
        .expect("the body in time")
        .expect("the whole body")
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn a_streamed_body_read_to_its_end_leaves_its_connection_for_the_next_call() {
    for (name, client) in clients() {
        let engine = engine(vec![
            Answer::Chunked(&["data: a\n\n", "data: [DONE]\n\n"]),
            Answer::Chunked(&["data: b\n\n"]),
        ])
        .await;
        assert_eq!(
            text(call(&client, &engine).await).await,
            "data: a\n\ndata: [DONE]\n\n"
        );
        assert_eq!(text(call(&client, &engine).await).await, "data: b\n\n");
        assert_eq!(engine.connections.load(Ordering::SeqCst), 1, "{name}");
    }
}

#[tokio::test]
async fn a_call_the_engine_closes_its_connection_under_goes_again_on_a_fresh_one() {
    for (name, client) in clients() {
        let engine = engine(vec![
            Answer::Chunked(&["first"]),
            Answer::Close,
            Answer::Chunked(&["again"]),
        ])
        .await;
        assert_eq!(text(call(&client, &engine).await).await, "first");
        // The pooled connection takes the request and closes: the same call is answered on a
        // second connection.
        assert_eq!(text(call(&client, &engine).await).await, "again", "{name}");
        assert_eq!(engine.connections.load(Ordering::SeqCst), 2, "{name}");
    }
}

#[tokio::test]
async fn a_body_dropped_mid_stream_closes_its_connection_instead_of_pooling_it() {
    for (name, client) in clients() {
        let engine = engine(vec![Answer::Hold("data: a\n\n"), Answer::Chunked(&["b"])]).await;
        let hung_up = engine.hung_up.notified();
        let mut body = call(&client, &engine).await.into_body();
        let first = tokio::time::timeout(PATIENCE, body.frame()).await.unwrap();
        assert_eq!(first.unwrap().unwrap().into_data().unwrap(), "data: a\n\n");
        drop(body);
        // A connection left to the pool would stay open: the engine would not see a hang-up.
        tokio::time::timeout(PATIENCE, hung_up)
            .await
            .unwrap_or_else(|_| panic!("{name}: the dropped body's connection was not closed"));
        assert_eq!(text(call(&client, &engine).await).await, "b", "{name}");
        assert_eq!(engine.connections.load(Ordering::SeqCst), 2, "{name}");
    }
}
