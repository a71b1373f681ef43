//! The admin API: credentials: join and admin tokens, revoked certificates, and the audit log.

use laneway_proto::admin::DocumentsReply;
use laneway_proto::admin::WriteReply;
use laneway_proto::admin::{
    AuditRequest, CreateAdminTokenRequest, CreateJoinTokenRequest, JoinTokenReply, RevokeCertificateRequest,
    RevokeTokenRequest,
};
use tonic::{Request, Response, Status};

use super::service::*;
use super::AdminError;
use crate::command::Command;

pub(super) async fn create_join_token(
    admin: &AdminGrpc,
    req: Request<CreateJoinTokenRequest>,
) -> Result<Response<JoinTokenReply>, Status> {
    admin
        .audited("create_join_token", super::audit::Caller::of(&req), async move {
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
            admin
                .write(Command::CreateJoinToken {
                    sha256: sha256.clone(),
                    token: record,
                })
                .await?;
            Ok(Response::new(token_reply(token, &sha256, expires_ms)))
        })
        .await
}

pub(super) async fn revoke_token(
    admin: &AdminGrpc,
    req: Request<RevokeTokenRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("revoke_token", super::audit::Caller::of(&req), async move {
            let id = req.into_inner().id;
            let matching: Vec<String> = admin.sm.with_registry(|r| {
                r.access
                    .join_tokens
                    .keys()
                    .chain(r.access.admin_tokens.keys())
                    .filter(|sha| id.len() >= 6 && sha.starts_with(&id))
                    .cloned()
                    .collect()
            });
            let [sha256] = matching.as_slice() else {
                let msg = format!(
                    "{} tokens have the id {id:?}; give the id `lanectl token list` shows",
                    matching.len()
                );
                // None is a token not found; several is an id too short to say which.
                let e = if matching.is_empty() {
                    AdminError::NotFound(msg)
                } else {
                    AdminError::InvalidArgument(msg)
                };
                return Err(e.into());
            };
            Ok(Response::new(
                admin.write(Command::RevokeToken { sha256: sha256.clone() }).await?,
            ))
        })
        .await
}

pub(super) async fn create_admin_token(
    admin: &AdminGrpc,
    req: Request<CreateAdminTokenRequest>,
) -> Result<Response<JoinTokenReply>, Status> {
    admin
        .audited("create_admin_token", super::audit::Caller::of(&req), async move {
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
            admin
                .write(Command::CreateAdminToken {
                    sha256: sha256.clone(),
                    token: record,
                })
                .await?;
            Ok(Response::new(token_reply(token, &sha256, expires_ms)))
        })
        .await
}

pub(super) async fn revoke_certificate(
    admin: &AdminGrpc,
    req: Request<RevokeCertificateRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("revoke_certificate", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let cert = crate::registry::RevokedCert {
                identity: r.identity,
                at_ms: crate::jobs::unix_ms(),
            };
            Ok(Response::new(
                admin
                    .write(Command::RevokeCertificate { serial: r.serial, cert })
                    .await?,
            ))
        })
        .await
}

pub(super) async fn audit(admin: &AdminGrpc, req: Request<AuditRequest>) -> Result<Response<DocumentsReply>, Status> {
    let req = req.into_inner();
    let Some(log) = &admin.audit else {
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
