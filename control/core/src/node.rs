//! What the Raft membership records about each controller.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A controller as recorded in the Raft membership: where its gRPC endpoint (Raft transport and
/// admin API on one port) can be reached by the other members and by `lanectl`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerNode {
    /// `host:port` of the controller's gRPC listener, as the other members should dial it.
    pub addr: String,
}

impl fmt::Display for ControllerNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.addr)
    }
}
