//! The leader's placement loop: once a second, decide each model's replica count from its load
//! (the fast loop, [`crate::scheduler::autoscale`]), plan the replicas (targets, warm floors,
//! re-placement off dead or draining nodes) from the applied state, and commit the changes
//! through Raft.
//!
//! Load comes from every controller's router: each reports its own once a second ([`report`]),
//! the leader's straight into the board, the others' through the admin API.
//! Every decision is committed before an agent acts on it, so a new leader continues from the
//! same intent; the next pass reads the applied result, so nothing is placed twice.

use std::time::Duration;

use std::collections::HashMap;

use tokio::time::Instant;

use crate::command::Command;
use crate::context::Context;
use crate::registry::{LaneKind, Registry};
use crate::scheduler::autoscale::{Inputs, ModelLoad, ScaleState, Signal};
use crate::scheduler::replicas;

/// How often the leader plans placement when nothing asks for it sooner.
pub const TICK: Duration = Duration::from_secs(1);
/// How often the fast loop looks at the load: a burst is acted on within this (plus the age
/// of the followers' load reports, [`REPORT_EVERY`]); placement runs at once when a target
/// changes, else every [`TICK`].
pub const FAST_TICK: Duration = Duration::from_millis(250);
/// Node placements committed in one log entry at most.
pub const PLACEMENT_BATCH: usize = 64;
/// How often each controller reports its router's load to the leader.
pub const REPORT_EVERY: Duration = Duration::from_millis(500);

