//! Admin API service: cluster membership, status, settings and snapshots.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::new_api_key;
use crate::registry::hash_key;
use laneway_proto::admin::JoinTokenReply;
use laneway_proto::admin::{MembershipReply, ReadIndexRequest, WriteReply};
use openraft::error::{ForwardToLeader, RaftError};
use openraft::ChangeMembers;
use tonic::{Response, Status};

use super::error::RaftApiError;
use super::pb_impl::members;
use super::AdminError;
use crate::client::AdminClient;
use crate::command::Command;
use crate::context::Context;
use crate::fleet::heartbeats::HeartbeatTable;
use crate::node::ControllerNode;
use crate::proposer::Proposer;
use crate::raft_types::{NodeId, Raft, RaftMetrics};
use crate::store::{LogStore, StateMachineStore};

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("registry types serialize")
}

/// Parses a registry document, naming the field that is wrong.
pub(super) fn parse_document<T: serde::de::DeserializeOwned>(what: &str, json: &str) -> Result<T, AdminError> {
    let de = &mut serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        AdminError::InvalidArgument(if path == "." {
            format!("{what} document: {}", e.into_inner())
        } else {
            format!("{what} document, field `{path}`: {}", e.into_inner())
        })
    })
}

/// A model document, its runtime preset resolved into explicit fields (ADR 0027) before it is
/// read, so the replicated entry never depends on this binary's preset table.
pub(super) fn parse_model(json: &str) -> Result<crate::registry::Model, AdminError> {
    let doc: serde_json::Value =
        serde_json::from_str(json).map_err(|e| AdminError::InvalidArgument(format!("model document: {e}")))?;
    crate::registry::presets::model_from_document(doc)
        .map_err(|e| AdminError::InvalidArgument(format!("model document: {e}")))
}

/// A new secret token (`prefix` and 256 random bits), its sha256 (all that is stored) and the
/// time now, once its lifetime is between a minute and `max_ms` (`range` says so otherwise).
pub(super) fn mint_token(
    prefix: &str,
    ttl_ms: u64,
    max_ms: u64,
    range: &str,
) -> Result<(String, String, u64), AdminError> {
    if !(60_000..=max_ms).contains(&ttl_ms) {
        return Err(AdminError::InvalidArgument(format!("ttl {ttl_ms} ms: {range}")));
    }
    let token = format!("{prefix}{}", &new_api_key()[3..]);
    let sha256 = hash_key(&token);
    Ok((token, sha256, crate::jobs::unix_ms()))
}

/// The answer that shows a token once, with its id (a prefix of its sha256).
pub(super) fn token_reply(token: String, sha256: &str, expires_ms: u64) -> JoinTokenReply {
    JoinTokenReply {
        token,
        id: sha256[..crate::registry::JOIN_TOKEN_ID_CHARS].to_string(),
        expires_unix_ms: expires_ms,
    }
}

/// How long a follower waits to apply up to a read index before giving up on a read.
const READ_INDEX_TIMEOUT: Duration = Duration::from_secs(5);
/// How long snapshot/purge requests wait for completion.
pub(super) const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the admin API of one controller.
pub struct AdminGrpc {
    pub(super) raft: Raft,
    pub(super) node_id: NodeId,
    pub(super) cluster: String,
    pub(super) advertise: String,
    pub(super) log: LogStore,
    pub(super) sm: StateMachineStore,
    pub(super) proposer: Proposer,
    pub(super) heartbeats: Arc<HeartbeatTable>,
    pub(super) router: Arc<crate::router::Router>,
    pub(super) load: Arc<crate::scheduler::load_board::LoadBoard>,
    pub(super) jobs: Arc<crate::jobs::gateway::JobGateway>,
    /// The leader's recent decisions (`Events`).
    pub(super) history: Arc<crate::observe::history::History>,
    /// Connections to other controllers (a follower asks the leader for read indexes).
    pub(super) peers: AdminClient,
    /// This controller's mTLS material, for calls to other controllers.
    pub(super) tls: Option<laneway_pki::Tls>,
    /// One membership change at a time from this controller, so a concurrent `remove` and
    /// `add` of the same id cannot both pass the retired-id check.
    pub(super) membership: tokio::sync::Mutex<()>,
    /// Where calls that change the cluster are recorded; `None`: not recorded.
    pub(super) audit: Option<Arc<super::audit::AuditLog>>,
    /// This controller's actors (`lanectl actors`).
    pub(super) actors: laneway_actors::ActorBoard,
    /// The whole context, for the router-only lines (`router_feed`).
    pub(super) ctx: Context,
}

