//! Controller configuration in two layers: what the operator wrote (TOML file, flags, env, all
//! optional) and the validated [`ControllerConfig`] the controller runs with. Validation happens
//! before any port is bound or file opened; an invalid configuration names the field, the value
//! and what was expected, and the binary exits with code 2.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Outer layer: the TOML file. Unknown fields are refused (a typo must not silently fall back to
/// a default on a controller).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub node_id: Option<u64>,
    pub cluster_name: Option<String>,
    pub listen: Option<String>,
    pub advertise: Option<String>,
    pub data_dir: Option<PathBuf>,
    #[serde(default)]
    pub raft: FileRaftConfig,
    pub max_admin_request_bytes: Option<usize>,
    /// A node silent this long is declared down (fenced: its jobs go back to the queue).
    pub node_dead_after_ms: Option<u64>,
    #[serde(default)]
    pub router: FileRouterConfig,
    #[serde(default)]
    pub jobs: FileJobsConfig,
    /// The slow loop's pools and node provider (see deploy/examples/provision.toml).
    pub provision: Option<PathBuf>,
    /// `[tls]`: the cluster CA's certificate and this controller's certificate and key.
    pub tls: Option<laneway_pki::TlsFiles>,
    /// Run without TLS and without authorization (development only; announced loudly).
    pub insecure_dev: Option<bool>,
}

/// `[jobs]` table of the TOML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileJobsConfig {
    /// Where durable jobs' results are read from: the directory (or object-store URL) the
    /// agents write them to. Default `<data_dir>/results`.
    pub results_store: Option<String>,
}

/// `[router]` table of the TOML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRouterConfig {
    /// `IP:port`, or `off` to run no router on this controller.
    pub listen: Option<String>,
    pub max_body_bytes: Option<usize>,
    pub header_read_timeout_ms: Option<u64>,
    pub max_connections: Option<usize>,
    /// A request's whole body must arrive within this, ms (408 after). Default 30000.
    pub body_timeout_ms: Option<u64>,
    /// Request body bytes all requests hold at once (503 above). Default max(256 MiB, 4 × max_body_bytes).
    pub max_body_bytes_in_flight: Option<usize>,
    /// Largest answer read whole from a replica or overflow endpoint (502 above). Default max(64 MiB, max_body_bytes).
    pub max_answer_bytes: Option<usize>,
    /// Longest line or event of a streamed answer (the stream ends with an error event above). Default 1 MiB.
    pub max_event_bytes: Option<usize>,
    /// Threads serving the router's connections. Default: one per core.
    pub threads: Option<usize>,
    /// HTTPS: the router's certificate chain and key (PEM), for the name clients use.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// `[raft]` table of the TOML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRaftConfig {
    pub heartbeat_ms: Option<u64>,
    pub election_timeout_min_ms: Option<u64>,
    pub election_timeout_max_ms: Option<u64>,
    pub snapshot_logs: Option<u64>,
    pub snapshot_max_log_mib: Option<u64>,
    pub keep_logs: Option<u64>,
}

