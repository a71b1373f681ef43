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
    bake: BakeClock,
}

impl RolloutJudge {
    pub fn new(ctx: Context) -> Self {
        RolloutJudge {
            ctx,
            said: HashMap::new(),
            bake: BakeClock::default(),
        }
    }
}

/// The time a rollout step is judged at: the wall clock, but never further past the moment this
/// leader first saw the step than its monotonic clock has run since. A bake is stamped in wall
/// time (`step_started_ms`, committed, so a new leader goes on from it), and a leader whose
/// wall clock jumps forward an hour would otherwise end every bake at once and promote a
/// canary nobody watched. A jump backwards only makes the bake longer.
#[derive(Default)]
struct BakeClock {
    /// (model, step, step_started_ms) → (monotonic, wall ms) when this leader first saw it.
    first_seen: HashMap<(String, usize, u64), (tokio::time::Instant, u64)>,
}

impl BakeClock {
    /// `wall_now` for `r`, held back to what the monotonic clock allows.
    fn now_for(&mut self, r: &Rollout, wall_now: u64, now: tokio::time::Instant) -> u64 {
        self.now_for_step((r.model.clone(), r.step, r.step_started_ms), wall_now, now)
    }

    fn now_for_step(&mut self, key: (String, usize, u64), wall_now: u64, now: tokio::time::Instant) -> u64 {
        let (at, wall_at) = *self.first_seen.entry(key).or_insert((now, wall_now));
        let ran = now.saturating_duration_since(at).as_millis() as u64;
        wall_now.min(wall_at.saturating_add(ran))
    }

    /// Forgets steps no longer running.
    fn keep(&mut self, running: &[Rollout]) {
        self.first_seen.retain(|(model, step, started), _| {
            running
                .iter()
                .any(|r| &r.model == model && r.step == *step && r.step_started_ms == *started)
        });
    }
}

impl laneway_actors::Ticker for RolloutJudge {
    const KIND: &'static str = "rollout_judge";

    async fn tick(&mut self) -> Duration {
        let ctx = &self.ctx;
        if !ctx.is_leader() {
            return TICK;
        }
        for (model, step, decision) in decide(ctx, &mut self.bake, crate::jobs::unix_ms()) {
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

/// The verdict on every running rollout at `now_ms` (held back by `bake`): model, the step
/// judged, verdict.
fn decide(ctx: &Context, bake: &mut BakeClock, now_ms: u64) -> Vec<(String, usize, Verdict)> {
    let running: Vec<Rollout> = ctx.sm.with_registry(|reg| {
        reg.rollouts
            .values()
            .filter(|r| r.state == crate::registry::rollout::RolloutState::Running)
            .cloned()
            .collect()
    });
    bake.keep(&running);
    let now = tokio::time::Instant::now();
    running
        .into_iter()
        .map(|r| {
            let a = assess(&ctx.sm, &r, bake.now_for(&r, now_ms, now));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_forward_clock_jump_does_not_end_a_bake_early() {
        let mut bake = BakeClock::default();
        let step = || ("chat".to_string(), 1, 1_000_000);
        let t0 = tokio::time::Instant::now();
        // First seen 20 s into its bake.
        assert_eq!(bake.now_for_step(step(), 1_020_000, t0), 1_020_000);
        // 10 s later the wall clock has jumped an hour ahead: the bake has run 30 s, not 3,630.
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(bake.now_for_step(step(), 4_630_000, t1), 1_030_000);
        // A jump back only lengthens it.
        assert_eq!(bake.now_for_step(step(), 1_010_000, t1), 1_010_000);
        // The next step is a new bake, judged from when it is first seen.
        let next = ("chat".to_string(), 2, 4_630_000);
        assert_eq!(bake.now_for_step(next, 4_640_000, t1), 4_640_000);
    }
}
