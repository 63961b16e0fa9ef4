//! prep_recv reservations: pages held for KV another engine pushes, from the answer until
//! start_generate takes them over, the caller cancels them, or their TTL passes; and the
//! quarantine their pages wait out before reuse, while a late push may still land in them.

use super::request::{CoreError, GenRequest, Output, PrepRecvReply, RequestId};
use super::seq::Seq;
use super::time::Time;
use super::{Core, window_slots};
use switchyard_kv::KvAddrInfo;

/// A prep_recv waiting for its pages.
#[derive(Debug)]
pub(super) struct PendingPrep {
    pub id: RequestId,
    pub user: String,
    pub request: GenRequest,
    pub end: usize,
}

#[derive(Debug)]
pub(super) struct Reservation {
    /// The prep_recv's request.
    pub id: RequestId,
    pub request: GenRequest,
    pub pages: Vec<u32>,
    pub page_keys: Vec<u64>,
    pub matched: usize,
    pub end: usize,
    pub deadline: Time,
}

/// Pages of a dropped reservation, kept out of use until `until` and until no receiver is
/// writing their slots.
#[derive(Debug)]
pub(super) struct Quarantined {
    pub pages: Vec<u32>,
    pub slots: Vec<u32>,
    pub until: Time,
}

impl Core {
    /// Reserve pages for positions `[0, end)` of `request`, waiting until they are free: the
    /// answer is an [`Output::Reserved`]. Refused at once when `user` is in flight already.
    pub fn prep_recv(
        &mut self,
        user: String,
        request: GenRequest,
        end: usize,
    ) -> Result<RequestId, CoreError> {
        if self.users.contains(&user) {
            return Err(CoreError::DuplicateUser { user });
        }
        let id = self.take_id();
        self.users.insert(user.clone());
        self.pending_preps.push_back(PendingPrep {
            id,
            user,
            request,
            end,
        });
        Ok(id)
    }

