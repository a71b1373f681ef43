//! The agent API on the controllers: registration (a Raft write) and heartbeat streams (kept in
//! the leader's memory, never in the log).

use futures::StreamExt;
use laneway_proto::agent::agent_service_server::AgentService;
use laneway_proto::agent::{AssignedJob, DesiredState, Heartbeat, JobRef, RegisterReply, RegisterRequest};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::admin::AdminError;
use crate::command::Command;
use crate::context::Context;
use crate::fleet::heartbeats::Seen;
use crate::fleet::{GpuRecord, NodeRegistration};
use crate::jobs::{Completion, JobResult, JobState};
use crate::registry::ReplicaRecord;

/// Serves agents.
pub struct AgentGrpc {
    ctx: Context,
}

impl AgentGrpc {
    pub fn new(ctx: Context) -> Self {
        AgentGrpc { ctx }
    }
}

/// The status that sends an agent to the leader (or tells it none is known yet).
fn not_leader(ctx: &Context) -> Status {
    match ctx.leader() {
        Some((leader_id, leader_addr)) if leader_id != ctx.node_id => AdminError::NotLeader {
            node_id: ctx.node_id,
            leader_id,
            leader_addr,
        }
        .into(),
        _ => AdminError::NoLeader { node_id: ctx.node_id }.into(),
    }
}

