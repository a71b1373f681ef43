//! The replicated registry: classes (each names its lane), models, tenants, and the replicas the
//! agents report as routable. Everything here is applied through Raft, so every controller's
//! router sees the same registry; a model registered under an existing class is servable as soon
//! as the entry is applied, with no router change or restart.
//!
//! Units are integers in the replicated state (the state is compared and hashed byte for byte):
//! times in microseconds behind [`Millis`], which reads and writes as fractional milliseconds.

pub mod rollout;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use rollout::{Rollout, RolloutAction, RolloutState};

/// Longest class, model or tenant name.
pub const MAX_NAME: usize = 63;
/// Most models, classes or tenants of each kind.
pub const MAX_ENTRIES: usize = 10_000;

/// A duration in milliseconds with microsecond precision, stored as an integer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(pub u64);

impl Millis {
    pub fn from_ms(ms: f64) -> Self {
        Millis((ms * 1000.0).round().max(0.0) as u64)
    }
    pub fn as_ms(self) -> f64 {
        self.0 as f64 / 1000.0
    }
    pub fn as_duration(self) -> std::time::Duration {
        std::time::Duration::from_micros(self.0)
    }
}

impl Serialize for Millis {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.as_ms())
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let ms = f64::deserialize(d)?;
        if !ms.is_finite() || ms < 0.0 {
            return Err(serde::de::Error::custom(format!(
                "{ms} is not a duration; give milliseconds >= 0"
            )));
        }
        Ok(Millis::from_ms(ms))
    }
}

/// How a lane admits and queues requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LaneKind {
    /// No queue: a free replica slot now, or 503 with Retry-After.
    Sync,
    /// A short per-lane queue bounded by a latency budget.
    Bounded,
    /// A replicated job queue (issue #5); the router answers 202 with a job id.
    Durable,
}

impl LaneKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LaneKind::Sync => "sync",
            LaneKind::Bounded => "bounded",
            LaneKind::Durable => "durable",
        }
    }
}

impl std::fmt::Display for LaneKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// What a bounded lane switches to when the overload policy degrades it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Degraded {
    /// Queue latency budget while degraded (longer than the normal one).
    pub budget_ms: Millis,
    /// Request parameters merged into every request while degraded, e.g. `resolution = "512"`.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

/// A class and its lane: how every model of the class is admitted, queued and scaled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    pub name: String,
    pub lane: LaneKind,
    /// Utilisation the scaler aims for, percent; `100 - target` is the lane's headroom.
    #[serde(default = "default_target")]
    pub utilisation_target_pct: u32,
    /// Queue latency budget (bounded, durable): admit only if the expected wait fits.
    #[serde(default)]
    pub budget_ms: Millis,
    /// Replicas kept warm whatever the traffic.
    #[serde(default)]
    pub warm_floor: u32,
    /// Overload protection rank: 0 is protected first; higher ranks degrade, then shed, first.
    #[serde(default)]
    pub protection_rank: u32,
    /// Longest a request of this lane may take end to end (queue + service).
    #[serde(default = "default_timeout")]
    pub request_timeout_ms: Millis,
    /// What the lane switches to under overload (bounded lanes).
    #[serde(default)]
    pub degraded: Option<Degraded>,
    /// Latency objective: p99 of end-to-end time (queue + service) of answered requests.
    /// Exported as `laneway_lane_slo_p99_seconds`; the alert rules in deploy/prometheus page
    /// on it. Durable lanes have none (their jobs are measured in GPU-seconds, not latency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_p99_ms: Option<Millis>,
    /// Pool taints this lane's replicas accept (`lanectl pool taint`): a pool with a taint the
    /// lane does not tolerate gets none of its replicas.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<String>,
    /// Language-model lane policy: token latency objectives and the scaling signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<LlmPolicy>,
    /// Whether this lane's replicas may time-slice a whole (non-MIG) card with other replicas,
    /// packed by GPU memory. Off (the default), each replica has its card to itself, as a
    /// Kubernetes GPU request does; MIG slices are hardware partitions and need no sharing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub time_slicing: bool,
    /// Answers kept and served again for the same input (sync and bounded lanes; opt-in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheSpec>,
    /// What the lane answers for a model with no healthy replica (and no fallback model that
    /// has one), instead of 503: e.g. an empty recommendation list. Marked
    /// `x-laneway-degraded: fallback-response`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_response: Option<FallbackResponse>,
    /// An external endpoint (a hosted API) that takes the requests above the lane's own
    /// capacity instead of refusing them (ADR 0017).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow: Option<OverflowSpec>,
    /// Sync lanes: a second copy of a request that has no answer after a while, to another
    /// replica, within a budget (ADR 0014).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hedge: Option<HedgeSpec>,
    /// Durable lanes: where a tenant's job may name its input (`input_uri`), as URL prefixes
    /// the operator allows (`s3://bucket/inputs/`, or a shared mount `file:///srv/inputs/`).
    /// None (the default): jobs carry their input inline. The agents fetch with their own
    /// credentials, so a tenant must never choose the location freely (ADR 0019).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub input_prefixes: Vec<String>,
}

/// Most input prefixes a class allows.
pub const MAX_INPUT_PREFIXES: usize = 16;
/// URL schemes an input may be fetched from (object stores, http(s), a shared mount).
pub const INPUT_SCHEMES: [&str; 6] = ["s3", "gs", "az", "https", "http", "file"];

/// Why `uri` is not a plain location (a query, a user, a `..` or an encoded separator that
/// could walk out of a prefix), or the URL.
fn plain_location(uri: &str) -> Result<url::Url, String> {
    let u = url::Url::parse(uri).map_err(|e| format!("{:?} is not a URL ({e})", crate::text::clip(uri, 128)))?;
    if !INPUT_SCHEMES.contains(&u.scheme()) {
        return Err(format!("{}: is not one of {}", u.scheme(), INPUT_SCHEMES.join(", ")));
    }
    if u.query().is_some() || u.fragment().is_some() || !u.username().is_empty() || u.password().is_some() {
        return Err(format!(
            "{:?} has a query, fragment or user name",
            crate::text::clip(uri, 128)
        ));
    }
    let raw = uri.to_ascii_lowercase();
    // `url` folds `..` away when it parses, so the text is checked as given.
    let after_scheme = raw.split_once("://").map_or(raw.as_str(), |(_, r)| r);
    if after_scheme.split('/').any(|seg| seg == ".." || seg == ".")
        || ["%2e", "%2f", "%5c", "\\", "//"]
            .iter()
            .any(|bad| after_scheme.contains(bad))
    {
        return Err(format!(
            "{:?} has a '.' or '..' segment, an empty segment or an encoded separator",
            crate::text::clip(uri, 128)
        ));
    }
    Ok(u)
}

