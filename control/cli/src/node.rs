//! `lanectl node`: the fleet's nodes, their GPUs and replicas, and an operator's flags on them.

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_proto::admin::{ListNodesRequest, NodeInfo, NodeStatus, SetNodeFlagsRequest, StatusRequest};
use serde_json::json;

use super::{print, Output};

#[derive(Subcommand)]
pub enum NodeCmd {
    /// All nodes: pool, liveness (suspect: its heartbeat stream broke), flags, GPUs, last heartbeat.
    List,
    /// One node in detail.
    Show { node_id: String },
    /// No new replicas on this node.
    Cordon { node_id: String },
    /// Allow new replicas again (also ends a drain).
    Uncordon { node_id: String },
    /// Move replicas off this node (implies cordon).
    Drain { node_id: String },
    /// Route the replicas this node runs from its own `[[replica]]` configuration (the
    /// routers take only scheduled replicas otherwise: an agent's word is not enough).
    AllowStatic { node_id: String },
    /// Stop routing this node's static replicas.
    DisallowStatic { node_id: String },
    /// A spot preemption notice (for the cloud's termination handler): drain the node and put
    /// its durable jobs back in the queue now, fenced, so they restart elsewhere before it dies.
    Preempt { node_id: String },
}

pub async fn node(client: &AdminClient, out: Output, cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::List => {
            let nodes = list_nodes(client).await?;
            print_nodes(out, &nodes, false);
        }
        NodeCmd::Show { node_id } => {
            let nodes = list_nodes(client).await?;
            let node: Vec<_> = nodes.into_iter().filter(|n| n.node_id == node_id).collect();
            if node.is_empty() {
                anyhow::bail!("no node {node_id}; `lanectl node list` shows the registered nodes");
            }
            print_nodes(out, &node, true);
        }
        NodeCmd::Cordon { node_id } => node_flag(client, out, node_id, "cordon").await?,
        NodeCmd::Uncordon { node_id } => node_flag(client, out, node_id, "uncordon").await?,
        NodeCmd::AllowStatic { node_id } => node_flag(client, out, node_id, "allow-static").await?,
        NodeCmd::DisallowStatic { node_id } => node_flag(client, out, node_id, "disallow-static").await?,
        NodeCmd::Drain { node_id } => node_flag(client, out, node_id, "drain").await?,
        NodeCmd::Preempt { node_id } => node_flag(client, out, node_id, "preempt").await?,
    }
    Ok(())
}

/// Lists nodes from the leader (only it knows when each node last heartbeated).
pub async fn list_nodes(client: &AdminClient) -> anyhow::Result<Vec<NodeInfo>> {
    let status: NodeStatus = client
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await?;
    let from_leader = if status.leader_addr.is_empty() {
        None
    } else {
        client
            .call_one(&status.leader_addr, |mut c| async move {
                c.list_nodes(ListNodesRequest {}).await
            })
            .await
            .ok()
    };
    let reply = match from_leader {
        Some(r) => r,
        None => {
            client
                .call(|mut c| async move { c.list_nodes(ListNodesRequest {}).await })
                .await?
        }
    };
    Ok(reply.nodes)
}

