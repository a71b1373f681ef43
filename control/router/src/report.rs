//! What the router tells the rest of the controller: one record per request into the meter and
//! the recent-requests ring, latencies for the dashboard, per-model load for the autoscaler, and
//! each lane's live status.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::time::Instant;

use super::*;
use lane::LaneStatus;
use laneway_core::registry::LaneKind;
use table::ModelRoute;

impl Router {
    /// Meters a request without counting it in the lanes' histograms or recent requests (a
    /// shadow copy: no caller waited for it).
    pub(super) fn meter_only(&self, rec: RequestRecord) {
        self.meter.add(&rec, rec.is_slow());
    }

    /// Queue and service latency histograms per lane.
    pub fn histograms(&self) -> &metrics::LaneHistograms {
        &self.histograms
    }

    /// This router's meter.
    pub fn meter(&self) -> &laneway_core::usage::Meter {
        &self.meter
    }

    /// Meters a request and keeps its record (the newest [`RECORDS_KEPT`]).
    pub fn record(&self, rec: RequestRecord) {
        // Slower than the lane's objective (its timeout when it sets none): what a rollout
        // judges a version's latency on. Only answers a replica gave count.
        let slow = rec.replica.is_some() && rec.is_slow();
        self.meter.add(&rec, slow);
        self.histograms.observe(&rec);
        tracing::debug!(target: "laneway::request", request_id = %rec.request_id, lane = %rec.lane, model = %rec.model, tenant = %rec.tenant, status = rec.status, replica = ?rec.replica, queue_ms = rec.queue_ms, service_ms = rec.service_ms, gpu_ms = ?rec.gpu_ms, "request");
        let mut r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == RECORDS_KEPT {
            r.pop_front();
        }
        r.push_back(rec);
    }

    /// Queue + service time (ms) of the requests a replica answered since `since_unix_ms`, by
    /// class (from the newest records kept).
    pub fn latencies_since(&self, since_unix_ms: u64) -> HashMap<String, Vec<f64>> {
        let r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: HashMap<String, Vec<f64>> = HashMap::new();
        // Records are kept in finishing order but stamped at arrival: look at all of them.
        for rec in r.iter() {
            if rec.replica.is_some() && rec.unix_ms >= since_unix_ms {
                out.entry(rec.class.clone())
                    .or_default()
                    .push(rec.queue_ms + rec.service_ms);
            }
        }
        out
    }

    /// The newest `n` records, of one class or all.
    pub fn recent(&self, class: Option<&str>, n: usize) -> Vec<RequestRecord> {
        let r = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<RequestRecord> = r
            .iter()
            .rev()
            .filter(|x| class.is_none_or(|c| x.class == c))
            .take(n)
            .cloned()
            .collect();
        out.reverse();
        out
    }

    /// Load per model on this router: requests on its replicas and waiting in its lane.
    pub fn model_load(&self) -> HashMap<String, laneway_core::scheduler::autoscale::ModelLoad> {
        let table = self.table();
        let now = Instant::now();
        table
            .models
            .values()
            .map(|m| {
                let load = laneway_core::scheduler::autoscale::ModelLoad {
                    in_flight: m.replicas.iter().map(|s| s.load()).sum(),
                    waiting: m.lane.lock().waiting_for(&m.name) as u32,
                    ttft_p99_ms: m
                        .llm
                        .as_ref()
                        .and_then(|_| self.llm_stats.ttft_p99(&m.public, llm::SIGNAL_WINDOW, now))
                        .map(|(p99, _)| p99),
                    ..Default::default()
                };
                (m.name.clone(), load)
            })
            .collect()
    }

    /// Live state of every lane on this router.
    pub fn lane_status(&self) -> Vec<LaneStatus> {
        let now = Instant::now();
        let table = self.table();
        let mut out: Vec<LaneStatus> = table
            .lanes
            .values()
            .filter_map(|lane| {
                let class = table.classes.get(&lane.class)?;
                let routes: Vec<&Arc<ModelRoute>> =
                    table.models.values().filter(|m| m.class.name == class.name).collect();
                let slots = routes
                    .iter()
                    .flat_map(|m| m.replicas.iter())
                    .map(|s| s.max_in_flight)
                    .sum();
                let in_flight = routes.iter().flat_map(|m| m.replicas.iter()).map(|s| s.load()).sum();
                let ready = routes.iter().map(|m| m.replicas.len()).sum();
                let short = self.sync_short(class, now);
                let jobs = (class.lane == LaneKind::Durable).then(|| self.durable_status(&routes));
                let mut s = lane.lock();
                let (queue_depth, in_flight) = match &jobs {
                    Some(j) => (
                        j["queued"].as_u64().unwrap_or(0) as usize,
                        (j["assigned"].as_u64().unwrap_or(0) + j["running"].as_u64().unwrap_or(0)) as u32,
                    ),
                    None => (s.depth(), in_flight),
                };
                Some(LaneStatus {
                    class: class.name.clone(),
                    lane: class.lane.to_string(),
                    level: s.level_name(short).to_string(),
                    queue_depth,
                    drain_per_s: s.drain.measured(now),
                    pressure: s.pressure,
                    in_flight,
                    slots,
                    jobs,
                    ready_replicas: ready,
                    counters: serde_json::to_value(s.counters).unwrap_or_default(),
                    level_for_s: now.saturating_duration_since(s.overload.changed_at).as_secs_f64(),
                    slo_p99_ms: class.slo_p99_ms.map(|m| m.as_ms()),
                    ttft_slo_p99_ms: class.llm.as_ref().and_then(|l| l.ttft_slo_p99_ms).map(|m| m.as_ms()),
                    itl_slo_p99_ms: class.llm.as_ref().and_then(|l| l.itl_slo_p99_ms).map(|m| m.as_ms()),
                    llm: self.llm_stats.summary(&class.name, now),
                    overflow: table.overflows.get(&class.name).map(|o| o.status(self.now_ms(now))),
                })
            })
            .collect();
        out.sort_by(|a, b| a.class.cmp(&b.class));
        out
    }
}
