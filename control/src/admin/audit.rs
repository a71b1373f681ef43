//! The audit log: every admin call that changes the cluster (membership, settings, registry,
//! tenants, prices, nodes, MIG layouts, snapshots) — who, what, when, and the result — appended
//! as one JSON line to `<data_dir>/audit.log` by the controller that served it, and synced to
//! disk before the call answers. `lanectl audit` reads every controller's log and merges them.
//!
//! The writes and syncs are made by a thread of the log's own (`audit-writer`), which takes
//! every entry queued while it synced the last ones and syncs them with one `fdatasync`: a
//! call waits for its entry's sync without holding a runtime thread, and calls made together
//! share a sync (ADR 0045).
//!
//! What goes in: the caller (peer address, and the identity its credentials name once admin
//! tokens exist), the call, its target (the request's fields; for documents only the name),
//! the outcome (ok, or the gRPC code and message) and how long it took. What never goes in:
//! request documents, replies (an API key is only ever in a reply) and credentials.
//! Reads (status, lists) and the controllers' own calls to each other are not audited.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use serde_json::Value;
use tonic::{Response, Status};

/// One audited call.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub unix_ms: u64,
    /// RFC 3339, UTC, for people reading the file.
    pub at: String,
    /// The controller that served the call.
    pub controller: u64,
    pub who: String,
    pub call: &'static str,
    pub target: String,
    /// "ok" or the gRPC code.
    pub result: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    pub ms: u64,
}

pub struct AuditLog {
    path: PathBuf,
    controller: u64,
    /// Lines for the writer thread, each with who waits for its sync.
    writes: std::sync::mpsc::Sender<Pending>,
    /// Refusals written in the current second, and refusals not written since the last one
    /// that was: anyone who reaches the port can be refused, and must not fill the disk.
    refusals: Mutex<(u64, u32, u64)>,
}

/// Refused calls recorded per second at most; the rest are counted into the next entry.
const REFUSALS_PER_SECOND: u32 = 20;

/// Longest target and message written, in characters: both may carry what a caller sent.
pub const MAX_TARGET_CHARS: usize = 512;
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// Size at which `audit.log` is rotated to `audit.log.1` (and `.1` to `.2`, …).
pub const ROTATE_BYTES: u64 = 64 * 1024 * 1024;
/// Rotated files kept beside the current one; the oldest is deleted.
pub const ROTATED_KEPT: usize = 4;

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog").field("path", &self.path).finish()
    }
}

/// Most entries one query returns.
pub const MAX_ENTRIES: usize = 10_000;

impl AuditLog {
    /// Opens (creating it) the log at `path` for appending, rotated at [`ROTATE_BYTES`].
    pub fn open(path: &Path, controller: u64) -> std::io::Result<AuditLog> {
        Self::open_rotating_at(path, controller, ROTATE_BYTES)
    }