fn print_nodes(out: Output, nodes: &[NodeInfo], detail: bool) {
    if out != Output::Table {
        let v: Vec<_> = nodes
            .iter()
            .map(|n| {
                json!({
                    "node_id": n.node_id, "hostname": n.hostname, "pool": n.pool, "labels": n.labels,
                    "liveness": n.liveness, "cordoned": n.cordoned, "draining": n.draining,
                    "last_heartbeat_ms_ago": n.last_heartbeat_ms_ago,
                    "suspect_ms_ago": (n.suspect_ms_ago >= 0).then_some(n.suspect_ms_ago),
                    "replicas_ready": n.replicas_ready, "replicas_total": n.replicas_total,
                    "gpus": n.gpus.iter().map(|g| json!({"uuid": g.uuid, "product": g.product,
                        "memory_bytes": g.memory_bytes, "mig_capable": g.mig_capable})).collect::<Vec<_>>(),
                    "replicas": n.replicas.iter().map(|r| json!({"id": r.id, "model": r.model, "state": r.state,
                        "cold_start": (r.ready_ms > 0 || r.started_ms > 0).then(|| json!({
                            "weights_ms": r.weights_ms, "started_ms": r.started_ms, "healthy_ms": r.healthy_ms,
                            "ready_ms": r.ready_ms, "fetched_bytes": r.fetched_bytes}))})).collect::<Vec<_>>(),
                })
            })
            .collect();
        crate::print(out, serde_json::Value::Array(v), String::new);
        return;
    }
    outln!(
        "{:<20} {:<10} {:<7} {:<10} {:<28} {:>10} {:>8}",
        "NODE",
        "POOL",
        "STATE",
        "FLAGS",
        "GPUS",
        "LAST SEEN",
        "REPLICAS"
    );
    for n in nodes {
        let mut products: std::collections::BTreeMap<&str, usize> = Default::default();
        for g in &n.gpus {
            *products.entry(g.product.as_str()).or_default() += 1;
        }
        let gpus = products
            .iter()
            .map(|(p, c)| format!("{c}x {p}"))
            .collect::<Vec<_>>()
            .join(", ");
        let flags = match (n.draining, n.cordoned) {
            (true, _) => "draining",
            (false, true) => "cordoned",
            _ => "-",
        };
        let seen = if n.last_heartbeat_ms_ago < 0 {
            "-".to_string()
        } else {
            format!("{:.1}s ago", n.last_heartbeat_ms_ago as f64 / 1000.0)
        };
        // Up but its heartbeat stream lost: the leader is replacing its replicas elsewhere.
        let state = if n.liveness == "up" && n.suspect_ms_ago >= 0 {
            "suspect"
        } else {
            n.liveness.as_str()
        };
        outln!(
            "{:<20} {:<10} {:<7} {:<10} {:<28} {:>10} {:>8}",
            n.node_id,
            n.pool,
            state,
            flags,
            gpus,
            seen,
            format!("{}/{}", n.replicas_ready, n.replicas_total)
        );
        if detail {
            outln!("  hostname: {}", n.hostname);
            for (k, v) in &n.labels {
                outln!("  label {k}={v}");
            }
            for g in &n.gpus {
                outln!(
                    "  gpu {} {} {:.0} GiB{}",
                    g.uuid,
                    g.product,
                    g.memory_bytes as f64 / (1u64 << 30) as f64,
                    if g.mig_capable { " (MIG)" } else { "" }
                );
            }
            if !n.replicas.is_empty() {
                // The last start of each replica, phase by phase (ms since it was placed).
                outln!(
                    "  {:<28} {:<20} {:<10} {:>9} {:>9} {:>9} {:>9}",
                    "REPLICA",
                    "MODEL",
                    "STATE",
                    "WEIGHTS",
                    "STARTED",
                    "HEALTHY",
                    "READY"
                );
                let ms = |v: u64| {
                    if v == 0 {
                        "-".to_string()
                    } else {
                        format!("{:.1}s", v as f64 / 1000.0)
                    }
                };
                for r in &n.replicas {
                    outln!(
                        "  {:<28} {:<20} {:<10} {:>9} {:>9} {:>9} {:>9}",
                        r.id,
                        r.model,
                        r.state,
                        ms(r.weights_ms),
                        ms(r.started_ms),
                        ms(r.healthy_ms),
                        ms(r.ready_ms)
                    );
                }
            }
        }
    }
}

async fn node_flag(client: &AdminClient, out: Output, node_id: String, action: &str) -> anyhow::Result<()> {
    let r = client
        .call(|mut c| {
            let (node_id, action) = (node_id.clone(), action.to_string());
            async move { c.set_node_flags(SetNodeFlagsRequest { node_id, action }).await }
        })
        .await?;
    print(
        out,
        json!({"node_id": node_id, "action": action, "log_index": r.log_index}),
        || format!("{action}: node {node_id} (committed at index {})", r.log_index),
    );
    Ok(())
}
