//! The leader's view of load per model: every controller's router reports its own once a
//! second (the leader's directly, the others through the admin API), and the fast loop reads
//! the sum of the fresh reports. Like heartbeats, load never enters the Raft log.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::autoscale::ModelLoad;
use crate::raft_types::NodeId;

/// A report older than this is ignored (its router stopped reporting: gone or cut off).
pub const REPORT_TTL: Duration = Duration::from_secs(3);

/// One router's last report: when it came and the load per model.
type Report = (Instant, HashMap<String, ModelLoad>);

/// Load reports by controller.
#[derive(Default)]
pub struct LoadBoard {
    reports: Mutex<HashMap<NodeId, Report>>,
}

impl LoadBoard {
    pub fn record(&self, controller: NodeId, load: HashMap<String, ModelLoad>, now: Instant) {
        self.reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(controller, (now, load));
    }

    /// Every reporter from `from` up with a fresh report: (reporter, in flight, waiting).
    pub fn fresh_from(&self, from: NodeId, now: Instant) -> Vec<(NodeId, u32, u32)> {
        let reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<_> = reports
            .iter()
            .filter(|(r, (at, _))| **r >= from && now.saturating_duration_since(*at) <= REPORT_TTL)
            .map(|(r, (_, load))| {
                let (f, w) = load.values().fold((0, 0), |(f, w), l| (f + l.in_flight, w + l.waiting));
                (*r, f, w)
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Load per model summed over the routers that reported within [`REPORT_TTL`].
    pub fn total(&self, now: Instant) -> HashMap<String, ModelLoad> {
        let mut out: HashMap<String, ModelLoad> = HashMap::new();
        let reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        for (at, load) in reports.values() {
            if now.saturating_duration_since(*at) > REPORT_TTL {
                continue;
            }
            for (model, l) in load {
                let e = out.entry(model.clone()).or_default();
                e.in_flight += l.in_flight;
                e.waiting += l.waiting;
                // The worst router's TTFT: a lane is as late as its slowest entry point.
                e.ttft_p99_ms = match (e.ttft_p99_ms, l.ttft_p99_ms) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_reports_are_summed_and_stale_ones_ignored() {
        let b = LoadBoard::default();
        let t0 = Instant::now();
        let l = |f, w| {
            HashMap::from([(
                "m".to_string(),
                ModelLoad {
                    in_flight: f,
                    waiting: w,
                    ..Default::default()
                },
            )])
        };
        b.record(1, l(4, 1), t0);
        b.record(2, l(6, 0), t0 + Duration::from_secs(2));
        assert_eq!(
            b.total(t0 + Duration::from_secs(2))["m"],
            ModelLoad {
                in_flight: 10,
                waiting: 1,
                ..Default::default()
            }
        );
        // Controller 1 stopped reporting.
        assert_eq!(
            b.total(t0 + Duration::from_secs(4))["m"],
            ModelLoad {
                in_flight: 6,
                waiting: 0,
                ..Default::default()
            }
        );
        // A newer report replaces the older one of the same controller.
        b.record(2, l(1, 0), t0 + Duration::from_secs(4));
        assert_eq!(b.total(t0 + Duration::from_secs(4))["m"].in_flight, 1);
    }
}
