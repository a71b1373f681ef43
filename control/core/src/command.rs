//! The replicated command set: everything a controller proposes through Raft.
//!
//! Commands are wrapped in a [`CommandEnvelope`] that carries the command format version. A
//! controller refuses to apply a command whose format is newer than it understands rather than
//! guess, so a half-upgraded cluster stops visibly instead of diverging. New commands are added
//! as new enum variants (never by changing an existing variant's fields), and the format number
//! goes up when an older binary must not apply them.

use serde::{Deserialize, Serialize};

use crate::capacity::Tier;
use crate::fleet::{validate_node_id, NodeRegistration};
use crate::jobs::Assignment;
use crate::jobs::{Completion, JobOutcome, JobSubmission};
use crate::ledger::UsageReport;
use crate::refused::Refused;
use crate::registry::{Class, DesiredReplica, Model, ReplicaRecord, Tenant, TenantLimit};

/// Highest command format this binary can apply. Format 2 added the registry commands, format 3
/// the durable job queue, format 4 spot preemption notices, format 5 the ledger (prices and
/// usage reports), format 6 language-model lanes (token policies, specs, limits and usage), format 7 the slow
/// loop's node requests and capacity marks, format 8 join tokens, format 9 model versions and rollouts, format 10 operator-approved static replicas and job input locations, format 11 tensor metadata and binary tensors, format 12 runtime presets, files, named ports and start/stop settings, format 13 no new command but snapshots of the state's rows (a member below it cannot install one; see `laneway_store::snapshot_file`); a command is written with the lowest format that can express it
/// ([`Command::format`]), so an older controller keeps applying what it knows and stops only
/// at the first command it cannot understand.
pub const COMMAND_FORMAT: u32 = 13;

/// The cluster setting holding the highest command format every member can apply, written at
/// `cluster init` and raised by `lanectl cluster finalize-upgrade` once every member runs a
/// binary that knows it. Commands of a format above it are refused before they are proposed,
/// so a controller left on an older binary during a rolling upgrade never meets one.
pub const FORMAT_SETTING: &str = "cluster.command_format";
/// Settings under this prefix belong to the cluster, not the operator: never deleted, and the
/// command format is never lowered (checked by the admin API and again in apply).
pub const CLUSTER_SETTINGS: &str = "cluster.";
/// Formats up to this one predate the gate: always allowed (a cluster without the setting was
/// created before it).
pub const UNGATED_FORMAT: u32 = 4;

/// The highest command format the cluster may propose.
pub fn allowed_format(setting: Option<&str>) -> u32 {
    setting
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(UNGATED_FORMAT)
        .max(UNGATED_FORMAT)
}

/// Refuses a command the cluster's members cannot all apply yet. `format_setting` is the
/// applied value of [`FORMAT_SETTING`].
pub fn check_allowed(format_setting: Option<&str>, command: &Command) -> Result<(), Refused> {
    let allowed = allowed_format(format_setting);
    let needs = command.format();
    if needs <= allowed {
        return Ok(());
    }
    Err(Refused::Conflict(format!(
        "this needs command format {needs} but the cluster is finalized at {allowed}: some controller may still run an older binary. Upgrade every controller, then run `lanectl cluster finalize-upgrade`"
    )))
}

/// Longest setting key accepted, in bytes.
pub const MAX_SETTING_KEY_BYTES: usize = 256;
/// Largest setting value accepted, in bytes.
pub const MAX_SETTING_VALUE_BYTES: usize = 64 * 1024;

/// A command plus the format version it was written with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandEnvelope {
    pub format: u32,
    pub command: Command,
}

impl CommandEnvelope {
    /// Wraps `command` with the lowest format that can express it.
    pub fn new(command: Command) -> Self {
        Self {
            format: command.format(),
            command,
        }
    }
}

