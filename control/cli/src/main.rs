//! `lanectl`: the operator CLI of a Laneway cluster (gRPC, follows the leader).

/// `print!` to standard output that ends lanectl quietly when its reader has gone
/// (`lanectl -o json plan … | head`), as Unix tools that die of SIGPIPE do.
macro_rules! out {
    ($($t:tt)*) => { $crate::write_out(format_args!($($t)*), false) };
}

/// `println!` that ends lanectl quietly when its reader has gone (see [`out!`]).
macro_rules! outln {
    () => { $crate::write_out(format_args!(""), true) };
    ($($t:tt)*) => { $crate::write_out(format_args!($($t)*), true) };
}

mod actors;
mod audit;
mod bootstrap;
mod certs;
mod job;
mod lane;
mod ledger;
mod mig;
mod model;
mod node;
mod output;
mod pool;
mod progress;
mod registry;
mod rollout;
mod tenant;
mod token;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use laneway_client::AdminClient;
use laneway_core::clock::unix_ms;
use laneway_core::planner;
use laneway_proto::admin::{
    AddLearnerRequest, DeleteSettingRequest, FinalizeUpgradeRequest, GetSettingRequest, InitRequest, MembershipReply,
    NodeStatus, PromoteRequest, PutSettingRequest, RemoveRequest, SnapshotRequest, StatusRequest,
};
use serde_json::json;

#[derive(Parser)]
#[command(name = "lanectl", version, about = "Operate a Laneway cluster")]
struct Cli {
    /// Controller address(es), `host:port`, comma-separated; any member works.
    #[arg(
        long,
        env = "LANECTL_ADDR",
        default_value = "127.0.0.1:7001",
        value_delimiter = ',',
        global = true
    )]
    addr: Vec<String>,
    /// Output format: `table` for people, `wide` (every field, as columns), `json`, `yaml`.
    #[arg(short, long, value_enum, default_value_t = Output::Table, global = true)]
    output: Output,
    /// How long to keep retrying while no controller answers or no leader is known, seconds.
    #[arg(long, default_value_t = 10, global = true)]
    retry_secs: u64,
    /// The cluster CA's certificate: speak TLS to the controllers.
    #[arg(long, env = "LANECTL_TLS_CA", global = true)]
    tls_ca: Option<std::path::PathBuf>,
    /// Your certificate (viewer, operator or admin), from `lanectl certs issue`.
    #[arg(long, env = "LANECTL_TLS_CERT", global = true)]
    tls_cert: Option<std::path::PathBuf>,
    /// Your private key.
    #[arg(long, env = "LANECTL_TLS_KEY", global = true)]
    tls_key: Option<std::path::PathBuf>,
    /// An admin bearer token (`lanectl token create --role`), instead of a certificate; with
    /// --tls-ca.
    #[arg(long, env = "LANECTL_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    #[command(subcommand)]
    command: Cmd,
}

pub(crate) use output::{print, Output};

