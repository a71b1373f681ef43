//! What a replica is: a model's runtime spec bound to a device, a port and its weights.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How to run a model server (from the model's registry entry).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Where the replica reports its requests in flight, read with every heartbeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<InFlightProbe>,
    /// Files written into the working directory before start (relative path → contents, with
    /// placeholders).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// Links made in the working directory before start (relative path → local file, e.g. a
    /// cached weight blob).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub links: BTreeMap<String, String>,
    /// The graceful stop signal (`SIGTERM` when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
    /// How long after the stop signal before SIGKILL, ms (the agent's drain grace when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_grace_ms: Option<u64>,
}

/// The ports one replica was given: the HTTP port the router sends to, and one per
/// `{port:NAME}` its command, environment or files ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ports {
    pub http: u16,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub named: BTreeMap<String, u16>,
}

impl Ports {
    /// `name=port,…`, as a replica's environment records them (for re-adoption).
    pub fn named_to_env(&self) -> String {
        self.named
            .iter()
            .map(|(n, p)| format!("{n}={p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Reads [`Ports::named_to_env`]'s form back; malformed parts are skipped.
    pub fn named_from_env(text: &str) -> BTreeMap<String, u16> {
        text.split(',')
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// The port a probe reads: its named port, or the HTTP port.
    pub fn for_probe(&self, probe: &InFlightProbe) -> Option<u16> {
        match &probe.port {
            None => Some(self.http),
            Some(name) => self.named.get(name).copied(),
        }
    }
}

/// A gauge of requests in flight on the replica's Prometheus endpoint: `GET path`, the value
/// of `metric` (summed over its label sets), e.g. vLLM's `vllm:num_requests_running`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InFlightProbe {
    /// The named port (`{port:NAME}`) the gauges are served on; none: the HTTP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<String>,
    pub path: String,
    pub metric: String,
    /// Language models: the gauge of requests waiting inside the engine, e.g.
    /// `vllm:num_requests_waiting` (the fast loop's `waiting` signal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// Language models: the gauge of KV-cache usage, 0–1, e.g. `vllm:gpu_cache_usage_perc`
    /// (the fast loop's `kv_cache` signal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<String>,
}

/// What one read of a replica's metrics found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProbeReading {
    pub in_flight: u32,
    /// Requests waiting in the engine, when the probe names that gauge.
    pub waiting: Option<u32>,
    /// KV-cache usage 0–1, when the probe names that gauge.
    pub kv_cache: Option<f64>,
}

impl InFlightProbe {
    /// A probe of requests in flight only.
    pub fn in_flight(path: &str, metric: &str) -> Self {
        InFlightProbe {
            port: None,
            path: path.into(),
            metric: metric.into(),
            waiting: None,
            kv_cache: None,
        }
    }

    /// The probe's value in a Prometheus text exposition, if the metric is there.
    pub fn read(&self, text: &str) -> Option<u32> {
        read_gauge(text, &self.metric).map(|v| v.max(0.0).round() as u32)
    }

    /// Every gauge the probe names; `None` when the in-flight gauge is absent.
    pub fn read_all(&self, text: &str) -> Option<ProbeReading> {
        Some(ProbeReading {
            in_flight: self.read(text)?,
            waiting: self
                .waiting
                .as_deref()
                .and_then(|m| read_gauge(text, m))
                .map(|v| v.max(0.0).round() as u32),
            kv_cache: self
                .kv_cache
                .as_deref()
                .and_then(|m| read_gauge(text, m))
                .map(|v| v.clamp(0.0, 1.0)),
        })
    }
}

/// The value of `metric` (summed over its label sets) in a Prometheus text exposition.
pub fn read_gauge(text: &str, metric: &str) -> Option<f64> {
    {
        let mut found = None;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(rest) = line.strip_prefix(metric) else {
                continue;
            };
            // The exact name: followed by labels or the value, not by more of a longer name.
            let rest = match rest.chars().next() {
                Some('{') => rest.split_once('}').map(|(_, v)| v)?,
                Some(' ') | Some('\t') => rest,
                _ => continue,
            };
            let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
            if !value.is_finite() {
                return None;
            }
            *found.get_or_insert(0.0) += value;
        }
        found
    }
}

/// A warm-up request: `POST path` with a JSON body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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

    /// The names of the extra ports (`{port:NAME}`) the runtime asks for.
    pub fn port_names(&self) -> Vec<String> {
        let r = &self.runtime;
        crate::registry::runtime_port_names(&r.command, &r.env, &r.files)
    }

    /// `text` with the agent's placeholders filled in.
    pub fn fill(&self, text: &str, ports: &Ports, workdir: &str) -> String {
        let mut out = text.to_string();
        for (name, port) in &ports.named {
            out = out.replace(&format!("{{port:{name}}}"), &port.to_string());
        }
        out.replace("{port}", &ports.http.to_string())
            .replace("{weights}", self.weights.as_deref().unwrap_or(""))
            .replace("{device}", &self.device)
            .replace("{model}", &self.model)
            .replace("{workdir}", workdir)
    }

    /// The command line with placeholders filled in.
    pub fn argv(&self, ports: &Ports, workdir: &str) -> Vec<String> {
        self.runtime
            .command
            .iter()
            .map(|a| self.fill(a, ports, workdir))
            .collect()
    }

    /// The stop signal's name (`SIGTERM` unless the runtime says otherwise).
    pub fn stop_signal(&self) -> &str {
        self.runtime.stop_signal.as_deref().unwrap_or("SIGTERM")
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
        for path in self.runtime.files.keys().chain(self.runtime.links.keys()) {
            crate::registry::validate_workdir_path(path).map_err(|e| format!("replica {}: {e}", self.id))?;
        }
        if !crate::registry::STOP_SIGNALS.contains(&self.stop_signal()) {
            return Err(format!(
                "replica {}: stop signal {:?}: use one of {}",
                self.id,
                self.stop_signal(),
                crate::registry::STOP_SIGNALS.join(", ")
            ));
        }
        if let Some(port) = self.runtime.in_flight.as_ref().and_then(|p| p.port.as_ref()) {
            if !self.port_names().contains(port) {
                return Err(format!(
                    "replica {}: the in-flight probe reads port {port:?}, which the runtime is not given ({{port:{port}}})",
                    self.id
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod in_flight_tests {
    use super::InFlightProbe;

    #[test]
    fn the_probe_reads_its_gauge_summed_over_label_sets_and_only_its_name() {
        let p = InFlightProbe::in_flight("/metrics", "vllm:num_requests_running");
        let text = "# HELP vllm:num_requests_running running\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model_name=\"a\"} 3.0\n\
                    vllm:num_requests_running{model_name=\"b\"} 2\n\
                    vllm:num_requests_running_total 99\n\
                    vllm:num_requests_waiting 7\n";
        assert_eq!(p.read(text), Some(5));
        let plain = InFlightProbe::in_flight("/metrics", "laneway_sim_in_flight");
        assert_eq!(plain.read("laneway_sim_in_flight 4\n"), Some(4));
        assert_eq!(plain.read("other 4\n"), None, "absent is not zero");
        assert_eq!(plain.read("laneway_sim_in_flight NaNx\n"), None);
    }
}
