//! `lanectl pool …`: taints on pools, which only lanes that tolerate them use.

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_proto::admin::{ListRegistryRequest, SetPoolTaintsRequest};
use serde_json::json;

use super::{print, Output};

#[derive(Subcommand)]
pub enum PoolCmd {
    /// Taint a pool: only lanes that tolerate every taint (`lanectl lane set --tolerate`)
    /// place replicas there; replicas of other lanes move off. Replaces its taints.
    Taint {
        pool: String,
        #[arg(required = true, num_args = 1..)]
        taints: Vec<String>,
    },
    /// Remove every taint of a pool.
    Untaint { pool: String },
    /// Pools with taints.
    List,
    /// The slow loop's node requests (requested, launched, joined, releasing) and the
    /// (product, region) pairs it is keeping launches away from after capacity failures.
    Requests,
}

pub async fn pool(client: &AdminClient, out: Output, cmd: PoolCmd) -> anyhow::Result<()> {
    let (pool, taints) = match cmd {
        PoolCmd::List => {
            let r = client
                .call(|mut c| async move { c.list_registry(ListRegistryRequest { kind: "pools".into() }).await })
                .await?;
            let pools: Vec<serde_json::Value> = r
                .json
                .iter()
                .map(|j| serde_json::from_str(j))
                .collect::<Result<_, _>>()?;
            print(out, json!(pools), || {
                if pools.is_empty() {
                    return "no pool has taints".into();
                }
                pools
                    .iter()
                    .map(|p| {
                        let taints: Vec<&str> = p["taints"]
                            .as_array()
                            .map(|a| a.iter().filter_map(|t| t.as_str()).collect())
                            .unwrap_or_default();
                        format!("{:<24} {}", p["pool"].as_str().unwrap_or(""), taints.join(","))
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
            return Ok(());
        }
        PoolCmd::Requests => return requests(client, out).await,
        PoolCmd::Taint { pool, taints } => (pool, taints),
        PoolCmd::Untaint { pool } => (pool, Vec::new()),
    };
    let r = client
        .call(|mut c| {
            let req = SetPoolTaintsRequest {
                pool: pool.clone(),
                taints: taints.clone(),
            };
            async move { c.set_pool_taints(req).await }
        })
        .await?;
    print(out, json!({"log_index": r.log_index}), || {
        if taints.is_empty() {
            format!("pool {pool} has no taints now (log index {})", r.log_index)
        } else {
            format!(
                "pool {pool} tainted {} (log index {}); only lanes tolerating it place replicas there",
                taints.join(","),
                r.log_index
            )
        }
    });
    Ok(())
}

async fn docs(client: &AdminClient, kind: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let kind = kind.to_string();
    let r = client
        .call(|mut c| {
            let kind = kind.clone();
            async move { c.list_registry(ListRegistryRequest { kind }).await }
        })
        .await?;
    Ok(r.json
        .iter()
        .map(|j| serde_json::from_str(j))
        .collect::<Result<_, _>>()?)
}

async fn requests(client: &AdminClient, out: Output) -> anyhow::Result<()> {
    let requests = docs(client, "node-requests").await?;
    let marks = docs(client, "capacity").await?;
    print(out, json!({"requests": requests, "capacity": marks}), || {
        let mut t = String::new();
        if requests.is_empty() {
            t.push_str("no node requests (the slow loop is off, or everything fits)");
        } else {
            t.push_str(&format!(
                "{:<28} {:<14} {:<10} {:<12} {:<10} {:<20} {}",
                "NODE", "POOL", "STATE", "PRODUCT", "TIER", "REQUESTED", "FOR"
            ));
            for r in &requests {
                let s = |k: &str| r[k].as_str().unwrap_or("").to_string();
                let models: Vec<&str> = r["models"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|m| m.as_str()).collect())
                    .unwrap_or_default();
                let via = r["fallback_from"]
                    .as_str()
                    .map_or(String::new(), |f| format!(" (fallback for {f})"));
                t.push_str(&format!(
                    "\n{:<28} {:<14} {:<10} {:<12} {:<10} {:<20} {}{via}",
                    s("id"),
                    s("pool"),
                    s("state"),
                    format!("{}×{}", r["gpus"], s("product")),
                    s("tier"),
                    laneway_core::ledger::fmt_unix_ms(r["requested_ms"].as_u64().unwrap_or(0)),
                    models.join(",")
                ));
            }
        }
        for m in &marks {
            t.push_str(&format!(
                "\nno launches of {} in {} until {}: {}",
                m["product"].as_str().unwrap_or(""),
                m["region"]
                    .as_str()
                    .filter(|r| !r.is_empty())
                    .unwrap_or("the default region"),
                laneway_core::ledger::fmt_unix_ms(m["until_ms"].as_u64().unwrap_or(0)),
                m["why"].as_str().unwrap_or("")
            ));
        }
        t
    });
    Ok(())
}