/// A sync lane's hedged requests: a request with no answer after `after_ms` is also sent to
/// another replica with a free slot; the first good answer wins. At most `percent` of the
/// lane's requests (plus a small burst) are hedged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HedgeSpec {
    /// How long the first replica has before the copy goes out: about the model's p95.
    pub after_ms: Millis,
    /// Hedges as a percent of the lane's requests, 1-50.
    pub percent: u8,
}

/// A lane's overflow endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverflowSpec {
    /// Base URL, `http://host:port[/prefix]`: requests go to `<url>/v2/models/<model>/infer`.
    pub url: String,
    /// Requests in flight to it at once, per router; above it the lane refuses as without.
    pub max_in_flight: u32,
    /// What it charges per request, micro-dollars (the ledger meters it as the request's cost).
    pub micros_per_request: u64,
    /// CA certificates (PEM) to trust for an https endpoint besides the system's: a private
    /// endpoint's own CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    /// The environment variable, on every controller, that holds the endpoint's API key (sent
    /// as `Authorization: Bearer`). The key itself is never in the cluster's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
}

/// A class's canned answer for when a model cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackResponse {
    /// HTTP status, 200-299 (an error needs no configuration).
    #[serde(default = "default_fallback_status")]
    pub status: u16,
    /// The body, JSON.
    pub body: String,
}

fn default_fallback_status() -> u16 {
    200
}

/// A class's result cache (ADR 0016): the key is the model version and the input as JSON in
/// canonical form, plus the tenant unless `shared`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSpec {
    /// How long an answer is served again, seconds.
    pub ttl_s: u64,
    /// Bytes of answers kept on each router, MiB (least recently used go first).
    pub max_mib: u64,
    /// One tenant's answer may be served to another (the inputs carry nothing private).
    #[serde(default)]
    pub shared: bool,
}

/// What a lane of language models scales on. GPU utilisation is never a signal: a decoding GPU
/// is busy whether it serves one sequence or sixty.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleSignal {
    /// Requests in flight and queued against the replicas' slots at the utilisation target
    /// (every lane's default).
    #[default]
    InFlight,
    /// Requests waiting: in the router's queue and in the engines' own queues
    /// (`vllm:num_requests_waiting`); any waiting adds replicas.
    Waiting,
    /// KV-cache usage the replicas report, against `kv_cache_target_pct`.
    KvCache,
    /// Time to first token p99 measured by the routers, against `ttft_slo_p99_ms`.
    Ttft,
}

impl ScaleSignal {
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleSignal::InFlight => "in_flight",
            ScaleSignal::Waiting => "waiting",
            ScaleSignal::KvCache => "kv_cache",
            ScaleSignal::Ttft => "ttft",
        }
    }
}

/// A language-model lane's policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmPolicy {
    /// Objective on time to first token, p99 (queue + prefill + first decode step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_slo_p99_ms: Option<Millis>,
    /// Objective on inter-token latency, p99 (gap between streamed chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_slo_p99_ms: Option<Millis>,
    /// The fast loop's signal for this lane.
    #[serde(default)]
    pub scale_on: ScaleSignal,
    /// KV-cache usage the `kv_cache` signal aims for, percent.
    #[serde(default = "default_kv_target")]
    pub kv_cache_target_pct: u32,
}

fn default_kv_target() -> u32 {
    75
}

fn default_target() -> u32 {
    70
}

fn default_timeout() -> Millis {
    Millis::from_ms(30_000.0)
}

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
}

impl Model {
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

/// Limits of one tenant on one lane (class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimit {
    /// Requests in flight (queued or running) at once on one router.
    pub concurrency: u32,
    /// Sustained requests per second (token bucket refill).
    pub rate_per_s: u32,
    /// Bucket size: requests that may arrive at once above the rate.
    pub burst: u32,
    /// Language-model lanes: input + output tokens per minute (a bucket a minute deep).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_min: Option<u32>,
}

/// A tenant: its API key (only the sha256 is stored) and its limits per class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    /// sha256 (hex) of the API key.
    pub key_sha256: String,
    /// Class name (or `*` for every class without its own entry) → limit. No entry: no limit.
    #[serde(default)]
    pub limits: BTreeMap<String, TenantLimit>,
}

impl Tenant {
    /// The limit that applies to `class`, if any.
    pub fn limit_for(&self, class: &str) -> Option<TenantLimit> {
        self.limits.get(class).or_else(|| self.limits.get("*")).copied()
    }
}

/// A replica as the leader last committed it from its agent's heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub id: String,
    pub model: String,
    /// GPU UUID (or MIG device UUID) it runs on.
    pub device: String,
    /// `starting`, `ready`, `draining`, `stopped`, `backoff`, `crash_loop`.
    pub state: String,
    /// `host:port` the router dials.
    pub endpoint: String,
}

/// Most replicas one node reports.
pub const MAX_REPLICAS_PER_NODE: usize = 128;

/// Checks what an agent reports of its replicas before it is proposed: a bounded set of
/// short, plain names (a compromised agent must not write megabytes per heartbeat).
pub fn validate_replica_report(replicas: &[ReplicaRecord]) -> Result<(), String> {
    if replicas.len() > MAX_REPLICAS_PER_NODE {
        return Err(format!(
            "{} replicas reported: a node runs {MAX_REPLICAS_PER_NODE} at most",
            replicas.len()
        ));
    }
    for r in replicas {
        for (what, v, max) in [
            ("id", &r.id, 128),
            ("model", &r.model, 160),
            ("device", &r.device, 128),
            ("state", &r.state, 32),
            ("endpoint", &r.endpoint, 300),
        ] {
            if v.len() > max || v.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(format!(
                    "replica {what} {:?}: {max} bytes at most, no spaces or control characters",
                    crate::text::clip(v, 64)
                ));
            }
        }
    }
    Ok(())
}

/// A replica the scheduler placed: intent, committed before any agent acts on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredReplica {
    pub id: String,
    pub model: String,
    /// GPU UUID it is pinned to.
    pub gpu: String,
    /// GPU product of that GPU (picks the model's profile).
    pub product: String,
}

