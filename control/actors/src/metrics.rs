//! The board as Prometheus series (registered under the caller's prefix, `laneway` for both
//! controllers and agents): `laneway_actor_up`, `laneway_actor_restarts_total`,
//! `laneway_actor_last_tick_age_seconds` and `laneway_actor_crash_loop`, each by `actor`.
//! Actors stopped by design (a leader's actors on a follower) have no `up` series, so
//! `laneway_actor_up == 0` always means one that should run does not.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::board::{ActorBoard, ActorState};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActorLabel {
    actor: String,
}

/// Registers the board's series in `r` (read now: call at scrape time).
pub fn register(r: &mut Registry, board: &ActorBoard) {
    let up = Family::<ActorLabel, Gauge>::default();
    let restarts = Family::<ActorLabel, Counter>::default();
    let age = Family::<ActorLabel, Gauge<f64, AtomicU64>>::default();
    let crash_loop = Family::<ActorLabel, Gauge>::default();
    for a in board.snapshot() {
        let l = ActorLabel { actor: a.name.clone() };
        restarts.get_or_create(&l).inc_by(a.restarts);
        if a.state == ActorState::Stopped {
            continue;
        }
        up.get_or_create(&l).set(i64::from(a.state == ActorState::Running));
        crash_loop.get_or_create(&l).set(i64::from(a.crash_loop));
        if let Some(ms) = a.last_tick_ms_ago {
            age.get_or_create(&l).set(ms as f64 / 1000.0);
        }
    }
    r.register(
        "actor_up",
        "1 while the actor runs, 0 while its supervisor restarts it",
        up,
    );
    r.register(
        "actor_restarts",
        "Restarts of the actor after a failure (panic, error, or an unexpected stop) since the process started",
        restarts,
    );
    r.register_with_unit(
        "actor_last_tick_age",
        "Time since the actor last finished a round of its loop (a hung actor grows this)",
        Unit::Seconds,
        age,
    );
    r.register(
        "actor_crash_loop",
        "1 while the actor failed 10 times within 5 minutes (still restarted, at the longest back-off)",
        crash_loop,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarting_actor_reads_down_with_its_restarts_and_a_stopped_one_has_no_up_series() {
        let b = ActorBoard::new();
        b.started("Scheduler", Some("LeaderScope"));
        b.started("NodeMonitor", Some("LeaderScope"));
        b.failed("Scheduler", "boom", false);
        b.stopped("NodeMonitor");
        let mut r = Registry::with_prefix("laneway");
        register(&mut r, &b);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        assert!(out.contains(r#"laneway_actor_up{actor="Scheduler"} 0"#), "{out}");
        assert!(
            out.contains(r#"laneway_actor_restarts_total{actor="Scheduler"} 1"#),
            "{out}"
        );
        assert!(!out.contains(r#"laneway_actor_up{actor="NodeMonitor"}"#), "{out}");
    }
}