/// Outer layer: flags and environment variables; each overrides the file.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct RunArgs {
    /// TOML configuration file (see deploy/examples/controller.toml).
    #[arg(long, env = "LANEWAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Raft node id of this controller (> 0, never reused once removed).
    #[arg(long, env = "LANEWAY_NODE_ID")]
    pub node_id: Option<u64>,
    /// Cluster name; a controller refuses data dirs and peers of another cluster. Default `laneway`.
    #[arg(long, env = "LANEWAY_CLUSTER_NAME")]
    pub cluster_name: Option<String>,
    /// gRPC listen address (Raft transport + admin API). Default `127.0.0.1:7001`.
    #[arg(long, env = "LANEWAY_LISTEN")]
    pub listen: Option<String>,
    /// Address other controllers and lanectl use to reach this one. Default: the listen address.
    #[arg(long, env = "LANEWAY_ADVERTISE")]
    pub advertise: Option<String>,
    /// Directory for the Raft log, state and snapshots.
    #[arg(long, env = "LANEWAY_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Leader heartbeat interval in ms. Default 100.
    #[arg(long, env = "LANEWAY_RAFT_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<u64>,
    /// Lower bound of the randomized election timeout in ms. Default 150.
    #[arg(long, env = "LANEWAY_RAFT_ELECTION_TIMEOUT_MIN_MS")]
    pub election_timeout_min_ms: Option<u64>,
    /// Upper bound (exclusive) of the election timeout in ms. Default 300.
    #[arg(long, env = "LANEWAY_RAFT_ELECTION_TIMEOUT_MAX_MS")]
    pub election_timeout_max_ms: Option<u64>,
    /// Spacing of snapshot points, applied entries; members' points are a third of it apart,
    /// and a member builds at one once the log since its last snapshot holds as many bytes as
    /// that snapshot. Default 10000.
    #[arg(long, env = "LANEWAY_RAFT_SNAPSHOT_LOGS")]
    pub snapshot_logs: Option<u64>,
    /// A node whose heartbeats stop for this long (ms) is declared down and its jobs requeued.
    /// A node whose heartbeat stream breaks is suspect at once (its replicas are replaced
    /// elsewhere) whatever this is. Default 3000.
    #[arg(long, env = "LANEWAY_NODE_DEAD_AFTER_MS")]
    pub node_dead_after_ms: Option<u64>,
    /// Inference router listen address (HTTP), or `off`. Default `127.0.0.1:8080`.
    #[arg(long, env = "LANEWAY_ROUTER_LISTEN")]
    pub router_listen: Option<String>,
    /// Serve the router over HTTPS with this certificate chain (PEM) for the name clients use.
    #[arg(long, env = "LANEWAY_ROUTER_TLS_CERT")]
    pub router_tls_cert: Option<PathBuf>,
    /// The router certificate's private key (PEM).
    #[arg(long, env = "LANEWAY_ROUTER_TLS_KEY")]
    pub router_tls_key: Option<PathBuf>,
    /// Results store of the durable lanes: a directory shared with the agents, or an
    /// object-store URL (s3://bucket/prefix). Default `<data-dir>/results`.
    #[arg(long, env = "LANEWAY_RESULTS_STORE")]
    pub results_store: Option<String>,
    /// The slow loop's pools and node provider (TOML; see deploy/examples/provision.toml).
    /// Without it, replicas that do not fit the fleet wait, reported as unplaced.
    #[arg(long, env = "LANEWAY_PROVISION")]
    pub provision: Option<PathBuf>,
    /// The cluster CA's certificate (PEM), from `lanectl certs init`.
    #[arg(long, env = "LANEWAY_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This controller's certificate (PEM), from `lanectl certs issue --kind controller`.
    #[arg(long, env = "LANEWAY_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// This controller's private key (PEM).
    #[arg(long, env = "LANEWAY_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA's key (PEM), optional: lets the controllers sign the certificates of agents that
    /// join with a token (`lanectl token create`) and renew them.
    #[arg(long, env = "LANEWAY_TLS_CA_KEY")]
    pub tls_ca_key: Option<PathBuf>,
    /// Serve plaintext gRPC with no authorization: for a development cluster on one machine
    /// only. Without TLS settings a controller refuses to start unless this is given.
    #[arg(long, env = "LANEWAY_INSECURE_DEV")]
    pub insecure_dev: bool,
}