    /// [`AuditLog::open`], rotated at `max_bytes`.
    pub fn open_rotating_at(path: &Path, controller: u64, max_bytes: u64) -> std::io::Result<AuditLog> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let bytes = file.metadata()?.len();
        let (writes, queued) = std::sync::mpsc::channel();
        let writer = Writer {
            path: path.to_path_buf(),
            file,
            bytes,
            max_bytes,
        };
        std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn(move || writer.run(queued))?;
        Ok(AuditLog {
            path: path.to_path_buf(),
            controller,
            writes,
            refusals: Mutex::new((0, 0, 0)),
        })
    }

    /// `audit.log.N`.
    fn rotated(&self, n: usize) -> PathBuf {
        rotated(&self.path, n)
    }

    /// Queues one entry for the writer; the receiver answers once it is synced (or could not
    /// be written, which the writer reports: the call it records has already happened and is
    /// not undone).
    fn queue(&self, entry: &Entry) -> tokio::sync::oneshot::Receiver<()> {
        let mut entry = entry.clone();
        entry.target = crate::text::clip(&entry.target, MAX_TARGET_CHARS);
        entry.who = crate::text::clip(&entry.who, MAX_TARGET_CHARS);
        entry.message = entry.message.map(|m| crate::text::clip(&m, MAX_MESSAGE_CHARS));
        let mut line = serde_json::to_vec(&entry).expect("entry serializes");
        line.push(b'\n');
        let (synced, wait) = tokio::sync::oneshot::channel();
        let pending = Pending {
            line,
            call: entry.call,
            synced,
        };
        if self.writes.send(pending).is_err() {
            tracing::error!(path = %self.path.display(), call = entry.call, "the audit log's writer has stopped; this entry is not written");
        }
        wait
    }

    /// Appends one entry and waits until it is synced to disk.
    pub async fn record(&self, entry: &Entry) {
        // An error means the writer is gone, which `queue` or the writer has reported.
        let _ = self.queue(entry).await;
    }

    /// Whether one more refusal may be written this second, and how many were not written
    /// since the last one that was (`None`: this one is not written either).
    fn refusal_budget(&self, now_ms: u64) -> Option<u64> {
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        let second = now_ms / 1000;
        if r.0 != second {
            *r = (second, 0, r.2);
        }
        if r.1 >= REFUSALS_PER_SECOND {
            r.2 += 1;
            return None;
        }
        r.1 += 1;
        Some(std::mem::take(&mut r.2))
    }

    /// Records a call refused before any handler ran; the receiver answers once the entry is
    /// synced (`None`: over the budget of refusals a second, not written).
    pub fn record_refusal(
        &self,
        who: Option<&laneway_pki::PeerIdentity>,
        remote: Option<std::net::SocketAddr>,
        method: &str,
        status: &Status,
    ) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let addr = remote.map_or_else(|| "unknown".into(), |a| a.to_string());
        let now = crate::jobs::unix_ms();
        let suppressed = self.refusal_budget(now)?;
        let mut message = crate::text::clip(status.message(), MAX_MESSAGE_CHARS);
        if suppressed > 0 {
            message.push_str(&format!(
                " ({suppressed} more refusals before this one were not recorded: over {REFUSALS_PER_SECOND} a second)"
            ));
        }
        Some(self.queue(&Entry {
            unix_ms: now,
            at: rfc3339(now),
            controller: self.controller,
            who: who.map_or_else(|| addr.clone(), |id| format!("{id}@{addr}")),
            call: "refused",
            target: method.to_string(),
            result: format!("{:?}", status.code()),
            message: Some(message),
            ms: 0,
        }))
    }

    /// Runs `call` for `caller` and records it.
    pub async fn around<T, F>(&self, caller: Caller, call: &'static str, f: F) -> Result<Response<T>, Status>
    where
        F: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        self.around_with(caller, call, false, f).await
    }

    /// [`AuditLog::around`] for a call anyone may make (a join): its failures are written
    /// within the refusals' budget, so a flood of bad calls costs a bounded amount of disk.
    pub async fn around_public<T, F>(&self, caller: Caller, call: &'static str, f: F) -> Result<Response<T>, Status>
    where
        F: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        self.around_with(caller, call, true, f).await
    }

    async fn around_with<T, F>(
        &self,
        caller: Caller,
        call: &'static str,
        public: bool,
        f: F,
    ) -> Result<Response<T>, Status>
    where
        F: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        let start = tokio::time::Instant::now();
        let result = f.await;
        let now = crate::jobs::unix_ms();
        let (outcome, mut message) = match &result {
            Ok(_) => ("ok".to_string(), None),
            Err(s) => (format!("{:?}", s.code()), Some(s.message().to_string())),
        };
        if public && result.is_err() {
            match self.refusal_budget(now) {
                None => return result,
                Some(0) => {}
                Some(n) => {
                    message = message.map(|m| {
                        format!("{m} ({n} more refusals before this one were not recorded: over {REFUSALS_PER_SECOND} a second)")
                    })
                }
            }
        }
        self.record(&Entry {
            unix_ms: now,
            at: rfc3339(now),
            controller: self.controller,
            who: caller.who,
            call,
            target: caller.target,
            result: outcome,
            message,
            ms: start.elapsed().as_millis() as u64,
        })
        .await;
        result
    }

    /// Entries at or after `since_ms`, oldest first, the last `limit` of them.
    pub fn read(&self, since_ms: u64, limit: usize) -> std::io::Result<Vec<Value>> {
        let mut out: Vec<Value> = Vec::new();
        // The rotated files first, oldest first, then the current one.
        let files = (1..=ROTATED_KEPT)
            .rev()
            .map(|n| self.rotated(n))
            .chain([self.path.clone()]);
        for path in files {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            out.extend(
                text.lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .filter(|v| v["unix_ms"].as_u64().is_some_and(|t| t >= since_ms)),
            );
        }
        let limit = limit.clamp(1, MAX_ENTRIES);
        if out.len() > limit {
            out.drain(..out.len() - limit);
        }
        Ok(out)
    }
}

