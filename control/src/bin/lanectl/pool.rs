//! `lanectl pool …`: taints on pools, which only lanes that tolerate them use.

use clap::Subcommand;
use laneway_control::client::AdminClient;
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