/// Raft timing and compaction settings, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaftSettings {
    /// Leader heartbeat interval, ms. Default 100. openraft 0.9 also uses it as the timeout of
    /// every AppendEntries RPC, so it must leave room for a follower's fsync under load.
    pub heartbeat_ms: u64,
    /// Election timeout range `[min, max)`, ms. Defaults 150 and 300. openraft makes a follower
    /// that knew a leader wait `max` (the leader lease) plus a random timeout in `[min, max)`
    /// before campaigning, so a dead leader is replaced after 450–600 ms (plus up to one 150 ms tick),
    /// and even a split vote (another `[min, max)` round) stays under the 1 s target. A follower
    /// must miss at least four heartbeats before it campaigns, so a busy leader is not deposed
    /// by accident.
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Snapshot points every this many applied entries, staggered by node id; a member builds
    /// at one once the log since its last snapshot holds as many bytes as that snapshot
    /// (`snapshot_points`, ADR 0035). Default 10000.
    pub snapshot_logs: u64,
    /// A log since the last snapshot this large (MiB) is snapshotted at once: bounds the log's
    /// memory and a restart's replay when the state is larger. Between points, a log twice the
    /// last snapshot (or twice an eighth of this) is snapshotted too (ADR 0036). Members use
    /// 6/6, 5/6 or 4/6 of both by node id, so they do not reach them at the same entry.
    /// Default 256.
    pub snapshot_max_log_mib: u64,
    /// Entries kept in the log behind a snapshot, for slow followers. Default 1000.
    pub keep_logs: u64,
}

impl Default for RaftSettings {
    fn default() -> Self {
        RaftSettings {
            heartbeat_ms: 100,
            election_timeout_min_ms: 150,
            election_timeout_max_ms: 300,
            snapshot_logs: 10_000,
            snapshot_max_log_mib: 256,
            keep_logs: 1_000,
        }
    }
}

/// Inner layer: the validated configuration a controller runs with.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub node_id: u64,
    pub cluster_name: String,
    pub listen: SocketAddr,
    /// `host:port` peers dial; empty means "the address actually bound".
    pub advertise: Option<String>,
    pub data_dir: PathBuf,
    pub raft: RaftSettings,
    /// Largest admin request accepted, bytes. Default 1 MiB.
    pub max_admin_request_bytes: usize,
    /// A node whose heartbeats stop for this long is declared down. Default 3 s.
    pub node_dead_after: std::time::Duration,
    /// The inference router's listener and limits.
    pub router: crate::router::server::RouterSettings,
    /// Results store of the durable lanes (directory or object-store URL).
    pub results_store: String,
    /// The slow loop's configuration; `None`: no provisioner.
    pub provision: Option<crate::provision::ProvisionConfig>,
    /// mTLS material; `None` only in insecure development mode (no TLS, no authorization).
    pub tls: Option<laneway_pki::Tls>,
    /// The cluster CA, when this controller may sign joining agents' certificates.
    pub issuer: Option<std::sync::Arc<laneway_pki::Ca>>,
}

/// An invalid configuration value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid configuration: {field} = {value}: {expected}")]
pub struct ConfigError {
    pub field: &'static str,
    pub value: String,
    pub expected: String,
}

fn bad(field: &'static str, value: impl std::fmt::Debug, expected: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        value: format!("{value:?}"),
        expected: expected.into(),
    }
}

/// Reads and parses a TOML config file.
pub fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        bad(
            "config",
            path.display().to_string(),
            format!("cannot read the file: {e}"),
        )
    })?;
    toml::from_str(&text).map_err(|e| {
        bad(
            "config",
            path.display().to_string(),
            format!("not a valid controller config: {}", e.to_string().trim()),
        )
    })
}

/// Checks a cluster name: 1–63 characters of `[a-z0-9-]`.
pub fn validate_cluster_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(())
    } else {
        Err(bad("cluster_name", name, "1 to 63 characters of a-z, 0-9 and '-'"))
    }
}

