//! The benches' and checkers' HTTP side: a pooled client, one request, closed-loop saturation,
//! open-loop load with latency from the intended send, and processes killed on drop.

use std::collections::BTreeMap;
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use super::pace::pace;

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

/// Latencies of one target in an open-loop run, as they come in.
struct OpenLoop {
    hist: Mutex<Histogram<u64>>,
    failed: Mutex<Failures>,
    /// The slowest acknowledged request of each [`WINDOW`] of intended send times, µs.
    windows: Vec<AtomicU64>,
}

/// The span of intended send times whose slowest request [`Latencies::windows`] keeps.
pub const WINDOW: Duration = Duration::from_millis(100);

/// One target's results of an open-loop run.
pub struct Latencies {
    /// Every acknowledged request's latency from its intended send time, µs.
    pub hist: Histogram<u64>,
    pub failed: Failures,
    /// The slowest acknowledged request of each [`WINDOW`] of intended send times, µs (0 for a
    /// window with none), so a tail can be placed in time: when it was made, against the
    /// servers' logs.
    pub windows: Vec<u64>,
    /// When the first window began, seconds since the Unix epoch.
    pub started_unix_s: f64,
    /// How late the pacer handed each send over, µs after its intended time, for every target
    /// of the run together: the generator's own error, included in `hist`.
    pub pacer_lag: Histogram<u64>,
}

impl Latencies {
    /// Folds `other` (another target of the same run) into this one.
    pub fn merge(&mut self, other: Latencies) -> anyhow::Result<()> {
        self.hist.add(other.hist)?;
        self.failed.merge(other.failed);
        for (mine, theirs) in self.windows.iter_mut().zip(other.windows) {
            *mine = (*mine).max(theirs);
        }
        Ok(())
    }

    /// The `n` windows with the slowest requests, in time order: each window's start (seconds
    /// since the Unix epoch, as servers' logs print it in UTC) and its slowest request, ms.
    pub fn slowest_windows(&self, n: usize) -> serde_json::Value {
        let mut worst: Vec<(usize, u64)> = self
            .windows
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, us)| *us > 0)
            .collect();
        worst.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        worst.truncate(n);
        worst.sort_unstable();
        let at = |i: usize| ((self.started_unix_s + i as f64 * WINDOW.as_secs_f64()) * 10.0).round() / 10.0;
        worst
            .into_iter()
            .map(|(i, us)| serde_json::json!({"at_unix_s": at(i), "max_ms": us as f64 / 1000.0}))
            .collect()
    }
}

/// Open loop at `rate`/s per target for `d`, the targets' arrivals interleaved in the same
/// window so that both see the same machine noise; latency from each intended send time, µs.
///
/// The sends are paced by a thread of their own ([`pace`], ADR 0041); how late each went out
/// comes back in [`Latencies::pacer_lag`].
pub async fn open_loop(targets: &[Target], rate: u64, d: Duration) -> anyhow::Result<Vec<Latencies>> {
    let client = client(256);
    let windows = (d.as_millis() / WINDOW.as_millis()) as usize + 1;
    let results: Vec<Arc<OpenLoop>> = targets
        .iter()
        .map(|_| {
            Ok(Arc::new(OpenLoop {
                hist: Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?),
                failed: Default::default(),
                windows: (0..windows).map(|_| AtomicU64::new(0)).collect(),
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let total_rate = rate * targets.len() as u64;
    let n = total_rate * d.as_secs();
    let lead = Duration::from_millis(50);
    let start = Instant::now() + lead;
    let started_unix_s = (std::time::SystemTime::now() + lead)
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |t| t.as_secs_f64());
    let (targets_owned, out) = (targets.to_vec(), results.clone());
    let paced = pace(total_rate, n, start, move |i, intended| {
        let k = (i % targets_owned.len() as u64) as usize;
        let (client, t, out) = (client.clone(), targets_owned[k].clone(), out[k].clone());
        let window = (i * 1_000 / total_rate / WINDOW.as_millis() as u64) as usize;
        async move {
            match try_send(&client, &t).await {
                Ok(()) => {
                    let us = intended.elapsed().as_micros() as u64;
                    if let Some(w) = out.windows.get(window) {
                        w.fetch_max(us, Ordering::Relaxed);
                    }
                    let _ = out.hist.lock().unwrap_or_else(|p| p.into_inner()).record(us.max(1));
                }
                Err(why) => out.failed.lock().unwrap_or_else(|p| p.into_inner()).add(why),
            }
        }
    })
    .await?;
    Ok(results
        .iter()
        .map(|r| Latencies {
            hist: r.hist.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            failed: r.failed.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            windows: r.windows.iter().map(|w| w.load(Ordering::Relaxed)).collect(),
            started_unix_s,
            pacer_lag: paced.lag.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn latencies(windows: Vec<u64>) -> Latencies {
        Latencies {
            hist: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
            failed: Failures::default(),
            windows,
            started_unix_s: 1_000.0,
            pacer_lag: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
        }
    }

    #[test]
    fn the_slowest_windows_are_listed_in_time_order_with_their_start() {
        let l = latencies(vec![5_000, 90_000, 0, 40_000, 120_000, 7_000]);
        assert_eq!(
            l.slowest_windows(3),
            serde_json::json!([
                {"at_unix_s": 1000.1, "max_ms": 90.0},
                {"at_unix_s": 1000.3, "max_ms": 40.0},
                {"at_unix_s": 1000.4, "max_ms": 120.0},
            ])
        );
        assert_eq!(
            latencies(vec![0, 0]).slowest_windows(3),
            serde_json::json!([]),
            "no acknowledged request"
        );
    }

    /// The pacing thread hands every send over and times each one: two targets at 20/s for a
    /// second against a server that answers at once.
    #[tokio::test]
    async fn the_open_loop_sends_every_request_and_notes_how_late_the_pacer_handed_each_over() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let answer = hyper::service::service_fn(|_| async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"{}"))))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), answer),
                );
            }
        });
        let target = |name| Target {
            name,
            uri: format!("http://{addr}/").parse().unwrap(),
            key: None,
            body: Bytes::from_static(b"{}"),
        };
        let out = open_loop(&[target("a"), target("b")], 20, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(out.len(), 2);
        for l in &out {
            assert_eq!(l.failed.total(), 0);
            assert_eq!(l.hist.len(), 20, "every send of this target answered and timed");
            assert_eq!(l.pacer_lag.len(), 40, "one lag per send of the run, both targets");
        }
    }

    #[test]
    fn merging_targets_keeps_each_windows_slowest() {
        let mut a = latencies(vec![1, 50, 3]);
        a.merge(latencies(vec![4, 2, 6])).unwrap();
        assert_eq!(a.windows, [4, 50, 6]);
    }
}
