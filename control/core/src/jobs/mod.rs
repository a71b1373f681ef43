//! The durable lane's job queue: replicated state and its transitions.
//!
//! Every transition is a Raft command applied here, deterministically, from the command and the
//! log index it was committed at: a job is acknowledged to its client only after its submission
//! is committed, the tenant's ceiling is counted here (so it holds across every router and every
//! failover), and an assignment's **fencing token is the log index of the assignment**. A
//! completion is accepted only with the job's current token, so an executor that lost its
//! assignment (its node was declared down, the job was cancelled or reassigned) can never
//! publish a result.
//!
//! Lifecycle: `Queued → Assigned → Running → Succeeded | Failed | Cancelled`; a failed attempt,
//! or a node declared down, puts the job back to `Queued` until it has used `max_attempts`.

pub mod dispatch;
mod table;

pub use table::JobTable;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::refused::Refused;
use serde::{Deserialize, Serialize};

/// Largest input carried in the job itself; larger inputs go by URI.
pub const MAX_INLINE_INPUT_BYTES: usize = 64 * 1024;
/// Attempts a job gets when the submission does not say.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Most attempts a submission may ask for.
pub const MAX_ATTEMPTS_LIMIT: u32 = 10;
/// How long finished jobs stay queryable when the `jobs.retention_s` setting is absent.
pub const DEFAULT_RETENTION_MS: u64 = 24 * 3600 * 1000;
/// Longest idempotency key accepted, bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    Assigned,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Assigned,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }

    /// On a replica (assigned or running).
    pub fn is_placed(self) -> bool {
        matches!(self, JobState::Assigned | JobState::Running)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Assigned => "assigned",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The published result of a job: the object the accepted executor wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobResult {
    /// Object key in the results store (includes the job id and the token).
    pub key: String,
    pub bytes: u64,
    /// GPU time the replica reported for the job, microseconds.
    pub gpu_us: u64,
    pub content_type: String,
}

/// One durable job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: String,
    /// Log index of the submission: FIFO order within a tenant.
    pub seq: u64,
    pub tenant: String,
    pub model: String,
    pub class: String,
    /// Inline input (a JSON document); dropped once the job is finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// Input by reference, for inputs over [`MAX_INLINE_INPUT_BYTES`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// sha256 (hex) of the submitted body: a reused idempotency key must carry the same body.
    pub body_sha256: String,
    pub state: JobState,
    /// Fencing token of the current assignment (its log index); `None` when not placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<u64>,
    /// Highest token ever issued for this job: a new assignment's token must exceed it.
    #[serde(default)]
    pub last_token: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// Assignments so far.
    pub attempts: u32,
    pub max_attempts: u32,
    /// Why each failed attempt failed, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<String>,
    pub submitted_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assigned_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<JobResult>,
}

/// A submission as the router proposes it (validated before it is proposed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSubmission {
    pub id: String,
    pub tenant: String,
    pub model: String,
    pub class: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub body_sha256: String,
    pub max_attempts: u32,
    /// Wall clock of the proposing controller, ms since the epoch.
    pub at_ms: u64,
}

impl JobSubmission {
    /// Checks what the router cannot have checked wrongly but a hand-made call could.
    pub fn validate(&self) -> Result<(), Refused> {
        if self.id.is_empty() || self.id.len() > 64 || !self.id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(format!("job id {:?} must be 1-64 of a-z, 0-9, '-'", self.id).into());
        }
        match (&self.input, &self.input_uri) {
            (Some(_), Some(_)) => return Err("give the input inline or by URI, not both".into()),
            (None, None) => return Err("a job needs an input (inline JSON or input_uri)".into()),
            (Some(i), None) if i.len() > MAX_INLINE_INPUT_BYTES => {
                return Err(format!(
                    "inline input is {} bytes, over {MAX_INLINE_INPUT_BYTES}; upload it and submit its URI",
                    i.len()
                )
                .into())
            }
            _ => {}
        }
        if let Some(k) = &self.idempotency_key {
            if k.is_empty() || k.len() > MAX_IDEMPOTENCY_KEY_BYTES {
                return Err(format!("idempotency key must be 1-{MAX_IDEMPOTENCY_KEY_BYTES} bytes").into());
            }
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS_LIMIT {
            return Err(format!("max_attempts must be 1-{MAX_ATTEMPTS_LIMIT}").into());
        }
        Ok(())
    }
}

