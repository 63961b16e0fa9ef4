//! The step itself: plan who runs how many positions, grow pages (preempting under pressure),
//! run the model over the batch, then let every sequence whose known tokens are all computed
//! take its next token, or hand over its slots.

use std::collections::HashMap;

use super::Core;
use super::backend::Planned;
use super::request::{FinishReason, Output, RequestId, Usage};
use super::seq::{Seq, Work};
use crate::kv_pool::PagePool;
use crate::latency::StepWork;
use crate::model::Sampled;

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy)]
struct Share {
    id: RequestId,
    /// Positions it computes.
    n: usize,
    /// One token after its whole prompt (else a prefill chunk).
    decoding: bool,
    /// Positions before them.
    context: usize,
}

enum Growth {
    Ready,
    SelfPreempted,
    EarlierPreempted,
}

/// What a sampled token did to its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Accepted {
    Continue,
    Finished,
    Preempt,
}

impl Core {
    /// Runs every running sequence once; returns what the step did, for costing.
    pub(super) fn run_batch(&mut self) -> StepWork {
        let plan = self.plan();
        let mut work = StepWork::default();
        for share in &plan {
            if share.decoding {
                work.decode_seqs += 1;
                work.decode_ctx_tokens += share.context + 1;
            } else {
                work.prefill_tokens += share.n;
                work.prefill_token_ctx += share.n * share.context;
            }
        }
        self.compute(&plan);
        // Sequences that processed every known token choose their next one (or lease their
        // slots), in plan order.
        for share in &plan {
            let Some(i) = self.running.iter().position(|s| s.id == share.id) else {
                continue;
            };
            if self.running[i].computed >= self.running[i].target() {
                self.finish_pass(i);
            }
        }
        work
    }

