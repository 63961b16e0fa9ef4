//! One simulated engine: the reference engine's scheduler core, driven as its step loop drives
//! it (a step at a time, each step's outputs handed out when its modelled cost has passed, a
//! turn at once after any command), plus what the router knows of it.

use std::collections::HashMap;

use switchyard_engine::scheduler::{Core, Gauges, RequestId, Time};

/// Who waits for a core request's outputs: a leg of an attempt of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Waiter {
    pub request: usize,
    pub attempt: u32,
    pub leg: Leg,
}

/// What a core request is to the attempt that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Leg {
    /// The generation the client's tokens come from.
    Generation,
    /// D's prep_recv: its answer is the reservation.
    Reservation,
    /// P's prefill for remote_send (MLC): its output is the lease of the window to send.
    SendPrefill,
    /// P's one-token generation that keeps its prompt's KV (vLLM, SGLang): a finishing event,
    /// then the lease.
    HeldPrefill,
}

/// An engine's load as the router reads it (its `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f32,
}

impl Load {
    pub(super) fn of(gauges: &Gauges) -> Load {
        let total = gauges.kv_pages_used + gauges.kv_pages_free;
        Load {
            running: gauges.running as u32,
            waiting: gauges.waiting as u32,
            kv_usage: if total == 0 {
                0.0
            } else {
                gauges.kv_pages_used as f32 / total as f32
            },
        }
    }
}

pub(super) struct Engine {
    pub core: Core,
    /// A step is under way: its outputs are not out yet, and no other step may start.
    pub busy: bool,
    /// A command came since the last step: the engine steps as soon as it is free, as the
    /// engine's loop does when its command channel has something.
    pub commanded: bool,
    /// When the engine's next turn is scheduled, if it is; `epoch` tells that turn from
    /// earlier ones a command overtook.
    pub wake: Option<Time>,
    pub epoch: u64,
    pub waiters: HashMap<RequestId, Waiter>,
    /// Legs the router has in flight on the engine (the snapshot's exact count).
    pub in_flight: u32,
    /// Prompt tokens the router sent the engine that it has not prefilled yet (the
    /// snapshot's exact count).
    pub pending_prefill: u32,
    pub probed: Load,
    /// Modelled time of every step, for utilisation.
    pub busy_us: u64,
    pub steps: u64,
}

impl Engine {
    pub fn new(core: Core) -> Engine {
        Engine {
            core,
            busy: false,
            commanded: false,
            wake: None,
            epoch: 0,
            waiters: HashMap::new(),
            in_flight: 0,
            pending_prefill: 0,
            probed: Load::default(),
            busy_us: 0,
            steps: 0,
        }
    }
}