/// How an executor says an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Completion {
    Succeeded(JobResult),
    Failed {
        reason: String,
        /// False when another attempt cannot help (the model refused the input).
        retryable: bool,
    },
}

/// What a job command did, for the caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobOutcome {
    /// A new job was queued.
    Created { id: String },
    /// The idempotency key named an existing job with the same body: that job.
    Existing { id: String },
    /// The tenant's ceiling on the lane is reached (queued + placed jobs).
    OverCeiling { active: u32, limit: u32 },
    /// The idempotency key names a job submitted with a different body.
    KeyConflict { id: String },
    /// Cancelled; the state it was in.
    Cancelled { from: JobState },
    /// Nothing to do: the job had already finished in this state.
    AlreadyFinished { state: JobState },
}

/// Every job, with indexes derived from them (rebuilt at load, never replicated).
///
/// The jobs are in a [`JobTable`] (hash maps that grow a shard at a time, ADR 0038): nothing
/// reads them in id order, and what needs an order has its own index (`by_tenant`, `queues`,
/// `finished`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Jobs {
    pub jobs: JobTable,
    /// (tenant, idempotency key) → job id.
    #[serde(skip)]
    by_key: HashMap<(String, String), String>,
    /// tenant → class → jobs queued or placed.
    #[serde(skip)]
    active: HashMap<String, HashMap<String, u32>>,
    /// class → jobs in each [`JobState`] (indexed as [`JobState::ALL`]): what the metrics and
    /// the status page show, without walking every job under the state lock.
    #[serde(skip)]
    counts: HashMap<String, [u64; 6]>,
    /// Finished jobs by `(finished_ms, id)`: retention finds what is due without a scan.
    #[serde(skip)]
    finished: BTreeSet<(u64, String)>,
    /// Queued jobs per model and tenant, oldest first: the dispatcher takes the heads, the
    /// router's drain estimate counts them, without walking every job.
    #[serde(skip)]
    queues: HashMap<String, BTreeMap<String, BTreeSet<(u64, String)>>>,
    /// Placed jobs per node (every heartbeat reply lists its node's).
    #[serde(skip)]
    placed: HashMap<String, BTreeSet<String>>,
    /// Every job of a tenant, by `(seq, id)`: a tenant's list reads its own jobs, never a
    /// scan of every tenant's under the state lock.
    #[serde(skip)]
    by_tenant: HashMap<String, BTreeSet<(u64, String)>>,
    /// Job ids changed since the state machine last persisted them, with their `seq` (the
    /// persisted key of a job is `(seq, id)`, so a removed job's row can still be found).
    #[serde(skip)]
    dirty: HashMap<String, u64>,
    /// Bumped on every change, so a caller can tell whether a run of commands changed a job.
    #[serde(skip)]
    changes: u64,
    /// Nodes whose placed jobs changed since the last [`Jobs::take_touched_nodes`]: only
    /// their heartbeat streams have a new job reply to send.
    #[serde(skip)]
    touched_nodes: BTreeSet<String>,
}

impl PartialEq for Jobs {
    fn eq(&self, other: &Self) -> bool {
        self.jobs == other.jobs
    }
}

impl Eq for Jobs {}

impl Jobs {
    /// Rebuilds the derived indexes from the jobs (after a load or a snapshot install).
    pub fn rebuild_index(&mut self) {
        self.by_key.clear();
        self.active.clear();
        self.counts.clear();
        self.finished.clear();
        self.queues.clear();
        self.placed.clear();
        self.by_tenant.clear();
        let ids: Vec<String> = self.jobs.keys().cloned().collect();
        for id in ids {
            let j = &self.jobs[id.as_str()];
            if let Some(k) = &j.idempotency_key {
                self.by_key.insert((j.tenant.clone(), k.clone()), id.clone());
            }
            self.by_tenant
                .entry(j.tenant.clone())
                .or_default()
                .insert((j.seq, id.clone()));
            self.index(&id, true);
        }
    }