/// Checks a `host:port` address that peers will dial: a DNS name, an IPv4 address or a
/// bracketed IPv6 address, and a non-zero port. Anything else would be committed into the
/// membership and then be unreachable forever.
pub fn validate_peer_addr(field: &'static str, addr: &str) -> Result<(), ConfigError> {
    let err = || {
        bad(
            field,
            addr,
            "host:port with a non-zero port, e.g. 10.0.0.5:7001, ctl-1.example.net:7001 or [fd00::1]:7001",
        )
    };
    let port = if let Some(rest) = addr.strip_prefix('[') {
        let (host, port) = rest.split_once("]:").ok_or_else(err)?;
        host.parse::<std::net::Ipv6Addr>().map_err(|_| err())?;
        port
    } else {
        let (host, port) = addr.rsplit_once(':').ok_or_else(err)?;
        if host.parse::<std::net::Ipv4Addr>().is_err() && !is_dns_name(host) {
            return Err(err());
        }
        port
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(err()),
    }
}

/// RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
fn is_dns_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

impl RunArgs {
    /// Merges file, env and flags (flags win) and validates the result.
    pub fn resolve(&self) -> Result<ControllerConfig, ConfigError> {
        let file = match &self.config {
            Some(p) => read_file(p)?,
            None => FileConfig::default(),
        };
        let node_id = self.node_id.or(file.node_id).ok_or_else(|| {
            bad(
                "node_id",
                "<unset>",
                "a node id > 0 (flag --node-id, env LANEWAY_NODE_ID or `node_id` in the file)",
            )
        })?;
        if node_id == 0 {
            return Err(bad("node_id", node_id, "a node id > 0"));
        }
        let cluster_name = self
            .cluster_name
            .clone()
            .or(file.cluster_name)
            .unwrap_or_else(|| "laneway".to_string());
        validate_cluster_name(&cluster_name)?;
        let listen_raw = self
            .listen
            .clone()
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:7001".to_string());
        let listen: SocketAddr = listen_raw
            .parse()
            .map_err(|_| bad("listen", &listen_raw, "an IP:port to listen on, e.g. 0.0.0.0:7001"))?;
        let advertise = self.advertise.clone().or(file.advertise);
        match &advertise {
            Some(a) => validate_peer_addr("advertise", a)?,
            None if listen.ip().is_unspecified() => {
                return Err(bad(
                    "advertise",
                    "<unset>",
                    format!("an address peers can dial; listen is {listen}, which peers cannot dial"),
                ))
            }
            None => {}
        }
        let data_dir = self.data_dir.clone().or(file.data_dir).ok_or_else(|| {
            bad(
                "data_dir",
                "<unset>",
                "a directory for this controller's data (flag --data-dir)",
            )
        })?;
        let defaults = RaftSettings::default();
        let raft = RaftSettings {
            heartbeat_ms: self
                .heartbeat_ms
                .or(file.raft.heartbeat_ms)
                .unwrap_or(defaults.heartbeat_ms),
            election_timeout_min_ms: self
                .election_timeout_min_ms
                .or(file.raft.election_timeout_min_ms)
                .unwrap_or(defaults.election_timeout_min_ms),
            election_timeout_max_ms: self
                .election_timeout_max_ms
                .or(file.raft.election_timeout_max_ms)
                .unwrap_or(defaults.election_timeout_max_ms),
            snapshot_logs: self
                .snapshot_logs
                .or(file.raft.snapshot_logs)
                .unwrap_or(defaults.snapshot_logs),
            snapshot_max_log_mib: file.raft.snapshot_max_log_mib.unwrap_or(defaults.snapshot_max_log_mib),
            keep_logs: file.raft.keep_logs.unwrap_or(defaults.keep_logs),
        };
        validate_raft(&raft)?;
        let max_admin_request_bytes = file.max_admin_request_bytes.unwrap_or(1024 * 1024);
        if !(4096..=64 * 1024 * 1024).contains(&max_admin_request_bytes) {
            return Err(bad(
                "max_admin_request_bytes",
                max_admin_request_bytes,
                "between 4096 and 67108864",
            ));
        }
        let node_dead_after_ms = self.node_dead_after_ms.or(file.node_dead_after_ms).unwrap_or(3000);
        if !(1000..=3_600_000).contains(&node_dead_after_ms) {
            return Err(bad(
                "node_dead_after_ms",
                node_dead_after_ms,
                "between 1000 (1 s) and 3600000 (1 h); more than a few agent heartbeat intervals",
            ));
        }
        let router = resolve_router(
            self.router_listen.clone(),
            self.router_tls_cert.clone().or(file.router.tls_cert.clone()),
            self.router_tls_key.clone().or(file.router.tls_key.clone()),
            &file.router,
        )?;
        let results_store = self
            .results_store
            .clone()
            .or_else(|| file.jobs.results_store.clone())
            .unwrap_or_else(|| data_dir.join("results").display().to_string());
        let provision = self
            .provision
            .clone()
            .or_else(|| file.provision.clone())
            .map(|p| crate::provision::ProvisionConfig::load(&p))
            .transpose()
            .map_err(|e| bad("provision", e.path.clone(), e.message))?;
        let tls = resolve_tls(self, file.tls.as_ref(), file.insecure_dev, node_id, &cluster_name)?;
        let issuer = match self
            .tls_ca_key
            .clone()
            .or_else(|| file.tls.as_ref().and_then(|t| t.ca_key.clone()))
        {
            None => None,
            Some(_) if tls.is_none() => {
                return Err(bad(
                    "tls.ca_key",
                    "<set>",
                    "only with TLS settings (a CA key means nothing in --insecure-dev)",
                ))
            }
            Some(path) => {
                let ca = self
                    .tls_ca
                    .clone()
                    .or_else(|| file.tls.as_ref().and_then(|t| t.ca.clone()))
                    .expect("TLS is on");
                let read = |p: &PathBuf| {
                    std::fs::read_to_string(p)
                        .map_err(|e| bad("tls.ca_key", p.display().to_string(), format!("a readable file ({e})")))
                };
                let ca = laneway_pki::Ca::load(&read(&ca)?, &read(&path)?)
                    .map_err(|e| bad("tls.ca_key", path.display().to_string(), e.to_string()))?;
                Some(std::sync::Arc::new(ca))
            }
        };
        if tls.is_none() {
            insecure_only_on_loopback("listen", &listen.to_string())?;
            if let Some(a) = &advertise {
                insecure_only_on_loopback("advertise", a)?;
            }
            if let Some(r) = &router.listen {
                insecure_only_on_loopback("router.listen", &r.to_string())?;
            }
        }
        if tls.is_some()
            && matches!(
                provision.as_ref().map(|p| &p.provider),
                Some(crate::provision::ProviderConfig::Sim { .. })
            )
        {
            return Err(bad(
                "provision",
                "provider = sim",
                "the simulated-host provider starts insecure agents: use it with --insecure-dev, or a real provider with TLS",
            ));
        }
        Ok(ControllerConfig {
            tls,
            issuer,
            provision,
            results_store,
            node_id,
            cluster_name,
            listen,
            advertise,
            data_dir,
            raft,
            max_admin_request_bytes,
            node_dead_after: std::time::Duration::from_millis(node_dead_after_ms),
            router,
        })
    }
}

