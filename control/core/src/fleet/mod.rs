//! The fleet as the replicated state knows it: registered nodes, their GPUs, committed
//! liveness and operator flags. Heartbeats are not here (they stay in the leader's memory, see
//! `laneway_control::fleet::heartbeats`); only transitions are.

pub mod liveness;

use std::collections::BTreeMap;

use crate::refused::Refused;
use serde::{Deserialize, Serialize};

/// Most GPUs one node may register.
pub const MAX_GPUS_PER_NODE: usize = 64;
/// Most labels on one node.
pub const MAX_LABELS: usize = 64;

/// A GPU as registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRecord {
    pub uuid: String,
    pub product: String,
    pub memory_bytes: u64,
    pub mig_capable: bool,
}

/// What an agent registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRegistration {
    pub node_id: String,
    pub hostname: String,
    pub pool: String,
    pub labels: BTreeMap<String, String>,
    pub gpus: Vec<GpuRecord>,
    /// Host routers dial for this node's replicas (empty: the hostname).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub replica_host: String,
}

impl NodeRegistration {
    /// The host routers dial to reach this node's replicas.
    pub fn replica_host(&self) -> &str {
        if self.replica_host.is_empty() {
            &self.hostname
        } else {
            &self.replica_host
        }
    }
}

/// Committed liveness of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    Up,
    Down,
}

/// A node in the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub registration: NodeRegistration,
    pub liveness: Liveness,
    /// No new replicas are placed here.
    pub cordoned: bool,
    /// Replicas are being moved off.
    pub draining: bool,
    /// The routers take the replicas the node runs from its own configuration (static
    /// replicas), not only those the scheduler placed there (`lanectl node allow-static`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub static_replicas: bool,
}

/// Checks a node id: 1–63 characters of `[a-z0-9-]`, not starting or ending with '-'.
pub fn validate_node_id(id: &str) -> Result<(), Refused> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && !id.starts_with('-')
        && !id.ends_with('-')
        && id
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "node id {:?}: use 1-63 characters of a-z, 0-9 and '-' (not at either end), e.g. gpu-h100-07",
            crate::text::clip(id, 64)
        )
        .into())
    }
}

impl NodeRegistration {
    /// Checks a registration before it is proposed.
    pub fn validate(&self) -> Result<(), Refused> {
        validate_node_id(&self.node_id)?;
        for (what, v) in [
            ("hostname", &self.hostname),
            ("pool", &self.pool),
            ("replica_host", &self.replica_host),
        ] {
            if v.len() > 253 {
                return Err(format!("{what} is {} bytes; at most 253", v.len()).into());
            }
        }
        if self
            .replica_host
            .contains(|c: char| c.is_whitespace() || c == '/' || c == '@')
        {
            return Err(format!(
                "replica_host {:?}: give a host name or IP address only (no port, scheme or path)",
                self.replica_host
            )
            .into());
        }
        if self.gpus.len() > MAX_GPUS_PER_NODE {
            return Err(format!(
                "{} GPUs registered; at most {MAX_GPUS_PER_NODE} per node",
                self.gpus.len()
            )
            .into());
        }
        if self.labels.len() > MAX_LABELS {
            return Err(format!("{} labels; at most {MAX_LABELS} per node", self.labels.len()).into());
        }
        for (k, v) in &self.labels {
            if k.is_empty() || k.len() > 128 || v.len() > 256 {
                return Err(format!("label {k:?}={v:?}: keys 1-128 bytes, values up to 256 bytes").into());
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for g in &self.gpus {
            if g.uuid.is_empty() || g.uuid.len() > 128 {
                return Err(format!("GPU uuid {:?}: expected a GPU-… UUID", g.uuid).into());
            }
            if g.product.len() > 64 {
                return Err(format!("GPU product name is {} bytes; at most 64", g.product.len()).into());
            }
            if !seen.insert(&g.uuid) {
                return Err(format!("GPU {} is listed twice", g.uuid).into());
            }
        }
        Ok(())
    }
}

/// The fleet part of the replicated state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fleet {
    pub nodes: BTreeMap<String, NodeRecord>,
    /// GPU UUID → owning node; derived from `nodes` (not serialized, rebuilt on load) so that a
    /// registration checks its GPUs in O(log n) instead of scanning every node.
    #[serde(skip)]
    gpu_owner: BTreeMap<String, String>,
}

impl Fleet {
    /// Rebuilds the derived GPU index after `nodes` was loaded or replaced.
    pub fn rebuild_index(&mut self) {
        self.gpu_owner = self
            .nodes
            .values()
            .flat_map(|n| {
                n.registration
                    .gpus
                    .iter()
                    .map(|g| (g.uuid.clone(), n.registration.node_id.clone()))
            })
            .collect();
    }

