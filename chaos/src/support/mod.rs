//! What the benches and the chaos runner share, at the bottom of this crate: nothing here imports
//! a bench or the runner, so they never import each other.

pub mod admin;
pub mod cpu;
pub mod fleet;
pub mod http;
pub mod pace;
pub mod stages;

/// The log filter the harness gives the controllers and agents it starts: `warn`, or
/// `LANEWAY_CHAOS_LOG` when set (e.g. `warn,laneway_control::jobs=debug` to follow a job).
pub fn log_filter() -> String {
    std::env::var("LANEWAY_CHAOS_LOG")
        .ok()
        .filter(|f| !f.trim().is_empty())
        .unwrap_or_else(|| "warn".into())
}
