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

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
pub use laneway_core::lane_report::LlmSummary;
use laneway_core::llm::{prefix_hash, CompletionRequest, Endpoint, CHARS_PER_TOKEN};
use tokio::time::Instant;

use super::admission::TokenBucket;
use super::answer::{error, request_id, stamp, with_retry_after, Meta};
use super::body::{read_answer, AnswerError};
use super::lane::SlotGuard;
pub use super::llm_stats::{quantile, LlmStats, RECENT, SIGNAL_WINDOW};
use super::metrics::{Labels, LaneHistograms};
use super::pipeline::{authenticate, lookup, read_body, Handled};
use super::sse::*;
use super::table::{ModelRoute, TenantRoute};
use super::token_count::TokenCount;
use super::{Admitted, ForwardError, Refusal, RequestRecord, Router, TenantGuard};
use laneway_core::registry::{Class, LaneKind};

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
            Handled::Answered(hit) => return hit,
            Handled::Pass(record) => record,
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
                    Handled::Answered(answered) => return answered,
                    Handled::Pass(record) => record,
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
    ) -> Handled {
        let Some(ov) = table.overflows.get(&route.class.name) else {
            return Handled::Pass(record);
        };
        let Some((slot, uri, client, authorization)) =
            ov.take(router.now_ms(Instant::now()), ov.uri_at(self.endpoint.path()))
        else {
            return Handled::Pass(record);
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
                return Handled::Pass(record);
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
                    return Handled::Answered(super::pipeline::overflow_answered(
                        router, ov, route, meta, record, times, r,
                    ));
                }
                Ok(Err(AnswerError::Broken(e))) => {
                    super::pipeline::overflow_failed(router, ov, route, &format!("broke off its answer: {e}"));
                    return Handled::Pass(record);
                }
                Err(_) => {
                    super::pipeline::overflow_failed(router, ov, route, "did not finish within the lane's timeout");
                    return Handled::Pass(record);
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
        Handled::Answered(super::pipeline::overflow_answered(
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

#[cfg(test)]
mod tests;
