//! The router's edge under abuse, as separate processes on loopback:
//!
//! - overload: ten times the requests the engines are given at once; some are refused with
//!   429 and `Retry-After`, none times out or gets a 5xx, every admitted stream completes, the
//!   engines never hold more than the limit, and the router's memory stays bounded;
//! - slowloris: 200 connections trickling a header a byte a second are closed at the header
//!   deadline, while ordinary requests sent meanwhile all succeed; a body slower than its
//!   deadline gets 408, and an idle connection is closed at the keep-alive timeout, not at the
//!   header deadline;
//! - `--workers N`: N connection-worker threads serve, and streams spread over them complete;
//! - out of file descriptors, the listener pauses between failed accepts instead of spinning,
//!   and serves again once descriptors are free;
//! - SIGTERM with 200 streams open: `/health` turns 503 while `/livez` stays 200, every stream
//!   completes or ends with an error event then `[DONE]`, and `switchyard up` exits with none
//!   of its engines left running.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_tests::{EngineProcess, RouterProcess};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

use crate::book::checkout_file;
use crate::http::{client, post, sse_payloads};
use crate::router::{eventually, metric};

/// How one streamed request ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// 200, text, `[DONE]`.
    Completed,
    /// 200, then an OpenAI error event with this code, then `[DONE]`.
    ErrorEvent(String),
    /// 429 with `Retry-After` (seconds) and an OpenAI error body.
    Refused { retry_after: u64 },
    /// Anything else: a timeout, a 5xx, a cut stream.
    Wrong(String),
}

/// Streams one completion and says how it ended.
async fn stream(client: &reqwest::Client, url: &str, prompt: &str, max_tokens: u32) -> Ended {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    let response = match client.post(url).json(&body).send().await {
        Ok(response) => response,
        Err(e) => return Ended::Wrong(format!("no answer: {e}")),
    };
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let text = match response.text().await {
        Ok(text) => text,
        Err(e) => return Ended::Wrong(format!("{status}: the body broke: {e}")),
    };
    match (status, retry_after) {
        (200, _) => ended_stream(&text),
        (429, Some(retry_after)) if is_openai_error(&text, "overloaded") => {
            Ended::Refused { retry_after }
        }
        _ => Ended::Wrong(format!("{status} (Retry-After {retry_after:?}): {text}")),
    }
}

fn is_openai_error(text: &str, code: &str) -> bool {
    serde_json::from_str::<Value>(text).is_ok_and(|v| {
        v["error"]["code"] == code
            && v["error"]["message"].is_string()
            && v["error"]["type"].is_string()
            && v["error"].get("param").is_some()
    })
}

/// A 200 stream: text then `[DONE]`, or text, one error event, then `[DONE]`.
fn ended_stream(text: &str) -> Ended {
    let payloads = sse_payloads(text);
    let Some((last, chunks)) = payloads.split_last() else {
        return Ended::Wrong("an empty stream".into());
    };
    if last != "[DONE]" {
        return Ended::Wrong(format!("cut without [DONE]: {text}"));
    }
    for (i, chunk) in chunks.iter().enumerate() {
        let Ok(chunk) = serde_json::from_str::<Value>(chunk) else {
            return Ended::Wrong(format!("not JSON: {chunk}"));
        };
        if let Some(code) = chunk["error"]["code"].as_str() {
            return if i + 1 == chunks.len() {
                Ended::ErrorEvent(code.to_owned())
            } else {
                Ended::Wrong(format!("an error event before the end: {text}"))
            };
        }
    }
    Ended::Completed
}

/// Resident memory of a process in bytes (`VmRSS` of `/proc/<pid>/status`).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process runs");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// Requests the router serves at once in the overload test: the engines' whole capacity.
const CAPACITY: usize = 8;
/// Offered load: ten times that many clients, each sending the next request as soon as the
/// last one ended.
const CLIENTS: usize = 10 * CAPACITY;
const REQUESTS_PER_CLIENT: usize = 6;
/// A bound far above the ~50 MiB the router uses idle, far below what an unbounded queue of
/// this load would take.
const RSS_BOUND: u64 = 256 << 20;

