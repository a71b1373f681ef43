//! `lanectl model`: registering models, their versions and where their replicas run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_core::registry::{Millis, Model, Profile};
use laneway_proto::admin::{NameRequest, PutDocumentRequest};
use serde_json::{json, Value};

use super::{print, Output};
use crate::registry::{committed, list};

#[derive(Subcommand)]
pub enum ModelCmd {
    /// Register a model (or a new version) under an existing class; servable at once.
    Register(ModelRegisterArgs),
    /// Deploy a version from a model file: the first version of a name serves at once; a later
    /// one is kept beside the serving version, idle, until `lanectl rollout start` moves
    /// traffic to it. Versions are immutable.
    Deploy {
        /// Model file, TOML or JSON (see deploy/examples/models/), with its `version`.
        file: PathBuf,
    },
    List,
    Show {
        name: String,
    },
    Remove {
        name: String,
    },
}

#[derive(clap::Args)]
pub struct ModelRegisterArgs {
    /// Model file, TOML or JSON (see deploy/examples/models/); flags below override it.
    #[arg(long, short)]
    file: Option<PathBuf>,
    /// Model name (required without --file).
    #[arg(long)]
    name: Option<String>,
    /// Class the model belongs to; it inherits the class's lane.
    #[arg(long)]
    class: Option<String>,
    #[arg(long)]
    version: Option<String>,
    /// Profile per GPU product: PRODUCT=SERVICE_MS:MAX_BATCH, e.g. L4=120:8 (repeatable).
    #[arg(long, value_parser = profile_flag)]
    profile: Vec<(String, Profile)>,
}

fn profile_flag(s: &str) -> Result<(String, Profile), String> {
    let err = || format!("{s:?}: expected PRODUCT=SERVICE_MS:MAX_BATCH, e.g. L4=120:8");
    let (product, rest) = s.split_once('=').ok_or_else(err)?;
    let (ms, batch) = rest.split_once(':').ok_or_else(err)?;
    let ms: f64 = ms.parse().map_err(|_| err())?;
    let max_batch: u32 = batch.parse().map_err(|_| err())?;
    Ok((
        product.to_string(),
        Profile {
            service_ms: Millis::from_ms(ms),
            max_batch,
            gpu_memory_gb: 0,
            mig_profiles: vec![],
            tokens_per_s: None,
        },
    ))
}

/// Reads a model file: TOML, or JSON when the name ends in `.json`.
fn read_model_file(path: &Path) -> anyhow::Result<Model> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let json = path.extension().is_some_and(|e| e == "json");
    laneway_core::registry::presets::parse_model(&text, json).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

