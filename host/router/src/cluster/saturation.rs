//! Saturation: whether an endpoint has room for another request, judged from what its engine
//! reports (requests waiting in the engine's own queue, its KV-cache usage) and the legs this
//! router has in flight on it, each against a threshold.
//!
//! An endpoint's *load* is the highest of its signals over its threshold (1 = at the
//! threshold); its *saturation* is that load capped at 1, and it is *saturated* at 1. A signal
//! the engine does not report counts as 0: an engine whose `/metrics` lacks the gauges is
//! judged by the router's own in-flight count alone (when that is configured).
//!
//! **Dispatch**: a saturated endpoint is shown to policies as draining (no new request; those
//! in flight finish) while an endpoint of its role that is healthy and not saturated remains,
//! so every policy, whatever it reads of the load, plans on an endpoint with room. When every
//! endpoint of a role is saturated, none is hidden: the request goes to an engine's own queue
//! rather than failing, and the policy still sees each engine's real load to choose by. The
//! router's admission queue keeps its own limits (`--max-concurrent-requests`).
//!
//! **Autoscaling**: per model and role, the mean saturation of the ready endpoints, and a
//! desired number of replicas: `ceil(ready × mean load / target)`, i.e. enough endpoints for
//! each to run at the target saturation (the load uncapped, so a backlog asks for more than
//! one step).

use switchyard_contract::{EndpointSnapshot, Health, Role};

/// The thresholds at which an endpoint is saturated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Requests waiting in the engine's queue (llm-d's saturation detector's default: 5).
    pub waiting: u32,
    /// The share of the engine's KV cache in use, `0.0..=1.0`.
    pub kv_usage: f64,
    /// Legs this router has in flight on the endpoint; `None`: not judged.
    pub in_flight: Option<u32>,
    /// The saturation the desired-replica hint aims each endpoint at.
    pub target: f64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            waiting: 5,
            kv_usage: 0.95,
            in_flight: None,
            target: 0.8,
        }
    }
}

impl SaturationConfig {
    /// The endpoint's highest signal over its threshold: 0 idle, 1 saturated, above 1 a
    /// backlog beyond the threshold.
    pub fn load(&self, endpoint: &EndpointSnapshot) -> f64 {
        let over = |value: f64, threshold: f64| value / threshold;
        let waiting = over(
            f64::from(endpoint.waiting.unwrap_or(0)),
            f64::from(self.waiting),
        );
        let kv = over(f64::from(endpoint.kv_usage.unwrap_or(0.0)), self.kv_usage);
        let in_flight = self.in_flight.map_or(0.0, |threshold| {
            over(f64::from(endpoint.in_flight), f64::from(threshold))
        });
        waiting.max(kv).max(in_flight)
    }

    /// [`Self::load`] capped at 1.
    pub fn saturation(&self, endpoint: &EndpointSnapshot) -> f64 {
        self.load(endpoint).min(1.0)
    }

    pub fn is_saturated(&self, endpoint: &EndpointSnapshot) -> bool {
        self.load(endpoint) >= 1.0
    }

    /// Shows each saturated healthy endpoint as draining while a healthy endpoint of its role
    /// has room.
    pub fn hide_saturated(&self, endpoints: &mut [EndpointSnapshot]) {
        for role in [Role::Any, Role::Prefill, Role::Decode] {
            let of_role = |e: &EndpointSnapshot| e.role == role && e.health == Health::Healthy;
            let room = endpoints
                .iter()
                .any(|e| of_role(e) && !self.is_saturated(e));
            if !room {
                continue;
            }
            for endpoint in endpoints.iter_mut() {
                if of_role(endpoint) && self.is_saturated(endpoint) {
                    endpoint.health = Health::Draining;
                }
            }
        }
    }

    /// What an autoscaler reads of `ready`, the healthy endpoints of one model and role.
    pub fn demand<'a>(&self, ready: impl IntoIterator<Item = &'a EndpointSnapshot>) -> Demand {
        let (mut count, mut load, mut saturation) = (0u32, 0.0, 0.0);
        for endpoint in ready {
            count += 1;
            load += self.load(endpoint);
            saturation += self.saturation(endpoint);
        }
        if count == 0 {
            return Demand::default();
        }
        Demand {
            ready: count,
            saturation: saturation / f64::from(count),
            desired_replicas: (load / self.target).ceil().max(1.0) as u32,
        }
    }
}