#[derive(Subcommand)]
enum Cmd {
    /// Shell completion for lanectl: `source <(lanectl completion bash)`, or write it where
    /// your shell loads completions (zsh: a file `_lanectl` on $fpath; fish:
    /// ~/.config/fish/completions/lanectl.fish).
    Completion { shell: clap_complete::Shell },
    /// The cluster CA and certificates for controllers, agents and people (offline).
    #[command(subcommand)]
    Certs(certs::CertsCmd),
    /// One-time join tokens for new GPU hosts (admin).
    #[command(subcommand)]
    Token(token::TokenCmd),
    /// Cluster membership and health.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Replicated cluster settings (string key/value).
    #[command(subcommand)]
    Settings(SettingsCmd),
    /// GPU nodes registered by agents.
    #[command(subcommand)]
    Node(node::NodeCmd),
    /// Classes and their lanes (sync, bounded, durable) with live state.
    #[command(subcommand)]
    Lane(lane::LaneCmd),
    /// Durable jobs of a tenant, through a router: submit (--wait), get, list, cancel, result.
    Job(job::JobArgs),
    /// Models: register under a class, list, show, remove.
    #[command(subcommand)]
    Model(model::ModelCmd),
    /// Canary rollouts of a model's new version: start, status (--watch), pause, resume,
    /// promote, abort.
    #[command(subcommand)]
    Rollout(rollout::RolloutCmd),
    /// Tenants: API keys and per-class limits.
    #[command(subcommand)]
    Tenant(tenant::TenantCmd),
    /// What the leader decided and why (scaling, placement, replicas it cannot place) and cost
    /// events, oldest first.
    Events {
        /// Window: the last 15m, 1h, 24h, ...
        #[arg(long, default_value = "1h")]
        since: String,
        /// Keep printing new events as they happen (Ctrl-C stops).
        #[arg(long)]
        follow: bool,
    },
    /// Every actor of every controller (or of one agent with --node): the supervised trees,
    /// each actor's state, restarts, last tick and last error.
    Actors {
        /// An agent's node id: its actors, as its last heartbeat to the leader reported them.
        #[arg(long)]
        node: Option<String>,
    },
    /// Calls that changed the cluster (who, what, when, result), from every controller's
    /// audit log, oldest first.
    Audit {
        /// Window: the last 15m, 1h, 24h, ...
        #[arg(long, default_value = "24h")]
        since: String,
        /// The newest this many entries.
        #[arg(long, default_value_t = 200)]
        limit: usize,
    },
    /// Pool taints: pools only the lanes that tolerate them use.
    #[command(subcommand)]
    Pool(pool::PoolCmd),
    /// MIG layouts of GPUs: set one, list what is wanted and what agents report.
    #[command(subcommand)]
    Mig(mig::MigCmd),
    /// What a card costs per GPU-hour, by product and tier (reserved, on-demand, spot).
    #[command(subcommand)]
    Price(ledger::PriceCmd),
    /// Requests, GPU-seconds and cost per lane, model or tenant, traffic share beside cost
    /// share, and what the fleet costs per hour by pool and tier.
    Ledger {
        /// Group rows by lane, model or tenant.
        #[arg(long, default_value = "lane")]
        by: String,
        /// Window: the last 15m, 1h, 24h, 7d, ... (the ledger keeps 35 days; beyond the last
        /// two hours it counts whole hours).
        #[arg(long, default_value = "1h")]
        since: String,
    },
    /// Capacity plan from a scenario file: cards, bill, warm floor, tiers, and what 3x/10x
    /// traffic does before new cards arrive (pure computation; no cluster needed).
    Plan {
        /// Scenario TOML (see deploy/examples/fleet.toml).
        scenario: std::path::PathBuf,
        /// Overload factors to plan for.
        #[arg(long, value_delimiter = ',', default_value = "3,10")]
        scale: Vec<f64>,
        /// Take lanes and models from the cluster's registry, and traffic from what the
        /// addressed controller's router observed (when it saw enough); the file keeps
        /// prices, cold starts and SLOs.
        #[arg(long)]
        from_cluster: bool,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Initialize a new cluster with the addressed controller as its only voter.
    Init,
    /// Members, leader, term and log indexes of every member.
    Status,
    /// Form a cluster from running controllers, or complete a half-formed one: initializes the
    /// first member when none belongs to a cluster, adds and promotes the others. Safe to run
    /// again (a container orchestrator can run it on every start).
    Bootstrap {
        /// A controller, `ID=HOST:PORT` (repeat for each; the first is initialized).
        #[arg(long = "member", required = true, value_parser = bootstrap::parse_member)]
        members: Vec<(u64, String)>,
        /// How long to wait for every controller to answer and for a leader.
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        wait: Duration,
    },
    /// Add a controller as a learner and wait until it has caught up.
    Add {
        node_id: u64,
        /// `host:port` the other controllers use to reach the new one. (Not named `addr`: that
        /// id belongs to the global `--addr` flag, and clap would let one overwrite the other.)
        #[arg(value_name = "HOST:PORT")]
        node_addr: String,
    },
    /// Promote a caught-up learner to voter.
    Promote { node_id: u64 },
    /// Remove a member. Its node id can never be used again.
    Remove { node_id: u64 },
    /// After upgrading every controller's binary: check that each member answers and can apply
    /// the new command format, then enable it (new commands are refused until then).
    FinalizeUpgrade,
    /// Take a snapshot on the addressed controller and purge its log up to it.
    Snapshot {
        /// Keep the log (only snapshot).
        #[arg(long)]
        no_purge: bool,
    },
}

#[derive(Subcommand)]
enum SettingsCmd {
    /// Read a setting.
    Get {
        key: String,
        /// Confirm with the leader first so the answer is not stale.
        #[arg(long)]
        linearizable: bool,
    },
    /// Write a setting (committed through Raft before this returns).
    Set { key: String, value: String },
    /// Delete a setting.
    Delete { key: String },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lanectl: {e:#}");
            let text = format!("{e:#}");
            if text.contains("h2 protocol error")
                || text.contains("InvalidContentType")
                || text.contains("corrupt message")
            {
                eprintln!("lanectl: hint: the controllers and lanectl disagree about TLS: give --tls-ca, --tls-cert and --tls-key (LANECTL_TLS_*) for a cluster with TLS, none of them for one started with --insecure-dev");
            }
            ExitCode::from(1)
        }
    }
}