fn rfc3339(unix_ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(unix_ms)).to_string()
}

/// Who made a call and what it was about.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The identity its certificate names (`viewer:alice`), and the peer address.
    pub who: String,
    pub target: String,
}

impl Caller {
    /// The request's fields are its target.
    pub fn of<T: std::fmt::Debug>(req: &tonic::Request<T>) -> Caller {
        Caller {
            who: peer(req),
            target: format!("{:?}", req.get_ref()),
        }
    }

    /// A registry document's `name` is its target, never the document itself (it may hold
    /// credentials in a runtime's environment).
    pub fn of_document(req: &tonic::Request<laneway_proto::admin::PutDocumentRequest>) -> Caller {
        Caller {
            who: peer(req),
            target: document_name(&req.get_ref().json),
        }
    }
}

impl crate::auth::RefusalLog for AuditLog {
    fn refused(
        &self,
        who: Option<&laneway_pki::PeerIdentity>,
        remote: Option<std::net::SocketAddr>,
        method: &str,
        status: &Status,
    ) -> futures::future::BoxFuture<'static, ()> {
        let recorded = self.record_refusal(who, remote, method, status);
        Box::pin(async move {
            if let Some(recorded) = recorded {
                let _ = recorded.await;
            }
        })
    }
}

fn peer<T>(req: &tonic::Request<T>) -> String {
    let addr = req.remote_addr().map_or_else(|| "unknown".into(), |a| a.to_string());
    match crate::auth::caller(req) {
        Some(id) => format!("{id}@{addr}"),
        None => addr,
    }
}

fn document_name(json: &str) -> String {
    serde_json::from_str::<Value>(json)
        .ok()
        .and_then(|v| v["name"].as_str().map(|n| format!("name: {n:?}")))
        .unwrap_or_else(|| "an unreadable document".into())
}

/// `path.N`: a rotated file.
fn rotated(path: &Path, n: usize) -> PathBuf {
    let mut p = path.to_path_buf().into_os_string();
    p.push(format!(".{n}"));
    PathBuf::from(p)
}

/// One line for the writer, and who waits for its sync.
struct Pending {
    line: Vec<u8>,
    call: &'static str,
    synced: tokio::sync::oneshot::Sender<()>,
}

/// Most entries written under one sync: a flood is synced in steps, so the first of it is
/// answered without waiting for the whole of it to be written.
const MAX_BATCH: usize = 1024;

/// The audit log's writer thread: owns the open file.
struct Writer {
    path: PathBuf,
    file: std::fs::File,
    /// Bytes in the current file.
    bytes: u64,
    /// Size past which the file is rotated.
    max_bytes: u64,
}