/// Two reference engines with a real engine's step times (`llama3-8b-h100`).
fn llama_engines() -> Vec<EngineProcess> {
    (0..2)
        .map(|_| EngineProcess::spawn(&["--profile", "llama3-8b-h100"]))
        .collect()
}

/// What the sampler saw while the load ran.
#[derive(Debug, Default)]
struct Peaks {
    router_in_flight: f64,
    engines_holding: f64,
    rss: u64,
    samples: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_with_429_and_what_is_admitted_completes() {
    let engines = llama_engines();
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let capacity = CAPACITY.to_string();
    let router = RouterProcess::serve(
        &urls,
        &[
            "--policy",
            "round-robin",
            "--max-concurrent-requests",
            &capacity,
            "--max-queued-requests",
            &capacity,
            "--queue-timeout",
            "200ms",
        ],
    );
    let idle_rss = rss_bytes(router.pid());
    let url = router.endpoint("/v1/completions");
    let client = client();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut ended = Vec::with_capacity(REQUESTS_PER_CLIENT);
                for r in 0..REQUESTS_PER_CLIENT {
                    let prompt = format!("client {c} request {r}: prefill decode router");
                    ended.push(stream(&client, &url, &prompt, 16).await);
                }
                ended
            })
        })
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample(
        router.endpoint("/metrics"),
        engines.iter().map(|e| e.endpoint("/metrics")).collect(),
        router.pid(),
        Arc::clone(&done),
    ));
    let mut ended = Vec::new();
    for c in clients {
        ended.extend(c.await.expect("no client panicked"));
    }
    done.store(true, Ordering::Release);
    let peaks = sampler.await.expect("no sampler panic");

    let completed = ended.iter().filter(|e| **e == Ended::Completed).count();
    let refused = ended
        .iter()
        .filter(|e| matches!(e, Ended::Refused { .. }))
        .count();
    let wrong: Vec<_> = ended
        .iter()
        .filter(|e| !matches!(e, Ended::Completed | Ended::Refused { .. }))
        .collect();
    println!(
        "overload: {} requests from {CLIENTS} clients at a limit of {CAPACITY}: {completed} \
         completed, {refused} refused (429); peaks over {} samples: {} admitted in flight, {} \
         held by the engines, router RSS {} MiB (idle {} MiB)",
        ended.len(),
        peaks.samples,
        peaks.router_in_flight,
        peaks.engines_holding,
        peaks.rss >> 20,
        idle_rss >> 20,
    );
    assert!(wrong.is_empty(), "{} went wrong: {wrong:?}", wrong.len());
    assert!(refused > 0, "ten times the capacity got no 429");
    assert!(completed > 0, "nothing was admitted");
    assert!(
        ended
            .iter()
            .all(|e| !matches!(e, Ended::Refused { retry_after } if *retry_after != 1)),
        "Retry-After is the queue timeout in whole seconds, at least 1"
    );
    assert!(peaks.samples > 0);
    assert!(peaks.router_in_flight <= CAPACITY as f64, "{peaks:?}");
    assert!(
        peaks.engines_holding <= CAPACITY as f64,
        "the engines held more requests than the router admits: {peaks:?}"
    );
    assert!(peaks.rss < RSS_BOUND, "{peaks:?}");

    let metrics = router.endpoint("/metrics");
    assert_eq!(
        metric(&metrics, "switchyard_admission_admitted_total").await,
        completed as f64
    );
    assert_eq!(
        metric(&metrics, "switchyard_admission_rejected_total").await,
        refused as f64
    );
    assert!(metric(&metrics, "switchyard_admission_queue_wait_seconds_count").await > 0.0);
    // The last permits go when hyper drops each body, just after the client read `[DONE]`.
    eventually(Duration::from_secs(10), || async {
        let in_flight = metric(&metrics, "switchyard_admission_in_flight").await;
        let queued = metric(&metrics, "switchyard_admission_queued").await;
        (in_flight + queued > 0.0).then(|| format!("{in_flight} in flight, {queued} queued"))
    })
    .await;
}

