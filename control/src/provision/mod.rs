//! The slow loop's shells: node providers (static, exec, sim) and the leader's loop that runs
//! them. The provisioning plan is `laneway_core::provision` (re-exported here).

pub use laneway_core::provision::*;

pub mod provider;
pub mod slow_loop;