/// The registry part of the replicated state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    pub classes: BTreeMap<String, Class>,
    pub models: BTreeMap<String, Model>,
    pub tenants: BTreeMap<String, Tenant>,
    /// Node id → its replicas as observed (from heartbeats).
    pub replicas: BTreeMap<String, Vec<ReplicaRecord>>,
    /// Node id → the replicas placed there (intent).
    #[serde(default)]
    pub desired: BTreeMap<String, Vec<DesiredReplica>>,
    /// Pool → its taints: only lanes that tolerate all of them place replicas there.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pool_taints: BTreeMap<String, Vec<String>>,
    /// Node id → GPU UUID → its MIG layout (mig-parted profile names; empty = the whole card,
    /// MIG off). A GPU without an entry is left as it is.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mig: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    /// Nodes the slow loop asked for, by request id (= the node id), until given back.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_requests: BTreeMap<String, crate::capacity::NodeRequest>,
    /// `product@region` → a recent capacity failure there (launches wait until it expires).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity_marks: BTreeMap<String, crate::capacity::CapacityMark>,
    /// The latest MIG capacity plan (`lanectl mig plan`), applied or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_plan: Option<crate::capacity::MigPlan>,
    /// Join tokens by the sha256 (hex) of the token (the token itself is never stored); their
    /// id is its first 12 characters. Kept after use, as a record of who joined with what.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub join_tokens: BTreeMap<String, JoinToken>,
    /// Node ids that joined with a token, and when (ms): they can never join again.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub joined: BTreeMap<String, u64>,
    /// Bearer tokens of the admin API, by the sha256 (hex) of the token.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub admin_tokens: BTreeMap<String, AdminToken>,
    /// Certificates refused from now on, by serial (hex).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub revoked_certs: BTreeMap<String, RevokedCert>,
    /// Public model name → the entry serving it, once a rollout promoted a later version
    /// (absent: the entry of the same name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub serving: BTreeMap<String, String>,
    /// Public model name → its latest rollout (kept when it ends, for `lanectl rollout status`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rollouts: BTreeMap<String, Rollout>,
}

/// A bearer token of the admin API with a role (ADR 0013).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminToken {
    /// Who holds it; calls made with it are audited as `role:name`.
    pub name: String,
    /// viewer, operator or admin.
    pub role: String,
    pub created_ms: u64,
    pub expires_ms: u64,
    #[serde(default)]
    pub revoked: bool,
}

/// A revoked certificate (keyed by its serial), or every certificate of an identity issued
/// until `at_ms` (keyed by the identity).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedCert {
    /// `kind:name`: every certificate of it valid from `at_ms` or earlier is refused too.
    pub identity: String,
    pub at_ms: u64,
}

/// The key a revocation is kept under: the serial, or for a revocation of an identity's every
/// certificate the identity (`agent:gpu-1`, never hex, so never a serial).
pub fn revocation_key(serial: &str, identity: &str) -> String {
    if serial.is_empty() {
        identity.to_string()
    } else {
        serial.to_ascii_lowercase()
    }
}

/// How long a join token's id is: a prefix of its sha256, enough to tell tokens apart.
pub const JOIN_TOKEN_ID_CHARS: usize = 12;

/// The short id of a token (by its sha256) in messages. Never slices mid-character: this runs
/// in apply, where a panic on odd input would stop every replica at the same log index.
pub fn token_id(sha256: &str) -> &str {
    sha256.get(..JOIN_TOKEN_ID_CHARS).unwrap_or(sha256)
}

/// A one-time token for a new host to join with (ADR 0013).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinToken {
    pub created_ms: u64,
    pub expires_ms: u64,
    /// Only this node id may join with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The node that joined with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_by: Option<String>,
    /// The sha256 of the public key it was first used for, and when: a retry (the first
    /// answer lost) must be for the same key, within [`JOIN_RETRY_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_ms: Option<u64>,
    #[serde(default)]
    pub revoked: bool,
}

/// How long after its first use a join token may be used again, by the same node with the
/// same key (the host's first answer was lost).
pub const JOIN_RETRY_MS: u64 = 10 * 60_000;

/// What an overflow endpoint's key variable must start with: a class document (which an
/// operator writes) may name only variables set on the controllers for that purpose, never
/// another secret of their environment (`AWS_SECRET_ACCESS_KEY`).
pub const OVERFLOW_TOKEN_ENV_PREFIX: &str = "LANEWAY_OVERFLOW_";

/// Checks the name of an overflow endpoint's key variable (on write, and again before it is read).
pub fn check_overflow_token_env(var: &str) -> Result<(), String> {
    let ok = !var.is_empty()
        && var.len() <= 128
        && var
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        return Err(format!(
            "token_env {:?}: give the name of an environment variable (A-Z, 0-9, _, e.g. {OVERFLOW_TOKEN_ENV_PREFIX}HOSTED_API), not the key itself",
            crate::text::clip(var, 64)
        ));
    }
    if !var.starts_with(OVERFLOW_TOKEN_ENV_PREFIX) {
        return Err(format!(
            "token_env {var:?}: the variable's name must start with {OVERFLOW_TOKEN_ENV_PREFIX} (e.g. {OVERFLOW_TOKEN_ENV_PREFIX}HOSTED_API), so that no other secret of the controllers' environment can be sent out"
        ));
    }
    Ok(())
}

/// Ready replicas of the registry entry `entry` among `replicas` (every node's).
pub fn ready_replicas(replicas: &BTreeMap<String, Vec<ReplicaRecord>>, entry: &str) -> usize {
    replicas
        .values()
        .flatten()
        .filter(|r| r.model == entry && r.state == "ready")
        .count()
}

impl Registry {
    /// The entry of version `version` of the model clients call `name`.
    pub fn version_entry(&self, name: &str, version: &str) -> Option<&Model> {
        self.models
            .values()
            .find(|m| m.public_name() == name && m.version == version)
    }

    /// The role and name an admin token (by its sha256) stands for at `now_ms`, or why it is
    /// refused.
    pub fn admin_token(&self, sha256: &str, now_ms: u64) -> Result<(&str, &str), String> {
        let id = token_id(sha256);
        let t = self
            .admin_tokens
            .get(sha256)
            .ok_or("the bearer token is not known to this cluster; make one with `lanectl token create --role`")?;
        if t.revoked {
            return Err(format!("admin token {id} ({}) was revoked", t.name));
        }
        if now_ms >= t.expires_ms {
            return Err(format!("admin token {id} ({}) has expired; make a new one", t.name));
        }
        Ok((&t.role, &t.name))
    }

