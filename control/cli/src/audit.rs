//! `lanectl audit`: the calls that changed the cluster, from every controller's audit log,
//! merged oldest first.

use std::collections::BTreeMap;
use std::time::Duration;

use laneway_client::AdminClient;
use laneway_proto::admin::{AuditRequest, StatusRequest};
use serde_json::Value;

use super::Output;

/// Every member once, by node id: at the address given with --addr when it answers there
/// (advertised names may not resolve from here), else at its advertised address; and a client
/// with a short call timeout to ask each.
pub async fn members(client: &AdminClient, given: &[String]) -> anyhow::Result<(BTreeMap<u64, String>, AdminClient)> {
    let first = client
        .call(|mut c| async move { c.status(StatusRequest::default()).await })
        .await?;
    let mut addr_of: BTreeMap<u64, String> = first.members.iter().map(|m| (m.node_id, m.addr.clone())).collect();
    let quick = crate::admin_client(Vec::new()).with_call_timeout(Duration::from_secs(3));
    for a in given {
        if let Ok(s) = quick
            .call_one(a, |mut c| async move { c.status(StatusRequest::default()).await })
            .await
        {
            addr_of.insert(s.node_id, a.clone());
        }
    }
    Ok((addr_of, quick))
}

pub async fn audit(
    client: &AdminClient,
    given: &[String],
    out: Output,
    since: &str,
    limit: usize,
) -> anyhow::Result<()> {
    let window = humantime::parse_duration(since)
        .map_err(|e| anyhow::anyhow!("--since {since:?}: {e}; give a duration such as 15m or 24h"))?;
    let since_ms = crate::unix_ms().saturating_sub(window.as_millis() as u64);
    let (addr_of, quick) = members(client, given).await?;
    let mut entries: Vec<Value> = Vec::new();
    for (id, addr) in &addr_of {
        let got = quick
            .call_one(addr, |mut c| async move {
                c.audit(AuditRequest {
                    since_ms,
                    limit: limit as u32,
                })
                .await
            })
            .await;
        match got {
            Ok(r) => entries.extend(r.json.iter().filter_map(|j| serde_json::from_str(j).ok())),
            Err(e) => eprintln!("lanectl: controller {id} at {addr} did not answer ({e}); its entries are missing"),
        }
    }
    entries.sort_by_key(|e| e["unix_ms"].as_u64().unwrap_or(0));
    if entries.len() > limit {
        entries.drain(..entries.len() - limit);
    }
    crate::output::print_records(out, &entries, || {
        let mut t = format!(
            "{:<24} {:>4} {:<21} {:<18} {:<18} TARGET\n",
            "AT", "CTRL", "WHO", "CALL", "RESULT"
        );
        for e in &entries {
            let target = e["target"].as_str().unwrap_or("");
            let target: String = target.chars().take(80).collect();
            t.push_str(&format!(
                "{:<24} {:>4} {:<21} {:<18} {:<18} {}{}\n",
                e["at"].as_str().unwrap_or(""),
                e["controller"].to_string(),
                e["who"].as_str().unwrap_or(""),
                e["call"].as_str().unwrap_or(""),
                e["result"].as_str().unwrap_or(""),
                target,
                e["message"].as_str().map(|m| format!(" — {m}")).unwrap_or_default()
            ));
        }
        t
    });
    Ok(())
}
