//! What the agent currently knows of its control plane: written by the heartbeat session,
//! read by the metrics endpoint, dev mode and tests.

/// What the agent currently knows, for dev mode, tests and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentView {
    /// The controller the heartbeat stream is open to, if any.
    pub connected_to: Option<String>,
    /// Heartbeats acknowledged by the leader.
    pub acked: u64,
    /// When the last one was (ms since the epoch; 0: never).
    pub last_ack_unix_ms: u64,
    pub cordoned: bool,
    pub draining: bool,
    /// The last registration refusal, if the leader refused this node.
    pub refused: Option<String>,
}
