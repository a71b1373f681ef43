//! The agent's side of the durable lane: run the jobs the controllers assigned to this node on
//! their replicas, write each result to the results store under a key that names the job and
//! its fencing token, and report the outcome until the controllers have settled it.
//!
//! Reports wait in a sled **outbox** until the leader acknowledges them (`settled` in a
//! heartbeat reply), so a result computed while no leader was reachable, or just before the
//! agent restarted, is still reported. sled's flush is not an fsync: if a power loss drops an
//! outbox entry, the job is still assigned here with the same token, so the agent runs it again
//! and writes the same key — work is repeated, never lost or published twice.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use laneway_proto::agent::{AssignedJob, JobRef, JobReport};
use tokio::sync::Notify;

use crate::results::ResultStore;
use crate::sim_model::GPU_MS_HEADER;
use crate::supervisor::{ReplicaState, Supervisor};

/// How long a job waits for its replica to be ready before the attempt is given back.
const REPLICA_WAIT: Duration = Duration::from_secs(30);

type Key = (String, u64);

/// Runs assigned jobs and keeps their reports.
#[derive(Clone)]
pub struct JobRunner {
    inner: Arc<Inner>,
}

/// The sled outbox.
///
/// sled 0.34's `flush_async` runs the flush on sled's own bounded IO thread pool, where it
/// waits for buffer writes that need a thread of that same pool: a few concurrent
/// `flush_async` calls exhaust it and every flush in the process deadlocks (seen in tests,
/// with the weight cache's flushes stuck behind them). So the outbox flushes with the blocking
/// `flush` on a tokio blocking thread ([`JobRunner::flush`]), never `flush_async`. sled also
/// flushes when its last handle drops; the handles are dropped on a thread of their own so a
/// slow final flush cannot hold a runtime worker.
struct Outbox(Option<(sled::Tree, sled::Db)>);

impl Outbox {
    fn tree(&self) -> &sled::Tree {
        &self.0.as_ref().expect("outbox open until dropped").0
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        if let Some(handles) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("outbox-close".into())
                .spawn(move || drop(handles));
        }
    }
}

struct Inner {
    store: ResultStore,
    outbox: Outbox,
    sup: Arc<Supervisor>,
    client: reqwest::Client,
    /// Attempts running now, each a `Job{id/token}` actor under the `JobRunner` supervisor.
    running: Mutex<HashSet<Key>>,
    /// The `JobRunner` supervisor (ADR 0018): a panicking attempt is run again after its
    /// back-off (attempts are fenced by their token, so a repeat is safe).
    runner: ractor::ActorRef<laneway_actors::SupervisorMsg>,
    runner_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Woken when a report is ready, so it goes out now instead of on the next beat.
    wake: Arc<Notify>,
}

/// Name of the job attempts' supervisor on the board.
pub const RUNNER: &str = "JobRunner";

/// An attempt's actor name: `Job{id/token}`.
fn actor_name(key: &Key) -> String {
    format!("Job{{{}/{}}}", key.0, key.1)
}

fn outbox_key(job_id: &str, token: u64) -> Vec<u8> {
    format!("{job_id}/{token}").into_bytes()
}

fn encode(r: &JobReport) -> Vec<u8> {
    prost::Message::encode_to_vec(r)
}

impl JobRunner {
    /// Opens the outbox under `data_dir`.
    pub fn open(data_dir: &Path, store: ResultStore, sup: Arc<Supervisor>) -> Result<Self, String> {
        let path = data_dir.join("jobs.sled");
        let db = crate::local_db::open(&path).map_err(|e| format!("opening the job outbox {}: {e}", path.display()))?;
        let outbox = db
            .open_tree("outbox")
            .map_err(|e| format!("opening the job outbox {}: {e}", path.display()))?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let (runner, runner_task) = laneway_actors::start_root_now(laneway_actors::SupervisorArgs::new(
            RUNNER,
            Some("AgentRoot"),
            sup.board().clone(),
        ));
        Ok(JobRunner {
            inner: Arc::new(Inner {
                store,
                outbox: Outbox(Some((outbox, db))),
                runner,
                runner_task: Mutex::new(Some(runner_task)),
                sup,
                client,
                running: Mutex::default(),
                wake: Arc::new(Notify::new()),
            }),
        })
    }

    /// Flushes the outbox on a blocking thread (see [`Outbox`] for why not `flush_async`).
    async fn flush(&self) {
        let this = self.clone();
        let flushed = tokio::task::spawn_blocking(move || this.inner.outbox.tree().flush()).await;
        if let Ok(Err(e)) = flushed {
            tracing::warn!(error = %e, "cannot flush the job outbox; a report lost in a crash makes its job run again");
        }
    }

    /// Notified when a report should go out at once.
    pub fn wake(&self) -> Arc<Notify> {
        self.inner.wake.clone()
    }

