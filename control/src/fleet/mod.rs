//! The fleet's shells: heartbeats in, liveness transitions out. The fleet's types and the pure
//! liveness decision are `laneway_core::fleet` (re-exported here).

pub use laneway_core::fleet::*;

pub mod heartbeats;
pub mod monitor;
