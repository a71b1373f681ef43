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
    /// extension: Triton, MLServer, Laneway's simulator). Without it the router refuses such a
    /// request with a 400 instead of sending the server bytes it cannot read.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub binary_tensors: bool,
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
        }
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
