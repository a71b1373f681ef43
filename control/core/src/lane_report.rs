//! What a router reports about its lanes (`lanectl lane show`, the dashboard, the admin API's
//! lane status): plain data, made by the router and read by the operator's tools.

use serde::{Deserialize, Serialize};

/// What `lanectl lane show` prints about a lane's live state on one router.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LaneStatus {
    pub class: String,
    pub lane: String,
    /// `normal`, `degraded` (bounded lane on its degraded settings) or `short` (a sync lane
    /// refused work in the last second).
    pub level: String,
    pub queue_depth: usize,
    /// Completions per second measured over the last 2 s (None: too few to trust).
    pub drain_per_s: Option<f64>,
    pub pressure: f64,
    pub in_flight: u32,
    pub slots: u32,
    pub ready_replicas: usize,
    pub counters: serde_json::Value,
    /// Seconds since the level last changed.
    pub level_for_s: f64,
    /// Durable lanes: the replicated job queue (the same on every controller) — jobs queued,
    /// assigned and running, and the seconds the queue takes to drain at the ready replicas'
    /// throughput (the number shedding uses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs: Option<serde_json::Value>,
    /// The class's latency objective (p99, ms), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_p99_ms: Option<f64>,
    /// Language-model lanes: objectives on time to first token and inter-token latency, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_slo_p99_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_slo_p99_ms: Option<f64>,
    /// Language models of the lane this router streamed for lately: TTFT, ITL and tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub llm: Vec<LlmSummary>,
    /// The lane's overflow endpoint on this router, if the class has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow: Option<OverflowStatus>,
}

/// One language model's recent figures on this router (the last [`RECENT`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LlmSummary {
    pub model: String,
    pub requests: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Output tokens per second of GPU time the replicas reported.
    pub output_tokens_per_gpu_s: Option<f64>,
}

/// A lane's overflow endpoint as one router sees it (`lanectl lane show`, metrics).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverflowStatus {
    pub url: String,
    /// Whether it takes requests now (configured here, breaker closed).
    pub usable: bool,
    /// `ready`, or why not: the breaker is open (for how long), or this router cannot use it
    /// (its environment lacks the key, the CA does not parse).
    pub state: String,
    pub in_flight: u32,
    pub max_in_flight: u32,
}
