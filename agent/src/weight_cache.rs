//! Content-addressed local cache of model weights.
//!
//! Blobs live at `<dir>/blobs/<sha256>`, fetched through `object_store` (`file://` by default,
//! `s3://` with the `s3` feature) into `<dir>/tmp/`, hashed while they stream, and renamed into
//! place only when size and sha256 match — a half-written or wrong blob is never visible under
//! its hash. A blob is re-verified the first time it is used after the agent starts (and its
//! size on every use), so a corrupted or truncated file is detected and fetched again.
//! Eviction is LRU by bytes against a budget; blobs pinned by running replicas are never
//! evicted.
//!
//! The index (size, last use, source) is kept in sled. sled's flush is lazy (it does not fsync
//! on every write), which is acceptable here because the index is rebuildable: at open, entries
//! whose file is missing are dropped and files without an entry are re-adopted, to be verified
//! at first use. Losing the newest index writes only costs LRU precision.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

/// A weight artifact as a model's registry entry names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    /// Where to fetch it: `file:///abs/path` or `s3://bucket/key`.
    pub uri: String,
    /// Lower-case hex sha256 of the content.
    pub sha256: String,
    /// Size in bytes.
    pub size: u64,
}

/// A blob in the cache, as reported in heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedBlob {
    pub sha256: String,
    pub size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct IndexEntry {
    size: u64,
    last_used: u64,
    uri: Option<String>,
}

/// Why the cache could not provide a blob.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("invalid artifact: {field} = {value:?}: expected {expected}")]
    BadArtifact {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("fetching {uri} failed: {detail}")]
    Fetch { uri: String, detail: String },
    #[error("{uri} has sha256 {got}, but the model registry says {expected}; the source changed or is corrupt — fix the artifact or the registry entry")]
    HashMismatch { uri: String, expected: String, got: String },
    #[error("{uri} is {got} bytes, but the model registry says {expected}")]
    SizeMismatch { uri: String, expected: u64, got: u64 },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("weight cache index: {0}")]
    Index(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CacheError {
    let what = what.into();
    move |source| CacheError::Io { what, source }
}

struct Inner {
    dir: PathBuf,
    budget_bytes: u64,
    index: sled::Db,
    pins: Mutex<HashMap<String, usize>>,
    /// Blobs whose content was hashed since this agent started.
    verified: Mutex<HashSet<String>>,
    clock: AtomicU64,
    /// One fetch-or-verify at a time: simple, and downloads share one link anyway.
    fetch: tokio::sync::Mutex<()>,
}

/// The weight cache of one agent. Cheap to clone.
#[derive(Clone)]
pub struct WeightCache {
    inner: Arc<Inner>,
}

/// A blob held for a replica: it cannot be evicted until this is dropped.
pub struct PinnedBlob {
    pub path: PathBuf,
    pub sha256: String,
    /// Whether this acquire fetched it (it was not in the cache).
    pub fetched: bool,
    inner: Arc<Inner>,
}

impl Drop for PinnedBlob {
    fn drop(&mut self) {
        let mut pins = self.inner.pins.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = pins.get_mut(&self.sha256) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&self.sha256);
            }
        }
    }
}

fn validate(a: &Artifact) -> Result<(), CacheError> {
    if a.sha256.len() != 64 || !a.sha256.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)) {
        return Err(CacheError::BadArtifact {
            field: "sha256",
            value: a.sha256.clone(),
            expected: "64 lower-case hex characters",
        });
    }
    if url::Url::parse(&a.uri).is_err() {
        return Err(CacheError::BadArtifact {
            field: "uri",
            value: a.uri.clone(),
            expected: "a URL such as file:///models/x.safetensors or s3://bucket/key",
        });
    }
    Ok(())
}

