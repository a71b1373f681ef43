//! Language-model lanes on the router: the OpenAI-compatible paths LLM servers (vLLM, TGI,
//! SGLang) expose, `POST /v1/chat/completions` and `POST /v1/completions`, streamed (server-sent
//! events) or not.
//!
//! Everything that can refuse a request happens before its first byte goes anywhere: the
//! tenant's key, a body that names a registered language model, input + `max_tokens` within the
//! model's context, the tenant's tokens per minute, its request ceilings, and the lane's own
//! admission (a free slot, or the bounded queue's budget). Then the replica is chosen by prompt
//! prefix (bounded-load rendezvous hashing, [`Router::pick_near`]) and its answer is passed
//! through frame by frame: nothing is buffered, so a slow client slows the replica's stream
//! (backpressure) and a client that goes away closes the connection to the replica, which
//! stops generating. A replica that fails mid-stream ends the stream with an `error` event;
//! the lane's request timeout bounds the whole stream, so nothing hangs.
//!
//! Per request the router measures time to first token (arrival → first chunk with a token),
//! the gaps between chunks (inter-token latency) and the tokens (from the replica's `usage`
//! when it reports one, else counted), which feed `/metrics`, `/ui`, `lanectl lane show`, the
//! ledger and the fast loop's `ttft` signal.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use laneway_agent::llm::{prefix_hash, CompletionRequest, Endpoint, CHARS_PER_TOKEN};
use serde::Deserialize;
use tokio::time::Instant;

use super::admission::TokenBucket;
use super::answer::{error, request_id, stamp, with_retry_after, Meta};
use super::body::{read_answer, AnswerError};
use super::lane::SlotGuard;
use super::metrics::{Labels, LaneHistograms};
use super::pipeline::{authenticate, lookup, read_body};
use super::table::{ModelRoute, TenantRoute};
use super::token_count::TokenCount;
use super::{Admitted, ForwardError, Refusal, RequestRecord, Router, TenantGuard};
use crate::registry::{Class, LaneKind};
pub use laneway_core::lane_report::LlmSummary;

/// The window of the TTFT the fast loop scales on.
pub const SIGNAL_WINDOW: Duration = Duration::from_secs(10);
/// Samples older than this leave the recent statistics.
pub const RECENT: Duration = Duration::from_secs(60);
const MAX_TTFT_SAMPLES: usize = 4096;
const MAX_ITL_SAMPLES: usize = 16384;

/// `POST /v1/chat/completions`.
pub(super) async fn chat_completions(State(router): State<Arc<Router>>, headers: HeaderMap, body: Body) -> Response {
    serve(router, Endpoint::Chat, headers, body).await
}

/// `POST /v1/completions`.
pub(super) async fn completions(State(router): State<Arc<Router>>, headers: HeaderMap, body: Body) -> Response {
    serve(router, Endpoint::Completion, headers, body).await
}

async fn serve(router: Arc<Router>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let since = Instant::now();
    let mut meta = Meta {
        request_id: request_id(&headers),
        ..Meta::default()
    };
    let table = router.table();
    let tenant = match authenticate(&table, &headers, &meta) {
        Ok(t) => t,
        Err(r) => return r,
    };
    // Only now, the key checked, is the body read.
    let (body, _body_share) = match read_body(&router, body, &headers, since, "send a shorter prompt", &meta).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    // The lane's clocks (its budget, the request timeout) start once the whole request is
    // here: a slow upload does not spend them.
    let arrived = Instant::now();
    let req = match CompletionRequest::parse(endpoint, &body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid completion request: {e}"),
                &meta,
            )
        }
    };
    let asked = match lookup(&router, &table, &req.model, &mut meta) {
        Ok(r) => r,
        Err(r) => return r,
    };
    // A fallback must be a language model too; a canned answer is one JSON body, which a
    // client reading a stream could not parse, so a stream is refused as usual instead.
    let is_llm = |r: &ModelRoute| r.llm.is_some();
    let route =
        match super::pipeline::healthy_or_fallback(&router, &table, &asked, &tenant, &mut meta, is_llm, !req.stream) {
            Ok(r) => r,
            Err(canned) => return canned,
        };
    // What the client sent is what is counted (the router's own changes below add nothing to
    // the prompt).
    let sent = body.clone();
    let body = if Arc::ptr_eq(&route, &asked) {
        body
    } else {
        for_model(&body, &route.public)
    };
    // A stream is metered from the usage its replica reports last: ask for it, and keep that
    // chunk from a client that did not.
    let strip_usage = req.stream && !req.include_usage;
    let body = if strip_usage { asking_for_usage(&body) } else { body };
    let Some(spec) = route.llm.clone() else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "model {} is not registered as a language model (its entry has no [llm] section with context_tokens); send KServe v2 requests to /v2/models/{}/infer, or re-register it with [llm]",
                route.name, route.name
            ),
            &meta,
        );
    };
    let class = route.class.clone();
    if class.lane == LaneKind::Durable {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "model {} is in the durable class {}: durable lanes take jobs (POST /v1/jobs), not completions",
                route.name, class.name
            ),
            &meta,
        );
    }
    let count = match TokenCount::of(endpoint, &sent, &req, spec.default_max_tokens) {
        Ok(c) => c,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid completion request: {e}"),
                &meta,
            )
        }
    };
    let (input, max_tokens) = (count.input, count.max_tokens);
    if count.per_sequence() > u64::from(spec.context_tokens) {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "model {} has a context of {} tokens; this request needs about {} ({input} input — messages, tools and other parts, estimated at {CHARS_PER_TOKEN} characters a token — + max_tokens {max_tokens}); shorten the prompt or lower max_tokens",
                route.name,
                spec.context_tokens,
                count.per_sequence()
            ),
            &meta,
        );
    }
    // Every sequence the engine generates (n, best_of, a batch of prompts) takes its max_tokens.
    let needed = count.total();
    let mut record = super::record_for(&meta.request_id, &route, &tenant.name);
    record.input_tokens = input;
    // Only a whole answer sampled greedily is the same answer next time.
    if !req.stream && greedy(&body) {
        record = match super::pipeline::from_cache(
            &router,
            &table,
            &route,
            &tenant,
            &headers,
            &body,
            endpoint.path(),
            &mut meta,
            record,
        ) {
            Ok(hit) => return hit,
            Err(record) => record,
        };
    }
    let retry_hint = route.min_service().unwrap_or(Duration::from_secs(1));
    let tenant_hold = match router.admit_tenant(&tenant, &class, retry_hint, arrived) {
        Ok(g) => g,
        Err((wait, why)) => return throttled(&router, &route, record, &meta, wait, why),
    };
    match router.admit_tokens(&tenant, &class, needed, arrived) {
        Ok(()) => {}
        Err(TokenRefusal::Never(why)) => return error(StatusCode::BAD_REQUEST, why, &meta),
        Err(TokenRefusal::Wait(wait, why)) => return throttled(&router, &route, record, &meta, wait, why),
    }
    let affinity = (spec.prefix_affinity_tokens > 0).then(|| prefix_hash(&req.prompt, spec.prefix_affinity_tokens));
    let admitted = match router.acquire_near(&route, arrived, affinity).await {
        Ok(a) => a,
        Err(refusal) => {
            // Above the lane's capacity: its overflow endpoint, if it has one and can take it.
            if matches!(refusal, Refusal::NoSlot { .. } | Refusal::OverBudget { .. }) {
                let sent = Overflowing {
                    endpoint,
                    stream: req.stream,
                    arrived,
                };
                record = match sent.send(&router, &table, &route, &body, &headers, &meta, record).await {
                    Ok(answered) => return answered,
                    Err(record) => record,
                };
            }
            // Not served: the tokens go back to the tenant's minute.
            router.refund_tokens(&tenant, &class, needed);
            let r = super::pipeline::refusal_response(&refusal, &route, &meta);
            record.status = r.status().as_u16();
            record.queue_ms = arrived.elapsed().as_secs_f64() * 1000.0;
            router.record(record);
            return r;
        }
    };
    router.mirror(&table, &route, &body, &meta.request_id, Some(endpoint));
    let call = Call {
        router,
        route,
        endpoint,
        stream: req.stream,
        strip_usage,
        arrived,
        meta,
        record,
        tenant_hold,
    };
    call.dispatch(admitted, body, headers.get("traceparent").cloned()).await
}

/// A completion the lane has no capacity for, on its way to the lane's overflow endpoint
/// (ADR 0017): the same OpenAI-compatible path and body; a stream is passed through as it
/// comes, holding one of the endpoint's slots until it ends.
struct Overflowing {
    endpoint: Endpoint,
    stream: bool,
    arrived: Instant,
}

