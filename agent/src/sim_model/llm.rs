//! The simulated model server's LLM mode: an OpenAI-compatible server (`/v1/chat/completions`,
//! `/v1/completions`, streamed or not) in front of a simulated engine with continuous batching.
//!
//! The engine works in steps, as vLLM's does. Each step every running sequence gets one token;
//! a step takes `running / tokens_per_s` (the product's decode throughput, shared by the
//! running sequences), never less than one token at `max_seq_tokens_per_s`, plus the prefill of
//! sequences that joined in it (`uncached input tokens / prefill_tokens_per_s`: a long prompt
//! stalls everyone's next token, as it does on a real GPU). A sequence joins when a running slot
//! is free (`max_running`) and its input + output budget fits the KV cache that is left; until
//! then it waits. Prompt prefixes stay in a prefix cache (blocks of 16 tokens, least recently
//! used dropped when the cached tokens pass the KV capacity), and a cached prefix is not
//! prefilled again: this is what prefix-affinity routing buys.
//!
//! `/metrics` reports what vLLM reports: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:gpu_cache_usage_perc` (0–1), token counters and prefix-cache hits.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::SimModelError;
use crate::llm::{CompletionRequest, Endpoint, CHARS_PER_TOKEN};

/// Tokens in one prefix-cache block.
pub const BLOCK_TOKENS: usize = 16;

/// How the simulated LLM engine behaves.
#[derive(Debug, Clone)]
pub struct LlmSimConfig {
    pub model: String,
    /// GPU product the replica runs on: picks the throughput and the KV capacity.
    pub product: String,
    /// Decode throughput of one replica by product, tokens/s over all running sequences.
    pub tokens_per_s: BTreeMap<String, f64>,
    /// KV-cache capacity by product, tokens.
    pub kv_cache_tokens: BTreeMap<String, u64>,
    /// Prefill throughput as a multiple of the decode throughput.
    pub prefill_factor: f64,
    /// One sequence's top speed, tokens/s (a step is never shorter than one such token).
    pub max_seq_tokens_per_s: f64,
    /// Sequences decoded at once (vLLM's `max_num_seqs`).
    pub max_running: usize,
    /// Longest input + output, tokens.
    pub context_tokens: u32,
    /// Output tokens when the request gives no `max_tokens`.
    pub default_max_tokens: u32,
    /// Break the connection (as a crashed server would) after this many tokens of a stream.
    pub abort_stream_after_tokens: Option<u32>,
}

