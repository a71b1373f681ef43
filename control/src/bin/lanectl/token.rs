//! `lanectl token`: one-time join tokens for new GPU hosts.

use std::time::Duration;

use clap::Subcommand;
use laneway_control::client::AdminClient;
use laneway_proto::admin::{CreateJoinTokenRequest, RevokeJoinTokenRequest};
use serde_json::json;

use crate::Output;

#[derive(Subcommand)]
pub enum TokenCmd {
    /// A one-time token a new host joins with (`join_token` in its agent config, with
    /// `[tls] ca`); printed once, only its hash is kept.
    Create {
        /// How long it may be used (1m .. 7d).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Only this node id may join with it.
        #[arg(long)]
        node: Option<String>,
    },
    /// Tokens: id, node, expiry, who used it, revoked.
    List,
    /// Refuse a token from now on.
    Revoke { id: String },
}

pub async fn run(client: &AdminClient, out: Output, cmd: TokenCmd) -> anyhow::Result<()> {
    match cmd {
        TokenCmd::Create { ttl, node } => {
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
            let expires =
                humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(r.expires_unix_ms));
            crate::print(
                out,
                json!({"token": r.token, "id": r.id, "expires": expires.to_string()}),
                || {
                    format!(
                        "{}\n(id {}, one-time, expires {expires}; it is not shown again)",
                        r.token, r.id
                    )
                },
            );
        }
        TokenCmd::List => {
            let tokens = crate::registry::list(client, "join-tokens").await?;
            let text = || {
                let mut s = format!(
                    "{:<14} {:<16} {:<22} {:<16} {}\n",
                    "ID", "NODE", "EXPIRES", "USED BY", "REVOKED"
                );
                for t in &tokens {
                    let expires = t["expires_ms"]
                        .as_u64()
                        .map(|ms| {
                            humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms))
                                .to_string()
                        })
                        .unwrap_or_default();
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
                    async move { c.revoke_join_token(RevokeJoinTokenRequest { id }).await }
                })
                .await?;
            crate::print(out, json!({"revoked": id}), || format!("join token {id} revoked"));
        }
    }
    Ok(())
}
