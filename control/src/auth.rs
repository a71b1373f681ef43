//! Who may call what on a controller's gRPC listener.
//!
//! Callers are identified by the client certificate the TLS handshake verified against the
//! cluster CA (see `laneway-pki`), unless its serial was revoked, or, without a certificate,
//! by an admin bearer token (`authorization: Bearer lwadm_…`) the cluster issued — never by
//! anything in the message. Each service is wrapped in
//! a [`Guarded`] layer that looks the method up in the service's table before the handler runs:
//! a method missing from the table is refused (default deny), and a refusal is written to the
//! audit log. The handler reads the identity back with [`caller`] where it must also check the
//! message against it (an agent writing its node's state, a Raft peer naming its node id).
//!
//! In insecure development mode (no TLS) there are no identities and nothing is refused.

use std::convert::Infallible;
use std::sync::Arc;

use laneway_pki::{Kind, PeerIdentity};
use tonic::body::Body;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service};
use tonic::server::NamedService;
use tonic::Status;

use crate::store::StateMachineStore;

/// What a method needs of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads: viewers, operators, admins, and controllers.
    Read,
    /// Changes to the fleet (models, classes, tenants, prices, nodes, MIG): operators and admins.
    Operate,
    /// Membership, upgrades and the cluster itself: admins.
    Administer,
    /// Calls controllers make to each other (Raft): controllers.
    Internal,
    /// What a router needs of the cluster (its routing state, job writes and reads, load and
    /// usage reports): controllers and router-only processes.
    Route,
    /// An agent's registration and heartbeats: agents.
    Agent,
    /// A new host's join: no certificate yet (the handler checks its one-time token), over TLS.
    Token,
}

impl Access {
    pub fn allows(self, kind: Kind) -> bool {
        match self {
            // Not routers: a router needs its routing state and job calls (Route), not the
            // registry's listings, the audit log or the ledger.
            Access::Read => matches!(kind, Kind::Viewer | Kind::Operator | Kind::Admin | Kind::Controller),
            Access::Operate => matches!(kind, Kind::Operator | Kind::Admin),
            Access::Administer => kind == Kind::Admin,
            Access::Internal => kind == Kind::Controller,
            Access::Route => matches!(kind, Kind::Controller | Kind::Router),
            Access::Agent => kind == Kind::Agent,
            Access::Token => true,
        }
    }

    fn needs(self) -> &'static str {
        match self {
            Access::Read => "the viewer, operator or admin role (a certificate or an admin token)",
            Access::Operate => "the operator or admin role",
            Access::Administer => "the admin role",
            Access::Internal => "a controller certificate",
            Access::Route => "a controller or router certificate",
            Access::Agent => "an agent certificate",
            Access::Token => "a join token",
        }
    }
}

/// The verified identity of a call's client and what it presented, put into the request's
/// extensions by [`Guarded`].
#[derive(Debug, Clone)]
pub struct Authenticated(pub PeerIdentity, pub Credential);

/// What a caller was authenticated with, kept so that a long call (a heartbeat stream) can be
/// checked again against revocations committed after it started.
#[derive(Debug, Clone)]
pub enum Credential {
    /// A client certificate: its serial and when it became valid.
    Cert { serial: String, from_ms: u64 },
    /// An admin bearer token, by its sha256.
    Token { sha256: String },
}

/// The caller's identity: `None` in insecure development mode.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&PeerIdentity> {
    req.extensions().get::<Authenticated>().map(|a| &a.0)
}

/// What the caller was authenticated with: `None` in insecure development mode.
pub fn authenticated<T>(req: &tonic::Request<T>) -> Option<Authenticated> {
    req.extensions().get::<Authenticated>().cloned()
}

/// Whether `auth` still holds: its certificate or token not revoked (nor expired) since.
pub fn recheck(state: &StateMachineStore, auth: &Authenticated) -> Result<(), String> {
    match &auth.1 {
        Credential::Cert { serial, from_ms } => {
            let who = auth.0.to_string();
            if state.with_registry(|r| r.cert_revoked(serial, &who, *from_ms)) {
                Err(format!(
                    "the certificate of {who} (serial {serial}) was revoked; get a new one issued"
                ))
            } else {
                Ok(())
            }
        }
        Credential::Token { sha256 } => state
            .with_registry(|r| r.admin_token(sha256, crate::jobs::unix_ms()).map(|_| ()))
            .map_err(|e| e.to_string()),
    }
}

