//! The floor under any Endpoint Picker behind Envoy: an ext_proc server that picks nothing. It
//! speaks `FULL_DUPLEX_STREAMED` as an EPP must: it holds the request's headers until the body
//! is whole (an EPP reads the body to pick), then answers them with one fixed destination
//! (`x-gateway-destination-endpoint` as a header and as `envoy.lb` dynamic metadata, as the
//! protocol asks) and passes every body chunk back unchanged, the response's as they come. It
//! parses nothing, plans nothing and spawns nothing: each answer is made inside the gRPC
//! response stream, as the inbound message is polled.
//!
//! `scripts/bench_epp.py` puts it behind the same Envoy configuration as `switchyard epp`, so the
//! table can say how much of the added latency Envoy's ext_proc costs with any processor on the
//! same stack (tonic, a multi-thread Tokio runtime) and how much is switchyard's own work.
//!
//! Usage: null_ext_proc PORT DESTINATION (DESTINATION: `ip:port`) [WORKERS, default 1]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::{Stream, StreamExt, stream};
use tonic::{Status, Streaming};

const DESTINATION: &str = "x-gateway-destination-endpoint";

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

struct NullPicker {
    /// The answer to every request's headers: the fixed destination.
    destination: ProcessingResponse,
}

#[tonic::async_trait]
impl ExternalProcessor for NullPicker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let destination = self.destination.clone();
        // The request's body chunks until the last one: the headers' answer comes first.
        let mut held: Vec<Vec<u8>> = Vec::new();
        let answers = request.into_inner().flat_map(move |message| match message {
            Ok(message) => stream::iter(answer(message, &destination, &mut held))
                .map(Ok)
                .left_stream(),
            // Envoy went away: the stream ends with it.
            Err(status) => stream::iter([Err(status)]).right_stream(),
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

/// What one of Envoy's messages is answered with (nothing while the request's body is not
/// whole).
fn answer(
    message: ProcessingRequest,
    destination: &ProcessingResponse,
    held: &mut Vec<Vec<u8>>,
) -> Vec<ProcessingResponse> {
    match message.request {
        Some(Message::RequestHeaders(headers)) if headers.end_of_stream => {
            vec![destination.clone()]
        }
        Some(Message::RequestHeaders(_)) | None => Vec::new(),
        Some(Message::RequestBody(body)) => {
            held.push(body.body);
            if !body.end_of_stream {
                return Vec::new();
            }
            let last = held.len() - 1;
            std::iter::once(destination.clone())
                .chain(
                    held.drain(..)
                        .enumerate()
                        .map(|(i, chunk)| body_chunk(true, chunk, i == last)),
                )
                .collect()
        }
        Some(Message::RequestTrailers(_)) => vec![respond(Response::RequestTrailers(
            TrailersResponse::default(),
        ))],
        Some(Message::ResponseHeaders(_)) => vec![respond(Response::ResponseHeaders(
            HeadersResponse::default(),
        ))],
        Some(Message::ResponseBody(body)) => vec![body_chunk(false, body.body, body.end_of_stream)],
        Some(Message::ResponseTrailers(_)) => vec![respond(Response::ResponseTrailers(
            TrailersResponse::default(),
        ))],
    }
}

/// The headers' answer naming `endpoint`, as a header and as `envoy.lb` dynamic metadata.
fn destination(endpoint: &str) -> ProcessingResponse {
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    let header = HeaderValueOption {
        header: Some(HeaderValue {
            key: DESTINATION.to_owned(),
            raw_value: endpoint.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    };
    let lb = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), string(endpoint))]),
    };
    ProcessingResponse {
        dynamic_metadata: Some(Struct {
            fields: HashMap::from([(
                "envoy.lb".to_owned(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]),
        }),
        ..respond(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![header],
                    remove_headers: Vec::new(),
                }),
                clear_route_cache: true,
                ..CommonResponse::default()
            }),
        }))
    }
}

fn body_chunk(request: bool, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let chunk = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..StreamedBodyResponse::default()
                    },
                )),
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

fn respond(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: null_ext_proc PORT DESTINATION [WORKERS]";
    let port: u16 = args.next().ok_or_else(|| anyhow::anyhow!(usage))?.parse()?;
    let endpoint = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let workers: usize = args.next().map_or(Ok(1), |w| w.parse())?;
    // Threads as `switchyard epp --workers` sets them, so the two compare on the same runtime.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let picker = NullPicker {
            destination: destination(&endpoint),
        };
        // TCP_NODELAY is the builder's default, as `switchyard epp` sets it.
        tonic::transport::Server::builder()
            .serve(
                SocketAddr::from(([127, 0, 0, 1], port)),
                ExternalProcessorServer::new(picker),
            )
            .await?;
        Ok(())
    })
}