    /// Generate from `user`'s reservation; positions before `begin` are in the pool already.
    pub fn start_generate(&mut self, user: String, begin: usize) -> Result<RequestId, CoreError> {
        let Some(r) = self.reservations.get(&user) else {
            return Err(CoreError::NoReservation { user });
        };
        if begin > r.end {
            return Err(CoreError::BeginPastWindow { begin, end: r.end });
        }
        if begin < r.matched {
            return Err(CoreError::BeginBeforeMatched {
                begin,
                matched: r.matched,
            });
        }
        // From here on only this engine touches the window.
        let slots = self.reservation_slots(r);
        if self
            .backend
            .gate()
            .is_some_and(|gate| !gate.close_unless_claimed(&slots))
        {
            return Err(CoreError::TransferInProgress { user });
        }
        let Some(r) = self.reservations.remove(&user) else {
            return Err(CoreError::NoReservation { user });
        };
        // P wrote [matched, end) behind our back: read those slots now so decode steps see the
        // bytes that actually arrived. Whether they are all there, nobody here can tell: a
        // router also calls start_generate to free a reservation whose remote_send failed,
        // hanging up at once. So the pages join the prefix cache only when the generation
        // finishes; one aborted or preempted leaves no unchecked page behind for others.
        for pos in r.matched..r.end {
            let slot = self.pool.slot(&r.pages, pos);
            self.backend.received(slot);
        }
        self.counters.prompt_tokens += r.request.tokens.len() as u64;
        let id = self.take_id();
        let mut seq = Seq::generation(id, Some(user), r.request);
        seq.pages = r.pages;
        seq.page_keys = r.page_keys;
        seq.registered_pages = r.matched / self.pool.page_size();
        seq.cache_after_finish = true;
        seq.computed = begin;
        // Served from this engine's own cache: what prep_recv matched, not what P pushed.
        seq.cached = r.matched;
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Drop `user`'s prep_recv whose caller gave up before start_generate (a vLLM or SGLang
    /// decode leg cancelled while it waited for the KV): a reservation goes through the expiry
    /// quarantine at once instead of holding its pages until the TTL; a prep_recv not answered
    /// yet is forgotten. Unknown ids are ignored.
    pub fn cancel_reservation(&mut self, user: &str, now: Time) {
        if let Some(r) = self.reservations.remove(user) {
            tracing::debug!(%user, pages = r.pages.len(), "reservation cancelled");
            self.retire(r, now + self.cfg.expiry_quarantine);
            self.users.remove(user);
        } else if let Some(i) = self.pending_preps.iter().position(|p| p.user == user) {
            self.pending_preps.remove(i);
            self.users.remove(user);
        }
    }

    /// Answers blocked prep_recv calls in order while their pages fit.
    pub(super) fn serve_pending_preps(&mut self, now: Time) {
        while let Some(prep) = self.pending_preps.front() {
            let ps = self.pool.page_size();
            let mut page_keys = Vec::new();
            self.pool.extend_keys(&mut page_keys, &prep.request.tokens);
            // Only whole pages inside [0, end) may be shared: D writes from `matched` on.
            let matched_pages = self.pool.match_prefix(&page_keys, prep.end / ps);
            let need = self
                .pool
                .pages_for(prep.end)
                .saturating_sub(matched_pages.len());
            let Some(fresh) = self.pool.alloc(need) else {
                self.pool.release(&matched_pages);
                return;
            };
            let Some(prep) = self.pending_preps.pop_front() else {
                return;
            };
            let matched = matched_pages.len() * ps;
            let mut pages = matched_pages;
            pages.extend(fresh);
            let slots = window_slots(&self.pool, &pages, matched, prep.end);
            // Open before answering: P can push as soon as the router has the answer.
            if let Some(gate) = self.backend.gate() {
                gate.open(slots.iter().copied());
            }
            let reply = PrepRecvReply {
                kv_addr_info: KvAddrInfo::from_slots(slots),
                prefix_matched_length: matched,
            };
            self.counters.prefix_matched_tokens += matched as u64;
            self.reservations.insert(
                prep.user,
                Reservation {
                    id: prep.id,
                    request: prep.request,
                    pages,
                    page_keys,
                    matched,
                    end: prep.end,
                    deadline: now + self.cfg.reservation_ttl,
                },
            );
            self.produced.push(Output::Reserved { id: prep.id, reply });
        }
    }

    pub(super) fn expire_reservations(&mut self, now: Time) {
        let expired: Vec<String> = self
            .reservations
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(u, _)| u.clone())
            .collect();
        for user in expired {
            if let Some(r) = self.reservations.remove(&user) {
                tracing::debug!(%user, pages = r.pages.len(), "prep_recv reservation expired");
                self.retire(r, now + self.cfg.expiry_quarantine);
                self.users.remove(&user);
                self.counters.reservations_expired += 1;
            }
        }
    }

    /// Closes a dropped reservation's window and quarantines its pages until `until` (and until
    /// no receiver writes them); [`Core::release_quarantined`] frees them.
    pub(super) fn retire(&mut self, r: Reservation, until: Time) {
        let slots = self.reservation_slots(&r);
        if let Some(gate) = self.backend.gate() {
            gate.close(slots.iter().copied());
        }
        self.quarantine.push(Quarantined {
            pages: r.pages,
            slots,
            until,
        });
    }

    /// Frees quarantined pages whose time is up and that no receiver is still writing.
    pub(super) fn release_quarantined(&mut self, now: Time) {
        let gate = self.backend.gate();
        let (done, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.quarantine)
            .into_iter()
            .partition(|q| {
                q.until <= now && !gate.is_some_and(|g| g.any_claimed(q.slots.iter().copied()))
            });
        self.quarantine = kept;
        for q in done {
            self.pool.release(&q.pages);
            self.freed = true;
        }
    }

    /// The slots of a reservation's window `[matched, end)`: what its prep_recv handed out.
    fn reservation_slots(&self, r: &Reservation) -> Vec<u32> {
        window_slots(&self.pool, &r.pages, r.matched, r.end)
    }
}