    /// Whether a certificate (its serial, its identity `kind:name`, valid from `from_ms`) is
    /// revoked: by serial, or as a certificate of that identity issued before a revocation of
    /// the identity or of any of its certificates (a renewal made with a stolen key included).
    pub fn cert_revoked(&self, serial: &str, identity: &str, from_ms: u64) -> bool {
        self.revoked_certs.contains_key(serial)
            || self
                .revoked_certs
                .values()
                .any(|c| c.identity == identity && from_ms <= c.at_ms)
    }

    /// Marks the join or admin token with this sha256 revoked.
    pub fn revoke_token(&mut self, sha256: &str) -> Result<(), String> {
        if let Some(t) = self.join_tokens.get_mut(sha256) {
            t.revoked = true;
        } else if let Some(t) = self.admin_tokens.get_mut(sha256) {
            t.revoked = true;
        } else {
            return Err("no such token; `lanectl token list` shows them".into());
        }
        Ok(())
    }

    /// Whether a host may join as `node_id` with the token hashing to `sha256` at `at_ms`
    /// (`registered`: the node id is in the fleet already), without changing anything.
    ///
    /// A token works for one node id, once: the same node may ask again with it for the same
    /// key within [`JOIN_RETRY_MS`] (its first answer may have been lost); nobody else, and
    /// no other key, ever may. A node id already in the cluster
    /// (joined before, or registered with a certificate from `lanectl certs issue`) is never
    /// taken by a new host; only a token an admin bound to that id (`--node`) gives it a new
    /// certificate, for the same host after it lost its key.
    pub fn check_join_token(
        &self,
        sha256: &str,
        node_id: &str,
        key_sha256: &str,
        at_ms: u64,
        registered: bool,
    ) -> Result<(), String> {
        let id = token_id(sha256);
        let Some(t) = self.join_tokens.get(sha256) else {
            return Err("the join token is not known to this cluster; create one with `lanectl token create`".into());
        };
        if t.revoked {
            return Err(format!(
                "join token {id} was revoked; create a new one with `lanectl token create`"
            ));
        }
        if at_ms >= t.expires_ms {
            return Err(format!(
                "join token {id} has expired; create a new one with `lanectl token create --ttl 1h`"
            ));
        }
        match &t.used_by {
            Some(by) if by == node_id => {
                let same_key = t.used_key.as_deref().is_some_and(|k| !k.is_empty() && k == key_sha256);
                let soon = t.used_ms.is_some_and(|u| at_ms < u.saturating_add(JOIN_RETRY_MS));
                if same_key && soon {
                    return Ok(());
                }
                return Err(format!(
                    "join token {id} was already used by node {by}; only the same key may use it again, within {} minutes of the join: create a new one (`lanectl token create --node {by}`)",
                    JOIN_RETRY_MS / 60_000
                ));
            }
            Some(by) => {
                return Err(format!(
                    "join token {id} was already used (by node {by}): a token lets one node in; create a new one"
                ))
            }
            None => {}
        }
        match &t.node_id {
            Some(only) if only != node_id => Err(format!("join token {id} is for node {only}, not {node_id}")),
            Some(_) => Ok(()),
            None if registered || self.joined.contains_key(node_id) => Err(format!(
                "node id {node_id} is already in this cluster and node ids are never reused: give this host a new node id (to re-key the same host, an admin makes a token bound to it: `lanectl token create --node {node_id}`)"
            )),
            None => Ok(()),
        }
    }

    /// Spends the token on `node_id` (see [`Registry::check_join_token`]).
    pub fn consume_join_token(
        &mut self,
        sha256: &str,
        node_id: &str,
        key_sha256: &str,
        at_ms: u64,
        registered: bool,
    ) -> Result<(), String> {
        self.check_join_token(sha256, node_id, key_sha256, at_ms, registered)?;
        if let Some(t) = self.join_tokens.get_mut(sha256).filter(|t| t.used_by.is_none()) {
            t.used_by = Some(node_id.to_string());
            t.used_key = Some(key_sha256.to_string());
            t.used_ms = Some(at_ms);
        }
        self.joined.insert(node_id.to_string(), at_ms);
        Ok(())
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Registry {
    /// Deploys version `version` of the registered `model` (same specification) and starts a
    /// shadow rollout of it copying every request.
    pub fn start_shadow_for_test(&mut self, model: &str, version: &str) {
        let next = Model {
            version: version.into(),
            ..self.models[model].clone()
        };
        self.deploy_version(&next).unwrap();
        let r = rollout::RolloutRequest {
            model: model.into(),
            version: version.into(),
            strategy: rollout::Strategy::Shadow,
            steps: vec![100],
            bake_s: 60,
            guards: Default::default(),
        }
        .rollout(self, 0, "admin:test")
        .unwrap();
        self.start_rollout(&r).unwrap();
    }
}

#[cfg(any(test, feature = "test-util"))]
impl OverflowSpec {
    /// A plain-http endpoint for tests: no CA, no key.
    pub fn for_test(url: &str, max_in_flight: u32, micros_per_request: u64) -> OverflowSpec {
        OverflowSpec {
            url: url.into(),
            max_in_flight,
            micros_per_request,
            ca_pem: None,
            token_env: None,
        }
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Class {
    /// A lane for tests: 60% target, no queue budget, no floor, rank 0, a 1 s timeout, a card
    /// per replica.
    pub fn for_test(name: &str, lane: LaneKind) -> Class {
        Class {
            overflow: None,
            hedge: None,
            input_prefixes: vec![],
            fallback_response: None,
            cache: None,
            name: name.into(),
            lane,
            utilisation_target_pct: 60,
            budget_ms: Millis(0),
            warm_floor: 0,
            protection_rank: 0,
            request_timeout_ms: Millis::from_ms(1000.0),
            degraded: None,
            slo_p99_ms: None,
            tolerations: vec![],
            time_slicing: false,
            llm: None,
        }
    }
}

/// Checks a taint (or toleration): 1-63 characters of a-z, 0-9, '.', '/', '-', '_'.
pub fn validate_taint(t: &str) -> Result<(), String> {
    let ok = !t.is_empty()
        && t.len() <= 63
        && t.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '/' | '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "taint {t:?}: use 1-63 characters of a-z, 0-9, '.', '/', '-' and '_', e.g. dedicated or team/research"
        ))
    }
}

/// Checks a class, model or tenant name.
pub fn validate_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} name {name:?}: use 1-{MAX_NAME} characters of a-z, 0-9, '-', '_' and '.', starting with a letter or digit"
        ))
    }
}

