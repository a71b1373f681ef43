//! Proposal batching: concurrent writes become one Raft entry.
//!
//! openraft 0.9 runs its engine commands after every client write and waits for the log append
//! to be flushed before it takes the next one, so one `client_write` per request costs one fsync
//! per request on the leader. The proposer collects every write queued while the previous
//! proposals are in flight and proposes them as a single [`Command::Batch`] entry: one fsync
//! (and one replication round) then covers the whole batch. Under light load a batch is a single
//! command and nothing waits for company.

use std::sync::Arc;

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;

use crate::command::{Command, CommandEnvelope, CommandResponse};
use crate::raft_types::{NodeId, Raft};
use openraft::error::{ClientWriteError, RaftError};

/// Most commands folded into one entry.
pub const MAX_BATCH: usize = 1024;
/// Most payload bytes folded into one entry, so that one entry alone fits an AppendEntries
/// well under `network::TARGET_APPEND_BYTES`, even JSON-escaped.
pub const MAX_BATCH_BYTES: usize = 256 * 1024;
/// Batches proposed concurrently; more let the leader's append overlap with replication.
const MAX_IN_FLIGHT: usize = 4;
/// Queue depth of pending writes before callers wait.
const QUEUE: usize = 16 * 1024;

/// The error a write gets back: openraft's, shared by every command of a failed batch.
pub type ProposeError = RaftError<NodeId, ClientWriteError<NodeId, crate::node::ControllerNode>>;

/// Result of one proposed command: the log index of its entry and its response.
pub type ProposeResult = Result<(u64, CommandResponse), ProposeError>;

struct Pending {
    command: Command,
    reply: oneshot::Sender<ProposeResult>,
    queued: Instant,
}

/// Handle to the batching task; cheap to clone.
#[derive(Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
    timings: Timings,
}

/// Where a proposal's time goes, for `/metrics`.
#[derive(Clone)]
struct Timings {
    /// Per write: from its call to `propose` until its batch is proposed (all
    /// [`MAX_IN_FLIGHT`] slots busy, or the queue ahead of it).
    wait: Histogram,
    /// Per entry: `client_write` until committed and applied (the leader's append and fsync,
    /// a quorum's, and the apply).
    commit: Histogram,
}

impl Proposer {
    /// Starts the batching task for `raft`; its handle is the server's to watch (the task
    /// ends only when every proposer handle is gone).
    pub fn start(raft: Raft) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let timings = Timings {
            wait: laneway_store::latency_histogram(),
            commit: laneway_store::latency_histogram(),
        };
        let task = tokio::spawn(run(raft, rx, timings.clone()));
        (Proposer { tx, timings }, task)
    }

    /// Seconds each write waited before its batch was proposed
    /// (`laneway_raft_proposal_wait_seconds`).
    pub fn wait_seconds(&self) -> Histogram {
        self.timings.wait.clone()
    }

    /// Seconds each proposed entry took to commit and apply (`laneway_raft_commit_seconds`).
    pub fn commit_seconds(&self) -> Histogram {
        self.timings.commit.clone()
    }

    /// Proposes one (already validated) command and waits until it is committed and applied.
    pub async fn propose(&self, command: Command) -> ProposeResult {
        let (reply, rx) = oneshot::channel();
        let pending = Pending {
            command,
            reply,
            queued: Instant::now(),
        };
        if self.tx.send(pending).await.is_err() {
            return Err(RaftError::Fatal(openraft::error::Fatal::Stopped));
        }
        rx.await
            .unwrap_or(Err(RaftError::Fatal(openraft::error::Fatal::Stopped)))
    }
}

async fn run(raft: Raft, mut rx: mpsc::Receiver<Pending>, timings: Timings) {
    let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    loop {
        // Wait for a free slot first, so writes keep accumulating while all slots are busy.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else { return };
        let batch = with_queued(&mut rx, first, MAX_BATCH, MAX_BATCH_BYTES, |p| {
            p.command.payload_bytes()
        });
        let now = Instant::now();
        for p in &batch {
            timings.wait.observe(now.duration_since(p.queued).as_secs_f64());
        }
        let raft = raft.clone();
        let commit = timings.commit.clone();
        tokio::spawn(async move {
            propose_batch(&raft, batch).await;
            commit.observe(now.elapsed().as_secs_f64());
            drop(permit);
        });
    }
}

/// `first` and whatever else is queued already, up to `max` items or until `max_bytes` (as
/// `size` counts them) is reached: what one batch takes.
pub(crate) fn with_queued<T>(
    rx: &mut mpsc::Receiver<T>,
    first: T,
    max: usize,
    max_bytes: usize,
    size: impl Fn(&T) -> usize,
) -> Vec<T> {
    let mut bytes = size(&first);
    let mut batch = vec![first];
    while batch.len() < max && bytes < max_bytes {
        match rx.try_recv() {
            Ok(item) => {
                bytes += size(&item);
                batch.push(item);
            }
            Err(_) => break,
        }
    }
    batch
}

async fn propose_batch(raft: &Raft, mut batch: Vec<Pending>) {
    if batch.len() == 1 {
        let p = batch.pop().expect("one pending write");
        let res = raft
            .client_write(CommandEnvelope::new(p.command))
            .await
            .map(|r| (r.log_id.index, r.data));
        let _ = p.reply.send(res);
        return;
    }
    let (commands, replies): (Vec<Command>, Vec<_>) = batch.into_iter().map(|p| (p.command, p.reply)).unzip();
    match raft.client_write(CommandEnvelope::new(Command::Batch(commands))).await {
        Ok(resp) => {
            let index = resp.log_id.index;
            let mut results = resp.data.batch.into_iter();
            for reply in replies {
                let r = results.next().unwrap_or_default();
                let _ = reply.send(Ok((index, r)));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
