//! `lanectl mig …`: the MIG layout of each GPU — what the controllers want, and what the
//! agent reports it has.

use std::fmt::Write as _;

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_proto::admin::{ApplyMigPlanRequest, PlanMigRequest, SetMigLayoutRequest};
use serde_json::json;

use super::node::list_nodes;
use super::{print, Output};

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
    /// Propose a layout for every MIG-capable GPU from the models that list MIG slices and
    /// the replicas they want, and keep it as the next plan version for review. Nothing
    /// changes until `lanectl mig apply --version N`.
    Plan {
        /// Show the latest plan instead of making a new one.
        #[arg(long)]
        show: bool,
    },
    /// Apply plan N (the latest, reviewed): each GPU whose layout changes drains first, then
    /// its agent re-partitions it.
    Apply {
        #[arg(long)]
        version: u64,
        /// Follow it until every GPU reports the layout it is given (at most this long, e.g.
        /// `10m`): progress on a terminal, a line per step otherwise.
        #[arg(long, value_name = "DURATION", num_args = 0..=1, default_missing_value = "15m")]
        wait: Option<String>,
    },
}

/// GPUs whose reported MIG devices are not yet the layout they are given, of those given one.
fn unsettled(nodes: &[laneway_proto::admin::NodeInfo]) -> (usize, usize) {
    let given: Vec<_> = nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .filter(|g| g.has_mig_layout)
        .collect();
    let pending = given
        .iter()
        .filter(|g| {
            let (mut want, mut have) = (g.mig_layout.clone(), g.mig_devices.clone());
            want.sort();
            have.sort();
            want != have
        })
        .count();
    (pending, given.len())
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
        MigCmd::Plan { show } => {
            let r = client
                .call(|mut c| async move {
                    if show {
                        c.show_mig_plan(PlanMigRequest {}).await
                    } else {
                        c.plan_mig(PlanMigRequest {}).await
                    }
                })
                .await?;
            let Some(doc) = r.json.first() else {
                print(out, json!(null), || {
                    "no MIG plan yet: `lanectl mig plan` makes one".into()
                });
                return Ok(());
            };
            let plan: serde_json::Value = serde_json::from_str(doc)?;
            print(out, plan.clone(), || plan_text(&plan));
        }
        MigCmd::Apply { version, wait } => {
            let r = client
                .call(|mut c| async move { c.apply_mig_plan(ApplyMigPlanRequest { version }).await })
                .await?;
            if let Some(wait) = wait {
                let limit = humantime::parse_duration(&wait)
                    .map_err(|e| anyhow::anyhow!("--wait {wait:?}: {e}; give a duration such as 10m"))?;
                let deadline = tokio::time::Instant::now() + limit;
                let mut progress =
                    crate::progress::Progress::start(&format!("MIG plan {version}: GPUs drain, then re-partition"));
                loop {
                    let (pending, given) = unsettled(&list_nodes(client).await?);
                    if pending == 0 {
                        progress.step(format!("all {given} GPU(s) with a layout report it"));
                        break;
                    }
                    progress.step(format!("{} of {given} GPU(s) report their layout", given - pending));
                    if tokio::time::Instant::now() >= deadline {
                        anyhow::bail!(
                            "{pending} GPU(s) did not reach their layout within {wait}; `lanectl mig list` shows which, `lanectl events` why"
                        );
                    }
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
            print(out, json!({"version": version, "log_index": r.log_index}), || {
                format!(
                    "MIG plan {version} applied (log index {}): changed GPUs drain, then their agents re-partition them; `lanectl mig list` shows progress",
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

/// A plan for review: what changes on which GPU, and for which models.
fn plan_text(plan: &serde_json::Value) -> String {
    let layout = |v: &serde_json::Value| {
        let l: Vec<&str> = v
            .as_array()
            .map(|a| a.iter().filter_map(|p| p.as_str()).collect())
            .unwrap_or_default();
        if l.is_empty() {
            "whole card".to_string()
        } else {
            l.join(",")
        }
    };
    let version = plan["version"].as_u64().unwrap_or(0);
    let mut s = format!(
        "MIG plan {version} ({})\n{:<16} {:<28} {:<10} {:<30} {:<30} {}\n",
        match plan["applied_ms"].as_u64() {
            Some(at) => format!("applied {}", laneway_core::ledger::fmt_unix_ms(at)),
            None => "not applied".to_string(),
        },
        "NODE",
        "GPU",
        "PRODUCT",
        "NOW",
        "PLANNED",
        "FOR"
    );
    let mut changes = 0;
    for g in plan["gpus"].as_array().into_iter().flatten() {
        let (now, planned) = (layout(&g["current"]), layout(&g["planned"]));
        let mark = if now == planned {
            "  "
        } else {
            changes += 1;
            "* "
        };
        let models: Vec<&str> = g["for_models"]
            .as_array()
            .map(|a| a.iter().filter_map(|m| m.as_str()).collect())
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "{mark}{:<14} {:<28} {:<10} {:<30} {:<30} {}",
            g["node"].as_str().unwrap_or(""),
            g["gpu"].as_str().unwrap_or(""),
            g["product"].as_str().unwrap_or(""),
            now,
            planned,
            models.join(",")
        );
    }
    for n in plan["notes"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "note: {}", n.as_str().unwrap_or(""));
    }
    if plan["applied_ms"].is_null() {
        let _ = write!(
            s,
            "{changes} GPU(s) change (*); they drain first. Apply with `lanectl mig apply --version {version}`"
        );
    }
    s.trim_end().to_string()
}