/// Exit status when standard output's reader has gone: a process killed by SIGPIPE (128 + 13),
/// which is what a shell pipeline with `pipefail` expects of a writer cut short.
const CLOSED_PIPE_EXIT: i32 = 141;

/// Writes `args` (and a newline) to standard output; a closed pipe ends the process quietly
/// with [`CLOSED_PIPE_EXIT`], any other write error with a message.
pub fn write_out(args: std::fmt::Arguments, newline: bool) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let written = stdout
        .write_fmt(args)
        .and_then(|()| if newline { stdout.write_all(b"\n") } else { Ok(()) })
        .and_then(|()| stdout.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(CLOSED_PIPE_EXIT),
        Err(e) => {
            eprintln!("lanectl: writing to standard output: {e}");
            std::process::exit(1);
        }
    }
}

/// TLS towards the controllers and the bearer token, set once from the flags.
static TLS: std::sync::OnceLock<(Option<tonic::transport::ClientTlsConfig>, Option<String>)> =
    std::sync::OnceLock::new();

/// A client of the controllers at `addrs`, over TLS when `--tls-ca` was given.
pub fn admin_client(addrs: Vec<String>) -> AdminClient {
    let (tls, token) = TLS.get().cloned().unwrap_or_default();
    let client = AdminClient::new(addrs).with_tls(tls);
    match client.with_token(token.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lanectl: {e}");
            std::process::exit(2);
        }
    }
}

