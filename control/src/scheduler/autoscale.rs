//! The fast loop's decision, pure: how many replicas a model should have from the load its
//! lane sees. Up at once (a burst cannot wait), down only after the load has stayed low for a
//! stable window, one replica at a time, never below the warm floor.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// How long load must stay below what fewer replicas could carry before one is removed.
pub const STABLE_WINDOW: Duration = Duration::from_secs(30);

/// Load of one model, summed over the routers that reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelLoad {
    /// Requests on its replicas now.
    pub in_flight: u32,
    /// Requests waiting in its lane's queue for it.
    pub waiting: u32,
}

/// One model's inputs for a decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Inputs {
    pub load: ModelLoad,
    /// Replicas placed now.
    pub current: usize,
    /// Concurrency of one replica (its max batch).
    pub slots_per_replica: u32,
    /// Utilisation the lane aims for, 0–1 (1 − headroom).
    pub target: f64,
    pub floor: usize,
}

/// Why a decision came out as it did (for `lanectl lane show` and the log).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub desired: usize,
    pub reason: String,
}

/// Memory of the fast loop between ticks: when each model's load went low. Leader-local: a
/// new leader starts with none, which only delays the next scale-down by one window.
#[derive(Debug, Default)]
pub struct ScaleState {
    low_since: HashMap<String, Instant>,
}

/// Replicas needed to carry `load` at `target` utilisation.
pub fn needed(i: &Inputs) -> usize {
    let per_replica = f64::from(i.slots_per_replica.max(1)) * i.target.clamp(0.05, 1.0);
    let demand = f64::from(i.load.in_flight + i.load.waiting);
    (demand / per_replica).ceil() as usize
}

impl ScaleState {
    /// Decides one model's replica count at `now`.
    pub fn decide(&mut self, model: &str, i: &Inputs, now: Instant) -> Decision {
        let need = needed(i).max(i.floor);
        if need > i.current {
            self.low_since.remove(model);
            return Decision {
                desired: need,
                reason: format!(
                    "up: {} in flight + {} waiting need {need} replicas of {} slots at {:.0}% (have {})",
                    i.load.in_flight,
                    i.load.waiting,
                    i.slots_per_replica,
                    i.target * 100.0,
                    i.current
                ),
            };
        }
        if need < i.current {
            let since = *self.low_since.entry(model.to_string()).or_insert(now);
            if now.saturating_duration_since(since) >= STABLE_WINDOW {
                // One step, then a new window: a decline is followed, not jumped to.
                self.low_since.insert(model.to_string(), now);
                return Decision {
                    desired: i.current - 1,
                    reason: format!(
                        "down: load has needed {need} replicas or fewer for {} s (have {})",
                        STABLE_WINDOW.as_secs(),
                        i.current
                    ),
                };
            }
            return Decision {
                desired: i.current,
                reason: "holding: load is low, waiting out the stable window".into(),
            };
        }
        self.low_since.remove(model);
        Decision {
            desired: i.current,
            reason: "steady".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn inputs(in_flight: u32, current: usize) -> Inputs {
        Inputs {
            load: ModelLoad { in_flight, waiting: 0 },
            current,
            slots_per_replica: 8,
            target: 0.5,
            floor: 2,
        }
    }

    #[test]
    fn a_step_in_load_scales_up_within_one_tick() {
        let mut s = ScaleState::default();
        let now = Instant::now();
        // 2 replicas × 8 slots at 50% carry 8; 16 in flight need 4.
        let d = s.decide("m", &inputs(16, 2), now);
        assert_eq!(d.desired, 4, "{}", d.reason);
        // Waiting requests count too.
        let mut i = inputs(8, 2);
        i.load.waiting = 8;
        assert_eq!(s.decide("m", &i, now).desired, 4);
    }

    #[test]
    fn a_decline_scales_down_only_after_the_stable_window_one_step_at_a_time_and_never_below_the_floor() {
        let mut s = ScaleState::default();
        let t0 = Instant::now();
        assert_eq!(s.decide("m", &inputs(0, 5), t0).desired, 5);
        assert_eq!(s.decide("m", &inputs(0, 5), t0 + STABLE_WINDOW / 2).desired, 5);
        assert_eq!(s.decide("m", &inputs(0, 5), t0 + STABLE_WINDOW).desired, 4);
        // The next step waits a new window.
        assert_eq!(
            s.decide("m", &inputs(0, 4), t0 + STABLE_WINDOW + Duration::from_secs(1))
                .desired,
            4
        );
        assert_eq!(s.decide("m", &inputs(0, 4), t0 + STABLE_WINDOW * 2).desired, 3);
        assert_eq!(s.decide("m", &inputs(0, 3), t0 + STABLE_WINDOW * 3).desired, 2);
        assert_eq!(
            s.decide("m", &inputs(0, 2), t0 + STABLE_WINDOW * 9).desired,
            2,
            "the floor"
        );
        // A burst in the middle of a window resets it.
        let mut s = ScaleState::default();
        s.decide("m", &inputs(0, 4), t0);
        s.decide("m", &inputs(30, 4), t0 + Duration::from_secs(10));
        assert_eq!(
            s.decide("m", &inputs(0, 4), t0 + STABLE_WINDOW).desired,
            4,
            "the window restarted"
        );
    }

    proptest! {
        /// A noisy steady load (±20% around what 4 replicas carry at target) never makes the
        /// replica count move more than once per stable window, and never below the floor.
        #[test]
        fn noisy_steady_load_does_not_oscillate(noise in prop::collection::vec(-3i32..=3, 120)) {
            let mut s = ScaleState::default();
            let t0 = Instant::now();
            let mut current = 4usize;
            let mut changes = Vec::new();
            for (tick, n) in noise.iter().enumerate() {
                let now = t0 + Duration::from_secs(tick as u64);
                let d = s.decide("m", &inputs((14 + n) as u32, current), now);
                prop_assert!(d.desired >= 2);
                if d.desired != current {
                    changes.push((tick, d.desired > current));
                    current = d.desired;
                }
            }
            // Downs are at least a stable window apart.
            let downs: Vec<usize> = changes.iter().filter(|c| !c.1).map(|c| c.0).collect();
            for w in downs.windows(2) {
                prop_assert!(w[1] - w[0] >= STABLE_WINDOW.as_secs() as usize, "{:?}", changes);
            }
        }
    }
}
