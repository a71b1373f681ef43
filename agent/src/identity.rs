//! The agent's certificate: files the operator installed, or one obtained with a one-time
//! join token and kept in `<data_dir>/tls/`, renewed over the heartbeat stream before it
//! expires (ADR 0013).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use laneway_pki::Tls;
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::JoinRequest;
use tonic::transport::ClientTlsConfig;

/// How this agent proves who it is.
#[derive(Clone)]
pub enum Credentials {
    /// Plaintext, no identity (`insecure_dev`).
    Insecure,
    /// Certificate files the operator installed (and rotates).
    Files(Tls),
    /// The cluster CA and a one-time join token: the agent gets its certificate itself.
    Join { ca_pem: String, token: String },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        match self {
            Credentials::Insecure => f.write_str("Insecure"),
            Credentials::Files(t) => f.debug_tuple("Files").field(t).finish(),
            Credentials::Join { .. } => f.write_str("Join { token: <redacted> }"),
        }
    }
}

/// The agent's current identity, shared by its connections.
pub struct Identity {
    node_id: String,
    /// `<data_dir>/tls`: where a joined agent keeps its key and certificate.
    dir: PathBuf,
    credentials: Credentials,
    current: Mutex<Option<Tls>>,
    /// The key of a renewal asked for and not answered yet.
    pending_key: Mutex<Option<String>>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// The file under `<data_dir>/tls/` that holds a joined agent's certificate and key.
const KEPT: &str = "agent.pem";

/// The certificate and the key of a kept pair.
fn split_pair(text: &str) -> Option<(String, String)> {
    const END: &str = "-----END CERTIFICATE-----";
    let start = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text.find(END)? + END.len();
    let cert = text[start..end].to_string() + "\n";
    let key = text[end..].trim_start().to_string();
    (!key.is_empty()).then_some((cert, key))
}

/// Renew once less than this share of the certificate's life is left.
const RENEW_AT_REMAINING: f64 = 1.0 / 3.0;

impl Identity {
    pub fn new(node_id: &str, data_dir: &std::path::Path, credentials: Credentials) -> Identity {
        let current = match &credentials {
            Credentials::Files(t) => Some(t.clone()),
            _ => None,
        };
        Identity {
            node_id: node_id.to_string(),
            dir: data_dir.join("tls"),
            credentials,
            current: Mutex::new(current),
            pending_key: Mutex::new(None),
        }
    }

    /// TLS towards the controllers, `None` in insecure mode.
    pub fn client_tls(&self) -> Option<ClientTlsConfig> {
        self.lock_current()
            .as_ref()
            .map(|t| t.client(laneway_pki::ANY_CONTROLLER))
    }

