//! Small states for the tests of this crate and the crates above (feature `test-util`).

use crate::fleet::Fleet;
use crate::registry::{Class, Registry};

/// One L4 node (`n1`, `GPU-1`, replicas dialled on 127.0.0.1), a sync class `speech` and a
/// model `whisper` (20 ms, batch 4): the fixture of the router's unit tests.
pub fn test_fixture() -> (Fleet, Registry) {
    use crate::fleet::{GpuRecord, NodeRegistration};
    use crate::registry::{LaneKind, Millis, Model, Profile};
    let mut fleet = Fleet::default();
    fleet
        .register(&NodeRegistration {
            node_id: "n1".into(),
            hostname: "n1".into(),
            pool: "l4".into(),
            labels: Default::default(),
            gpus: vec![GpuRecord {
                uuid: "GPU-1".into(),
                product: "L4".into(),
                memory_bytes: 1,
                mig_capable: false,
            }],
            replica_host: "127.0.0.1".into(),
        })
        .unwrap();
    // The tests' replicas are set by hand, as static replicas are.
    fleet.set_static("n1", true).unwrap();
    let mut reg = Registry::default();
    reg.put_class(&Class {
        warm_floor: 1,
        ..Class::for_test("speech", LaneKind::Sync)
    })
    .unwrap();
    reg.put_model(&Model {
        inputs: Vec::new(),
        outputs: Vec::new(),
        fallback: None,
        name: "whisper".into(),
        class: "speech".into(),
        version: "1".into(),
        profiles: [(
            "L4".to_string(),
            Profile {
                service_ms: Millis::from_ms(20.0),
                max_batch: 4,
                gpu_memory_gb: 1,
                mig_profiles: vec![],
                tokens_per_s: None,
            },
        )]
        .into(),
        runtime: Default::default(),
        weights: vec![],
        llm: None,
        serves: None,
    })
    .unwrap();
    (fleet, reg)
}
