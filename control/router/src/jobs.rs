//! The durable lane's HTTP face: submit (`POST /v1/jobs`, or `POST /v2/models/{m}/infer` on a
//! durable model), read (`GET /v1/jobs`, `GET /v1/jobs/{id}`), cancel (`DELETE /v1/jobs/{id}`)
//! and fetch the result (`GET /v1/jobs/{id}/result`). A submission is answered `202` only
//! after it is committed through Raft.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::answer::{error, request_id, stamp, with_retry_after, Meta};
use super::pipeline::{authenticate, check_body, lookup, read_body};
use super::table::{ModelRoute, TenantRoute};
use super::{unix_ms, Router};
use laneway_core::jobs::{GatewayError, JobWrite};
use laneway_core::jobs::{
    Job, JobOutcome, JobState, JobSubmission, DEFAULT_MAX_ATTEMPTS, MAX_ATTEMPTS_LIMIT, MAX_IDEMPOTENCY_KEY_BYTES,
    MAX_INLINE_INPUT_BYTES,
};
use laneway_core::registry::LaneKind;

/// Header a client sets so that resubmitting returns the same job.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Longest Retry-After the router gives a durable submission.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// Most jobs `GET /v1/jobs` returns.
const LIST_LIMIT: usize = 1000;

/// `POST /v1/jobs` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SubmitBody {
    model: String,
    /// The inference request the job runs (an Open Inference Protocol request).
    #[serde(default)]
    input: Option<Value>,
    /// Or a URL of it, for inputs over 64 KiB.
    #[serde(default)]
    input_uri: Option<String>,
    #[serde(default)]
    max_attempts: Option<u32>,
}

/// What a job looks like to its tenant.
pub fn view(job: &Job) -> Value {
    let result = job.result.as_ref().map(|r| {
        json!({
            "location": format!("/v1/jobs/{}/result", job.id),
            "bytes": r.bytes,
            "content_type": r.content_type,
            "gpu_seconds": r.gpu_us as f64 / 1e6,
        })
    });
    json!({
        "job_id": job.id,
        "model": job.model,
        "class": job.class,
        "state": job.state,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "failures": job.failures,
        "submitted_unix_ms": job.submitted_ms,
        "assigned_unix_ms": job.assigned_ms,
        "started_unix_ms": job.started_ms,
        "finished_unix_ms": job.finished_ms,
        "node": job.node,
        "replica": job.replica,
        "result": result,
    })
}

fn meta_for(headers: &HeaderMap) -> Meta {
    Meta {
        request_id: request_id(headers),
        lane: Some("durable"),
        ..Meta::default()
    }
}

fn json_response(status: StatusCode, body: Value, meta: &Meta) -> Response {
    let mut r = (status, Json(body)).into_response();
    stamp(r.headers_mut(), meta);
    r
}

fn clamp(d: Duration) -> Duration {
    d.min(MAX_RETRY_AFTER).max(Duration::from_secs(1))
}

impl Router {
    /// How long the queued jobs of `route`'s model take to drain at the ready replicas'
    /// throughput: queued jobs × service time ÷ job slots (`None` with no ready replica).
    pub fn durable_drain(&self, route: &ModelRoute) -> (usize, Option<Duration>) {
        let queued = self.sm.job_counts(&route.name).queued;
        let per_s = route.capacity_per_s();
        let drain = (per_s > 0.0).then(|| Duration::from_secs_f64(queued as f64 / per_s));
        (queued, drain)
    }
}

impl Router {
    /// The job queue of a durable lane's models, for `lane show`.
    pub(super) fn durable_status(&self, routes: &[&Arc<ModelRoute>]) -> Value {
        let (mut queued, mut assigned, mut running) = (0usize, 0usize, 0usize);
        let mut drain_s: Option<f64> = Some(0.0);
        for route in routes {
            let (q, drain) = self.durable_drain(route);
            queued += q;
            drain_s = match (drain_s, drain) {
                (Some(a), Some(d)) => Some(a.max(d.as_secs_f64())),
                (_, None) if q > 0 => None,
                (a, _) => a,
            };
            let counts = self.sm.job_counts(&route.name);
            running += counts.running;
            assigned += counts.assigned;
        }
        json!({ "queued": queued, "assigned": assigned, "running": running,
                "drain_s": drain_s.map(|d| (d * 10.0).round() / 10.0) })
    }
}

