//! The steps every request takes before its body is known, whatever protocol brought it: who
//! asks (the tenant's key), which route serves it (or its fallback, or the class's canned
//! answer), reading and checking the body, and the lane's refusals with an honest Retry-After.
//! The steps after reading are [`super::flight`]'s. The protocol files (`http` for
//! KServe v2, `llm` for OpenAI, `jobs`) only translate.

use std::borrow::Cow;
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

use super::answer::{error, shed, stamp, with_retry_after, Meta, DEGRADED};
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

/// The route of `model` (during a rollout, the side this request draws), or of its `version`
/// when the request pins one; 404 when there is none.
pub fn lookup(
    router: &Router,
    table: &Table,
    model: &str,
    version: Option<&str>,
    meta: &mut Meta,
) -> Result<Arc<ModelRoute>, Response> {
    let found = match version {
        None => table.route(model, router.now_ms(Instant::now())),
        Some(v) => table.version(model, v),
    };
    let route = found.ok_or_else(|| {
        let msg = match version {
            Some(v) if table.route(model, 0).is_some() => format!(
                "model {model:?} has no version {v:?}; its versions are {:?} (`lanectl model show {model}`)",
                table.versions(model)
            ),
            _ => format!("model {model:?} is not registered; `lanectl model list` shows the models"),
        };
        error(StatusCode::NOT_FOUND, msg, meta)
    })?;
    meta.lane = Some(route.class.lane.as_str());
    meta.class = Some(route.class_header.clone());
    meta.version = Some(route.version_header.clone());
    Ok(route)
}

/// The Open Inference Protocol request, checked field by field before it costs a replica slot:
/// every input's elements agree with its shape and datatype, whether its data is JSON or (the
/// binary tensor data extension) bytes after the JSON header. JSON data is counted, never
/// copied.
#[derive(Deserialize)]
#[allow(dead_code)]
struct InferRequest<'a> {
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    inputs: Vec<InferInput<'a>>,
    #[serde(default)]
    parameters: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    outputs: Option<Vec<IgnoredAny>>,
}

#[derive(Deserialize)]
struct InferInput<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    shape: Vec<i64>,
    #[serde(borrow)]
    datatype: Cow<'a, str>,
    #[serde(default)]
    parameters: Option<InputParameters>,
    #[serde(default)]
    data: Option<DataCount>,
}

#[derive(Deserialize)]
struct InputParameters {
    #[serde(default)]
    binary_data_size: Option<u64>,
}

/// The number of elements of a tensor's JSON `data` (nested or flat arrays of scalars).
struct DataCount(u64);

impl<'de> Deserialize<'de> for DataCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Count;
        impl<'de> serde::de::Visitor<'de> for Count {
            type Value = DataCount;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of the tensor's elements")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<DataCount, A::Error> {
                let mut n = 0u64;
                while let Some(DataCount(k)) = seq.next_element()? {
                    n += k;
                }
                Ok(DataCount(n))
            }
            fn visit_bool<E>(self, _: bool) -> Result<DataCount, E> {
                Ok(DataCount(1))
            }
            fn visit_i64<E>(self, _: i64) -> Result<DataCount, E> {
                Ok(DataCount(1))
            }
            fn visit_u64<E>(self, _: u64) -> Result<DataCount, E> {
                Ok(DataCount(1))
            }
            fn visit_f64<E>(self, _: f64) -> Result<DataCount, E> {
                Ok(DataCount(1))
            }
            fn visit_str<E>(self, _: &str) -> Result<DataCount, E> {
                Ok(DataCount(1))
            }
        }
        d.deserialize_any(Count)
    }
}

/// A binary v2 request's JSON part length (the binary tensor data extension), as checked, and
/// the `Inference-Header-Content-Length` value that says it to a replica.
#[derive(Clone)]
pub struct BinaryPart {
    pub len: usize,
    pub header: HeaderValue,
}

