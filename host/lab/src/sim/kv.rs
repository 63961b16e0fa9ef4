//! The router's index of the engines' prefix caches, fed as production feeds it: each core
//! reports what its cache stored and evicted ([`Output::KvEvents`]) with the outputs of the step
//! that did it, due when the step ends, as the engine publishes them; a batch reaches the index
//! `--kv-events-delay-ms` later (the wire and the router's subscriber), and a snapshot's
//! `cached-prefix` is the index's answer for the attempt's prompt, one lookup for every engine,
//! as the router's is. So a policy sees what the router would show it: the caches as of their
//! engines' last published step, never the step under way.
//!
//! [`Output::KvEvents`]: switchyard_engine::scheduler::Output::KvEvents

use std::collections::VecDeque;
use std::time::Duration;

use switchyard_contract::EndpointId;
use switchyard_kv_index::{Adapter, KvIndex, MediumSet};
use switchyard_wire::kv_events::Event;

/// The index, and the batches on their way to it.
pub(super) struct KvView {
    index: KvIndex,
    delay: Duration,
    engines: usize,
    /// Batches published and not applied yet, with their engine, oldest first. Every batch
    /// waits the same delay, so they arrive in the order they left (the agenda breaks ties in
    /// scheduling order): the front is always the one due.
    in_transit: VecDeque<(EndpointId, Vec<Event>)>,
}

/// What `delay` means for a batch just published.
pub(super) enum Published {
    /// Applied already: no delay.
    Applied,
    /// On its way: [`KvView::arrive`] applies it after the delay.
    InTransit(Duration),
}

impl KvView {
    pub fn new(engines: usize, delay: Duration) -> KvView {
        KvView {
            index: KvIndex::default(),
            delay,
            engines,
            in_transit: VecDeque::new(),
        }
    }

    /// Engine `engine` published `events` (its step ended).
    pub fn publish(&mut self, engine: usize, events: Vec<Event>) -> Published {
        let endpoint = endpoint_id(engine);
        if self.delay.is_zero() {
            self.apply(endpoint, &events);
            return Published::Applied;
        }
        self.in_transit.push_back((endpoint, events));
        Published::InTransit(self.delay)
    }

    /// The oldest batch in transit reaches the index.
    pub fn arrive(&mut self) {
        if let Some((endpoint, events)) = self.in_transit.pop_front() {
            self.apply(endpoint, &events);
        }
    }

    fn apply(&mut self, endpoint: EndpointId, events: &[Event]) {
        for event in events {
            self.index.apply(endpoint, event);
        }
    }

    /// How many leading tokens of `prompt` each engine holds, by engine index, as the router's
    /// lookup finds them: base-model blocks in the engines' own (GPU) caches; an engine that has
    /// published nothing yet holds nothing.
    pub fn cached_prefixes(&self, prompt: &[u32]) -> Vec<u32> {
        let mut cached = vec![0; self.engines];
        for m in self.index.lookup(prompt, Adapter::Base, MediumSet::GPU) {
            if let Some(slot) = cached.get_mut(m.endpoint as usize) {
                *slot = u32::try_from(m.tokens).unwrap_or(u32::MAX);
            }
        }
        cached
    }
}

fn endpoint_id(engine: usize) -> EndpointId {
    EndpointId::try_from(engine).unwrap_or(EndpointId::MAX)
}

/// How often the index predicted what the generating engine then served from its cache: the
/// lab's twin of the router's `switchyard_kv_prediction_hits_total` over
/// `switchyard_kv_predictions_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvPredictions {
    /// Completed requests whose last attempt had a prediction for its generator.
    pub made: u64,
    pub hits: u64,
}

impl KvPredictions {
    /// Counts the prediction `predicted` of an attempt's `prompt_len`-token prompt against the
    /// `cached` tokens its engine reported serving from cache, with `page_size`-token pages, by
    /// the router's rule ([`switchyard_kv_index::prediction_hit`]).
    pub fn count(&mut self, predicted: usize, cached: usize, prompt_len: usize, page_size: usize) {
        self.made += 1;
        if switchyard_kv_index::prediction_hit(predicted, cached, prompt_len, page_size) {
            self.hits += 1;
        }
    }

    /// `hits / made`; `None` before any prediction.
    pub fn accuracy(&self) -> Option<f64> {
        (self.made > 0).then(|| self.hits as f64 / self.made as f64)
    }
}
