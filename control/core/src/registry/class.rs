//! Classes: a lane and its numbers (budget, warm floor, headroom, protection rank), how it scales,
//! degrades, caches, hedges and overflows, and the checks a class must pass.

use serde::{Deserialize, Serialize};

use super::*;
use crate::refused::Refused;

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

/// What an overflow endpoint's key variable must start with: a class document (which an
/// operator writes) may name only variables set on the controllers for that purpose, never
/// another secret of their environment (`AWS_SECRET_ACCESS_KEY`).
pub const OVERFLOW_TOKEN_ENV_PREFIX: &str = "LANEWAY_OVERFLOW_";

/// Checks the name of an overflow endpoint's key variable (on write, and again before it is read).
pub fn check_overflow_token_env(var: &str) -> Result<(), Refused> {
    let ok = !var.is_empty()
        && var.len() <= 128
        && var
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        return Err(format!(
            "token_env {:?}: give the name of an environment variable (A-Z, 0-9, _, e.g. {OVERFLOW_TOKEN_ENV_PREFIX}HOSTED_API), not the key itself",
            crate::text::clip(var, 64)
        ).into());
    }
    if !var.starts_with(OVERFLOW_TOKEN_ENV_PREFIX) {
        return Err(format!(
            "token_env {var:?}: the variable's name must start with {OVERFLOW_TOKEN_ENV_PREFIX} (e.g. {OVERFLOW_TOKEN_ENV_PREFIX}HOSTED_API), so that no other secret of the controllers' environment can be sent out"
        ).into());
    }
    Ok(())
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

/// Checks a taint (or toleration): 1-63 characters of a-z, 0-9, '.', '/', '-', '_'.
pub fn validate_taint(t: &str) -> Result<(), Refused> {
    let ok = !t.is_empty()
        && t.len() <= 63
        && t.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '/' | '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "taint {t:?}: use 1-63 characters of a-z, 0-9, '.', '/', '-' and '_', e.g. dedicated or team/research"
        )
        .into())
    }
}

/// The certificates of an overflow endpoint's CA: one or more well-formed CERTIFICATE blocks.
/// Whether each is a usable CA certificate needs a TLS library: the admin API checks it before
/// it proposes a class, and the router where it builds the client
/// (`laneway_router::overflow::parse_ca_pem`, which starts from this).
pub fn ca_certs(pem: &str) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("ca_pem is not PEM: {e}"))?;
    if certs.is_empty() {
        return Err("ca_pem holds no certificate (expected -----BEGIN CERTIFICATE-----)".into());
    }
    Ok(certs)
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

impl Class {
    /// Whether a tenant's job of this class may name `uri` as its input: a plain location
    /// under one of the operator's [`Class::input_prefixes`]. Never a bare path, never
    /// `file://` outside a prefix, never a walk out of one.
    pub fn check_input_uri(&self, uri: &str) -> Result<(), Refused> {
        let n = &self.name;
        if self.input_prefixes.is_empty() {
            return Err(format!(
                "class {n} takes inputs inline only: send {{\"model\": …, \"input\": {{…}}}}; an operator allows locations for input_uri with `lanectl lane set {n} --input-prefix s3://bucket/inputs/`"
            ).into());
        }
        plain_location(uri).map_err(|e| format!("input_uri: {e}"))?;
        if self.input_prefixes.iter().any(|p| uri.starts_with(p.as_str())) {
            Ok(())
        } else {
            Err(format!(
                "input_uri {:?} is not under a location class {n} allows ({}); upload the input there",
                crate::text::clip(uri, 128),
                self.input_prefixes.join(", ")
            )
            .into())
        }
    }

