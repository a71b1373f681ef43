//! What the benches and the chaos runner share, at the bottom of this crate: nothing here imports
//! a bench or the runner, so they never import each other.

pub mod admin;
pub mod cpu;
pub mod fleet;
pub mod http;
