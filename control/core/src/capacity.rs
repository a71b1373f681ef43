//! The capacity area of the replicated state: how a card is paid for (its tier), the nodes the
//! slow loop asked providers for, the (product, region) pairs that recently had no capacity, and
//! the committed MIG plan (MIG geometry is a capacity plan, DESIGN §4). Types only: the
//! decisions that write them are `provision` and `scheduler::mig_plan`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Node label that names a node's capacity tier.
pub const TIER_LABEL: &str = "tier";

/// A capacity tier: how a card is paid for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tier {
    Reserved,
    OnDemand,
    Spot,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Reserved, Tier::OnDemand, Tier::Spot];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Reserved => "reserved",
            Tier::OnDemand => "on-demand",
            Tier::Spot => "spot",
        }
    }

    pub fn parse(s: &str) -> Result<Tier, String> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "reserved" => Ok(Tier::Reserved),
            "on-demand" | "ondemand" => Ok(Tier::OnDemand),
            "spot" => Ok(Tier::Spot),
            _ => Err(format!("tier {s:?}: use reserved, on-demand or spot")),
        }
    }

    /// A node's tier from its `tier` label. A node without one is on-demand: the price nobody
    /// negotiated down, so an unlabelled fleet is never reported cheaper than it is.
    pub fn of_labels(labels: &BTreeMap<String, String>) -> Tier {
        labels
            .get(TIER_LABEL)
            .and_then(|t| Tier::parse(t).ok())
            .unwrap_or(Tier::OnDemand)
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a node request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RequestState {
    /// Committed; the provider has not confirmed the launch yet.
    Requested,
    /// The provider launched it; waiting for its agent to register.
    Launched,
    /// Its agent registered: a node of the fleet the slow loop made (and may give back).
    Joined,
    /// Being given back to the provider.
    Releasing,
}

/// A node the slow loop asked for, committed before the provider is called. Its id is the
/// node id the new host's agent registers with, and the idempotency key of the launch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRequest {
    pub id: String,
    pub pool: String,
    pub product: String,
    pub region: String,
    pub tier: Tier,
    pub gpus: u32,
    /// The models it was asked for.
    pub models: Vec<String>,
    /// The pool it stands in for, when a fallback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_from: Option<String>,
    pub requested_ms: u64,
    /// Not joined by then: a capacity failure.
    pub deadline_ms: u64,
    pub state: RequestState,
    /// The provider's handle (an instance id), when it gave one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// Joined: since when no replica has been placed on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
}

/// A (product, region) that recently had no capacity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityMark {
    pub product: String,
    pub region: String,
    pub until_ms: u64,
    pub why: String,
}

/// One GPU in a plan: its layout now and the one proposed (empty = the whole card).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedGpu {
    pub node: String,
    pub gpu: String,
    pub product: String,
    pub current: Vec<String>,
    pub planned: Vec<String>,
    /// The models whose slices the planned layout holds.
    pub for_models: Vec<String>,
}

impl PlannedGpu {
    pub fn changes(&self) -> bool {
        self.current != self.planned
    }
}

/// A numbered MIG capacity plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigPlan {
    pub version: u64,
    pub created_ms: u64,
    pub gpus: Vec<PlannedGpu>,
    /// Demand the MIG-capable GPUs cannot hold, and other remarks for the reviewer.
    pub notes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_ms: Option<u64>,
}

/// What the slow loop and the MIG planner asked for, replicated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityState {
    /// Nodes the slow loop asked for, by request id (= the node id), until given back.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_requests: BTreeMap<String, NodeRequest>,
    /// `product@region` → a recent capacity failure there (launches wait until it expires).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity_marks: BTreeMap<String, CapacityMark>,
    /// The latest MIG capacity plan (`lanectl mig plan`), applied or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_plan: Option<MigPlan>,
}
