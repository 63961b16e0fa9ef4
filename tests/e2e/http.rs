//! HTTP helpers every end-to-end test uses against engines and routers alike.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use serde_json::Value;

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("reqwest client")
}

/// POST `body` as JSON: the status and the body text.
pub(crate) async fn post(url: &str, body: &Value) -> (u16, String) {
    let response = client()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: server unreachable: {e}"));
    let status = response.status().as_u16();
    (status, response.text().await.expect("body"))
}

/// POST `body` as JSON, expecting 200 and a JSON answer.
pub(crate) async fn post_json(url: &str, body: &Value) -> Value {
    let (status, text) = post(url, body).await;
    assert_eq!(status, 200, "POST {url} {body} -> {text}");
    serde_json::from_str(&text).expect("JSON body")
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
pub(crate) fn sse_payloads(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {event:?}"))
                .to_owned()
        })
        .collect()
}

/// A request's body read whole as JSON (`null` when it is empty or not JSON): what a mock
/// engine records of a leg.
pub(crate) async fn json_body(req: hyper::Request<hyper::body::Incoming>) -> Value {
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// Serve `answer` on a fresh loopback port, a task per connection, for as long as the test
/// runs: a mock engine's base URL.
pub(crate) async fn serve_loopback<F, Fut>(answer: F) -> String
where
    F: Fn(hyper::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Full<Bytes>>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let answered = answer(req);
                    async move { Ok::<_, Infallible>(answered.await) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}
