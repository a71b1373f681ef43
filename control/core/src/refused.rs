//! Why the domain refused a change, typed by what the caller can do about it: name something
//! that exists ([`Refused::NotFound`]), send a well-formed change ([`Refused::Invalid`]), or
//! change the state first ([`Refused::Conflict`]). The message is the operator's, unchanged; the
//! kind is what an API answers with (gRPC `NOT_FOUND`, `INVALID_ARGUMENT`,
//! `FAILED_PRECONDITION`), carried through Raft in [`crate::command::CommandResponse`].

use serde::{Deserialize, Serialize};

/// A refused change: its kind and the message that says what was wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Something the change names does not exist (a node, model, tenant, token, job).
    #[error("{0}")]
    NotFound(String),
    /// The change itself is malformed or out of bounds, whatever the state.
    #[error("{0}")]
    Invalid(String),
    /// The change conflicts with the state as it is (exists already, in use, in a rollout).
    #[error("{0}")]
    Conflict(String),
}

/// A [`Refused`]'s kind, as carried in a command's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    NotFound,
    Invalid,
    Conflict,
}

impl Refused {
    pub fn kind(&self) -> RefusalKind {
        match self {
            Refused::NotFound(_) => RefusalKind::NotFound,
            Refused::Invalid(_) => RefusalKind::Invalid,
            Refused::Conflict(_) => RefusalKind::Conflict,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Refused::NotFound(m) | Refused::Invalid(m) | Refused::Conflict(m) => m,
        }
    }

    /// The refusal a response carried. One without a kind (from a controller older than
    /// kinds) is a conflict, which is what every refusal was answered as then.
    pub fn from_parts(kind: Option<RefusalKind>, message: String) -> Self {
        match kind.unwrap_or(RefusalKind::Conflict) {
            RefusalKind::NotFound => Refused::NotFound(message),
            RefusalKind::Invalid => Refused::Invalid(message),
            RefusalKind::Conflict => Refused::Conflict(message),
        }
    }
}

/// A validation message (the many checks that only say what is malformed) is an invalid change.
impl From<String> for Refused {
    fn from(message: String) -> Self {
        Refused::Invalid(message)
    }
}

impl From<&str> for Refused {
    fn from(message: &str) -> Self {
        Refused::Invalid(message.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::CommandResponse;
    use crate::registry::{Registry, Tenant};

    #[test]
    fn a_refusal_keeps_its_kind_through_a_response_and_an_old_response_reads_as_before() {
        let mut r = Registry::default();
        let acme = Tenant {
            name: "acme".into(),
            key_sha256: "0".repeat(64),
            limits: Default::default(),
        };
        r.create_tenant(&acme).unwrap();
        assert!(matches!(r.create_tenant(&acme), Err(Refused::Conflict(m)) if m.contains("exists")));
        assert!(matches!(r.remove_model("ghost"), Err(Refused::NotFound(m)) if m.contains("no model ghost")));
        let bad = Tenant {
            name: "Not OK".into(),
            ..acme
        };
        assert!(matches!(r.create_tenant(&bad), Err(Refused::Invalid(_))));

        let said = CommandResponse {
            rejected: Some("no node n9".into()),
            rejected_as: Some(RefusalKind::NotFound),
            ..CommandResponse::default()
        };
        let wire = serde_json::to_string(&said).unwrap();
        assert_eq!(
            wire,
            r#"{"previous":null,"rejected":"no node n9","rejected_as":"not_found"}"#
        );
        let back: CommandResponse = serde_json::from_str(&wire).unwrap();
        assert_eq!(back.refused(), Some(Refused::NotFound("no node n9".into())));
        // A controller older than kinds sent no kind: answered as every refusal was then.
        let old: CommandResponse = serde_json::from_str(r#"{"previous":null,"rejected":"x"}"#).unwrap();
        assert_eq!(old.refused(), Some(Refused::Conflict("x".into())));
        assert_eq!(CommandResponse::default().refused(), None);
    }
}

#[cfg(test)]
mod rollout_tests {
    use super::*;
    use crate::registry::rollout::{RolloutAction, RolloutRequest, Strategy};
    use crate::registry::Model;

    /// What an operator or an automation does next depends on the kind: retry later
    /// (Conflict), name something else (NotFound), fix the request (Invalid).
    #[test]
    fn rollout_refusals_say_whether_to_wait_or_to_name_something_else() {
        let (_, mut r) = crate::fixtures::test_fixture();
        let request = |version: &str| RolloutRequest {
            model: "whisper".into(),
            version: version.into(),
            strategy: Strategy::Canary,
            steps: vec![5, 100],
            bake_s: 60,
            guards: Default::default(),
        };
        let e = request("2").rollout(&r, 0, "admin:test").unwrap_err();
        assert!(matches!(e, Refused::NotFound(m) if m.contains("no version 2")));
        let next = Model {
            version: "2".into(),
            ..r.models["whisper"].clone()
        };
        r.deploy_version(&next).unwrap();
        let rollout = request("2").rollout(&r, 0, "admin:test").unwrap();
        r.start_rollout(&rollout).unwrap();
        // No replica of version 2 is ready: promoting must wait for them.
        let e = r
            .update_rollout("whisper", None, RolloutAction::Promote, 1, "op")
            .unwrap_err();
        assert!(matches!(e, Refused::Conflict(m) if m.contains("no ready replica yet")));
        r.update_rollout("whisper", None, RolloutAction::Abort, 2, "op")
            .unwrap();
        let e = r
            .update_rollout("whisper", None, RolloutAction::Resume, 3, "op")
            .unwrap_err();
        assert!(matches!(e, Refused::Conflict(m) if m.contains("has ended")));
        let e = r
            .update_rollout("sdxl", None, RolloutAction::Abort, 4, "op")
            .unwrap_err();
        assert!(matches!(e, Refused::NotFound(_)));
    }
}
