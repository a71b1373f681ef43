//! `laneway-control`: a Laneway controller.

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use laneway_control::config::RunArgs;
use laneway_control::dev::{self, DevArgs, DevError};
use laneway_control::server;
use laneway_control::telemetry::{self, LogFormat};

/// mimalloc instead of glibc's malloc: the controller allocates and frees many small buffers
/// per request across its worker threads, where glibc's arenas spent about a fifth of the CPU
/// of the jobs benchmark (`laneway-chaos jobs`, perf) in malloc/free and consolidation.
/// Built without transparent huge pages (`no_thp`): with them, the kernel zeroed a whole 2 MiB
/// page at each first touch of a fresh allocator page, 13-23% of the members' CPU at
/// saturation (ADR 0037).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "laneway-control",
    version,
    about = "Laneway controller: the Raft-replicated control plane of a GPU inference fleet"
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info,openraft=warn`.
    #[arg(long, env = "LANEWAY_LOG", default_value = "info,openraft=warn", global = true)]
    log: String,
    /// Log lines as text or JSON (one object per line). Traces go over OTLP when
    /// OTEL_EXPORTER_OTLP_ENDPOINT is set.
    #[arg(long, env = "LANEWAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one controller of a cluster.
    Run(Box<RunArgs>),
    /// Run the embedded default: a single-node cluster in a temp dir, for trying Laneway out.
    Dev(DevArgs),
    /// Run a router-only process: routes tenants' requests from the cluster's routing state,
    /// without a Raft vote or storage of its own (ADR 0029). Run many behind a load balancer.
    Router(Box<laneway_control::router_only::RouterArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Kept to the end of main: dropping it flushes the spans not yet exported.
    let _telemetry = match telemetry::init("laneway-control", &cli.log, cli.log_format) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("laneway-control: {e}");
            return ExitCode::from(2);
        }
    };
    let _failpoints = match laneway_actors::failpoint::setup_from_env("laneway-control") {
        Ok(f) => f,
        Err(e) => {
            eprintln!("laneway-control: {e}");
            return ExitCode::from(2);
        }
    };
    if std::env::var_os(laneway_store::power_loss::ENV).is_some() && !laneway_store::power_loss::armed() {
        eprintln!(
            "laneway-control: {} is set, but power-loss simulation needs a testing build (`cargo build --features laneway-control/testing`) and the value 1 (lose every unsynced write) or torn (lose some sectors of them); unset it",
            laneway_store::power_loss::ENV
        );
        return ExitCode::from(2);
    }
    // Validate configuration before starting the runtime, binding ports or opening files.
    let run_cfg = match &cli.command {
        Cmd::Run(args) => match args.resolve() {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("laneway-control: {e}");
                return ExitCode::from(2);
            }
        },
        Cmd::Dev(_) | Cmd::Router(_) => None,
    };
    let router_cfg = match &cli.command {
        Cmd::Router(args) => match args.resolve() {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("laneway-control router: {e}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("laneway-control: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async move {
        if laneway_store::power_loss::armed() {
            if let Err(e) = cut_power_on_sigusr1() {
                eprintln!("laneway-control: {e}");
                return ExitCode::from(1);
            }
        }
        match cli.command {
            Cmd::Run(_) => {
                let cfg = run_cfg.expect("resolved above");
                let mut controller = match server::start(cfg).await {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("laneway-control: {e}");
                        return ExitCode::from(e.exit_code() as u8);
                    }
                };
                println!(
                    "laneway-control: node listening on {} (advertised as {})",
                    controller.addr, controller.advertise
                );
                tokio::select! {
                    res = controller.serve_until_stopped() => {
                        if let Err(e) = res {
                            eprintln!("laneway-control: {e}; exiting so the service manager restarts this controller");
                            return ExitCode::from(1);
                        }
                        ExitCode::SUCCESS
                    }
                    _ = stop_requested() => {
                        controller.shutdown().await;
                        ExitCode::SUCCESS
                    }
                }
            }
            Cmd::Router(_) => {
                let cfg = router_cfg.expect("resolved above");
                let router = match laneway_control::router_only::start(cfg).await {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("laneway-control router: {e}");
                        return ExitCode::from(1);
                    }
                };
                println!("laneway-control router: serving on {}", router.addr);
                stop_requested().await;
                router.shutdown().await;
                ExitCode::SUCCESS
            }
            Cmd::Dev(args) => {
                let dev = match dev::start(args).await {
                    Ok(d) => d,
                    Err(DevError::Start(e)) => {
                        eprintln!("laneway-control dev: {e}");
                        return ExitCode::from(e.exit_code() as u8);
                    }
                    Err(e) => {
                        eprintln!("laneway-control dev: {e}");
                        return ExitCode::from(1);
                    }
                };
                let addr = dev.controller.advertise.clone();
                println!("Laneway dev controller is up (single-node Raft cluster \"dev\").");
                println!("  admin + raft gRPC: {addr}");
                println!("  data dir:          {}", dev.data_dir.display());
                println!("  security:          INSECURE development mode: plaintext gRPC, no authorization (ADR 0013)");
                let nodes: Vec<&str> = dev.agents.iter().map(|(n, _)| n.as_str()).collect();
                println!("  simulated nodes:   {}", nodes.join(", "));
                if let Some(r) = dev.router_addr {
                    println!("  inference router:  http://{r}");
                }
                println!("  classes:           speech (sync), image (bounded), video (durable)");
                println!("  models:            whisper (speech), sdxl (image), wan-video (video)");
                if let Some(real) = &dev.real_runtimes {
                    for m in &real.models {
                        println!("  real runtime:      {} on {} ({})", m.name, m.runtime, m.file.display());
                    }
                    for s in &real.skipped {
                        println!("  not served:        {s}");
                    }
                }
                println!("  tenant dev key:    {}", dev.api_key);
                if !dev.replicas_running {
                    println!("  (laneway-sim-model was not found next to this binary: no replicas run; `cargo build` builds it)");
                }
                println!("Try:");
                println!("  lanectl --addr {addr} lane list");
                println!("  lanectl --addr {addr} node list");
                println!("  lanectl --addr {addr} ledger --by model --since 15m");
                if let (Some(r), true) = (dev.router_addr, dev.replicas_running) {
                    println!(
                        "  curl -s -D - -H 'Authorization: Bearer {}' -d '{{\"inputs\":[{{\"name\":\"audio\",\"shape\":[1],\"datatype\":\"FP32\",\"data\":[0.5]}}]}}' http://{r}/v2/models/whisper/infer",
                        dev.api_key
                    );
                }
                if let (Some(r), [fast, costly, ..]) = (dev.router_addr, dev.rollout_examples.as_slice()) {
                    println!("A canary rollout (ADR 0015): traffic in the background, then a version that costs 3x the GPU time per request");
                    println!(
                        "  while sleep 0.05; do curl -s -o /dev/null -H 'Authorization: Bearer {}' -d '{{\"inputs\":[{{\"name\":\"audio\",\"shape\":[1],\"datatype\":\"FP32\",\"data\":[0.5]}}]}}' http://{r}/v2/models/whisper/infer; done &",
                        dev.api_key
                    );
                    println!("  lanectl --addr {addr} model deploy {}", costly.display());
                    println!("  lanectl --addr {addr} rollout start whisper --version 3 --canary 10,50,100 --bake 15s");
                    println!("  lanectl --addr {addr} rollout status whisper --watch      (rolled back on cost; {} is a good version 2)", fast.display());
                }
                println!("Press Ctrl-C to stop.");
                let mut dev = dev;
                tokio::select! {
                    _ = stop_requested() => {}
                    res = dev.controller.serve_until_stopped() => {
                        if let Err(e) = res {
                            eprintln!("laneway-control dev: {e}; stopping");
                        }
                    }
                }
                // Not println!: stdout may be a closed pipe by now (`laneway-control dev | head`),
                // and a panic here would skip the drain below and leave replicas running.
                let _ = writeln!(std::io::stdout(), "stopping");
                // Dev mode owns its replicas: drain them (all at once) so nothing outlives the
                // process. Each agent stops first, or it would start placed replicas again as
                // they go.
                let mut drains = Vec::new();
                for (_, agent) in dev.agents {
                    let supervisor = agent.supervisor.clone();
                    agent.stop();
                    for r in supervisor.status() {
                        let supervisor = supervisor.clone();
                        drains.push(async move {
                            let _ = supervisor
                                .drain(
                                    &r.id,
                                    std::sync::Arc::new(|| 0),
                                    std::time::Duration::from_secs(1),
                                    std::time::Duration::from_secs(2),
                                )
                                .await;
                        });
                    }
                }
                futures::future::join_all(drains).await;
                dev.controller.shutdown().await;
                ExitCode::SUCCESS
            }
        }
    })
}

/// Ctrl-C (SIGINT) or SIGTERM — what systemd, `docker stop` and `kill` send — whichever comes
/// first, so a stop through any of them shuts down cleanly (dev mode drains its replicas).
async fn stop_requested() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("laneway-control: cannot watch SIGTERM ({e}); stop with Ctrl-C");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Testing builds with the power-loss disk armed: SIGUSR1 is a power cut (every write not yet
/// synced is lost and the process exits at once; see `laneway_store::power_loss`). Installed
/// before anything opens, so a cut during start-up is a cut too, not SIGUSR1's default death.
fn cut_power_on_sigusr1() -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut usr1 = signal(SignalKind::user_defined1()).map_err(|e| format!("cannot listen for SIGUSR1: {e}"))?;
    eprintln!(
        "laneway-control: TESTING BUILD, power-loss disk armed: SIGUSR1 drops every unsynced write and exits {}",
        laneway_store::power_loss::EXIT_CODE
    );
    tokio::spawn(async move {
        if usr1.recv().await.is_some() {
            laneway_store::power_loss::cut();
        }
    });
    Ok(())
}
