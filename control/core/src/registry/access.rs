//! Credentials the cluster keeps: admin tokens, one-time join tokens and revoked certificates
//! (only hashes and serials are replicated), and the checks against them.

use serde::{Deserialize, Serialize};

use super::*;
use crate::refused::Refused;

/// A bearer token of the admin API with a role (ADR 0013).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminToken {
    /// Who holds it; calls made with it are audited as `role:name`.
    pub name: String,
    /// viewer, operator or admin.
    pub role: String,
    pub created_ms: u64,
    pub expires_ms: u64,
    #[serde(default)]
    pub revoked: bool,
}

/// A revoked certificate (keyed by its serial), or every certificate of an identity issued
/// until `at_ms` (keyed by the identity).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedCert {
    /// `kind:name`: every certificate of it valid from `at_ms` or earlier is refused too.
    pub identity: String,
    pub at_ms: u64,
}

/// The key a revocation is kept under: the serial, or for a revocation of an identity's every
/// certificate the identity (`agent:gpu-1`, never hex, so never a serial).
pub fn revocation_key(serial: &str, identity: &str) -> String {
    if serial.is_empty() {
        identity.to_string()
    } else {
        serial.to_ascii_lowercase()
    }
}

/// How long a join token's id is: a prefix of its sha256, enough to tell tokens apart.
pub const JOIN_TOKEN_ID_CHARS: usize = 12;

/// The short id of a token (by its sha256) in messages. Never slices mid-character: this runs
/// in apply, where a panic on odd input would stop every replica at the same log index.
pub fn token_id(sha256: &str) -> &str {
    sha256.get(..JOIN_TOKEN_ID_CHARS).unwrap_or(sha256)
}

/// A one-time token for a new host to join with (ADR 0013).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinToken {
    pub created_ms: u64,
    pub expires_ms: u64,
    /// Only this node id may join with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The node that joined with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_by: Option<String>,
    /// The sha256 of the public key it was first used for, and when: a retry (the first
    /// answer lost) must be for the same key, within [`JOIN_RETRY_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_ms: Option<u64>,
    #[serde(default)]
    pub revoked: bool,
}

/// How long after its first use a join token may be used again, by the same node with the
/// same key (the host's first answer was lost).
pub const JOIN_RETRY_MS: u64 = 10 * 60_000;

/// Who may join the cluster and call its API, besides the cluster CA's certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Access {
    /// Join tokens by the sha256 (hex) of the token (the token itself is never stored); their
    /// id is its first 12 characters. Kept after use, as a record of who joined with what.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub join_tokens: BTreeMap<String, JoinToken>,
    /// Node ids that joined with a token, and when (ms): they can never join again.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub joined: BTreeMap<String, u64>,
    /// Bearer tokens of the admin API, by the sha256 (hex) of the token.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub admin_tokens: BTreeMap<String, AdminToken>,
    /// Certificates refused from now on, by serial (hex).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub revoked_certs: BTreeMap<String, RevokedCert>,
}

impl Registry {
    /// The role and name an admin token (by its sha256) stands for at `now_ms`, or why it is
    /// refused.
    pub fn admin_token(&self, sha256: &str, now_ms: u64) -> Result<(&str, &str), String> {
        let id = token_id(sha256);
        let t = self
            .access
            .admin_tokens
            .get(sha256)
            .ok_or("the bearer token is not known to this cluster; make one with `lanectl token create --role`")?;
        if t.revoked {
            return Err(format!("admin token {id} ({}) was revoked", t.name));
        }
        if now_ms >= t.expires_ms {
            return Err(format!("admin token {id} ({}) has expired; make a new one", t.name));
        }
        Ok((&t.role, &t.name))
    }

    /// Whether a certificate (its serial, its identity `kind:name`, valid from `from_ms`) is
    /// revoked: by serial, or as a certificate of that identity issued before a revocation of
    /// the identity or of any of its certificates (a renewal made with a stolen key included).
    pub fn cert_revoked(&self, serial: &str, identity: &str, from_ms: u64) -> bool {
        self.access.revoked_certs.contains_key(serial)
            || self
                .access
                .revoked_certs
                .values()
                .any(|c| c.identity == identity && from_ms <= c.at_ms)
    }

