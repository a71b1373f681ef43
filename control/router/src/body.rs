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
    use hyper::body::Body as _;
    if req.body().is_end_stream() {
        return next.run(req).await;
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
    let mut r = next.run(tracked).await;
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

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    fn gate(max_body: usize, in_flight: usize, timeout: Duration) -> BodyGate {
        BodyGate::new(BodyLimits {
            max_body_bytes: max_body,
            body_timeout: timeout,
            max_body_bytes_in_flight: in_flight,
            ..BodyLimits::default()
        })
    }

    fn content_length(n: u64) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::CONTENT_LENGTH, HeaderValue::from(n));
        h
    }

    /// A body of `chunks` (no Content-Length: read as it comes).
    fn chunked(chunks: &[&'static [u8]]) -> Body {
        let frames: Vec<Result<Bytes, std::io::Error>> = chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        Body::from_stream(futures::stream::iter(frames))
    }

    /// A body that never sends a byte.
    fn silent() -> Body {
        Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>())
    }

    #[test]
    fn defaults_scale_with_the_largest_body() {
        let d = BodyLimits::default();
        assert_eq!(d.max_body_bytes, 8 * MIB);
        assert_eq!(d.body_timeout, Duration::from_secs(30));
        assert_eq!(d.max_body_bytes_in_flight, 256 * MIB);
        assert_eq!(d.max_answer_bytes, 64 * MIB);
        assert_eq!(d.max_event_bytes, MIB);
        let big = BodyLimits::for_max_body(1024 * MIB);
        assert_eq!(big.max_body_bytes_in_flight, 4096 * MIB);
        assert_eq!(big.max_answer_bytes, 1024 * MIB);
        assert_eq!(
            gate(MIB, 10, Duration::from_secs(1)).limits().max_body_bytes_in_flight,
            MIB,
            "a budget always fits the largest body"
        );
    }

    #[tokio::test]
    async fn a_body_is_read_whole_and_holds_its_bytes_until_dropped() {
        let g = gate(100, 1000, Duration::from_secs(5));
        let (bytes, share) = g
            .read(chunked(&[b"abc", b"def"]), &HeaderMap::new(), Instant::now())
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"abcdef");
        assert_eq!((share.bytes(), g.in_flight_bytes()), (6, 6));
        drop(share);
        assert_eq!(g.in_flight_bytes(), 0);
        let (bytes, share) = g
            .read(Body::from("0123456789"), &content_length(10), Instant::now())
            .await
            .unwrap();
        assert_eq!((bytes.len(), share.bytes()), (10, 10));
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_by_its_length_before_a_byte_is_read() {
        let g = gate(100, 1000, Duration::from_secs(5));
        // Declared too large: refused at once, the silent body is never polled.
        let e = g
            .read(silent(), &content_length(101), Instant::now())
            .await
            .unwrap_err();
        assert_eq!(
            e,
            BodyError::TooLarge {
                limit: 100,
                declared: Some(101)
            }
        );
        assert_eq!(e.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(
            e.to_string().contains("101 bytes, over the router's limit of 100"),
            "{e}"
        );
        // Undeclared: refused once what came passes the limit, its budget given back.
        let e = g
            .read(chunked(&[&[b'x'; 60], &[b'x'; 60]]), &HeaderMap::new(), Instant::now())
            .await
            .unwrap_err();
        assert_eq!(
            e,
            BodyError::TooLarge {
                limit: 100,
                declared: None
            }
        );
        assert_eq!(g.in_flight_bytes(), 0);
    }

    #[tokio::test]
    async fn bodies_beyond_the_budget_in_flight_are_refused_with_a_retry_after() {
        let g = gate(100, 150, Duration::from_secs(5));
        let (_a, held) = g
            .read(Body::from(vec![0u8; 100]), &content_length(100), Instant::now())
            .await
            .unwrap();
        // Declared: refused before any byte is read.
        let e = g.read(silent(), &content_length(60), Instant::now()).await.unwrap_err();
        assert_eq!(e, BodyError::Busy { limit: 150 });
        // Undeclared: refused when a chunk would pass the budget.
        let e = g
            .read(chunked(&[&[b'x'; 40], &[b'x'; 40]]), &HeaderMap::new(), Instant::now())
            .await
            .unwrap_err();
        assert_eq!(e, BodyError::Busy { limit: 150 });
        assert_eq!(g.in_flight_bytes(), 100, "the refused bodies gave their share back");
        let r = e.response("x", &Meta::default());
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "1");
        assert_eq!(r.headers()[axum::http::header::CONNECTION], "close");
        drop(held);
        assert!(g
            .read(chunked(&[&[b'x'; 80]]), &HeaderMap::new(), Instant::now())
            .await
            .is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_not_there_by_the_deadline_is_a_408() {
        let g = gate(100, 1000, Duration::from_millis(300));
        let trickle = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"ab"))])
            .chain(futures::stream::pending());
        let since = Instant::now();
        let e = g
            .read(Body::from_stream(trickle), &content_length(50), since)
            .await
            .unwrap_err();
        assert_eq!(
            e,
            BodyError::Timeout {
                limit: Duration::from_millis(300),
                received: 2,
                declared: Some(50)
            }
        );
        assert_eq!(Instant::now() - since, Duration::from_millis(300));
        assert!(e.to_string().contains("2 of 50 bytes came"), "{e}");
        assert_eq!(e.response("x", &Meta::default()).status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(g.in_flight_bytes(), 0);
    }

    #[tokio::test]
    async fn an_answer_over_the_cap_is_refused() {
        let body = http_body_util::Full::new(Bytes::from(vec![0u8; 2048]));
        assert_eq!(
            read_answer(body.clone(), 1024).await,
            Err(AnswerError::TooLarge { limit: 1024 })
        );
        assert_eq!(read_answer(body, 2048).await.map(|b| b.len()), Ok(2048));
    }
}

