//! The controller's side of router-only processes (ADR 0029): the `WatchRouting` line that
//! sends them the routing state, `ReadJobs` for their tenants' job reads, and the board of the
//! routers this controller feeds (`crate::router_board`, for `lanectl cluster status`).
//!
//! One encoding of the state per applied index is shared by every line, so a hundred routers
//! cost one serialization per change, not a hundred.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use laneway_proto::admin::{JobCounts, ReadJobsRequest, RoutingUpdate, WatchRoutingRequest};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status};

use crate::context::Context;

/// A line sends a beat when nothing changed for this long; a router that hears nothing for
/// [`crate::router_only::SILENT_AFTER`] tries another controller.
pub const BEAT_EVERY: Duration = Duration::from_secs(1);
/// Changes are gathered for this long before one update goes out (a burst of heartbeats' commits
/// becomes one update).
pub const COALESCE: Duration = Duration::from_millis(50);
/// A controller that cannot confirm a leader with a quorum for this long ends its lines: its
/// state may be falling behind a leader it cannot hear (or it leads a minority), and the
/// routers should follow one that can.
pub const LEADERLESS_LIMIT: Duration = Duration::from_secs(3);
/// How many jobs one `ReadJobs` answers at most.
pub const READ_LIMIT: usize = 1000;

/// The full update at the state's applied index now (built once per index).
fn full(ctx: &Context) -> Result<Arc<RoutingUpdate>, Status> {
    let applied = ctx.sm.applied_index();
    if let Some(u) = ctx.routers.cached(applied, ctx.node_id) {
        return Ok(u);
    }
    // Read before the state (never inside `with_jobs`: a second read of the state's lock
    // while a writer waits deadlocks): the state sent is at least as new as its index.
    let applied_index = applied;
    // Copied under the state's read lock, encoded outside it: encoding a large fleet must not
    // hold up the state machine's applies.
    let (fleet, registry, jobs) = ctx.sm.with_jobs(|jobs, fleet, registry| {
        // A router needs no join tokens nor the record of who joined: they stay here.
        let mut registry = registry.clone();
        registry.access.join_tokens.clear();
        registry.access.joined.clear();
        let mut counts: HashMap<String, JobCounts> = registry
            .models
            .keys()
            .map(|m| {
                (
                    m.clone(),
                    JobCounts {
                        queued: jobs.queued(m) as u64,
                        ..JobCounts::default()
                    },
                )
            })
            .collect();
        for j in jobs.placed() {
            let c = counts.entry(j.model.clone()).or_default();
            match j.state {
                laneway_core::jobs::JobState::Running => c.running += 1,
                _ => c.assigned += 1,
            }
        }
        (fleet.clone(), registry, counts)
    });
    let (fleet_json, registry_json) = (serde_json::to_vec(&fleet), serde_json::to_vec(&registry));
    let encode = |e: serde_json::Error| Status::internal(format!("encoding the routing state: {e}"));
    let update = Arc::new(RoutingUpdate {
        applied_index,
        controller_id: ctx.node_id,
        has_state: true,
        fleet_json: fleet_json.map_err(encode)?.into(),
        registry_json: registry_json.map_err(encode)?.into(),
        jobs,
        ..RoutingUpdate::default()
    });
    ctx.routers.cache(update.clone());
    Ok(update)
}

/// The router number a `WatchRouting` call speaks for: the one its certificate names (a
/// controller may watch under any number, as the chaos harness and tests do in development
/// mode too).
fn router_of(req: &Request<WatchRoutingRequest>) -> Result<u32, Status> {
    let asked = req.get_ref().router;
    match crate::auth::caller(req) {
        Some(id) if id.router_number().is_some() => {
            let n = id.router_number().expect("checked");
            if asked != 0 && asked != n {
                return Err(Status::permission_denied(format!(
                    "this watch speaks for router {asked} but came with the certificate of router {n}"
                )));
            }
            Ok(n)
        }
        _ if asked == 0 => Err(Status::invalid_argument(
            "name the router number (`laneway-control router --router-id N`); 0 is not one",
        )),
        _ => Ok(asked),
    }
}

/// `WatchRouting`: the routing state now and on every change, from a controller caught up
/// with the leader.
pub async fn watch(
    ctx: &Context,
    req: Request<WatchRoutingRequest>,
) -> Result<ReceiverStream<Result<RoutingUpdate, Status>>, Status> {
    let router = router_of(&req)?;
    let addr: String = req.get_ref().router_addr.chars().take(256).collect();
    // Never a state older than what a client may already have been told.
    if !ctx.jobs.caught_up().await {
        return Err(Status::unavailable(format!(
            "controller {} is not caught up with the leader (or knows none); try another controller",
            ctx.node_id
        )));
    }
    // Subscribed before the first state is read: a change applied in between is sent next,
    // never missed.
    let mut changes = (ctx.sm.subscribe_changes(), ctx.sm.subscribe_jobs());
    changes.0.borrow_and_update();
    changes.1.borrow_and_update();
    let first = full(ctx)?;
    let (tx, rx) = mpsc::channel(4);
    let generation = ctx.routers.open(router, addr);
    let ctx = ctx.clone();
    tracing::info!(router, "a router-only process follows this controller's routing state");
    tokio::spawn(async move {
        let why = feed(&ctx, router, generation, first, changes, &tx).await;
        ctx.routers.closed(router, generation);
        tracing::info!(router, %why, "routing line closed");
    });
    Ok(ReceiverStream::new(rx))
}