/// In insecure development mode every listener and advertised address stays on this host:
/// without TLS anyone who reaches a port is an admin and can join as an agent.
fn insecure_only_on_loopback(field: &'static str, addr: &str) -> Result<(), ConfigError> {
    let host = match addr.parse::<SocketAddr>() {
        Ok(a) => a.ip().to_string(),
        Err(_) => addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_string(),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback =
        host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        Ok(())
    } else {
        Err(bad(
            field,
            addr,
            "a loopback address (127.0.0.1, [::1] or localhost) in --insecure-dev, which has no authentication at all; for a cluster other hosts reach, use TLS (`lanectl certs init`, `lanectl certs issue --kind controller`)",
        ))
    }
}

/// TLS on, or insecure development mode said out loud; anything in between is refused.
fn resolve_tls(
    args: &RunArgs,
    file: Option<&laneway_pki::TlsFiles>,
    file_insecure: Option<bool>,
    node_id: u64,
    cluster: &str,
) -> Result<Option<laneway_pki::Tls>, ConfigError> {
    let file = file.cloned().unwrap_or_default();
    let files = laneway_pki::TlsFiles {
        ca: args.tls_ca.clone().or(file.ca),
        cert: args.tls_cert.clone().or(file.cert),
        key: args.tls_key.clone().or(file.key),
        ca_key: None,
    };
    let insecure = args.insecure_dev || file_insecure.unwrap_or(false);
    let tls = files.load().map_err(|e| bad("tls", "[ca, cert, key]", e.to_string()))?;
    match (tls, insecure) {
        (Some(_), true) => Err(bad(
            "insecure_dev",
            true,
            "not together with TLS settings: remove --insecure-dev (or the tls settings)",
        )),
        (None, false) => Err(bad(
            "tls",
            "<unset>",
            "TLS settings (--tls-ca, --tls-cert, --tls-key or a [tls] table; make them with `lanectl certs init` and `lanectl certs issue --kind controller`), or --insecure-dev for a development cluster",
        )),
        (None, true) => Ok(None),
        (Some(tls), false) => {
            let id = tls.identity();
            if id.controller_id() != Some(node_id) || id.cluster != cluster {
                return Err(bad(
                    "tls.cert",
                    id.uri(),
                    format!(
                        "a certificate for controller {node_id} of cluster {cluster:?}; issue one with `lanectl certs issue --kind controller --name {node_id}`"
                    ),
                ));
            }
            Ok(Some(tls))
        }
    }
}