    /// Adds (`add`) or removes a job's part in the derived counts, from its current state.
    /// Every transition is `index(id, false)`, the change, `index(id, true)`.
    ///
    /// Runs on every apply: a map entry is created (its key allocated) only when it is new.
    fn index(&mut self, id: &str, add: bool) {
        let Some(j) = self.jobs.get(id) else { return };
        let delta: i32 = if add { 1 } else { -1 };
        count(&mut self.counts, &j.class, j.state, delta);
        if j.state.is_terminal() {
            if let Some(at) = j.finished_ms {
                if add {
                    self.finished.insert((at, id.to_string()));
                } else {
                    self.finished.remove(&(at, id.to_string()));
                }
            }
            return;
        }
        let classes = match self.active.get_mut(&j.tenant) {
            Some(c) => c,
            None => self.active.entry(j.tenant.clone()).or_default(),
        };
        let e = match classes.get_mut(&j.class) {
            Some(e) => e,
            None => classes.entry(j.class.clone()).or_default(),
        };
        *e = e.saturating_add_signed(delta);
        if *e == 0 {
            classes.remove(&j.class);
            if classes.is_empty() {
                self.active.remove(&j.tenant);
            }
        }
        if j.state == JobState::Queued {
            let tenants = match self.queues.get_mut(&j.model) {
                Some(t) => t,
                None => self.queues.entry(j.model.clone()).or_default(),
            };
            let q = match tenants.get_mut(&j.tenant) {
                Some(q) => q,
                None => tenants.entry(j.tenant.clone()).or_default(),
            };
            if add {
                q.insert((j.seq, id.to_string()));
            } else {
                q.remove(&(j.seq, id.to_string()));
                if q.is_empty() {
                    tenants.remove(&j.tenant);
                    if tenants.is_empty() {
                        self.queues.remove(&j.model);
                    }
                }
            }
        }
        if let (true, Some(node)) = (j.state.is_placed(), j.node.as_deref()) {
            if !self.touched_nodes.contains(node) {
                self.touched_nodes.insert(node.to_string());
            }
            let set = match self.placed.get_mut(node) {
                Some(set) => set,
                None => self.placed.entry(node.to_string()).or_default(),
            };
            if add {
                set.insert(id.to_string());
            } else {
                set.remove(id);
                if set.is_empty() {
                    self.placed.remove(node);
                }
            }
        }
    }

    /// Jobs per class in each state, every state listed (zeros included), in
    /// [`JobState::ALL`] order.
    pub fn counts_by_class(&self) -> impl Iterator<Item = (&str, [(JobState, u64); 6])> {
        self.counts
            .iter()
            .map(|(class, n)| (class.as_str(), JobState::ALL.map(|s| (s, n[s as usize]))))
    }

    /// Whether a job finished before `before_ms` (retention would compact it).
    pub fn any_finished_before(&self, before_ms: u64) -> bool {
        self.finished.first().is_some_and(|(at, _)| *at < before_ms)
    }

    /// Queued jobs of `model`.
    pub fn queued(&self, model: &str) -> usize {
        self.queues
            .get(model)
            .map_or(0, |t| t.values().map(BTreeSet::len).sum())
    }

    /// The queue of `model`: per tenant, its queued jobs' (submission index, id), oldest first.
    pub fn queue(&self, model: &str) -> Option<&BTreeMap<String, BTreeSet<(u64, String)>>> {
        self.queues.get(model)
    }

    /// Every placed job (assigned or running), node by node.
    pub fn placed(&self) -> impl Iterator<Item = &Job> {
        self.placed.values().flatten().filter_map(|id| self.jobs.get(id))
    }