    fn lock_current(&self) -> std::sync::MutexGuard<'_, Option<Tls>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// For a joining agent: the certificate kept from an earlier join, or a new one from the
    /// controllers in exchange for the token. Retries until it has one; a refusal (a used,
    /// expired or revoked token, a node id that joined before) is logged with its reason and
    /// retried slowly, since only the operator can fix it.
    pub async fn ensure(&self, controllers: &[String]) {
        let Credentials::Join { ca_pem, token } = &self.credentials else {
            return;
        };
        match self.load_kept(ca_pem) {
            Ok(Some(tls)) => {
                tracing::info!(node = %self.node_id, "using the certificate from an earlier join");
                *self.lock_current() = Some(tls);
                return;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "the kept certificate is not usable; joining again")
            }
        }
        let mut i = 0usize;
        loop {
            let addr = &controllers[i % controllers.len()];
            match self.join_once(addr, ca_pem, token).await {
                Ok(tls) => {
                    tracing::info!(node = %self.node_id, controller = %addr, "joined the cluster; certificate kept in {}", self.dir.display());
                    *self.lock_current() = Some(tls);
                    return;
                }
                Err(JoinError::Redirect(leader)) => match self.join_once(&leader, ca_pem, token).await {
                    Ok(tls) => {
                        tracing::info!(node = %self.node_id, controller = %leader, "joined the cluster; certificate kept in {}", self.dir.display());
                        *self.lock_current() = Some(tls);
                        return;
                    }
                    Err(JoinError::Refused(why)) => {
                        tracing::error!(node = %self.node_id, reason = %why, "the controllers refused to let this node join; fix join_token or node_id and restart the agent");
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    Err(JoinError::Failed(why) | JoinError::Redirect(why)) => {
                        tracing::warn!(controller = %leader, reason = %why, "join attempt at the leader failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                },
                Err(JoinError::Refused(why)) => {
                    tracing::error!(node = %self.node_id, reason = %why, "the controllers refused to let this node join; fix join_token or node_id and restart the agent");
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                Err(JoinError::Failed(why)) => {
                    tracing::warn!(controller = %addr, reason = %why, "join attempt failed; trying another controller");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            i += 1;
        }
    }

    fn load_kept(&self, ca_pem: &str) -> Result<Option<Tls>, String> {
        let path = self.dir.join(KEPT);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (cert, key) =
            split_pair(&text).ok_or_else(|| format!("{} holds no certificate and key", path.display()))?;
        let tls = Tls::from_pem(ca_pem.to_string(), cert, key).map_err(|e| e.to_string())?;
        let id = tls.identity();
        if id.kind != laneway_pki::Kind::Agent || id.name != self.node_id {
            return Err(format!("it is for {id}, this agent is node {}", self.node_id));
        }
        Ok(Some(tls))
    }

    async fn join_once(&self, addr: &str, ca_pem: &str, token: &str) -> Result<Tls, JoinError> {
        let csr = laneway_pki::new_csr().map_err(|e| JoinError::Failed(e.to_string()))?;
        let tls = laneway_pki::client_without_identity(ca_pem, laneway_pki::ANY_CONTROLLER);
        let channel = laneway_pki::endpoint(addr, Some(tls))
            .map_err(JoinError::Failed)?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .map_err(|e| JoinError::Failed(format!("connect: {e}")))?;
        let reply = AgentServiceClient::new(channel)
            .join(JoinRequest {
                token: token.to_string(),
                node_id: self.node_id.clone(),
                csr_pem: csr.cert_pem.clone(),
            })
            .await
            .map_err(|status| {
                if let Some(leader) = status
                    .metadata()
                    .get(laneway_proto::LEADER_ADDR_METADATA)
                    .and_then(|v| v.to_str().ok())
                {
                    return JoinError::Redirect(leader.to_string());
                }
                match status.code() {
                    tonic::Code::PermissionDenied
                    | tonic::Code::InvalidArgument
                    | tonic::Code::FailedPrecondition
                    | tonic::Code::Unauthenticated => JoinError::Refused(status.message().to_string()),
                    _ => JoinError::Failed(status.message().to_string()),
                }
            })?
            .into_inner();
        self.keep(ca_pem, &reply.cert_pem, &csr.key_pem)
            .map_err(JoinError::Failed)
    }

    /// Checks that the key and certificate go together, writes both in one file (0600, by
    /// rename: a crash leaves the old pair or the new one, never a mix) and returns the TLS
    /// material.
    fn keep(&self, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Tls, String> {
        let tls =
            Tls::from_pem(ca_pem.to_string(), cert_pem.to_string(), key_pem.to_string()).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        write_atomic(
            &self.dir.join(KEPT),
            &format!("{}\n{}", cert_pem.trim_end(), key_pem),
            0o600,
        )?;
        Ok(tls)
    }

    /// A CSR to send with the next heartbeat when a joined certificate nears its end (and no
    /// renewal is pending).
    pub fn renewal_csr(&self) -> Option<String> {
        if !matches!(self.credentials, Credentials::Join { .. }) {
            return None;
        }
        let mut pending = self.pending_key.lock().unwrap_or_else(|p| p.into_inner());
        if pending.is_some() {
            return None;
        }
        let cert_pem = self.lock_current().as_ref()?.cert_pem().to_string();
        let expires = laneway_pki::not_after(&cert_pem).ok()?;
        let issued = laneway_pki::not_before(&cert_pem).ok()?;
        let life = expires.duration_since(issued).unwrap_or_default();
        let left = expires.duration_since(SystemTime::now()).unwrap_or_default();
        if left.as_secs_f64() > life.as_secs_f64() * RENEW_AT_REMAINING {
            return None;
        }
        let csr = laneway_pki::new_csr().ok()?;
        *pending = Some(csr.key_pem);
        tracing::info!(node = %self.node_id, left_s = left.as_secs(), "asking the controllers to renew this node's certificate");
        Some(csr.cert_pem)
    }

    /// Installs a renewed certificate (for the key of the pending request); the next
    /// connection uses it.
    pub fn renewed(&self, cert_pem: &str) {
        let Credentials::Join { ca_pem, .. } = &self.credentials else {
            return;
        };
        let Some(key) = self.pending_key.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        match self.keep(ca_pem, cert_pem, &key) {
            Ok(tls) => {
                tracing::info!(node = %self.node_id, "certificate renewed");
                *self.lock_current() = Some(tls);
            }
            Err(e) => tracing::warn!(error = %e, "the renewed certificate could not be kept; asking again later"),
        }
    }

    /// A renewal asked for on a stream that ended: ask again on the next one.
    pub fn forget_pending(&self) {
        self.pending_key.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

enum JoinError {
    Redirect(String),
    Refused(String),
    Failed(String),
}

fn write_atomic(path: &std::path::Path, text: &str, mode: u32) -> Result<(), String> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_joined_agent_restarts_on_its_kept_certificate_and_renews_near_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let ca = laneway_pki::Ca::create("prod", Duration::from_secs(86_400)).unwrap();
        let creds = Credentials::Join {
            ca_pem: ca.cert_pem().to_string(),
            token: "lwjoin_spent".into(),
        };
        let first = Identity::new("gpu-1", dir.path(), creds.clone());
        let csr = laneway_pki::new_csr().unwrap();
        // Valid from a minute ago for 2 more seconds: well under a third of its life is left.
        let cert = ca
            .sign_csr(&csr.cert_pem, laneway_pki::Kind::Agent, "gpu-1", Duration::from_secs(2))
            .unwrap();
        first.keep(ca.cert_pem(), &cert, &csr.key_pem).unwrap();
        // Restarted: the kept pair is used (no controller is asked: there are none).
        let again = Identity::new("gpu-1", dir.path(), creds);
        again.ensure(&[]).await;
        assert!(again.client_tls().is_some());
        let ask = again.renewal_csr().expect("near its end, a renewal is asked for");
        assert!(again.renewal_csr().is_none(), "one request at a time");
        let renewed = ca
            .sign_csr(&ask, laneway_pki::Kind::Agent, "gpu-1", Duration::from_secs(86_400))
            .unwrap();
        again.renewed(&renewed);
        let kept = std::fs::read_to_string(dir.path().join("tls").join(KEPT)).unwrap();
        assert!(kept.starts_with(renewed.trim_end()), "the renewed certificate is kept");
        assert!(again.renewal_csr().is_none(), "a fresh certificate needs no renewal");
        // Another node's kept certificate is not taken for this one's.
        let other = Identity::new(
            "gpu-2",
            dir.path(),
            Credentials::Join {
                ca_pem: ca.cert_pem().into(),
                token: String::new(),
            },
        );
        assert!(other.load_kept(ca.cert_pem()).is_err());
    }
}