/// A state transition of the controllers' replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Set a cluster setting (a string key/value the operator owns).
    PutSetting {
        key: String,
        value: String,
    },
    /// Remove a cluster setting; removing an absent key is not an error.
    DeleteSetting {
        key: String,
    },
    /// Several commands committed as one log entry (group commit), applied in order. Never
    /// nested.
    Batch(Vec<Command>),
    /// An agent registers (or re-registers) its node and GPUs.
    RegisterNode(NodeRegistration),
    /// The leader's node monitor commits a liveness transition.
    SetNodeLiveness {
        node_id: String,
        up: bool,
    },
    /// Operator flags: cordon (no new replicas) and drain (move replicas off).
    SetNodeFlags {
        node_id: String,
        cordoned: Option<bool>,
        draining: Option<bool>,
    },
    /// Create or replace a class and its lane.
    PutClass(Class),
    /// Register a model (or a new version of it) under an existing class.
    PutModel(Model),
    RemoveModel {
        name: String,
    },
    /// Create a tenant; the key is generated by the controller that received the call and
    /// only its hash is replicated.
    CreateTenant(Tenant),
    /// Set (or, with `None`, remove) a tenant's limit on one class (`*` = every class).
    SetTenantLimit {
        tenant: String,
        class: String,
        limit: Option<TenantLimit>,
    },
    RotateTenantKey {
        tenant: String,
        key_sha256: String,
    },
    /// The leader commits a node's replicas when their routable facts change (state, port).
    SetNodeReplicas {
        node_id: String,
        replicas: Vec<ReplicaRecord>,
    },
    /// Whether the routers take the node's static replicas (from its own `[[replica]]`
    /// configuration, not placed by the scheduler): an operator's word, never an agent's.
    SetNodeStatic {
        node_id: String,
        allowed: bool,
    },
    /// The scheduler's placements on one node (the whole set).
    SetDesiredReplicas {
        node_id: String,
        replicas: Vec<DesiredReplica>,
    },
    /// The node monitor declares a node down: its liveness goes Down and, in the same entry,
    /// its jobs lose their fencing tokens and go back to the queue.
    NodeDown {
        node_id: String,
        at_ms: u64,
    },
    /// A spot node got its preemption notice: it is cordoned and drained and, in the same
    /// entry, its jobs lose their fencing tokens and go back to the queue — before the node
    /// dies, so they restart elsewhere at once instead of after the liveness timeout.
    PreemptNode {
        node_id: String,
        at_ms: u64,
    },
    /// A durable job, acknowledged to its client only once this is committed.
    SubmitJob(JobSubmission),
    /// The dispatcher's assignments; each job's fencing token is this entry's log index.
    AssignJobs {
        assignments: Vec<Assignment>,
        at_ms: u64,
    },
    /// The executor holding `token` started the job.
    JobStarted {
        job_id: String,
        token: u64,
        at_ms: u64,
    },
    /// The executor holding `token` finished an attempt (refused with any other token).
    FinishJob {
        job_id: String,
        token: u64,
        completion: Completion,
        at_ms: u64,
    },
    CancelJob {
        job_id: String,
        at_ms: u64,
    },
    /// Forget finished jobs that finished before `before_ms` (retention).
    CompactJobs {
        before_ms: u64,
    },
    /// Set (or, with `None`, remove) the price of a GPU product on a capacity tier,
    /// micro-dollars per GPU-hour. Applies to usage committed from then on.
    SetPrice {
        product: String,
        tier: Tier,
        micros_per_hour: Option<u64>,
    },
    /// A router's metered usage since its previous report (priced when applied).
    RecordUsage(UsageReport),
    /// The MIG layout of one GPU (mig-parted profile names; empty = the whole card). The
    /// scheduler moves whole-card replicas off a GPU being split, and its agent applies the
    /// layout once nothing runs on it.
    SetMigLayout {
        node_id: String,
        gpu: String,
        profiles: Vec<String>,
    },
    /// Taints of a pool (empty = none): only lanes tolerating all of them place replicas
    /// there.
    SetPoolTaints {
        pool: String,
        taints: Vec<String>,
    },
    /// The slow loop's record of a node it asked a provider for (created or replaced whole).
    PutNodeRequest(crate::capacity::NodeRequest),
    /// A node request is over: it failed, or its node was given back.
    RemoveNodeRequest {
        id: String,
    },
    /// A MIG capacity plan: the next version (refused otherwise), or the latest marked applied.
    PutMigPlan(crate::capacity::MigPlan),
    /// Set (or, with `None`, clear) the insufficient-capacity mark of `product@region`.
    SetCapacityMark {
        key: String,
        mark: Option<crate::capacity::CapacityMark>,
    },
    /// A new one-time join token (only its sha256 is replicated).
    CreateJoinToken {
        sha256: String,
        token: crate::registry::JoinToken,
    },
    /// Revoke a join or admin token.
    RevokeToken {
        sha256: String,
    },
    /// A new admin bearer token (only its sha256 is replicated).
    CreateAdminToken {
        sha256: String,
        token: crate::registry::AdminToken,
    },
    /// Refuse the certificate with this serial from now on.
    RevokeCertificate {
        serial: String,
        cert: crate::registry::RevokedCert,
    },
    /// A host joins as `node_id` with the token whose sha256 this is: refused unless the token
    /// is known, unused, unrevoked, unexpired at `at_ms` and (when bound) for this node, and
    /// the node id never joined before.
    ConsumeJoinToken {
        sha256: String,
        node_id: String,
        /// The sha256 of the public key the certificate is signed for (empty in entries
        /// written before it was recorded).
        #[serde(default)]
        key_sha256: String,
        at_ms: u64,
    },
    /// A version of a model (`lanectl model deploy`): the first of its name is an ordinary
    /// model, a later one the idle entry `name@version` (ADR 0015).
    DeployVersion(Model),
    /// Starts a canary rollout.
    StartRollout(crate::registry::rollout::Rollout),
    /// Moves a rollout on: a step the loop judged, or an operator's promote, abort, pause or
    /// resume. With `expect_step`, only if the rollout is still at that step.
    UpdateRollout {
        model: String,
        expect_step: Option<usize>,
        action: crate::registry::rollout::RolloutAction,
        at_ms: u64,
        message: String,
    },
}

