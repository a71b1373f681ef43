//! Capacity planner (`lanectl plan`): turns traffic, model profiles and prices into a fleet, a
//! bill and a shedding plan. Pure computation over a [`Scenario`]: no cluster needed.

pub mod cluster;
pub mod plan;
pub mod queueing;
pub mod report;
pub mod scenario;

pub use plan::{plan, Plan, PlanError};
pub use scenario::{Scenario, ScenarioError};

#[cfg(test)]
mod tests;
