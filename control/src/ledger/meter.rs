//! The router side of the meter: sums what this controller's router served and commits it to
//! the ledger every [`REPORT_EVERY`], through the leader.
//!
//! A report that may not have been delivered is sent again unchanged (same sequence number)
//! until one attempt is answered, while new usage waits for the next report: the ledger skips
//! a sequence it has applied, so a lost reply never counts a request twice, and usage is never
//! dropped because the leader was changing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::{Usage, UsageReport};
use crate::router::RequestRecord;

/// How often a router commits its usage.
pub const REPORT_EVERY: Duration = Duration::from_secs(5);
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

impl Default for Meter {
    fn default() -> Self {
        Self::new()
    }
}

impl Meter {
    pub fn new() -> Self {
        Meter {
            incarnation: uuid::Uuid::new_v4().simple().to_string(),
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

/// What one attempt to commit usage did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Nothing was waiting.
    Nothing,
    /// A report was committed (or refused for good: it will not be sent again).
    Delivered,
    /// A report is still pending (no leader, not delivered, or held back by the upgrade gate).
    Pending,
}

/// Commits the pending report, or a new one of what was counted since: through this
/// controller's proposer when it leads, else to the leader over the admin API.
pub async fn send_once(ctx: &crate::context::Context, leaders: &crate::client::AdminClient) -> Sent {
    let meter = ctx.router.meter();
    let Some(report) = meter.next_report(ctx.node_id, crate::jobs::unix_ms()) else {
        return Sent::Nothing;
    };
    let seq = report.seq;
    let requests: u64 = report.rows.iter().map(|r| r.requests).sum();
    let mut command = crate::command::Command::RecordUsage(report);
    if ctx.sm.check_allowed(&command).is_err() {
        // A cluster not yet finalized at format 9 cannot count slow requests: they are left
        // out (rollouts need format 9 anyway) rather than holding back the usage itself.
        if let crate::command::Command::RecordUsage(r) = &mut command {
            for u in &mut r.rows {
                u.slow = 0;
            }
        }
    }
    if let Err(e) = ctx.sm.check_allowed(&command) {
        // Not yet: the report stays pending (and usage keeps adding up in the meter) until
        // the upgrade is finalized.
        tracing::debug!(seq, error = %e, "usage report held back");
        return Sent::Pending;
    }
    let sent = match ctx.leader() {
        Some((id, _)) if id == ctx.node_id => ctx
            .proposer
            .propose(command)
            .await
            .map(|_| ())
            .map_err(|e| (e.to_string(), false)),
        Some((_, addr)) => {
            let crate::command::Command::RecordUsage(report) = command else {
                unreachable!("built above")
            };
            let req = laneway_proto::admin::UsageReportRequest {
                json: serde_json::to_string(&report).expect("usage reports serialize"),
            };
            leaders
                .call_one(&addr, |mut c| {
                    let req = req.clone();
                    async move { c.record_usage(req).await }
                })
                .await
                .map(|_| ())
                .map_err(|e| {
                    // Refused as such, not merely undelivered: sending it again cannot help.
                    let refused = matches!(e.code(), Some(tonic::Code::InvalidArgument | tonic::Code::OutOfRange));
                    (e.to_string(), refused)
                })
        }
        None => Err(("no leader".to_string(), false)),
    };
    match sent {
        Ok(()) => {
            meter.delivered(seq);
            Sent::Delivered
        }
        Err((e, true)) => {
            tracing::warn!(seq, requests, error = %e, "usage report refused by the leader; its requests are not in the ledger");
            meter.delivered(seq);
            Sent::Delivered
        }
        Err((e, false)) => {
            tracing::debug!(seq, error = %e, "usage report not committed yet; sending it again in {:?}", REPORT_EVERY);
            Sent::Pending
        }
    }
}

/// The `UsageMeter` actor: commits this router's usage every [`REPORT_EVERY`].
pub struct UsageMeter {
    ctx: crate::context::Context,
    leaders: crate::client::AdminClient,
}

impl UsageMeter {
    pub fn new(ctx: crate::context::Context) -> Self {
        let leaders = ctx.controllers_client(Duration::from_secs(2));
        UsageMeter { ctx, leaders }
    }
}

impl laneway_actors::Ticker for UsageMeter {
    const KIND: &'static str = "usage_meter";

    async fn tick(&mut self) -> Duration {
        send_once(&self.ctx, &self.leaders).await;
        REPORT_EVERY
    }
}

/// At shutdown, after the router stopped taking requests: commits what it served and has
/// not reported, for up to `within`.
pub async fn flush(ctx: &crate::context::Context, within: Duration) {
    let leaders = ctx.controllers_client(Duration::from_millis(500));
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match send_once(ctx, &leaders).await {
            Sent::Nothing => return,
            Sent::Delivered => continue,
            Sent::Pending if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Sent::Pending => {
                let left = ctx.router.meter().unreported_requests();
                tracing::warn!(unreported = left, "stopping with usage the ledger did not receive");
                return;
            }
        }
    }
}