impl Class {
    /// Whether a tenant's job of this class may name `uri` as its input: a plain location
    /// under one of the operator's [`Class::input_prefixes`]. Never a bare path, never
    /// `file://` outside a prefix, never a walk out of one.
    pub fn check_input_uri(&self, uri: &str) -> Result<(), String> {
        let n = &self.name;
        if self.input_prefixes.is_empty() {
            return Err(format!(
                "class {n} takes inputs inline only: send {{\"model\": …, \"input\": {{…}}}}; an operator allows locations for input_uri with `lanectl lane set {n} --input-prefix s3://bucket/inputs/`"
            ));
        }
        plain_location(uri).map_err(|e| format!("input_uri: {e}"))?;
        if self.input_prefixes.iter().any(|p| uri.starts_with(p.as_str())) {
            Ok(())
        } else {
            Err(format!(
                "input_uri {:?} is not under a location class {n} allows ({}); upload the input there",
                crate::text::clip(uri, 128),
                self.input_prefixes.join(", ")
            ))
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        validate_name("class", &self.name)?;
        let n = &self.name;
        if !self.input_prefixes.is_empty() && self.lane != LaneKind::Durable {
            return Err(format!(
                "class {n}: input_prefixes are for durable lanes (their jobs may name an input_uri)"
            ));
        }
        if self.input_prefixes.len() > MAX_INPUT_PREFIXES {
            return Err(format!("class {n}: {MAX_INPUT_PREFIXES} input_prefixes at most"));
        }
        for p in &self.input_prefixes {
            let u = plain_location(p).map_err(|e| format!("class {n}: input prefix {e}"))?;
            if !p.ends_with('/') || u.path().trim_matches('/').is_empty() && u.scheme() == "file" {
                return Err(format!(
                    "class {n}: input prefix {p:?}: end it with '/' and name a directory (file:///srv/inputs/, s3://bucket/inputs/), never a whole host's files"
                ));
            }
        }
        if let Some(o) = &self.overflow {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: a durable lane queues its excess as jobs; overflow is for sync and bounded lanes"
                ));
            }
            let url = o.url.trim_end_matches('/');
            let https = url.starts_with("https://");
            if let Ok(parsed) = url::Url::parse(url) {
                if parsed.query().is_some()
                    || parsed.fragment().is_some()
                    || !parsed.username().is_empty()
                    || parsed.password().is_some()
                {
                    return Err(format!(
                        "class {n}: overflow url {url:?}: no query, fragment or user name; give scheme://host[:port][/prefix] and the key in token_env"
                    ));
                }
            }
            if !(https || url.starts_with("http://"))
                || format!("{url}/v2/models/m/infer").parse::<http::Uri>().is_err()
            {
                return Err(format!(
                    "class {n}: overflow url {url:?}: give http://host:port[/prefix] or https://host[:port][/prefix]"
                ));
            }
            if let Some(pem) = &o.ca_pem {
                if !https {
                    return Err(format!(
                        "class {n}: overflow ca_pem is for an https endpoint; {url:?} is plain http"
                    ));
                }
                check_ca_pem(pem).map_err(|e| format!("class {n}: overflow {e}"))?;
            }
            if let Some(var) = &o.token_env {
                check_overflow_token_env(var).map_err(|e| format!("class {n}: overflow {e}"))?;
                if !https {
                    return Err(format!(
                        "class {n}: overflow token_env: {url:?} is plain http and would carry the key in the clear; use https"
                    ));
                }
            }
            if o.max_in_flight == 0 || o.max_in_flight > 10_000 {
                return Err(format!(
                    "class {n}: overflow max_in_flight = {}: give 1-10000",
                    o.max_in_flight
                ));
            }
        }
        if let Some(h) = &self.hedge {
            if self.lane != LaneKind::Sync {
                return Err(format!(
                    "class {n}: hedged requests are for sync lanes (a bounded lane queues, a durable one retries jobs)"
                ));
            }
            if h.after_ms.as_ms() <= 0.0 || h.after_ms.as_ms() >= self.request_timeout_ms.as_ms() {
                return Err(format!(
                    "class {n}: hedge after {} ms: give more than 0 and less than the lane's timeout ({} ms), about the model's p95",
                    h.after_ms.as_ms(),
                    self.request_timeout_ms.as_ms()
                ));
            }
            if !(1..=50).contains(&h.percent) {
                return Err(format!(
                    "class {n}: hedge percent {}: give 1-50 (each hedge is a second GPU run of a request)",
                    h.percent
                ));
            }
        }
        if let Some(f) = &self.fallback_response {
            if self.lane == LaneKind::Durable || !(200..300).contains(&f.status) {
                return Err(format!(
                    "class {n}: fallback_response is for sync and bounded lanes, with a 2xx status (got {})",
                    f.status
                ));
            }
            if f.body.len() > 64 * 1024 || serde_json::from_str::<serde_json::Value>(&f.body).is_err() {
                return Err(format!(
                    "class {n}: fallback_response.body must be a JSON document of at most 64 KiB"
                ));
            }
        }
        if let Some(c) = &self.cache {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: a durable lane's results are stored per job, not cached; remove cache"
                ));
            }
            if !(1..=7 * 86_400).contains(&c.ttl_s) || !(1..=65_536).contains(&c.max_mib) {
                return Err(format!(
                    "class {n}: cache ttl_s = {} and max_mib = {}: give 1 s to 7 days and 1 MiB to 64 GiB",
                    c.ttl_s, c.max_mib
                ));
            }
        }
        if !(1..=100).contains(&self.utilisation_target_pct) {
            return Err(format!(
                "class {n}: utilisation_target_pct = {}: give 1-100 (sync lanes keep headroom, e.g. 60)",
                self.utilisation_target_pct
            ));
        }
        match self.lane {
            LaneKind::Sync if self.budget_ms.0 > 0 => {
                return Err(format!(
                    "class {n}: a sync lane has no queue, so budget_ms must be 0 (got {}); use lane = \"bounded\" for a queue",
                    self.budget_ms.as_ms()
                ))
            }
            LaneKind::Bounded | LaneKind::Durable if self.budget_ms.0 == 0 => {
                return Err(format!(
                    "class {n}: a {} lane needs budget_ms > 0 (the longest a request may wait in its queue)",
                    self.lane
                ))
            }
            _ => {}
        }
        if self.request_timeout_ms.0 == 0 {
            return Err(format!("class {n}: request_timeout_ms must be > 0"));
        }
        self.tolerations.iter().try_for_each(|t| validate_taint(t))?;
        if let Some(slo) = self.slo_p99_ms {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: a durable lane has no latency objective (jobs are not waited on); remove slo_p99_ms"
                ));
            }
            if slo.0 == 0 || slo > self.request_timeout_ms {
                return Err(format!(
                    "class {n}: slo_p99_ms = {}: give more than 0 and at most request_timeout_ms ({})",
                    slo.as_ms(),
                    self.request_timeout_ms.as_ms()
                ));
            }
        }
        if let Some(l) = &self.llm {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: durable lanes take jobs, not streams; token objectives and signals are for sync and bounded lanes"
                ));
            }
            for (what, slo) in [
                ("ttft_slo_p99_ms", l.ttft_slo_p99_ms),
                ("itl_slo_p99_ms", l.itl_slo_p99_ms),
            ] {
                if slo.is_some_and(|s| s.0 == 0 || s > self.request_timeout_ms) {
                    return Err(format!(
                        "class {n}: {what} must be more than 0 and at most request_timeout_ms ({})",
                        self.request_timeout_ms.as_ms()
                    ));
                }
            }
            if l.scale_on == ScaleSignal::Ttft && l.ttft_slo_p99_ms.is_none() {
                return Err(format!(
                    "class {n}: scale_on = \"ttft\" needs ttft_slo_p99_ms (the objective it scales against)"
                ));
            }
            if !(1..=100).contains(&l.kv_cache_target_pct) {
                return Err(format!(
                    "class {n}: kv_cache_target_pct = {}: give 1-100",
                    l.kv_cache_target_pct
                ));
            }
        }
        if let Some(d) = &self.degraded {
            if self.lane != LaneKind::Bounded {
                return Err(format!(
                    "class {n}: only bounded lanes degrade; remove [degraded] or use lane = \"bounded\""
                ));
            }
            if d.budget_ms < self.budget_ms {
                return Err(format!(
                    "class {n}: degraded.budget_ms ({}) must be at least budget_ms ({}): degrading lengthens the queue budget",
                    d.budget_ms.as_ms(),
                    self.budget_ms.as_ms()
                ));
            }
        }
        Ok(())
    }
}

