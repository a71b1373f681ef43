//! Usage as the router sees it: one [`RequestRecord`] per request, summed by the [`Meter`] into
//! the usage reports the ledger commits. In memory only: sending the reports through the leader
//! is the controller's (`laneway_control::ledger::meter`).

use std::collections::HashMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::ledger::{Usage, UsageReport};

/// One request as the router saw it; the meter's raw material.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestRecord {
    pub request_id: String,
    pub unix_ms: u64,
    pub lane: String,
    pub class: String,
    pub model: String,
    /// Model version that served it (the ledger compares versions' cost per request).
    #[serde(default)]
    pub version: String,
    pub tenant: String,
    pub status: u16,
    pub replica: Option<String>,
    pub product: Option<String>,
    pub mig_profile: Option<String>,
    pub queue_ms: f64,
    pub service_ms: f64,
    pub gpu_ms: Option<f64>,
    pub degraded: bool,
    /// Language models: tokens in and out (as the replica reported them, else estimated) and
    /// the time to the first token (streamed) or to the whole answer.
    #[serde(default)]
    pub input_tokens: u32,
    #[serde(default)]
    pub output_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// What the overflow endpoint charged for it, micro-dollars (0: served by the fleet).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overflow_micros: u64,
    /// Its lane's objective, ms (`slo_p99_ms`, else the request timeout): a request slower
    /// than this is metered as slow (what a rollout judges latency on).
    #[serde(skip)]
    pub objective_ms: f64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl RequestRecord {
    /// Whether it took longer than its lane's objective.
    pub fn is_slow(&self) -> bool {
        self.queue_ms + self.service_ms > self.objective_ms
    }
}

/// Rows in one report at most (about 300 bytes each, well under the admin API's 1 MiB): a
/// larger backlog goes out over the next reports instead of in one that would be refused.
pub const MAX_REPORT_ROWS: usize = 2_000;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    class: String,
    lane: String,
    model: String,
    version: String,
    tenant: String,
    node: Option<String>,
    product: Option<String>,
    mig_profile: Option<String>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    requests: u64,
    ok: u64,
    gpu_us: u64,
    input_tokens: u64,
    output_tokens: u64,
    slow: u64,
    overflow_nanos: u64,
}

/// Usage this router served and has not yet reported.
pub struct Meter {
    incarnation: String,
    state: Mutex<MeterState>,
}

#[derive(Default)]
struct MeterState {
    rows: HashMap<Key, Sums>,
    seq: u64,
    /// A report handed out and not yet confirmed delivered.
    pending: Option<UsageReport>,
}

impl Meter {
    /// A meter whose reports carry `incarnation` (a fresh random id per process, so the ledger
    /// tells this router's sequence numbers from a restarted one's).
    pub fn new(incarnation: String) -> Self {
        Meter {
            incarnation,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one request the router answered; `slow`: it took longer than its lane's
    /// objective.
    pub fn add(&self, rec: &RequestRecord, slow: bool) {
        let node = rec
            .replica
            .as_deref()
            .and_then(|r| r.split_once('/'))
            .map(|(node, _)| node.to_string());
        let key = Key {
            class: rec.class.clone(),
            lane: rec.lane.clone(),
            model: rec.model.clone(),
            version: rec.version.clone(),
            tenant: rec.tenant.clone(),
            node,
            product: rec.product.clone(),
            mig_profile: rec.mig_profile.clone(),
        };
        // A replica cannot have used more GPU time on a request than the router waited for
        // it: a broken or hostile header is clamped, never billed as years.
        let gpu_us = rec
            .gpu_ms
            .filter(|ms| ms.is_finite())
            .map_or(0, |ms| (ms.clamp(0.0, rec.service_ms.max(0.0)) * 1000.0).round() as u64);
        let mut s = self.lock();
        let sums = s.rows.entry(key).or_default();
        sums.requests += 1;
        sums.ok += u64::from((200..300).contains(&rec.status));
        sums.slow += u64::from(slow);
        sums.overflow_nanos = sums
            .overflow_nanos
            .saturating_add(rec.overflow_micros.saturating_mul(1000));
        sums.gpu_us = sums.gpu_us.saturating_add(gpu_us);
        // Tokens count only for requests a replica worked on (a refused request's estimate is
        // not usage).
        if rec.replica.is_some() {
            sums.input_tokens += u64::from(rec.input_tokens);
            sums.output_tokens += u64::from(rec.output_tokens);
        }
    }

    /// The report to send now: the one still pending, else a new one of everything counted
    /// since (`None` when there is nothing to report).
    pub fn next_report(&self, reporter: u64, at_ms: u64) -> Option<UsageReport> {
        let mut s = self.lock();
        if let Some(p) = &s.pending {
            return Some(p.clone());
        }
        if s.rows.is_empty() {
            return None;
        }
        let keys: Vec<Key> = s.rows.keys().take(MAX_REPORT_ROWS).cloned().collect();
        let rows: Vec<Usage> = keys
            .into_iter()
            .filter_map(|k| s.rows.remove_entry(&k))
            .map(|(k, v)| Usage {
                class: k.class,
                lane: k.lane,
                model: k.model,
                version: k.version,
                tenant: k.tenant,
                node: k.node,
                product: k.product,
                mig_profile: k.mig_profile,
                requests: v.requests,
                ok: v.ok,
                gpu_us: v.gpu_us,
                input_tokens: v.input_tokens,
                output_tokens: v.output_tokens,
                slow: v.slow,
                overflow_nanos: v.overflow_nanos,
            })
            .collect();
        s.seq += 1;
        let report = UsageReport {
            reporter,
            incarnation: self.incarnation.clone(),
            seq: s.seq,
            at_ms,
            rows,
        };
        s.pending = Some(report.clone());
        Some(report)
    }

    /// The pending report `seq` was committed (or found already applied), or refused for
    /// good: either way the next report is a new one.
    pub fn delivered(&self, seq: u64) {
        let mut s = self.lock();
        if s.pending.as_ref().is_some_and(|p| p.seq == seq) {
            s.pending = None;
        }
    }

    /// Requests counted and not yet handed out in a report.
    pub fn unreported_requests(&self) -> u64 {
        self.lock().rows.values().map(|s| s.requests).sum()
    }
}
