//! `lanectl actors`: every actor of every controller (or of one agent, `--node`), as a tree:
//! state, restarts, time since its last tick, what it holds and its last error (ADR 0018).

use laneway_client::AdminClient;
use laneway_proto::admin::ActorsRequest;
use serde_json::Value;

use super::Output;

/// Ticks older than this are flagged in the table: a loop that ticks every second or faster
/// has stopped making progress.
const STALE_TICK_MS: u64 = 30_000;

pub async fn actors(client: &AdminClient, given: &[String], out: Output, node: Option<String>) -> anyhow::Result<()> {
    let mut docs: Vec<Value> = Vec::new();
    match node {
        Some(node) => {
            let r = client
                .call(|mut c| {
                    let node = node.clone();
                    async move { c.actors(ActorsRequest { node }).await }
                })
                .await?;
            docs.extend(r.json.iter().filter_map(|j| serde_json::from_str(j).ok()));
        }
        None => {
            let (addr_of, quick) = super::audit::members(client, given).await?;
            for (id, addr) in &addr_of {
                let got = quick
                    .call_one(addr, |mut c| async move {
                        c.actors(ActorsRequest { node: String::new() }).await
                    })
                    .await;
                match got {
                    Ok(r) => docs.extend(r.json.iter().filter_map(|j| serde_json::from_str(j).ok())),
                    Err(e) => {
                        eprintln!("lanectl: controller {id} at {addr} did not answer ({e}); its actors are missing")
                    }
                }
            }
        }
    }
    crate::output::print_records(out, &docs, || table(&docs));
    Ok(())
}

/// The table: each process's tree, children under their supervisor.
fn table(docs: &[Value]) -> String {
    let mut out = format!(
        "{:<20} {:<44} {:<10} {:>8} {:>10}  {:<28} LAST ERROR\n",
        "PROCESS", "ACTOR", "STATE", "RESTARTS", "LAST TICK", "DETAIL"
    );
    let mut processes: Vec<&str> = docs.iter().filter_map(|d| d["process"].as_str()).collect();
    processes.dedup();
    for p in processes {
        let mine: Vec<&Value> = docs.iter().filter(|d| d["process"].as_str() == Some(p)).collect();
        let names: Vec<&str> = mine.iter().filter_map(|d| d["name"].as_str()).collect();
        // Roots: no parent, or a parent this process does not list.
        let mut stack: Vec<(&Value, usize)> = mine
            .iter()
            .rev()
            .filter(|d| d["parent"].as_str().is_none_or(|parent| !names.contains(&parent)))
            .map(|d| (*d, 0))
            .collect();
        while let Some((d, depth)) = stack.pop() {
            out.push_str(&row(p, d, depth));
            let name = d["name"].as_str().unwrap_or_default();
            stack.extend(
                mine.iter()
                    .rev()
                    .filter(|c| c["parent"].as_str() == Some(name))
                    .map(|c| (*c, depth + 1)),
            );
        }
    }
    out
}

fn row(process: &str, d: &Value, depth: usize) -> String {
    let name = format!("{}{}", "  ".repeat(depth), d["name"].as_str().unwrap_or("?"));
    let mut state = d["state"].as_str().unwrap_or("?").to_string();
    if d["crash_loop"].as_bool() == Some(true) {
        state.push_str(" CRASH-LOOP");
    }
    let tick = match d["last_tick_ms_ago"].as_u64() {
        Some(ms) if ms >= STALE_TICK_MS && d["state"] == "running" => format!("{}s STALE", ms / 1000),
        Some(ms) if ms >= 10_000 => format!("{}s", ms / 1000),
        Some(ms) => format!("{ms}ms"),
        None => "-".into(),
    };
    let detail: String = d["detail"].as_str().unwrap_or("").chars().take(28).collect();
    let error: String = d["last_error"].as_str().unwrap_or("").chars().take(100).collect();
    format!(
        "{:<20} {:<44} {:<10} {:>8} {:>10}  {:<28} {}\n",
        process,
        name,
        state,
        d["restarts"].as_u64().unwrap_or(0),
        tick,
        detail,
        error
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_nests_children_under_their_supervisor_and_flags_trouble() {
        let doc = |name: &str, parent: Option<&str>, state: &str, restarts: u64, tick: Option<u64>| {
            serde_json::json!({
                "process": "controller 1", "name": name, "parent": parent, "state": state,
                "restarts": restarts, "last_tick_ms_ago": tick, "detail": "", "last_error": null,
                "crash_loop": restarts >= 10,
            })
        };
        let docs = vec![
            doc("ControllerRoot", None, "running", 0, None),
            doc("LeaderScope", Some("LeadershipWatcher"), "running", 0, None),
            doc("LeadershipWatcher", Some("ControllerRoot"), "running", 0, Some(5)),
            doc("Scheduler", Some("LeaderScope"), "restarting", 12, Some(400)),
            doc("Lane{speech}", Some("LaneSupervisor"), "running", 0, Some(45_000)),
            doc("LaneSupervisor", Some("LeaderScope"), "running", 0, Some(100)),
        ];
        let t = table(&docs);
        let lines: Vec<&str> = t.lines().collect();
        let pos = |s: &str| lines.iter().position(|l| l.contains(s)).unwrap();
        assert!(pos("ControllerRoot") < pos("  LeadershipWatcher"));
        assert!(pos("    LeaderScope") < pos("      Scheduler"));
        assert!(lines[pos("Scheduler")].contains("restarting CRASH-LOOP"), "{t}");
        assert!(lines[pos("Lane{speech}")].contains("45s STALE"), "{t}");
        assert!(lines[pos("Lane{speech}")].contains("        Lane{speech}"), "{t}");
    }
}
