//! The router side of the meter: sums what this controller's router served and commits it to
//! the ledger every [`REPORT_EVERY`], through the leader.
//!
//! A report that may not have been delivered is sent again unchanged (same sequence number)
//! until one attempt is answered, while new usage waits for the next report: the ledger skips
//! a sequence it has applied, so a lost reply never counts a request twice, and usage is never
//! dropped because the leader was changing.

use std::time::Duration;

/// How often a router commits its usage.
pub const REPORT_EVERY: Duration = Duration::from_secs(5);

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