impl Overflowing {
    /// `Err(record)`: not sent, or it failed — the caller refuses as it would have without.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        self,
        router: &Router,
        table: &super::table::Table,
        route: &ModelRoute,
        body: &Bytes,
        headers: &HeaderMap,
        meta: &Meta,
        mut record: RequestRecord,
    ) -> Result<Response, RequestRecord> {
        let Some(ov) = table.overflows.get(&route.class.name) else {
            return Err(record);
        };
        let Some((slot, uri, client, authorization)) =
            ov.take(router.now_ms(Instant::now()), ov.uri_at(self.endpoint.path()))
        else {
            return Err(record);
        };
        let deadline = self.arrived + route.class.request_timeout_ms.as_duration();
        let started = Instant::now();
        let out = super::Outbound {
            uri: &uri,
            target: "overflow",
            request_id: &meta.request_id,
            traceparent: headers.get("traceparent"),
            authorization,
        };
        let left = deadline.saturating_duration_since(started);
        let head = router.send_head(client, out, body.clone(), left).await;
        let resp = match head {
            Ok(r) if super::overflow::answered(r.status()) => r,
            other => {
                let why = match other {
                    Ok(r) => format!("answered {}", r.status()),
                    Err(e) => format!("{e:?}"),
                };
                super::pipeline::overflow_failed(router, ov, route, &why);
                return Err(record);
            }
        };
        let (parts, upstream) = resp.into_parts();
        let body = if self.stream && parts.status.is_success() {
            // The endpoint's slot goes with the stream: freed when it ends or the client goes.
            let held = slot;
            Body::new(upstream.map_frame(move |frame| {
                let _slot = &held;
                frame
            }))
        } else {
            let limit = router.bodies().limits().max_answer_bytes;
            let bytes = match tokio::time::timeout_at(deadline, read_answer(upstream, limit)).await {
                Ok(Ok(b)) => b,
                Ok(Err(AnswerError::TooLarge { limit })) => {
                    // It answered (and charged for it), more than the router passes on: not
                    // the endpoint's fault, and not to be sent anywhere again.
                    drop(slot);
                    let r = error(
                        StatusCode::BAD_GATEWAY,
                        super::body::answer_too_large("the overflow endpoint", limit),
                        meta,
                    );
                    let times = (self.arrived, started);
                    return Ok(super::pipeline::overflow_answered(
                        router, ov, route, meta, record, times, r,
                    ));
                }
                Ok(Err(AnswerError::Broken(e))) => {
                    super::pipeline::overflow_failed(router, ov, route, &format!("broke off its answer: {e}"));
                    return Err(record);
                }
                Err(_) => {
                    super::pipeline::overflow_failed(router, ov, route, "did not finish within the lane's timeout");
                    return Err(record);
                }
            };
            drop(slot);
            if let Some((input, output, _)) = answer_usage(&bytes) {
                (record.input_tokens, record.output_tokens) = (input, output);
            }
            Body::from(bytes)
        };
        let mut r = Response::new(body);
        *r.status_mut() = parts.status;
        if let Some(ct) = parts.headers.get(axum::http::header::CONTENT_TYPE) {
            r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct.clone());
        }
        let times = (self.arrived, started);
        Ok(super::pipeline::overflow_answered(
            router, ov, route, meta, record, times, r,
        ))
    }
}

fn throttled(
    router: &Router,
    route: &ModelRoute,
    mut record: RequestRecord,
    meta: &Meta,
    wait: Duration,
    why: String,
) -> Response {
    route.lane.lock().counters.throttled += 1;
    record.status = 429;
    router.record(record);
    with_retry_after(error(StatusCode::TOO_MANY_REQUESTS, why, meta), wait)
}

/// Why a tenant's tokens per minute refused a request.
pub enum TokenRefusal {
    /// It fits the minute later: 429 with this wait.
    Wait(Duration, String),
    /// It is larger than the tenant's whole minute: it never fits.
    Never(String),
}

impl Router {
    /// Takes `tokens` from the tenant's tokens-per-minute bucket on `class`, if it has one.
    pub fn admit_tokens(
        &self,
        tenant: &TenantRoute,
        class: &Class,
        tokens: u32,
        now: Instant,
    ) -> Result<(), TokenRefusal> {
        let Some(per_min) = tenant.limit_for(&class.name).and_then(|l| l.tokens_per_min) else {
            return Ok(());
        };
        if tokens > per_min {
            return Err(TokenRefusal::Never(format!(
                "this request counts about {tokens} tokens (input + max_tokens for each choice), more than tenant {}'s whole minute on class {} ({per_min} tokens/min); lower max_tokens or n, or split the prompt",
                tenant.name, class.name
            )));
        }
        let rate = per_min.div_ceil(60).max(1);
        let mut buckets = self.token_buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets
            .entry((tenant.name.clone(), class.name.clone()))
            .or_insert_with(|| TokenBucket::new(rate, per_min, now));
        if !bucket.has_limits(rate, per_min) {
            *bucket = TokenBucket::new(rate, per_min, now);
        }
        bucket.take_n(tokens, now).map_err(|wait| {
            TokenRefusal::Wait(
                wait,
                format!(
                    "tenant {} is over its {per_min} tokens/min on class {} (this request counts about {tokens}: input + max_tokens for each choice); retry after the Retry-After",
                    tenant.name, class.name
                ),
            )
        })
    }

    /// Gives back tokens of a request that was admitted by tokens and then not served.
    pub fn refund_tokens(&self, tenant: &TenantRoute, class: &Class, tokens: u32) {
        let mut buckets = self.token_buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(&(tenant.name.clone(), class.name.clone())) {
            b.give_back(tokens);
        }
    }

    /// Recent TTFT, ITL and tokens of language models.
    pub fn llm_stats(&self) -> &LlmStats {
        &self.llm_stats
    }
}

/// Rendezvous (highest random weight) score of a replica for a prefix hash.
pub fn rendezvous(key: u64, replica: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    replica.hash(&mut h);
    h.finish()
}

/// One admitted completion on its way to a replica.
struct Call {
    router: Arc<Router>,
    route: Arc<ModelRoute>,
    endpoint: Endpoint,
    stream: bool,
    /// The client did not ask for the usage chunk the router asked the replica for.
    strip_usage: bool,
    arrived: Instant,
    meta: Meta,
    record: RequestRecord,
    tenant_hold: Option<TenantGuard>,
}