pub async fn model(client: &AdminClient, out: Output, cmd: ModelCmd) -> anyhow::Result<()> {
    match cmd {
        ModelCmd::Register(a) => {
            let mut m = match &a.file {
                Some(p) => read_model_file(p)?,
                None => Model {
                    inputs: Vec::new(),
                    outputs: Vec::new(),
                    fallback: None,
                    name: a
                        .name
                        .clone()
                        .ok_or_else(|| anyhow::anyhow!("give --file, or --name, --class and --profile"))?,
                    class: a
                        .class
                        .clone()
                        .ok_or_else(|| anyhow::anyhow!("--class is required without --file"))?,
                    version: "1".into(),
                    profiles: BTreeMap::new(),
                    runtime: Default::default(),
                    weights: vec![],
                    llm: None,
                    serves: None,
                },
            };
            if let Some(n) = a.name {
                m.name = n;
            }
            if let Some(c) = a.class {
                m.class = c;
            }
            if let Some(v) = a.version {
                m.version = v;
            }
            m.profiles.extend(a.profile);
            m.validate().map_err(anyhow::Error::msg)?;
            let json = serde_json::to_string(&m)?;
            let r = client
                .call(|mut cl| {
                    let json = json.clone();
                    async move { cl.put_model(PutDocumentRequest { json }).await }
                })
                .await?;
            committed(
                out,
                &r,
                format!("model {} version {} registered in class {}", m.name, m.version, m.class),
            );
        }
        ModelCmd::Deploy { file } => {
            let m = read_model_file(&file)?;
            m.validate().map_err(anyhow::Error::msg)?;
            let json = serde_json::to_string(&m)?;
            let r = client
                .call(|mut cl| {
                    let json = json.clone();
                    async move { cl.deploy_model(PutDocumentRequest { json }).await }
                })
                .await?;
            // A later version is kept idle as name@version; the first one serves at once.
            let entry = format!("{}@{}", m.name, m.version);
            let idle = list(client, "models")
                .await?
                .iter()
                .any(|d| d["name"] == entry.as_str());
            let what = if idle {
                format!(
                    "model {} version {} deployed, idle: `lanectl rollout start {} --version {}` moves traffic to it",
                    m.name, m.version, m.name, m.version
                )
            } else {
                format!("model {} version {} deployed; it serves {}", m.name, m.version, m.name)
            };
            committed(out, &r, what);
        }
        ModelCmd::List => {
            let states: std::collections::HashMap<String, Value> = list(client, "model-states")
                .await?
                .into_iter()
                .filter_map(|s| Some((s["name"].as_str()?.to_string(), s["state"].clone())))
                .collect();
            // The specification with what the version does now (a view: `state` is not part
            // of a model file).
            let models: Vec<Value> = list(client, "models")
                .await?
                .into_iter()
                .map(|mut m| {
                    let state = m["name"].as_str().and_then(|n| states.get(n)).cloned();
                    m["state"] = state.unwrap_or(Value::Null);
                    m
                })
                .collect();
            print(out, json!(models), || {
                let mut t = format!(
                    "{:<20} {:<14} {:<8} {:<11} PROFILES (service ms / max batch)",
                    "MODEL", "CLASS", "VERSION", "STATE"
                );
                for m in &models {
                    let profiles: Vec<String> = m["profiles"]
                        .as_object()
                        .map(|p| {
                            p.iter()
                                .map(|(k, v)| format!("{k} {}/{}", v["service_ms"], v["max_batch"]))
                                .collect()
                        })
                        .unwrap_or_default();
                    t.push_str(&format!(
                        "\n{:<20} {:<14} {:<8} {:<11} {}",
                        m["name"].as_str().unwrap_or(""),
                        m["class"].as_str().unwrap_or(""),
                        m["version"].as_str().unwrap_or(""),
                        m["state"].as_str().unwrap_or(""),
                        profiles.join(", ")
                    ));
                }
                t
            });
        }
        ModelCmd::Show { name } => {
            let m = list(client, "models")
                .await?
                .into_iter()
                .find(|m| m["name"] == name.as_str())
                .ok_or_else(|| anyhow::anyhow!("no model {name}; `lanectl model list` shows the models"))?;
            let replicas: Vec<Value> = list(client, "replicas")
                .await?
                .into_iter()
                .filter(|r| r["replica"]["model"] == name.as_str())
                .collect();
            print(out, json!({"model": m, "replicas": replicas}), || {
                let mut t = serde_json::to_string_pretty(&m).unwrap_or_default();
                t.push_str("\nreplicas:");
                for r in &replicas {
                    t.push_str(&format!(
                        "\n  {}/{}  {}  {}",
                        r["node"].as_str().unwrap_or(""),
                        r["replica"]["id"].as_str().unwrap_or(""),
                        r["replica"]["state"].as_str().unwrap_or(""),
                        r["replica"]["endpoint"].as_str().unwrap_or(""),
                    ));
                }
                if replicas.is_empty() {
                    t.push_str(" none reported");
                }
                t
            });
        }
        ModelCmd::Remove { name } => {
            let r = client
                .call(|mut cl| {
                    let name = name.clone();
                    async move { cl.remove_model(NameRequest { name }).await }
                })
                .await?;
            committed(out, &r, format!("model {name} removed"));
        }
    }
    Ok(())
}