/// What applying one log entry produced.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResponse {
    /// For settings commands: the value the key held before.
    pub previous: Option<String>,
    /// For a batch: one response per command, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch: Vec<CommandResponse>,
    /// Set when the state machine refused the command (state unchanged), with the reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
    /// What kind of refusal `rejected` is (absent from controllers older than kinds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_as: Option<crate::refused::RefusalKind>,
    /// For job submissions and cancels: what happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<JobOutcome>,
}

/// Why a command was refused before it was proposed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CommandError {
    #[error("setting key is empty: give a non-empty key such as `fleet.region`")]
    EmptyKey,
    #[error("setting key is {len} bytes; keys are at most {MAX_SETTING_KEY_BYTES} bytes")]
    KeyTooLong { len: usize },
    #[error("setting key {key:?} contains a control character; use printable characters")]
    KeyNotPrintable { key: String },
    #[error("setting value is {len} bytes; values are at most {MAX_SETTING_VALUE_BYTES} bytes")]
    ValueTooLarge { len: usize },
    #[error("a batch may not contain another batch")]
    NestedBatch,
    #[error("{0}")]
    InvalidNode(Refused),
    #[error("{0}")]
    Invalid(Refused),
}

impl CommandResponse {
    /// The refusal of this command, typed, if it was refused.
    pub fn refused(&self) -> Option<crate::refused::Refused> {
        let message = self.rejected.clone()?;
        Some(crate::refused::Refused::from_parts(self.rejected_as, message))
    }

