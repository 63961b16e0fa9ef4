//! The Endpoint Picker protocol's names, and the ext_proc messages that carry them: read from
//! what Envoy sends (headers, the subset hint, the served endpoint), written into what the EPP
//! answers (the destination as a header and as dynamic metadata, streamed body chunks, an
//! immediate response).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

/// The header (and the `envoy.lb` metadata key) naming the endpoint a request goes to.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the destination, as the protocol's reference wiring reads it.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The request metadata namespace and key of the endpoints a pick is restricted to.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The `envoy.lb` key of the endpoint that served the request, on the response.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The header naming the prefill endpoint of a disaggregated plan, for the decode endpoint's
/// sidecar (llm-d's routing sidecar reads it).
pub const PREFILLER: &str = "x-prefiller-host-port";

/// A request's head as Envoy sends it: its pseudo-headers apart (`http` has no names with a
/// colon), the rest as an [`http::HeaderMap`].
#[derive(Debug, Default)]
pub struct Head {
    pub method: String,
    pub path: String,
    pub headers: http::HeaderMap,
}

/// A request's headers. Headers that are not valid HTTP are skipped.
pub fn head(map: Option<&HeaderMap>) -> Head {
    let mut head = Head::default();
    for h in headers(map) {
        let raw = raw(h);
        match h.key.as_str() {
            ":method" => head.method = String::from_utf8_lossy(raw).into_owned(),
            // The path without its query: routes match on it.
            ":path" => {
                let path = String::from_utf8_lossy(raw);
                head.path = path.split('?').next().unwrap_or_default().to_owned();
            }
            _ => {
                if let (Ok(name), Ok(value)) = (
                    http::HeaderName::from_bytes(h.key.as_bytes()),
                    http::HeaderValue::from_bytes(raw),
                ) {
                    head.headers.append(name, value);
                }
            }
        }
    }
    head
}

/// A response's `:status`; its other headers are not read (the gateway passes them on).
pub fn status(map: Option<&HeaderMap>) -> Option<u16> {
    let h = headers(map).iter().find(|h| h.key == ":status")?;
    std::str::from_utf8(raw(h)).ok()?.parse().ok()
}

fn headers(map: Option<&HeaderMap>) -> &[HeaderValue] {
    map.map_or(&[][..], |m| &m.headers)
}

/// A header's value: Envoy sends it in `raw_value`, older Envoys in `value`.
fn raw(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The endpoints (`ip:port`) the request's metadata restricts the pick to: `None` without a
/// hint; a list of strings, or one comma-separated string.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let value = field(metadata, SUBSET_NAMESPACE, SUBSET)?;
    Some(match &value.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    })
}

/// The endpoint the gateway says served the response (`envoy.lb` →
/// `x-gateway-destination-endpoint-served`), when it says.
pub fn served(metadata: Option<&Metadata>) -> Option<String> {
    match &field(metadata, DESTINATION_NAMESPACE, SERVED)?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn field<'a>(metadata: Option<&'a Metadata>, namespace: &str, key: &str) -> Option<&'a Value> {
    metadata?.filter_metadata.get(namespace)?.fields.get(key)
}

/// Where a request goes: the answer to its headers (or to its last body chunk, which Envoy
/// holds the headers for) with the destination set twice, as the protocol asks: the header,
/// and `envoy.lb` dynamic metadata; with fallbacks, the endpoints' ordered comma list.
/// `prefiller` is the prefill endpoint of a handoff.
pub fn destination(destinations: &[String], prefiller: Option<&str>) -> ProcessingResponse {
    let destination = destinations.join(",");
    let destination = destination.as_str();
    let mut set_headers = vec![set_header(DESTINATION, destination)];
    set_headers.extend(prefiller.map(|p| set_header(PREFILLER, p)));
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers: Vec::new(),
        }),
        // The destination header picks the upstream host; routes matched on it must see it.
        clear_route_cache: true,
        ..CommonResponse::default()
    };
    let endpoint = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), string(destination))]),
    };
    let metadata = Struct {
        fields: HashMap::from([(
            DESTINATION_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(endpoint)),
            },
        )]),
    };
    ProcessingResponse {
        dynamic_metadata: Some(metadata),
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })),
        ..ProcessingResponse::default()
    }
}

/// Headers passed on unchanged: the answer to the response's headers, or to a request's headers
/// when nothing is to be set.
pub fn continue_headers(request: bool) -> ProcessingResponse {
    let headers = HeadersResponse::default();
    respond(if request {
        Response::RequestHeaders(headers)
    } else {
        Response::ResponseHeaders(headers)
    })
}

/// One body chunk passed on as it came (`FULL_DUPLEX_STREAMED`: every chunk crosses the stream
/// and is sent back, the last with `end_of_stream`).
pub fn body_chunk(request: bool, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let streamed = StreamedBodyResponse {
        body,
        end_of_stream,
        ..StreamedBodyResponse::default()
    };
    let chunk = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(streamed)),
            }),
            ..CommonResponse::default()
        }),
    };
    respond(if request {
        Response::RequestBody(chunk)
    } else {
        Response::ResponseBody(chunk)
    })
}

/// Trailers passed on unchanged.
pub fn continue_trailers(request: bool) -> ProcessingResponse {
    let trailers = TrailersResponse::default();
    respond(if request {
        Response::RequestTrailers(trailers)
    } else {
        Response::ResponseTrailers(trailers)
    })
}

