//! The operator (admin) gRPC API of a controller.

mod access;
mod api;
pub mod audit;
mod cluster;
pub mod error;
mod fleet;
mod observe;
pub use observe::CLOCK_OFFSET;
pub mod pb_impl;
mod registry;
pub mod service;

pub use error::AdminError;
pub use service::AdminGrpc;
