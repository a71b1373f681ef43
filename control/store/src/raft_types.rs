//! openraft type configuration for Laneway controllers, and aliases for the generic openraft
//! types specialised to it.

use std::io::Cursor;

use laneway_core::command::{CommandEnvelope, CommandResponse};
use laneway_core::node::ControllerNode;

openraft::declare_raft_types!(
    /// Type configuration of the controllers' Raft group.
    pub TypeConfig:
        D = CommandEnvelope,
        R = CommandResponse,
        NodeId = u64,
        Node = ControllerNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// Controller node id.
pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, ControllerNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, ControllerNode>;
pub type Snapshot = openraft::Snapshot<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type RaftMetrics = openraft::RaftMetrics<NodeId, ControllerNode>;
/// Who leads and in which term: reported only when that changes (`Raft::server_metrics`), where
/// [`RaftMetrics`] is sent on every turn of openraft's loop.
pub type RaftServerMetrics = openraft::metrics::RaftServerMetrics<NodeId, ControllerNode>;
pub type LogState = openraft::storage::LogState<TypeConfig>;
