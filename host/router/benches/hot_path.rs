//! The router's per-request work outside the network, piece by piece:
//!
//! - `parse+inject`: a `/v1/completions` body (text or token-id prompt; 200 B, 16 KiB, 1 MiB)
//!   parsed and validated, then the engine bodies built from it and serialised, as a disagg
//!   attempt does (prep_recv, remote_send and start_generate each carry the whole prompt).
//! - `validate`: a 3-step disagg plan and a forward plan checked against 8 endpoints.
//! - `sse relay`: one engine SSE chunk parsed and re-framed as the client's chunk.
//!
//! The policy call itself is measured by `benches/policy.rs`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;
use switchyard_contract::{EndpointSnapshot, Plan, Role, SendBegin, Step, validate};
use switchyard_router::api::{Defaults, PromptTokenizer, Responder, Shape, parse_completion};
use switchyard_router::cluster::{Cluster, EndpointSpec, OutlierConfig};
use switchyard_wire::completion::{CompletionRequest, Prompt};
use switchyard_wire::microserving::{PrepRecvRequest, RemoteSendRequest, StartGenerateRequest};
use switchyard_wire::sse::parse_chunks;

const BODY_SIZES: [(&str, usize); 3] = [("200B", 200), ("16KiB", 16 << 10), ("1MiB", 1 << 20)];

/// A completion body of about `size` bytes whose prompt is text: words of 1 to 7 letters
/// between spaces, as prose splits (one endless word would measure the BPE worst case).
fn text_body(size: usize) -> Vec<u8> {
    let envelope = r#"{"model":"m","prompt":"","max_tokens":32,"stream":true,"temperature":0.7}"#;
    let prompt: String = (0..size.saturating_sub(envelope.len()))
        .map(|i| match i % 8 {
            7 => ' ',
            k => char::from(b'a' + ((i / 8 + k) % 26) as u8),
        })
        .collect();
    envelope
        .replace(r#""prompt":"""#, &format!(r#""prompt":"{prompt}""#))
        .into_bytes()
}

/// A completion body of about `size` bytes whose prompt is token ids (`"97,"` is 3 bytes).
fn token_body(size: usize) -> Vec<u8> {
    let ids: Vec<String> = (0..size / 3).map(|i| (97 + i % 26).to_string()).collect();
    format!(
        r#"{{"model":"m","prompt":[{}],"max_tokens":32,"stream":true,"temperature":0.7}}"#,
        ids.join(",")
    )
    .into_bytes()
}

/// The three engine bodies of one disagg attempt, serialised as the HTTP client sends them.
fn engine_bodies(template: &CompletionRequest, prompt: Vec<u32>, max_tokens: u32) -> usize {
    let end = prompt.len() as i64 - 1;
    let mut body = template.clone();
    body.prompt = Prompt::Tokens(prompt);
    body.max_tokens = Some(max_tokens);
    body.user = Some("cmpl-0123456789abcdef0123456789abcdef-1".to_owned());
    let prep = PrepRecvRequest {
        common: body.clone(),
        end,
    };
    let send = RemoteSendRequest {
        common: body.clone(),
        begin: 0,
        end,
        kv_addr_info: "tcp:127.0.0.1:18202/AAAAAAAAAAAAAAAAAAAA".to_owned(),
        recv_rank: 1,
    };
    let generate = StartGenerateRequest {
        common: body,
        begin: end,
    };
    let mut bytes = 0;
    bytes += serde_json::to_vec(&prep).expect("serialises").len();
    bytes += serde_json::to_vec(&send).expect("serialises").len();
    bytes += serde_json::to_vec(&generate).expect("serialises").len();
    bytes
}

fn parse_and_inject(c: &mut Criterion) {
    let tokenizer =
        std::sync::Arc::new(PromptTokenizer::byte_level().expect("byte-level tokenizer"));
    let defaults = Defaults {
        model: "m",
        max_tokens: 16,
        context_length: 32768,
        max_prompt_tokens: 32767,
    };
    let mut group = c.benchmark_group("parse+inject");
    for (format, make) in [
        ("text", text_body as fn(usize) -> Vec<u8>),
        ("tokens", token_body),
    ] {
        for (name, size) in BODY_SIZES {
            let body = make(size);
            group.throughput(Throughput::Bytes(body.len() as u64));
            // A 1 MiB parse takes milliseconds: fewer samples keep the run short.
            group.sample_size(if size >= 1 << 20 { 10 } else { 100 });
            group.bench_with_input(BenchmarkId::new(format, name), &body, |b, body| {
                b.iter(|| {
                    let parsed =
                        parse_completion(black_box(body), &tokenizer, defaults).expect("valid");
                    // An MLC attempt needs the ids: the parse leaves a text prompt untokenized.
                    let prompt = parsed.prompt.ids_now().expect("tokenizes").to_vec();
                    black_box(engine_bodies(&parsed.template, prompt, parsed.max_tokens))
                })
            });
        }
    }
    group.finish();
}

/// 4 prefill + 4 decode endpoints, all healthy, as the router's cluster reports them.
fn endpoints() -> Vec<EndpointSnapshot> {
    let specs = (0..8)
        .map(|i| EndpointSpec {
            role: if i < 4 { Role::Prefill } else { Role::Decode },
            ..EndpointSpec::new(format!("http://127.0.0.1:{}", 18101 + i))
        })
        .collect();
    let cluster = Cluster::new(specs, OutlierConfig::default());
    for id in 0..8 {
        cluster.set_health(id, true);
    }
    cluster.snapshot()
}

fn validate_plans(c: &mut Criterion) {
    let endpoints = endpoints();
    let disagg = Plan {
        steps: vec![
            Step::PrepRecv { decode: 5, end: -1 },
            Step::RemoteSend {
                prefill: 1,
                decode: 5,
                begin: SendBegin::PrefixMatched,
                end: -1,
            },
            Step::StartGenerate {
                decode: 5,
                begin: -1,
            },
        ],
    };
    let forward = Plan {
        steps: vec![Step::Forward { endpoint: 3 }],
    };
    let mut group = c.benchmark_group("validate");
    for (name, plan) in [("disagg 3 steps", &disagg), ("forward", &forward)] {
        group.bench_function(name, |b| {
            b.iter(|| validate(black_box(plan), 1000, &endpoints).expect("valid plan"))
        });
    }
    group.finish();
}

fn sse_relay(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let chunk = Bytes::from_static(
        br#"data: {"id":"cmpl-0123456789abcdef-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":" token","finish_reason":null,"logprobs":null}],"usage":null}

"#,
    );
    let responder = Responder {
        shape: Shape::Completion,
        id: "cmpl-0123456789abcdef0123456789abcdef".to_owned(),
        created: 1_700_000_000,
        model: "m".to_owned(),
        include_usage: false,
    };
    let text_frames = responder.text_frames();
    c.bench_function("sse relay/one chunk engine -> client", |b| {
        b.iter(|| {
            let bytes = futures::stream::iter([Ok::<_, std::io::Error>(chunk.clone())]);
            let mut chunks = parse_chunks(bytes);
            let parsed = runtime
                .block_on(chunks.next())
                .expect("one chunk")
                .expect("parses");
            let text = &parsed.choice.expect("a choice").text;
            let mut frame = Vec::new();
            text_frames.write(&mut frame, text);
            black_box(frame)
        })
    });
}

criterion_group!(benches, parse_and_inject, validate_plans, sse_relay);
criterion_main!(benches);
