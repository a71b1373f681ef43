//! The router's HTTP face: KServe Open Inference Protocol (v2) paths, and a listener with limits
//! on everything a client controls (connections, header read time, body size and read time,
//! bodies in flight, request time; see [`super::body`]).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::answer::{error, request_id, stamp, stamp_version, with_retry_after, Meta, DEGRADED, QUEUE_MS, REPLICA};
use super::pipeline::{
    authenticate, check_body, from_cache, healthy_or_fallback, lookup, overflow_answered, overflow_failed, read_body,
    refusal_response, Handled,
};
use super::table::{ModelRoute, Table};
use super::{Admitted, ForwardError, Refusal, RequestRecord, Router};

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
    let class = route.class.clone();
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
    if class.lane == laneway_core::registry::LaneKind::Durable {
        return super::jobs::submit_infer(&router, &tenant, &route, body, &headers, &meta).await;
    }
    let mut record = super::record_for(&meta.request_id, &route, &tenant.name);
    record = match from_cache(
        &router, &table, &route, &tenant, &headers, &body, "infer", &mut meta, record,
    ) {
        Handled::Answered(hit) => return hit,
        Handled::Pass(record) => record,
    };
    let retry_hint = route.min_service().unwrap_or(Duration::from_secs(1));
    let _tenant_hold = match router.admit_tenant(&tenant, &class, retry_hint, arrived) {
        Ok(g) => g,
        Err((wait, why)) => {
            route.lane.lock().counters.throttled += 1;
            record.status = 429;
            router.record(record);
            return with_retry_after(error(StatusCode::TOO_MANY_REQUESTS, why, &meta), wait);
        }
    };
    let admitted = match router.acquire(&route, arrived).await {
        Ok(a) => a,
        Err(refusal) => {
            // Above the lane's capacity: its overflow endpoint, if it has one and can take it.
            if matches!(refusal, Refusal::NoSlot { .. } | Refusal::OverBudget { .. }) {
                record = match overflow(&router, &table, &route, &body, &headers, &meta, record, arrived).await {
                    Handled::Answered(answered) => return answered,
                    Handled::Pass(record) => record,
                };
            }
            let r = refusal_response(&refusal, &route, &meta);
            record.status = r.status().as_u16();
            record.queue_ms = arrived.elapsed().as_secs_f64() * 1000.0;
            router.record(record);
            return r;
        }
    };
    router.mirror(&table, &route, &body, &meta.request_id, None);
    dispatch(&router, &route, admitted, body, &headers, arrived, meta, record).await
}

/// Sends a request the lane has no capacity for to its overflow endpoint (ADR 0017).
/// `Pass`: not sent, or it failed — the caller refuses as it would have without.
#[allow(clippy::too_many_arguments)]
async fn overflow(
    router: &Router,
    table: &Table,
    route: &ModelRoute,
    body: &Bytes,
    headers: &HeaderMap,
    meta: &Meta,
    record: RequestRecord,
    arrived: Instant,
) -> Handled {
    let Some(ov) = table.overflows.get(&route.class.name) else {
        return Handled::Pass(record);
    };
    let Some((slot, uri, client, authorization)) = ov.take(router.now_ms(Instant::now()), ov.uri(&route.public)) else {
        return Handled::Pass(record);
    };
    let left = (arrived + route.class.request_timeout_ms.as_duration()).saturating_duration_since(Instant::now());
    let started = Instant::now();
    let out = super::Outbound {
        uri: &uri,
        target: "overflow",
        request_id: &meta.request_id,
        traceparent: headers.get("traceparent"),
        authorization,
    };
    let sent = router.send(client, out, body.clone(), left).await;
    drop(slot);
    let f = match sent {
        Ok(f) if super::overflow::answered(f.status) => f,
        Err(ForwardError::AnswerTooLarge { limit }) => {
            // It answered (and charged for it), more than the router passes on: not the
            // endpoint's fault, and not to be sent anywhere again.
            let r = error(
                StatusCode::BAD_GATEWAY,
                super::body::answer_too_large("the overflow endpoint", limit),
                meta,
            );
            return Handled::Answered(overflow_answered(
                router,
                ov,
                route,
                meta,
                record,
                (arrived, started),
                r,
            ));
        }
        other => {
            let why = match other {
                Ok(f) => format!("answered {}", f.status),
                Err(e) => format!("{e:?}"),
            };
            overflow_failed(router, ov, route, &why);
            return Handled::Pass(record);
        }
    };
    let mut r = (f.status, f.body).into_response();
    if let Some(ct) = f.content_type {
        r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct);
    }
    Handled::Answered(overflow_answered(
        router,
        ov,
        route,
        meta,
        record,
        (arrived, started),
        r,
    ))
}