    /// The node owning a GPU, if any.
    pub fn gpu_owner(&self, uuid: &str) -> Option<&str> {
        self.gpu_owner.get(uuid).map(String::as_str)
    }

    /// Registers (or re-registers, after an agent restart) a node. A GPU UUID owned by another
    /// node is refused: two agents claiming one card is a misconfiguration or an impostor.
    pub fn register(&mut self, reg: &NodeRegistration) -> Result<(), Refused> {
        for g in &reg.gpus {
            if let Some(owner) = self.gpu_owner(&g.uuid) {
                if owner != reg.node_id {
                    return Err(Refused::Conflict(format!(
                        "GPU {} is already registered to node {owner}; node {} cannot claim it (wrong host, or a cloned node id?)",
                        g.uuid, reg.node_id
                    )));
                }
            }
        }
        let (cordoned, draining, static_replicas) = self
            .nodes
            .get(&reg.node_id)
            .map_or((false, false, false), |n| (n.cordoned, n.draining, n.static_replicas));
        if let Some(old) = self.nodes.get(&reg.node_id) {
            for g in &old.registration.gpus {
                self.gpu_owner.remove(&g.uuid);
            }
        }
        for g in &reg.gpus {
            self.gpu_owner.insert(g.uuid.clone(), reg.node_id.clone());
        }
        self.nodes.insert(
            reg.node_id.clone(),
            NodeRecord {
                registration: reg.clone(),
                liveness: Liveness::Up,
                cordoned,
                draining,
                static_replicas,
            },
        );
        Ok(())
    }

    /// Lets the routers take `node_id`'s static replicas, or stops them.
    pub fn set_static(&mut self, node_id: &str, allowed: bool) -> Result<(), Refused> {
        self.node_mut(node_id)?.static_replicas = allowed;
        Ok(())
    }

    /// The registered node `node_id`, to change, or what to do when there is none.
    fn node_mut(&mut self, node_id: &str) -> Result<&mut NodeRecord, Refused> {
        self.nodes.get_mut(node_id).ok_or_else(|| {
            Refused::NotFound(format!(
                "no node {node_id}; `lanectl node list` shows the registered nodes"
            ))
        })
    }

    pub fn set_liveness(&mut self, node_id: &str, liveness: Liveness) -> Result<(), Refused> {
        let n = self
            .nodes
            .get_mut(node_id)
            .ok_or_else(|| Refused::NotFound(format!("no node {node_id}")))?;
        n.liveness = liveness;
        Ok(())
    }

    pub fn set_flags(&mut self, node_id: &str, cordoned: Option<bool>, draining: Option<bool>) -> Result<(), Refused> {
        let n = self.node_mut(node_id)?;
        if let Some(c) = cordoned {
            n.cordoned = c;
        }
        if let Some(d) = draining {
            n.draining = d;
            if d {
                // Draining implies no new work.
                n.cordoned = true;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(node: &str, gpus: &[&str]) -> NodeRegistration {
        NodeRegistration {
            node_id: node.into(),
            hostname: node.into(),
            pool: "p".into(),
            labels: BTreeMap::new(),
            gpus: gpus
                .iter()
                .map(|u| GpuRecord {
                    uuid: u.to_string(),
                    product: "L4".into(),
                    memory_bytes: 1,
                    mig_capable: false,
                })
                .collect(),
            replica_host: String::new(),
        }
    }

    #[test]
    fn a_gpu_belongs_to_one_node() {
        let mut f = Fleet::default();
        f.register(&reg("a", &["GPU-1", "GPU-2"])).unwrap();
        let e = f.register(&reg("b", &["GPU-2"])).unwrap_err();
        assert!(e.message().contains("already registered to node a"), "{e}");
        assert!(
            !f.nodes.contains_key("b"),
            "a refused registration must not change state"
        );
        // The owner may re-register (agent restart), keeping its flags.
        f.set_flags("a", Some(true), None).unwrap();
        f.register(&reg("a", &["GPU-1"])).unwrap();
        assert!(f.nodes["a"].cordoned);
        // GPU-2 is free again.
        f.register(&reg("b", &["GPU-2"])).unwrap();
    }

    #[test]
    fn registrations_are_validated() {
        assert!(reg("Bad_Id", &[]).validate().is_err());
        assert!(reg("ok-1", &["GPU-1", "GPU-1"])
            .validate()
            .unwrap_err()
            .message()
            .contains("twice"));
        assert!(reg("ok-1", &["GPU-1"]).validate().is_ok());
    }
}
