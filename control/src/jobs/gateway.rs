//! How a router writes jobs: on the leader through its proposer, on a follower by forwarding
//! the write to the leader (`JobWrites`). A follower forwards every write its routers queued
//! while its previous calls were in flight in one call (the leader proposes them together, so
//! they become one Raft entry): one gRPC round trip per batch instead of per job. The answer
//! does not wait for this follower to apply the write (that would add up to a Raft heartbeat
//! interval to every submission); a read that misses a job catches up first
//! ([`JobGateway::catch_up`]), so a client told `202` still reads its job back from the same
//! router at once.
//!
//! A write rides through an election or a leader change instead of failing with it: for up to
//! [`WRITE_PATIENCE`] the gateway waits for a leader and tries again. A write that was never
//! proposed (no leader known, the leader refused the call) is always tried again. A submission
//! that may have been committed is proposed again as it was: the router drew its job id before
//! the first proposal, and the state machine answers the same submission with the job it
//! already created, so a retry never makes a second job. A cancel that may have been committed
//! is answered as unsure.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;

pub use laneway_core::jobs::{GatewayError, JobWrite};

/// The command a job write proposes.
pub fn command_of(write: JobWrite) -> Command {
    match write {
        JobWrite::Submit(s) => Command::SubmitJob(s),
        JobWrite::Cancel { job_id, at_ms } => Command::CancelJob { job_id, at_ms },
    }
}

use super::JobOutcome;
use crate::client::AdminClient;
use crate::command::{Command, CommandResponse};
use crate::proposer::Proposer;
use crate::raft_types::{NodeId, Raft};

/// How long a job write keeps trying through an election or leader change before it answers
/// that no leader took it: several elections on a loaded machine (each a leader lease plus an
/// election timeout, under a second), well short of a client's usual 10 s time-out.
const WRITE_PATIENCE: Duration = Duration::from_secs(5);
/// First pause before trying a write again; doubled each try up to [`RETRY_PAUSE_MAX`].
const RETRY_PAUSE: Duration = Duration::from_millis(20);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(250);

/// How long a follower waits to apply up to the leader's read index.
const APPLY_WAIT: Duration = Duration::from_secs(2);
/// Timeout of one forwarded call.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);
/// Most writes forwarded in one call, and most bytes of JSON (well under gRPC's 4 MiB).
const FORWARD_BATCH: usize = 512;
const FORWARD_BATCH_BYTES: usize = 1024 * 1024;
/// Forwarding calls in flight at once; writes queue up behind them and go in the next call.
/// The leader's proposer is where writes are folded into entries: a call here only has to get
/// them to it. With 4, a follower's writes waited a whole round trip (itself a proposer queue
/// and a commit) before leaving: at 5,000 submissions/s spread over three routers a write
/// through a follower took 65–75 ms against 6–8 ms through the leader. With 16 the median of
/// that 5,000/s phase went from 55 to 14 ms (`laneway-chaos jobs`, issue #29's note).
const FORWARD_IN_FLIGHT: usize = 16;
/// Writes waiting to be forwarded before routers wait for room.
const FORWARD_QUEUE: usize = 16 * 1024;

/// Why one try at a job write got no answer.
#[derive(Debug)]
enum Miss {
    /// The answer: the state machine refused the write, or something that retrying cannot fix.
    Final(GatewayError),
    /// Nothing was proposed (no leader known, or the leader refused the call): any write may be
    /// tried again.
    NotSent(String),
    /// Proposed, but the leader changed or went silent before it answered: the write may or
    /// may not have been committed.
    Unsure(String),
}

/// A write waiting for the forwarder.
struct Forward {
    json: String,
    reply: oneshot::Sender<Result<JobOutcome, Miss>>,
}

/// The routers' path to the job queue.
pub struct JobGateway {
    raft: Raft,
    node_id: NodeId,
    proposer: Proposer,
    leaders: Arc<AdminClient>,
    forward: mpsc::Sender<Forward>,
    /// Executor reports being committed now (job, token, state), so a report repeated by
    /// the next heartbeat before the first commit lands is not proposed twice.
    reporting: std::sync::Mutex<std::collections::HashSet<(String, u64, String)>>,
    /// Per write forwarded from this follower: until the leader's answer arrived.
    forward_seconds: prometheus_client::metrics::histogram::Histogram,
}

fn outcome(resp: CommandResponse) -> Result<JobOutcome, GatewayError> {
    if let Some(why) = resp.rejected {
        return Err(GatewayError::Rejected(why));
    }
    resp.job
        .ok_or_else(|| GatewayError::Rejected("the state machine gave no job outcome".into()))
}

