//! A Raft RPC's payload as a peer sends it: decoded or refused, never a panic.
#![no_main]

use laneway_control::raft_types::TypeConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<openraft::raft::AppendEntriesRequest<TypeConfig>>(data);
    let _ = serde_json::from_slice::<openraft::raft::VoteRequest<u64>>(data);
    let _ = serde_json::from_slice::<openraft::raft::InstallSnapshotRequest<TypeConfig>>(data);
});
