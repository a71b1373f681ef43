//! Model versions and canary rollouts (issue #11, ADR 0015).
//!
//! A model is served under its public name; each further version deployed with
//! `lanectl model deploy` is a registry entry of its own, `name@version`, placed and scaled like
//! any model while it serves or is being rolled out, and idle (specification only) otherwise.
//! A rollout shifts a share of the public name's traffic to the new version in steps; the
//! leader's rollout loop judges each step from the ledger (errors, requests over the lane's
//! objective, GPU cost per request against the version it replaces) and commits the next step,
//! the promotion or the rollback. Every step is a Raft entry, so a new leader carries on from
//! the step the old one committed.

use crate::refused::Refused;
use serde::{Deserialize, Serialize};

/// Registry entry key of `model`'s `version` (never a valid model name: names have no '@').
pub fn entry_key(model: &str, version: &str) -> String {
    format!("{model}@{version}")
}

/// Default canary weights, percent of the model's traffic.
pub const DEFAULT_STEPS: [u8; 4] = [1, 5, 25, 100];
/// Default time each step runs before it is judged.
pub const DEFAULT_BAKE_MS: u64 = 60_000;
/// Events kept per rollout (the oldest go first).
pub const MAX_EVENTS: usize = 64;

/// How a rollout moves traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// A share of the traffic per step (`steps`), rising to 100.
    #[default]
    Canary,
    /// Steps `[0, 100]`: the new version's whole fleet is placed and warmed while it gets
    /// nothing, then all traffic switches at once; the old fleet stays placed (warm) through
    /// the last step's bake, the rollback window.
    BlueGreen,
    /// Steps `[pct]`: a copy of `pct`% of the live requests goes to the new version and its
    /// answers are dropped; callers are never served by it. Ends passed or rolled back, moving
    /// no traffic.
    Shadow,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Canary => "canary",
            Strategy::BlueGreen => "blue_green",
            Strategy::Shadow => "shadow",
        }
    }
}

/// Where a rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutState {
    Running,
    /// Held at its step by an operator: nothing is judged until it is resumed.
    Paused,
    /// The new version serves all traffic.
    Promoted,
    /// Judged worse than the version it was to replace: traffic went back.
    RolledBack,
    /// Stopped by an operator: traffic went back.
    Aborted,
    /// A shadow comparison passed (no traffic moved): start a canary or blue/green next.
    Passed,
}

impl RolloutState {
    pub fn is_active(self) -> bool {
        matches!(self, RolloutState::Running | RolloutState::Paused)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RolloutState::Running => "running",
            RolloutState::Paused => "paused",
            RolloutState::Promoted => "promoted",
            RolloutState::RolledBack => "rolled_back",
            RolloutState::Aborted => "aborted",
            RolloutState::Passed => "passed",
        }
    }
}

/// What the canary may do worse than the version it replaces before it is rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Guards {
    /// Error rate over the baseline's, in tenths of a percentage point (10 = 1 point).
    pub max_error_rise_permille: u32,
    /// Share of requests slower than the lane's objective (`slo_p99_ms`, else its timeout), in
    /// tenths of a percent: 10 means "p99 within the objective".
    pub max_slow_permille: u32,
    /// GPU cost per request over the baseline's, percent (a checkpoint that doubles the
    /// GPU-seconds of a request is rolled back even when it is fast enough).
    pub max_cost_rise_pct: u32,
    /// Requests the canary must have served before a step is judged.
    pub min_requests: u64,
}

impl Default for Guards {
    fn default() -> Self {
        Guards {
            max_error_rise_permille: 10,
            max_slow_permille: 10,
            max_cost_rise_pct: 25,
            min_requests: 20,
        }
    }
}

/// One thing that happened to a rollout, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutEvent {
    pub at_ms: u64,
    pub message: String,
}

/// A canary rollout of one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    /// The public model name.
    pub model: String,
    /// Entry that served the model when the rollout started (traffic returns to it).
    pub from: String,
    /// Entry of the new version.
    pub to: String,
    pub from_version: String,
    pub to_version: String,
    #[serde(default)]
    pub strategy: Strategy,
    /// Percent per step: canary weights rising to 100; blue/green `[0, 100]`; shadow the
    /// mirrored share.
    pub steps: Vec<u8>,
    pub bake_ms: u64,
    #[serde(default)]
    pub guards: Guards,
    /// Index into `steps` of the weight in force.
    pub step: usize,
    pub state: RolloutState,
    pub started_ms: u64,
    pub step_started_ms: u64,
    /// Who started it (`kind:name` of the caller).
    pub by: String,
    #[serde(default)]
    pub events: Vec<RolloutEvent>,
}

