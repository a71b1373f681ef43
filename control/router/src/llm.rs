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

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
pub use laneway_core::lane_report::LlmSummary;
use laneway_core::llm::{prefix_hash, CompletionRequest, Endpoint, CHARS_PER_TOKEN};
use tokio::time::Instant;

use super::answer::{error, request_id, Meta};
use super::flight::{Flight, Overflowing, Sent};
use super::lane::SlotGuard;
pub use super::llm_stats::{quantile, LlmStats, RECENT, SIGNAL_WINDOW};
use super::metrics::{Labels, LaneHistograms};
use super::pipeline::{authenticate, lookup, read_body};
use super::sse::*;
use super::table::ModelRoute;
use super::token_count::TokenCount;
use super::Router;
use laneway_core::registry::{LaneKind, LlmTask};

/// `GET /v1/models`: the language models (public names, one entry for all versions), in
/// OpenAI's list shape. Any tenant key may list them: a tenant's limits are per class, not a
/// list of models it may see.
pub(super) async fn models(State(router): State<Arc<Router>>, headers: HeaderMap) -> Response {
    let table = router.table();
    if let Err(r) = openai_key(&table, &headers) {
        return r;
    }
    let mut names: Vec<&str> = table
        .models
        .values()
        // Durable classes take jobs, not completions: listing them would offer a model that
        // always answers 400.
        .filter(|m| m.llm.is_some() && m.class.lane != LaneKind::Durable)
        .map(|m| m.public.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    axum::Json(serde_json::json!({
        "object": "list",
        "data": names.iter().map(|n| openai_model(n)).collect::<Vec<_>>(),
    }))
    .into_response()
}

/// `GET /v1/models/{model}`: one language model, or OpenAI's 404.
pub(super) async fn model(
    State(router): State<Arc<Router>>,
    axum::extract::Path(model): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    let table = router.table();
    if let Err(r) = openai_key(&table, &headers) {
        return r;
    }
    match table
        .route(&model, 0)
        .filter(|r| r.llm.is_some() && r.class.lane != LaneKind::Durable)
    {
        Some(r) => axum::Json(openai_model(&r.public)).into_response(),
        None => openai_error(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("the model {model:?} does not exist or is not a language model; GET /v1/models lists them"),
        ),
    }
}

/// A model in OpenAI's shape. The registry keeps no creation time: `created` is 0.
fn openai_model(name: &str) -> serde_json::Value {
    serde_json::json!({"id": name, "object": "model", "created": 0, "owned_by": "laneway"})
}

/// The tenant's key checked, with OpenAI's error shape when it is missing or unknown.
fn openai_key(table: &super::table::Table, headers: &HeaderMap) -> Result<(), Response> {
    authenticate(table, headers, &Meta::default()).map(|_| ()).map_err(|r| {
        let code = if headers.contains_key(axum::http::header::AUTHORIZATION) {
            "invalid_api_key"
        } else {
            "missing_api_key"
        };
        openai_error(
            r.status(),
            code,
            "unknown or missing API key: send `Authorization: Bearer <key>` (`lanectl tenant create` issues keys)"
                .into(),
        )
    })
}

/// An error in OpenAI's error object shape.
fn openai_error(status: StatusCode, code: &str, message: String) -> Response {
    (status, axum::Json(openai_error_body(status, Some(code), &message))).into_response()
}

/// OpenAI's error object: `type` from the status (the names OpenAI's own API and its clients
/// use), `code` when one is known.
fn openai_error_body(status: StatusCode, code: Option<&str>, message: &str) -> serde_json::Value {
    let kind = match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// An error the router answered itself (never a replica's answer, passed on as it came), in
/// OpenAI's error object shape, keeping Laneway's fields (`request_id`, `lane`) beside it and
/// every header (`Retry-After`, `x-laneway-*`).
fn in_openai_shape(r: Response) -> Response {
    let Some(super::answer::Said(message)) = r.extensions().get::<super::answer::Said>().cloned() else {
        return r;
    };
    let (mut parts, _) = r.into_parts();
    let code = match parts.status {
        StatusCode::UNAUTHORIZED => Some("invalid_api_key"),
        StatusCode::NOT_FOUND => Some("model_not_found"),
        StatusCode::TOO_MANY_REQUESTS => Some("rate_limit_exceeded"),
        StatusCode::SERVICE_UNAVAILABLE => Some("overloaded"),
        StatusCode::GATEWAY_TIMEOUT => Some("timeout"),
        _ => None,
    };
    let mut body = openai_error_body(parts.status, code, &message);
    let id = parts
        .headers
        .get(super::answer::REQUEST_ID)
        .and_then(|v| v.to_str().ok());
    body["request_id"] = id.into();
    body["lane"] = parts
        .headers
        .get(super::answer::LANE)
        .and_then(|v| v.to_str().ok())
        .into();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// `POST /v1/chat/completions`.
pub(super) async fn chat_completions(State(router): State<Arc<Router>>, headers: HeaderMap, body: Body) -> Response {
    in_openai_shape(serve(router, Endpoint::Chat, headers, body).await)
}

/// `POST /v1/completions`.
pub(super) async fn completions(State(router): State<Arc<Router>>, headers: HeaderMap, body: Body) -> Response {
    in_openai_shape(serve(router, Endpoint::Completion, headers, body).await)
}

/// `POST /v1/embeddings`, for models whose `[llm]` says `task = "embed"`: metered by input
/// tokens, never streamed, cached when the class has a cache (an embedding is the same next
/// time).
pub(super) async fn embeddings(State(router): State<Arc<Router>>, headers: HeaderMap, body: Body) -> Response {
    in_openai_shape(serve(router, Endpoint::Embeddings, headers, body).await)
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
    if endpoint == Endpoint::Embeddings && req.stream {
        return error(
            StatusCode::BAD_REQUEST,
            "`stream` is not an embeddings option: an embedding comes back whole".into(),
            &meta,
        );
    }
    let asked = match lookup(&router, &table, &req.model, None, &mut meta) {
        Ok(r) => r,
        Err(r) => return r,
    };
    // A fallback must be a language model too; a canned answer is one JSON body, which a
    // client reading a stream could not parse, so a stream is refused as usual instead.
    let task = endpoint.task();
    let is_llm = |r: &ModelRoute| r.llm.as_ref().is_some_and(|l| l.task == task);
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
    if spec.task != task {
        let (path, what) = match spec.task {
            LlmTask::Embed => ("/v1/embeddings", "an embedding model"),
            LlmTask::Generate => ("/v1/chat/completions or /v1/completions", "a text-generating model"),
        };
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "model {} is {what} (its [llm] task); send its requests to {path}",
                route.public
            ),
            &meta,
        );
    }
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
    if count.per_sequence() > u64::from(spec.context_tokens) && endpoint == Endpoint::Embeddings {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "model {} has a context of {} tokens; an input here is about {} (estimated at {CHARS_PER_TOKEN} characters a token); split or shorten it",
                route.name,
                spec.context_tokens,
                count.per_sequence()
            ),
            &meta,
        );
    }
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
    let affinity = (spec.prefix_affinity_tokens > 0).then(|| prefix_hash(&req.prompt, spec.prefix_affinity_tokens));
    let mut flight = Flight::new(router, table, tenant, route, meta, &headers, arrived);
    flight.record.input_tokens = input;
    let completion = Completion {
        endpoint,
        stream: req.stream,
        strip_usage,
        affinity,
        tokens: needed,
    };
    match completion.serve(flight, &headers, body).await {
        Ok(r) | Err(r) => r,
    }
}

