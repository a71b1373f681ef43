//! Starting and stopping one controller: storage, Raft, and the gRPC listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use laneway_proto::admin::admin_service_server::AdminServiceServer;
use laneway_proto::raft::raft_service_server::RaftServiceServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::admin::AdminGrpc;
use crate::agent_api::AgentGrpc;
use crate::auth;
use crate::config::ControllerConfig;
use crate::context::Context;
use crate::fleet::heartbeats::HeartbeatTable;
use crate::network::raft_client::NetworkFactory;
use crate::network::raft_service::RaftGrpc;
use crate::network::MAX_RAFT_MESSAGE_BYTES;
use crate::proposer::Proposer;
use crate::raft_types::Raft;
use crate::router::server::{self as router_server, RouterServer};
use crate::router::Router;
use crate::store::{self, Identity, StateMachineStore, StoreError};
use laneway_proto::agent::agent_service_server::AgentServiceServer;

/// Limits of the gRPC listener (Raft, admin and agent APIs), set explicitly rather than left to
/// library defaults that may change. A unary call that takes longer than this is cancelled
/// (streams are not: the limit applies until their response starts).
const GRPC_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Calls served at once on one connection; more wait (Raft pipelines and a router's forwards
/// stay well under it).
const GRPC_CONCURRENCY_PER_CONNECTION: usize = 256;
/// HTTP/2 streams open at once on one connection (agents hold one heartbeat stream each).
const GRPC_MAX_STREAMS: u32 = 1024;
/// Streams a client may reset before the server answers GOAWAY (rapid-reset floods).
const GRPC_MAX_PENDING_RESETS: usize = 64;
/// Request headers, bytes.
const GRPC_MAX_HEADER_BYTES: u32 = 16 * 1024;
/// HTTP/2 PING and TCP keepalive interval: a peer gone without a FIN is noticed within
/// interval + timeout.
const GRPC_KEEPALIVE: Duration = Duration::from_secs(20);
const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The gRPC listener's connections, each with TCP_NODELAY and TCP keepalive set.
///
/// tonic sets its builder's `tcp_nodelay` and `tcp_keepalive` only on a listener it binds
/// itself, never on an incoming stream it is handed, and this one is handed (it is bound
/// before Raft starts, so a busy port fails the start early). Without TCP_NODELAY every
/// answer this controller sent went out under Nagle's algorithm: an answer written in more
/// than one piece waited for the peer's delayed ACK, about 40 ms on Linux. A follower's
/// answers to the leader's AppendEntries took 40-48 ms instead of 2-6 ms once in every few
/// (`laneway_raft_append_round_trip_seconds`), and every commit waited on them.
fn grpc_incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(GRPC_KEEPALIVE))
}
/// Connections are closed (GOAWAY, then the grace for calls in flight) after this long, so
/// load spreads again over controllers that were restarted; agents and peers reconnect.
const GRPC_MAX_CONNECTION_AGE: Duration = Duration::from_secs(3600);
const GRPC_MAX_CONNECTION_AGE_GRACE: Duration = Duration::from_secs(60);
/// A client that has not finished its TLS handshake by then is disconnected (handshakes run
/// concurrently, so a slow one holds only its own connection).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The data dir is not this controller's (another node, another cluster, newer format).
    #[error("{0}")]
    DataDir(StoreError),
    #[error("cannot open the data dir: {0}")]
    Storage(StoreError),
    #[error("cannot listen on {addr}: {source}; is another controller (or its router) already using it?")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot use the TLS settings: {0}")]
    Tls(String),
    #[error("invalid raft settings: {0}")]
    RaftConfig(String),
    #[error("raft failed to start: {0}")]
    Raft(String),
    #[error("cannot start the router's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("{0}; set jobs.results_store (or --results-store) to a directory or object-store URL the controllers and agents share")]
    Results(String),
    #[error("cannot open the audit log {path}: {source}; the data dir must be writable")]
    Audit {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl StartError {
    /// Process exit code: 2 for a misconfiguration the operator must fix, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            StartError::DataDir(_) | StartError::RaftConfig(_) | StartError::Results(_) | StartError::Tls(_) => 2,
            StartError::Storage(_)
            | StartError::Bind { .. }
            | StartError::Raft(_)
            | StartError::Runtime(_)
            | StartError::Audit { .. } => 1,
        }
    }
}

