//! A client request's body, whichever server read its connection: the router's own HTTP/1.1
//! server ([`connection::http1`]) or hyper-util's automatic one (HTTP/2, and the connections
//! whose first bytes did not say). Handlers read it as any `http_body::Body`.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::connection;

#[derive(Debug)]
pub enum Incoming {
    Http1(connection::http1::Body),
    Hyper(hyper::body::Incoming),
}

/// Why a request's body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum IncomingError {
    #[error(transparent)]
    Http1(#[from] connection::http1::BodyError),
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
}

impl Body for Incoming {
    type Data = Bytes;
    type Error = IncomingError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, IncomingError>>> {
        match self.get_mut() {
            Incoming::Http1(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map_err(Into::into))),
            Incoming::Hyper(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Incoming::Http1(body) => body.is_end_stream(),
            Incoming::Hyper(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Incoming::Http1(body) => body.size_hint(),
            Incoming::Hyper(body) => body.size_hint(),
        }
    }
}
