//! The agent API on the controllers: registration (a Raft write) and heartbeat streams (kept in
//! the leader's memory, never in the log).

use futures::StreamExt;
use laneway_proto::agent::agent_service_server::AgentService;
use laneway_proto::agent::{DesiredState, Heartbeat, RegisterReply, RegisterRequest};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::admin::AdminError;
use crate::command::Command;
use crate::context::Context;
use crate::fleet::heartbeats::Seen;
use crate::fleet::{GpuRecord, NodeRegistration};
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
            while let Some(msg) = inbound.next().await {
                let Ok(hb) = msg else { break };
                let reply = handle(&ctx, &mut bound, &hb);
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
        },
    );
    sync_replicas(ctx, hb);
    let (cordoned, draining) = ctx.sm.node_flags(&hb.node_id).unwrap_or((false, false));
    Ok(DesiredState {
        version: ctx.sm.applied_index(),
        sequence: hb.sequence,
        cordoned,
        draining,
        replicas: ctx.sm.desired_for(&hb.node_id),
        replicas_managed: true,
    })
}
