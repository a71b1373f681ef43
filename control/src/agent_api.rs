//! The agent API on the controllers: registration (a Raft write) and heartbeat streams (kept in
//! the leader's memory, never in the log).

use futures::StreamExt;
use laneway_proto::agent::agent_service_server::AgentService;
use laneway_proto::agent::{
    AssignedJob, DesiredState, Heartbeat, JobRef, JoinReply, JoinRequest, RegisterReply, RegisterRequest,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::admin::AdminError;
use crate::command::Command;
use crate::context::Context;
use crate::fleet::heartbeats::{Propose, Seen};
use crate::fleet::{GpuRecord, NodeRegistration};
use crate::jobs::{Completion, JobResult, JobState};
use crate::registry::ReplicaRecord;

/// Serves agents.
pub struct AgentGrpc {
    ctx: Context,
    /// Where joins are recorded.
    audit: Option<std::sync::Arc<crate::admin::audit::AuditLog>>,
    /// Join attempts by peer address.
    joins: JoinLimiter,
}

impl AgentGrpc {
    pub fn new(ctx: Context) -> Self {
        AgentGrpc {
            ctx,
            audit: None,
            joins: JoinLimiter::new(),
        }
    }

    pub fn with_audit(mut self, log: std::sync::Arc<crate::admin::audit::AuditLog>) -> Self {
        self.audit = Some(log);
        self
    }
}

/// Join attempts a peer address may make at once, and how many a second after that: a fleet
/// brought up behind one NAT address joins a few dozen hosts in a minute; a flood is cut to a
/// trickle.
const JOIN_BURST: u32 = 30;
const JOINS_PER_SECOND: u32 = 1;
/// Addresses remembered before the ones that are full again are forgotten.
const JOIN_PEERS_KEPT: usize = 100_000;

/// Join attempts by peer IP (a GCRA per address, from `governor`).
struct JoinLimiter(governor::DefaultKeyedRateLimiter<std::net::IpAddr>);

impl JoinLimiter {
    fn new() -> Self {
        let quota = governor::Quota::per_second(std::num::NonZeroU32::new(JOINS_PER_SECOND).expect("non-zero"))
            .allow_burst(std::num::NonZeroU32::new(JOIN_BURST).expect("non-zero"));
        JoinLimiter(governor::RateLimiter::keyed(quota))
    }

    /// Ok, or how long until `peer` may try again. A call without an address (in-process) is
    /// not limited.
    fn check(&self, peer: Option<std::net::SocketAddr>) -> Result<(), std::time::Duration> {
        let Some(ip) = peer.map(|a| a.ip()) else { return Ok(()) };
        if self.0.len() > JOIN_PEERS_KEPT {
            self.0.retain_recent();
        }
        self.0.check_key(&ip).map_err(|not_until| {
            use governor::clock::Clock as _;
            not_until.wait_time_from(governor::clock::DefaultClock::default().now())
        })
    }
}

/// Ok when this controller leads and a quorum of controllers answered it within its lease.
/// Otherwise the status that sends the agent elsewhere: to the leader this controller knows of,
/// or, from a leader out of touch with its quorum (a disk whose fsyncs stall its Raft core, a
/// network cut), to the next controller, which knows whom the others elected meanwhile.
/// `Register` commits through Raft and is held to the tight lease; a heartbeat stream gets the
/// longer one ([`crate::leader::pulse_lease`]).
fn leading(ctx: &Context) -> Result<(), Status> {
    leading_within(ctx, |now| ctx.pulse.out_of_touch(now))
}

/// [`leading`] for a heartbeat stream.
fn leading_stream(ctx: &Context) -> Result<(), Status> {
    leading_within(ctx, |now| ctx.pulse.out_of_touch_for_streams(now))
}

fn leading_within(ctx: &Context, out_of_touch: impl Fn(Instant) -> Option<std::time::Duration>) -> Result<(), Status> {
    if !ctx.is_leader() {
        return Err(not_leader(ctx));
    }
    match out_of_touch(Instant::now()) {
        None => Ok(()),
        Some(silent) => Err(AdminError::Unavailable(format!(
            "node {} leads by its own account, but no quorum of controllers has answered it for {} ms (a stalled disk or a cut network): the others may have elected another leader; try the next controller",
            ctx.node_id,
            silent.as_millis()
        ))
        .into()),
    }
}

/// The status that sends an agent to the leader (or tells it none is known yet).
fn not_leader(ctx: &Context) -> Status {
    match ctx.leader() {
        Some((leader_id, leader_addr)) if leader_id != ctx.node_id => AdminError::NotLeader {
            node_id: ctx.node_id,
            leader_id,
            leader_addr,
        }
        .into(),
        _ => AdminError::NoLeader { node_id: ctx.node_id }.into(),
    }
}

#[tonic::async_trait]
impl AgentService for AgentGrpc {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        // Anyone who reaches the listener may call Join: what it costs them is bounded before
        // anything is written. A peer address gets a burst of attempts, then one a second.
        let remote = req.remote_addr();
        let refuse = |status: Status| {
            let recorded = self
                .audit
                .as_ref()
                .and_then(|log| log.record_refusal(None, remote, "Join", &status));
            async move {
                if let Some(recorded) = recorded {
                    let _ = recorded.await;
                }
                Err(status)
            }
        };
        if let Err(wait) = self.joins.check(remote) {
            return refuse(Status::resource_exhausted(format!(
                "too many join attempts from {}; retry in {} s",
                remote.map_or_else(|| "this address".into(), |a| a.ip().to_string()),
                wait.as_secs() + 1
            )))
            .await;
        }
        let r = req.into_inner();
        if let Err(why) = crate::fleet::validate_node_id(&r.node_id) {
            return refuse(Status::invalid_argument(why.to_string())).await;
        }
        // Never the request itself in the audit log: it holds the token.
        let caller = crate::admin::audit::Caller {
            who: remote.map_or_else(|| "unknown".into(), |a| a.to_string()),
            target: format!("node_id: {:?}", r.node_id),
        };
        let join = async {
            if !self.ctx.is_leader() {
                return Err(not_leader(&self.ctx));
            }
            let Some(ca) = self.ctx.issuer.clone() else {
                return Err(Status::failed_precondition(
                    "the controllers hold no CA key (tls.ca_key), so they sign no certificates: give this host one from `lanectl certs issue --kind agent --name NODE` instead of a join token",
                ));
            };
            let key_sha256 =
                laneway_pki::csr_key_sha256(&r.csr_pem).map_err(|e| Status::invalid_argument(e.to_string()))?;
            let sha256 = crate::registry::hash_key(&r.token);
            let now = crate::jobs::unix_ms();
            // Checked here first, so that a made-up or spent token costs no Raft entry (anyone
            // reaching the listener may call Join); the commit checks again, in order.
            let registered = self.ctx.sm.node_flags(&r.node_id).is_some();
            self.ctx
                .sm
                .with_registry(|reg| reg.check_join_token(&sha256, &r.node_id, &key_sha256, now, registered))
                .map_err(|e| Status::permission_denied(e.to_string()))?;
            let consume = Command::ConsumeJoinToken {
                sha256,
                node_id: r.node_id.clone(),
                key_sha256,
                at_ms: now,
            };
            self.ctx
                .sm
                .check_allowed(&consume)
                .map_err(|e| Status::failed_precondition(e.to_string()))?;
            // The request must be good before the token is spent on it.
            let cert = ca
                .sign_csr(&r.csr_pem, laneway_pki::Kind::Agent, &r.node_id, AGENT_CERT_LIFETIME)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
            let (_, resp) = self.ctx.proposer.propose(consume).await.map_err(|e| match e
                .forward_to_leader::<crate::node::ControllerNode>()
            {
                Some(_) => not_leader(&self.ctx),
                None => Status::unavailable(format!("the join could not be committed: {e}")),
            })?;
            if let Some(why) = resp.rejected {
                tracing::warn!(node = %r.node_id, %why, "join refused");
                return Err(Status::permission_denied(why));
            }
            tracing::info!(node = %r.node_id, "node joined with a token");
            let expires = laneway_pki::not_after(&cert).map_err(|e| Status::internal(e.to_string()))?;
            Ok(Response::new(JoinReply {
                cert_pem: cert,
                expires_unix_ms: expires
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
            }))
        };
        match &self.audit {
            Some(log) => log.around_public(caller, "join", join).await,
            None => join.await,
        }
    }

    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        // Not held by a leader out of touch with its quorum: its commit would wait on a stalled
        // disk or a cut network while the others elect a leader the agent should find.
        leading(&self.ctx)?;
        let certified = crate::auth::caller(&req).map(|id| id.name.clone());
        let r = req.into_inner();
        if let Some(cert) = certified.filter(|c| *c != r.node_id) {
            tracing::warn!(certificate = %cert, claimed = %r.node_id, "registration for another node refused");
            return Err(Status::permission_denied(format!(
                "this agent's certificate is for node {cert}; it may not register node {} (an agent may only write its own node's state)",
                r.node_id
            )));
        }
        let reg = NodeRegistration {
            node_id: r.node_id,
            hostname: r.hostname,
            pool: r.pool,
            labels: r.labels.into_iter().collect(),
            gpus: r
                .gpus
                .into_iter()
                .map(|g| GpuRecord {
                    uuid: g.uuid,
                    product: g.product,
                    memory_bytes: g.memory_bytes,
                    mig_capable: g.mig_capable,
                })
                .collect(),
            replica_host: r.replica_host,
        };
        reg.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
        let node_id = reg.node_id.clone();
        let (log_index, resp) = self
            .ctx
            .proposer
            .propose(Command::RegisterNode(reg))
            .await
            .map_err(|e| match e.forward_to_leader::<crate::node::ControllerNode>() {
                Some(_) => not_leader(&self.ctx),
                None => Status::unavailable(format!("registration could not be committed: {e}")),
            })?;
        if let Some(reason) = resp.rejected {
            tracing::warn!(node = %node_id, %reason, "node registration refused");
            return Err(Status::already_exists(reason));
        }
        tracing::info!(node = %node_id, log_index, "node registered");
        Ok(Response::new(RegisterReply { log_index }))
    }

    type HeartbeatsStream = ReceiverStream<Result<DesiredState, Status>>;

    async fn heartbeats(&self, req: Request<Streaming<Heartbeat>>) -> Result<Response<Self::HeartbeatsStream>, Status> {
        leading_stream(&self.ctx)?;
        // With mTLS, the node the certificate names; every heartbeat must be for it.
        let certified = crate::auth::caller(&req).map(|id| id.name.clone());
        // Checked again at every message: a stream lives as long as its connection, and a
        // revocation committed meanwhile must end it.
        let credential = crate::auth::authenticated(&req);
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            // The node this stream speaks for, fixed by its first heartbeat, and the stream's
            // number in the heartbeat table.
            let mut bound: Option<(String, u64)> = None;
            // Whether the agent ended the stream itself (a clean end: it is restarting or
            // shutting down, its replicas keep serving), rather than losing it.
            let mut goodbye = false;
            // Whether this controller ended the stream because it does not lead.
            let mut sent_away = false;
            let mut last: Option<Heartbeat> = None;
            // What the last reply told the agent: a change to it (an assignment, a cancel, a
            // replica placed, a drain) goes out when it commits, not on the next heartbeat.
            let mut sent: Option<Told> = None;
            // Wakes when what this stream's node is told may have changed (from its first
            // heartbeat on): one node's change wakes its stream only.
            let mut node_changed: Option<tokio::sync::watch::Receiver<u64>> = None;
            // When a replica report that had to wait may be proposed.
            let mut resync: Option<Instant> = None;
            loop {
                let reply = tokio::select! {
                    msg = inbound.next() => {
                        let hb = match msg {
                            Some(Ok(hb)) => hb,
                            Some(Err(_)) => break,
                            None => {
                                goodbye = true;
                                break;
                            }
                        };
                        if let Some(Err(why)) = credential.as_ref().map(|c| crate::auth::recheck(&ctx.sm, c)) {
                            tracing::warn!(node = %hb.node_id, %why, "heartbeat stream closed: its credential was revoked");
                            let _ = tx.send(Err(Status::unauthenticated(why))).await;
                            break;
                        }
                        // Before the reply is built, so nothing committed in between is
                        // missed; only for a registered node (a made-up name gets no signal).
                        if node_changed.is_none() && ctx.sm.node_flags(&hb.node_id).is_some() {
                            let mut rx = ctx.sm.subscribe_node(&hb.node_id);
                            rx.mark_unchanged();
                            node_changed = Some(rx);
                        }
                        let reply = handle(&ctx, certified.as_deref(), &mut bound, &hb);
                        match &reply {
                            Ok(_) => resync = sync_replicas(&ctx, &hb),
                            // This controller sent the agent away because it does not lead
                            // (or lost touch with its quorum): the node is not lost, so the
                            // end says nothing of the node's health.
                            Err(_) if leading_stream(&ctx).is_err() => sent_away = true,
                            Err(_) => {}
                        }
                        last = Some(hb);
                        reply
                    }
                    changed = async { node_changed.as_mut().expect("guarded").changed().await }, if node_changed.is_some() => {
                        if changed.is_err() {
                            break;
                        }
                        let Some(hb) = last.as_ref().filter(|_| ctx.is_leader()) else { continue };
                        if let Some(Err(why)) = credential.as_ref().map(|c| crate::auth::recheck(&ctx.sm, c)) {
                            let _ = tx.send(Err(Status::unauthenticated(why))).await;
                            break;
                        }
                        let (jobs, settled) = job_reply(&ctx, hb);
                        let ds = desired_state(&ctx, hb, jobs, settled);
                        if sent.as_ref() == Some(&Told::of(&ds)) {
                            continue;
                        }
                        Ok(ds)
                    }
                    _ = tokio::time::sleep_until(resync.unwrap_or_else(Instant::now)), if resync.is_some() => {
                        resync = last.as_ref().filter(|_| ctx.is_leader()).and_then(|hb| sync_replicas(&ctx, hb));
                        continue;
                    }
                };
                if let Ok(r) = &reply {
                    sent = Some(Told::of(r));
                }
                let stop = reply.is_err();
                if tx.send(reply).await.is_err() || stop {
                    break;
                }
            }
            if let Some((node, stream)) = bound {
                let end = if sent_away {
                    StreamEnd::SentAway
                } else if goodbye {
                    StreamEnd::Goodbye
                } else {
                    StreamEnd::Lost
                };
                stream_ended(&ctx, &node, stream, end);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// How a heartbeat stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamEnd {
    /// The connection broke: the host or its agent died, or the network between.
    Lost,
    /// The agent closed its side (a restart re-adopts its replicas).
    Goodbye,
    /// This controller sent the agent away: it does not lead, or lost touch with its quorum.
    SentAway,
}

/// A node's heartbeat stream ended. Lost makes the node suspect at once: its replicas are
/// replaced elsewhere and it gets no new job, while it stays up (not fenced) until
/// `node_dead_after` of silence. A clean end, or one this controller chose, only forgets the
/// stream; silence still counts.
fn stream_ended(ctx: &Context, node: &str, stream: u64, end: StreamEnd) {
    if !ctx.is_leader() {
        return;
    }
    match end {
        StreamEnd::Goodbye => {
            tracing::info!(%node, "the agent closed its heartbeat stream");
            return;
        }
        StreamEnd::SentAway => {
            tracing::info!(%node, "sent the agent to look for the leader elsewhere");
            return;
        }
        StreamEnd::Lost => {}
    }
    if ctx.heartbeats.stream_closed(node, stream, Instant::now()) {
        tracing::warn!(%node, "heartbeat stream lost: node is suspect, its replicas are replaced elsewhere until it reconnects");
        ctx.history.event(
            "suspect",
            node,
            "heartbeat stream lost: replicas replaced elsewhere; declared down if still silent after node_dead_after"
                .to_string(),
        );
    }
}

/// What a heartbeat says of the node's replicas, as the state records them (sorted by id),
/// each dialled at the node's `host`.
pub fn replica_records(hb: &Heartbeat, host: &str) -> Vec<ReplicaRecord> {
    let mut reported: Vec<ReplicaRecord> = hb
        .replicas
        .iter()
        .map(|r| ReplicaRecord {
            id: r.id.clone(),
            model: r.model.clone(),
            device: r.device.clone(),
            state: r.state.clone(),
            endpoint: if r.port == 0 {
                String::new()
            } else if host.contains(':') {
                format!("[{host}]:{}", r.port)
            } else {
                format!("{host}:{}", r.port)
            },
        })
        .collect();
    reported.sort_by(|a, b| a.id.cmp(&b.id));
    reported
}

/// Commits the node's replicas when their routable facts (state, endpoint) differ from what
/// the state holds. In-flight counts and other fast-moving numbers never reach the log.
/// Returns when to look again when the report has to wait (a set was proposed just before).
fn sync_replicas(ctx: &Context, hb: &Heartbeat) -> Option<Instant> {
    let host = ctx.sm.replica_host(&hb.node_id)?;
    let reported = replica_records(hb, &host);
    if reported == ctx.sm.node_replicas(&hb.node_id) {
        return None;
    }
    if let Err(why) = crate::registry::validate_replica_report(&reported) {
        tracing::warn!(node = %hb.node_id, %why, "replica report refused");
        return None;
    }
    match ctx.heartbeats.should_propose(&hb.node_id, &reported, Instant::now()) {
        Propose::Now => {}
        Propose::InFlight => return None,
        Propose::After(at) => return Some(at),
    }
    let ctx = ctx.clone();
    let node_id = hb.node_id.clone();
    tokio::spawn(async move {
        let n = reported.len();
        let cmd = Command::SetNodeReplicas {
            node_id: node_id.clone(),
            replicas: reported,
        };
        match ctx.proposer.propose(cmd).await {
            Ok((index, resp)) => match resp.rejected {
                Some(why) => tracing::warn!(node = %node_id, %why, "replica update refused"),
                None => tracing::debug!(node = %node_id, replicas = n, index, "replicas committed"),
            },
            Err(e) => {
                tracing::warn!(node = %node_id, error = %e, "replica update not committed; retried on a later heartbeat")
            }
        }
    });
    None
}

/// One heartbeat: check who sent it, record it, answer with the node's desired state.
fn handle(
    ctx: &Context,
    certified: Option<&str>,
    bound: &mut Option<(String, u64)>,
    hb: &Heartbeat,
) -> Result<DesiredState, Status> {
    if let Some(cert) = certified.filter(|c| *c != hb.node_id) {
        tracing::warn!(certificate = %cert, claimed = %hb.node_id, "heartbeat for another node refused");
        return Err(Status::permission_denied(format!(
            "this agent's certificate is for node {cert}; a heartbeat for {} is refused (an agent may only write its own node's state)",
            hb.node_id
        )));
    }
    match bound {
        Some((node, _)) if *node != hb.node_id => {
            tracing::warn!(stream_node = %node, claimed = %hb.node_id, "heartbeat for another node on this stream; closing it");
            return Err(Status::permission_denied(format!(
                "this stream belongs to node {node}; a heartbeat for {} is refused (an agent may only speak for its own node)",
                hb.node_id
            )));
        }
        Some(_) => {}
        None => {
            if ctx.sm.node_flags(&hb.node_id).is_none() {
                tracing::warn!(node = %hb.node_id, "heartbeat from an unregistered node");
                return Err(Status::not_found(format!(
                    "node {} is not registered; call Register first",
                    hb.node_id
                )));
            }
            leading_stream(ctx)?;
            *bound = Some((hb.node_id.clone(), ctx.heartbeats.stream_opened(&hb.node_id)));
        }
    }
    leading_stream(ctx)?;
    let replicas_ready = hb.replicas.iter().filter(|r| r.state == "ready").count() as u32;
    let actors = agent_actors(ctx, hb);
    ctx.heartbeats.record(
        &hb.node_id,
        Seen {
            at: Instant::now(),
            replicas_ready,
            replicas_total: hb.replicas.len() as u32,
            lag_ms: crate::jobs::unix_ms().checked_sub(hb.sent_unix_ms),
            cached_blobs: hb.cached_blobs.clone(),
            actors,
            replicas: hb
                .replicas
                .iter()
                .take(MAX_AGENT_ACTORS)
                .map(|r| {
                    let c = r.cold_start.unwrap_or_default();
                    let cut = |s: &str| s.chars().take(160).collect::<String>();
                    laneway_proto::admin::ReplicaSeen {
                        id: cut(&r.id),
                        model: cut(&r.model),
                        state: cut(&r.state),
                        weights_ms: c.weights_ms,
                        started_ms: c.started_ms,
                        healthy_ms: c.healthy_ms,
                        ready_ms: c.ready_ms,
                        fetched_bytes: c.fetched_bytes,
                        device: cut(&r.device),
                    }
                })
                .collect(),
            in_flight: hb
                .replicas
                .iter()
                .map(|r| {
                    (
                        r.id.clone(),
                        r.model.clone(),
                        u32::try_from(r.in_flight).unwrap_or(u32::MAX),
                    )
                })
                .collect(),
            engine: hb
                .replicas
                .iter()
                .filter(|r| r.state == "ready")
                .map(|r| {
                    (
                        r.model.clone(),
                        u32::try_from(r.waiting).unwrap_or(u32::MAX),
                        (r.kv_cache_usage >= 0.0 && r.kv_cache_usage.is_finite()).then_some(r.kv_cache_usage.min(1.0)),
                    )
                })
                .collect(),
            gpus: hb
                .gpus
                .iter()
                .map(|g| crate::fleet::heartbeats::GpuSeen {
                    uuid: g.uuid.clone(),
                    utilisation_pct: g.utilisation_pct,
                    memory_used_bytes: g.memory_used_bytes,
                    healthy: g.healthy,
                    mig_devices: g.mig_devices.clone(),
                    mig_profiles: g.mig_profiles.clone(),
                })
                .collect(),
        },
    );
    commit_job_reports(ctx, hb);
    let (jobs, settled) = job_reply(ctx, hb);
    let mut ds = desired_state(ctx, hb, jobs, settled);
    ds.renewed_cert_pem = renew(ctx, certified, hb);
    Ok(ds)
}

/// Actors an agent's heartbeat may report (one per replica, fetch and job attempt, plus its
/// own dozen): more are dropped.
const MAX_AGENT_ACTORS: usize = 1024;

/// The agent's actors from its heartbeat (bounded), and an event for each one whose restarts
/// rose since its previous heartbeat.
fn agent_actors(ctx: &Context, hb: &Heartbeat) -> Vec<laneway_actors::ActorStatus> {
    let cut = |s: &str, n: usize| -> String { s.chars().take(n).collect() };
    let actors: Vec<laneway_actors::ActorStatus> = hb
        .actors
        .iter()
        .take(MAX_AGENT_ACTORS)
        .map(|a| laneway_actors::ActorStatus {
            name: cut(&a.name, 160),
            parent: (!a.parent.is_empty()).then(|| cut(&a.parent, 160)),
            state: match a.state.as_str() {
                "running" => laneway_actors::ActorState::Running,
                "restarting" => laneway_actors::ActorState::Restarting,
                _ => laneway_actors::ActorState::Stopped,
            },
            detail: cut(&a.detail, 256),
            restarts: a.restarts,
            last_tick_ms_ago: u64::try_from(a.last_tick_ms_ago).ok(),
            last_error: (!a.last_error.is_empty()).then(|| cut(&a.last_error, 512)),
            crash_loop: a.crash_loop,
        })
        .collect();
    // An actor this leader has not heard of yet has nothing to compare with: its restarts
    // happened before (or under another leader).
    for a in ctx.heartbeats.restarted(&hb.node_id, &actors).unwrap_or_default() {
        ctx.history.event(
            "actor",
            &format!("{}/{}", hb.node_id, a.name),
            format!(
                "failed and restarted: {}",
                a.last_error.as_deref().unwrap_or("no message")
            ),
        );
    }
    actors
}

/// How long a certificate signed for an agent (at a join, or renewed) is valid; agents renew
/// when a third of it is left.
pub const AGENT_CERT_LIFETIME: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// A renewed certificate when the heartbeat asks for one: only on a stream authenticated as
/// the node itself, and only by a controller that holds the CA key.
fn renew(ctx: &Context, certified: Option<&str>, hb: &Heartbeat) -> String {
    if hb.renew_csr_pem.is_empty() {
        return String::new();
    }
    let (Some(node), Some(ca)) = (certified, ctx.issuer.as_ref()) else {
        tracing::warn!(node = %hb.node_id, "a certificate renewal was asked for, but this controller signs none (no tls.ca_key)");
        return String::new();
    };
    match ca.sign_csr(&hb.renew_csr_pem, laneway_pki::Kind::Agent, node, AGENT_CERT_LIFETIME) {
        Ok(cert) => {
            tracing::info!(%node, "renewed the node's certificate");
            cert
        }
        Err(e) => {
            tracing::warn!(%node, error = %e, "certificate renewal refused");
            String::new()
        }
    }
}

/// What a reply tells an agent, to compare with the last one sent (jobs by id and token: the
/// input crosses once).
#[derive(PartialEq)]
struct Told {
    jobs: Vec<(String, u64)>,
    replicas: Vec<laneway_proto::agent::DesiredReplica>,
    mig: Vec<laneway_proto::agent::MigLayout>,
    cordoned: bool,
    draining: bool,
}

impl Told {
    fn of(ds: &DesiredState) -> Self {
        Told {
            jobs: ds.jobs.iter().map(|j| (j.job_id.clone(), j.token)).collect(),
            replicas: ds.replicas.clone(),
            mig: ds.mig.clone(),
            cordoned: ds.cordoned,
            draining: ds.draining,
        }
    }
}

/// The reply to `hb`: the node's flags, placed replicas and jobs.
fn desired_state(ctx: &Context, hb: &Heartbeat, jobs: Vec<AssignedJob>, settled: Vec<JobRef>) -> DesiredState {
    let (cordoned, draining) = ctx.sm.node_flags(&hb.node_id).unwrap_or((false, false));
    DesiredState {
        version: ctx.sm.applied_index(),
        sequence: hb.sequence,
        cordoned,
        draining,
        replicas: desired_for(&ctx.sm, &hb.node_id),
        replicas_managed: true,
        jobs,
        settled,
        mig: mig_for(&ctx.sm, &hb.node_id),
        renewed_cert_pem: String::new(),
    }
}

/// Commits what the agent reports of its jobs: started and finished, each only while the job
/// still holds the report's token.
fn commit_job_reports(ctx: &Context, hb: &Heartbeat) {
    let now = crate::jobs::unix_ms();
    let mut commits = Vec::new();
    ctx.sm.with_jobs(|jobs, _, _| {
        for r in &hb.jobs {
            // Only the node the job is assigned to reports on it: a token is a log index any
            // agent can guess, and must not let one node finish another's job.
            let Some(job) = jobs.get(&r.job_id).filter(|j| reports_on(j, &hb.node_id, r.token)) else {
                continue;
            };
            let command = match r.state.as_str() {
                "running" if job.state == JobState::Assigned => Command::JobStarted {
                    job_id: r.job_id.clone(),
                    token: r.token,
                    at_ms: now,
                },
                "succeeded" => Command::FinishJob {
                    job_id: r.job_id.clone(),
                    token: r.token,
                    completion: Completion::Succeeded(JobResult {
                        key: r.result_key.clone(),
                        bytes: r.result_bytes,
                        gpu_us: r.gpu_us,
                        content_type: r.content_type.clone(),
                    }),
                    at_ms: now,
                },
                "failed" => Command::FinishJob {
                    job_id: r.job_id.clone(),
                    token: r.token,
                    completion: Completion::Failed {
                        reason: format!("on {}: {}", hb.node_id, crate::text::clip(&r.error, 1024)),
                        retryable: r.retryable,
                    },
                    at_ms: now,
                },
                _ => continue,
            };
            commits.push(((r.job_id.clone(), r.token, r.state.clone()), command));
        }
    });
    for (key, command) in commits {
        if matches!(command, Command::FinishJob { .. }) {
            // Chaos: the replica finished and published its result; the completion is not
            // committed yet.
            fail::fail_point!("jobs::before_completion_commit");
        }
        ctx.jobs.commit_report(key, command);
    }
}

/// Whether `node` may report on `job` with `token`: it holds the job's current attempt.
fn reports_on(job: &crate::jobs::Job, node: &str, token: u64) -> bool {
    job.token == Some(token) && job.node.as_deref() == Some(node)
}

/// The jobs assigned to `hb`'s node now, and the reports it may drop (finished, cancelled,
/// reassigned or forgotten jobs: such a report can never count).
fn job_reply(ctx: &Context, hb: &Heartbeat) -> (Vec<AssignedJob>, Vec<JobRef>) {
    ctx.sm.with_jobs(|jobs, _, registry| {
        let mut settled = Vec::new();
        let mut reported = std::collections::HashSet::new();
        for r in &hb.jobs {
            reported.insert((r.job_id.as_str(), r.token));
            let current = jobs.get(&r.job_id).is_some_and(|j| j.token == Some(r.token));
            if !current && r.state != "running" {
                settled.push(JobRef {
                    job_id: r.job_id.clone(),
                    token: r.token,
                });
            }
        }
        let assigned = jobs
            .placed_on(&hb.node_id)
            .filter_map(|j| {
                let token = j.token?;
                let known = reported.contains(&(j.id.as_str(), token));
                Some(AssignedJob {
                    job_id: j.id.clone(),
                    token,
                    model: j.model.clone(),
                    replica_id: j.replica.clone().unwrap_or_default(),
                    // The agent already has it: the input crosses the stream once.
                    input: if known {
                        String::new()
                    } else {
                        j.input.clone().unwrap_or_default()
                    },
                    input_uri: if known {
                        String::new()
                    } else {
                        j.input_uri.clone().unwrap_or_default()
                    },
                    timeout_ms: registry
                        .classes
                        .get(&j.class)
                        .map_or(laneway_core::jobs::DEFAULT_ATTEMPT_TIMEOUT_MS, |c| {
                            c.request_timeout_ms.as_duration().as_millis() as u64
                        }),
                    result_key: laneway_agent::results::result_key(&j.id, token),
                })
            })
            .collect();
        (assigned, settled)
    })
}

/// The replicas placed on a node, with how to run them (the model's runtime, with
/// `{product}` and `{max_batch}` filled in from the placement).
/// The MIG layouts wanted on a node's GPUs.
/// The MIG layouts the controllers want on `node_id`, as the heartbeat reply carries them.
pub fn mig_for(sm: &crate::store::StateMachineStore, node_id: &str) -> Vec<laneway_proto::agent::MigLayout> {
    sm.with_registry(|r| {
        r.placement
            .mig
            .get(node_id)
            .into_iter()
            .flatten()
            .map(|(gpu, profiles)| laneway_proto::agent::MigLayout {
                gpu: gpu.clone(),
                profiles: profiles.clone(),
            })
            .collect()
    })
}

/// The replicas placed on `node_id`, as the heartbeat reply carries them: each model's runtime
/// command with its placeholders filled in.
pub fn desired_for(sm: &crate::store::StateMachineStore, node_id: &str) -> Vec<laneway_proto::agent::DesiredReplica> {
    sm.with_registry(|r| {
        r.placement
            .desired
            .get(node_id)
            .into_iter()
            .flatten()
            .filter_map(|d| {
                let m = r.models.get(&d.model)?;
                let max_batch = m.profiles.get(&d.product).map_or(1, |p| p.max_batch).to_string();
                // The controller's placeholders; the agent fills in the host's own.
                let fill = |a: &str| {
                    // The server serves the public name (a later version's entry is
                    // name@version; its clients still ask for name).
                    a.replace("{model}", m.public_name())
                        .replace("{product}", &d.product)
                        .replace("{max_batch}", &max_batch)
                };
                let r = &m.runtime;
                let probe = r.in_flight.as_ref();
                Some(laneway_proto::agent::DesiredReplica {
                    id: d.id.clone(),
                    model: d.model.clone(),
                    device: d.gpu.clone(),
                    command: r.command.iter().map(|a| fill(a)).collect(),
                    env: r.env.iter().map(|(k, v)| (k.clone(), fill(v))).collect(),
                    health_path: fill(&r.health_path),
                    start_timeout_ms: u64::from(r.start_timeout_s()) * 1000,
                    in_flight_path: probe.map_or_else(String::new, |p| p.path.clone()),
                    in_flight_metric: probe.map_or_else(String::new, |p| p.metric.clone()),
                    waiting_metric: probe.and_then(|p| p.waiting.clone()).unwrap_or_default(),
                    kv_cache_metric: probe.and_then(|p| p.kv_cache.clone()).unwrap_or_default(),
                    in_flight_port: probe.and_then(|p| p.port.clone()).unwrap_or_default(),
                    files: r.files.iter().map(|(k, v)| (k.clone(), fill(v))).collect(),
                    stop_signal: r.stop_signal.clone().unwrap_or_default(),
                    stop_grace_s: r.stop_grace_s.unwrap_or(0),
                    warmup_path: r.warmup.as_ref().map_or_else(String::new, |w| fill(&w.path)),
                    warmup_body: r.warmup.as_ref().map_or_else(String::new, |w| fill(&w.body)),
                    weights: m
                        .weights
                        .iter()
                        .map(|a| laneway_proto::agent::WeightArtifact {
                            uri: a.uri.clone(),
                            sha256: a.sha256.clone(),
                            size_bytes: a.size_bytes,
                            path: a.path.clone().unwrap_or_default(),
                        })
                        .collect(),
                })
            })
            .collect()
    })
}