/// One model's and role's figures for an autoscaler.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Demand {
    /// Healthy endpoints.
    pub ready: u32,
    /// Their mean saturation, `0.0..=1.0`; 0 with none ready.
    pub saturation: f64,
    /// `ceil(ready × mean load / target)`, at least 1 while one is ready; 0 with none ready
    /// (scale from zero on the router's queue depth).
    pub desired_replicas: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(id: u32, role: Role, waiting: u32, kv_usage: f32) -> EndpointSnapshot {
        EndpointSnapshot {
            role,
            waiting: Some(waiting),
            kv_usage: Some(kv_usage),
            ..EndpointSnapshot::synthetic(id)
        }
    }

    #[test]
    fn load_is_the_highest_signal_over_its_threshold() {
        let config = SaturationConfig {
            in_flight: Some(10),
            ..SaturationConfig::default()
        };
        let load = |waiting, kv_usage, in_flight| {
            config.load(&EndpointSnapshot {
                in_flight,
                ..endpoint(0, Role::Any, waiting, kv_usage)
            })
        };
        assert_eq!(load(0, 0.0, 0), 0.0);
        assert_eq!(load(1, 0.0, 0), 0.2, "1 of 5 waiting");
        assert_eq!(load(1, 0.0, 5), 0.5, "5 of 10 in flight");
        assert!((load(0, 0.76, 0) - 0.8).abs() < 1e-6, "KV 0.76 of 0.95");
        assert_eq!(
            load(15, 0.5, 2),
            3.0,
            "a backlog: three times the threshold"
        );
        let unreported = EndpointSnapshot::synthetic(0);
        assert_eq!(SaturationConfig::default().load(&unreported), 0.0);
        assert_eq!(config.saturation(&endpoint(0, Role::Any, 15, 0.0)), 1.0);
    }

    #[test]
    fn saturated_endpoints_are_hidden_only_while_one_of_their_role_has_room() {
        let config = SaturationConfig::default();
        let mut endpoints = vec![
            endpoint(0, Role::Prefill, 5, 0.1),
            endpoint(1, Role::Prefill, 0, 0.1),
            endpoint(2, Role::Decode, 0, 0.97),
            endpoint(3, Role::Decode, 9, 0.2),
            EndpointSnapshot {
                health: Health::NotReady,
                ..endpoint(4, Role::Any, 0, 0.0)
            },
            endpoint(5, Role::Any, 7, 0.0),
        ];
        config.hide_saturated(&mut endpoints);
        let health: Vec<_> = endpoints.iter().map(|e| e.health).collect();
        assert_eq!(
            health,
            [
                Health::Draining,
                Health::Healthy,
                // Every decode endpoint is saturated: both stay plannable.
                Health::Healthy,
                Health::Healthy,
                Health::NotReady,
                // The only other role-less endpoint is down: this one has no healthy peer.
                Health::Healthy,
            ]
        );
    }

    #[test]
    fn desired_replicas_run_each_at_the_target() {
        let config = SaturationConfig::default();
        let ready = [
            endpoint(0, Role::Decode, 5, 0.0),
            endpoint(1, Role::Decode, 10, 0.0),
            endpoint(2, Role::Decode, 0, 0.0),
        ];
        let demand = config.demand(&ready);
        assert_eq!(demand.ready, 3);
        assert!((demand.saturation - 2.0 / 3.0).abs() < 1e-9);
        // Loads 1 + 2 + 0 = 3 endpoints' worth at the threshold, 3.75 at 0.8 each.
        assert_eq!(demand.desired_replicas, 4);
        let idle = config.demand(&ready[2..]);
        assert_eq!((idle.saturation, idle.desired_replicas), (0.0, 1));
        assert_eq!(config.demand(&[]), Demand::default());
    }
}
