//! What `lanectl lane|model|tenant|rollout|token` share: listing registry entries, the
//! registry and traffic `plan --from-cluster` reads, and how a committed write is shown.

use std::collections::BTreeMap;

use laneway_client::AdminClient;
use laneway_core::lane_report::LaneStatus;
use laneway_core::registry::{Class, Model};
use laneway_core::usage::RequestRecord;
use laneway_proto::admin::{LaneStatusRequest, ListRegistryRequest, WriteReply};
use serde_json::{json, Value};

use super::{print, Output};

pub async fn list(client: &AdminClient, kind: &str) -> anyhow::Result<Vec<Value>> {
    let r = client
        .call(|mut c| {
            let kind = kind.to_string();
            async move { c.list_registry(ListRegistryRequest { kind }).await }
        })
        .await?;
    r.json
        .iter()
        .map(|j| serde_json::from_str(j).map_err(Into::into))
        .collect()
}

/// The registry and the traffic the addressed router observed, for `plan --from-cluster`.
pub async fn cluster_inputs(client: &AdminClient) -> anyhow::Result<laneway_core::planner::cluster::ClusterInputs> {
    let classes = list(client, "classes")
        .await?
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<Vec<Class>, _>>()?;
    let models = list(client, "models")
        .await?
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<Vec<Model>, _>>()?;
    let records: Vec<RequestRecord> = lane_status(client, 1000)
        .await?
        .into_iter()
        .flat_map(|(_, r)| r)
        .collect();
    let observed = match (
        records.iter().map(|r| r.unix_ms).min(),
        records.iter().map(|r| r.unix_ms).max(),
    ) {
        (Some(first), Some(last)) => {
            let mut by_class = BTreeMap::new();
            for r in &records {
                *by_class.entry(r.class.clone()).or_insert(0u64) += 1;
            }
            Some(laneway_core::planner::cluster::Observed {
                requests_by_class: by_class,
                window_s: (last - first) as f64 / 1000.0,
            })
        }
        _ => None,
    };
    // The longest replica start the agents measured, per GPU product (the GPU its device
    // names, else — a MIG slice — the node's one product).
    let mut measured_cold_start_s: BTreeMap<String, f64> = BTreeMap::new();
    for n in crate::node::list_nodes(client).await? {
        let products: std::collections::BTreeSet<&str> = n.gpus.iter().map(|g| g.product.as_str()).collect();
        for r in n.replicas.iter().filter(|r| r.ready_ms > 0) {
            let product = n
                .gpus
                .iter()
                .find(|g| g.uuid == r.device)
                .map(|g| g.product.as_str())
                .or_else(|| (products.len() == 1).then(|| *products.first().unwrap()));
            if let Some(p) = product {
                let e = measured_cold_start_s.entry(p.to_string()).or_default();
                *e = e.max(r.ready_ms as f64 / 1000.0);
            }
        }
    }
    Ok(laneway_core::planner::cluster::ClusterInputs {
        classes,
        models,
        observed,
        measured_cold_start_s,
    })
}

pub fn committed(out: Output, r: &WriteReply, what: String) {
    print(out, json!({"log_index": r.log_index, "done": what}), || {
        format!("{what} (committed at index {})", r.log_index)
    });
}

pub async fn lane_status(client: &AdminClient, recent: u32) -> anyhow::Result<Vec<(LaneStatus, Vec<RequestRecord>)>> {
    let r = client
        .call(|mut c| async move { c.lane_status(LaneStatusRequest { recent }).await })
        .await?;
    r.json
        .iter()
        .map(|j| {
            let v: Value = serde_json::from_str(j)?;
            Ok((
                serde_json::from_value(v["status"].clone())?,
                serde_json::from_value(v["recent"].clone())?,
            ))
        })
        .collect()
}
