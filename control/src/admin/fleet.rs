//! The admin API: nodes, pools and MIG layouts.

use laneway_proto::admin::DocumentsReply;
use laneway_proto::admin::{ApplyMigPlanRequest, PlanMigRequest, SetMigLayoutRequest, SetPoolTaintsRequest};
use laneway_proto::admin::{
    GpuRecord as PbGpu, ListNodesReply, ListNodesRequest, NodeInfo, SetNodeFlagsRequest, WriteReply,
};
use tonic::{Request, Response, Status};

use super::service::*;
use super::AdminError;
use crate::command::Command;

pub(super) async fn set_pool_taints(
    admin: &AdminGrpc,
    req: Request<SetPoolTaintsRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("set_pool_taints", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            Ok(Response::new(
                admin
                    .write(Command::SetPoolTaints {
                        pool: r.pool,
                        taints: r.taints,
                    })
                    .await?,
            ))
        })
        .await
}

pub(super) async fn set_mig_layout(
    admin: &AdminGrpc,
    req: Request<SetMigLayoutRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("set_mig_layout", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            Ok(Response::new(
                admin
                    .write(Command::SetMigLayout {
                        node_id: r.node_id,
                        gpu: r.gpu,
                        profiles: r.profiles,
                    })
                    .await?,
            ))
        })
        .await
}

pub(super) async fn plan_mig(
    admin: &AdminGrpc,
    req: Request<PlanMigRequest>,
) -> Result<Response<DocumentsReply>, Status> {
    admin
        .audited("plan_mig", super::audit::Caller::of(&req), async move {
            admin.linearizable_barrier().await?;
            let (fleet, registry) = (admin.sm.fleet(), admin.sm.registry());
            let (gpus, notes) = crate::scheduler::mig_plan::propose(&fleet, &registry);
            if gpus.is_empty() {
                return Err(AdminError::FailedPrecondition(
                "no MIG-capable GPU on a schedulable node: there is nothing to plan (`lanectl mig list` shows the GPUs)"
                    .into(),
            )
            .into());
            }
            let plan = crate::scheduler::mig_plan::MigPlan {
                version: registry.capacity.mig_plan.as_ref().map_or(1, |p| p.version + 1),
                created_ms: crate::jobs::unix_ms(),
                gpus,
                notes,
                applied_ms: None,
            };
            let w = admin.write(Command::PutMigPlan(plan.clone())).await?;
            Ok(Response::new(DocumentsReply {
                json: vec![to_json(&plan)],
                applied_index: w.log_index,
            }))
        })
        .await
}

pub(super) async fn show_mig_plan(
    admin: &AdminGrpc,
    _req: Request<PlanMigRequest>,
) -> Result<Response<DocumentsReply>, Status> {
    admin.linearizable_barrier().await?;
    Ok(Response::new(DocumentsReply {
        json: admin.sm.registry().capacity.mig_plan.iter().map(to_json).collect(),
        applied_index: admin.sm.applied_index(),
    }))
}

pub(super) async fn apply_mig_plan(
    admin: &AdminGrpc,
    req: Request<ApplyMigPlanRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin.audited("apply_mig_plan", super::audit::Caller::of(&req), async move {
        let version = req.into_inner().version;
        admin.linearizable_barrier().await?;
        let (fleet, registry) = (admin.sm.fleet(), admin.sm.registry());
        let Some(plan) = registry.capacity.mig_plan.clone() else {
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
                .placement.mig
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
        admin.sm.check_allowed(&commands[0]).map_err(AdminError::from)?;
        let (log_index, resp) = admin
            .proposer
            .propose(Command::Batch(commands))
            .await
            .map_err(|e| admin.raft_error(e))?;
        if let Some(why) = resp
            .refused()
            .or_else(|| resp.batch.iter().find_map(|b| b.refused()))
        {
            return Err(AdminError::from(why).into());
        }
        admin.history.event(
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

pub(super) async fn list_nodes(
    admin: &AdminGrpc,
    _req: Request<ListNodesRequest>,
) -> Result<Response<ListNodesReply>, Status> {
    let fleet = admin.sm.fleet();
    let layouts = admin.sm.registry().placement.mig;
    let leader = admin.raft.metrics().borrow().current_leader == Some(admin.node_id);
    let suspects = if leader {
        admin.heartbeats.suspects()
    } else {
        Default::default()
    };
    let nodes = fleet
        .nodes
        .values()
        .map(|n| {
            let seen = if leader {
                admin.heartbeats.get(&n.registration.node_id)
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
                replicas: seen.as_ref().map(|s| s.replicas.clone()).unwrap_or_default(),
                suspect_ms_ago: suspects
                    .get(&r.node_id)
                    .filter(|_| n.liveness == crate::fleet::Liveness::Up)
                    .map_or(-1, |at| at.elapsed().as_millis() as i64),
            }
        })
        .collect();
    Ok(Response::new(ListNodesReply { nodes }))
}

pub(super) async fn set_node_flags(
    admin: &AdminGrpc,
    req: Request<SetNodeFlagsRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("set_node_flags", super::audit::Caller::of(&req), async move {
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
                    return Ok(Response::new(admin.write(command).await?));
                }
                "preempt" => {
                    let command = Command::PreemptNode {
                        node_id: req.node_id,
                        at_ms: crate::jobs::unix_ms(),
                    };
                    return Ok(Response::new(admin.write(command).await?));
                }
                other => {
                    return Err(AdminError::InvalidArgument(format!(
                        "action {other:?}: expected cordon, uncordon, drain, preempt, allow-static or disallow-static"
                    ))
                    .into())
                }
            };
            Ok(Response::new(
                admin
                    .write(Command::SetNodeFlags {
                        node_id: req.node_id,
                        cordoned,
                        draining,
                    })
                    .await?,
            ))
        })
        .await
}
