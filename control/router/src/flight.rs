//! A request on its way through the steps after reading, which are the same whatever protocol
//! brought it: the class's cache, the tenant's ceilings, the lane's admission (its overflow
//! endpoint, else an honest refusal), forwarding (hedged when the class asks, sent once more
//! elsewhere when a replica was never reached), ejecting a replica at fault, and the headers
//! every served answer carries.
//!
//! A [`Flight`] holds the request's record, and every way it ends takes the flight by value
//! ([`Flight::end`] and the refusals and failures built on it), so a request is recorded exactly
//! once. A step that may end the request returns `Result<Flight, Response>`, as the steps
//! before it do (`authenticate`, `lookup`): `Err` is the request's answer, `Ok` the flight going
//! on. The protocol files (`http` for KServe v2, `llm` for OpenAI) build one and only
//! translate: how a body is checked, where it is sent, how an answer is read.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::answer::{error, stamp, stamp_version, with_retry_after, Meta, DEGRADED, QUEUE_MS, REPLICA};
use super::body::{read_answer, AnswerError};
use super::lane::SlotGuard;
use super::table::{ModelRoute, Table, TenantRoute};
use super::{Admitted, ForwardError, Forwarded, Refusal, RequestRecord, Router, TenantGuard};

/// One request whose tenant, route and whole body are known, until it ends.
pub struct Flight {
    pub router: Arc<Router>,
    /// The routing table the request was authenticated and looked up in.
    pub table: Arc<Table>,
    pub tenant: Arc<TenantRoute>,
    /// The route that serves it (a fallback's, when its own model has no healthy replica).
    pub route: Arc<ModelRoute>,
    pub meta: Meta,
    pub record: RequestRecord,
    /// When the whole request was here: the lane's budget and the request timeout count from
    /// it, so a slow upload spends neither.
    pub arrived: Instant,
    pub traceparent: Option<HeaderValue>,
    /// A binary KServe v2 request's JSON part (its length, sent on in
    /// `Inference-Header-Content-Length`).
    pub binary: Option<super::pipeline::BinaryPart>,
    /// The model version a KServe v2 client pinned (`/versions/{v}/infer`): an overflow
    /// endpoint is asked for that version too.
    pub pinned_version: Option<String>,
    /// The tenant's hold on its concurrency ceiling, let go when the request ends.
    tenant_hold: Option<TenantGuard>,
    /// Tokens taken from the tenant's minute: given back when the request is refused.
    tokens: u32,
    /// Recorded: by [`Flight::close`], or on drop as a request its client left (499).
    ended: bool,
}

impl Drop for Flight {
    /// A flight dropped before it ended is a request whose client went away while it was
    /// queued or at a replica (its handler's future was dropped): recorded as nginx's 499, its
    /// tokens given back to the tenant's minute, its holds let go.
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if self.tokens > 0 {
            self.router.refund_tokens(&self.tenant, &self.route.class, self.tokens);
        }
        drop(self.tenant_hold.take());
        self.record.status = 499;
        if self.record.queue_ms == 0.0 {
            self.record.queue_ms = self.arrived.elapsed().as_secs_f64() * 1000.0;
        }
        self.router.record(std::mem::take(&mut self.record));
    }
}

/// What a replica was sent, for [`Flight::forward`]: the outcome, the slot it came from (a
/// hedged copy's may win), and whether a second send already went out (no retry then).
pub struct Sent<T> {
    pub outcome: Result<T, ForwardError>,
    pub guard: SlotGuard,
    pub copied: bool,
}

/// Where a request the lane has no capacity for goes on its overflow endpoint, and how.
pub struct Overflowing<'a> {
    /// The path on the endpoint, the protocol's own: an OpenAI path (`/v1/chat/completions`,
    /// whose answer's `usage` is metered), or none for the KServe v2 infer path of the
    /// request's model.
    pub path: Option<&'a str>,
    /// A stream is passed through as it comes, holding the endpoint's slot until it ends.
    pub stream: bool,
}

