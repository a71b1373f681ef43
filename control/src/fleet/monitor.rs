//! The `NodeMonitor` actor: on the leader, turns heartbeat silence into committed liveness
//! transitions (the decision is [`super::liveness::decide`]; this only feeds and carries it).

use std::time::Duration;

use tokio::time::Instant;

use super::liveness::decide;
use super::Liveness;
use crate::command::Command;
use crate::context::Context;

/// How often the monitor looks.
pub const TICK: Duration = Duration::from_millis(500);

/// The `NodeMonitor` actor's state, for one term.
pub struct NodeMonitor {
    ctx: Context,
    /// When this node started leading the term.
    since: Instant,
    dead_after: Duration,
}

impl NodeMonitor {
    /// A node silent for `dead_after` (counted from when it was last heard, or from the start
    /// of this term when this leader has not heard it yet) is declared down.
    pub fn new(ctx: Context, since: Instant, dead_after: Duration) -> Self {
        NodeMonitor { ctx, since, dead_after }
    }
}

impl laneway_actors::Ticker for NodeMonitor {
    const KIND: &'static str = "node_monitor";

    async fn tick(&mut self) -> Duration {
        let ctx = &self.ctx;
        if !ctx.is_leader() {
            return TICK;
        }
        let dead_after = self.dead_after;
        let nodes = ctx.sm.node_liveness();
        let transitions = decide(
            &nodes,
            &ctx.heartbeats.last_seen(),
            self.since,
            Instant::now(),
            dead_after,
        );
        // Proposed together, so a rack going dark is a few batched entries, not one round
        // trip per node.
        let proposals = transitions.into_iter().map(|t| {
            let ctx = ctx.clone();
            async move {
                let up = t.to == Liveness::Up;
                let cmd = if up {
                    Command::SetNodeLiveness {
                        node_id: t.node_id.clone(),
                        up,
                    }
                } else {
                    // Down and fenced in one entry: its jobs go back to the queue at once.
                    Command::NodeDown {
                        node_id: t.node_id.clone(),
                        at_ms: crate::jobs::unix_ms(),
                    }
                };
                match ctx.proposer.propose(cmd).await {
                    Ok(_) if up => tracing::info!(node = %t.node_id, "node is back up"),
                    Ok(_) => tracing::warn!(node = %t.node_id, silent_for = ?dead_after, "node declared down"),
                    Err(e) => tracing::warn!(node = %t.node_id, error = %e, "could not commit a liveness change"),
                }
            }
        });
        futures::future::join_all(proposals).await;
        TICK
    }
}