    pub fn validate(&self) -> Result<(), Refused> {
        validate_name("class", &self.name)?;
        let n = &self.name;
        if !self.input_prefixes.is_empty() && self.lane != LaneKind::Durable {
            return Err(
                format!("class {n}: input_prefixes are for durable lanes (their jobs may name an input_uri)").into(),
            );
        }
        if self.input_prefixes.len() > MAX_INPUT_PREFIXES {
            return Err(format!("class {n}: {MAX_INPUT_PREFIXES} input_prefixes at most").into());
        }
        for p in &self.input_prefixes {
            let u = plain_location(p).map_err(|e| format!("class {n}: input prefix {e}"))?;
            if !p.ends_with('/') || u.path().trim_matches('/').is_empty() && u.scheme() == "file" {
                return Err(format!(
                    "class {n}: input prefix {p:?}: end it with '/' and name a directory (file:///srv/inputs/, s3://bucket/inputs/), never a whole host's files"
                ).into());
            }
        }
        if let Some(o) = &self.overflow {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: a durable lane queues its excess as jobs; overflow is for sync and bounded lanes"
                )
                .into());
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
                    ).into());
                }
            }
            if !(https || url.starts_with("http://"))
                || format!("{url}/v2/models/m/infer").parse::<http::Uri>().is_err()
            {
                return Err(format!(
                    "class {n}: overflow url {url:?}: give http://host:port[/prefix] or https://host[:port][/prefix]"
                )
                .into());
            }
            if let Some(pem) = &o.ca_pem {
                if !https {
                    return Err(
                        format!("class {n}: overflow ca_pem is for an https endpoint; {url:?} is plain http").into(),
                    );
                }
                ca_certs(pem)
                    .map(|_| ())
                    .map_err(|e| format!("class {n}: overflow {e}"))?;
            }
            if let Some(var) = &o.token_env {
                check_overflow_token_env(var).map_err(|e| format!("class {n}: overflow {e}"))?;
                if !https {
                    return Err(format!(
                        "class {n}: overflow token_env: {url:?} is plain http and would carry the key in the clear; use https"
                    ).into());
                }
            }
            if o.max_in_flight == 0 || o.max_in_flight > 10_000 {
                return Err(format!("class {n}: overflow max_in_flight = {}: give 1-10000", o.max_in_flight).into());
            }
        }
        if let Some(h) = &self.hedge {
            if self.lane != LaneKind::Sync {
                return Err(format!(
                    "class {n}: hedged requests are for sync lanes (a bounded lane queues, a durable one retries jobs)"
                )
                .into());
            }
            if h.after_ms.as_ms() <= 0.0 || h.after_ms.as_ms() >= self.request_timeout_ms.as_ms() {
                return Err(format!(
                    "class {n}: hedge after {} ms: give more than 0 and less than the lane's timeout ({} ms), about the model's p95",
                    h.after_ms.as_ms(),
                    self.request_timeout_ms.as_ms()
                ).into());
            }
            if !(1..=50).contains(&h.percent) {
                return Err(format!(
                    "class {n}: hedge percent {}: give 1-50 (each hedge is a second GPU run of a request)",
                    h.percent
                )
                .into());
            }
        }
        if let Some(f) = &self.fallback_response {
            if self.lane == LaneKind::Durable || !(200..300).contains(&f.status) {
                return Err(format!(
                    "class {n}: fallback_response is for sync and bounded lanes, with a 2xx status (got {})",
                    f.status
                )
                .into());
            }
            if f.body.len() > 64 * 1024 || serde_json::from_str::<serde_json::Value>(&f.body).is_err() {
                return Err(
                    format!("class {n}: fallback_response.body must be a JSON document of at most 64 KiB").into(),
                );
            }
        }
        if let Some(c) = &self.cache {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: a durable lane's results are stored per job, not cached; remove cache"
                )
                .into());
            }
            if !(1..=7 * 86_400).contains(&c.ttl_s) || !(1..=65_536).contains(&c.max_mib) {
                return Err(format!(
                    "class {n}: cache ttl_s = {} and max_mib = {}: give 1 s to 7 days and 1 MiB to 64 GiB",
                    c.ttl_s, c.max_mib
                )
                .into());
            }
        }
        if !(1..=100).contains(&self.utilisation_target_pct) {
            return Err(format!(
                "class {n}: utilisation_target_pct = {}: give 1-100 (sync lanes keep headroom, e.g. 60)",
                self.utilisation_target_pct
            )
            .into());
        }
        match self.lane {
            LaneKind::Sync if self.budget_ms.0 > 0 => {
                return Err(format!(
                    "class {n}: a sync lane has no queue, so budget_ms must be 0 (got {}); use lane = \"bounded\" for a queue",
                    self.budget_ms.as_ms()
                ).into())
            }
            LaneKind::Bounded | LaneKind::Durable if self.budget_ms.0 == 0 => {
                return Err(format!(
                    "class {n}: a {} lane needs budget_ms > 0 (the longest a request may wait in its queue)",
                    self.lane
                ).into())
            }
            _ => {}
        }
        if self.request_timeout_ms.0 == 0 {
            return Err(format!("class {n}: request_timeout_ms must be > 0").into());
        }
        self.tolerations.iter().try_for_each(|t| validate_taint(t))?;
        if let Some(slo) = self.slo_p99_ms {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: a durable lane has no latency objective (jobs are not waited on); remove slo_p99_ms"
                )
                .into());
            }
            if slo.0 == 0 || slo > self.request_timeout_ms {
                return Err(format!(
                    "class {n}: slo_p99_ms = {}: give more than 0 and at most request_timeout_ms ({})",
                    slo.as_ms(),
                    self.request_timeout_ms.as_ms()
                )
                .into());
            }
        }
        if let Some(l) = &self.llm {
            if self.lane == LaneKind::Durable {
                return Err(format!(
                    "class {n}: durable lanes take jobs, not streams; token objectives and signals are for sync and bounded lanes"
                ).into());
            }
            for (what, slo) in [
                ("ttft_slo_p99_ms", l.ttft_slo_p99_ms),
                ("itl_slo_p99_ms", l.itl_slo_p99_ms),
            ] {
                if slo.is_some_and(|s| s.0 == 0 || s > self.request_timeout_ms) {
                    return Err(format!(
                        "class {n}: {what} must be more than 0 and at most request_timeout_ms ({})",
                        self.request_timeout_ms.as_ms()
                    )
                    .into());
                }
            }
            if l.scale_on == ScaleSignal::Ttft && l.ttft_slo_p99_ms.is_none() {
                return Err(format!(
                    "class {n}: scale_on = \"ttft\" needs ttft_slo_p99_ms (the objective it scales against)"
                )
                .into());
            }
            if !(1..=100).contains(&l.kv_cache_target_pct) {
                return Err(format!("class {n}: kv_cache_target_pct = {}: give 1-100", l.kv_cache_target_pct).into());
            }
        }
        if let Some(d) = &self.degraded {
            if self.lane != LaneKind::Bounded {
                return Err(format!(
                    "class {n}: only bounded lanes degrade; remove [degraded] or use lane = \"bounded\""
                )
                .into());
            }
            if d.budget_ms < self.budget_ms {
                return Err(format!(
                    "class {n}: degraded.budget_ms ({}) must be at least budget_ms ({}): degrading lengthens the queue budget",
                    d.budget_ms.as_ms(),
                    self.budget_ms.as_ms()
                ).into());
            }
        }
        Ok(())
    }
}