impl Rollout {
    /// Percent of the model's traffic the new version serves now.
    pub fn weight(&self) -> u8 {
        match (self.state, self.strategy) {
            (_, Strategy::Shadow) => 0,
            (RolloutState::Running | RolloutState::Paused, _) => self.steps.get(self.step).copied().unwrap_or(0),
            (RolloutState::Promoted, _) => 100,
            (RolloutState::RolledBack | RolloutState::Aborted | RolloutState::Passed, _) => 0,
        }
    }

    /// Percent of the requests copied to the new version (shadow), while it runs.
    pub fn mirror(&self) -> u8 {
        match (self.strategy, self.state.is_active()) {
            (Strategy::Shadow, true) => self.steps.first().copied().unwrap_or(0),
            _ => 0,
        }
    }

    pub fn validate(&self) -> Result<(), Refused> {
        match self.strategy {
            Strategy::Canary => self.validate_canary()?,
            Strategy::BlueGreen if self.steps != [0, 100] => {
                return Err(format!("rollout of {}: blue/green steps are [0, 100]", self.model).into())
            }
            Strategy::Shadow if !matches!(self.steps.as_slice(), [1..=100]) => {
                return Err(format!(
                    "rollout of {}: shadow mirrors one share of the traffic, 1 to 100 percent; got {:?}",
                    self.model, self.steps
                )
                .into())
            }
            _ => {}
        }
        if !(1_000..=86_400_000).contains(&self.bake_ms) {
            return Err(format!(
                "rollout of {}: bake time {} ms; give 1 s to 24 h per step",
                self.model, self.bake_ms
            )
            .into());
        }
        if self.guards.min_requests == 0 {
            return Err(format!(
                "rollout of {}: min_requests must be at least 1 (a step judged on no traffic says nothing)",
                self.model
            )
            .into());
        }
        Ok(())
    }

    fn validate_canary(&self) -> Result<(), Refused> {
        if self.steps.is_empty() || self.steps.len() > 20 {
            return Err(format!(
                "rollout of {}: give 1 to 20 canary steps, e.g. --steps 1,5,25,100",
                self.model
            )
            .into());
        }
        if self.steps.windows(2).any(|w| w[0] >= w[1]) || self.steps[0] == 0 {
            return Err(format!(
                "rollout of {}: steps {:?} must rise from above 0, e.g. 1,5,25,100",
                self.model, self.steps
            )
            .into());
        }
        if self.steps.last() != Some(&100) {
            return Err(format!(
                "rollout of {}: the last step must be 100 (the new version takes all traffic before it is promoted); got {:?}",
                self.model, self.steps
            ).into());
        }
        Ok(())
    }

    pub fn note(&mut self, at_ms: u64, message: String) {
        if self.events.len() == MAX_EVENTS {
            self.events.remove(0);
        }
        self.events.push(RolloutEvent { at_ms, message });
    }
}

/// What `lanectl rollout start` sends: the rest comes from the registry when it is applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutRequest {
    pub model: String,
    /// The deployed version to roll out.
    pub version: String,
    #[serde(default)]
    pub strategy: Strategy,
    #[serde(default = "default_steps")]
    pub steps: Vec<u8>,
    #[serde(default = "default_bake_s")]
    pub bake_s: u64,
    #[serde(default)]
    pub guards: Guards,
}

fn default_steps() -> Vec<u8> {
    DEFAULT_STEPS.to_vec()
}

fn default_bake_s() -> u64 {
    DEFAULT_BAKE_MS / 1000
}

impl RolloutRequest {
    /// The rollout this request starts from `registry` at `now_ms`, by `by`.
    pub fn rollout(&self, registry: &super::Registry, now_ms: u64, by: &str) -> Result<Rollout, Refused> {
        let Some(serving) = registry.models.get(registry.serving_entry(&self.model)) else {
            return Err(Refused::NotFound(format!(
                "no model {}; `lanectl model list` shows the models",
                self.model
            )));
        };
        let to = registry.version_entry(&self.model, &self.version).ok_or_else(|| {
            Refused::NotFound(format!(
                "no version {} of {} is deployed; `lanectl model deploy FILE` deploys it first",
                self.version, self.model
            ))
        })?;
        let mut r = Rollout {
            model: self.model.clone(),
            from: serving.name.clone(),
            to: to.name.clone(),
            from_version: serving.version.clone(),
            to_version: to.version.clone(),
            strategy: self.strategy,
            steps: match self.strategy {
                Strategy::BlueGreen => vec![0, 100],
                _ => self.steps.clone(),
            },
            bake_ms: self.bake_s.saturating_mul(1000),
            guards: self.guards,
            step: 0,
            state: RolloutState::Running,
            started_ms: now_ms,
            step_started_ms: now_ms,
            by: by.to_string(),
            events: Vec::new(),
        };
        r.note(
            now_ms,
            format!(
                "started by {by}: {} of version {} → {}, steps {:?}%, {} s each",
                r.strategy.as_str(),
                r.from_version,
                r.to_version,
                r.steps,
                self.bake_s
            ),
        );
        r.validate()?;
        Ok(r)
    }
}