pub(crate) fn resolve_router(
    flag: Option<String>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    file: &FileRouterConfig,
) -> Result<crate::router::server::RouterSettings, ConfigError> {
    let tls = match (tls_cert, tls_key) {
        (None, None) => None,
        (Some(cert), Some(key)) => {
            let read = |p: &PathBuf| {
                std::fs::read_to_string(p).map_err(|e| {
                    bad(
                        "router.tls_cert",
                        p.display().to_string(),
                        format!("a readable file ({e})"),
                    )
                })
            };
            let acceptor = laneway_pki::https_acceptor(&read(&cert)?, &read(&key)?)
                .map_err(|e| bad("router.tls_cert", cert.display().to_string(), e.to_string()))?;
            Some(crate::router::server::HttpsSettings {
                acceptor,
                cert_path: cert,
            })
        }
        (cert, _) => {
            return Err(bad(
                "router.tls_cert",
                cert.map_or("<unset>".into(), |c| c.display().to_string()),
                "router.tls_cert and router.tls_key together (HTTPS), or neither (HTTP)",
            ))
        }
    };
    let d = crate::router::server::RouterSettings::default();
    let raw = flag
        .or_else(|| file.listen.clone())
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    let listen = if raw == "off" {
        None
    } else {
        Some(raw.parse::<SocketAddr>().map_err(|_| {
            bad(
                "router.listen",
                &raw,
                "an IP:port for the inference router, e.g. 0.0.0.0:8080, or `off`",
            )
        })?)
    };
    let max_body_bytes = file.max_body_bytes.unwrap_or(d.max_body_bytes);
    if !(1024..=1024 * 1024 * 1024).contains(&max_body_bytes) {
        return Err(bad(
            "router.max_body_bytes",
            max_body_bytes,
            "between 1024 and 1073741824",
        ));
    }
    let header_ms = file
        .header_read_timeout_ms
        .unwrap_or(d.header_read_timeout.as_millis() as u64);
    if !(100..=120_000).contains(&header_ms) {
        return Err(bad(
            "router.header_read_timeout_ms",
            header_ms,
            "between 100 and 120000",
        ));
    }
    let max_connections = file.max_connections.unwrap_or(d.max_connections);
    if !(1..=1_000_000).contains(&max_connections) {
        return Err(bad("router.max_connections", max_connections, "between 1 and 1000000"));
    }
    let body_ms = file.body_timeout_ms.unwrap_or(d.body_timeout.as_millis() as u64);
    if !(100..=600_000).contains(&body_ms) {
        return Err(bad("router.body_timeout_ms", body_ms, "between 100 and 600000"));
    }
    if let Some(n) = file.max_body_bytes_in_flight.filter(|n| *n < max_body_bytes) {
        return Err(bad(
            "router.max_body_bytes_in_flight",
            n,
            format!("at least router.max_body_bytes ({max_body_bytes}), or no request could ever be read"),
        ));
    }
    if let Some(n) = file.max_answer_bytes.filter(|n| *n < 1024) {
        return Err(bad("router.max_answer_bytes", n, "at least 1024"));
    }
    let max_event_bytes = file.max_event_bytes.unwrap_or(d.max_event_bytes);
    if max_event_bytes < 1024 || file.max_answer_bytes.is_some_and(|a| max_event_bytes > a) {
        return Err(bad(
            "router.max_event_bytes",
            max_event_bytes,
            "at least 1024 and at most router.max_answer_bytes",
        ));
    }
    let threads = file.threads.unwrap_or(d.threads);
    if !(1..=1024).contains(&threads) {
        return Err(bad(
            "router.threads",
            threads,
            "between 1 and 1024 (default: one per core)",
        ));
    }
    Ok(crate::router::server::RouterSettings {
        listen,
        threads,
        max_body_bytes,
        header_read_timeout: std::time::Duration::from_millis(header_ms),
        max_connections,
        body_timeout: std::time::Duration::from_millis(body_ms),
        max_body_bytes_in_flight: file.max_body_bytes_in_flight,
        max_answer_bytes: file.max_answer_bytes,
        max_event_bytes,
        tls,
    })
}