/// A service's method table: the access each method needs, `None` for a method it does not
/// know (refused).
pub type MethodTable = fn(&str) -> Option<Access>;

/// Where the guard records the calls it refused before any handler ran (the admin audit log,
/// `crate::admin::audit::AuditLog`). A trait so the guard does not depend on the audit log's
/// module, which reads the authenticated caller back from this one.
pub trait RefusalLog: Send + Sync {
    /// Records one refused call: who presented what (if anything), from where, and why. The
    /// future ends once the record is on disk (or was not written: within the log's budget of
    /// refusals, or after an error the log reports); the refusal is answered after it.
    fn refused(
        &self,
        who: Option<&PeerIdentity>,
        remote: Option<std::net::SocketAddr>,
        method: &str,
        status: &Status,
    ) -> futures::future::BoxFuture<'static, ()>;
}

/// What every service of one controller is guarded with.
#[derive(Clone)]
pub struct Guard {
    cluster: String,
    /// `false`: insecure development mode.
    secure: bool,
    audit: Option<Arc<dyn RefusalLog>>,
    /// Where revoked certificates and admin tokens are looked up.
    state: Option<StateMachineStore>,
}

impl Guard {
    pub fn new(
        cluster: &str,
        secure: bool,
        audit: Option<Arc<dyn RefusalLog>>,
        state: Option<StateMachineStore>,
    ) -> Self {
        Guard {
            cluster: cluster.to_string(),
            secure,
            audit,
            state,
        }
    }

    /// `inner`, with every call checked against `table`.
    pub fn wrap<S>(&self, inner: S, table: MethodTable) -> Guarded<S> {
        Guarded {
            inner,
            policy: Arc::new(Policy {
                cluster: self.cluster.clone(),
                secure: self.secure,
                table,
                audit: self.audit.clone(),
                state: self.state.clone(),
            }),
        }
    }
}

/// A service whose every call is checked against its method table.
#[derive(Clone)]
pub struct Guarded<S> {
    inner: S,
    policy: Arc<Policy>,
}

struct Policy {
    cluster: String,
    secure: bool,
    table: MethodTable,
    audit: Option<Arc<dyn RefusalLog>>,
    state: Option<StateMachineStore>,
}

/// What a call presented, checked: the identity, or why it does not count.
type Presented = Option<Result<PeerIdentity, String>>;

impl<S: NamedService> NamedService for Guarded<S> {
    const NAME: &'static str = S::NAME;
}

impl Policy {
    /// The identity a call to `method` is made with, or why it is refused.
    /// The identity a client certificate (DER) names, unless its serial was revoked.
    fn identify_cert(&self, der: &[u8]) -> Result<(PeerIdentity, Credential), String> {
        let id = laneway_pki::identity_of(der).map_err(|e| e.to_string())?;
        let serial = laneway_pki::serial_of(der).map_err(|e| e.to_string())?;
        let (from, _) = laneway_pki::validity_der(der).map_err(|e| e.to_string())?;
        let from_ms = from
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let auth = Authenticated(id, Credential::Cert { serial, from_ms });
        if let Some(state) = &self.state {
            // This serial, or any certificate of the same identity issued before a revocation
            // (a renewal made with a stolen key included).
            recheck(state, &auth)?;
            // A controller's certificate counts while it is a member: removal revokes it.
            if let Some(cid) = auth.0.controller_id() {
                state.may_speak_as_controller(cid)?;
            }
        }
        Ok((auth.0, auth.1))
    }

    /// The identity an admin bearer token stands for.
    fn identify_token(&self, token: &str) -> Result<(PeerIdentity, Credential), String> {
        let Some(state) = &self.state else {
            return Err("this listener accepts no bearer tokens".into());
        };
        let sha = crate::registry::hash_key(token);
        let (role, name) = state.with_registry(|r| {
            r.admin_token(&sha, crate::jobs::unix_ms())
                .map(|(role, name)| (role.to_string(), name.to_string()))
        })?;
        let kind: Kind = role.parse().map_err(|e: laneway_pki::IdentityError| e.to_string())?;
        let id = PeerIdentity::new(&self.cluster, kind, &name).map_err(|e| e.to_string())?;
        Ok((id, Credential::Token { sha256: sha }))
    }