impl Call {
    async fn dispatch(mut self, admitted: Admitted, body: Bytes, traceparent: Option<HeaderValue>) -> Response {
        let Admitted { mut guard, queued, .. } = admitted;
        self.record.queue_ms = queued.as_secs_f64() * 1000.0;
        let class = self.route.class.clone();
        let timeout = class.request_timeout_ms.as_duration();
        let deadline = self.arrived + timeout;
        let started = Instant::now();
        let mut retried = false;
        let outcome = loop {
            let r = self.send(&guard, body.clone(), traceparent.as_ref(), deadline).await;
            match r {
                Err(ForwardError::NotDelivered(why)) if !retried => {
                    // Never reached the replica: safe to send once more, elsewhere, if the
                    // lane's retry budget allows.
                    match self
                        .router
                        .retry_elsewhere(&self.route, &guard.slot, &why, deadline)
                        .await
                    {
                        Some(other) => {
                            guard = SlotGuard::new(other, self.route.lane.clone());
                            retried = true;
                        }
                        None => break Err(ForwardError::NotDelivered(why)),
                    }
                }
                other => break other,
            }
        };
        self.record.replica = Some(guard.slot.name.clone());
        self.record.product = Some(guard.slot.product.clone());
        let resp = match outcome {
            Ok(resp) => resp,
            Err(e) => {
                self.route.lane.lock().counters.failed += 1;
                let (status, msg) = match &e {
                    ForwardError::NotDelivered(why) => (
                        StatusCode::BAD_GATEWAY,
                        format!("no replica of {} could be reached ({why})", self.route.name),
                    ),
                    ForwardError::Timeout => (
                        StatusCode::GATEWAY_TIMEOUT,
                        format!(
                            "replica {} did not start answering within the {} lane's request timeout ({} ms)",
                            guard.slot.name,
                            class.name,
                            timeout.as_millis()
                        ),
                    ),
                    ForwardError::Failed(why) => (
                        StatusCode::BAD_GATEWAY,
                        format!(
                            "replica {} failed ({why}); not retried, it may have run",
                            guard.slot.name
                        ),
                    ),
                    ForwardError::AnswerTooLarge { limit } => (
                        StatusCode::BAD_GATEWAY,
                        super::body::answer_too_large(&format!("replica {}", guard.slot.name), *limit),
                    ),
                };
                if !matches!(e, ForwardError::NotDelivered(_) | ForwardError::AnswerTooLarge { .. }) {
                    self.router.eject(&guard.slot, &msg);
                }
                self.record.service_ms = started.elapsed().as_secs_f64() * 1000.0;
                let mut r = error(status, msg, &self.meta);
                self.finish_headers(r.headers_mut(), &guard);
                self.record.status = status.as_u16();
                self.router.record(self.record);
                return r;
            }
        };
        let (parts, upstream) = resp.into_parts();
        if !super::fails_replica(parts.status) {
            // Not measured for slowness: a language model's answer time is its prompt's and
            // generation's length, not the replica's speed (ADR 0014).
            guard.slot.health.answered();
        }
        if self.stream && parts.status.is_success() {
            return self.relay(parts, upstream, guard, started, deadline);
        }
        // Whole answers (and errors) are read within the deadline and measured at once.
        let limit = self.router.bodies().limits().max_answer_bytes;
        let collected = tokio::time::timeout_at(deadline, read_answer(upstream, limit)).await;
        let bytes = match collected {
            Ok(Ok(b)) => b,
            Ok(Err(AnswerError::TooLarge { limit })) => {
                // The request's doing (what it asked for), not the replica's fault: not ejected.
                let msg = super::body::answer_too_large(&format!("replica {}", guard.slot.name), limit);
                return self.failed(StatusCode::BAD_GATEWAY, msg, &guard, started);
            }
            Ok(Err(AnswerError::Broken(e))) => {
                let msg = format!("replica {} broke off its answer: {e}", guard.slot.name);
                self.router.eject(&guard.slot, &msg);
                return self.failed(StatusCode::BAD_GATEWAY, msg, &guard, started);
            }
            Err(_) => {
                let msg = format!(
                    "replica {} did not finish within the {} lane's request timeout ({} ms)",
                    guard.slot.name,
                    class.name,
                    timeout.as_millis()
                );
                self.router.eject(&guard.slot, &msg);
                return self.failed(StatusCode::GATEWAY_TIMEOUT, msg, &guard, started);
            }
        };
        let elapsed = started.elapsed();
        if super::ejects_replica(&guard.slot, parts.status) {
            self.router.eject(
                &guard.slot,
                &format!(
                    "answered {} {} times in a row",
                    parts.status,
                    super::table::ERROR_ANSWERS_TO_EJECT
                ),
            );
        }
        {
            let mut lane = self.route.lane.lock();
            if parts.status.is_success() {
                lane.counters.completed += 1;
            } else {
                lane.counters.failed += 1;
            }
        }
        if let Some((cache, key, _)) = &self.meta.cache {
            cache.put(
                *key,
                super::cache::Cached {
                    status: parts.status.as_u16(),
                    content_type: parts.headers.get(axum::http::header::CONTENT_TYPE).cloned(),
                    body: bytes.clone(),
                },
            );
        }
        if parts.status.is_success() {
            let usage = serde_json::from_slice::<Chunk>(&bytes).ok().and_then(|c| c.usage);
            self.record.ttft_ms = Some(self.arrived.elapsed().as_secs_f64() * 1000.0);
            if let Some(u) = usage {
                self.record.input_tokens = u.prompt_tokens;
                self.record.output_tokens = u.completion_tokens;
                self.record.gpu_ms = u.laneway_gpu_ms;
            }
        }
        self.record.service_ms = elapsed.as_secs_f64() * 1000.0;
        self.record.status = parts.status.as_u16();
        let mut r = (parts.status, bytes).into_response();
        if let Some(ct) = parts.headers.get(axum::http::header::CONTENT_TYPE) {
            r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct.clone());
        }
        self.finish_headers(r.headers_mut(), &guard);
        self.router.llm_stats.finished(&self.record, Instant::now());
        self.router.record(self.record);
        r
    }

    fn failed(mut self, status: StatusCode, msg: String, guard: &SlotGuard, started: Instant) -> Response {
        self.route.lane.lock().counters.failed += 1;
        self.record.service_ms = started.elapsed().as_secs_f64() * 1000.0;
        self.record.status = status.as_u16();
        let mut r = error(status, msg, &self.meta);
        self.finish_headers(r.headers_mut(), guard);
        self.router.record(self.record);
        r
    }

    fn finish_headers(&self, h: &mut HeaderMap, guard: &SlotGuard) {
        stamp(h, &self.meta);
        if let Some((_, _, said)) = &self.meta.cache {
            h.insert(super::cache::CACHE_HEADER, HeaderValue::from_static(said));
        }
        h.insert(super::answer::REPLICA, guard.slot.name_header.clone());
        super::answer::stamp_version(h, &self.meta);
        if let Ok(v) = HeaderValue::from_str(&format!("{:.3}", self.record.queue_ms)) {
            h.insert(super::answer::QUEUE_MS, v);
        }
    }

    /// Sends the request; the answer's head must come before `deadline`.
    async fn send(
        &self,
        guard: &SlotGuard,
        body: Bytes,
        traceparent: Option<&HeaderValue>,
        deadline: Instant,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ForwardError> {
        let uri: hyper::Uri = format!("http://{}{}", guard.slot.endpoint, self.endpoint.path())
            .parse()
            .map_err(|e| ForwardError::NotDelivered(format!("endpoint {:?}: {e}", guard.slot.endpoint)))?;
        let mut req = hyper::Request::post(uri)
            .header(axum::http::header::CONTENT_TYPE, "application/json")
            .header("x-request-id", self.meta.request_id.as_str())
            .header(
                super::TIMEOUT_HEADER,
                super::replica_timeout_ms(deadline.saturating_duration_since(Instant::now())).to_string(),
            );
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| ForwardError::NotDelivered(e.to_string()))?;
        match tokio::time::timeout_at(deadline, self.router.client.request(req)).await {
            Err(_) => Err(ForwardError::Timeout),
            Ok(Err(e)) if e.is_connect() => Err(ForwardError::NotDelivered(e.to_string())),
            Ok(Err(e)) => Err(ForwardError::Failed(e.to_string())),
            Ok(Ok(r)) => Ok(r),
        }
    }

    /// Streams the replica's answer to the client as it comes.
    fn relay(
        self,
        parts: hyper::http::response::Parts,
        upstream: hyper::body::Incoming,
        guard: SlotGuard,
        started: Instant,
        deadline: Instant,
    ) -> Response {
        let mut head = HeaderMap::new();
        self.finish_headers(&mut head, &guard);
        let labels = LaneHistograms::llm_labels(&self.record.class, &self.record.lane, &self.record.model);
        let relay = Relay {
            upstream,
            deadline,
            started,
            last_token_at: None,
            sse: SseScanner::new(self.strip_usage, self.router.bodies().limits().max_event_bytes),
            token_events: 0,
            usage: None,
            labels,
            guard: Some(guard),
            done: false,
            call: Some(self),
        };
        let stream = futures::stream::unfold(relay, |mut r| async move {
            if r.done {
                return None;
            }
            let next = tokio::select! {
                f = r.upstream.frame() => Some(f),
                _ = tokio::time::sleep_until(r.deadline) => None,
            };
            match next {
                None => {
                    let msg = r.fail(
                        StatusCode::GATEWAY_TIMEOUT,
                        "the stream ran past the lane's request timeout; the replica was cut off",
                    );
                    Some((Ok::<Bytes, std::io::Error>(error_event(&msg)), r))
                }
                Some(None) => {
                    r.finish(StatusCode::OK);
                    // An unfinished last event (no blank line after it) still goes out.
                    r.done = true;
                    let rest = r.sse.rest();
                    (!rest.is_empty()).then_some((Ok(rest), r))
                }
                Some(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => match r.scan(&data, Instant::now()) {
                        Ok(()) => {
                            let data = if r.sse.strips() { r.sse.take_out() } else { data };
                            Some((Ok(data), r))
                        }
                        Err(too_long) => {
                            let msg = r.fail(StatusCode::BAD_GATEWAY, &too_long.to_string());
                            let mut out = r.sse.cut_off(data).to_vec();
                            out.extend_from_slice(&error_event(&msg));
                            Some((Ok(Bytes::from(out)), r))
                        }
                    },
                    Err(_) => Some((Ok(Bytes::new()), r)),
                },
                Some(Some(Err(e))) => {
                    let msg = r.fail(
                        StatusCode::BAD_GATEWAY,
                        &format!("the replica broke off the stream: {e}"),
                    );
                    Some((Ok(error_event(&msg)), r))
                }
            }
        });
        let mut resp = Response::new(Body::from_stream(stream));
        *resp.status_mut() = parts.status;
        let h = resp.headers_mut();
        h.insert(
            axum::http::header::CONTENT_TYPE,
            parts
                .headers
                .get(axum::http::header::CONTENT_TYPE)
                .cloned()
                .unwrap_or(HeaderValue::from_static("text/event-stream")),
        );
        h.insert(axum::http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        // Proxies in front of the router must not buffer the stream either.
        h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        h.extend(head);
        resp
    }
}

/// An SSE `error` event, as OpenAI-compatible clients read it.
fn error_event(message: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "laneway_stream_error"}});
    Bytes::from(format!("event: error\ndata: {v}\n\n"))
}

/// The part of a completion (or a streamed chunk) the router reads.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<ReportedUsage>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize, Clone, Copy)]
pub(super) struct ReportedUsage {
    prompt_tokens: u32,
    completion_tokens: u32,
    /// The simulated server's GPU time for the request; real servers do not report it.
    #[serde(default)]
    laneway_gpu_ms: Option<f64>,
}