/// A running controller.
pub struct Controller {
    pub raft: Raft,
    pub state: StateMachineStore,
    /// The address actually bound.
    pub addr: SocketAddr,
    /// The address peers dial.
    pub advertise: String,
    /// The inference router's address, when it runs.
    pub router_addr: Option<SocketAddr>,
    pub router: Arc<Router>,
    shutdown: Option<oneshot::Sender<()>>,
    /// The gRPC server's task; `None` once [`Controller::serve_until_stopped`] saw it end.
    server: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    router_server: Option<RouterServer>,
    /// The runtime the router's connections run on (ADR 0021); declared after
    /// `router_server` so that it outlives it.
    _data_plane: DataPlane,
    /// The runtime the gRPC services run on; declared after `server`.
    _grpc_plane: DataPlane,
    /// The supervised actor tree (ADR 0018).
    actors: crate::actors::Tree,
    /// Infrastructure that stays a plain task (ADR 0018): if one ends, the controller is
    /// broken and [`Controller::serve_until_stopped`] says so, so the process exits non-zero
    /// and systemd restarts it instead of it serving half-alive.
    infrastructure: Vec<(&'static str, JoinHandle<()>)>,
    /// For the last usage report at shutdown.
    ctx: Context,
}

/// The data plane's own Tokio runtime (ADR 0021): the router's accept loop, its connections
/// and its handlers run here, Raft, the gRPC services and the actors on the runtime that
/// started the controller. A burst of inference requests then queues behind other requests,
/// not in front of the heartbeats and votes that keep a leader elected.
///
/// The gRPC services (agents' heartbeat streams, the admin API, peers' Raft RPCs) get a runtime
/// of their own the same way (`laneway-grpc`): 25,000 agents opening their streams at once
/// must not queue in front of the Raft core and its replication tasks, which stay on the
/// runtime that started the controller — on two cores that burst used to delay the leader's
/// AppendEntries past their deadline and cost an election.
struct DataPlane(Option<tokio::runtime::Runtime>);

impl DataPlane {
    fn start(name: &str) -> std::io::Result<Self> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(name)
            .enable_all()
            .build()
            .map(|rt| DataPlane(Some(rt)))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("the data plane runs until dropped").handle()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        // Dropped from async code (the controller's owner): a blocking shutdown would panic
        // there. Its tasks are already stopped (the router server first) or can be abandoned.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Opens the data dir, starts Raft and serves the Raft and admin gRPC services.
/// Pending connections the router's socket queues.
pub(crate) const ROUTER_BACKLOG: u32 = 1024;

/// Binds a TCP socket to `addr` without listening on it yet (see the router's in [`start`]).
pub(crate) fn reserve(addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As TcpListener::bind does: a restarted controller rebinds its port at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

pub async fn start(cfg: ControllerConfig) -> Result<Controller, StartError> {
    let listener = TcpListener::bind(cfg.listen).await.map_err(|source| StartError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| addr.to_string());
    // The router's port is bound now (a port in use fails the start before any file is
    // opened) but listens only once the router serves: until then a client's connection is
    // refused at once and it tries another router, instead of waiting in the accept queue
    // while the stores open (seconds on a long log; the 10-minute soak saw 261 requests
    // answered past their timeout by a restarting controller's router).
    let router_socket = match cfg.router.listen {
        Some(raddr) => Some(reserve(raddr).map_err(|source| StartError::Bind { addr: raddr, source })?),
        None => None,
    };

    let identity = Identity {
        cluster: cfg.cluster_name.clone(),
        node_id: cfg.node_id,
    };
    let (log, sm) = store::open(&cfg.data_dir, &identity).map_err(|e| match e {
        StoreError::WrongIdentity { .. } | StoreError::NewerFormat { .. } => StartError::DataDir(e),
        other => StartError::Storage(other),
    })?;

    let raft_config = openraft::Config {
        cluster_name: cfg.cluster_name.clone(),
        heartbeat_interval: cfg.raft.heartbeat_ms,
        election_timeout_min: cfg.raft.election_timeout_min_ms,
        election_timeout_max: cfg.raft.election_timeout_max_ms,
        install_snapshot_timeout: 10_000,
        // Entries can be batches of up to 256 KiB (proposer::MAX_BATCH_BYTES). When the entries
        // of one AppendEntries exceed network::TARGET_APPEND_BYTES, the network answers
        // PayloadTooLarge with a smaller hint and openraft retries with fewer entries.
        max_payload_entries: 64,
        // At points staggered across the members, once the log is worth it:
        // `snapshot_points`, started below.
        snapshot_policy: openraft::SnapshotPolicy::Never,
        max_in_snapshot_log_to_keep: cfg.raft.keep_logs,
        ..Default::default()
    }
    .validate()
    .map_err(|e| StartError::RaftConfig(e.to_string()))?;

    let raft_timings = crate::network::RaftTimings::default();
    let raft = Raft::new(
        cfg.node_id,
        Arc::new(raft_config),
        NetworkFactory::new(cfg.cluster_name.clone(), cfg.tls.clone(), raft_timings.clone()),
        log.clone(),
        sm.clone(),
    )
    .await
    .map_err(|e| StartError::Raft(e.to_string()))?;

    let (proposer, proposer_task) = Proposer::start(raft.clone());
    let (jobs, forward_task) =
        crate::jobs::gateway::JobGateway::new(raft.clone(), cfg.node_id, proposer.clone(), cfg.tls.as_ref());
    let jobs = Arc::new(jobs);
    let results = laneway_agent::results::ResultStore::open(&cfg.results_store)
        .map_err(|e| StartError::Results(e.to_string()))?;
    let ctx = Context {
        raft: raft.clone(),
        node_id: cfg.node_id,
        cluster: cfg.cluster_name.clone(),
        advertise: advertise.clone(),
        log,
        sm: sm.clone(),
        proposer,
        raft_timings,
        heartbeats: Arc::new(HeartbeatTable::default()),
        router: Router::new(Arc::new(crate::router_host::AppliedState(sm.clone()))),
        load: Arc::default(),
        jobs: jobs.clone(),
        history: Arc::default(),
        unplaced: Arc::default(),
        tls: cfg.tls.clone(),
        issuer: cfg.issuer.clone(),
        actors: laneway_actors::ActorBoard::new(),
        routers: Arc::default(),
        pulse: {
            let lease = Duration::from_millis(cfg.raft.election_timeout_max_ms + cfg.raft.heartbeat_ms);
            let stream_lease = crate::leader::pulse_lease(lease, cfg.node_dead_after);
            Arc::new(crate::leader::RaftPulse::new(cfg.node_id, lease, stream_lease))
        },
    };
    let pulse_task = ctx.pulse.follow(&raft);
    let snapshot_task = crate::snapshot_points::follow(
        raft.clone(),
        cfg.node_id,
        crate::snapshot_points::Policy::new(cfg.raft.snapshot_logs, cfg.raft.snapshot_max_log_mib << 20),
        ctx.log.clone(),
        sm.clone(),
    );
    let router = ctx.router.clone();
    router.enable_jobs(jobs, Arc::new(crate::router_host::Results(results)));
    let data_plane = DataPlane::start("laneway-router").map_err(StartError::Runtime)?;
    let (router_task, router_server) = {
        // Everything the router spawns from here on runs on the data plane's runtime.
        let _on_data_plane = data_plane.handle().enter();
        let router_task = router.start();
        let bind_error = |source| StartError::Bind {
            addr: cfg.router.listen.unwrap_or(addr),
            source,
        };
        let router_server = match router_socket {
            Some(socket) => {
                // Listening here registers the socket with the data plane's reactor.
                let l = socket.listen(ROUTER_BACKLOG).map_err(bind_error)?;
                Some(
                    router_server::serve(router.clone(), crate::observe::routes(ctx.clone()), l, &cfg.router)
                        .map_err(bind_error)?,
                )
            }
            None => None,
        };
        (router_task, router_server)
    };
    let router_addr = router_server.as_ref().map(|s| s.addr);
    let leader_contact = Arc::new(crate::network::LeaderContact::default());
    let raft_svc = RaftServiceServer::new(RaftGrpc::new(
        raft.clone(),
        cfg.cluster_name.clone(),
        cfg.node_id,
        leader_contact.clone(),
        &ctx.raft_timings,
    ))
    .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
    let audit_path = cfg.data_dir.join("audit.log");
    let audit = crate::admin::audit::AuditLog::open(&audit_path, cfg.node_id).map_err(|source| StartError::Audit {
        path: audit_path.clone(),
        source,
    })?;
    let audit = Arc::new(audit);
    let admin_svc = AdminServiceServer::new(AdminGrpc::new(ctx.clone()).with_audit(audit.clone()))
        .max_decoding_message_size(cfg.max_admin_request_bytes);
    let agent_svc = AgentServiceServer::new(AgentGrpc::new(ctx.clone()).with_audit(audit.clone()))
        .max_decoding_message_size(cfg.max_admin_request_bytes);
    let guard = auth::Guard::new(
        &cfg.cluster_name,
        cfg.tls.is_some(),
        Some(audit.clone()),
        Some(sm.clone()),
    );
    let mut grpc = tonic::transport::Server::builder();
    match &cfg.tls {
        Some(tls) => {
            grpc = grpc
                .tls_config(tls.server(TLS_HANDSHAKE_TIMEOUT))
                .map_err(|e| StartError::Tls(e.to_string()))?;
        }
        None => {
            tracing::warn!("INSECURE DEVELOPMENT MODE: gRPC is plaintext and every caller may do anything; never run this on a network others can reach");
        }
    }
    let actors = crate::actors::start(
        &ctx,
        crate::actors::LeaderConfig {
            node_dead_after: cfg.node_dead_after,
            leader_contact,
            raft_lease: Duration::from_millis(cfg.raft.election_timeout_max_ms),
            raft_heartbeat: Duration::from_millis(cfg.raft.heartbeat_ms),
            provision: cfg.provision.clone(),
            data_dir: cfg.data_dir.clone(),
        },
    )
    .await
    .map_err(StartError::Raft)?;

    let (tx, rx) = oneshot::channel::<()>();
    let grpc_plane = DataPlane::start("laneway-grpc").map_err(StartError::Runtime)?;
    let listener = {
        let _on_grpc_plane = grpc_plane.handle().enter();
        let bind_error = |source| StartError::Bind { addr, source };
        TcpListener::from_std(listener.into_std().map_err(bind_error)?).map_err(bind_error)?
    };
    let server = grpc_plane.handle().spawn(
        grpc.timeout(GRPC_REQUEST_TIMEOUT)
            .concurrency_limit_per_connection(GRPC_CONCURRENCY_PER_CONNECTION)
            .max_concurrent_streams(GRPC_MAX_STREAMS)
            .http2_max_pending_accept_reset_streams(Some(GRPC_MAX_PENDING_RESETS))
            .http2_max_header_list_size(GRPC_MAX_HEADER_BYTES)
            .http2_keepalive_interval(Some(GRPC_KEEPALIVE))
            .http2_keepalive_timeout(Some(GRPC_KEEPALIVE_TIMEOUT))
            .max_connection_age(GRPC_MAX_CONNECTION_AGE)
            .max_connection_age_grace(GRPC_MAX_CONNECTION_AGE_GRACE)
            .add_service(guard.wrap(raft_svc, auth::raft_methods))
            .add_service(guard.wrap(admin_svc, auth::admin_methods))
            .add_service(guard.wrap(agent_svc, auth::agent_methods))
            .serve_with_incoming_shutdown(grpc_incoming(listener), async {
                let _ = rx.await;
            }),
    );
    tracing::info!(node_id = cfg.node_id, %addr, %advertise, router = ?router_addr, cluster = %cfg.cluster_name, data_dir = %cfg.data_dir.display(), "controller started");
    Ok(Controller {
        raft,
        state: sm,
        addr,
        advertise,
        router_addr,
        router,
        shutdown: Some(tx),
        server: Some(server),
        router_server,
        _data_plane: data_plane,
        _grpc_plane: grpc_plane,
        actors,
        infrastructure: vec![
            ("proposer", proposer_task),
            ("job gateway forwarder", forward_task),
            ("router table", router_task),
            ("raft pulse", pulse_task),
            ("snapshot points", snapshot_task),
        ],
        ctx,
    })
}

impl Controller {
    /// Stops serving and shuts Raft down.
    pub async fn shutdown(mut self) {
        // The leader's actors stop first (nothing more is proposed), then the rest of the tree.
        let _ = self
            .actors
            .root
            .stop_and_wait(Some("the controller is stopping".into()), Some(Duration::from_secs(5)))
            .await;
        if let Some(r) = self.router_server.take() {
            r.stop().await;
        }
        // No request arrives any more: what the router served goes to the ledger before Raft
        // stops (a stop must not lose what a client was already answered).
        crate::ledger::meter::flush(&self.ctx, Duration::from_secs(3)).await;
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Only now: the flush above proposes through the proposer.
        for (_, task) in &self.infrastructure {
            task.abort();
        }
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft shutdown");
        }
        if let Some(server) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
    }

    /// Waits until the controller stops serving: the gRPC server stopped (only on shutdown or
    /// a fatal listener error), or a piece of infrastructure or the actor tree ended — each of
    /// them an error: the caller exits non-zero so the service manager restarts the process.
    pub async fn serve_until_stopped(&mut self) -> Result<(), String> {
        let infrastructure = futures::future::select_all(
            self.infrastructure
                .iter_mut()
                .map(|(name, task)| Box::pin(async move { (*name, task.await) })),
        );
        let router_server = &mut self.router_server;
        let router = async move {
            match router_server.as_mut() {
                Some(r) => r.ended().await,
                None => std::future::pending().await,
            }
        };
        let actors = &mut self.actors.handle;
        let server_slot = &mut self.server;
        let server = async move {
            match server_slot.as_mut() {
                Some(s) => {
                    let r = s.await;
                    *server_slot = None;
                    r
                }
                None => std::future::pending().await,
            }
        };
        // Raft's core ended (a fatal storage error, a panic in it): nothing is replicated or
        // applied here any more. Its core closes the server metrics' watch when it ends; that
        // watch changes only with leadership, where the whole metrics change on every turn of
        // openraft's loop and would wake this thread each time.
        let (mut server_metrics, metrics) = (self.raft.server_metrics(), self.raft.metrics());
        let raft = async move {
            while server_metrics.changed().await.is_ok() {}
            match metrics.borrow().running_state.clone() {
                Err(fatal) => fatal.to_string(),
                Ok(()) => "its metrics channel closed".to_string(),
            }
        };
        tokio::select! {
            why = raft => Err(format!("raft stopped on this controller: {why}")),
            served = server => match served {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("gRPC server failed: {e}")),
                Err(e) => Err(format!("gRPC server task failed: {e}")),
            },
            ((name, ended), _, _) = infrastructure => Err(match ended {
                Ok(()) => format!("the {name} task ended; the controller cannot work without it"),
                Err(e) => format!("the {name} task failed: {e}"),
            }),
            ended = actors => Err(format!(
                "the controller's actor tree ended ({}); nothing would be scheduled any more",
                match ended { Ok(()) => "stopped".to_string(), Err(e) => e.to_string() }
            )),
            () = router => Err("the inference router's listener stopped".to_string()),
        }
    }

    /// Every actor of this controller.
    pub fn actors(&self) -> &laneway_actors::ActorBoard {
        &self.ctx.actors
    }

    /// Whether this controller leads now (see [`Context::is_leader`]).
    pub fn is_leader(&self) -> bool {
        self.ctx.is_leader()
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    /// Every connection the gRPC server accepts has Nagle's algorithm off (see `grpc_incoming`).
    #[tokio::test]
    async fn grpc_connections_are_accepted_with_nodelay() {
        let listener = super::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::grpc_incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.expect("a connection").unwrap();
        assert!(
            accepted.nodelay().unwrap(),
            "an accepted gRPC connection has TCP_NODELAY off"
        );
    }
}
