//! The router's HTTP server: the routes of every protocol (KServe v2, OpenAI, jobs), the
//! listener with its connection limits and TLS, and readiness until the router has caught up.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::answer::{error, request_id, with_retry_after, Meta};
use super::http::{infer, metadata, model_ready};
use super::Router;

/// Limits of the router's listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterSettings {
    /// Where the router listens; `None` runs no router on this controller.
    pub listen: Option<SocketAddr>,
    /// Largest request body, bytes (413 above). Default 8 MiB.
    pub max_body_bytes: usize,
    /// A client must send its request headers within this (slowloris guard). Default 5 s.
    /// hyper also applies it to idle keep-alive connections, so it is the idle timeout too
    /// (Apache's KeepAliveTimeout default); clients keep their pool idle timeout under it.
    pub header_read_timeout: Duration,
    /// Open connections at most; more wait in the listen backlog until one ends. Default 4096.
    pub max_connections: usize,
    /// HTTPS, when the operator gave the router a certificate; `None`: plain HTTP.
    pub tls: Option<HttpsSettings>,
    /// A request's whole body must arrive within this (408 after). Default 30 s.
    pub body_timeout: Duration,
    /// Request body bytes all requests hold at once (503 above); `None`: the larger of
    /// 256 MiB and 4 × `max_body_bytes`.
    pub max_body_bytes_in_flight: Option<usize>,
    /// Largest answer read whole from a replica or an overflow endpoint (502 above); `None`:
    /// the larger of 64 MiB and `max_body_bytes`.
    pub max_answer_bytes: Option<usize>,
    /// Longest line or event of a streamed answer. Default 1 MiB.
    pub max_event_bytes: usize,
    /// Threads serving connections (ADR 0031). Default: one per core.
    pub threads: usize,
}

/// The router's HTTPS certificate, loaded.
#[derive(Clone)]
pub struct HttpsSettings {
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// Where the certificate came from (for logs and comparisons).
    pub cert_path: std::path::PathBuf,
}

impl std::fmt::Debug for HttpsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsSettings")
            .field("cert_path", &self.cert_path)
            .finish_non_exhaustive()
    }
}

impl PartialEq for HttpsSettings {
    fn eq(&self, other: &Self) -> bool {
        self.cert_path == other.cert_path
    }
}

impl Eq for HttpsSettings {}

impl RouterSettings {
    /// The limits on what the router reads: the defaults for its largest body.
    pub fn body_limits(&self) -> super::body::BodyLimits {
        let d = super::body::BodyLimits::for_max_body(self.max_body_bytes);
        super::body::BodyLimits {
            body_timeout: self.body_timeout,
            max_body_bytes_in_flight: self.max_body_bytes_in_flight.unwrap_or(d.max_body_bytes_in_flight),
            max_answer_bytes: self.max_answer_bytes.unwrap_or(d.max_answer_bytes),
            max_event_bytes: self.max_event_bytes,
            ..d
        }
    }
}