/// What a client asked to run, as either jobs path reads it.
pub(super) struct JobInput {
    /// The inference request (inline), or the URI it is read from.
    pub input: Result<String, String>,
    /// sha256 of the request body: what a reused Idempotency-Key is compared with.
    pub body_sha256: String,
    pub max_attempts: u32,
}

/// Submits one job for `route`'s model.
pub(super) async fn submit(
    router: &Arc<Router>,
    tenant: &TenantRoute,
    route: &ModelRoute,
    asked: JobInput,
    headers: &HeaderMap,
    meta: &Meta,
) -> Response {
    let JobInput {
        input,
        body_sha256,
        max_attempts,
    } = asked;
    let Some(gateway) = router.jobs.get() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this router takes no durable jobs (it runs without a controller)".into(),
            meta,
        );
    };
    let class = &route.class;
    let now = tokio::time::Instant::now();
    // The tenant's request rate applies to submissions like to any request; its ceiling on
    // jobs queued or running is counted in the state machine below.
    let retry_hint = route.min_service().unwrap_or(Duration::from_secs(1));
    let _hold = match router.admit_tenant(tenant, class, retry_hint, now) {
        Ok(g) => g,
        Err((wait, why)) => {
            route.lane.lock().counters.throttled += 1;
            return with_retry_after(error(StatusCode::TOO_MANY_REQUESTS, why, meta), wait);
        }
    };
    // Protect the more protected lanes first, and never accept a job the queue cannot start
    // within the lane's budget: say honestly when it could.
    let (queued, drain) = router.durable_drain(route);
    let budget = class.budget_ms.as_duration();
    let over_budget = drain.is_some_and(|d| !budget.is_zero() && d > budget);
    if router.fleet_short_for(class.protection_rank, now) || over_budget {
        let wait = match drain {
            Some(d) if over_budget => d.saturating_sub(budget),
            Some(d) => d,
            None => super::NO_REPLICA_RETRY,
        };
        route.lane.lock().counters.shed += 1;
        return with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the {} lane is shedding new jobs: {queued} queued for {} drain in about {} s{}; jobs already accepted keep running — retry after the Retry-After",
                    class.name,
                    route.name,
                    drain.map_or(0, |d| d.as_secs()),
                    if over_budget {
                        format!(", over the lane's {} s budget", budget.as_secs())
                    } else {
                        ", and a more protected lane is short of capacity".into()
                    }
                ),
                meta,
            ),
            clamp(wait),
        );
    }
    let idempotency_key = match headers.get(IDEMPOTENCY_KEY).map(|v| v.to_str()) {
        None => None,
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_BYTES => Some(k.to_string()),
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY_BYTES} visible ASCII characters"),
                meta,
            )
        }
    };
    let (input, input_uri) = match input {
        Ok(inline) => (Some(inline), None),
        Err(uri) => (None, Some(uri)),
    };
    let submission = JobSubmission {
        // 128 random bits from the thread's seeded generator (no getrandom call per job).
        id: format!("{:032x}", rand::random::<u128>()),
        tenant: tenant.name.clone(),
        model: route.name.clone(),
        class: class.name.clone(),
        input,
        input_uri,
        idempotency_key,
        body_sha256,
        max_attempts,
        at_ms: unix_ms(),
    };
    if let Err(e) = submission.validate() {
        return error(StatusCode::BAD_REQUEST, e.to_string(), meta);
    }
    // The agents fetch an input with their own credentials: only from where the operator
    // allowed this class's jobs to name one.
    if let Some(uri) = &submission.input_uri {
        if let Err(e) = class.check_input_uri(uri) {
            return error(StatusCode::BAD_REQUEST, e.to_string(), meta);
        }
    }
    #[cfg(feature = "testing")]
    fail::fail_point!("router::ack_before_commit", |_| {
        planted_ack_before_commit(router, gateway, &submission, meta)
    });
    match gateway.write(JobWrite::Submit(submission)).await {
        Ok(JobOutcome::Created { id }) => {
            route.lane.lock().counters.admitted += 1;
            accepted(router, &id, false, meta)
        }
        Ok(JobOutcome::Existing { id }) => accepted(router, &id, true, meta),
        Ok(JobOutcome::OverCeiling { active, limit }) => {
            // A slot frees when one of the tenant's jobs finishes: about one service time.
            let wait = route.min_service().unwrap_or(Duration::from_secs(5));
            route.lane.lock().counters.throttled += 1;
            with_retry_after(
                error(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "tenant {} has {active} jobs queued or running on the {} lane, its ceiling of {limit}; retry after the Retry-After",
                        tenant.name, class.name
                    ),
                    meta,
                ),
                clamp(wait),
            )
        }
        Ok(JobOutcome::KeyConflict { id }) => error(
            StatusCode::CONFLICT,
            format!("Idempotency-Key was already used for job {id} with a different body; use a new key for a new job"),
            meta,
        ),
        Ok(other) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("unexpected outcome of a submission: {other:?}"),
            meta,
        ),
        Err(GatewayError::Unavailable(why)) => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{why}; resubmit with the same Idempotency-Key to be sure of one job"),
                meta,
            ),
            Duration::from_secs(1),
        ),
        Err(GatewayError::Rejected(why)) => error(StatusCode::BAD_REQUEST, why, meta),
    }
}

