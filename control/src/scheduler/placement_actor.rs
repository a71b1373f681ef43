//! The `Scheduler` actor (the leader's placement): every [`FAST_TICK`], take the replica counts
//! the lane actors decided ([`crate::scheduler::lane_actor`]), plan the replicas (targets, warm
//! floors, re-placement off dead or draining nodes) from the applied state, and commit the
//! changes through Raft — at once when a target changed, else every [`TICK`].
//!
//! Every decision is committed before an agent acts on it, so a new leader continues from the
//! same intent; the next pass reads the applied result, so nothing is placed twice. A lane whose
//! actor is down has its models held at their current count ([`held_targets`]), never dropped
//! to the floor.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::command::Command;
use crate::context::Context;
use crate::registry::Registry;
use crate::scheduler::replicas;
use crate::scheduler::term::{LaneDecision, Term};

/// How often the leader plans placement when nothing asks for it sooner.
pub const TICK: Duration = Duration::from_secs(1);
/// How often the lanes look at the load and the scheduler at their targets: a burst is acted
/// on within this (plus the age of the followers' load reports); placement runs at once when
/// a target changes, else every [`TICK`].
pub const FAST_TICK: Duration = Duration::from_millis(250);
/// Node placements committed in one log entry at most.
pub const PLACEMENT_BATCH: usize = 64;
/// A lane whose targets are older than this is not followed: its models are held.
pub const LANE_STALE_AFTER: Duration = Duration::from_secs(2);

/// The scheduler's state for one term.
pub struct Scheduler {
    ctx: Context,
    term: Arc<Term>,
    last_unplaced: Vec<String>,
    /// The last plan: when it ran, from what, and whether it settled.
    last_plan: Option<LastPlan>,
}

/// What the last placement pass was made from, and whether it settled (changed nothing and
/// had nothing left to commit). The plan is a pure function of these inputs: while they stay
/// the same a settled plan would come out the same, so it is not made again. That is what
/// keeps an idle fleet of 25,000 nodes from being copied and indexed every second.
struct LastPlan {
    at: Instant,
    targets: HashMap<String, usize>,
    suspect: HashSet<String>,
    /// The state machine's count of fleet and registry changes.
    state: u64,
    /// The heartbeat table's count of changes placement reads (caches, MIG devices).
    observed: u64,
    settled: bool,
}

impl LastPlan {
    /// Whether a plan is due now: at once when the targets or the suspect nodes changed; on
    /// the [`TICK`] when the committed state or what heartbeats say changed, or the last plan
    /// left something to commit; never while a settled plan's inputs stay the same.
    fn due(last: Option<&LastPlan>, now: Instant, next: &LastPlan) -> bool {
        let Some(last) = last else { return true };
        if last.targets != next.targets || last.suspect != next.suspect {
            return true;
        }
        let changed = last.state != next.state || last.observed != next.observed || !last.settled;
        changed && now.saturating_duration_since(last.at) >= TICK
    }
}

impl Scheduler {
    pub fn new(ctx: Context, term: Arc<Term>) -> Self {
        Scheduler {
            ctx,
            term,
            last_unplaced: Vec::new(),
            last_plan: None,
        }
    }
}

impl laneway_actors::Ticker for Scheduler {
    const KIND: &'static str = "scheduler";

    async fn tick(&mut self) -> Duration {
        // The scope is stopped when leadership goes; this catches the moment in between.
        if !self.ctx.is_leader() {
            return FAST_TICK;
        }
        self.place().await;
        FAST_TICK
    }
}

