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
use super::pipeline::{authenticate, check_body, healthy_or_fallback, lookup, read_body};
use super::table::ModelRoute;
use super::{Admitted, Router};

/// The request's metadata, its tenant checked and its model looked up (the GET paths).
fn authorized(router: &Router, model: &str, headers: &HeaderMap) -> Result<(Meta, Arc<ModelRoute>), Response> {
    let mut meta = Meta {
        request_id: request_id(headers),
        ..Meta::default()
    };
    let table = router.table();
    authenticate(&table, headers, &meta)?;
    let route = lookup(router, &table, model, &mut meta)?;
    Ok((meta, route))
}

pub async fn metadata(State(router): State<Arc<Router>>, Path(model): Path<String>, headers: HeaderMap) -> Response {
    let (meta, route) = match authorized(&router, &model, &headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let mut r = Json(json!({
        "name": route.name,
        "versions": [route.version],
        "platform": "laneway",
        "class": route.class.name,
        "lane": route.class.lane,
        "ready_replicas": route.replicas.len(),
    }))
    .into_response();
    stamp(r.headers_mut(), &meta);
    r
}

pub async fn model_ready(State(router): State<Arc<Router>>, Path(model): Path<String>, headers: HeaderMap) -> Response {
    let (meta, route) = match authorized(&router, &model, &headers) {
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

/// Merges the degraded lane's parameters into the request's `parameters`.
fn degrade(body: &[u8], params: &std::collections::BTreeMap<String, String>) -> Result<Bytes, String> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
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
    serde_json::to_vec(&v).map(Bytes::from).map_err(|e| e.to_string())
}

/// `POST /v2/models/{model}/infer`, in a span that continues the client's W3C trace and that
/// the dispatch to the replica continues (exported when traces are configured).
pub async fn infer(
    State(router): State<Arc<Router>>,
    Path(model): Path<String>,
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
        return serve_infer(router, model, headers, body).await;
    }
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let parent = opentelemetry::global::get_text_map_propagator(|p| {
            p.extract(&opentelemetry_http::HeaderExtractor(&headers))
        });
        let _ = span.set_parent(parent);
    }
    let resp = tracing::Instrument::instrument(serve_infer(router, model, headers, body), span.clone()).await;
    span.record("status", resp.status().as_u16());
    resp
}

async fn serve_infer(router: Arc<Router>, model: String, headers: HeaderMap, body: Body) -> Response {
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
    let route = match lookup(&router, &table, &model, &mut meta) {
        Ok(r) => r,
        Err(r) => return r,
    };
    // A fallback of the same kind: a language model's is one too.
    let same_kind = |r: &ModelRoute| r.llm.is_some() == route.llm.is_some();
    let route = match healthy_or_fallback(&router, &table, &route, &tenant, &mut meta, same_kind, true) {
        Ok(r) => r,
        Err(canned) => return canned,
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
    if let Err(msg) = check_body(&body) {
        return error(StatusCode::BAD_REQUEST, msg, &meta);
    }
    if route.class.lane == laneway_core::registry::LaneKind::Durable {
        return super::jobs::submit_infer(&router, &tenant, &route, body, &headers, &meta).await;
    }
    let flight = Flight::new(router, table, tenant, route, meta, &headers, arrived);
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
        usage: false,
    };
    let (mut flight, admitted) = flight.acquire(None, &body, over).await?;
    flight
        .router
        .mirror(&flight.table, &flight.route, &body, &flight.meta.request_id, None);
    let Admitted {
        guard,
        queued,
        degraded,
    } = admitted;
    flight.record.queue_ms = queued.as_secs_f64() * 1000.0;
    let body = match &degraded {
        Some(params) => match degrade(&body, params) {
            Ok(b) => {
                flight.record.degraded = true;
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
                        let outcome = (f.router)
                            .forward(
                                &guard.slot,
                                body.clone(),
                                &f.meta.request_id,
                                f.traceparent.as_ref(),
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
mod tests;