/// The chaos harness's planted bug (testing builds only, failpoint `router::ack_before_commit`):
/// acknowledges the job at once and commits it a second later in the background, which is
/// exactly what the durable lane must never do. A router killed within that second loses jobs
/// it acknowledged; `laneway-chaos run chaos/scenarios/planted` proves the checkers see it.
#[cfg(feature = "testing")]
fn planted_ack_before_commit(
    router: &Router,
    gateway: &Arc<dyn crate::host::JobSink>,
    submission: &laneway_core::jobs::JobSubmission,
    meta: &Meta,
) -> Response {
    let (gateway, submission) = (gateway.clone(), submission.clone());
    let id = submission.id.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = gateway.write(JobWrite::Submit(submission)).await;
    });
    accepted(router, &id, false, meta)
}

fn accepted(router: &Router, id: &str, replay: bool, meta: &Meta) -> Response {
    let location = format!("/v1/jobs/{id}");
    // A follower may not have applied the submission yet: then it is queued. Read in place:
    // a copy of the job (its input included) only for its state costs every submission.
    let mut state = JobState::Queued;
    router.sm.visit_jobs(&mut |jobs, _, _| {
        if let Some(j) = jobs.get(id) {
            state = j.state;
        }
    });
    let mut r = json_response(
        StatusCode::ACCEPTED,
        json!({ "job_id": id, "state": state, "location": location, "idempotent_replay": replay }),
        meta,
    );
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(axum::http::header::LOCATION, v);
    }
    r
}

fn too_large(len: usize, meta: &Meta) -> Response {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "the job input is {len} bytes, over the {MAX_INLINE_INPUT_BYTES}-byte inline limit; upload it and submit {{\"model\": …, \"input_uri\": \"s3://…\"}} to POST /v1/jobs"
        ),
        meta,
    )
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// `POST /v2/models/{model}/infer` on a durable model: the request itself is the job's input.
pub(super) async fn submit_infer(
    router: &Arc<Router>,
    tenant: &TenantRoute,
    route: &ModelRoute,
    body: Bytes,
    headers: &HeaderMap,
    meta: &Meta,
) -> Response {
    if body.len() > MAX_INLINE_INPUT_BYTES {
        return too_large(body.len(), meta);
    }
    let Ok(text) = std::str::from_utf8(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "the request body is not UTF-8 JSON".into(),
            meta,
        );
    };
    let asked = JobInput {
        input: Ok(text.to_string()),
        body_sha256: sha256_hex(&body),
        max_attempts: DEFAULT_MAX_ATTEMPTS,
    };
    submit(router, tenant, route, asked, headers, meta).await
}

