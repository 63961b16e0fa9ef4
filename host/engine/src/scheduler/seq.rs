//! A sequence: one request the core computes, from the waiting queue through the running batch
//! until it ends, with its pages and how far its KV is computed.

use super::request::{GenRequest, RequestId};
use super::text::TextStream;
use crate::model::Sampling;

#[derive(Debug)]
pub(super) struct Seq {
    pub id: RequestId,
    /// The microserving request id, reserved in `Core::users` until the sequence ends.
    pub user: Option<String>,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub pages: Vec<u32>,
    pub page_keys: Vec<u64>,
    pub registered_pages: usize,
    /// Join the prefix cache only once the generation finishes: its first pages arrived from a
    /// prefill engine, unchecked (see `Core::start_generate`).
    pub cache_after_finish: bool,
    /// Positions whose KV is in the pool.
    pub computed: usize,
    /// Prompt positions this engine's prefix cache served when the sequence started.
    pub cached: usize,
    pub work: Work,
}

#[derive(Debug)]
pub(super) enum Work {
    Generate(GenState),
    /// P's half of remote_send: prefill, then lease the slots from `begin`.
    Prefill {
        begin: usize,
    },
}

#[derive(Debug)]
pub(super) struct GenState {
    pub sampling: Sampling,
    pub logprobs: bool,
    pub max_tokens: usize,
    pub generated: usize,
    pub text: TextStream,
    /// Fault injection (`preempt_every`): preempt once this many tokens are generated.
    pub preempt_at: Option<usize>,
    /// Counted towards `preempt_every` (at its first sampled token).
    pub counted: bool,
    /// Lease the prompt's slots when the generation finishes (`Core::generate_and_hold`).
    pub hold: bool,
}

impl Seq {
    /// A generation of `request`'s tokens, nothing computed yet.
    pub fn generation(id: RequestId, user: Option<String>, request: GenRequest) -> Seq {
        Seq::new(
            id,
            user,
            request.tokens,
            Work::Generate(GenState {
                sampling: request.sampling,
                logprobs: request.logprobs,
                max_tokens: request.max_tokens,
                generated: 0,
                text: TextStream::new(request.stop),
                preempt_at: None,
                counted: false,
                hold: false,
            }),
        )
    }

    /// A prefill of `tokens` whose slots from `begin` are leased for sending.
    pub fn prefill(id: RequestId, tokens: Vec<u32>, begin: usize) -> Seq {
        Seq::new(id, None, tokens, Work::Prefill { begin })
    }

    fn new(id: RequestId, user: Option<String>, tokens: Vec<u32>, work: Work) -> Seq {
        Seq {
            id,
            user,
            prompt_len: tokens.len(),
            tokens,
            pages: Vec::new(),
            page_keys: Vec::new(),
            registered_pages: 0,
            cache_after_finish: false,
            computed: 0,
            cached: 0,
            work,
        }
    }

    /// How many positions the sequence knows: its KV is complete when `computed` reaches it.
    pub fn target(&self) -> usize {
        self.tokens.len()
    }

    pub fn generates(&self) -> bool {
        matches!(self.work, Work::Generate(_))
    }
}