fn validate_raft(r: &RaftSettings) -> Result<(), ConfigError> {
    if !(10..=10_000).contains(&r.heartbeat_ms) {
        return Err(bad("raft.heartbeat_ms", r.heartbeat_ms, "between 10 and 10000 ms"));
    }
    if r.election_timeout_min_ms <= r.heartbeat_ms {
        return Err(bad(
            "raft.election_timeout_min_ms",
            r.election_timeout_min_ms,
            format!("more than raft.heartbeat_ms ({} ms)", r.heartbeat_ms),
        ));
    }
    if r.election_timeout_max_ms <= r.election_timeout_min_ms {
        return Err(bad(
            "raft.election_timeout_max_ms",
            r.election_timeout_max_ms,
            format!(
                "greater than raft.election_timeout_min_ms ({} ms)",
                r.election_timeout_min_ms
            ),
        ));
    }
    // A follower campaigns after election_timeout_max (the leader lease) plus a random timeout
    // of at least election_timeout_min: that silence must span several heartbeats.
    if r.election_timeout_max_ms + r.election_timeout_min_ms < 4 * r.heartbeat_ms {
        return Err(bad(
            "raft.election_timeout_max_ms",
            r.election_timeout_max_ms,
            format!(
                "election_timeout_max_ms + election_timeout_min_ms of at least 4 × raft.heartbeat_ms ({} ms)",
                4 * r.heartbeat_ms
            ),
        ));
    }
    if r.snapshot_logs < 100 {
        return Err(bad("raft.snapshot_logs", r.snapshot_logs, "at least 100 entries"));
    }
    if !(1..=1 << 20).contains(&r.snapshot_max_log_mib) {
        return Err(bad(
            "raft.snapshot_max_log_mib",
            r.snapshot_max_log_mib,
            "between 1 and 1048576 MiB (the log since the last snapshot is held in memory)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
