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
        // Up to LIVENESS_BATCH transitions per log entry: a rack going dark, or a whole fleet
        // whose agents were slow to find a new leader, is a few entries (one apply, one router
        // rebuild each), not one entry and round trip per node.
        let at_ms = crate::jobs::unix_ms();
        let commands: Vec<(String, bool, Command)> = transitions
            .into_iter()
            .map(|t| {
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
                        at_ms,
                    }
                };
                (t.node_id, up, cmd)
            })
            .collect();
        let proposals = commands.chunks(LIVENESS_BATCH).map(|chunk| {
            let ctx = ctx.clone();
            let cmd = Command::batch_of(chunk.iter().map(|(_, _, c)| c.clone()).collect());
            async move {
                match ctx.proposer.propose(cmd).await {
                    Ok((_, r)) => {
                        for why in r.refusals() {
                            tracing::warn!(%why, "liveness change refused");
                        }
                        for (node, up, _) in chunk {
                            if *up {
                                tracing::info!(%node, "node is back up");
                            } else {
                                tracing::warn!(%node, silent_for = ?dead_after, "node declared down");
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(nodes = chunk.len(), error = %e, "could not commit liveness changes; trying again next tick")
                    }
                }
            }
        });
        futures::future::join_all(proposals).await;
        TICK
    }
}

/// Liveness transitions committed in one log entry at most.
pub const LIVENESS_BATCH: usize = 256;
