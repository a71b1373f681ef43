//! Laneway controller.
//!
//! A controller is one member of a small Raft group (openraft over tonic, redb storage) that holds
//! the fleet's desired state. This crate is the wiring and the I/O shells: the server, leadership
//! and the actor trees, the Raft transport, the admin and agent APIs, the router, observability,
//! configuration, dev mode, and the client used by `lanectl`.
//!
//! The domain and the pure decisions are `laneway_core`, storage is `laneway_store`; the modules
//! re-exported here keep the paths the shells use (`crate::registry::Model`) while the code lives
//! in the lower layers.

pub use laneway_client as client;
pub use laneway_router as router;
pub use laneway_store::{self as store, raft_types};

pub use laneway_core::{admission, command, gpu, llm, node, planner, registry, runtime_spec, state, text, usage};

pub mod actors;
pub mod admin;
pub mod agent_api;
pub mod auth;
pub mod config;
pub mod context;
pub mod dev;
pub mod fleet;
pub mod jobs;
pub mod leader;
pub mod ledger;
pub mod network;
pub mod observe;
pub mod proposer;
pub mod provision;

pub mod router_board;
pub mod router_feed;
pub mod router_host;
pub mod router_only;
pub mod scheduler;
pub mod server;
pub mod snapshot_points;
pub mod telemetry;
