//! The router's HTTP face: KServe Open Inference Protocol (v2) paths, and a listener with limits
//! on everything a client controls (connections, header read time, body size and read time,
//! bodies in flight, request time; see [`super::body`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::answer::{error, request_id, stamp, Meta};
use super::flight::{Flight, Overflowing, Sent};
use super::pipeline::{authenticate, check_body, healthy_or_fallback, lookup, read_body, BinaryPart};
use super::table::ModelRoute;
use super::{Admitted, Router};

/// The request's metadata, its tenant checked and its model (or that `version` of it) looked
/// up: the GET paths.
pub(crate) fn authorized(
    router: &Router,
    model: &str,
    version: Option<&str>,
    headers: &HeaderMap,
) -> Result<(Meta, Arc<ModelRoute>), Response> {
    let mut meta = Meta {
        request_id: request_id(headers),
        ..Meta::default()
    };
    let table = router.table();
    authenticate(&table, headers, &meta)?;
    let route = lookup(router, &table, model, version, &mut meta)?;
    Ok((meta, route))
}

/// The server's name in v2 server metadata.
pub const SERVER_NAME: &str = "laneway";

/// The v2 protocol extensions the router serves (HTTP and gRPC alike).
pub const EXTENSIONS: &[&str] = &["binary_tensor_data"];

/// The platform v2 model metadata names.
pub const PLATFORM: &str = "laneway";

/// `GET /v2`: the server's name, version and the protocol extensions it serves.
pub async fn server_metadata() -> Response {
    Json(json!({
        "name": SERVER_NAME,
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": EXTENSIONS,
    }))
    .into_response()
}

/// A model path's parameters: `/v2/models/{model}[/versions/{version}]…`.
#[derive(serde::Deserialize)]
pub struct ModelPath {
    model: String,
    /// A pinned version (that entry only: no fallback, no rollout split).
    #[serde(default)]
    version: Option<String>,
}

impl ModelPath {
    pub fn new(model: String, version: Option<String>) -> Self {
        ModelPath { model, version }
    }
}

/// `GET /v2/models/{model}[/versions/{version}]`: the model's name, its registered versions,
/// and the tensors its model file declares; Laneway adds its class, lane and ready replicas.
pub async fn metadata(State(router): State<Arc<Router>>, Path(p): Path<ModelPath>, headers: HeaderMap) -> Response {
    model_metadata(&router, &p.model, p.version.as_deref(), &headers)
}

fn model_metadata(router: &Router, model: &str, version: Option<&str>, headers: &HeaderMap) -> Response {
    let (meta, route) = match authorized(router, model, version, headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let versions = match version {
        Some(v) => vec![v.to_string()],
        None => router.table().versions(&route.public),
    };
    let mut r = Json(json!({
        "name": route.public,
        "versions": versions,
        "platform": PLATFORM,
        "inputs": route.inputs,
        "outputs": route.outputs,
        "class": route.class.name,
        "lane": route.class.lane,
        "ready_replicas": route.replicas.len(),
    }))
    .into_response();
    stamp(r.headers_mut(), &meta);
    r
}

/// `GET /v2/models/{model}[/versions/{version}]/ready`: 200 when a replica is ready.
pub async fn model_ready(State(router): State<Arc<Router>>, Path(p): Path<ModelPath>, headers: HeaderMap) -> Response {
    ready_answer(&router, &p.model, p.version.as_deref(), &headers)
}

fn ready_answer(router: &Router, model: &str, version: Option<&str>, headers: &HeaderMap) -> Response {
    let (meta, route) = match authorized(router, model, version, headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    if route.replicas.is_empty() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("model {model} has no ready replica"),
            &meta,
        );
    }
    let mut r = StatusCode::OK.into_response();
    stamp(r.headers_mut(), &meta);
    r
}

/// Merges the degraded lane's parameters into the request's `parameters` (the JSON part of a
/// binary request, whose new length it returns with it).
fn degrade(
    body: &[u8],
    binary: Option<&BinaryPart>,
    params: &std::collections::BTreeMap<String, String>,
) -> Result<(Bytes, Option<BinaryPart>), String> {
    let (json, tensors) = laneway_core::kserve::split_binary(body, binary.map_or(body.len(), |b| b.len))?;
    let mut v: Value = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let obj = v.as_object_mut().ok_or("the body is not a JSON object")?;
    let p = obj
        .entry("parameters")
        .or_insert_with(|| Value::Object(Default::default()));
    if let Some(p) = p.as_object_mut() {
        for (k, val) in params {
            p.insert(k.clone(), Value::String(val.clone()));
        }
        p.insert("laneway_degraded".into(), Value::Bool(true));
    }
    let mut out = serde_json::to_vec(&v).map_err(|e| e.to_string())?;
    let binary = binary.map(|_| BinaryPart::new(out.len()));
    out.extend_from_slice(tensors);
    Ok((Bytes::from(out), binary))
}

/// `POST /v2/models/{model}[/versions/{version}]/infer` (a pinned version: that entry only, no
/// fallback and no rollout split), in a span that continues the client's W3C trace and that
/// the dispatch to the replica continues (exported when traces are configured).
pub async fn infer(
    State(router): State<Arc<Router>>,
    Path(ModelPath { model, version }): Path<ModelPath>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let span = tracing::debug_span!(
        target: "laneway_trace",
        "infer",
        model = %model,
        status = tracing::field::Empty,
        otel.kind = "server"
    );
    if span.is_disabled() {
        return serve_infer(router, model, version, headers, body).await;
    }
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let parent = opentelemetry::global::get_text_map_propagator(|p| {
            p.extract(&opentelemetry_http::HeaderExtractor(&headers))
        });
        let _ = span.set_parent(parent);
    }
    let resp = tracing::Instrument::instrument(serve_infer(router, model, version, headers, body), span.clone()).await;
    span.record("status", resp.status().as_u16());
    resp
}

