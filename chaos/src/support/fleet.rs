//! Agents played by the harness: a registered node with static replicas, a heartbeat loop, a
//! node with GPUs of a given product — what benches need of a fleet without real agents.

use std::time::Duration;

use anyhow::Context as _;
use laneway_proto::admin::{CreateTenantRequest, PutDocumentRequest, SetNodeFlagsRequest};
use laneway_proto::agent::agent_service_client::AgentServiceClient;
use laneway_proto::agent::{GpuInfo, Heartbeat, RegisterRequest, ReplicaReport};
use tokio_stream::wrappers::ReceiverStream;

/// Puts a class and a model in the registry and creates the tenant `bench`; its API key.
pub async fn register(
    admin: &laneway_control::client::AdminClient,
    class: serde_json::Value,
    model: serde_json::Value,
) -> anyhow::Result<String> {
    for (what, doc) in [("class", class), ("model", model)] {
        let json = doc.to_string();
        admin
            .call(|mut c| {
                let json = json.clone();
                async move {
                    if what == "class" {
                        c.put_class(PutDocumentRequest { json }).await
                    } else {
                        c.put_model(PutDocumentRequest { json }).await
                    }
                }
            })
            .await?;
    }
    Ok(admin
        .call(|mut c| async move { c.create_tenant(CreateTenantRequest { name: "bench".into() }).await })
        .await?
        .api_key)
}

/// Registers a node with one ready replica of `model`, vouches for it as an operator would
/// (`lanectl node allow-static`), and keeps it alive with heartbeats.
pub async fn play_agent(leader: &str, port: u16, model: &str) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let gpus = vec![GpuInfo {
        product: "L4".into(),
        uuid: "GPU-bench-0".into(),
        memory_bytes: 24 << 30,
        mig_capable: false,
    }];
    let replica = ReplicaReport {
        id: format!("{model}-0"),
        model: model.to_string(),
        device: "GPU-bench-0".into(),
        state: "ready".into(),
        port: u32::from(port),
        in_flight: 0,
        last_exit: String::new(),
        waiting: 0,
        kv_cache_usage: -1.0,
        cold_start: None,
    };
    let agent = fake_node(leader, "bench-node", "l4", gpus, vec![replica]).await?;
    // Routers take an agent's own replicas only from a node an operator vouched for (ADR 0019):
    // the bench is that operator.
    super::admin::admin_client(vec![leader.to_string()])
        .with_retry_for(Duration::from_secs(10))
        .call(|mut c| async move {
            c.set_node_flags(SetNodeFlagsRequest {
                node_id: "bench-node".into(),
                action: "allow-static".into(),
            })
            .await
        })
        .await
        .context("vouching for the bench node (allow-static)")?;
    Ok(agent)
}

/// Registers node `id` of `pool` with `gpus` at the leader and heartbeats `replicas` every
/// 500 ms, as an agent would (it runs nothing it is told to).
pub async fn fake_node(
    leader: &str,
    id: &str,
    pool: &str,
    gpus: Vec<GpuInfo>,
    replicas: Vec<ReplicaReport>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut agent = AgentServiceClient::connect(format!("http://{leader}")).await?;
    agent
        .register(RegisterRequest {
            node_id: id.into(),
            hostname: id.into(),
            labels: Default::default(),
            pool: pool.into(),
            gpus,
            join_token: String::new(),
            replica_host: "127.0.0.1".into(),
        })
        .await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut replies = agent.heartbeats(ReceiverStream::new(rx)).await?.into_inner();
    let id = id.to_string();
    Ok(tokio::spawn(async move {
        let mut seq = 0;
        loop {
            seq += 1;
            let hb = Heartbeat {
                renew_csr_pem: String::new(),
                node_id: id.clone(),
                sequence: seq,
                sent_unix_ms: 0,
                gpus: vec![],
                replicas: replicas.clone(),
                cached_blobs: vec![],
                jobs: vec![],
                actors: vec![],
            };
            if tx.send(hb).await.is_err() {
                return;
            }
            let _ = replies.message().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }))
}
