//! The waiting queue: requests join it, and leave it for the running batch in arrival order
//! once the pool has pages for every token they know (after a prefix-cache match).

use super::Core;
use super::request::{GenRequest, RequestId};
use super::seq::{Seq, Work};

impl Core {
    /// `/v1/completions`: prefill and generate.
    pub fn generate(&mut self, request: GenRequest) -> RequestId {
        let id = self.take_id();
        self.enqueue(Seq::generation(id, None, request));
        id
    }

    /// Prefill and generate as [`Core::generate`], then, when the generation ends, keep the
    /// prompt's KV instead of freeing it: the slots of positions `[0, prompt_len)` follow the
    /// finishing event as an [`Output::Leased`](super::Output::Leased). A vLLM prefill leg (its
    /// blocks wait under a lease for D's pull) and an SGLang prefill leg (it pushes them to D)
    /// both sample their one token this way, so P computes the prompt once. A generation
    /// aborted or preempted keeps nothing.
    pub fn generate_and_hold(&mut self, request: GenRequest) -> RequestId {
        let id = self.take_id();
        let mut seq = Seq::generation(id, None, request);
        if let Work::Generate(g) = &mut seq.work {
            g.hold = true;
        }
        self.enqueue(seq);
        id
    }

    /// remote_send's prefill: compute `tokens` (= `prompt[0:end]`), then lease the slots of
    /// `[begin, end)` for sending.
    pub fn prefill_for_send(&mut self, tokens: Vec<u32>, begin: usize) -> RequestId {
        let id = self.take_id();
        self.counters.remote_send_received += 1;
        self.waiting.push_back(Seq::prefill(id, tokens, begin));
        id
    }

    fn enqueue(&mut self, seq: Seq) {
        self.counters.prompt_tokens += seq.prompt_len as u64;
        self.waiting.push_back(seq);
    }

    pub(super) fn admit_waiting(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(mut seq) = self.waiting.pop_front() else {
                return;
            };
            if self.try_admit(&mut seq) {
                self.running.push(seq);
            } else {
                self.waiting.push_front(seq);
                if self.running.is_empty() {
                    self.break_waiting_deadlock();
                }
                return;
            }
        }
    }

    /// Gives `seq` pages for every known token (after a prefix-cache match if it has none yet);
    /// `false`, with nothing changed, when the pool cannot.
    fn try_admit(&mut self, seq: &mut Seq) -> bool {
        let ps = self.pool.page_size();
        let fresh_start = seq.pages.is_empty() && seq.computed == 0;
        let mut matched_pages = Vec::new();
        if fresh_start {
            self.pool.extend_keys(&mut seq.page_keys, &seq.tokens);
            // A generation must compute at least its last prompt token itself (that pass yields
            // the first output token); a prefill for remote_send may be served entirely.
            let limit = match seq.work {
                Work::Generate(_) => (seq.target() - 1) / ps,
                Work::Prefill { .. } => seq.target() / ps,
            };
            matched_pages = self.pool.match_prefix(&seq.page_keys, limit);
        }
        let need = self
            .pool
            .pages_for(seq.target())
            .saturating_sub(seq.pages.len() + matched_pages.len());
        let Some(fresh) = self.pool.alloc(need) else {
            self.pool.release(&matched_pages);
            return false;
        };
        if fresh_start {
            let matched = matched_pages.len() * ps;
            self.counters.prefix_matched_tokens += matched as u64;
            seq.registered_pages = matched_pages.len();
            seq.computed = matched;
            seq.cached = matched;
            seq.pages = matched_pages;
        }
        seq.pages.extend(fresh);
        true
    }

    /// Nothing runs and the head cannot get pages: if other waiting requests hold pages (started
    /// reservations), preempt the last of them, or the pool would stay stuck.
    fn break_waiting_deadlock(&mut self) {
        let holder = (1..self.waiting.len())
            .rev()
            .find(|&i| !self.waiting[i].pages.is_empty());
        if let Some(seq) = holder.and_then(|i| self.waiting.remove(i)) {
            self.preempt(seq);
        }
    }
}