impl LlmSimConfig {
    fn engine(&self) -> Result<EngineConfig, SimModelError> {
        let known = || self.tokens_per_s.keys().cloned().collect::<Vec<_>>().join(", ");
        let tps = *self
            .tokens_per_s
            .get(&self.product)
            .ok_or_else(|| SimModelError::NoThroughput {
                product: self.product.clone(),
                known: known(),
            })?;
        let kv = self.kv_cache_tokens.get(&self.product).copied().unwrap_or(u64::MAX);
        for (field, value, ok) in [
            ("tokens-per-s", tps, tps.is_finite() && tps > 0.0),
            (
                "prefill-factor",
                self.prefill_factor,
                self.prefill_factor.is_finite() && self.prefill_factor > 0.0,
            ),
            (
                "max-seq-tokens-per-s",
                self.max_seq_tokens_per_s,
                self.max_seq_tokens_per_s.is_finite() && self.max_seq_tokens_per_s > 0.0,
            ),
            ("max-batch", self.max_running as f64, self.max_running > 0),
            ("kv-cache-tokens", kv as f64, kv > 0),
        ] {
            if !ok {
                return Err(SimModelError::Invalid {
                    field,
                    value: value.to_string(),
                    expected: "a number > 0",
                });
            }
        }
        Ok(EngineConfig {
            tokens_per_s: tps,
            prefill_tokens_per_s: tps * self.prefill_factor,
            min_step: Duration::from_secs_f64(1.0 / self.max_seq_tokens_per_s),
            max_running: self.max_running,
            kv_capacity: kv,
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct EngineConfig {
    tokens_per_s: f64,
    prefill_tokens_per_s: f64,
    min_step: Duration,
    max_running: usize,
    kv_capacity: u64,
}

/// What the engine sends a request's handler.
#[derive(Debug)]
enum Event {
    Token(u32),
    Done(Usage),
}

#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
    /// This sequence's share of the GPU time of the steps it was in.
    gpu_ms: f64,
}

struct Seq {
    prompt_tokens: u32,
    blocks: Vec<u64>,
    /// 0: an embedding — done after its prefill, nothing generated.
    max_tokens: u32,
    generated: u32,
    cached_tokens: u32,
    prefilled: bool,
    gpu_ms: f64,
    tx: mpsc::UnboundedSender<Event>,
}

/// Hands a new sequence to the engine; its events come on the receiver.
fn submit(
    s: &AppState,
    prompt_tokens: u32,
    blocks: Vec<u64>,
    max_tokens: u32,
) -> Result<mpsc::UnboundedReceiver<Event>, Response> {
    let (tx, rx) = mpsc::unbounded_channel();
    let seq = Seq {
        prompt_tokens,
        blocks,
        max_tokens,
        generated: 0,
        cached_tokens: 0,
        prefilled: false,
        gpu_ms: 0.0,
        tx,
    };
    s.submit
        .send(seq)
        .map_err(|_| error(StatusCode::SERVICE_UNAVAILABLE, "the simulated engine stopped".into()))?;
    Ok(rx)
}

impl Seq {
    fn reserve(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_tokens)
    }
}

/// Counters `/metrics` reports.
#[derive(Default)]
struct Stats {
    running: AtomicU64,
    waiting: AtomicU64,
    /// KV tokens reserved by running sequences.
    kv_used: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    cancelled: AtomicU64,
    finished: AtomicU64,
}

/// The prefix cache: block hashes, least recently used first out.
struct PrefixCache {
    capacity_blocks: usize,
    /// Uses in order: (block, tick of that use); older uses of a block are stale.
    order: VecDeque<(u64, u64)>,
    /// Block → tick of its last use.
    present: HashMap<u64, u64>,
    tick: u64,
}

impl PrefixCache {
    fn new(kv_capacity: u64) -> Self {
        PrefixCache {
            capacity_blocks: usize::try_from(kv_capacity / BLOCK_TOKENS as u64)
                .unwrap_or(usize::MAX)
                .max(1),
            order: VecDeque::new(),
            present: HashMap::new(),
            tick: 0,
        }
    }

    /// Tokens of the leading blocks already cached; then caches all of `blocks`.
    fn lookup_and_insert(&mut self, blocks: &[u64]) -> u32 {
        let hit = blocks.iter().take_while(|b| self.present.contains_key(b)).count();
        for b in blocks {
            self.tick += 1;
            self.present.insert(*b, self.tick);
            self.order.push_back((*b, self.tick));
        }
        while self.present.len() > self.capacity_blocks {
            let Some((b, t)) = self.order.pop_front() else { break };
            if self.present.get(&b) == Some(&t) {
                self.present.remove(&b);
            }
        }
        u32::try_from(hit * BLOCK_TOKENS).unwrap_or(u32::MAX)
    }
}

/// Chained hashes of the prompt's full blocks of [`BLOCK_TOKENS`] estimated tokens.
fn block_hashes(prompt: &str) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    let chars: Vec<char> = prompt.chars().collect();
    let per_block = BLOCK_TOKENS * CHARS_PER_TOKEN;
    let mut out = Vec::with_capacity(chars.len() / per_block);
    let mut prev = 0u64;
    for block in chars.chunks_exact(per_block) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        prev.hash(&mut h);
        block.hash(&mut h);
        prev = h.finish();
        out.push(prev);
    }
    out
}

