//! The leader's slow loop (the `Provisioner` actor): every few seconds, decide ([`super::plan`]) from the applied state
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

/// The node provider and its spot-preemption notices: built once per process, so a restarted
/// `Provisioner` (or a new term's) talks to the same provider.
#[derive(Clone)]
pub struct Provider {
    provider: Arc<dyn NodeProvider>,
    notices: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<String>>>,
    /// Requests with a provider call under way (a launch can take minutes).
    busy: Arc<Mutex<HashSet<String>>>,
}

impl Provider {
    pub fn build(cfg: &ProvisionConfig, data_dir: &Path) -> Provider {
        let (tx, notices) = mpsc::unbounded_channel();
        let provider = provider::build(cfg, data_dir, tx);
        tracing::info!(
            provider = provider.kind(),
            pools = cfg.pools.len(),
            "slow loop (provisioner) on"
        );
        Provider {
            provider,
            notices: Arc::new(tokio::sync::Mutex::new(notices)),
            busy: Arc::default(),
        }
    }
}

/// The `Provisioner` actor's state, for one term.
pub struct Provisioner {
    ctx: Context,
    cfg: ProvisionConfig,
    p: Provider,
    last_stuck: Vec<(String, String)>,
    /// When each model's replicas were first seen unplaced, in this leader's term.
    unplaced_since: std::collections::HashMap<String, tokio::time::Instant>,
    next_round: tokio::time::Instant,
}

impl Provisioner {
    pub fn new(ctx: Context, cfg: ProvisionConfig, p: Provider) -> Self {
        Provisioner {
            ctx,
            cfg,
            p,
            last_stuck: Vec::new(),
            unplaced_since: Default::default(),
            next_round: tokio::time::Instant::now(),
        }
    }
}

impl laneway_actors::Ticker for Provisioner {
    const KIND: &'static str = "provisioner";

    /// Waits for the next round (every `tick_s`) or a preemption notice, and handles it.
    async fn tick(&mut self) -> Duration {
        let notice = {
            let mut notices = self.p.notices.lock().await;
            tokio::select! {
                _ = tokio::time::sleep_until(self.next_round) => None,
                n = notices.recv() => n,
            }
        };
        let round_due = notice.is_none();
        if round_due {
            self.next_round = tokio::time::Instant::now() + Duration::from_secs(self.cfg.tick_s);
        }
        if !self.ctx.is_leader() {
            return Duration::ZERO;
        }
        match notice {
            Some(node) => preempt(&self.ctx, &node).await,
            None => self.round().await,
        }
        Duration::ZERO
    }
}

impl Provisioner {
    async fn round(&mut self) {
        let (ctx, cfg) = (&self.ctx, &self.cfg);
        let grace = Duration::from_secs(cfg.unplaced_for_s);
        let now_ms = crate::jobs::unix_ms();
        let (fleet, registry) = ctx.sm.routing_inputs();
        let now = tokio::time::Instant::now();
        let unplaced: Vec<_> = {
            let all = ctx.unplaced.lock().unwrap_or_else(|p| p.into_inner()).clone();
            self.unplaced_since.retain(|m, _| all.iter().any(|u| &u.model == m));
            all.into_iter()
                .filter(|u| {
                    let since = *self.unplaced_since.entry(u.model.clone()).or_insert(now);
                    now.saturating_duration_since(since) >= grace
                })
                .collect()
        };
        let mut new_id =
            |pool: &super::PoolSpec| format!("{}-{}", pool.name, &uuid::Uuid::new_v4().simple().to_string()[..6]);
        let plan = super::plan(
            &PlanInputs {
                config: cfg,
                fleet: &fleet,
                registry: &registry,
                unplaced: &unplaced,
                now_ms,
            },
            &mut new_id,
        );
        if plan.stuck != self.last_stuck {
            for (model, why) in &plan.stuck {
                tracing::warn!(%model, %why, "slow loop cannot provision");
                ctx.history.event("provision", model, why.clone());
            }
            self.last_stuck = plan.stuck;
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
                    return;
                }
            }
        }
        // Provider calls for what is committed now, each beside the actor (a launch can take
        // minutes; its outcome is committed only while this node still leads).
        let registry = ctx.sm.registry();
        let join = Join {
            controllers: controllers(ctx),
        };
        for r in registry.capacity.node_requests.values() {
            if !matches!(r.state, RequestState::Requested | RequestState::Releasing) {
                continue;
            }
            if !self
                .p
                .busy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(r.id.clone())
            {
                continue;
            }
            let (ctx, provider, busy, r, join, cfg) = (
                ctx.clone(),
                self.p.provider.clone(),
                self.p.busy.clone(),
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
                .capacity
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
