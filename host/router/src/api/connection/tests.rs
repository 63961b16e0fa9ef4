use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

use super::*;

fn limits() -> ConnectionLimits {
    ConnectionLimits {
        header_read_timeout: Duration::from_secs(2),
        keep_alive_timeout: Duration::from_secs(60),
        ..ConnectionLimits::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_connection_with_no_request_closes_after_the_keep_alive_timeout() {
    let activity = Activity::new();
    let started = Instant::now();
    assert_eq!(activity.expired(&limits()).await, Expired::Idle);
    assert_eq!(started.elapsed(), Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn a_header_still_incomplete_at_the_deadline_closes_the_connection() {
    let activity = Activity::new();
    let (mut client, server) = tokio::io::duplex(64);
    let mut server = Watched::new(server, Arc::clone(&activity));
    tokio::time::sleep(Duration::from_secs(30)).await;
    client.write_all(b"P").await.expect("write");
    let mut byte = [0u8; 1];
    server.read_exact(&mut byte).await.expect("read");
    let first_byte = Instant::now();
    assert_eq!(activity.expired(&limits()).await, Expired::Header);
    assert_eq!(first_byte.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_header_begun_while_the_watchdog_sleeps_still_closes_at_its_deadline() {
    let activity = Activity::new();
    let watchdog = {
        let activity = Arc::clone(&activity);
        tokio::spawn(async move { activity.expired(&limits()).await })
    };
    let (mut client, server) = tokio::io::duplex(64);
    let mut server = Watched::new(server, Arc::clone(&activity));
    tokio::time::sleep(Duration::from_millis(30_500)).await;
    client.write_all(b"P").await.expect("write");
    let mut byte = [0u8; 1];
    server.read_exact(&mut byte).await.expect("read");
    let first_byte = Instant::now();
    assert_eq!(watchdog.await.expect("no panic"), Expired::Header);
    assert_eq!(first_byte.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_request_in_progress_never_expires_and_idleness_counts_from_its_end() {
    let activity = Activity::new();
    let (mut client, server) = tokio::io::duplex(64);
    let mut server = Watched::new(server, Arc::clone(&activity));
    client.write_all(b"GET").await.expect("write");
    let mut head = [0u8; 3];
    server.read_exact(&mut head).await.expect("read");
    let request = activity.request_started();
    let second = activity.request_started();
    let watchdog = {
        let activity = Arc::clone(&activity);
        tokio::spawn(async move { activity.expired(&limits()).await })
    };
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(!watchdog.is_finished(), "a busy connection stays open");
    drop(request);
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(
        !watchdog.is_finished(),
        "one of its two requests is still running"
    );
    // Bytes read while busy (the next pipelined request, a client's body) start nothing.
    client.write_all(b"x").await.expect("write");
    server.read_exact(&mut head[..1]).await.expect("read");
    drop(second);
    let ended = Instant::now();
    assert_eq!(watchdog.await.expect("no panic"), Expired::Idle);
    assert_eq!(ended.elapsed(), Duration::from_secs(60));
}

#[test]
fn accept_pauses_double_up_to_a_bound_and_reset_on_success() {
    let mut backoff = AcceptBackoff::default();
    let emfile = io::Error::from_raw_os_error(24);
    let pauses: Vec<_> = (0..10).filter_map(|_| backoff.failed(&emfile)).collect();
    assert_eq!(pauses[0], Duration::from_millis(5));
    assert_eq!(pauses[1], Duration::from_millis(10));
    assert_eq!(pauses[9], Duration::from_secs(1), "{pauses:?}");
    assert!(pauses.windows(2).all(|w| w[0] <= w[1]));
    let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
    assert_eq!(backoff.failed(&aborted), None, "one failed connection");
    backoff.accepted();
    assert_eq!(backoff.failed(&emfile), Some(Duration::from_millis(5)));
}

/// A connected pair on loopback: the client's end and the accepted one.
async fn pair() -> (TcpStream, TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = listener.accept().await.unwrap();
    (client, accepted)
}

/// HTTP/1 only when the first bytes cannot be HTTP/2's preface; the preface, its start, and a
/// connection closed before any byte are left to the automatic server; and nothing is taken:
/// the server reads every byte the client sent.
#[tokio::test]
async fn a_connection_is_http1_when_its_first_bytes_are_no_http2_preface_and_keeps_them() {
    let cases: [(&[u8], bool); 5] = [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", true),
        (b"GET /health HTTP/1.1\r\n", true),
        (b"P", false),
        (b"PRI * HTTP/2.0\r\n", false),
        (H2_PREFACE, false),
    ];
    for (first, http1) in cases {
        let (mut client, accepted) = pair().await;
        client.write_all(first).await.unwrap();
        assert_eq!(
            starts_http1(&accepted).await,
            http1,
            "{:?}",
            String::from_utf8_lossy(first)
        );
        drop(client);
        let mut read = Vec::new();
        let mut accepted = accepted;
        accepted.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, first);
    }
    let (client, accepted) = pair().await;
    drop(client);
    assert!(!starts_http1(&accepted).await, "closed before a byte");
}