impl AdminGrpc {
    /// Runs a call that changes the cluster, recorded in the audit log when there is one.
    pub(super) async fn audited<T, F>(
        &self,
        call: &'static str,
        caller: super::audit::Caller,
        f: F,
    ) -> Result<Response<T>, Status>
    where
        F: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        match &self.audit {
            Some(log) => log.around(caller, call, f).await,
            None => f.await,
        }
    }

    /// Records every call that changes the cluster in `log`.
    pub fn with_audit(mut self, log: Arc<super::audit::AuditLog>) -> Self {
        self.audit = Some(log);
        self
    }

    pub fn new(ctx: Context) -> Self {
        let whole = ctx.clone();
        let Context {
            raft,
            node_id,
            cluster,
            advertise,
            log,
            sm,
            proposer,
            raft_timings: _,
            heartbeats,
            router,
            load,
            jobs,
            history,
            unplaced: _,
            tls,
            issuer: _,
            actors,
            routers: _,
            pulse: _,
        } = ctx;
        AdminGrpc {
            ctx: whole,
            router,
            load,
            jobs,
            history,
            proposer,
            heartbeats,
            peers: crate::context::controllers_client(tls.as_ref(), READ_INDEX_TIMEOUT),
            tls,
            membership: tokio::sync::Mutex::new(()),
            audit: None,
            actors,
            raft,
            node_id,
            cluster,
            advertise,
            log,
            sm,
        }
    }

    pub(super) fn metrics(&self) -> RaftMetrics {
        self.raft.metrics().borrow().clone()
    }

    /// Maps a Raft error: a forward-to-leader becomes a redirect, the rest internal errors.
    pub(super) fn raft_error<E>(&self, e: RaftError<NodeId, E>) -> AdminError
    where
        E: std::error::Error + openraft::TryAsRef<ForwardToLeader<NodeId, ControllerNode>> + RaftApiError,
    {
        if let Some(f) = e.forward_to_leader::<ControllerNode>() {
            return match (f.leader_id, &f.leader_node) {
                (Some(leader_id), Some(node)) => AdminError::NotLeader {
                    node_id: self.node_id,
                    leader_id,
                    leader_addr: node.addr.clone(),
                },
                _ => AdminError::NoLeader { node_id: self.node_id },
            };
        }
        match e {
            RaftError::APIError(api) => api.to_admin(self.node_id),
            RaftError::Fatal(f) => AdminError::Unavailable(format!(
                "raft on node {} has stopped ({f}); use another controller and check this one's log",
                self.node_id
            )),
        }
    }

    pub(super) async fn write(&self, command: Command) -> Result<WriteReply, AdminError> {
        command.validate().map_err(|e| match e {
            crate::command::CommandError::KeyTooLong { .. } | crate::command::CommandError::ValueTooLarge { .. } => {
                AdminError::OutOfRange(e.to_string())
            }
            crate::command::CommandError::EmptyKey
            | crate::command::CommandError::KeyNotPrintable { .. }
            | crate::command::CommandError::NestedBatch
            | crate::command::CommandError::InvalidNode(_)
            | crate::command::CommandError::Invalid(_) => AdminError::InvalidArgument(e.to_string()),
        })?;
        self.sm.check_allowed(&command)?;
        let (log_index, resp) = self.proposer.propose(command).await.map_err(|e| self.raft_error(e))?;
        if let Some(refused) = resp.refused() {
            return Err(refused.into());
        }
        Ok(WriteReply {
            log_index,
            previous: resp.previous,
        })
    }

    pub(super) fn membership_reply(&self, log_index: u64) -> MembershipReply {
        MembershipReply {
            log_index,
            members: members(&self.metrics().membership_config),
        }
    }

    /// Commits a membership change (removed nodes are not kept as learners).
    pub(super) async fn change_membership(
        &self,
        change: ChangeMembers<NodeId, ControllerNode>,
    ) -> Result<Response<MembershipReply>, Status> {
        let resp = self
            .raft
            .change_membership(change, false)
            .await
            .map_err(|e| self.raft_error(e))?;
        Ok(Response::new(self.membership_reply(resp.log_id.index)))
    }

    /// Waits until `index_of(metrics) >= target`, returning the value reached.
    pub(super) async fn wait_index(
        &self,
        what: &str,
        target: u64,
        index_of: impl Fn(&RaftMetrics) -> u64,
    ) -> Result<u64, AdminError> {
        let mut rx = self.raft.metrics();
        let wait = async {
            loop {
                let now = index_of(&rx.borrow());
                if now >= target {
                    return Ok(now);
                }
                if rx.changed().await.is_err() {
                    return Err(AdminError::Internal("raft stopped".into()));
                }
            }
        };
        tokio::time::timeout(SNAPSHOT_TIMEOUT, wait).await.map_err(|_| {
            AdminError::DeadlineExceeded(format!(
                "{what} did not reach index {target} within {}s",
                SNAPSHOT_TIMEOUT.as_secs()
            ))
        })?
    }

    /// Returns once a read on this controller is linearizable: the leader confirms its
    /// leadership with a quorum and names a read index, and this controller has applied it.
    /// A follower asks the leader for the index, then waits for its own state machine, so
    /// reads are served by every member rather than all by the leader.
    pub(super) async fn linearizable_barrier(&self) -> Result<(), AdminError> {
        // A planted bug for the chaos harness (testing builds): serve "linearizable" reads from
        // this controller's state as it is, without the read index. The linearizability
        // checker must catch it (chaos/scenarios/planted/stale-reads.toml).
        fail::fail_point!("admin::stale_read", |_| Ok(()));
        let m = self.metrics();
        let Some(leader_id) = m.current_leader else {
            return Err(AdminError::NoLeader { node_id: self.node_id });
        };
        if leader_id == self.node_id {
            self.raft.ensure_linearizable().await.map_err(|e| self.raft_error(e))?;
            return Ok(());
        }
        let addr = m
            .membership_config
            .membership()
            .get_node(&leader_id)
            .map(|n| n.addr.clone())
            .ok_or(AdminError::NoLeader { node_id: self.node_id })?;
        let read_index = self
            .peers
            .call_one(&addr, |mut c| async move { c.read_index(ReadIndexRequest {}).await })
            .await
            .map_err(|e| AdminError::Unavailable(format!("leader {leader_id} at {addr} gave no read index: {e}")))?
            .read_index;
        self.raft
            .wait(Some(READ_INDEX_TIMEOUT))
            .applied_index_at_least(Some(read_index), "linearizable read")
            .await
            .map_err(|e| {
                AdminError::DeadlineExceeded(format!(
                    "node {} did not apply up to read index {read_index} in time ({e}); it may be partitioned from the leader",
                    self.node_id
                ))
            })?;
        Ok(())
    }

    /// Refuses a leader-only call on a follower, naming the leader.
    pub(super) fn leader_only(&self) -> Result<(), AdminError> {
        let m = self.metrics();
        if crate::context::leads(&m, self.node_id).is_some() {
            return Ok(());
        }
        let leader = m
            .current_leader
            .and_then(|id| Some((id, m.membership_config.membership().get_node(&id)?.addr.clone())));
        Err(match leader {
            Some((leader_id, leader_addr)) => AdminError::NotLeader {
                node_id: self.node_id,
                leader_id,
                leader_addr,
            },
            None => AdminError::NoLeader { node_id: self.node_id },
        })
    }

    pub(super) fn check_node_id(&self, node_id: u64) -> Result<(), AdminError> {
        if node_id == 0 {
            return Err(AdminError::InvalidArgument("node_id must be > 0".into()));
        }
        Ok(())
    }
}
