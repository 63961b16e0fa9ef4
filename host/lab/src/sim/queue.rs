//! The simulation's agenda: events due at virtual times, taken earliest first, ties in the
//! order they were scheduled (a sequence number), so a run never depends on a heap's whims.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use switchyard_engine::scheduler::Time;

/// Events in due order.
#[derive(Debug)]
pub(super) struct Agenda<E> {
    heap: BinaryHeap<Due<E>>,
    next_seq: u64,
}

#[derive(Debug)]
struct Due<E> {
    at: Time,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Due<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Due<E> {}

impl<E> PartialOrd for Due<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Reversed: `BinaryHeap` pops its greatest, the agenda its earliest.
impl<E> Ord for Due<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl<E> Default for Agenda<E> {
    fn default() -> Self {
        Agenda {
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }
}

impl<E> Agenda<E> {
    pub(super) fn schedule(&mut self, at: Time, event: E) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Due { at, seq, event });
    }

    /// The earliest event, and when it is due.
    pub(super) fn pop(&mut self) -> Option<(Time, E)> {
        self.heap.pop().map(|due| (due.at, due.event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_and_ties_in_scheduling_order() {
        let mut agenda = Agenda::default();
        let t = Time::from_micros;
        agenda.schedule(t(5), "b");
        agenda.schedule(t(1), "a");
        agenda.schedule(t(5), "c");
        agenda.schedule(t(5), "d");
        let order: Vec<_> = std::iter::from_fn(|| agenda.pop()).collect();
        assert_eq!(order, [(t(1), "a"), (t(5), "b"), (t(5), "c"), (t(5), "d")]);
    }
}