#[tonic::async_trait]
impl AgentService for AgentGrpc {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        if !self.ctx.is_leader() {
            return Err(not_leader(&self.ctx));
        }
        let r = req.into_inner();
        if !r.join_token.is_empty() {
            // Said on every registration so nobody believes tokens are checked yet.
            tracing::warn!(node = %r.node_id, "join tokens are not enforced yet (issue #9); accepting the registration");
        }
        let reg = NodeRegistration {
            node_id: r.node_id,
            hostname: r.hostname,
            pool: r.pool,
            labels: r.labels.into_iter().collect(),
            gpus: r
                .gpus
                .into_iter()
                .map(|g| GpuRecord {
                    uuid: g.uuid,
                    product: g.product,
                    memory_bytes: g.memory_bytes,
                    mig_capable: g.mig_capable,
                })
                .collect(),
            replica_host: r.replica_host,
        };
        reg.validate().map_err(Status::invalid_argument)?;
        let node_id = reg.node_id.clone();
        let (log_index, resp) = self
            .ctx
            .proposer
            .propose(Command::RegisterNode(reg))
            .await
            .map_err(|e| match e.forward_to_leader::<crate::node::ControllerNode>() {
                Some(_) => not_leader(&self.ctx),
                None => Status::unavailable(format!("registration could not be committed: {e}")),
            })?;
        if let Some(reason) = resp.rejected {
            tracing::warn!(node = %node_id, %reason, "node registration refused");
            return Err(Status::already_exists(reason));
        }
        tracing::info!(node = %node_id, log_index, "node registered");
        Ok(Response::new(RegisterReply { log_index }))
    }

    type HeartbeatsStream = ReceiverStream<Result<DesiredState, Status>>;

    async fn heartbeats(&self, req: Request<Streaming<Heartbeat>>) -> Result<Response<Self::HeartbeatsStream>, Status> {
        if !self.ctx.is_leader() {
            return Err(not_leader(&self.ctx));
        }
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            // The node this stream speaks for, fixed by its first heartbeat.
            let mut bound: Option<String> = None;
            let mut last: Option<Heartbeat> = None;
            // Jobs in the last reply: an assignment or a cancel goes out when it commits,
            // not on the next heartbeat.
            let mut sent: Vec<(String, u64)> = Vec::new();
            let mut jobs_changed = ctx.sm.subscribe_jobs();
            loop {
                let reply = tokio::select! {
                    msg = inbound.next() => {
                        let Some(Ok(hb)) = msg else { break };
                        let reply = handle(&ctx, &mut bound, &hb);
                        last = Some(hb);
                        reply
                    }
                    changed = jobs_changed.changed() => {
                        if changed.is_err() {
                            break;
                        }
                        let Some(hb) = last.as_ref().filter(|_| ctx.is_leader()) else { continue };
                        let (jobs, settled) = job_reply(&ctx, hb);
                        if job_keys(&jobs) == sent {
                            continue;
                        }
                        Ok(desired_state(&ctx, hb, jobs, settled))
                    }
                };
                if let Ok(r) = &reply {
                    sent = job_keys(&r.jobs);
                }
                let stop = reply.is_err();
                if tx.send(reply).await.is_err() || stop {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Commits the node's replicas when their routable facts (state, endpoint) differ from what
/// the state holds. In-flight counts and other fast-moving numbers never reach the log.
fn sync_replicas(ctx: &Context, hb: &Heartbeat) {
    let Some(host) = ctx.sm.replica_host(&hb.node_id) else {
        return;
    };
    let mut reported: Vec<ReplicaRecord> = hb
        .replicas
        .iter()
        .map(|r| ReplicaRecord {
            id: r.id.clone(),
            model: r.model.clone(),
            device: r.device.clone(),
            state: r.state.clone(),
            endpoint: if r.port == 0 {
                String::new()
            } else if host.contains(':') {
                format!("[{host}]:{}", r.port)
            } else {
                format!("{host}:{}", r.port)
            },
        })
        .collect();
    reported.sort_by(|a, b| a.id.cmp(&b.id));
    if reported == ctx.sm.node_replicas(&hb.node_id) {
        return;
    }
    if !ctx.heartbeats.should_propose(&hb.node_id, &reported, Instant::now()) {
        return;
    }
    let ctx = ctx.clone();
    let node_id = hb.node_id.clone();
    tokio::spawn(async move {
        let n = reported.len();
        let cmd = Command::SetNodeReplicas {
            node_id: node_id.clone(),
            replicas: reported,
        };
        match ctx.proposer.propose(cmd).await {
            Ok((index, resp)) => match resp.rejected {
                Some(why) => tracing::warn!(node = %node_id, %why, "replica update refused"),
                None => tracing::debug!(node = %node_id, replicas = n, index, "replicas committed"),
            },
            Err(e) => {
                tracing::warn!(node = %node_id, error = %e, "replica update not committed; retried on a later heartbeat")
            }
        }
    });
}

/// One heartbeat: check who sent it, record it, answer with the node's desired state.
fn handle(ctx: &Context, bound: &mut Option<String>, hb: &Heartbeat) -> Result<DesiredState, Status> {
    match bound {
        Some(node) if *node != hb.node_id => {
            tracing::warn!(stream_node = %node, claimed = %hb.node_id, "heartbeat for another node on this stream; closing it");
            return Err(Status::permission_denied(format!(
                "this stream belongs to node {node}; a heartbeat for {} is refused (an agent may only speak for its own node)",
                hb.node_id
            )));
        }
        Some(_) => {}
        None => {
            if ctx.sm.node_flags(&hb.node_id).is_none() {
                tracing::warn!(node = %hb.node_id, "heartbeat from an unregistered node");
                return Err(Status::not_found(format!(
                    "node {} is not registered; call Register first",
                    hb.node_id
                )));
            }
            *bound = Some(hb.node_id.clone());
        }
    }
    if !ctx.is_leader() {
        return Err(not_leader(ctx));
    }
    let replicas_ready = hb.replicas.iter().filter(|r| r.state == "ready").count() as u32;
    ctx.heartbeats.record(
        &hb.node_id,
        Seen {
            at: Instant::now(),
            replicas_ready,
            replicas_total: hb.replicas.len() as u32,
            lag_ms: crate::jobs::unix_ms().checked_sub(hb.sent_unix_ms),
            cached_blobs: hb.cached_blobs.clone(),
            in_flight: hb
                .replicas
                .iter()
                .map(|r| {
                    (
                        r.id.clone(),
                        r.model.clone(),
                        u32::try_from(r.in_flight).unwrap_or(u32::MAX),
                    )
                })
                .collect(),
            engine: hb
                .replicas
                .iter()
                .filter(|r| r.state == "ready")
                .map(|r| {
                    (
                        r.model.clone(),
                        u32::try_from(r.waiting).unwrap_or(u32::MAX),
                        (r.kv_cache_usage >= 0.0 && r.kv_cache_usage.is_finite()).then_some(r.kv_cache_usage.min(1.0)),
                    )
                })
                .collect(),
            gpus: hb
                .gpus
                .iter()
                .map(|g| crate::fleet::heartbeats::GpuSeen {
                    uuid: g.uuid.clone(),
                    utilisation_pct: g.utilisation_pct,
                    memory_used_bytes: g.memory_used_bytes,
                    healthy: g.healthy,
                    mig_devices: g.mig_devices.clone(),
                    mig_profiles: g.mig_profiles.clone(),
                })
                .collect(),
        },
    );
    sync_replicas(ctx, hb);
    commit_job_reports(ctx, hb);
    let (jobs, settled) = job_reply(ctx, hb);
    Ok(desired_state(ctx, hb, jobs, settled))
}

fn job_keys(jobs: &[AssignedJob]) -> Vec<(String, u64)> {
    jobs.iter().map(|j| (j.job_id.clone(), j.token)).collect()
}

/// The reply to `hb`: the node's flags, placed replicas and jobs.
fn desired_state(ctx: &Context, hb: &Heartbeat, jobs: Vec<AssignedJob>, settled: Vec<JobRef>) -> DesiredState {
    let (cordoned, draining) = ctx.sm.node_flags(&hb.node_id).unwrap_or((false, false));
    DesiredState {
        version: ctx.sm.applied_index(),
        sequence: hb.sequence,
        cordoned,
        draining,
        replicas: ctx.sm.desired_for(&hb.node_id),
        replicas_managed: true,
        jobs,
        settled,
        mig: ctx.sm.mig_for(&hb.node_id),
    }
}

/// Commits what the agent reports of its jobs: started and finished, each only while the job
/// still holds the report's token.
fn commit_job_reports(ctx: &Context, hb: &Heartbeat) {
    let now = crate::jobs::unix_ms();
    let mut commits = Vec::new();
    ctx.sm.with_jobs(|jobs, _, _| {
        for r in &hb.jobs {
            let Some(job) = jobs.get(&r.job_id).filter(|j| j.token == Some(r.token)) else {
                continue;
            };
            let command = match r.state.as_str() {
                "running" if job.state == JobState::Assigned => Command::JobStarted {
                    job_id: r.job_id.clone(),
                    token: r.token,
                    at_ms: now,
                },
                "succeeded" => Command::FinishJob {
                    job_id: r.job_id.clone(),
                    token: r.token,
                    completion: Completion::Succeeded(JobResult {
                        key: r.result_key.clone(),
                        bytes: r.result_bytes,
                        gpu_us: r.gpu_us,
                        content_type: r.content_type.clone(),
                    }),
                    at_ms: now,
                },
                "failed" => Command::FinishJob {
                    job_id: r.job_id.clone(),
                    token: r.token,
                    completion: Completion::Failed {
                        reason: format!("on {}: {}", hb.node_id, r.error),
                        retryable: r.retryable,
                    },
                    at_ms: now,
                },
                _ => continue,
            };
            commits.push(((r.job_id.clone(), r.token, r.state.clone()), command));
        }
    });
    for (key, command) in commits {
        if matches!(command, Command::FinishJob { .. }) {
            // Chaos: the replica finished and published its result; the completion is not
            // committed yet.
            fail::fail_point!("jobs::before_completion_commit");
        }
        ctx.jobs.commit_report(key, command);
    }
}

/// The jobs assigned to `hb`'s node now, and the reports it may drop (finished, cancelled,
/// reassigned or forgotten jobs: such a report can never count).
fn job_reply(ctx: &Context, hb: &Heartbeat) -> (Vec<AssignedJob>, Vec<JobRef>) {
    ctx.sm.with_jobs(|jobs, _, registry| {
        let mut settled = Vec::new();
        let mut reported = std::collections::HashSet::new();
        for r in &hb.jobs {
            reported.insert((r.job_id.as_str(), r.token));
            let current = jobs.get(&r.job_id).is_some_and(|j| j.token == Some(r.token));
            if !current && r.state != "running" {
                settled.push(JobRef {
                    job_id: r.job_id.clone(),
                    token: r.token,
                });
            }
        }
        let assigned = jobs
            .placed_on(&hb.node_id)
            .filter_map(|j| {
                let token = j.token?;
                let known = reported.contains(&(j.id.as_str(), token));
                Some(AssignedJob {
                    job_id: j.id.clone(),
                    token,
                    model: j.model.clone(),
                    replica_id: j.replica.clone().unwrap_or_default(),
                    // The agent already has it: the input crosses the stream once.
                    input: if known {
                        String::new()
                    } else {
                        j.input.clone().unwrap_or_default()
                    },
                    input_uri: if known {
                        String::new()
                    } else {
                        j.input_uri.clone().unwrap_or_default()
                    },
                    timeout_ms: registry
                        .classes
                        .get(&j.class)
                        .map_or(600_000, |c| c.request_timeout_ms.as_duration().as_millis() as u64),
                    result_key: laneway_agent::results::result_key(&j.id, token),
                })
            })
            .collect();
        (assigned, settled)
    })
}
