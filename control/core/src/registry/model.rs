//! Models: per-GPU-product profiles, the runtime that serves them, weight artifacts, language
//! model settings, and the checks a model must pass.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;
use crate::refused::Refused;

/// How one model runs on one GPU product.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Service time of one batch.
    pub service_ms: Millis,
    /// Largest batch; also the replica's concurrency (the router never sends more at once).
    pub max_batch: u32,
    /// GPU memory one replica needs.
    #[serde(default)]
    pub gpu_memory_gb: u32,
    /// MIG profiles a replica fits in (e.g. `3g.40gb`); empty = whole cards only.
    #[serde(default)]
    pub mig_profiles: Vec<String>,
    /// Language models: decode throughput of one replica on this product, output tokens/s
    /// over all its sequences (the planner turns tokens/s of demand into cards with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<u32>,
}

/// A weight artifact, content-addressed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    pub uri: String,
    pub sha256: String,
    pub size_bytes: u64,
    /// Where the replica finds it, relative to its working directory (a link to the cached
    /// blob), e.g. `model.joblib` or `repository/resnet/1/model.onnx`; without it, `{weights}`
    /// (the first artifact's blob path) is the only way to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// How an agent starts a replica of the model (see the agent's replica spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Runtime {
    /// Program and arguments. The agent substitutes `{port}`, `{weights}`, `{device}` and
    /// `{model}`; the controller `{product}` (the GPU product placed on) and `{max_batch}` (the
    /// profile's for that product).
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default = "default_health")]
    pub health_path: String,
    /// Where replicas report requests in flight (`{ path = "/metrics", metric = "…" }`);
    /// agents read it with every heartbeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<crate::runtime_spec::InFlightProbe>,
    /// The server takes KServe v2 requests with binary tensors (Triton's binary tensor data
    /// extension: Triton, Laneway's simulator; not MLServer's REST API). Without it the router
    /// converts such a request to JSON, or refuses it with a 400 saying why when it cannot.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub binary_tensors: bool,
    /// The runtime preset (`runtime_presets.toml`) the entry's defaults came from: resolved
    /// into the fields above when the document is read, kept as a label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// Files written into the replica's working directory before it starts (relative path →
    /// contents, placeholders substituted), e.g. MLServer's `model-settings.json`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// A request sent once healthy, before the replica is reported Ready (its answer is the
    /// "warm" phase of the cold start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<crate::runtime_spec::Warmup>,
    /// How long start-up (process, health, warm-up) may take before the replica counts as
    /// crashed; default 60 s. Weight downloads are not in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timeout_s: Option<u32>,
    /// The signal that asks the server to stop gracefully (default SIGTERM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
    /// How long after the stop signal before SIGKILL (default: the agent's drain grace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_grace_s: Option<u32>,
}

/// Signals a runtime may be stopped with.
pub const STOP_SIGNALS: &[&str] = &["SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2"];

/// Default start-up budget, seconds.
pub const DEFAULT_START_TIMEOUT_S: u32 = 60;

impl Runtime {
    /// Whether the entry uses what command format 12 added (presets, files, start/stop data).
    pub fn uses_format_12(&self) -> bool {
        self.preset.is_some()
            || !self.files.is_empty()
            || self.warmup.is_some()
            || self.start_timeout_s.is_some()
            || self.stop_signal.is_some()
            || self.stop_grace_s.is_some()
            || self.in_flight.as_ref().is_some_and(|p| p.port.is_some())
    }

    /// The start-up budget.
    pub fn start_timeout_s(&self) -> u32 {
        self.start_timeout_s.unwrap_or(DEFAULT_START_TIMEOUT_S)
    }
}

/// Checks a path inside a replica's working directory: relative, no `..`, no empty parts.
pub fn validate_workdir_path(path: &str) -> Result<(), String> {
    let ok = !path.is_empty()
        && path.len() <= 255
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != ".." && !part.contains('\\'))
        && path.chars().all(|c| !c.is_control());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{path:?} must be a relative path inside the replica's working directory (no leading '/', no '..'), e.g. model-settings.json or repository/m/1/model.onnx"
        ))
    }
}

