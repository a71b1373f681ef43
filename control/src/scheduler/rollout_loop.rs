//! The leader's `RolloutJudge` actor: once a second, judge every running rollout from the ledger
//! ([`crate::registry::rollout::judge`]) and commit what it decided — the next step, the
//! promotion or the rollback — through Raft. Rollouts live in the replicated registry, so a new
//! leader judges them from the step the old one committed; a proposal names the step it judged
//! and is refused if the rollout has moved on, so nothing is applied twice.

use std::collections::HashMap;
use std::time::Duration;

use crate::command::Command;
use crate::context::Context;
use crate::registry::rollout::{judge, Rollout, RolloutAction, Verdict, VersionSignals};
use crate::store::StateMachineStore;

/// How often the leader judges running rollouts.
pub const TICK: Duration = Duration::from_secs(1);

/// The `RolloutJudge` actor's state (one per term: what it said is forgotten with the term).
pub struct RolloutJudge {
    ctx: Context,
    /// The last wait reported per rollout, so the log says a thing once.
    said: HashMap<String, String>,
}

impl RolloutJudge {
    pub fn new(ctx: Context) -> Self {
        RolloutJudge {
            ctx,
            said: HashMap::new(),
        }
    }
}

impl laneway_actors::Ticker for RolloutJudge {
    const KIND: &'static str = "rollout_judge";

    async fn tick(&mut self) -> Duration {
        let ctx = &self.ctx;
        if !ctx.is_leader() {
            return TICK;
        }
        for (model, step, decision) in decide(ctx, crate::jobs::unix_ms()) {
            let (action, why) = match decision {
                Verdict::Wait(why) => {
                    if self.said.get(&model) != Some(&why) {
                        tracing::debug!(%model, %why, "rollout waiting");
                        self.said.insert(model, why);
                    }
                    continue;
                }
                Verdict::Advance(why) => (RolloutAction::Advance, why),
                Verdict::Promote(why) => (RolloutAction::Promote, format!("promoted: {why}")),
                Verdict::Pass(why) => (RolloutAction::Promote, format!("passed: {why}")),
                Verdict::RollBack(why) => (RolloutAction::RollBack, format!("rolled back: {why}")),
            };
            commit(ctx, &model, step, action, why).await;
        }
        TICK
    }
}

/// The verdict on every running rollout at `now_ms`: model, the step judged, verdict.
fn decide(ctx: &Context, now_ms: u64) -> Vec<(String, usize, Verdict)> {
    let running: Vec<Rollout> = ctx.sm.with_registry(|reg| {
        reg.rollouts
            .values()
            .filter(|r| r.state == crate::registry::rollout::RolloutState::Running)
            .cloned()
            .collect()
    });
    running
        .into_iter()
        .map(|r| {
            let a = assess(&ctx.sm, &r, now_ms);
            (r.model.clone(), r.step, a.verdict)
        })
        .collect()
}

/// A rollout's numbers and what the loop would decide now (also for `lanectl rollout
/// status`).
#[derive(Debug)]
pub struct Assessment {
    pub canary: VersionSignals,
    pub baseline: VersionSignals,
    pub verdict: Verdict,
}

pub fn assess(sm: &StateMachineStore, r: &Rollout, now_ms: u64) -> Assessment {
    let (speed, fleet) = sm.with_registry(|reg| {
        (
            crate::registry::rollout::speed_of(reg, &r.from),
            crate::registry::rollout::fleet_of(reg, r),
        )
    });
    sm.with_ledger(|l, _| {
        let signals = l.version_signals(&r.model, r.started_ms);
        let canary = signals.get(&r.to_version).cloned().unwrap_or_default();
        let baseline = signals.get(&r.from_version).cloned().unwrap_or_default();
        let verdict = judge(r, &canary, &baseline, &speed, fleet, now_ms);
        Assessment {
            canary,
            baseline,
            verdict,
        }
    })
}

async fn commit(ctx: &Context, model: &str, step: usize, action: RolloutAction, why: String) {
    let command = Command::UpdateRollout {
        model: model.to_string(),
        expect_step: Some(step),
        action,
        at_ms: crate::jobs::unix_ms(),
        message: why.clone(),
    };
    if let Err(e) = ctx.sm.check_allowed(&command) {
        tracing::warn!(%model, error = %e, "rollout step held back");
        return;
    }
    match ctx.proposer.propose(command).await {
        Ok((index, r)) => match r.rejected {
            None => {
                tracing::info!(%model, index, %why, "rollout step committed");
                ctx.history
                    .event("rollout", model, format!("{why} (log index {index})"));
            }
            Some(refused) => tracing::info!(%model, %refused, "rollout step not applied"),
        },
        Err(e) => tracing::warn!(%model, error = %e, "rollout step not committed; judging again next tick"),
    }
}