#[allow(clippy::too_many_arguments)]
async fn dispatch(
    router: &Arc<Router>,
    route: &ModelRoute,
    admitted: Admitted,
    body: Bytes,
    headers: &HeaderMap,
    arrived: Instant,
    meta: Meta,
    mut record: RequestRecord,
) -> Response {
    let class = &route.class;
    let Admitted {
        mut guard,
        queued,
        degraded,
    } = admitted;
    record.queue_ms = queued.as_secs_f64() * 1000.0;
    let body = match &degraded {
        Some(params) => match degrade(&body, params) {
            Ok(b) => {
                record.degraded = true;
                b
            }
            Err(e) => return error(StatusCode::BAD_REQUEST, e, &meta),
        },
        None => body,
    };
    let deadline = arrived + class.request_timeout_ms.as_duration();
    let traceparent = headers.get("traceparent");
    let mut retried = false;
    let started = Instant::now();
    let outcome = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let r = match class.hedge {
            // A retried request is not hedged too: one extra send per request at most.
            Some(hedge) if !retried => {
                let (r, winner, copied) =
                    hedged(router, route, guard, &body, &meta.request_id, traceparent, left, hedge).await;
                guard = winner;
                // One extra send per request at most: a hedged request is not retried too.
                retried |= copied;
                r
            }
            _ => {
                router
                    .forward(&guard.slot, body.clone(), &meta.request_id, traceparent, left)
                    .await
            }
        };
        match r {
            Err(ForwardError::NotDelivered(why)) if !retried => {
                // Never reached the replica: safe to send once more, elsewhere, if the lane's
                // retry budget allows.
                match router.retry_elsewhere(route, &guard.slot, &why, deadline).await {
                    Some(other) => {
                        guard = super::lane::SlotGuard::new(other, route.lane.clone());
                        retried = true;
                    }
                    None => break Err(ForwardError::NotDelivered(why)),
                }
            }
            other => break other,
        }
    };
    record.replica = Some(guard.slot.name.clone());
    record.product = Some(guard.slot.product.clone());
    record.mig_profile = guard.slot.mig_profile.clone();
    record.service_ms = started.elapsed().as_secs_f64() * 1000.0;
    let mut resp = match outcome {
        Ok(f) => {
            route.lane.lock().counters.completed += 1;
            // A degraded answer (a bounded lane under pressure) is not the answer to the input
            // the key was made from: not kept.
            if let Some((cache, key, _)) = meta.cache.as_ref().filter(|_| !record.degraded) {
                cache.put(
                    *key,
                    super::cache::Cached {
                        status: f.status.as_u16(),
                        content_type: f.content_type.clone(),
                        body: f.body.clone(),
                    },
                );
            }
            if super::ejects_replica(&guard.slot, f.status) {
                router.eject(
                    &guard.slot,
                    &format!(
                        "answered {} {} times in a row",
                        f.status,
                        super::table::ERROR_ANSWERS_TO_EJECT
                    ),
                );
            }
            record.gpu_ms = f.gpu_ms;
            let mut r = (f.status, f.body).into_response();
            if let Some(ct) = f.content_type {
                r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct);
            }
            if let Some(g) = f.gpu_ms {
                if let Ok(v) = HeaderValue::from_str(&format!("{g:.3}")) {
                    r.headers_mut().insert(super::GPU_MS_HEADER, v);
                }
            }
            stamp(r.headers_mut(), &meta);
            r
        }
        Err(e) => {
            route.lane.lock().counters.failed += 1;
            let (status, msg) = match &e {
                ForwardError::NotDelivered(why) => (
                    StatusCode::BAD_GATEWAY,
                    format!("no replica of {} could be reached ({why})", route.name),
                ),
                ForwardError::Timeout => (
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "replica {} did not answer within the {} lane's request timeout ({} ms)",
                        guard.slot.name,
                        class.name,
                        class.request_timeout_ms.as_duration().as_millis()
                    ),
                ),
                ForwardError::Failed(why) => (
                    StatusCode::BAD_GATEWAY,
                    format!(
                        "replica {} failed while serving the request ({why}); not retried, it may have run",
                        guard.slot.name
                    ),
                ),
                ForwardError::AnswerTooLarge { limit } => (
                    StatusCode::BAD_GATEWAY,
                    super::body::answer_too_large(&format!("replica {}", guard.slot.name), *limit),
                ),
            };
            // An unreached replica was dealt with by the retry; an answer too large is the
            // request's doing, not the replica's fault.
            if !matches!(e, ForwardError::NotDelivered(_) | ForwardError::AnswerTooLarge { .. }) {
                router.eject(&guard.slot, &msg);
            }
            error(status, msg, &meta)
        }
    };
    let h = resp.headers_mut();
    h.insert(REPLICA, guard.slot.name_header.clone());
    stamp_version(h, &meta);
    if let Some((_, _, said)) = &meta.cache {
        h.insert(super::cache::CACHE_HEADER, HeaderValue::from_static(said));
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{:.3}", record.queue_ms)) {
        h.insert(QUEUE_MS, v);
    }
    if record.degraded {
        h.insert(DEGRADED, HeaderValue::from_static("1"));
    }
    record.status = resp.status().as_u16();
    drop(guard);
    router.record(record);
    resp
}

