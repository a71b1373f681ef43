//! `lanectl certs`: the cluster CA and the certificates of controllers, agents and people.
//! The CA key stays with whoever runs these commands (an offline machine, a vault); nothing
//! here talks to the cluster.

use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use laneway_pki::{Ca, Kind};

#[derive(Subcommand)]
pub enum CertsCmd {
    /// Create the cluster CA: DIR/ca.pem (give it to every process) and DIR/ca.key (keep it
    /// offline; it can make any identity).
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// The cluster's name (the controllers' cluster_name).
        #[arg(long, default_value = "laneway")]
        cluster: String,
        #[arg(long, default_value = "3650d", value_parser = humantime::parse_duration)]
        valid_for: Duration,
    },
    /// Issue a key and certificate: OUT/KIND-NAME.pem and OUT/KIND-NAME.key.
    Issue {
        /// The CA's directory (ca.pem and ca.key).
        #[arg(long)]
        dir: PathBuf,
        /// controller (NAME = its node id), agent (NAME = its node id), router (a router-only
        /// process; NAME = its router number), or a person's or script's role: viewer,
        /// operator, admin.
        #[arg(long)]
        kind: String,
        #[arg(long)]
        name: String,
        /// Extra DNS names or IP addresses the holder is reached at (repeat).
        #[arg(long = "san")]
        sans: Vec<String>,
        #[arg(long, default_value = "365d", value_parser = humantime::parse_duration)]
        valid_for: Duration,
        /// Where to write; default: the CA's directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Create what is missing and keep what exists: the CA (unless DIR/ca.pem is there) and
    /// each `--issue KIND:NAME[:SAN,SAN…]` whose DIR/KIND-NAME.pem is not. Safe to run on
    /// every start (the compose file's `certs` service does).
    Ensure {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value = "laneway")]
        cluster: String,
        /// `KIND:NAME` or `KIND:NAME:SAN,SAN` (repeat), e.g. controller:1:c1,10.0.0.11
        #[arg(long = "issue")]
        issue: Vec<String>,
        /// Where issued certificates (and a copy of ca.pem) go; default DIR. Keeps the CA key
        /// out of what is handed to the processes.
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value = "365d", value_parser = humantime::parse_duration)]
        valid_for: Duration,
    },
    /// The identity, serial and expiry of a certificate file.
    Show { cert: PathBuf },
    /// Refuse a certificate from now on (a leaked key, a person who left, a host retired):
    /// every controller refuses calls made with it. Needs the cluster (admin).
    /// Every certificate of the identity issued until now is refused too (its renewals, made
    /// with the same key, included).
    Revoke {
        /// The certificate file; or give --identity (with --serial for one certificate).
        cert: Option<PathBuf>,
        /// The serial number (hex), as `certs show` prints it; needs --identity.
        #[arg(long, conflicts_with = "cert", requires = "identity")]
        serial: Option<String>,
        /// Whose certificates: kind:name, e.g. agent:gpu-1 (alone: all of them issued so far).
        #[arg(long, conflicts_with = "cert")]
        identity: Option<String>,
    },
}

impl CertsCmd {
    /// Whether this command talks to the cluster (the others are offline).
    pub fn needs_cluster(&self) -> bool {
        matches!(self, CertsCmd::Revoke { .. })
    }
}

/// `certs revoke`: the serial (and identity, for the record) to refuse.
pub fn revocation(
    cert: Option<PathBuf>,
    serial: Option<String>,
    identity: Option<String>,
) -> anyhow::Result<(String, String)> {
    match (cert, serial, identity) {
        (Some(path), _, _) => {
            let pem = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
            Ok((
                laneway_pki::serial_of_pem(&pem)?,
                laneway_pki::identity_of_pem(&pem)?.to_string(),
            ))
        }
        (None, serial, Some(identity)) => Ok((serial.unwrap_or_default().to_ascii_lowercase(), identity)),
        (None, _, None) => anyhow::bail!(
            "give the certificate file, or --identity kind:name (with --serial for one of its certificates)"
        ),
    }
}