/// Runs for the controller's lifetime; plans only while leader.
pub async fn run(ctx: Context) {
    let mut tick = tokio::time::interval(FAST_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_unplaced = Vec::new();
    let mut scale = ScaleState::default();
    let mut said: HashMap<String, (usize, usize)> = HashMap::new();
    let mut last_plan: Option<(Instant, HashMap<String, usize>)> = None;
    loop {
        tick.tick().await;
        if !ctx.is_leader() {
            last_plan = None;
            continue;
        }
        let now = Instant::now();
        // The leader's own router, fresh (the others report every REPORT_EVERY).
        ctx.load.record(ctx.node_id, ctx.router.model_load(), now);
        let (fleet, registry) = ctx.sm.routing_inputs();
        // Replica ids are letters, digits, '-', '_' and '.': a version's entry `name@v` gives
        // `name-v`.
        let mut new_id = |model: &str| {
            format!(
                "{}-{}",
                model.replace('@', "-"),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        };
        let mut targets = fast_loop(&ctx, &registry, &mut scale, &mut said, now);
        blue_green_targets(&registry, &mut targets);
        let due = last_plan
            .as_ref()
            .is_none_or(|(at, before)| *before != targets || now.saturating_duration_since(*at) >= TICK);
        if !due {
            continue;
        }
        last_plan = Some((now, targets.clone()));
        let cached = cached_models(&ctx, &registry);
        let slices = settled_slices(&ctx, &registry);
        let plan = replicas::plan_observed(&fleet, &registry, &targets, &cached, &slices, &mut new_id);
        *ctx.unplaced.lock().unwrap_or_else(|p| p.into_inner()) = plan.unplaced.clone();
        let unplaced: Vec<String> = plan
            .unplaced
            .iter()
            .map(|u| format!("{}: {}", u.model, u.reason))
            .collect();
        if unplaced != last_unplaced {
            for u in &plan.unplaced {
                tracing::warn!(model = %u.model, reason = %u.reason, "cannot place a replica the warm floor needs");
                ctx.history
                    .event("unplaced", &u.model, format!("cannot place a replica: {}", u.reason));
            }
            last_unplaced = unplaced;
        }
        // One log entry per PLACEMENT_BATCH nodes changed: a pass that touches many nodes
        // commits in a few round trips instead of one per node.
        let mut commands = plan.commands.into_iter().peekable();
        while commands.peek().is_some() {
            let chunk: Vec<Command> = commands.by_ref().take(PLACEMENT_BATCH).collect();
            let summaries: Vec<_> = chunk.iter().filter_map(placement_summary).collect();
            let proposal = if chunk.len() == 1 {
                chunk.into_iter().next().expect("one command")
            } else {
                Command::Batch(chunk)
            };
            match ctx.proposer.propose(proposal).await {
                Ok((index, r)) => {
                    let refused: Vec<&String> = r
                        .rejected
                        .iter()
                        .chain(r.batch.iter().filter_map(|b| b.rejected.as_ref()))
                        .collect();
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

/// A blue/green rollout's new version is placed as large as the serving version runs before
/// traffic switches to it (its own load is nothing until then), and stays at least that large
/// through the rollback window.
fn blue_green_targets(registry: &Registry, targets: &mut HashMap<String, usize>) {
    for r in registry.rollouts.values().filter(|r| r.state.is_active()) {
        if r.strategy != crate::registry::rollout::Strategy::BlueGreen {
            continue;
        }
        let serving = registry
            .desired
            .values()
            .flatten()
            .filter(|d| d.model == r.from)
            .count();
        let t = targets.entry(r.to.clone()).or_default();
        *t = (*t).max(serving);
    }
}

/// The fast loop: a replica count per model from its load — the routers' in-flight and
/// waiting requests for sync and bounded lanes, the replicated job queue (placed and queued
/// jobs) for durable lanes.
fn fast_loop(
    ctx: &Context,
    registry: &Registry,
    scale: &mut ScaleState,
    said: &mut HashMap<String, (usize, usize)>,
    now: Instant,
) -> HashMap<String, usize> {
    let load = ctx.load.total(now);
    let job_load: HashMap<String, ModelLoad> = ctx.sm.with_jobs(|jobs, _, _| {
        jobs.load_by_model()
            .into_iter()
            .map(|(m, (in_flight, waiting))| {
                (
                    m,
                    ModelLoad {
                        in_flight,
                        waiting,
                        ..Default::default()
                    },
                )
            })
            .collect()
    });
    let engine = engine_load(ctx);
    let mut targets = HashMap::new();
    for m in registry.models.values() {
        let Some(class) = registry.classes.get(&m.class) else {
            continue;
        };
        let load = if class.lane == LaneKind::Durable {
            &job_load
        } else {
            &load
        };
        let placed: Vec<u32> = registry
            .desired
            .values()
            .flatten()
            .filter(|r| r.model == m.name)
            .map(|r| m.profiles.get(&r.product).map_or(1, |p| p.max_batch))
            .collect();
        if placed.is_empty() {
            continue;
        }
        let mut model_load = load.get(&m.name).copied().unwrap_or_default();
        if let Some(e) = engine.get(&m.name) {
            model_load.engine_waiting = e.waiting;
            model_load.engines_without_waiting = e.without_waiting;
            model_load.kv_cache = e.kv_cache;
        }
        let ready = crate::registry::ready_replicas(&registry.replicas, &m.name);
        let inputs = Inputs {
            signal: Signal::of(class),
            load: model_load,
            current: placed.len(),
            ready,
            slots_per_replica: placed.iter().sum::<u32>() / placed.len() as u32,
            target: f64::from(class.utilisation_target_pct) / 100.0,
            floor: class.warm_floor as usize,
        };
        let d = scale.decide(&m.name, &inputs, now);
        // Said once per change (the loop ticks faster than a placement may take to land).
        let new = said.insert(m.name.clone(), (inputs.current, d.desired)) != Some((inputs.current, d.desired));
        if d.desired != inputs.current && new {
            tracing::info!(model = %m.name, from = inputs.current, to = d.desired, reason = %d.reason, "scaling");
            ctx.history.event(
                "scale",
                &m.name,
                format!("{} → {} replicas: {}", inputs.current, d.desired, d.reason),
            );
        }
        targets.insert(m.name.clone(), d.desired);
    }
    targets
}

/// Per model, from the heartbeats: requests waiting in the replicas' engines, and their mean
/// KV-cache usage (for replicas that report them).
fn engine_load(ctx: &Context) -> HashMap<String, EngineLoad> {
    let mut sums: HashMap<String, (EngineLoad, f64, u32)> = HashMap::new();
    for (_, seen) in ctx.heartbeats.all() {
        for (model, waiting, kv) in &seen.engine {
            let e = sums.entry(model.clone()).or_default();
            e.0.waiting += waiting;
            e.0.without_waiting += u32::from(*waiting == 0);
            if let Some(kv) = kv {
                e.1 += kv;
                e.2 += 1;
            }
        }
    }
    sums.into_iter()
        .map(|(m, (mut e, kv, n))| {
            e.kv_cache = (n > 0).then(|| kv / f64::from(n));
            (m, e)
        })
        .collect()
}

/// One model's engine-side load, summed over its ready replicas' heartbeats.
#[derive(Default)]
struct EngineLoad {
    waiting: u32,
    /// Replicas whose engine has nothing waiting.
    without_waiting: u32,
    kv_cache: Option<f64>,
}

/// Per node heard from, its MIG devices on GPUs whose reported layout is the one wanted (no
/// re-partitioning pending), from the heartbeats.
fn settled_slices(ctx: &Context, registry: &Registry) -> HashMap<String, Vec<replicas::Slice>> {
    ctx.heartbeats
        .all()
        .into_iter()
        .map(|(node, seen)| {
            let slices = seen
                .gpus
                .iter()
                .filter(|g| !g.mig_devices.is_empty())
                .filter(|g| {
                    let mut wanted = registry
                        .mig
                        .get(&node)
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
            (node, slices)
        })
        .collect()
}

/// Per node, the models whose every weight artifact is in its cache (from the heartbeats).
fn cached_models(ctx: &Context, registry: &Registry) -> HashMap<String, std::collections::HashSet<String>> {
    let with_weights: Vec<_> = registry.models.values().filter(|m| !m.weights.is_empty()).collect();
    if with_weights.is_empty() {
        return HashMap::new();
    }
    ctx.heartbeats
        .all()
        .into_iter()
        .map(|(node, seen)| {
            let blobs: std::collections::HashSet<&str> = seen.cached_blobs.iter().map(String::as_str).collect();
            let models = with_weights
                .iter()
                .filter(|m| m.weights.iter().all(|w| blobs.contains(w.sha256.as_str())))
                .map(|m| m.name.clone())
                .collect();
            (node, models)
        })
        .collect()
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

/// Reports this controller's router load to the leader every [`REPORT_EVERY`], for the fast
/// loop.
pub async fn report(ctx: Context) {
    let mut tick = tokio::time::interval(REPORT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let leaders = ctx.controllers_client(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let load = ctx.router.model_load();
        match ctx.leader() {
            Some((id, _)) if id == ctx.node_id => ctx.load.record(ctx.node_id, load, Instant::now()),
            Some((_, addr)) => {
                let report = laneway_proto::admin::LoadReport {
                    controller_id: ctx.node_id,
                    models: load
                        .into_iter()
                        .map(|(model, l)| laneway_proto::admin::ModelLoadReport {
                            model,
                            in_flight: l.in_flight,
                            waiting: l.waiting,
                            ttft_p99_ms: l.ttft_p99_ms.unwrap_or(0.0),
                        })
                        .collect(),
                };
                let sent = leaders
                    .call_one(&addr, |mut c| {
                        let report = report.clone();
                        async move { c.report_load(report).await }
                    })
                    .await;
                if let Err(e) = sent {
                    tracing::debug!(leader = %addr, error = %e, "load report not delivered; the next one follows in a second");
                }
            }
            None => {}
        }
    }
}