/// Sends the request to `guard`'s replica and, when it has not answered within the class's
/// hedge delay, the lane's hedge budget allows and another replica has a free slot, a copy
/// there too (never queued). The first good answer wins; the other send is dropped (its
/// connection closed, its slot freed). When both fail, the first send's failure is the
/// request's. Returns the outcome, the guard of the replica it came from, and whether a copy
/// was sent.
#[allow(clippy::too_many_arguments)]
async fn hedged(
    router: &Arc<Router>,
    route: &ModelRoute,
    guard: super::lane::SlotGuard,
    body: &Bytes,
    request_id: &str,
    traceparent: Option<&HeaderValue>,
    left: Duration,
    hedge: laneway_core::registry::HedgeSpec,
) -> (Result<super::Forwarded, ForwardError>, super::lane::SlotGuard, bool) {
    let started = Instant::now();
    let after = hedge.after_ms.as_duration();
    // The sends borrow their own handle on the slot, so the guard can be handed back.
    let first_slot = guard.slot.clone();
    let first = router.forward(&first_slot, body.clone(), request_id, traceparent, left);
    tokio::pin!(first);
    // A copy needs the time to be answered: the delay and then the fastest replica's service.
    if left <= after + route.min_service().unwrap_or_default() {
        return (first.await, guard, false);
    }
    if let Ok(r) = tokio::time::timeout(after, &mut first).await {
        return (r, guard, false);
    }
    if !route.lane.lock().take_hedge(hedge.percent) {
        return (first.await, guard, false);
    }
    let Some(other) = router.pick(route, Some(&guard.slot.name), Instant::now()) else {
        route.lane.lock().refund_hedge();
        return (first.await, guard, false);
    };
    let second_guard = super::lane::SlotGuard::new(other, route.lane.clone());
    let second_slot = second_guard.slot.clone();
    let left = left.saturating_sub(started.elapsed());
    let second = router.forward(&second_slot, body.clone(), request_id, traceparent, left);
    tokio::pin!(second);
    let good = |r: &Result<super::Forwarded, ForwardError>| r.as_ref().is_ok_and(|f| !super::fails_replica(f.status));
    let won = |r| {
        route.lane.lock().counters.hedge_won += 1;
        (r, second_guard, true)
    };
    // A copy that failed is ejected as any failure would be, except for running out of time:
    // it only had what the first send left of the deadline.
    let copy_failed = |r: &Result<super::Forwarded, ForwardError>| match r {
        Err(ForwardError::Timeout | ForwardError::AnswerTooLarge { .. }) => {}
        Err(ForwardError::NotDelivered(why)) => router.eject(&second_slot, why),
        Err(e) => router.eject(&second_slot, &format!("hedged copy: {e:?}")),
        Ok(f) if super::ejects_replica(&second_slot, f.status) => {
            router.eject(&second_slot, &format!("answered {} to a hedged copy", f.status))
        }
        Ok(_) => {}
    };
    tokio::select! {
        r1 = &mut first => {
            if good(&r1) {
                return (r1, guard, true);
            }
            let r2 = second.await;
            if good(&r2) {
                return won(r2);
            }
            copy_failed(&r2);
            (r1, guard, true)
        }
        r2 = &mut second => {
            if good(&r2) {
                return won(r2);
            }
            copy_failed(&r2);
            (first.await, guard, true)
        }
    }
}

#[cfg(test)]
mod tests;