/// What an operator or the rollout loop asks of a rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutAction {
    /// To the next step (the loop, when a step passed).
    Advance,
    /// Make the new version serve all traffic now.
    Promote,
    /// Send traffic back (the loop, when a step failed).
    RollBack,
    /// Send traffic back (an operator).
    Abort,
    Pause,
    Resume,
}

impl RolloutAction {
    /// What an operator asks for (advancing and rolling back are the rollout loop's to decide).
    pub fn parse_operator(s: &str) -> Result<Self, String> {
        Ok(match s {
            "advance" | "roll_back" | "rollback" => {
                return Err(format!(
                    "{s:?} is the rollout loop's to decide; an operator may promote, abort, pause or resume"
                ))
            }
            "promote" => RolloutAction::Promote,
            "abort" => RolloutAction::Abort,
            "pause" => RolloutAction::Pause,
            "resume" => RolloutAction::Resume,
            other => {
                return Err(format!(
                    "unknown rollout action {other:?}: use promote, abort, pause or resume"
                ))
            }
        })
    }
}

/// What one version served during a rollout (from the ledger).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VersionSignals {
    /// Requests that reached a replica.
    pub requests: u64,
    /// Of those, not answered 2xx.
    pub errors: u64,
    /// Of those, slower than the lane's objective.
    pub slow: u64,
    pub gpu_us: u64,
    /// Nano-dollars, when the cards it ran on have prices.
    pub cost_nanos: u64,
    /// GPU product → (requests, GPU-µs) there.
    pub by_product: std::collections::BTreeMap<String, (u64, u64)>,
}

impl VersionSignals {
    fn permille(part: u64, whole: u64) -> u64 {
        part.saturating_mul(1000) / whole.max(1)
    }

    /// GPU time per request in units of what `speed` (product → service ms) says a request
    /// takes on each card: versions placed on different cards compare fairly. `None` without
    /// GPU time on a card `speed` knows.
    fn relative_gpu_time(&self, speed: &std::collections::BTreeMap<String, f64>) -> Option<f64> {
        let (mut units, mut requests) = (0.0, 0u64);
        for (product, (n, gpu_us)) in &self.by_product {
            let Some(ms) = speed.get(product).filter(|ms| **ms > 0.0) else {
                continue;
            };
            if *gpu_us == 0 {
                continue;
            }
            units += *gpu_us as f64 / 1000.0 / ms;
            requests += n;
        }
        (requests > 0).then(|| units / requests as f64)
    }
}

/// The new version's fleet against the serving version's: ready replicas of `r.to`, placed
/// replicas of `r.from`.
pub fn fleet_of(registry: &super::Registry, r: &Rollout) -> Fleet {
    let ready = super::ready_replicas(&registry.placement.replicas, &r.to);
    let needed = registry
        .placement
        .desired
        .values()
        .flatten()
        .filter(|d| d.model == r.from)
        .count();
    Fleet { ready, needed }
}

/// The service time (ms) per GPU product of `entry`'s profiles: the yardstick [`judge`]
/// compares versions' GPU time with.
pub fn speed_of(registry: &super::Registry, entry: &str) -> std::collections::BTreeMap<String, f64> {
    registry
        .models
        .get(entry)
        .map(|m| {
            m.profiles
                .iter()
                .map(|(p, prof)| (p.clone(), prof.service_ms.as_ms()))
                .collect()
        })
        .unwrap_or_default()
}

/// The new version's replicas: ready now, and how many the serving version runs (what a
/// blue/green switch waits for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fleet {
    pub ready: usize,
    pub needed: usize,
}

/// The loop's decision about one running rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Wait(String),
    Advance(String),
    Promote(String),
    /// A shadow comparison passed (ends it; no traffic moves).
    Pass(String),
    RollBack(String),
}

impl Verdict {
    /// What it says, for people.
    pub fn describe(&self) -> String {
        match self {
            Verdict::Wait(w) => format!("waiting: {w}"),
            Verdict::Advance(w) => format!("next tick: advance ({w})"),
            Verdict::Promote(w) => format!("next tick: promote ({w})"),
            Verdict::Pass(w) => format!("next tick: pass ({w})"),
            Verdict::RollBack(w) => format!("next tick: roll back ({w})"),
        }
    }
}

