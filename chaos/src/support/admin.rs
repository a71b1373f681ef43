//! The admin API as the harness uses it: a client (over mTLS when the backend runs with it), a
//! member's status, waiting on a condition, and reading and writing registry documents.

use std::time::Duration;

use anyhow::bail;
use laneway_control::client::AdminClient;
use laneway_proto::admin::{ListRegistryRequest, NodeStatus, PutDocumentRequest, StatusRequest};
use serde_json::Value;
use tokio::time::Instant;

/// TLS towards the cluster under test, set at the start of each run from its backend.
static ADMIN_TLS: std::sync::RwLock<Option<tonic::transport::ClientTlsConfig>> = std::sync::RwLock::new(None);

/// Sets how the harness authenticates to the cluster under test. Each run sets its own: every
/// docker run's cluster has a CA of its own, so a setting kept from the first run would leave
/// every later run of the process unable to reach its cluster.
pub fn use_admin_tls(tls: Option<tonic::transport::ClientTlsConfig>) {
    *ADMIN_TLS.write().unwrap_or_else(|p| p.into_inner()) = tls;
}

/// An admin client of the cluster under test (over mTLS when its backend runs with it).
pub fn admin_client(addrs: Vec<String>) -> AdminClient {
    AdminClient::new(addrs).with_tls(ADMIN_TLS.read().unwrap_or_else(|p| p.into_inner()).clone())
}

/// One member's own status, or None if it does not answer within 500 ms.
pub async fn status_of(addr: &str) -> Option<NodeStatus> {
    status_with(addr, false, Duration::from_millis(500)).await
}

/// [`status_of`] with the member's state hash, to compare members (a pass over the whole state
/// on the member: a checker's question, not a poll's).
pub async fn hashed_status_of(addr: &str) -> Option<NodeStatus> {
    status_with(addr, true, Duration::from_secs(5)).await
}

async fn status_with(addr: &str, with_state_hash: bool, timeout: Duration) -> Option<NodeStatus> {
    let c = admin_client(vec![addr.to_string()]).with_call_timeout(timeout);
    c.call_one(addr, |mut cl| async move {
        cl.status(StatusRequest { with_state_hash }).await
    })
    .await
    .ok()
}

/// Polls `f` until true or `limit` passes.
pub async fn wait_until<F, Fut>(limit: Duration, mut f: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f().await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("condition not met within {limit:?}")
}

/// (node, replica) documents of a registry kind.
pub async fn docs(admin: &AdminClient, kind: &str) -> Vec<Value> {
    let kind = kind.to_string();
    admin
        .call(|mut c| {
            let kind = kind.clone();
            async move { c.list_registry(ListRegistryRequest { kind }).await }
        })
        .await
        .map(|r| r.json.iter().filter_map(|j| serde_json::from_str(j).ok()).collect())
        .unwrap_or_default()
}

/// Ready replicas of `model`, by node.
pub async fn ready(admin: &AdminClient, model: &str) -> Vec<String> {
    docs(admin, "replicas")
        .await
        .iter()
        .filter(|d| d["replica"]["model"] == model && d["replica"]["state"] == "ready")
        .map(|d| d["node"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// A node's committed liveness ("up", "down"), or None when no controller answers.
pub async fn liveness(admin: &AdminClient, node: &str) -> Option<String> {
    let reply = admin
        .call(|mut c| async move { c.list_nodes(laneway_proto::admin::ListNodesRequest {}).await })
        .await
        .ok()?;
    reply.nodes.into_iter().find(|n| n.node_id == node).map(|n| n.liveness)
}

pub async fn put(admin: &AdminClient, class: bool, doc: Value) -> anyhow::Result<()> {
    let json = doc.to_string();
    admin
        .call(|mut c| {
            let json = json.clone();
            async move {
                if class {
                    c.put_class(PutDocumentRequest { json }).await
                } else {
                    c.put_model(PutDocumentRequest { json }).await
                }
            }
        })
        .await?;
    Ok(())
}