    fn finished(&self) -> Vec<JobReport> {
        self.inner
            .outbox
            .tree()
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(_, v)| prost::Message::decode(v.as_ref()).ok())
            .collect()
    }

    /// What goes into the next heartbeat: finished attempts not yet settled, and running ones.
    pub fn reports(&self) -> Vec<JobReport> {
        let mut out = self.finished();
        let done: HashSet<Key> = out.iter().map(|r| (r.job_id.clone(), r.token)).collect();
        let running = lock(&self.inner.running);
        for (id, token) in running.iter() {
            if !done.contains(&(id.clone(), *token)) {
                out.push(JobReport {
                    job_id: id.clone(),
                    token: *token,
                    state: "running".into(),
                    ..JobReport::default()
                });
            }
        }
        out
    }

    /// Reconciles with a heartbeat reply: drop settled reports, start newly assigned jobs,
    /// stop the ones no longer assigned here (cancelled, or reassigned after this node was
    /// declared down).
    pub fn reconcile(&self, assigned: &[AssignedJob], settled: &[JobRef]) {
        for s in settled {
            let _ = self.inner.outbox.tree().remove(outbox_key(&s.job_id, s.token));
        }
        if !settled.is_empty() {
            let this = self.clone();
            tokio::spawn(async move { this.flush().await });
        }
        let want: HashSet<Key> = assigned.iter().map(|a| (a.job_id.clone(), a.token)).collect();
        let mut running = lock(&self.inner.running);
        running.retain(|key| {
            if want.contains(key) {
                return true;
            }
            tracing::info!(job = %key.0, token = key.1, "job no longer assigned here (cancelled or reassigned): stopping it");
            let _ = self
                .inner
                .runner
                .send_message(laneway_actors::SupervisorMsg::Remove(actor_name(key)));
            false
        });
        for a in assigned {
            let key = (a.job_id.clone(), a.token);
            if running.contains(&key) {
                continue;
            }
            if self
                .inner
                .outbox
                .tree()
                .contains_key(outbox_key(&a.job_id, a.token))
                .unwrap_or(false)
            {
                continue;
            }
            if a.input.is_empty() && a.input_uri.is_empty() {
                // Its input was left out because this agent reported the job as running, but
                // it is not running here (a restart): the next reply carries the input again.
                continue;
            }
            let (this, job, done) = (self.clone(), a.clone(), key.clone());
            let attempt = laneway_actors::oneshot::child(actor_name(&key), "job", move || {
                let (this, job, done) = (this.clone(), job.clone(), done.clone());
                async move {
                    this.run(job).await;
                    lock(&this.inner.running).remove(&done);
                }
            });
            if self
                .inner
                .runner
                .send_message(laneway_actors::SupervisorMsg::Add(attempt))
                .is_err()
            {
                tracing::error!(job = %a.job_id, "the agent's job runner is not running; the agent must restart");
                continue;
            }
            running.insert(key);
        }
    }

    /// The `JobRunner` supervisor.
    pub fn runner(&self) -> ractor::ActorRef<laneway_actors::SupervisorMsg> {
        self.inner.runner.clone()
    }

    /// The `JobRunner` supervisor's task, once (the agent exits if it ever ends).
    pub fn take_runner_task(&self) -> Option<tokio::task::JoinHandle<()>> {
        lock(&self.inner.runner_task).take()
    }

    async fn run(&self, job: AssignedJob) {
        // The start goes out now, not on the next beat.
        self.inner.wake.notify_one();
        let report = match self.attempt(&job).await {
            Ok((bytes, gpu_us, content_type)) => JobReport {
                job_id: job.job_id.clone(),
                token: job.token,
                state: "succeeded".into(),
                result_key: job.result_key.clone(),
                result_bytes: bytes,
                gpu_us,
                content_type,
                ..JobReport::default()
            },
            Err((error, retryable)) => {
                tracing::warn!(job = %job.job_id, token = job.token, %error, retryable, "job attempt failed");
                JobReport {
                    job_id: job.job_id.clone(),
                    token: job.token,
                    state: "failed".into(),
                    error,
                    retryable,
                    ..JobReport::default()
                }
            }
        };
        let key = outbox_key(&job.job_id, job.token);
        if let Err(e) = self.inner.outbox.tree().insert(key, encode(&report)) {
            tracing::error!(job = %job.job_id, error = %e, "cannot record a finished job in the outbox; it will run again");
            return;
        }
        self.flush().await;
        self.inner.wake.notify_one();
    }

    /// One attempt: returns (result bytes, GPU µs, content type) or (error, retryable).
    async fn attempt(&self, job: &AssignedJob) -> Result<(u64, u64, String), (String, bool)> {
        let port = self.ready_port(&job.replica_id).await?;
        let input: Bytes = if job.input_uri.is_empty() {
            Bytes::from(job.input.clone())
        } else {
            fetch(&job.input_uri, MAX_INPUT_BYTES).await?
        };
        let url = format!("http://127.0.0.1:{port}/v2/models/{}/infer", job.model);
        let timeout = Duration::from_millis(job.timeout_ms.max(1000));
        let resp = self
            .inner
            .client
            .post(&url)
            .header("content-type", "application/json")
            .header("x-request-id", job.job_id.as_str())
            .timeout(timeout)
            .body(input)
            .send()
            .await
            .map_err(|e| (format!("replica {}: {e}", job.replica_id), true))?;
        let status = resp.status();
        let gpu_us = resp
            .headers()
            .get(GPU_MS_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |ms| (ms * 1000.0) as u64);
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/octet-stream")
            .to_string();
        let body = resp
            .bytes()
            .await
            .map_err(|e| (format!("replica {}: reading the answer: {e}", job.replica_id), true))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).to_string();
            // A 4xx is the model refusing this input: another attempt gets the same answer.
            return Err((format!("replica answered {status}: {text}"), !status.is_client_error()));
        }
        let n = body.len() as u64;
        self.inner
            .store
            .put(&job.result_key, body)
            .await
            .map_err(|e| (e.to_string(), true))?;
        Ok((n, gpu_us, content_type))
    }

    async fn ready_port(&self, replica: &str) -> Result<u16, (String, bool)> {
        let deadline = tokio::time::Instant::now() + REPLICA_WAIT;
        loop {
            let status = self.inner.sup.status();
            match status.iter().find(|s| s.id == replica) {
                Some(s) if s.state == ReplicaState::Ready && s.port != 0 => return Ok(s.port),
                Some(_) if tokio::time::Instant::now() < deadline => {}
                Some(s) => return Err((format!("replica {replica} is not ready ({:?})", s.state), true)),
                None => return Err((format!("replica {replica} does not run on this node"), true)),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Reads an input given by URL (`file://`, `s3://`, …) or absolute local path, through
/// `object_store` as the weight cache reads weights.
/// Largest job input an agent fetches by URI: the replica is handed it whole.
pub const MAX_INPUT_BYTES: u64 = 256 * 1024 * 1024;

/// Fetches a job's input. The controllers let a tenant name only locations the operator
/// allowed for the class; this is the agent's own line behind that: a URL (never a bare
/// path), a file only by a path with no symlink or `..` in it, and at most `max_bytes`.
async fn fetch(uri: &str, max_bytes: u64) -> Result<Bytes, (String, bool)> {
    // Refused: the same on every attempt. Unreachable: worth another.
    let refused = |e: String| (e, false);
    let failed = |e: String| (e, true);
    use futures::StreamExt as _;
    use object_store::ObjectStoreExt;
    let url = url::Url::parse(uri).map_err(|e| refused(format!("input {uri} is not a URL: {e}")))?;
    if url.scheme() == "file" {
        let path = url
            .to_file_path()
            .map_err(|()| refused(format!("input {uri} is not a local file URL")))?;
        let real = tokio::fs::canonicalize(&path)
            .await
            .map_err(|e| refused(format!("input {uri}: {e}")))?;
        if real != path {
            return Err(refused(format!(
                "input {uri} goes through a symlink or '..' (it is {}); give the file's own path",
                real.display()
            )));
        }
    }
    let (store, path) = object_store::parse_url(&url).map_err(|e| refused(format!("input {uri}: {e}")))?;
    let got = store
        .get(&path)
        .await
        .map_err(|e| failed(format!("input {uri}: {e}")))?;
    let too_big = |n: u64| {
        refused(format!(
            "input {uri} is {n} bytes or more, over the {max_bytes}-byte limit of a job input"
        ))
    };
    if got.meta.size > max_bytes {
        return Err(too_big(got.meta.size));
    }
    let mut out = bytes::BytesMut::new();
    let mut stream = got.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| failed(format!("input {uri}: {e}")))?;
        if (out.len() + chunk.len()) as u64 > max_bytes {
            return Err(too_big((out.len() + chunk.len()) as u64));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod fetch_tests {
    use super::fetch;

    /// A job input is read only by its own path, and only up to the limit: a symlink planted
    /// under an allowed directory, or a huge file, is refused without retries.
    #[tokio::test]
    async fn inputs_are_read_by_their_own_path_and_only_up_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let secret = real.join("agent.pem");
        std::fs::write(&secret, "-----BEGIN PRIVATE KEY-----").unwrap();
        let inputs = real.join("inputs");
        std::fs::create_dir(&inputs).unwrap();
        std::fs::write(inputs.join("a.json"), "{\"inputs\": []}").unwrap();
        std::os::unix::fs::symlink(&secret, inputs.join("link.json")).unwrap();
        let url = |p: &std::path::Path| format!("file://{}", p.display());
        assert_eq!(
            &fetch(&url(&inputs.join("a.json")), 1024).await.unwrap()[..],
            b"{\"inputs\": []}"
        );
        let (e, retry) = fetch(&url(&inputs.join("link.json")), 1024).await.unwrap_err();
        assert!(e.contains("symlink") && !retry, "{e}");
        let (e, _) = fetch(&secret.display().to_string(), 1024).await.unwrap_err();
        assert!(e.contains("not a URL"), "a bare path is refused: {e}");
        let (e, retry) = fetch(&url(&inputs.join("a.json")), 4).await.unwrap_err();
        assert!(e.contains("over the 4-byte limit") && !retry, "{e}");
    }
}
