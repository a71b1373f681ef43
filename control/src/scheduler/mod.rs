//! Scheduling decisions (issue #6), each a pure function of state, observations and time whose
//! output is committed through Raft by a leader-only actor. Placement is the first of them.

pub mod autoscale;
pub mod load_board;
pub mod mig_plan;
pub mod placement;
pub mod replicas;
pub mod rollout_loop;
pub mod warm_floor_loop;
