//! Open-loop traffic: Poisson arrivals (plus bursts) with the scenario's lane mix over several
//! tenants, spread over every controller's router. Every request, its answer and every
//! acknowledged job go to the history (kept in memory for the checkers and written as JSON
//! lines).
//!
//! A client that cannot connect to one router (it is dead), or that a router turns away
//! because it is still catching up with the cluster (nothing was done), tries the next, as a
//! real client with several endpoints would; any other answer, or a connection lost after the
//! request went out, is final: the request is not retried.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::time::Instant;

use super::scenario::Traffic;
use crate::support::http::{client, HttpClient};

/// The three lanes of the mix, each with the model the harness registers for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Sync,
    Bounded,
    Durable,
}

impl Lane {
    pub const ALL: [Lane; 3] = [Lane::Sync, Lane::Bounded, Lane::Durable];

    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Sync => "sync",
            Lane::Bounded => "bounded",
            Lane::Durable => "durable",
        }
    }

    pub fn model(self) -> &'static str {
        match self {
            Lane::Sync => "chat",
            Lane::Bounded => "embed",
            Lane::Durable => "clip",
        }
    }

    /// The class's request timeout (see `setup::register`).
    pub fn timeout(self) -> Duration {
        match self {
            Lane::Sync => Duration::from_millis(3000),
            Lane::Bounded => Duration::from_millis(5000),
            Lane::Durable => Duration::from_millis(5000),
        }
    }
}

/// One request of the history.
#[derive(Debug, Clone, Serialize)]
pub struct Request {
    /// When it was due (open loop), ms since the traffic started.
    pub at_ms: u64,
    pub lane: Lane,
    pub tenant: String,
    /// The router that answered (or the last one tried).
    pub router: String,
    /// HTTP status; 0 when no answer came.
    pub status: u16,
    pub latency_ms: f64,
    /// Still unanswered past the lane's timeout plus the grace.
    pub hung: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The job id of an acknowledged (202) durable submission.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
}

impl Request {
    pub fn ok(&self) -> bool {
        matches!(self.status, 200 | 202)
    }
}

/// Tenants (name, API key) and the routers to send to; the router list changes when a
/// controller is replaced.
#[derive(Clone)]
pub struct Targets {
    pub tenants: Arc<Vec<(String, String)>>,
    pub routers: Arc<RwLock<Vec<String>>>,
}

pub struct Load {
    pub history: Arc<Mutex<Vec<Request>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

/// What a router that has not caught up with the cluster answers (see `until_caught_up` in
/// control/src/router/http.rs): the request was not served, another router may take it.
const CATCHING_UP: &str = "is catching up with the cluster";

const INFER: &str = r#"{"inputs":[{"name":"x","shape":[4],"datatype":"FP32","data":[0.1,0.2,0.3,0.4]}]}"#;

fn body(lane: Lane, n: u64) -> Bytes {
    match lane {
        Lane::Durable => Bytes::from(format!(
            r#"{{"model":"clip","input":{{"inputs":[{{"name":"prompt","shape":[1],"datatype":"BYTES","data":["chaos job {n}"]}}]}}}}"#
        )),
        _ => Bytes::from_static(INFER.as_bytes()),
    }
}

fn path(lane: Lane) -> String {
    match lane {
        Lane::Durable => "/v1/jobs".into(),
        l => format!("/v2/models/{}/infer", l.model()),
    }
}

/// Starts open-loop traffic drawn from `seed`.
pub fn start(spec: &Traffic, seed: u64, targets: Targets, hang_grace: Duration) -> Load {
    let history: Arc<Mutex<Vec<Request>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let task = {
        let (spec, history, stop) = (spec.clone(), history.clone(), stop.clone());
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x7472_6166);
            let http = client(512);
            let start = Instant::now();
            let mut due = 0.0f64;
            let mut n = 0u64;
            let total = (spec.mix.sync + spec.mix.bounded + spec.mix.durable) as f64;
            let mut tasks = tokio::task::JoinSet::new();
            while !stop.load(Ordering::SeqCst) {
                let rate = match spec.bursts {
                    Some(b) if due % b.every_s < b.length_s => spec.rate * b.factor,
                    _ => spec.rate,
                };
                // Exponential gap: -ln(U)/rate.
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                due += -u.ln() / rate;
                tokio::time::sleep_until(start + Duration::from_secs_f64(due)).await;
                let pick = rng.random_range(0.0..total);
                let lane = if pick < spec.mix.sync as f64 {
                    Lane::Sync
                } else if pick < (spec.mix.sync + spec.mix.bounded) as f64 {
                    Lane::Bounded
                } else {
                    Lane::Durable
                };
                let tenant = rng.random_range(0..targets.tenants.len());
                let first = rng.random_range(0..64usize);
                let (http, targets, history) = (http.clone(), targets.clone(), history.clone());
                let at_ms = (due * 1000.0) as u64;
                tasks.spawn(async move {
                    let r = send(&http, &targets, lane, tenant, first, n, at_ms, hang_grace).await;
                    history.lock().unwrap().push(r);
                });
                while tasks.try_join_next().is_some() {}
                n += 1;
            }
            while tasks.join_next().await.is_some() {}
            n
        })
    };
    Load { history, stop, task }
}

