//! `laneway-sim-model`: a simulated model server speaking the KServe Open Inference Protocol
//! (v2) over HTTP, with a batch window, a max batch, a service time per GPU product, the GPU
//! time each request used in a response header, and failure knobs. Dev mode, tests, chaos and
//! benchmarks run against it instead of real model servers.

pub mod batcher;
pub mod llm;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::time::Instant;

use batcher::Batcher;

/// Response header: GPU milliseconds this request used (its share of the batch).
pub const GPU_MS_HEADER: &str = "x-laneway-gpu-ms";
/// Response header: size of the batch the request ran in.
pub const BATCH_SIZE_HEADER: &str = "x-laneway-batch-size";
/// Request header: how long the router's caller still waits, ms (the router's
/// `TIMEOUT_HEADER`).
pub const TIMEOUT_HEADER: &str = "x-laneway-timeout-ms";

/// Failure knobs, for tests and chaos.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Exit the process (as a crash would) on the request after this many were served.
    pub crash_after: Option<u64>,
    /// Stop answering (requests hang, readiness stays up) after this many requests.
    pub hang_after: Option<u64>,
    /// Report not-ready for this long after start.
    pub slow_start: Duration,
    /// Fraction of requests answered with a 500.
    pub error_rate: f64,
    pub seed: u64,
}

/// How the simulated server behaves.
#[derive(Debug, Clone)]
pub struct SimModelConfig {
    pub model: String,
    /// GPU product it was started for; picks the service time.
    pub product: String,
    /// Service time per batch by product, ms.
    pub service_ms: BTreeMap<String, f64>,
    pub max_batch: usize,
    pub batch_window: Duration,
    pub faults: Faults,
}

/// Why a configuration cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimModelError {
    #[error("no service time for product {product:?}; give --service-ms {product}=<ms> (known: {known})")]
    NoServiceTime { product: String, known: String },
    #[error("no decode throughput for product {product:?}; give --tokens-per-s {product}=<tokens/s> (known: {known})")]
    NoThroughput { product: String, known: String },
    #[error("{field} = {value}: {expected}")]
    Invalid {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
}

impl SimModelConfig {
    /// Service time of one batch on the configured product.
    pub fn service_time(&self) -> Result<Duration, SimModelError> {
        let ms = self
            .service_ms
            .get(&self.product)
            .ok_or_else(|| SimModelError::NoServiceTime {
                product: self.product.clone(),
                known: self.service_ms.keys().cloned().collect::<Vec<_>>().join(", "),
            })?;
        if !(ms.is_finite() && *ms > 0.0) {
            return Err(SimModelError::Invalid {
                field: "service-ms",
                value: ms.to_string(),
                expected: "a service time > 0 ms",
            });
        }
        if self.max_batch == 0 {
            return Err(SimModelError::Invalid {
                field: "max-batch",
                value: "0".into(),
                expected: "at least 1",
            });
        }
        if !(0.0..=1.0).contains(&self.faults.error_rate) {
            return Err(SimModelError::Invalid {
                field: "error-rate",
                value: self.faults.error_rate.to_string(),
                expected: "a fraction between 0 and 1",
            });
        }
        Ok(Duration::from_secs_f64(ms / 1000.0))
    }
}

struct AppState {
    cfg: SimModelConfig,
    batcher: Batcher,
    started: Instant,
    served: AtomicU64,
    /// Requests given up at the router's deadline.
    abandoned: AtomicU64,
    /// Requests taken and not yet answered.
    in_flight: AtomicU64,
    rng: Mutex<StdRng>,
}

/// The gauge `/metrics` reports requests in flight under (what an agent's in-flight probe reads).
pub const IN_FLIGHT_METRIC: &str = "laneway_sim_in_flight";

/// Counts a request in flight for as long as it lives.
struct InFlight<'a>(&'a AtomicU64);

