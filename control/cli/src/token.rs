//! `lanectl token`: one-time join tokens for new GPU hosts.

use std::time::Duration;

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_proto::admin::{CreateAdminTokenRequest, CreateJoinTokenRequest, RevokeTokenRequest};
use serde_json::json;

use crate::Output;

#[derive(Subcommand)]
pub enum TokenCmd {
    /// A one-time join token a new host joins with (`join_token` in its agent config, with
    /// `[tls] ca`); or, with --role, an admin bearer token for a tool without a certificate.
    /// Printed once; only its hash is kept.
    Create {
        /// How long it may be used (join: 1m .. 7d, default 1h; admin: up to 400d).
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        /// Join token: only this node id may join with it.
        #[arg(long, conflicts_with = "role")]
        node: Option<String>,
        /// Admin token: viewer, operator or admin.
        #[arg(long, requires = "name")]
        role: Option<String>,
        /// Admin token: who holds it (the audit log's `who`).
        #[arg(long, requires = "role")]
        name: Option<String>,
    },
    /// Join and admin tokens: id, node or role, expiry, use, revoked.
    List,
    /// Refuse a join or admin token from now on.
    Revoke { id: String },
}

pub async fn run(client: &AdminClient, out: Output, cmd: TokenCmd) -> anyhow::Result<()> {
    match cmd {
        TokenCmd::Create {
            ttl,
            node,
            role: Some(role),
            name: Some(name),
        } => {
            let _ = node;
            let ttl = ttl.unwrap_or(Duration::from_secs(90 * 86_400));
            let r = client
                .call(|mut c| {
                    let (role, name) = (role.clone(), name.clone());
                    async move {
                        c.create_admin_token(CreateAdminTokenRequest {
                            role,
                            name,
                            ttl_ms: ttl.as_millis() as u64,
                        })
                        .await
                    }
                })
                .await?;
            let expires = at(r.expires_unix_ms);
            crate::print(
                out,
                json!({"token": r.token, "id": r.id, "role": role, "name": name, "expires": expires}),
                || {
                    format!("{}\n(id {}, {role}:{name}, expires {expires}; it is not shown again; use it as LANECTL_TOKEN with LANECTL_TLS_CA)", r.token, r.id)
                },
            );
        }
        TokenCmd::Create { ttl, node, .. } => {
            let ttl = ttl.unwrap_or(Duration::from_secs(3600));
            let r = client
                .call(|mut c| {
                    let node_id = node.clone().unwrap_or_default();
                    async move {
                        c.create_join_token(CreateJoinTokenRequest {
                            ttl_ms: ttl.as_millis() as u64,
                            node_id,
                        })
                        .await
                    }
                })
                .await?;
            let expires = at(r.expires_unix_ms);
            crate::print(out, json!({"token": r.token, "id": r.id, "expires": expires}), || {
                format!(
                    "{}\n(id {}, one-time, expires {expires}; it is not shown again)",
                    r.token, r.id
                )
            });
        }
        TokenCmd::List => {
            let mut tokens = crate::registry::list(client, "join-tokens").await?;
            for mut t in crate::registry::list(client, "admin-tokens").await? {
                t["node_id"] = json!(format!(
                    "{}:{}",
                    t["role"].as_str().unwrap_or("?"),
                    t["name"].as_str().unwrap_or("?")
                ));
                t["used_by"] = json!("(admin token)");
                tokens.push(t);
            }
            let text = || {
                let mut s = format!(
                    "{:<14} {:<16} {:<22} {:<16} {}\n",
                    "ID", "FOR", "EXPIRES", "USED BY", "REVOKED"
                );
                for t in &tokens {
                    let expires = t["expires_ms"].as_u64().map(at).unwrap_or_default();
                    s.push_str(&format!(
                        "{:<14} {:<16} {:<22} {:<16} {}\n",
                        t["id"].as_str().unwrap_or(""),
                        t["node_id"].as_str().unwrap_or("any"),
                        expires,
                        t["used_by"].as_str().unwrap_or("-"),
                        t["revoked"].as_bool().unwrap_or(false)
                    ));
                }
                s.trim_end().to_string()
            };
            crate::print(out, json!(tokens), text);
        }
        TokenCmd::Revoke { id } => {
            client
                .call(|mut c| {
                    let id = id.clone();
                    async move { c.revoke_token(RevokeTokenRequest { id }).await }
                })
                .await?;
            crate::print(out, json!({"revoked": id}), || format!("token {id} revoked"));
        }
    }
    Ok(())
}

/// A Unix time in ms, as RFC 3339 to the second.
fn at(unix_ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(unix_ms)).to_string()
}
