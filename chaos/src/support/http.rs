//! The benches' and checkers' HTTP side: a pooled client, one request, closed-loop saturation,
//! open-loop load with latency from the intended send, and processes killed on drop.

use std::collections::BTreeMap;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One request target (the replica directly, a router, an etcd member): where to POST what.
#[derive(Clone)]
pub struct Target {
    pub name: &'static str,
    pub uri: hyper::Uri,
    /// Bearer API key, if the target wants one.
    pub key: Option<String>,
    pub body: Bytes,
}

pub async fn send(client: &HttpClient, t: &Target) -> anyhow::Result<()> {
    try_send(client, t)
        .await
        .map_err(|why| anyhow::anyhow!("{}: {why}", t.name))
}

/// One request; on failure, what gave out in a few words that group alike failures together:
/// the status and the start of the answer's `error`, or the transport error's innermost cause
/// (a connection refused or reset, no file descriptors left, a time-out).
pub async fn try_send(client: &HttpClient, t: &Target) -> Result<(), String> {
    let mut req = hyper::Request::post(t.uri.clone()).header("content-type", "application/json");
    if let Some(k) = &t.key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = req
        .body(Full::new(t.body.clone()))
        .map_err(|e| format!("bad request: {e}"))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("transport: {}", root_cause(&e)))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {}", root_cause(&e)))?
        .to_bytes();
    if status.is_success() {
        return Ok(());
    }
    let error = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| {
            v.get("error")
                .map(|e| e.as_str().map(str::to_owned).unwrap_or_else(|| e.to_string()))
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    Err(format!("{status}: {}", error.chars().take(120).collect::<String>()))
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// Failed requests of a run, counted by what gave out.
#[derive(Debug, Default, Clone)]
pub struct Failures(pub BTreeMap<String, u64>);

impl Failures {
    pub fn add(&mut self, why: String) {
        *self.0.entry(why).or_default() += 1;
    }

    pub fn merge(&mut self, other: Failures) {
        for (why, n) in other.0 {
            *self.0.entry(why).or_default() += n;
        }
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// `{"what gave out": count}`, for a bench's JSON line.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Object(self.0.iter().map(|(k, v)| (k.clone(), (*v).into())).collect())
    }
}

pub fn client(connections: usize) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(connections)
        // Under the router's keep-alive idle timeout (its 5 s header timeout, ADR 0006), as a
        // client should be: hyper's default of 90 s reused connections the router was closing
        // at that instant between two phases ("connection closed before message completed").
        .pool_idle_timeout(Duration::from_secs(4))
        .build(c)
}

/// Closed loop: `connections` clients back to back for `d`, spread over `targets`; successful
/// requests per second and failures.
pub async fn saturate(targets: &[Target], connections: usize, d: Duration) -> anyhow::Result<(f64, Failures)> {
    let client = client(connections);
    let end = Instant::now() + d;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..connections {
        let (client, t) = (client.clone(), targets[i % targets.len()].clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u64, Failures::default());
            while Instant::now() < end {
                match try_send(&client, &t).await {
                    Ok(()) => ok += 1,
                    Err(why) => failed.add(why),
                }
            }
            (ok, failed)
        }));
    }
    let (mut ok, mut failed) = (0, Failures::default());
    for task in tasks {
        let (o, f) = task.await?;
        ok += o;
        failed.merge(f);
    }
    Ok((ok as f64 / start.elapsed().as_secs_f64(), failed))
}

/// Latencies of one target in an open-loop run.
struct OpenLoop {
    hist: Mutex<Histogram<u64>>,
    failed: Mutex<Failures>,
}

/// Open loop at `rate`/s per target for `d`, the targets' arrivals interleaved in the same
/// window so that both see the same machine noise; latency from each intended send time, µs.
pub async fn open_loop(targets: &[Target], rate: u64, d: Duration) -> anyhow::Result<Vec<(Histogram<u64>, Failures)>> {
    let client = client(256);
    let results: Vec<Arc<OpenLoop>> = targets
        .iter()
        .map(|_| {
            Ok(Arc::new(OpenLoop {
                hist: Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?),
                failed: Default::default(),
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let total_rate = rate * targets.len() as u64;
    let n = total_rate * d.as_secs();
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let intended = start + Duration::from_nanos(i * 1_000_000_000 / total_rate);
        tokio::time::sleep_until(intended).await;
        let k = (i % targets.len() as u64) as usize;
        let (client, t, out) = (client.clone(), targets[k].clone(), results[k].clone());
        tasks.push(tokio::spawn(async move {
            match try_send(&client, &t).await {
                Ok(()) => {
                    let us = intended.elapsed().as_micros() as u64;
                    let _ = out.hist.lock().unwrap_or_else(|p| p.into_inner()).record(us.max(1));
                }
                Err(why) => out.failed.lock().unwrap_or_else(|p| p.into_inner()).add(why),
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    Ok(results
        .iter()
        .map(|r| {
            (
                r.hist.lock().unwrap_or_else(|p| p.into_inner()).clone(),
                r.failed.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            )
        })
        .collect())
}

pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub struct KillOnDrop(pub Child);

/// Raises this process's open-file limit (which the processes it starts inherit) to its hard
/// limit, and fails with what to do when even that is below `need`: a saturation run holds a
/// socket per connection here and another in the server it talks to.
pub fn allow_open_files(need: u64) -> anyhow::Result<()> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    if hard < need {
        anyhow::bail!(
            "this run needs about {need} open files and the hard limit is {hard}: raise it (`ulimit -Hn {need}` as root, or `LimitNOFILE=` in a unit) or pass fewer --connections"
        );
    }
    Ok(())
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