fn client_tls(cli: &Cli) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))
    };
    match (&cli.tls_ca, &cli.tls_cert, &cli.tls_key) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => {
            let tls = laneway_pki::Tls::from_pem(read(ca)?, read(cert)?, read(key)?)?;
            Ok(Some(tls.client(laneway_pki::ANY_CONTROLLER)))
        }
        (Some(ca), None, None) => Ok(Some(laneway_pki::client_without_identity(&read(ca)?, laneway_pki::ANY_CONTROLLER))),
        _ => anyhow::bail!("give --tls-ca with --tls-cert and --tls-key together (or --tls-ca alone to check the controllers' identity without one of your own)"),
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Cmd::Completion { shell } = cli.command {
        let mut script = Vec::new();
        clap_complete::generate(
            shell,
            &mut <Cli as clap::CommandFactory>::command(),
            "lanectl",
            &mut script,
        );
        out!("{}", String::from_utf8_lossy(&script));
        return Ok(());
    }
    if matches!(&cli.command, Cmd::Certs(c) if !c.needs_cluster()) {
        let Cmd::Certs(cmd) = cli.command else {
            unreachable!("matched above")
        };
        let out = cli.output;
        let r = certs::run(cmd)?;
        print(out, r.clone(), || {
            r.as_object()
                .map(|o| {
                    o.iter()
                        .map(|(k, v)| format!("{k}: {}", v.as_str().map_or_else(|| v.to_string(), str::to_string)))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default()
        });
        return Ok(());
    }
    if cli.token.is_some() && cli.tls_ca.is_none() {
        anyhow::bail!("--token needs --tls-ca: a bearer token is only ever sent over TLS");
    }
    let _ = TLS.set((client_tls(&cli)?, cli.token.clone()));
    if let Cmd::Job(args) = cli.command {
        return job::run(cli.output, args).await;
    }
    if let Cmd::Plan {
        scenario,
        scale,
        from_cluster: false,
    } = &cli.command
    {
        return plan(scenario, scale, cli.output, None);
    }
    let client = admin_client(cli.addr.clone()).with_retry_for(Duration::from_secs(cli.retry_secs));
    if let Cmd::Plan { scenario, scale, .. } = &cli.command {
        let inputs = registry::cluster_inputs(&client).await?;
        return plan(scenario, scale, cli.output, Some(inputs));
    }
    let out = cli.output;
    match cli.command {
        Cmd::Cluster(ClusterCmd::Init) => {
            let r = client
                .call_one(&cli.addr[0], |mut c| async move { c.init(InitRequest {}).await })
                .await?;
            print(out, json!({"node_id": r.node_id, "cluster": r.cluster}), || {
                format!(
                    "initialized cluster {:?} with node {} as its first voter",
                    r.cluster, r.node_id
                )
            });
        }
        Cmd::Cluster(ClusterCmd::Status) => status(&client, &cli.addr, out).await?,
        Cmd::Cluster(ClusterCmd::Bootstrap { members, wait }) => {
            let r = bootstrap::run(&members, wait).await?;
            print(out, r.clone(), || {
                let done: Vec<&str> = r["done"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|d| d.as_str())
                    .collect();
                if done.is_empty() {
                    format!("the cluster of {} controllers was already formed", members.len())
                } else {
                    format!("cluster of {} controllers: {}", members.len(), done.join(", "))
                }
            });
        }
        Cmd::Cluster(ClusterCmd::FinalizeUpgrade) => {
            let r = client
                .call(|mut c| async move { c.finalize_upgrade(FinalizeUpgradeRequest {}).await })
                .await?;
            let members: Vec<_> = r
                .members
                .iter()
                .map(|m| json!({"node_id": m.node_id, "addr": m.addr, "command_format": m.command_format}))
                .collect();
            print(
                out,
                json!({"command_format": r.command_format, "members": members}),
                || {
                    let each: Vec<String> = r
                        .members
                        .iter()
                        .map(|m| format!("{} ({}): {}", m.node_id, m.addr, m.command_format))
                        .collect();
                    format!(
                        "cluster command format is {}; members: {}",
                        r.command_format,
                        each.join(", ")
                    )
                },
            );
        }
        Cmd::Cluster(ClusterCmd::Add { node_id, node_addr }) => {
            if !out.is_document() {
                eprintln!("adding node {node_id} at {node_addr} as a learner and waiting for it to catch up…");
            }
            let r = client
                .call(|mut c| {
                    let addr = node_addr.clone();
                    async move { c.add_learner(AddLearnerRequest { node_id, addr }).await }
                })
                .await?;
            print_membership(out, &r, &format!("node {node_id} added as a learner"));
        }
        Cmd::Cluster(ClusterCmd::Promote { node_id }) => {
            let r = client
                .call(|mut c| async move { c.promote(PromoteRequest { node_id }).await })
                .await?;
            print_membership(out, &r, &format!("node {node_id} is now a voter"));
        }
        Cmd::Cluster(ClusterCmd::Remove { node_id }) => {
            let r = client
                .call(|mut c| async move { c.remove(RemoveRequest { node_id }).await })
                .await?;
            print_membership(out, &r, &format!("node {node_id} removed; its id is retired"));
        }
        Cmd::Cluster(ClusterCmd::Snapshot { no_purge }) => {
            let r = client
                .call_one(&cli.addr[0], |mut c| async move {
                    c.snapshot(SnapshotRequest { purge: !no_purge }).await
                })
                .await?;
            print(
                out,
                json!({"snapshot_index": r.snapshot_index, "purged_index": r.purged_index}),
                || {
                    format!(
                        "snapshot at index {}, log purged up to {}",
                        r.snapshot_index, r.purged_index
                    )
                },
            );
        }
        Cmd::Settings(SettingsCmd::Get { key, linearizable }) => {
            let r = client
                .call(|mut c| {
                    let key = key.clone();
                    async move { c.get_setting(GetSettingRequest { key, linearizable }).await }
                })
                .await?;
            print(
                out,
                json!({"key": key, "value": r.value, "applied_index": r.applied_index}),
                || match &r.value {
                    Some(v) => v.clone(),
                    None => format!("(not set: {key})"),
                },
            );
        }
        Cmd::Settings(SettingsCmd::Set { key, value }) => {
            let r = client
                .call(|mut c| {
                    let (key, value) = (key.clone(), value.clone());
                    async move { c.put_setting(PutSettingRequest { key, value }).await }
                })
                .await?;
            print(out, json!({"log_index": r.log_index, "previous": r.previous}), || {
                format!("committed at index {}", r.log_index)
            });
        }
        Cmd::Plan { .. } | Cmd::Job(_) => unreachable!("handled before connecting"),
        Cmd::Lane(c) => lane::lane(&client, out, c).await?,
        Cmd::Price(c) => ledger::price(&client, out, c).await?,
        Cmd::Mig(c) => mig::mig(&client, out, c).await?,
        Cmd::Pool(c) => pool::pool(&client, out, c).await?,
        Cmd::Events { since, follow } => {
            let window = humantime::parse_duration(&since)
                .map_err(|e| anyhow::anyhow!("--since {since:?}: {e}; give a duration such as 15m or 1h"))?;
            let mut from = crate::unix_ms().saturating_sub(window.as_millis() as u64);
            loop {
                let evs = events(&client, from).await?;
                output::print_records(out, &evs, || {
                    evs.iter()
                        .map(|e| {
                            format!(
                                "{} {:<16} {:<20} {}\n",
                                laneway_core::ledger::fmt_unix_ms(e["at_ms"].as_u64().unwrap_or(0)),
                                e["kind"].as_str().unwrap_or(""),
                                e["subject"].as_str().unwrap_or(""),
                                e["message"].as_str().unwrap_or("")
                            )
                        })
                        .collect()
                });
                for e in &evs {
                    from = from.max(e["at_ms"].as_u64().unwrap_or(0) + 1);
                }
                if !follow {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        Cmd::Audit { since, limit } => audit::audit(&client, &cli.addr, out, &since, limit).await?,
        Cmd::Actors { node } => actors::actors(&client, &cli.addr, out, node).await?,
        Cmd::Token(c) => token::run(&client, out, c).await?,
        Cmd::Certs(certs::CertsCmd::Revoke { cert, serial, identity }) => {
            let (serial, identity) = certs::revocation(cert, serial, identity)?;
            client
                .call(|mut c| {
                    let (serial, identity) = (serial.clone(), identity.clone());
                    async move {
                        c.revoke_certificate(laneway_proto::admin::RevokeCertificateRequest { serial, identity })
                            .await
                    }
                })
                .await?;
            print(out, json!({"revoked": serial, "identity": identity}), || {
                if serial.is_empty() {
                    format!("every certificate of {identity} issued so far revoked: every controller refuses them from now on")
                } else {
                    format!("certificate {serial} ({identity}) revoked, with every certificate of {identity} issued so far: every controller refuses them from now on")
                }
            });
        }
        Cmd::Certs(_) => unreachable!("offline certs commands are handled before connecting"),
        Cmd::Completion { .. } => unreachable!("completion is handled before connecting"),
        Cmd::Ledger { by, since } => ledger::ledger(&client, out, &by, &since).await?,
        Cmd::Model(c) => model::model(&client, out, c).await?,
        Cmd::Rollout(c) => rollout::rollout(&client, out, c).await?,
        Cmd::Tenant(c) => tenant::tenant(&client, out, c).await?,
        Cmd::Node(c) => node::node(&client, out, c).await?,
        Cmd::Settings(SettingsCmd::Delete { key }) => {
            let r = client
                .call(|mut c| {
                    let key = key.clone();
                    async move { c.delete_setting(DeleteSettingRequest { key }).await }
                })
                .await?;
            print(out, json!({"log_index": r.log_index, "previous": r.previous}), || {
                format!("committed at index {}", r.log_index)
            });
        }
    }
    Ok(())
}

/// The leader's events at or after `since_ms`, oldest first.
pub(crate) async fn events(client: &AdminClient, since_ms: u64) -> anyhow::Result<Vec<serde_json::Value>> {
    let r = client
        .call(|mut c| async move { c.events(laneway_proto::admin::EventsRequest { since_ms }).await })
        .await?;
    r.json
        .iter()
        .map(|j| serde_json::from_str(j).map_err(Into::into))
        .collect()
}

fn plan(
    scenario: &std::path::Path,
    scale: &[f64],
    out: Output,
    cluster: Option<planner::cluster::ClusterInputs>,
) -> anyhow::Result<()> {
    if let Some(bad) = scale.iter().find(|f| !(f.is_finite() && **f >= 1.0)) {
        anyhow::bail!("--scale {bad}: overload factors must be numbers >= 1, e.g. --scale 3,10");
    }
    let scenario = match cluster {
        None => planner::Scenario::from_file(scenario)?,
        Some(inputs) => {
            let text = std::fs::read_to_string(scenario)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", scenario.display()))?;
            let (s, notes) = planner::cluster::scenario_with_cluster(&text, &inputs)?;
            for n in notes {
                eprintln!("lanectl plan: {n}");
            }
            s
        }
    };
    let plan = planner::plan(&scenario, scale)?;
    print(out, serde_json::to_value(&plan)?, || {
        planner::report::render(&plan).trim_end().to_string()
    });
    Ok(())
}

fn print_membership(out: Output, r: &MembershipReply, msg: &str) {
    let members: Vec<_> = r
        .members
        .iter()
        .map(|m| json!({"node_id": m.node_id, "addr": m.addr, "role": m.role}))
        .collect();
    print(out, json!({"log_index": r.log_index, "members": members}), || {
        let mut s = format!("{msg} (log index {})\n", r.log_index);
        for m in &r.members {
            s.push_str(&format!("  {:>4}  {:<8} {}\n", m.node_id, m.role, m.addr));
        }
        s.trim_end().to_string()
    });
}

/// Asks any member for the membership, then every member for its own view.
async fn status(client: &AdminClient, given: &[String], out: Output) -> anyhow::Result<()> {
    let first: NodeStatus = client
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await?;
    // Members answer at the addresses given with --addr first: from outside the members'
    // network (a NAT, published container ports) their advertised addresses may not resolve.
    // Each member's own answer carries its state hash, to compare members.
    let hashed = || StatusRequest { with_state_hash: true };
    let mut by_id = std::collections::HashMap::new();
    for a in given {
        if let Ok(s) = client
            .call_one(a, |mut c| async move { c.status(hashed()).await })
            .await
        {
            by_id.insert(s.node_id, s);
        }
    }
    let mut rows = Vec::new();
    for m in &first.members {
        let s = match by_id.remove(&m.node_id) {
            Some(s) => Ok(s),
            None => {
                client
                    .call_one(&m.addr, |mut c| async move { c.status(hashed()).await })
                    .await
            }
        };
        rows.push((m.clone(), s));
    }
    let leader = first.leader_id;
    let members: Vec<_> = rows
        .iter()
        .map(|(m, s)| match s {
            Ok(s) => json!({
                "node_id": m.node_id, "addr": m.addr, "role": m.role, "reachable": true,
                "state": s.state, "term": s.term, "leader_id": s.leader_id,
                "last_log_index": s.last_log_index, "committed_index": s.committed_index,
                "applied_index": s.applied_index, "snapshot_index": s.snapshot_index,
                "purged_index": s.purged_index, "state_hash": s.state_hash,
            }),
            Err(e) => json!({"node_id": m.node_id, "addr": m.addr, "role": m.role, "reachable": false, "error": e.to_string()}),
        })
        .collect();
    // Router-only processes: each is fed by one controller, and its load is on the leader.
    let mut routers: std::collections::BTreeMap<u32, (u64, laneway_proto::admin::RouterInfo)> = Default::default();
    let mut loads: std::collections::BTreeMap<u32, (u32, u32)> = Default::default();
    for (m, s) in &rows {
        let Ok(s) = s else { continue };
        for l in &s.router_loads {
            loads.insert(l.router, (l.in_flight, l.waiting));
        }
        for r in &s.routers {
            let newer = routers.get(&r.router).is_none_or(|(_, old)| {
                (r.connected, std::cmp::Reverse(r.last_sent_ms_ago))
                    > (old.connected, std::cmp::Reverse(old.last_sent_ms_ago))
            });
            if newer {
                routers.insert(r.router, (m.node_id, r.clone()));
            }
        }
    }
    let router_rows: Vec<_> = routers
        .values()
        .map(|(fed_by, r)| {
            let load = loads.get(&r.router).copied();
            let (in_flight, waiting) = load.unwrap_or_default();
            (*fed_by, r.clone(), in_flight, waiting, load.is_some())
        })
        .collect();
    let routers_json: Vec<_> = router_rows
        .iter()
        .map(|(fed_by, r, in_flight, waiting, reported)| {
            json!({"router": r.router, "addr": r.router_addr, "fed_by": fed_by, "connected": r.connected,
                   "sent_index": r.sent_index, "lag_entries": r.lag_entries, "last_sent_ms_ago": r.last_sent_ms_ago,
                   "in_flight": in_flight, "waiting": waiting, "load_reported": reported})
        })
        .collect();
    let v = json!({"cluster": first.cluster, "leader_id": leader, "term": first.term,
                   "retired_node_ids": first.retired_node_ids, "members": members, "routers": routers_json});
    print(out, v, || {
        let mut t = format!(
            "cluster {:?}  leader {}  term {}\n",
            first.cluster,
            if leader == 0 {
                "none".to_string()
            } else {
                leader.to_string()
            },
            first.term
        );
        t.push_str(&format!(
            "{:>4}  {:<21} {:<8} {:<12} {:>5} {:>9} {:>9} {:>9} {:>9}  STATE HASH\n",
            "ID", "ADDR", "ROLE", "STATE", "TERM", "LAST LOG", "COMMITTED", "APPLIED", "SNAPSHOT"
        ));
        for (m, s) in &rows {
            t.push_str(&match s {
                Ok(s) => format!(
                    "{:>4}  {:<21} {:<8} {:<12} {:>5} {:>9} {:>9} {:>9} {:>9}  {}\n",
                    m.node_id,
                    m.addr,
                    m.role,
                    s.state,
                    s.term,
                    s.last_log_index,
                    s.committed_index,
                    s.applied_index,
                    s.snapshot_index,
                    s.state_hash.get(..12).unwrap_or(&s.state_hash)
                ),
                Err(e) => format!("{:>4}  {:<21} {:<8} unreachable: {e}\n", m.node_id, m.addr, m.role),
            });
        }
        if !router_rows.is_empty() {
            t.push_str(&format!(
                "router-only processes\n{:>6}  {:<21} {:>7} {:<9} {:>9} {:>5} {:>9} {:>9} {:>7}\n",
                "ROUTER", "ADDR", "FED BY", "LINE", "SENT", "LAG", "HEARD", "IN FLIGHT", "WAITING"
            ));
            for (fed_by, r, in_flight, waiting, reported) in &router_rows {
                let (in_flight, waiting) = if *reported {
                    (in_flight.to_string(), waiting.to_string())
                } else {
                    ("-".to_string(), "-".to_string())
                };
                t.push_str(&format!(
                    "{:>6}  {:<21} {:>7} {:<9} {:>9} {:>5} {:>7}ms {:>9} {:>7}\n",
                    r.router,
                    r.router_addr,
                    fed_by,
                    if r.connected { "open" } else { "closed" },
                    r.sent_index,
                    r.lag_entries,
                    r.last_sent_ms_ago,
                    in_flight,
                    waiting
                ));
            }
        }
        if !first.retired_node_ids.is_empty() {
            t.push_str(&format!(
                "retired node ids (never reusable): {:?}",
                first.retired_node_ids
            ));
        }
        t.trim_end().to_string()
    });
    Ok(())
}