impl Chunk {
    fn has_token(&self) -> bool {
        self.choices.iter().any(|c| {
            c.text.as_deref().is_some_and(|t| !t.is_empty())
                || c.delta
                    .as_ref()
                    .and_then(|d| d.content.as_deref())
                    .is_some_and(|t| !t.is_empty())
        })
    }
}

/// A server-sent event stream's line (or, stripping, event) over the router's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("sent a server-sent event line or event over the router's limit of {limit} bytes (router.max_event_bytes); the stream was cut off there")]
pub(super) struct EventTooLong {
    limit: usize,
}

/// Reads server-sent events as they pass, across frame boundaries. When it strips the usage
/// chunk (the router asked for it, the client did not), it also rebuilds what passes on: whole
/// events only, without that one; otherwise frames pass on untouched. What it holds is bounded:
/// a line (and, stripping, an event) longer than `max_event_bytes` ends the scan.
pub(super) struct SseScanner {
    /// An event line split across frames.
    carry: Vec<u8>,
    /// The longest line, and the longest event stripping, it reads.
    max_event_bytes: usize,
    strip_usage: bool,
    /// Stripping: the lines read of the event not yet ended.
    event: Vec<u8>,
    /// Stripping: that event is the usage chunk.
    event_is_usage: bool,
    /// Stripping: whole events to pass on.
    out: Vec<u8>,
}

impl SseScanner {
    pub(super) fn new(strip_usage: bool, max_event_bytes: usize) -> Self {
        SseScanner {
            carry: Vec::new(),
            max_event_bytes,
            strip_usage,
            event: Vec::new(),
            event_is_usage: false,
            out: Vec::new(),
        }
    }

    fn strips(&self) -> bool {
        self.strip_usage
    }

    /// Events in `data` that carry a token, and the usage if one reported it; or, for a line
    /// (or an event) over the limit, the error, after which the stream must end
    /// ([`SseScanner::cut_off`]).
    pub(super) fn scan(&mut self, data: &[u8]) -> Result<(u32, Option<ReportedUsage>), EventTooLong> {
        let too_long = EventTooLong {
            limit: self.max_event_bytes,
        };
        let (mut tokens, mut usage) = (0, None);
        let mut rest = data;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            if self.carry.len() + i > self.max_event_bytes {
                return Err(too_long);
            }
            let line = if self.carry.is_empty() {
                &rest[..i]
            } else {
                self.carry.extend_from_slice(&rest[..i]);
                self.carry.as_slice()
            };
            if let Some(payload) = line.strip_prefix(b"data:") {
                let payload = payload.trim_ascii();
                if payload != b"[DONE]" {
                    if let Ok(c) = serde_json::from_slice::<Chunk>(payload) {
                        tokens += u32::from(c.has_token());
                        // The usage chunk has no choices (OpenAI's `include_usage`).
                        self.event_is_usage |= c.usage.is_some() && c.choices.is_empty();
                        usage = c.usage.or(usage);
                    }
                }
            }
            if self.strip_usage {
                if self.event.len() + line.len() + 1 > self.max_event_bytes {
                    return Err(too_long);
                }
                self.event.extend_from_slice(line);
                self.event.push(b'\n');
                if line.trim_ascii().is_empty() {
                    if !self.event_is_usage {
                        self.out.extend_from_slice(&self.event);
                    }
                    self.event.clear();
                }
            }
            if line.trim_ascii().is_empty() {
                self.event_is_usage = false;
            }
            self.carry.clear();
            rest = &rest[i + 1..];
        }
        if self.carry.len() + rest.len() > self.max_event_bytes {
            return Err(too_long);
        }
        self.carry.extend_from_slice(rest);
        Ok((tokens, usage))
    }

    /// After [`EventTooLong`] on `data`: what still passes on before the error event, and
    /// nothing is held any more. Stripping, the whole events read before the long one; else
    /// `data` as it came and a blank line, which ends the line cut off mid-way.
    fn cut_off(&mut self, data: Bytes) -> Bytes {
        let out = std::mem::take(&mut self.out);
        (self.carry, self.event) = (Vec::new(), Vec::new());
        if self.strip_usage {
            return Bytes::from(out);
        }
        let mut passed = Vec::with_capacity(data.len() + 2);
        passed.extend_from_slice(&data);
        passed.extend_from_slice(b"\n\n");
        Bytes::from(passed)
    }

    /// Stripping: the whole events read so far, to pass on.
    pub(super) fn take_out(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.out))
    }

    /// Stripping, at the end of the stream: whatever was held back of an unfinished event.
    fn rest(&mut self) -> Bytes {
        if !self.strip_usage {
            return Bytes::new();
        }
        let mut rest = std::mem::take(&mut self.out);
        if !self.event_is_usage {
            rest.append(&mut self.event);
            rest.append(&mut self.carry);
        }
        Bytes::from(rest)
    }
}

/// The request's body with `stream_options.include_usage` set, so the replica reports the
/// stream's tokens (and, simulated, its GPU time) at the end. The body parsed as a completion
/// request already; were it somehow not a JSON object, it goes on unchanged.
fn asking_for_usage(body: &Bytes) -> Bytes {
    rewritten(body, |obj| {
        let options = obj.entry("stream_options").or_insert_with(|| serde_json::json!({}));
        if !options.is_object() {
            *options = serde_json::json!({});
        }
        options["include_usage"] = serde_json::Value::Bool(true);
    })
}

/// Whether the request asks for greedy sampling (`temperature` 0): the only kind whose answer
/// the result cache may give again.
fn greedy(body: &Bytes) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("temperature")?.as_f64())
        == Some(0.0)
}

/// The body a shadow copy is sent with: a whole answer (its usage read from it), whatever
/// the caller asked for.
pub(super) fn whole_answer(body: &Bytes) -> Bytes {
    rewritten(body, |obj| {
        obj.insert("stream".into(), serde_json::Value::Bool(false));
        obj.remove("stream_options");
    })
}

/// Tokens and (simulated) GPU time a whole answer reports: (input, output, GPU ms).
pub(super) fn answer_usage(body: &[u8]) -> Option<(u32, u32, Option<f64>)> {
    let u = serde_json::from_slice::<Chunk>(body).ok()?.usage?;
    Some((u.prompt_tokens, u.completion_tokens, u.laneway_gpu_ms))
}

/// The request's body for the model `name` (its fallback answers it: the engine serves only
/// its own name).
fn for_model(body: &Bytes, name: &str) -> Bytes {
    rewritten(body, |obj| {
        obj.insert("model".into(), serde_json::Value::String(name.into()));
    })
}

/// `body` with `change` made to it. The body parsed as a completion request already; were it
/// somehow not a JSON object, it goes on unchanged.
fn rewritten(body: &Bytes, change: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> Bytes {
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return body.clone();
    };
    change(&mut obj);
    serde_json::to_vec(&obj)
        .map(Bytes::from)
        .unwrap_or_else(|_| body.clone())
}

/// A stream being passed through, and what it has shown so far.
struct Relay {
    upstream: hyper::body::Incoming,
    deadline: Instant,
    started: Instant,
    last_token_at: Option<Instant>,
    sse: SseScanner,
    token_events: u32,
    usage: Option<ReportedUsage>,
    labels: Labels,
    guard: Option<SlotGuard>,
    done: bool,
    /// Taken when the request is recorded (once).
    call: Option<Call>,
}

impl Relay {
    /// Reads the events in `data` (without changing it): tokens, and the usage if reported.
    fn scan(&mut self, data: &[u8], now: Instant) -> Result<(), EventTooLong> {
        let (tokens, usage) = self.sse.scan(data)?;
        self.usage = usage.or(self.usage);
        if tokens == 0 {
            return Ok(());
        }
        self.token_events += tokens;
        let Some(call) = &mut self.call else { return Ok(()) };
        match self.last_token_at {
            None => call.record.ttft_ms = Some(now.saturating_duration_since(call.arrived).as_secs_f64() * 1000.0),
            Some(last) => {
                let gap = now.saturating_duration_since(last);
                call.router.histograms.observe_itl(&self.labels, gap.as_secs_f64());
                call.router.llm_stats.observe_itl(
                    &call.record.class,
                    &call.record.model,
                    gap.as_secs_f64() * 1000.0,
                    now,
                );
            }
        }
        self.last_token_at = Some(now);
        Ok(())
    }

    /// Ends the stream as failed; returns the message for the error event.
    fn fail(&mut self, status: StatusCode, why: &str) -> String {
        let replica = self.guard.as_ref().map(|g| g.slot.name.clone()).unwrap_or_default();
        let msg = format!("replica {replica}: {why}");
        if let (Some(call), Some(g)) = (&self.call, &self.guard) {
            call.router.eject(&g.slot, &msg);
        }
        self.done = true;
        self.finish(status);
        msg
    }

