//! The steps every request takes before its body is known, whatever protocol brought it: who
//! asks (the tenant's key), which route serves it (or its fallback, or the class's canned
//! answer), reading and checking the body, and the lane's refusals with an honest Retry-After.
//! The steps after reading are [`super::flight`]'s. The protocol files (`http` for
//! KServe v2, `llm` for OpenAI, `jobs`) only translate.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;
use tokio::time::Instant;

use super::answer::{error, stamp, with_retry_after, Meta, DEGRADED};
use super::table::{ModelRoute, Table, TenantRoute};
use super::{Refusal, Router};
use laneway_core::registry::hash_key;

/// The route that answers a request for `route` at `now_ms`: itself while it has a healthy
/// replica; else its fallback model if that one has (and the request's path `accepts` it);
/// else `Err` with the class's canned answer when it configures one and the request can take
/// it (`canned`; marked degraded, metered to `tenant` as a request no replica served), or
/// itself (refused as usual).
pub fn healthy_or_fallback(
    router: &Router,
    table: &Table,
    route: &Arc<ModelRoute>,
    tenant: &TenantRoute,
    meta: &mut Meta,
    accepts: impl Fn(&ModelRoute) -> bool,
    canned: bool,
) -> Result<Arc<ModelRoute>, Response> {
    let now_ms = router.now_ms(Instant::now());
    if route.is_healthy(now_ms) {
        return Ok(route.clone());
    }
    let fallback = route.fallback.as_deref().and_then(|f| table.route(f, now_ms));
    if let Some(fb) = fallback
        .filter(|f| f.is_healthy(now_ms) && f.class.lane != laneway_core::registry::LaneKind::Durable && accepts(f))
    {
        tracing::debug!(model = %route.public, fallback = %fb.public, "no healthy replica: the fallback model answers");
        meta.fallback_for = HeaderValue::from_str(&route.public).ok();
        meta.lane = Some(fb.class.lane.as_str());
        meta.class = Some(fb.class_header.clone());
        meta.version = Some(fb.version_header.clone());
        return Ok(fb);
    }
    if let Some(canned) = route.class.fallback_response.as_ref().filter(|_| canned) {
        let status = StatusCode::from_u16(canned.status).unwrap_or(StatusCode::OK);
        let mut r = (status, canned.body.clone()).into_response();
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r.headers_mut()
            .insert(DEGRADED, HeaderValue::from_static("fallback-response"));
        stamp(r.headers_mut(), meta);
        let mut record = super::record_for(&meta.request_id, route, &tenant.name);
        record.status = status.as_u16();
        record.degraded = true;
        router.record(record);
        return Err(r);
    }
    Ok(route.clone())
}

/// Authenticates the bearer API key.
pub fn authenticate(table: &Table, headers: &HeaderMap, meta: &Meta) -> Result<Arc<TenantRoute>, Response> {
    let Some(value) = headers.get(axum::http::header::AUTHORIZATION) else {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "missing API key: send `Authorization: Bearer <key>` (`lanectl tenant create` issues keys)".into(),
            meta,
        ));
    };
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .unwrap_or_default();
    if key.is_empty() {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "the Authorization header must be `Bearer <key>`".into(),
            meta,
        ));
    }
    table.tenants.get(&hash_key(key)).cloned().ok_or_else(|| {
        error(
            StatusCode::UNAUTHORIZED,
            "unknown API key (rotated or mistyped?); `lanectl tenant rotate-key` issues a new one".into(),
            meta,
        )
    })
}

pub fn lookup(router: &Router, table: &Table, model: &str, meta: &mut Meta) -> Result<Arc<ModelRoute>, Response> {
    let route = table.route(model, router.now_ms(Instant::now())).ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            format!("model {model:?} is not registered; `lanectl model list` shows the models"),
            meta,
        )
    })?;
    meta.lane = Some(route.class.lane.as_str());
    meta.class = Some(route.class_header.clone());
    meta.version = Some(route.version_header.clone());
    Ok(route)
}

/// The Open Inference Protocol request, checked field by field before it costs a replica slot.
/// Tensor data is not inspected (only required), so checking costs no copy of it.
#[derive(Deserialize)]
#[allow(dead_code)]
pub struct InferRequest {
    #[serde(default)]
    id: Option<String>,
    inputs: Vec<InferInput>,
    #[serde(default)]
    parameters: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    outputs: Option<Vec<IgnoredAny>>,
}

#[derive(Deserialize)]
#[allow(dead_code)]
struct InferInput {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<IgnoredAny>,
    data: IgnoredAny,
}

pub fn check_body(body: &[u8]) -> Result<InferRequest, String> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            format!("invalid inference request: {inner}")
        } else {
            format!("invalid inference request at `{path}`: {inner}")
        }
    })
}

/// The request body, read now that the request's key was checked (within the router's limits
/// and deadline, counted from `since`, when the handler began), with its share of the budget
/// of bodies in flight; or the answer to a body that could not be read. `what_to_do` says what
/// a client whose body is too large can send instead.
pub async fn read_body(
    router: &Router,
    body: Body,
    headers: &HeaderMap,
    since: Instant,
    what_to_do: &str,
    meta: &Meta,
) -> Result<(Bytes, super::body::BodyShare), Response> {
    router
        .bodies()
        .read(body, headers, since)
        .await
        .map_err(|e| e.response(what_to_do, meta))
}

pub fn refusal_response(refusal: &Refusal, route: &ModelRoute, meta: &Meta) -> Response {
    match refusal {
        Refusal::NoSlot { retry_after } => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "every replica of {} is busy and the {} lane has no queue; retry after the Retry-After",
                    route.name, route.class.name
                ),
                meta,
            ),
            *retry_after,
        ),
        Refusal::OverBudget {
            retry_after,
            expected_wait,
        } => with_retry_after(
            error(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the {} queue would make this request wait about {} ms, over its budget; retry after the Retry-After",
                    route.class.name,
                    expected_wait.as_millis()
                ),
                meta,
            ),
            *retry_after,
        ),
        Refusal::Expired { waited } => error(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "queued {} ms without a free replica, past the {} lane's budget",
                waited.as_millis(),
                route.class.name
            ),
            meta,
        ),
        Refusal::NoReplica => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("model {} has no ready replica yet", route.name),
                meta,
            ),
            super::NO_REPLICA_RETRY,
        ),
        Refusal::AllEjected => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "every replica of {} failed a recent request and is skipped until it answers a health probe; retry after the Retry-After",
                    route.name
                ),
                meta,
            ),
            super::table::PROBE_EVERY.max(Duration::from_secs(1)),
        ),
        Refusal::Durable => error(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "model {} is in the durable class {}: durable lanes take jobs (POST /v1/jobs, issue #5), not synchronous requests",
                route.name, route.class.name
            ),
            meta,
        ),
    }
}
