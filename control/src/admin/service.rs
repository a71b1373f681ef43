//! Admin API service: cluster membership, status, settings and snapshots.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::auth::new_api_key;
use crate::registry::{hash_key, Class, Model, Tenant, TenantLimit};
use laneway_proto::admin::admin_service_server::AdminService;
use laneway_proto::admin::{ActorsRequest, SetFailpointReply, SetFailpointRequest};
use laneway_proto::admin::{
    AddLearnerRequest, DeleteSettingRequest, GetSettingReply, GetSettingRequest, GpuRecord as PbGpu, InitReply,
    InitRequest, ListNodesReply, ListNodesRequest, MembershipReply, NodeInfo, NodeStatus, PromoteRequest,
    PutSettingRequest, ReadIndexReply, ReadIndexRequest, RemoveRequest, SetNodeFlagsRequest, SnapshotReply,
    SnapshotRequest, StatusRequest, WriteReply,
};
use laneway_proto::admin::{
    ApplyMigPlanRequest, AuditRequest, CreateAdminTokenRequest, CreateJoinTokenRequest, EventsRequest,
    FinalizeUpgradeReply, FinalizeUpgradeRequest, JoinTokenReply, MemberFormat, PlanMigRequest,
    RevokeCertificateRequest, RevokeTokenRequest, SetMigLayoutRequest, SetPoolTaintsRequest, UpdateRolloutRequest,
};
use laneway_proto::admin::{
    CreateTenantRequest, DocumentsReply, JobWriteReply, JobWritesReply, JobWritesRequest, LaneStatusRequest,
    LedgerRequest, ListRegistryRequest, LoadReport, LoadReportReply, NameRequest, PutDocumentRequest, SetPriceRequest,
    SetTenantLimitRequest, TenantKeyReply, UsageReportRequest,
};
use openraft::error::{ForwardToLeader, RaftError};
use openraft::{ChangeMembers, ServerState};
use tonic::{Request, Response, Status};

use super::error::RaftApiError;
use super::pb_impl::{members, state_name};
use super::AdminError;
use crate::client::AdminClient;
use crate::command::{validate_key, Command};
use crate::config::validate_peer_addr;
use crate::context::Context;
use crate::fleet::heartbeats::HeartbeatTable;
use crate::node::ControllerNode;
use crate::proposer::Proposer;
use crate::raft_types::{NodeId, Raft, RaftMetrics};
use crate::store::{LogStore, StateMachineStore};

fn to_json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("registry types serialize")
}