/// Samples, until `done`, the router's admitted requests in flight, the requests the engines
/// hold (running or waiting) and the router's RSS. At most one sample per 20 ms, 3000 in all.
async fn sample(
    router_metrics: String,
    engine_metrics: Vec<String>,
    router_pid: u32,
    done: Arc<AtomicBool>,
) -> Peaks {
    let mut peaks = Peaks::default();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    for _ in 0..3000 {
        if done.load(Ordering::Acquire) {
            break;
        }
        tick.tick().await;
        let mut holding = 0.0;
        for m in &engine_metrics {
            holding += metric(m, "switchyard_engine_running_requests").await;
            holding += metric(m, "switchyard_engine_waiting_requests").await;
        }
        let in_flight = metric(&router_metrics, "switchyard_admission_in_flight").await;
        peaks.engines_holding = peaks.engines_holding.max(holding);
        peaks.router_in_flight = peaks.router_in_flight.max(in_flight);
        peaks.rss = peaks.rss.max(rss_bytes(router_pid));
        peaks.samples += 1;
    }
    peaks
}

/// Slow connections in the slowloris test.
const SLOW_CONNECTIONS: usize = 200;
/// Bytes a slow connection sends at most (a byte a second) before the test gives up on it.
const MAX_TRICKLE: usize = 60;

/// `--workers 3`: the router serves on three connection-worker threads beside its control
/// thread, and streams on connections of their own, spread over them, all complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_served_on_as_many_workers_as_the_flag_asks() {
    let engines: Vec<_> = (0..2)
        .map(|_| EngineProcess::spawn(&["--profile", "null"]))
        .collect();
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let router = RouterProcess::serve(&urls, &["--policy", "round-robin", "--workers", "3"]);
    // Thread names are cut to 15 bytes: switchyard-worker-N, switchyard-control. The control
    // runtime's blocking threads (loading the policies) carry its name too.
    let names = thread_names(router.pid());
    let named = |prefix: &str| names.iter().filter(|n| n.starts_with(prefix)).count();
    assert_eq!(named("switchyard-work"), 3, "{names:?}");
    assert!(named("switchyard-cont") >= 1, "{names:?}");
    let url = router.endpoint("/v1/completions");
    let streams: Vec<_> = (0..12)
        .map(|i| {
            let url = url.clone();
            // A client each: a connection each.
            tokio::spawn(async move { stream(&client(), &url, &format!("stream {i}"), 8).await })
        })
        .collect();
    for s in streams {
        assert_eq!(s.await.expect("no client panicked"), Ended::Completed);
    }
}

