//! `lanectl job`: durable jobs through a router's HTTP API, as the tenant whose API key is given
//! (jobs belong to tenants; the operator's admin API does not read their inputs or results).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use clap::Subcommand;
use serde_json::{json, Value};

use super::{print, Output};

#[derive(clap::Args)]
pub struct JobArgs {
    /// Router base URL.
    #[arg(long, env = "LANEWAY_ROUTER", default_value = "http://127.0.0.1:8080")]
    router: String,
    /// Tenant API key (`lanectl tenant create` prints one).
    #[arg(long, env = "LANEWAY_API_KEY", hide_env_values = true)]
    api_key: String,
    #[command(subcommand)]
    command: JobCmd,
}

#[derive(Subcommand)]
pub enum JobCmd {
    /// Submit a job to a durable model; `--wait` follows it to its result.
    Submit {
        /// Model (of a durable class).
        #[arg(long)]
        model: String,
        /// File with the inference request (JSON), or `-` for stdin. Default: a small test input.
        #[arg(long, conflicts_with = "input_uri")]
        input: Option<PathBuf>,
        /// URL of the input, for inputs over 64 KiB.
        #[arg(long)]
        input_uri: Option<String>,
        /// Resubmitting with the same key returns the same job.
        #[arg(long)]
        idempotency_key: Option<String>,
        #[arg(long)]
        max_attempts: Option<u32>,
        /// Follow the job until it finishes, then print its result.
        #[arg(long)]
        wait: bool,
        /// With --wait: write the result here instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// One job: state, timestamps, attempts, result location.
    Get { job_id: String },
    /// The tenant's jobs, newest first.
    List {
        /// Only this state: queued, assigned, running, succeeded, failed, cancelled.
        #[arg(long)]
        state: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Cancel a job (stops it on its replica if it runs; a finished job is left as it is).
    Cancel { job_id: String },
    /// Download a finished job's result.
    Result {
        job_id: String,
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

struct Api {
    base: String,
    key: String,
    http: reqwest::Client,
}

impl Api {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<(u16, Value)> {
        let url = format!("{}{path}", self.base.trim_end_matches('/'));
        let mut req = self.http.request(method, &url).bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.with_context(|| {
            format!("cannot reach the router at {url}; is a controller running (laneway-control dev)?")
        })?;
        let status = resp.status().as_u16();
        let retry = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let bytes = resp.bytes().await?;
        let mut v: Value =
            serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({"body": String::from_utf8_lossy(&bytes)}));
        if let (Some(r), Some(o)) = (retry, v.as_object_mut()) {
            o.insert("retry_after_s".into(), json!(r));
        }
        Ok((status, v))
    }

    async fn ok(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let (status, v) = self.call(method, path, body).await?;
        if !(200..300).contains(&status) {
            let msg = v["error"].as_str().map_or_else(|| v.to_string(), str::to_string);
            match v.get("retry_after_s") {
                Some(r) => bail!("{status}: {msg} (Retry-After: {} s)", r.as_str().unwrap_or("?")),
                None => bail!("{status}: {msg}"),
            }
        }
        Ok(v)
    }

    async fn result(&self, id: &str) -> anyhow::Result<bytes::Bytes> {
        let url = format!("{}/v1/jobs/{id}/result", self.base.trim_end_matches('/'));
        let resp = self.http.get(&url).bearer_auth(&self.key).send().await?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        if !status.is_success() {
            bail!("{}: {}", status.as_u16(), String::from_utf8_lossy(&bytes));
        }
        Ok(bytes)
    }
}

/// The sim-model's smallest valid inference request.
fn test_input() -> Value {
    json!({"inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES", "data": ["a lighthouse at dusk"]}]})
}

fn line(v: &Value) -> String {
    let s = |k: &str| v[k].as_str().unwrap_or("-").to_string();
    format!(
        "{:<34} {:<12} {:<10} {:>3}/{:<3} {}",
        s("job_id"),
        s("model"),
        s("state"),
        v["attempts"],
        v["max_attempts"],
        v["replica"].as_str().unwrap_or("")
    )
}

fn describe(v: &Value) -> String {
    let mut s = format!(
        "job {}\n  model     {} ({})\n  state     {}\n  attempts  {} of {}\n",
        v["job_id"].as_str().unwrap_or("?"),
        v["model"].as_str().unwrap_or("?"),
        v["class"].as_str().unwrap_or("?"),
        v["state"].as_str().unwrap_or("?"),
        v["attempts"],
        v["max_attempts"]
    );
    for (label, key) in [
        ("submitted", "submitted_unix_ms"),
        ("assigned", "assigned_unix_ms"),
        ("started", "started_unix_ms"),
        ("finished", "finished_unix_ms"),
    ] {
        if let Some(ms) = v[key].as_u64() {
            s.push_str(&format!("  {label:<9} {ms} (unix ms)\n"));
        }
    }
    if let Some(r) = v["replica"].as_str() {
        s.push_str(&format!("  replica   {} on {}\n", r, v["node"].as_str().unwrap_or("?")));
    }
    if let Some(f) = v["failures"].as_array() {
        for f in f {
            s.push_str(&format!("  failure   {}\n", f.as_str().unwrap_or("")));
        }
    }
    if v["result"].is_object() {
        s.push_str(&format!(
            "  result    {} ({} bytes, {:.1} GPU-s)\n",
            v["result"]["location"].as_str().unwrap_or("?"),
            v["result"]["bytes"],
            v["result"]["gpu_seconds"].as_f64().unwrap_or(0.0)
        ));
    }
    s.trim_end().to_string()
}

async fn write_result(api: &Api, id: &str, out: Option<PathBuf>) -> anyhow::Result<()> {
    let bytes = api.result(id).await?;
    match out {
        Some(p) => {
            std::fs::write(&p, &bytes).with_context(|| format!("writing {}", p.display()))?;
            eprintln!("result of {id}: {} bytes written to {}", bytes.len(), p.display());
        }
        None => outln!("{}", String::from_utf8_lossy(&bytes)),
    }
    Ok(())
}

/// Polls a job until it finishes, showing each change of state ([`crate::progress`]).
async fn follow(api: &Api, id: &str) -> anyhow::Result<Value> {
    let mut progress = crate::progress::Progress::start(&format!("job {id}: waiting for it to finish"));
    loop {
        let v = api.ok(reqwest::Method::GET, &format!("/v1/jobs/{id}"), None).await?;
        let state = v["state"].as_str().unwrap_or("?").to_string();
        let attempt = v["attempts"].as_u64().unwrap_or(0);
        let place = v["replica"]
            .as_str()
            .map(|r| format!(" on {r} ({}), attempt {attempt}", v["node"].as_str().unwrap_or("?")))
            .unwrap_or_default();
        progress.step(format!("{state}{place}"));
        if matches!(state.as_str(), "succeeded" | "failed" | "cancelled") {
            return Ok(v);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

pub async fn run(out: Output, args: JobArgs) -> anyhow::Result<()> {
    let api = Api {
        base: args.router,
        key: args.api_key,
        http: reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?,
    };
    match args.command {
        JobCmd::Submit {
            model,
            input,
            input_uri,
            idempotency_key,
            max_attempts,
            wait,
            out: result_out,
        } => {
            let mut body = json!({ "model": model });
            match (input, input_uri) {
                (_, Some(uri)) => body["input_uri"] = json!(uri),
                (Some(p), None) => {
                    let text = if p.as_os_str() == "-" {
                        std::io::read_to_string(std::io::stdin())?
                    } else {
                        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?
                    };
                    body["input"] =
                        serde_json::from_str(&text).map_err(|e| anyhow!("{} is not JSON: {e}", p.display()))?;
                }
                (None, None) => body["input"] = test_input(),
            }
            if let Some(n) = max_attempts {
                body["max_attempts"] = json!(n);
            }
            let url = format!("{}/v1/jobs", api.base.trim_end_matches('/'));
            let mut req = api.http.post(&url).bearer_auth(&api.key).json(&body);
            if let Some(k) = &idempotency_key {
                req = req.header("idempotency-key", k);
            }
            let resp = req
                .send()
                .await
                .with_context(|| format!("cannot reach the router at {url}"))?;
            let status = resp.status();
            let retry = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            if !status.is_success() {
                let msg = v["error"].as_str().unwrap_or("(no message)");
                match retry {
                    Some(r) => bail!("{}: {msg} (Retry-After: {r} s)", status.as_u16()),
                    None => bail!("{}: {msg}", status.as_u16()),
                }
            }
            let id = v["job_id"]
                .as_str()
                .ok_or_else(|| anyhow!("no job id in {v}"))?
                .to_string();
            if !wait {
                print(out, v.clone(), || {
                    format!(
                        "job {id} accepted ({}){}",
                        v["state"].as_str().unwrap_or("queued"),
                        if v["idempotent_replay"].as_bool() == Some(true) {
                            ", the same job as before for this idempotency key"
                        } else {
                            ""
                        }
                    )
                });
                return Ok(());
            }
            eprintln!("job {id} accepted");
            let v = follow(&api, &id).await?;
            if v["state"] != "succeeded" {
                bail!("{}", describe(&v));
            }
            eprintln!("{}", describe(&v));
            write_result(&api, &id, result_out).await
        }
        JobCmd::Get { job_id } => {
            let v = api
                .ok(reqwest::Method::GET, &format!("/v1/jobs/{job_id}"), None)
                .await?;
            print(out, v.clone(), || describe(&v));
            Ok(())
        }
        JobCmd::List { state, limit } => {
            let mut path = format!("/v1/jobs?limit={limit}");
            if let Some(s) = state {
                path.push_str(&format!("&state={s}"));
            }
            let v = api.ok(reqwest::Method::GET, &path, None).await?;
            print(out, v.clone(), || {
                let mut s = format!(
                    "{:<34} {:<12} {:<10} {:>7} {}\n",
                    "JOB", "MODEL", "STATE", "ATTEMPT", "REPLICA"
                );
                for j in v["jobs"].as_array().into_iter().flatten() {
                    s.push_str(&line(j));
                    s.push('\n');
                }
                s.trim_end().to_string()
            });
            Ok(())
        }
        JobCmd::Cancel { job_id } => {
            let v = api
                .ok(reqwest::Method::DELETE, &format!("/v1/jobs/{job_id}"), None)
                .await?;
            print(out, v.clone(), || {
                format!("job {job_id}: {}", v["message"].as_str().unwrap_or("cancelled"))
            });
            Ok(())
        }
        JobCmd::Result { job_id, out: path } => write_result(&api, &job_id, path).await,
    }
}
