use super::*;
use crate::fleet::{GpuRecord, NodeRegistration};
use crate::registry::{Class, Millis, Profile};

const MIN: u64 = 60_000;

fn config(provider: ProviderConfig) -> ProvisionConfig {
    let toml = r#"
        [provider]
        kind = "sim"
        [[pool]]
        name = "l4-east"
        product = "L4"
        gpu_memory_gb = 24
        gpus_per_node = 2
        region = "us-east-1"
        max_nodes = 3
        [[pool]]
        name = "h100-east"
        product = "H100-80GB"
        gpu_memory_gb = 80
        gpus_per_node = 8
        region = "us-east-1"
        max_nodes = 2
        boot_deadline_s = 300
        fallback = ["h100-west", "a100-east"]
        [[pool]]
        name = "h100-west"
        product = "H100-80GB"
        gpu_memory_gb = 80
        gpus_per_node = 8
        region = "us-west-2"
        max_nodes = 1
        standby = true
        [[pool]]
        name = "a100-east"
        product = "A100-80GB"
        gpu_memory_gb = 80
        gpus_per_node = 8
        region = "us-east-1"
        max_nodes = 1
        standby = true
        [[pool]]
        name = "spot-east"
        product = "H100-80GB"
        gpu_memory_gb = 80
        gpus_per_node = 8
        region = "us-east-1"
        tier = "spot"
        max_nodes = 4
    "#;
    let mut c: ProvisionConfig = toml::from_str(toml).unwrap();
    c.validate().unwrap();
    c.provider = provider;
    c
}

fn sim() -> ProviderConfig {
    ProviderConfig::Sim {
        boot_delay_s: 0.0,
        unavailable: vec![],
        spot_notice_after_s: None,
        dir: None,
    }
}

/// `whisper` (speech, sync) on L4 or H100 at 10 GB; `wan` (video, durable) on H100 or
/// A100, a whole card.
fn registry() -> Registry {
    let mut r = Registry::default();
    r.put_class(&Class::for_test("speech", LaneKind::Sync)).unwrap();
    r.put_class(&Class {
        budget_ms: Millis::from_ms(600_000.0),
        ..Class::for_test("video", LaneKind::Durable)
    })
    .unwrap();
    let profile = |gb| Profile {
        service_ms: Millis::from_ms(50.0),
        max_batch: 4,
        gpu_memory_gb: gb,
        mig_profiles: vec![],
        tokens_per_s: None,
    };
    let model = |name: &str, class: &str, profiles: Vec<(&str, u32)>| Model {
        inputs: Vec::new(),
        outputs: Vec::new(),
        fallback: None,
        name: name.into(),
        class: class.into(),
        version: "1".into(),
        profiles: profiles
            .into_iter()
            .map(|(p, gb)| (p.to_string(), profile(gb)))
            .collect(),
        runtime: Default::default(),
        weights: vec![],
        llm: None,
        serves: None,
    };
    r.put_model(&model("whisper", "speech", vec![("L4", 10), ("H100-80GB", 10)]))
        .unwrap();
    r.put_model(&model("wan", "video", vec![("H100-80GB", 0), ("A100-80GB", 0)]))
        .unwrap();
    r
}

fn unplaced(model: &str, missing: usize) -> Unplaced {
    Unplaced {
        model: model.into(),
        reason: "no room".into(),
        missing,
    }
}

fn pass(cfg: &ProvisionConfig, fleet: &Fleet, reg: &Registry, demand: &[Unplaced], now_ms: u64) -> ProvisionPlan {
    let mut n = 0;
    plan(
        &PlanInputs {
            config: cfg,
            fleet,
            registry: reg,
            unplaced: demand,
            now_ms,
        },
        &mut |p: &PoolSpec| {
            n += 1;
            format!("{}-{n}", p.name)
        },
    )
}

fn apply(reg: &mut Registry, p: &ProvisionPlan) {
    for c in &p.commands {
        match c {
            Command::PutNodeRequest(r) => {
                reg.capacity.node_requests.insert(r.id.clone(), r.clone());
            }
            Command::RemoveNodeRequest { id } => {
                reg.capacity.node_requests.remove(id);
            }
            Command::SetCapacityMark { key, mark } => match mark {
                Some(m) => {
                    reg.capacity.capacity_marks.insert(key.clone(), m.clone());
                }
                None => {
                    reg.capacity.capacity_marks.remove(key);
                }
            },
            _ => {}
        }
    }
}

fn requests(p: &ProvisionPlan) -> Vec<NodeRequest> {
    p.commands
        .iter()
        .filter_map(|c| match c {
            Command::PutNodeRequest(r) if r.state == RequestState::Requested => Some(r.clone()),
            _ => None,
        })
        .collect()
}