impl BinaryPart {
    pub fn new(len: usize) -> Self {
        BinaryPart {
            len,
            header: HeaderValue::from(len),
        }
    }
}

/// Checks a v2 request `body` whose `Inference-Header-Content-Length` (the binary tensor data
/// extension) is in `headers` or absent; says what is wrong and how to send it instead.
/// `Some`: the body is binary, its JSON part as long as checked.
pub fn check_body(body: &[u8], headers: &HeaderMap) -> Result<Option<BinaryPart>, String> {
    let header_len = headers
        .get(laneway_core::kserve::INFERENCE_HEADER)
        .map(|v| laneway_core::kserve::json_part_len(v.as_bytes()))
        .transpose()?;
    let (json, rest) = match header_len {
        Some(n) => laneway_core::kserve::split_binary(body, n)?,
        None => (body, &[][..]),
    };
    // The path of what was wrong is tracked only once something is: tracking it costs every
    // request (ADR 0031).
    let req: InferRequest = serde_json::from_slice(json).map_err(|_| {
        let de = &mut serde_json::Deserializer::from_slice(json);
        match serde_path_to_error::deserialize::<_, InferRequest>(de) {
            Err(e) => {
                let path = e.path().to_string();
                let inner = e.into_inner();
                if path == "." {
                    format!("invalid inference request: {inner}")
                } else {
                    format!("invalid inference request at `{path}`: {inner}")
                }
            }
            Ok(_) => "invalid inference request".to_string(),
        }
    })?;
    let mut offset = 0usize;
    for input in &req.inputs {
        let name = &input.name;
        if laneway_core::kserve::element_bytes(&input.datatype).is_none() {
            return Err(format!(
                "input {name}: datatype {:?} is not a KServe v2 datatype (BOOL, UINT8…UINT64, INT8…INT64, FP16, BF16, FP32, FP64, BYTES)",
                input.datatype
            ));
        }
        let size = input.parameters.as_ref().and_then(|p| p.binary_data_size);
        match (size, &input.data) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "input {name}: give `data` or parameters.binary_data_size, not both"
                ))
            }
            (None, None) => return Err(format!("input {name}: no `data` and no parameters.binary_data_size")),
            (Some(size), None) => {
                if header_len.is_none() {
                    return Err(format!(
                        "input {name}: binary_data_size needs the {} header (the binary tensor data extension), giving the length of the JSON part",
                        laneway_core::kserve::INFERENCE_HEADER
                    ));
                }
                let end = usize::try_from(size)
                    .ok()
                    .and_then(|s| offset.checked_add(s))
                    .filter(|e| *e <= rest.len());
                let Some(end) = end else {
                    return Err(format!(
                        "input {name}: binary_data_size {size} runs past the body: {} bytes of binary data follow the JSON part",
                        rest.len()
                    ));
                };
                laneway_core::kserve::check_binary(name, &input.datatype, &input.shape, &rest[offset..end])?;
                offset = end;
            }
            (None, Some(DataCount(n))) => {
                let want = laneway_core::kserve::elements(name, &input.shape)?;
                if *n != want {
                    return Err(format!(
                        "input {name}: `data` has {n} elements; shape {:?} is {want}",
                        input.shape
                    ));
                }
            }
        }
    }
    if offset != rest.len() {
        return Err(format!(
            "the binary part is {} bytes; the inputs' binary_data_size add up to {offset}",
            rest.len()
        ));
    }
    // What goes on to the replica is the length as checked here, in one form.
    Ok(header_len.map(BinaryPart::new))
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
        Refusal::NoSlot { retry_after } => shed(with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "every replica of {} is busy and the {} lane has no queue; retry after the Retry-After",
                    route.name, route.class.name
                ),
                meta,
            ),
            *retry_after,
        )),
        Refusal::OverBudget {
            retry_after,
            expected_wait,
        } => shed(with_retry_after(
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
        )),
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