/// The gateway answers the client itself: `status`, `headers` (e.g. `content-type`,
/// `retry-after`) and `body`, the request going nowhere.
pub fn immediate(
    status: http::StatusCode,
    headers: &http::HeaderMap,
    body: Vec<u8>,
    details: &str,
) -> ProcessingResponse {
    let set_headers = headers
        .iter()
        .map(|(name, value)| HeaderValueOption {
            header: Some(HeaderValue {
                key: name.as_str().to_owned(),
                raw_value: value.as_bytes().to_vec(),
                ..HeaderValue::default()
            }),
            ..HeaderValueOption::default()
        })
        .collect();
    respond(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status.as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers,
            remove_headers: Vec::new(),
        }),
        body,
        // Envoy logs it as the response's code details, which allow no spaces.
        details: details.replace(' ', "_"),
        ..ImmediateResponse::default()
    }))
}

fn respond(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::protobuf::ListValue;

    use super::*;

    fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                namespace.to_owned(),
                Struct {
                    fields: HashMap::from([(key.to_owned(), value)]),
                },
            )]),
            ..Metadata::default()
        }
    }

    #[test]
    fn the_subset_hint_is_a_list_or_a_comma_string_and_absent_without_its_key() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string(" 10.0.0.2:8000")],
            })),
        };
        let hinted = metadata(SUBSET_NAMESPACE, SUBSET, list);
        assert_eq!(
            subset_hint(Some(&hinted)),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
        );
        let comma = metadata(
            SUBSET_NAMESPACE,
            SUBSET,
            string("10.0.0.1:8000, 10.0.0.3:80"),
        );
        assert_eq!(
            subset_hint(Some(&comma)).map(|s| s.len()),
            Some(2),
            "a comma list"
        );
        let empty = metadata(SUBSET_NAMESPACE, SUBSET, string(""));
        assert_eq!(
            subset_hint(Some(&empty)),
            Some(Vec::new()),
            "empty: no endpoint"
        );
        let elsewhere = metadata(DESTINATION_NAMESPACE, SUBSET, string("10.0.0.1:8000"));
        assert_eq!(subset_hint(Some(&elsewhere)), None);
        assert_eq!(subset_hint(None), None);
    }

    #[test]
    fn the_served_endpoint_is_read_from_envoy_lb() {
        let served_by = metadata(DESTINATION_NAMESPACE, SERVED, string("10.0.0.2:8000"));
        assert_eq!(served(Some(&served_by)).as_deref(), Some("10.0.0.2:8000"));
        let other_key = metadata(DESTINATION_NAMESPACE, DESTINATION, string("10.0.0.2:8000"));
        assert_eq!(served(Some(&other_key)), None);
        assert_eq!(served(None), None);
    }

    /// The destination `answer` sets in its `envoy.lb` dynamic metadata.
    fn lb_destination(answer: &ProcessingResponse) -> Option<&Value> {
        let lb = answer
            .dynamic_metadata
            .as_ref()
            .and_then(|m| m.fields.get(DESTINATION_NAMESPACE));
        let Some(Value {
            kind: Some(Kind::StructValue(lb)),
        }) = lb
        else {
            panic!("envoy.lb metadata: {answer:?}");
        };
        lb.fields.get(DESTINATION)
    }

    #[test]
    fn the_destination_is_a_header_and_the_same_envoy_lb_metadata() {
        let answer = destination(&["10.0.0.2:8000".to_owned()], Some("10.0.0.1:8000"));
        let Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })) = &answer.response
        else {
            panic!("a request headers response: {answer:?}");
        };
        let set: Vec<(&str, &[u8])> = common
            .header_mutation
            .as_ref()
            .map(|m| &m.set_headers[..])
            .unwrap_or_default()
            .iter()
            .filter_map(|o| o.header.as_ref())
            .map(|h| (h.key.as_str(), &h.raw_value[..]))
            .collect();
        assert_eq!(
            set,
            [
                (DESTINATION, &b"10.0.0.2:8000"[..]),
                (PREFILLER, &b"10.0.0.1:8000"[..])
            ]
        );
        assert_eq!(lb_destination(&answer), Some(&string("10.0.0.2:8000")));
    }

    #[test]
    fn fallbacks_make_the_destination_an_ordered_comma_list() {
        let list = ["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.3:8000"].map(str::to_owned);
        let answer = destination(&list, None);
        let Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })) = &answer.response
        else {
            panic!("a request headers response: {answer:?}");
        };
        let header = common
            .header_mutation
            .as_ref()
            .and_then(|m| m.set_headers.first())
            .and_then(|o| o.header.as_ref())
            .map(|h| h.raw_value.clone());
        let joined = "10.0.0.2:8000,10.0.0.1:8000,10.0.0.3:8000";
        assert_eq!(header.as_deref(), Some(joined.as_bytes()));
        assert_eq!(lb_destination(&answer), Some(&string(joined)));
    }

    #[test]
    fn heads_read_pseudo_headers_raw_values_and_plain_ones_and_a_response_its_status() {
        let header = |key: &str, raw: &[u8], value: &str| HeaderValue {
            key: key.into(),
            raw_value: raw.to_vec(),
            value: value.into(),
        };
        let map = HeaderMap {
            headers: vec![
                header(":method", b"POST", ""),
                header(":path", b"/v1/completions?x=1", ""),
                header("x-priority", b"", "high"),
                header("bad header", b"x", ""),
            ],
        };
        let h = head(Some(&map));
        assert_eq!(
            (h.method.as_str(), h.path.as_str()),
            ("POST", "/v1/completions")
        );
        assert_eq!(
            h.headers.get("x-priority").map(|v| v.as_bytes()),
            Some(&b"high"[..])
        );
        assert_eq!(h.headers.len(), 1, "an invalid name is skipped");
        let response = HeaderMap {
            headers: vec![
                header("content-type", b"text/plain", ""),
                header(":status", b"503", ""),
            ],
        };
        assert_eq!(status(Some(&response)), Some(503));
        assert_eq!(status(Some(&map)), None, "a request has none");
    }
}