impl WeightCache {
    /// Opens (or creates) a cache in `dir` with a budget of `budget_bytes`.
    pub fn open(dir: &Path, budget_bytes: u64) -> Result<Self, CacheError> {
        for sub in ["blobs", "tmp"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io(format!("creating {}", dir.join(sub).display())))?;
        }
        // Leftover partial downloads from a crash are never valid.
        for e in std::fs::read_dir(dir.join("tmp")).map_err(io("listing tmp"))? {
            let e = e.map_err(io("listing tmp"))?;
            let _ = std::fs::remove_file(e.path());
        }
        let index = crate::local_db::open(&dir.join("index")).map_err(|e| CacheError::Index(e.to_string()))?;
        let mut max_clock = 0;
        // Drop entries whose blob is gone.
        for kv in index.iter() {
            let (k, v) = kv.map_err(|e| CacheError::Index(e.to_string()))?;
            let sha = String::from_utf8_lossy(&k).to_string();
            let entry: Option<IndexEntry> = serde_json::from_slice(&v).ok();
            match entry {
                Some(e) if dir.join("blobs").join(&sha).exists() => max_clock = max_clock.max(e.last_used),
                _ => {
                    index.remove(&k).map_err(|e| CacheError::Index(e.to_string()))?;
                }
            }
        }
        // Re-adopt blobs without an entry (verified at first use).
        for e in std::fs::read_dir(dir.join("blobs")).map_err(io("listing blobs"))? {
            let e = e.map_err(io("listing blobs"))?;
            let sha = e.file_name().to_string_lossy().to_string();
            if index.get(&sha).map_err(|e| CacheError::Index(e.to_string()))?.is_none() {
                let size = e.metadata().map_err(io("stat blob"))?.len();
                let entry = IndexEntry {
                    size,
                    last_used: 0,
                    uri: None,
                };
                index
                    .insert(&sha, serde_json::to_vec(&entry).expect("entry serializes"))
                    .map_err(|e| CacheError::Index(e.to_string()))?;
            }
        }
        Ok(WeightCache {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                budget_bytes,
                index,
                pins: Mutex::default(),
                verified: Mutex::default(),
                clock: AtomicU64::new(max_clock + 1),
                fetch: tokio::sync::Mutex::new(()),
            }),
        })
    }

    fn blob_path(&self, sha: &str) -> PathBuf {
        self.inner.dir.join("blobs").join(sha)
    }

    fn entries(&self) -> Vec<(String, IndexEntry)> {
        self.inner
            .index
            .iter()
            .filter_map(|kv| kv.ok())
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k).to_string(),
                    serde_json::from_slice(&v).ok()?,
                ))
            })
            .collect()
    }

    /// What the cache holds, for heartbeats (placement prefers warm nodes).
    pub fn contents(&self) -> Vec<CachedBlob> {
        self.entries()
            .into_iter()
            .map(|(sha256, e)| CachedBlob { sha256, size: e.size })
            .collect()
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.entries().iter().map(|(_, e)| e.size).sum()
    }

    fn touch(&self, sha: &str, size: u64, uri: &str) -> Result<(), CacheError> {
        let entry = IndexEntry {
            size,
            last_used: self.inner.clock.fetch_add(1, Ordering::Relaxed),
            uri: Some(uri.to_string()),
        };
        self.inner
            .index
            .insert(sha, serde_json::to_vec(&entry).expect("entry serializes"))
            .map_err(|e| CacheError::Index(e.to_string()))?;
        Ok(())
    }

    fn forget(&self, sha: &str) {
        let _ = std::fs::remove_file(self.blob_path(sha));
        let _ = self.inner.index.remove(sha);
        self.inner
            .verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sha);
    }

    /// Returns the blob for `artifact`, fetching and verifying it if needed, pinned until the
    /// returned guard is dropped.
    pub async fn acquire(&self, artifact: &Artifact) -> Result<PinnedBlob, CacheError> {
        validate(artifact)?;
        let sha = artifact.sha256.clone();
        let path = self.blob_path(&sha);
        let mut fetched = false;
        {
            let _one = self.inner.fetch.lock().await;
            if !self.usable(artifact, &path).await? {
                self.fetch(artifact, &path).await?;
                fetched = true;
            }
            self.touch(&sha, artifact.size, &artifact.uri)?;
            *self
                .inner
                .pins
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(sha.clone())
                .or_default() += 1;
            // Under the same lock as fetches, so no blob is verified and pinned between the
            // eviction's choice and its deletion.
            self.evict();
        }
        Ok(PinnedBlob {
            path,
            sha256: sha,
            fetched,
            inner: self.inner.clone(),
        })
    }

    /// Fetches an artifact ahead of need (a scheduler hint), without pinning it.
    pub async fn prefetch(&self, artifact: &Artifact) -> Result<(), CacheError> {
        self.acquire(artifact).await.map(drop)
    }

    /// Whether the blob on disk is the artifact: size always, content once per agent run.
    async fn usable(&self, a: &Artifact, path: &Path) -> Result<bool, CacheError> {
        let Ok(meta) = tokio::fs::metadata(path).await else {
            return Ok(false);
        };
        if meta.len() != a.size {
            tracing::warn!(sha256 = %a.sha256, on_disk = meta.len(), expected = a.size, "truncated weight blob; fetching again");
            self.forget(&a.sha256);
            return Ok(false);
        }
        if self
            .inner
            .verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&a.sha256)
        {
            return Ok(true);
        }
        let p = path.to_path_buf();
        let got = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            use std::io::Read;
            let mut f = std::fs::File::open(p)?;
            let mut h = Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
            Ok(hex::encode(h.finalize()))
        })
        .await
        .map_err(|e| CacheError::Index(e.to_string()))?
        .map_err(io("hashing a cached blob"))?;
        if got != a.sha256 {
            tracing::warn!(sha256 = %a.sha256, %got, "corrupt weight blob; fetching again");
            self.forget(&a.sha256);
            return Ok(false);
        }
        self.inner
            .verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(a.sha256.clone());
        Ok(true)
    }

    async fn fetch(&self, a: &Artifact, dest: &Path) -> Result<(), CacheError> {
        let fetch_err = |detail: String| CacheError::Fetch {
            uri: a.uri.clone(),
            detail,
        };
        let url = url::Url::parse(&a.uri).map_err(|e| fetch_err(e.to_string()))?;
        let (store, path) = object_store::parse_url(&url).map_err(|e| fetch_err(e.to_string()))?;
        let mut stream = store
            .get(&path)
            .await
            .map_err(|e| fetch_err(e.to_string()))?
            .into_stream();
        let tmp = self.inner.dir.join("tmp").join(format!("{}.part", a.sha256));
        let result = async {
            let mut file = tokio::fs::File::create(&tmp)
                .await
                .map_err(io("creating a temp blob"))?;
            let mut hasher = Sha256::new();
            let mut got: u64 = 0;
            let mut next_report = a.size / 10;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| fetch_err(e.to_string()))?;
                hasher.update(&chunk);
                got += chunk.len() as u64;
                if got > a.size {
                    return Err(CacheError::SizeMismatch {
                        uri: a.uri.clone(),
                        expected: a.size,
                        got,
                    });
                }
                file.write_all(&chunk).await.map_err(io("writing a temp blob"))?;
                if a.size >= 10 * 1024 * 1024 && got >= next_report {
                    tracing::info!(uri = %a.uri, pct = got * 100 / a.size.max(1), "downloading weights");
                    next_report += a.size / 10;
                }
            }
            if got != a.size {
                return Err(CacheError::SizeMismatch {
                    uri: a.uri.clone(),
                    expected: a.size,
                    got,
                });
            }
            let digest = hex::encode(hasher.finalize());
            if digest != a.sha256 {
                return Err(CacheError::HashMismatch {
                    uri: a.uri.clone(),
                    expected: a.sha256.clone(),
                    got: digest,
                });
            }
            file.sync_all().await.map_err(io("syncing a blob"))?;
            drop(file);
            tokio::fs::rename(&tmp, dest)
                .await
                .map_err(io("moving a blob into place"))?;
            if let Ok(d) = std::fs::File::open(self.inner.dir.join("blobs")) {
                let _ = d.sync_all();
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        } else {
            self.inner
                .verified
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(a.sha256.clone());
        }
        result
    }

    /// Evicts least-recently-used unpinned blobs until the cache fits its budget.
    fn evict(&self) {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|(_, e)| e.size).sum();
        if total <= self.inner.budget_bytes {
            return;
        }
        entries.sort_by_key(|(_, e)| e.last_used);
        for (sha, e) in entries {
            if total <= self.inner.budget_bytes {
                return;
            }
            let pinned = self
                .inner
                .pins
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&sha);
            if pinned {
                continue;
            }
            tracing::info!(sha256 = %sha, size = e.size, "evicting weight blob (LRU)");
            self.forget(&sha);
            total -= e.size;
        }
        tracing::warn!(
            used = total,
            budget = self.inner.budget_bytes,
            "weight cache over budget: every remaining blob is pinned by a running replica"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Src {
        dir: tempfile::TempDir,
    }

    impl Src {
        fn new() -> Self {
            Src {
                dir: tempfile::tempdir().unwrap(),
            }
        }

        /// Writes `content` as a source object and returns its artifact.
        fn put(&self, name: &str, content: &[u8]) -> Artifact {
            let p = self.dir.path().join(name);
            std::fs::write(&p, content).unwrap();
            Artifact {
                uri: url::Url::from_file_path(&p).unwrap().to_string(),
                sha256: hex::encode(Sha256::digest(content)),
                size: content.len() as u64,
            }
        }
    }

    #[tokio::test]
    async fn fetches_verifies_and_pins() {
        let src = Src::new();
        let a = src.put("a.bin", &[1u8; 100]);
        let dir = tempfile::tempdir().unwrap();
        let cache = WeightCache::open(dir.path(), 1_000).unwrap();
        let blob = cache.acquire(&a).await.unwrap();
        assert_eq!(std::fs::read(&blob.path).unwrap(), vec![1u8; 100]);
        assert_eq!(
            cache.contents(),
            vec![CachedBlob {
                sha256: a.sha256.clone(),
                size: 100
            }]
        );
    }

    #[tokio::test]
    async fn hash_mismatch_is_rejected_and_leaves_nothing_visible() {
        let src = Src::new();
        let mut a = src.put("a.bin", b"real weights");
        a.sha256 = hex::encode(Sha256::digest(b"other weights"));
        let dir = tempfile::tempdir().unwrap();
        let cache = WeightCache::open(dir.path(), 1_000).unwrap();
        let e = cache.acquire(&a).await.err().unwrap();
        assert!(matches!(e, CacheError::HashMismatch { .. }), "{e}");
        assert!(!dir.path().join("blobs").join(&a.sha256).exists());
        assert_eq!(std::fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
        assert!(cache.contents().is_empty());
    }

    #[tokio::test]
    async fn eviction_is_lru_by_bytes_and_respects_pins() {
        let src = Src::new();
        let a = src.put("a", &[1u8; 100]);
        let b = src.put("b", &[2u8; 100]);
        let c = src.put("c", &[3u8; 100]);
        let dir = tempfile::tempdir().unwrap();
        let cache = WeightCache::open(dir.path(), 250).unwrap();
        let pinned_a = cache.acquire(&a).await.unwrap(); // oldest, but pinned
        drop(cache.acquire(&b).await.unwrap());
        drop(cache.acquire(&c).await.unwrap());
        let held: Vec<String> = cache.contents().into_iter().map(|b| b.sha256).collect();
        assert!(held.contains(&a.sha256), "pinned blob evicted");
        assert!(!held.contains(&b.sha256), "LRU unpinned blob kept");
        assert!(held.contains(&c.sha256));
        assert!(cache.used_bytes() <= 250);
        drop(pinned_a);
    }

    #[tokio::test]
    async fn corrupt_or_truncated_blob_is_fetched_again() {
        let src = Src::new();
        let a = src.put("a", &[7u8; 64]);
        let dir = tempfile::tempdir().unwrap();
        {
            let cache = WeightCache::open(dir.path(), 1_000).unwrap();
            drop(cache.acquire(&a).await.unwrap());
        }
        // Flip bytes on disk (same size), as a bad disk would; a restarted agent re-verifies.
        let path = dir.path().join("blobs").join(&a.sha256);
        std::fs::write(&path, [8u8; 64]).unwrap();
        let cache = WeightCache::open(dir.path(), 1_000).unwrap();
        let blob = cache.acquire(&a).await.unwrap();
        assert_eq!(std::fs::read(&blob.path).unwrap(), vec![7u8; 64]);
        // Truncation is caught on every use, even within one run.
        std::fs::write(&path, [7u8; 10]).unwrap();
        let blob = cache.acquire(&a).await.unwrap();
        assert_eq!(std::fs::read(&blob.path).unwrap().len(), 64);
    }

    #[tokio::test]
    async fn bad_artifacts_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let cache = WeightCache::open(dir.path(), 1_000).unwrap();
        let bad = Artifact {
            uri: "file:///x".into(),
            sha256: "XYZ".into(),
            size: 1,
        };
        assert!(cache.acquire(&bad).await.err().unwrap().to_string().contains("sha256"));
        let bad = Artifact {
            uri: "not a url".into(),
            sha256: "a".repeat(64),
            size: 1,
        };
        assert!(cache.acquire(&bad).await.err().unwrap().to_string().contains("uri"));
    }
}
