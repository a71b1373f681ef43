//! The ledger's shell: the usage meter that batches request records into replicated usage
//! reports. The ledger's types and queries are `laneway_core::ledger` (re-exported here).

pub use laneway_core::ledger::*;

pub mod meter;
