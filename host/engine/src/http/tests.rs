//! Response bodies built from step-loop events.

use super::*;

fn meta() -> ResponseMeta {
    ResponseMeta {
        id: "cmpl-t".into(),
        created: 0,
        model: "m".into(),
        token_ids: false,
        logprobs: None,
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
async fn a_finished_stream_ends_with_done() {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(token("hi")).unwrap();
    tx.send(Event {
        text: String::new(),
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        finish: Some((FinishReason::Length, Default::default())),
    })
    .unwrap();
    let (text, failed) = frames(sse(meta(), false, rx)).await;
    assert!(!failed);
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

#[tokio::test]
async fn a_stream_whose_step_loop_died_is_cut_without_done() {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(token("hi")).unwrap();
    // The step loop is gone: its end of the channel drops without a finish.
    drop(tx);
    let (text, failed) = frames(sse(meta(), true, rx)).await;
    assert!(
        failed,
        "the body must end in an error so hyper aborts the connection"
    );
    assert!(text.contains("hi"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
}
