//! The writer's states, with chunks that spell out what they carry.

use http_body_util::BodyExt as _;

use super::*;
use crate::scheduler::FinishReason;

/// `text`, `usage N` and `first` as plain SSE data.
#[derive(Clone)]
struct Spelled;

impl Chunks for Spelled {
    fn event(&self, event: Event, first: bool) -> Bytes {
        let mark = if first { "first " } else { "" };
        sse::event(&format!("{mark}{}", event.text))
    }

    fn usage(&self, usage: Usage) -> Bytes {
        sse::event(&format!("usage {}", usage.completion_tokens))
    }
}

fn token(text: &str) -> Event {
    Event {
        text: text.into(),
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        finish: None,
    }
}

fn finish(usage: Usage) -> Event {
    Event {
        finish: Some((FinishReason::Length, usage)),
        ..token("")
    }
}

/// The body's frames as text, and whether it ended with an error.
async fn frames(response: Response<Body>) -> (String, bool) {
    let mut body = response.into_body();
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(&String::from_utf8_lossy(&data));
                }
            }
            Err(BodyError) => return (text, true),
        }
    }
    (text, false)
}

#[tokio::test]
async fn a_finished_stream_ends_with_its_usage_then_done() {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(token("hi")).unwrap();
    tx.send(token("!")).unwrap();
    let usage = Usage {
        prompt_tokens: 3,
        completion_tokens: 2,
        cached_tokens: 0,
    };
    tx.send(finish(usage)).unwrap();
    let (text, failed) = frames(stream(Spelled, true, rx)).await;
    assert!(!failed);
    assert_eq!(
        text,
        "data: \"first hi\"\n\ndata: \"!\"\n\ndata: \"\"\n\ndata: \"usage 2\"\n\ndata: [DONE]\n\n"
    );
}

#[tokio::test]
async fn without_include_usage_done_follows_the_finish() {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(finish(Usage::default())).unwrap();
    let (text, failed) = frames(stream(Spelled, false, rx)).await;
    assert!(!failed);
    assert_eq!(text, "data: \"first \"\n\ndata: [DONE]\n\n");
}

#[tokio::test]
async fn a_stream_whose_step_loop_died_is_cut_without_done() {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(token("hi")).unwrap();
    // The step loop is gone: its end of the channel drops without a finish.
    drop(tx);
    let (text, failed) = frames(stream(Spelled, true, rx)).await;
    assert!(
        failed,
        "the body must end in an error so hyper aborts the connection"
    );
    assert!(text.contains("hi"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
}

#[tokio::test]
async fn work_that_fails_after_the_head_ends_with_an_error_event_then_done() {
    let work = async { Err(HttpError::status(http::StatusCode::GATEWAY_TIMEOUT, "no P")) };
    let response = stream_after(Spelled, false, work);
    assert_eq!(response.status(), http::StatusCode::OK);
    let (text, failed) = frames(response).await;
    assert!(!failed);
    let first = text.split("\n\n").next().unwrap();
    let error: serde_json::Value =
        serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], 504, "{text}");
    assert_eq!(error["error"]["message"], "no P", "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}
