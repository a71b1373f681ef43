//! `laneway-control dev`: the embedded default — one process, a single-node Raft group in a
//! temporary (or given) data dir, and simulated agents (an L4, an L40S and an H100 node) with a
//! simulated replica, so a newcomer sees the system run with one command and no GPU.

use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;

use laneway_agent::config::AgentConfig;
use laneway_agent::gpu::sim::SimBackend;
use laneway_agent::runtime::Agent;

use crate::config::{ControllerConfig, RaftSettings};
use crate::server::{self, Controller, StartError};

pub mod real;

/// Flags of `laneway-control dev`.
#[derive(Debug, Clone, clap::Args)]
pub struct DevArgs {
    /// Keep data here instead of a temporary directory (deleted on exit).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// gRPC listen address (admin API + Raft).
    #[arg(long, default_value = "127.0.0.1:7001")]
    pub listen: std::net::SocketAddr,
    /// Inference router listen address (HTTP).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub router_listen: std::net::SocketAddr,
    /// Run the slow loop with these pools and provider (e.g. deploy/examples/provision.toml,
    /// whose simulated provider boots `laneway-agent` processes).
    #[arg(long)]
    pub provision: Option<PathBuf>,
    /// Also serve a real model server beside the simulated ones: a scikit-learn model on
    /// MLServer (`deploy/examples/models/mlserver-iris.toml`; needs `mlserver` on PATH, see
    /// tests/runtimes/requirements.txt).
    #[arg(long)]
    pub real_runtimes: bool,
}

/// A running dev controller, its simulated agents, and the temp dir it owns.
pub struct DevController {
    pub controller: Controller,
    pub data_dir: PathBuf,
    pub agents: Vec<(String, Agent)>,
    /// Whether the simulated model server binary was found (replicas run only then).
    pub replicas_running: bool,
    /// The inference router's address.
    pub router_addr: Option<std::net::SocketAddr>,
    /// API key of the `dev` tenant (rotated on every start; only its hash is stored).
    pub api_key: String,
    /// Model files of later whisper versions to try a rollout with (replicas running only).
    pub rollout_examples: Vec<PathBuf>,
    /// With `--real-runtimes`: the models real model servers serve, and what was skipped.
    pub real_runtimes: Option<real::Served>,
    _temp: Option<tempfile::TempDir>,
}

/// The simulated nodes of dev mode: (node id, pool, GPU product, count, capacity tier).
const DEV_NODES: &[(&str, &str, &str, u32, &str)] = &[
    ("sim-l4-1", "l4", "L4", 2, "reserved"),
    ("sim-l40s-1", "l40s", "L40S", 2, "on-demand"),
    ("sim-h100-1", "h100", "H100-80GB", 4, "on-demand"),
];

