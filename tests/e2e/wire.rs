//! The router's HTTP/1.1 server on the wire, written byte by byte as any client may: request
//! bodies framed by length or by chunks, framing that could be read two ways (request
//! smuggling) refused with an OpenAI error or read one way, and the connection closed, oversized heads, keep-alive by
//! version and `Connection`, pipelining, `Expect: 100-continue`, `HEAD`, and how a stream is
//! delimited for HTTP/1.0 and 1.1 clients; requests split anywhere across writes, and near-valid
//! requests mutated at random. These pin what any server connection the router runs on must do,
//! whoever wrote it.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// How long any one read may wait: far above a loaded CI box's worst, a hang fails the test.
const READ_WITHIN: Duration = Duration::from_secs(30);

/// One reference engine and a router in front of it.
fn router() -> (EngineProcess, RouterProcess) {
    let engine = EngineProcess::spawn(&[]);
    let router = RouterProcess::serve(&[&engine.url], &["--policy", "round-robin"]);
    (engine, router)
}

/// One response as read off the wire.
#[derive(Debug)]
struct Response {
    /// `HTTP/1.1` or `HTTP/1.0`.
    version: String,
    status: u16,
    /// Names lower-cased, in the order sent.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{} is no JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// Whether the body is an OpenAI error: `{"error": {"message": …}}`.
    fn is_openai_error(&self) -> bool {
        serde_json::from_slice::<Value>(&self.body)
            .is_ok_and(|body| body["error"]["message"].is_string())
    }

    /// A completion's `usage.completion_tokens`: which of several requests this answers.
    fn completion_tokens(&self) -> u64 {
        assert_eq!(self.status, 200, "{}", String::from_utf8_lossy(&self.body));
        self.json()["usage"]["completion_tokens"]
            .as_u64()
            .expect("usage.completion_tokens")
    }
}

/// A raw connection to the router, and what was read on it past the last response.
struct Wire {
    stream: TcpStream,
    unread: Vec<u8>,
}

impl Wire {
    async fn open(router: &RouterProcess) -> Wire {
        let stream = TcpStream::connect(router.addr)
            .await
            .expect("router reachable");
        Wire {
            stream,
            unread: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send");
    }

    /// Read once more into `unread`: false at the end of the stream (or a reset).
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 << 10];
        let read = tokio::time::timeout(READ_WITHIN, self.stream.read(&mut chunk))
            .await
            .expect("bytes or the end of the stream within 30 s");
        match read {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.unread.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// `n` bytes off the front of what was read, reading more as needed.
    async fn take(&mut self, n: usize) -> Vec<u8> {
        while self.unread.len() < n {
            assert!(self.fill().await, "the connection ended inside a body");
        }
        self.unread.drain(..n).collect()
    }

    /// One line (CRLF-terminated) off the front, without its CRLF.
    async fn line(&mut self) -> String {
        loop {
            if let Some(end) = self.unread.windows(2).position(|w| w == b"\r\n") {
                let line = self.unread.drain(..end + 2).collect::<Vec<u8>>();
                return String::from_utf8_lossy(&line[..end]).into_owned();
            }
            assert!(self.fill().await, "the connection ended inside a line");
        }
    }

    /// The next response; `to_head`: it answers a `HEAD`, so it has no body whatever its
    /// headers say.
    async fn response(&mut self, to_head: bool) -> Response {
        let status_line = self.line().await;
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or_default().to_owned();
        let status = parts
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("a status line: {status_line:?}"));
        let mut headers = Vec::new();
        loop {
            let line = self.line().await;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').expect("a header line");
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        let mut response = Response {
            version,
            status,
            headers,
            body: Vec::new(),
        };
        if to_head || status < 200 || status == 204 || status == 304 {
            return response;
        }
        response.body = if response.header("transfer-encoding") == Some("chunked") {
            self.chunked_body().await
        } else if let Some(length) = response.header("content-length") {
            let length = length.parse().expect("a numeric content-length");
            self.take(length).await
        } else {
            while self.fill().await {}
            std::mem::take(&mut self.unread)
        };
        response
    }

    async fn chunked_body(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let size = self.line().await;
            let size = size.split(';').next().unwrap_or_default();
            let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
            if size == 0 {
                // No trailers: the blank line that ends the body.
                assert_eq!(self.line().await, "", "the chunked body's last line");
                return body;
            }
            body.extend(self.take(size).await);
            assert_eq!(self.line().await, "", "a chunk ends with CRLF");
        }
    }

