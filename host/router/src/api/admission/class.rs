//! What admission reads of a request before it is parsed (its prompt is tokenized only once
//! it has a place): its priority, tenant and deadline, what it will cost, and its model.
//!
//! - Priority: the priority header (`x-priority` unless configured; an integer, higher first;
//!   anything else counts as 0), else the body's `priority` in vLLM's sense (lower first: the
//!   router negates it; the body reaches engines unchanged), else 0.
//! - Tenant: `x-tenant`, else the body's `user`, else one shared tenant.
//! - Deadline: `x-request-deadline-ms`, milliseconds from arrival by which the request must
//!   start; a value that is not a whole number is the client's mistake (400).
//! - Cost, for `least-service`: `max_tokens` (or `max_completion_tokens`, else the default)
//!   plus the body's bytes / 4, about its prompt's tokens.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use serde_json::{Map, Value};

use super::FlowControl;

/// The header naming a request's tenant.
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-tenant");
/// The header giving a request's deadline, in milliseconds from arrival.
pub const DEADLINE_HEADER: HeaderName = HeaderName::from_static("x-request-deadline-ms");

/// Bytes of body text per prompt token, roughly, for a cost known before tokenizing.
const BYTES_PER_TOKEN: u64 = 4;

/// A request as admission sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Claim {
    /// Higher is served first; negative is sheddable.
    pub priority: i32,
    /// Whose share it counts against; empty: the shared tenant.
    pub tenant: Arc<str>,
    /// How long from now it may wait to start; `None`: the queue timeout.
    pub deadline: Option<Duration>,
    /// Tokens it asks for, about: what `least-service` charges its tenant.
    pub cost: u64,
    /// The body's `model` (the caller labels metrics only with a name it serves).
    pub model: String,
}

/// `x-request-deadline-ms` is not a whole number of milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("x-request-deadline-ms must be a whole number of milliseconds, not {0:?}")]
pub struct BadDeadline(pub String);

