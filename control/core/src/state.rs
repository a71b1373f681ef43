//! The replicated application state and its `apply`: deterministic, a function of the state,
//! the command and its log index only. The redb persistence and openraft's storage traits around
//! it are `laneway_store`'s (today `laneway_control::store`).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::command::{Command, CommandResponse};
use crate::fleet::{Fleet, Liveness};
use crate::jobs::{Completion, JobOutcome, JobState, Jobs};
use crate::ledger::Ledger;
use crate::refused::Refused;
use crate::registry::Registry;

/// The application state every controller holds identically.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppState {
    /// Operator-owned cluster settings.
    pub settings: BTreeMap<String, String>,
    /// Node ids that were members once and were removed; they can never be reused.
    pub retired_node_ids: BTreeSet<u64>,
    /// Registered GPU nodes.
    #[serde(default)]
    pub fleet: Fleet,
    /// Classes, models, tenants and routable replicas.
    #[serde(default)]
    pub registry: Registry,
    /// The durable lanes' jobs.
    #[serde(default)]
    pub jobs: Jobs,
    /// Prices, metered usage and cost events.
    #[serde(default)]
    pub ledger: Ledger,
}

impl AppState {
    /// sha256 (hex) over a canonical encoding of the state; equal on every member that has
    /// applied the same log prefix.
    pub fn state_hash(&self) -> String {
        /// Feeds the encoding straight into the hash: no copy of a state of many jobs.
        struct Hashing(Sha256);
        impl std::io::Write for Hashing {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.update(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        // BTreeMap/BTreeSet iterate in key order, so the JSON encoding is canonical.
        let mut h = Hashing(Sha256::new());
        serde_json::to_writer(&mut h, self).expect("state serializes");
        hex::encode(h.0.finalize())
    }

    /// Applies one command committed at log `index`. Deterministic: depends only on the state,
    /// the command and the index (a job assignment's fencing token is its index).
    pub fn apply(&mut self, command: &Command, index: u64) -> CommandResponse {
        match command {
            Command::PutSetting { key, value } => {
                if key == crate::command::FORMAT_SETTING {
                    let current = self.settings.get(key).map(|v| crate::command::allowed_format(Some(v)));
                    if current.is_some_and(|c| crate::command::allowed_format(Some(value)) < c) {
                        return refused(Err(Refused::Conflict(format!(
                            "{key} is never lowered: a format the cluster finalized may already be in its log"
                        ))));
                    }
                }
                CommandResponse {
                    previous: self.settings.insert(key.clone(), value.clone()),
                    ..CommandResponse::default()
                }
            }
            Command::DeleteSetting { key } => {
                if key.starts_with(crate::command::CLUSTER_SETTINGS) {
                    return refused(Err(Refused::Invalid(format!(
                        "{key} is the cluster's own setting and is never deleted"
                    ))));
                }
                CommandResponse {
                    previous: self.settings.remove(key),
                    ..CommandResponse::default()
                }
            }
            Command::Batch(commands) => CommandResponse {
                batch: commands.iter().map(|c| self.apply(c, index)).collect(),
                ..CommandResponse::default()
            },
            Command::RegisterNode(reg) => refused(self.fleet.register(reg)),
            Command::SetNodeLiveness { node_id, up } => refused(
                self.fleet
                    .set_liveness(node_id, if *up { Liveness::Up } else { Liveness::Down }),
            ),
            Command::SetNodeFlags {
                node_id,
                cordoned,
                draining,
            } => refused(self.fleet.set_flags(node_id, *cordoned, *draining)),
            Command::PutClass(c) => refused(self.registry.put_class(c)),
            Command::PutModel(m) => refused(self.registry.put_model(m)),
            Command::RemoveModel { name } => refused(self.registry.remove_model(name)),
            Command::CreateTenant(t) => refused(self.registry.create_tenant(t)),
            Command::SetTenantLimit { tenant, class, limit } => {
                refused(self.registry.set_tenant_limit(tenant, class, *limit))
            }
            Command::RotateTenantKey { tenant, key_sha256 } => refused(self.registry.rotate_key(tenant, key_sha256)),
            Command::SetDesiredReplicas { node_id, replicas } => {
                if self.fleet.nodes.contains_key(node_id) || replicas.is_empty() {
                    self.registry.set_desired(node_id, replicas);
                    CommandResponse::default()
                } else {
                    refused(Err(Refused::NotFound(format!("no node {node_id}"))))
                }
            }
            Command::SetNodeReplicas { node_id, replicas } => {
                if self.fleet.nodes.contains_key(node_id) {
                    self.registry.set_node_replicas(node_id, replicas);
                    CommandResponse::default()
                } else {
                    refused(Err(Refused::NotFound(format!("no node {node_id}"))))
                }
            }
            Command::SetNodeStatic { node_id, allowed } => refused(self.fleet.set_static(node_id, *allowed)),
            Command::NodeDown { node_id, at_ms } => {
                let r = self.fleet.set_liveness(node_id, Liveness::Down);
                if r.is_ok() {
                    self.jobs
                        .requeue_node(node_id, &format!("node {node_id} was declared down"), *at_ms);
                }
                refused(r)
            }
            Command::PreemptNode { node_id, at_ms } => {
                let r = self.fleet.set_flags(node_id, Some(true), Some(true));
                if r.is_ok() {
                    let why = format!("node {node_id} got a spot preemption notice");
                    self.jobs.requeue_node(node_id, &why, *at_ms);
                }
                refused(r)
            }
            Command::SubmitJob(s) => {
                let ceiling = self
                    .registry
                    .tenants
                    .get(&s.tenant)
                    .and_then(|t| t.limit_for(&s.class))
                    .map(|l| l.concurrency);
                job_reply(self.jobs.submit(s, ceiling, index))
            }
            Command::AssignJobs { assignments, at_ms } => {
                let refusals: Vec<Refused> = assignments
                    .iter()
                    .filter_map(|a| {
                        self.jobs
                            .assign(&a.job_id, &a.node_id, &a.replica_id, index, *at_ms)
                            .err()
                    })
                    .collect();
                refused(if refusals.is_empty() {
                    Ok(())
                } else {
                    let all: Vec<String> = refusals.iter().map(Refused::to_string).collect();
                    Err(Refused::Conflict(all.join("; ")))
                })
            }
            Command::JobStarted { job_id, token, at_ms } => refused(self.jobs.started(job_id, *token, *at_ms)),
            Command::FinishJob {
                job_id,
                token,
                completion,
                at_ms,
            } => {
                let r = self.jobs.finish(job_id, *token, completion, *at_ms);
                if r.is_ok() {
                    self.meter_job(job_id, completion, *at_ms);
                }
                refused(r)
            }
            Command::CancelJob { job_id, at_ms } => job_reply(self.jobs.cancel(job_id, *at_ms)),
            Command::CompactJobs { before_ms } => {
                self.jobs.compact(*before_ms);
                CommandResponse::default()
            }
            Command::SetPrice {
                product,
                tier,
                micros_per_hour,
            } => refused(self.ledger.set_price(product, *tier, *micros_per_hour)),
            Command::SetMigLayout { node_id, gpu, profiles } => refused(self.set_mig_layout(node_id, gpu, profiles)),
            Command::SetPoolTaints { pool, taints } => {
                if taints.is_empty() {
                    self.registry.placement.pool_taints.remove(pool);
                } else {
                    self.registry.placement.pool_taints.insert(pool.clone(), taints.clone());
                }
                CommandResponse::default()
            }
            Command::PutNodeRequest(r) => refused(crate::fleet::validate_node_id(&r.id).map(|()| {
                self.registry.capacity.node_requests.insert(r.id.clone(), r.clone());
            })),
            Command::RemoveNodeRequest { id } => {
                self.registry.capacity.node_requests.remove(id);
                CommandResponse::default()
            }
            Command::PutMigPlan(p) => {
                let latest = self.registry.capacity.mig_plan.as_ref();
                let next = latest.map_or(1, |l| l.version + 1);
                let marks_applied =
                    latest.is_some_and(|l| l.version == p.version && l.applied_ms.is_none()) && p.applied_ms.is_some();
                if p.version == next || marks_applied {
                    self.registry.capacity.mig_plan = Some(p.clone());
                    CommandResponse::default()
                } else {
                    refused(Err(Refused::Conflict(format!(
                        "MIG plan version {} is not the next one ({next}) nor the latest being applied; run `lanectl mig plan` again",
                        p.version
                    ))))
                }
            }
            Command::SetCapacityMark { key, mark } => {
                match mark {
                    Some(m) => self.registry.capacity.capacity_marks.insert(key.clone(), m.clone()),
                    None => self.registry.capacity.capacity_marks.remove(key),
                };
                CommandResponse::default()
            }
            Command::CreateJoinToken { sha256, token } => {
                if self.registry.access.join_tokens.contains_key(sha256) {
                    return refused(Err(Refused::Conflict("this join token exists already".into())));
                }
                self.registry.access.join_tokens.insert(sha256.clone(), token.clone());
                CommandResponse::default()
            }
            Command::RevokeToken { sha256 } => refused(self.registry.revoke_token(sha256)),
            Command::CreateAdminToken { sha256, token } => {
                if self.registry.access.admin_tokens.contains_key(sha256) {
                    return refused(Err(Refused::Conflict("this admin token exists already".into())));
                }
                self.registry.access.admin_tokens.insert(sha256.clone(), token.clone());
                CommandResponse::default()
            }
            Command::RevokeCertificate { serial, cert } => {
                self.registry
                    .access
                    .revoked_certs
                    .insert(crate::registry::revocation_key(serial, &cert.identity), cert.clone());
                CommandResponse::default()
            }
            Command::DeployVersion(m) => refused(self.registry.deploy_version(m).map(|_| ())),
            Command::StartRollout(r) => refused(self.registry.start_rollout(r)),
            Command::UpdateRollout {
                model,
                expect_step,
                action,
                at_ms,
                message,
            } => refused(
                self.registry
                    .update_rollout(model, *expect_step, *action, *at_ms, message),
            ),
            Command::ConsumeJoinToken {
                sha256,
                node_id,
                key_sha256,
                at_ms,
            } => refused(self.registry.consume_join_token(
                sha256,
                node_id,
                key_sha256,
                *at_ms,
                self.fleet.nodes.contains_key(node_id),
            )),
            Command::RecordUsage(report) => {
                let pct = self.cost_regression_pct();
                self.ledger.apply_report(report, &self.fleet, pct);
                CommandResponse::default()
            }
        }
    }

    /// Checks a MIG layout against the GPU's product and records it.
    fn set_mig_layout(&mut self, node_id: &str, gpu: &str, profiles: &[String]) -> Result<(), Refused> {
        let node = self.fleet.nodes.get(node_id).ok_or_else(|| {
            Refused::NotFound(format!(
                "no node {node_id}; `lanectl node list` shows the registered nodes"
            ))
        })?;
        let record = node.registration.gpus.iter().find(|g| g.uuid == gpu).ok_or_else(|| {
            Refused::NotFound(format!(
                "node {node_id} has no GPU {gpu}; `lanectl node show {node_id}` lists its GPUs"
            ))
        })?;
        if !profiles.is_empty() {
            let mut geometry = crate::gpu::mig::Geometry::new();
            for p in profiles {
                *geometry.entry(p.clone()).or_default() += 1;
            }
            let product = crate::gpu::Product::from(record.product.clone());
            crate::gpu::mig::validate(&product, gpu, &geometry).map_err(|e| e.to_string())?;
        }
        self.registry.set_mig_layout(node_id, gpu, profiles);
        Ok(())
    }

    /// Threshold of the cost-regression event, from the cluster setting or the default.
    fn cost_regression_pct(&self) -> u64 {
        self.settings
            .get(crate::ledger::COST_REGRESSION_SETTING)
            .and_then(|v| v.trim().trim_end_matches('%').parse().ok())
            .unwrap_or(crate::ledger::DEFAULT_COST_REGRESSION_PCT)
    }

    /// Meters a job that just reached a terminal state: one request, the GPU time its result
    /// reports, on the card its replica was placed on.
    fn meter_job(&mut self, job_id: &str, completion: &Completion, at_ms: u64) {
        let Some(job) = self.jobs.get(job_id) else { return };
        if !matches!(job.state, JobState::Succeeded | JobState::Failed) {
            return;
        }
        // A finished job keeps the placement of the attempt that ended it.
        let (node, replica) = (job.node.clone(), job.replica.clone());
        // The product it was placed for, or, for a static replica, that of the GPU it runs on.
        let product = node.as_ref().and_then(|n| {
            let replica = replica.as_ref()?;
            let placed = self.registry.placement.desired.get(n).into_iter().flatten();
            if let Some(d) = placed.into_iter().find(|d| &d.id == replica) {
                return Some(d.product.clone());
            }
            let device = &self
                .registry
                .placement
                .replicas
                .get(n)?
                .iter()
                .find(|r| &r.id == replica)?
                .device;
            let gpus = &self.fleet.nodes.get(n)?.registration.gpus;
            gpus.iter().find(|g| &g.uuid == device).map(|g| g.product.clone())
        });
        let usage = crate::ledger::Usage {
            overflow_nanos: 0,
            class: job.class.clone(),
            lane: self
                .registry
                .classes
                .get(&job.class)
                .map_or_else(|| "durable".to_string(), |c| c.lane.to_string()),
            model: job.model.clone(),
            version: self
                .registry
                .models
                .get(&job.model)
                .map_or_else(String::new, |m| m.version.clone()),
            tenant: job.tenant.clone(),
            node,
            product,
            mig_profile: None,
            requests: 1,
            ok: u64::from(job.state == JobState::Succeeded),
            gpu_us: match completion {
                Completion::Succeeded(r) => r.gpu_us,
                Completion::Failed { .. } => 0,
            },
            input_tokens: 0,
            output_tokens: 0,
            slow: 0,
        };
        let pct = self.cost_regression_pct();
        self.ledger.record(at_ms, &[usage], &self.fleet, pct);
    }

    /// The stored value of a registry key (`class/…`, `model/…`, `tenant/…`, `replicas/…`), or
    /// `None` when the entry does not exist.
    pub fn registry_value(&self, key: &str) -> Option<Vec<u8>> {
        let (kind, name) = key.split_once('/')?;
        let r = &self.registry;
        match kind {
            "class" => r.classes.get(name).map(json),
            "model" => r.models.get(name).map(json),
            "tenant" => r.tenants.get(name).map(json),
            "replicas" => r.placement.replicas.get(name).map(json),
            "desired" => r.placement.desired.get(name).map(json),
            "mig" => r.placement.mig.get(name).map(json),
            "pool" => r.placement.pool_taints.get(name).map(json),
            "noderequest" => r.capacity.node_requests.get(name).map(json),
            "capacity" => r.capacity.capacity_marks.get(name).map(json),
            "migplan" => r.capacity.mig_plan.as_ref().map(json),
            "jointoken" => r.access.join_tokens.get(name).map(json),
            "joined" => r.access.joined.get(name).map(json),
            "admintoken" => r.access.admin_tokens.get(name).map(json),
            "revokedcert" => r.access.revoked_certs.get(name).map(json),
            "serving" => r.serving.get(name).map(json),
            "rollout" => r.rollouts.get(name).map(json),
            _ => None,
        }
    }

    /// Loads one stored registry entry.
    pub fn load_registry_entry(&mut self, key: &str, bytes: &[u8]) -> Result<(), String> {
        let (kind, name) = key.split_once('/').ok_or_else(|| format!("bad key {key:?}"))?;
        let r = &mut self.registry;
        let e = |e: serde_json::Error| e.to_string();
        match kind {
            "class" => r
                .classes
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "model" => r
                .models
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "tenant" => r
                .tenants
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "replicas" => r
                .placement
                .replicas
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "desired" => r
                .placement
                .desired
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "mig" => r
                .placement
                .mig
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "pool" => r
                .placement
                .pool_taints
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "noderequest" => r
                .capacity
                .node_requests
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "capacity" => r
                .capacity
                .capacity_marks
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "migplan" => {
                r.capacity.mig_plan = Some(serde_json::from_slice(bytes).map_err(e)?);
                None
            }
            "jointoken" => r
                .access
                .join_tokens
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "joined" => r
                .access
                .joined
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "admintoken" => r
                .access
                .admin_tokens
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "revokedcert" => r
                .access
                .revoked_certs
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "serving" => r
                .serving
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            "rollout" => r
                .rollouts
                .insert(name.into(), serde_json::from_slice(bytes).map_err(e)?)
                .map(|_| ()),
            _ => return Err(format!("unknown registry key {key:?}")),
        };
        Ok(())
    }

    /// Every registry entry as stored (key, JSON).
    pub fn registry_entries(&self) -> Vec<(String, Vec<u8>)> {
        let r = &self.registry;
        let keys = r
            .classes
            .keys()
            .map(|k| format!("class/{k}"))
            .chain(r.models.keys().map(|k| format!("model/{k}")))
            .chain(r.tenants.keys().map(|k| format!("tenant/{k}")))
            .chain(r.placement.replicas.keys().map(|k| format!("replicas/{k}")))
            .chain(r.placement.desired.keys().map(|k| format!("desired/{k}")))
            .chain(r.placement.mig.keys().map(|k| format!("mig/{k}")))
            .chain(r.placement.pool_taints.keys().map(|k| format!("pool/{k}")))
            .chain(r.capacity.node_requests.keys().map(|k| format!("noderequest/{k}")))
            .chain(r.capacity.capacity_marks.keys().map(|k| format!("capacity/{k}")))
            .chain(r.capacity.mig_plan.iter().map(|_| "migplan/latest".to_string()))
            .chain(r.access.join_tokens.keys().map(|k| format!("jointoken/{k}")))
            .chain(r.access.joined.keys().map(|k| format!("joined/{k}")))
            .chain(r.access.admin_tokens.keys().map(|k| format!("admintoken/{k}")))
            .chain(r.access.revoked_certs.keys().map(|k| format!("revokedcert/{k}")))
            .chain(r.serving.keys().map(|k| format!("serving/{k}")))
            .chain(r.rollouts.keys().map(|k| format!("rollout/{k}")));
        keys.filter_map(|k| self.registry_value(&k).map(|v| (k, v))).collect()
    }
}

/// A job command's answer: its outcome, or why it was refused.
fn job_reply(r: Result<JobOutcome, Refused>) -> CommandResponse {
    match r {
        Ok(outcome) => CommandResponse {
            job: Some(outcome),
            ..CommandResponse::default()
        },
        Err(e) => refused(Err(e)),
    }
}

/// A response that carries a refusal, if any.
fn refused(r: Result<(), Refused>) -> CommandResponse {
    let Err(e) = r else {
        return CommandResponse::default();
    };
    CommandResponse {
        rejected_as: Some(e.kind()),
        rejected: Some(e.to_string()),
        ..CommandResponse::default()
    }
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("state machine types serialize to JSON")
}
