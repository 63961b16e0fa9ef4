//! Leases: computed KV held for a handoff, from the step that computed it until the driver
//! releases it (the push is done, failed, or nobody took it).

use super::request::{Lease, Output, RequestId};
use super::seq::{Seq, Work};
use super::{Core, window_slots};

impl Core {
    /// The lease `id` is over: its pages go back to the pool (or the prefix cache).
    pub fn release_lease(&mut self, id: RequestId) {
        if let Some(seq) = self.leases.remove(&id) {
            self.pool.release(&seq.pages);
            self.freed = true;
        }
    }

    /// A prefill for sending is computed: its slots from `begin` are leased.
    pub(super) fn lease(&mut self, seq: Seq) {
        let Work::Prefill { begin } = seq.work else {
            return;
        };
        let slots = window_slots(&self.pool, &seq.pages, begin, seq.computed);
        self.hold(seq, slots);
    }

    /// A held generation finished: its prompt's slots are leased.
    pub(super) fn hold_prompt(&mut self, seq: Seq) {
        let slots = window_slots(&self.pool, &seq.pages, 0, seq.prompt_len);
        if let Some(user) = &seq.user {
            self.users.remove(user);
        }
        self.hold(seq, slots);
    }

    fn hold(&mut self, seq: Seq, slots: Vec<u32>) {
        let (id, cached_tokens) = (seq.id, seq.cached);
        self.backend.forget(id);
        self.leases.insert(id, seq);
        self.produced.push(Output::Leased(Lease {
            id,
            slots,
            cached_tokens,
        }));
    }
}
