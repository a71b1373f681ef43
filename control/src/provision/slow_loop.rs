//! The leader's slow loop: every few seconds, decide ([`super::plan`]) from the applied state
//! and the replicas the placement pass could not place, commit the decision, and only then
//! call the node provider for what is committed: launches of requests not yet confirmed,
//! give-backs of nodes being released. Provider calls run beside the loop (a launch can take
//! minutes); their outcomes are committed too. Spot preemption notices from the provider are
//! committed as `PreemptNode` (the node drains, its jobs are requeued at once).

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use super::provider::{self, Join, NodeProvider, ProviderError};
use super::{NodeRequest, PlanInputs, ProvisionConfig, RequestState};
use crate::command::Command;
use crate::context::Context;

/// Runs for the controller's lifetime; decides only while leader.
pub async fn run(ctx: Context, cfg: ProvisionConfig, data_dir: &Path) {
    let (tx, mut notices) = mpsc::unbounded_channel();
    let provider = provider::build(&cfg, data_dir, tx);
    tracing::info!(
        provider = provider.kind(),
        pools = cfg.pools.len(),
        "slow loop (provisioner) on"
    );
    let busy: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mut tick = tokio::time::interval(Duration::from_secs(cfg.tick_s));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_stuck: Vec<(String, String)> = Vec::new();
    // When each model's replicas were first seen unplaced, in this leader's term.
    let mut unplaced_since: std::collections::HashMap<String, tokio::time::Instant> = Default::default();
    let grace = Duration::from_secs(cfg.unplaced_for_s);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            Some(node) = notices.recv() => {
                if ctx.is_leader() {
                    preempt(&ctx, &node).await;
                }
                continue;
            }
        }
        if !ctx.is_leader() {
            last_stuck.clear();
            unplaced_since.clear();
            continue;
        }
        let now_ms = crate::jobs::unix_ms();
        let (fleet, registry) = ctx.sm.routing_inputs();
        let now = tokio::time::Instant::now();
        let unplaced: Vec<_> = {
            let all = ctx.unplaced.lock().unwrap_or_else(|p| p.into_inner()).clone();
            unplaced_since.retain(|m, _| all.iter().any(|u| &u.model == m));
            all.into_iter()
                .filter(|u| {
                    let since = *unplaced_since.entry(u.model.clone()).or_insert(now);
                    now.saturating_duration_since(since) >= grace
                })
                .collect()
        };
        let mut new_id =
            |pool: &super::PoolSpec| format!("{}-{}", pool.name, &uuid::Uuid::new_v4().simple().to_string()[..6]);
        let plan = super::plan(
            &PlanInputs {
                config: &cfg,
                fleet: &fleet,
                registry: &registry,
                unplaced: &unplaced,
                now_ms,
            },
            &mut new_id,
        );
        if plan.stuck != last_stuck {
            for (model, why) in &plan.stuck {
                tracing::warn!(%model, %why, "slow loop cannot provision");
                ctx.history.event("provision", model, why.clone());
            }
            last_stuck = plan.stuck;
        }
        if !plan.commands.is_empty() {
            match ctx.proposer.propose(Command::Batch(plan.commands)).await {
                Ok((index, r)) if r.rejected.is_none() && r.batch.iter().all(|b| b.rejected.is_none()) => {
                    for (subject, message) in plan.events {
                        tracing::info!(%subject, %message, index, "slow loop");
                        ctx.history.event("provision", &subject, message);
                    }
                }
                Ok((_, r)) => tracing::warn!(response = ?r, "slow loop decision refused"),
                Err(e) => {
                    tracing::warn!(error = %e, "slow loop decision not committed; deciding again next tick");
                    continue;
                }
            }
        }
        // Provider calls for what is committed now.
        let registry = ctx.sm.registry();
        let join = Join {
            controllers: controllers(&ctx),
        };
        for r in registry.node_requests.values() {
            if !matches!(r.state, RequestState::Requested | RequestState::Releasing) {
                continue;
            }
            if !busy.lock().unwrap_or_else(|p| p.into_inner()).insert(r.id.clone()) {
                continue;
            }
            let (ctx, provider, busy, r, join, cfg) = (
                ctx.clone(),
                provider.clone(),
                busy.clone(),
                r.clone(),
                join.clone(),
                cfg.clone(),
            );
            tokio::spawn(async move {
                match r.state {
                    RequestState::Requested => launch(&ctx, provider.as_ref(), &r, &join, &cfg).await,
                    _ => give_back(&ctx, provider.as_ref(), &r).await,
                }
                busy.lock().unwrap_or_else(|p| p.into_inner()).remove(&r.id);
            });
        }
    }
}

