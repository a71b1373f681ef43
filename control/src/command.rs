//! The replicated command set: everything a controller proposes through Raft.
//!
//! Commands are wrapped in a [`CommandEnvelope`] that carries the command format version. A
//! controller refuses to apply a command whose format is newer than it understands rather than
//! guess, so a half-upgraded cluster stops visibly instead of diverging. New commands are added
//! as new enum variants (never by changing an existing variant's fields), and the format number
//! goes up when an older binary must not apply them.

use serde::{Deserialize, Serialize};

use crate::fleet::{validate_node_id, NodeRegistration};

/// Highest command format this binary can apply.
pub const COMMAND_FORMAT: u32 = 1;

/// Longest setting key accepted, in bytes.
pub const MAX_SETTING_KEY_BYTES: usize = 256;
/// Largest setting value accepted, in bytes.
pub const MAX_SETTING_VALUE_BYTES: usize = 64 * 1024;

/// A command plus the format version it was written with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandEnvelope {
    pub format: u32,
    pub command: Command,
}

impl CommandEnvelope {
    /// Wraps `command` with this binary's command format.
    pub fn new(command: Command) -> Self {
        Self {
            format: COMMAND_FORMAT,
            command,
        }
    }
}

/// A state transition of the controllers' replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Set a cluster setting (a string key/value the operator owns).
    PutSetting { key: String, value: String },
    /// Remove a cluster setting; removing an absent key is not an error.
    DeleteSetting { key: String },
    /// Several commands committed as one log entry (group commit), applied in order. Never
    /// nested.
    Batch(Vec<Command>),
    /// An agent registers (or re-registers) its node and GPUs.
    RegisterNode(NodeRegistration),
    /// The leader's node monitor commits a liveness transition.
    SetNodeLiveness { node_id: String, up: bool },
    /// Operator flags: cordon (no new replicas) and drain (move replicas off).
    SetNodeFlags {
        node_id: String,
        cordoned: Option<bool>,
        draining: Option<bool>,
    },
}

/// What applying one log entry produced.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResponse {
    /// For settings commands: the value the key held before.
    pub previous: Option<String>,
    /// For a batch: one response per command, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch: Vec<CommandResponse>,
    /// Set when the state machine refused the command (state unchanged), with the reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
}

/// Why a command was refused before it was proposed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CommandError {
    #[error("setting key is empty: give a non-empty key such as `fleet.region`")]
    EmptyKey,
    #[error("setting key is {len} bytes; keys are at most {MAX_SETTING_KEY_BYTES} bytes")]
    KeyTooLong { len: usize },
    #[error("setting key {key:?} contains a control character; use printable characters")]
    KeyNotPrintable { key: String },
    #[error("setting value is {len} bytes; values are at most {MAX_SETTING_VALUE_BYTES} bytes")]
    ValueTooLarge { len: usize },
    #[error("a batch may not contain another batch")]
    NestedBatch,
    #[error("{0}")]
    InvalidNode(String),
}

impl Command {
    /// Bytes of user data the command carries (keys and values), for batch sizing.
    pub fn payload_bytes(&self) -> usize {
        match self {
            Command::PutSetting { key, value } => key.len() + value.len(),
            Command::DeleteSetting { key } => key.len(),
            Command::Batch(commands) => commands.iter().map(Command::payload_bytes).sum(),
            Command::RegisterNode(r) => {
                256 + r.node_id.len()
                    + r.hostname.len()
                    + r.pool.len()
                    + r.gpus
                        .iter()
                        .map(|g| 96 + g.uuid.len() + g.product.len())
                        .sum::<usize>()
                    + r.labels.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>()
            }
            Command::SetNodeLiveness { node_id, .. } | Command::SetNodeFlags { node_id, .. } => node_id.len() + 16,
        }
    }

    /// Checks a command's arguments before it is proposed, so nothing malformed reaches the log.
    pub fn validate(&self) -> Result<(), CommandError> {
        match self {
            Command::PutSetting { key, value } => {
                validate_key(key)?;
                if value.len() > MAX_SETTING_VALUE_BYTES {
                    return Err(CommandError::ValueTooLarge { len: value.len() });
                }
                Ok(())
            }
            Command::DeleteSetting { key } => validate_key(key),
            Command::Batch(commands) => commands.iter().try_for_each(|c| match c {
                Command::Batch(_) => Err(CommandError::NestedBatch),
                other => other.validate(),
            }),
            Command::RegisterNode(r) => r.validate().map_err(CommandError::InvalidNode),
            Command::SetNodeLiveness { node_id, .. } | Command::SetNodeFlags { node_id, .. } => {
                validate_node_id(node_id).map_err(CommandError::InvalidNode)
            }
        }
    }
}

/// Checks a setting key (shared by writes and reads).
pub fn validate_key(key: &str) -> Result<(), CommandError> {
    if key.is_empty() {
        return Err(CommandError::EmptyKey);
    }
    if key.len() > MAX_SETTING_KEY_BYTES {
        return Err(CommandError::KeyTooLong { len: key.len() });
    }
    if key.chars().any(char::is_control) {
        return Err(CommandError::KeyNotPrintable {
            key: key.escape_debug().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let long = "k".repeat(MAX_SETTING_KEY_BYTES + 1);
        let cases = [
            (
                Command::DeleteSetting { key: String::new() },
                Some(CommandError::EmptyKey),
            ),
            (
                Command::DeleteSetting { key: long.clone() },
                Some(CommandError::KeyTooLong { len: long.len() }),
            ),
            (
                Command::PutSetting {
                    key: "a".into(),
                    value: "v".repeat(MAX_SETTING_VALUE_BYTES + 1),
                },
                Some(CommandError::ValueTooLarge {
                    len: MAX_SETTING_VALUE_BYTES + 1,
                }),
            ),
            (
                Command::PutSetting {
                    key: "a\nb".into(),
                    value: String::new(),
                },
                Some(CommandError::KeyNotPrintable { key: "a\\nb".into() }),
            ),
            (
                Command::PutSetting {
                    key: "fleet.region".into(),
                    value: "eu".into(),
                },
                None,
            ),
        ];
        for (cmd, want) in cases {
            assert_eq!(cmd.validate().err(), want, "{cmd:?}");
        }
    }
}
