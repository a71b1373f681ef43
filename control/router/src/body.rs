//! What the router reads, within limits: request bodies from clients and answers from replicas
//! and overflow endpoints.
//!
//! A request body is read only once the request's API key has been checked: handlers take the
//! unread [`Body`] and hand it to [`BodyGate::read`] after [`super::pipeline::authenticate`], so an
//! anonymous request is answered from its headers and its body never costs memory. The read has
//! a whole-body deadline (a client that trickles its body holds a connection no longer than
//! that), and every body held in memory counts against one budget of bytes for all requests
//! together, from its first byte until the request is answered, so that many large bodies at
//! once are refused (503) instead of exhausting memory. Answers the router reads whole are
//! capped by [`read_answer`].

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::answer::{error, with_retry_after, Meta};

const MIB: usize = 1024 * 1024;

/// The Retry-After of a request refused because the budget of bodies in flight is spent:
/// bodies are read in seconds, so some budget is free again soon.
pub const BUSY_RETRY: Duration = Duration::from_secs(1);

/// Limits on what the router reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyLimits {
    /// Largest request body, bytes (413 above; `router.max_body_bytes`). Default 8 MiB.
    pub max_body_bytes: usize,
    /// A request's whole body must arrive within this, counted from when its headers had
    /// (408 after). Default 30 s.
    pub body_timeout: Duration,
    /// Bytes of request bodies all requests together hold at once, from a body's first byte
    /// until its request is answered (503 with Retry-After above). Default the larger of
    /// 256 MiB and 4 × `max_body_bytes`; never under `max_body_bytes`.
    pub max_body_bytes_in_flight: usize,
    /// Largest answer the router reads whole from a replica or an overflow endpoint, bytes
    /// (502 above). Default the larger of 64 MiB and `max_body_bytes`.
    pub max_answer_bytes: usize,
    /// Longest line, and longest event, of a server-sent event stream the router reads as it
    /// passes, bytes (the stream ends with an error event above). Default 1 MiB.
    pub max_event_bytes: usize,
}

impl BodyLimits {
    /// The defaults for a router whose largest request body is `max_body_bytes`.
    pub fn for_max_body(max_body_bytes: usize) -> Self {
        BodyLimits {
            max_body_bytes,
            body_timeout: Duration::from_secs(30),
            max_body_bytes_in_flight: (256 * MIB).max(max_body_bytes.saturating_mul(4)),
            max_answer_bytes: (64 * MIB).max(max_body_bytes),
            max_event_bytes: MIB,
        }
    }
}

impl Default for BodyLimits {
    fn default() -> Self {
        BodyLimits::for_max_body(8 * MIB)
    }
}

/// Why a request body was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Over `max_body_bytes`, by its Content-Length or as it came: 413.
    #[error(
        "the request body is {}over the router's limit of {limit} bytes (router.max_body_bytes)",
        .declared.map(|n| format!("{n} bytes, ")).unwrap_or_default()
    )]
    TooLarge { limit: usize, declared: Option<u64> },
    /// Not all there by the deadline: 408.
    #[error(
        "the request body did not arrive within the router's body deadline of {} ms ({received} of {} bytes came); send the body without pausing, or raise router.body_timeout_ms",
        .limit.as_millis(),
        .declared.map_or_else(|| "an unknown number of".to_string(), |n| n.to_string())
    )]
    Timeout {
        limit: Duration,
        received: usize,
        declared: Option<u64>,
    },
    /// The budget of bodies in flight is spent: 503 with Retry-After.
    #[error(
        "the router is holding its limit of {limit} bytes of request bodies in flight (router.max_body_bytes_in_flight); retry after the Retry-After"
    )]
    Busy { limit: usize },
    /// The client broke off its body, or sent a malformed one: 400.
    #[error("the request body could not be read ({0}); send the request again")]
    Broken(String),
}