async fn serve_infer(
    router: Arc<Router>,
    model: String,
    version: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let since = Instant::now();
    let mut meta = Meta {
        request_id: request_id(&headers),
        ..Meta::default()
    };
    // One snapshot of the table per request: the key and the model are read from the same one.
    let table = router.table();
    let tenant = match authenticate(&table, &headers, &meta) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let route = match lookup(&router, &table, &model, version.as_deref(), &mut meta) {
        Ok(r) => r,
        Err(r) => return r,
    };
    // A fallback of the same kind: a language model's is one too. A pinned version is that
    // version or nothing.
    let same_kind = |r: &ModelRoute| r.llm.is_some() == route.llm.is_some();
    let route = match &version {
        Some(_) => route,
        None => match healthy_or_fallback(&router, &table, &route, &tenant, &mut meta, same_kind, true) {
            Ok(r) => r,
            Err(canned) => return canned,
        },
    };
    // Only now, the key checked and the model known, is the body read.
    let (body, _body_share) =
        match read_body(&router, body, &headers, since, "send a smaller input or a URI", &meta).await {
            Ok(b) => b,
            Err(r) => return r,
        };
    // The lane's clocks (its budget, the request timeout) start once the whole request is
    // here: a slow upload does not spend them.
    let arrived = Instant::now();
    let binary = match check_body(&body, &headers) {
        Ok(b) => b,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg, &meta),
    };
    let durable = route.class.lane == laneway_core::registry::LaneKind::Durable;
    // A server that reads only JSON (and a job's input, which is JSON) gets the same request
    // in JSON: tritonclient's default binary tensors work against any server.
    let (body, binary) = match binary {
        Some(part) if durable || !route.binary_tensors => {
            let limit = super::body::json_elements_limit(router.bodies().limits().max_body_bytes);
            match laneway_core::kserve::binary_request_as_json(&body, part.len, limit) {
                Ok(json) => (Bytes::from(json), None),
                Err(why) => {
                    let takes = if durable {
                        format!(
                            "model {} is in the durable class {}, whose jobs take JSON",
                            route.public, route.class.name
                        )
                    } else {
                        format!(
                            "model {}'s server takes tensors as JSON only (no `binary_tensors = true` under [runtime])",
                            route.public
                        )
                    };
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!("{takes}, and the router cannot convert this request: {why}; send the tensors as JSON `data` (tritonclient: binary_data=False)"),
                        &meta,
                    );
                }
            }
        }
        b => (body, b),
    };
    if durable {
        return super::jobs::submit_infer(&router, &tenant, &route, body, &headers, &meta).await;
    }
    let mut flight = Flight::new(router, table, tenant, route, meta, &headers, arrived);
    flight.binary = binary;
    flight.pinned_version = version;
    match serve_flight(flight, &headers, body).await {
        Ok(r) | Err(r) => r,
    }
}

/// The steps after reading, for a KServe v2 request: cache, tenant, lane (or overflow), the
/// replica (hedged, retried elsewhere when never reached); the answer passed on whole.
async fn serve_flight(flight: Flight, headers: &HeaderMap, body: Bytes) -> Result<Response, Response> {
    let flight = flight.from_cache(headers, &body, "infer")?.admit_tenant()?;
    let over = Overflowing {
        path: None,
        stream: false,
    };
    let (mut flight, admitted) = flight.acquire(None, &body, over).await?;
    let shadow = crate::forward::Mirrored::Infer {
        binary: flight.binary.as_ref().map(|b| &b.header),
    };
    flight
        .router
        .mirror(&flight.table, &flight.route, &body, &flight.meta.request_id, shadow);
    let Admitted {
        guard,
        queued,
        degraded,
    } = admitted;
    flight.record.queue_ms = queued.as_secs_f64() * 1000.0;
    let body = match &degraded {
        Some(params) => match degrade(&body, flight.binary.as_ref(), params) {
            Ok((b, binary)) => {
                flight.record.degraded = true;
                flight.binary = binary;
                b
            }
            Err(e) => {
                let r = error(StatusCode::BAD_REQUEST, e, &flight.meta);
                return Err(flight.end(r));
            }
        },
        None => body,
    };
    let started = Instant::now();
    // A retried request is not hedged too: one extra send per request at most.
    let mut hedge = flight.route.class.hedge;
    let (f, body) = (&flight, &body);
    let (outcome, guard) = f
        .forward(guard, move |guard| {
            let hedge = hedge.take();
            async move {
                match hedge {
                    Some(hedge) => f.hedged(guard, body, hedge).await,
                    None => {
                        let left = f.deadline().saturating_duration_since(Instant::now());
                        let binary = f.binary.as_ref().map(|b| &b.header);
                        let outcome = (f.router)
                            .forward(
                                &guard.slot,
                                body.clone(),
                                &f.meta.request_id,
                                f.traceparent.as_ref(),
                                binary,
                                left,
                            )
                            .await;
                        Sent {
                            outcome,
                            guard,
                            copied: false,
                        }
                    }
                }
            }
        })
        .await;
    Ok(match outcome {
        Ok(f) => flight.answered(f, guard, started),
        Err(e) => flight.failed(e, guard, started),
    })
}

#[cfg(test)]
pub(crate) mod tests;
