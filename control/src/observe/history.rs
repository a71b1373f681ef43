//! The last few minutes of each lane, sampled once a second for the dashboard: GPU
//! utilisation, queue depth, p99 latency, admitted and shed rates. Kept in memory on every
//! controller (it is a view, not state); Prometheus keeps the long history.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use serde::Serialize;

use crate::router::lane::LaneStatus;

/// Samples kept per lane (one a second: five minutes).
pub const KEPT: usize = 300;
/// Latency percentiles are taken over the requests that finished in this window.
pub const LATENCY_WINDOW_MS: u64 = 5_000;
/// Operational events kept (scaling, placement, replicas that cannot be placed).
const EVENTS_KEPT: usize = 1_000;

/// One second of one lane.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_ms: u64,
    /// Mean utilisation of the GPUs running the lane's replicas (leader only: heartbeats go
    /// there).
    pub gpu_util_pct: Option<f64>,
    pub queue_depth: f64,
    pub in_flight: f64,
    /// p99 of queue + service time of the requests served in the last few seconds.
    pub p99_ms: Option<f64>,
    pub admitted_per_s: f64,
    /// Refused, throttled and expired per second.
    pub shed_per_s: f64,
    /// Language-model lanes: p99 of time to first token and of inter-token gaps over the last
    /// few seconds.
    #[serde(default)]
    pub ttft_p99_ms: Option<f64>,
    #[serde(default)]
    pub itl_p99_ms: Option<f64>,
}

/// What the leader's loops decided, with why: for `lanectl events` and `lanectl lane show`.
/// Kept in the leader's memory (a new leader starts a new list); the decisions themselves are
/// committed through Raft.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct OpsEvent {
    pub at_ms: u64,
    /// `scale`, `placement`, `unplaced`, `cost-regression`.
    pub kind: String,
    /// The model or node it is about.
    pub subject: String,
    pub message: String,
}

#[derive(Default)]
pub struct History {
    lanes: Mutex<BTreeMap<String, VecDeque<Sample>>>,
    /// Last counter totals per lane (admitted, shed), for the rates.
    last: Mutex<HashMap<String, (u64, u64)>>,
    events: Mutex<VecDeque<OpsEvent>>,
}

impl History {
    /// Every lane's samples, oldest first.
    pub fn lanes(&self) -> BTreeMap<String, Vec<Sample>> {
        let lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        lanes
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().cloned().collect()))
            .collect()
    }

    /// Records an operational event.
    pub fn event(&self, kind: &str, subject: &str, message: String) {
        let mut es = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if es.len() == EVENTS_KEPT {
            es.pop_front();
        }
        es.push_back(OpsEvent {
            at_ms: crate::jobs::unix_ms(),
            kind: kind.to_string(),
            subject: subject.to_string(),
            message,
        });
    }

    /// Events at or after `since_ms`, oldest first.
    pub fn events_since(&self, since_ms: u64) -> Vec<OpsEvent> {
        let es = self.events.lock().unwrap_or_else(|p| p.into_inner());
        es.iter().filter(|e| e.at_ms >= since_ms).cloned().collect()
    }

    /// The last `n` scaling decisions, newest first.
    pub fn decisions(&self, n: usize) -> Vec<OpsEvent> {
        let es = self.events.lock().unwrap_or_else(|p| p.into_inner());
        es.iter().rev().filter(|e| e.kind == "scale").take(n).cloned().collect()
    }

    /// Keeps one sample of every lane, from what the sampler (`super::sampler`) read at
    /// `now_ms`.
    pub fn record(&self, now_ms: u64, observed: &Observed) {
        let Observed {
            lanes,
            latencies,
            util,
            token_p99,
        } = observed;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let mut kept = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        for l in lanes {
            let counter = |k: &str| l.counters.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
            let admitted = counter("admitted");
            let shed = counter("refused") + counter("throttled") + counter("expired");
            let (prev_admitted, prev_shed) = last
                .insert(l.class.clone(), (admitted, shed))
                .unwrap_or((admitted, shed));
            let sample = Sample {
                t_ms: now_ms,
                gpu_util_pct: util.get(&l.class).copied(),
                queue_depth: l.queue_depth as f64,
                in_flight: f64::from(l.in_flight),
                p99_ms: latencies.get(&l.class).and_then(|v| percentile(v, 0.99)),
                admitted_per_s: admitted.saturating_sub(prev_admitted) as f64,
                shed_per_s: shed.saturating_sub(prev_shed) as f64,
                ttft_p99_ms: token_p99.get(&l.class).and_then(|p| p.0),
                itl_p99_ms: token_p99.get(&l.class).and_then(|p| p.1),
            };
            let q = kept.entry(l.class.clone()).or_default();
            if q.len() == KEPT {
                q.pop_front();
            }
            q.push_back(sample);
        }
        kept.retain(|class, _| lanes.iter().any(|l| &l.class == class));
    }
}

/// What the sampler read of every lane at one instant.
pub struct Observed {
    pub lanes: Vec<LaneStatus>,
    /// Latencies of the last [`LATENCY_WINDOW_MS`] per class, ms.
    pub latencies: HashMap<String, Vec<f64>>,
    /// Mean GPU utilisation per class, %.
    pub util: HashMap<String, f64>,
    /// Time-to-first-token and inter-token p99 per class, ms.
    pub token_p99: HashMap<String, (Option<f64>, Option<f64>)>,
}

/// The `q` quantile (nearest rank) of `values`.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.99), None);
    }
}