/// `POST /v1/jobs`.
pub(super) async fn post_job(State(router): State<Arc<Router>>, headers: HeaderMap, body: Body) -> Response {
    let since = tokio::time::Instant::now();
    let mut meta = meta_for(&headers);
    let table = router.table();
    let tenant = match authenticate(&table, &headers, &meta) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let (body, _body_share) =
        match read_body(&router, body, &headers, since, "submit a job with input_uri", &meta).await {
            Ok(b) => b,
            Err(r) => return r,
        };
    let de = &mut serde_json::Deserializer::from_slice(&body);
    let req: SubmitBody = match serde_path_to_error::deserialize(de) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "invalid job at `{}`: {}; send {{\"model\": \"…\", \"input\": {{…}}}} or {{\"model\": \"…\", \"input_uri\": \"…\"}}",
                    e.path(),
                    e.inner()
                ),
                &meta,
            )
        }
    };
    let route = match lookup(&router, &table, &req.model, None, &mut meta) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if route.class.lane != LaneKind::Durable {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "model {} is in the {} lane {}, which takes requests, not jobs: POST /v2/models/{}/infer",
                route.name, route.class.lane, route.class.name, route.name
            ),
            &meta,
        );
    }
    let max_attempts = req.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("max_attempts = {max_attempts}: give 1-{MAX_ATTEMPTS_LIMIT}"),
            &meta,
        );
    }
    let input = match (req.input, req.input_uri) {
        (Some(v), None) => {
            let text = v.to_string();
            if text.len() > MAX_INLINE_INPUT_BYTES {
                return too_large(text.len(), &meta);
            }
            if let Err(e) = check_body(text.as_bytes(), &HeaderMap::new()) {
                return error(StatusCode::BAD_REQUEST, format!("`input`: {e}"), &meta);
            }
            Ok(text)
        }
        (None, Some(uri)) if !uri.is_empty() && uri.len() <= 2048 => Err(uri),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "give exactly one of `input` (the inference request) or `input_uri` (up to 2048 bytes)".into(),
                &meta,
            )
        }
    };
    // The body (not the generated job id) is what a reused Idempotency-Key is compared with.
    let asked = JobInput {
        input,
        body_sha256: sha256_hex(&body),
        max_attempts,
    };
    submit(&router, &tenant, &route, asked, &headers, &meta).await
}

/// The tenant's job, or a 404 that does not reveal other tenants' jobs. A miss catches up with
/// the leader first: the job may have been acknowledged a moment ago through another router.
async fn owned_job(router: &Router, tenant: &TenantRoute, id: &str, meta: &Meta) -> Result<Job, Response> {
    let mine = |j: &Job| j.tenant == tenant.name;
    if let Some(read) = router.jobs.get().and_then(|g| g.fetch_job(&tenant.name, id)) {
        // A router-only process: the cluster holds the jobs.
        let found = read.await.map_err(|why| {
            with_retry_after(
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the job cannot be read now: {why}; retry after the Retry-After"),
                    meta,
                ),
                Duration::from_secs(1),
            )
        })?;
        return found.filter(mine).ok_or_else(|| not_found(tenant, id, meta));
    }
    if let Some(job) = router.sm.job(id).filter(mine) {
        return Ok(job);
    }
    if let Some(gateway) = router.jobs.get() {
        gateway.catch_up().await;
    }
    router
        .sm
        .job(id)
        .filter(mine)
        .ok_or_else(|| not_found(tenant, id, meta))
}

fn not_found(tenant: &TenantRoute, id: &str, meta: &Meta) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!(
            "no job {id} for tenant {} (finished jobs are kept for the retention period)",
            tenant.name
        ),
        meta,
    )
}

fn tenant_of(router: &Router, headers: &HeaderMap, meta: &Meta) -> Result<Arc<TenantRoute>, Response> {
    authenticate(&router.table(), headers, meta)
}

/// What every `/v1/jobs/{id}` handler starts with: the response meta, and the calling
/// tenant's job (or the 401/404 to answer).
async fn tenant_job(router: &Router, headers: &HeaderMap, id: &str) -> Result<(Meta, Job), Response> {
    let meta = meta_for(headers);
    let tenant = tenant_of(router, headers, &meta)?;
    let job = owned_job(router, &tenant, id, &meta).await?;
    Ok((meta, job))
}

/// `GET /v1/jobs/{id}`.
pub(super) async fn get_job(State(router): State<Arc<Router>>, Path(id): Path<String>, headers: HeaderMap) -> Response {
    match tenant_job(&router, &headers, &id).await {
        Ok((meta, job)) => json_response(StatusCode::OK, view(&job), &meta),
        Err(r) => r,
    }
}

