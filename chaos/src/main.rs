//! `laneway-chaos`: fault-injection harness and benchmarks for Laneway.
//!
//! Benchmarks print one JSON object per line per figure (`{"bench": …}`), and compare against a
//! baseline measured in the same run, because the machines they run on are shared and noisy.

mod bench;
mod heartbeat_bench;
mod jobs_bench;
mod llm_bench;
mod placement_bench;
mod process_cluster;
mod router_bench;
mod run;
mod scaling_bench;
mod support;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "laneway-chaos", version, about = "Laneway fault injection and benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Raft write throughput/latency on a 3-process cluster, and leader failover time.
    Bench(bench::BenchArgs),
    /// Chaos scenarios (chaos/scenarios/…): controllers and simulated hosts under open-loop
    /// traffic of every lane, faults drawn from a seed, checkers on the history and the healed
    /// cluster, a report; exit code 1 on any violation, with the seed to replay it.
    Run(run::RunArgs),
    /// A scenario's cluster under its lane mix, ramped in steps until an objective breaks: the
    /// figures at the target rate and at the breaking point, and what gave out first.
    Load(run::load::LoadArgs),
    /// How many agents heartbeating at 1 Hz one leader sustains (lag p99 < 1 s).
    Heartbeats(heartbeat_bench::HeartbeatArgs),
    /// Router overhead against a no-op replica: max throughput and added p50/p99 at a fixed
    /// rate, router vs the replica called directly, side by side.
    Router(router_bench::RouterBenchArgs),
    /// Placement decision core: replicas placed per second on a synthetic 10,000-node ×
    /// 8-GPU fleet, against a full scan of the same fleet in the same run.
    Placement(placement_bench::PlacementArgs),
    /// Durable job submissions: acknowledged/s and submit p99 on a 3-controller cluster,
    /// against a 3-member etcd cluster's puts in the same run.
    Jobs(jobs_bench::JobsBenchArgs),
    /// Streaming overhead of the router for language models: TTFT and inter-token latency
    /// through the router vs direct to a simulated LLM replica, at a fixed open-loop rate.
    Llm(llm_bench::LlmBenchArgs),
    /// Placement and fast loops end to end on a 3-controller cluster: replicas placed and
    /// committed per second, step load → scale decision committed and new replica Ready, host
    /// kill → replicas Ready elsewhere.
    Scaling(scaling_bench::ScalingArgs),
}

/// Default path of a sibling binary (the one Cargo built next to this one).
pub fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.with_file_name(name)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let res = rt.block_on(async {
        match cli.command {
            Cmd::Bench(args) => bench::run(args).await,
            Cmd::Heartbeats(args) => heartbeat_bench::run(args).await,
            Cmd::Run(args) => run::run(args).await,
            Cmd::Load(args) => run::load::run(args).await,
            Cmd::Router(args) => router_bench::run(args).await,
            Cmd::Placement(args) => placement_bench::run(args),
            Cmd::Jobs(args) => jobs_bench::run(args).await,
            Cmd::Llm(args) => llm_bench::run(args).await,
            Cmd::Scaling(args) => scaling_bench::run(args).await,
        }
    });
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("laneway-chaos: {e:#}");
            ExitCode::from(1)
        }
    }
}
