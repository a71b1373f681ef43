//! The Raft transport service: checks the envelope, then hands the RPC to the local Raft node.

use laneway_proto::raft::raft_reply::Result as ReplyResult;
use laneway_proto::raft::raft_service_server::RaftService;
use laneway_proto::raft::{RaftReply, RaftRequest};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use std::sync::Arc;

use laneway_proto::raft::{WatchReply, WatchRequest};
use tokio_stream::wrappers::ReceiverStream;

use super::{LeaderContact, RaftTimings, PAYLOAD_FORMAT};
use crate::raft_types::{NodeId, Raft, TypeConfig};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};

/// Serves peers' Raft RPCs for one controller.
pub struct RaftGrpc {
    raft: Raft,
    cluster: String,
    node_id: NodeId,
    /// Stamped by every AppendEntries (the leader watch reads it).
    contact: Arc<LeaderContact>,
    /// Handling times of AppendEntries that carry entries.
    append_handle: prometheus_client::metrics::histogram::Histogram,
}

impl RaftGrpc {
    pub fn new(
        raft: Raft,
        cluster: String,
        node_id: NodeId,
        contact: Arc<LeaderContact>,
        timings: &RaftTimings,
    ) -> Self {
        RaftGrpc {
            raft,
            cluster,
            node_id,
            contact,
            append_handle: timings.append_handle.clone(),
        }
    }

    /// Refuses RPCs meant for another cluster or another member, or in an unknown format.
    fn open<T: DeserializeOwned>(&self, req: &RaftRequest) -> Result<T, Status> {
        if req.cluster != self.cluster {
            return Err(Status::permission_denied(format!(
                "this controller belongs to cluster {:?}, the request was for cluster {:?}; check the peer's cluster_name",
                self.cluster, req.cluster
            )));
        }
        if req.target != self.node_id {
            return Err(Status::failed_precondition(format!(
                "this controller is node {}, the request was addressed to node {}; the membership has a stale address",
                self.node_id, req.target
            )));
        }
        if req.format != PAYLOAD_FORMAT {
            return Err(Status::invalid_argument(format!(
                "raft payload format {} is not supported (expected {PAYLOAD_FORMAT}); run the same laneway-control version on every controller",
                req.format
            )));
        }
        serde_json::from_slice(&req.payload)
            .map_err(|e| Status::invalid_argument(format!("malformed raft payload: {e}")))
    }
}

/// Refuses an RPC whose sender (the candidate or leader it names) is not the controller its
/// certificate names: a controller cannot speak for another member.
fn check_sender<T>(req: &Request<T>, sender: Option<NodeId>) -> Result<(), Status> {
    let Some(id) = crate::auth::caller(req) else {
        return Ok(());
    };
    match (id.controller_id(), sender) {
        (Some(cert), Some(claimed)) if cert == claimed => Ok(()),
        (cert, claimed) => Err(Status::permission_denied(format!(
            "this RPC speaks for node {claimed:?} but came with the certificate of {id} (node {cert:?}); a controller may only speak for itself"
        ))),
    }
}

fn reply<T: Serialize, E: Serialize>(res: Result<T, E>) -> Result<Response<RaftReply>, Status> {
    let result = match res {
        Ok(v) => ReplyResult::Ok(serde_json::to_vec(&v).map_err(|e| Status::internal(e.to_string()))?),
        Err(e) => ReplyResult::RaftError(serde_json::to_vec(&e).map_err(|e| Status::internal(e.to_string()))?),
    };
    Ok(Response::new(RaftReply { result: Some(result) }))
}

#[tonic::async_trait]
impl RaftService for RaftGrpc {
    async fn append_entries(&self, req: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        let rpc: AppendEntriesRequest<TypeConfig> = self.open(req.get_ref())?;
        check_sender(&req, rpc.vote.leader_id().voted_for())?;
        self.contact.heard();
        let carries = !rpc.entries.is_empty();
        let started = tokio::time::Instant::now();
        let answer = self.raft.append_entries(rpc).await;
        if carries {
            self.append_handle.observe(started.elapsed().as_secs_f64());
        }
        reply(answer)
    }

    async fn vote(&self, req: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        let rpc: VoteRequest<NodeId> = self.open(req.get_ref())?;
        check_sender(&req, rpc.vote.leader_id().voted_for())?;
        reply(self.raft.vote(rpc).await)
    }

    async fn install_snapshot(&self, req: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        let rpc: InstallSnapshotRequest<TypeConfig> = self.open(req.get_ref())?;
        check_sender(&req, rpc.vote.leader_id().voted_for())?;
        self.contact.heard();
        reply(self.raft.install_snapshot(rpc).await)
    }

    type WatchStream = ReceiverStream<Result<WatchReply, Status>>;

    async fn watch(&self, req: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        check_sender(&req, Some(req.get_ref().follower))?;
        let w = req.into_inner();
        if w.cluster != self.cluster || w.target != self.node_id {
            return Err(Status::failed_precondition(format!(
                "this is node {} of cluster {:?}; the watch was for node {} of {:?}",
                self.node_id, self.cluster, w.target, w.cluster
            )));
        }
        // The server metrics change only with who leads: the whole metrics would wake this
        // stream's task on every turn of openraft's loop.
        let mut metrics = self.raft.server_metrics();
        let term = {
            let m = metrics.borrow();
            if m.current_leader != Some(self.node_id) {
                return Err(Status::failed_precondition(format!(
                    "node {} does not lead (leader: {:?})",
                    self.node_id, m.current_leader
                )));
            }
            m.vote.leader_id().get_term()
        };
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let _ = tx.try_send(Ok(WatchReply {
            leader: self.node_id,
            term,
        }));
        let me = self.node_id;
        // Held open while this node leads in this term; closed (cleanly) when it stops, or
        // dropped when the follower goes.
        tokio::spawn(async move {
            let still_leading = async {
                while metrics.changed().await.is_ok() {
                    let m = metrics.borrow();
                    if m.current_leader != Some(me) || m.vote.leader_id().get_term() != term {
                        return;
                    }
                }
            };
            tokio::select! {
                _ = still_leading => {}
                _ = tx.closed() => {}
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
