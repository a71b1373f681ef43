//! How every answer of the router is shaped, whatever the protocol: Laneway's response headers
//! (lane, class, replica, queue time, model version), the error body, and `Retry-After`.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::retry_after_header;

/// Response header on an answer a fallback model gave: the model the request was for.
pub const FALLBACK_FOR: &str = "x-laneway-fallback-for";

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

pub const LANE: HeaderName = HeaderName::from_static("x-laneway-lane");

pub const CLASS: HeaderName = HeaderName::from_static("x-laneway-class");

pub const REPLICA: HeaderName = HeaderName::from_static("x-laneway-replica");

pub const QUEUE_MS: HeaderName = HeaderName::from_static("x-laneway-queue-ms");

pub const DEGRADED: HeaderName = HeaderName::from_static("x-laneway-degraded");

/// The version of the model that answered (during a rollout, which side of the split).
pub const MODEL_VERSION: HeaderName = HeaderName::from_static("x-laneway-model-version");

/// What every response says about the request, as far as it is known.
#[derive(Default, Clone)]
pub struct Meta {
    pub request_id: String,
    pub lane: Option<&'static str>,
    pub class: Option<HeaderValue>,
    /// The version of the model that serves the request, for [`stamp_version`].
    pub version: Option<HeaderValue>,
    /// The model this request was for, when its fallback answers it.
    pub fallback_for: Option<HeaderValue>,
    /// Where to keep the answer, and what the response says about the cache (`miss` or
    /// `bypass`).
    pub cache: Option<(Arc<super::cache::ClassCache>, super::cache::Key, &'static str)>,
}

/// Marks a refusal that sheds load (the lane or the tenant has no room now, come back after
/// the `Retry-After`), as opposed to one where nothing could serve: a protocol with its own
/// codes says so (gRPC's `RESOURCE_EXHAUSTED` rather than `UNAVAILABLE`). Never on the wire.
#[derive(Clone, Copy, Debug)]
pub struct Shed;

/// `r`, marked as a [`Shed`].
pub fn shed(mut r: Response) -> Response {
    r.extensions_mut().insert(Shed);
    r
}

/// The message of an error the router itself answered (not a replica's answer passed on), for
/// a protocol that shapes its errors its own way (OpenAI's error object). Never on the wire.
#[derive(Clone, Debug)]
pub struct Said(pub Arc<str>);

pub fn error(status: StatusCode, message: String, meta: &Meta) -> Response {
    let said = Said(message.as_str().into());
    let mut r = (
        status,
        Json(json!({
            "error": message,
            "request_id": meta.request_id,
            "lane": meta.lane,
        })),
    )
        .into_response();
    stamp(r.headers_mut(), meta);
    r.extensions_mut().insert(said);
    r
}

pub fn stamp(h: &mut HeaderMap, meta: &Meta) {
    if let Ok(v) = HeaderValue::from_str(&meta.request_id) {
        h.insert(REQUEST_ID, v);
    }
    h.insert(LANE, HeaderValue::from_static(meta.lane.unwrap_or("none")));
    if let Some(c) = &meta.class {
        h.insert(CLASS, c.clone());
    }
    if let Some(m) = &meta.fallback_for {
        h.insert(FALLBACK_FOR, m.clone());
    }
}

/// Names the model version on a response one of its replicas (or the cache of its answers)
/// gave, failures included; never on a refusal made before a version was involved.
pub fn stamp_version(h: &mut HeaderMap, meta: &Meta) {
    if let Some(v) = &meta.version {
        h.insert(MODEL_VERSION, v.clone());
    }
}

pub fn with_retry_after(mut r: Response, wait: Duration) -> Response {
    r.headers_mut()
        .insert(axum::http::header::RETRY_AFTER, retry_after_header(wait));
    r
}

/// The request id: the client's `x-request-id` when it is a sane token, else a new one.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(
            // 128 random bits from the thread's seeded generator: no getrandom syscall per
            // request (uuid::new_v4 makes one).
            || format!("{:032x}", rand::random::<u128>()),
            str::to_string,
        )
}
