//! The admin API: membership, status, upgrades, settings and snapshots.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use laneway_proto::admin::{
    AddLearnerRequest, DeleteSettingRequest, GetSettingReply, GetSettingRequest, InitReply, InitRequest,
    MembershipReply, NodeStatus, PromoteRequest, PutSettingRequest, ReadIndexReply, ReadIndexRequest, RemoveRequest,
    SnapshotReply, SnapshotRequest, StatusRequest, WriteReply,
};
use laneway_proto::admin::{FinalizeUpgradeReply, FinalizeUpgradeRequest, MemberFormat};
use openraft::error::RaftError;
use openraft::{ChangeMembers, ServerState};
use tonic::{Request, Response, Status};

use super::pb_impl::{members, state_name};
use super::service::*;
use super::AdminError;
use crate::command::{validate_key, Command};
use crate::config::validate_peer_addr;
use crate::node::ControllerNode;

/// How long `add` waits for a new learner to catch up before giving up.
const LEARNER_CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);

pub(super) async fn init(admin: &AdminGrpc, req: Request<InitRequest>) -> Result<Response<InitReply>, Status> {
    admin.audited("init", super::audit::Caller::of(&req), async move {
        let nodes = BTreeMap::from([(
            admin.node_id,
            ControllerNode {
                addr: admin.advertise.clone(),
            },
        )]);
        match admin.raft.initialize(nodes).await {
            Ok(()) => {
                // A new cluster has one member, this binary: every format it knows is allowed.
                admin.raft
                    .wait(Some(Duration::from_secs(10)))
                    .current_leader(admin.node_id, "the new cluster's first leader")
                    .await
                    .map_err(|e| AdminError::Unavailable(format!("initialized, but no leader yet: {e}")))?;
                admin.proposer
                    .propose(Command::PutSetting {
                        key: crate::command::FORMAT_SETTING.into(),
                        value: crate::command::COMMAND_FORMAT.to_string(),
                    })
                    .await
                    .map_err(|e| admin.raft_error(e))?;
                Ok(Response::new(InitReply {
                    node_id: admin.node_id,
                    cluster: admin.cluster.clone(),
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

pub(super) async fn status(admin: &AdminGrpc, req: Request<StatusRequest>) -> Result<Response<NodeStatus>, Status> {
    let m = admin.metrics();
    let (applied, snapshot) = admin.sm.positions();
    // The hash costs a pass over the whole state: only when asked, on a blocking thread. Its
    // applied index is the one the hash was taken at, so members compare like with like.
    let (state_hash, applied) = if req.into_inner().with_state_hash {
        let sm = admin.sm.clone();
        tokio::task::spawn_blocking(move || sm.state_hash())
            .await
            .map_err(|e| Status::internal(format!("hashing the state: {e}")))?
    } else {
        (String::new(), applied)
    };
    let leader_addr = m
        .current_leader
        .and_then(|id| m.membership_config.membership().get_node(&id).map(|n| n.addr.clone()))
        .unwrap_or_default();
    let initialized = m.membership_config.membership().nodes().next().is_some();
    Ok(Response::new(NodeStatus {
        node_id: admin.node_id,
        cluster: admin.cluster.clone(),
        addr: admin.advertise.clone(),
        state: state_name(m.state).to_string(),
        term: m.current_term,
        leader_id: m.current_leader.unwrap_or(0),
        leader_addr,
        last_log_index: m.last_log_index.unwrap_or(0),
        committed_index: admin.log.db().committed().map_or(0, |l| l.index),
        applied_index: applied.map_or(0, |l| l.index),
        snapshot_index: snapshot.map_or(0, |l| l.index),
        purged_index: m.purged.map_or(0, |l| l.index),
        members: members(&m.membership_config),
        state_hash,
        initialized,
        retired_node_ids: admin.sm.retired_node_ids(),
        command_format: crate::command::COMMAND_FORMAT,
        routers: admin.ctx.routers.list(applied.map_or(0, |l| l.index)),
        router_loads: if admin.leader_only().is_ok() {
            let base = laneway_core::identity::ROUTER_REPORTER_BASE;
            admin
                .load
                .fresh_from(base + 1, tokio::time::Instant::now())
                .into_iter()
                .map(|(r, in_flight, waiting)| laneway_proto::admin::RouterLoad {
                    router: (r - base) as u32,
                    in_flight,
                    waiting,
                })
                .collect()
        } else {
            Vec::new()
        },
    }))
}

pub(super) async fn finalize_upgrade(
    admin: &AdminGrpc,
    req: Request<FinalizeUpgradeRequest>,
) -> Result<Response<FinalizeUpgradeReply>, Status> {
    admin
        .audited("finalize_upgrade", super::audit::Caller::of(&req), async move {
            admin.leader_only()?;
            let m = admin.metrics();
            let client = crate::context::controllers_client(admin.tls.as_ref(), Duration::from_secs(3));
            let mut members = Vec::new();
            for (id, node) in m.membership_config.membership().nodes() {
                let format = if *id == admin.node_id {
                    Ok(crate::command::COMMAND_FORMAT)
                } else {
                    client
                        .call_one(
                            &node.addr,
                            |mut c| async move { c.status(StatusRequest::default()).await },
                        )
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
                crate::command::allowed_format(admin.sm.get_setting(crate::command::FORMAT_SETTING).0.as_deref());
            if format > current {
                admin
                    .proposer
                    .propose(Command::PutSetting {
                        key: crate::command::FORMAT_SETTING.into(),
                        value: format.to_string(),
                    })
                    .await
                    .map_err(|e| admin.raft_error(e))?;
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

pub(super) async fn add_learner(
    admin: &AdminGrpc,
    req: Request<AddLearnerRequest>,
) -> Result<Response<MembershipReply>, Status> {
    admin.audited("add_learner", super::audit::Caller::of(&req), async move {
        let req = req.into_inner();
        admin.check_node_id(req.node_id)?;
        validate_peer_addr("addr", &req.addr).map_err(|e| {
            AdminError::InvalidArgument(format!("{} = {}: expected {}", e.field, e.value, e.expected))
        })?;
        let _one_at_a_time = admin.membership.lock().await;
        if admin.sm.is_retired(req.node_id) {
            return Err(AdminError::FailedPrecondition(format!(
                "node id {} was removed from this cluster and node ids are never reused; start the new controller with a fresh --node-id and an empty data dir",
                req.node_id
            ))
            .into());
        }
        let m = admin.metrics();
        if let Some(existing) = m.membership_config.membership().get_node(&req.node_id) {
            if existing.addr != req.addr {
                return Err(AdminError::FailedPrecondition(format!(
                    "node {} is already a member at {}; remove it first or use a new node id for {}",
                    req.node_id, existing.addr, req.addr
                ))
                .into());
            }
            // Already a member at this address: nothing to change.
            return Ok(Response::new(admin.membership_reply(m.last_log_index.unwrap_or(0))));
        }
        let node = ControllerNode { addr: req.addr.clone() };
        let resp = tokio::time::timeout(LEARNER_CATCH_UP_TIMEOUT, admin.raft.add_learner(req.node_id, node, true))
            .await
            .map_err(|_| {
                AdminError::DeadlineExceeded(format!(
                    "node {} was added as a learner but did not catch up within {}s; is laneway-control running at {} with cluster_name {:?}?",
                    req.node_id,
                    LEARNER_CATCH_UP_TIMEOUT.as_secs(),
                    req.addr,
                    admin.cluster
                ))
            })?
            .map_err(|e| admin.raft_error(e))?;
        Ok(Response::new(admin.membership_reply(resp.log_id.index)))
    })
    .await
}

pub(super) async fn promote(
    admin: &AdminGrpc,
    req: Request<PromoteRequest>,
) -> Result<Response<MembershipReply>, Status> {
    admin
        .audited("promote", super::audit::Caller::of(&req), async move {
            let id = req.into_inner().node_id;
            admin.check_node_id(id)?;
            let _one_at_a_time = admin.membership.lock().await;
            let m = admin.metrics();
            let membership = m.membership_config.membership();
            if membership.voter_ids().any(|v| v == id) {
                return Ok(Response::new(admin.membership_reply(m.last_log_index.unwrap_or(0))));
            }
            if membership.get_node(&id).is_none() {
                return Err(AdminError::FailedPrecondition(format!(
                "node {id} is not a learner of this cluster; add it first with `lanectl cluster add {id} HOST:PORT`"
            ))
                .into());
            }
            admin
                .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])))
                .await
        })
        .await
}

pub(super) async fn remove(
    admin: &AdminGrpc,
    req: Request<RemoveRequest>,
) -> Result<Response<MembershipReply>, Status> {
    admin
        .audited("remove", super::audit::Caller::of(&req), async move {
            let id = req.into_inner().node_id;
            admin.check_node_id(id)?;
            let _one_at_a_time = admin.membership.lock().await;
            let m = admin.metrics();
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
            admin.change_membership(change).await
        })
        .await
}

pub(super) async fn put_setting(
    admin: &AdminGrpc,
    req: Request<PutSettingRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin.audited("put_setting", super::audit::Caller::of(&req), async move {
        let req = req.into_inner();
        if req.key == crate::command::FORMAT_SETTING {
            return Err(AdminError::InvalidArgument(format!(
                "{} is raised only by `lanectl cluster finalize-upgrade`, which first checks that every controller can apply that format",
                req.key
            ))
            .into());
        }
        Ok(Response::new(
            admin.write(Command::PutSetting {
                key: req.key,
                value: req.value,
            })
            .await?,
        ))
    })
    .await
}

pub(super) async fn delete_setting(
    admin: &AdminGrpc,
    req: Request<DeleteSettingRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin.audited("delete_setting", super::audit::Caller::of(&req), async move {
        let req = req.into_inner();
        if req.key.starts_with(crate::command::CLUSTER_SETTINGS) {
            return Err(AdminError::InvalidArgument(format!(
                "{} is the cluster's own setting and is never deleted: without it the controllers would stop accepting revocations and token commands (`lanectl cluster finalize-upgrade` raises the command format)",
                req.key
            ))
            .into());
        }
        Ok(Response::new(
            admin.write(Command::DeleteSetting { key: req.key }).await?,
        ))
    })
    .await
}

pub(super) async fn get_setting(
    admin: &AdminGrpc,
    req: Request<GetSettingRequest>,
) -> Result<Response<GetSettingReply>, Status> {
    let req = req.into_inner();
    validate_key(&req.key).map_err(|e| AdminError::InvalidArgument(e.to_string()))?;
    if req.linearizable {
        admin.linearizable_barrier().await?;
    }
    let (value, applied) = admin.sm.get_setting(&req.key);
    Ok(Response::new(GetSettingReply {
        value,
        applied_index: applied.map_or(0, |l| l.index),
    }))
}

pub(super) async fn snapshot(
    admin: &AdminGrpc,
    req: Request<SnapshotRequest>,
) -> Result<Response<SnapshotReply>, Status> {
    admin
        .audited("snapshot", super::audit::Caller::of(&req), async move {
            let purge = req.into_inner().purge;
            let m = admin.metrics();
            if m.state == ServerState::Shutdown {
                return Err(AdminError::Internal("raft is shut down".into()).into());
            }
            let target = m.last_applied.map_or(0, |l| l.index);
            admin
                .raft
                .trigger()
                .snapshot()
                .await
                .map_err(|e| AdminError::Internal(e.to_string()))?;
            let snapshot_index = admin
                .wait_index("snapshot", target, |m| m.snapshot.map_or(0, |l| l.index))
                .await?;
            let mut purged_index = m.purged.map_or(0, |l| l.index);
            if purge && snapshot_index > 0 {
                admin
                    .raft
                    .trigger()
                    .purge_log(snapshot_index)
                    .await
                    .map_err(|e| AdminError::Internal(e.to_string()))?;
                // openraft may defer a purge while replication still reads those entries.
                purged_index = admin
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

pub(super) async fn read_index(
    admin: &AdminGrpc,
    _req: Request<ReadIndexRequest>,
) -> Result<Response<ReadIndexReply>, Status> {
    let (read_log_id, _applied) = admin.raft.get_read_log_id().await.map_err(|e| admin.raft_error(e))?;
    Ok(Response::new(ReadIndexReply {
        read_index: read_log_id.map_or(0, |l| l.index),
    }))
}