/// What the steps after reading need to know of a completion request.
struct Completion {
    endpoint: Endpoint,
    stream: bool,
    /// The client did not ask for the usage chunk the router asks the replica for.
    strip_usage: bool,
    /// The prompt prefix's hash, when the model routes by it.
    affinity: Option<u64>,
    /// Tokens it counts against the tenant's minute: input + max_tokens for each sequence.
    tokens: u32,
}

impl Completion {
    /// Cache (a whole answer sampled greedily is the only one the same next time), tenant
    /// ceilings and tokens, the lane (or its overflow endpoint), the replica chosen by prompt
    /// prefix (retried elsewhere when never reached); the answer streamed or passed on whole.
    async fn serve(self, flight: Flight, headers: &HeaderMap, body: Bytes) -> Result<Response, Response> {
        let path = self.endpoint.path();
        let cacheable = !self.stream && (self.endpoint == Endpoint::Embeddings || greedy(&body));
        let flight = match cacheable {
            true => flight.from_cache(headers, &body, path)?,
            false => flight,
        };
        let flight = flight.admit_tenant()?.admit_tokens(self.tokens)?;
        let over = Overflowing {
            path: Some(path),
            stream: self.stream,
        };
        let (mut flight, admitted) = flight.acquire(self.affinity, &body, over).await?;
        let router = flight.router.clone();
        router.mirror(
            &flight.table,
            &flight.route,
            &body,
            &flight.meta.request_id,
            super::forward::Mirrored::Completion(self.endpoint),
        );
        flight.record.queue_ms = admitted.queued.as_secs_f64() * 1000.0;
        let started = Instant::now();
        let endpoint = self.endpoint;
        let (f, router, body) = (&flight, &router, &body);
        let (outcome, guard) = f
            .forward(admitted.guard, move |guard| async move {
                let left = f.deadline().saturating_duration_since(Instant::now());
                let outcome = match router.completion_uri(&guard.slot, endpoint) {
                    Ok(uri) => {
                        let out = super::Outbound {
                            uri: &uri,
                            target: &guard.slot.name,
                            request_id: &f.meta.request_id,
                            traceparent: f.traceparent.as_ref(),
                            authorization: None,
                            binary: None,
                        };
                        router.send_head(&router.client(), out, body.clone(), left).await
                    }
                    Err(e) => Err(e),
                };
                Sent {
                    outcome,
                    guard,
                    copied: false,
                }
            })
            .await;
        let answer = match outcome {
            Ok(a) => a,
            Err(e) => return Ok(flight.failed(e, guard, started)),
        };
        if !super::fails_replica(answer.status()) {
            // Not measured for slowness: a language model's answer time is its prompt's and
            // generation's length, not the replica's speed (ADR 0014).
            guard.slot.health.answered();
        }
        if self.stream && answer.status().is_success() {
            return Ok(relay(flight, self.strip_usage, answer, guard, started));
        }
        // Whole answers (and errors) are read within the deadline and measured at once.
        let f = match router.whole(answer, flight.deadline()).await {
            Ok(f) => f,
            Err(e) => return Ok(flight.failed(e, guard, started)),
        };
        if f.status.is_success() {
            flight.record.ttft_ms = Some(flight.arrived.elapsed().as_secs_f64() * 1000.0);
            if let Some(u) = serde_json::from_slice::<Chunk>(&f.body).ok().and_then(|c| c.usage) {
                flight.record.input_tokens = u.prompt_tokens;
                flight.record.output_tokens = u.completion_tokens;
                flight.record.gpu_ms = u.laneway_gpu_ms;
            }
        }
        Ok(flight.answered(f, guard, started))
    }
}