    /// Records the request (once) and frees its slot and tenant hold.
    fn finish(&mut self, status: StatusCode) {
        let Some(mut call) = self.call.take() else { return };
        {
            let mut lane = call.route.lane.lock();
            if status.is_success() {
                lane.counters.completed += 1;
            } else {
                lane.counters.failed += 1;
            }
        }
        let rec = &mut call.record;
        rec.status = status.as_u16();
        rec.service_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        rec.output_tokens = self.token_events;
        if let Some(u) = self.usage {
            rec.input_tokens = u.prompt_tokens;
            rec.output_tokens = u.completion_tokens;
            rec.gpu_ms = u.laneway_gpu_ms;
        }
        call.router.llm_stats.finished(rec, Instant::now());
        drop(self.guard.take());
        drop(call.tenant_hold.take());
        call.router.record(call.record);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Dropped before the end: the client went away (nginx's 499). Dropping `upstream`
        // closes the connection to the replica, which stops generating.
        if self.call.is_some() {
            self.finish(StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST));
        }
    }
}

/// Recent samples of one (class, model).
#[derive(Default)]
struct Recent {
    ttft: VecDeque<(Instant, f64)>,
    itl: VecDeque<(Instant, f64)>,
    /// (finished at, input tokens, output tokens, GPU ms).
    done: VecDeque<(Instant, u32, u32, f64)>,
}

impl Recent {
    fn trim(&mut self, now: Instant) {
        let old = |at: &Instant| now.saturating_duration_since(*at) > RECENT;
        while self.ttft.front().is_some_and(|(at, _)| old(at)) || self.ttft.len() > MAX_TTFT_SAMPLES {
            self.ttft.pop_front();
        }
        while self.itl.front().is_some_and(|(at, _)| old(at)) || self.itl.len() > MAX_ITL_SAMPLES {
            self.itl.pop_front();
        }
        while self.done.front().is_some_and(|(at, ..)| old(at)) || self.done.len() > MAX_TTFT_SAMPLES {
            self.done.pop_front();
        }
    }
}