#[derive(Deserialize)]
pub(super) struct ListQuery {
    state: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/jobs?state=…&limit=…`: the tenant's jobs, newest first.
pub(super) async fn list_jobs(
    State(router): State<Arc<Router>>,
    Query(q): Query<ListQuery>,
    headers: HeaderMap,
) -> Response {
    let meta = meta_for(&headers);
    let tenant = match tenant_of(&router, &headers, &meta) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let state = match q.state.as_deref().map(|s| serde_json::from_value::<JobState>(json!(s))) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "state must be one of queued, assigned, running, succeeded, failed, cancelled".into(),
                &meta,
            )
        }
    };
    let limit = q.limit.unwrap_or(100).min(LIST_LIMIT);
    if let Some(read) = router.jobs.get().and_then(|g| g.fetch_jobs(&tenant.name, state, limit)) {
        return match read.await {
            Ok(jobs) => {
                let jobs: Vec<Value> = jobs.iter().filter(|j| j.tenant == tenant.name).map(view).collect();
                json_response(StatusCode::OK, json!({ "jobs": jobs }), &meta)
            }
            Err(why) => with_retry_after(
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the jobs cannot be read now: {why}; retry after the Retry-After"),
                    &meta,
                ),
                Duration::from_secs(1),
            ),
        };
    }
    let jobs: Vec<Value> = router.sm.with_jobs(|jobs, _, _| {
        // The tenant's own jobs only (an index, newest first): never a scan of every tenant's.
        jobs.of_tenant(&tenant.name)
            .filter(|j| state.is_none_or(|s| j.state == s))
            .take(limit)
            .map(view)
            .collect()
    });
    json_response(StatusCode::OK, json!({ "jobs": jobs }), &meta)
}

/// `DELETE /v1/jobs/{id}`: cancels; a finished job is a no-op with a clear answer.
pub(super) async fn cancel_job(
    State(router): State<Arc<Router>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let meta = match tenant_job(&router, &headers, &id).await {
        Ok((meta, _)) => meta,
        Err(r) => return r,
    };
    let Some(gateway) = router.jobs.get() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this router takes no durable jobs".into(),
            &meta,
        );
    };
    let write = JobWrite::Cancel {
        job_id: id.clone(),
        at_ms: unix_ms(),
    };
    match gateway.write(write).await {
        Ok(JobOutcome::Cancelled { from }) => json_response(
            StatusCode::OK,
            json!({ "job_id": id, "state": JobState::Cancelled, "cancelled_from": from,
                    "message": format!("cancelled while {from}; a running attempt is stopped on its replica") }),
            &meta,
        ),
        Ok(JobOutcome::AlreadyFinished { state }) => json_response(
            StatusCode::OK,
            json!({ "job_id": id, "state": state,
                    "message": format!("the job had already finished ({state}); nothing was cancelled") }),
            &meta,
        ),
        Ok(other) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("unexpected outcome of a cancel: {other:?}"),
            &meta,
        ),
        Err(GatewayError::Unavailable(why)) => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{why}; a cancel is safe to repeat"),
                &meta,
            ),
            Duration::from_secs(1),
        ),
        Err(GatewayError::Rejected(why)) => error(StatusCode::NOT_FOUND, why, &meta),
    }
}

/// `GET /v1/jobs/{id}/result`: the published result object.
pub(super) async fn get_result(
    State(router): State<Arc<Router>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let (meta, job) = match tenant_job(&router, &headers, &id).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let Some(result) = job.result.as_ref().filter(|_| job.state == JobState::Succeeded) else {
        let status = if job.state.is_terminal() {
            StatusCode::NOT_FOUND
        } else {
            StatusCode::CONFLICT
        };
        return error(
            status,
            if job.state.is_terminal() {
                format!("job {id} is {} and has no result", job.state)
            } else {
                format!(
                    "job {id} is {} and has no result yet; poll GET /v1/jobs/{id}",
                    job.state
                )
            },
            &meta,
        );
    };
    let Some(store) = router.results.get() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this router has no results store".into(),
            &meta,
        );
    };
    match store.get(&result.key).await {
        Ok(bytes) => {
            let mut r = (StatusCode::OK, bytes).into_response();
            if let Ok(v) = HeaderValue::from_str(&result.content_type) {
                r.headers_mut().insert(axum::http::header::CONTENT_TYPE, v);
            }
            stamp(r.headers_mut(), &meta);
            r
        }
        Err(e) => error(
            StatusCode::BAD_GATEWAY,
            format!(
                "the result of job {id} could not be read from the results store {}: {e}",
                store.location()
            ),
            &meta,
        ),
    }
}