impl Default for RouterSettings {
    fn default() -> Self {
        RouterSettings {
            listen: None,
            max_body_bytes: 8 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(5),
            max_connections: 4096,
            tls: None,
            body_timeout: Duration::from_secs(30),
            max_body_bytes_in_flight: None,
            max_answer_bytes: None,
            max_event_bytes: 1024 * 1024,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// The router's HTTP app. Its handlers read request bodies themselves, after authentication
/// and within the router's [`super::body::BodyLimits`].
pub fn app(router: Arc<Router>) -> axum::Router {
    axum::Router::new()
        // The status is the answer (Triton's clients read it); the body says it too (KServe's
        // read `live` / `ready`).
        .route("/v2/health/live", get(|| async { axum::Json(serde_json::json!({"live": true})) }))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(super::http::server_metadata))
        .route("/v2/models/{model}", get(metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}", get(metadata))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer))
        .route("/v1/models", get(super::llm::models))
        .route("/v1/models/{model}", get(super::llm::model))
        .route("/v1/chat/completions", post(super::llm::chat_completions))
        .route("/v1/completions", post(super::llm::completions))
        .route("/v1/embeddings", post(super::llm::embeddings))
        .route("/v1/jobs", post(super::jobs::post_job).get(super::jobs::list_jobs))
        .route(
            "/v1/jobs/{id}",
            get(super::jobs::get_job).delete(super::jobs::cancel_job),
        )
        .route("/v1/jobs/{id}/result", get(super::jobs::get_result))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "no such path; the router serves KServe v2 at GET /v2, GET /v2/health/live|ready, GET /v2/models/{model}[/versions/{version}][/ready] and POST /v2/models/{model}[/versions/{version}]/infer, language models at GET /v1/models[/{model}], POST /v1/chat/completions, /v1/completions and /v1/embeddings, KServe v2 over gRPC on this port, jobs at POST|GET /v1/jobs, GET|DELETE /v1/jobs/{id}, GET /v1/jobs/{id}/result, and GET /metrics and /ui (docs/protocols.md)".into(),
                &Meta::default(),
            )
        })
        .layer(axum::middleware::from_fn_with_state(router.clone(), until_caught_up))
        .layer(axum::middleware::from_fn(super::body::close_unless_read))
        .with_state(router)
}

/// Response header of a router-only process cut off from every controller: seconds since it
/// last heard the cluster. It routes from the state it last heard meanwhile (ADR 0029).
pub const CUT_OFF_HEADER: &str = "x-laneway-cut-off-s";

/// A restarted or newly added controller answers nothing from its state until it has caught
/// up with the leader: an older state would deny API keys, models and jobs that the cluster
/// already has. Health probes pass through (`/v2/health/ready` says 503 meanwhile).
async fn until_caught_up(
    State(router): State<Arc<Router>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    once_caught_up(&router, req, |req| next.run(req)).await
}

/// [`until_caught_up`] around `serve` (the inference route calls it without axum's middleware).
async fn once_caught_up<F, Fut>(router: &Router, req: axum::extract::Request, serve: F) -> Response
where
    F: FnOnce(axum::extract::Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    if router.is_ready() || req.uri().path().starts_with("/v2/health/") {
        let mut answer = serve(req).await;
        if let Some(cut_off) = router.cut_off_for() {
            // Static stability: still routing, from what it last heard; says so.
            if let Ok(v) = HeaderValue::from_str(&cut_off.as_secs().to_string()) {
                answer.headers_mut().insert(CUT_OFF_HEADER, v);
            }
        }
        return answer;
    }
    with_retry_after(
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this router is catching up with the cluster (it just started or joined, or has not yet received the routing state); retry in a moment or through another router".into(),
            &Meta {
                request_id: request_id(req.headers()),
                ..Meta::default()
            },
        ),
        Duration::from_secs(1),
    )
}

/// A running router listener.
pub struct RouterServer {
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    /// The accept loop; `None` once [`RouterServer::ended`] saw it end.
    task: Option<JoinHandle<()>>,
}

