//! The durable lanes' shells: the leader's dispatcher and the routers' job gateway. The job
//! queue's types and the pure dispatch decision are `laneway_core::jobs` (re-exported here).

pub use laneway_core::clock::unix_ms;
pub use laneway_core::jobs::*;

pub mod dispatcher;
pub mod gateway;