impl Model {
    pub fn validate(&self) -> Result<(), String> {
        validate_name("model", &self.name)?;
        validate_name("class", &self.class)?;
        let n = &self.name;
        if self.profiles.is_empty() {
            return Err(format!(
                "model {n}: no profiles; give at least one [profiles.<GPU product>] with service_ms and max_batch"
            ));
        }
        for (product, p) in &self.profiles {
            if product.is_empty() || product.len() > 64 {
                return Err(format!(
                    "model {n}: profile for {product:?}: name a GPU product such as L4 or H100-80GB"
                ));
            }
            if p.service_ms.0 == 0 {
                return Err(format!("model {n}: profiles.{product}.service_ms must be > 0"));
            }
            if p.max_batch == 0 || p.max_batch > 4096 {
                return Err(format!(
                    "model {n}: profiles.{product}.max_batch = {}: give 1-4096",
                    p.max_batch
                ));
            }
        }
        for a in &self.weights {
            if a.sha256.len() != 64 || !a.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(format!(
                    "model {n}: weights {:?}: sha256 must be 64 hex characters",
                    a.uri
                ));
            }
            if a.uri.is_empty() {
                return Err(format!("model {n}: a weight artifact has an empty uri"));
            }
        }
        if !self.runtime.health_path.starts_with('/') {
            return Err(format!(
                "model {n}: runtime.health_path {:?} must be an HTTP path starting with '/', e.g. /v2/health/ready",
                self.runtime.health_path
            ));
        }
        if self.version.is_empty() || self.version.len() > 64 {
            return Err(format!("model {n}: version must be 1-64 characters"));
        }
        if let Some(l) = &self.llm {
            if l.context_tokens == 0 {
                return Err(format!(
                    "model {n}: llm.context_tokens must be > 0 (the model's context window)"
                ));
            }
            if l.default_max_tokens == 0 || l.default_max_tokens > l.context_tokens {
                return Err(format!(
                    "model {n}: llm.default_max_tokens = {}: give 1 to context_tokens ({})",
                    l.default_max_tokens, l.context_tokens
                ));
            }
        }
        Ok(())
    }
}

impl TenantLimit {
    pub fn validate(&self) -> Result<(), String> {
        if self.concurrency == 0 || self.rate_per_s == 0 || self.burst == 0 || self.tokens_per_min == Some(0) {
            return Err(format!(
                "limit {self:?}: concurrency, rate_per_s, burst and tokens_per_min must all be > 0 (to stop a tenant, rotate its key)"
            ));
        }
        Ok(())
    }
}

impl Registry {
    pub fn put_class(&mut self, class: &Class) -> Result<(), String> {
        class.validate()?;
        if let Some(old) = self.classes.get(&class.name) {
            if old.lane != class.lane {
                let models: Vec<&str> = self
                    .models
                    .values()
                    .filter(|m| m.class == class.name)
                    .map(|m| m.name.as_str())
                    .collect();
                if !models.is_empty() {
                    return Err(format!(
                        "class {} is a {} lane with models ({}); its lane kind cannot change under them: create a new class and move the models",
                        class.name,
                        old.lane,
                        models.join(", ")
                    ));
                }
            }
        } else if self.classes.len() >= MAX_ENTRIES {
            return Err(format!("{MAX_ENTRIES} classes already; remove one first"));
        }
        self.classes.insert(class.name.clone(), class.clone());
        Ok(())
    }

    pub fn put_model(&mut self, model: &Model) -> Result<(), String> {
        model.validate()?;
        self.check_fallback(model)?;
        if model.serves.is_some() {
            return Err(format!(
                "model {}: `serves` is set by the registry, not in a model file; remove it",
                model.name
            ));
        }
        if let Some(r) = self
            .rollouts
            .values()
            .find(|r| r.state.is_active() && (r.from == model.name || r.to == model.name))
        {
            return Err(format!(
                "model {} is in the running rollout of {} (version {} → {}): a rollout compares fixed versions; promote or abort it first, or deploy a new version",
                model.name, r.model, r.from_version, r.to_version
            ));
        }
        if !self.classes.contains_key(&model.class) {
            return Err(format!(
                "model {}: class {:?} does not exist; `lanectl lane list` shows the classes",
                model.name, model.class
            ));
        }
        if !self.models.contains_key(&model.name) && self.models.len() >= MAX_ENTRIES {
            return Err(format!("{MAX_ENTRIES} models already; remove one first"));
        }
        self.models.insert(model.name.clone(), model.clone());
        Ok(())
    }

