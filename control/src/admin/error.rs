//! Errors of the admin API and their mapping to gRPC status codes.

use laneway_proto::LEADER_ADDR_METADATA;
use tonic::metadata::MetadataValue;
use tonic::Status;

use openraft::error::{ChangeMembershipError, CheckIsLeaderError, ClientWriteError};

use crate::node::ControllerNode;

/// Why an admin call failed. Mapped exhaustively to a `tonic::Status` in [`From`].
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The request was malformed; the message says which field and what is expected.
    #[error("{0}")]
    InvalidArgument(String),
    /// A value was outside its allowed range.
    #[error("{0}")]
    OutOfRange(String),
    /// Something the request names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// This controller is not the leader; the request must go to `leader_addr`.
    #[error("node {node_id} is not the leader; the leader is node {leader_id} at {leader_addr} (lanectl follows this redirect)")]
    NotLeader {
        node_id: u64,
        leader_id: u64,
        leader_addr: String,
    },
    /// No leader is known (an election is in progress or there is no quorum).
    #[error("node {node_id} knows no leader (election in progress or no quorum); retry in a moment, and check `lanectl cluster status` if it persists")]
    NoLeader { node_id: u64 },
    /// The request conflicts with the cluster's state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// This controller cannot serve the request now (no quorum, raft stopped, a membership
    /// change in progress); another controller or a retry may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// The operation did not finish in time.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A storage or Raft failure on this controller.
    #[error("internal error on this controller: {0}")]
    Internal(String),
}

impl From<AdminError> for Status {
    fn from(e: AdminError) -> Status {
        let msg = e.to_string();
        match e {
            AdminError::InvalidArgument(_) => Status::invalid_argument(msg),
            AdminError::OutOfRange(_) => Status::out_of_range(msg),
            AdminError::NotFound(_) => Status::not_found(msg),
            AdminError::NotLeader { leader_addr, .. } => {
                let mut status = Status::failed_precondition(msg);
                if let Ok(v) = MetadataValue::try_from(leader_addr.as_str()) {
                    status.metadata_mut().insert(LEADER_ADDR_METADATA, v);
                }
                status
            }
            AdminError::NoLeader { .. } => Status::unavailable(msg),
            AdminError::FailedPrecondition(_) => Status::failed_precondition(msg),
            AdminError::Unavailable(_) => Status::unavailable(msg),
            AdminError::DeadlineExceeded(_) => Status::deadline_exceeded(msg),
            AdminError::Internal(_) => Status::internal(msg),
        }
    }
}

/// The domain's refusal, answered by its kind.
impl From<laneway_core::refused::Refused> for AdminError {
    fn from(r: laneway_core::refused::Refused) -> Self {
        use laneway_core::refused::Refused;
        match r {
            Refused::NotFound(m) => AdminError::NotFound(m),
            Refused::Invalid(m) => AdminError::InvalidArgument(m),
            Refused::Conflict(m) => AdminError::FailedPrecondition(m),
        }
    }
}

/// Maps an openraft API error to an admin error: one exhaustive match per openraft error type,
/// where retryability is decided.
pub trait RaftApiError {
    fn to_admin(&self, node_id: u64) -> AdminError;
}

impl RaftApiError for ClientWriteError<u64, ControllerNode> {
    fn to_admin(&self, node_id: u64) -> AdminError {
        match self {
            // Callers turn forwards into redirects first; one without a leader lands here.
            ClientWriteError::ForwardToLeader(_) => AdminError::NoLeader { node_id },
            ClientWriteError::ChangeMembershipError(e) => match e {
                ChangeMembershipError::InProgress(_) => AdminError::Unavailable(format!(
                    "{e}; another membership change is still being committed, retry in a moment"
                )),
                ChangeMembershipError::EmptyMembership(_) | ChangeMembershipError::LearnerNotFound(_) => {
                    AdminError::FailedPrecondition(e.to_string())
                }
            },
        }
    }
}

impl RaftApiError for CheckIsLeaderError<u64, ControllerNode> {
    fn to_admin(&self, node_id: u64) -> AdminError {
        match self {
            CheckIsLeaderError::ForwardToLeader(_) => AdminError::NoLeader { node_id },
            CheckIsLeaderError::QuorumNotEnough(e) => AdminError::Unavailable(format!(
                "{e}; the leader cannot reach a quorum, so it cannot confirm a linearizable read"
            )),
        }
    }
}