fn join(fleet: &mut Fleet, r: &NodeRequest) {
    fleet
        .register(&NodeRegistration {
            node_id: r.id.clone(),
            hostname: r.id.clone(),
            pool: r.pool.clone(),
            labels: Default::default(),
            gpus: (0..r.gpus)
                .map(|g| GpuRecord {
                    uuid: format!("{}-{g}", r.id),
                    product: r.product.clone(),
                    memory_bytes: 80_000_000_000,
                    mig_capable: false,
                })
                .collect(),
            replica_host: String::new(),
        })
        .unwrap();
}

#[test]
fn unplaced_replicas_become_node_requests_on_the_smallest_card_once() {
    let cfg = config(sim());
    let fleet = Fleet::default();
    let mut reg = registry();
    // 5 replicas of 10 GB: two per 24 GB L4, two L4s per node → 2 nodes.
    let p = pass(&cfg, &fleet, &reg, &[unplaced("whisper", 5)], 0);
    let made = requests(&p);
    assert_eq!(made.len(), 2, "{p:?}");
    assert!(made
        .iter()
        .all(|r| r.pool == "l4-east" && r.gpus == 2 && r.deadline_ms == 600_000));
    assert!(
        p.events
            .iter()
            .any(|(_, e)| e.contains("requested 2 L4 node(s) in pool l4-east")),
        "{p:?}"
    );
    apply(&mut reg, &p);
    // The same demand next pass: the nodes coming cover it.
    let p = pass(&cfg, &fleet, &reg, &[unplaced("whisper", 5)], 1000);
    assert!(requests(&p).is_empty(), "asked twice: {p:?}");
    // More demand than they cover asks for the rest only, up to the pool's max_nodes.
    let p = pass(&cfg, &fleet, &reg, &[unplaced("whisper", 20)], 2000);
    assert_eq!(requests(&p).len(), 1, "max_nodes 3: {p:?}");
}

#[test]
fn spot_capacity_is_asked_for_durable_lanes_only() {
    let mut cfg = config(sim());
    // Only H100 pools: whisper may not use spot-east, wan prefers it only by order.
    cfg.pools.retain(|p| p.product == "H100-80GB");
    for p in &mut cfg.pools {
        p.fallback.clear();
        p.standby = false;
    }
    cfg.pools.retain(|p| p.name != "h100-west");
    cfg.pools.rotate_left(1); // spot-east first
    let reg = registry();
    let p = pass(&cfg, &Fleet::default(), &reg, &[unplaced("whisper", 1)], 0);
    assert!(requests(&p).iter().all(|r| r.tier != Tier::Spot), "{p:?}");
    assert_eq!(requests(&p).len(), 1);
    let p = pass(&cfg, &Fleet::default(), &reg, &[unplaced("wan", 1)], 0);
    assert_eq!(requests(&p)[0].pool, "spot-east", "{p:?}");
}

#[test]
fn a_launch_that_never_joins_marks_the_capacity_and_the_fallback_is_used_visibly() {
    let cfg = config(sim());
    let fleet = Fleet::default();
    let mut reg = registry();
    let p = pass(&cfg, &fleet, &reg, &[unplaced("wan", 1)], 0);
    assert_eq!(requests(&p)[0].pool, "h100-east");
    apply(&mut reg, &p);
    // Past its 300 s deadline: a capacity mark, the request gone, and in the same pass the
    // first fallback, another region, saying what it stands in for.
    let p = pass(&cfg, &fleet, &reg, &[unplaced("wan", 1)], 5 * MIN);
    assert!(p.commands.contains(&Command::RemoveNodeRequest {
        id: "h100-east-1".into()
    }));
    let r = &requests(&p)[0];
    assert_eq!((r.pool.as_str(), r.region.as_str()), ("h100-west", "us-west-2"));
    assert!(r.fallback_from.as_deref().is_some_and(|f| f.starts_with("h100-east")));
    assert!(
        p.events.iter().any(|(_, e)| e.contains("fallback for pool h100-east")),
        "{p:?}"
    );
    apply(&mut reg, &p);
    let mark = &reg.capacity.capacity_marks["H100-80GB@us-east-1"];
    assert_eq!(mark.until_ms, 5 * MIN + 600_000);
    assert!(mark.why.contains("did not join within 300 s"), "{mark:?}");
    // Both H100 regions out: the A100 fallback (a product the model also lists).
    reg.capacity.capacity_marks.insert(
        "H100-80GB@us-west-2".into(),
        CapacityMark {
            product: "H100-80GB".into(),
            region: "us-west-2".into(),
            until_ms: 30 * MIN,
            why: "test".into(),
        },
    );
    reg.capacity.node_requests.clear();
    let p = pass(&cfg, &fleet, &reg, &[unplaced("wan", 1)], 6 * MIN);
    assert_eq!(requests(&p)[0].product, "A100-80GB", "{p:?}");
    // whisper does not list A100: with its L4 pool full and H100 out, it waits, saying why.
    let mut cfg2 = cfg.clone();
    cfg2.pools.retain(|p| p.product != "L4");
    let p = pass(&cfg2, &fleet, &reg, &[unplaced("whisper", 1)], 6 * MIN);
    assert!(requests(&p).is_empty(), "{p:?}");
    assert!(p.stuck[0].1.contains("has no capacity until"), "{:?}", p.stuck);
    // The mark expires: launches there are tried again.
    let p = pass(&cfg, &fleet, &reg, &[], 16 * MIN);
    assert!(
        p.commands.contains(&Command::SetCapacityMark {
            key: "H100-80GB@us-east-1".into(),
            mark: None
        }),
        "{p:?}"
    );
}