impl<'a> InFlight<'a> {
    fn new(c: &'a AtomicU64) -> Self {
        c.fetch_add(1, Ordering::SeqCst);
        InFlight(c)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Prometheus text: requests in flight and served, as a real model server reports them.
async fn metrics(State(s): State<Arc<AppState>>) -> String {
    format!(
        "# TYPE {IN_FLIGHT_METRIC} gauge\n{IN_FLIGHT_METRIC} {}\n# TYPE laneway_sim_requests counter\nlaneway_sim_requests_total {}\n# TYPE laneway_sim_abandoned counter\nlaneway_sim_abandoned_total {}\n",
        s.in_flight.load(Ordering::SeqCst),
        s.served.load(Ordering::SeqCst),
        s.abandoned.load(Ordering::SeqCst)
    )
}

/// Builds the HTTP app. Validates the configuration first.
pub fn app(cfg: SimModelConfig) -> Result<Router, SimModelError> {
    let service = cfg.service_time()?;
    let state = Arc::new(AppState {
        batcher: Batcher::start(cfg.max_batch, cfg.batch_window, service),
        rng: Mutex::new(StdRng::seed_from_u64(cfg.faults.seed)),
        cfg,
        started: Instant::now(),
        served: AtomicU64::new(0),
        abandoned: AtomicU64::new(0),
        in_flight: AtomicU64::new(0),
    });
    Ok(Router::new()
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{model}", get(metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/metrics", get(metrics))
        .with_state(state))
}

/// A no-op model server: answers every inference at once with a fixed result, no batching
/// and no simulated GPU time. The benchmarks measure the router against it.
pub fn noop_app(model: String) -> Router {
    let body: Arc<str> = Arc::from(
        json!({
            "model_name": model,
            "model_version": "1",
            "outputs": [{"name": "output0", "datatype": "FP32", "shape": [1], "data": [0.0]}],
        })
        .to_string(),
    );
    Router::new()
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route(
            "/v2/models/{model}/infer",
            post(move |_body: axum::body::Bytes| {
                let body = body.clone();
                async move {
                    (
                        [
                            (axum::http::header::CONTENT_TYPE, "application/json"),
                            (axum::http::HeaderName::from_static(GPU_MS_HEADER), "0.000"),
                        ],
                        body.to_string(),
                    )
                }
            }),
        )
}

fn error(status: StatusCode, msg: String) -> Response {
    (status, Json(json!({ "error": msg }))).into_response()
}

fn is_ready(s: &AppState) -> bool {
    s.started.elapsed() >= s.cfg.faults.slow_start
}

async fn ready(State(s): State<Arc<AppState>>) -> StatusCode {
    if is_ready(&s) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

fn check_model(s: &AppState, model: &str) -> Result<(), Response> {
    if model == s.cfg.model {
        Ok(())
    } else {
        Err(error(
            StatusCode::NOT_FOUND,
            format!(
                "model {model:?} is not served here; this server serves {:?}",
                s.cfg.model
            ),
        ))
    }
}

async fn metadata(State(s): State<Arc<AppState>>, Path(model): Path<String>) -> Response {
    if let Err(r) = check_model(&s, &model) {
        return r;
    }
    Json(json!({
        "name": s.cfg.model,
        "versions": ["1"],
        "platform": "laneway-sim",
        "inputs": [{"name": "input0", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "output0", "datatype": "FP32", "shape": [-1]}],
    }))
    .into_response()
}

async fn model_ready(State(s): State<Arc<AppState>>, Path(model): Path<String>) -> Response {
    if let Err(r) = check_model(&s, &model) {
        return r;
    }
    if is_ready(&s) {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

/// The simulated model's answer: its first input, as `output0` with the input's datatype and
/// shape, the data as JSON (a binary input decoded from `tensors`, the bytes after the JSON
/// part). An input it cannot decode is answered as an empty FP32 tensor.
fn echo_first_input(request: &Value, tensors: &[u8]) -> (Value, Value, Value) {
    let Some(first) = request.get("inputs").and_then(|i| i.get(0)) else {
        return (json!("FP32"), json!([0]), json!([]));
    };
    let datatype = first.get("datatype").cloned().unwrap_or(json!("FP32"));
    let shape = first.get("shape").cloned().unwrap_or(json!([1]));
    if let Some(data) = first.get("data") {
        return (datatype, shape, data.clone());
    }
    let size = first
        .pointer("/parameters/binary_data_size")
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok());
    let decoded = size
        .and_then(|n| tensors.get(..n))
        .zip(datatype.as_str())
        .and_then(|(bytes, dt)| laneway_core::kserve::decode(dt, bytes));
    match decoded {
        Some(values) => (datatype, shape, Value::Array(values)),
        None => (json!("FP32"), json!([0]), json!([])),
    }
}

async fn infer(
    State(s): State<Arc<AppState>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Err(r) = check_model(&s, &model) {
        return r;
    }
    if !is_ready(&s) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "model is still starting".into());
    }
    // The binary tensor data extension: a JSON part of the header's length, then the tensors.
    let (json_part, tensors) = match headers.get(laneway_core::kserve::INFERENCE_HEADER) {
        None => (&body[..], &[][..]),
        Some(v) => match laneway_core::kserve::json_part_len(v.as_bytes())
            .and_then(|n| laneway_core::kserve::split_binary(&body, n))
        {
            Ok(split) => split,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        },
    };
    let request: Value = match serde_json::from_slice(json_part) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the body must be a JSON object with `inputs`".into(),
            )
        }
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("the body is not valid JSON: {e}")),
    };
    let _in_flight = InFlight::new(&s.in_flight);
    let n = s.served.fetch_add(1, Ordering::SeqCst) + 1;
    if s.cfg.faults.crash_after.is_some_and(|c| n > c) {
        tracing::error!(
            served = n - 1,
            "crash-after reached: exiting as a crashed model server would"
        );
        std::process::exit(101);
    }
    if s.cfg.faults.hang_after.is_some_and(|h| n > h) {
        // A hung server: accept the connection, never answer.
        std::future::pending::<()>().await;
    }
    let fail = {
        let mut rng = s.rng.lock().unwrap_or_else(|p| p.into_inner());
        rng.random_bool(s.cfg.faults.error_rate)
    };
    // The router says how long its caller still waits: past that, nobody reads the answer,
    // so a real model server stops working on it.
    let deadline = headers
        .get(TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis);
    let work = s.batcher.infer();
    let outcome = match deadline {
        Some(d) => match tokio::time::timeout(d, work).await {
            Ok(r) => r,
            Err(_) => {
                s.abandoned.fetch_add(1, Ordering::SeqCst);
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "the router's deadline ({} ms) passed before the answer; stopped",
                        d.as_millis()
                    ),
                );
            }
        },
        None => work.await,
    };
    let Some(result) = outcome else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the simulated GPU stopped".into());
    };
    let mut headers = HeaderMap::new();
    headers.insert(
        GPU_MS_HEADER,
        HeaderValue::from_str(&format!("{:.3}", result.gpu_ms)).expect("ascii"),
    );
    headers.insert(BATCH_SIZE_HEADER, HeaderValue::from(result.batch_size as u64));
    if fail {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            headers,
            Json(json!({"error": "injected failure"})),
        )
            .into_response();
    }
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let (datatype, shape, echoed) = echo_first_input(&request, tensors);
    (
        headers,
        Json(json!({
            "model_name": s.cfg.model,
            "model_version": "1",
            "id": id,
            "outputs": [{"name": "output0", "datatype": datatype, "shape": shape, "data": echoed}],
            "parameters": {"batch_size": result.batch_size, "queue_ms": result.queue_ms},
        })),
    )
        .into_response()
}
