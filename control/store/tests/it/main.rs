//! Integration tests of the store (one test binary, see PRACTICES §14): openraft's storage
//! conformance suite, power loss of the Raft log, and the golden formats.

mod golden;
mod power_loss;
mod suite;
