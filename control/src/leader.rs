//! Who leads the controllers' Raft group, by this member's own metrics, and how to reach the
//! other controllers' admin API. Below [`crate::context`], so the router's job gateway can use
//! it without the whole context.

use crate::raft_types::{NodeId, Raft};

/// The term this node leads according to `m`, if it leads one: in the leader state, naming
/// itself leader, and with Raft running (openraft leaves `current_leader` as it was after a
/// shutdown or a fatal error, so an ex-leader whose Raft stopped must not keep "leading").
pub fn leads(m: &crate::raft_types::RaftMetrics, me: NodeId) -> Option<u64> {
    (m.state == openraft::ServerState::Leader && m.current_leader == Some(me) && m.running_state.is_ok())
        .then_some(m.current_term)
}

/// A client of the controllers' admin API that presents `tls`'s certificate.
pub fn controllers_client(
    tls: Option<&laneway_pki::Tls>,
    call_timeout: std::time::Duration,
) -> crate::client::AdminClient {
    crate::client::AdminClient::new(Vec::new())
        .with_call_timeout(call_timeout)
        .with_tls(tls.map(|t| t.client(laneway_pki::ANY_CONTROLLER)))
}

/// The leader `raft` knows of now, with its address (from this member's own metrics).
pub fn current_leader(raft: &Raft) -> Option<(NodeId, String)> {
    let m = raft.metrics().borrow().clone();
    let id = m.current_leader?;
    let addr = m.membership_config.membership().get_node(&id)?.addr.clone();
    Some((id, addr))
}