impl Scheduler {
    async fn place(&mut self) {
        let ctx = &self.ctx;
        let now = Instant::now();
        // Replica ids are letters, digits, '-', '_' and '.': a version's entry `name@v` gives
        // `name-v`.
        let mut new_id = |model: &str| {
            format!(
                "{}-{}",
                model.replace('@', "-"),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        };
        // A node whose heartbeat stream dropped is planned around at once, not on the tick.
        let suspect = ctx.heartbeats.suspect_nodes();
        // The targets from the registry in place: the fleet and registry are copied only when
        // a plan is due (four passes a second over a fleet of 25,000 nodes is not free).
        let lanes = self.term.lanes.published();
        let targets = ctx.sm.with_registry(|registry| {
            let mut targets = held_targets(registry, &lanes, &suspect, now, LANE_STALE_AFTER);
            blue_green_targets(registry, &mut targets);
            targets
        });
        // The counts are read before the fleet, registry and heartbeats are: a change landing
        // in between makes the next pass plan again rather than be missed.
        let mut next = LastPlan {
            at: now,
            targets,
            suspect,
            state: ctx.sm.changes(),
            observed: ctx.heartbeats.placement_inputs(),
            settled: false,
        };
        if !LastPlan::due(self.last_plan.as_ref(), now, &next) {
            return;
        }
        let (fleet, registry) = ctx.sm.routing_inputs();
        let observed = replicas::Observed {
            cached: cached_models(ctx, &registry),
            slices: settled_slices(ctx, &registry),
            suspect: next.suspect.clone(),
        };
        let plan = replicas::plan_observed(&fleet, &registry, &next.targets, &observed, &mut new_id);
        *ctx.unplaced.lock().unwrap_or_else(|p| p.into_inner()) = plan.unplaced.clone();
        let unplaced: Vec<String> = plan
            .unplaced
            .iter()
            .map(|u| format!("{}: {}", u.model, u.reason))
            .collect();
        if unplaced != self.last_unplaced {
            for u in &plan.unplaced {
                tracing::warn!(model = %u.model, reason = %u.reason, "cannot place a replica the warm floor needs");
                ctx.history
                    .event("unplaced", &u.model, format!("cannot place a replica: {}", u.reason));
            }
            self.last_unplaced = unplaced;
        }
        next.settled = plan.commands.is_empty();
        self.last_plan = Some(next);
        // One log entry per PLACEMENT_BATCH nodes changed: a pass that touches many nodes
        // commits in a few round trips instead of one per node.
        let mut commands = plan.commands.into_iter().peekable();
        while commands.peek().is_some() {
            let chunk: Vec<Command> = commands.by_ref().take(PLACEMENT_BATCH).collect();
            let summaries: Vec<_> = chunk.iter().filter_map(placement_summary).collect();
            let proposal = Command::batch_of(chunk);
            match ctx.proposer.propose(proposal).await {
                Ok((index, r)) => {
                    let refused: Vec<&String> = r.refusals().collect();
                    for why in &refused {
                        tracing::warn!(%why, "placement refused");
                    }
                    tracing::info!(index, nodes = summaries.len(), "placement committed");
                    if refused.is_empty() {
                        for (node, text) in &summaries {
                            ctx.history
                                .event("placement", node, format!("{text} (log index {index})"));
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "placement not committed; planning again next tick");
                    break;
                }
            }
        }
    }
}

/// The replica count to plan for each placed model: its lane's latest decision when that lane
/// decided within `stale_after`, else the count placed now (a lane actor that is down or
/// restarting holds its models where they are; the warm floor still applies in the plan).
pub fn held_targets(
    registry: &Registry,
    lanes: &HashMap<String, LaneDecision>,
    suspect: &HashSet<String>,
    now: Instant,
    stale_after: Duration,
) -> HashMap<String, usize> {
    let mut targets = HashMap::new();
    for m in registry.models.values() {
        // A suspect node's replicas are being replaced: holding them too would place them twice.
        let placed = registry
            .placement
            .desired
            .iter()
            .filter(|(node, _)| !suspect.contains(*node))
            .flat_map(|(_, rs)| rs)
            .filter(|r| r.model == m.name)
            .count();
        let decided = lanes
            .get(&m.class)
            .filter(|d| now.saturating_duration_since(d.at) <= stale_after)
            .and_then(|d| {
                let n = d.targets.get(&m.name).copied()?;
                // A node that was suspect when the lane decided is back: its replicas count
                // again here, and not yet in the decision. Trimming to the decision would
                // stop them for a flap; the lane's next decision says whether there is a
                // surplus, and removes it after its stable window as any surplus is.
                let returned = d.suspect.iter().any(|node| !suspect.contains(node));
                Some(if returned { n.max(placed) } else { n })
            });
        match decided {
            Some(n) => {
                targets.insert(m.name.clone(), n);
            }
            None if placed > 0 => {
                targets.insert(m.name.clone(), placed);
            }
            None => {}
        }
    }
    targets
}

/// A blue/green rollout's new version is placed as large as the serving version runs before
/// traffic switches to it (its own load is nothing until then), and stays at least that large
/// through the rollback window.
fn blue_green_targets(registry: &Registry, targets: &mut HashMap<String, usize>) {
    for r in registry.rollouts.values().filter(|r| r.state.is_active()) {
        if r.strategy != crate::registry::rollout::Strategy::BlueGreen {
            continue;
        }
        let serving = registry
            .placement
            .desired
            .values()
            .flatten()
            .filter(|d| d.model == r.from)
            .count();
        let t = targets.entry(r.to.clone()).or_default();
        *t = (*t).max(serving);
    }
}

/// Per node heard from, its MIG devices on GPUs whose reported layout is the one wanted (no
/// re-partitioning pending), from the heartbeats.
fn settled_slices(ctx: &Context, registry: &Registry) -> HashMap<String, Vec<replicas::Slice>> {
    ctx.heartbeats.with_all(|all| {
        all.iter()
            .map(|(node, seen)| {
                let slices = seen
                    .gpus
                    .iter()
                    .filter(|g| !g.mig_devices.is_empty())
                    .filter(|g| {
                        let mut wanted = registry
                            .placement
                            .mig
                            .get(node)
                            .and_then(|m| m.get(&g.uuid))
                            .cloned()
                            .unwrap_or_default();
                        let mut reported = g.mig_profiles.clone();
                        wanted.sort();
                        reported.sort();
                        wanted == reported
                    })
                    .flat_map(|g| {
                        g.mig_devices
                            .iter()
                            .zip(&g.mig_profiles)
                            .map(|(uuid, profile)| replicas::Slice {
                                parent: g.uuid.clone(),
                                uuid: uuid.clone(),
                                profile: profile.clone(),
                            })
                    })
                    .collect();
                (node.clone(), slices)
            })
            .collect()
    })
}

/// Per node, the models whose every weight artifact is in its cache (from the heartbeats).
fn cached_models(ctx: &Context, registry: &Registry) -> HashMap<String, std::collections::HashSet<String>> {
    let with_weights: Vec<_> = registry.models.values().filter(|m| !m.weights.is_empty()).collect();
    if with_weights.is_empty() {
        return HashMap::new();
    }
    ctx.heartbeats.with_all(|all| {
        all.iter()
            .map(|(node, seen)| {
                let blobs: std::collections::HashSet<&str> = seen.cached_blobs.iter().map(String::as_str).collect();
                let models = with_weights
                    .iter()
                    .filter(|m| m.weights.iter().all(|w| blobs.contains(w.sha256.as_str())))
                    .map(|m| m.name.clone())
                    .collect();
                (node.clone(), models)
            })
            .collect()
    })
}

/// A placement command as a line an operator reads: the node and what it runs now.
fn placement_summary(cmd: &crate::command::Command) -> Option<(String, String)> {
    let crate::command::Command::SetDesiredReplicas { node_id, replicas } = cmd else {
        return None;
    };
    let mut per_model: std::collections::BTreeMap<&str, usize> = Default::default();
    for r in replicas {
        *per_model.entry(r.model.as_str()).or_default() += 1;
    }
    let mut per_gpu: std::collections::BTreeMap<&str, usize> = Default::default();
    for r in replicas {
        *per_gpu.entry(r.gpu.as_str()).or_default() += 1;
    }
    let shared = per_gpu.values().filter(|n| **n > 1).count();
    let mut runs: Vec<String> = per_model.iter().map(|(m, n)| format!("{m} ×{n}")).collect();
    if shared > 0 {
        runs.push(format!("{shared} card(s) time-sliced"));
    }
    let text = if runs.is_empty() {
        "runs no placed replica now".to_string()
    } else {
        format!("runs {} now", runs.join(", "))
    };
    Some((node_id.clone(), text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Class, DesiredReplica, LaneKind, Millis, Model, Profile};

    fn registry() -> Registry {
        let mut r = Registry::default();
        for (class, lane) in [("speech", LaneKind::Sync), ("video", LaneKind::Sync)] {
            r.put_class(&Class::for_test(class, lane)).unwrap();
        }
        for (name, class) in [("whisper", "speech"), ("wan", "video"), ("new", "speech")] {
            r.put_model(&Model {
                inputs: Vec::new(),
                outputs: Vec::new(),
                fallback: None,
                name: name.into(),
                class: class.into(),
                version: "1".into(),
                profiles: [(
                    "L4".to_string(),
                    Profile {
                        service_ms: Millis::from_ms(50.0),
                        max_batch: 4,
                        gpu_memory_gb: 10,
                        mig_profiles: vec![],
                        tokens_per_s: None,
                    },
                )]
                .into(),
                runtime: Default::default(),
                weights: vec![],
                llm: None,
                serves: None,
            })
            .unwrap();
        }
        let replica = |id: &str, model: &str| DesiredReplica {
            id: id.into(),
            model: model.into(),
            gpu: format!("{id}-gpu"),
            product: "L4".into(),
        };
        r.set_desired(
            "n1",
            &[replica("w1", "whisper"), replica("w2", "whisper"), replica("v1", "wan")],
        );
        r.set_desired("n2", &[replica("w3", "whisper"), replica("v2", "wan")]);
        r
    }

    #[test]
    fn a_lane_that_has_not_decided_lately_holds_its_models_at_their_current_count() {
        let r = registry();
        let now = Instant::now();
        let fresh = now - Duration::from_millis(300);
        let stale = now - Duration::from_secs(3);
        let counts =
            |c: &[(&str, usize)]| -> HashMap<String, usize> { c.iter().map(|(m, n)| (m.to_string(), *n)).collect() };
        let lane = |class: &str, at: Instant, t: &[(&str, usize)]| {
            (
                class.to_string(),
                LaneDecision {
                    at,
                    targets: counts(t),
                    suspect: HashSet::new(),
                },
            )
        };
        let cases = [
            (
                "both lanes fresh: their decisions",
                vec![
                    lane("speech", fresh, &[("whisper", 5)]),
                    lane("video", fresh, &[("wan", 1)]),
                ],
                counts(&[("whisper", 5), ("wan", 1)]),
            ),
            (
                "the video lane's actor is down: wan held at 2, not dropped to its floor",
                vec![
                    lane("speech", fresh, &[("whisper", 1)]),
                    lane("video", stale, &[("wan", 0)]),
                ],
                counts(&[("whisper", 1), ("wan", 2)]),
            ),
            (
                "no lane has decided (a new term): every placed model held",
                vec![],
                counts(&[("whisper", 3), ("wan", 2)]),
            ),
        ];
        for (what, lanes, want) in cases {
            let lanes: HashMap<String, LaneDecision> = lanes.into_iter().collect();
            let got = held_targets(&r, &lanes, &HashSet::new(), now, LANE_STALE_AFTER);
            assert_eq!(got, want, "{what}");
        }
    }

    /// n1 runs two whisper replicas and n2 one. The lane decided 2 while n1 was suspect. When
    /// n1 is heard from again before the lane decides anew, all three are held, not trimmed to
    /// the old decision; a decision made with no suspect node, or with one that still is, is
    /// followed.
    #[test]
    fn a_suspect_node_heard_from_again_keeps_its_replicas_until_the_lane_decides_anew() {
        let r = registry();
        let now = Instant::now();
        let decided = |suspect: &[&str]| -> HashMap<String, LaneDecision> {
            [(
                "speech".to_string(),
                LaneDecision {
                    at: now - Duration::from_millis(100),
                    targets: [("whisper".to_string(), 2)].into(),
                    suspect: suspect.iter().map(|s| s.to_string()).collect(),
                },
            )]
            .into()
        };
        let none = HashSet::new();
        let n1: HashSet<String> = ["n1".to_string()].into();
        let whisper = |lanes: &HashMap<String, LaneDecision>, suspect: &HashSet<String>| {
            held_targets(&r, lanes, suspect, now, LANE_STALE_AFTER)["whisper"]
        };
        assert_eq!(
            whisper(&decided(&["n1"]), &none),
            3,
            "n1 is back: its 2 and n2's 1 are held until the lane has seen them"
        );
        assert_eq!(
            whisper(&decided(&["n1"]), &n1),
            2,
            "n1 still suspect: the decision is followed (replacements placed)"
        );
        assert_eq!(
            whisper(&decided(&[]), &none),
            2,
            "no flap: a lane's scale-down is followed"
        );
        assert_eq!(
            whisper(&decided(&[]), &n1),
            2,
            "n1 just became suspect: the decision is followed"
        );
    }

    #[test]
    fn a_settled_plan_is_made_again_only_when_what_it_reads_changes() {
        let t0 = Instant::now();
        let plan = |at: Instant, state: u64, observed: u64, settled: bool| LastPlan {
            at,
            targets: [("whisper".to_string(), 2)].into(),
            suspect: HashSet::new(),
            state,
            observed,
            settled,
        };
        let last = plan(t0, 7, 3, true);
        let later = t0 + TICK;
        let soon = t0 + FAST_TICK;
        assert!(
            LastPlan::due(None, t0, &plan(t0, 7, 3, false)),
            "the term's first pass plans"
        );
        assert!(
            !LastPlan::due(Some(&last), later + TICK * 10, &plan(later, 7, 3, false)),
            "settled, nothing changed: not planned again however long it has been"
        );
        assert!(
            LastPlan::due(Some(&last), later, &plan(later, 8, 3, false)),
            "a commit changed the fleet or registry"
        );
        assert!(
            !LastPlan::due(Some(&last), soon, &plan(soon, 8, 3, false)),
            "…on the tick, as before"
        );
        assert!(
            LastPlan::due(Some(&last), later, &plan(later, 7, 4, false)),
            "a weight cache or MIG layout changed"
        );
        let unsettled = plan(t0, 7, 3, false);
        assert!(
            LastPlan::due(Some(&unsettled), later, &plan(later, 7, 3, false)),
            "the last plan had something to commit: planned again on the tick"
        );
        let mut moved = plan(soon, 7, 3, false);
        moved.targets.insert("whisper".into(), 3);
        assert!(
            LastPlan::due(Some(&last), soon, &moved),
            "a lane changed a target: at once"
        );
        let mut suspect = plan(soon, 7, 3, false);
        suspect.suspect.insert("n1".into());
        assert!(
            LastPlan::due(Some(&last), soon, &suspect),
            "a node became suspect: at once"
        );
    }
}
