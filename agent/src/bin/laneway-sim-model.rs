//! `laneway-sim-model`: simulated model server (KServe v2 over HTTP).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use laneway_agent::sim_model::llm::{self, LlmSimConfig};
use laneway_agent::sim_model::{app, noop_app, Faults, SimModelConfig};

#[derive(Parser)]
#[command(name = "laneway-sim-model", version, about = "Simulated model server for Laneway")]
struct Cli {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Model name served.
    #[arg(long)]
    model: String,
    /// GPU product this replica runs on (picks the service time).
    #[arg(long)]
    product: String,
    /// Service time per batch by product, e.g. `L4=150,L40S=90,H100-80GB=45` (ms).
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    service_ms: Vec<(String, f64)>,
    /// Largest batch.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// How long the first request of a batch waits for company, ms.
    #[arg(long, default_value_t = 5)]
    batch_window_ms: u64,
    /// Crash (exit 101) on the request after this many were served.
    #[arg(long)]
    crash_after: Option<u64>,
    /// Stop answering after this many requests.
    #[arg(long)]
    hang_after: Option<u64>,
    /// Report not-ready for this long after start, ms.
    #[arg(long, default_value_t = 0)]
    slow_start_ms: u64,
    /// Fraction of requests answered with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// Seed of the failure RNG.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Serve an LLM (OpenAI-compatible `/v1/chat/completions` and `/v1/completions`, streamed
    /// or not) with continuous batching instead of the KServe v2 batcher; needs --tokens-per-s.
    #[arg(long)]
    llm: bool,
    /// LLM: decode throughput of one replica by product, tokens/s shared by its running
    /// sequences, e.g. `L4=800,H100-80GB=4000`.
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    tokens_per_s: Vec<(String, f64)>,
    /// LLM: KV-cache capacity by product, tokens, e.g. `L4=60000,H100-80GB=400000`.
    #[arg(long, value_delimiter = ',', value_parser = parse_pair)]
    kv_cache_tokens: Vec<(String, f64)>,
    /// LLM: prefill throughput as a multiple of the decode throughput.
    #[arg(long, default_value_t = 20.0)]
    prefill_factor: f64,
    /// LLM: one sequence's top decode speed, tokens/s.
    #[arg(long, default_value_t = 100.0)]
    max_seq_tokens_per_s: f64,
    /// LLM: longest input + output, tokens.
    #[arg(long, default_value_t = 8192)]
    context_tokens: u32,
    /// LLM: output tokens when a request gives no max_tokens.
    #[arg(long, default_value_t = 64)]
    default_max_tokens: u32,
    /// LLM: break the connection after this many tokens of a stream (a crash mid-stream).
    #[arg(long)]
    abort_stream_after_tokens: Option<u32>,
    /// Answer at once with a fixed result (no batching, no service time): a no-op replica for
    /// router benchmarks. Service-time flags are ignored.
    #[arg(long)]
    noop: bool,
}

fn parse_pair(s: &str) -> Result<(String, f64), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected PRODUCT=MS, e.g. L4=150"))?;
    let ms: f64 = v
        .parse()
        .map_err(|_| format!("{s:?}: {v:?} is not a number of milliseconds"))?;
    Ok((k.to_string(), ms))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let cfg = SimModelConfig {
        model: cli.model,
        product: cli.product,
        service_ms: cli.service_ms.into_iter().collect::<BTreeMap<_, _>>(),
        max_batch: cli.max_batch,
        batch_window: Duration::from_millis(cli.batch_window_ms),
        faults: Faults {
            crash_after: cli.crash_after,
            hang_after: cli.hang_after,
            slow_start: Duration::from_millis(cli.slow_start_ms),
            error_rate: cli.error_rate,
            seed: cli.seed,
        },
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(async move {
        let router = if cli.llm {
            let llm = LlmSimConfig {
                model: cfg.model,
                product: cfg.product,
                tokens_per_s: cli.tokens_per_s.into_iter().collect(),
                kv_cache_tokens: cli.kv_cache_tokens.into_iter().map(|(k, v)| (k, v as u64)).collect(),
                prefill_factor: cli.prefill_factor,
                max_seq_tokens_per_s: cli.max_seq_tokens_per_s,
                max_running: cli.max_batch,
                context_tokens: cli.context_tokens,
                default_max_tokens: cli.default_max_tokens,
                abort_stream_after_tokens: cli.abort_stream_after_tokens,
            };
            match llm::app(llm) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("laneway-sim-model: {e}");
                    return ExitCode::from(2);
                }
            }
        } else if cli.noop {
            noop_app(cfg.model)
        } else {
            match app(cfg) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("laneway-sim-model: {e}");
                    return ExitCode::from(2);
                }
            }
        };
        let listener = match tokio::net::TcpListener::bind(cli.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("laneway-sim-model: cannot listen on {}: {e}", cli.listen);
                return ExitCode::from(1);
            }
        };
        println!("laneway-sim-model listening on {}", cli.listen);
        // axum 0.8 leaves Nagle's algorithm on; a model server answers at once (uvicorn,
        // vLLM's server and Triton set TCP_NODELAY), and so does the simulator.
        use axum::serve::ListenerExt as _;
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                eprintln!("laneway-sim-model: cannot set TCP_NODELAY on a connection: {e}");
            }
        });
        match axum::serve(listener, router).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("laneway-sim-model: {e}");
                ExitCode::from(1)
            }
        }
    })
}