    /// Per model: jobs placed (in flight) and queued (waiting), for the fast loop.
    pub fn load_by_model(&self) -> HashMap<String, (u32, u32)> {
        let mut load: HashMap<String, (u32, u32)> = HashMap::new();
        for j in self.placed() {
            load.entry(j.model.clone()).or_default().0 += 1;
        }
        for model in self.queues.keys() {
            load.entry(model.clone()).or_default().1 = self.queued(model) as u32;
        }
        load
    }

    /// `tenant`'s jobs, newest first.
    pub fn of_tenant<'a>(&'a self, tenant: &str) -> impl Iterator<Item = &'a Job> + 'a {
        self.by_tenant
            .get(tenant)
            .into_iter()
            .flat_map(|set| set.iter().rev())
            .filter_map(|(_, id)| self.jobs.get(id))
    }

    /// Jobs assigned to or running on `node`.
    pub fn placed_on(&self, node: &str) -> impl Iterator<Item = &Job> {
        self.placed
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.jobs.get(id))
    }

    /// Inserts a stored job (load from the state database).
    pub fn load(&mut self, job: Job) {
        self.jobs.insert(job.id.clone(), job);
    }

    /// Jobs changed since the last call, as `(seq, id)` (their stored key) in key order, so the
    /// write-behind flush writes its rows in the order they are stored.
    pub fn take_dirty(&mut self) -> Vec<(u64, String)> {
        let mut dirty: Vec<(u64, String)> = self.dirty.drain().map(|(id, seq)| (seq, id)).collect();
        dirty.sort_unstable();
        dirty
    }

    /// Nodes whose placed jobs (assigned or running) changed since the last call.
    pub fn take_touched_nodes(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.touched_nodes)
    }

    pub fn get(&self, id: &str) -> Option<&Job> {
        self.jobs.get(id)
    }

    /// Jobs queued or placed for `tenant` on `class`.
    pub fn active(&self, tenant: &str, class: &str) -> u32 {
        self.active
            .get(tenant)
            .and_then(|classes| classes.get(class))
            .copied()
            .unwrap_or(0)
    }

    fn touch(&mut self, id: &str) {
        if let Some(seq) = self.jobs.get(id).map(|j| j.seq) {
            self.touch_seq(id, seq);
        }
    }

    fn touch_seq(&mut self, id: &str, seq: u64) {
        self.changes += 1;
        if !self.dirty.contains_key(id) {
            self.dirty.insert(id.to_string(), seq);
        }
    }

    /// Count of changes so far (not replicated; only differences between two reads mean much).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Queues a submission unless its idempotency key or the tenant's ceiling says otherwise.
    pub fn submit(&mut self, s: &JobSubmission, ceiling: Option<u32>, index: u64) -> Result<JobOutcome, Refused> {
        s.validate()?;
        if let Some(j) = self.jobs.get(&s.id) {
            // The router draws a job's id before it proposes the submission, so the same
            // submission proposed again (the router's retry after a leader change left it
            // unsure whether the first commit landed) finds its own job: that is the job it
            // created, not a conflict — and not an idempotent replay either, so this comes
            // before the key.
            if j.tenant == s.tenant
                && j.model == s.model
                && j.body_sha256 == s.body_sha256
                && j.idempotency_key == s.idempotency_key
            {
                return Ok(JobOutcome::Created { id: j.id.clone() });
            }
            return Err(Refused::Conflict(format!("job id {} is already taken", s.id)));
        }
        if let Some(k) = &s.idempotency_key {
            if let Some(id) = self.by_key.get(&(s.tenant.clone(), k.clone())) {
                let same = self.jobs.get(id).is_some_and(|j| j.body_sha256 == s.body_sha256);
                return Ok(if same {
                    JobOutcome::Existing { id: id.clone() }
                } else {
                    JobOutcome::KeyConflict { id: id.clone() }
                });
            }
        }
        if let Some(limit) = ceiling {
            let active = self.active(&s.tenant, &s.class);
            if active >= limit {
                return Ok(JobOutcome::OverCeiling { active, limit });
            }
        }
        let job = Job {
            id: s.id.clone(),
            seq: index,
            tenant: s.tenant.clone(),
            model: s.model.clone(),
            class: s.class.clone(),
            input: s.input.clone(),
            input_uri: s.input_uri.clone(),
            idempotency_key: s.idempotency_key.clone(),
            body_sha256: s.body_sha256.clone(),
            state: JobState::Queued,
            token: None,
            last_token: 0,
            node: None,
            replica: None,
            attempts: 0,
            max_attempts: s.max_attempts,
            failures: Vec::new(),
            submitted_ms: s.at_ms,
            assigned_ms: None,
            started_ms: None,
            finished_ms: None,
            result: None,
        };
        if let Some(k) = &s.idempotency_key {
            self.by_key.insert((s.tenant.clone(), k.clone()), s.id.clone());
        }
        let of_tenant = match self.by_tenant.get_mut(&s.tenant) {
            Some(set) => set,
            None => self.by_tenant.entry(s.tenant.clone()).or_default(),
        };
        of_tenant.insert((job.seq, s.id.clone()));
        self.jobs.insert(s.id.clone(), job);
        self.index(&s.id, true);
        self.touch(&s.id);
        Ok(JobOutcome::Created { id: s.id.clone() })
    }

    /// Assigns a queued job to a replica; the token is `index`.
    pub fn assign(&mut self, id: &str, node: &str, replica: &str, index: u64, at_ms: u64) -> Result<(), Refused> {
        let job = self
            .jobs
            .get(id)
            .ok_or_else(|| Refused::NotFound(format!("no job {id}")))?;
        if job.state != JobState::Queued {
            return Err(Refused::Conflict(format!("job {id} is {}, not queued", job.state)));
        }
        if index <= job.last_token {
            return Err(format!("job {id}: token {index} is not above its last token {}", job.last_token).into());
        }
        self.index(id, false);
        let job = self.jobs.get_mut(id).expect("checked above");
        job.state = JobState::Assigned;
        job.token = Some(index);
        job.last_token = index;
        job.node = Some(node.to_string());
        job.replica = Some(replica.to_string());
        job.attempts += 1;
        job.assigned_ms = Some(at_ms);
        job.started_ms = None;
        self.index(id, true);
        self.touch(id);
        Ok(())
    }

    fn current<'a>(jobs: &'a mut JobTable, id: &str, token: u64) -> Result<&'a mut Job, Refused> {
        let job = jobs
            .get_mut(id)
            .ok_or_else(|| Refused::NotFound(format!("no job {id}")))?;
        if job.token != Some(token) {
            return Err(Refused::Conflict(format!(
                "stale token {token} for job {id} (current: {}); this executor no longer owns it",
                job.token.map_or_else(|| "none".to_string(), |t| t.to_string())
            )));
        }
        Ok(job)
    }

    /// The executor holding `token` started the job.
    pub fn started(&mut self, id: &str, token: u64, at_ms: u64) -> Result<(), Refused> {
        let job = Self::current(&mut self.jobs, id, token)?;
        if job.state == JobState::Assigned {
            job.state = JobState::Running;
            job.started_ms = Some(at_ms);
            // Placed before and after: only the per-state count moves (not through `index`,
            // which would mark the node's job list changed and send it an unchanged reply).
            count(&mut self.counts, &job.class, JobState::Assigned, -1);
            count(&mut self.counts, &job.class, JobState::Running, 1);
            self.touch(id);
        }
        Ok(())
    }

    /// The executor holding `token` finished an attempt.
    pub fn finish(&mut self, id: &str, token: u64, completion: &Completion, at_ms: u64) -> Result<(), Refused> {
        Self::current(&mut self.jobs, id, token)?;
        self.index(id, false);
        let job = self.jobs.get_mut(id).expect("checked above");
        match completion {
            Completion::Succeeded(result) => {
                // The result is where this attempt was told to write it, nowhere else (another
                // tenant's result, say), and its metered GPU time fits the attempt.
                let expected = result_key(id, token);
                if result.key != expected {
                    return Err(format!(
                        "job {id}: a result at {:?} is refused; this attempt's result is {expected}",
                        crate::text::clip(&result.key, 128)
                    )
                    .into());
                }
                if !valid_content_type(&result.content_type) {
                    return Err(format!(
                        "job {id}: content type {:?} is refused; give a media type such as application/json",
                        crate::text::clip(&result.content_type, 128)
                    )
                    .into());
                }
                let mut result = result.clone();
                let since = job.assigned_ms.unwrap_or(at_ms);
                result.gpu_us = result.gpu_us.min(max_gpu_us(since, at_ms));
                job.result = Some(result);
                Self::end(job, JobState::Succeeded, at_ms);
            }
            Completion::Failed { reason, retryable } => {
                job.failures.push(format!("attempt {}: {reason}", job.attempts));
                if *retryable && job.attempts < job.max_attempts {
                    Self::requeue(job);
                } else {
                    Self::end(job, JobState::Failed, at_ms);
                }
            }
        }
        self.index(id, true);
        self.touch(id);
        Ok(())
    }

    fn requeue(job: &mut Job) {
        job.state = JobState::Queued;
        job.token = None;
        job.node = None;
        job.replica = None;
        job.assigned_ms = None;
        job.started_ms = None;
    }

    fn end(job: &mut Job, state: JobState, at_ms: u64) {
        job.state = state;
        job.token = None;
        job.finished_ms = Some(at_ms);
        job.input = None;
    }

    /// Cancels a job in any state; a finished job is left as it is.
    pub fn cancel(&mut self, id: &str, at_ms: u64) -> Result<JobOutcome, Refused> {
        let job = self
            .jobs
            .get_mut(id)
            .ok_or_else(|| Refused::NotFound(format!("no job {id}")))?;
        if job.state.is_terminal() {
            return Ok(JobOutcome::AlreadyFinished { state: job.state });
        }
        let from = job.state;
        self.index(id, false);
        let job = self.jobs.get_mut(id).expect("found above");
        Self::end(job, JobState::Cancelled, at_ms);
        self.index(id, true);
        self.touch(id);
        Ok(JobOutcome::Cancelled { from })
    }

    /// A node was declared down or got a preemption notice: its jobs lose their tokens and go
    /// back to the queue (or end Failed when they have used their attempts), `reason` recorded.
    pub fn requeue_node(&mut self, node: &str, reason: &str, at_ms: u64) -> usize {
        let ids: Vec<String> = self.placed_on(node).map(|j| j.id.clone()).collect();
        for id in &ids {
            let job = self.jobs.get_mut(id).expect("listed above");
            let token = job.token.expect("placed jobs hold a token");
            // Through `finish`, so the attempt accounting is the same as any failure's.
            let _ = self.finish(
                id,
                token,
                &Completion::Failed {
                    reason: reason.to_string(),
                    retryable: true,
                },
                at_ms,
            );
        }
        ids.len()
    }

    /// Drops finished jobs that finished before `before_ms`; returns how many.
    pub fn compact(&mut self, before_ms: u64) -> usize {
        let old: Vec<String> = self
            .finished
            .range(..(before_ms, String::new()))
            .map(|(_, id)| id.clone())
            .collect();
        for id in &old {
            self.index(id, false);
            if let Some(j) = self.jobs.remove(id) {
                self.touch_seq(id, j.seq);
                if let Some(set) = self.by_tenant.get_mut(&j.tenant) {
                    set.remove(&(j.seq, id.clone()));
                    if set.is_empty() {
                        self.by_tenant.remove(&j.tenant);
                    }
                }
                if let Some(k) = j.idempotency_key {
                    self.by_key.remove(&(j.tenant, k));
                }
            }
        }
        old.len()
    }

    /// The derived indexes, to compare incremental upkeep with a rebuild.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    fn derived(
        &self,
    ) -> (
        Vec<((String, String), u32)>,
        Vec<(String, BTreeMap<String, BTreeSet<(u64, String)>>)>,
        Vec<(String, BTreeSet<String>)>,
        Vec<((String, String), String)>,
        Vec<(String, BTreeSet<(u64, String)>)>,
        Vec<(String, [u64; 6])>,
        BTreeSet<(u64, String)>,
    ) {
        fn sorted<K: Ord + Clone, V: Clone>(m: &HashMap<K, V>) -> Vec<(K, V)> {
            let mut v: Vec<(K, V)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        }
        let mut active: Vec<((String, String), u32)> = self
            .active
            .iter()
            .flat_map(|(t, classes)| classes.iter().map(move |(c, n)| ((t.clone(), c.clone()), *n)))
            .collect();
        active.sort();
        (
            active,
            sorted(&self.queues),
            sorted(&self.placed),
            sorted(&self.by_key),
            sorted(&self.by_tenant),
            sorted(&self.counts),
            self.finished.clone(),
        )
    }
}