/// The engine loop: admits waiting sequences, runs steps, sends tokens, frees finished or
/// abandoned sequences.
async fn engine(cfg: EngineConfig, mut rx: mpsc::UnboundedReceiver<Seq>, stats: Arc<Stats>) {
    let mut waiting: VecDeque<Seq> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut kv_used: u64 = 0;
    let mut cache = PrefixCache::new(cfg.kv_capacity);
    loop {
        if running.is_empty() && waiting.is_empty() {
            match rx.recv().await {
                Some(s) => waiting.push_back(s),
                None => return,
            }
        }
        while let Ok(s) = rx.try_recv() {
            waiting.push_back(s);
        }
        // Abandoned before they ran: drop them.
        waiting.retain(|s| {
            let gone = s.tx.is_closed();
            if gone {
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        while running.len() < cfg.max_running {
            let Some(front) = waiting.front() else { break };
            if kv_used + front.reserve() > cfg.kv_capacity && !running.is_empty() {
                break;
            }
            let s = waiting.pop_front().expect("front exists");
            kv_used += s.reserve();
            running.push(s);
        }
        // One step: prefill of the newcomers, then a token for everyone.
        let mut prefill_tokens = 0u64;
        for s in running.iter_mut().filter(|s| !s.prefilled) {
            s.cached_tokens = cache.lookup_and_insert(&s.blocks).min(s.prompt_tokens);
            stats
                .prefix_queries
                .fetch_add(u64::from(s.prompt_tokens), Ordering::Relaxed);
            stats
                .prefix_hits
                .fetch_add(u64::from(s.cached_tokens), Ordering::Relaxed);
            stats
                .prompt_tokens
                .fetch_add(u64::from(s.prompt_tokens), Ordering::Relaxed);
            prefill_tokens += u64::from(s.prompt_tokens - s.cached_tokens);
            s.prefilled = true;
        }
        let n = running.len();
        let decode = Duration::from_secs_f64(n as f64 / cfg.tokens_per_s).max(cfg.min_step);
        let step = decode + Duration::from_secs_f64(prefill_tokens as f64 / cfg.prefill_tokens_per_s);
        stats.running.store(n as u64, Ordering::Relaxed);
        stats.waiting.store(waiting.len() as u64, Ordering::Relaxed);
        stats.kv_used.store(kv_used, Ordering::Relaxed);
        tokio::time::sleep(step).await;
        let share = step.as_secs_f64() * 1000.0 / n as f64;
        running.retain_mut(|s| {
            s.gpu_ms += share;
            if s.max_tokens == 0 {
                stats.finished.fetch_add(1, Ordering::Relaxed);
                let _ = s.tx.send(Event::Done(Usage {
                    prompt_tokens: s.prompt_tokens,
                    completion_tokens: 0,
                    cached_tokens: s.cached_tokens,
                    gpu_ms: s.gpu_ms,
                }));
                kv_used -= s.reserve();
                return false;
            }
            s.generated += 1;
            stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
            let delivered = s.tx.send(Event::Token(s.generated)).is_ok();
            let keep = if !delivered {
                // The client went away: stop working for it.
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                false
            } else if s.generated >= s.max_tokens {
                stats.finished.fetch_add(1, Ordering::Relaxed);
                let _ = s.tx.send(Event::Done(Usage {
                    prompt_tokens: s.prompt_tokens,
                    completion_tokens: s.generated,
                    cached_tokens: s.cached_tokens,
                    gpu_ms: s.gpu_ms,
                }));
                false
            } else {
                true
            };
            if !keep {
                kv_used -= s.reserve();
            }
            keep
        });
        stats.running.store(running.len() as u64, Ordering::Relaxed);
        stats.kv_used.store(kv_used, Ordering::Relaxed);
    }
}

struct AppState {
    cfg: LlmSimConfig,
    engine: EngineConfig,
    submit: mpsc::UnboundedSender<Seq>,
    stats: Arc<Stats>,
    next_id: AtomicU64,
    created: u64,
}

/// Builds the LLM server. Validates the configuration first.
pub fn app(cfg: LlmSimConfig) -> Result<Router, SimModelError> {
    let engine_cfg = cfg.engine()?;
    let (tx, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(Stats::default());
    tokio::spawn(engine(engine_cfg, rx, stats.clone()));
    let state = Arc::new(AppState {
        cfg,
        engine: engine_cfg,
        submit: tx,
        stats,
        next_id: AtomicU64::new(0),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    Ok(Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<AppState>>, b: Bytes| complete(s, Endpoint::Chat, b)),
        )
        .route(
            "/v1/completions",
            post(|s: State<Arc<AppState>>, b: Bytes| complete(s, Endpoint::Completion, b)),
        )
        .route("/v1/embeddings", post(embed))
        .route("/metrics", get(metrics))
        .with_state(state))
}

/// Dimensions of the simulated embeddings.
pub const EMBEDDING_DIMS: usize = 8;

/// The simulated embedding of `input` (a text, or token ids as JSON): deterministic, unit
/// length, so tests can check the same input gives the same vector.
pub fn embedding_of(input: &Value) -> Vec<f32> {
    use std::hash::{Hash, Hasher};
    let v: Vec<f32> = (0..EMBEDDING_DIMS)
        .map(|i| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (i, input.to_string()).hash(&mut h);
            (h.finish() % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(f32::EPSILON);
    v.into_iter().map(|x| x / norm).collect()
}

/// The request, for this server's model; else the answer a server gives.
fn parse(s: &AppState, endpoint: Endpoint, body: &[u8]) -> Result<CompletionRequest, Response> {
    let req = CompletionRequest::parse(endpoint, body).map_err(|e| error(StatusCode::BAD_REQUEST, e))?;
    if req.model != s.cfg.model {
        return Err(error(
            StatusCode::NOT_FOUND,
            format!(
                "the model `{}` does not exist; this server serves `{}`",
                req.model, s.cfg.model
            ),
        ));
    }
    Ok(req)
}

/// `POST /v1/embeddings`: each input is one prefill on the engine (it queues and shares the
/// engine with completions), answered in OpenAI's shape with usage.
async fn embed(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    if let Err(r) = parse(&s, Endpoint::Embeddings, &body) {
        return r;
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    let inputs: Vec<Value> = match &v["input"] {
        Value::Array(items) if items.iter().all(|i| !i.is_u64()) => items.clone(),
        one => vec![one.clone()],
    };
    let tokens = laneway_core::llm::embedding_tokens(Some(&v["input"])).unwrap_or_default();
    if let Some(t) = tokens.iter().find(|&&t| t > s.cfg.context_tokens) {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens; an input has {t}.",
                s.cfg.context_tokens
            ),
        );
    }
    let mut done = Vec::new();
    for (input, &prompt_tokens) in inputs.iter().zip(&tokens) {
        match submit(&s, prompt_tokens, block_hashes(input.as_str().unwrap_or_default()), 0) {
            Ok(rx) => done.push(rx),
            Err(r) => return r,
        }
    }
    let (mut prompt_tokens, mut gpu_ms) = (0u32, 0.0f64);
    for rx in &mut done {
        match rx.recv().await {
            Some(Event::Done(u)) => {
                prompt_tokens += u.prompt_tokens;
                gpu_ms += u.gpu_ms;
            }
            _ => return error(StatusCode::SERVICE_UNAVAILABLE, "the simulated engine stopped".into()),
        }
    }
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| json!({"object": "embedding", "index": i, "embedding": embedding_of(input)}))
        .collect();
    Json(json!({
        "object": "list",
        "data": data,
        "model": s.cfg.model,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "laneway_gpu_ms": (gpu_ms * 1000.0).round() / 1000.0,
        },
    }))
    .into_response()
}

fn error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}})),
    )
        .into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.cfg.model, "object": "model", "owned_by": "laneway-sim", "max_model_len": s.cfg.context_tokens}]}),
    )
}

