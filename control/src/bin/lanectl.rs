//! `lanectl`: the operator CLI of a Laneway cluster (gRPC, follows the leader).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use laneway_control::client::AdminClient;
use laneway_control::planner;
use laneway_proto::admin::{
    AddLearnerRequest, DeleteSettingRequest, GetSettingRequest, InitRequest, MembershipReply, NodeStatus,
    PromoteRequest, PutSettingRequest, RemoveRequest, SnapshotRequest, StatusRequest,
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
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = Output::Table, global = true)]
    output: Output,
    /// How long to keep retrying while no controller answers or no leader is known, seconds.
    #[arg(long, default_value_t = 10, global = true)]
    retry_secs: u64,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Cluster membership and health.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Replicated cluster settings (string key/value).
    #[command(subcommand)]
    Settings(SettingsCmd),
    /// Capacity plan from a scenario file: cards, bill, warm floor, tiers, and what 3x/10x
    /// traffic does before new cards arrive (pure computation; no cluster needed).
    Plan {
        /// Scenario TOML (see deploy/examples/fleet.toml).
        scenario: std::path::PathBuf,
        /// Overload factors to plan for.
        #[arg(long, value_delimiter = ',', default_value = "3,10")]
        scale: Vec<f64>,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Initialize a new cluster with the addressed controller as its only voter.
    Init,
    /// Members, leader, term and log indexes of every member.
    Status,
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
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Cmd::Plan { scenario, scale } = &cli.command {
        return plan(scenario, scale, cli.output);
    }
    let client = AdminClient::new(cli.addr.clone()).with_retry_for(Duration::from_secs(cli.retry_secs));
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
        Cmd::Cluster(ClusterCmd::Status) => status(&client, out).await?,
        Cmd::Cluster(ClusterCmd::Add { node_id, node_addr }) => {
            if out == Output::Table {
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
        Cmd::Plan { .. } => unreachable!("handled before connecting"),
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

fn plan(scenario: &std::path::Path, scale: &[f64], out: Output) -> anyhow::Result<()> {
    if let Some(bad) = scale.iter().find(|f| !(f.is_finite() && **f >= 1.0)) {
        anyhow::bail!("--scale {bad}: overload factors must be numbers >= 1, e.g. --scale 3,10");
    }
    let scenario = planner::Scenario::from_file(scenario)?;
    let plan = planner::plan(&scenario, scale)?;
    match out {
        Output::Json => println!("{}", serde_json::to_string_pretty(&plan)?),
        Output::Table => print!("{}", planner::report::render(&plan)),
    }
    Ok(())
}

fn print(out: Output, value: serde_json::Value, table: impl FnOnce() -> String) {
    match out {
        Output::Json => println!("{}", serde_json::to_string_pretty(&value).expect("json")),
        Output::Table => println!("{}", table()),
    }
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
async fn status(client: &AdminClient, out: Output) -> anyhow::Result<()> {
    let first: NodeStatus = client
        .call(|mut c| async move { c.status(StatusRequest {}).await })
        .await?;
    let mut rows = Vec::new();
    for m in &first.members {
        let s = client
            .call_one(&m.addr, |mut c| async move { c.status(StatusRequest {}).await })
            .await;
        rows.push((m.clone(), s));
    }
    let leader = first.leader_id;
    match out {
        Output::Json => {
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
            let v = json!({"cluster": first.cluster, "leader_id": leader, "term": first.term,
                           "retired_node_ids": first.retired_node_ids, "members": members});
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        Output::Table => {
            println!(
                "cluster {:?}  leader {}  term {}",
                first.cluster,
                if leader == 0 {
                    "none".to_string()
                } else {
                    leader.to_string()
                },
                first.term
            );
            println!(
                "{:>4}  {:<21} {:<8} {:<12} {:>5} {:>9} {:>9} {:>9} {:>9}  STATE HASH",
                "ID", "ADDR", "ROLE", "STATE", "TERM", "LAST LOG", "COMMITTED", "APPLIED", "SNAPSHOT"
            );
            for (m, s) in &rows {
                match s {
                    Ok(s) => println!(
                        "{:>4}  {:<21} {:<8} {:<12} {:>5} {:>9} {:>9} {:>9} {:>9}  {}",
                        m.node_id,
                        m.addr,
                        m.role,
                        s.state,
                        s.term,
                        s.last_log_index,
                        s.committed_index,
                        s.applied_index,
                        s.snapshot_index,
                        &s.state_hash[..12]
                    ),
                    Err(e) => println!("{:>4}  {:<21} {:<8} unreachable: {e}", m.node_id, m.addr, m.role),
                }
            }
            if !first.retired_node_ids.is_empty() {
                println!("retired node ids (never reusable): {:?}", first.retired_node_ids);
            }
        }
    }
    Ok(())
}
