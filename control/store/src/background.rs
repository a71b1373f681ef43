//! Background work of the store (building snapshots) on a thread of its own at a lower CPU
//! priority than the controller's async workers, so that on a busy host it yields to the Raft
//! core, replication and the gRPC services, the way databases run compaction (RocksDB's
//! low-priority background pool). ADR 0021 says why.

use tokio::sync::oneshot;

/// Niceness of background threads: about a tenth of a normal thread's share of a contended CPU
/// (Linux's weights: 110 against 1024), all of an idle one.
const BACKGROUND_NICE: i32 = 10;

/// The thread running `work` panicked or could not be started.
#[derive(Debug, thiserror::Error)]
#[error("background thread {name}: {why}")]
pub struct BackgroundError {
    name: &'static str,
    why: String,
}

/// Runs `work` on a new thread named `name` at [`BACKGROUND_NICE`] and waits for its result
/// without holding an async worker.
pub async fn run<T, F>(name: &'static str, work: F) -> Result<T, BackgroundError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            lower_priority(name);
            let _ = tx.send(work());
        })
        .map_err(|e| BackgroundError {
            name,
            why: e.to_string(),
        })?;
    rx.await.map_err(|_| BackgroundError {
        name,
        why: "it panicked (see the log)".into(),
    })
}

/// CPU time the calling thread has used so far (user and system): what a background job
/// cost the host, which its wall time on a contended, lowered-priority thread does not say.
pub fn thread_cpu_time() -> std::time::Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    std::time::Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// Lowers the calling thread's priority. On Linux the nice value belongs to the thread (NPTL):
/// `setpriority` on this thread's id leaves the rest of the process as it was.
#[cfg(target_os = "linux")]
fn lower_priority(name: &str) {
    let me = Some(rustix::thread::gettid());
    let lowered = rustix::process::getpriority_process(me)
        .and_then(|nice| rustix::process::setpriority_process(me, (nice + BACKGROUND_NICE).min(19)));
    if let Err(e) = lowered {
        tracing::debug!(thread = name, error = %e, "could not lower the thread's priority; it runs at normal priority");
    }
}

/// Elsewhere the nice value is the whole process's: the thread keeps normal priority.
#[cfg(not(target_os = "linux"))]
fn lower_priority(_name: &str) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_at_a_lower_priority_and_its_result_comes_back() {
        #[cfg(target_os = "linux")]
        {
            let nice_of = || rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap();
            let ours = nice_of();
            let theirs = run("test-background", nice_of).await.unwrap();
            assert_eq!(theirs, (ours + BACKGROUND_NICE).min(19));
            assert_eq!(nice_of(), ours, "only the background thread changed");
        }
        assert_eq!(run("test-background", || 41 + 1).await.unwrap(), 42);
    }

    #[tokio::test]
    async fn a_panic_is_an_error_not_a_hang() {
        let e = run("test-panics", || -> u32 { panic!("boom") }).await.unwrap_err();
        assert!(e.to_string().contains("test-panics"), "{e}");
    }
}
