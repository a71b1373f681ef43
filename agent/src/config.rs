//! Agent configuration: a TOML file plus flags, validated before anything starts. Unknown
//! fields are tolerated (an agent must survive a config written for a newer version during a
//! rollback); invalid values exit with code 2 naming the field.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::supervisor::{ReplicaSpec, RuntimeSpec};

/// The file as written.
#[derive(Debug, Default, Deserialize)]
pub struct AgentFile {
    pub node_id: Option<String>,
    #[serde(default)]
    pub controllers: Vec<String>,
    pub pool: Option<String>,
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    pub data_dir: Option<PathBuf>,
    pub join_token: Option<String>,
    pub heartbeat_ms: Option<u64>,
    /// Host (name or IP) the routers dial to reach this node's replicas. Default: the hostname.
    pub replica_host: Option<String>,
    /// Where durable jobs' results are written: a directory shared with the controllers, or
    /// an object-store URL (`s3://bucket/prefix`). Default: `<data_dir>/results`.
    pub results_store: Option<String>,
    /// `/metrics` for Prometheus: `host:port`, or "off". Default 0.0.0.0:9419.
    pub metrics_listen: Option<String>,
    #[serde(default)]
    pub gpu: GpuFile,
    /// Static replicas: run whatever the controllers say (like a kubelet's static pods).
    #[serde(default)]
    pub replica: Vec<StaticReplicaFile>,
    /// `[tls]`: the cluster CA's certificate and this node's certificate and key.
    #[serde(default)]
    pub tls: laneway_pki::TlsFiles,
    /// Talk to the controllers in plaintext (development clusters only).
    pub insecure_dev: Option<bool>,
}

/// `[gpu]` table.
#[derive(Debug, Default, Deserialize)]
pub struct GpuFile {
    /// `nvml` (default) or `sim`.
    pub backend: Option<String>,
    pub sim_config: Option<PathBuf>,
}

/// `[[replica]]` entries.
#[derive(Debug, Deserialize)]
pub struct StaticReplicaFile {
    pub id: String,
    pub model: String,
    /// Index of the GPU (in `laneway-agent gpus` order) to pin it to.
    #[serde(default)]
    pub gpu_index: u32,
    pub command: Vec<String>,
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    pub health_path: String,
    pub warmup_path: Option<String>,
    pub warmup_body: Option<String>,
    #[serde(default = "default_start_timeout")]
    pub start_timeout_ms: u64,
    /// Where the replica reports requests in flight: `{ path = "/metrics", metric = "…" }`.
    pub in_flight: Option<crate::supervisor::InFlightProbe>,
}

fn default_start_timeout() -> u64 {
    60_000
}

/// Which GPU backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Nvml,
    Sim(PathBuf),
}

/// A static replica before its GPU index is resolved to a UUID.
#[derive(Debug, Clone)]
pub struct StaticReplica {
    pub gpu_index: u32,
    pub spec: ReplicaSpec,
}

/// The validated agent configuration.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node_id: String,
    pub controllers: Vec<String>,
    pub pool: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub data_dir: PathBuf,
    /// Interval between heartbeats. Default 1 s.
    pub heartbeat: Duration,
    /// Host the routers dial to reach this node's replicas; empty = the hostname.
    pub replica_host: String,
    /// Results store location (directory or object-store URL).
    pub results_store: String,
    pub backend: Backend,
    pub replicas: Vec<StaticReplica>,
    /// Where `/metrics` is served; `None`: nowhere.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// How the agent proves its identity to the controllers.
    pub credentials: crate::identity::Credentials,
}

/// Default `/metrics` address of an agent.
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9419";

/// An invalid configuration value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid agent configuration: {field} = {value}: {expected}")]
pub struct AgentConfigError {
    pub field: String,
    pub value: String,
    pub expected: String,
}

fn bad(field: impl Into<String>, value: impl std::fmt::Debug, expected: impl Into<String>) -> AgentConfigError {
    AgentConfigError {
        field: field.into(),
        value: format!("{value:?}"),
        expected: expected.into(),
    }
}

/// Reads a config file.
pub fn read_file(path: &Path) -> Result<AgentFile, AgentConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad("config", path.display().to_string(), format!("a readable file ({e})")))?;
    toml::from_str(&text).map_err(|e| bad("config", path.display().to_string(), e.to_string().trim().to_string()))
}