/// The names of the extra ports (`{port:NAME}`) a runtime's command, environment and files
/// ask for, each once, in order of first use.
pub fn runtime_port_names(
    command: &[String],
    env: &BTreeMap<String, String>,
    files: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for text in command.iter().chain(env.values()).chain(files.values()) {
        for n in named_ports(text) {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    names
}

/// The names of the extra ports (`{port:NAME}`) a text asks for.
pub fn named_ports(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("{port:") {
        rest = &rest[i + 6..];
        if let Some(end) = rest.find('}') {
            let name = &rest[..end];
            if !name.is_empty()
                && name.len() <= 32
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                && !out.iter().any(|n| n == name)
            {
                out.push(name.to_string());
            }
        }
    }
    out
}

fn default_health() -> String {
    "/v2/health/ready".into()
}

impl Default for Runtime {
    fn default() -> Self {
        Runtime {
            command: Vec::new(),
            env: BTreeMap::new(),
            health_path: default_health(),
            in_flight: None,
            binary_tensors: false,
            preset: None,
            files: BTreeMap::new(),
            warmup: None,
            start_timeout_s: None,
            stop_signal: None,
            stop_grace_s: None,
        }
    }
}

/// A model: which class it belongs to, and how it runs on each GPU product.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub class: String,
    #[serde(default = "default_version")]
    pub version: String,
    /// GPU product (normalised name, e.g. `L4`, `H100-80GB`) → profile.
    pub profiles: BTreeMap<String, Profile>,
    #[serde(default)]
    pub runtime: Runtime,
    #[serde(default)]
    pub weights: Vec<Artifact>,
    /// A language model: served on the OpenAI-compatible paths, admitted by tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<LlmSpec>,
    /// Set on a later version's entry (`name@version`, see [`rollout`]): the public model name
    /// it is a version of. Never given in a model file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serves: Option<String>,
    /// Another model (e.g. a smaller variant) that answers this one's requests while it has no
    /// healthy replica; the answer says so (`x-laneway-fallback`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// The tensors it takes (`[[inputs]]` name, datatype, shape), as `GET /v2/models/{m}`
    /// reports them to clients.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<crate::kserve::TensorSpec>,
    /// The tensors it answers (`[[outputs]]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<crate::kserve::TensorSpec>,
}

impl Model {
    /// Whether the entry uses what command format 11 added: tensor metadata, binary tensors.
    pub fn declares_v2_signature(&self) -> bool {
        !self.inputs.is_empty() || !self.outputs.is_empty() || self.runtime.binary_tensors
    }

    /// The name clients use (and the model server serves).
    pub fn public_name(&self) -> &str {
        self.serves.as_deref().unwrap_or(&self.name)
    }
}

/// What the router needs to know of a language model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSpec {
    /// Longest input + output, tokens: longer requests are refused before they queue.
    pub context_tokens: u32,
    /// Output tokens a request without `max_tokens` is counted for (set it to the server's
    /// own default).
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u32,
    /// Leading prompt tokens that route requests to the same replica (prefix affinity);
    /// 0 turns affinity off.
    #[serde(default = "default_prefix_tokens")]
    pub prefix_affinity_tokens: u32,
    /// What the model does: `generate` (chat and completions, the default) or `embed`
    /// (`/v1/embeddings` only). A request to the other kind's paths is refused with where to
    /// send it.
    #[serde(default, skip_serializing_if = "LlmTask::is_generate")]
    pub task: LlmTask,
}

/// What a language model serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlmTask {
    /// Chat and text completions (`/v1/chat/completions`, `/v1/completions`).
    #[default]
    Generate,
    /// Embeddings (`/v1/embeddings`): input tokens only, nothing generated.
    Embed,
}

impl LlmTask {
    pub fn is_generate(&self) -> bool {
        *self == LlmTask::Generate
    }
}

fn default_max_tokens() -> u32 {
    256
}

fn default_prefix_tokens() -> u32 {
    256
}

fn default_version() -> String {
    "1".into()
}

