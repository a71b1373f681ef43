//! `laneway-agent`: the Laneway node agent.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use laneway_agent::gpu::nvml::NvmlBackend;
use laneway_agent::gpu::sim::SimBackend;
use laneway_agent::gpu::{Gpu, GpuBackend, GpuError};
use laneway_agent::logging::LogFormat;

#[derive(Parser)]
#[command(name = "laneway-agent", version, about = "Laneway node agent")]
struct Cli {
    /// Log lines as text or JSON (one object per line); the filter is LANEWAY_LOG.
    #[arg(long, env = "LANEWAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    /// Real GPUs through NVML (needs the NVIDIA driver).
    Nvml,
    /// Simulated GPUs described by --sim-config.
    Sim,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent: register this node, heartbeat to the leader, supervise replicas.
    Run(Box<RunArgs>),
    /// Print this host's GPU inventory: the first thing to run on a new host.
    Gpus {
        #[arg(long, value_enum, default_value_t = Backend::Nvml, env = "LANEWAY_GPU_BACKEND")]
        backend: Backend,
        /// Simulated GPU description (TOML), for --backend sim.
        #[arg(long, env = "LANEWAY_SIM_CONFIG")]
        sim_config: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

/// Flags of `laneway-agent run`; each overrides the config file.
#[derive(clap::Args)]
struct RunArgs {
    /// Agent config file (TOML; see deploy/examples/agent.toml).
    #[arg(long, env = "LANEWAY_AGENT_CONFIG")]
    config: Option<PathBuf>,
    #[arg(long, env = "LANEWAY_NODE_ID")]
    node_id: Option<String>,
    /// Controller addresses, comma-separated (any member; the agent finds the leader).
    #[arg(long, env = "LANEWAY_CONTROLLERS", value_delimiter = ',')]
    controllers: Vec<String>,
    #[arg(long, env = "LANEWAY_AGENT_DATA_DIR")]
    data_dir: Option<PathBuf>,
    #[arg(long, env = "LANEWAY_POOL")]
    pool: Option<String>,
    #[arg(long, value_enum, env = "LANEWAY_GPU_BACKEND")]
    backend: Option<Backend>,
    #[arg(long, env = "LANEWAY_SIM_CONFIG")]
    sim_config: Option<PathBuf>,
    #[arg(long, env = "LANEWAY_JOIN_TOKEN")]
    join_token: Option<String>,
    /// The cluster CA's certificate (PEM).
    #[arg(long, env = "LANEWAY_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This node's certificate (PEM), from `lanectl certs issue --kind agent --name NODE`.
    #[arg(long, env = "LANEWAY_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, env = "LANEWAY_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Talk to the controllers in plaintext: development clusters only.
    #[arg(long, env = "LANEWAY_INSECURE_DEV")]
    insecure_dev: bool,
    /// Where durable jobs' results go: a directory the controllers also read, or an
    /// object-store URL (s3://bucket/prefix). Default: <data-dir>/results.
    #[arg(long, env = "LANEWAY_RESULTS_STORE")]
    results_store: Option<String>,
    /// Prometheus `/metrics` address, `host:port` or "off" (default 0.0.0.0:9419).
    #[arg(long, env = "LANEWAY_METRICS_LISTEN")]
    metrics_listen: Option<String>,
}

fn run_agent(args: RunArgs, log_format: LogFormat) -> ExitCode {
    // Chaos only: failpoints (e.g. `actor::replica`) in a testing build.
    let _failpoints = match laneway_actors::failpoint::setup_from_env("laneway-agent") {
        Ok(f) => f,
        Err(e) => {
            eprintln!("laneway-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let mut file = match &args.config {
        Some(p) => match laneway_agent::config::read_file(p) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("laneway-agent: {e}");
                return ExitCode::from(2);
            }
        },
        None => Default::default(),
    };
    if args.node_id.is_some() {
        file.node_id = args.node_id;
    }
    if !args.controllers.is_empty() {
        file.controllers = args.controllers;
    }
    if args.data_dir.is_some() {
        file.data_dir = args.data_dir;
    }
    if args.pool.is_some() {
        file.pool = args.pool;
    }
    if args.join_token.is_some() {
        file.join_token = args.join_token;
    }
    for (flag, field) in [
        (args.tls_ca, &mut file.tls.ca),
        (args.tls_cert, &mut file.tls.cert),
        (args.tls_key, &mut file.tls.key),
    ] {
        if flag.is_some() {
            *field = flag;
        }
    }
    if args.insecure_dev {
        file.insecure_dev = Some(true);
    }
    if args.results_store.is_some() {
        file.results_store = args.results_store;
    }
    if args.metrics_listen.is_some() {
        file.metrics_listen = args.metrics_listen;
    }
    if let Some(b) = args.backend {
        file.gpu.backend = Some(match b {
            Backend::Nvml => "nvml".into(),
            Backend::Sim => "sim".into(),
        });
    }
    if args.sim_config.is_some() {
        file.gpu.sim_config = args.sim_config;
    }
    let cfg = match file.validate() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("laneway-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = std::env::var("LANEWAY_LOG").unwrap_or_else(|_| "info".into());
    if let Err(e) = laneway_agent::logging::init(&filter, log_format) {
        eprintln!("laneway-agent: {e}");
        return ExitCode::from(2);
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(async move {
        let backend: std::sync::Arc<dyn GpuBackend> = match &cfg.backend {
            laneway_agent::config::Backend::Nvml => match NvmlBackend::new() {
                Ok(b) => std::sync::Arc::new(b),
                Err(e) => {
                    eprintln!("laneway-agent: {e}");
                    return ExitCode::from(1);
                }
            },
            laneway_agent::config::Backend::Sim(p) => match SimBackend::from_file(p) {
                Ok(b) => std::sync::Arc::new(b),
                Err(e) => {
                    eprintln!("laneway-agent: {e}");
                    return ExitCode::from(2);
                }
            },
        };
        let mut agent = match laneway_agent::runtime::start(cfg, backend).await {
            Ok(a) => a,
            Err(e) => {
                eprintln!("laneway-agent: {e}");
                return ExitCode::from(2);
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            why = agent.ended() => {
                // Replicas keep running: the restarted agent re-adopts them.
                eprintln!("laneway-agent: {why}; exiting so the service manager restarts the agent");
                return ExitCode::from(1);
            }
        }
        // Replicas keep running: a restarted agent re-adopts them.
        agent.stop();
        ExitCode::SUCCESS
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Run(args) => run_agent(*args, cli.log_format),
        Cmd::Gpus {
            backend,
            sim_config,
            output,
        } => {
            let backend: Box<dyn GpuBackend> = match open(backend, sim_config) {
                Ok(b) => b,
                Err((code, msg)) => {
                    eprintln!("laneway-agent: {msg}");
                    return ExitCode::from(code);
                }
            };
            match backend.inventory() {
                Ok(gpus) => {
                    print(&gpus, output);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("laneway-agent: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

/// Opens the backend; a missing or bad --sim-config is a usage error (exit 2), a host without
/// NVML an environment error (exit 1).
fn open(backend: Backend, sim_config: Option<PathBuf>) -> Result<Box<dyn GpuBackend>, (u8, String)> {
    match backend {
        Backend::Nvml => NvmlBackend::new()
            .map(|b| Box::new(b) as Box<dyn GpuBackend>)
            .map_err(|e| (1, e.to_string())),
        Backend::Sim => {
            let path = sim_config.ok_or((
                2,
                "--backend sim needs --sim-config FILE (see deploy/examples/sim-node.toml)".to_string(),
            ))?;
            SimBackend::from_file(&path)
                .map(|b| Box::new(b) as Box<dyn GpuBackend>)
                .map_err(|e: GpuError| (2, e.to_string()))
        }
    }
}

fn print(gpus: &[Gpu], output: Output) {
    if output == Output::Json {
        println!("{}", serde_json::to_string_pretty(gpus).expect("inventory serializes"));
        return;
    }
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    println!(
        "{:>3}  {:<12} {:<40} {:>10} {:>5}  {:<8} HEALTH",
        "IDX", "PRODUCT", "UUID", "MEMORY", "UTIL", "MIG"
    );
    for g in gpus {
        let mig = match (g.mig.capable, g.mig.enabled) {
            (false, _) => "-".to_string(),
            (true, false) => "off".to_string(),
            (true, true) => format!("on ({})", g.mig.devices.len()),
        };
        let health = if g.health.healthy {
            "ok".to_string()
        } else {
            g.health.reason.clone().unwrap_or_else(|| "unhealthy".into())
        };
        println!(
            "{:>3}  {:<12} {:<40} {:>4.0}/{:<3.0}GiB {:>4}%  {:<8} {}",
            g.index,
            g.product.to_string(),
            g.uuid,
            g.memory_used_bytes as f64 / GIB,
            g.memory_total_bytes as f64 / GIB,
            g.utilisation_pct,
            mig,
            health
        );
        for d in &g.mig.devices {
            println!("       └─ {:<10} {}", d.profile, d.uuid);
        }
    }
}
