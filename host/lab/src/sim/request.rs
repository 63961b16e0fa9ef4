//! A request in flight in the simulation, the attempt it is on, and how it ended.

use std::time::Duration;

use switchyard_contract::{EndpointId, Failure};
use switchyard_engine::scheduler::{RequestId, Time};

/// A client request, from arrival until it completes or fails.
#[derive(Debug)]
pub(super) struct Request {
    pub arrived: Time,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Every token the client has received, over all attempts: a continuation's prompt is
    /// the original prompt and these.
    pub delivered: Vec<u32>,
    pub first_token: Option<Time>,
    /// When the last chunk with tokens reached the client.
    pub last_chunk: Option<Time>,
    /// Gaps between consecutive chunks with tokens.
    pub itl: Vec<Duration>,
    /// Attempts started.
    pub attempts: u32,
    /// Attempts that ended without delivering anything, which the router's attempt cap counts.
    pub fruitless: u32,
    /// Retries since the last attempt that delivered something: the backoff's exponent.
    pub backoff: u32,
    pub last_failure: Option<Failure>,
    pub attempt: Option<Attempt>,
    /// What the router reports to the policy's `on-complete`.
    pub generator: Option<EndpointId>,
    pub prefix_matched: u32,
    /// Prompt tokens whose KV the engines reused rather than computed, in the attempt that
    /// computed the prompt last.
    pub cached_tokens: Option<usize>,
}

impl Request {
    pub fn new(arrived: Time, prompt: Vec<u32>, max_tokens: u32) -> Request {
        Request {
            arrived,
            prompt,
            max_tokens,
            delivered: Vec::new(),
            first_token: None,
            last_chunk: None,
            itl: Vec::new(),
            attempts: 0,
            fruitless: 0,
            backoff: 0,
            last_failure: None,
            attempt: None,
            generator: None,
            prefix_matched: 0,
            cached_tokens: None,
        }
    }

    /// The prompt an attempt sends: the original one and what the client already has.
    pub fn continued_prompt(&self) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(self.prompt.len() + self.delivered.len());
        tokens.extend_from_slice(&self.prompt);
        tokens.extend_from_slice(&self.delivered);
        tokens
    }

    /// Tokens still owed to the client.
    pub fn remaining(&self) -> u32 {
        self.max_tokens
            .saturating_sub(u32::try_from(self.delivered.len()).unwrap_or(u32::MAX))
    }

    /// A chunk of `tokens` reaches the client at `now`.
    pub fn deliver(&mut self, tokens: &[u32], now: Time) {
        if tokens.is_empty() {
            return;
        }
        if let Some(last) = self.last_chunk {
            self.itl.push(now.saturating_since(last));
        }
        self.first_token.get_or_insert(now);
        self.last_chunk = Some(now);
        self.delivered.extend_from_slice(tokens);
    }

    /// The attempt `number`, if it is the one under way.
    pub fn current(&mut self, number: u32) -> Option<&mut Attempt> {
        self.attempt.as_mut().filter(|a| a.number == number)
    }
}

/// Where an attempt's plan runs, engines by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// One engine serves the whole request.
    Forward { engine: usize },
    /// MLC: prep_recv for `[0, end)` on `decode`; if a remote_send is planned and `decode`
    /// lacks part of the window, `prefill` computes it and pushes it; start_generate from
    /// `end` on `decode`.
    Mlc {
        decode: usize,
        end: usize,
        send: Option<Send>,
    },
    /// vLLM: `prefill` computes the prompt and one token and holds the KV; then `decode`
    /// reserves all but the last position, pulls what its cache lacks, and generates.
    Vllm { prefill: usize, decode: usize },
    /// SGLang: both legs at once: `decode` reserves and registers, `prefill` computes the
    /// prompt and pushes what `decode` lacks, `decode` generates.
    Sglang { prefill: usize, decode: usize },
}

/// An MLC remote_send: from `prefill`, from `begin` or, when `None`, the prefix `decode`
/// matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Send {
    pub prefill: usize,
    pub begin: Option<usize>,
}

impl Route {
    /// The engine whose tokens the client gets.
    pub fn generator(&self) -> usize {
        match *self {
            Route::Forward { engine } => engine,
            Route::Mlc { decode, .. }
            | Route::Vllm { decode, .. }
            | Route::Sglang { decode, .. } => decode,
        }
    }

    /// The engine that prefills for another, if any.
    pub fn prefill(&self) -> Option<usize> {
        match *self {
            Route::Forward { .. } => None,
            Route::Mlc { send, .. } => send.map(|s| s.prefill),
            Route::Vllm { prefill, .. } | Route::Sglang { prefill, .. } => Some(prefill),
        }
    }
}

/// One attempt of a request and the legs it has live on the engines. Each leg is the core's
/// request id on its engine, the engine being the route's.
#[derive(Debug)]
pub(super) struct Attempt {
    pub number: u32,
    /// The upstream id of the attempt's reservation (`<request>-<attempt>`).
    pub user: String,
    pub route: Route,
    pub prompt_len: usize,
    /// Tokens the client had when the attempt began.
    pub delivered_before: usize,
    /// D's prep_recv, then its reservation, until start_generate takes it over.
    pub reservation: Option<RequestId>,
    /// The prefix D's reservation matched in its cache.
    pub matched: Option<usize>,
    /// P's prefill (for sending, or held) until its lease comes.
    pub prefill: Option<RequestId>,
    /// P's lease, held until its KV is moved (or the attempt ends).
    pub lease: Option<RequestId>,
    /// The lease's KV is on its way: the transfer's end releases it.
    pub moving: bool,
    pub generation: Option<RequestId>,
    /// Whether the attempt counts in the in-flight of its generator and of its prefill engine.
    pub holds_generator: bool,
    pub holds_prefill: bool,
    /// Prompt tokens the engine that computed the prompt found in its cache.
    pub cached_tokens: Option<usize>,
    /// `(engine, tokens)`: prompt tokens counted in an engine's pending prefill until that
    /// prefill ends, as the router's `Prefilling` guards count them.
    pub prefilling: Vec<(usize, u32)>,
    /// Each endpoint's `cached-prefix` in the snapshot the attempt was planned on (by engine):
    /// the generator's is the index's prediction, and the router's pending-prefill guards count
    /// them as already held.
    pub cached: Vec<Option<u32>>,
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    pub arrived: Time,
    pub first_token: Option<Time>,
    pub at: Time,
    pub attempts: u32,
    /// The error the client got, if it failed.
    pub error: Option<String>,
}
