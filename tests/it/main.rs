//! The cross-binary tests: real `laneway-control` processes, `lanectl`, in-process agents and
//! `laneway-sim-model` replicas on 127.0.0.1 (one test binary, see PRACTICES §14). Built as the
//! `it` test of the `laneway-control` package (see tests/README.md).

mod actors;
mod agents;
mod attacks;
mod clients;
mod cluster;
mod harness;
mod jobs;
mod observe;
mod plan_cli;
mod provision;
mod rollout;
mod router;
mod routers;
mod runtimes;
mod security;