impl BodyError {
    pub fn status(&self) -> StatusCode {
        match self {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::Timeout { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            BodyError::Broken(_) => StatusCode::BAD_REQUEST,
        }
    }

    /// The answer to a request whose body this refused; `what_to_do` says what else a client
    /// with a body too large can send. The rest of the body is never read, so the connection
    /// cannot carry another request: the answer says so (`Connection: close`), or a client would
    /// reuse it and lose its next request.
    pub(super) fn response(&self, what_to_do: &str, meta: &Meta) -> Response {
        let message = match self {
            BodyError::TooLarge { .. } => format!("{self}; {what_to_do}"),
            BodyError::Timeout { .. } | BodyError::Busy { .. } | BodyError::Broken(_) => self.to_string(),
        };
        let mut r = error(self.status(), message, meta);
        if matches!(self, BodyError::Busy { .. }) {
            r = with_retry_after(r, BUSY_RETRY);
        }
        r.headers_mut()
            .insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
        r
    }
}

/// Reads request bodies within [`BodyLimits`], against the budget of bodies in flight.
#[derive(Debug)]
pub struct BodyGate {
    limits: BodyLimits,
    budget: Arc<Semaphore>,
}

/// A body's share of the budget of bodies in flight: given back when dropped, so a handler
/// holds it for as long as it holds the body.
#[derive(Debug)]
pub struct BodyShare(Option<OwnedSemaphorePermit>);

impl BodyShare {
    /// Bytes of the budget this share holds.
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }
}

impl BodyGate {
    /// A gate with `limits`; a budget under `max_body_bytes` is raised to it (a body the
    /// router accepts must fit its budget), and `max_body_bytes` is at most 4 GiB - 1.
    pub fn new(mut limits: BodyLimits) -> Self {
        limits.max_body_bytes = limits.max_body_bytes.min(u32::MAX as usize);
        limits.max_body_bytes_in_flight = limits
            .max_body_bytes_in_flight
            .clamp(limits.max_body_bytes, Semaphore::MAX_PERMITS);
        BodyGate {
            budget: Arc::new(Semaphore::new(limits.max_body_bytes_in_flight)),
            limits,
        }
    }

    pub fn limits(&self) -> &BodyLimits {
        &self.limits
    }

    /// Bytes of request bodies held now.
    pub fn in_flight_bytes(&self) -> usize {
        self.limits.max_body_bytes_in_flight - self.budget.available_permits()
    }

    /// `n` more bytes of the budget, at once or not at all.
    fn take(&self, share: &mut BodyShare, n: usize) -> Result<(), BodyError> {
        let busy = || BodyError::Busy {
            limit: self.limits.max_body_bytes_in_flight,
        };
        // n is at most max_body_bytes, which fits a u32.
        let n = u32::try_from(n).map_err(|_| busy())?;
        let permit = self.budget.clone().try_acquire_many_owned(n).map_err(|_| busy())?;
        match &mut share.0 {
            Some(held) => held.merge(permit),
            None => share.0 = Some(permit),
        }
        Ok(())
    }

    /// Reads a request's whole body: by `since + body_timeout`, at most `max_body_bytes`, its
    /// bytes taken from the budget as they arrive (all of a Content-Length up front, so a body
    /// that cannot fit is refused before it is read). Call it only once the request's key has
    /// been checked.
    pub async fn read(&self, body: Body, headers: &HeaderMap, since: Instant) -> Result<(Bytes, BodyShare), BodyError> {
        let limit = self.limits.max_body_bytes;
        // hyper has refused a malformed Content-Length already, and holds the body to it.
        let declared = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let declared_len = match declared.map(usize::try_from) {
            Some(Ok(n)) if n <= limit => Some(n),
            Some(_) => return Err(BodyError::TooLarge { limit, declared }),
            None => None,
        };
        let mut share = BodyShare(None);
        self.take(&mut share, declared_len.unwrap_or(0))?;
        let mut buf = BytesMut::with_capacity(declared_len.unwrap_or(0));
        let read = async {
            let mut body = body;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| BodyError::Broken(e.to_string()))?;
                let Ok(data) = frame.into_data() else {
                    // Trailers: nothing the router reads.
                    continue;
                };
                let total = buf.len() + data.len();
                if total > limit {
                    return Err(BodyError::TooLarge { limit, declared });
                }
                let held = share.bytes();
                if total > held {
                    self.take(&mut share, total - held)?;
                }
                buf.extend_from_slice(&data);
            }
            Ok(())
        };
        let deadline = since + self.limits.body_timeout;
        let outcome = tokio::time::timeout_at(deadline, read).await;
        match outcome {
            Ok(Ok(())) => Ok((buf.freeze(), share)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(BodyError::Timeout {
                limit: self.limits.body_timeout,
                received: buf.len(),
                declared,
            }),
        }
    }
}

