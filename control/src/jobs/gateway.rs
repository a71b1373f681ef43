//! How a router writes jobs: on the leader through its proposer, on a follower by forwarding
//! the write to the leader (`JobWrite`). The answer does not wait for this follower to apply
//! the write (that would add up to a Raft heartbeat interval to every submission); a read
//! that misses a job catches up first ([`JobGateway::catch_up`]), so a client told `202` still
//! reads its job back from the same router at once.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{JobOutcome, JobSubmission};
use crate::client::AdminClient;
use crate::command::{Command, CommandResponse};
use crate::proposer::Proposer;
use crate::typ::{NodeId, Raft};

/// How long a follower waits to apply up to the leader's read index.
const APPLY_WAIT: Duration = Duration::from_secs(2);
/// Timeout of one forwarded write.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// A job write a router may make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobWrite {
    Submit(JobSubmission),
    Cancel { job_id: String, at_ms: u64 },
}

impl JobWrite {
    pub fn into_command(self) -> Command {
        match self {
            JobWrite::Submit(s) => Command::SubmitJob(s),
            JobWrite::Cancel { job_id, at_ms } => Command::CancelJob { job_id, at_ms },
        }
    }
}

/// Why a job write has no answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GatewayError {
    /// No leader, or the leader changed or could not be reached while the write was in
    /// flight: it may or may not have been committed. Retrying with the same
    /// `Idempotency-Key` is safe.
    #[error("{0}")]
    Unavailable(String),
    /// The state machine refused it (state unchanged).
    #[error("{0}")]
    Rejected(String),
}

/// The routers' path to the job queue.
pub struct JobGateway {
    raft: Raft,
    node_id: NodeId,
    proposer: Proposer,
    leaders: AdminClient,
    /// Executor reports being committed now (job, token, state), so a report repeated by
    /// the next heartbeat before the first commit lands is not proposed twice.
    reporting: std::sync::Mutex<std::collections::HashSet<(String, u64, String)>>,
}

fn outcome(resp: CommandResponse) -> Result<JobOutcome, GatewayError> {
    if let Some(why) = resp.rejected {
        return Err(GatewayError::Rejected(why));
    }
    resp.job
        .ok_or_else(|| GatewayError::Rejected("the state machine gave no job outcome".into()))
}

impl JobGateway {
    pub fn new(raft: Raft, node_id: NodeId, proposer: Proposer) -> Self {
        JobGateway {
            raft,
            node_id,
            proposer,
            leaders: AdminClient::new(Vec::new()).with_call_timeout(FORWARD_TIMEOUT),
            reporting: Default::default(),
        }
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

    fn leader(&self) -> Option<(NodeId, String)> {
        crate::context::current_leader(&self.raft)
    }

    /// Commits `write` on the leader (this controller must be it): used by `JobWrite` calls.
    pub async fn commit_here(&self, write: JobWrite) -> Result<(u64, CommandResponse), GatewayError> {
        self.proposer
            .propose(write.into_command())
            .await
            .map_err(|e| GatewayError::Unavailable(format!("the write may not have been committed: {e}")))
    }

    /// Commits `write` through the leader and answers once this controller has applied it.
    pub async fn write(&self, write: JobWrite) -> Result<JobOutcome, GatewayError> {
        let Some((leader, addr)) = self.leader() else {
            return Err(GatewayError::Unavailable(
                "no controller leader is elected right now (an election is in progress)".into(),
            ));
        };
        if leader == self.node_id {
            let (_, resp) = self.commit_here(write).await?;
            return outcome(resp);
        }
        let json = serde_json::to_string(&write).expect("job writes serialize");
        let reply = self
            .leaders
            .call_one(&addr, |mut c| async move {
                c.job_write(laneway_proto::admin::JobWriteRequest { json }).await
            })
            .await
            .map_err(|e| {
                GatewayError::Unavailable(format!(
                    "leader {leader} at {addr} did not answer; the write may not have been committed: {e}"
                ))
            })?;
        if !reply.rejected.is_empty() {
            return Err(GatewayError::Rejected(reply.rejected));
        }
        serde_json::from_str(&reply.outcome_json)
            .map_err(|e| GatewayError::Unavailable(format!("leader {leader} answered an unreadable outcome: {e}")))
    }

    /// Brings this controller's state up to everything committed when the call started: a
    /// follower asks the leader for its read index and waits (at most 2 s) to apply it. Used
    /// when a read misses, so a job acknowledged through any router is found. Best effort: on
    /// failure the read answers from what is applied.
    pub async fn catch_up(&self) {
        let Some((leader, addr)) = self.leader() else { return };
        if leader == self.node_id {
            return;
        }
        let index = self
            .leaders
            .call_one(&addr, |mut c| async move {
                c.read_index(laneway_proto::admin::ReadIndexRequest {}).await
            })
            .await;
        if let Ok(r) = index {
            let _ = self
                .raft
                .wait(Some(APPLY_WAIT))
                .applied_index_at_least(Some(r.read_index), "job read")
                .await;
        }
    }
}
