//! `lanectl mig …`: the MIG layout of each GPU — what the controllers want, and what the
//! agent reports it has.

use std::fmt::Write as _;

use clap::Subcommand;
use laneway_control::client::AdminClient;
use laneway_proto::admin::SetMigLayoutRequest;
use serde_json::json;

use super::{list_nodes, print, Output};

#[derive(Subcommand)]
pub enum MigCmd {
    /// Set a GPU's MIG layout: profile names, one per device (e.g. `3g.40gb 3g.40gb 1g.10gb`),
    /// or `whole` for the whole card (MIG off). The controllers first move whole-card replicas
    /// off the GPU; its agent applies the layout once nothing runs on it.
    Set {
        node_id: String,
        /// GPU UUID (`lanectl mig list` or `lanectl node show NODE` shows them).
        gpu: String,
        #[arg(required = true, num_args = 1..)]
        profiles: Vec<String>,
    },
    /// Every GPU: product, the layout wanted and the MIG devices the agent reports.
    List,
}

pub async fn mig(client: &AdminClient, out: Output, cmd: MigCmd) -> anyhow::Result<()> {
    match cmd {
        MigCmd::Set {
            node_id,
            gpu,
            mut profiles,
        } => {
            if profiles.len() == 1 && profiles[0] == "whole" {
                profiles.clear();
            }
            let r = client
                .call(|mut c| {
                    let req = SetMigLayoutRequest {
                        node_id: node_id.clone(),
                        gpu: gpu.clone(),
                        profiles: profiles.clone(),
                    };
                    async move { c.set_mig_layout(req).await }
                })
                .await?;
            print(out, json!({"log_index": r.log_index}), || {
                let what = if profiles.is_empty() {
                    "the whole card (MIG off)".to_string()
                } else {
                    profiles.join(" + ")
                };
                format!(
                    "{node_id} {gpu}: {what} (log index {}); replicas move off first, then the agent applies it",
                    r.log_index
                )
            });
        }
        MigCmd::List => {
            let nodes = list_nodes(client).await?;
            let rows: Vec<serde_json::Value> = nodes
                .iter()
                .flat_map(|n| {
                    n.gpus.iter().map(move |g| {
                        json!({
                            "node_id": n.node_id, "gpu": g.uuid, "product": g.product,
                            "mig_capable": g.mig_capable,
                            "wanted": g.has_mig_layout.then(|| g.mig_layout.clone()),
                            "reported": g.mig_devices,
                        })
                    })
                })
                .collect();
            print(out, json!(rows), || {
                let mut s = format!(
                    "{:<16} {:<28} {:<10} {:<34} {}\n",
                    "NODE", "GPU", "PRODUCT", "WANTED", "REPORTED"
                );
                for n in &nodes {
                    for g in &n.gpus {
                        let wanted = match (g.has_mig_layout, g.mig_layout.is_empty()) {
                            (false, _) => "-".to_string(),
                            (true, true) => "whole card".to_string(),
                            (true, false) => g.mig_layout.join(","),
                        };
                        let reported = if g.mig_devices.is_empty() {
                            "whole card".to_string()
                        } else {
                            g.mig_devices.join(",")
                        };
                        let _ = writeln!(
                            s,
                            "{:<16} {:<28} {:<10} {:<34} {}",
                            n.node_id, g.uuid, g.product, wanted, reported
                        );
                    }
                }
                s.trim_end().to_string()
            });
        }
    }
    Ok(())
}
