//! The one place where errors become OpenAI error bodies and HTTP status codes:
//! `{"error": {"message", "type", "param", "code"}}`, as a response or as a terminal SSE event.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use serde::Serialize;
use switchyard_contract::TranslateError;
use switchyard_wire::error::{ErrorBody, INVALID_REQUEST_ERROR, SERVER_ERROR};
use switchyard_wire::sse;

use super::admission::Refusal;
use super::{Body, full};
use crate::RouteError;
use crate::cluster::EndpointError;
use crate::plan::Origin;

/// Everything a client request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON at all.
    #[error("the request body is not valid JSON: {0}")]
    MalformedJson(String),
    /// A field has the wrong type or an invalid value.
    #[error("{message}")]
    InvalidField {
        param: &'static str,
        message: String,
    },
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("cannot read the request body: {0}")]
    BodyRead(String),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(Duration),
    /// Admission control refused the request; the client may try again after `retry_after`.
    #[error("{refusal}; try again in {}s", retry_after.as_secs())]
    Overloaded {
        refusal: Refusal,
        retry_after: Duration,
    },
    #[error("the router is draining: it is shutting down")]
    Draining,
    #[error("the router is shutting down and its grace period is over")]
    ShuttingDown,
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("this route needs `Authorization: Bearer <admin token>`")]
    Unauthorized,
    #[error("without --admin-token, /admin/* answers only on loopback")]
    AdminNotLocal,
    #[error("the router is not ready: {0}")]
    NotReady(&'static str),
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("no healthy endpoint serves the model `{0}` now")]
    ModelUnavailable(String),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Route(#[from] RouteError),
}

impl ApiError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError::InvalidField {
            param,
            message: message.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::MalformedJson(_) | ApiError::InvalidField { .. } | ApiError::BodyRead(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            // The client's own deadline passed: the wait, not the capacity, is the answer.
            ApiError::Overloaded {
                refusal: Refusal::DeadlineExpired { .. },
                ..
            } => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Draining | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::AdminNotLocal => StatusCode::FORBIDDEN,
            ApiError::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Tokenize(_) => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::ModelUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Endpoint(EndpointError::Unknown(_)) => StatusCode::NOT_FOUND,
            ApiError::Endpoint(EndpointError::Invalid { .. }) => StatusCode::BAD_REQUEST,
            ApiError::Endpoint(_) => StatusCode::CONFLICT,
            ApiError::Route(e) => route_status(e),
        }
    }

    /// OpenAI's `type`: the client's fault or ours.
    fn kind(&self) -> &'static str {
        match self {
            // A 429 for being at capacity is about the server, not the request (OpenAI's own
            // "the engine is currently overloaded" is a 429 `server_error` too).
            ApiError::Overloaded { .. } => SERVER_ERROR,
            _ if self.status().is_client_error() => INVALID_REQUEST_ERROR,
            _ => SERVER_ERROR,
        }
    }

    fn param(&self) -> Option<&'static str> {
        match self {
            ApiError::InvalidField { param, .. } => Some(param),
            ApiError::ModelNotFound(_) | ApiError::ModelUnavailable(_) => Some("model"),
            _ => None,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ApiError::MalformedJson(_) => "invalid_json",
            ApiError::InvalidField { .. } => "invalid_value",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::BodyRead(_) => "invalid_body",
            ApiError::BodyTimeout(_) => "body_read_timeout",
            ApiError::Overloaded {
                refusal: Refusal::DeadlineExpired { .. },
                ..
            } => "deadline_exceeded",
            ApiError::Overloaded { .. } => "overloaded",
            ApiError::Draining => "draining",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::NotFound { .. } => "not_found",
            ApiError::Unauthorized => "unauthorized",
            ApiError::AdminNotLocal => "forbidden",
            ApiError::NotReady(_) => "not_ready",
            ApiError::Tokenize(_) => "invalid_prompt",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::ModelUnavailable(_) => "model_not_available",
            ApiError::Endpoint(_) => "endpoint_change_refused",
            ApiError::Route(RouteError::Policy(TranslateError::Unavailable { .. })) => {
                "no_endpoint_available"
            }
            ApiError::Route(RouteError::Policy(TranslateError::Rejected { .. })) => {
                "rejected_by_policy"
            }
            ApiError::Route(RouteError::Policy(_)) => "policy_error",
            ApiError::Route(RouteError::InvalidPlan(_)) => "invalid_plan",
            ApiError::Route(
                RouteError::Exhausted { .. } | RouteError::Preempted { .. } | RouteError::Engine(_),
            ) => "upstream_error",
            ApiError::Route(RouteError::RetryBudget { .. }) => "retry_budget_exhausted",
            ApiError::Route(RouteError::Deadline(_)) => "request_timeout",
            ApiError::Route(RouteError::Tokenize(_)) => "internal_error",
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(
            self.to_string(),
            self.kind(),
            self.param(),
            Some(self.code()),
        )
    }

    /// The error as a response.
    pub fn response(&self) -> Response<Body> {
        let mut response = json_response(self.status(), &self.body());
        if let ApiError::Overloaded { retry_after, .. } = self
            && self.status() == StatusCode::TOO_MANY_REQUESTS
        {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(retry_after.as_secs()),
            );
        }
        response
    }

    /// The error as the terminal event of an SSE stream (followed by `[DONE]`).
    pub fn sse_event(&self) -> Bytes {
        sse::event(&self.body())
    }
}