/// Judges a running rollout at `now_ms` from what the new version (`canary`) and the version it
/// replaces (`baseline`) served since it started. A guard that fails rolls back at once, bake
/// time or not; a step passes once it has baked and the canary has served enough requests.
///
/// GPU time is compared card for card: `speed` is the serving version's profile (product →
/// service ms), so a new version placed on a faster or a dearer card is judged on what the
/// checkpoint costs, not on where the scheduler put it.
pub fn judge(
    r: &Rollout,
    canary: &VersionSignals,
    baseline: &VersionSignals,
    speed: &std::collections::BTreeMap<String, f64>,
    fleet: Fleet,
    now_ms: u64,
) -> Verdict {
    let g = &r.guards;
    if r.strategy == Strategy::BlueGreen && r.step == 0 {
        // Nothing is served by the new version yet: only its fleet is judged.
        return if fleet.ready >= fleet.needed.max(1) {
            Verdict::Advance(format!(
                "the new fleet is warm ({} replicas ready for the {} serving now); all traffic switches to version {}",
                fleet.ready, fleet.needed, r.to_version
            ))
        } else {
            Verdict::Wait(format!(
                "warming the new fleet: {} of {} replicas ready",
                fleet.ready,
                fleet.needed.max(1)
            ))
        };
    }
    if canary.requests >= g.min_requests {
        let (ce, be) = (
            VersionSignals::permille(canary.errors, canary.requests),
            VersionSignals::permille(baseline.errors, baseline.requests),
        );
        if ce > be + u64::from(g.max_error_rise_permille) {
            return Verdict::RollBack(format!(
                "error rate {:.1}% against {:.1}% for version {} (allowed: {:.1} points more), over {} and {} requests",
                ce as f64 / 10.0,
                be as f64 / 10.0,
                r.from_version,
                f64::from(g.max_error_rise_permille) / 10.0,
                canary.requests,
                baseline.requests
            ));
        }
        let slow = VersionSignals::permille(canary.slow, canary.requests);
        if slow > u64::from(g.max_slow_permille) {
            return Verdict::RollBack(format!(
                "{:.1}% of its requests were slower than the lane's objective (allowed {:.1}%: p99 over the objective), over {} requests",
                slow as f64 / 10.0,
                f64::from(g.max_slow_permille) / 10.0,
                canary.requests
            ));
        }
        if baseline.requests >= g.min_requests {
            let relative = (canary.relative_gpu_time(speed), baseline.relative_gpu_time(speed));
            if let (Some(c), Some(b)) = relative {
                if b > 0.0 && c > b * (1.0 + f64::from(g.max_cost_rise_pct) / 100.0) {
                    return Verdict::RollBack(format!(
                        "takes {:.0}% more GPU time per request than version {} (card for card, by version {}'s profiles; allowed +{}%)",
                        (c / b - 1.0) * 100.0,
                        r.from_version,
                        r.from_version,
                        g.max_cost_rise_pct
                    ));
                }
            }
        }
    }
    let share = match r.strategy {
        Strategy::Shadow => format!("{}% mirrored", r.mirror()),
        _ => format!("{}%", r.weight()),
    };
    let baked = now_ms.saturating_sub(r.step_started_ms);
    if baked < r.bake_ms {
        return Verdict::Wait(format!(
            "baking at {share}: {} s of {} s",
            baked / 1000,
            r.bake_ms / 1000
        ));
    }
    if canary.requests < g.min_requests {
        return Verdict::Wait(format!(
            "at {share}: {} of the {} requests a step is judged on",
            canary.requests, g.min_requests
        ));
    }
    let summary = format!(
        "{} requests, {:.1}% errors, {:.1}% over the objective",
        canary.requests,
        VersionSignals::permille(canary.errors, canary.requests) as f64 / 10.0,
        VersionSignals::permille(canary.slow, canary.requests) as f64 / 10.0
    );
    if r.strategy == Strategy::Shadow {
        Verdict::Pass(format!(
            "{summary} against version {}; no traffic moved",
            r.from_version
        ))
    } else if r.step + 1 >= r.steps.len() {
        Verdict::Promote(format!("passed every step ({summary})"))
    } else {
        Verdict::Advance(format!(
            "step {}% passed ({summary}); to {}%",
            r.weight(),
            r.steps[r.step + 1]
        ))
    }
}

#[cfg(test)]
mod tests;