impl Flight {
    pub fn new(
        router: Arc<Router>,
        table: Arc<Table>,
        tenant: Arc<TenantRoute>,
        route: Arc<ModelRoute>,
        meta: Meta,
        headers: &HeaderMap,
        arrived: Instant,
    ) -> Self {
        let record = super::record_for(&meta.request_id, &route, &tenant.name);
        Flight {
            router,
            table,
            tenant,
            route,
            meta,
            record,
            arrived,
            traceparent: headers.get("traceparent").cloned(),
            binary: None,
            pinned_version: None,
            tenant_hold: None,
            tokens: 0,
            ended: false,
        }
    }

    /// When the lane's request timeout runs out.
    pub fn deadline(&self) -> Instant {
        self.arrived + self.route.class.request_timeout_ms.as_duration()
    }

    /// Ends the request with `r`: recorded (once), its tenant hold let go.
    pub fn end(mut self, r: Response) -> Response {
        self.record.status = r.status().as_u16();
        self.close();
        r
    }

    /// Records the request with the status already in its record (a stream that ended).
    pub fn close(mut self) {
        self.ended = true;
        drop(self.tenant_hold.take());
        self.router.llm_stats.finished(&self.record, Instant::now());
        self.router.record(std::mem::take(&mut self.record));
    }