impl RouterServer {
    /// Returns when the accept loop has ended (only on `stop`, unless something broke it).
    pub async fn ended(&mut self) {
        match self.task.as_mut() {
            Some(t) => {
                let _ = t.await;
                self.task = None;
            }
            None => std::future::pending().await,
        }
    }

    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// Serves the router, and `extra` routes beside it (the controller's `/metrics` and `/ui`), on
/// an already-bound listener, with the settings' limits (which it gives the router).
pub fn serve(
    router: Arc<Router>,
    extra: axum::Router,
    listener: TcpListener,
    settings: &RouterSettings,
) -> std::io::Result<RouterServer> {
    let addr = listener.local_addr()?;
    router.set_body_limits(settings.body_limits());
    // KServe v2 over gRPC on the same port (HTTP/2), outside the HTTP layers: it answers
    // catching-up and unread bodies in its own terms. A gRPC message is read by tonic, not the
    // body gate: its key is checked first, and it must arrive whole within the body timeout,
    // as an HTTP body must (grpc::KeyFirst).
    let grpc = axum::Router::new().route_service(super::grpc::PATH, super::grpc::service(router.clone()));
    let routes = Routes {
        router: router.clone(),
        app: app(router).merge(extra).merge(grpc),
    };
    let max_connections = settings.max_connections;
    let permits = Arc::new(Semaphore::new(max_connections));
    let header_timeout = settings.header_read_timeout;
    let tls = settings.tls.as_ref().map(|t| t.acceptor.clone());
    let (tx, mut rx) = watch::channel(false);
    let mut threads =
        ConnectionThreads::start(settings.threads, rx.clone(), permits.clone(), settings.max_connections)?;
    let task = tokio::spawn(async move {
        let mut refused_logged = Instant::now() - Duration::from_secs(60);
        loop {
            // At the limit the router stops accepting, as HAProxy's `maxconn` does: new
            // connections wait in the kernel's listen backlog until one ends (and past it, the
            // client's SYN is retried), so a burst costs its clients time, not a reset.
            // Closing them at accept, as the router once did, failed requests outright.
            let permit = match permits.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    if refused_logged.elapsed() > Duration::from_secs(10) {
                        tracing::warn!(
                            max_connections,
                            "router at its connection limit; new connections wait in the listen backlog until one ends (raise router.max_connections if this host has the memory)"
                        );
                        refused_logged = Instant::now();
                    }
                    tokio::select! {
                        p = permits.clone().acquire_owned() => match p {
                            Ok(p) => p,
                            Err(_) => return,
                        },
                        _ = rx.changed() => return,
                    }
                }
            };
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(s) => s,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "router accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = rx.changed() => return,
            };
            let _ = stream.set_nodelay(true);
            // Off this runtime's reactor, onto the connection thread's (ADR 0031).
            let stream = match stream.into_std() {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "router could not hand a connection to its threads");
                    continue;
                }
            };
            let routes = routes.clone();
            let stop = rx.clone();
            let tls = tls.clone();
            threads.next().spawn(async move {
                let stream = match tokio::net::TcpStream::from_std(stream) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "router connection thread could not take a connection");
                        return;
                    }
                };
                match tls {
                    // A client that opens a connection and says nothing holds a permit no
                    // longer than the header timeout.
                    None => match tokio::time::timeout(header_timeout, speaks_http2(&stream)).await {
                        Ok(Some(h2)) => serve_connection(TokioIo::new(stream), routes, header_timeout, h2, stop).await,
                        Ok(None) => {}
                        Err(_) => tracing::debug!(%peer, "router connection sent nothing within the header timeout"),
                    },
                    // The handshake gets the header timeout too; HTTP/2 when ALPN chose it.
                    Some(acceptor) => match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                            serve_connection(TokioIo::new(tls), routes, header_timeout, h2, stop).await
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "router TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "router TLS handshake timed out"),
                    },
                }
                drop(permit);
            });
        }
    });
    Ok(RouterServer {
        addr,
        shutdown: tx,
        task: Some(task),
    })
}

/// The threads that serve the router's connections (ADR 0031): each runs a single-threaded
/// runtime of its own, and every request of a connection, its forwarding to a replica (over
/// that thread's own pool, [`super::Router::client`]) and its answer stay on that thread. The
/// accept loop deals connections out in turn. A work-stealing runtime instead moved each
/// request's send and answer between threads: two cross-thread wake-ups a request, measured
/// at 45–72 µs of router CPU a request on two threads against 41–43 µs on one
/// (`laneway-chaos router`, this machine).
struct ConnectionThreads {
    handles: Vec<tokio::runtime::Handle>,
    next: usize,
}

/// How long a stopping router waits for its connections to finish their requests.
const STOP_GRACE: Duration = Duration::from_secs(5);