    /// A model's fallback names another existing model, not in a durable class.
    fn check_fallback(&self, model: &Model) -> Result<(), String> {
        let Some(f) = &model.fallback else { return Ok(()) };
        if f == model.public_name() {
            return Err(format!("model {}: a model cannot be its own fallback", model.name));
        }
        let Some(fm) = self.models.get(self.serving_entry(f)) else {
            return Err(format!(
                "model {}: fallback {f:?} is not registered; register it first (`lanectl model list` shows the models)",
                model.name
            ));
        };
        if self.classes.get(&fm.class).is_some_and(|c| c.lane == LaneKind::Durable) {
            return Err(format!(
                "model {}: fallback {f} is in a durable class; a fallback answers synchronously",
                model.name
            ));
        }
        Ok(())
    }

    /// The entry that serves the public model `name` (stable traffic).
    pub fn serving_entry<'a>(&'a self, name: &'a str) -> &'a str {
        self.serving
            .get(name)
            .filter(|e| self.models.contains_key(e.as_str()))
            .map_or(name, String::as_str)
    }

    /// The rollout of `name` that is running or paused.
    pub fn active_rollout(&self, name: &str) -> Option<&Rollout> {
        self.rollouts.get(name).filter(|r| r.state.is_active())
    }

    /// What version entry `m` does now: `serving` its name, `in rollout` (the target of a
    /// running or paused rollout), or `idle` (a specification only).
    pub fn version_state(&self, m: &Model) -> &'static str {
        let public = m.public_name();
        if self.serving_entry(public) == m.name {
            "serving"
        } else if self.active_rollout(public).is_some_and(|r| r.to == m.name) {
            "in rollout"
        } else {
            "idle"
        }
    }

    /// Whether `m`'s replicas are placed: it serves its model, or a running rollout is moving
    /// traffic to it. Other versions are kept as specifications only, costing no GPU.
    pub fn is_placed(&self, m: &Model) -> bool {
        let public = m.public_name();
        self.serving_entry(public) == m.name || self.active_rollout(public).is_some_and(|r| r.to == m.name)
    }

    /// Deploys a version of a model (`lanectl model deploy`): the first version of a name is
    /// an ordinary model; a later one becomes the entry `name@version`, idle until a rollout
    /// moves traffic to it. Versions are immutable: deploying one again with another
    /// specification is refused. Returns the entry key.
    pub fn deploy_version(&mut self, model: &Model) -> Result<String, String> {
        if model.serves.is_some() {
            return Err(format!(
                "model {}: `serves` is set by the registry, not in a model file; remove it",
                model.name
            ));
        }
        validate_name("version", &model.version)?;
        let Some(current) = self.models.get(self.serving_entry(&model.name)) else {
            self.put_model(model)?;
            return Ok(model.name.clone());
        };
        if current.class != model.class {
            return Err(format!(
                "model {} is in class {}, this version says {}: a version changes the model, not its lane; keep class = {:?}",
                model.name, current.class, model.class, current.class
            ));
        }
        if let Some(e) = self.version_entry(&model.name, &model.version) {
            let same = Model {
                name: e.public_name().to_string(),
                serves: None,
                ..e.clone()
            } == *model;
            return if same {
                Ok(e.name.clone())
            } else {
                Err(format!(
                    "version {} of {} is already deployed with another specification; versions are immutable: give this one a new version",
                    model.version, model.name
                ))
            };
        }
        model.validate()?;
        self.check_fallback(model)?;
        let key = rollout::entry_key(&model.name, &model.version);
        if self.models.len() >= MAX_ENTRIES {
            return Err(format!("{MAX_ENTRIES} models already; retire old versions first"));
        }
        self.models.insert(
            key.clone(),
            Model {
                name: key.clone(),
                serves: Some(model.name.clone()),
                ..model.clone()
            },
        );
        Ok(key)
    }

    /// Starts a rollout (validated against the registry as it is when applied).
    pub fn start_rollout(&mut self, r: &Rollout) -> Result<(), String> {
        r.validate()?;
        if let Some(a) = self.active_rollout(&r.model) {
            return Err(format!(
                "{} is already rolling out version {} ({}); promote or abort it first",
                r.model,
                a.to_version,
                a.state.as_str()
            ));
        }
        let Some(to) = self.models.get(&r.to) else {
            return Err(format!(
                "no version {} of {}; `lanectl model deploy FILE` deploys it first",
                r.to_version, r.model
            ));
        };
        if to.public_name() != r.model {
            return Err(format!("{} is not a version of {}", r.to, r.model));
        }
        let class = self.classes.get(&to.class);
        if class.is_some_and(|c| c.lane == LaneKind::Durable) {
            return Err(format!(
                "{} is in a durable class: rollouts split synchronous traffic (sync and bounded lanes); jobs are not split between versions yet",
                r.model
            ));
        }
        let serving = self.serving_entry(&r.model);
        if serving == r.to {
            return Err(format!("version {} already serves {}", r.to_version, r.model));
        }
        if serving != r.from {
            return Err(format!(
                "{} is served by {serving}, not {}: start the rollout again",
                r.model, r.from
            ));
        }
        self.rollouts.insert(r.model.clone(), r.clone());
        Ok(())
    }

    /// Moves a rollout on. `expect_step`: only if it is still at that step (the loop judged that
    /// step; a retried or stale proposal does nothing).
    pub fn update_rollout(
        &mut self,
        model: &str,
        expect_step: Option<usize>,
        action: RolloutAction,
        at_ms: u64,
        message: &str,
    ) -> Result<(), String> {
        let replicas = &self.replicas;
        let Some(r) = self.rollouts.get_mut(model) else {
            return Err(format!("{model} has no rollout; `lanectl rollout start` starts one"));
        };
        if !r.state.is_active() {
            return Err(format!(
                "the rollout of {model} to version {} has ended ({}); start a new one",
                r.to_version,
                r.state.as_str()
            ));
        }
        if expect_step.is_some_and(|s| s != r.step) {
            return Err(format!(
                "the rollout of {model} is at step {}, not {}: already moved on",
                r.step,
                expect_step.unwrap_or_default()
            ));
        }
        let mut promoted = false;
        match action {
            RolloutAction::Advance if r.state == RolloutState::Running && r.step + 1 < r.steps.len() => {
                r.step += 1;
                r.step_started_ms = at_ms;
            }
            RolloutAction::Advance => {
                return Err(format!(
                    "the rollout of {model} cannot advance now ({})",
                    r.state.as_str()
                ))
            }
            // A shadow moves no traffic: promoting it ends the comparison as passed.
            RolloutAction::Promote if r.strategy == rollout::Strategy::Shadow => r.state = RolloutState::Passed,
            // A promotion needs a ready replica of the new version.
            RolloutAction::Promote if ready_replicas(replicas, &r.to) == 0 => {
                return Err(format!(
                    "version {} of {model} has no ready replica yet: promoting now would send every request to nothing; wait for its replicas (`lanectl rollout status {model}`) or abort",
                    r.to_version
                ))
            }
            RolloutAction::Promote => {
                r.state = RolloutState::Promoted;
                r.step = r.steps.len() - 1;
                promoted = true;
            }
            RolloutAction::RollBack => r.state = RolloutState::RolledBack,
            RolloutAction::Abort => r.state = RolloutState::Aborted,
            RolloutAction::Pause => r.state = RolloutState::Paused,
            RolloutAction::Resume => {
                r.state = RolloutState::Running;
                // The step bakes again from now: what it served while held is still counted.
                r.step_started_ms = at_ms;
            }
        }
        r.note(at_ms, message.to_string());
        if promoted {
            let to = r.to.clone();
            if to == model {
                self.serving.remove(model);
            } else {
                self.serving.insert(model.to_string(), to);
            }
        }
        Ok(())
    }

    pub fn remove_model(&mut self, name: &str) -> Result<(), String> {
        if let Some(m) = self.models.get(name) {
            let public = m.public_name();
            if self.serving_entry(public) == name
                && self
                    .models
                    .values()
                    .any(|o| o.public_name() == public && o.name != name)
            {
                return Err(format!(
                    "{name} serves {public} while other versions exist; roll out another version first"
                ));
            }
            if self
                .active_rollout(public)
                .is_some_and(|r| r.to == name || r.from == name)
            {
                return Err(format!(
                    "{name} is in the running rollout of {public}; promote or abort it first"
                ));
            }
        }
        self.models
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| format!("no model {name}; `lanectl model list` shows the models"))
    }

    pub fn create_tenant(&mut self, tenant: &Tenant) -> Result<(), String> {
        validate_name("tenant", &tenant.name)?;
        if self.tenants.contains_key(&tenant.name) {
            return Err(format!(
                "tenant {} exists; use `lanectl tenant rotate-key` for a new key",
                tenant.name
            ));
        }
        if self.tenants.len() >= MAX_ENTRIES {
            return Err(format!("{MAX_ENTRIES} tenants already"));
        }
        for l in tenant.limits.values() {
            l.validate()?;
        }
        self.tenants.insert(tenant.name.clone(), tenant.clone());
        Ok(())
    }

    pub fn set_tenant_limit(&mut self, tenant: &str, class: &str, limit: Option<TenantLimit>) -> Result<(), String> {
        if class != "*" && !self.classes.contains_key(class) {
            return Err(format!(
                "no class {class}; give a class from `lanectl lane list`, or * for every class"
            ));
        }
        let t = self
            .tenants
            .get_mut(tenant)
            .ok_or_else(|| format!("no tenant {tenant}; `lanectl tenant list` shows the tenants"))?;
        match limit {
            Some(l) => {
                l.validate()?;
                t.limits.insert(class.to_string(), l);
            }
            None => {
                t.limits.remove(class);
            }
        }
        Ok(())
    }

    pub fn rotate_key(&mut self, tenant: &str, key_sha256: &str) -> Result<(), String> {
        let t = self
            .tenants
            .get_mut(tenant)
            .ok_or_else(|| format!("no tenant {tenant}; `lanectl tenant list` shows the tenants"))?;
        t.key_sha256 = key_sha256.to_string();
        Ok(())
    }

    /// Replaces the replicas placed on a node (an empty list removes them all).
    /// Whether a GPU is (to be) split into MIG slices: whole-card replicas do not go there.
    pub fn mig_split(&self, node_id: &str, gpu: &str) -> bool {
        self.mig
            .get(node_id)
            .and_then(|g| g.get(gpu))
            .is_some_and(|profiles| !profiles.is_empty())
    }

    /// Sets a GPU's MIG layout (validated by the caller).
    pub fn set_mig_layout(&mut self, node_id: &str, gpu: &str, profiles: &[String]) {
        self.mig
            .entry(node_id.to_string())
            .or_default()
            .insert(gpu.to_string(), profiles.to_vec());
    }

    pub fn set_desired(&mut self, node_id: &str, replicas: &[DesiredReplica]) {
        if replicas.is_empty() {
            self.desired.remove(node_id);
        } else {
            self.desired.insert(node_id.to_string(), replicas.to_vec());
        }
    }

    /// Replaces a node's committed replicas (an empty list forgets them).
    pub fn set_node_replicas(&mut self, node_id: &str, replicas: &[ReplicaRecord]) {
        if replicas.is_empty() {
            self.replicas.remove(node_id);
        } else {
            self.replicas.insert(node_id.to_string(), replicas.to_vec());
        }
    }
}

/// sha256 (hex) of an API key, as stored.
pub fn hash_key(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

/// Checks the PEM shape of an overflow endpoint's CA: one or more well-formed CERTIFICATE
/// blocks. Whether each is a usable CA certificate needs a TLS library: the admin API checks it
/// before it proposes a class, and the router where it builds the client
/// (`laneway_control::router::overflow::parse_ca_pem`).
pub fn check_ca_pem(pem: &str) -> Result<(), String> {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("ca_pem is not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("ca_pem holds no certificate (expected -----BEGIN CERTIFICATE-----)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod example_tests {
    #[test]
    fn the_example_model_file_is_valid() {
        let m: super::Model = toml::from_str(include_str!("../../../../deploy/examples/models/whisper.toml")).unwrap();
        m.validate().unwrap();
        assert_eq!(m.profiles["L4"].max_batch, 8);
    }
}