    /// Who runs how many positions this step, each holding the pages it needs (preempting the
    /// last running generations while none are free). The positions run afterwards in one
    /// batch.
    fn plan(&mut self) -> Vec<Share> {
        let mut plan = Vec::new();
        let mut budget = self.cfg.prefill_chunk;
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            let remaining = seq.target() - seq.computed;
            let decoding = remaining == 1 && seq.generates();
            let n = if decoding { 1 } else { remaining.min(budget) };
            if n == 0 && remaining > 0 {
                i += 1;
                continue;
            }
            let extra = pages_needed(&self.pool, seq, n);
            match self.ensure_pages(i, extra) {
                Growth::Ready => {}
                Growth::SelfPreempted => continue,
                Growth::EarlierPreempted => {
                    i -= 1;
                    continue;
                }
            }
            if !decoding {
                budget -= n;
            }
            let seq = &self.running[i];
            plan.push(Share {
                id: seq.id,
                n,
                decoding,
                context: seq.computed,
            });
            i += 1;
        }
        // A sequence preempted to make room for a later one leaves the plan.
        plan.retain(|share| self.running.iter().any(|s| s.id == share.id));
        plan
    }

    /// Makes `running[i]` own `extra` more pages, preempting the last running generation while
    /// none are free.
    fn ensure_pages(&mut self, i: usize, extra: usize) -> Growth {
        loop {
            if extra == 0 {
                return Growth::Ready;
            }
            if let Some(pages) = self.pool.alloc(extra) {
                self.running[i].pages.extend(pages);
                return Growth::Ready;
            }
            let victim = self
                .running
                .iter()
                .rposition(|s| matches!(s.work, Work::Generate(_)))
                .unwrap_or(i);
            let seq = self.running.remove(victim);
            self.preempt(seq);
            match victim.cmp(&i) {
                std::cmp::Ordering::Equal => return Growth::SelfPreempted,
                std::cmp::Ordering::Less => return Growth::EarlierPreempted,
                std::cmp::Ordering::Greater => {}
            }
        }
    }

    /// Runs the model over the planned positions, writing their KV.
    fn compute(&mut self, plan: &[Share]) {
        let n_of: HashMap<RequestId, usize> = plan.iter().map(|s| (s.id, s.n)).collect();
        let mut planned: Vec<Planned<'_>> = self
            .running
            .iter_mut()
            .filter_map(|seq| n_of.get(&seq.id).map(|&n| Planned { seq, n }))
            .collect();
        self.backend.compute(&self.pool, &mut planned);
        for p in planned {
            register_full_pages(&mut self.pool, p.seq);
        }
    }

    /// `running[i]` has processed every known token: a prefill hands over its slots, a
    /// generation takes its next token and may end.
    fn finish_pass(&mut self, i: usize) {
        let seq = &self.running[i];
        let Work::Generate(g) = &seq.work else {
            let seq = self.running.remove(i);
            self.lease(seq);
            return;
        };
        let sampled = self
            .backend
            .next_token(&self.pool, seq, &g.sampling, g.logprobs);
        match self.accept_token(i, sampled) {
            Accepted::Continue => {}
            Accepted::Finished => {
                let mut seq = self.running.remove(i);
                if seq.cache_after_finish {
                    seq.cache_after_finish = false;
                    register_full_pages(&mut self.pool, &mut seq);
                }
                match &seq.work {
                    Work::Generate(g) if g.hold => self.hold_prompt(seq),
                    _ => self.end(seq),
                }
            }
            Accepted::Preempt => {
                let seq = self.running.remove(i);
                self.preempt(seq);
            }
        }
    }

    /// Appends a sampled token, streams its text, and decides whether the generation ends.
    fn accept_token(&mut self, i: usize, Sampled { token, logprob }: Sampled) -> Accepted {
        let preempt_every = self.cfg.preempt_every;
        let seq = &mut self.running[i];
        let (id, prompt_len, cached) = (seq.id, seq.prompt_len, seq.cached);
        let Work::Generate(g) = &mut seq.work else {
            return Accepted::Continue;
        };
        if !g.counted {
            g.counted = true;
            self.decode_counter += 1;
            if preempt_every.is_some_and(|k| k > 0 && self.decode_counter.is_multiple_of(k))
                && g.max_tokens >= 2
            {
                g.preempt_at = Some(g.max_tokens / 2);
            }
        }
        let mut finish = None;
        if self.backend.is_eos(token) {
            finish = Some(FinishReason::Stop);
        } else {
            seq.tokens.push(token);
            g.generated += 1;
            self.counters.generated_tokens += 1;
            let bytes = self.backend.token_bytes(token);
            if g.text.push(token, bytes, logprob.filter(|_| g.logprobs)) {
                finish = Some(FinishReason::Stop);
            } else if g.generated >= g.max_tokens {
                finish = Some(FinishReason::Length);
            }
        }
        if finish.is_none() && g.preempt_at == Some(g.generated) {
            // Text held back as a possible stop-string start stays unsent: the preemption event
            // carries no text (MLC's), and the rerun produces it again anyway.
            let event = g.text.take(false);
            if !event.text.is_empty() {
                self.produced.push(Output::Event { id, event });
            }
            return Accepted::Preempt;
        }
        let mut event = g.text.take(finish.is_some());
        event.finish = finish.map(|f| {
            let usage = Usage {
                prompt_tokens: prompt_len,
                completion_tokens: g.generated,
                cached_tokens: cached,
            };
            (f, usage)
        });
        if !event.text.is_empty() || event.finish.is_some() {
            self.produced.push(Output::Event { id, event });
        }
        match finish {
            Some(_) => Accepted::Finished,
            None => Accepted::Continue,
        }
    }
}

fn pages_needed(pool: &PagePool, seq: &Seq, n: usize) -> usize {
    pool.pages_for(seq.computed + n)
        .saturating_sub(seq.pages.len())
}

/// Offers the sequence's newly completed pages to the prefix cache.
fn register_full_pages(pool: &mut PagePool, seq: &mut Seq) {
    if seq.cache_after_finish {
        return;
    }
    let ps = pool.page_size();
    let full = seq.computed / ps;
    if full <= seq.registered_pages {
        return;
    }
    pool.extend_keys(&mut seq.page_keys, &seq.tokens[..full * ps]);
    pool.register(
        &seq.pages,
        &seq.page_keys[..full],
        &seq.tokens,
        seq.registered_pages,
    );
    seq.registered_pages = full;
}