/// Moves `class`'s count of jobs in `state` by `delta`; a class with no jobs left is dropped.
fn count(counts: &mut HashMap<String, [u64; 6]>, class: &str, state: JobState, delta: i32) {
    let by_state = match counts.get_mut(class) {
        Some(c) => c,
        None => counts.entry(class.to_string()).or_default(),
    };
    let n = &mut by_state[state as usize];
    *n = n.saturating_add_signed(delta.into());
    if by_state.iter().all(|&n| n == 0) {
        counts.remove(class);
    }
}

/// Most GPUs one attempt may be metered for: the most one host holds. The GPU time an agent
/// reports is capped at this many GPUs busy for the whole attempt, so a compromised agent
/// cannot bill a tenant for more than its hardware could have done.
pub const MAX_GPUS_PER_ATTEMPT: u64 = 16;

/// How long a job attempt may run when its class sets no `request_timeout_ms`: the agent stops
/// it then. Also the attempt length GPU time is capped at when the leaders' stamps cannot
/// measure the attempt (see [`max_gpu_us`]).
pub const DEFAULT_ATTEMPT_TIMEOUT_MS: u64 = 600_000;

/// A finish stamped this much or more before its assignment means a wall clock was stepped
/// back between the two (or forward at the assignment), not the few milliseconds two
/// controllers' clocks differ by across a failover.
pub const CLOCK_STEP_MS: u64 = 1_000;