/// Whether this controller still follows a leader that a quorum follows, confirmed within the
/// last second (one confirmation shared by every line): a leader cut off in a minority still
/// believes it leads, and a follower cut off from it still names it.
async fn still_current(ctx: &Context) -> bool {
    let _one_at_a_time = ctx.routers.confirming.lock().await;
    if ctx.routers.confirmed_within(BEAT_EVERY) {
        return true;
    }
    let ok = tokio::time::timeout(BEAT_EVERY, ctx.jobs.caught_up())
        .await
        .unwrap_or(false);
    if ok {
        ctx.routers.confirmed();
    }
    ok
}

/// Sends updates on `tx` until the router hangs up or this controller loses the leader.
async fn feed(
    ctx: &Context,
    router: u32,
    generation: u64,
    first: Arc<RoutingUpdate>,
    (mut changes, mut job_changes): (tokio::sync::watch::Receiver<u64>, tokio::sync::watch::Receiver<u64>),
    tx: &mpsc::Sender<Result<RoutingUpdate, Status>>,
) -> String {
    let stamp = |mut u: RoutingUpdate| {
        u.leader_id = ctx.leader().map_or(0, |(id, _)| id);
        u.controllers = member_addrs(&ctx.raft);
        u.sent_unix_ms = crate::jobs::unix_ms();
        u
    };
    let mut sent = first.applied_index;
    if tx.send(Ok(stamp((*first).clone()))).await.is_err() {
        return "the router hung up".into();
    }
    ctx.routers.sent(router, generation, sent);
    let mut current_at = Instant::now();
    loop {
        let changed = tokio::select! {
            r = changes.changed() => r.is_ok(),
            r = job_changes.changed() => r.is_ok(),
            _ = tokio::time::sleep(BEAT_EVERY) => false,
            _ = tx.closed() => return "the router hung up".into(),
        };
        if !ctx.routers.is_current(router, generation) {
            return "replaced by a newer line of the same router".into();
        }
        if still_current(ctx).await {
            current_at = Instant::now();
        } else if current_at.elapsed() >= LEADERLESS_LIMIT {
            let _ = tx
                .send(Err(Status::unavailable(format!(
                    "controller {} has not been able to confirm a leader with a quorum for {} s (an election, or this controller is cut off); follow another controller",
                    ctx.node_id,
                    LEADERLESS_LIMIT.as_secs()
                ))))
                .await;
            return "no confirmed leader".into();
        }
        // Only a change of the fleet, the registry or the jobs sends the state again: usage
        // reports, settings and the like move the applied index but not what routers read.
        let update = if changed {
            tokio::time::sleep(COALESCE).await;
            changes.borrow_and_update();
            job_changes.borrow_and_update();
            match full(ctx) {
                Ok(u) => (*u).clone(),
                Err(e) => {
                    let _ = tx.send(Err(e.clone())).await;
                    return e.message().to_string();
                }
            }
        } else {
            // Nothing a router reads changed: its copy is current as of the index now.
            RoutingUpdate {
                applied_index: ctx.sm.applied_index().max(sent),
                controller_id: ctx.node_id,
                ..RoutingUpdate::default()
            }
        };
        sent = update.applied_index;
        if tx.send(Ok(stamp(update))).await.is_err() {
            return "the router hung up".into();
        }
        ctx.routers.sent(router, generation, sent);
    }
}

/// Every member's gRPC address.
fn member_addrs(raft: &crate::raft_types::Raft) -> Vec<String> {
    let m = raft.metrics().borrow().membership_config.clone();
    m.membership().nodes().map(|(_, n)| n.addr.clone()).collect()
}

/// `ReadJobs`: a tenant's job by id, or its newest jobs, as applied here once caught up.
pub async fn read_jobs(ctx: &Context, req: Request<ReadJobsRequest>) -> Result<Vec<String>, Status> {
    let r = req.into_inner();
    if r.tenant.is_empty() {
        return Err(Status::invalid_argument("name the tenant whose jobs to read"));
    }
    let state = match r.state.as_str() {
        "" => None,
        s => Some(
            serde_json::from_value::<laneway_core::jobs::JobState>(serde_json::json!(s)).map_err(|_| {
                Status::invalid_argument("state must be one of queued, assigned, running, succeeded, failed, cancelled")
            })?,
        ),
    };
    let mine = |j: &laneway_core::jobs::Job| j.tenant == r.tenant;
    // What a job's view shows: its inline input (a tenant's prompt) stays here.
    let encode = |j: &laneway_core::jobs::Job| {
        let mut j = j.clone();
        j.input = None;
        serde_json::to_string(&j).expect("jobs serialize")
    };
    let behind = || {
        Status::unavailable(format!(
            "controller {} cannot confirm it has applied what the leader committed; try another controller",
            ctx.node_id
        ))
    };
    if !r.id.is_empty() {
        if let Some(j) = ctx.sm.job(&r.id).filter(mine) {
            return Ok(vec![encode(&j)]);
        }
        // Acknowledged a moment ago through another router, perhaps: a miss is an answer
        // only from a controller caught up with the leader.
        if !ctx.jobs.caught_up().await {
            return Err(behind());
        }
        return Ok(ctx.sm.job(&r.id).filter(mine).iter().map(encode).collect());
    }
    if !ctx.jobs.caught_up().await {
        return Err(behind());
    }
    let limit = (r.limit as usize).min(READ_LIMIT);
    Ok(ctx.sm.with_jobs(|jobs, _, _| {
        jobs.of_tenant(&r.tenant)
            .filter(|j| state.is_none_or(|s| j.state == s))
            .take(limit)
            .map(encode)
            .collect()
    }))
}
