//! GPU products and MIG geometry: what the scheduler places on and what the agent reports,
//! shared by both so a product name or a MIG profile means the same on either side.

pub mod mig;
pub mod product;

pub use product::Product;
