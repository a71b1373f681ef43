//! The durable lanes' shells: the leader's dispatcher and the routers' job gateway. The job
//! queue's types and the pure dispatch decision are `laneway_core::jobs` (re-exported here).

pub use laneway_core::jobs::*;

pub mod dispatcher;
pub mod gateway;

/// Wall-clock milliseconds since the Unix epoch, for the timestamps commands carry.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
