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
    /// Language models: time to first token p99 over the last seconds, the worst router's.
    pub ttft_p99_ms: Option<f64>,
    /// Language models: requests waiting inside the replicas' engines (heartbeats).
    pub engine_waiting: u32,
    /// Language models: ready replicas whose engine has nothing waiting (heartbeats).
    pub engines_without_waiting: u32,
    /// Language models: mean KV-cache usage of the replicas, 0–1 (heartbeats).
    pub kv_cache: Option<f64>,
}

/// What the lane scales on (its class's `llm.scale_on`; in-flight for every other lane).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Signal {
    InFlight,
    Waiting,
    KvCache { target: f64 },
    Ttft { slo_ms: f64 },
}

impl Signal {
    pub fn of(class: &crate::registry::Class) -> Signal {
        use crate::registry::ScaleSignal;
        let Some(l) = &class.llm else { return Signal::InFlight };
        match l.scale_on {
            ScaleSignal::InFlight => Signal::InFlight,
            ScaleSignal::Waiting => Signal::Waiting,
            ScaleSignal::KvCache => Signal::KvCache {
                target: f64::from(l.kv_cache_target_pct) / 100.0,
            },
            ScaleSignal::Ttft => match l.ttft_slo_p99_ms {
                Some(slo) => Signal::Ttft { slo_ms: slo.as_ms() },
                None => Signal::InFlight,
            },
        }
    }
}

/// One model's inputs for a decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Inputs {
    pub load: ModelLoad,
    /// Replicas placed now.
    pub current: usize,
    /// Of those, the ones Ready. Signals read from the replicas (engine queues, KV cache,
    /// TTFT) count only what the Ready ones carry: a replica still starting reads as empty,
    /// so a scale-up is not repeated while the replicas it added warm up.
    pub ready: usize,
    /// Concurrency of one replica (its max batch).
    pub slots_per_replica: u32,
    /// Utilisation the lane aims for, 0–1 (1 − headroom).
    pub target: f64,
    pub floor: usize,
    pub signal: Signal,
    /// The longest start of one of its replicas as the agents measured it (placement to
    /// Ready), when one is known: a replica is not given back sooner than it takes to get one
    /// back, so the stable window is at least this long.
    pub cold_start: Option<Duration>,
}

