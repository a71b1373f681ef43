//! Generated protobuf and gRPC code for Laneway's wire APIs.
//!
//! Only wire types live here; domain types and the conversions to and from them live in the
//! crates that own the domain (see `laneway-control`'s `pb_impl` modules).

#![allow(clippy::all, missing_docs)]

/// Raft transport between controllers.
pub mod raft {
    tonic::include_proto!("laneway.raft.v1");
}

/// Operator (admin) API served by every controller.
pub mod admin {
    tonic::include_proto!("laneway.admin.v1");
}

/// Node agent API (registration and heartbeats).
pub mod agent {
    tonic::include_proto!("laneway.agent.v1");
}

/// Response metadata key that carries the current leader's address on a redirect.
pub const LEADER_ADDR_METADATA: &str = "laneway-leader-addr";
