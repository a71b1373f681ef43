//! The operator (admin) gRPC API of a controller.

pub mod audit;
pub mod error;
pub mod pb_impl;
pub mod service;

pub use error::AdminError;
pub use service::AdminGrpc;
