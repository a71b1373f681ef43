//! Replica supervisor against real `laneway-sim-model` processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use laneway_agent::supervisor::process::alive;
use laneway_agent::supervisor::{
    ReplicaSpec, ReplicaState, ReplicaStatus, RuntimeSpec, Supervisor, SupervisorConfig, Warmup,
};

fn spec(id: &str, extra: &[&str]) -> ReplicaSpec {
    let mut command: Vec<String> = [
        env!("CARGO_BIN_EXE_laneway-sim-model"),
        "--listen",
        "127.0.0.1:{port}",
        "--model",
        "{model}",
        "--product",
        "L4",
        "--service-ms",
        "L4=5",
        "--batch-window-ms",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    command.extend(extra.iter().map(|s| s.to_string()));
    ReplicaSpec {
        id: id.into(),
        model: "m".into(),
        device: "GPU-sim-n-0".into(),
        weights: None,
        runtime: RuntimeSpec {
            command,
            env: Default::default(),
            health_path: "/v2/health/ready".into(),
            warmup: Some(Warmup {
                path: "/v2/models/m/infer".into(),
                body: "{\"inputs\":[]}".into(),
            }),
            start_timeout_ms: 10_000,
            in_flight: None,
            ..Default::default()
        },
    }
}

fn config(dir: &std::path::Path) -> SupervisorConfig {
    SupervisorConfig {
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(200),
        crash_loop_after: 3,
        ..SupervisorConfig::new(dir.to_path_buf())
    }
}

async fn wait_until(sup: &Supervisor, id: &str, what: &str, f: impl Fn(&ReplicaStatus) -> bool) -> ReplicaStatus {
    let mut rx = sup.watch(id).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let s = rx.borrow().clone();
            if f(&s) {
                return s;
            }
            if rx.changed().await.is_err() {
                return rx.borrow().clone();
            }
        }
    })
    .await;
    r.unwrap_or_else(|_| panic!("timed out waiting for {what}; status {:?}", sup.status()))
}

async fn infer(port: u16) -> Result<reqwest::StatusCode, reqwest::Error> {
    reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/v2/models/m/infer"))
        .body("{\"inputs\":[]}")
        .send()
        .await
        .map(|r| r.status())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_after_health_and_warmup_then_restarts_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let sup = Supervisor::new(config(dir.path()));
    // Crashes on the second request: the warm-up is the first.
    sup.start(spec("r1", &["--crash-after", "1"])).unwrap();
    let ready = wait_until(&sup, "r1", "ready", |s| s.state == ReplicaState::Ready).await;
    let first_pid = ready.pid.unwrap();
    let _ = infer(ready.port).await; // kills it
    wait_until(&sup, "r1", "a restart", |s| {
        matches!(s.state, ReplicaState::Backoff { restarts: 1, .. })
    })
    .await;
    let again = wait_until(&sup, "r1", "ready again", |s| s.state == ReplicaState::Ready).await;
    assert_ne!(again.pid.unwrap(), first_pid);
    stop_all(&sup).await;
}

/// Replicas outlive their supervisor by design; tests stop theirs.
async fn stop_all(sup: &Supervisor) {
    for r in sup.status() {
        sup.drain(&r.id, Arc::new(|| 0), Duration::from_secs(1), Duration::from_secs(2))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_keeps_crashing_is_reported_as_crash_looping() {
    let dir = tempfile::tempdir().unwrap();
    let sup = Supervisor::new(config(dir.path()));
    // An unknown flag: the server exits at once, every time.
    sup.start(spec("r2", &["--no-such-flag"])).unwrap();
    let s = wait_until(&sup, "r2", "crash loop", |s| {
        matches!(s.state, ReplicaState::CrashLoop { .. })
    })
    .await;
    match s.state {
        ReplicaState::CrashLoop { restarts, last_exit } => {
            assert!(restarts >= 3);
            assert!(last_exit.contains("exited while starting"), "{last_exit}");
        }
        other => panic!("{other:?}"),
    }
    stop_all(&sup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_in_flight_then_stops() {
    let dir = tempfile::tempdir().unwrap();
    let sup = Arc::new(Supervisor::new(config(dir.path())));
    sup.start(spec("r3", &[])).unwrap();
    let ready = wait_until(&sup, "r3", "ready", |s| s.state == ReplicaState::Ready).await;
    let pid = ready.pid.unwrap();
    let in_flight = Arc::new(AtomicU64::new(2));
    let counter = in_flight.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        counter.store(0, Ordering::SeqCst);
    });
    let probe = in_flight.clone();
    let draining = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.drain(
                "r3",
                Arc::new(move || probe.load(Ordering::SeqCst)),
                Duration::from_secs(5),
                Duration::from_secs(2),
            )
            .await
        })
    };
    wait_until(&sup, "r3", "draining", |s| s.state == ReplicaState::Draining).await;
    // Still serving its in-flight work while draining.
    assert!(alive(pid));
    draining.await.unwrap().unwrap();
    assert_eq!(
        in_flight.load(Ordering::SeqCst),
        0,
        "drain returned before in-flight work finished"
    );
    assert_eq!(sup.status()[0].state, ReplicaState::Stopped);
    assert!(!alive(pid), "replica still running after drain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_survive_an_agent_restart_and_are_re_adopted_or_reaped() {
    let dir = tempfile::tempdir().unwrap();
    let (keep, drop_me) = (spec("keep", &[]), spec("old", &[]));
    let (keep_pid, keep_port, old_pid) = {
        let sup = Supervisor::new(config(dir.path()));
        sup.start(keep.clone()).unwrap();
        sup.start(drop_me.clone()).unwrap();
        let k = wait_until(&sup, "keep", "ready", |s| s.state == ReplicaState::Ready).await;
        let o = wait_until(&sup, "old", "ready", |s| s.state == ReplicaState::Ready).await;
        (k.pid.unwrap(), k.port, o.pid.unwrap())
        // The agent "restarts": the supervisor goes away, the processes stay.
    };
    assert!(alive(keep_pid) && alive(old_pid));
    assert_eq!(
        infer(keep_port).await.unwrap(),
        200,
        "replica stopped serving while the agent was down"
    );

    let sup = Supervisor::new(config(dir.path()));
    let mut rec = sup.recover(std::slice::from_ref(&keep), Duration::from_secs(2)).await;
    rec.adopted.sort();
    assert_eq!(rec.adopted, vec!["keep".to_string()]);
    assert_eq!(rec.reaped, vec!["old".to_string()]);
    assert!(!alive(old_pid), "undesired orphan still running");
    let s = wait_until(&sup, "keep", "adopted ready", |s| s.state == ReplicaState::Ready).await;
    assert_eq!(s.pid, Some(keep_pid), "re-adopted, not restarted");
    assert!(
        matches!(&sup.status()[..], [st] if st.pid == Some(keep_pid) && st.state == ReplicaState::Ready),
        "the adopted replica was taken for dead and replaced: {:?}",
        sup.status()
    );
    // Clean up.
    sup.drain("keep", Arc::new(|| 0), Duration::from_secs(1), Duration::from_secs(2))
        .await
        .unwrap();
    assert!(!alive(keep_pid), "drained replica still running: {:?}", sup.status());
}
