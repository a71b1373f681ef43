//! Scheduling decisions (issue #6), each a pure function of state, observations and time whose
//! output is committed through Raft by a leader-only actor. Placement is the first of them.

pub mod autoscale;
pub mod lane_actor;
pub mod load_board;
pub mod load_reporter;
pub mod mig_plan;
pub mod placement;
pub mod placement_actor;
pub mod replicas;
pub mod rollout_loop;
pub mod term;