impl ConnectionThreads {
    /// `threads` threads (at least one). Each ends once `stop` says so and every connection
    /// has given back its permit, or [`STOP_GRACE`] has passed; at once if `stop`'s sender is
    /// dropped without saying so.
    fn start(
        threads: usize,
        stop: watch::Receiver<bool>,
        permits: Arc<Semaphore>,
        max_connections: usize,
    ) -> std::io::Result<Self> {
        // Requests on these threads are traced where the router's starter's were (a test's
        // scoped subscriber; else the global one, looked up as usual).
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let scoped = !dispatch.is::<tracing::subscriber::NoSubscriber>();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            handles.push(rt.handle().clone());
            let mut stop = stop.clone();
            let permits = permits.clone();
            let dispatch = dispatch.clone();
            std::thread::Builder::new()
                .name(format!("laneway-router-{i}"))
                .spawn(move || {
                    let _tracing = scoped.then(|| tracing::dispatcher::set_default(&dispatch));
                    rt.block_on(async move {
                        // A router dropped without `stop` (its controller dropped) ends its
                        // connections at once, as its data plane runtime's tasks end.
                        if stop.wait_for(|s| *s).await.is_ok() {
                            let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
                            let _ = tokio::time::timeout(STOP_GRACE, permits.acquire_many(all)).await;
                        }
                    });
                })?;
        }
        Ok(ConnectionThreads { handles, next: 0 })
    }

    /// The thread the next connection goes to.
    fn next(&mut self) -> &tokio::runtime::Handle {
        self.next = (self.next + 1) % self.handles.len();
        &self.handles[self.next]
    }
}

/// Read buffer of one connection, bytes: request headers must fit (nginx allows 32 KiB).
pub const MAX_CONNECTION_BUFFER: usize = 32 * 1024;

/// Streams one HTTP/2 connection (a gRPC client's) may have open at once.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// Whether a plain-TCP client speaks HTTP/2 with prior knowledge (gRPC clients, `curl
/// --http2-prior-knowledge`): its first bytes are the connection preface `PRI * HTTP/2.0`, which
/// no HTTP/1 request line starts with. `None`: it closed without a byte.
async fn speaks_http2(stream: &tokio::net::TcpStream) -> Option<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0";
    let mut buf = [0u8; PREFACE.len()];
    let mut wait = Duration::from_millis(1);
    loop {
        let n = stream.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        // A prefix of the preface may be all that has come yet: wait for the rest (within the
        // caller's header timeout), else decide.
        if n < buf.len() && PREFACE.starts_with(&buf[..n]) {
            // Backing off: thousands of clients that send one byte cost no busy polling.
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(100));
            continue;
        }
        return Some(buf[..n] == *PREFACE);
    }
}

/// Serves one connection, HTTP/1.1 or (`h2`) HTTP/2, until it closes or the router stops (then
/// gracefully, for up to 5 s).
async fn serve_connection<I>(io: I, routes: Routes, header_timeout: Duration, h2: bool, stop: watch::Receiver<bool>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    if h2 {
        let app = routes.app;
        // HTTP/2 has no idle timeout of its own: requests are counted, and a connection with
        // none for the header timeout (from its handshake on) is closed, as HTTP/1.1's
        // keep-alive is — an idle client, or one that sent only the preface, holds no permit.
        let activity = Arc::new(Activity::default());
        let app = app.layer(axum::middleware::from_fn_with_state(activity.clone(), count_requests));
        let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            .max_header_list_size(MAX_CONNECTION_BUFFER as u32)
            // A client that stops answering pings is gone: its streams and permit are let go.
            .keep_alive_interval(Some(Duration::from_secs(30)))
            .keep_alive_timeout(Duration::from_secs(10))
            .serve_connection(io, TowerToHyperService::new(app));
        let idle = async {
            loop {
                tokio::time::sleep(header_timeout).await;
                if activity.idle_for(header_timeout) {
                    return;
                }
            }
        };
        let mut conn = std::pin::pin!(conn);
        let mut stop = stop;
        tokio::select! {
            _ = conn.as_mut() => return,
            // Idle: GOAWAY, and nothing in flight to wait for.
            _ = idle => {}
            _ = stop.changed() => {}
        }
        conn.as_mut().graceful_shutdown();
        let _ = tokio::time::timeout(STOP_GRACE, conn).await;
    } else {
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            // What a connection buffers of a request at most (headers included): thousands of
            // clients sending bodies at once must not cost the router hyper's 400 KB each.
            .max_buf_size(MAX_CONNECTION_BUFFER)
            .keep_alive(true)
            .serve_connection(io, hyper::service::service_fn(move |req| routes.clone().serve(req)));
        until_stopped(conn, stop, |c| c.graceful_shutdown()).await;
    }
}