impl Inputs {
    /// How long load must stay low before a replica is removed.
    pub fn stable_window(&self) -> Duration {
        self.cold_start.map_or(STABLE_WINDOW, |c| c.max(STABLE_WINDOW))
    }
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

/// Replicas the lane's signal asks for, and the reading it rests on. A signal without a
/// reading (no traffic, no replica reporting) falls back to in-flight.
pub fn needed_by_signal(i: &Inputs) -> (usize, String) {
    let by_in_flight = || {
        (
            needed(i),
            format!(
                "{} in flight + {} waiting need {} replicas of {} slots at {:.0}%",
                i.load.in_flight,
                i.load.waiting,
                needed(i),
                i.slots_per_replica,
                i.target * 100.0
            ),
        )
    };
    let current = i.current.max(1) as f64;
    let ready = i.ready.min(i.current).max(1);
    match i.signal {
        Signal::InFlight => by_in_flight(),
        Signal::Waiting => {
            let waiting = i.load.waiting + i.load.engine_waiting;
            if waiting == 0 {
                // Nothing waits: keep what carries the running requests.
                let running = Inputs {
                    load: ModelLoad { waiting: 0, ..i.load },
                    ..*i
                };
                let n = needed(&running);
                return (n, format!("nothing waiting; {} running need {n}", i.load.in_flight));
            }
            if i.load.waiting == 0 && i.load.engines_without_waiting > 0 {
                // Requests queued inside one engine stay there: another replica would not take
                // them, and a replica with room exists for the next ones.
                return (
                    i.current,
                    format!(
                        "{} waiting in the engines while {} replica(s) have nothing waiting",
                        i.load.engine_waiting, i.load.engines_without_waiting
                    ),
                );
            }
            let more = waiting.div_ceil(i.slots_per_replica.max(1)) as usize;
            let n = (ready + more).max(i.current);
            (
                n,
                format!(
                    "{waiting} waiting ({} at the router, {} in the engines) need {more} more than the {ready} ready",
                    i.load.waiting, i.load.engine_waiting
                ),
            )
        }
        Signal::KvCache { target } => match i.load.kv_cache {
            Some(kv) => {
                // Replicas still starting hold no cache yet: the ready ones' usage, spread
                // over what is placed, is what the next ones will see.
                let n = (ready as f64 * kv / target.max(0.01)).ceil() as usize;
                (
                    n,
                    format!(
                        "KV cache {:.0}% on {ready} ready against a {:.0}% target",
                        kv * 100.0,
                        target * 100.0
                    ),
                )
            }
            None => by_in_flight(),
        },
        Signal::Ttft { slo_ms } => match i.load.ttft_p99_ms {
            // Replicas added and still starting: wait for them before reading TTFT again.
            Some(p99) if p99 > slo_ms && i.ready < i.current => (
                i.current,
                format!(
                    "TTFT p99 {p99:.0} ms over its {slo_ms:.0} ms objective; {} replica(s) still starting",
                    i.current - i.ready
                ),
            ),
            Some(p99) if p99 > slo_ms => {
                let n = ((current * p99 / slo_ms).ceil() as usize).max(i.current + 1);
                (n, format!("TTFT p99 {p99:.0} ms over its {slo_ms:.0} ms objective"))
            }
            // Between half the objective and the objective: hold.
            Some(p99) if p99 * 2.0 > slo_ms => (
                i.current,
                format!("TTFT p99 {p99:.0} ms within its {slo_ms:.0} ms objective"),
            ),
            Some(p99) => {
                let n = (current * p99 * 2.0 / slo_ms).ceil() as usize;
                (
                    n,
                    format!("TTFT p99 {p99:.0} ms, under half its {slo_ms:.0} ms objective"),
                )
            }
            None => by_in_flight(),
        },
    }
}

impl ScaleState {
    /// Decides one model's replica count at `now`.
    pub fn decide(&mut self, model: &str, i: &Inputs, now: Instant) -> Decision {
        let (by_signal, why) = needed_by_signal(i);
        let need = by_signal.max(i.floor);
        if need > i.current {
            self.low_since.remove(model);
            return Decision {
                desired: need,
                reason: format!("up to {need}: {why} (have {})", i.current),
            };
        }
        if need < i.current {
            let since = *self.low_since.entry(model.to_string()).or_insert(now);
            let window = i.stable_window();
            if now.saturating_duration_since(since) >= window {
                // One step, then a new window: a decline is followed, not jumped to.
                self.low_since.insert(model.to_string(), now);
                return Decision {
                    desired: i.current - 1,
                    reason: format!(
                        "down: load has needed {need} replicas or fewer for {} s{} (have {}; now {why})",
                        window.as_secs(),
                        if window > STABLE_WINDOW {
                            ", as long as a replica of it takes to start"
                        } else {
                            ""
                        },
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
            load: ModelLoad {
                in_flight,
                ..ModelLoad::default()
            },
            current,
            ready: current,
            slots_per_replica: 8,
            target: 0.5,
            floor: 2,
            signal: Signal::InFlight,
            cold_start: None,
        }
    }

    /// A model whose replicas take longer to start than the stable window keeps a replica it
    /// does not need for as long as one takes to start; a fast one for the window.
    #[test]
    fn a_slow_starting_model_is_scaled_down_no_sooner_than_it_starts() {
        let t0 = Instant::now();
        let slow = Inputs {
            cold_start: Some(Duration::from_secs(120)),
            ..inputs(0, 5)
        };
        let mut s = ScaleState::default();
        assert_eq!(s.decide("m", &slow, t0).desired, 5);
        assert_eq!(
            s.decide("m", &slow, t0 + STABLE_WINDOW).desired,
            5,
            "30 s is not enough"
        );
        let d = s.decide("m", &slow, t0 + Duration::from_secs(120));
        assert_eq!(d.desired, 4);
        assert!(
            d.reason.contains("120 s") && d.reason.contains("takes to start"),
            "{}",
            d.reason
        );
        let fast = Inputs {
            cold_start: Some(Duration::from_secs(3)),
            ..inputs(0, 5)
        };
        let mut s = ScaleState::default();
        s.decide("m", &fast, t0);
        assert_eq!(
            s.decide("m", &fast, t0 + STABLE_WINDOW).desired,
            4,
            "never shorter than the window"
        );
    }

    /// Language-model signals: a TTFT breach adds replicas in proportion, engine-side waiting
    /// and KV-cache pressure add them too, and a signal without a reading falls back to
    /// in-flight.
    #[test]
    fn language_model_lanes_scale_on_their_own_signal() {
        let now = Instant::now();
        let mut s = ScaleState::default();
        let mut i = inputs(4, 2);
        i.signal = Signal::Ttft { slo_ms: 500.0 };
        i.load.ttft_p99_ms = Some(1500.0);
        let d = s.decide("m", &i, now);
        assert_eq!(d.desired, 6, "3x over the objective: 3x the replicas ({})", d.reason);
        assert!(d.reason.contains("TTFT p99 1500 ms"), "{}", d.reason);
        i.load.ttft_p99_ms = Some(510.0);
        assert_eq!(s.decide("m", &i, now).desired, 3, "just over: at least one more");
        i.load.ttft_p99_ms = Some(400.0);
        assert_eq!(s.decide("m", &i, now).desired, 2, "within the objective: hold");
        i.load.ttft_p99_ms = None;
        i.load.in_flight = 40;
        assert_eq!(s.decide("m", &i, now).desired, 10, "no TTFT reading: in-flight decides");

        let mut i = inputs(8, 2);
        i.signal = Signal::Waiting;
        i.load.engine_waiting = 9;
        let d = s.decide("w", &i, now);
        assert_eq!(
            d.desired, 4,
            "9 waiting in the engines need 2 more replicas of 8 ({})",
            d.reason
        );

        let mut i = inputs(1, 4);
        i.signal = Signal::KvCache { target: 0.75 };
        i.load.kv_cache = Some(0.9);
        assert_eq!(s.decide("k", &i, now).desired, 5, "90% KV at a 75% target: 4 × 1.2");
        i.load.kv_cache = Some(0.3);
        let held = s.decide("k", &i, now);
        assert_eq!(held.desired, 4, "down waits for the stable window");
        let later = s.decide("k", &i, now + STABLE_WINDOW);
        assert_eq!(later.desired, 3, "{}", later.reason);

        // While the replicas a scale-up added are starting, the same readings add nothing more.
        let mut s = ScaleState::default();
        let mut i = inputs(1, 2);
        i.ready = 1;
        i.signal = Signal::KvCache { target: 0.5 };
        i.load.kv_cache = Some(0.73);
        assert_eq!(
            s.decide("k", &i, now).desired,
            2,
            "1 ready at 73% needs 2: placed already"
        );
        i.signal = Signal::Waiting;
        i.load.engine_waiting = 1;
        assert_eq!(
            s.decide("w", &i, now).desired,
            2,
            "the waiting one goes to the starting replica"
        );
        i.ready = 2;
        i.load.engines_without_waiting = 1;
        assert_eq!(
            s.decide("w", &i, now).desired,
            2,
            "one engine's queue does not move to a replica that has room"
        );
        i.ready = 1;
        i.load.engines_without_waiting = 0;
        i.signal = Signal::Ttft { slo_ms: 500.0 };
        i.load.ttft_p99_ms = Some(1500.0);
        assert_eq!(s.decide("t", &i, now).desired, 2, "TTFT is read again once it is ready");
        i.ready = 2;
        assert_eq!(s.decide("t", &i, now).desired, 6);
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
