//! The results store: where agents write durable jobs' results and routers read them back,
//! through `object_store` (a local directory by default, `s3://` with the `s3` feature).
//!
//! A result's key names the job **and the fencing token** of the attempt that wrote it
//! (`jobs/<job id>/<token>`), so an executor that lost its assignment writes beside the
//! published result, never over it; the controllers publish exactly one key per job.

use std::sync::Arc;

use bytes::Bytes;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

/// Why the store could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ResultStoreError {
    #[error("results store {location:?}: {message}")]
    Open { location: String, message: String },
    #[error("no result object {0}")]
    NotFound(String),
    #[error("results store: {0}")]
    Io(String),
}

/// A handle to the results store; cheap to clone.
#[derive(Clone)]
pub struct ResultStore {
    store: Arc<dyn ObjectStore>,
    root: Path,
    location: String,
}

impl std::fmt::Debug for ResultStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultStore").field("location", &self.location).finish()
    }
}

pub use laneway_core::jobs::result_key;

impl ResultStore {
    /// Opens `location`: a directory path or `file://` URL (created if missing), or an
    /// object-store URL such as `s3://bucket/prefix`.
    pub fn open(location: &str) -> Result<Self, ResultStoreError> {
        let err = |message: String| ResultStoreError::Open {
            location: location.to_string(),
            message,
        };
        let dir = match location.strip_prefix("file://") {
            Some(p) => Some(std::path::PathBuf::from(p)),
            None if !location.contains("://") => Some(std::path::PathBuf::from(location)),
            None => None,
        };
        let (store, root): (Arc<dyn ObjectStore>, Path) = match dir {
            Some(dir) => {
                std::fs::create_dir_all(&dir).map_err(|e| err(format!("cannot create the directory: {e}")))?;
                let dir = dir
                    .canonicalize()
                    .map_err(|e| err(format!("cannot resolve the directory: {e}")))?;
                let fs = LocalFileSystem::new_with_prefix(&dir).map_err(|e| err(e.to_string()))?;
                (Arc::new(fs), Path::default())
            }
            None => {
                let url = url::Url::parse(location).map_err(|e| err(format!("not a URL: {e}")))?;
                let (store, root) = object_store::parse_url(&url)
                    .map_err(|e| err(format!("{e} (s3:// needs laneway built with the `s3` feature)")))?;
                (Arc::from(store), root)
            }
        };
        Ok(ResultStore {
            store,
            root,
            location: location.to_string(),
        })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    fn path(&self, key: &str) -> Path {
        let mut p = self.root.clone();
        for part in key.split('/').filter(|s| !s.is_empty()) {
            p = p.join(part);
        }
        p
    }

    /// Writes an object (atomically on a local directory: a temp file renamed into place).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), ResultStoreError> {
        self.store
            .put(&self.path(key), PutPayload::from(bytes))
            .await
            .map(|_| ())
            .map_err(|e| ResultStoreError::Io(format!("writing {key}: {e}")))
    }

    /// Reads an object.
    pub async fn get(&self, key: &str) -> Result<Bytes, ResultStoreError> {
        match self.store.get(&self.path(key)).await {
            Ok(r) => r
                .bytes()
                .await
                .map_err(|e| ResultStoreError::Io(format!("reading {key}: {e}"))),
            Err(object_store::Error::NotFound { .. }) => Err(ResultStoreError::NotFound(key.to_string())),
            Err(e) => Err(ResultStoreError::Io(format!("reading {key}: {e}"))),
        }
    }

    /// Whether an object exists.
    pub async fn exists(&self, key: &str) -> Result<bool, ResultStoreError> {
        match self.store.head(&self.path(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(ResultStoreError::Io(format!("checking {key}: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn writes_and_reads_back_under_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let store = ResultStore::open(dir.path().join("results").to_str().unwrap()).unwrap();
        let key = result_key("job-1", 42);
        assert!(!store.exists(&key).await.unwrap());
        assert!(matches!(store.get(&key).await, Err(ResultStoreError::NotFound(_))));
        store.put(&key, Bytes::from_static(b"{\"ok\":1}")).await.unwrap();
        assert_eq!(store.get(&key).await.unwrap(), Bytes::from_static(b"{\"ok\":1}"));
        assert!(dir.path().join("results/jobs/job-1/42").exists());
        let again = ResultStore::open(&format!("file://{}", dir.path().join("results").display())).unwrap();
        assert!(again.exists(&key).await.unwrap());
    }
}
