//! Forwarding a request to a replica: deadlines, retries elsewhere when it never reached one,
//! the streamed completion path, and shadow copies.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper_util::client::legacy::Client;
use tokio::time::Instant;

use super::*;
use table::{ModelRoute, ReplicaSlot, Table};

impl Router {
    /// A request never reached `failed` (nothing was sent): eject it and, if the lane's retry
    /// budget allows, wait a jittered backoff (at most [`RETRY_BACKOFF`], never past
    /// `deadline`) and pick another replica to send it to once. The jitter spreads the retries
    /// of one incident (a host with many replicas gone) instead of sending them as one wave.
    pub async fn retry_elsewhere(
        &self,
        route: &ModelRoute,
        failed: &ReplicaSlot,
        why: &str,
        deadline: Instant,
    ) -> Option<Arc<ReplicaSlot>> {
        self.eject(failed, why);
        if !route.lane.lock().take_retry() {
            tracing::warn!(model = %route.name, replica = %failed.name, "retry budget spent: not retrying");
            return None;
        }
        let backoff = RETRY_BACKOFF.mul_f64(rand::random_range(0.0..=1.0));
        tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
        self.pick(route, Some(&failed.name), Instant::now())
    }

    /// Sends the request (binary when `binary` is its JSON part's length) to the replica
    /// within `timeout`.
    pub async fn forward(
        &self,
        slot: &ReplicaSlot,
        body: Bytes,
        request_id: &str,
        traceparent: Option<&HeaderValue>,
        binary: Option<&HeaderValue>,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError> {
        let out = Outbound {
            uri: &slot.infer_uri,
            target: &slot.name,
            request_id,
            traceparent,
            authorization: None,
            binary,
        };
        self.forward_to(slot, out, body, timeout, true).await
    }

    /// Sends the request (`out`) to `slot`'s replica within `timeout`, and notes what it says
    /// about the replica's health and, when `measure`, its speed: an answer's time, or, for a
    /// send dropped unanswered (a hedge it lost, a caller gone), the time so far as a lower
    /// bound — a replica slower than the hedge delay must not look fast for losing every race.
    pub(super) async fn forward_to(
        &self,
        slot: &ReplicaSlot,
        out: Outbound<'_>,
        body: Bytes,
        timeout: Duration,
        measure: bool,
    ) -> Result<Forwarded, ForwardError> {
        struct Timing<'a> {
            router: &'a Router,
            slot: &'a ReplicaSlot,
            started: Instant,
            dropped_unanswered: bool,
        }
        impl Drop for Timing<'_> {
            fn drop(&mut self) {
                if self.dropped_unanswered {
                    self.router.measure(self.slot, self.started);
                }
            }
        }
        let mut timing = Timing {
            router: self,
            slot,
            started: Instant::now(),
            dropped_unanswered: measure,
        };
        let r = self.send(&self.client(), out, body, timeout).await;
        timing.dropped_unanswered = false;
        if r.as_ref().is_ok_and(|f| !fails_replica(f.status)) {
            slot.health.answered();
            if measure {
                self.measure(slot, timing.started);
            }
        }
        r
    }

    /// Counts the time since `started` towards finding slow replicas.
    pub(super) fn measure(&self, slot: &ReplicaSlot, started: Instant) {
        let now = Instant::now();
        slot.health
            .observe(now.duration_since(started), slot.service, self.now_ms(now));
    }

    /// Where a language model's request to `endpoint` goes on `slot`'s replica.
    pub(super) fn completion_uri(
        &self,
        slot: &ReplicaSlot,
        endpoint: laneway_core::llm::Endpoint,
    ) -> Result<hyper::Uri, ForwardError> {
        format!("http://{}{}", slot.endpoint, endpoint.path())
            .parse()
            .map_err(|e| ForwardError::NotDelivered(format!("endpoint {:?}: {e}", slot.endpoint)))
    }

    /// Sends a language model's request (for a whole answer) to `slot`'s `endpoint` within
    /// `timeout`.
    pub(super) async fn forward_completion(
        &self,
        slot: &ReplicaSlot,
        endpoint: laneway_core::llm::Endpoint,
        body: Bytes,
        request_id: &str,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError> {
        let uri = self.completion_uri(slot, endpoint)?;
        let out = Outbound {
            uri: &uri,
            target: &slot.name,
            request_id,
            traceparent: None,
            authorization: None,
            binary: None,
        };
        // A language model's answer time is its generation's length: not comparable across
        // replicas, so not measured (ADR 0014).
        self.forward_to(slot, out, body, timeout, false).await
    }

    /// Posts an inference request (`out`) with `client` within `timeout`, with the deadline and
    /// the trace context.
    pub(super) async fn send<C>(
        &self,
        client: &Client<C, Full<Bytes>>,
        out: Outbound<'_>,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Forwarded, ForwardError>
    where
        C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
    {
        let deadline = Instant::now() + timeout;
        let answer = self.send_head(client, out, body, timeout).await?;
        self.whole(answer, deadline).await
    }

    /// The whole of `answer` (its head already here), read before `deadline` and within the
    /// router's limit on answers.
    pub(super) async fn whole(
        &self,
        answer: hyper::Response<hyper::body::Incoming>,
        deadline: Instant,
    ) -> Result<Forwarded, ForwardError> {
        let (parts, body) = answer.into_parts();
        let limit = self.bodies().limits().max_answer_bytes;
        let body = tokio::time::timeout_at(deadline, body::read_answer(body, limit))
            .await
            .map_err(|_| ForwardError::Timeout)?
            .map_err(|e| match e {
                body::AnswerError::TooLarge { limit } => ForwardError::AnswerTooLarge { limit },
                body::AnswerError::Broken(why) => ForwardError::Failed(format!("reading the answer: {why}")),
            })?;
        let gpu_ms = parts
            .headers
            .get(GPU_MS_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Ok(Forwarded {
            status: parts.status,
            content_type: parts.headers.get(CONTENT_TYPE).cloned(),
            binary: parts.headers.get(laneway_core::kserve::INFERENCE_HEADER).cloned(),
            body,
            gpu_ms,
        })
    }

    /// Posts an inference request (`out`) with `client`, with the deadline and the trace
    /// context; the answer's head must come within `timeout`, its body is the caller's to read.
    pub(super) async fn send_head<C>(
        &self,
        client: &Client<C, Full<Bytes>>,
        out: Outbound<'_>,
        body: Bytes,
        timeout: Duration,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ForwardError>
    where
        C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
    {
        let Outbound {
            uri,
            target,
            request_id,
            traceparent,
            authorization,
            binary,
        } = out;
        let span = tracing::debug_span!(target: "laneway_trace", "dispatch", replica = %target, otel.kind = "client");
        let mut req = hyper::Request::post(uri.clone())
            .header(
                CONTENT_TYPE,
                if binary.is_some() {
                    "application/octet-stream"
                } else {
                    "application/json"
                },
            )
            .header("x-request-id", request_id)
            .header(TIMEOUT_HEADER, replica_timeout_ms(timeout).to_string());
        if let Some(a) = authorization {
            req = req.header(hyper::header::AUTHORIZATION, a);
        }
        if let Some(len) = binary {
            req = req.header(laneway_core::kserve::INFERENCE_HEADER, len);
        }
        // The replica continues this dispatch's span when traces are exported, else the
        // client's trace as it came.
        let mut trace_headers = hyper::HeaderMap::new();
        if !span.is_disabled() {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let cx = span.context();
            opentelemetry::global::get_text_map_propagator(|p| {
                p.inject_context(&cx, &mut opentelemetry_http::HeaderInjector(&mut trace_headers))
            });
        }
        match (trace_headers.is_empty(), traceparent) {
            (false, _) => {
                if let Some(h) = req.headers_mut() {
                    h.extend(trace_headers);
                }
            }
            (true, Some(tp)) => req = req.header("traceparent", tp),
            (true, None) => {}
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| ForwardError::NotDelivered(e.to_string()))?;
        let work = async {
            client.request(req).await.map_err(|e| {
                if e.is_connect() {
                    ForwardError::NotDelivered(e.to_string())
                } else {
                    ForwardError::Failed(e.to_string())
                }
            })
        };
        tracing::Instrument::instrument(tokio::time::timeout(timeout, work), span)
            .await
            .unwrap_or(Err(ForwardError::Timeout))
    }

    /// Sends a copy of a request for `route`'s model to the version a shadow rollout compares,
    /// when the table draws it: never queued (only a free slot of the new version takes it),
    /// never waited for (its own task), its answer dropped. The copy is metered to the tenant
    /// [`SHADOW_TENANT`], which is what the rollout judges the new version on.
    /// A language model's request (`completion`: its endpoint) is copied as a request for a
    /// whole answer, whose usage says its tokens and GPU time.
    pub fn mirror(
        self: &Arc<Self>,
        table: &Table,
        route: &ModelRoute,
        body: &Bytes,
        request_id: &str,
        form: Mirrored<'_>,
    ) {
        let (completion, binary) = match form {
            Mirrored::Infer { binary } => (None, binary.cloned()),
            Mirrored::Completion(endpoint) => (Some(endpoint), None),
        };
        let Some(shadow) = table.shadow(&route.public) else {
            return;
        };
        // A binary request goes only to a version whose servers read binary tensors.
        if binary.is_some() && !shadow.binary_tensors {
            return;
        }
        let Some(slot) = self.pick(&shadow, None, Instant::now()) else {
            return;
        };
        struct Held(Arc<ReplicaSlot>);
        impl Drop for Held {
            fn drop(&mut self) {
                self.0.release();
            }
        }
        let held = Held(slot);
        let router = self.clone();
        let body = match completion {
            Some(_) => sse::whole_answer(body),
            None => body.clone(),
        };
        let mut record = record_for(&format!("{request_id}-shadow"), &shadow, SHADOW_TENANT);
        tokio::spawn(async move {
            let slot = &held.0;
            let started = Instant::now();
            let timeout = shadow.class.request_timeout_ms.as_duration();
            let r = match completion {
                None => {
                    router
                        .forward(slot, body, &record.request_id, None, binary.as_ref(), timeout)
                        .await
                }
                Some(endpoint) => {
                    router
                        .forward_completion(slot, endpoint, body, &record.request_id, timeout)
                        .await
                }
            };
            record.replica = Some(slot.name.clone());
            record.product = Some(slot.product.clone());
            record.service_ms = started.elapsed().as_secs_f64() * 1000.0;
            record.status = match &r {
                Ok(f) => {
                    record.gpu_ms = f.gpu_ms;
                    if let Some((input, output, gpu_ms)) = completion.and_then(|_| sse::answer_usage(&f.body)) {
                        (record.input_tokens, record.output_tokens) = (input, output);
                        record.gpu_ms = gpu_ms.or(f.gpu_ms);
                    }
                    if ejects_replica(slot, f.status) {
                        router.eject(slot, &format!("answered {} to shadow copies in a row", f.status));
                    }
                    f.status.as_u16()
                }
                Err(e) => {
                    if !matches!(e, ForwardError::AnswerTooLarge { .. }) {
                        router.eject(slot, &format!("shadow copy: {e:?}"));
                    }
                    match e {
                        ForwardError::Timeout => 504,
                        ForwardError::NotDelivered(_)
                        | ForwardError::Failed(_)
                        | ForwardError::AnswerTooLarge { .. } => 502,
                    }
                }
            };
            drop(held);
            router.meter_only(record);
        });
    }
}

/// What kind of request a shadow copy is.
pub enum Mirrored<'a> {
    /// A KServe v2 request (binary when this is its JSON part's length).
    Infer { binary: Option<&'a HeaderValue> },
    /// A language model's request to this OpenAI-compatible endpoint.
    Completion(laneway_core::llm::Endpoint),
}