    fn admit(&self, method: &str, peer: Presented) -> Result<Option<PeerIdentity>, Status> {
        if !self.secure {
            return Ok(None);
        }
        let Some(access) = (self.table)(method) else {
            return Err(Status::unimplemented(format!("unknown method {method}")));
        };
        let id = match peer {
            None if access == Access::Token => return Ok(None),
            None => {
                return Err(Status::unauthenticated(format!(
                    "{method} needs {}; this connection presented no certificate and no token (lanectl: --tls-cert and --tls-key from `lanectl certs issue`, or --token from `lanectl token create --role`)",
                    access.needs()
                )))
            }
            Some(Err(e)) => return Err(Status::unauthenticated(format!("{method} refused: {e}"))),
            Some(Ok(id)) => id,
        };
        if id.cluster != self.cluster {
            return Err(Status::permission_denied(format!(
                "{id} belongs to cluster {:?}, this is cluster {:?}",
                id.cluster, self.cluster
            )));
        }
        if !access.allows(id.kind) {
            return Err(Status::permission_denied(format!(
                "{id} may not call {method}: it needs {}",
                access.needs()
            )));
        }
        Ok(Some(id))
    }
}

impl<S> Service<http::Request<Body>> for Guarded<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let method = req.uri().path().rsplit('/').next().unwrap_or_default().to_string();
        let tls = req
            .extensions()
            .get::<tonic::transport::server::TlsConnectInfo<tonic::transport::server::TcpConnectInfo>>();
        let remote = tls.and_then(|t| t.get_ref().remote_addr());
        let cert = tls
            .and_then(|t| t.peer_certs())
            .and_then(|certs| certs.first().cloned());
        let bearer = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_string);
        let presented = match (self.policy.secure, cert, bearer) {
            (false, _, _) => None,
            (true, Some(cert), _) => Some(self.policy.identify_cert(cert.as_ref())),
            (true, None, Some(token)) => Some(self.policy.identify_token(&token)),
            (true, None, None) => None,
        };
        let credential = presented.as_ref().and_then(|p| p.as_ref().ok()).map(|(_, c)| c.clone());
        let peer: Presented = presented.map(|p| p.map(|(id, _)| id));
        let who = peer.as_ref().and_then(|p| p.as_ref().ok()).cloned();
        match self.policy.admit(&method, peer) {
            Ok(id) => {
                if let (Some(id), Some(credential)) = (id, credential) {
                    req.extensions_mut().insert(Authenticated(id, credential));
                }
                let fut = self.inner.call(req);
                Box::pin(fut)
            }
            Err(status) => {
                tracing::warn!(%method, remote = ?remote, reason = %status.message(), "call refused");
                let recorded = self
                    .policy
                    .audit
                    .as_ref()
                    .map(|log| log.refused(who.as_ref(), remote, &method, &status));
                Box::pin(async move {
                    if let Some(recorded) = recorded {
                        recorded.await;
                    }
                    Ok(status.into_http())
                })
            }
        }
    }
}

/// The admin API: reads for viewers, fleet changes for operators, the cluster for admins, and
/// the calls controllers make to the leader.
pub fn admin_methods(method: &str) -> Option<Access> {
    use Access::*;
    Some(match method {
        "Status" | "GetSetting" | "ReadIndex" | "ListNodes" | "ListRegistry" | "LaneStatus" | "Ledger"
        | "ShowMigPlan" | "Events" | "Audit" | "Actors" => Read,
        // PlanMig commits the plan it proposes.
        "PutSetting" | "DeleteSetting" | "Snapshot" | "SetNodeFlags" | "PutClass" | "PutModel" | "RemoveModel"
        | "CreateTenant" | "RotateTenantKey" | "SetTenantLimit" | "SetPrice" | "SetMigLayout" | "PlanMig"
        | "ApplyMigPlan" | "SetPoolTaints" | "DeployModel" | "StartRollout" | "UpdateRollout" => Operate,
        "Init" | "AddLearner" | "Promote" | "Remove" | "FinalizeUpgrade" | "CreateJoinToken" | "CreateAdminToken"
        | "RevokeToken" | "RevokeCertificate" | "SetFailpoint" => Administer,
        "ReportLoad" | "JobWrites" | "RecordUsage" | "WatchRouting" | "ReadJobs" => Route,
        _ => return None,
    })
}

