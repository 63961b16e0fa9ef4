//! [`SlotGate`]: which slots of a pool a receiving transport may write, and which it is writing.
//!
//! A decode engine hands out slot ids in `kv_append_metadata`; anyone who can reach its KV
//! listener can then name slots. Without a check, a late or stray push would land in pages that
//! were freed and reused by another request (silently wrong output), and a receiver's `&mut`
//! view of the pool could alias the step loop reading the same bytes. The gate is the shared
//! truth both sides consult:
//!
//! - the engine *opens* a reservation's slots when prep_recv answers and *closes* them at
//!   start_generate or expiry ([`SlotGate::open`], [`SlotGate::close`]);
//! - a receiver *claims* the runs of a transfer before writing ([`SlotGate::claim`]): every slot
//!   must be open and not already claimed, so two transfers never write one slot at once; the
//!   claim ends when its [`WriteClaim`] drops, and a closed slot cannot be claimed again;
//! - [`crate::KvStore::read_slot`] / `write_slot` refuse a slot under a claim, and the
//!   engine never reuses pages whose slots are still claimed ([`SlotGate::any_claimed`]).
//!
//! A pool built for an engine is *guarded* (slots start closed). A standalone pool (tests,
//! benchmarks, the `kv` example) is unguarded: every slot counts as open, but claims are still
//! exclusive, so receivers never alias each other.
//!
//! One-sided transports (shm, cuda) write without the receiver's involvement and cannot be
//! gated; the engine quarantines an expired reservation's pages instead (see
//! `engine::scheduler`).

use parking_lot::Mutex;

use super::SlotRun;

/// Per-slot open/claimed state of one pool, shared by the engine and its receivers.
#[derive(Debug)]
pub struct SlotGate {
    guarded: bool,
    state: Mutex<Vec<Slot>>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    open: bool,
    claimed: bool,
}

/// Why a receiver may not write a transfer's slots.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    #[error("slot {slot} is not reserved for a transfer (no open prep_recv names it)")]
    NotOpen { slot: u32 },
    #[error("slot {slot} is already being written by another transfer")]
    Claimed { slot: u32 },
}

impl SlotGate {
    /// A gate for `num_slots` slots. `guarded`: slots start closed and only [`SlotGate::open`]
    /// lets receivers write them; otherwise every slot is always open.
    pub(crate) fn new(num_slots: u32, guarded: bool) -> Self {
        SlotGate {
            guarded,
            state: Mutex::new(vec![Slot::default(); num_slots as usize]),
        }
    }

    /// Lets receivers write `slots` (a reservation was handed out). Out-of-range ids are ignored:
    /// the engine's bookkeeping only names slots of its own pool.
    pub fn open(&self, slots: impl IntoIterator<Item = u32>) {
        let mut state = self.state.lock();
        for slot in slots {
            if let Some(s) = state.get_mut(slot as usize) {
                s.open = true;
            }
        }
    }

    /// Stops receivers from starting new writes into `slots`. A write already under way keeps
    /// its claim; see [`SlotGate::any_claimed`].
    pub fn close(&self, slots: impl IntoIterator<Item = u32>) {
        let mut state = self.state.lock();
        for slot in slots {
            if let Some(s) = state.get_mut(slot as usize) {
                s.open = false;
            }
        }
    }

    /// Closes `slots` if no receiver is writing any of them; `false`, with nothing changed,
    /// otherwise. Checked and closed under one lock, so no claim can slip in between.
    pub fn close_unless_claimed(&self, slots: &[u32]) -> bool {
        let mut state = self.state.lock();
        if slots
            .iter()
            .any(|&slot| state.get(slot as usize).is_some_and(|s| s.claimed))
        {
            return false;
        }
        for &slot in slots {
            if let Some(s) = state.get_mut(slot as usize) {
                s.open = false;
            }
        }
        true
    }

    /// Whether a receiver is writing any of `slots` right now.
    pub fn any_claimed(&self, slots: impl IntoIterator<Item = u32>) -> bool {
        let state = self.state.lock();
        slots
            .into_iter()
            .any(|slot| state.get(slot as usize).is_some_and(|s| s.claimed))
    }

