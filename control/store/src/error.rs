//! Errors opening or using a controller's data dir.

use std::path::PathBuf;

/// Why the storage layer failed. Opening errors are shown to the operator verbatim.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("redb error while {what}: {message}")]
    Db { what: String, message: String },
    #[error(
        "data in {path} is format {found}, but this laneway-control understands formats up to \
         {supported}; run a newer laneway-control on it (downgrades are not supported)"
    )]
    NewerFormat { path: PathBuf, found: u32, supported: u32 },
    #[error(
        "the data in {path} belongs to node {found} of cluster {found_cluster:?}, but this controller \
         is configured as node {expected} of cluster {expected_cluster:?}; point --data-dir at \
         this node's own directory (or an empty one to join as a new node)"
    )]
    WrongIdentity {
        path: PathBuf,
        found: u64,
        found_cluster: String,
        expected: u64,
        expected_cluster: String,
    },
    #[error(
        "{path} is in use by another running process (another controller on the same data dir?); \
         stop it or give this controller its own --data-dir"
    )]
    InUse { path: PathBuf },
    #[error("corrupt record {what} in {path}: {message}")]
    Corrupt {
        path: PathBuf,
        what: String,
        message: String,
    },
    #[error("the log writer has stopped after an earlier failure: {0}")]
    WriterStopped(String),
}

impl StoreError {
    pub(crate) fn db(what: impl Into<String>, e: impl std::fmt::Display) -> Self {
        StoreError::Db {
            what: what.into(),
            message: e.to_string(),
        }
    }
}