/// MIG layouts of dev mode, set through the controller as an operator would (`lanectl mig
/// set`): the last GPU of these nodes is split into these profiles.
const DEV_MIG: &[(&str, &[&str])] = &[("sim-h100-1", &["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])];

/// Example prices, US dollars per GPU-hour (reserved, on-demand, spot), set when the dev
/// cluster has none, so the ledger shows costs from the first request.
const DEV_PRICES: &[(&str, [f64; 3])] = &[
    ("L4", [0.45, 0.80, 0.30]),
    ("L40S", [0.95, 1.60, 0.70]),
    ("H100-80GB", [2.10, 3.50, 1.60]),
    ("H200", [2.80, 4.50, 2.10]),
];

/// The example registry of dev mode, as the TOML an operator would write.
const DEV_REGISTRY: &str = r#"
[[class]]
name = "speech"
# Small models: replicas may share a card (time-sliced), packed by GPU memory.
time_slicing = true
lane = "sync"
utilisation_target_pct = 60
warm_floor = 2
protection_rank = 0
request_timeout_ms = 5000
slo_p99_ms = 1000

[[class]]
name = "image"
lane = "bounded"
utilisation_target_pct = 80
budget_ms = 2000
warm_floor = 1
protection_rank = 1
request_timeout_ms = 20000
slo_p99_ms = 8000
degraded = { budget_ms = 4000, parameters = { resolution = "512" } }

[[class]]
name = "chat"
lane = "bounded"
utilisation_target_pct = 80
budget_ms = 1000
warm_floor = 1
protection_rank = 1
request_timeout_ms = 60000
llm = { ttft_slo_p99_ms = 800, itl_slo_p99_ms = 100, scale_on = "ttft" }

[[class]]
name = "embed"
# Embeddings for retrieval: small and fast, no queue.
time_slicing = true
lane = "sync"
utilisation_target_pct = 60
warm_floor = 1
protection_rank = 0
request_timeout_ms = 5000
slo_p99_ms = 500

[[class]]
name = "video"
lane = "durable"
utilisation_target_pct = 90
budget_ms = 600000
warm_floor = 1
protection_rank = 2
request_timeout_ms = 600000

[[model]]
name = "whisper"
class = "speech"
profiles.L4 = { service_ms = 120, max_batch = 8, gpu_memory_gb = 6 }
profiles.L40S = { service_ms = 80, max_batch = 8, gpu_memory_gb = 6 }
profiles.H100-80GB = { service_ms = 40, max_batch = 8, gpu_memory_gb = 6, mig_profiles = ["1g.10gb"] }
# What GET /v2/models/whisper reports to clients: 16 kHz audio in, token ids out.
inputs = [{ name = "audio", datatype = "FP32", shape = [-1, -1] }]
outputs = [{ name = "tokens", datatype = "INT64", shape = [-1, -1] }]

[[model]]
name = "sdxl"
class = "image"
profiles.L40S = { service_ms = 900, max_batch = 2, gpu_memory_gb = 16 }
profiles.H100-80GB = { service_ms = 450, max_batch = 4, gpu_memory_gb = 16 }

[[model]]
name = "llama-3-8b"
class = "chat"
# service_ms: a typical whole answer (Retry-After and queue estimates before any is measured).
profiles.L40S = { service_ms = 3000, max_batch = 32, gpu_memory_gb = 20, tokens_per_s = 1500 }
profiles.H100-80GB = { service_ms = 1500, max_batch = 64, gpu_memory_gb = 20, tokens_per_s = 4000 }
llm = { context_tokens = 8192, default_max_tokens = 64 }

[[model]]
name = "bge-small"
class = "embed"
# An embedding model: POST /v1/embeddings only, metered by input tokens.
profiles.L4 = { service_ms = 20, max_batch = 32, gpu_memory_gb = 2, tokens_per_s = 20000 }
profiles.H100-80GB = { service_ms = 8, max_batch = 64, gpu_memory_gb = 2, tokens_per_s = 60000, mig_profiles = ["1g.10gb"] }
llm = { context_tokens = 512, default_max_tokens = 1, prefix_affinity_tokens = 0, task = "embed" }

[[model]]
name = "wan-video"
class = "video"
# ~45 GPU-seconds a clip in production; 15 s here so a dev job finishes while you watch.
profiles.H100-80GB = { service_ms = 15000, max_batch = 1, gpu_memory_gb = 70 }
"#;

#[derive(serde::Deserialize)]
struct DevRegistry {
    class: Vec<crate::registry::Class>,
    model: Vec<crate::registry::Model>,
}

/// Starts the simulated agents; the controllers place the replicas (warm floors).
async fn start_agents(controller: &str, data_dir: &std::path::Path) -> Result<Vec<(String, Agent)>, DevError> {
    let mut agents = Vec::new();
    for (node, pool, product, count, tier) in DEV_NODES.iter() {
        let backend = SimBackend::from_toml(&format!(
            "node = \"{node}\"\n[[gpu]]\nproduct = \"{product}\"\ncount = {count}\n"
        ))
        .map_err(|e| DevError::Other(e.to_string()))?;
        let cfg = AgentConfig {
            node_id: node.to_string(),
            controllers: vec![controller.to_string()],
            pool: pool.to_string(),
            labels: [
                ("product".to_string(), product.to_string()),
                (crate::ledger::TIER_LABEL.to_string(), tier.to_string()),
            ]
            .into_iter()
            .collect(),
            data_dir: data_dir.join("agents").join(node),
            heartbeat: Duration::from_secs(1),
            replica_host: "127.0.0.1".into(),
            results_store: data_dir.join("results").display().to_string(),
            backend: laneway_agent::config::Backend::Nvml,
            replicas: Vec::new(),
            // The controller's /metrics covers dev mode's in-process agents.
            metrics_listen: None,
            credentials: laneway_agent::identity::Credentials::Insecure,
        };
        let agent = laneway_agent::runtime::start(cfg, Arc::new(backend))
            .await
            .map_err(|e| DevError::Other(format!("simulated agent {node}: {e}")))?;
        agents.push((node.to_string(), agent));
    }
    Ok(agents)
}

/// Points every example model at the simulated model server next to this binary (`None`: it
/// is not there, and no replica can run).
fn with_sim_runtime(registry: &mut DevRegistry) -> bool {
    let Some(bin) = std::env::current_exe()
        .ok()
        .map(|p| p.with_file_name("laneway-sim-model"))
        .filter(|p| p.exists())
    else {
        for c in &mut registry.class {
            c.warm_floor = 0;
        }
        return false;
    };
    for m in &mut registry.model {
        if let Some(llm) = &m.llm {
            m.runtime.command = sim_llm_command(&bin, m, llm);
            m.runtime.health_path = "/health".into();
            m.runtime.in_flight = Some(laneway_agent::supervisor::InFlightProbe {
                waiting: Some("vllm:num_requests_waiting".into()),
                kv_cache: Some("vllm:gpu_cache_usage_perc".into()),
                ..laneway_agent::supervisor::InFlightProbe::in_flight(
                    "/metrics",
                    laneway_agent::sim_model::IN_FLIGHT_METRIC,
                )
            });
            continue;
        }
        let service: Vec<String> = m
            .profiles
            .iter()
            .map(|(p, prof)| format!("{p}={}", prof.service_ms.as_ms()))
            .collect();
        m.runtime.command = vec![
            bin.display().to_string(),
            "--listen".into(),
            "127.0.0.1:{port}".into(),
            "--model".into(),
            "{model}".into(),
            "--product".into(),
            "{product}".into(),
            "--service-ms".into(),
            service.join(","),
            "--max-batch".into(),
            "{max_batch}".into(),
        ];
        m.runtime.in_flight = Some(laneway_agent::supervisor::InFlightProbe::in_flight(
            "/metrics",
            laneway_agent::sim_model::IN_FLIGHT_METRIC,
        ));
        // The simulator reads binary tensors, as Triton and MLServer do.
        m.runtime.binary_tensors = true;
    }
    true
}

/// Writes two later versions of whisper next to the data: version 2, as fast as version 1,
/// and version 3, three times the GPU time per request (under the lane's objective, so only its
/// cost gives it away). `lanectl model deploy` + `lanectl rollout start` show a promotion and
/// an automatic rollback.
fn write_rollout_examples(registry: &DevRegistry, dir: &std::path::Path) -> Result<Vec<PathBuf>, DevError> {
    let Some(v1) = registry.model.iter().find(|m| m.name == "whisper") else {
        return Ok(Vec::new());
    };
    let mut versions = DevRegistry {
        class: Vec::new(),
        model: vec![
            crate::registry::Model {
                version: "2".into(),
                ..v1.clone()
            },
            crate::registry::Model {
                version: "3".into(),
                profiles: v1
                    .profiles
                    .iter()
                    .map(|(p, prof)| {
                        let slower = crate::registry::Millis::from_ms(prof.service_ms.as_ms() * 3.0);
                        (
                            p.clone(),
                            crate::registry::Profile {
                                service_ms: slower,
                                ..prof.clone()
                            },
                        )
                    })
                    .collect(),
                ..v1.clone()
            },
        ],
    };
    with_sim_runtime(&mut versions);
    std::fs::create_dir_all(dir).map_err(|e| DevError::Other(format!("{}: {e}", dir.display())))?;
    let mut files = Vec::new();
    for (m, name) in versions
        .model
        .iter()
        .zip(["whisper-v2.json", "whisper-v3-3x-gpu-time.json"])
    {
        let path = dir.join(name);
        let json = serde_json::to_string_pretty(m).map_err(|e| DevError::Other(e.to_string()))?;
        std::fs::write(&path, json).map_err(|e| DevError::Other(format!("{}: {e}", path.display())))?;
        files.push(path);
    }
    Ok(files)
}

/// The simulated LLM server's command for a language model: decode throughput from the
/// profiles, a KV cache of what the card's memory holds beside the weights (an 8B model with
/// grouped-query attention keeps about 8,192 tokens per GB).
fn sim_llm_command(bin: &std::path::Path, m: &crate::registry::Model, llm: &crate::registry::LlmSpec) -> Vec<String> {
    let card_gb = |product: &str| -> u32 {
        match product {
            "L4" => 24,
            "L40S" => 48,
            "H200" => 141,
            _ => 80,
        }
    };
    let tps: Vec<String> = m
        .profiles
        .iter()
        .filter_map(|(p, prof)| Some(format!("{p}={}", prof.tokens_per_s?)))
        .collect();
    let kv: Vec<String> = m
        .profiles
        .iter()
        .map(|(p, prof)| format!("{p}={}", card_gb(p).saturating_sub(prof.gpu_memory_gb).max(1) * 8192))
        .collect();
    [
        bin.display().to_string().as_str(),
        "--llm",
        "--listen",
        "127.0.0.1:{port}",
        "--model",
        "{model}",
        "--product",
        "{product}",
        "--tokens-per-s",
        &tps.join(","),
        "--kv-cache-tokens",
        &kv.join(","),
        "--max-batch",
        "{max_batch}",
        "--context-tokens",
        &llm.context_tokens.to_string(),
        "--default-max-tokens",
        &llm.default_max_tokens.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// Commits a registry command on the dev controller.
async fn commit(controller: &Controller, command: crate::command::Command) -> Result<(), DevError> {
    let resp = controller
        .raft
        .client_write(crate::command::CommandEnvelope::new(command))
        .await
        .map_err(|e| DevError::Other(format!("registering the dev examples: {e}")))?;
    match resp.data.rejected {
        Some(why) => Err(DevError::Other(format!("registering the dev examples: {why}"))),
        None => Ok(()),
    }
}

/// Registers the example classes and models and issues the `dev` tenant a fresh key.
async fn register_examples(controller: &Controller, registry: &DevRegistry) -> Result<String, DevError> {
    use crate::auth::new_api_key;
    use crate::command::Command;
    use crate::registry::{hash_key, Tenant};
    for c in &registry.class {
        commit(controller, Command::PutClass(c.clone())).await?;
    }
    for m in &registry.model {
        commit(controller, Command::PutModel(m.clone())).await?;
    }
    if controller.state.with_ledger(|l, _| l.prices.is_empty()) {
        for (product, prices) in DEV_PRICES {
            for (tier, usd) in crate::ledger::Tier::ALL.into_iter().zip(prices) {
                let micros = crate::ledger::usd_to_micros(*usd).map_err(DevError::Other)?;
                commit(
                    controller,
                    Command::SetPrice {
                        product: product.to_string(),
                        tier,
                        micros_per_hour: Some(micros),
                    },
                )
                .await?;
            }
        }
    }
    let key = new_api_key();
    let exists = controller.state.registry().tenants.contains_key("dev");
    let cmd = if exists {
        Command::RotateTenantKey {
            tenant: "dev".into(),
            key_sha256: hash_key(&key),
        }
    } else {
        Command::CreateTenant(Tenant {
            name: "dev".into(),
            key_sha256: hash_key(&key),
            limits: Default::default(),
        })
    };
    commit(controller, cmd).await?;
    Ok(key)
}

/// Commits dev mode's MIG layouts once their nodes have registered.
async fn set_mig_layouts(controller: &Controller) -> Result<(), DevError> {
    for (node, profiles) in DEV_MIG {
        let Some(&(_, _, _, count, _)) = DEV_NODES.iter().find(|n| n.0 == *node) else {
            continue;
        };
        let registered = tokio::time::timeout(Duration::from_secs(10), async {
            while controller.state.node_flags(node).is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        if registered.is_err() {
            return Err(DevError::Other(format!("simulated node {node} did not register")));
        }
        commit(
            controller,
            crate::command::Command::SetMigLayout {
                node_id: node.to_string(),
                gpu: format!("GPU-sim-{node}-{}", count - 1),
                profiles: profiles.iter().map(|p| p.to_string()).collect(),
            },
        )
        .await?;
    }
    Ok(())
}

/// Waits (up to 30 s) until the router can route `model`.
pub async fn wait_routable(controller: &Controller, model: &str) -> bool {
    wait_routable_for(controller, model, Duration::from_secs(30)).await
}

/// [`wait_routable`] with its own bound (a real model server starts slower than the simulator).
pub async fn wait_routable_for(controller: &Controller, model: &str, bound: Duration) -> bool {
    tokio::time::timeout(bound, async {
        loop {
            if controller
                .router
                .table()
                .models
                .get(model)
                .is_some_and(|m| !m.replicas.is_empty())
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .is_ok()
}

/// Starts a single-node cluster and initializes it if its data dir is new.
pub async fn start(args: DevArgs) -> Result<DevController, DevError> {
    // Dev mode has no authentication at all: it stays on this host.
    for (flag, addr) in [("--listen", args.listen), ("--router-listen", args.router_listen)] {
        if !addr.ip().is_loopback() {
            return Err(DevError::Other(format!(
                "{flag} {addr}: dev mode has no authentication, so it listens on loopback only (127.0.0.1 or [::1]); for a cluster other hosts reach, run `laneway-control run` with TLS"
            )));
        }
    }
    let (data_dir, temp) = match args.data_dir {
        Some(d) => (d, None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("laneway-dev-")
                .tempdir()
                .map_err(|e| DevError::Other(format!("cannot create a temp data dir: {e}")))?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let cfg = ControllerConfig {
        node_id: 1,
        cluster_name: "dev".into(),
        listen: args.listen,
        advertise: None,
        data_dir: data_dir.clone(),
        raft: RaftSettings::default(),
        max_admin_request_bytes: 1024 * 1024,
        node_dead_after: Duration::from_secs(3),
        results_store: data_dir.join("results").display().to_string(),
        provision: args
            .provision
            .as_deref()
            .map(crate::provision::ProvisionConfig::load)
            .transpose()
            .map_err(|e| DevError::Other(e.to_string()))?,
        router: crate::router::server::RouterSettings {
            listen: Some(args.router_listen),
            ..Default::default()
        },
        // Dev mode is one machine and says so: plaintext, no authorization.
        tls: None,
        issuer: None,
    };
    let controller = server::start(cfg).await.map_err(DevError::Start)?;
    let initialized = controller
        .raft
        .is_initialized()
        .await
        .map_err(|e| DevError::Other(e.to_string()))?;
    if !initialized {
        let nodes = std::collections::BTreeMap::from([(
            1u64,
            crate::node::ControllerNode {
                addr: controller.advertise.clone(),
            },
        )]);
        controller
            .raft
            .initialize(nodes)
            .await
            .map_err(|e| DevError::Other(format!("initializing the dev cluster: {e}")))?;
    }
    controller
        .raft
        .wait(Some(Duration::from_secs(10)))
        .current_leader(1, "dev controller becomes leader")
        .await
        .map_err(|e| DevError::Other(format!("the dev controller did not become leader: {e}")))?;
    // Dev mode's cluster has one member, this binary: every format it knows is allowed.
    commit(
        &controller,
        crate::command::Command::PutSetting {
            key: crate::command::FORMAT_SETTING.into(),
            value: crate::command::COMMAND_FORMAT.to_string(),
        },
    )
    .await?;
    let mut registry: DevRegistry =
        toml::from_str(DEV_REGISTRY).map_err(|e| DevError::Other(format!("dev registry: {e}")))?;
    let replicas_running = with_sim_runtime(&mut registry);
    let real = args.real_runtimes.then(|| real::prepare(&data_dir)).transpose()?;
    if let Some(real) = &real {
        registry.class.extend(real.classes.iter().cloned());
        registry.model.extend(real.models.iter().cloned());
    }
    let rollout_examples = if replicas_running {
        write_rollout_examples(&registry, &data_dir.join("examples"))?
    } else {
        Vec::new()
    };
    let api_key = register_examples(&controller, &registry).await?;
    let agents = start_agents(&controller.advertise, &data_dir).await?;
    set_mig_layouts(&controller).await?;
    if replicas_running {
        for m in ["whisper", "sdxl", "llama-3-8b", "bge-small"] {
            if !wait_routable(&controller, m).await {
                tracing::warn!(model = m, "no routable replica after 30 s");
            }
        }
    }
    let real_runtimes = real.map(|r| r.served);
    for m in real_runtimes.iter().flat_map(|s| s.models.iter().map(|m| &m.name)) {
        // Its start-up budget: MLServer takes seconds, not milliseconds, to load a model.
        if !wait_routable_for(&controller, m, Duration::from_secs(120)).await {
            tracing::warn!(model = %m, "no routable replica of a real runtime after 120 s; its log is under the agent's replicas/ directory");
        }
    }
    Ok(DevController {
        rollout_examples,
        real_runtimes,
        router_addr: controller.router_addr,
        controller,
        data_dir,
        agents,
        replicas_running,
        api_key,
        _temp: temp,
    })
}

/// Why dev mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    #[error(transparent)]
    Start(StartError),
    #[error("{0}")]
    Other(String),
}
