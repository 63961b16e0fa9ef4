//! One HTTP/1.1 connection per closed-loop client (`--connection-per-client`), as wrk keeps.
//!
//! hyper-util's pool (under reqwest) hands a streamed response's connection back from a task of
//! its own once the body is read, so a client that sends its next request at once finds none
//! idle and opens another (hyperium/hyper#4134): N clients then hold up to 2N connections to the
//! server. A [`Connection`] is owned by one client and used for one request at a time, so the
//! server holds exactly N; it opens a new one only when the server closed the last.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST};
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::client::{self, RequestError};
use super::stats::Timing;
use switchyard_wire::error_chain;

/// Where a client's connection goes: the completions URL, split once.
#[derive(Debug, Clone)]
pub struct Target {
    /// `HOST:PORT` to connect to.
    address: String,
    /// The `Host` header.
    authority: String,
    path: String,
    connect_timeout: Duration,
}

impl Target {
    /// `url` is an `http://` URL (validated by the config); `None` for any other.
    pub fn of(url: &str, connect_timeout: Duration) -> Option<Self> {
        let uri: Uri = url.parse().ok()?;
        if uri.scheme_str() != Some("http") {
            return None;
        }
        let authority = uri.authority()?;
        let address = format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(80)
        );
        Some(Self {
            address,
            authority: authority.to_string(),
            path: uri.path_and_query()?.to_string(),
            connect_timeout,
        })
    }
}

/// One client's connection, opened at its first request.
#[derive(Debug)]
pub struct Connection {
    target: Target,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Connection {
    pub fn new(target: Target) -> Self {
        Self {
            target,
            sender: None,
        }
    }

    /// POSTs `body` on this client's connection and times the answer from `start`.
    pub async fn post_completion(
        &mut self,
        call: &'static str,
        body: &serde_json::Value,
        start: Instant,
        stream: bool,
    ) -> Result<Timing, RequestError> {
        let request = Request::post(&self.target.path)
            .header(HOST, &self.target.authority)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| RequestError::Protocol {
                call,
                reason: e.to_string(),
            })?;
        let mut sender = self.ready(call).await?;
        let answer = sender.send_request(request);
        self.sender = Some(sender);
        let response = answer.await.map_err(|e| RequestError::Connect {
            call,
            reason: error_chain(&e),
        })?;
        let (head, body) = response.into_parts();
        if !head.status.is_success() {
            let text = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return Err(RequestError::Status {
                call,
                status: head.status.as_u16(),
                body: client::excerpt(&String::from_utf8_lossy(&text)),
            });
        }
        if stream {
            client::time_stream(call, body.into_data_stream(), start).await
        } else {
            let bytes = body.collect().await.map_err(|e| RequestError::Protocol {
                call,
                reason: error_chain(&e),
            })?;
            client::time_whole(call, &bytes.to_bytes(), start)
        }
    }

    /// The open connection once its last response is done, or a new one if the server closed
    /// it (or the last body was dropped unread, which closes it).
    async fn ready(
        &mut self,
        call: &'static str,
    ) -> Result<SendRequest<Full<Bytes>>, RequestError> {
        if let Some(mut sender) = self.sender.take()
            && sender.ready().await.is_ok()
        {
            return Ok(sender);
        }
        self.open(call).await
    }

    async fn open(&self, call: &'static str) -> Result<SendRequest<Full<Bytes>>, RequestError> {
        let connect_failed = |reason: String| RequestError::Connect { call, reason };
        let tcp = tokio::time::timeout(
            self.target.connect_timeout,
            TcpStream::connect(&self.target.address),
        )
        .await
        .map_err(|_| connect_failed("connect timed out".into()))?
        .map_err(|e| connect_failed(e.to_string()))?;
        tcp.set_nodelay(true)
            .map_err(|e| connect_failed(e.to_string()))?;
        let (sender, connection) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| connect_failed(error_chain(&e)))?;
        // The connection's I/O runs beside the client; it ends when the sender is dropped or
        // the server closes, and the next `ready` sees which.
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a client connection ended");
            }
        });
        Ok(sender)
    }
}
