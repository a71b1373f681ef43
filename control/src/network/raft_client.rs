//! openraft's `RaftNetwork` over tonic.

use std::time::Duration;

use laneway_proto::raft::raft_reply::Result as ReplyResult;
use laneway_proto::raft::raft_service_client::RaftServiceClient;
use laneway_proto::raft::{RaftReply, RaftRequest};
use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::transport::Channel;

use super::{RaftTimings, MAX_RAFT_MESSAGE_BYTES, PAYLOAD_FORMAT, TARGET_APPEND_BYTES};
use crate::node::ControllerNode;
use crate::raft_types::{NodeId, TypeConfig};

/// How long to wait for a TCP connection to a peer.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(300);

/// Creates one [`PeerClient`] per replication target.
#[derive(Clone)]
pub struct NetworkFactory {
    cluster: String,
    /// This controller's mTLS material; `None` in insecure development mode.
    tls: Option<laneway_pki::Tls>,
    timings: RaftTimings,
}

impl NetworkFactory {
    pub fn new(cluster: impl Into<String>, tls: Option<laneway_pki::Tls>, timings: RaftTimings) -> Self {
        NetworkFactory {
            cluster: cluster.into(),
            tls,
            timings,
        }
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &ControllerNode) -> PeerClient {
        // The peer must present the certificate of the member being addressed: one for another
        // node id fails the handshake.
        let tls = self
            .tls
            .as_ref()
            .map(|t| t.client(&laneway_pki::controller_server_name(target)));
        let client = laneway_pki::endpoint(&node.addr, tls)
            .map(|ep| {
                let channel = ep.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true).connect_lazy();
                RaftServiceClient::new(channel)
                    .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES)
            })
            .map_err(|e| format!("peer {target} has an invalid address {:?}: {e}", node.addr));
        PeerClient {
            target,
            cluster: self.cluster.clone(),
            client,
            round_trip: self.timings.append_round_trip.clone(),
        }
    }
}

/// Connection to one peer controller.
pub struct PeerClient {
    target: NodeId,
    cluster: String,
    client: Result<RaftServiceClient<Channel>, String>,
    /// Round trips of AppendEntries that carry entries.
    round_trip: prometheus_client::metrics::histogram::Histogram,
}

/// Which RPC to send.
#[derive(Clone, Copy)]
enum Rpc {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, ControllerNode, RaftError<NodeId, E>>>;

impl PeerClient {
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: Rpc,
        req: &Req,
        entry_count: Option<u64>,
        ttl: Duration,
    ) -> RpcResult<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let client = match &mut self.client {
            Ok(c) => c,
            Err(msg) => {
                return Err(RPCError::Unreachable(Unreachable::new(&std::io::Error::other(
                    msg.clone(),
                ))))
            }
        };
        let payload = serde_json::to_vec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        if let (Rpc::AppendEntries, Some(n)) = (rpc, entry_count) {
            if payload.len() > TARGET_APPEND_BYTES && n > 1 {
                // Ask openraft to send fewer entries; it retries at once with the hint.
                return Err(RPCError::PayloadTooLarge(PayloadTooLarge::new_entries_hint(
                    (n / 2).max(1),
                )));
            }
        }
        let mut request = tonic::Request::new(RaftRequest {
            cluster: self.cluster.clone(),
            target: self.target,
            format: PAYLOAD_FORMAT,
            payload,
        });
        request.set_timeout(ttl);
        let reply = match rpc {
            Rpc::AppendEntries => client.append_entries(request).await,
            Rpc::Vote => client.vote(request).await,
            Rpc::InstallSnapshot => client.install_snapshot(request).await,
        };
        let reply: RaftReply = match reply {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unavailable => {
                return Err(RPCError::Unreachable(Unreachable::new(&status)))
            }
            Err(status) => return Err(RPCError::Network(NetworkError::new(&status))),
        };
        match reply.result {
            Some(ReplyResult::Ok(bytes)) => {
                serde_json::from_slice(&bytes).map_err(|e| RPCError::Network(NetworkError::new(&e)))
            }
            Some(ReplyResult::RaftError(bytes)) => {
                let err: RaftError<NodeId, E> =
                    serde_json::from_slice(&bytes).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
                Err(RPCError::RemoteError(RemoteError::new(self.target, err)))
            }
            None => Err(RPCError::Network(NetworkError::new(&std::io::Error::other(
                "peer sent an empty Raft reply",
            )))),
        }
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, openraft::error::Infallible> {
        let n = rpc.entries.len() as u64;
        let sent = tokio::time::Instant::now();
        let answer = self.call(Rpc::AppendEntries, &rpc, Some(n), option.hard_ttl()).await;
        // Heartbeats (no entries) would drown the writes' round trips.
        if n > 0 && answer.is_ok() {
            self.round_trip.observe(sent.elapsed().as_secs_f64());
        }
        answer
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        self.call(Rpc::InstallSnapshot, &rpc, None, option.hard_ttl()).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, openraft::error::Infallible> {
        self.call(Rpc::Vote, &rpc, None, option.hard_ttl()).await
    }

    /// A peer that is down is retried every 200 ms (openraft's default is 500 ms), so a restarted
    /// controller is caught up quickly.
    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(Duration::from_millis(200)))
    }
}
