//! Laneway node agent.
//!
//! Runs on every GPU host: reports the GPU inventory (through NVML, or a simulated backend for
//! dev mode, tests and chaos), applies MIG geometry, supervises model replicas, keeps the local
//! weight cache, and heartbeats to the controllers' leader ([`runtime`]).

pub mod config;
pub mod gpu;
pub mod identity;
pub mod jobs;
pub mod local_db;
pub use laneway_core::llm;
pub mod logging;
pub mod metrics;
pub mod mig;
pub mod placed;
pub mod results;
pub mod runtime;
pub mod sim_model;
pub mod supervisor;
pub mod view;
pub mod weight_cache;