#[test]
fn a_node_that_joins_is_kept_while_busy_and_given_back_when_idle() {
    let cfg = config(sim());
    let mut fleet = Fleet::default();
    let mut reg = registry();
    let p = pass(&cfg, &fleet, &reg, &[unplaced("whisper", 1)], 0);
    apply(&mut reg, &p);
    let r = requests(&p)[0].clone();
    join(&mut fleet, &r);
    let p = pass(&cfg, &fleet, &reg, &[], 30_000);
    apply(&mut reg, &p);
    assert_eq!(reg.capacity.node_requests[&r.id].state, RequestState::Joined);
    assert!(p
        .events
        .iter()
        .any(|(_, e)| e.contains("joined pool l4-east after 30 s")));
    // Busy: a replica placed there.
    reg.set_desired(
        &r.id,
        &[crate::registry::DesiredReplica {
            id: "w-1".into(),
            model: "whisper".into(),
            gpu: format!("{}-0", r.id),
            product: "L4".into(),
        }],
    );
    let p = pass(&cfg, &fleet, &reg, &[], 60_000);
    apply(&mut reg, &p);
    assert_eq!(reg.capacity.node_requests[&r.id].idle_since_ms, None);
    // Idle from 2 min; given back 10 min later, drained first.
    reg.set_desired(&r.id, &[]);
    let p = pass(&cfg, &fleet, &reg, &[], 2 * MIN);
    apply(&mut reg, &p);
    assert_eq!(reg.capacity.node_requests[&r.id].idle_since_ms, Some(2 * MIN));
    let p = pass(&cfg, &fleet, &reg, &[], 11 * MIN);
    assert!(
        !p.commands.iter().any(|c| matches!(c, Command::SetNodeFlags { .. })),
        "{p:?}"
    );
    let p = pass(&cfg, &fleet, &reg, &[], 12 * MIN);
    assert!(p.commands.contains(&Command::SetNodeFlags {
        node_id: r.id.clone(),
        cordoned: None,
        draining: Some(true)
    }));
    apply(&mut reg, &p);
    assert_eq!(reg.capacity.node_requests[&r.id].state, RequestState::Releasing);
}

#[test]
fn static_hosts_are_named_from_the_list_and_never_given_back() {
    let cfg = config(ProviderConfig::Static {
        hosts: vec![
            StaticHost {
                node_id: "rack1-l4".into(),
                pool: "l4-east".into(),
            },
            StaticHost {
                node_id: "rack2-l4".into(),
                pool: "l4-east".into(),
            },
        ],
    });
    let mut fleet = Fleet::default();
    let mut reg = registry();
    let p = pass(&cfg, &fleet, &reg, &[unplaced("whisper", 20)], 0);
    let ids: Vec<String> = requests(&p).into_iter().map(|r| r.id).collect();
    assert_eq!(ids, ["rack1-l4", "rack2-l4"], "only the listed hosts: {p:?}");
    apply(&mut reg, &p);
    join(&mut fleet, &reg.capacity.node_requests["rack1-l4"].clone());
    let p = pass(&cfg, &fleet, &reg, &[], 1000);
    apply(&mut reg, &p);
    let p = pass(&cfg, &fleet, &reg, &[], 2000);
    apply(&mut reg, &p);
    let p = pass(&cfg, &fleet, &reg, &[], 60 * MIN);
    assert!(
        !p.commands.iter().any(|c| matches!(c, Command::SetNodeFlags { .. })),
        "a fixed host stays: {p:?}"
    );
}

#[test]
fn the_example_config_is_valid() {
    let cfg: ProvisionConfig = toml::from_str(include_str!("../../../../deploy/examples/provision.toml")).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.pools.len(), 5);
}

#[test]
fn bad_configs_are_refused_saying_what_to_fix() {
    let mut cfg = config(sim());
    cfg.pools[1].fallback = vec!["nowhere".into()];
    assert!(cfg.validate().unwrap_err().message().contains("fallback \"nowhere\""));
    let mut cfg = config(sim());
    cfg.pools[0].gpus_per_node = 0;
    assert!(cfg.validate().unwrap_err().message().contains("gpus_per_node"));
    let cfg = config(ProviderConfig::Static {
        hosts: vec![StaticHost {
            node_id: "h1".into(),
            pool: "gone".into(),
        }],
    });
    assert!(cfg
        .validate()
        .unwrap_err()
        .message()
        .contains("no [[pool]] named \"gone\""));
    let err = toml::from_str::<ProvisionConfig>("[provider]\nkind = \"cloud\"\n").unwrap_err();
    assert!(err.to_string().contains("cloud"), "{err}");
}