impl Model {
    fn validate_runtime(&self) -> Result<(), Refused> {
        let (n, r) = (&self.name, &self.runtime);
        for (path, contents) in &r.files {
            validate_workdir_path(path).map_err(|e| format!("model {n}: runtime.files: {e}"))?;
            if contents.len() > 64 * 1024 {
                return Err(format!(
                    "model {n}: runtime.files.{path:?} is {} bytes; files are for settings (64 KiB at most) — ship large files as weight artifacts with a path",
                    contents.len()
                )
                .into());
            }
        }
        if r.files.len() > 32 {
            return Err(format!("model {n}: runtime.files has {} files; 32 at most", r.files.len()).into());
        }
        if let Some(sig) = &r.stop_signal {
            if !STOP_SIGNALS.contains(&sig.as_str()) {
                return Err(format!(
                    "model {n}: runtime.stop_signal {sig:?}: use one of {}",
                    STOP_SIGNALS.join(", ")
                )
                .into());
            }
        }
        if r.start_timeout_s.is_some_and(|s| s == 0 || s > 24 * 3600) {
            return Err(format!("model {n}: runtime.start_timeout_s: give 1 to 86400 seconds").into());
        }
        if r.stop_grace_s.is_some_and(|s| s > 3600) {
            return Err(format!("model {n}: runtime.stop_grace_s: give 0 to 3600 seconds").into());
        }
        if let Some(w) = &r.warmup {
            if !w.path.starts_with('/') {
                return Err(format!("model {n}: runtime.warmup.path {:?} must start with '/'", w.path).into());
            }
        }
        let ports = runtime_port_names(&r.command, &r.env, &r.files);
        if let Some(port) = r.in_flight.as_ref().and_then(|p| p.port.as_ref()) {
            if !ports.contains(port) {
                return Err(format!(
                    "model {n}: runtime.in_flight.port {port:?} is not a port the runtime is given; use {{port:{port}}} in its command or env, or leave port out to read the HTTP port"
                )
                .into());
            }
        }
        if ports.len() > 8 {
            return Err(format!("model {n}: runtime asks for {} named ports; 8 at most", ports.len()).into());
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), Refused> {
        validate_name("model", &self.name)?;
        validate_name("class", &self.class)?;
        let n = &self.name;
        if self.profiles.is_empty() {
            return Err(format!(
                "model {n}: no profiles; give at least one [profiles.<GPU product>] with service_ms and max_batch"
            )
            .into());
        }
        for (product, p) in &self.profiles {
            if product.is_empty() || product.len() > 64 {
                return Err(
                    format!("model {n}: profile for {product:?}: name a GPU product such as L4 or H100-80GB").into(),
                );
            }
            if p.service_ms.0 == 0 {
                return Err(format!("model {n}: profiles.{product}.service_ms must be > 0").into());
            }
            if p.max_batch == 0 || p.max_batch > 4096 {
                return Err(format!("model {n}: profiles.{product}.max_batch = {}: give 1-4096", p.max_batch).into());
            }
        }
        for a in &self.weights {
            if a.sha256.len() != 64 || !a.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(format!("model {n}: weights {:?}: sha256 must be 64 hex characters", a.uri).into());
            }
            if a.uri.is_empty() {
                return Err(format!("model {n}: a weight artifact has an empty uri").into());
            }
            if let Some(p) = &a.path {
                validate_workdir_path(p).map_err(|e| format!("model {n}: weights {:?}: path {e}", a.uri))?;
            }
        }
        self.validate_runtime()?;
        if !self.runtime.health_path.starts_with('/') {
            return Err(format!(
                "model {n}: runtime.health_path {:?} must be an HTTP path starting with '/', e.g. /v2/health/ready",
                self.runtime.health_path
            )
            .into());
        }
        crate::kserve::validate_signature(&self.inputs, &self.outputs).map_err(|e| format!("model {n}: {e}"))?;
        if self.version.is_empty() || self.version.len() > 64 {
            return Err(format!("model {n}: version must be 1-64 characters").into());
        }
        if let Some(l) = &self.llm {
            if l.context_tokens == 0 {
                return Err(format!("model {n}: llm.context_tokens must be > 0 (the model's context window)").into());
            }
            if l.default_max_tokens == 0 || l.default_max_tokens > l.context_tokens {
                return Err(format!(
                    "model {n}: llm.default_max_tokens = {}: give 1 to context_tokens ({})",
                    l.default_max_tokens, l.context_tokens
                )
                .into());
            }
        }
        Ok(())
    }
}