/// The names of `pid`'s threads.
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the router's threads")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim_end().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_connections_are_closed_at_the_header_deadline_while_requests_succeed() {
    let engine = EngineProcess::spawn(&[]);
    let router = RouterProcess::serve(
        &[&engine.url],
        &["--policy", "round-robin", "--header-read-timeout", "2s"],
    );
    let (started, mut trickling) = tokio::sync::mpsc::unbounded_channel();
    let slow: Vec<_> = (0..SLOW_CONNECTIONS)
        .map(|_| tokio::spawn(trickle(router.addr, started.clone())))
        .collect();
    for _ in 0..SLOW_CONNECTIONS {
        trickling
            .recv()
            .await
            .expect("every slow connection starts");
    }
    // Ordinary requests while the 200 connections trickle: 4 clients, 10 requests each.
    let url = router.endpoint("/v1/completions");
    let normal: Vec<_> = (0..4)
        .map(|c| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for r in 0..10 {
                    let body =
                        json!({"prompt": format!("client {c} request {r}"), "max_tokens": 8});
                    let sent = Instant::now();
                    let (status, text) = post(&url, &body).await;
                    assert_eq!(status, 200, "{text}");
                    latencies.push(sent.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for n in normal {
        latencies.extend(n.await.expect("every ordinary request succeeded"));
    }
    let mut closed = Vec::new();
    for s in slow {
        closed.push(s.await.expect("no panic"));
    }
    latencies.sort();
    println!(
        "slowloris: {} ordinary requests beside {SLOW_CONNECTIONS} slow connections: p50 {:?}, \
         max {:?}; slow connections closed after {:?} bytes",
        latencies.len(),
        latencies[latencies.len() / 2],
        latencies.last().expect("some"),
        closed.iter().filter_map(|c| c.as_ref().ok()).max(),
    );
    let still_open: Vec<_> = closed.iter().filter_map(|c| c.as_ref().err()).collect();
    assert!(still_open.is_empty(), "{still_open:?}");
    let closed_by_deadline = metric(
        &router.endpoint("/metrics"),
        r#"switchyard_connections_closed_total{reason="header_timeout"}"#,
    )
    .await;
    assert_eq!(closed_by_deadline, SLOW_CONNECTIONS as f64);
}

/// Sends a request header that never ends, a byte a second, until the server closes the
/// connection without answering; returns the bytes sent. Reports on `started` once the first
/// byte is out.
async fn trickle(
    addr: std::net::SocketAddr,
    started: tokio::sync::mpsc::UnboundedSender<()>,
) -> Result<usize, String> {
    let head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut answer = [0u8; 256];
    for sent in 0..MAX_TRICKLE {
        let byte = head.get(sent).copied().unwrap_or(b'a');
        if stream.write_all(&[byte]).await.is_err() {
            return Ok(sent);
        }
        if sent == 0 {
            let _ = started.send(());
        }
        tokio::select! {
            read = stream.read(&mut answer) => return match read {
                Ok(0) | Err(_) => Ok(sent + 1),
                Ok(n) => Err(format!("answered {:?}", String::from_utf8_lossy(&answer[..n]))),
            },
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
    Err(format!("still open after {MAX_TRICKLE} bytes"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_gets_408_and_idle_connections_close_at_the_keep_alive_timeout() {
    let engine = EngineProcess::spawn(&[]);
    let router = RouterProcess::serve(
        &[&engine.url],
        &[
            "--header-read-timeout",
            "1s",
            "--body-read-timeout",
            "1s",
            "--keep-alive-timeout",
            "5s",
        ],
    );
    // Idle longer than the header deadline between two requests: only the keep-alive timeout
    // applies while no request is under way.
    let mut kept = tokio::net::TcpStream::connect(router.addr)
        .await
        .expect("connect");
    let get = b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    for _ in 0..2 {
        kept.write_all(get).await.expect("write");
        assert_eq!(read_response(&mut kept).await.0, 200);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), kept.read_to_end(&mut rest))
        .await
        .expect("closed at the keep-alive timeout")
        .expect("a clean close");
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    assert!(
        metric(
            &router.endpoint("/metrics"),
            r#"switchyard_connections_closed_total{reason="idle_timeout"}"#
        )
        .await
            >= 1.0
    );

    let mut slow = tokio::net::TcpStream::connect(router.addr)
        .await
        .expect("connect");
    let head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\"";
    slow.write_all(head.as_bytes()).await.expect("write");
    let (status, body) = read_response(&mut slow).await;
    assert_eq!(status, 408, "{body}");
    assert!(is_openai_error(&body, "body_read_timeout"), "{body}");
}

/// Reads one HTTP/1.1 response with a Content-Length: its status and body.
async fn read_response(stream: &mut tokio::net::TcpStream) -> (u16, String) {
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    let (head_len, length) = loop {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf))
            .await
            .expect("an answer within 30 s")
            .expect("read");
        assert!(n > 0, "closed before a whole response: {read:?}");
        read.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&read);
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")?
                        .trim()
                        .parse()
                        .ok()
                })
                .expect("a content-length");
            break (end + 4, length);
        }
    };
    while read.len() < head_len + length {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "closed mid-body");
        read.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&read).into_owned();
    let status = text[9..12].parse().expect("a status code");
    (status, text[head_len..head_len + length].to_owned())
}

