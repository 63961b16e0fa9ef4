//! Response bodies: JSON, plain, empty and metrics answers, and the body type every route
//! answers with.

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use serde::Serialize;

pub(crate) type Body = UnsyncBoxBody<Bytes, BodyError>;

/// Why a response body stopped early; hyper then aborts the connection, so the client sees a
/// cut stream (no `[DONE]`), never a short one that looks complete.
#[derive(Debug, thiserror::Error)]
#[error("the engine step loop stopped mid-generation")]
pub(crate) struct BodyError;

pub(crate) fn json(status: StatusCode, value: &impl Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(body))
        .unwrap_or_else(|_| Response::new(full("")))
}

/// An answer with no body, as vLLM and SGLang give their `/health`.
pub(crate) fn empty(status: StatusCode) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(full(""))
        .unwrap_or_else(|_| Response::new(full("")))
}

/// `/metrics`: Prometheus text in the OpenMetrics content type.
pub(crate) fn openmetrics(text: String) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
        .body(full(text))
        .unwrap_or_else(|_| Response::new(full("")))
}

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    BodyExt::boxed_unsync(Full::new(bytes.into()).map_err(|never| match never {}))
}