    /// Every refusal in this response: its own, and each batched command's.
    pub fn refusals(&self) -> impl Iterator<Item = &String> {
        self.rejected
            .iter()
            .chain(self.batch.iter().filter_map(|b| b.rejected.as_ref()))
    }
}

impl Command {
    /// `commands` as one log entry: the command itself when there is one, else a batch.
    pub fn batch_of(mut commands: Vec<Command>) -> Command {
        if commands.len() == 1 {
            commands.pop().expect("one command")
        } else {
            Command::Batch(commands)
        }
    }

    /// The lowest command format that can express this command.
    pub fn format(&self) -> u32 {
        match self {
            Command::PutSetting { .. }
            | Command::DeleteSetting { .. }
            | Command::RegisterNode(_)
            | Command::SetNodeLiveness { .. }
            | Command::SetNodeFlags { .. } => 1,
            Command::Batch(commands) => commands.iter().map(Command::format).max().unwrap_or(1),
            // An older binary refuses a class with fields it does not know.
            Command::PutModel(m) | Command::DeployVersion(m)
                if m.runtime.uses_format_12() || m.weights.iter().any(|a| a.path.is_some()) =>
            {
                12
            }
            Command::PutModel(m) | Command::DeployVersion(m) if m.declares_v2_signature() => 11,
            Command::PutClass(c) if !c.input_prefixes.is_empty() => 10,
            Command::PutClass(c)
                if c.cache.is_some() || c.fallback_response.is_some() || c.overflow.is_some() || c.hedge.is_some() =>
            {
                9
            }
            Command::PutModel(m) if m.fallback.is_some() => 9,
            Command::PutClass(c) if c.time_slicing => 7,
            Command::PutClass(c) if c.llm.is_some() => 6,
            Command::PutModel(m)
                if m.llm.is_some()
                    || m.profiles.values().any(|p| p.tokens_per_s.is_some())
                    || m.runtime
                        .in_flight
                        .as_ref()
                        .is_some_and(|p| p.waiting.is_some() || p.kv_cache.is_some()) =>
            {
                6
            }
            Command::SetTenantLimit { limit: Some(l), .. } if l.tokens_per_min.is_some() => 6,
            // Requests over the objective are counted for rollouts (format 9).
            Command::RecordUsage(r) if r.rows.iter().any(|u| u.slow > 0 || u.overflow_nanos > 0) => 9,
            Command::RecordUsage(r) if r.rows.iter().any(|u| u.input_tokens > 0 || u.output_tokens > 0) => 6,
            Command::PutClass(c) if c.slo_p99_ms.is_some() || !c.tolerations.is_empty() => 5,
            Command::PutModel(m) if m.runtime.in_flight.is_some() => 5,
            Command::PutClass(_)
            | Command::PutModel(_)
            | Command::RemoveModel { .. }
            | Command::CreateTenant(_)
            | Command::SetTenantLimit { .. }
            | Command::RotateTenantKey { .. }
            | Command::SetNodeReplicas { .. }
            | Command::SetDesiredReplicas { .. } => 2,
            Command::SetNodeStatic { .. } => 10,
            Command::NodeDown { .. }
            | Command::SubmitJob(_)
            | Command::AssignJobs { .. }
            | Command::JobStarted { .. }
            | Command::FinishJob { .. }
            | Command::CancelJob { .. }
            | Command::CompactJobs { .. } => 3,
            Command::PreemptNode { .. } => 4,
            Command::PutNodeRequest(_)
            | Command::RemoveNodeRequest { .. }
            | Command::SetCapacityMark { .. }
            | Command::PutMigPlan(_) => 7,
            Command::CreateJoinToken { .. }
            | Command::RevokeToken { .. }
            | Command::ConsumeJoinToken { .. }
            | Command::CreateAdminToken { .. }
            | Command::RevokeCertificate { .. } => 8,
            Command::DeployVersion(_) | Command::StartRollout(_) | Command::UpdateRollout { .. } => 9,
            Command::SetPrice { .. }
            | Command::RecordUsage(_)
            | Command::SetMigLayout { .. }
            | Command::SetPoolTaints { .. } => 5,
        }
    }