impl JobGateway {
    /// Starts the gateway and its forwarding task (needs a Tokio runtime); the task's handle is
    /// the server's to watch.
    pub fn new(
        raft: Raft,
        node_id: NodeId,
        proposer: Proposer,
        tls: Option<&laneway_pki::Tls>,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let leaders = Arc::new(crate::leader::controllers_client(tls, FORWARD_TIMEOUT));
        let (forward, rx) = mpsc::channel(FORWARD_QUEUE);
        let task = tokio::spawn(forward_loop(raft.clone(), leaders.clone(), rx));
        let gateway = JobGateway {
            raft,
            node_id,
            proposer,
            leaders,
            forward,
            reporting: Default::default(),
            forward_seconds: laneway_store::latency_histogram(),
        };
        (gateway, task)
    }

    /// Commits an executor's report (started / finished) unless the same one is in flight.
    pub fn commit_report(self: &std::sync::Arc<Self>, key: (String, u64, String), command: Command) {
        if !self
            .reporting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone())
        {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            match this.proposer.propose(command).await {
                Ok((_, resp)) => {
                    if let Some(why) = resp.rejected {
                        tracing::debug!(job = %key.0, token = key.1, report = %key.2, %why, "job report refused");
                    }
                }
                Err(e) => tracing::warn!(job = %key.0, error = %e, "job report not committed; the agent repeats it"),
            }
            this.reporting.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        });
    }

    /// Seconds each write this follower forwarded took to be answered by the leader, the wait
    /// for a forwarding slot included (`laneway_raft_forward_seconds`).
    pub fn forward_seconds(&self) -> prometheus_client::metrics::histogram::Histogram {
        self.forward_seconds.clone()
    }

    fn leader(&self) -> Option<(NodeId, String)> {
        crate::leader::current_leader(&self.raft)
    }

    /// Commits `write` on the leader (this controller must be it): used by `JobWrite` calls.
    pub async fn commit_here(&self, write: JobWrite) -> Result<(u64, CommandResponse), GatewayError> {
        self.proposer
            .propose(command_of(write))
            .await
            .map_err(|e| GatewayError::Unavailable(format!("the write may not have been committed: {e}")))
    }

    /// Commits `write` through the leader, trying again through elections and leader changes
    /// for up to [`WRITE_PATIENCE`] (see the module's comment for which writes are retried).
    pub async fn write(&self, write: JobWrite) -> Result<JobOutcome, GatewayError> {
        // A submission carries its job id, so proposing it again cannot make a second job.
        let retry_unsure = matches!(write, JobWrite::Submit(_));
        let json = serde_json::to_string(&write).expect("job writes serialize");
        let deadline = Instant::now() + WRITE_PATIENCE;
        let mut pause = RETRY_PAUSE;
        let mut tries = 0u32;
        loop {
            tries += 1;
            let why = match self.try_write(&write, &json, deadline).await {
                Ok(outcome) => return Ok(outcome),
                Err(Miss::Final(e)) => return Err(e),
                Err(Miss::NotSent(why)) => why,
                Err(Miss::Unsure(why)) if retry_unsure => why,
                Err(Miss::Unsure(why)) => return Err(GatewayError::Unavailable(why)),
            };
            let now = Instant::now();
            if now + pause >= deadline {
                return Err(GatewayError::Unavailable(format!(
                    "{why} (tried {tries} times over {} s while the controllers elected a leader)",
                    WRITE_PATIENCE.as_secs()
                )));
            }
            tracing::debug!(tries, %why, "job write not answered; trying again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_PAUSE_MAX);
            // Wait out an election rather than poll it.
            let _ = self
                .raft
                .wait(Some(deadline.saturating_duration_since(Instant::now())))
                .metrics(|m| m.current_leader.is_some(), "a controller leader")
                .await;
        }
    }

    /// One try: proposed here when this controller leads (waiting for the commit until
    /// `deadline` at most), else forwarded to the leader.
    async fn try_write(&self, write: &JobWrite, json: &str, deadline: Instant) -> Result<JobOutcome, Miss> {
        let Some((leader, _)) = self.leader() else {
            return Err(Miss::NotSent(
                "no controller leader is elected right now (an election is in progress)".into(),
            ));
        };
        if leader == self.node_id {
            // A leader whose disk syncs slowly commits late; the client gets an answer that
            // says so within the gateway's patience, as through a follower, not a hung request
            // (a chaos run's slow_fsync_leader left one unanswered past 7 s). The proposal stays
            // in the log and may still commit: the caller resubmits with its key.
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(proposed) = tokio::time::timeout(left, self.proposer.propose(command_of(write.clone()))).await
            else {
                return Err(Miss::Final(GatewayError::Unavailable(format!(
                    "controller {} leads but did not commit the write within {} s (its disk or its followers are slow); it may not have been committed: resubmit with the same Idempotency-Key to be sure of one job",
                    self.node_id,
                    WRITE_PATIENCE.as_secs()
                ))));
            };
            return match proposed {
                Ok((_, resp)) => outcome(resp).map_err(Miss::Final),
                Err(openraft::error::RaftError::APIError(e)) => Err(Miss::Unsure(format!(
                    "controller {} stopped leading while the write was in flight: {e}",
                    self.node_id
                ))),
                Err(e) => Err(Miss::Final(GatewayError::Unavailable(format!(
                    "the write may not have been committed: {e}"
                )))),
            };
        }
        let (reply, rx) = oneshot::channel();
        let sent = Instant::now();
        let stopped = || Miss::Final(GatewayError::Unavailable("this controller is shutting down".into()));
        self.forward
            .send(Forward {
                json: json.to_owned(),
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        let answer = rx.await.unwrap_or_else(|_| Err(stopped()));
        self.forward_seconds.observe(sent.elapsed().as_secs_f64());
        answer
    }

    /// Whether this controller has applied everything the leader had committed when asked
    /// (the leader itself: once it has applied what it committed). `false` while no
    /// leader is known or it does not answer.
    pub async fn caught_up(&self) -> bool {
        match self.leader() {
            None => false,
            Some((leader, _)) if leader == self.node_id => self.raft.ensure_linearizable().await.is_ok(),
            Some((_, addr)) => self.apply_read_index_of(&addr).await,
        }
    }

    /// Brings this controller's state up to everything committed when the call started: a
    /// follower asks the leader for its read index and waits (at most 2 s) to apply it. Used
    /// when a read misses, so a job acknowledged through any router is found. Best effort: on
    /// failure the read answers from what is applied.
    pub async fn catch_up(&self) {
        if let Some((leader, addr)) = self.leader() {
            if leader != self.node_id {
                self.apply_read_index_of(&addr).await;
            }
        }
    }

    /// Asks the leader at `addr` for its read index and waits (at most [`APPLY_WAIT`]) until
    /// this controller has applied it; whether it has.
    async fn apply_read_index_of(&self, addr: &str) -> bool {
        let Ok(r) = self
            .leaders
            .call_one(addr, |mut c| async move {
                c.read_index(laneway_proto::admin::ReadIndexRequest {}).await
            })
            .await
        else {
            return false;
        };
        self.raft
            .wait(Some(APPLY_WAIT))
            .applied_index_at_least(Some(r.read_index), "catching up with the leader")
            .await
            .is_ok()
    }
}

/// Forwards queued writes to the leader: each call takes every write queued while the previous
/// calls were in flight (up to [`FORWARD_BATCH`]).
async fn forward_loop(raft: Raft, leaders: Arc<AdminClient>, mut rx: mpsc::Receiver<Forward>) {
    let permits = Arc::new(Semaphore::new(FORWARD_IN_FLIGHT));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else { return };
        let batch = crate::proposer::with_queued(&mut rx, first, FORWARD_BATCH, FORWARD_BATCH_BYTES, |f| f.json.len());
        let raft = raft.clone();
        let leaders = leaders.clone();
        tokio::spawn(async move {
            forward_batch(&raft, &leaders, batch).await;
            drop(permit);
        });
    }
}

async fn forward_batch(raft: &Raft, leaders: &AdminClient, batch: Vec<Forward>) {
    let (json, replies): (Vec<String>, Vec<_>) = batch.into_iter().map(|f| (f.json, f.reply)).unzip();
    let fail_all = |replies: Vec<oneshot::Sender<_>>, miss: &dyn Fn(String) -> Miss, why: String| {
        for r in replies {
            let _ = r.send(Err(miss(why.clone())));
        }
    };
    // Whoever leads now: the leader may have changed while the writes were queued.
    let Some((leader, addr)) = crate::leader::current_leader(raft) else {
        return fail_all(
            replies,
            &Miss::NotSent,
            "no controller leader is elected right now (an election is in progress)".into(),
        );
    };
    let sent = json.len();
    let answer = leaders
        .call_one(&addr, |mut c| async move {
            c.job_writes(laneway_proto::admin::JobWritesRequest { json }).await
        })
        .await;
    let answers = match answer {
        Ok(a) if a.replies.len() == sent => a.replies,
        Ok(a) => {
            return fail_all(
                replies,
                &Miss::Unsure,
                format!(
                    "leader {leader} at {addr} answered {} of {sent} writes; they may or may not have been committed",
                    a.replies.len()
                ),
            )
        }
        Err(e) => {
            return fail_all(
                replies,
                &Miss::Unsure,
                format!("leader {leader} at {addr} did not answer; the write may not have been committed: {e}"),
            )
        }
    };
    for (reply, a) in replies.into_iter().zip(answers) {
        let result = if !a.unavailable.is_empty() {
            Err(Miss::Unsure(format!("leader {leader} at {addr}: {}", a.unavailable)))
        } else if !a.rejected.is_empty() {
            Err(Miss::Final(GatewayError::Rejected(a.rejected)))
        } else {
            serde_json::from_str(&a.outcome_json).map_err(|e| {
                Miss::Final(GatewayError::Unavailable(format!(
                    "leader {leader} answered an unreadable outcome: {e}"
                )))
            })
        };
        let _ = reply.send(result);
    }
}