/// Why an answer was not read whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    /// Over the router's `max_answer_bytes`.
    #[error("the answer is over the router's limit of {limit} bytes (router.max_answer_bytes)")]
    TooLarge { limit: usize },
    /// The connection broke, or the answer was malformed.
    #[error("{0}")]
    Broken(String),
}

/// Reads an answer (a replica's, an overflow endpoint's) whole, at most `limit` bytes.
pub async fn read_answer<B>(body: B, limit: usize) -> Result<Bytes, AnswerError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(AnswerError::TooLarge { limit }),
        Err(e) => Err(AnswerError::Broken(e.to_string())),
    }
}

/// What the client is told when `from`'s answer (`from`: "replica n1/a", "the overflow
/// endpoint") was over the router's `limit`.
pub fn answer_too_large(from: &str, limit: usize) -> String {
    format!(
        "{from} answered more than the router's limit of {limit} bytes on an answer (router.max_answer_bytes); ask for a smaller output (fewer tokens, a smaller batch), or have the operator raise the limit; not retried, it ran"
    )
}

/// How long, at most, the router goes on reading (and dropping, never holding) a body it will
/// not use, after answering its request — nginx's lingering close: a client still sending the
/// body gets to read the answer, instead of a broken pipe when the connection closes under
/// it. As long as a client gets to send its headers (router.header_read_timeout_ms's default),
/// so that a client without a key holds a connection at most twice that.
pub const DRAIN_FOR: Duration = Duration::from_secs(5);

/// Middleware: a response to a request whose body was not read to its end says
/// `Connection: close` (a client told so does not reuse the connection and lose its next
/// request), and what is left of the body is read and dropped, for at most [`DRAIN_FOR`],
/// before the connection closes.
pub async fn close_unless_read(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    closing_unless_read(req, |req| next.run(req)).await
}

/// [`close_unless_read`] around `serve` (the router's inference route calls it without axum's
/// middleware, `server::Routes`).
pub async fn closing_unless_read<F, Fut>(req: axum::extract::Request, serve: F) -> Response
where
    F: FnOnce(axum::extract::Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    use hyper::body::Body as _;
    if req.body().is_end_stream() {
        return serve(req).await;
    }
    let read = Arc::new(AtomicBool::new(false));
    let tracked = {
        let read = read.clone();
        req.map(|inner| {
            Body::new(Tracked {
                inner: Some(inner),
                read,
            })
        })
    };
    let mut r = serve(tracked).await;
    if !read.load(Ordering::Acquire) {
        r.headers_mut()
            .insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

/// A request body that notes when it was read to its end, and is drained when dropped before.
struct Tracked {
    /// Taken by the drain.
    inner: Option<Body>,
    read: Arc<AtomicBool>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        use hyper::body::Body as _;
        if self.read.load(Ordering::Acquire) {
            return;
        }
        let Some(mut body) = self.inner.take().filter(|b| !b.is_end_stream()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let drain = async { while let Some(Ok(_)) = body.frame().await {} };
            let _ = tokio::time::timeout(DRAIN_FOR, drain).await;
        });
    }
}

/// Most elements a request may send a server that reads only JSON (the router converts binary
/// tensors for it, on either protocol): each becomes a JSON value on the way (tens of bytes),
/// so a request within the body limit cannot turn into many times that.
pub(crate) fn json_elements_limit(max_body_bytes: usize) -> u64 {
    (max_body_bytes / 8) as u64
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod over_tcp;
