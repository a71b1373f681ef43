//! The admin API: classes, models, versions and rollouts, tenants: the registry documents.

use laneway_proto::admin::UpdateRolloutRequest;
use laneway_proto::admin::WriteReply;
use laneway_proto::admin::{
    CreateTenantRequest, DocumentsReply, ListRegistryRequest, NameRequest, PutDocumentRequest, SetTenantLimitRequest,
    TenantKeyReply,
};
use tonic::{Request, Response, Status};

use super::service::*;
use super::AdminError;
use crate::auth::new_api_key;
use crate::command::Command;
use crate::registry::{hash_key, Class, Model, Tenant, TenantLimit};

pub(super) async fn put_class(
    admin: &AdminGrpc,
    req: Request<PutDocumentRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("put_class", super::audit::Caller::of_document(&req), async move {
            let class: Class = parse_document("class", &req.into_inner().json)?;
            // The core checks the PEM's shape; that each certificate is a usable CA needs the
            // TLS library, so it is checked here, before anything is proposed.
            if let Some(pem) = class.overflow.as_ref().and_then(|o| o.ca_pem.as_deref()) {
                crate::router::overflow::parse_ca_pem(pem)
                    .map_err(|e| AdminError::InvalidArgument(format!("class {}: overflow {e}", class.name)))?;
            }
            Ok(Response::new(admin.write(Command::PutClass(class)).await?))
        })
        .await
}

pub(super) async fn put_model(
    admin: &AdminGrpc,
    req: Request<PutDocumentRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("put_model", super::audit::Caller::of_document(&req), async move {
            let model: Model = parse_model(&req.into_inner().json)?;
            Ok(Response::new(admin.write(Command::PutModel(model)).await?))
        })
        .await
}

pub(super) async fn deploy_model(
    admin: &AdminGrpc,
    req: Request<PutDocumentRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("deploy_model", super::audit::Caller::of_document(&req), async move {
            let model: Model = parse_model(&req.into_inner().json)?;
            Ok(Response::new(admin.write(Command::DeployVersion(model)).await?))
        })
        .await
}

pub(super) async fn start_rollout(
    admin: &AdminGrpc,
    req: Request<PutDocumentRequest>,
) -> Result<Response<WriteReply>, Status> {
    let caller = super::audit::Caller::of(&req);
    let by = caller.who.clone();
    admin
        .audited("start_rollout", caller, async move {
            let spec: crate::registry::rollout::RolloutRequest = parse_document("rollout", &req.into_inner().json)?;
            let rollout = admin
                .sm
                .with_registry(|r| spec.rollout(r, crate::jobs::unix_ms(), &by))
                .map_err(AdminError::from)?;
            Ok(Response::new(admin.write(Command::StartRollout(rollout)).await?))
        })
        .await
}