impl Router {
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

/// Streams the replica's `answer` to the client as it comes.
fn relay(
    flight: Flight,
    strip_usage: bool,
    answer: hyper::Response<hyper::body::Incoming>,
    guard: SlotGuard,
    started: Instant,
) -> Response {
    let (parts, upstream) = answer.into_parts();
    let mut head = HeaderMap::new();
    flight.stamp_served(&mut head, &guard);
    let rec = &flight.record;
    let labels = LaneHistograms::llm_labels(&rec.class, &rec.lane, &rec.model);
    let relay = Relay {
        upstream,
        deadline: flight.deadline(),
        started,
        last_token_at: None,
        sse: SseScanner::new(strip_usage, flight.router.bodies().limits().max_event_bytes),
        token_events: 0,
        usage: None,
        labels,
        guard: Some(guard),
        done: false,
        flight: Some(flight),
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
    flight: Option<Flight>,
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
        let Some(flight) = &mut self.flight else { return Ok(()) };
        match self.last_token_at {
            None => flight.record.ttft_ms = Some(now.saturating_duration_since(flight.arrived).as_secs_f64() * 1000.0),
            Some(last) => {
                let gap = now.saturating_duration_since(last);
                flight.router.histograms.observe_itl(&self.labels, gap.as_secs_f64());
                flight.router.llm_stats.observe_itl(
                    &flight.record.class,
                    &flight.record.model,
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
        if let (Some(flight), Some(g)) = (&self.flight, &self.guard) {
            flight.router.eject(&g.slot, &msg);
        }
        self.done = true;
        self.finish(status);
        msg
    }

    /// Records the request (once) and frees its slot and tenant hold.
    fn finish(&mut self, status: StatusCode) {
        let Some(mut flight) = self.flight.take() else { return };
        {
            let mut lane = flight.route.lane.lock();
            if status.is_success() {
                lane.counters.completed += 1;
            } else {
                lane.counters.failed += 1;
            }
        }
        // The replica that streamed it: its tokens and time are usage (the ledger counts
        // tokens only for requests a replica worked on).
        if let Some(g) = &self.guard {
            flight.served_by(g, self.started);
        }
        let rec = &mut flight.record;
        rec.status = status.as_u16();
        rec.service_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        rec.output_tokens = self.token_events;
        if let Some(u) = self.usage {
            rec.input_tokens = u.prompt_tokens;
            rec.output_tokens = u.completion_tokens;
            rec.gpu_ms = u.laneway_gpu_ms;
        }
        if rec.gpu_ms.is_none() {
            rec.gpu_ms = self.guard.as_ref().map(|g| g.slot.shared_gpu_ms(rec.service_ms));
        }
        drop(self.guard.take());
        flight.close();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Dropped before the end: the client went away (nginx's 499). Dropping `upstream`
        // closes the connection to the replica, which stops generating.
        if self.flight.is_some() {
            self.finish(StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST));
        }
    }
}

#[cfg(test)]
mod tests;
