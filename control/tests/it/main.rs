//! Integration tests of the controller crate (one test binary, see PRACTICES §14).

mod actors;
mod agents;
mod attacks;
mod cluster;
mod harness;
mod jobs;
mod observe;
mod plan_cli;
mod power_loss;
mod provision;
mod rollout;
mod router;
mod security;
mod store_suite;