impl Claim {
    /// The claim of a request with `headers` and a body of `body_len` bytes whose JSON object
    /// has `fields` (`None`: the body is no JSON object, and claims none of them), which
    /// arrived `elapsed` ago. With flow control off, every request has priority 0, the shared
    /// tenant and no deadline.
    pub fn read(
        flow: &FlowControl,
        headers: &HeaderMap,
        fields: Option<&Map<String, Value>>,
        body_len: usize,
        default_max_tokens: u32,
        elapsed: Duration,
    ) -> Result<Claim, BadDeadline> {
        // A field set to null counts as absent.
        let field = |name| fields?.get(name).filter(|value| !value.is_null());
        let max_tokens = field("max_tokens")
            .or_else(|| field("max_completion_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(u64::from(default_max_tokens));
        let mut claim = Claim {
            cost: max_tokens.saturating_add(body_len as u64 / BYTES_PER_TOKEN),
            model: text(field("model")).unwrap_or_default(),
            ..Claim::default()
        };
        if !flow.enabled {
            return Ok(claim);
        }
        claim.priority = match headers.get(&flow.priority_header) {
            Some(value) => value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<i64>().ok())
                .map_or(0, saturate),
            None => field("priority")
                .and_then(Value::as_i64)
                .map_or(0, |vllm| saturate(vllm.saturating_neg())),
        };
        claim.tenant = headers
            .get(&TENANT_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| text(field("user")))
            .unwrap_or_default()
            .into();
        claim.deadline = deadline(headers)?.map(|d| d.saturating_sub(elapsed));
        Ok(claim)
    }
}

fn deadline(headers: &HeaderMap) -> Result<Option<Duration>, BadDeadline> {
    let Some(value) = headers.get(&DEADLINE_HEADER) else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(value.as_bytes());
    text.trim()
        .parse::<u64>()
        .map(|ms| Some(Duration::from_millis(ms)))
        .map_err(|_| BadDeadline(text.into_owned()))
}

fn text(value: Option<&Value>) -> Option<String> {
    value.and_then(Value::as_str).map(str::to_owned)
}

fn saturate(priority: i64) -> i32 {
    i32::try_from(priority).unwrap_or(if priority < 0 { i32::MIN } else { i32::MAX })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::openai::{BodyObject, Shape};

    fn claim(headers: &[(&str, &str)], body: &str) -> Result<Claim, BadDeadline> {
        let mut map = HeaderMap::new();
        for &(name, value) in headers {
            map.insert(
                HeaderName::from_bytes(name.as_bytes()).expect("name"),
                value.parse().expect("value"),
            );
        }
        // The body read as the router reads it, once, before admission.
        let object = BodyObject::read(body.as_bytes(), Shape::Completion).ok();
        Claim::read(
            &FlowControl::default(),
            &map,
            object.as_ref().map(BodyObject::fields),
            body.len(),
            100,
            Duration::from_millis(30),
        )
    }

    #[test]
    fn a_null_field_counts_as_absent() {
        let body = r#"{"max_tokens": null, "max_completion_tokens": 7, "model": null, "user": null, "priority": null}"#;
        let claim = claim(&[], body).unwrap();
        assert_eq!(claim.cost, 7 + body.len() as u64 / 4);
        assert_eq!(claim.model, "");
        assert_eq!(&*claim.tenant, "");
        assert_eq!(claim.priority, 0);
    }

    #[test]
    fn a_field_of_the_wrong_type_reads_as_its_default() {
        for body in [
            r#"{"max_tokens": "5", "priority": 3.0, "model": 1, "user": ["bob"]}"#,
            r#"{"max_tokens": -1, "priority": 1e300, "model": {}, "user": 2}"#,
            r#"{"max_tokens": 100000000000000000000, "priority": 9223372036854775808}"#,
        ] {
            let claim = claim(&[], body).unwrap();
            assert_eq!(claim.cost, 100 + body.len() as u64 / 4, "{body}");
            assert_eq!((claim.priority, claim.model.as_str()), (0, ""), "{body}");
            assert_eq!(&*claim.tenant, "", "{body}");
        }
    }

    /// A body that is no JSON object claims nothing of itself (its parse answers 400 once
    /// admitted); the headers still say its priority and tenant.
    #[test]
    fn a_body_that_is_no_object_claims_only_its_headers() {
        let headers = [("x-priority", "4"), ("x-tenant", "acme")];
        for body in [
            "not json",
            r#"["prompt"]"#,
            r#""text""#,
            r#"{"priority": 3"#,
            "",
        ] {
            let claim = claim(&headers, body).unwrap();
            assert_eq!(claim.priority, 4, "{body}");
            assert_eq!(&*claim.tenant, "acme", "{body}");
            assert_eq!(claim.model, "", "{body}");
            assert_eq!(claim.cost, 100 + body.len() as u64 / 4, "{body}");
        }
    }

    /// A field given twice reads as its last, as the parse reads it: the claim's model is the
    /// one the request is parsed with.
    #[test]
    fn a_field_given_twice_reads_as_its_last() {
        let claim = claim(&[], r#"{"model": "a", "user": "x", "model": "b"}"#).unwrap();
        assert_eq!((claim.model.as_str(), &*claim.tenant), ("b", "x"));
    }

    /// The prompt is the one field left unread: a `model` or `user` inside it is not the
    /// request's.
    #[test]
    fn fields_inside_the_prompt_are_not_the_requests() {
        let body = r#"{"prompt": {"model": "p", "user": "u", "priority": -9}, "model": "m"}"#;
        let claim = claim(&[], body).unwrap();
        assert_eq!((claim.model.as_str(), &*claim.tenant), ("m", ""));
        assert_eq!(claim.priority, 0);
    }

    #[test]
    fn the_header_priority_wins_and_a_non_integer_counts_as_zero() {
        assert_eq!(
            claim(&[("x-priority", "7")], r#"{"priority": 3}"#)
                .unwrap()
                .priority,
            7
        );
        assert_eq!(claim(&[("x-priority", " -2 ")], "{}").unwrap().priority, -2);
        assert_eq!(
            claim(&[("x-priority", "high")], r#"{"priority": -9}"#)
                .unwrap()
                .priority,
            0
        );
        assert_eq!(
            claim(&[("x-priority", "99999999999")], "{}")
                .unwrap()
                .priority,
            i32::MAX
        );
    }

    #[test]
    fn the_body_priority_is_vllms_negated() {
        assert_eq!(claim(&[], r#"{"priority": 3}"#).unwrap().priority, -3);
        assert_eq!(claim(&[], r#"{"priority": -5}"#).unwrap().priority, 5);
        assert_eq!(claim(&[], r#"{"priority": "urgent"}"#).unwrap().priority, 0);
        assert_eq!(claim(&[], "not json").unwrap().priority, 0);
    }

    #[test]
    fn the_tenant_is_the_header_else_the_user_else_shared() {
        let user = r#"{"user": "bob"}"#;
        assert_eq!(
            &*claim(&[("x-tenant", "acme")], user).unwrap().tenant,
            "acme"
        );
        assert_eq!(&*claim(&[], user).unwrap().tenant, "bob");
        assert_eq!(&*claim(&[], "{}").unwrap().tenant, "");
    }

    #[test]
    fn the_deadline_counts_from_arrival_and_must_be_whole_milliseconds() {
        let due = |v| claim(&[("x-request-deadline-ms", v)], "{}");
        assert_eq!(
            due("500").unwrap().deadline,
            Some(Duration::from_millis(470))
        );
        assert_eq!(
            due("10").unwrap().deadline,
            Some(Duration::ZERO),
            "already past"
        );
        assert_eq!(claim(&[], "{}").unwrap().deadline, None);
        assert_eq!(due("1.5"), Err(BadDeadline("1.5".into())));
        assert_eq!(due("-3"), Err(BadDeadline("-3".into())));
    }

    #[test]
    fn the_cost_is_the_tokens_asked_for_plus_the_prompts_about() {
        let body = r#"{"prompt": "0123456789abcdefghij", "max_tokens": 50}"#;
        assert_eq!(claim(&[], body).unwrap().cost, 50 + body.len() as u64 / 4);
        assert_eq!(
            claim(&[], "{}").unwrap().cost,
            100,
            "the default max_tokens"
        );
        assert_eq!(claim(&[], r#"{"model": "m"}"#).unwrap().model, "m");
    }

    #[test]
    fn flow_control_off_reads_no_priority_tenant_or_deadline() {
        let flow = FlowControl {
            enabled: false,
            ..FlowControl::default()
        };
        let mut headers = HeaderMap::new();
        headers.insert("x-priority", "5".parse().unwrap());
        headers.insert("x-tenant", "acme".parse().unwrap());
        headers.insert("x-request-deadline-ms", "oops".parse().unwrap());
        let fields = Map::new();
        let claim = Claim::read(&flow, &headers, Some(&fields), 2, 1, Duration::ZERO).unwrap();
        assert_eq!(
            (claim.priority, &*claim.tenant, claim.deadline),
            (0, "", None)
        );
    }
}
