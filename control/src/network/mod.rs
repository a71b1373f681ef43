//! Raft transport over tonic: the client side openraft uses to reach peers ([`raft_client`]) and
//! the service that hands peers' RPCs to the local Raft node ([`raft_service`]).

pub mod raft_client;
pub mod raft_service;

/// Wire format of the JSON payloads in `RaftRequest` (openraft 0.9 serde types).
pub const PAYLOAD_FORMAT: u32 = 1;

/// Largest Raft RPC a controller accepts or sends, in bytes (entries are batched below this).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// AppendEntries payloads above this many bytes are split (openraft retries with fewer
/// entries). openraft 0.9 times every AppendEntries out after one heartbeat interval, so a
/// payload must encode, cross the wire, decode and be fsync'd on the follower well within it,
/// even on a loaded machine: a timed-out AppendEntries is resent whole and also delays the
/// heartbeats that keep followers from campaigning.
pub const TARGET_APPEND_BYTES: usize = 1024 * 1024;