pub(super) async fn update_rollout(
    admin: &AdminGrpc,
    req: Request<UpdateRolloutRequest>,
) -> Result<Response<WriteReply>, Status> {
    let caller = super::audit::Caller::of(&req);
    let by = caller.who.clone();
    admin
        .audited("update_rollout", caller, async move {
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
                admin
                    .write(Command::UpdateRollout {
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

pub(super) async fn remove_model(admin: &AdminGrpc, req: Request<NameRequest>) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("remove_model", super::audit::Caller::of(&req), async move {
            let name = req.into_inner().name;
            Ok(Response::new(admin.write(Command::RemoveModel { name }).await?))
        })
        .await
}

pub(super) async fn list_registry(
    admin: &AdminGrpc,
    req: Request<ListRegistryRequest>,
) -> Result<Response<DocumentsReply>, Status> {
    let kind = req.into_inner().kind;
    admin.linearizable_barrier().await?;
    let applied_index = admin.sm.applied_index();
    let r = admin.sm.registry();
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
                    let a = crate::scheduler::rollout_loop::assess(&admin.sm, ro, crate::jobs::unix_ms());
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
            .placement.pool_taints
            .iter()
            .map(|(pool, taints)| to_json(&serde_json::json!({"pool": pool, "taints": taints})))
            .collect(),
        "node-requests" => r.capacity.node_requests.values().map(to_json).collect(),
        "admin-tokens" => r
            .access.admin_tokens
            .iter()
            .map(|(sha, t)| {
                let mut v = serde_json::to_value(t).expect("admin token serializes");
                v["id"] = serde_json::json!(&sha[..crate::registry::JOIN_TOKEN_ID_CHARS]);
                to_json(&v)
            })
            .collect(),
        "revoked" => r
            .access.revoked_certs
            .iter()
            .map(|(serial, c)| to_json(&serde_json::json!({"serial": serial, "identity": c.identity, "at_ms": c.at_ms})))
            .collect(),
        // The token's hash stays inside: its id is a prefix of the hash.
        "join-tokens" => r
            .access.join_tokens
            .iter()
            .map(|(sha, t)| {
                let mut v = serde_json::to_value(t).expect("join token serializes");
                v["id"] = serde_json::json!(&sha[..crate::registry::JOIN_TOKEN_ID_CHARS]);
                to_json(&v)
            })
            .collect(),
        "capacity" => r.capacity.capacity_marks.values().map(to_json).collect(),
        "desired" => r
            .placement.desired
            .iter()
            .flat_map(|(node, rs)| {
                rs.iter()
                    .map(move |x| to_json(&serde_json::json!({"node": node, "replica": x})))
            })
            .collect(),
        "replicas" => r
            .placement.replicas
            .iter()
            .flat_map(|(node, rs)| {
                rs.iter()
                    .map(move |x| to_json(&serde_json::json!({"node": node, "replica": x})))
            })
            .collect(),
        // Every tenant's jobs, for the operator: state and placement, never the input.
        "jobs" => admin.sm.with_jobs(|jobs, _, _| {
            // In id order, as before the jobs were kept in a hash map: a stable listing.
            let mut all: Vec<&crate::jobs::Job> = jobs.jobs.values().collect();
            all.sort_unstable_by(|a, b| a.id.cmp(&b.id));
            all.into_iter()
                .map(|j| {
                    let mut v = crate::router::jobs::view(j);
                    v["tenant"] = serde_json::json!(j.tenant);
                    v["token"] = serde_json::json!(j.token);
                    v["result_key"] = serde_json::json!(j.result.as_ref().map(|r| &r.key));
                    to_json(&v)
                })
                .collect()
        }),
        "prices" => admin.sm.with_ledger(|l, _| {
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

pub(super) async fn create_tenant(
    admin: &AdminGrpc,
    req: Request<CreateTenantRequest>,
) -> Result<Response<TenantKeyReply>, Status> {
    admin
        .audited("create_tenant", super::audit::Caller::of(&req), async move {
            let name = req.into_inner().name;
            let api_key = new_api_key();
            let tenant = Tenant {
                name: name.clone(),
                key_sha256: hash_key(&api_key),
                limits: Default::default(),
            };
            let w = admin.write(Command::CreateTenant(tenant)).await?;
            Ok(Response::new(TenantKeyReply {
                tenant: name,
                api_key,
                log_index: w.log_index,
            }))
        })
        .await
}

pub(super) async fn rotate_tenant_key(
    admin: &AdminGrpc,
    req: Request<NameRequest>,
) -> Result<Response<TenantKeyReply>, Status> {
    admin
        .audited("rotate_tenant_key", super::audit::Caller::of(&req), async move {
            let tenant = req.into_inner().name;
            let api_key = new_api_key();
            let w = admin
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

pub(super) async fn set_tenant_limit(
    admin: &AdminGrpc,
    req: Request<SetTenantLimitRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("set_tenant_limit", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let limit = (!r.remove).then_some(TenantLimit {
                concurrency: r.concurrency,
                rate_per_s: r.rate_per_s,
                burst: r.burst,
                tokens_per_min: (r.tokens_per_min > 0).then_some(r.tokens_per_min),
            });
            Ok(Response::new(
                admin
                    .write(Command::SetTenantLimit {
                        tenant: r.tenant,
                        class: r.class,
                        limit,
                    })
                    .await?,
            ))
        })
        .await
}