/// The most GPU time (µs) an attempt assigned at `since_ms` and finished at `at_ms` can have used.
/// Both stamps are wall-clock reads of whichever controller led. Within clock skew, a finish
/// stamped before its assignment measures nothing (0). A clock stepped back between them
/// leaves no measure of the attempt, and a cap of zero would bill real work as nothing (a
/// clock-jump chaos run found 7 jobs billed 0): then the cap is the longest attempt the
/// default timeout allows. An agent cannot step a controller's clock, so it cannot choose that
/// cap.
fn max_gpu_us(since_ms: u64, at_ms: u64) -> u64 {
    let attempt_ms = if at_ms >= since_ms {
        at_ms - since_ms
    } else if since_ms - at_ms < CLOCK_STEP_MS {
        0
    } else {
        DEFAULT_ATTEMPT_TIMEOUT_MS
    };
    attempt_ms.saturating_mul(1000).saturating_mul(MAX_GPUS_PER_ATTEMPT)
}

/// A media type (`type/subtype`, optional parameters) short and plain enough to send back as
/// a header.
fn valid_content_type(ct: &str) -> bool {
    let essence = ct.split(';').next().unwrap_or_default().trim();
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
    };
    ct.len() <= 128
        && ct.bytes().all(|b| (0x20..0x7f).contains(&b))
        && essence.split_once('/').is_some_and(|(t, s)| token(t) && token(s))
}

/// One assignment the dispatcher proposes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Assignment {
    pub job_id: String,
    pub node_id: String,
    pub replica_id: String,
}

/// A job write a router may make.
/// A job write a router sends to the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobWrite {
    Submit(JobSubmission),
    Cancel { job_id: String, at_ms: u64 },
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

/// The key of the result an attempt writes.
pub fn result_key(job_id: &str, token: u64) -> String {
    format!("jobs/{job_id}/{token}")
}

#[cfg(test)]
mod tests;
