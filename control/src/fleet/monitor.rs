//! The node monitor: on the leader, turns heartbeat silence into committed liveness
//! transitions (the decision is [`super::liveness::decide`]; this only feeds and carries it).

use std::time::Duration;

use tokio::time::Instant;

use super::liveness::decide;
use super::Liveness;
use crate::command::Command;
use crate::context::Context;

/// How often the monitor looks.
pub const TICK: Duration = Duration::from_millis(500);

/// Runs until the task is aborted. A node silent for `dead_after` is declared down.
pub async fn run(ctx: Context, dead_after: Duration) {
    let mut leader_since: Option<Instant> = None;
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        if !ctx.is_leader() {
            if leader_since.take().is_some() {
                ctx.heartbeats.clear();
            }
            continue;
        }
        let since = *leader_since.get_or_insert_with(|| {
            // A new leader starts with an empty table: everyone gets `dead_after` to find it.
            ctx.heartbeats.clear();
            Instant::now()
        });
        let nodes = ctx.sm.node_liveness();
        let transitions = decide(&nodes, &ctx.heartbeats.last_seen(), since, Instant::now(), dead_after);
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
    }
}
