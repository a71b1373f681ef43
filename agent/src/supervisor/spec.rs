//! What a replica is: a model's runtime spec bound to a device, a port and its weights.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How to run a model server (from the model's registry entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSpec {
    /// Program and arguments; `{port}`, `{weights}`, `{device}` and `{model}` are substituted.
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// HTTP path that answers 200 once the server is ready, e.g. `/v2/health/ready`.
    pub health_path: String,
    /// Request sent once healthy, before the replica is reported Ready.
    pub warmup: Option<Warmup>,
    /// How long start + health + warm-up may take, ms.
    pub start_timeout_ms: u64,
}

/// A warm-up request: `POST path` with a JSON body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warmup {
    pub path: String,
    pub body: String,
}

/// One replica to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSpec {
    /// Unique id (assigned by the controller).
    pub id: String,
    pub model: String,
    /// GPU or MIG UUID the replica is pinned to (`CUDA_VISIBLE_DEVICES`).
    pub device: String,
    /// Local path of the weights (from the weight cache), if the model has any.
    pub weights: Option<String>,
    pub runtime: RuntimeSpec,
}

impl ReplicaSpec {
    pub fn start_timeout(&self) -> Duration {
        Duration::from_millis(self.runtime.start_timeout_ms)
    }

    /// The command line with placeholders filled in.
    pub fn argv(&self, port: u16) -> Vec<String> {
        self.runtime
            .command
            .iter()
            .map(|a| {
                a.replace("{port}", &port.to_string())
                    .replace("{weights}", self.weights.as_deref().unwrap_or(""))
                    .replace("{device}", &self.device)
                    .replace("{model}", &self.model)
            })
            .collect()
    }

    /// Checks the spec before anything is spawned.
    pub fn validate(&self) -> Result<(), String> {
        if self.id.is_empty() || !self.id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(format!(
                "replica id {:?}: use letters, digits, '-', '_' and '.'",
                self.id
            ));
        }
        if self.runtime.command.is_empty() {
            return Err(format!(
                "replica {}: runtime.command is empty; give the model server's program",
                self.id
            ));
        }
        if !self.runtime.health_path.starts_with('/') {
            return Err(format!(
                "replica {}: runtime.health_path {:?} must start with '/'",
                self.id, self.runtime.health_path
            ));
        }
        if self.runtime.start_timeout_ms == 0 {
            return Err(format!("replica {}: runtime.start_timeout_ms must be > 0", self.id));
        }
        Ok(())
    }
}