    /// Bytes of user data the command carries (keys and values), for batch sizing.
    pub fn payload_bytes(&self) -> usize {
        match self {
            Command::PutSetting { key, value } => key.len() + value.len(),
            Command::DeleteSetting { key } => key.len(),
            Command::Batch(commands) => commands.iter().map(Command::payload_bytes).sum(),
            Command::RegisterNode(r) => {
                256 + r.node_id.len()
                    + r.hostname.len()
                    + r.pool.len()
                    + r.gpus
                        .iter()
                        .map(|g| 96 + g.uuid.len() + g.product.len())
                        .sum::<usize>()
                    + r.labels.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>()
            }
            Command::SetNodeLiveness { node_id, .. }
            | Command::SetNodeFlags { node_id, .. }
            | Command::SetNodeStatic { node_id, .. } => node_id.len() + 16,
            Command::PutClass(_) => 512,
            Command::PutModel(m) => serde_json::to_vec(m).map_or(4096, |b| b.len()),
            Command::CreateTenant(t) => 256 + t.limits.len() * 64,
            Command::RemoveModel { name } => name.len(),
            Command::SetTenantLimit { tenant, class, .. } => tenant.len() + class.len() + 32,
            Command::RotateTenantKey { tenant, key_sha256 } => tenant.len() + key_sha256.len(),
            Command::SetNodeReplicas { node_id, replicas } => {
                node_id.len()
                    + replicas
                        .iter()
                        .map(|r| 64 + r.id.len() + r.model.len() + r.device.len() + r.endpoint.len())
                        .sum::<usize>()
            }
            Command::SetDesiredReplicas { node_id, replicas } => {
                node_id.len()
                    + replicas
                        .iter()
                        .map(|r| 64 + r.id.len() + r.model.len() + r.gpu.len() + r.product.len())
                        .sum::<usize>()
            }
            Command::NodeDown { node_id, .. } | Command::PreemptNode { node_id, .. } => node_id.len() + 16,
            Command::SubmitJob(s) => {
                // JSON-escaped in the log: quotes in the input double.
                256 + s.input.as_ref().map_or(0, |i| i.len() * 5 / 4)
                    + s.input_uri.as_ref().map_or(0, String::len)
                    + s.idempotency_key.as_ref().map_or(0, String::len)
            }
            Command::AssignJobs { assignments, .. } => assignments
                .iter()
                .map(|a| 48 + a.job_id.len() + a.node_id.len() + a.replica_id.len())
                .sum(),
            Command::JobStarted { job_id, .. } | Command::CancelJob { job_id, .. } => job_id.len() + 32,
            Command::FinishJob { job_id, completion, .. } => {
                job_id.len()
                    + 64
                    + match completion {
                        Completion::Succeeded(r) => r.key.len() + r.content_type.len() + 32,
                        Completion::Failed { reason, .. } => reason.len(),
                    }
            }
            Command::CompactJobs { .. } => 16,
            Command::SetPrice { product, .. } => product.len() + 32,
            Command::RecordUsage(r) => r
                .rows
                .iter()
                .map(|u| 96 + u.class.len() + u.model.len() + u.version.len() + u.tenant.len())
                .sum(),
            Command::SetMigLayout { node_id, gpu, profiles } => {
                node_id.len() + gpu.len() + profiles.iter().map(|p| p.len() + 4).sum::<usize>()
            }
            Command::SetPoolTaints { pool, taints } => pool.len() + taints.iter().map(|t| t.len() + 4).sum::<usize>(),
            Command::PutNodeRequest(r) => 256 + r.id.len() + r.models.iter().map(|m| m.len() + 4).sum::<usize>(),
            Command::RemoveNodeRequest { id } => id.len(),
            Command::PutMigPlan(p) => serde_json::to_vec(p).map_or(4096, |b| b.len()),
            Command::CreateJoinToken { .. }
            | Command::RevokeToken { .. }
            | Command::ConsumeJoinToken { .. }
            | Command::CreateAdminToken { .. }
            | Command::RevokeCertificate { .. } => 512,
            Command::DeployVersion(m) => serde_json::to_vec(m).map_or(4096, |b| b.len()),
            Command::StartRollout(r) => {
                512 + r.steps.len() * 4 + r.events.iter().map(|e| e.message.len() + 16).sum::<usize>()
            }
            Command::UpdateRollout { model, message, .. } => 64 + model.len() + message.len(),
            Command::SetCapacityMark { key, mark } => key.len() + mark.as_ref().map_or(0, |m| 64 + m.why.len()),
        }
    }

