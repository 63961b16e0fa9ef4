//! Why a request failed, and the one place where that becomes an HTTP answer: an OpenAI
//! error body with the status, type and param the cause calls for.

use http::{Response, StatusCode};
use switchyard_kv::KvError;
use switchyard_wire::error::{ErrorBody, INVALID_REQUEST_ERROR, SERVER_ERROR};

use super::respond::{Body, json};
use crate::metrics::Metrics;
use crate::scheduler::CoreError;

/// Why a request failed; [`HttpError::into_response`] is the only place these become HTTP.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    #[error("{message}")]
    Invalid {
        message: String,
        param: Option<&'static str>,
    },
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("KV transfer to device rank {rank} failed: {source}")]
    Transfer { rank: u32, source: KvError },
    #[error("the engine is shutting down")]
    CoreGone,
    #[error("injected failure (--fail-rate)")]
    Injected,
    #[error("no route for {path}")]
    NotFound { path: String },
    #[error("method not allowed")]
    MethodNotAllowed,
    /// Any other answer with its own status (the vLLM and SGLang handoffs' failures).
    #[error("{message}")]
    Status {
        status: StatusCode,
        message: String,
        param: Option<&'static str>,
    },
}

impl HttpError {
    pub(crate) fn status(status: StatusCode, message: impl Into<String>) -> HttpError {
        HttpError::Status {
            status,
            message: message.into(),
            param: None,
        }
    }

    pub(crate) fn parts(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        const CLIENT: &str = INVALID_REQUEST_ERROR;
        const SERVER: &str = SERVER_ERROR;
        match self {
            HttpError::Invalid { param, .. } => (StatusCode::BAD_REQUEST, CLIENT, *param),
            HttpError::Core(e) => core_fault(e),
            HttpError::Transfer { source, .. } => transfer_fault(source),
            HttpError::CoreGone => (StatusCode::SERVICE_UNAVAILABLE, SERVER, None),
            HttpError::Injected => (StatusCode::INTERNAL_SERVER_ERROR, SERVER, None),
            HttpError::NotFound { .. } => (StatusCode::NOT_FOUND, CLIENT, None),
            HttpError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, CLIENT, None),
            HttpError::Status { status, param, .. } => {
                let kind = if status.is_client_error() {
                    CLIENT
                } else {
                    SERVER
                };
                (*status, kind, *param)
            }
        }
    }
}

/// A 400 about `param`.
pub(crate) fn invalid(param: &'static str, message: impl Into<String>) -> HttpError {
    HttpError::Invalid {
        message: message.into(),
        param: Some(param),
    }
}

impl HttpError {
    pub(crate) fn into_response(self) -> Response<Body> {
        let (status, kind, param) = self.parts();
        // Debug, not warn: under a failing peer every request would log; the caller gets the
        // whole message in the body.
        if status.is_server_error() {
            tracing::debug!(error = %self, "request failed");
        }
        json(status, &ErrorBody::new(self.to_string(), kind, param, None))
    }
}

/// Status, type and param of a refused core command. The spec sets no codes (an MLC engine
/// crashes on these); a request id already in use, or a reservation still being written, is a
/// conflict with the engine's state rather than a malformed request.
fn core_fault(e: &CoreError) -> (StatusCode, &'static str, Option<&'static str>) {
    match e {
        CoreError::DuplicateUser { .. } | CoreError::TransferInProgress { .. } => {
            (StatusCode::CONFLICT, INVALID_REQUEST_ERROR, Some("user"))
        }
        CoreError::NoReservation { .. } => {
            (StatusCode::BAD_REQUEST, INVALID_REQUEST_ERROR, Some("user"))
        }
        CoreError::BeginPastWindow { .. } | CoreError::BeginBeforeMatched { .. } => (
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST_ERROR,
            Some("begin"),
        ),
    }
}

/// Status, type and param of a failed KV push. Only what the destination says about
/// `kv_addr_info` is the caller's fault; an unknown `recv_rank` is this engine's `--kv-peer`
/// configuration, and a bad source slot is a bug here.
fn transfer_fault(e: &KvError) -> (StatusCode, &'static str, Option<&'static str>) {
    match e {
        KvError::SlotOutOfRange {
            side: "destination",
            ..
        }
        | KvError::LengthMismatch { .. }
        | KvError::ModelCount { .. }
        | KvError::Metadata { .. }
        | KvError::Rejected { .. } => (
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST_ERROR,
            Some("kv_addr_info"),
        ),
        KvError::UnknownRank { .. } => (
            StatusCode::INTERNAL_SERVER_ERROR,
            SERVER_ERROR,
            Some("recv_rank"),
        ),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR, None),
    }
}

/// A 400 for a request that broke the protocol's contract, counted.
pub(crate) fn violation(
    metrics: &Metrics,
    param: &'static str,
    message: impl Into<String>,
) -> HttpError {
    metrics.pd.protocol_violations.inc();
    let message = message.into();
    tracing::debug!(%message, "protocol violation");
    HttpError::Status {
        status: StatusCode::BAD_REQUEST,
        message,
        param: Some(param),
    }
}
