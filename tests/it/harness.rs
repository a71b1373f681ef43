//! Multi-process test harness: real `laneway-control` processes on 127.0.0.1.

use std::fs::File;
use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use laneway_control::client::AdminClient;
use laneway_proto::admin::{NodeStatus, StatusRequest};
use tokio::time::Instant;

pub const CLUSTER: &str = "it";

/// Path of the controller binary Cargo built for this test.
pub fn control_bin() -> &'static str {
    env!("CARGO_BIN_EXE_laneway-control")
}

/// Path of the lanectl binary (its own package, `control/cli`, builds it).
pub fn lanectl_bin() -> PathBuf {
    sibling_bin("lanectl", "lanectl")
}

/// A binary of another package of this workspace, built next to this test's own directory
/// (Cargo names only its own package's binaries in `CARGO_BIN_EXE_`): `cargo test --workspace`
/// builds every package's binaries before it runs any test.
pub fn sibling_bin(name: &str, package: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo test --workspace` (or `cargo build -p {package}` first)",
        bin.display()
    );
    bin
}

/// Runs lanectl against the controller at `addr`; panics with its stderr if it fails.
pub fn lanectl_ok(addr: &str, args: &[&str]) -> std::process::Output {
    let out = Command::new(lanectl_bin())
        .args(["--addr", addr])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "lanectl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Client TLS as `<file>` (`admin-root`, `viewer-dash`, …) of the `lanectl certs` directory
/// `dir`, verifying any controller of the cluster.
pub fn client_tls(dir: &Path, file: &str) -> tonic::transport::ClientTlsConfig {
    let read = |name: String| std::fs::read_to_string(dir.join(name)).unwrap();
    laneway_pki::Tls::from_pem(
        read("ca.pem".into()),
        read(format!("{file}.pem")),
        read(format!("{file}.key")),
    )
    .unwrap()
    .client(laneway_pki::ANY_CONTROLLER)
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One controller process.
pub struct Node {
    pub id: u64,
    pub addr: String,
    /// The inference router (HTTP).
    pub router_addr: String,
    pub dir: PathBuf,
    /// The durable lanes' results store, shared by every controller and agent of a test.
    pub results: PathBuf,
    /// More flags for `laneway-control run`.
    pub extra_args: Vec<String>,
    /// A directory of `lanectl certs` output: the node runs with mTLS (its certificate
    /// `controller-<id>.pem`), and [`Node::client`] calls it as `admin-root`. `None`:
    /// `--insecure-dev`.
    pub certs: Option<PathBuf>,
    child: Option<Child>,
}

impl Node {
    pub fn new(root: &Path, id: u64) -> Node {
        Node {
            id,
            addr: format!("127.0.0.1:{}", free_port()),
            router_addr: format!("127.0.0.1:{}", free_port()),
            dir: root.join(format!("node-{id}")),
            results: root.join("results"),
            extra_args: Vec::new(),
            certs: None,
            child: None,
        }
    }

    fn args(&self) -> Vec<String> {
        vec![
            "run".into(),
            "--node-id".into(),
            self.id.to_string(),
            "--listen".into(),
            self.addr.clone(),
            "--data-dir".into(),
            self.dir.join("data").display().to_string(),
            "--cluster-name".into(),
            CLUSTER.into(),
            // Small snapshot threshold so snapshots happen during tests too.
            "--snapshot-logs".into(),
            "500".into(),
            "--router-listen".into(),
            self.router_addr.clone(),
            "--results-store".into(),
            self.results.display().to_string(),
        ]
        .into_iter()
        .chain(match &self.certs {
            None => vec!["--insecure-dev".to_string()],
            Some(d) => vec![
                "--tls-ca".into(),
                d.join("ca.pem").display().to_string(),
                "--tls-cert".into(),
                d.join(format!("controller-{}.pem", self.id)).display().to_string(),
                "--tls-key".into(),
                d.join(format!("controller-{}.key", self.id)).display().to_string(),
            ],
        })
        .chain(self.extra_args.iter().cloned())
        .collect()
    }

    /// Starts (or restarts) the process, logging to `dir/log-N.txt`.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "node {} already running", self.id);
        std::fs::create_dir_all(&self.dir).unwrap();
        let n = std::fs::read_dir(&self.dir).unwrap().count();
        let log = File::create(self.dir.join(format!("log-{n}.txt"))).unwrap();
        let child = Command::new(control_bin())
            .args(self.args())
            .env("LANEWAY_LOG", "info,openraft=info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn laneway-control");
        self.child = Some(child);
    }

    /// SIGTERM, as systemd stops it, and waits (up to 20 s) for it to exit.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        for _ in 0..200 {
            if let Ok(Some(status)) = c.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = c.kill();
        c.wait().ok()
    }

    /// The running process's id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Runs the controller in the foreground with extra/replaced args and returns its output
    /// (for processes expected to refuse to start).
    pub fn run_expecting_exit(&self, extra: &[&str]) -> Output {
        let mut args = self.args();
        for pair in extra.chunks(2) {
            if let Some(i) = args.iter().position(|a| a == pair[0]) {
                args[i + 1] = pair[1].to_string();
            } else {
                args.extend(pair.iter().map(|s| s.to_string()));
            }
        }
        Command::new(control_bin())
            .args(args)
            .output()
            .expect("run laneway-control")
    }

    /// The lines of this node's logs (every start's `log-N.txt`) that contain any of `words`.
    pub fn log_lines(&self, words: &[&str]) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            if !entry.file_name().to_string_lossy().starts_with("log-") {
                continue;
            }
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for line in text.lines().filter(|l| words.iter().any(|w| l.contains(w))) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    pub fn client(&self) -> AdminClient {
        let tls = self.certs.as_ref().map(|d| client_tls(d, "admin-root"));
        AdminClient::new(vec![self.addr.clone()])
            .with_retry_for(Duration::from_secs(5))
            .with_tls(tls)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` until it returns `Some`, failing the test with `what` after `limit`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_explained(what, limit, f, String::new).await
}

/// [`wait_for`], whose failure also says what `explain` gives then (a node's log lines, say).
pub async fn wait_for_explained<T, F, Fut>(what: &str, limit: Duration, mut f: F, explain: impl Fn() -> String) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}\n{}",
            explain()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Status of one node, or None if it does not answer.
/// `node`'s status, with its state hash.
pub async fn status(node: &Node) -> Option<NodeStatus> {
    node.client()
        .call_one(&node.addr, |mut c| async move {
            c.status(StatusRequest { with_state_hash: true }).await
        })
        .await
        .ok()
}