    /// Claims every slot of `runs` for one transfer's writes, or none of them, until the claim
    /// drops: what a receiving transport does before it writes. The caller checked the runs are
    /// inside the pool. (Public so an engine's tests can hold a transfer open.)
    pub fn claim(&self, runs: &[SlotRun]) -> Result<WriteClaim<'_>, GateError> {
        let mut state = self.state.lock();
        let slots = || runs.iter().flat_map(SlotRun::slots);
        let mut marked = 0;
        let mut refused = None;
        for slot in slots() {
            let s = &mut state[slot as usize];
            if self.guarded && !s.open {
                refused = Some(GateError::NotOpen { slot });
            } else if s.claimed {
                // Also catches one request naming a slot twice.
                refused = Some(GateError::Claimed { slot });
            } else {
                s.claimed = true;
                marked += 1;
                continue;
            }
            break;
        }
        if let Some(e) = refused {
            for slot in slots().take(marked) {
                state[slot as usize].claimed = false;
            }
            return Err(e);
        }
        Ok(WriteClaim {
            gate: self,
            runs: runs.to_vec(),
        })
    }

    /// Runs `access` on `slot` while no receiver can claim it.
    ///
    /// # Panics
    /// If a receiver is writing `slot`: the engine's bookkeeping let it touch a slot it handed
    /// out and did not take back, a bug like an out-of-range index.
    pub(crate) fn with_unclaimed<R>(&self, slot: u32, access: impl FnOnce() -> R) -> R {
        let state = self.state.lock();
        assert!(
            !state.get(slot as usize).is_some_and(|s| s.claimed),
            "slot {slot} is accessed while a KV transfer writes it"
        );
        access()
    }
}

/// Proof that one transfer alone may write its runs' slots; the claim ends on drop.
#[derive(Debug)]
pub struct WriteClaim<'a> {
    gate: &'a SlotGate,
    runs: Vec<SlotRun>,
}

impl WriteClaim<'_> {
    /// The claimed runs, in the order of the request.
    pub(crate) fn runs(&self) -> &[SlotRun] {
        &self.runs
    }
}

impl Drop for WriteClaim<'_> {
    fn drop(&mut self) {
        let mut state = self.gate.state.lock();
        for slot in self.runs.iter().flat_map(SlotRun::slots) {
            state[slot as usize].claimed = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(begin: u32, len: u32) -> SlotRun {
        SlotRun { begin, len }
    }

    #[test]
    fn a_guarded_gate_admits_only_open_slots() {
        let gate = SlotGate::new(16, true);
        assert_eq!(
            gate.claim(&[run(2, 2)]).unwrap_err(),
            GateError::NotOpen { slot: 2 }
        );
        gate.open([2, 3]);
        let claim = gate.claim(&[run(2, 2)]).expect("open slots");
        assert!(gate.any_claimed([3]));
        drop(claim);
        assert!(!gate.any_claimed([2, 3]));
        gate.close([2, 3]);
        assert_eq!(
            gate.claim(&[run(3, 1)]).unwrap_err(),
            GateError::NotOpen { slot: 3 }
        );
    }

    #[test]
    fn claims_are_exclusive_and_all_or_nothing() {
        let gate = SlotGate::new(16, false);
        let first = gate.claim(&[run(4, 4)]).expect("unguarded slots are open");
        assert_eq!(
            gate.claim(&[run(0, 2), run(7, 2)]).unwrap_err(),
            GateError::Claimed { slot: 7 }
        );
        // The refused claim marked nothing: slots 0 and 1 are free.
        assert!(!gate.any_claimed([0, 1, 8]));
        // One request naming a slot twice is refused too, and leaves nothing behind.
        assert_eq!(
            gate.claim(&[run(10, 2), run(11, 1)]).unwrap_err(),
            GateError::Claimed { slot: 11 }
        );
        assert!(!gate.any_claimed(10..12));
        drop(first);
        assert!(gate.claim(&[run(0, 16)]).is_ok());
    }

    #[test]
    fn closing_keeps_a_running_claim_until_it_drops() {
        let gate = SlotGate::new(8, true);
        gate.open(0..4);
        let claim = gate.claim(&[run(0, 4)]).unwrap();
        gate.close(0..4);
        assert!(
            gate.any_claimed(0..4),
            "the write under way still owns them"
        );
        drop(claim);
        assert!(!gate.any_claimed(0..4));
    }

    #[test]
    #[should_panic(expected = "while a KV transfer writes it")]
    fn touching_a_claimed_slot_panics() {
        let gate = SlotGate::new(4, false);
        let _claim = gate.claim(&[run(1, 1)]).unwrap();
        gate.with_unclaimed(1, || ());
    }
}