/// What an HTTP/1.1 connection serves. `POST /v2/models/{model}/infer`, the route nearly every
/// inference request takes, goes straight to its handler through the same two steps the app's
/// middleware takes (the unread-body close around the caught-up check); every other request
/// goes to the app. Through axum's router, its two `from_fn` layers and its extractors (which
/// box, move and copy the handler's large future and clone the request's headers) the route
/// cost the router several microseconds a request more (`laneway-chaos router`, ADR 0033).
/// HTTP/2 connections (gRPC clients, and any client that speaks HTTP/2) are served by the app
/// alone.
#[derive(Clone)]
struct Routes {
    router: Arc<Router>,
    app: axum::Router,
}

impl Routes {
    async fn serve(
        self,
        req: axum::http::Request<hyper::body::Incoming>,
    ) -> Result<Response, std::convert::Infallible> {
        let Some(model) = inference_model(&req) else {
            return hyper::service::Service::call(&TowerToHyperService::new(self.app), req).await;
        };
        let router = self.router;
        let req = req.map(axum::body::Body::new);
        Ok(crate::body::closing_unless_read(req, |req| async move {
            once_caught_up(&router.clone(), req, |req| {
                let (parts, body) = req.into_parts();
                let model = axum::extract::Path(super::http::ModelPath::new(model, None));
                infer(State(router), model, parts.headers, body)
            })
            .await
        })
        .await)
    }
}

/// The model of a `POST /v2/models/{model}/infer` request, when its name needs no decoding
/// (a `%` in it, or anything else, goes through the app, which decodes and answers as always).
pub(crate) fn inference_model<B>(req: &axum::http::Request<B>) -> Option<String> {
    if req.method() != axum::http::Method::POST {
        return None;
    }
    let model = req.uri().path().strip_prefix("/v2/models/")?.strip_suffix("/infer")?;
    (!model.is_empty() && !model.contains(['/', '%'])).then(|| model.to_string())
}

/// Requests in flight on one HTTP/2 connection, and when the last one ended.
struct Activity {
    in_flight: std::sync::atomic::AtomicUsize,
    last: std::sync::Mutex<Instant>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            in_flight: Default::default(),
            last: std::sync::Mutex::new(Instant::now()),
        }
    }
}

impl Activity {
    /// No request in flight, and none ended within `window`.
    fn idle_for(&self, window: Duration) -> bool {
        use std::sync::atomic::Ordering;
        self.in_flight.load(Ordering::Acquire) == 0
            && self.last.lock().unwrap_or_else(|e| e.into_inner()).elapsed() >= window
    }
}

async fn count_requests(
    State(activity): State<Arc<Activity>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use std::sync::atomic::Ordering;
    activity.in_flight.fetch_add(1, Ordering::AcqRel);
    let r = next.run(req).await;
    *activity.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    activity.in_flight.fetch_sub(1, Ordering::AcqRel);
    r
}

/// Runs a connection until it ends, or until the router stops: then `graceful` and up to 5 s.
async fn until_stopped<C: std::future::Future>(
    conn: C,
    mut stop: watch::Receiver<bool>,
    graceful: impl FnOnce(std::pin::Pin<&mut C>),
) {
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = stop.changed() => {
            graceful(conn.as_mut());
            let _ = tokio::time::timeout(STOP_GRACE, conn).await;
        }
    }
}

async fn ready(State(router): State<Arc<Router>>) -> (StatusCode, axum::Json<serde_json::Value>) {
    let ready = router.is_ready();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(serde_json::json!({ "ready": ready })))
}
