//! The leader's scheduling actors: each feeds a pure decision from `laneway_core::scheduler`
//! (re-exported here) and commits its output through Raft.

pub use laneway_core::scheduler::*;

pub mod lane_actor;
pub mod load_board;
pub mod load_reporter;
pub mod placement_actor;
pub mod rollout_loop;
pub mod term;