    /// Whether the router closed the connection (after anything still unread).
    async fn closed(&mut self) -> bool {
        while self.unread.is_empty() {
            if !self.fill().await {
                return true;
            }
        }
        false
    }
}

/// A completion request's JSON body asking for `tokens` tokens (the answer's
/// `usage.completion_tokens` then says which request it answers).
fn completion(tokens: u32) -> Vec<u8> {
    json!({"prompt": "the wire", "max_tokens": tokens})
        .to_string()
        .into_bytes()
}

/// `POST /v1/completions` over HTTP/1.1 with `extra` header lines (each ending CRLF) and
/// `body` framed by its length.
fn post(extra: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         {extra}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// The head of a chunked `POST /v1/completions`.
const CHUNKED_HEAD: &str = "POST /v1/completions HTTP/1.1\r\nhost: router\r\n\
                            content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";

/// `body` in chunks of `size` bytes, the first with an extension, then trailers.
fn chunked(body: &[u8], size: usize) -> Vec<u8> {
    let mut encoded = Vec::new();
    for (i, chunk) in body.chunks(size).enumerate() {
        let extension = if i == 0 { ";name=value" } else { "" };
        encoded.extend(format!("{:x}{extension}\r\n", chunk.len()).into_bytes());
        encoded.extend_from_slice(chunk);
        encoded.extend_from_slice(b"\r\n");
    }
    encoded.extend_from_slice(b"0\r\nx-trailer: ignored\r\n\r\n");
    encoded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_is_read_the_same_framed_by_length_by_chunks_or_a_byte_at_a_time() {
    let (_engine, router) = router();
    let body = completion(3);
    let mut wire = Wire::open(&router).await;
    wire.send(&post("", &body)).await;
    let by_length = wire.response(false).await.json();
    assert_eq!(by_length["usage"]["completion_tokens"], 3, "{by_length}");

    // Chunked, on the same kept-alive connection.
    let mut request = CHUNKED_HEAD.as_bytes().to_vec();
    request.extend(chunked(&body, 7));
    wire.send(&request).await;
    let by_chunks = wire.response(false).await.json();
    assert_eq!(by_chunks["choices"], by_length["choices"]);

    // Every byte of the request in a write of its own, chunks of one byte.
    let mut request = CHUNKED_HEAD.as_bytes().to_vec();
    request.extend(chunked(&body, 1));
    for byte in &request {
        wire.send(std::slice::from_ref(byte)).await;
    }
    let bytewise = wire.response(false).await.json();
    assert_eq!(bytewise["choices"], by_length["choices"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_a_server_could_read_two_ways_is_refused_and_the_connection_closed() {
    let (_engine, router) = router();
    let body = completion(2);
    let refused = [
        (
            "two differing lengths",
            post("content-length: 5\r\n", &body),
        ),
        ("a signed length", {
            let request = post("", &body);
            String::from_utf8(request)
                .expect("ascii")
                .replace("content-length: ", "content-length: +")
                .into_bytes()
        }),
        ("a length that is no number", {
            let mut request =
                b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-length: 3 3\r\n\r\n"
                    .to_vec();
            request.extend_from_slice(&body);
            request
        }),
        ("a coding other than chunked", {
            let mut request =
                b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ntransfer-encoding: gzip\r\n\r\n"
                    .to_vec();
            request.extend_from_slice(&body);
            request
        }),
        ("chunked not the last coding", {
            let mut request = b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n\
                                transfer-encoding: chunked, gzip\r\n\r\n"
                .to_vec();
            request.extend(chunked(&body, 8));
            request
        }),
        (
            "a header folded over two lines",
            post("x-folded: first\r\n second\r\n", &body),
        ),
    ];
    for (what, request) in refused {
        let mut wire = Wire::open(&router).await;
        wire.send(&request).await;
        let response = wire.response(false).await;
        assert_eq!(response.status, 400, "{what}: {response:?}");
        assert!(response.is_openai_error(), "{what}: {response:?}");
        assert!(wire.closed().await, "{what}: the connection is closed");
    }

    // A chunk size that is no number: the body cannot be read, and nothing after it is a
    // request.
    let mut wire = Wire::open(&router).await;
    let mut request = CHUNKED_HEAD.as_bytes().to_vec();
    request.extend_from_slice(b"zz\r\n");
    request.extend_from_slice(&body);
    request.extend_from_slice(b"\r\n0\r\n\r\n");
    request.extend(post("", &completion(1)));
    wire.send(&request).await;
    let response = wire.response(false).await;
    assert!(
        (400..500).contains(&response.status),
        "a bad chunk size: {response:?}"
    );
    assert!(wire.closed().await, "a bad chunk size: closed");

    // Both a length and chunked: read as chunked (the length ignored) or refused, and either
    // way the connection is closed, so the bytes a length-reader would call the next request
    // are never answered as one.
    let mut both = chunked(&body, body.len());
    both.extend(post("", &completion(1)));
    let mut request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\ncontent-length: {}\r\n\r\n",
        both.len()
    )
    .into_bytes();
    request.extend(both);
    let mut wire = Wire::open(&router).await;
    wire.send(&request).await;
    let response = wire.response(false).await;
    match response.status {
        200 => assert_eq!(response.completion_tokens(), 2, "read as chunked"),
        400 => {}
        other => panic!("a length and chunked: {other} {response:?}"),
    }
    assert!(
        wire.closed().await,
        "a length and chunked: closed, the smuggled request unanswered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_its_bounds_gets_431_and_one_within_them_an_answer() {
    let (_engine, router) = router();
    let body = completion(2);
    // Within: what browsers and proxies send at most (8 KiB of headers, 40 of them).
    let within: String = (0..40)
        .map(|i| format!("x-within-{i}: {}\r\n", "v".repeat(200)))
        .collect();
    let mut wire = Wire::open(&router).await;
    wire.send(&post(&within, &body)).await;
    assert_eq!(wire.response(false).await.completion_tokens(), 2);

    let over = [
        (
            "a 1 MiB header",
            format!("x-big: {}\r\n", "a".repeat(1 << 20)),
        ),
        (
            "200 headers",
            (0..200).map(|i| format!("x-many-{i}: 1\r\n")).collect(),
        ),
    ];
    for (what, extra) in over {
        let mut wire = Wire::open(&router).await;
        // The router may answer and close before all of it is sent.
        let _ = wire.stream.write_all(&post(&extra, &body)).await;
        let response = wire.response(false).await;
        assert_eq!(response.status, 431, "{what}: {response:?}");
        assert!(response.is_openai_error(), "{what}: {response:?}");
        assert!(wire.closed().await, "{what}: closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_is_kept_alive_as_its_version_and_connection_header_say() {
    let (_engine, router) = router();
    let body = completion(1);
    let as_http10 = |extra: &str| {
        String::from_utf8(post(extra, &body))
            .expect("ascii")
            .replacen("HTTP/1.1", "HTTP/1.0", 1)
            .into_bytes()
    };
    let cases = [
        ("HTTP/1.1", post("", &body), true),
        (
            "HTTP/1.1 with close",
            post("connection: close\r\n", &body),
            false,
        ),
        ("HTTP/1.0", as_http10(""), false),
        (
            "HTTP/1.0 with keep-alive",
            as_http10("connection: keep-alive\r\n"),
            true,
        ),
    ];
    for (what, request, kept) in cases {
        let mut wire = Wire::open(&router).await;
        wire.send(&request).await;
        let response = wire.response(false).await;
        assert_eq!(response.completion_tokens(), 1, "{what}");
        // RFC 9112, section 2.3: the server's own version, or the client's lower one.
        let versions: &[&str] = if what.starts_with("HTTP/1.0") {
            &["HTTP/1.0", "HTTP/1.1"]
        } else {
            &["HTTP/1.1"]
        };
        assert!(
            versions.contains(&response.version.as_str()),
            "{what}: answered in {}",
            response.version
        );
        if kept {
            // Still open: a second request on it is answered.
            wire.send(&request).await;
            assert_eq!(wire.response(false).await.completion_tokens(), 1, "{what}");
        } else {
            assert!(wire.closed().await, "{what}: closed after the answer");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_head_and_expect_continue_are_answered_in_order() {
    let (_engine, router) = router();
    // Three requests in one write: answered in the order sent.
    let mut wire = Wire::open(&router).await;
    let mut requests = post("", &completion(3));
    requests.extend_from_slice(b"GET /v1/models HTTP/1.1\r\nhost: router\r\n\r\n");
    requests.extend(post("", &completion(1)));
    wire.send(&requests).await;
    assert_eq!(wire.response(false).await.completion_tokens(), 3);
    let models = wire.response(false).await;
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["object"], "list");
    assert_eq!(wire.response(false).await.completion_tokens(), 1);

    // HEAD: a head with no body, whatever its length says, and the connection goes on.
    wire.send(b"HEAD /v1/models HTTP/1.1\r\nhost: router\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: router\r\n\r\n")
        .await;
    let head = wire.response(true).await;
    assert!(head.header("content-length").is_some(), "{head:?}");
    let models = wire.response(false).await;
    assert_eq!(
        models.json()["object"],
        "list",
        "the next answer, not a body"
    );

    // Expect: 100-continue: the router asks for the body before it is sent.
    let body = completion(2);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         expect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    wire.send(head.as_bytes()).await;
    let interim = wire.response(false).await;
    assert_eq!(interim.status, 100, "{interim:?}");
    wire.send(&body).await;
    assert_eq!(wire.response(false).await.completion_tokens(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_chunked_for_http11_and_ended_by_close_for_http10() {
    let (_engine, router) = router();
    let body = json!({"prompt": "the wire", "max_tokens": 4, "stream": true})
        .to_string()
        .into_bytes();
    for version in ["HTTP/1.1", "HTTP/1.0"] {
        let request = String::from_utf8(post("", &body))
            .expect("ascii")
            .replacen("HTTP/1.1", version, 1);
        let mut wire = Wire::open(&router).await;
        wire.send(request.as_bytes()).await;
        let response = wire.response(false).await;
        assert_eq!(response.status, 200, "{version}: {response:?}");
        assert_eq!(
            response.header("content-type"),
            Some("text/event-stream"),
            "{version}"
        );
        let chunked = response.header("transfer-encoding") == Some("chunked");
        assert_eq!(chunked, version == "HTTP/1.1", "{version}: {response:?}");
        let text = String::from_utf8_lossy(&response.body);
        assert!(text.ends_with("data: [DONE]\n\n"), "{version}: {text}");
        if version == "HTTP/1.1" {
            // The connection outlives the stream: a second request on it is answered.
            wire.send(&post("", &completion(1))).await;
            assert_eq!(wire.response(false).await.completion_tokens(), 1);
        } else {
            assert!(
                wire.closed().await,
                "an HTTP/1.0 stream ends with its connection"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_shorter_than_its_length_is_an_openai_400() {
    let (_engine, router) = router();
    let body = completion(2);
    let mut request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len() + 50
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let mut wire = Wire::open(&router).await;
    wire.send(&request).await;
    // The client says it is done sending: the body can never be whole.
    wire.stream.shutdown().await.expect("half-close");
    let response = wire.response(false).await;
    assert_eq!(response.status, 400, "{response:?}");
    let error = response.json();
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(wire.closed().await);
}

/// A completion by length, one in chunks, the model list and another completion, in one stream
/// of bytes: answered as 1, 2 and 3 completion tokens with the list between.
fn four_requests() -> Vec<u8> {
    let mut requests = post("", &completion(1));
    requests.extend_from_slice(CHUNKED_HEAD.as_bytes());
    requests.extend(chunked(&completion(2), 5));
    requests.extend_from_slice(b"GET /v1/models HTTP/1.1\r\nhost: router\r\n\r\n");
    requests.extend(post("", &completion(3)));
    requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_split_anywhere_across_writes_are_answered_the_same() {
    let (_engine, router) = router();
    let requests = four_requests();
    let mut rng = StdRng::seed_from_u64(33);
    for round in 0..100 {
        let mut cuts: Vec<usize> = (0..rng.random_range(1..8))
            .map(|_| rng.random_range(1..requests.len()))
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut wire = Wire::open(&router).await;
        wire.stream.set_nodelay(true).expect("nodelay");
        let mut from = 0;
        for cut in cuts.into_iter().chain([requests.len()]) {
            wire.send(&requests[from..cut]).await;
            from = cut;
        }
        let what = format!("round {round}");
        assert_eq!(wire.response(false).await.completion_tokens(), 1, "{what}");
        assert_eq!(wire.response(false).await.completion_tokens(), 2, "{what}");
        assert_eq!(
            wire.response(false).await.json()["object"],
            "list",
            "{what}"
        );
        assert_eq!(wire.response(false).await.completion_tokens(), 3, "{what}");
    }
}

/// `request` with one to four random edits: a byte replaced, removed or inserted, or a run of
/// bytes repeated.
fn mutated(rng: &mut StdRng, request: &[u8]) -> Vec<u8> {
    let mut bytes = request.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let at = rng.random_range(0..bytes.len());
        match rng.random_range(0..4) {
            0 => bytes[at] = rng.random(),
            1 => {
                bytes.remove(at);
            }
            2 => bytes.insert(at, rng.random()),
            _ => {
                let end = (at + rng.random_range(1..16)).min(bytes.len());
                let run = bytes[at..end].to_vec();
                bytes.splice(at..at, run);
            }
        }
        if bytes.is_empty() {
            bytes.push(b'P');
        }
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_mutated_requests_get_answers_or_a_close_never_a_5xx_and_errors_in_json() {
    let engine = EngineProcess::spawn(&[]);
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let router =
        RouterProcess::serve_logging_to(&[&engine.url], &["--policy", "round-robin"], log.path());
    let valid = four_requests();
    let mut rng = StdRng::seed_from_u64(9112);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for round in 0..2_000 {
        let request = mutated(&mut rng, &valid);
        let mut wire = Wire::open(&router).await;
        // Some edits leave the router waiting for more bytes: the client's end of sending says
        // there are none.
        let _ = wire.stream.write_all(&request).await;
        let _ = wire.stream.shutdown().await;
        // Whatever it answers, every answer is whole and none is a server error, until it
        // closes the connection.
        while !wire.closed().await {
            let response = wire.response(false).await;
            assert!(
                response.status < 500,
                "round {round}: {} for {:?}",
                response.status,
                String::from_utf8_lossy(&request)
            );
            assert!(
                response.status < 400 || response.is_openai_error(),
                "round {round}: {response:?} for {:?}",
                String::from_utf8_lossy(&request)
            );
            *statuses.entry(response.status).or_default() += 1;
        }
    }
    eprintln!("2,000 mutated requests: answers by status {statuses:?}");
    assert!(
        statuses.contains_key(&200) && statuses.keys().any(|s| (400..500).contains(s)),
        "the mutations reach both sound and refused requests: {statuses:?}"
    );
    // Still serving, and nothing panicked.
    let mut wire = Wire::open(&router).await;
    wire.send(&post("", &completion(2))).await;
    assert_eq!(wire.response(false).await.completion_tokens(), 2);
    let logged = std::fs::read_to_string(log.path()).expect("the router's log");
    assert!(
        !logged.contains("panicked"),
        "the router panicked:\n{logged}"
    );
}