    /// Checks a command's arguments before it is proposed, so nothing malformed reaches the log.
    pub fn validate(&self) -> Result<(), CommandError> {
        match self {
            Command::PutSetting { key, value } => {
                validate_key(key)?;
                if value.len() > MAX_SETTING_VALUE_BYTES {
                    return Err(CommandError::ValueTooLarge { len: value.len() });
                }
                Ok(())
            }
            Command::DeleteSetting { key } => validate_key(key),
            Command::Batch(commands) => commands.iter().try_for_each(|c| match c {
                Command::Batch(_) => Err(CommandError::NestedBatch),
                other => other.validate(),
            }),
            Command::RegisterNode(r) => r.validate().map_err(CommandError::InvalidNode),
            Command::SetNodeLiveness { node_id, .. }
            | Command::NodeDown { node_id, .. }
            | Command::PreemptNode { node_id, .. }
            | Command::SetNodeFlags { node_id, .. }
            | Command::SetNodeStatic { node_id, .. }
            | Command::SetDesiredReplicas { node_id, .. } => {
                validate_node_id(node_id).map_err(CommandError::InvalidNode)
            }
            Command::SetNodeReplicas { node_id, replicas } => {
                validate_node_id(node_id).map_err(CommandError::InvalidNode)?;
                crate::registry::validate_replica_report(replicas).map_err(CommandError::Invalid)
            }
            Command::PutClass(c) => c.validate().map_err(CommandError::Invalid),
            Command::PutModel(m) => m.validate().map_err(CommandError::Invalid),
            Command::RemoveModel { name } => {
                // A model, or one of its later versions (`name@version`).
                let (model, version) = name
                    .split_once('@')
                    .map_or((name.as_str(), None), |(m, v)| (m, Some(v)));
                crate::registry::validate_name("model", model).map_err(CommandError::Invalid)?;
                version.map_or(Ok(()), |v| {
                    crate::registry::validate_name("version", v).map_err(CommandError::Invalid)
                })
            }
            Command::CreateTenant(t) => crate::registry::validate_name("tenant", &t.name)
                .and_then(|()| t.limits.values().try_for_each(TenantLimit::validate))
                .map_err(CommandError::Invalid),
            Command::SetTenantLimit { tenant, limit, .. } => crate::registry::validate_name("tenant", tenant)
                .and_then(|()| limit.as_ref().map_or(Ok(()), TenantLimit::validate))
                .map_err(CommandError::Invalid),
            Command::RotateTenantKey { tenant, .. } => {
                crate::registry::validate_name("tenant", tenant).map_err(CommandError::Invalid)
            }
            Command::SubmitJob(s) => s.validate().map_err(CommandError::Invalid),
            Command::AssignJobs { assignments, .. } => assignments
                .iter()
                .try_for_each(|a| validate_node_id(&a.node_id))
                .map_err(CommandError::InvalidNode),
            Command::JobStarted { .. }
            | Command::FinishJob { .. }
            | Command::CancelJob { .. }
            | Command::CompactJobs { .. } => Ok(()),
            Command::SetPrice { product, .. } => {
                if product.is_empty() || product.len() > 64 || product.chars().any(char::is_control) {
                    Err(CommandError::Invalid(
                        format!("product {product:?}: give a GPU product name such as H100-80GB or L4").into(),
                    ))
                } else {
                    Ok(())
                }
            }
            Command::RecordUsage(r) => r.validate().map_err(CommandError::Invalid),
            Command::SetPoolTaints { pool, taints } => {
                if pool.is_empty() || pool.len() > 63 {
                    return Err(CommandError::Invalid(
                        format!("pool {pool:?}: give the pool name agents register with (1-63 characters)").into(),
                    ));
                }
                taints
                    .iter()
                    .try_for_each(|t| crate::registry::validate_taint(t))
                    .map_err(CommandError::Invalid)
            }
            Command::PutNodeRequest(r) => validate_node_id(&r.id).map_err(CommandError::InvalidNode),
            Command::RemoveNodeRequest { id } => validate_node_id(id).map_err(CommandError::InvalidNode),
            Command::PutMigPlan(p) => p
                .gpus
                .iter()
                .try_for_each(|g| validate_node_id(&g.node))
                .map_err(CommandError::InvalidNode),
            Command::CreateJoinToken { sha256, token } => {
                validate_sha256(sha256)?;
                match &token.node_id {
                    Some(n) => validate_node_id(n).map_err(CommandError::InvalidNode),
                    None => Ok(()),
                }
            }
            Command::RevokeToken { sha256 } => validate_sha256(sha256),
            Command::CreateAdminToken { sha256, token } => {
                validate_sha256(sha256)?;
                let kind: crate::identity::Kind = token
                    .role
                    .parse()
                    .map_err(|e: crate::identity::IdentityError| CommandError::Invalid(e.to_string().into()))?;
                if !kind.is_role() {
                    return Err(CommandError::Invalid(
                        format!("an admin token's role is viewer, operator or admin, not {kind}").into(),
                    ));
                }
                crate::identity::PeerIdentity::new("x", kind, &token.name)
                    .map(|_| ())
                    .map_err(|e| CommandError::Invalid(e.to_string().into()))
            }
            Command::RevokeCertificate { serial, cert } => {
                // The identity is what catches the certificate's renewals (and, with no
                // serial, every certificate of it issued so far).
                let identity_ok = cert.identity.split_once(':').is_some_and(|(kind, name)| {
                    kind.parse::<crate::identity::Kind>().is_ok()
                        && crate::identity::PeerIdentity::new("x", kind.parse().expect("parsed"), name).is_ok()
                });
                if !identity_ok {
                    return Err(CommandError::Invalid(format!(
                        "certificate identity {:?}: kind:name, e.g. agent:gpu-1 or admin:alice (`lanectl certs show` prints it)",
                        crate::text::clip(&cert.identity, 80)
                    ).into()));
                }
                if serial.len() > 64 || !serial.chars().all(|c| c.is_ascii_hexdigit()) {
                    Err(CommandError::Invalid(
                        format!(
                            "certificate serial {:?}: hex digits, as `lanectl certs show` prints",
                            crate::text::clip(serial, 80)
                        )
                        .into(),
                    ))
                } else {
                    Ok(())
                }
            }
            Command::ConsumeJoinToken { sha256, node_id, .. } => {
                validate_sha256(sha256)?;
                validate_node_id(node_id).map_err(CommandError::InvalidNode)
            }
            Command::DeployVersion(m) => m.validate().map_err(CommandError::Invalid),
            Command::StartRollout(r) => r.validate().map_err(CommandError::Invalid),
            Command::UpdateRollout { model, message, .. } => {
                crate::registry::validate_name("model", model).map_err(CommandError::Invalid)?;
                if message.len() > 4096 {
                    return Err(CommandError::Invalid("a rollout note is 4096 bytes at most".into()));
                }
                Ok(())
            }
            Command::SetCapacityMark { key, .. } => {
                if key.is_empty() || key.len() > 256 || !key.contains('@') {
                    Err(CommandError::Invalid(
                        format!("capacity key {key:?}: product@region").into(),
                    ))
                } else {
                    Ok(())
                }
            }
            Command::SetMigLayout { node_id, profiles, .. } => {
                validate_node_id(node_id).map_err(CommandError::InvalidNode)?;
                if profiles.len() > 7 {
                    return Err(CommandError::Invalid(
                        format!("{} MIG devices: a GPU has 7 compute slices at most", profiles.len()).into(),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Checks a token's sha256 as commands carry it: 64 lowercase hex digits.
fn validate_sha256(sha256: &str) -> Result<(), CommandError> {
    if sha256.len() == 64 && sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(CommandError::Invalid(
            format!(
                "token hash {:?}: a sha256 is 64 lowercase hex digits",
                sha256.chars().take(80).collect::<String>()
            )
            .into(),
        ))
    }
}

/// Checks a setting key (shared by writes and reads).
pub fn validate_key(key: &str) -> Result<(), CommandError> {
    if key.is_empty() {
        return Err(CommandError::EmptyKey);
    }
    if key.len() > MAX_SETTING_KEY_BYTES {
        return Err(CommandError::KeyTooLong { len: key.len() });
    }
    if key.chars().any(char::is_control) {
        return Err(CommandError::KeyNotPrintable {
            key: key.escape_debug().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster from before the gate (no format setting, or a lower one) takes only the
    /// formats that predate it; what it holds is read as written.
    #[test]
    fn the_gate_reads_the_cluster_setting() {
        assert_eq!(allowed_format(None), UNGATED_FORMAT);
        assert_eq!(allowed_format(Some("3")), UNGATED_FORMAT);
        assert_eq!(allowed_format(Some("not a number")), UNGATED_FORMAT);
        assert_eq!(allowed_format(Some(" 10 ")), 10);
        let static_replicas = Command::SetNodeStatic {
            node_id: "gpu-1".into(),
            allowed: true,
        };
        assert_eq!(static_replicas.format(), 10, "an older binary never meets it");
        let report = Command::SetNodeReplicas {
            node_id: "gpu-1".into(),
            replicas: vec![
                crate::registry::ReplicaRecord {
                    id: "r".into(),
                    model: "m".into(),
                    device: "GPU-1".into(),
                    state: "ready".into(),
                    endpoint: "h:1".into(),
                };
                crate::registry::MAX_REPLICAS_PER_NODE + 1
            ],
        };
        assert!(report.validate().unwrap_err().to_string().contains("at most"));
    }

    #[test]
    fn validation_names_the_problem() {
        let long = "k".repeat(MAX_SETTING_KEY_BYTES + 1);
        let cases = [
            (
                Command::DeleteSetting { key: String::new() },
                Some(CommandError::EmptyKey),
            ),
            (
                Command::DeleteSetting { key: long.clone() },
                Some(CommandError::KeyTooLong { len: long.len() }),
            ),
            (
                Command::PutSetting {
                    key: "a".into(),
                    value: "v".repeat(MAX_SETTING_VALUE_BYTES + 1),
                },
                Some(CommandError::ValueTooLarge {
                    len: MAX_SETTING_VALUE_BYTES + 1,
                }),
            ),
            (
                Command::PutSetting {
                    key: "a\nb".into(),
                    value: String::new(),
                },
                Some(CommandError::KeyNotPrintable { key: "a\\nb".into() }),
            ),
            (
                Command::PutSetting {
                    key: "fleet.region".into(),
                    value: "eu".into(),
                },
                None,
            ),
        ];
        for (cmd, want) in cases {
            assert_eq!(cmd.validate().err(), want, "{cmd:?}");
        }
    }
}
