//! Replicas: what the scheduler placed on each node (intent), what each agent reports running
//! there (observed), and the MIG layouts GPUs are to have.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;
use crate::refused::Refused;

/// A replica as the leader last committed it from its agent's heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub id: String,
    pub model: String,
    /// GPU UUID (or MIG device UUID) it runs on.
    pub device: String,
    /// `starting`, `ready`, `draining`, `stopped`, `backoff`, `crash_loop`.
    pub state: String,
    /// `host:port` the router dials.
    pub endpoint: String,
}

/// Most replicas one node reports.
pub const MAX_REPLICAS_PER_NODE: usize = 128;

/// Checks what an agent reports of its replicas before it is proposed: a bounded set of
/// short, plain names (a compromised agent must not write megabytes per heartbeat).
pub fn validate_replica_report(replicas: &[ReplicaRecord]) -> Result<(), Refused> {
    if replicas.len() > MAX_REPLICAS_PER_NODE {
        return Err(format!(
            "{} replicas reported: a node runs {MAX_REPLICAS_PER_NODE} at most",
            replicas.len()
        )
        .into());
    }
    for r in replicas {
        for (what, v, max) in [
            ("id", &r.id, 128),
            ("model", &r.model, 160),
            ("device", &r.device, 128),
            ("state", &r.state, 32),
            ("endpoint", &r.endpoint, 300),
        ] {
            if v.len() > max || v.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(format!(
                    "replica {what} {:?}: {max} bytes at most, no spaces or control characters",
                    crate::text::clip(v, 64)
                )
                .into());
            }
        }
    }
    Ok(())
}

/// A replica the scheduler placed: intent, committed before any agent acts on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredReplica {
    pub id: String,
    pub model: String,
    /// GPU UUID it is pinned to.
    pub gpu: String,
    /// GPU product of that GPU (picks the model's profile).
    pub product: String,
}

/// Ready replicas of the registry entry `entry` among `replicas` (every node's).
pub fn ready_replicas(replicas: &BTreeMap<String, Vec<ReplicaRecord>>, entry: &str) -> usize {
    replicas
        .values()
        .flatten()
        .filter(|r| r.model == entry && r.state == "ready")
        .count()
}

/// Where replicas run, per node: what the leader placed (intent) and what the agents report
/// (observed), with the pools' taints and the GPUs' MIG layouts placement reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Node id → its replicas as observed (from heartbeats).
    pub replicas: BTreeMap<String, Vec<ReplicaRecord>>,
    /// Node id → the replicas placed there (intent).
    #[serde(default)]
    pub desired: BTreeMap<String, Vec<DesiredReplica>>,
    /// Pool → its taints: only lanes that tolerate all of them place replicas there.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pool_taints: BTreeMap<String, Vec<String>>,
    /// Node id → GPU UUID → its MIG layout (mig-parted profile names; empty = the whole card,
    /// MIG off). A GPU without an entry is left as it is.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mig: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

impl Registry {
    /// Whether a GPU is (to be) split into MIG slices: whole-card replicas do not go there.
    pub fn mig_split(&self, node_id: &str, gpu: &str) -> bool {
        self.placement
            .mig
            .get(node_id)
            .and_then(|g| g.get(gpu))
            .is_some_and(|profiles| !profiles.is_empty())
    }

    /// Sets a GPU's MIG layout (validated by the caller).
    pub fn set_mig_layout(&mut self, node_id: &str, gpu: &str, profiles: &[String]) {
        self.placement
            .mig
            .entry(node_id.to_string())
            .or_default()
            .insert(gpu.to_string(), profiles.to_vec());
    }

    /// Replaces the replicas placed on a node (an empty list removes them all).
    pub fn set_desired(&mut self, node_id: &str, replicas: &[DesiredReplica]) {
        if replicas.is_empty() {
            self.placement.desired.remove(node_id);
        } else {
            self.placement.desired.insert(node_id.to_string(), replicas.to_vec());
        }
    }

    /// Replaces a node's committed replicas (an empty list forgets them).
    pub fn set_node_replicas(&mut self, node_id: &str, replicas: &[ReplicaRecord]) {
        if replicas.is_empty() {
            self.placement.replicas.remove(node_id);
        } else {
            self.placement.replicas.insert(node_id.to_string(), replicas.to_vec());
        }
    }
}
