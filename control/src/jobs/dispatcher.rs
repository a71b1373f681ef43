//! The leader's `JobDispatcher` actor (dispatch and retention): thin shells around [`super::dispatch::dispatch`]
//! and [`super::Jobs::compact`] that commit their decisions through Raft. Both read only the
//! applied state, so a new leader continues where the old one stopped.

use std::time::Duration;

use crate::command::Command;
use crate::context::Context;

/// The dispatcher looks at least this often (and whenever a job, node or replica changes).
const TICK: Duration = Duration::from_millis(500);
/// How often finished jobs past their retention are compacted.
const COMPACT_EVERY: Duration = Duration::from_secs(60);
/// Cluster setting: seconds finished jobs stay queryable.
pub const RETENTION_SETTING: &str = "jobs.retention_s";

/// The `JobDispatcher` actor's state.
pub struct JobDispatcher {
    ctx: Context,
    jobs_changed: tokio::sync::watch::Receiver<u64>,
    fleet_changed: tokio::sync::watch::Receiver<u64>,
    last_compact: tokio::time::Instant,
}

impl JobDispatcher {
    pub fn new(ctx: Context) -> Self {
        JobDispatcher {
            jobs_changed: ctx.sm.subscribe_jobs(),
            fleet_changed: ctx.sm.subscribe_changes(),
            last_compact: tokio::time::Instant::now(),
            ctx,
        }
    }
}

impl laneway_actors::Ticker for JobDispatcher {
    const KIND: &'static str = "job_dispatcher";

    /// One round: assign what can be assigned, compact when due, then wait for a job, node or
    /// replica change (or [`TICK`]).
    async fn tick(&mut self) -> Duration {
        if self.ctx.is_leader() {
            self.dispatch().await;
        }
        tokio::select! {
            _ = self.jobs_changed.changed() => {}
            _ = self.fleet_changed.changed() => {}
            _ = tokio::time::sleep(TICK) => {}
        }
        Duration::ZERO
    }
}

impl JobDispatcher {
    async fn dispatch(&mut self) {
        let ctx = &self.ctx;
        let suspect = ctx.heartbeats.suspect_nodes();
        let assignments = ctx
            .sm
            .with_jobs(|jobs, fleet, registry| super::dispatch::dispatch(fleet, registry, jobs, &suspect));
        if !assignments.is_empty() {
            let n = assignments.len();
            let cmd = Command::AssignJobs {
                assignments,
                at_ms: super::unix_ms(),
            };
            // Awaited: the next round reads the applied result, so nothing is assigned twice.
            match ctx.proposer.propose(cmd).await {
                Ok((index, r)) => {
                    // Chaos: assignments committed, not yet handed to any agent (they go out
                    // with each node's next heartbeat reply).
                    fail::fail_point!("jobs::after_assign");
                    match r.rejected {
                        Some(why) => tracing::warn!(%why, "some job assignments were refused"),
                        None => tracing::debug!(jobs = n, token = index, "jobs assigned"),
                    }
                }
                Err(e) => tracing::warn!(error = %e, "job assignments not committed; retrying"),
            }
        }
        if self.last_compact.elapsed() >= COMPACT_EVERY {
            self.last_compact = tokio::time::Instant::now();
            compact(ctx).await;
        }
    }
}

/// Forgets finished jobs older than the retention (`jobs.retention_s`, default 24 h).
async fn compact(ctx: &Context) {
    let retention_ms = match ctx.sm.get_setting(RETENTION_SETTING).0 {
        Some(v) => match v.parse::<u64>() {
            Ok(s) => s.saturating_mul(1000),
            Err(_) => {
                tracing::warn!(value = %v, "setting {RETENTION_SETTING} is not a number of seconds; using the default");
                super::DEFAULT_RETENTION_MS
            }
        },
        None => super::DEFAULT_RETENTION_MS,
    };
    let before_ms = super::unix_ms().saturating_sub(retention_ms);
    let due = ctx.sm.with_jobs(|jobs, _, _| jobs.any_finished_before(before_ms));
    if due {
        if let Err(e) = ctx.proposer.propose(Command::CompactJobs { before_ms }).await {
            tracing::warn!(error = %e, "job compaction not committed; retried later");
        }
    }
}
