//! A snapshot as it arrives from the leader: decoded or refused, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = laneway_control::store::snapshot_file::SnapshotFile::decode(data);
});
