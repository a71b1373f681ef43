//! Conversions between domain types and admin protobuf messages.

use laneway_proto::admin::Member;
use openraft::ServerState;

use crate::raft_types::StoredMembership;

/// Lists the members of a membership config, voters first.
pub fn members(membership: &StoredMembership) -> Vec<Member> {
    let m = membership.membership();
    let voters: std::collections::BTreeSet<u64> = m.voter_ids().collect();
    let mut out: Vec<Member> = m
        .nodes()
        .map(|(id, node)| Member {
            node_id: *id,
            addr: node.addr.clone(),
            role: if voters.contains(id) { "voter" } else { "learner" }.to_string(),
        })
        .collect();
    out.sort_by_key(|m| (m.role != "voter", m.node_id));
    out
}

/// Lower-case name of a Raft server state, as shown by `lanectl`.
pub fn state_name(state: ServerState) -> &'static str {
    match state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}