/// Parses a registry document, naming the field that is wrong.
fn parse_document<T: serde::de::DeserializeOwned>(what: &str, json: &str) -> Result<T, AdminError> {
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

/// A new secret token (`prefix` and 256 random bits), its sha256 (all that is stored) and the
/// time now, once its lifetime is between a minute and `max_ms` (`range` says so otherwise).
fn mint_token(prefix: &str, ttl_ms: u64, max_ms: u64, range: &str) -> Result<(String, String, u64), AdminError> {
    if !(60_000..=max_ms).contains(&ttl_ms) {
        return Err(AdminError::InvalidArgument(format!("ttl {ttl_ms} ms: {range}")));
    }
    let token = format!("{prefix}{}", &new_api_key()[3..]);
    let sha256 = hash_key(&token);
    Ok((token, sha256, crate::jobs::unix_ms()))
}

/// The answer that shows a token once, with its id (a prefix of its sha256).
fn token_reply(token: String, sha256: &str, expires_ms: u64) -> JoinTokenReply {
    JoinTokenReply {
        token,
        id: sha256[..crate::registry::JOIN_TOKEN_ID_CHARS].to_string(),
        expires_unix_ms: expires_ms,
    }
}

/// How long `add` waits for a new learner to catch up before giving up.
const LEARNER_CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a follower waits to apply up to a read index before giving up on a read.
const READ_INDEX_TIMEOUT: Duration = Duration::from_secs(5);
/// How long snapshot/purge requests wait for completion.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the admin API of one controller.
pub struct AdminGrpc {
    raft: Raft,
    node_id: NodeId,
    cluster: String,
    advertise: String,
    log: LogStore,
    sm: StateMachineStore,
    proposer: Proposer,
    heartbeats: Arc<HeartbeatTable>,
    router: Arc<crate::router::Router>,
    load: Arc<crate::scheduler::load_board::LoadBoard>,
    jobs: Arc<crate::jobs::gateway::JobGateway>,
    /// The leader's recent decisions (`Events`).
    history: Arc<crate::observe::history::History>,
    /// Connections to other controllers (a follower asks the leader for read indexes).
    peers: AdminClient,
    /// This controller's mTLS material, for calls to other controllers.
    tls: Option<laneway_pki::Tls>,
    /// One membership change at a time from this controller, so a concurrent `remove` and
    /// `add` of the same id cannot both pass the retired-id check.
    membership: tokio::sync::Mutex<()>,
    /// Where calls that change the cluster are recorded; `None`: not recorded.
    audit: Option<Arc<super::audit::AuditLog>>,
    /// This controller's actors (`lanectl actors`).
    actors: laneway_actors::ActorBoard,
}

impl AdminGrpc {
    /// Runs a call that changes the cluster, recorded in the audit log when there is one.
    async fn audited<T, F>(&self, call: &'static str, caller: super::audit::Caller, f: F) -> Result<Response<T>, Status>
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
        let Context {
            raft,
            node_id,
            cluster,
            advertise,
            log,
            sm,
            proposer,
            heartbeats,
            router,
            load,
            jobs,
            history,
            unplaced: _,
            tls,
            issuer: _,
            actors,
        } = ctx;
        AdminGrpc {
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

    fn metrics(&self) -> RaftMetrics {
        self.raft.metrics().borrow().clone()
    }

    /// Maps a Raft error: a forward-to-leader becomes a redirect, the rest internal errors.
    fn raft_error<E>(&self, e: RaftError<NodeId, E>) -> AdminError
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

    async fn write(&self, command: Command) -> Result<WriteReply, AdminError> {
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
        self.sm
            .check_allowed(&command)
            .map_err(AdminError::FailedPrecondition)?;
        let (log_index, resp) = self.proposer.propose(command).await.map_err(|e| self.raft_error(e))?;
        if let Some(reason) = resp.rejected {
            return Err(AdminError::FailedPrecondition(reason));
        }
        Ok(WriteReply {
            log_index,
            previous: resp.previous,
        })
    }

    fn membership_reply(&self, log_index: u64) -> MembershipReply {
        MembershipReply {
            log_index,
            members: members(&self.metrics().membership_config),
        }
    }

    /// Commits a membership change (removed nodes are not kept as learners).
    async fn change_membership(
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
    async fn wait_index(
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
    async fn linearizable_barrier(&self) -> Result<(), AdminError> {
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
    fn leader_only(&self) -> Result<(), AdminError> {
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

    fn check_node_id(&self, node_id: u64) -> Result<(), AdminError> {
        if node_id == 0 {
            return Err(AdminError::InvalidArgument("node_id must be > 0".into()));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl AdminService for AdminGrpc {
    async fn init(&self, req: Request<InitRequest>) -> Result<Response<InitReply>, Status> {
        self.audited("init", super::audit::Caller::of(&req), async move {
            let nodes = BTreeMap::from([(
                self.node_id,
                ControllerNode {
                    addr: self.advertise.clone(),
                },
            )]);
            match self.raft.initialize(nodes).await {
                Ok(()) => {
                    // A new cluster has one member, this binary: every format it knows is allowed.
                    self.raft
                        .wait(Some(Duration::from_secs(10)))
                        .current_leader(self.node_id, "the new cluster's first leader")
                        .await
                        .map_err(|e| AdminError::Unavailable(format!("initialized, but no leader yet: {e}")))?;
                    self.proposer
                        .propose(Command::PutSetting {
                            key: crate::command::FORMAT_SETTING.into(),
                            value: crate::command::COMMAND_FORMAT.to_string(),
                        })
                        .await
                        .map_err(|e| self.raft_error(e))?;
                    Ok(Response::new(InitReply {
                        node_id: self.node_id,
                        cluster: self.cluster.clone(),
                    }))
                }
                Err(RaftError::APIError(e)) => Err(AdminError::FailedPrecondition(format!(
                    "cannot initialize: {e}; this controller already has cluster state (use `lanectl cluster add` to grow an existing cluster)"
                ))
                .into()),
                Err(RaftError::Fatal(f)) => Err(AdminError::Internal(f.to_string()).into()),
            }
        })
        .await
    }

    async fn status(&self, _req: Request<StatusRequest>) -> Result<Response<NodeStatus>, Status> {
        let m = self.metrics();
        let view = self.sm.view();
        let leader_addr = m
            .current_leader
            .and_then(|id| m.membership_config.membership().get_node(&id).map(|n| n.addr.clone()))
            .unwrap_or_default();
        let initialized = m.membership_config.membership().nodes().next().is_some();
        Ok(Response::new(NodeStatus {
            node_id: self.node_id,
            cluster: self.cluster.clone(),
            addr: self.advertise.clone(),
            state: state_name(m.state).to_string(),
            term: m.current_term,
            leader_id: m.current_leader.unwrap_or(0),
            leader_addr,
            last_log_index: m.last_log_index.unwrap_or(0),
            committed_index: self.log.db().committed().map_or(0, |l| l.index),
            applied_index: view.last_applied.map_or(0, |l| l.index),
            snapshot_index: view.snapshot.map_or(0, |l| l.index),
            purged_index: m.purged.map_or(0, |l| l.index),
            members: members(&m.membership_config),
            state_hash: view.state.state_hash(),
            initialized,
            retired_node_ids: view.state.retired_node_ids.iter().copied().collect(),
            command_format: crate::command::COMMAND_FORMAT,
        }))
    }

    async fn finalize_upgrade(
        &self,
        req: Request<FinalizeUpgradeRequest>,
    ) -> Result<Response<FinalizeUpgradeReply>, Status> {
        self.audited("finalize_upgrade", super::audit::Caller::of(&req), async move {
            self.leader_only()?;
            let m = self.metrics();
            let client = crate::context::controllers_client(self.tls.as_ref(), Duration::from_secs(3));
            let mut members = Vec::new();
            for (id, node) in m.membership_config.membership().nodes() {
                let format = if *id == self.node_id {
                    Ok(crate::command::COMMAND_FORMAT)
                } else {
                    client
                        .call_one(&node.addr, |mut c| async move { c.status(StatusRequest {}).await })
                        .await
                        .map(|s| s.command_format)
                        .map_err(|e| e.to_string())
                };
                members.push((*id, node.addr.clone(), format));
            }
            let unreachable: Vec<String> = members
                .iter()
                .filter_map(|(id, addr, f)| f.as_ref().err().map(|e| format!("{id} at {addr}: {e}")))
                .collect();
            if !unreachable.is_empty() {
                return Err(AdminError::FailedPrecondition(format!(
                    "every member must answer before the cluster's command format is raised; not answering: {}",
                    unreachable.join("; ")
                ))
                .into());
            }
            // A member too old to report its format reports 0.
            let format = members
                .iter()
                .filter_map(|(_, _, f)| f.as_ref().ok().copied())
                .min()
                .unwrap_or(crate::command::UNGATED_FORMAT)
                .max(crate::command::UNGATED_FORMAT);
            let current =
                crate::command::allowed_format(self.sm.get_setting(crate::command::FORMAT_SETTING).0.as_deref());
            if format > current {
                self.proposer
                    .propose(Command::PutSetting {
                        key: crate::command::FORMAT_SETTING.into(),
                        value: format.to_string(),
                    })
                    .await
                    .map_err(|e| self.raft_error(e))?;
            }
            Ok(Response::new(FinalizeUpgradeReply {
                command_format: format.max(current),
                members: members
                    .into_iter()
                    .map(|(node_id, addr, f)| MemberFormat {
                        node_id,
                        addr,
                        command_format: f.unwrap_or(0),
                    })
                    .collect(),
            }))
        })
        .await
    }

    async fn add_learner(&self, req: Request<AddLearnerRequest>) -> Result<Response<MembershipReply>, Status> {
        self.audited("add_learner", super::audit::Caller::of(&req), async move {
            let req = req.into_inner();
            self.check_node_id(req.node_id)?;
            validate_peer_addr("addr", &req.addr).map_err(|e| {
                AdminError::InvalidArgument(format!("{} = {}: expected {}", e.field, e.value, e.expected))
            })?;
            let _one_at_a_time = self.membership.lock().await;
            if self.sm.is_retired(req.node_id) {
                return Err(AdminError::FailedPrecondition(format!(
                    "node id {} was removed from this cluster and node ids are never reused; start the new controller with a fresh --node-id and an empty data dir",
                    req.node_id
                ))
                .into());
            }
            let m = self.metrics();
            if let Some(existing) = m.membership_config.membership().get_node(&req.node_id) {
                if existing.addr != req.addr {
                    return Err(AdminError::FailedPrecondition(format!(
                        "node {} is already a member at {}; remove it first or use a new node id for {}",
                        req.node_id, existing.addr, req.addr
                    ))
                    .into());
                }
                // Already a member at this address: nothing to change.
                return Ok(Response::new(self.membership_reply(m.last_log_index.unwrap_or(0))));
            }
            let node = ControllerNode { addr: req.addr.clone() };
            let resp = tokio::time::timeout(LEARNER_CATCH_UP_TIMEOUT, self.raft.add_learner(req.node_id, node, true))
                .await
                .map_err(|_| {
                    AdminError::DeadlineExceeded(format!(
                        "node {} was added as a learner but did not catch up within {}s; is laneway-control running at {} with cluster_name {:?}?",
                        req.node_id,
                        LEARNER_CATCH_UP_TIMEOUT.as_secs(),
                        req.addr,
                        self.cluster
                    ))
                })?
                .map_err(|e| self.raft_error(e))?;
            Ok(Response::new(self.membership_reply(resp.log_id.index)))
        })
        .await
    }

    async fn promote(&self, req: Request<PromoteRequest>) -> Result<Response<MembershipReply>, Status> {
        self.audited("promote", super::audit::Caller::of(&req), async move {
            let id = req.into_inner().node_id;
            self.check_node_id(id)?;
            let _one_at_a_time = self.membership.lock().await;
            let m = self.metrics();
            let membership = m.membership_config.membership();
            if membership.voter_ids().any(|v| v == id) {
                return Ok(Response::new(self.membership_reply(m.last_log_index.unwrap_or(0))));
            }
            if membership.get_node(&id).is_none() {
                return Err(AdminError::FailedPrecondition(format!(
                    "node {id} is not a learner of this cluster; add it first with `lanectl cluster add {id} HOST:PORT`"
                ))
                .into());
            }
            self.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])))
                .await
        })
        .await
    }

    async fn remove(&self, req: Request<RemoveRequest>) -> Result<Response<MembershipReply>, Status> {
        self.audited("remove", super::audit::Caller::of(&req), async move {
            let id = req.into_inner().node_id;
            self.check_node_id(id)?;
            let _one_at_a_time = self.membership.lock().await;
            let m = self.metrics();
            let membership = m.membership_config.membership();
            let voters: BTreeSet<u64> = membership.voter_ids().collect();
            let change = if voters.contains(&id) {
                if voters.len() == 1 {
                    return Err(AdminError::FailedPrecondition(format!(
                        "node {id} is the only voter; a cluster cannot remove its last voter"
                    ))
                    .into());
                }
                ChangeMembers::RemoveVoters(BTreeSet::from([id]))
            } else if membership.get_node(&id).is_some() {
                ChangeMembers::RemoveNodes(BTreeSet::from([id]))
            } else {
                return Err(
                    AdminError::FailedPrecondition(format!("node {id} is not a member of this cluster")).into(),
                );
            };
            self.change_membership(change).await
        })
        .await
    }

    async fn put_setting(&self, req: Request<PutSettingRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("put_setting", super::audit::Caller::of(&req), async move {
            let req = req.into_inner();
            if req.key == crate::command::FORMAT_SETTING {
                return Err(AdminError::InvalidArgument(format!(
                    "{} is raised only by `lanectl cluster finalize-upgrade`, which first checks that every controller can apply that format",
                    req.key
                ))
                .into());
            }
            Ok(Response::new(
                self.write(Command::PutSetting {
                    key: req.key,
                    value: req.value,
                })
                .await?,
            ))
        })
        .await
    }

    async fn delete_setting(&self, req: Request<DeleteSettingRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("delete_setting", super::audit::Caller::of(&req), async move {
            let req = req.into_inner();
            if req.key.starts_with(crate::command::CLUSTER_SETTINGS) {
                return Err(AdminError::InvalidArgument(format!(
                    "{} is the cluster's own setting and is never deleted: without it the controllers would stop accepting revocations and token commands (`lanectl cluster finalize-upgrade` raises the command format)",
                    req.key
                ))
                .into());
            }
            Ok(Response::new(
                self.write(Command::DeleteSetting { key: req.key }).await?,
            ))
        })
        .await
    }

    async fn put_class(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("put_class", super::audit::Caller::of_document(&req), async move {
            let class: Class = parse_document("class", &req.into_inner().json)?;
            // The core checks the PEM's shape; that each certificate is a usable CA needs the
            // TLS library, so it is checked here, before anything is proposed.
            if let Some(pem) = class.overflow.as_ref().and_then(|o| o.ca_pem.as_deref()) {
                crate::router::overflow::parse_ca_pem(pem)
                    .map_err(|e| AdminError::InvalidArgument(format!("class {}: overflow {e}", class.name)))?;
            }
            Ok(Response::new(self.write(Command::PutClass(class)).await?))
        })
        .await
    }

    async fn put_model(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("put_model", super::audit::Caller::of_document(&req), async move {
            let model: Model = parse_document("model", &req.into_inner().json)?;
            Ok(Response::new(self.write(Command::PutModel(model)).await?))
        })
        .await
    }

    async fn deploy_model(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("deploy_model", super::audit::Caller::of_document(&req), async move {
            let model: Model = parse_document("model", &req.into_inner().json)?;
            Ok(Response::new(self.write(Command::DeployVersion(model)).await?))
        })
        .await
    }

    async fn start_rollout(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        let caller = super::audit::Caller::of(&req);
        let by = caller.who.clone();
        self.audited("start_rollout", caller, async move {
            let spec: crate::registry::rollout::RolloutRequest = parse_document("rollout", &req.into_inner().json)?;
            let rollout = self
                .sm
                .with_registry(|r| spec.rollout(r, crate::jobs::unix_ms(), &by))
                .map_err(AdminError::InvalidArgument)?;
            Ok(Response::new(self.write(Command::StartRollout(rollout)).await?))
        })
        .await
    }

    async fn update_rollout(&self, req: Request<UpdateRolloutRequest>) -> Result<Response<WriteReply>, Status> {
        let caller = super::audit::Caller::of(&req);
        let by = caller.who.clone();
        self.audited("update_rollout", caller, async move {
            let r = req.into_inner();
            let action = crate::registry::rollout::RolloutAction::parse_operator(&r.action)
                .map_err(AdminError::InvalidArgument)?;
            let reason = if r.reason.is_empty() {
                "no reason given".into()
            } else {
                r.reason
            };
            let message = format!("{} by {by}: {reason}", r.action);
            Ok(Response::new(
                self.write(Command::UpdateRollout {
                    model: r.model,
                    expect_step: None,
                    action,
                    at_ms: crate::jobs::unix_ms(),
                    message,
                })
                .await?,
            ))
        })
        .await
    }

    async fn remove_model(&self, req: Request<NameRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("remove_model", super::audit::Caller::of(&req), async move {
            let name = req.into_inner().name;
            Ok(Response::new(self.write(Command::RemoveModel { name }).await?))
        })
        .await
    }

    async fn list_registry(&self, req: Request<ListRegistryRequest>) -> Result<Response<DocumentsReply>, Status> {
        let kind = req.into_inner().kind;
        self.linearizable_barrier().await?;
        let applied_index = self.sm.applied_index();
        let r = self.sm.registry();
        let docs: Vec<String> = match kind.as_str() {
            "classes" => r.classes.values().map(to_json).collect(),
            "models" => r.models.values().map(to_json).collect(),
            // What each version entry does now (serving, in rollout, idle); apart from the
            // models, whose documents stay specifications that can be registered again.
            "model-states" => r
                .models
                .values()
                .map(|m| to_json(&serde_json::json!({"name": m.name, "state": r.version_state(m)})))
                .collect(),
            // With the numbers the leader judges by, and what it would decide now.
            "rollouts" => r
                .rollouts
                .values()
                .map(|ro| {
                    let mut v = serde_json::to_value(ro).expect("rollouts serialize");
                    if ro.state == crate::registry::rollout::RolloutState::Running {
                        let a = crate::scheduler::rollout_loop::assess(&self.sm, ro, crate::jobs::unix_ms());
                        v["now"] = serde_json::json!({
                            "new_version": a.canary,
                            "serving_version": a.baseline,
                            "judgement": a.verdict.describe(),
                        });
                    }
                    to_json(&v)
                })
                .collect(),
            // The key hash never leaves the controllers.
            "tenants" => r
                .tenants
                .values()
                .map(|t| to_json(&serde_json::json!({"name": t.name, "limits": t.limits})))
                .collect(),
            "pools" => r
                .pool_taints
                .iter()
                .map(|(pool, taints)| to_json(&serde_json::json!({"pool": pool, "taints": taints})))
                .collect(),
            "node-requests" => r.node_requests.values().map(to_json).collect(),
            "admin-tokens" => r
                .admin_tokens
                .iter()
                .map(|(sha, t)| {
                    let mut v = serde_json::to_value(t).expect("admin token serializes");
                    v["id"] = serde_json::json!(&sha[..crate::registry::JOIN_TOKEN_ID_CHARS]);
                    to_json(&v)
                })
                .collect(),
            "revoked" => r
                .revoked_certs
                .iter()
                .map(|(serial, c)| to_json(&serde_json::json!({"serial": serial, "identity": c.identity, "at_ms": c.at_ms})))
                .collect(),
            // The token's hash stays inside: its id is a prefix of the hash.
            "join-tokens" => r
                .join_tokens
                .iter()
                .map(|(sha, t)| {
                    let mut v = serde_json::to_value(t).expect("join token serializes");
                    v["id"] = serde_json::json!(&sha[..crate::registry::JOIN_TOKEN_ID_CHARS]);
                    to_json(&v)
                })
                .collect(),
            "capacity" => r.capacity_marks.values().map(to_json).collect(),
            "desired" => r
                .desired
                .iter()
                .flat_map(|(node, rs)| {
                    rs.iter()
                        .map(move |x| to_json(&serde_json::json!({"node": node, "replica": x})))
                })
                .collect(),
            "replicas" => r
                .replicas
                .iter()
                .flat_map(|(node, rs)| {
                    rs.iter()
                        .map(move |x| to_json(&serde_json::json!({"node": node, "replica": x})))
                })
                .collect(),
            // Every tenant's jobs, for the operator: state and placement, never the input.
            "jobs" => self.sm.with_jobs(|jobs, _, _| {
                jobs.jobs
                    .values()
                    .map(|j| {
                        let mut v = crate::router::jobs::view(j);
                        v["tenant"] = serde_json::json!(j.tenant);
                        v["token"] = serde_json::json!(j.token);
                        v["result_key"] = serde_json::json!(j.result.as_ref().map(|r| &r.key));
                        to_json(&v)
                    })
                    .collect()
            }),
            "prices" => self.sm.with_ledger(|l, _| {
                l.prices
                    .iter()
                    .flat_map(|(product, tiers)| {
                        tiers.iter().map(move |(tier, m)| {
                            to_json(&serde_json::json!({
                                "product": product,
                                "tier": tier,
                                "usd_per_hour": *m as f64 / 1e6,
                            }))
                        })
                    })
                    .collect()
            }),
            other => {
                return Err(AdminError::InvalidArgument(format!(
                    "unknown registry kind {other:?}; use classes, models, model-states, tenants, replicas, desired, pools, node-requests, capacity, jobs or prices"
                ))
                .into())
            }
        };
        Ok(Response::new(DocumentsReply {
            json: docs,
            applied_index,
        }))
    }

    async fn create_tenant(&self, req: Request<CreateTenantRequest>) -> Result<Response<TenantKeyReply>, Status> {
        self.audited("create_tenant", super::audit::Caller::of(&req), async move {
            let name = req.into_inner().name;
            let api_key = new_api_key();
            let tenant = Tenant {
                name: name.clone(),
                key_sha256: hash_key(&api_key),
                limits: Default::default(),
            };
            let w = self.write(Command::CreateTenant(tenant)).await?;
            Ok(Response::new(TenantKeyReply {
                tenant: name,
                api_key,
                log_index: w.log_index,
            }))
        })
        .await
    }

    async fn create_join_token(
        &self,
        req: Request<CreateJoinTokenRequest>,
    ) -> Result<Response<JoinTokenReply>, Status> {
        self.audited("create_join_token", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let (token, sha256, now) = mint_token(
                "lwjoin_",
                r.ttl_ms,
                7 * 86_400_000,
                "a join token lives between 1 minute and 7 days",
            )?;
            let record = crate::registry::JoinToken {
                created_ms: now,
                expires_ms: now + r.ttl_ms,
                node_id: (!r.node_id.is_empty()).then_some(r.node_id),
                used_by: None,
                used_key: None,
                used_ms: None,
                revoked: false,
            };
            let expires_ms = record.expires_ms;
            self.write(Command::CreateJoinToken {
                sha256: sha256.clone(),
                token: record,
            })
            .await?;
            Ok(Response::new(token_reply(token, &sha256, expires_ms)))
        })
        .await
    }

    async fn revoke_token(&self, req: Request<RevokeTokenRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("revoke_token", super::audit::Caller::of(&req), async move {
            let id = req.into_inner().id;
            let matching: Vec<String> = self.sm.with_registry(|r| {
                r.join_tokens
                    .keys()
                    .chain(r.admin_tokens.keys())
                    .filter(|sha| id.len() >= 6 && sha.starts_with(&id))
                    .cloned()
                    .collect()
            });
            let [sha256] = matching.as_slice() else {
                return Err(AdminError::InvalidArgument(format!(
                    "{} tokens have the id {id:?}; give the id `lanectl token list` shows",
                    matching.len()
                ))
                .into());
            };
            Ok(Response::new(
                self.write(Command::RevokeToken { sha256: sha256.clone() }).await?,
            ))
        })
        .await
    }

    async fn create_admin_token(
        &self,
        req: Request<CreateAdminTokenRequest>,
    ) -> Result<Response<JoinTokenReply>, Status> {
        self.audited("create_admin_token", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let (token, sha256, now) = mint_token(
                "lwadm_",
                r.ttl_ms,
                400 * 86_400_000,
                "an admin token lives between 1 minute and 400 days",
            )?;
            let record = crate::registry::AdminToken {
                name: r.name,
                role: r.role,
                created_ms: now,
                expires_ms: now + r.ttl_ms,
                revoked: false,
            };
            let expires_ms = record.expires_ms;
            self.write(Command::CreateAdminToken {
                sha256: sha256.clone(),
                token: record,
            })
            .await?;
            Ok(Response::new(token_reply(token, &sha256, expires_ms)))
        })
        .await
    }

    async fn revoke_certificate(&self, req: Request<RevokeCertificateRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("revoke_certificate", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let cert = crate::registry::RevokedCert {
                identity: r.identity,
                at_ms: crate::jobs::unix_ms(),
            };
            Ok(Response::new(
                self.write(Command::RevokeCertificate { serial: r.serial, cert })
                    .await?,
            ))
        })
        .await
    }

    async fn rotate_tenant_key(&self, req: Request<NameRequest>) -> Result<Response<TenantKeyReply>, Status> {
        self.audited("rotate_tenant_key", super::audit::Caller::of(&req), async move {
            let tenant = req.into_inner().name;
            let api_key = new_api_key();
            let w = self
                .write(Command::RotateTenantKey {
                    tenant: tenant.clone(),
                    key_sha256: hash_key(&api_key),
                })
                .await?;
            Ok(Response::new(TenantKeyReply {
                tenant,
                api_key,
                log_index: w.log_index,
            }))
        })
        .await
    }

    async fn set_tenant_limit(&self, req: Request<SetTenantLimitRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("set_tenant_limit", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let limit = (!r.remove).then_some(TenantLimit {
                concurrency: r.concurrency,
                rate_per_s: r.rate_per_s,
                burst: r.burst,
                tokens_per_min: (r.tokens_per_min > 0).then_some(r.tokens_per_min),
            });
            Ok(Response::new(
                self.write(Command::SetTenantLimit {
                    tenant: r.tenant,
                    class: r.class,
                    limit,
                })
                .await?,
            ))
        })
        .await
    }

    async fn report_load(&self, req: Request<LoadReport>) -> Result<Response<LoadReportReply>, Status> {
        self.leader_only()?;
        // The reporting controller is the one its certificate names, whatever the message says.
        let certified = crate::auth::caller(&req).and_then(|id| id.controller_id());
        let r = req.into_inner();
        if let Some(cid) = certified.filter(|c| *c != r.controller_id) {
            return Err(Status::permission_denied(format!(
                "this load report speaks for controller {} but came with the certificate of controller {cid}; a controller reports only its own load",
                r.controller_id
            )));
        }
        let load = r
            .models
            .into_iter()
            .map(|l| {
                (
                    l.model,
                    crate::scheduler::autoscale::ModelLoad {
                        in_flight: l.in_flight,
                        waiting: l.waiting,
                        ttft_p99_ms: (l.ttft_p99_ms > 0.0).then_some(l.ttft_p99_ms),
                        ..Default::default()
                    },
                )
            })
            .collect();
        self.load.record(r.controller_id, load, tokio::time::Instant::now());
        // A follower's actor restarts, for this leader's events (bounded: a report carries
        // what one controller's actors did in half a second).
        for e in r
            .actor_events
            .iter()
            .take(crate::scheduler::load_reporter::MAX_EVENTS_PER_REPORT)
        {
            let actor: String = e.actor.chars().take(128).collect();
            let message: String = e.message.chars().take(512).collect();
            self.history.event(
                "actor",
                &format!("controller {}/{actor}", r.controller_id),
                format!("failed and restarted: {message}"),
            );
        }
        Ok(Response::new(LoadReportReply {}))
    }

    async fn actors(&self, req: Request<ActorsRequest>) -> Result<Response<DocumentsReply>, Status> {
        let node = req.into_inner().node;
        let docs: Vec<String> = if node.is_empty() {
            crate::actors::documents(&format!("controller {}", self.node_id), self.actors.snapshot())
        } else {
            self.leader_only()?;
            let seen = self.heartbeats.get(&node).ok_or_else(|| {
                Status::not_found(format!(
                    "no heartbeat from node {node:?} reached this leader; is its agent connected? (`lanectl node list` shows when each node was last heard)"
                ))
            })?;
            crate::actors::documents(&format!("agent {node}"), seen.actors)
        };
        Ok(Response::new(DocumentsReply {
            json: docs,
            applied_index: self.sm.applied_index(),
        }))
    }

    async fn set_failpoint(&self, req: Request<SetFailpointRequest>) -> Result<Response<SetFailpointReply>, Status> {
        self.audited("set_failpoint", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            if !fail::has_failpoints() {
                return Err(Status::failed_precondition(
                    "this controller was built without failpoints (a release build); failpoints are for the chaos harness, on a build with `--features laneway-control/testing`",
                ));
            }
            fail::cfg(r.name.clone(), &r.actions).map_err(|e| {
                Status::invalid_argument(format!(
                    "failpoint {:?}: actions {:?}: {e}; give the fail crate's syntax, e.g. `1*return` or `off`",
                    r.name, r.actions
                ))
            })?;
            tracing::warn!(failpoint = %r.name, actions = %r.actions, "failpoint set (chaos)");
            Ok(Response::new(SetFailpointReply {}))
        })
        .await
    }

    async fn record_usage(&self, req: Request<UsageReportRequest>) -> Result<Response<WriteReply>, Status> {
        self.leader_only()?;
        let mut report: crate::ledger::UsageReport = parse_document("usage report", &req.into_inner().json)?;
        // Usage is filed by the leader's clock, as its own router's is: one clock drives the
        // ledger's buckets, whatever the reporting controller's says.
        report.at_ms = crate::jobs::unix_ms();
        Ok(Response::new(self.write(Command::RecordUsage(report)).await?))
    }

    async fn set_price(&self, req: Request<SetPriceRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("set_price", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let tier = crate::ledger::Tier::parse(&r.tier).map_err(AdminError::InvalidArgument)?;
            let micros_per_hour = if r.remove {
                None
            } else {
                Some(crate::ledger::usd_to_micros(r.usd_per_hour).map_err(AdminError::InvalidArgument)?)
            };
            Ok(Response::new(
                self.write(Command::SetPrice {
                    product: r.product,
                    tier,
                    micros_per_hour,
                })
                .await?,
            ))
        })
        .await
    }

    async fn ledger(&self, req: Request<LedgerRequest>) -> Result<Response<DocumentsReply>, Status> {
        let r = req.into_inner();
        let by = crate::ledger::query::By::parse(if r.by.is_empty() { "lane" } else { &r.by })
            .map_err(AdminError::InvalidArgument)?;
        let window_ms = if r.window_ms == 0 {
            crate::ledger::HOUR_MS
        } else {
            r.window_ms
        };
        if window_ms > crate::ledger::HOURS_KEPT_MS {
            return Err(AdminError::OutOfRange(format!(
                "window of {} h: the ledger keeps {} days; ask for less",
                window_ms / crate::ledger::HOUR_MS,
                crate::ledger::HOURS_KEPT_MS / crate::ledger::HOUR_MS / 24
            ))
            .into());
        }
        self.linearizable_barrier().await?;
        let applied_index = self.sm.applied_index();
        let now = crate::jobs::unix_ms();
        let report = self
            .sm
            .with_ledger(|l, f| crate::ledger::query::report(l, f, by, now.saturating_sub(window_ms), now));
        Ok(Response::new(DocumentsReply {
            json: vec![to_json(&report)],
            applied_index,
        }))
    }

    async fn job_writes(&self, req: Request<JobWritesRequest>) -> Result<Response<JobWritesReply>, Status> {
        self.leader_only()?;
        use crate::jobs::gateway::{GatewayError, JobWrite};
        // Every write is proposed at once, so the proposer folds them into one entry.
        let replies = futures::future::join_all(req.into_inner().json.iter().map(|json| async move {
            let refused = |why: String| JobWriteReply {
                rejected: why,
                ..JobWriteReply::default()
            };
            let write: JobWrite = match parse_document("job write", json) {
                Ok(w) => w,
                Err(e) => return refused(e.to_string()),
            };
            if let Err(e) = write.clone().into_command().validate() {
                return refused(e.to_string());
            }
            match self.jobs.commit_here(write).await {
                Ok((log_index, resp)) => JobWriteReply {
                    outcome_json: resp.job.as_ref().map(to_json).unwrap_or_default(),
                    rejected: resp.rejected.unwrap_or_default(),
                    log_index,
                    unavailable: String::new(),
                },
                Err(GatewayError::Rejected(m)) => refused(m),
                Err(GatewayError::Unavailable(m)) => JobWriteReply {
                    unavailable: m,
                    ..JobWriteReply::default()
                },
            }
        }))
        .await;
        Ok(Response::new(JobWritesReply { replies }))
    }

    async fn lane_status(&self, req: Request<LaneStatusRequest>) -> Result<Response<DocumentsReply>, Status> {
        let recent = req.into_inner().recent.min(1000) as usize;
        let docs = self
            .router
            .lane_status()
            .into_iter()
            .map(|l| {
                let records = self.router.recent(Some(&l.class), recent);
                to_json(&serde_json::json!({"status": l, "recent": records}))
            })
            .collect();
        Ok(Response::new(DocumentsReply {
            json: docs,
            applied_index: self.sm.applied_index(),
        }))
    }

    async fn get_setting(&self, req: Request<GetSettingRequest>) -> Result<Response<GetSettingReply>, Status> {
        let req = req.into_inner();
        validate_key(&req.key).map_err(|e| AdminError::InvalidArgument(e.to_string()))?;
        if req.linearizable {
            self.linearizable_barrier().await?;
        }
        let (value, applied) = self.sm.get_setting(&req.key);
        Ok(Response::new(GetSettingReply {
            value,
            applied_index: applied.map_or(0, |l| l.index),
        }))
    }

    async fn snapshot(&self, req: Request<SnapshotRequest>) -> Result<Response<SnapshotReply>, Status> {
        self.audited("snapshot", super::audit::Caller::of(&req), async move {
            let purge = req.into_inner().purge;
            let m = self.metrics();
            if m.state == ServerState::Shutdown {
                return Err(AdminError::Internal("raft is shut down".into()).into());
            }
            let target = m.last_applied.map_or(0, |l| l.index);
            self.raft
                .trigger()
                .snapshot()
                .await
                .map_err(|e| AdminError::Internal(e.to_string()))?;
            let snapshot_index = self
                .wait_index("snapshot", target, |m| m.snapshot.map_or(0, |l| l.index))
                .await?;
            let mut purged_index = m.purged.map_or(0, |l| l.index);
            if purge && snapshot_index > 0 {
                self.raft
                    .trigger()
                    .purge_log(snapshot_index)
                    .await
                    .map_err(|e| AdminError::Internal(e.to_string()))?;
                // openraft may defer a purge while replication still reads those entries.
                purged_index = self
                    .wait_index("log purge", snapshot_index, |m| m.purged.map_or(0, |l| l.index))
                    .await?;
            }
            Ok(Response::new(SnapshotReply {
                snapshot_index,
                purged_index,
            }))
        })
        .await
    }

    async fn read_index(&self, _req: Request<ReadIndexRequest>) -> Result<Response<ReadIndexReply>, Status> {
        let (read_log_id, _applied) = self.raft.get_read_log_id().await.map_err(|e| self.raft_error(e))?;
        Ok(Response::new(ReadIndexReply {
            read_index: read_log_id.map_or(0, |l| l.index),
        }))
    }

    async fn set_pool_taints(&self, req: Request<SetPoolTaintsRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("set_pool_taints", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            Ok(Response::new(
                self.write(Command::SetPoolTaints {
                    pool: r.pool,
                    taints: r.taints,
                })
                .await?,
            ))
        })
        .await
    }

    async fn events(&self, req: Request<EventsRequest>) -> Result<Response<DocumentsReply>, Status> {
        self.leader_only()?;
        let since = req.into_inner().since_ms;
        let mut events = self.history.events_since(since);
        self.sm.with_ledger(|l, _| {
            events.extend(
                l.events
                    .iter()
                    .filter(|e| e.at_ms >= since)
                    .map(|e| crate::observe::history::OpsEvent {
                        at_ms: e.at_ms,
                        kind: e.kind.clone(),
                        subject: e.subject.clone(),
                        message: e.message.clone(),
                    }),
            )
        });
        events.sort_by_key(|e| e.at_ms);
        Ok(Response::new(DocumentsReply {
            json: events.iter().map(to_json).collect(),
            applied_index: self.sm.applied_index(),
        }))
    }

    async fn set_mig_layout(&self, req: Request<SetMigLayoutRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("set_mig_layout", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            Ok(Response::new(
                self.write(Command::SetMigLayout {
                    node_id: r.node_id,
                    gpu: r.gpu,
                    profiles: r.profiles,
                })
                .await?,
            ))
        })
        .await
    }

    async fn plan_mig(&self, req: Request<PlanMigRequest>) -> Result<Response<DocumentsReply>, Status> {
        self.audited("plan_mig", super::audit::Caller::of(&req), async move {
            self.linearizable_barrier().await?;
            let (fleet, registry) = (self.sm.fleet(), self.sm.registry());
            let (gpus, notes) = crate::scheduler::mig_plan::propose(&fleet, &registry);
            if gpus.is_empty() {
                return Err(AdminError::FailedPrecondition(
                    "no MIG-capable GPU on a schedulable node: there is nothing to plan (`lanectl mig list` shows the GPUs)"
                        .into(),
                )
                .into());
            }
            let plan = crate::scheduler::mig_plan::MigPlan {
                version: registry.mig_plan.as_ref().map_or(1, |p| p.version + 1),
                created_ms: crate::jobs::unix_ms(),
                gpus,
                notes,
                applied_ms: None,
            };
            let w = self.write(Command::PutMigPlan(plan.clone())).await?;
            Ok(Response::new(DocumentsReply {
                json: vec![to_json(&plan)],
                applied_index: w.log_index,
            }))
        })
        .await
    }

    async fn show_mig_plan(&self, _req: Request<PlanMigRequest>) -> Result<Response<DocumentsReply>, Status> {
        self.linearizable_barrier().await?;
        Ok(Response::new(DocumentsReply {
            json: self.sm.registry().mig_plan.iter().map(to_json).collect(),
            applied_index: self.sm.applied_index(),
        }))
    }

    async fn apply_mig_plan(&self, req: Request<ApplyMigPlanRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("apply_mig_plan", super::audit::Caller::of(&req), async move {
            let version = req.into_inner().version;
            self.linearizable_barrier().await?;
            let (fleet, registry) = (self.sm.fleet(), self.sm.registry());
            let Some(plan) = registry.mig_plan.clone() else {
                return Err(AdminError::FailedPrecondition(
                    "no MIG plan yet: run `lanectl mig plan` and review it".into(),
                )
                .into());
            };
            if plan.version != version {
                return Err(AdminError::FailedPrecondition(format!(
                    "plan {version} is not the latest (that is {}): review it with `lanectl mig plan --show`",
                    plan.version
                ))
                .into());
            }
            if plan.applied_ms.is_some() {
                return Err(AdminError::FailedPrecondition(format!("plan {version} is already applied")).into());
            }
            let mut commands = Vec::new();
            for g in plan.gpus.iter().filter(|g| g.changes()) {
                let known = fleet
                    .nodes
                    .get(&g.node)
                    .is_some_and(|n| n.registration.gpus.iter().any(|x| x.uuid == g.gpu));
                if !known {
                    return Err(AdminError::FailedPrecondition(format!(
                        "plan {version} names GPU {} of node {}, which the fleet no longer has: run `lanectl mig plan` again",
                        g.gpu, g.node
                    ))
                    .into());
                }
                let now = registry
                    .mig
                    .get(&g.node)
                    .and_then(|m| m.get(&g.gpu))
                    .cloned()
                    .unwrap_or_default();
                if now != g.current {
                    return Err(AdminError::FailedPrecondition(format!(
                        "GPU {} of node {} changed since plan {version} was made: run `lanectl mig plan` again",
                        g.gpu, g.node
                    ))
                    .into());
                }
                commands.push(Command::SetMigLayout {
                    node_id: g.node.clone(),
                    gpu: g.gpu.clone(),
                    profiles: g.planned.clone(),
                });
            }
            commands.push(Command::PutMigPlan(crate::scheduler::mig_plan::MigPlan {
                applied_ms: Some(crate::jobs::unix_ms()),
                ..plan
            }));
            self.sm.check_allowed(&commands[0]).map_err(AdminError::FailedPrecondition)?;
            let (log_index, resp) = self
                .proposer
                .propose(Command::Batch(commands))
                .await
                .map_err(|e| self.raft_error(e))?;
            if let Some(why) = resp
                .rejected
                .or_else(|| resp.batch.iter().find_map(|b| b.rejected.clone()))
            {
                return Err(AdminError::FailedPrecondition(why).into());
            }
            self.history.event(
                "mig",
                &format!("plan {version}"),
                format!("MIG plan {version} applied (log index {log_index}); changed GPUs drain, then their agents re-partition them"),
            );
            Ok(Response::new(WriteReply {
                log_index,
                previous: None,
            }))
        })
        .await
    }

    async fn list_nodes(&self, _req: Request<ListNodesRequest>) -> Result<Response<ListNodesReply>, Status> {
        let fleet = self.sm.fleet();
        let layouts = self.sm.registry().mig;
        let leader = self.raft.metrics().borrow().current_leader == Some(self.node_id);
        let nodes = fleet
            .nodes
            .values()
            .map(|n| {
                let seen = if leader {
                    self.heartbeats.get(&n.registration.node_id)
                } else {
                    None
                };
                let r = &n.registration;
                NodeInfo {
                    node_id: r.node_id.clone(),
                    hostname: r.hostname.clone(),
                    pool: r.pool.clone(),
                    labels: r.labels.clone().into_iter().collect(),
                    gpus: r
                        .gpus
                        .iter()
                        .map(|g| {
                            let layout = layouts.get(&r.node_id).and_then(|l| l.get(&g.uuid));
                            PbGpu {
                                uuid: g.uuid.clone(),
                                product: g.product.clone(),
                                memory_bytes: g.memory_bytes,
                                mig_capable: g.mig_capable,
                                mig_layout: layout.cloned().unwrap_or_default(),
                                has_mig_layout: layout.is_some(),
                                mig_devices: seen
                                    .as_ref()
                                    .and_then(|s| s.gpus.iter().find(|x| x.uuid == g.uuid))
                                    .map(|x| x.mig_profiles.clone())
                                    .unwrap_or_default(),
                            }
                        })
                        .collect(),
                    liveness: match n.liveness {
                        crate::fleet::Liveness::Up => "up".into(),
                        crate::fleet::Liveness::Down => "down".into(),
                    },
                    cordoned: n.cordoned,
                    draining: n.draining,
                    last_heartbeat_ms_ago: seen.as_ref().map_or(-1, |s| s.at.elapsed().as_millis() as i64),
                    replicas_ready: seen.as_ref().map_or(0, |s| s.replicas_ready),
                    replicas_total: seen.as_ref().map_or(0, |s| s.replicas_total),
                }
            })
            .collect();
        Ok(Response::new(ListNodesReply { nodes }))
    }

    async fn audit(&self, req: Request<AuditRequest>) -> Result<Response<DocumentsReply>, Status> {
        let req = req.into_inner();
        let Some(log) = &self.audit else {
            return Err(Status::failed_precondition("this controller keeps no audit log"));
        };
        let limit = if req.limit == 0 { 1000 } else { req.limit as usize };
        let entries = log
            .read(req.since_ms, limit)
            .map_err(|e| Status::internal(format!("reading the audit log: {e}")))?;
        Ok(Response::new(DocumentsReply {
            json: entries.iter().map(|e| e.to_string()).collect(),
            applied_index: 0,
        }))
    }

    async fn set_node_flags(&self, req: Request<SetNodeFlagsRequest>) -> Result<Response<WriteReply>, Status> {
        self.audited("set_node_flags", super::audit::Caller::of(&req), async move {
            let req = req.into_inner();
            let (cordoned, draining) = match req.action.as_str() {
                "cordon" => (Some(true), None),
                "uncordon" => (Some(false), Some(false)),
                "drain" => (None, Some(true)),
                "allow-static" | "disallow-static" => {
                    let command = Command::SetNodeStatic {
                        node_id: req.node_id,
                        allowed: req.action == "allow-static",
                    };
                    return Ok(Response::new(self.write(command).await?));
                }
                "preempt" => {
                    let command = Command::PreemptNode {
                        node_id: req.node_id,
                        at_ms: crate::jobs::unix_ms(),
                    };
                    return Ok(Response::new(self.write(command).await?));
                }
                other => {
                    return Err(AdminError::InvalidArgument(format!(
                        "action {other:?}: expected cordon, uncordon, drain, preempt, allow-static or disallow-static"
                    ))
                    .into())
                }
            };
            Ok(Response::new(
                self.write(Command::SetNodeFlags {
                    node_id: req.node_id,
                    cordoned,
                    draining,
                })
                .await?,
            ))
        })
        .await
    }
}