fn route_status(error: &RouteError) -> StatusCode {
    match error {
        RouteError::Policy(TranslateError::Unavailable { .. }) => StatusCode::SERVICE_UNAVAILABLE,
        RouteError::Policy(TranslateError::Rejected { .. }) => StatusCode::BAD_REQUEST,
        RouteError::Policy(_) | RouteError::InvalidPlan(_) | RouteError::Tokenize(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
        RouteError::Exhausted { last, .. } if last.timed_out() => StatusCode::GATEWAY_TIMEOUT,
        RouteError::Exhausted { .. } | RouteError::Preempted { .. } => StatusCode::BAD_GATEWAY,
        // Retrying now would add load where engines are already failing: come back later.
        RouteError::RetryBudget { .. } => StatusCode::SERVICE_UNAVAILABLE,
        RouteError::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
        // The engine refused the request itself (e.g. a prompt longer than its context).
        RouteError::Engine(e) if e.origin() == Origin::Downstream => StatusCode::BAD_REQUEST,
        RouteError::Engine(_) => StatusCode::BAD_GATEWAY,
    }
}

/// A JSON response.
pub fn json_response(status: StatusCode, value: &impl Serialize) -> Response<Body> {
    // Room for a whole answer or error at once: `to_vec`'s 128 bytes grew twice for most.
    let mut body = Vec::with_capacity(512);
    // Plain data structs and JSON values always serialise.
    serde_json::to_writer(&mut body, value).expect("a response body serialises");
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn error_bodies_have_the_openai_shape() {
        let e = ApiError::invalid("max_tokens", "max_tokens must be at least 1");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            serde_json::to_value(e.body()).expect("serializes"),
            json!({"error": {"message": "max_tokens must be at least 1",
                "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}})
        );
        let e = ApiError::BodyTooLarge { limit: 10 };
        assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(e.body().error.param, None);
        let e = ApiError::Overloaded {
            refusal: Refusal::QueueTimeout {
                waited: Duration::from_secs(5),
            },
            retry_after: Duration::from_secs(5),
        };
        let response = e.response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "5");
        assert_eq!(
            serde_json::to_value(e.body()).expect("serializes"),
            json!({"error": {"message": "the router is at capacity: no place freed up within 5s; try again in 5s",
                "type": "server_error", "param": null, "code": "overloaded"}})
        );
        let e = ApiError::NotReady("engines starting");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.body().error.kind, "server_error");
        assert!(e.sse_event().starts_with(b"data: {\"error\""));
    }
}
