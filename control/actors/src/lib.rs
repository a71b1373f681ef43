//! Supervision for Laneway's actor trees (ractor).
//!
//! Every long-running piece of work in a controller or an agent is an actor in a supervised
//! tree. This crate holds what both processes share:
//! - [`restart`]: the restart policy — jittered exponential back-off, reset after a healthy
//!   spell, crash-loop detection — as pure functions of an injected `now`;
//! - [`board`]: the status board every actor reports to (up, restarts, last tick, last error),
//!   read by `/metrics`, `/ui` and `lanectl actors`;
//! - [`supervisor`]: a generic supervisor actor that starts its children, restarts a failed one
//!   after its back-off, and can reconcile a changing set of children (one lane per class);
//! - [`failpoint`]: the `testing`-build failpoint that panics inside a named actor.
//!
//! ractor restarts nothing by itself: a panic in a handler is caught and reported to the
//! supervisor as `ActorFailed`, and what happens next is written in
//! [`supervisor::Supervisor`]'s `handle_supervisor_evt`.

#![forbid(unsafe_code)]

pub mod board;
pub mod failpoint;
pub mod labels;
pub mod metrics;
pub mod oneshot;
pub mod restart;
pub mod supervisor;
pub mod ticker;

pub use board::{ActorBoard, ActorState, ActorStatus};
pub use ractor;
pub use restart::RestartPolicy;
pub use supervisor::{start_root, start_root_now, ChildSpec, Restart, Supervisor, SupervisorArgs, SupervisorMsg};
pub use ticker::{Ticker, Ticking};
