//! `lanectl price …` and `lanectl ledger`: what each card costs, and what each lane, model and
//! tenant used and cost, traffic share and cost share side by side.

use std::fmt::Write as _;
use std::time::Duration;

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_core::ledger::query::LedgerReport;
use laneway_proto::admin::{LedgerRequest, ListRegistryRequest, SetPriceRequest};
use serde_json::json;

use super::{print, Output};

#[derive(Subcommand)]
pub enum PriceCmd {
    /// Set what one card of a product costs on a tier, US dollars per GPU-hour. Usage is
    /// priced when it is committed: a change applies from now on, never to the past.
    Set {
        /// GPU product as agents report it (L4, L40S, H100-80GB, H200, ...).
        product: String,
        /// reserved, on-demand or spot (a node's tier is its `tier` label; none = on-demand).
        #[arg(long)]
        tier: String,
        /// US dollars per GPU-hour, e.g. 3.50.
        usd_per_hour: f64,
    },
    /// Remove a product's price on a tier (its usage is then reported as unpriced).
    Remove {
        product: String,
        #[arg(long)]
        tier: String,
    },
    /// Every price.
    List,
}

pub async fn price(client: &AdminClient, out: Output, cmd: PriceCmd) -> anyhow::Result<()> {
    let (product, tier, usd_per_hour, remove) = match cmd {
        PriceCmd::List => {
            let r = client
                .call(|mut c| async move { c.list_registry(ListRegistryRequest { kind: "prices".into() }).await })
                .await?;
            let prices: Vec<serde_json::Value> = r
                .json
                .iter()
                .map(|j| serde_json::from_str(j))
                .collect::<Result<_, _>>()?;
            print(out, json!(prices), || {
                if prices.is_empty() {
                    return "no prices set; `lanectl price set H100-80GB --tier on-demand 3.50` sets one".into();
                }
                let mut s = format!("{:<14} {:<10} {:>10}\n", "PRODUCT", "TIER", "$/GPU-HOUR");
                for p in &prices {
                    let _ = writeln!(
                        s,
                        "{:<14} {:<10} {:>10.2}",
                        p["product"].as_str().unwrap_or(""),
                        p["tier"].as_str().unwrap_or(""),
                        p["usd_per_hour"].as_f64().unwrap_or(0.0)
                    );
                }
                s.trim_end().to_string()
            });
            return Ok(());
        }
        PriceCmd::Set {
            product,
            tier,
            usd_per_hour,
        } => (product, tier, usd_per_hour, false),
        PriceCmd::Remove { product, tier } => (product, tier, 0.0, true),
    };
    let r = client
        .call(|mut c| {
            let req = SetPriceRequest {
                product: product.clone(),
                tier: tier.clone(),
                usd_per_hour,
                remove,
            };
            async move { c.set_price(req).await }
        })
        .await?;
    print(out, json!({"log_index": r.log_index}), || {
        if remove {
            format!("removed the {tier} price of {product} (log index {})", r.log_index)
        } else {
            format!(
                "{product} on {tier}: ${usd_per_hour:.2} per GPU-hour from now on (log index {})",
                r.log_index
            )
        }
    });
    Ok(())
}

/// `lanectl ledger`.
pub async fn ledger(client: &AdminClient, out: Output, by: &str, since: &str) -> anyhow::Result<()> {
    let window: Duration = humantime::parse_duration(since)
        .map_err(|e| anyhow::anyhow!("--since {since:?}: {e}; give a duration such as 15m, 1h or 7d"))?;
    let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
    let r = client
        .call(|mut c| {
            let by = by.to_string();
            async move { c.ledger(LedgerRequest { by, window_ms }).await }
        })
        .await?;
    let doc = r
        .json
        .first()
        .ok_or_else(|| anyhow::anyhow!("the controller answered without a ledger"))?;
    let report: LedgerReport = serde_json::from_str(doc)?;
    print(out, serde_json::to_value(&report)?, || render(&report, since));
    Ok(())
}

/// The ledger as a table: traffic share and cost share on the same row.
pub fn render(r: &LedgerReport, since: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "ledger by {} over the last {since} (requests metered by every router, jobs when they finish)\n",
        serde_json::to_value(r.by)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default()
    );
    let header = format!(
        "{:<28} {:<8} {:>10} {:>8} {:>11} {:>11} {:>8} {:>11}",
        "NAME", "LANE", "REQUESTS", "TRAFFIC", "GPU-SEC", "COST $", "COST%", "$/1K REQ"
    );
    let _ = writeln!(s, "{header}");
    let line = |s: &mut String, x: &laneway_core::ledger::query::LedgerRow| {
        let _ = writeln!(
            s,
            "{:<28} {:<8} {:>10} {:>7.1}% {:>11.1} {:>11.4} {:>7.1}% {:>11.4}",
            truncate(&x.name, 28),
            x.lane,
            x.requests,
            x.traffic_share_pct,
            x.gpu_seconds,
            x.cost_usd,
            x.cost_share_pct,
            x.cost_per_1k_requests_usd
        );
    };
    for x in &r.rows {
        line(&mut s, x);
    }
    line(&mut s, &r.total);
    if r.total.input_tokens + r.total.output_tokens > 0 {
        let _ = writeln!(
            s,
            "\n{:<28} {:>14} {:>14} {:>12} {:>14}",
            "LANGUAGE MODELS", "INPUT TOK", "OUTPUT TOK", "$/1M TOK", "$/1M OUT TOK"
        );
        let money = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
        for x in r
            .rows
            .iter()
            .chain([&r.total])
            .filter(|x| x.input_tokens + x.output_tokens > 0)
        {
            let _ = writeln!(
                s,
                "{:<28} {:>14} {:>14} {:>12} {:>14}",
                truncate(&x.name, 28),
                x.input_tokens,
                x.output_tokens,
                money(x.cost_per_1m_tokens_usd),
                money(x.cost_per_1m_output_tokens_usd)
            );
        }
    }
    if r.total.unpriced_gpu_seconds > 0.0 {
        let _ = writeln!(
            s,
            "\n{:.1} GPU-seconds ran on cards with no price for their tier and are not in the cost: set one with `lanectl price set PRODUCT --tier TIER USD`",
            r.total.unpriced_gpu_seconds
        );
    }
    let _ = writeln!(s, "\nfleet cost now: ${:.2}/hour", r.fleet_usd_per_hour);
    let _ = writeln!(s, "{:<16} {:<10} {:>5} {:>10}", "POOL", "TIER", "GPUS", "$/HOUR");
    for p in &r.fleet {
        let unpriced = if p.unpriced_gpus > 0 {
            format!("  ({} unpriced)", p.unpriced_gpus)
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "{:<16} {:<10} {:>5} {:>10.2}{unpriced}",
            p.pool, p.tier, p.gpus, p.usd_per_hour
        );
    }
    if !r.events.is_empty() {
        let _ = writeln!(s, "\nevents:");
        for e in &r.events {
            let _ = writeln!(
                s,
                "  {} {}: {}",
                laneway_core::ledger::fmt_unix_ms(e.at_ms),
                e.kind,
                e.message
            );
        }
    }
    s.trim_end().to_string()
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}
