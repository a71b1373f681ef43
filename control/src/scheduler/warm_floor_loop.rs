//! The leader's placement loop: once a second, plan the replicas (warm floors, re-placement
//! off dead or draining nodes) from the applied state and commit the changes through Raft.
//! Every decision is committed before an agent acts on it, so a new leader continues from the
//! same intent; the next pass reads the applied result, so nothing is placed twice.

use std::time::Duration;

use crate::context::Context;
use crate::scheduler::replicas;

/// How often the leader plans.
pub const TICK: Duration = Duration::from_secs(1);

/// Runs for the controller's lifetime; plans only while leader.
pub async fn run(ctx: Context) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_unplaced = Vec::new();
    loop {
        tick.tick().await;
        if !ctx.is_leader() {
            continue;
        }
        let (fleet, registry) = ctx.sm.routing_inputs();
        let mut new_id = |model: &str| format!("{model}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let plan = replicas::plan(&fleet, &registry, &mut new_id);
        let unplaced: Vec<String> = plan
            .unplaced
            .iter()
            .map(|u| format!("{}: {}", u.model, u.reason))
            .collect();
        if unplaced != last_unplaced {
            for u in &unplaced {
                tracing::warn!(replica = %u, "cannot place a replica the warm floor needs");
            }
            last_unplaced = unplaced;
        }
        for cmd in plan.commands {
            let what = format!("{cmd:?}");
            match ctx.proposer.propose(cmd).await {
                Ok((index, r)) => match r.rejected {
                    Some(why) => tracing::warn!(%why, "placement refused"),
                    None => tracing::info!(index, placement = %what, "placement committed"),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "placement not committed; planning again next tick");
                    break;
                }
            }
        }
    }
}
