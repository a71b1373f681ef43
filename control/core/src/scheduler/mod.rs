//! Scheduling decisions (issue #6), each a pure function of state, observations and time whose
//! output the leader's actors commit through Raft (`laneway_control::scheduler`).

pub mod autoscale;
pub mod mig_plan;
pub mod placement;
pub mod replicas;