pub fn run(cmd: CertsCmd) -> anyhow::Result<serde_json::Value> {
    match cmd {
        CertsCmd::Init {
            dir,
            cluster,
            valid_for,
        } => {
            let ca = Ca::create(&cluster, valid_for)?;
            std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
            write_new(&dir.join("ca.pem"), ca.cert_pem(), 0o644)?;
            write_new(&dir.join("ca.key"), ca.key_pem(), 0o600)?;
            Ok(serde_json::json!({"cluster": cluster, "ca": dir.join("ca.pem"), "key": dir.join("ca.key")}))
        }
        CertsCmd::Issue {
            dir,
            kind,
            name,
            sans,
            valid_for,
            out,
        } => {
            let kind: Kind = kind.parse()?;
            let ca = Ca::load_dir(&dir)?;
            let issued = ca.issue(kind, &name, &sans, valid_for)?;
            let out = out.unwrap_or(dir);
            std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
            let cert = out.join(format!("{kind}-{name}.pem"));
            let key = out.join(format!("{kind}-{name}.key"));
            write_new(&cert, &issued.cert_pem, 0o644)?;
            write_new(&key, &issued.key_pem, 0o600)?;
            Ok(
                serde_json::json!({"identity": format!("{kind}:{name}"), "cluster": ca.cluster(), "cert": cert, "key": key}),
            )
        }
        CertsCmd::Ensure {
            dir,
            cluster,
            issue,
            valid_for,
            out,
        } => {
            let mut created = Vec::new();
            let out = out.unwrap_or_else(|| dir.clone());
            if !dir.join("ca.pem").exists() {
                run(CertsCmd::Init {
                    dir: dir.clone(),
                    cluster: cluster.clone(),
                    valid_for: valid_for.max(Duration::from_secs(10 * 365 * 86_400)),
                })?;
                created.push("ca".to_string());
            }
            let ca = Ca::load_dir(&dir)?;
            anyhow::ensure!(
                ca.cluster() == cluster,
                "{} is the CA of cluster {:?}, not {cluster:?}",
                dir.display(),
                ca.cluster()
            );
            for spec in issue {
                let mut parts = spec.splitn(3, ':');
                let (Some(kind), Some(name)) = (parts.next(), parts.next()) else {
                    anyhow::bail!("--issue {spec:?}: expected KIND:NAME or KIND:NAME:SAN,SAN");
                };
                let sans: Vec<String> = parts
                    .next()
                    .map(|s| s.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
                    .unwrap_or_default();
                if out.join(format!("{kind}-{name}.pem")).exists() {
                    continue;
                }
                run(CertsCmd::Issue {
                    dir: dir.clone(),
                    kind: kind.to_string(),
                    name: name.to_string(),
                    sans,
                    valid_for,
                    out: Some(out.clone()),
                })?;
                created.push(format!("{kind}:{name}"));
            }
            if !out.join("ca.pem").exists() {
                write_new(&out.join("ca.pem"), ca.cert_pem(), 0o644)?;
            }
            Ok(serde_json::json!({"cluster": cluster, "dir": dir, "created": created}))
        }
        CertsCmd::Revoke { .. } => anyhow::bail!("`certs revoke` talks to the cluster"),
        CertsCmd::Show { cert } => {
            let pem = std::fs::read_to_string(&cert).with_context(|| format!("cannot read {}", cert.display()))?;
            let id = laneway_pki::identity_of_pem(&pem)?;
            let expires = laneway_pki::not_after(&pem)?;
            Ok(serde_json::json!({
                "identity": id.to_string(),
                "serial": laneway_pki::serial_of_pem(&pem)?,
                "uri": id.uri(),
                "cluster": id.cluster,
                "expires": humantime::format_rfc3339_seconds(expires).to_string(),
                "expired": expires <= std::time::SystemTime::now(),
            }))
        }
    }
}

/// Writes a file that must not exist yet (a CA or a key is never silently replaced).
fn write_new(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| {
            format!(
                "cannot create {} (it is never overwritten; move the old one away first)",
                path.display()
            )
        })?;
    std::io::Write::write_all(&mut f, text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
}