    /// The class's cached answer to this input (`body`, for `api`), if it has a cache and the
    /// answer is in it: the request ends with it, served with no GPU time. On a miss (or a
    /// bypass) `meta` says where to keep the answer the replica will give.
    pub fn from_cache(self, headers: &HeaderMap, body: &Bytes, api: &str) -> Result<Self, Response> {
        let mut flight = self;
        let route = flight.route.clone();
        let Some(cache) = flight.table.caches.get(&route.class.name).cloned() else {
            return Ok(flight);
        };
        let bypass = headers
            .get(super::cache::CACHE_HEADER)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(super::cache::BYPASS.as_bytes()));
        let json_len = flight.binary.as_ref().map(|b| b.len);
        let Some(key) = cache.key(&route.name, &route.version, api, &flight.tenant.name, body, json_len) else {
            return Ok(flight);
        };
        let Some(hit) = cache.get(&key).filter(|_| !bypass) else {
            route.lane.lock().counters.cache_miss += 1;
            flight.meta.cache = Some((cache, key, if bypass { super::cache::BYPASS } else { "miss" }));
            return Ok(flight);
        };
        route.lane.lock().counters.cache_hit += 1;
        let mut r = (
            StatusCode::from_u16(hit.status).unwrap_or(StatusCode::OK),
            hit.body.clone(),
        )
            .into_response();
        if let Some(ct) = &hit.content_type {
            r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct.clone());
        }
        if let Some(len) = &hit.binary {
            r.headers_mut()
                .insert(laneway_core::kserve::INFERENCE_HEADER, len.clone());
        }
        r.headers_mut()
            .insert(super::cache::CACHE_HEADER, HeaderValue::from_static("hit"));
        stamp(r.headers_mut(), &flight.meta);
        stamp_version(r.headers_mut(), &flight.meta);
        Err(flight.end(r))
    }

    /// Takes the request's place under its tenant's request ceilings on the class (rate and
    /// concurrency, held until the request ends); over one, it ends with a 429.
    pub fn admit_tenant(mut self) -> Result<Self, Response> {
        let retry_hint = self.route.min_service().unwrap_or(Duration::from_secs(1));
        match self
            .router
            .admit_tenant(&self.tenant, &self.route.class, retry_hint, self.arrived)
        {
            Ok(hold) => {
                self.tenant_hold = hold;
                Ok(self)
            }
            Err((wait, why)) => Err(self.throttled(wait, why)),
        }
    }

    /// Takes `tokens` from the tenant's tokens per minute on the class (given back if the lane
    /// then refuses the request); a request over the whole minute ends with a 400, one that
    /// fits later with a 429.
    pub fn admit_tokens(mut self, tokens: u32) -> Result<Self, Response> {
        match self
            .router
            .admit_tokens(&self.tenant, &self.route.class, tokens, self.arrived)
        {
            Ok(()) => {
                self.tokens = tokens;
                Ok(self)
            }
            Err(super::admit::TokenRefusal::Never(why)) => {
                let r = error(StatusCode::BAD_REQUEST, why, &self.meta);
                Err(self.end(r))
            }
            Err(super::admit::TokenRefusal::Wait(wait, why)) => Err(self.throttled(wait, why)),
        }
    }

    fn throttled(self, wait: Duration, why: String) -> Response {
        self.route.lane.lock().counters.throttled += 1;
        let r = super::answer::shed(with_retry_after(
            error(StatusCode::TOO_MANY_REQUESTS, why, &self.meta),
            wait,
        ));
        self.end(r)
    }

    /// A slot of the lane (preferring the replicas `affinity`, a prompt-prefix hash, maps to),
    /// or the request's end: when the lane is full, its overflow endpoint's answer if it has
    /// one that takes it (`body`, sent as `over` says); else the lane's honest refusal.
    pub async fn acquire(
        self,
        affinity: Option<u64>,
        body: &Bytes,
        over: Overflowing<'_>,
    ) -> Result<(Self, Admitted), Response> {
        let refusal = match self.router.acquire_near(&self.route, self.arrived, affinity).await {
            Ok(admitted) => return Ok((self, admitted)),
            Err(refusal) => refusal,
        };
        let mut flight = self;
        if matches!(refusal, Refusal::NoSlot { .. } | Refusal::OverBudget { .. }) {
            flight = flight.overflow(body, over).await?;
        }
        // Not served: its tokens go back to the tenant's minute.
        if flight.tokens > 0 {
            flight
                .router
                .refund_tokens(&flight.tenant, &flight.route.class, flight.tokens);
        }
        flight.record.queue_ms = flight.arrived.elapsed().as_secs_f64() * 1000.0;
        let r = super::pipeline::refusal_response(&refusal, &flight.route, &flight.meta);
        Err(flight.end(r))
    }

    /// Sends a request the lane has no capacity for to its overflow endpoint (ADR 0017): the
    /// request ends with the endpoint's answer, or comes back (`Ok`) when there is none, it is
    /// open or full, or it failed — to be refused as it would have been without.
    async fn overflow(mut self, body: &Bytes, over: Overflowing<'_>) -> Result<Self, Response> {
        let router = self.router.clone();
        let Some(ov) = self.table.overflows.get(&self.route.class.name).cloned() else {
            return Ok(self);
        };
        let uri = match over.path {
            Some(path) => ov.uri_at(path),
            None => ov.uri(&self.route.public, self.pinned_version.as_deref()),
        };
        let Some((slot, uri, client, authorization)) = ov.take(router.now_ms(Instant::now()), uri) else {
            return Ok(self);
        };
        let deadline = self.deadline();
        let started = Instant::now();
        let out = super::Outbound {
            uri: &uri,
            target: "overflow",
            request_id: &self.meta.request_id,
            traceparent: self.traceparent.as_ref(),
            authorization,
            binary: self.binary.as_ref().map(|b| &b.header),
        };
        let left = deadline.saturating_duration_since(started);
        let head = router.send_head(client, out, body.clone(), left).await;
        let failed = |why: &str| {
            if ov.failed(router.now_ms(Instant::now())) {
                tracing::warn!(class = %self.route.class.name, url = %ov.spec.url, %why, "overflow endpoint failed {} times in a row: not used for {} s", super::overflow::BREAKER_FAILURES, super::overflow::BREAKER_OPEN.as_secs());
            } else {
                tracing::debug!(class = %self.route.class.name, url = %ov.spec.url, %why, "overflow endpoint failed");
            }
        };
        let resp = match head {
            Ok(r) if super::overflow::answered(r.status()) => r,
            Ok(r) => {
                failed(&format!("answered {}", r.status()));
                return Ok(self);
            }
            Err(e) => {
                failed(&format!("{e:?}"));
                return Ok(self);
            }
        };
        let (parts, upstream) = resp.into_parts();
        let answer = if over.stream && parts.status.is_success() {
            // The endpoint's slot goes with the stream: freed when it ends or the client goes.
            let held = slot;
            Body::new(upstream.map_frame(move |frame| {
                let _slot = &held;
                frame
            }))
        } else {
            let limit = router.bodies().limits().max_answer_bytes;
            let read = tokio::time::timeout_at(deadline, read_answer(upstream, limit)).await;
            drop(slot);
            match read {
                Ok(Ok(bytes)) => {
                    if let Some((input, output, _)) = over.path.and_then(|_| super::sse::answer_usage(&bytes)) {
                        (self.record.input_tokens, self.record.output_tokens) = (input, output);
                    }
                    Body::from(bytes)
                }
                Ok(Err(AnswerError::TooLarge { limit })) => {
                    // It answered (and charged for it), more than the router passes on: not the
                    // endpoint's fault, and not to be sent anywhere again.
                    let r = error(
                        StatusCode::BAD_GATEWAY,
                        super::body::answer_too_large("the overflow endpoint", limit),
                        &self.meta,
                    );
                    return Err(self.overflow_answered(&ov, started, r));
                }
                Ok(Err(AnswerError::Broken(e))) => {
                    failed(&format!("broke off its answer: {e}"));
                    return Ok(self);
                }
                Err(_) => {
                    failed("did not finish within the lane's timeout");
                    return Ok(self);
                }
            }
        };
        let mut r = Response::new(answer);
        *r.status_mut() = parts.status;
        for h in [
            axum::http::header::CONTENT_TYPE.as_str(),
            laneway_core::kserve::INFERENCE_HEADER,
        ] {
            if let Some(v) = parts.headers.get(h) {
                r.headers_mut().insert(h, v.clone());
            }
        }
        Err(self.overflow_answered(&ov, started, r))
    }

    /// The overflow endpoint answered `r` to the request it was sent at `started`: its breaker's
    /// count starts over, the answer is marked, and the request is metered at the endpoint's
    /// price with no node (nothing of the fleet's is billed for it).
    fn overflow_answered(mut self, ov: &super::overflow::Overflow, started: Instant, mut r: Response) -> Response {
        ov.succeeded();
        self.route.lane.lock().counters.overflowed += 1;
        let rec = &mut self.record;
        rec.replica = Some(laneway_core::ledger::OVERFLOW_PRODUCT.into());
        rec.product = Some(laneway_core::ledger::OVERFLOW_PRODUCT.into());
        rec.service_ms = started.elapsed().as_secs_f64() * 1000.0;
        rec.queue_ms = started.saturating_duration_since(self.arrived).as_secs_f64() * 1000.0;
        rec.overflow_micros = ov.spec.micros_per_request;
        r.headers_mut()
            .insert(super::overflow::OVERFLOW_HEADER, HeaderValue::from_static("1"));
        stamp(r.headers_mut(), &self.meta);
        self.end(r)
    }

    /// Sends the request with `send` from the admitted slot `guard` and, when it never reached
    /// that replica (nothing was sent, so nothing ran) and no copy went out, once more elsewhere
    /// if the lane's retry budget allows. Returns the outcome and the slot it came from.
    pub async fn forward<T, Fut>(
        &self,
        guard: SlotGuard,
        mut send: impl FnMut(SlotGuard) -> Fut,
    ) -> (Result<T, ForwardError>, SlotGuard)
    where
        Fut: std::future::Future<Output = Sent<T>>,
    {
        let mut guard = guard;
        let mut retried = false;
        loop {
            let sent = send(guard).await;
            guard = sent.guard;
            retried |= sent.copied;
            match sent.outcome {
                Err(ForwardError::NotDelivered(why)) if !retried => {
                    match self
                        .router
                        .retry_elsewhere(&self.route, &guard.slot, &why, self.deadline())
                        .await
                    {
                        Some(other) => {
                            guard = SlotGuard::new(other, self.route.lane.clone());
                            retried = true;
                        }
                        None => return (Err(ForwardError::NotDelivered(why)), guard),
                    }
                }
                other => return (other, guard),
            }
        }
    }

    /// Sends the (whole) request to `guard`'s replica and, when it has not answered within the
    /// class's hedge delay, the lane's hedge budget allows and another replica has a free slot,
    /// a copy there too (never queued). The first good answer wins; the other send is dropped
    /// (its connection closed, its slot freed). When both fail, the first send's failure is the
    /// request's.
    pub async fn hedged(
        &self,
        guard: SlotGuard,
        body: &Bytes,
        hedge: laneway_core::registry::HedgeSpec,
    ) -> Sent<Forwarded> {
        let (router, route) = (&self.router, &self.route);
        let request_id = self.meta.request_id.as_str();
        let (traceparent, binary) = (self.traceparent.as_ref(), self.binary.as_ref().map(|b| &b.header));
        let started = Instant::now();
        let left = self.deadline().saturating_duration_since(started);
        let after = hedge.after_ms.as_duration();
        let alone = |outcome, guard| Sent {
            outcome,
            guard,
            copied: false,
        };
        // The sends borrow their own handle on the slot, so the guard can be handed back.
        let first_slot = guard.slot.clone();
        let first = router.forward(&first_slot, body.clone(), request_id, traceparent, binary, left);
        tokio::pin!(first);
        // A copy needs the time to be answered: the delay and then the fastest replica's service.
        if left <= after + route.min_service().unwrap_or_default() {
            return alone(first.await, guard);
        }
        if let Ok(r) = tokio::time::timeout(after, &mut first).await {
            return alone(r, guard);
        }
        if !route.lane.lock().take_hedge(hedge.percent) {
            return alone(first.await, guard);
        }
        let Some(other) = router.pick(route, Some(&guard.slot.name), Instant::now()) else {
            route.lane.lock().refund_hedge();
            return alone(first.await, guard);
        };
        let second_guard = SlotGuard::new(other, route.lane.clone());
        let second_slot = second_guard.slot.clone();
        let left = left.saturating_sub(started.elapsed());
        let second = router.forward(&second_slot, body.clone(), request_id, traceparent, binary, left);
        tokio::pin!(second);
        let good = |r: &Result<Forwarded, ForwardError>| r.as_ref().is_ok_and(|f| !super::fails_replica(f.status));
        let copied = |outcome, guard| Sent {
            outcome,
            guard,
            copied: true,
        };
        // A copy that failed is ejected as any failure would be, except for running out of time:
        // it only had what the first send left of the deadline.
        let copy_failed = |r: &Result<Forwarded, ForwardError>| match r {
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
                    return copied(r1, guard);
                }
                let r2 = second.await;
                if good(&r2) {
                    route.lane.lock().counters.hedge_won += 1;
                    return copied(r2, second_guard);
                }
                copy_failed(&r2);
                copied(r1, guard)
            }
            r2 = &mut second => {
                if good(&r2) {
                    route.lane.lock().counters.hedge_won += 1;
                    return copied(r2, second_guard);
                }
                copy_failed(&r2);
                copied(first.await, guard)
            }
        }
    }

    /// Notes which replica served the request and for how long since `started`.
    pub fn served_by(&mut self, guard: &SlotGuard, started: Instant) {
        let rec = &mut self.record;
        rec.replica = Some(guard.slot.name.clone());
        rec.product = Some(guard.slot.product.clone());
        rec.mig_profile = guard.slot.mig_profile.clone();
        rec.service_ms = started.elapsed().as_secs_f64() * 1000.0;
    }

    /// The request failed at `guard`'s replica (`e`, sent at `started`): the replica is ejected
    /// when the failure is its fault, and the request ends with an answer that says what gave
    /// out.
    pub fn failed(mut self, e: ForwardError, guard: SlotGuard, started: Instant) -> Response {
        self.route.lane.lock().counters.failed += 1;
        self.served_by(&guard, started);
        let replica = &guard.slot.name;
        let (status, msg) = match &e {
            ForwardError::NotDelivered(why) => (
                StatusCode::BAD_GATEWAY,
                format!("no replica of {} could be reached ({why})", self.route.name),
            ),
            ForwardError::Timeout => (
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "replica {replica} did not answer within the {} lane's request timeout ({} ms)",
                    self.route.class.name,
                    self.route.class.request_timeout_ms.as_duration().as_millis()
                ),
            ),
            ForwardError::Failed(why) => (
                StatusCode::BAD_GATEWAY,
                format!("replica {replica} failed while serving the request ({why}); not retried, it may have run"),
            ),
            ForwardError::AnswerTooLarge { limit } => (
                StatusCode::BAD_GATEWAY,
                super::body::answer_too_large(&format!("replica {replica}"), *limit),
            ),
        };
        // An unreached replica was dealt with by the retry; an answer too large is the
        // request's doing, not the replica's fault.
        if !matches!(e, ForwardError::NotDelivered(_) | ForwardError::AnswerTooLarge { .. }) {
            self.router.eject(&guard.slot, &msg);
        }
        let mut r = error(status, msg, &self.meta);
        self.stamp_served(r.headers_mut(), &guard);
        drop(guard);
        self.end(r)
    }

    /// `guard`'s replica answered `f` (whole) to the request sent at `started`: counted, kept in
    /// the cache when the request may be (a degraded answer is not the answer to the input the
    /// key was made from), the replica ejected after enough errors in a row; the request ends
    /// with the answer and the headers of a served answer.
    pub fn answered(mut self, f: Forwarded, guard: SlotGuard, started: Instant) -> Response {
        self.served_by(&guard, started);
        {
            let mut lane = self.route.lane.lock();
            if f.status.is_server_error() {
                lane.counters.failed += 1;
            } else {
                lane.counters.completed += 1;
            }
        }
        if let Some((cache, key, _)) = self.meta.cache.as_ref().filter(|_| !self.record.degraded) {
            cache.put(
                *key,
                super::cache::Cached {
                    status: f.status.as_u16(),
                    content_type: f.content_type.clone(),
                    binary: f.binary.clone(),
                    body: f.body.clone(),
                },
            );
        }
        if super::ejects_replica(&guard.slot, f.status) {
            self.router.eject(
                &guard.slot,
                &format!(
                    "answered {} {} times in a row",
                    f.status,
                    super::table::ERROR_ANSWERS_TO_EJECT
                ),
            );
        }
        // A language model's own usage (set by its protocol) says more than the header; a
        // server that says neither is metered by its time on the request.
        self.record.gpu_ms = self
            .record
            .gpu_ms
            .or(f.gpu_ms)
            .or_else(|| Some(guard.slot.shared_gpu_ms(self.record.service_ms)));
        let mut r = (f.status, f.body).into_response();
        if let Some(ct) = f.content_type {
            r.headers_mut().insert(axum::http::header::CONTENT_TYPE, ct);
        }
        if let Some(len) = f.binary {
            r.headers_mut().insert(laneway_core::kserve::INFERENCE_HEADER, len);
        }
        if let Some(g) = f.gpu_ms {
            if let Ok(v) = HeaderValue::from_str(&format!("{g:.3}")) {
                r.headers_mut().insert(super::GPU_MS_HEADER, v);
            }
        }
        self.stamp_served(r.headers_mut(), &guard);
        drop(guard);
        self.end(r)
    }

    /// The headers of an answer a replica served (or failed): Laneway's, the replica, the
    /// model version, what the cache said, the time queued, and whether it was degraded.
    pub fn stamp_served(&self, h: &mut HeaderMap, guard: &SlotGuard) {
        stamp(h, &self.meta);
        h.insert(REPLICA, guard.slot.name_header.clone());
        stamp_version(h, &self.meta);
        if let Some((_, _, said)) = &self.meta.cache {
            h.insert(super::cache::CACHE_HEADER, HeaderValue::from_static(said));
        }
        if let Ok(v) = HeaderValue::from_str(&format!("{:.3}", self.record.queue_ms)) {
            h.insert(QUEUE_MS, v);
        }
        if self.record.degraded {
            h.insert(DEGRADED, HeaderValue::from_static("1"));
        }
    }
}