/// The Raft transport: controllers only (and each handler checks the sender's node id).
pub fn raft_methods(method: &str) -> Option<Access> {
    matches!(method, "AppendEntries" | "Vote" | "InstallSnapshot" | "Watch").then_some(Access::Internal)
}

/// The agent API: agents only (and each handler checks the node id against the certificate).
pub fn agent_methods(method: &str) -> Option<Access> {
    match method {
        "Register" | "Heartbeats" => Some(Access::Agent),
        "Join" => Some(Access::Token),
        _ => None,
    }
}

/// A new random API key: `lw_` and 32 random bytes in hex.
pub fn new_api_key() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("lw_{}", hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(table: MethodTable) -> Policy {
        Policy {
            cluster: "prod".into(),
            secure: true,
            table,
            audit: None,
            state: None,
        }
    }

    fn id(kind: Kind, name: &str) -> Presented {
        Some(Ok(PeerIdentity::new("prod", kind, name).unwrap()))
    }

    #[test]
    fn roles_reach_what_they_may_and_nothing_more() {
        let p = policy(admin_methods);
        for method in ["ListNodes", "Status", "Audit"] {
            assert!(p.admit(method, id(Kind::Viewer, "dash")).is_ok(), "{method}");
        }
        for method in ["PutModel", "SetNodeFlags", "Remove", "Init", "RecordUsage"] {
            let e = p.admit(method, id(Kind::Viewer, "dash")).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{method}");
            assert!(e.message().contains("viewer:dash may not call"), "{}", e.message());
        }
        assert!(p.admit("PutModel", id(Kind::Operator, "ops")).is_ok());
        assert!(p.admit("Remove", id(Kind::Operator, "ops")).is_err());
        assert!(p.admit("Remove", id(Kind::Admin, "root")).is_ok());
        assert!(p.admit("RecordUsage", id(Kind::Controller, "2")).is_ok());
        assert!(
            p.admit("PutModel", id(Kind::Agent, "l4-1")).is_err(),
            "agents have no admin access"
        );
        assert!(
            p.admit("RecordUsage", id(Kind::Admin, "root")).is_err(),
            "people cannot forge controller calls"
        );
    }

    #[test]
    fn every_rpc_of_the_protos_has_an_entry() {
        for (proto, table) in [
            (
                include_str!("../../proto/proto/admin.proto"),
                admin_methods as MethodTable,
            ),
            (include_str!("../../proto/proto/raft.proto"), raft_methods),
            (include_str!("../../proto/proto/agent.proto"), agent_methods),
        ] {
            let rpcs: Vec<&str> = proto
                .lines()
                .filter_map(|l| l.trim().strip_prefix("rpc "))
                .filter_map(|l| l.split('(').next())
                .collect();
            assert!(!rpcs.is_empty());
            for rpc in rpcs {
                assert!(
                    table(rpc.trim()).is_some(),
                    "{rpc} has no access rule: it would be refused to everyone"
                );
            }
        }
    }

    #[test]
    fn unknown_methods_missing_certificates_and_other_clusters_are_refused() {
        let p = policy(admin_methods);
        assert_eq!(
            p.admit("DropEverything", id(Kind::Admin, "root")).unwrap_err().code(),
            tonic::Code::Unimplemented
        );
        assert_eq!(
            p.admit("Status", None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        let other = Some(Ok(PeerIdentity::new("staging", Kind::Admin, "root").unwrap()));
        assert_eq!(
            p.admit("Status", other).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        let raft = policy(raft_methods);
        assert!(raft.admit("Vote", id(Kind::Admin, "root")).is_err());
        assert!(raft.admit("Vote", id(Kind::Controller, "3")).is_ok());
        let agents = policy(agent_methods);
        assert!(agents.admit("Heartbeats", id(Kind::Controller, "3")).is_err());
        assert!(agents.admit("Heartbeats", id(Kind::Agent, "h100-1")).is_ok());
        let dev = Policy {
            secure: false,
            ..policy(admin_methods)
        };
        assert!(
            dev.admit("Init", None).unwrap().is_none(),
            "insecure dev mode admits everyone"
        );
    }
}