async fn metrics(State(s): State<Arc<AppState>>) -> String {
    let st = &s.stats;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let kv = load(&st.kv_used) as f64 / s.engine.kv_capacity.max(1) as f64;
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {}\n\
         # TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc {kv}\n\
         # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total {}\n\
         # TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total {}\n\
         # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total {}\n\
         # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total {}\n\
         # TYPE laneway_sim_llm_cancelled counter\nlaneway_sim_llm_cancelled_total {}\n\
         # TYPE laneway_sim_llm_finished counter\nlaneway_sim_llm_finished_total {}\n\
         # TYPE {in_flight} gauge\n{in_flight} {}\n",
        load(&st.running),
        load(&st.waiting),
        load(&st.prompt_tokens),
        load(&st.generation_tokens),
        load(&st.prefix_queries),
        load(&st.prefix_hits),
        load(&st.cancelled),
        load(&st.finished),
        load(&st.running) + load(&st.waiting),
        in_flight = super::IN_FLIGHT_METRIC,
    )
}

/// The text of output token `i` (deterministic, so tests can check what arrived).
pub fn token_text(i: u32) -> String {
    format!("t{i} ")
}

async fn complete(State(s): State<Arc<AppState>>, endpoint: Endpoint, body: Bytes) -> Response {
    let req = match parse(&s, endpoint, &body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let prompt_tokens = req.input_tokens();
    let max_tokens = req.max_tokens.unwrap_or(s.cfg.default_max_tokens);
    let total = u64::from(prompt_tokens) + u64::from(max_tokens);
    if total > u64::from(s.cfg.context_tokens) || total > s.engine.kv_capacity {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens (KV cache {}). However, you requested {total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
                s.cfg.context_tokens, s.engine.kv_capacity
            ),
        );
    }
    let mut rx = match submit(&s, prompt_tokens, block_hashes(&req.prompt), max_tokens) {
        Ok(rx) => rx,
        Err(r) => return r,
    };
    let id = format!("cmpl-{}", s.next_id.fetch_add(1, Ordering::Relaxed));
    let (model, created, object) = (s.cfg.model.clone(), s.created, endpoint.chunk_object());
    let usage_json = |u: &Usage| {
        json!({
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "laneway_gpu_ms": (u.gpu_ms * 1000.0).round() / 1000.0,
        })
    };
    let choice = move |text: Option<String>, finish: Option<&str>| match (endpoint, text) {
        (Endpoint::Chat, Some(t)) => json!({"index": 0, "delta": {"content": t}, "finish_reason": finish}),
        (Endpoint::Chat, None) => json!({"index": 0, "delta": {}, "finish_reason": finish}),
        (Endpoint::Completion | Endpoint::Embeddings, t) => {
            json!({"index": 0, "text": t.unwrap_or_default(), "finish_reason": finish})
        }
    };
    if !req.stream {
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token(i) => text.push_str(&token_text(i)),
                Event::Done(u) => {
                    let choice = match endpoint {
                        Endpoint::Chat => {
                            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
                        }
                        Endpoint::Completion | Endpoint::Embeddings => {
                            json!({"index": 0, "text": text, "finish_reason": "length"})
                        }
                    };
                    let object = match endpoint {
                        Endpoint::Chat => "chat.completion",
                        Endpoint::Completion | Endpoint::Embeddings => "text_completion",
                    };
                    return Json(json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage_json(&u)})).into_response();
                }
            }
        }
        return error(StatusCode::SERVICE_UNAVAILABLE, "the simulated engine stopped".into());
    }
    let abort_after = s.cfg.abort_stream_after_tokens;
    let include_usage = req.include_usage;
    let stream = async_stream(rx, move |ev| {
        let data = |v: Value| Bytes::from(format!("data: {v}\n\n"));
        match ev {
            Event::Token(i) => {
                if abort_after.is_some_and(|a| i > a) {
                    return Err(std::io::Error::other("simulated crash mid-stream"));
                }
                let mut out = Vec::new();
                if i == 1 && endpoint == Endpoint::Chat {
                    out.push(data(json!({"id": id, "object": object, "created": created, "model": model, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]})));
                }
                out.push(data(json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice(Some(token_text(i)), None)]})));
                Ok(out)
            }
            Event::Done(u) => {
                let mut out = vec![data(
                    json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice(None, Some("length"))]}),
                )];
                if include_usage {
                    out.push(data(json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage_json(&u)})));
                }
                out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                Ok(out)
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("valid response")
}

/// The SSE body: each engine event becomes its frames. Dropping the body (the client went
/// away) drops the receiver, which the engine sees as a cancelled sequence.
fn async_stream<F>(
    rx: mpsc::UnboundedReceiver<Event>,
    frame: F,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static
where
    F: FnMut(Event) -> Result<Vec<Bytes>, std::io::Error> + Send + 'static,
{
    use futures::StreamExt;
    futures::stream::unfold(rx, |mut rx| async move {
        let ev = rx.recv().await?;
        Some((ev, rx))
    })
    .map(frame)
    .flat_map(|r| match r {
        Ok(frames) => futures::stream::iter(frames.into_iter().map(Ok).collect::<Vec<_>>()),
        Err(e) => futures::stream::iter(vec![Err(e)]),
    })
}