impl AgentFile {
    /// Validates the file (after flags were merged into it).
    pub fn validate(self) -> Result<AgentConfig, AgentConfigError> {
        let node_id = self
            .node_id
            .ok_or_else(|| bad("node_id", "<unset>", "this node's name, e.g. gpu-h100-07"))?;
        if !(1..=63).contains(&node_id.len())
            || node_id.starts_with('-')
            || node_id.ends_with('-')
            || !node_id
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        {
            return Err(bad("node_id", &node_id, "1-63 characters of a-z, 0-9 and '-'"));
        }
        if self.controllers.is_empty() {
            return Err(bad("controllers", "[]", "at least one controller host:port"));
        }
        for c in &self.controllers {
            let ok = c
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(bad("controllers", c, "host:port, e.g. 10.0.0.11:7001"));
            }
        }
        let data_dir = self.data_dir.ok_or_else(|| {
            bad(
                "data_dir",
                "<unset>",
                "a directory for the agent's state and weight cache",
            )
        })?;
        let heartbeat_ms = self.heartbeat_ms.unwrap_or(1000);
        if !(100..=60_000).contains(&heartbeat_ms) {
            return Err(bad("heartbeat_ms", heartbeat_ms, "between 100 and 60000"));
        }
        let backend = match self.gpu.backend.as_deref().unwrap_or("nvml") {
            "nvml" => Backend::Nvml,
            "sim" => Backend::Sim(self.gpu.sim_config.ok_or_else(|| {
                bad(
                    "gpu.sim_config",
                    "<unset>",
                    "a simulated GPU file when gpu.backend = \"sim\"",
                )
            })?),
            other => return Err(bad("gpu.backend", other, "\"nvml\" or \"sim\"")),
        };
        let mut replicas = Vec::new();
        for (i, r) in self.replica.into_iter().enumerate() {
            let spec = ReplicaSpec {
                id: r.id,
                model: r.model,
                device: String::new(),
                weights: None,
                runtime: RuntimeSpec {
                    command: r.command,
                    env: r.env,
                    health_path: r.health_path,
                    warmup: r.warmup_path.map(|path| crate::supervisor::Warmup {
                        path,
                        body: r.warmup_body.unwrap_or_else(|| "{\"inputs\":[]}".into()),
                    }),
                    start_timeout_ms: r.start_timeout_ms,
                    in_flight: r.in_flight,
                    ..Default::default()
                },
            };
            spec.validate().map_err(|e| bad(format!("replica[{i}]"), &spec.id, e))?;
            replicas.push(StaticReplica {
                gpu_index: r.gpu_index,
                spec,
            });
        }
        let results_store = self
            .results_store
            .unwrap_or_else(|| data_dir.join("results").display().to_string());
        let metrics_listen = match self.metrics_listen.as_deref().unwrap_or(DEFAULT_METRICS_LISTEN) {
            "off" => None,
            a => Some(a.parse().map_err(|_| {
                bad(
                    "metrics_listen",
                    a,
                    "an IP address and port such as 0.0.0.0:9419, or \"off\"",
                )
            })?),
        };
        let join_token = self.join_token.unwrap_or_default();
        let joining =
            self.tls.ca.is_some() && self.tls.cert.is_none() && self.tls.key.is_none() && !join_token.is_empty();
        let credentials = match (self.tls.load(), self.insecure_dev.unwrap_or(false)) {
            _ if joining => {
                let ca = self.tls.ca.as_ref().expect("checked above");
                let ca_pem = std::fs::read_to_string(ca)
                    .map_err(|e| bad("tls.ca", ca.display().to_string(), format!("a readable CA certificate ({e})")))?;
                crate::identity::Credentials::Join {
                    ca_pem,
                    token: join_token,
                }
            }
            (Err(e), _) => return Err(bad("tls", "[ca, cert, key]", e.to_string())),
            (Ok(Some(_)), true) => {
                return Err(bad("insecure_dev", true, "not together with TLS settings: remove one of them"))
            }
            (Ok(None), false) => {
                return Err(bad(
                    "tls",
                    "<unset>",
                    "TLS settings: [tls] ca with a join_token (from `lanectl token create`), or [tls] ca, cert and key (from `lanectl certs issue --kind agent`); or insecure_dev = true (--insecure-dev) for a development cluster",
                ))
            }
            (Ok(None), true) => crate::identity::Credentials::Insecure,
            (Ok(Some(tls)), false) => {
                let id = tls.identity();
                if id.kind != laneway_pki::Kind::Agent || id.name != node_id {
                    return Err(bad(
                        "tls.cert",
                        id.uri(),
                        format!("a certificate for agent {node_id}; issue one with `lanectl certs issue --kind agent --name {node_id}`"),
                    ));
                }
                crate::identity::Credentials::Files(tls)
            }
        };
        Ok(AgentConfig {
            credentials,
            node_id,
            controllers: self.controllers,
            pool: self.pool.unwrap_or_else(|| "default".into()),
            labels: self.labels,
            data_dir,
            heartbeat: Duration::from_millis(heartbeat_ms),
            replica_host: self.replica_host.unwrap_or_default(),
            results_store,
            backend,
            replicas,
            metrics_listen,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> String {
        "node_id = \"n1\"\ncontrollers = [\"127.0.0.1:7001\"]\ndata_dir = \"/tmp/a\"\ninsecure_dev = true\n".to_string()
    }

    #[test]
    fn unknown_fields_are_tolerated() {
        let f: AgentFile = toml::from_str(&(base() + "future_knob = 3\n")).unwrap();
        assert_eq!(f.validate().unwrap().node_id, "n1");
    }

    #[test]
    fn errors_name_the_field() {
        for (text, field) in [
            (base().replace("n1", "N_1"), "node_id"),
            (base().replace("127.0.0.1:7001", "nowhere"), "controllers"),
            (base() + "heartbeat_ms = 5\n", "heartbeat_ms"),
            (base() + "[gpu]\nbackend = \"cuda\"\n", "gpu.backend"),
            (base() + "[gpu]\nbackend = \"sim\"\n", "gpu.sim_config"),
            (base().replace("data_dir = \"/tmp/a\"\n", ""), "data_dir"),
        ] {
            let f: AgentFile = toml::from_str(&text).unwrap();
            assert_eq!(f.validate().unwrap_err().field, field);
        }
    }
}
