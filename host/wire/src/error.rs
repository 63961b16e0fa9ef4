//! OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: what the router and
//! the reference engine answer with when a request fails.

use serde::Serialize;

/// `type` of an error the client caused.
pub const INVALID_REQUEST_ERROR: &str = "invalid_request_error";
/// `type` of an error on the server's side.
pub const SERVER_ERROR: &str = "server_error";

/// OpenAI's error body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The `error` object of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    /// [`INVALID_REQUEST_ERROR`] or [`SERVER_ERROR`].
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
    /// A stable, machine-readable name for the error.
    pub code: Option<&'static str>,
}

impl ErrorBody {
    pub fn new(
        message: String,
        kind: &'static str,
        param: Option<&'static str>,
        code: Option<&'static str>,
    ) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message,
                kind,
                param,
                code,
            },
        }
    }
}