/// The router over TCP: what a client sees of these limits.
#[cfg(test)]
mod over_tcp {
    use std::net::SocketAddr;

    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::server::{serve, RouterServer, RouterSettings};
    use crate::Router;
    use laneway_core::registry::{hash_key, LlmSpec, ReplicaRecord, Tenant};

    /// How long a test waits for an answer the router must give (far more than it needs).
    const ANSWER_WITHIN: Duration = Duration::from_secs(10);
    /// Bytes of every answer the fake replica gives.
    const ANSWER_BYTES: usize = 4096;

    /// A replica that answers every request with [`ANSWER_BYTES`] bytes: an inference answer, a
    /// completion, or a stream whose second event is one long line.
    async fn big_answers() -> SocketAddr {
        let pad = "x".repeat(ANSWER_BYTES);
        let infer = format!(r#"{{"outputs":[],"pad":"{}"}}"#, &pad[..ANSWER_BYTES - 25]);
        let completion = format!(r#"{{"choices":[{{"message":{{"content":"{pad}"}}}}]}}"#);
        let app = axum::Router::new()
            .route("/v2/health/ready", get(|| async { StatusCode::OK }))
            .route("/v2/models/{m}/infer", post(move || async move { infer }))
            .route(
                "/v1/chat/completions",
                post(move |body: Bytes| async move {
                    if body.windows(13).any(|w| w == b"\"stream\":true") {
                        let events = format!("data: {{\"choices\":[{{\"text\":\"t1\"}}]}}\n\ndata: {pad}\n\n");
                        ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], events)
                    } else {
                        ([(axum::http::header::CONTENT_TYPE, "application/json")], completion)
                    }
                }),
            );
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        addr
    }

    /// A router with `whisper` and the language model `chat` on the replica at `replica`, and
    /// tenant `t` (key `k`), served with `limits` (`overflow`: the speech lane's endpoint).
    async fn serving(replica: SocketAddr, overflow: Option<SocketAddr>, limits: BodyLimits) -> Served {
        let (fleet, mut reg) = crate::table::test_fixture();
        let mut chat = reg.models["whisper"].clone();
        chat.name = "chat".into();
        chat.llm = Some(LlmSpec {
            context_tokens: 4096,
            default_max_tokens: 8,
            prefix_affinity_tokens: 0,
        });
        reg.put_model(&chat).unwrap();
        if let Some(at) = overflow {
            let mut speech = reg.classes["speech"].clone();
            speech.overflow = Some(laneway_core::registry::OverflowSpec::for_test(
                &format!("http://{at}"),
                8,
                1_000,
            ));
            reg.put_class(&speech).unwrap();
        }
        reg.create_tenant(&Tenant {
            name: "t".into(),
            key_sha256: hash_key("k"),
            limits: Default::default(),
        })
        .unwrap();
        let replica = |model: &str| ReplicaRecord {
            id: format!("{model}-0"),
            model: model.into(),
            device: "GPU-1".into(),
            state: "ready".into(),
            endpoint: replica.to_string(),
        };
        reg.set_node_replicas("n1", &[replica("whisper"), replica("chat")]);
        let router = Router::new(Arc::new(crate::host::MemoryState::default()));
        router.install(crate::table::build(&fleet, &reg, &Default::default()));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = serve(
            router.clone(),
            axum::Router::new(),
            listener,
            &RouterSettings::default(),
        )
        .unwrap();
        router.set_body_limits(limits);
        Served { router, server }
    }

    struct Served {
        router: Arc<Router>,
        server: RouterServer,
    }

