//! Who a certificate speaks for: a kind (controller, agent, or an admin role) and a name, and the
//! rules every such name follows. The certificates themselves are `laneway_pki`'s; the names are
//! domain, checked by commands (admin tokens, revocations) as well as by the TLS layer.

use std::fmt;
use std::str::FromStr;

/// A name or kind that cannot stand in an identity; the message says what to use instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IdentityError(pub String);

/// What a certificate's holder is, and for people and scripts, what they may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A `laneway-control` process; its name is its Raft node id.
    Controller,
    /// A `laneway-agent`; its name is its node id.
    Agent,
    /// Reads everything, changes nothing.
    Viewer,
    /// Runs the fleet: models, classes, tenants, prices, nodes, MIG layouts.
    Operator,
    /// Everything, including cluster membership and credentials.
    Admin,
    /// A router-only `laneway-control router` process; its name is its router number. It reads
    /// the routing state, writes durable jobs and reports its usage and load — nothing else.
    Router,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Controller,
        Kind::Agent,
        Kind::Viewer,
        Kind::Operator,
        Kind::Admin,
        Kind::Router,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Controller => "controller",
            Kind::Agent => "agent",
            Kind::Viewer => "viewer",
            Kind::Operator => "operator",
            Kind::Admin => "admin",
            Kind::Router => "router",
        }
    }

    /// A person's or a script's role (viewer, operator, admin), as opposed to a process.
    pub fn is_role(self) -> bool {
        matches!(self, Kind::Viewer | Kind::Operator | Kind::Admin)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Kind {
    type Err = IdentityError;
    fn from_str(s: &str) -> Result<Self, IdentityError> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            IdentityError(format!(
                "unknown kind {s:?}; use controller, agent, router, viewer, operator or admin"
            ))
        })
    }
}

/// Router-only processes report load and usage under ids from here up (router number `n`
/// reports as `ROUTER_REPORTER_BASE + n`), apart from controllers' node ids, which stay below.
pub const ROUTER_REPORTER_BASE: u64 = 1 << 32;

/// Who holds a certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerIdentity {
    pub cluster: String,
    pub kind: Kind,
    pub name: String,
}

impl PeerIdentity {
    /// Checks the parts: a cluster and a name of letters, digits, `-`, `_` and `.`.
    pub fn new(cluster: &str, kind: Kind, name: &str) -> Result<PeerIdentity, IdentityError> {
        for (what, v) in [("cluster name", cluster), ("name", name)] {
            let ok = !v.is_empty()
                && v.len() <= 128
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if !ok {
                return Err(IdentityError(format!(
                    "{what} {v:?} cannot go in a certificate: use 1-128 letters, digits, '-', '_' or '.'"
                )));
            }
        }
        if kind == Kind::Controller && name.parse::<u64>().is_err() {
            return Err(IdentityError(format!(
                "a controller's name is its node id (a number), not {name:?}"
            )));
        }
        if kind == Kind::Router && !name.parse::<u32>().is_ok_and(|n| n > 0) {
            return Err(IdentityError(format!(
                "a router's name is its router number (1 to {}), not {name:?}",
                u32::MAX
            )));
        }
        Ok(PeerIdentity {
            cluster: cluster.to_string(),
            kind,
            name: name.to_string(),
        })
    }

    pub fn uri(&self) -> String {
        format!("laneway://{}/{}/{}", self.cluster, self.kind, self.name)
    }

    /// Parses `laneway://<cluster>/<kind>/<name>`; `None` when `uri` is not a Laneway identity.
    pub fn from_uri(uri: &str) -> Option<Result<PeerIdentity, IdentityError>> {
        let rest = uri.strip_prefix("laneway://")?;
        let mut parts = rest.split('/');
        let (Some(cluster), Some(kind), Some(name), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Some(Err(IdentityError(format!("malformed identity {uri:?}"))));
        };
        Some(kind.parse().and_then(|kind| PeerIdentity::new(cluster, kind, name)))
    }

    /// The controller's Raft node id, when this is a controller.
    /// The router-only process's number, when this is one.
    pub fn router_number(&self) -> Option<u32> {
        (self.kind == Kind::Router).then(|| self.name.parse().ok()).flatten()
    }

    /// The id a controller or router-only process reports its load and usage under: a
    /// controller's node id, or [`ROUTER_REPORTER_BASE`] plus a router's number.
    pub fn reporter_id(&self) -> Option<u64> {
        self.controller_id()
            .or_else(|| self.router_number().map(|n| ROUTER_REPORTER_BASE + u64::from(n)))
    }

    pub fn controller_id(&self) -> Option<u64> {
        (self.kind == Kind::Controller)
            .then(|| self.name.parse().ok())
            .flatten()
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.name)
    }
}