impl Load {
    /// Stops new arrivals, waits for every request in flight; the number sent.
    pub async fn stop(self) -> (u64, Vec<Request>) {
        self.stop.store(true, Ordering::SeqCst);
        let n = self.task.await.unwrap_or(0);
        let mut h = self.history.lock().unwrap().clone();
        h.sort_by_key(|r| r.at_ms);
        (n, h)
    }
}

#[allow(clippy::too_many_arguments)]
async fn send(
    http: &HttpClient,
    targets: &Targets,
    lane: Lane,
    tenant: usize,
    first: usize,
    n: u64,
    at_ms: u64,
    hang_grace: Duration,
) -> Request {
    let routers = targets.routers.read().unwrap().clone();
    let (tenant_name, key) = targets.tenants[tenant].clone();
    let started = Instant::now();
    let limit = lane.timeout() + hang_grace;
    let mut r = Request {
        at_ms,
        lane,
        tenant: tenant_name,
        router: String::new(),
        status: 0,
        latency_ms: 0.0,
        hung: false,
        error: None,
        job_id: None,
    };
    for k in 0..routers.len() {
        let router = &routers[(first + k) % routers.len()];
        r.router = router.clone();
        let req = hyper::Request::post(format!("http://{router}{}", path(lane)))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {key}"))
            .header("idempotency-key", format!("chaos-{n}"))
            .body(Full::new(body(lane, n)))
            .expect("request");
        let left = limit.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, http.request(req)).await {
            Err(_) => {
                r.hung = true;
                r.error = Some(format!("no answer within {} ms", limit.as_millis()));
                break;
            }
            Ok(Err(e)) if e.is_connect() => {
                r.error = Some(format!("connect: {e}"));
                continue;
            }
            Ok(Err(e)) => {
                r.error = Some(format!("{e}"));
                break;
            }
            Ok(Ok(resp)) => {
                r.status = resp.status().as_u16();
                let left = limit.saturating_sub(started.elapsed());
                match tokio::time::timeout(left, resp.into_body().collect()).await {
                    Err(_) => {
                        r.hung = true;
                        r.error = Some(format!("body not finished within {} ms", limit.as_millis()));
                    }
                    Ok(Err(e)) => r.error = Some(format!("reading the body: {e}")),
                    Ok(Ok(b)) => {
                        let b = b.to_bytes();
                        if r.status == 503 && k + 1 < routers.len() && String::from_utf8_lossy(&b).contains(CATCHING_UP)
                        {
                            r.error = Some(String::from_utf8_lossy(&b).into_owned());
                            continue;
                        }
                        if r.status == 202 {
                            r.job_id = serde_json::from_slice::<serde_json::Value>(&b)
                                .ok()
                                .and_then(|v| v["job_id"].as_str().map(String::from));
                        } else if !r.ok() {
                            r.error = Some(String::from_utf8_lossy(&b[..b.len().min(300)]).into_owned());
                        }
                    }
                }
                break;
            }
        }
    }
    r.latency_ms = started.elapsed().as_secs_f64() * 1000.0;
    r
}
