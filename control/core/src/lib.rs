//! Laneway's domain and every pure decision.
//!
//! The replicated command set and the state it is applied to ([`command`], [`state`]), the
//! fleet, registry, jobs, ledger and provisioning areas of that state, and the policies that
//! read it and propose commands: placement, autoscaling, admission, job dispatch, MIG plans,
//! provisioning, rollout judging, the capacity planner. GPU products and MIG geometry are shared
//! with the agent.
//!
//! No I/O here, and no decision reads the clock: every decision takes `now` and returns a plan or
//! commands. [`clock::unix_ms`] is the one wall-clock read, for the shells above.
//! This crate must not depend on openraft, redb, hyper, axum or tonic; `.ci/layering` checks it.

pub mod admission;
pub mod capacity;
pub mod clock;
pub mod command;
#[cfg(any(test, feature = "test-util"))]
pub mod fixtures;
pub mod fleet;
pub mod gpu;
pub mod identity;
pub mod jobs;
pub mod kserve;
pub mod lane_report;
pub mod ledger;
pub mod llm;
pub mod node;
pub mod planner;
pub mod provision;
pub mod refused;
pub mod registry;
pub mod runtime_spec;
pub mod scheduler;
pub mod state;
pub mod text;
pub mod usage;
