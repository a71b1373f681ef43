//! The `LeaderWatch` actor: a follower's open line to the leader (`RaftService.Watch`).
//!
//! openraft lets a follower campaign only after the leader's lease (`election_timeout_max`)
//! plus a random election timeout, checked on a tick of 1.5 heartbeat intervals: 450–750 ms
//! with the defaults. When the leader's process dies, its kernel closes the line at once; the
//! follower then waits out exactly the lease (no voter grants a vote before it ends), checks
//! that no AppendEntries arrived meanwhile (a line broken by the network alone must not unseat
//! a leader that is still heard) and campaigns. The surviving followers go one after another in
//! node id order, a heartbeat interval apart, so they do not split the vote. Everything else is
//! openraft's own election: this only starts it sooner, which Raft's safety never depends on.

use std::sync::Arc;
use std::time::Duration;

use laneway_proto::raft::raft_service_client::RaftServiceClient;
use laneway_proto::raft::{WatchReply, WatchRequest};
use tokio::time::Instant;

use super::LeaderContact;
use crate::context::Context;
use crate::raft_types::NodeId;

/// How long a line may take to open.
const OPEN_TIMEOUT: Duration = Duration::from_millis(500);
/// Longest a tick waits on the line (the board's tick age stays fresh).
const WAIT: Duration = Duration::from_secs(1);
/// Past the lease before the first follower campaigns: the other voters' leases began at the
/// last heartbeat they took, no later than the line broke.
const MARGIN: Duration = Duration::from_millis(20);

/// The actor's state.
pub struct LeaderWatch {
    ctx: Context,
    contact: Arc<LeaderContact>,
    /// openraft's leader lease (`election_timeout_max`).
    lease: Duration,
    /// Between two followers' campaigns (the heartbeat interval).
    stagger: Duration,
    line: Option<Line>,
    /// The leader and term whose line broke, and when.
    broken: Option<(NodeId, u64, Instant)>,
}

struct Line {
    leader: NodeId,
    term: u64,
    replies: tonic::Streaming<WatchReply>,
}

impl LeaderWatch {
    pub fn new(ctx: Context, contact: Arc<LeaderContact>, lease: Duration, stagger: Duration) -> Self {
        LeaderWatch {
            ctx,
            contact,
            lease,
            stagger,
            line: None,
            broken: None,
        }
    }

    /// This follower's place among the voters that may take over from `leader` (by node id).
    fn rank(&self, leader: NodeId) -> u32 {
        let m = self.ctx.raft.metrics().borrow().membership_config.clone();
        m.membership()
            .voter_ids()
            .filter(|id| *id != leader && *id < self.ctx.node_id)
            .count() as u32
    }

    async fn open(&self, leader: NodeId, addr: &str) -> Result<tonic::Streaming<WatchReply>, String> {
        let tls = self
            .ctx
            .tls
            .as_ref()
            .map(|t| t.client(&laneway_pki::controller_server_name(leader)));
        let ep = laneway_pki::endpoint(addr, tls).map_err(|e| e.to_string())?;
        let channel = ep
            .connect_timeout(OPEN_TIMEOUT)
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        let req = WatchRequest {
            cluster: self.ctx.cluster.clone(),
            target: leader,
            follower: self.ctx.node_id,
        };
        let mut replies = tokio::time::timeout(OPEN_TIMEOUT, RaftServiceClient::new(channel).watch(req))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|s| s.message().to_string())?
            .into_inner();
        match tokio::time::timeout(OPEN_TIMEOUT, replies.message()).await {
            Ok(Ok(Some(_))) => Ok(replies),
            _ => Err("no answer on the line".into()),
        }
    }
}

impl laneway_actors::Ticker for LeaderWatch {
    const KIND: &'static str = "leader_watch";

    async fn tick(&mut self) -> Duration {
        let (leader, term, voter) = {
            let m = self.ctx.raft.metrics().borrow().clone();
            let voter = m
                .membership_config
                .membership()
                .voter_ids()
                .any(|id| id == self.ctx.node_id);
            (m.current_leader, m.current_term, voter)
        };
        let Some(leader) = leader.filter(|l| *l != self.ctx.node_id && voter) else {
            self.line = None;
            self.broken = None;
            return Duration::from_millis(100);
        };
        if let Some((was, was_term, at)) = self.broken {
            if (was, was_term) != (leader, term) {
                // A new leader (or a new term) already: nothing to do.
                self.broken = None;
            } else {
                let go = at + self.lease + MARGIN + self.stagger * self.rank(leader);
                let now = Instant::now();
                if now < go {
                    return go - now;
                }
                self.broken = None;
                if self.contact.heard_since(at) {
                    tracing::info!(
                        leader,
                        term,
                        "the line to the leader broke but it is still heard; not campaigning"
                    );
                } else {
                    tracing::warn!(
                        leader,
                        term,
                        "the leader's line broke and it has been silent for its whole lease; campaigning now"
                    );
                    self.ctx.history.event(
                        "election",
                        &format!("controller {}", self.ctx.node_id),
                        format!(
                            "campaigned {} ms after the line to leader {leader} (term {term}) broke: silent for its whole lease",
                            at.elapsed().as_millis()
                        ),
                    );
                    if let Err(e) = self.ctx.raft.trigger().elect().await {
                        tracing::warn!(error = %e, "could not start an election");
                    }
                }
                return Duration::from_millis(50);
            }
        }
        match &mut self.line {
            Some(line) if (line.leader, line.term) == (leader, term) => {
                match tokio::time::timeout(WAIT, line.replies.message()).await {
                    Err(_) | Ok(Ok(Some(_))) => Duration::ZERO,
                    Ok(end) => {
                        tracing::info!(leader, term, end = ?end.err(), "the line to the leader broke");
                        self.line = None;
                        self.broken = Some((leader, term, Instant::now()));
                        Duration::ZERO
                    }
                }
            }
            _ => {
                self.line = None;
                let Some((_, addr)) = self.ctx.leader() else {
                    return Duration::from_millis(100);
                };
                match self.open(leader, &addr).await {
                    Ok(replies) => {
                        self.line = Some(Line { leader, term, replies });
                        Duration::ZERO
                    }
                    Err(why) => {
                        tracing::debug!(leader, %why, "no line to the leader yet");
                        Duration::from_millis(200)
                    }
                }
            }
        }
    }

    fn detail(&self) -> String {
        match (&self.line, &self.broken) {
            (_, Some((leader, term, _))) => format!("leader {leader} (term {term}) lost"),
            (Some(l), None) => format!("line to leader {} (term {})", l.leader, l.term),
            (None, None) => String::new(),
        }
    }
}