    /// Marks the join or admin token with this sha256 revoked.
    pub fn revoke_token(&mut self, sha256: &str) -> Result<(), Refused> {
        if let Some(t) = self.access.join_tokens.get_mut(sha256) {
            t.revoked = true;
        } else if let Some(t) = self.access.admin_tokens.get_mut(sha256) {
            t.revoked = true;
        } else {
            return Err(Refused::NotFound(
                "no such token; `lanectl token list` shows them".into(),
            ));
        }
        Ok(())
    }

    /// Whether a host may join as `node_id` with the token hashing to `sha256` at `at_ms`
    /// (`registered`: the node id is in the fleet already), without changing anything.
    ///
    /// A token works for one node id, once: the same node may ask again with it for the same
    /// key within [`JOIN_RETRY_MS`] (its first answer may have been lost); nobody else, and
    /// no other key, ever may. A node id already in the cluster
    /// (joined before, or registered with a certificate from `lanectl certs issue`) is never
    /// taken by a new host; only a token an admin bound to that id (`--node`) gives it a new
    /// certificate, for the same host after it lost its key.
    pub fn check_join_token(
        &self,
        sha256: &str,
        node_id: &str,
        key_sha256: &str,
        at_ms: u64,
        registered: bool,
    ) -> Result<(), Refused> {
        let id = token_id(sha256);
        let Some(t) = self.access.join_tokens.get(sha256) else {
            return Err(Refused::NotFound(
                "the join token is not known to this cluster; create one with `lanectl token create`".into(),
            ));
        };
        if t.revoked {
            return Err(Refused::Conflict(format!(
                "join token {id} was revoked; create a new one with `lanectl token create`"
            )));
        }
        if at_ms >= t.expires_ms {
            return Err(Refused::Conflict(format!(
                "join token {id} has expired; create a new one with `lanectl token create --ttl 1h`"
            )));
        }
        match &t.used_by {
            Some(by) if by == node_id => {
                let same_key = t.used_key.as_deref().is_some_and(|k| !k.is_empty() && k == key_sha256);
                let soon = t.used_ms.is_some_and(|u| at_ms < u.saturating_add(JOIN_RETRY_MS));
                if same_key && soon {
                    return Ok(());
                }
                return Err(Refused::Conflict(format!(
                    "join token {id} was already used by node {by}; only the same key may use it again, within {} minutes of the join: create a new one (`lanectl token create --node {by}`)",
                    JOIN_RETRY_MS / 60_000
                )));
            }
            Some(by) => {
                return Err(Refused::Conflict(format!(
                    "join token {id} was already used (by node {by}): a token lets one node in; create a new one"
                )))
            }
            None => {}
        }
        match &t.node_id {
            Some(only) if only != node_id => Err(Refused::Conflict(format!("join token {id} is for node {only}, not {node_id}"))),
            Some(_) => Ok(()),
            None if registered || self.access.joined.contains_key(node_id) => Err(Refused::Conflict(format!(
                "node id {node_id} is already in this cluster and node ids are never reused: give this host a new node id (to re-key the same host, an admin makes a token bound to it: `lanectl token create --node {node_id}`)"
            ))),
            None => Ok(()),
        }
    }

    /// Spends the token on `node_id` (see [`Registry::check_join_token`]).
    pub fn consume_join_token(
        &mut self,
        sha256: &str,
        node_id: &str,
        key_sha256: &str,
        at_ms: u64,
        registered: bool,
    ) -> Result<(), Refused> {
        self.check_join_token(sha256, node_id, key_sha256, at_ms, registered)?;
        if let Some(t) = self.access.join_tokens.get_mut(sha256).filter(|t| t.used_by.is_none()) {
            t.used_by = Some(node_id.to_string());
            t.used_key = Some(key_sha256.to_string());
            t.used_ms = Some(at_ms);
        }
        self.access.joined.insert(node_id.to_string(), at_ms);
        Ok(())
    }
}