/// Every member's address, for a new host's agent (it finds the leader itself).
fn controllers(ctx: &Context) -> Vec<String> {
    let m = ctx.raft.metrics().borrow().clone();
    m.membership_config
        .membership()
        .nodes()
        .map(|(_, n)| n.addr.clone())
        .collect()
}

async fn commit(ctx: &Context, cmd: Command) -> bool {
    match ctx.proposer.propose(cmd).await {
        Ok((_, r)) if r.rejected.is_none() && r.batch.iter().all(|b| b.rejected.is_none()) => true,
        Ok((_, r)) => {
            tracing::warn!(response = ?r, "slow loop: refused");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "slow loop: not committed (the next leader takes over)");
            false
        }
    }
}

async fn launch(ctx: &Context, provider: &dyn NodeProvider, r: &NodeRequest, join: &Join, cfg: &ProvisionConfig) {
    match provider.create(r, join).await {
        Ok(instance) => {
            // Still wanted? (released or joined meanwhile: leave it)
            let still = ctx
                .sm
                .registry()
                .node_requests
                .get(&r.id)
                .is_some_and(|now| now.state == RequestState::Requested);
            if still
                && commit(
                    ctx,
                    Command::PutNodeRequest(NodeRequest {
                        state: RequestState::Launched,
                        instance: instance.clone(),
                        ..r.clone()
                    }),
                )
                .await
            {
                ctx.history.event(
                    "provision",
                    &r.id,
                    format!(
                        "{} launched node {} ({} × {} in {}){}; waiting for it to join",
                        provider.kind(),
                        r.id,
                        r.gpus,
                        r.product,
                        super::region_name(&r.region),
                        if instance.is_empty() {
                            String::new()
                        } else {
                            format!(", instance {instance}")
                        }
                    ),
                );
            }
        }
        Err(e) => {
            let why = match &e {
                ProviderError::NoCapacity(w) => format!("launch of {} failed: no capacity: {w}", r.id),
                ProviderError::Failed(w) => format!("launch of {} failed: {w}", r.id),
            };
            let now = crate::jobs::unix_ms();
            let mark = Command::SetCapacityMark {
                key: super::capacity_key(&r.product, &r.region),
                mark: Some(super::CapacityMark {
                    product: r.product.clone(),
                    region: r.region.clone(),
                    until_ms: now + cfg.capacity_ttl_s * 1000,
                    why: why.clone(),
                }),
            };
            let cmd = Command::Batch(vec![mark, Command::RemoveNodeRequest { id: r.id.clone() }]);
            if commit(ctx, cmd).await {
                tracing::warn!(node = %r.id, %why, "slow loop: launch failed");
                ctx.history.event(
                    "provision",
                    &r.id,
                    format!(
                        "{why}; no launch of {} in {} for {} s (a configured fallback is tried instead)",
                        r.product,
                        super::region_name(&r.region),
                        cfg.capacity_ttl_s
                    ),
                );
            }
        }
    }
}

async fn give_back(ctx: &Context, provider: &dyn NodeProvider, r: &NodeRequest) {
    match provider.destroy(r).await {
        Ok(()) => {
            if commit(ctx, Command::RemoveNodeRequest { id: r.id.clone() }).await {
                ctx.history.event(
                    "provision",
                    &r.id,
                    format!("node {} given back to {}", r.id, provider.kind()),
                );
            }
        }
        Err(e) => {
            tracing::warn!(node = %r.id, error = %e, "slow loop: giving a node back failed; retrying next tick");
            ctx.history.event(
                "provision",
                &r.id,
                format!("giving node {} back failed: {e}; retrying", r.id),
            );
        }
    }
}

/// A provider's spot preemption notice: the node drains and its jobs go back to the queue.
async fn preempt(ctx: &Context, node: &str) {
    let cmd = Command::PreemptNode {
        node_id: node.to_string(),
        at_ms: crate::jobs::unix_ms(),
    };
    if commit(ctx, cmd).await {
        ctx.history.event(
            "provision",
            node,
            format!("spot preemption notice for {node}: draining it, its jobs requeued"),
        );
    }
}
