//! `LoadReporter`: every controller reports its router's load to the leader every
//! [`REPORT_EVERY`], for the lanes' fast loops (the leader's own straight into the board).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::client::AdminClient;
use crate::context::Context;

/// Actor events one load report carries at most (a crash loop reports 10 in 5 minutes).
pub const MAX_EVENTS_PER_REPORT: usize = 32;

/// Restarts of this controller's actors not yet told to the leader (kept when the leader
/// cannot be reached; the oldest go first when more pile up).
pub type ActorEvents = Arc<Mutex<VecDeque<laneway_proto::admin::ActorEvent>>>;

/// How often each controller reports its router's load to the leader.
pub const REPORT_EVERY: Duration = Duration::from_millis(500);

/// A router's load per model, as a load report carries it (a controller's router or a
/// router-only process).
pub fn model_reports(
    load: std::collections::HashMap<String, crate::scheduler::autoscale::ModelLoad>,
) -> Vec<laneway_proto::admin::ModelLoadReport> {
    load.into_iter()
        .map(|(model, l)| laneway_proto::admin::ModelLoadReport {
            model,
            in_flight: l.in_flight,
            waiting: l.waiting,
            ttft_p99_ms: l.ttft_p99_ms.unwrap_or(0.0),
        })
        .collect()
}

pub struct LoadReporter {
    ctx: Context,
    leaders: AdminClient,
    /// This controller's actor restarts, carried to the leader with the load.
    events: ActorEvents,
}

impl LoadReporter {
    pub fn new(ctx: Context, events: ActorEvents) -> Self {
        let leaders = ctx.controllers_client(Duration::from_millis(500));
        LoadReporter { ctx, leaders, events }
    }
}

impl laneway_actors::Ticker for LoadReporter {
    const KIND: &'static str = "load_reporter";

    async fn tick(&mut self) -> Duration {
        let ctx = &self.ctx;
        let load = ctx.router.model_load();
        match ctx.leader() {
            Some((id, _)) if id == ctx.node_id => {
                ctx.load.record(ctx.node_id, load, Instant::now());
                // Restarts from before this node led: its own history has them now.
                let queued: Vec<_> = self
                    .events
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain(..)
                    .collect();
                for e in queued {
                    ctx.history
                        .event("actor", &e.actor, format!("failed and restarted: {}", e.message));
                }
            }
            Some((_, addr)) => {
                let actor_events: Vec<_> = {
                    let q = self.events.lock().unwrap_or_else(|p| p.into_inner());
                    q.iter().take(MAX_EVENTS_PER_REPORT).cloned().collect()
                };
                let report = laneway_proto::admin::LoadReport {
                    actor_events: actor_events.clone(),
                    controller_id: ctx.node_id,
                    models: model_reports(load),
                };
                let sent = self
                    .leaders
                    .call_one(&addr, |mut c| {
                        let report = report.clone();
                        async move { c.report_load(report).await }
                    })
                    .await;
                match sent {
                    Ok(_) => {
                        // Delivered: those events are the leader's now.
                        let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
                        for _ in 0..actor_events.len().min(q.len()) {
                            q.pop_front();
                        }
                    }
                    Err(e) => {
                        tracing::debug!(leader = %addr, error = %e, "load report not delivered; the next one follows in a second")
                    }
                }
            }
            None => {}
        }
        REPORT_EVERY
    }
}