impl Writer {
    /// Writes what is queued, syncs once, answers everyone it wrote for, and waits for more;
    /// returns when the log is dropped and nothing is left to write.
    fn run(mut self, queued: std::sync::mpsc::Receiver<Pending>) {
        while let Ok(first) = queued.recv() {
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match queued.try_recv() {
                    Ok(p) => batch.push(p),
                    Err(_) => break,
                }
            }
            for p in &batch {
                self.append(&p.line, p.call);
            }
            if let Err(e) = self.file.sync_data() {
                tracing::error!(path = %self.path.display(), error = %e, entries = batch.len(), "audit log sync failed");
            }
            for p in batch {
                // The caller may have gone (its call was cancelled): nothing to answer.
                let _ = p.synced.send(());
            }
        }
    }

    /// Appends one line, rotating the file first when the line would take it past its size.
    fn append(&mut self, line: &[u8], call: &str) {
        if self.bytes > 0 && self.bytes + line.len() as u64 > self.max_bytes {
            if let Err(e) = self.rotate() {
                tracing::error!(path = %self.path.display(), error = %e, "audit log rotation failed; appending to the current file");
            }
        }
        match self.file.write_all(line) {
            Ok(()) => self.bytes += line.len() as u64,
            Err(e) => tracing::error!(path = %self.path.display(), error = %e, call, "audit log write failed"),
        }
    }

    /// Moves the full file aside (`.1`, the older ones up by one, the oldest deleted) and
    /// starts a new one. What was written to the old file is synced first.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.file.sync_data()?;
        // Shifted only while the current file is in place. A rotation whose new file could
        // not be opened (no file descriptors, a full disk) leaves the open file moved to `.1`;
        // the retry at the next append must only open a new file, not shift the open one on
        // until it is deleted and every later entry goes into a file nobody can read.
        if self.path.exists() {
            for n in (1..ROTATED_KEPT).rev() {
                let from = rotated(&self.path, n);
                if from.exists() {
                    std::fs::rename(&from, rotated(&self.path, n + 1))?;
                }
            }
            std::fs::rename(&self.path, rotated(&self.path, 1))?;
        }
        self.file = std::fs::OpenOptions::new().create(true).append(true).open(&self.path)?;
        self.bytes = 0;
        match self.path.parent() {
            // The renames are durable before anything is written to the new file.
            Some(dir) => std::fs::File::open(dir).and_then(|d| d.sync_all()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(target: &str) -> Caller {
        Caller {
            who: "10.0.0.5:4000".into(),
            target: target.into(),
        }
    }

    #[tokio::test]
    async fn calls_are_appended_with_their_outcome_and_read_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(&dir.path().join("audit.log"), 1).unwrap();
        let ok: Result<Response<()>, Status> = log
            .around(caller("key: \"a\""), "put_setting", async { Ok(Response::new(())) })
            .await;
        assert!(ok.is_ok());
        let err: Result<Response<()>, Status> = log
            .around(caller("node_id: 9"), "remove", async {
                Err(Status::failed_precondition("node 9 is not a member"))
            })
            .await;
        assert!(err.is_err());
        let all = log.read(0, 100).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0]["call"], "put_setting");
        assert_eq!(all[0]["result"], "ok");
        assert_eq!(all[1]["result"], "FailedPrecondition");
        assert_eq!(all[1]["message"], "node 9 is not a member");
        assert_eq!(log.read(0, 1).unwrap()[0]["call"], "remove", "the newest when limited");
        // Reopened (a restart): appended to, not truncated.
        drop(log);
        let log = AuditLog::open(&dir.path().join("audit.log"), 1).unwrap();
        assert_eq!(log.read(0, 100).unwrap().len(), 2);
    }

    /// Calls made together share the writer's syncs, and each answers only once its own entry
    /// is in the file: read back as soon as each call returns, every one is there.
    #[tokio::test]
    async fn concurrent_calls_each_answer_once_their_entry_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let log = std::sync::Arc::new(AuditLog::open(&dir.path().join("audit.log"), 1).unwrap());
        let calls = (0..300).map(|i| {
            let log = log.clone();
            tokio::spawn(async move {
                let _: Result<Response<()>, Status> = log
                    .around(caller(&format!("key: \"k{i}\"")), "put_setting", async {
                        Ok(Response::new(()))
                    })
                    .await;
                let written = log.read(0, MAX_ENTRIES).unwrap();
                let mine = format!("key: \"k{i}\"");
                assert!(
                    written.iter().any(|e| e["target"] == mine.as_str()),
                    "call {i} answered before its entry was written"
                );
            })
        });
        for call in futures::future::join_all(calls).await {
            call.unwrap();
        }
        assert_eq!(log.read(0, MAX_ENTRIES).unwrap().len(), 300);
    }

    /// A refusal's entry is written before the refusal is answered.
    #[tokio::test]
    async fn a_refusal_is_on_disk_when_its_record_answers() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(&dir.path().join("audit.log"), 1).unwrap();
        let status = Status::unauthenticated("no certificate");
        let recorded = crate::auth::RefusalLog::refused(&log, None, None, "PutSetting", &status);
        recorded.await;
        let all = log.read(0, 10).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0]["call"], "refused");
        assert_eq!(all[0]["target"], "PutSetting");
    }

    /// What a caller sent is clipped, and the file is rotated: a flood of calls costs a
    /// bounded amount of disk, and reads still see the rotated entries.
    #[tokio::test]
    async fn entries_are_clipped_and_the_file_rotates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::open_rotating_at(&path, 1, 8 * 1024).unwrap();
        let huge = "x".repeat(1024 * 1024);
        for _ in 0..200 {
            let _: Result<Response<()>, Status> = log
                .around(caller(&huge), "join", async {
                    Err(Status::permission_denied("y".repeat(1 << 20)))
                })
                .await;
        }
        let mut total = 0;
        for n in 0..=ROTATED_KEPT + 1 {
            let p = if n == 0 { path.clone() } else { log.rotated(n) };
            if let Ok(m) = std::fs::metadata(&p) {
                assert!(n <= ROTATED_KEPT, "at most {ROTATED_KEPT} rotated files are kept");
                assert!(m.len() <= 8 * 1024 + 4096, "{} is {} bytes", p.display(), m.len());
                total += m.len();
            }
        }
        assert!(total <= (ROTATED_KEPT as u64 + 1) * 12 * 1024, "{total} bytes in all");
        let all = log.read(0, 10_000).unwrap();
        assert!(
            all.len() > 5,
            "entries of the rotated files are read too: {}",
            all.len()
        );
        let line = all[0]["target"].as_str().unwrap();
        assert!(
            line.len() < 2 * MAX_TARGET_CHARS && line.ends_with("(1048576 bytes in all)"),
            "{line}"
        );
    }

    /// Failures of a call anyone may make are written within the refusal budget.
    #[tokio::test]
    async fn public_failures_are_written_within_a_budget() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(&dir.path().join("audit.log"), 1).unwrap();
        let start = tokio::time::Instant::now();
        for _ in 0..500 {
            let _: Result<Response<()>, Status> = log
                .around_public(caller("node_id: \"x\""), "join", async {
                    Err(Status::permission_denied("no"))
                })
                .await;
        }
        let seconds = start.elapsed().as_secs() as usize + 2;
        let n = log.read(0, 10_000).unwrap().len();
        assert!(
            n <= seconds * REFUSALS_PER_SECOND as usize && n < 500,
            "{n} entries written for 500 refused joins in under {seconds} s"
        );
        let ok: Result<Response<()>, Status> = log
            .around_public(caller("x"), "join", async { Ok(Response::new(())) })
            .await;
        assert!(ok.is_ok());
        assert_eq!(
            log.read(0, 10_000).unwrap().last().unwrap()["result"],
            "ok",
            "successes are always written"
        );
    }

    #[test]
    fn documents_are_named_never_copied() {
        let doc = r#"{"name":"whisper","runtime":{"env":{"HF_TOKEN":"secret"}}}"#;
        assert_eq!(document_name(doc), "name: \"whisper\"");
        assert!(!document_name(doc).contains("secret"));
    }
}