/// Quantile `q` (0–1) of `values` by nearest rank.
pub fn quantile(mut values: Vec<f64>, q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

/// TTFT, ITL and tokens of the language models this router served lately.
#[derive(Default)]
pub struct LlmStats {
    models: Mutex<HashMap<(String, String), Recent>>,
}

impl LlmStats {
    fn with<R>(&self, class: &str, model: &str, f: impl FnOnce(&mut Recent) -> R) -> R {
        let mut m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry((class.to_string(), model.to_string())).or_default())
    }

    pub fn observe_itl(&self, class: &str, model: &str, ms: f64, now: Instant) {
        self.with(class, model, |r| {
            r.itl.push_back((now, ms));
            r.trim(now);
        });
    }

    /// Counts a finished request (one that reached a replica and measured a first token).
    pub fn finished(&self, rec: &RequestRecord, now: Instant) {
        let Some(ttft) = rec.ttft_ms else { return };
        self.with(&rec.class, &rec.model, |r| {
            r.ttft.push_back((now, ttft));
            r.done
                .push_back((now, rec.input_tokens, rec.output_tokens, rec.gpu_ms.unwrap_or(0.0)));
            r.trim(now);
        });
    }

    /// The models of `class`, summarised.
    pub fn summary(&self, class: &str, now: Instant) -> Vec<LlmSummary> {
        let mut m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<LlmSummary> = m
            .iter_mut()
            .filter(|((c, _), _)| c == class)
            .map(|((_, model), r)| {
                r.trim(now);
                let ttft: Vec<f64> = r.ttft.iter().map(|(_, v)| *v).collect();
                let itl: Vec<f64> = r.itl.iter().map(|(_, v)| *v).collect();
                let gpu_ms: f64 = r.done.iter().map(|d| d.3).sum();
                let output: u64 = r.done.iter().map(|d| u64::from(d.2)).sum();
                LlmSummary {
                    model: model.clone(),
                    requests: r.done.len() as u64,
                    ttft_p50_ms: quantile(ttft.clone(), 0.5),
                    ttft_p99_ms: quantile(ttft, 0.99),
                    itl_p50_ms: quantile(itl.clone(), 0.5),
                    itl_p99_ms: quantile(itl, 0.99),
                    input_tokens: r.done.iter().map(|d| u64::from(d.1)).sum(),
                    output_tokens: output,
                    output_tokens_per_gpu_s: (gpu_ms > 0.0).then(|| output as f64 / (gpu_ms / 1000.0)),
                }
            })
            .filter(|s| s.requests > 0 || s.itl_p99_ms.is_some())
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// TTFT and ITL p99 (ms) of every model of `class` over the last `window`.
    pub fn lane_p99(&self, class: &str, window: Duration, now: Instant) -> (Option<f64>, Option<f64>) {
        let m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let recent = |samples: &VecDeque<(Instant, f64)>| -> Vec<f64> {
            samples
                .iter()
                .filter(|(at, _)| now.saturating_duration_since(*at) <= window)
                .map(|(_, v)| *v)
                .collect()
        };
        let (mut ttft, mut itl) = (Vec::new(), Vec::new());
        for ((c, _), r) in m.iter() {
            if c == class {
                ttft.extend(recent(&r.ttft));
                itl.extend(recent(&r.itl));
            }
        }
        (quantile(ttft, 0.99), quantile(itl, 0.99))
    }

    /// TTFT p99 (ms) of `model` over the last `window`, and how many samples it rests on.
    pub fn ttft_p99(&self, model: &str, window: Duration, now: Instant) -> Option<(f64, usize)> {
        let m = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let values: Vec<f64> = m
            .iter()
            .filter(|((_, name), _)| name == model)
            .flat_map(|(_, r)| r.ttft.iter())
            .filter(|(at, _)| now.saturating_duration_since(*at) <= window)
            .map(|(_, v)| *v)
            .collect();
        let n = values.len();
        quantile(values, 0.99).map(|p| (p, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(v.clone(), 0.99), Some(99.0));
        assert_eq!(quantile(v.clone(), 0.5), Some(50.0));
        assert_eq!(quantile(vec![7.0], 0.99), Some(7.0));
        assert_eq!(quantile(vec![], 0.5), None);
    }

    #[test]
    fn events_split_across_frames_are_read_once() {
        let mut s = SseScanner::new(false, MIB);
        let events = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"t1 \"}}]}\n\ndata: {\"choices\":[{\"text\":\"t2\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        // Cut everywhere: the counts do not depend on where frames end.
        for cut in 1..events.len() {
            let mut s2 = SseScanner::new(false, MIB);
            let (a, u1) = s2.scan(&events[..cut]).unwrap();
            let (b, u2) = s2.scan(&events[cut..]).unwrap();
            assert_eq!(a + b, 2, "cut at {cut}");
            let u = u2.or(u1).expect("usage read");
            assert_eq!((u.prompt_tokens, u.completion_tokens), (7, 2));
        }
        let (n, _) = s
            .scan(b"event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\n")
            .unwrap();
        assert_eq!(n, 0, "an error event is not a token");

        // Stripping the usage chunk the client did not ask for: the rest passes on byte for
        // byte, wherever the frames were cut.
        let expected = String::from_utf8_lossy(events).replace(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\n",
            "",
        );
        for cut in 1..events.len() {
            let mut s = SseScanner::new(true, MIB);
            let (a, u1) = s.scan(&events[..cut]).unwrap();
            let mut out = s.take_out().to_vec();
            let (b, u2) = s.scan(&events[cut..]).unwrap();
            out.extend_from_slice(&s.take_out());
            out.extend_from_slice(&s.rest());
            assert_eq!((a + b, u2.or(u1).is_some()), (2, true), "cut at {cut}");
            assert_eq!(String::from_utf8_lossy(&out), expected, "cut at {cut}");
        }
        // A last event without its blank line is not lost.
        let mut s = SseScanner::new(true, MIB);
        s.scan(b"data: {\"choices\":[{\"text\":\"t1\"}]}\n\ndata: [DONE]")
            .unwrap();
        assert_eq!(&s.take_out()[..], b"data: {\"choices\":[{\"text\":\"t1\"}]}\n\n");
        assert_eq!(&s.rest()[..], b"data: [DONE]");
    }

    /// A line (or, stripping, an event) longer than the limit ends the scan wherever the frames
    /// were cut, instead of growing the scanner's buffers; what was whole before it still
    /// passes on.
    #[test]
    fn a_line_or_event_over_the_limit_ends_the_stream() {
        let good = b"data: {\"choices\":[{\"text\":\"t1\"}]}\n\n";
        let long = format!("data: {}", "x".repeat(200));
        for strip in [false, true] {
            // Never ended: the line grows across frames.
            let mut s = SseScanner::new(strip, 100);
            assert_eq!(s.scan(good).unwrap().0, 1);
            let mut failed = None;
            for (i, chunk) in long.as_bytes().chunks(30).enumerate() {
                if let Err(e) = s.scan(chunk) {
                    failed = Some((i, e));
                    break;
                }
            }
            let (i, e) = failed.expect("the long line was refused");
            assert_eq!(e, EventTooLong { limit: 100 });
            assert!(i <= 4, "refused as it passed the limit, not at its end: chunk {i}");
            assert!(s.carry.len() <= 100 && s.event.len() <= 100, "strip {strip}");
            let passed = s.cut_off(Bytes::from_static(b"xx"));
            assert!(s.carry.is_empty() && s.event.is_empty());
            if strip {
                assert_eq!(&passed[..], &good[..], "the whole event before it");
            } else {
                assert_eq!(&passed[..], b"xx\n\n", "the frame, and its line ended");
            }
            // Ended, in one frame.
            let mut s = SseScanner::new(strip, 100);
            assert!(s.scan(format!("{long}\n\n").as_bytes()).is_err(), "strip {strip}");
        }
        // Stripping: an event of short lines that adds up past the limit.
        let mut s = SseScanner::new(true, 100);
        let event = "data: x\n".repeat(20);
        assert!(s.scan(event.as_bytes()).is_err());
        let mut s = SseScanner::new(false, 100);
        assert!(s.scan(event.as_bytes()).is_ok(), "passing through, only lines are held");
    }

    #[test]
    fn the_router_asks_for_usage_and_keeps_the_clients_other_options() {
        let v = |b: Bytes| serde_json::from_slice::<serde_json::Value>(&b).unwrap();
        let asked = asking_for_usage(&Bytes::from_static(br#"{"model":"m","prompt":"p","stream":true}"#));
        assert_eq!(v(asked)["stream_options"], serde_json::json!({"include_usage": true}));
        let asked = asking_for_usage(&Bytes::from_static(
            br#"{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false}}"#,
        ));
        assert_eq!(
            v(asked)["stream_options"],
            serde_json::json!({"include_usage": true, "continuous_usage_stats": false})
        );
    }

    use std::net::SocketAddr;

    use laneway_agent::sim_model::llm::{self as sim, LlmSimConfig};

    use super::super::server::{serve as serve_http, RouterServer, RouterSettings};
    use crate::registry::{hash_key, LlmSpec, ReplicaRecord, Tenant, TenantLimit};

    /// A simulated LLM replica of `chat` on 127.0.0.1: 20 tokens/s per sequence.
    async fn replica(abort_after: Option<u32>) -> SocketAddr {
        replica_of("chat", abort_after).await
    }

    /// [`replica`] serving `model`.
    async fn replica_of(model: &str, abort_after: Option<u32>) -> SocketAddr {
        let app = sim::app(LlmSimConfig {
            model: model.into(),
            product: "L4".into(),
            tokens_per_s: [("L4".to_string(), 1000.0)].into(),
            kv_cache_tokens: [("L4".to_string(), 100_000)].into(),
            prefill_factor: 20.0,
            max_seq_tokens_per_s: 20.0,
            max_running: 4,
            context_tokens: 4096,
            default_max_tokens: 8,
            abort_stream_after_tokens: abort_after,
        })
        .unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        addr
    }

    /// A router with the language model `chat` (class `speech`, sync, context 4096) on
    /// `replicas`, tenant key `k` with `limit` on every class.
    async fn router(
        replicas: &[SocketAddr],
        limit: Option<TenantLimit>,
    ) -> (Arc<Router>, RouterServer, tempfile::TempDir) {
        let (fleet, mut reg) = super::super::table::test_fixture();
        let mut m = reg.models["whisper"].clone();
        m.name = "chat".into();
        m.llm = Some(LlmSpec {
            context_tokens: 4096,
            default_max_tokens: 8,
            prefix_affinity_tokens: 64,
        });
        reg.put_model(&m).unwrap();
        reg.create_tenant(&Tenant {
            name: "t".into(),
            key_sha256: hash_key("k"),
            limits: limit.map(|l| [("*".to_string(), l)].into()).unwrap_or_default(),
        })
        .unwrap();
        let records: Vec<ReplicaRecord> = replicas
            .iter()
            .enumerate()
            .map(|(i, addr)| ReplicaRecord {
                id: format!("r{i}"),
                model: "chat".into(),
                device: "GPU-1".into(),
                state: "ready".into(),
                endpoint: addr.to_string(),
            })
            .collect();
        reg.set_node_replicas("n1", &records);
        serve_registry(&fleet, &reg).await
    }

    /// A router with the table built from `fleet` and `reg`, served on a free port.
    async fn serve_registry(
        fleet: &crate::fleet::Fleet,
        reg: &crate::registry::Registry,
    ) -> (Arc<Router>, RouterServer, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let router = Router::new(crate::store::StateMachineStore::open(dir.path()).unwrap());
        router.install(super::super::table::build(fleet, reg, &Default::default()));
        let server = serve_http(
            router.clone(),
            axum::Router::new(),
            tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            &RouterSettings::default(),
        )
        .unwrap();
        (router, server, dir)
    }

    /// The language model `name` in class `speech` (context 4096), falling back to `fallback`.
    fn language_model(reg: &crate::registry::Registry, name: &str, fallback: Option<&str>) -> crate::registry::Model {
        crate::registry::Model {
            name: name.into(),
            fallback: fallback.map(Into::into),
            llm: Some(LlmSpec {
                context_tokens: 4096,
                default_max_tokens: 8,
                prefix_affinity_tokens: 0,
            }),
            ..reg.models["whisper"].clone()
        }
    }

    /// Tenant `t` with key `k`, no limits.
    fn tenant_k(reg: &mut crate::registry::Registry) {
        reg.create_tenant(&Tenant {
            name: "t".into(),
            key_sha256: hash_key("k"),
            limits: Default::default(),
        })
        .unwrap();
    }

    /// A ready replica `id` of the entry `model` on n1's GPU, at `addr`.
    fn ready(id: &str, model: &str, addr: SocketAddr) -> ReplicaRecord {
        ReplicaRecord {
            id: id.into(),
            model: model.into(),
            device: "GPU-1".into(),
            state: "ready".into(),
            endpoint: addr.to_string(),
        }
    }

    /// A language model's fallback (a smaller one) answers its requests, streamed or not,
    /// while it has no healthy replica — the body names the fallback, whose engine serves only
    /// its own name — and says so. Without a fallback, the lane's canned answer is given to a
    /// whole-answer request only: a stream is refused as usual.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_language_models_fallback_answers_while_it_has_no_healthy_replica() {
        let small = replica_of("chat-small", None).await;
        let (fleet, mut reg) = super::super::table::test_fixture();
        for (name, fallback) in [("chat-small", None), ("chat", Some("chat-small")), ("lonely", None)] {
            reg.put_model(&language_model(&reg, name, fallback)).unwrap();
        }
        let mut speech = reg.classes["speech"].clone();
        speech.fallback_response = Some(crate::registry::FallbackResponse {
            status: 200,
            body: r#"{"choices":[]}"#.into(),
        });
        reg.put_class(&speech).unwrap();
        tenant_k(&mut reg);
        reg.set_node_replicas("n1", &[ready("s0", "chat-small", small)]);
        let (_router, server, _dir) = serve_registry(&fleet, &reg).await;

        for stream in [false, true] {
            let r = chat(&server, ask("hello", 4, stream)).send().await.unwrap();
            assert_eq!(r.status(), 200, "stream {stream}");
            assert_eq!(r.headers()["x-laneway-fallback-for"], "chat");
            let text = r.text().await.unwrap();
            assert!(text.contains("chat-small"), "answered by the fallback: {text}");
        }
        assert_eq!(replica_metric(small, "laneway_sim_llm_finished_total").await, 2.0);

        let lonely_ask = |stream: bool| serde_json::json!({"model": "lonely", "messages": [{"role": "user", "content": "hi"}], "stream": stream});
        let r = chat(&server, lonely_ask(false)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-laneway-degraded"], "fallback-response");
        assert_eq!(r.text().await.unwrap(), r#"{"choices":[]}"#);
        let r = chat(&server, lonely_ask(true)).send().await.unwrap();
        assert_eq!(r.status(), 503, "a stream gets no canned JSON");
        assert!(r.headers().get("x-laneway-degraded").is_none());
        server.stop().await;
    }

    /// Above the lane's four slots, completions go to its overflow endpoint (another OpenAI-
    /// compatible server) at the same path: a stream is passed through as a stream, a whole
    /// answer as it came with its tokens metered, each marked and metered at the endpoint's
    /// price; the endpoint's slots come back when the streams end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completions_above_the_lanes_capacity_go_to_its_overflow_endpoint() {
        let (owned, hosted) = (replica(None).await, replica(None).await);
        let (fleet, mut reg) = super::super::table::test_fixture();
        reg.put_model(&language_model(&reg, "chat", None)).unwrap();
        let mut speech = reg.classes["speech"].clone();
        speech.request_timeout_ms = crate::registry::Millis::from_ms(5_000.0);
        speech.overflow = Some(crate::registry::OverflowSpec::for_test(
            &format!("http://{hosted}"),
            8,
            3_000,
        ));
        reg.put_class(&speech).unwrap();
        tenant_k(&mut reg);
        reg.set_node_replicas("n1", &[ready("r0", "chat", owned)]);
        let (router, server, _dir) = serve_registry(&fleet, &reg).await;
        // Six at once, each about a second of generation (20 tokens at 20 tokens/s).
        let at = &server;
        let calls: Vec<_> = (0..6)
            .map(|i| {
                let stream = i % 2 == 0;
                async move {
                    let r = chat(at, ask("tell me more", 20, stream)).send().await.unwrap();
                    let overflowed = r.headers().contains_key("x-laneway-overflow");
                    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
                    (r.status(), overflowed, stream, ct, r.text().await.unwrap())
                }
            })
            .collect();
        let mut out = 0;
        for (status, overflowed, stream, ct, text) in futures::future::join_all(calls).await {
            assert_eq!(status, 200, "the excess is answered, not refused: {text}");
            assert_eq!(ct.starts_with("text/event-stream"), stream, "{ct}");
            if stream {
                assert!(text.trim_end().ends_with("data: [DONE]"), "a whole stream: {text}");
            }
            out += u64::from(overflowed);
        }
        assert_eq!(out, 2, "only what the four slots could not take went out");
        assert_eq!(replica_metric(hosted, "laneway_sim_llm_finished_total").await, 2.0);
        assert_eq!(
            router.overflow_metered(),
            (2, 2 * 3_000_000),
            "metered at $0.003 a request"
        );
        server.stop().await;
    }

    /// A class with a result cache: a whole answer sampled greedily (temperature 0) is given
    /// again with the same bytes and no replica work; a sampled one, or a stream, is not
    /// cached.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_greedy_whole_answer_is_cached_and_sampled_or_streamed_ones_are_not() {
        let addr = replica(None).await;
        let (fleet, mut reg) = super::super::table::test_fixture();
        reg.put_model(&language_model(&reg, "chat", None)).unwrap();
        let mut speech = reg.classes["speech"].clone();
        speech.cache = Some(crate::registry::CacheSpec {
            ttl_s: 60,
            max_mib: 1,
            shared: false,
        });
        reg.put_class(&speech).unwrap();
        tenant_k(&mut reg);
        reg.set_node_replicas("n1", &[ready("r0", "chat", addr)]);
        let (_router, server, _dir) = serve_registry(&fleet, &reg).await;
        let at = |temperature: f64, stream: bool| {
            let mut b = ask("the same question", 4, stream);
            b["temperature"] = serde_json::json!(temperature);
            b
        };
        let finished = || replica_metric(addr, "laneway_sim_llm_finished_total");

        let first = chat(&server, at(0.0, false)).send().await.unwrap();
        assert_eq!(first.headers()["x-laneway-cache"], "miss");
        let first = first.bytes().await.unwrap();
        let again = chat(&server, at(0.0, false)).send().await.unwrap();
        assert_eq!(again.headers()["x-laneway-cache"], "hit");
        assert_eq!(again.bytes().await.unwrap(), first, "identical bytes");
        assert_eq!(finished().await, 1.0, "the hit did no replica work");

        for (temperature, stream) in [(0.7, false), (0.7, false), (0.0, true)] {
            let r = chat(&server, at(temperature, stream)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert!(r.headers().get("x-laneway-cache").is_none(), "{temperature} {stream}");
            r.bytes().await.unwrap();
        }
        assert_eq!(
            finished().await,
            4.0,
            "sampled and streamed answers are generated each time"
        );
        server.stop().await;
    }

    /// A shadow rollout of a language model copies requests (streamed ones as requests for a
    /// whole answer) to the new version; the caller gets the serving version's answer as it
    /// asked for it, and the copies are metered to the shadow tenant with their tokens.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_language_models_shadow_gets_copies_and_the_caller_never_sees_them() {
        let (v1, v2) = (replica(None).await, replica(None).await);
        let (fleet, mut reg) = super::super::table::test_fixture();
        reg.put_model(&language_model(&reg, "chat", None)).unwrap();
        reg.start_shadow_for_test("chat", "2");
        tenant_k(&mut reg);
        reg.set_node_replicas("n1", &[ready("a", "chat", v1), ready("b", "chat@2", v2)]);
        let (router, server, _dir) = serve_registry(&fleet, &reg).await;
        for stream in [false, true, false] {
            let r = chat(&server, ask("hello", 4, stream)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(
                r.headers()["x-laneway-replica"],
                "n1/a",
                "served by the serving version"
            );
            let ct = r.headers()["content-type"].to_str().unwrap().to_string();
            assert_eq!(ct.starts_with("text/event-stream"), stream, "{ct}");
            r.bytes().await.unwrap();
        }
        let copies = async {
            while replica_metric(v2, "laneway_sim_llm_finished_total").await < 3.0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), copies)
            .await
            .expect("every request was copied to the new version");
        // Metered once the router has read each copy's answer, just after the replica counts it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let report = router.meter().next_report(1, 0).unwrap();
        let shadow: Vec<_> = report
            .rows
            .iter()
            .filter(|u| u.tenant == super::super::SHADOW_TENANT)
            .collect();
        assert_eq!(shadow.iter().map(|u| u.requests).sum::<u64>(), 3, "{shadow:?}");
        assert!(
            shadow
                .iter()
                .all(|u| u.version == "2" && u.output_tokens > 0 && u.gpu_us > 0),
            "{shadow:?}"
        );
        server.stop().await;
    }

    fn chat(server: &RouterServer, body: serde_json::Value) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .post(format!("http://{}/v1/chat/completions", server.addr))
            .bearer_auth("k")
            .json(&body)
    }

    fn ask(prompt: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
        serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream})
    }

    /// A gauge or counter from the replica's /metrics.
    async fn replica_metric(addr: SocketAddr, name: &str) -> f64 {
        let text = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }

    /// The first chunk reaches the client while the replica is still generating; the whole
    /// stream passes through unchanged and is measured.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_passes_through_chunk_by_chunk() {
        let addr = replica(None).await;
        let (router, server, _dir) = router(&[addr], None).await;
        let mut resp = chat(&server, ask("hello", 10, true)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        assert_eq!(resp.headers()["x-laneway-lane"], "sync");
        let mut text = String::new();
        while !text.contains("t1 ") {
            let chunk = resp.chunk().await.unwrap().expect("more chunks");
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        let generated = replica_metric(addr, "vllm:generation_tokens_total").await;
        assert!(
            generated < 10.0,
            "the first token arrived after {generated} of 10 were generated: the router buffered"
        );
        while let Some(chunk) = resp.chunk().await.unwrap() {
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        for i in 1..=10 {
            assert!(text.contains(&format!("\"t{i} \"")), "token {i} missing from {text}");
        }
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert!(
            !text.contains("\"usage\""),
            "the usage chunk the router asked for is kept from a client that did not: {text}"
        );
        let rec = router.recent(None, 1).pop().unwrap();
        assert_eq!((rec.status, rec.output_tokens), (200, 10));
        assert!(rec.ttft_ms.is_some_and(|t| t < rec.service_ms), "{rec:?}");
        assert!(
            rec.gpu_ms.is_some_and(|g| g > 0.0),
            "metered from the replica's usage: {rec:?}"
        );

        let s = router.llm_stats().summary("speech", Instant::now());
        assert_eq!(s[0].requests, 1);
        assert!(
            s[0].itl_p99_ms.is_some_and(|ms| ms >= 25.0),
            "20 tokens/s means ~50 ms gaps: {s:?}"
        );
        assert_eq!(
            router.table().models["chat"].replicas[0].load(),
            0,
            "the slot is free again"
        );

        // A client that asks for the usage gets it, once.
        let mut body = ask("hello", 3, true);
        body["stream_options"] = serde_json::json!({"include_usage": true});
        let text = chat(&server, body).send().await.unwrap().text().await.unwrap();
        assert_eq!(text.matches("\"usage\"").count(), 1, "{text}");
        assert!(text.contains("\"completion_tokens\":3"), "{text}");
        server.stop().await;
    }

    /// A client that goes away mid-stream stops the replica's work for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_disconnects_cancels_the_generation() {
        let addr = replica(None).await;
        let (router, server, _dir) = router(&[addr], None).await;
        let mut resp = chat(&server, ask("hello", 1000, true)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.chunk().await.unwrap().expect("a first chunk");
        drop(resp);
        let mut cancelled = 0.0;
        for _ in 0..100 {
            cancelled = replica_metric(addr, "laneway_sim_llm_cancelled_total").await;
            if cancelled >= 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(cancelled, 1.0, "the replica never noticed the client left");
        assert_eq!(replica_metric(addr, "vllm:num_requests_running").await, 0.0);
        let generated = replica_metric(addr, "vllm:generation_tokens_total").await;
        assert!(generated < 1000.0, "{generated}");
        let rec = router.recent(None, 1).pop().unwrap();
        assert_eq!(rec.status, 499, "recorded as abandoned by the client: {rec:?}");
        assert_eq!(router.table().models["chat"].replicas[0].load(), 0);
        server.stop().await;
    }

    /// A replica that dies mid-stream ends the client's stream with an error event, at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_crash_mid_stream_ends_it_with_an_error_event() {
        let addr = replica(Some(3)).await;
        let (router, server, _dir) = router(&[addr], None).await;
        let resp = chat(&server, ask("hello", 50, true)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let text = tokio::time::timeout(Duration::from_secs(10), resp.text())
            .await
            .expect("the stream ended instead of hanging")
            .unwrap_or_default();
        assert!(text.contains("\"t3 \""), "{text}");
        assert!(!text.contains("\"t4 \"") && !text.contains("[DONE]"), "{text}");
        assert!(text.contains("event: error") && text.contains("broke off"), "{text}");
        let rec = router.recent(None, 1).pop().unwrap();
        assert_eq!((rec.status, rec.output_tokens), (502, 3));
        let slot = &router.table().models["chat"].replicas[0];
        assert_eq!(slot.load(), 0);
        assert!(
            slot.is_ejected(router.now_ms(Instant::now())),
            "the failed replica is skipped"
        );
        server.stop().await;
    }

    /// Whole answers are measured too; tokens come from the replica's usage.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unstreamed_completion_is_metered_from_its_usage() {
        let addr = replica(None).await;
        let (router, server, _dir) = router(&[addr], None).await;
        let resp = chat(&server, ask(&"x".repeat(400), 3, false)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "t1 t2 t3 ");
        let rec = router.recent(None, 1).pop().unwrap();
        assert_eq!(
            (rec.input_tokens, rec.output_tokens),
            (v["usage"]["prompt_tokens"].as_u64().unwrap() as u32, 3)
        );
        assert!(rec.gpu_ms.is_some_and(|g| g > 0.0), "{rec:?}");
        server.stop().await;
    }

    /// Bad requests are refused before any replica sees them, saying what to change.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_over_the_context_or_the_token_rate_are_refused_up_front() {
        let addr = replica(None).await;
        let limit = TenantLimit {
            concurrency: 100,
            rate_per_s: 100,
            burst: 100,
            tokens_per_min: Some(40),
        };
        let (router, server, _dir) = router(&[addr], Some(limit)).await;
        let r = chat(&server, ask("hi", 5000, false)).send().await.unwrap();
        assert_eq!(r.status(), 400);
        let e = r.text().await.unwrap();
        assert!(e.contains("context of 4096 tokens") && e.contains("max_tokens"), "{e}");
        let r = chat(&server, ask("hi", 100, false)).send().await.unwrap();
        assert_eq!(r.status(), 400, "larger than the whole minute: never fits");
        assert!(r.text().await.unwrap().contains("40 tokens/min"));
        let r = chat(&server, serde_json::json!({"model": "chat", "messages": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        assert!(r.text().await.unwrap().contains("messages"));
        // 40 tokens a minute: three requests of 13 (3 input + 10 output) fit, the fourth waits
        // for the refill.
        for _ in 0..3 {
            assert_eq!(chat(&server, ask("hi", 10, false)).send().await.unwrap().status(), 200);
        }
        let r = chat(&server, ask("hi", 10, false)).send().await.unwrap();
        assert_eq!(r.status(), 429);
        let wait: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&wait), "{wait}");
        assert!(r.text().await.unwrap().contains("tokens/min"));
        assert_eq!(replica_metric(addr, "laneway_sim_llm_finished_total").await, 3.0);
        let v2 = reqwest::Client::new()
            .post(format!("http://{}/v1/chat/completions", server.addr))
            .bearer_auth("k")
            .json(&serde_json::json!({"model": "whisper", "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(v2.status(), 400, "a model without [llm] is not served here");
        assert!(v2.text().await.unwrap().contains("/v2/models/whisper/infer"));
        drop(router);
        server.stop().await;
    }

    /// What a request costs counts everything that reaches the engine: each of its `n` choices
    /// takes `max_tokens`, and tool definitions and images are prompt tokens, against both the
    /// tenant's minute and the model's context.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn choices_tools_and_images_count_against_the_minute_and_the_context() {
        let addr = replica(None).await;
        let limit = TenantLimit {
            concurrency: 100,
            rate_per_s: 100,
            burst: 100,
            tokens_per_min: Some(40),
        };
        let (router, server, _dir) = router(&[addr], Some(limit)).await;
        let with = |extra: serde_json::Value| {
            let mut body = ask("hi", 10, false);
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            body
        };
        // 3 input + 10 output fits the 40-token minute once; four choices of 10 never do.
        for extra in [
            serde_json::json!({"n": 4}),
            serde_json::json!({"best_of": 4}),
            serde_json::json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d".repeat(200)}}]}),
        ] {
            let r = chat(&server, with(extra.clone())).send().await.unwrap();
            assert_eq!(r.status(), 400, "{extra}");
            let e = r.text().await.unwrap();
            assert!(e.contains("40 tokens/min"), "{extra}: {e}");
        }
        let image = serde_json::json!([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]);
        let r = chat(
            &server,
            serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": image}], "max_tokens": 1}),
        )
        .send()
        .await
        .unwrap();
        assert_eq!(r.status(), 400, "an image is more than the minute");
        // The context: 16,000 characters of tool definitions are about 4,000 tokens of prompt.
        let tools =
            serde_json::json!([{"type": "function", "function": {"name": "f", "description": "d".repeat(16_000)}}]);
        let r = chat(&server, with(serde_json::json!({"tools": tools, "max_tokens": 200})))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let e = r.text().await.unwrap();
        assert!(e.contains("context of 4096 tokens") && e.contains("tools"), "{e}");
        let r = chat(&server, with(serde_json::json!({"n": "4"}))).send().await.unwrap();
        assert_eq!(r.status(), 400);
        let e: serde_json::Value = r.json().await.unwrap();
        assert!(
            e["error"]
                .as_str()
                .unwrap()
                .contains("`n` = \"4\": expected a whole number"),
            "{e}"
        );
        assert_eq!(chat(&server, ask("hi", 10, false)).send().await.unwrap().status(), 200);
        assert_eq!(
            replica_metric(addr, "laneway_sim_llm_finished_total").await,
            1.0,
            "only the request that fits reached the replica"
        );
        drop(router);
        server.stop().await;
    }

    /// Requests sharing a prefix go to one replica until its load bound, then spread; other
    /// prefixes spread over the replicas.
    #[tokio::test(flavor = "current_thread")]
    async fn prefix_affinity_keeps_a_prefix_on_one_replica_up_to_its_load_bound() {
        use super::super::table::test_slot_named;
        let dir = tempfile::tempdir().unwrap();
        let router = Router::new(crate::store::StateMachineStore::open(dir.path()).unwrap());
        let (fleet, reg) = super::super::table::test_fixture();
        let table = super::super::table::build(&fleet, &reg, &Default::default());
        let mut route = (*table.models["whisper"]).clone_for_test();
        route.replicas = (0..4).map(|i| test_slot_named(&format!("n{i}/r"), 8)).collect();
        let now = Instant::now();
        let key = prefix_hash(&format!("{}question", "system prompt ".repeat(40)), 64);
        // Idle replicas: the same prefix always lands on the same one.
        let first = router.pick_near(&route, Some(key), now).unwrap();
        first.release();
        for _ in 0..10 {
            let s = router.pick_near(&route, Some(key), now).unwrap();
            assert_eq!(s.name, first.name);
            s.release();
        }
        // Held requests: the bound is 1.25 × the mean load after the request, so the favourite
        // takes the first ones and then the prefix spreads.
        let held: Vec<_> = (0..12)
            .map(|_| router.pick_near(&route, Some(key), now).unwrap())
            .collect();
        let on_first = held.iter().filter(|s| s.name == first.name).count();
        assert!((2..=5).contains(&on_first), "{on_first} of 12 on the favourite");
        let loads: Vec<u32> = route.replicas.iter().map(|s| s.load()).collect();
        assert!(
            loads.iter().all(|l| *l <= 5),
            "no replica overloaded by one prefix: {loads:?}"
        );
        for s in held {
            s.release();
        }
        // Different prefixes prefer different replicas.
        let favourites: std::collections::HashSet<String> = (0..40)
            .map(|i| {
                let s = router
                    .pick_near(&route, Some(prefix_hash(&format!("tenant {i} system prompt"), 64)), now)
                    .unwrap();
                s.release();
                s.name.clone()
            })
            .collect();
        assert!(favourites.len() >= 3, "{favourites:?}");
    }
}