/// Plain connections are served however their first bytes come (the router peeks at them to
/// serve HTTP/1 alone, and leaves the rest to the server that reads HTTP/2's preface): a
/// completion with 10 KiB of headers, one whose first byte arrives alone (`P`: the preface's
/// start, as far as it shows), and an HTTP/2 client with prior knowledge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_connections_are_served_however_their_first_bytes_come() {
    let engine = EngineProcess::spawn(&[]);
    let router = RouterProcess::serve(&[&engine.url], &["--policy", "round-robin"]);

    let padding = "p".repeat(10 * 1024);
    let response = crate::http::client()
        .post(router.endpoint("/v1/completions"))
        .header("x-padding", &padding)
        .json(&json!({"prompt": "large headers", "max_tokens": 4}))
        .send()
        .await
        .expect("an answer");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"choices\""), "{text}");

    let mut trickled = tokio::net::TcpStream::connect(router.addr)
        .await
        .expect("connect");
    trickled.set_nodelay(true).expect("nodelay");
    trickled.write_all(b"P").await.expect("write");
    // Not synchronisation: the first byte goes out in a segment of its own.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let body = json!({"prompt": "trickled", "max_tokens": 4}).to_string();
    let rest = format!(
        "OST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    trickled.write_all(rest.as_bytes()).await.expect("write");
    let (status, body) = read_response(&mut trickled).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"choices\""), "{body}");

    let tcp = tokio::net::TcpStream::connect(router.addr)
        .await
        .expect("connect");
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let request = hyper::Request::get(router.endpoint("/v1/models"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let response = sender.send_request(request).await.expect("h2 response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), hyper::Version::HTTP_2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_the_listener_pauses_instead_of_spinning_and_recovers() {
    let engine = EngineProcess::spawn(&[]);
    let router = RouterProcess::serve(&[&engine.url], &["--policy", "round-robin"]);
    let pid = router.pid();
    let open_fds = || std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let limit = open_fds() + 8;
    let raw = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    let cap = rustix::process::Rlimit {
        current: Some(limit as u64),
        maximum: Some(limit as u64),
    };
    rustix::process::prlimit(Some(raw), rustix::process::Resource::Nofile, cap)
        .expect("limit the router's open files");
    // More connections than it has descriptors left: the kernel completes them all, the
    // router accepts what it can and then fails with EMFILE.
    let mut clients = Vec::new();
    for _ in 0..40 {
        clients.push(
            tokio::net::TcpStream::connect(router.addr)
                .await
                .expect("the backlog takes it"),
        );
    }
    eventually(Duration::from_secs(10), || async {
        let open = open_fds();
        (open < limit).then(|| format!("{open} of {limit} descriptors open"))
    })
    .await;
    let exhausted = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let window = exhausted.elapsed();
    drop(clients);
    // Served again once descriptors are free: the backlog drains and /metrics answers.
    let metrics = router.endpoint("/metrics");
    let mut errors = None;
    for _ in 0..100 {
        if let Ok(response) = client().get(&metrics).send().await
            && let Ok(text) = response.text().await
        {
            errors = text
                .lines()
                .find_map(|l| l.strip_prefix("switchyard_accept_errors_total "))
                .and_then(|v| v.trim().parse::<f64>().ok());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let errors = errors.expect("the router serves again once descriptors are free");
    // Pauses of 5 ms doubling up to 1 s: about 8 failures in the first second, 1 a second
    // after. An accept loop that retried at once would fail thousands of times.
    let bound = 12.0 + 2.0 * window.as_secs_f64().ceil();
    println!("EMFILE for {window:?}: {errors} failed accepts (bound {bound})");
    assert!(errors >= 1.0, "the router never ran out of descriptors");
    assert!(errors <= bound, "{errors} failed accepts in {window:?}");
    let (status, text) = post(
        &router.endpoint("/v1/completions"),
        &json!({"prompt": "after EMFILE", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
}

/// Streams open when SIGTERM arrives in the drain test.
const OPEN_STREAMS: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_200_streams_open_drains_them_and_up_exits_with_its_engines() {
    // Decode steps ten times a real engine's (~70 ms at this batch): most streams outlast the
    // drain delay and the grace period, and the ones that reach their end of text finish.
    let up = RouterProcess::up(&[
        "--engine-arg=--profile=llama3-8b-h100",
        "--engine-arg=--time-scale=10",
        "--drain-delay",
        "2s",
        "--shutdown-grace",
        "3s",
    ]);
    let engines = children(up.pid());
    assert_eq!(
        engines.len(),
        3,
        "1 prefill and 2 decode engines: {engines:?}"
    );
    let url = up.endpoint("/v1/completions");
    let client = client();
    let (first_bytes, mut streaming) = tokio::sync::mpsc::unbounded_channel();
    let signalled = Arc::new(AtomicBool::new(false));
    let streams: Vec<_> = (0..OPEN_STREAMS)
        .map(|i| {
            let (client, url, first_bytes) = (client.clone(), url.clone(), first_bytes.clone());
            let signalled = Arc::clone(&signalled);
            tokio::spawn(async move {
                let prompt = format!("drain {i}");
                let ended = stream_reporting_first_bytes(&client, &url, &prompt, first_bytes).await;
                (ended, signalled.load(Ordering::Acquire))
            })
        })
        .collect();
    for _ in 0..OPEN_STREAMS {
        tokio::time::timeout(Duration::from_secs(60), streaming.recv())
            .await
            .expect("every stream starts within a minute")
            .expect("a stream task ended before its first bytes");
    }

    signalled.store(true, Ordering::Release);
    up.signal(rustix::process::Signal::TERM);
    let (health, livez) = (up.endpoint("/health"), up.endpoint("/livez"));
    // Signal delivery has no event to wait on from here: poll until the router has taken it.
    eventually(Duration::from_secs(10), || async {
        let status = status_of(&health).await;
        (status != Some(503)).then(|| format!("/health answers {status:?}"))
    })
    .await;
    assert_eq!(
        status_of(&livez).await,
        Some(200),
        "alive while /health is 503"
    );
    // Until the listener closes, /health stays 503 (then connections are refused).
    for _ in 0..100 {
        match status_of(&health).await {
            Some(503) => {}
            None => break,
            other => panic!("/health answered {other:?} while draining"),
        }
    }

    let mut ended = Vec::new();
    let mut open_at_signal = 0;
    for s in streams {
        let (e, after_signal) = s.await.expect("no stream task panicked");
        open_at_signal += usize::from(after_signal);
        ended.push(e);
    }
    let exit = tokio::task::spawn_blocking(move || up.wait_exit(Duration::from_secs(60)))
        .await
        .expect("no panic");
    assert_eq!(exit.map(|s| s.success()), Some(true), "a clean exit");

    let completed = ended.iter().filter(|e| **e == Ended::Completed).count();
    let cut = ended
        .iter()
        .filter(|e| matches!(e, Ended::ErrorEvent(code) if code == "shutting_down"))
        .count();
    println!(
        "SIGTERM: {OPEN_STREAMS} streams, {open_at_signal} open at the signal: {completed} \
         completed, {cut} ended with an error event"
    );
    assert_eq!(completed + cut, OPEN_STREAMS, "{ended:?}");
    assert!(cut > 0, "no stream outlasted the grace period");
    let survivors: Vec<_> = engines.iter().filter(|e| e.alive()).collect();
    assert!(survivors.is_empty(), "engines outlived `up`: {survivors:?}");
}

/// Streams one completion like [`stream`], reporting on `first_bytes` once its first chunk
/// has arrived.
async fn stream_reporting_first_bytes(
    client: &reqwest::Client,
    url: &str,
    prompt: &str,
    first_bytes: tokio::sync::mpsc::UnboundedSender<()>,
) -> Ended {
    let body = json!({"prompt": prompt, "max_tokens": 4000, "stream": true});
    let mut response = match client.post(url).json(&body).send().await {
        Ok(r) if r.status() == 200 => r,
        Ok(r) => return Ended::Wrong(format!("{}", r.status())),
        Err(e) => return Ended::Wrong(format!("no answer: {e}")),
    };
    let mut text = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if text.is_empty() {
                    let _ = first_bytes.send(());
                }
                text.extend_from_slice(&chunk);
            }
            Ok(None) => return ended_stream(&String::from_utf8_lossy(&text)),
            Err(e) => return Ended::Wrong(format!("the stream broke: {e}")),
        }
    }
}

/// The status of `GET url` on a fresh connection; `None` when nothing answers.
async fn status_of(url: &str) -> Option<u16> {
    let fresh = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let response = fresh.get(url).send().await.ok()?;
    Some(response.status().as_u16())
}

/// A process, told apart from a later one that reuses its pid by its start time.
#[derive(Debug, PartialEq, Eq)]
struct Process {
    pid: u32,
    started: u64,
}

impl Process {
    /// The pid's parent and start time, if it runs (a zombie has exited).
    fn read(pid: u32) -> Option<(u32, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // After the command name in parentheses: state, ppid, … starttime (the 20th).
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        if fields.first() == Some(&"Z") {
            return None;
        }
        Some((fields.get(1)?.parse().ok()?, fields.get(19)?.parse().ok()?))
    }

    fn alive(&self) -> bool {
        Process::read(self.pid).is_some_and(|(_, started)| started == self.started)
    }
}

/// The processes whose parent is `parent`.
fn children(parent: u32) -> Vec<Process> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let (ppid, started) = Process::read(pid)?;
            (ppid == parent).then_some(Process { pid, started })
        })
        .collect()
}

/// The edge's flags and their defaults, as the issue fixes them.
const EDGE_FLAGS: [(&str, &str); 11] = [
    ("workers", "one per core"),
    ("max-concurrent-requests", "1024"),
    ("max-queued-requests", "1024"),
    ("queue-timeout", "5s"),
    ("max-body-bytes", "4194304"),
    ("header-read-timeout", "10s"),
    ("body-read-timeout", "30s"),
    ("keep-alive-timeout", "75s"),
    ("max-connections", "4096"),
    ("drain-delay", "5s"),
    ("shutdown-grace", "30s"),
];

#[test]
fn help_and_the_book_give_every_edge_flag_with_its_default() {
    let page = checkout_file("docs/src/operating/overload.md");
    for command in ["serve", "up"] {
        let help = std::process::Command::new(switchyard_tests::switchyard_bin())
            .args([command, "--help"])
            .output()
            .expect("switchyard runs");
        let help = String::from_utf8_lossy(&help.stdout);
        for (flag, default) in EDGE_FLAGS {
            let described = help
                .split(&format!("--{flag} <"))
                .nth(1)
                .and_then(|rest| rest.split("\n      --").next())
                .unwrap_or_else(|| panic!("`switchyard {command} --help` has no --{flag}"));
            assert!(
                described.contains(&format!("[default: {default}")),
                "switchyard {command} --help: --{flag} does not say [default: {default}]: {described}"
            );
        }
    }
    for (flag, default) in EDGE_FLAGS {
        assert!(
            page.contains(&format!("| `--{flag}` | {default}")),
            "docs/src/operating/overload.md has no row `--{flag}` | {default}"
        );
    }
}

#[test]
fn help_and_the_book_give_the_kubernetes_discovery_flags() {
    let page = checkout_file("docs/src/kubernetes.md");
    let help = std::process::Command::new(switchyard_tests::switchyard_bin())
        .args(["serve", "--help"])
        .output()
        .expect("switchyard runs");
    let help = String::from_utf8_lossy(&help.stdout);
    for (flag, default) in [
        ("discovery", "off"),
        ("k8s-selector", "required"),
        ("k8s-namespace", "the kubeconfig's"),
        ("k8s-resync", "30s"),
    ] {
        assert!(
            help.contains(&format!("--{flag} <")),
            "`switchyard serve --help` has no --{flag}"
        );
        assert!(
            page.contains(&format!("| `--{flag}` | {default}")),
            "docs/src/kubernetes.md has no row `--{flag}` | {default}"
        );
    }
    let resync = help
        .split("--k8s-resync <")
        .nth(1)
        .and_then(|rest| rest.split("\n      --").next())
        .unwrap_or_default();
    assert!(resync.contains("[default: 30s]"), "{resync}");
}

// === the overload benchmark ===

/// Requests the benchmark's router serves at once: 8 per engine.
const BENCH_CAPACITY: u32 = 16;

/// A benchmark, not a test (it asserts nothing about time): admitted requests' TTFT when ten
/// times the engines' throughput is offered, against the same router and engines below their
/// capacity (4 clients) and at it (16 clients, the router's limit). Two `llama3-8b-h100` engines
/// behind `--policy round-robin`, 128-token prompts, 32 output tokens, streamed;
/// `switchyard bench` is the load generator (closed loop, then Poisson arrivals at ten times
/// the throughput measured at capacity). Prints a markdown table (the book's, in
/// `docs/src/performance.md`):
///
/// ```sh
/// cargo build --release -p switchyard && make plugins
/// SWITCHYARD_BIN=$PWD/target/release/switchyard cargo test -p switchyard-tests --test e2e \
///     edge::overload_benchmark -- --ignored --nocapture
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run it alone, see its doc comment"]
async fn overload_benchmark() {
    let engines = llama_engines();
    let urls: Vec<&str> = engines.iter().map(|e| e.url.as_str()).collect();
    let capacity = BENCH_CAPACITY.to_string();
    let limited = [
        "--max-concurrent-requests",
        &capacity,
        "--max-queued-requests",
        "0",
    ];
    let queued = [
        "--max-concurrent-requests",
        &capacity,
        "--max-queued-requests",
        &capacity,
        "--queue-timeout",
        "1s",
    ];
    let light = bench_run(&urls, &limited, &["--concurrency", "4"], 500);
    let full = bench_run(&urls, &limited, &["--concurrency", &capacity], 2000);
    // Ten times what the engines completed at their capacity, as Poisson arrivals.
    let rate = format!("{:.0}", 10.0 * full.throughput);
    let overload = |router: &[&str]| bench_run(&urls, router, &["--rate", &rate], 20_000);
    let rows = [
        ("c=4, limit 16, no queue", light),
        ("c=16, limit 16, no queue", full),
        ("10x offered, limit 16, no queue", overload(&limited)),
        ("10x offered, limit 16, queue 16 for 1s", overload(&queued)),
        ("10x offered, default limits (1024 + 1024)", overload(&[])),
    ];
    println!(
        "\nmachine: {} cores; offered rate for 10x: {rate}/s",
        num_cpus()
    );
    println!(
        "| load | admitted | refused (429) | failed otherwise | admitted req/s | p50 TTFT ms | \
         p99 TTFT ms | p99 ÷ c=4 p99 | p99 ÷ c=16 p99 | router peak RSS MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let (below, at) = (rows[0].1.p99_ttft_ms, rows[1].1.p99_ttft_ms);
    for (name, r) in &rows {
        println!(
            "| {name} | {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} |",
            r.completed,
            r.refused,
            r.failed - r.refused,
            r.throughput,
            r.p50_ttft_ms,
            r.p99_ttft_ms,
            r.p99_ttft_ms / below,
            r.p99_ttft_ms / at,
            r.peak_rss_mib,
        );
    }
}

/// What one `switchyard bench` run measured.
#[derive(Debug, Clone, Copy)]
struct BenchRow {
    completed: u64,
    failed: u64,
    refused: u64,
    throughput: f64,
    p50_ttft_ms: f64,
    p99_ttft_ms: f64,
    peak_rss_mib: f64,
}

/// `switchyard bench` with `load` flags and `requests` requests against a fresh router (with
/// `router` flags) in front of `urls`.
fn bench_run(urls: &[&str], router: &[&str], load: &[&str], requests: u32) -> BenchRow {
    let mut args = vec!["--policy", "round-robin"];
    args.extend_from_slice(router);
    let router = RouterProcess::serve(urls, &args);
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let pid = router.pid().to_string();
    let requests = requests.to_string();
    let status = std::process::Command::new(switchyard_tests::switchyard_bin())
        .args(["bench", "--url", &router.url, "--router-pid", &pid])
        .args([
            "--num-requests",
            &requests,
            "--input-len",
            "128",
            "--output-len",
            "32",
        ])
        .args(["--request-timeout", "60", "--json"])
        .arg(&json)
        .args(load)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("switchyard bench runs");
    assert!(status.success(), "switchyard bench failed");
    let report: Value =
        serde_json::from_slice(&std::fs::read(&json).expect("bench JSON")).expect("JSON");
    let number = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    let refused = report["error_counts"]
        .as_object()
        .expect("error_counts")
        .iter()
        .filter(|(message, _)| message.contains("HTTP 429"))
        .filter_map(|(_, count)| count.as_u64())
        .sum();
    BenchRow {
        completed: report["completed"].as_u64().expect("completed"),
        failed: report["failed"].as_u64().expect("failed"),
        refused,
        throughput: number("request_throughput"),
        p50_ttft_ms: number("p50_ttft_ms"),
        p99_ttft_ms: number("p99_ttft_ms"),
        peak_rss_mib: report["router"]["peak_rss_kib"]
            .as_f64()
            .unwrap_or(f64::NAN)
            / 1024.0,
    }
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}
