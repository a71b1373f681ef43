//! `Lane{class}`: one class's fast loop. Every [`FAST_TICK`] it decides a replica count for
//! each of the class's models from their load — the routers' in-flight and waiting requests for
//! sync and bounded lanes, the replicated job queue for durable lanes, the engines' waiting
//! requests and KV cache for language models — with [`crate::scheduler::autoscale`] (pure), and
//! publishes the counts for the scheduler. Its scaling state (stabilisation windows) lives only
//! as long as the actor: a new term, or a restart after a failure, starts it afresh.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::context::Context;
use crate::registry::{LaneKind, Registry};
use crate::scheduler::autoscale::{Inputs, ModelLoad, ScaleState, Signal};
use crate::scheduler::placement_actor::FAST_TICK;
use crate::scheduler::term::Term;

/// One lane's actor state.
pub struct Lane {
    ctx: Context,
    class: String,
    term: Arc<Term>,
    scale: ScaleState,
    /// The last (current, desired) said per model, so a decision is logged once.
    said: HashMap<String, (usize, usize)>,
    /// The latest counts, for the board.
    last: HashMap<String, usize>,
}

impl Lane {
    pub fn new(ctx: Context, class: String, term: Arc<Term>) -> Self {
        Lane {
            ctx,
            class,
            term,
            scale: ScaleState::default(),
            said: HashMap::new(),
            last: HashMap::new(),
        }
    }
}

impl laneway_actors::Ticker for Lane {
    const KIND: &'static str = "lane";

    async fn tick(&mut self) -> Duration {
        if !self.ctx.is_leader() {
            return FAST_TICK;
        }
        let now = Instant::now();
        // The leader's own router, fresh (the others report every REPORT_EVERY).
        self.ctx
            .load
            .record(self.ctx.node_id, self.ctx.router.model_load(), now);
        let registry = self.ctx.sm.registry();
        if !registry.classes.contains_key(&self.class) {
            // Removed: the lane supervisor stops this actor at its next look.
            return FAST_TICK;
        }
        let suspect = self.ctx.heartbeats.suspect_nodes();
        let targets = fast_loop(
            &self.ctx,
            &registry,
            &self.class,
            &suspect,
            &mut self.scale,
            &mut self.said,
            now,
        );
        self.term.lanes.publish(&self.class, targets.clone(), suspect, now);
        self.last = targets;
        FAST_TICK
    }

    fn detail(&self) -> String {
        let mut v: Vec<String> = self.last.iter().map(|(m, n)| format!("{m}={n}")).collect();
        v.sort();
        v.join(", ")
    }
}

/// The fast loop: a replica count per model from its load — the routers' in-flight and
/// waiting requests for sync and bounded lanes, the replicated job queue (placed and queued
/// jobs) for durable lanes.
fn fast_loop(
    ctx: &Context,
    registry: &Registry,
    class_name: &str,
    suspect: &HashSet<String>,
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
    let cold_starts = cold_starts(ctx);
    let mut targets = HashMap::new();
    for m in registry.models.values().filter(|m| m.class == class_name) {
        let Some(class) = registry.classes.get(&m.class) else {
            continue;
        };
        let load = if class.lane == LaneKind::Durable {
            &job_load
        } else {
            &load
        };
        // Every placed replica's batch size, and how many of them are on suspect nodes.
        let mut placed: Vec<u32> = Vec::new();
        let mut on_suspect = 0;
        for (node, rs) in &registry.placement.desired {
            for r in rs.iter().filter(|r| r.model == m.name) {
                placed.push(m.profiles.get(&r.product).map_or(1, |p| p.max_batch));
                on_suspect += usize::from(suspect.contains(node));
            }
        }
        if placed.is_empty() {
            continue;
        }
        // While a suspect node's replicas are being replaced the model has what runs elsewhere,
        // and its intent is what was decided before: neither shrinks it (the suspect node's
        // share would never be replaced) nor grows it (the replacements are not new demand).
        let live = placed.len() - on_suspect;
        let current = match said.get(&m.name) {
            Some((_, before)) if on_suspect > 0 => live.max((*before).min(placed.len())),
            _ => live,
        };
        let mut model_load = load.get(&m.name).copied().unwrap_or_default();
        if let Some(e) = engine.get(&m.name) {
            model_load.engine_waiting = e.waiting;
            model_load.engines_without_waiting = e.without_waiting;
            model_load.kv_cache = e.kv_cache;
        }
        let ready = registry
            .placement
            .replicas
            .iter()
            .filter(|(node, _)| !suspect.contains(*node))
            .flat_map(|(_, rs)| rs)
            .filter(|r| r.model == m.name && r.state == "ready")
            .count();
        let inputs = Inputs {
            signal: Signal::of(class),
            load: model_load,
            current,
            ready,
            slots_per_replica: placed.iter().sum::<u32>() / placed.len() as u32,
            target: f64::from(class.utilisation_target_pct) / 100.0,
            floor: class.warm_floor as usize,
            cold_start: cold_starts.get(&m.name).copied(),
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

/// Per model, from the heartbeats: the longest start (placement to Ready) its replicas
/// reported, as the agents measured it.
fn cold_starts(ctx: &Context) -> HashMap<String, Duration> {
    let mut out: HashMap<String, Duration> = HashMap::new();
    ctx.heartbeats.with_all(|all| {
        for r in all.values().flat_map(|seen| &seen.replicas).filter(|r| r.ready_ms > 0) {
            let d = Duration::from_millis(r.ready_ms);
            let e = out.entry(r.model.clone()).or_default();
            *e = (*e).max(d);
        }
    });
    out
}

/// Per model, from the heartbeats: requests waiting in the replicas' engines, and their mean
/// KV-cache usage (for replicas that report them).
fn engine_load(ctx: &Context) -> HashMap<String, EngineLoad> {
    let mut sums: HashMap<String, (EngineLoad, f64, u32)> = HashMap::new();
    ctx.heartbeats.with_all(|all| {
        for (model, waiting, kv) in all.values().flat_map(|seen| &seen.engine) {
            let e = sums.entry(model.clone()).or_default();
            e.0.waiting += waiting;
            e.0.without_waiting += u32::from(*waiting == 0);
            if let Some(kv) = kv {
                e.1 += kv;
                e.2 += 1;
            }
        }
    });
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
