//! The Raft transport service: checks the envelope, then hands the RPC to the local Raft node.

use laneway_proto::raft::raft_reply::Result as ReplyResult;
use laneway_proto::raft::raft_service_server::RaftService;
use laneway_proto::raft::{RaftReply, RaftRequest};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use super::PAYLOAD_FORMAT;
use crate::raft_types::{NodeId, Raft, TypeConfig};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};

/// Serves peers' Raft RPCs for one controller.
pub struct RaftGrpc {
    raft: Raft,
    cluster: String,
    node_id: NodeId,
}

impl RaftGrpc {
    pub fn new(raft: Raft, cluster: String, node_id: NodeId) -> Self {
        RaftGrpc { raft, cluster, node_id }
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
        reply(self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, req: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        let rpc: VoteRequest<NodeId> = self.open(req.get_ref())?;
        check_sender(&req, rpc.vote.leader_id().voted_for())?;
        reply(self.raft.vote(rpc).await)
    }

    async fn install_snapshot(&self, req: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        let rpc: InstallSnapshotRequest<TypeConfig> = self.open(req.get_ref())?;
        check_sender(&req, rpc.vote.leader_id().voted_for())?;
        reply(self.raft.install_snapshot(rpc).await)
    }
}