    impl Served {
        /// Opens a connection and sends a POST's head (with `Content-Length: declared` and
        /// `authorization`, if any) and the first bytes of its body, nothing more.
        async fn start_post(
            &self,
            path: &str,
            authorization: Option<&str>,
            declared: usize,
            first: &[u8],
        ) -> TcpStream {
            let mut c = TcpStream::connect(self.server.addr).await.unwrap();
            let auth = authorization.map_or(String::new(), |a| format!("authorization: {a}\r\n"));
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n{auth}\r\n"
            );
            c.write_all(head.as_bytes()).await.unwrap();
            c.write_all(first).await.unwrap();
            c
        }

        /// Waits until the router holds `bytes` of request bodies.
        async fn holding(&self, bytes: usize) {
            let gate = self.router.bodies();
            let waited = tokio::time::timeout(ANSWER_WITHIN, async {
                while gate.in_flight_bytes() != bytes {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
            waited
                .await
                .unwrap_or_else(|_| panic!("holds {} bytes of bodies, not {bytes}", gate.in_flight_bytes()));
        }

        fn url(&self, path: &str) -> String {
            format!("http://{}{path}", self.server.addr)
        }
    }

    /// An answer as it came over the wire.
    struct Answer {
        status: u16,
        /// The head, names lowercased.
        head: String,
        body: String,
    }

    /// Reads the answer on `c`; panics if it does not come within [`ANSWER_WITHIN`].
    async fn answer(c: &mut (impl tokio::io::AsyncRead + Unpin)) -> Answer {
        let read = async {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let end = loop {
                if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let n = c.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed without an answer: {}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
            };
            let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            while got.len() < end + length {
                let n = c.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed mid-answer");
                got.extend_from_slice(&buf[..n]);
            }
            let status = head[9..12].parse().unwrap();
            let body = String::from_utf8_lossy(&got[end..end + length]).into_owned();
            Answer { status, head, body }
        };
        tokio::time::timeout(ANSWER_WITHIN, read)
            .await
            .expect("no answer within 10 s: the router waited for the body")
    }

    const BODY_PATHS: [&str; 4] = [
        "/v2/models/whisper/infer",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/jobs",
    ];

    /// A request without a valid key is answered 401 from its headers: its body (4 MB
    /// declared, one byte sent) is never waited for, never read, never held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_anonymous_request_is_refused_before_its_body_is_read() {
        let s = serving(big_answers().await, None, BodyLimits::default()).await;
        for path in BODY_PATHS {
            for key in [None, Some("Bearer not-a-key")] {
                let mut c = s.start_post(path, key, 4_000_000, b"{").await;
                let a = answer(&mut c).await;
                assert_eq!(a.status, 401, "{path} {key:?}: {}", a.body);
                assert!(a.body.contains("API key"), "{}", a.body);
                assert!(
                    a.head.contains("connection: close"),
                    "the rest of the body is on the connection: {}",
                    a.head
                );
                assert_eq!(s.router.bodies().in_flight_bytes(), 0, "{path}");
            }
        }
        s.server.stop().await;
    }

    /// A client that sends its whole body anyway, more than the sockets' buffers hold, reads
    /// the refusal (given at once, from the headers) instead of a broken pipe: the router drops
    /// the rest of the body as it comes, holding none of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_still_sending_a_refused_body_reads_the_refusal() {
        let s = serving(big_answers().await, None, BodyLimits::default()).await;
        let big = Bytes::from(vec![b' '; 16 * 1024 * 1024]);
        let client = reqwest::Client::new();
        for _ in 0..5 {
            for (key, status) in [(None, 401), (Some("k"), 413)] {
                let mut post = client.post(s.url("/v2/models/whisper/infer")).body(big.clone());
                if let Some(k) = key {
                    post = post.bearer_auth(k);
                }
                let r = post.send().await.expect("an answer, not a broken pipe");
                assert_eq!(r.status(), status);
                assert_eq!(r.headers()["connection"], "close");
                assert_eq!(s.router.bodies().in_flight_bytes(), 0);
            }
        }
        s.server.stop().await;
    }

