//! A response body that holds a guard until hyper drops the body: after its last frame is
//! written, or when the client goes away mid-response. Admission permits and connection
//! activity ride on it, so they last exactly as long as the response (a stream included).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};

use super::Body;

/// `response`, with `guard` dropped when its body is.
pub fn hold<G: Send + Unpin + 'static>(response: Response<Body>, guard: G) -> Response<Body> {
    response.map(|body| {
        Guarded {
            body,
            _guard: guard,
        }
        .boxed_unsync()
    })
}

struct Guarded<G> {
    body: Body,
    _guard: G,
}

impl<G: Unpin> hyper::body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    // Both delegate, so a whole body keeps its Content-Length and hyper drops it (and the
    // guard) as soon as its last frame is out.
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hyper::body::Body as _;

    use super::*;
    use crate::api::full;

    #[tokio::test]
    async fn the_guard_lives_as_long_as_the_body_and_the_length_is_kept() {
        let guard = Arc::new(());
        let response = hold(Response::new(full("four")), Arc::clone(&guard));
        assert_eq!(Arc::strong_count(&guard), 2);
        assert_eq!(response.body().size_hint().exact(), Some(4));
        let body = response.into_body().collect().await.expect("infallible");
        assert_eq!(body.to_bytes(), "four");
        assert_eq!(Arc::strong_count(&guard), 1, "dropped with the body");
    }
}
