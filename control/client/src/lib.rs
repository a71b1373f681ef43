//! Client of the admin API that follows leader redirects; used by `lanectl`, tests and the
//! benchmarks.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use laneway_proto::admin::admin_service_client::AdminServiceClient;
use laneway_proto::LEADER_ADDR_METADATA;
use tokio::time::Instant;
use tonic::transport::{Channel, ClientTlsConfig};
use tonic::{Code, Status};

/// Redirects followed for one call before giving up (guards against a redirect loop during an
/// election).
const MAX_REDIRECTS: usize = 5;

/// Why a call failed after following redirects and retrying.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid controller address {addr:?}: {message}")]
    BadAddress { addr: String, message: String },
    #[error("{addr}: {}: {}", .status.code(), .status.message())]
    Status { addr: String, status: Status },
    #[error("no controller answered within {waited:?} (tried {tried}); last error: {last}")]
    Unreachable {
        waited: Duration,
        tried: String,
        last: String,
    },
}

impl ClientError {
    /// The gRPC status code, when the server answered.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Status { status, .. } => Some(status.code()),
            _ => None,
        }
    }
}

/// Admin API client over a list of controller addresses.
pub struct AdminClient {
    addrs: Vec<String>,
    /// How long to keep retrying when no controller answers or no leader is known.
    retry_for: Duration,
    /// Per-call deadline.
    call_timeout: Duration,
    channels: Mutex<HashMap<String, Channel>>,
    /// Last address that answered a write, tried first.
    preferred: Mutex<Option<String>>,
    /// TLS towards the controllers (`None`: plaintext, development clusters only).
    tls: Option<ClientTlsConfig>,
    /// An admin bearer token sent with every call (for callers without a certificate).
    bearer: Bearer,
    /// Controllers learned since (a router-only process learns every member from its
    /// routing state), tried after `addrs`.
    learned: Mutex<Vec<String>>,
    /// Largest answer decoded, bytes (tonic's default 4 MiB when `None`).
    max_decoding: Option<usize>,
}

/// Adds `authorization: Bearer …` to every call when a token is set.
#[derive(Clone, Default)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// The admin API client type `call` hands to its closures.
pub type Admin = AdminServiceClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

impl AdminClient {
    /// `addrs`: `host:port` of one or more controllers.
    pub fn new(addrs: Vec<String>) -> Self {
        AdminClient {
            addrs,
            retry_for: Duration::from_secs(10),
            call_timeout: Duration::from_secs(75),
            channels: Mutex::default(),
            preferred: Mutex::default(),
            tls: None,
            bearer: Bearer::default(),
            learned: Mutex::default(),
            max_decoding: None,
        }
    }

    /// Decodes answers up to `bytes` (a routing state or a page of jobs can pass tonic's
    /// default 4 MiB).
    pub fn with_max_decoding(mut self, bytes: usize) -> Self {
        self.max_decoding = Some(bytes);
        self
    }

    /// Adds controllers to try after the configured ones (members learned from the cluster).
    pub fn learn(&self, addrs: &[String]) {
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        for a in addrs {
            if !self.addrs.contains(a) && !learned.contains(a) {
                learned.push(a.clone());
            }
        }
    }

    fn client(&self, channel: Channel) -> Admin {
        let c = AdminServiceClient::with_interceptor(channel, self.bearer.clone());
        match self.max_decoding {
            Some(n) => c.max_decoding_message_size(n),
            None => c,
        }
    }

    /// Authenticates every call with an admin bearer token (`lanectl token create --role`),
    /// for callers without a client certificate. The token must be printable ASCII.
    pub fn with_token(mut self, token: Option<&str>) -> Result<Self, ClientError> {
        self.bearer =
            Bearer(
                token
                    .map(|t| format!("Bearer {t}").parse())
                    .transpose()
                    .map_err(|_| ClientError::BadAddress {
                        addr: String::new(),
                        message: "the admin token holds characters a header cannot carry".into(),
                    })?,
            );
        Ok(self)
    }

    /// Speaks TLS to the controllers (which must present a controller certificate of the
    /// cluster's CA).
    pub fn with_tls(mut self, tls: Option<ClientTlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// Changes how long calls keep retrying unreachable controllers or a missing leader.
    pub fn with_retry_for(mut self, d: Duration) -> Self {
        self.retry_for = d;
        self
    }

    /// Changes the deadline of one attempt.
    pub fn with_call_timeout(mut self, d: Duration) -> Self {
        self.call_timeout = d;
        self
    }

    /// The configured addresses.
    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    fn channel(&self, addr: &str) -> Result<Channel, ClientError> {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let ep = laneway_pki::endpoint(addr, self.tls.clone()).map_err(|message| ClientError::BadAddress {
            addr: addr.to_string(),
            message,
        })?;
        let ch = ep
            .connect_timeout(Duration::from_millis(500))
            .timeout(self.call_timeout)
            .tcp_nodelay(true)
            .connect_lazy();
        map.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }

    /// Calls one specific controller, without redirects or retries.
    pub async fn call_one<T, F, Fut>(&self, addr: &str, f: F) -> Result<T, ClientError>
    where
        F: FnOnce(Admin) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let client = self.client(self.channel(addr)?);
        f(client)
            .await
            .map(|r| r.into_inner())
            .map_err(|status| ClientError::Status {
                addr: addr.to_string(),
                status,
            })
    }

    /// Calls the cluster: follows leader redirects, and retries other controllers while none
    /// answers or no leader is known, for up to `retry_for`.
    ///
    /// A request that timed out may still have been committed, and is then sent again: use it
    /// for idempotent operations (setting a value, membership changes that check the current
    /// membership first). Non-idempotent submissions carry their own idempotency key.
    pub async fn call<T, F, Fut>(&self, mut f: F) -> Result<T, ClientError>
    where
        F: FnMut(Admin) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        if self.addrs.is_empty() {
            return Err(ClientError::BadAddress {
                addr: String::new(),
                message: "no controller address given".into(),
            });
        }
        let start = Instant::now();
        let mut order: Vec<String> = Vec::new();
        if let Some(p) = self.preferred.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            order.push(p);
        }
        order.extend(self.addrs.iter().cloned());
        order.extend(self.learned.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned());
        let mut next = 0usize;
        let mut target = order[0].clone();
        let mut redirects = 0usize;
        let mut last;
        loop {
            let client = self.client(self.channel(&target)?);
            match f(client).await {
                Ok(r) => {
                    *self.preferred.lock().unwrap_or_else(|p| p.into_inner()) = Some(target);
                    return Ok(r.into_inner());
                }
                Err(status) => {
                    let leader = status
                        .metadata()
                        .get(LEADER_ADDR_METADATA)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    match (status.code(), leader) {
                        (Code::FailedPrecondition, Some(leader)) if redirects < MAX_REDIRECTS && leader != target => {
                            redirects += 1;
                            target = leader;
                            continue;
                        }
                        (Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown, _)
                        | (Code::FailedPrecondition, Some(_)) => {
                            last = format!("{target}: {}", status.message());
                        }
                        _ => return Err(ClientError::Status { addr: target, status }),
                    }
                }
            }
            if start.elapsed() >= self.retry_for {
                return Err(ClientError::Unreachable {
                    waited: start.elapsed(),
                    tried: self.addrs.join(","),
                    last,
                });
            }
            next += 1;
            if next.is_multiple_of(order.len()) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            target = order[next % order.len()].clone();
            redirects = 0;
        }
    }
}