    /// A key does not buy a slow body time: the whole body must be there by the deadline,
    /// however steadily it trickles, or the request is answered 408.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_that_does_not_arrive_by_the_deadline_is_a_408() {
        let limits = BodyLimits {
            body_timeout: Duration::from_millis(300),
            ..BodyLimits::default()
        };
        let s = serving(big_answers().await, None, limits).await;
        for path in BODY_PATHS {
            let c = s.start_post(path, Some("Bearer k"), 1000, b"{").await;
            // A byte every 20 ms: never idle, never done.
            let (mut rd, mut wr) = c.into_split();
            let trickle = tokio::spawn(async move {
                while wr.write_all(b" ").await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
            let a = answer(&mut rd).await;
            trickle.abort();
            assert_eq!(a.status, 408, "{path}: {}", a.body);
            assert!(a.head.contains("connection: close"), "{}", a.head);
            assert!(a.body.contains("body deadline of 300 ms"), "{}", a.body);
        }
        s.holding(0).await;
        s.server.stop().await;
    }

    /// Bodies held at once are bounded: past the budget a request is answered 503 with a
    /// Retry-After before its body is read, and served again once the budget is back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bodies_beyond_the_budget_in_flight_wait_for_a_retry() {
        let limits = BodyLimits {
            max_body_bytes: 64 * 1024,
            max_body_bytes_in_flight: 100 * 1024,
            ..BodyLimits::default()
        };
        let s = serving(big_answers().await, None, limits).await;
        let holder = s
            .start_post("/v2/models/whisper/infer", Some("Bearer k"), 60_000, b"{")
            .await;
        s.holding(60_000).await;
        for path in BODY_PATHS {
            let mut c = s.start_post(path, Some("Bearer k"), 60_000, b"{").await;
            let a = answer(&mut c).await;
            assert_eq!(a.status, 503, "{path}: {}", a.body);
            assert!(a.head.contains("retry-after: 1"), "{}", a.head);
            assert!(a.body.contains("router.max_body_bytes_in_flight"), "{}", a.body);
        }
        // Small bodies still fit beside it.
        let small = reqwest::Client::new()
            .post(s.url("/v2/models/whisper/infer"))
            .bearer_auth("k")
            .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(small.status(), 200);
        // The client that held the budget goes away: its share comes back.
        drop(holder);
        s.holding(0).await;
        let mut c = s
            .start_post("/v1/chat/completions", Some("Bearer k"), 60_000, b"{")
            .await;
        s.holding(60_000).await;
        c.write_all(&[b' '; 59_999]).await.unwrap();
        let a = answer(&mut c).await;
        assert_eq!(a.status, 400, "read whole, and found wanting: {}", a.body);
        s.server.stop().await;
    }

    /// An answer read whole (a replica's, a language model's, an overflow endpoint's) over the
    /// cap is a 502 that says so, and the replica is not held responsible; a stream with a line
    /// over the cap ends with an error event.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_over_the_cap_are_a_502_and_long_stream_lines_end_the_stream() {
        let limits = BodyLimits {
            max_answer_bytes: 1024,
            max_event_bytes: 1024,
            ..BodyLimits::default()
        };
        let fake = big_answers().await;
        let s = serving(fake, Some(fake), limits).await;
        let client = reqwest::Client::new();
        let infer = || {
            client
                .post(s.url("/v2/models/whisper/infer"))
                .bearer_auth("k")
                .body(r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#)
                .send()
        };
        let chat = |stream: bool| {
            client
                .post(s.url("/v1/chat/completions"))
                .bearer_auth("k")
                .json(&serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}))
                .send()
        };
        for _ in 0..3 {
            let r = infer().await.unwrap();
            assert_eq!(r.status(), 502);
            let text = r.text().await.unwrap();
            assert!(
                text.contains("replica n1/whisper-0") && text.contains("router.max_answer_bytes"),
                "{text}"
            );
            let r = chat(false).await.unwrap();
            assert_eq!(r.status(), 502);
            let text = r.text().await.unwrap();
            assert!(text.contains("limit of 1024 bytes"), "{text}");
        }
        let table = s.router.table();
        let now_ms = s.router.now_ms(Instant::now());
        for m in ["whisper", "chat"] {
            assert!(
                !table.models[m].replicas[0].is_ejected(now_ms),
                "{m}: an answer too large is not the replica's fault"
            );
        }

        // Every slot busy: the overflow endpoint answers, too much.
        let busy: Vec<(&str, u32)> = ["whisper", "chat"]
            .into_iter()
            .map(|m| {
                let slot = &table.models[m].replicas[0];
                let mut taken = 0;
                while slot.try_acquire() {
                    taken += 1;
                }
                (m, taken)
            })
            .collect();
        let r = infer().await.unwrap();
        assert_eq!(r.status(), 502);
        assert!(r.headers().contains_key(crate::overflow::OVERFLOW_HEADER));
        assert!(r.text().await.unwrap().contains("the overflow endpoint answered more"));
        let r = chat(false).await.unwrap();
        assert_eq!(r.status(), 502);
        assert!(r.headers().contains_key(crate::overflow::OVERFLOW_HEADER));
        assert!(r.text().await.unwrap().contains("the overflow endpoint answered more"));
        for (m, taken) in busy {
            for _ in 0..taken {
                table.models[m].replicas[0].release();
            }
        }

        let r = chat(true).await.unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        assert!(
            text.starts_with("data: {\"choices\":[{\"text\":\"t1\"}]}\n\n"),
            "{text}"
        );
        assert!(
            text.contains("event: error") && text.contains("router.max_event_bytes"),
            "{text}"
        );
        assert!(!text.contains(&"x".repeat(2000)), "the long line did not pass on whole");
        s.server.stop().await;
    }
}
