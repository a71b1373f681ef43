//! `lanectl tenant`: tenants, their API keys and their limits per class.

use clap::Subcommand;
use laneway_client::AdminClient;
use laneway_proto::admin::{CreateTenantRequest, NameRequest, SetTenantLimitRequest, TenantKeyReply};
use serde_json::json;

use super::{print, Output};
use crate::registry::{committed, list};

#[derive(Subcommand)]
pub enum TenantCmd {
    /// Create a tenant and print its API key (shown once; only its hash is stored).
    Create {
        name: String,
    },
    List,
    /// Set a tenant's limits on one class (or `*` for every class without its own).
    SetLimit {
        name: String,
        #[arg(long, default_value = "*")]
        class: String,
        /// Requests in flight (queued or running) at once, per router; on a durable lane, jobs
        /// queued or running at once across the whole cluster.
        #[arg(long, required_unless_present = "remove")]
        concurrency: Option<u32>,
        /// Sustained requests per second.
        #[arg(long, required_unless_present = "remove")]
        rate: Option<u32>,
        /// Requests that may arrive at once above the rate. Default: the rate.
        #[arg(long)]
        burst: Option<u32>,
        /// Language-model lanes: input + output tokens per minute (estimated at admission).
        #[arg(long)]
        tokens_per_min: Option<u32>,
        /// Remove the limit on this class instead.
        #[arg(long)]
        remove: bool,
    },
    /// Issue a new API key; the old one stops working once the change is applied.
    RotateKey {
        name: String,
    },
}

fn print_key(out: Output, r: &TenantKeyReply) {
    print(
        out,
        json!({"tenant": r.tenant, "api_key": r.api_key, "log_index": r.log_index}),
        || {
            format!(
                "tenant {}\napi key {}\n(shown once: only its sha256 is stored; send it as `Authorization: Bearer <key>`)",
                r.tenant, r.api_key
            )
        },
    );
}

pub async fn tenant(client: &AdminClient, out: Output, cmd: TenantCmd) -> anyhow::Result<()> {
    match cmd {
        TenantCmd::Create { name } => {
            let r = client
                .call(|mut c| {
                    let name = name.clone();
                    async move { c.create_tenant(CreateTenantRequest { name }).await }
                })
                .await?;
            print_key(out, &r);
        }
        TenantCmd::RotateKey { name } => {
            let r = client
                .call(|mut c| {
                    let name = name.clone();
                    async move { c.rotate_tenant_key(NameRequest { name }).await }
                })
                .await?;
            print_key(out, &r);
        }
        TenantCmd::List => {
            let tenants = list(client, "tenants").await?;
            print(out, json!(tenants), || {
                let mut t = format!("{:<20} LIMITS (class: concurrency, rate/s, burst)", "TENANT");
                for x in &tenants {
                    let limits: Vec<String> = x["limits"]
                        .as_object()
                        .map(|l| {
                            l.iter()
                                .map(|(k, v)| {
                                    let tokens = v["tokens_per_min"]
                                        .as_u64()
                                        .map_or(String::new(), |t| format!(", {t} tok/min"));
                                    format!(
                                        "{k}: {}, {}/s, {}{tokens}",
                                        v["concurrency"], v["rate_per_s"], v["burst"]
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    let limits = if limits.is_empty() {
                        "none".to_string()
                    } else {
                        limits.join("; ")
                    };
                    t.push_str(&format!("\n{:<20} {limits}", x["name"].as_str().unwrap_or("")));
                }
                t
            });
        }
        TenantCmd::SetLimit {
            name,
            class,
            concurrency,
            rate,
            burst,
            tokens_per_min,
            remove,
        } => {
            let req = SetTenantLimitRequest {
                tenant: name.clone(),
                class: class.clone(),
                remove,
                concurrency: concurrency.unwrap_or(0),
                rate_per_s: rate.unwrap_or(0),
                burst: burst.or(rate).unwrap_or(0),
                tokens_per_min: tokens_per_min.unwrap_or(0),
            };
            let r = client
                .call(|mut c| {
                    let req = req.clone();
                    async move { c.set_tenant_limit(req).await }
                })
                .await?;
            let what = if remove {
                format!("tenant {name}: limit on {class} removed")
            } else {
                let tokens = match tokens_per_min {
                    Some(t) => format!(", {t} tokens/min"),
                    None => String::new(),
                };
                format!(
                    "tenant {name}: {} in flight, {}/s (burst {}){tokens} on {class}",
                    req.concurrency, req.rate_per_s, req.burst
                )
            };
            committed(out, &r, what);
        }
    }
    Ok(())
}
