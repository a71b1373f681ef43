//! openraft's storage conformance suite against the redb log store and state machine.

use laneway_store::raft_types::{StorageError, TypeConfig};
use laneway_store::{self as store, Identity, LogStore, StateMachineStore};
use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;

struct RedbBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for RedbBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let identity = Identity {
            cluster: "suite".into(),
            node_id: 1,
        };
        let (log, sm) = store::open(dir.path(), &identity).expect("open store");
        Ok((dir, log, sm))
    }
}

#[test]
fn redb_store_passes_openraft_suite() {
    Suite::test_all(RedbBuilder).expect("openraft storage suite");
}
