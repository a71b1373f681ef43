use std::collections::HashSet;

use super::dispatch::{dispatch, Assignment};
use super::*;
use crate::command::Command;
use crate::refused::Refused;
use crate::registry::{ReplicaRecord, Tenant, TenantLimit};
use crate::state::AppState;

fn sub(id: &str, tenant: &str, key: Option<&str>, body: &str) -> JobSubmission {
    JobSubmission {
        id: id.into(),
        tenant: tenant.into(),
        model: "wan-video".into(),
        class: "video".into(),
        input: Some(body.into()),
        input_uri: None,
        idempotency_key: key.map(str::to_string),
        body_sha256: format!("sha-of-{body}"),
        max_attempts: 2,
        at_ms: 1_000,
    }
}

fn ok_result(id: &str, token: u64) -> Completion {
    Completion::Succeeded(JobResult {
        key: format!("jobs/{id}/{token}"),
        bytes: 10,
        gpu_us: 45_000_000,
        content_type: "application/json".into(),
    })
}

fn failed(retryable: bool) -> Completion {
    Completion::Failed {
        reason: "replica crashed".into(),
        retryable,
    }
}

#[test]
fn idempotency_key_returns_the_same_job_and_refuses_a_different_body() {
    let mut j = Jobs::default();
    assert_eq!(
        j.submit(&sub("a", "t1", Some("k"), "x"), None, 1),
        Ok(JobOutcome::Created { id: "a".into() })
    );
    // Same key, same body, new id proposed by another router: the first job.
    assert_eq!(
        j.submit(&sub("b", "t1", Some("k"), "x"), None, 2),
        Ok(JobOutcome::Existing { id: "a".into() })
    );
    assert_eq!(
        j.submit(&sub("c", "t1", Some("k"), "y"), None, 3),
        Ok(JobOutcome::KeyConflict { id: "a".into() })
    );
    // Keys are per tenant.
    assert_eq!(
        j.submit(&sub("d", "t2", Some("k"), "y"), None, 4),
        Ok(JobOutcome::Created { id: "d".into() })
    );
    assert_eq!(j.jobs.len(), 2);
    // The index survives a rebuild (a restart or a snapshot install).
    let mut restored = Jobs::default();
    for job in j.jobs.values() {
        restored.load(job.clone());
    }
    restored.rebuild_index();
    assert_eq!(
        restored.submit(&sub("e", "t1", Some("k"), "x"), None, 5),
        Ok(JobOutcome::Existing { id: "a".into() })
    );
}

#[test]
fn the_same_submission_proposed_twice_is_one_job_and_a_stolen_id_is_refused() {
    let mut j = Jobs::default();
    let first = sub("a", "t1", None, "x");
    assert_eq!(j.submit(&first, None, 1), Ok(JobOutcome::Created { id: "a".into() }));
    // A router unsure whether its first proposal committed proposes it again: the same job,
    // still one, and the ceiling does not count it twice.
    assert_eq!(j.submit(&first, Some(1), 2), Ok(JobOutcome::Created { id: "a".into() }));
    assert_eq!(j.jobs.len(), 1);
    assert_eq!(j.active("t1", "video"), 1);
    // With an idempotency key too: the retry is the creation the client asked for, not a
    // replay of an earlier request.
    let keyed = sub("k1", "t1", Some("key"), "x");
    assert_eq!(j.submit(&keyed, None, 3), Ok(JobOutcome::Created { id: "k1".into() }));
    assert_eq!(j.submit(&keyed, None, 4), Ok(JobOutcome::Created { id: "k1".into() }));
    assert_eq!(
        j.submit(&sub("k2", "t1", Some("key"), "x"), None, 5),
        Ok(JobOutcome::Existing { id: "k1".into() }),
        "another router's submission with the same key is the replay"
    );
    assert_eq!(j.jobs.len(), 2);
    // The same id with another tenant, model or body is not a retry.
    let mut other_tenant = first.clone();
    other_tenant.tenant = "t2".into();
    let mut other_model = first.clone();
    other_model.model = "other".into();
    let other_body = sub("a", "t1", None, "y");
    for s in [other_tenant, other_model, other_body] {
        let e = j.submit(&s, None, 6).unwrap_err();
        assert!(e.message().contains("job id a is already taken"), "{e}");
    }
    assert_eq!(j.jobs.len(), 2);
}

#[test]
fn ceiling_counts_queued_and_placed_jobs_and_frees_on_finish() {
    let mut j = Jobs::default();
    assert!(matches!(
        j.submit(&sub("a", "t", None, "1"), Some(2), 1),
        Ok(JobOutcome::Created { .. })
    ));
    assert!(matches!(
        j.submit(&sub("b", "t", None, "2"), Some(2), 2),
        Ok(JobOutcome::Created { .. })
    ));
    assert_eq!(
        j.submit(&sub("c", "t", None, "3"), Some(2), 3),
        Ok(JobOutcome::OverCeiling { active: 2, limit: 2 })
    );
    // Another tenant has its own ceiling.
    assert!(matches!(
        j.submit(&sub("d", "u", None, "4"), Some(2), 4),
        Ok(JobOutcome::Created { .. })
    ));
    j.assign("a", "n1", "r1", 5, 10).unwrap();
    assert_eq!(j.active("t", "video"), 2, "an assigned job still counts");
    j.finish("a", 5, &ok_result("a", 5), 20).unwrap();
    assert_eq!(j.active("t", "video"), 1);
    assert!(matches!(
        j.submit(&sub("c", "t", None, "3"), Some(2), 6),
        Ok(JobOutcome::Created { .. })
    ));
}

#[test]
fn ceiling_comes_from_the_tenant_limit_in_the_state_machine() {
    let mut s = AppState::default();
    let mut limits = std::collections::BTreeMap::new();
    limits.insert(
        "video".to_string(),
        TenantLimit {
            concurrency: 1,
            rate_per_s: 10,
            burst: 10,
            tokens_per_min: None,
        },
    );
    s.registry.tenants.insert(
        "t".into(),
        Tenant {
            name: "t".into(),
            key_sha256: "00".into(),
            limits,
        },
    );
    let r = s.apply(&Command::SubmitJob(sub("a", "t", None, "1")), 1);
    assert_eq!(r.job, Some(JobOutcome::Created { id: "a".into() }));
    let r = s.apply(&Command::SubmitJob(sub("b", "t", None, "2")), 2);
    assert_eq!(r.job, Some(JobOutcome::OverCeiling { active: 1, limit: 1 }));
}

#[test]
fn a_stale_token_cannot_complete_a_job() {
    let mut j = Jobs::default();
    j.submit(&sub("a", "t", None, "1"), None, 1).unwrap();
    j.assign("a", "n1", "r1", 10, 100).unwrap();
    j.started("a", 10, 110).unwrap();
    assert_eq!(j.get("a").unwrap().state, JobState::Running);
    // The first executor fails; the retry goes to another node with a higher token.
    j.finish("a", 10, &failed(true), 120).unwrap();
    assert_eq!(j.get("a").unwrap().state, JobState::Queued);
    j.assign("a", "n2", "r2", 20, 130).unwrap();
    // The first executor reports (late) that it succeeded after all: refused.
    let err = j.finish("a", 10, &ok_result("a", 10), 140).unwrap_err();
    assert!(err.message().contains("stale token 10"), "{err}");
    assert!(j.started("a", 10, 140).is_err());
    j.finish("a", 20, &ok_result("a", 20), 150).unwrap();
    let job = j.get("a").unwrap();
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.result.as_ref().unwrap().key, "jobs/a/20");
    assert_eq!(job.input, None, "a finished job drops its input");
    // A duplicate completion (the agent resending from its outbox) changes nothing.
    assert!(j.finish("a", 20, &ok_result("a", 20), 160).is_err());
    assert_eq!(j.get("a").unwrap().finished_ms, Some(150));
}

#[test]
fn a_token_never_goes_backwards() {
    let mut j = Jobs::default();
    j.submit(&sub("a", "t", None, "1"), None, 1).unwrap();
    j.assign("a", "n1", "r1", 10, 100).unwrap();
    j.finish("a", 10, &failed(true), 120).unwrap();
    assert!(j.assign("a", "n1", "r1", 10, 130).is_err());
    assert!(j.assign("a", "n1", "r1", 9, 130).is_err());
}

/// A state with one registered node.
fn state_with_node(node_id: &str) -> AppState {
    let mut s = AppState::default();
    s.fleet
        .register(&crate::fleet::NodeRegistration {
            node_id: node_id.into(),
            hostname: "h".into(),
            pool: "p".into(),
            labels: Default::default(),
            gpus: Vec::new(),
            replica_host: String::new(),
        })
        .unwrap();
    s
}

/// Commits job `job`'s assignment to `node`/`replica` at log `index` (its fencing token).
fn assign(s: &mut AppState, job: &str, node: &str, replica: &str, index: u64) {
    s.apply(
        &Command::AssignJobs {
            assignments: vec![Assignment {
                job_id: job.into(),
                node_id: node.into(),
                replica_id: replica.into(),
            }],
            at_ms: 5,
        },
        index,
    );
}

#[test]
fn node_down_requeues_its_jobs_and_fences_the_old_token() {
    let mut s = state_with_node("n1");
    s.apply(&Command::SubmitJob(sub("a", "t", None, "1")), 1);
    s.apply(&Command::SubmitJob(sub("b", "t", None, "2")), 2);
    assign(&mut s, "a", "n1", "r1", 3);
    assert_eq!(s.jobs.get("a").unwrap().token, Some(3));
    s.apply(
        &Command::NodeDown {
            node_id: "n1".into(),
            at_ms: 9,
        },
        4,
    );
    let a = s.jobs.get("a").unwrap();
    assert_eq!(a.state, JobState::Queued);
    assert_eq!(a.token, None);
    assert_eq!(a.failures, vec!["attempt 1: node n1 was declared down".to_string()]);
    let r = s.apply(
        &Command::FinishJob {
            job_id: "a".into(),
            token: 3,
            completion: ok_result("a", 3),
            at_ms: 10,
        },
        5,
    );
    assert!(r.rejected.unwrap().contains("stale token"));
    assert_eq!(
        s.jobs.get("b").unwrap().state,
        JobState::Queued,
        "unplaced jobs are untouched"
    );
}

#[test]
fn a_preemption_notice_drains_the_node_and_requeues_its_jobs_before_it_dies() {
    let mut s = state_with_node("spot-1");
    s.apply(&Command::SubmitJob(sub("a", "t", None, "1")), 1);
    let assign = |node: &str| Command::AssignJobs {
        assignments: vec![Assignment {
            job_id: "a".into(),
            node_id: node.into(),
            replica_id: "r1".into(),
        }],
        at_ms: 5,
    };
    s.apply(&assign("spot-1"), 2);
    s.apply(
        &Command::JobStarted {
            job_id: "a".into(),
            token: 2,
            at_ms: 6,
        },
        3,
    );
    let r = s.apply(
        &Command::PreemptNode {
            node_id: "spot-1".into(),
            at_ms: 7,
        },
        4,
    );
    assert_eq!(r.rejected, None);
    let node = &s.fleet.nodes["spot-1"];
    assert!(
        node.cordoned && node.draining,
        "no new work lands on a node about to die"
    );
    assert_eq!(
        node.liveness,
        crate::fleet::Liveness::Up,
        "it still serves until it dies"
    );
    let a = s.jobs.get("a").unwrap();
    assert_eq!((a.state, a.token), (JobState::Queued, None));
    assert_eq!(
        a.failures,
        vec!["attempt 1: node spot-1 got a spot preemption notice".to_string()]
    );
    // The preempted executor is fenced: its late completion is refused.
    let late = s.apply(
        &Command::FinishJob {
            job_id: "a".into(),
            token: 2,
            completion: ok_result("a", 2),
            at_ms: 8,
        },
        5,
    );
    // A fenced executor's write conflicts with the state; a node nobody registered is not found:
    // the API answers FAILED_PRECONDITION and NOT_FOUND for them.
    assert!(matches!(late.refused(), Some(Refused::Conflict(m)) if m.contains("stale token")));
    let unknown = s.apply(
        &Command::PreemptNode {
            node_id: "nope".into(),
            at_ms: 9,
        },
        6,
    );
    assert!(matches!(unknown.refused(), Some(Refused::NotFound(m)) if m.contains("no node nope")));
}

#[test]
fn a_job_fails_for_good_after_its_attempts_or_a_non_retryable_error() {
    let mut j = Jobs::default();
    j.submit(&sub("a", "t", None, "1"), None, 1).unwrap();
    j.assign("a", "n", "r", 2, 0).unwrap();
    j.finish("a", 2, &failed(true), 0).unwrap();
    j.assign("a", "n", "r", 3, 0).unwrap();
    j.finish("a", 3, &failed(true), 0).unwrap();
    let a = j.get("a").unwrap();
    assert_eq!(a.state, JobState::Failed, "max_attempts is 2");
    assert_eq!(a.failures.len(), 2);
    assert_eq!(j.active("t", "video"), 0);

    j.submit(&sub("b", "t", None, "2"), None, 4).unwrap();
    j.assign("b", "n", "r", 5, 0).unwrap();
    j.finish("b", 5, &failed(false), 0).unwrap();
    assert_eq!(
        j.get("b").unwrap().state,
        JobState::Failed,
        "a bad input is not retried"
    );
}

#[test]
fn cancel_in_each_state() {
    let mut j = Jobs::default();
    for (i, id) in ["q", "as", "ru", "done"].iter().enumerate() {
        j.submit(&sub(id, "t", None, id), None, i as u64 + 1).unwrap();
    }
    j.assign("as", "n", "r", 10, 0).unwrap();
    j.assign("ru", "n", "r", 11, 0).unwrap();
    j.started("ru", 11, 0).unwrap();
    j.assign("done", "n", "r", 12, 0).unwrap();
    j.finish("done", 12, &ok_result("done", 12), 0).unwrap();
    assert_eq!(j.active("t", "video"), 3);
    for (id, from) in [
        ("q", JobState::Queued),
        ("as", JobState::Assigned),
        ("ru", JobState::Running),
    ] {
        assert_eq!(j.cancel(id, 50), Ok(JobOutcome::Cancelled { from }));
        let job = j.get(id).unwrap();
        assert_eq!(job.state, JobState::Cancelled);
        assert_eq!(job.token, None, "the executor's token is void");
    }
    assert_eq!(j.active("t", "video"), 0);
    // A cancelled running job's executor cannot publish a result.
    assert!(j.finish("ru", 11, &ok_result("ru", 11), 60).is_err());
    assert_eq!(
        j.cancel("done", 70),
        Ok(JobOutcome::AlreadyFinished {
            state: JobState::Succeeded
        })
    );
    assert_eq!(
        j.cancel("q", 70),
        Ok(JobOutcome::AlreadyFinished {
            state: JobState::Cancelled
        })
    );
    assert!(j.cancel("nope", 70).is_err());
}

#[test]
fn compaction_forgets_old_finished_jobs_and_their_keys() {
    let mut j = Jobs::default();
    j.submit(&sub("old", "t", Some("k1"), "1"), None, 1).unwrap();
    j.submit(&sub("new", "t", None, "2"), None, 2).unwrap();
    j.submit(&sub("live", "t", None, "3"), None, 3).unwrap();
    j.cancel("old", 100).unwrap();
    j.cancel("new", 900).unwrap();
    j.take_dirty();
    assert_eq!(j.compact(500), 1);
    assert!(j.get("old").is_none());
    assert!(j.get("new").is_some() && j.get("live").is_some());
    assert!(
        j.take_dirty().iter().any(|(_, id)| id == "old"),
        "the removal is persisted"
    );
    // The key is free again.
    assert!(matches!(
        j.submit(&sub("again", "t", Some("k1"), "other"), None, 4),
        Ok(JobOutcome::Created { .. })
    ));
}

#[test]
fn submissions_are_checked() {
    let mut s = sub("a", "t", None, "1");
    s.input = Some("x".repeat(MAX_INLINE_INPUT_BYTES + 1));
    assert!(s.validate().unwrap_err().message().contains("URI"));
    let mut s = sub("a", "t", None, "1");
    s.input_uri = Some("file:///x".into());
    assert!(s.validate().unwrap_err().message().contains("not both"));
    let mut s = sub("A b", "t", None, "1");
    s.max_attempts = 1;
    assert!(s.validate().is_err());
}

/// A fleet of `nodes` Up nodes, each with one ready replica of wan-video (max batch 2 on H100).
fn durable_fleet(nodes: usize) -> AppState {
    use crate::registry::{Class, LaneKind, Millis, Model, Profile};
    let mut s = AppState::default();
    s.registry
        .put_class(&Class {
            overflow: None,
            hedge: None,
            fallback_response: None,
            cache: None,
            name: "video".into(),
            lane: LaneKind::Durable,
            utilisation_target_pct: 80,
            budget_ms: Millis::from_ms(600_000.0),
            warm_floor: 1,
            protection_rank: 2,
            request_timeout_ms: Millis::from_ms(120_000.0),
            degraded: None,
            slo_p99_ms: None,
            tolerations: vec![],
            time_slicing: false,
            input_prefixes: vec![],
            llm: None,
        })
        .unwrap();
    s.registry
        .put_model(&Model {
            inputs: Vec::new(),
            outputs: Vec::new(),
            fallback: None,
            name: "wan-video".into(),
            class: "video".into(),
            version: "1".into(),
            profiles: [(
                "H100-80GB".to_string(),
                Profile {
                    service_ms: Millis::from_ms(45_000.0),
                    max_batch: 2,
                    gpu_memory_gb: 40,
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
    for n in 0..nodes {
        let node = format!("n{n}");
        s.fleet
            .register(&crate::fleet::NodeRegistration {
                node_id: node.clone(),
                hostname: "h".into(),
                pool: "p".into(),
                labels: Default::default(),
                gpus: vec![crate::fleet::GpuRecord {
                    uuid: format!("GPU-{n}"),
                    product: "H100-80GB".into(),
                    memory_bytes: 80 << 30,
                    mig_capable: true,
                }],
                replica_host: String::new(),
            })
            .unwrap();
        s.registry.placement.replicas.insert(
            node.clone(),
            vec![ReplicaRecord {
                id: format!("video-{n}"),
                model: "wan-video".into(),
                device: format!("GPU-{n}"),
                state: "ready".into(),
                endpoint: "127.0.0.1:1".into(),
            }],
        );
    }
    s
}

fn assign_all(s: &mut AppState, index: u64) -> Vec<Assignment> {
    let a = dispatch(&s.fleet, &s.registry, &s.jobs, &HashSet::new());
    s.apply(
        &Command::AssignJobs {
            assignments: a.clone(),
            at_ms: 0,
        },
        index,
    );
    a
}

#[test]
fn dispatch_fills_replicas_up_to_their_max_batch_and_no_further() {
    let mut s = durable_fleet(2);
    for i in 0..10 {
        s.apply(
            &Command::SubmitJob(sub(&format!("j{i:02}"), "t", None, &i.to_string())),
            i + 1,
        );
    }
    let a = assign_all(&mut s, 100);
    assert_eq!(a.len(), 4, "2 replicas × max batch 2");
    assert!(assign_all(&mut s, 101).is_empty(), "full replicas take nothing more");
    // FIFO within the tenant: the four oldest.
    let mut ids: Vec<_> = a.iter().map(|a| a.job_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["j00", "j01", "j02", "j03"]);
    // One finishes: exactly one more goes out.
    s.apply(
        &Command::FinishJob {
            job_id: "j00".into(),
            token: 100,
            completion: ok_result("j00", 100),
            at_ms: 0,
        },
        102,
    );
    let next = assign_all(&mut s, 103);
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].job_id, "j04");
}

#[test]
fn dispatch_shares_replicas_fairly_across_tenants() {
    let mut s = durable_fleet(1);
    // A floods first, B submits one job later.
    for i in 0..20 {
        s.apply(
            &Command::SubmitJob(sub(&format!("a{i:02}"), "A", None, &i.to_string())),
            i + 1,
        );
    }
    s.apply(&Command::SubmitJob(sub("b00", "B", None, "b")), 50);
    let a = assign_all(&mut s, 100);
    let tenants: Vec<_> = a
        .iter()
        .map(|x| s.jobs.get(&x.job_id).unwrap().tenant.as_str())
        .collect();
    assert!(tenants.contains(&"B"), "B's job is not behind A's backlog: {tenants:?}");
}

#[test]
fn dispatch_skips_down_draining_and_suspect_nodes_and_unready_replicas() {
    let mut s = durable_fleet(3);
    s.fleet.set_liveness("n0", crate::fleet::Liveness::Down).unwrap();
    s.fleet.set_flags("n1", None, Some(true)).unwrap();
    s.registry.placement.replicas.get_mut("n2").unwrap()[0].state = "starting".into();
    s.apply(&Command::SubmitJob(sub("a", "t", None, "1")), 1);
    assert!(dispatch(&s.fleet, &s.registry, &s.jobs, &HashSet::new()).is_empty());
    s.registry.placement.replicas.get_mut("n2").unwrap()[0].state = "ready".into();
    // A node whose heartbeat stream dropped (suspect) gets nothing new either.
    let n2 = HashSet::from(["n2".to_string()]);
    assert!(dispatch(&s.fleet, &s.registry, &s.jobs, &n2).is_empty());
    let a = dispatch(&s.fleet, &s.registry, &s.jobs, &HashSet::new());
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].node_id, "n2");
}

#[test]
fn the_derived_indexes_kept_on_every_transition_match_a_rebuild() {
    let mut j = Jobs::default();
    for i in 0..12u64 {
        let key = (i % 3 == 0).then(|| format!("k{i}"));
        j.submit(
            &sub(
                &format!("j{i:02}"),
                if i % 2 == 0 { "A" } else { "B" },
                key.as_deref(),
                &i.to_string(),
            ),
            None,
            i + 1,
        )
        .unwrap();
    }
    for i in 0..8u64 {
        j.assign(&format!("j{i:02}"), if i < 4 { "n1" } else { "n2" }, "r", 100 + i, 0)
            .unwrap();
    }
    j.started("j00", 100, 0).unwrap();
    // j03 stays running: its count in `Running` must match a rebuild's.
    j.started("j03", 103, 0).unwrap();
    j.finish("j00", 100, &ok_result("j00", 100), 5).unwrap();
    j.finish("j01", 101, &failed(true), 5).unwrap();
    j.cancel("j02", 5).unwrap();
    j.cancel("j10", 5).unwrap();
    j.requeue_node("n2", "node n2 was declared down", 6);
    j.submit(&sub("j12", "A", None, "12"), None, 13).unwrap();
    j.cancel("j12", 7).unwrap();
    assert!(j.any_finished_before(6));
    assert_eq!(j.compact(6), 3, "j00, j02 and j10 finished at 5; j12 at 7 stays");
    assert!(!j.any_finished_before(6));
    assert!(j.any_finished_before(8));
    let mut rebuilt = j.clone();
    rebuilt.rebuild_index();
    assert_eq!(j.derived(), rebuilt.derived());
    assert_eq!(
        j.queued("wan-video"),
        8,
        "j01 requeued, n2's four requeued, j08, j09, j11"
    );
    assert_eq!(j.placed_on("n1").count(), 1, "only j03 is still on n1");
    assert_eq!(j.placed_on("n2").count(), 0);
}

/// A job is metered once, when it ends: its GPU time at the price of the card its replica ran
/// on, on the node's tier; a failed attempt that is retried is not yet a request.
#[test]
fn a_finished_job_is_metered_at_the_price_of_its_card() {
    let mut s = state_with_node("n1");
    s.apply(
        &Command::SetPrice {
            product: "H100-80GB".into(),
            tier: crate::ledger::Tier::OnDemand,
            micros_per_hour: Some(3_600_000),
        },
        1,
    );
    s.apply(
        &Command::SetDesiredReplicas {
            node_id: "n1".into(),
            replicas: vec![crate::registry::DesiredReplica {
                id: "r1".into(),
                model: "wan-video".into(),
                gpu: "GPU-1".into(),
                product: "H100-80GB".into(),
            }],
        },
        2,
    );
    s.apply(&Command::SubmitJob(sub("a", "t", None, "1")), 3);
    assign(&mut s, "a", "n1", "r1", 4);
    s.apply(
        &Command::FinishJob {
            job_id: "a".into(),
            token: 4,
            completion: failed(true),
            at_ms: 6,
        },
        5,
    );
    assert!(
        s.ledger.minutes.is_empty(),
        "a retried attempt is not a finished request"
    );
    assign(&mut s, "a", "n1", "r1", 6);
    // A stale completion is refused and meters nothing.
    let stale = s.apply(
        &Command::FinishJob {
            job_id: "a".into(),
            token: 4,
            completion: ok_result("a", 4),
            at_ms: 7,
        },
        7,
    );
    assert!(stale.rejected.is_some());
    assert!(s.ledger.minutes.is_empty());
    s.apply(
        &Command::FinishJob {
            job_id: "a".into(),
            token: 6,
            completion: ok_result("a", 6),
            at_ms: 8,
        },
        8,
    );
    let rows: Vec<_> = s.ledger.minutes.values().flatten().collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = rows[0];
    assert_eq!((r.key.model.as_str(), r.key.tenant.as_str()), ("wan-video", "t"));
    assert_eq!(
        (r.key.product.as_str(), r.key.pool.as_str(), r.key.tier.as_str()),
        ("H100-80GB", "p", "on-demand")
    );
    assert_eq!((r.counts.requests, r.counts.ok, r.counts.gpu_us), (1, 1, 45_000_000));
    // 45 GPU-seconds at $3.60/h = $0.045.
    assert_eq!(r.counts.cost_nanos, 45_000_000);
}

/// A job on a static replica (not placed by the scheduler) is priced by the GPU it runs on.
#[test]
fn a_job_on_a_static_replica_is_priced_by_its_gpu() {
    let mut s = AppState::default();
    s.fleet
        .register(&crate::fleet::NodeRegistration {
            node_id: "n1".into(),
            hostname: "h".into(),
            pool: "p".into(),
            labels: [("tier".to_string(), "spot".to_string())].into(),
            gpus: vec![crate::fleet::GpuRecord {
                uuid: "GPU-9".into(),
                product: "L4".into(),
                memory_bytes: 24 << 30,
                mig_capable: false,
            }],
            replica_host: String::new(),
        })
        .unwrap();
    s.apply(
        &Command::SetPrice {
            product: "L4".into(),
            tier: crate::ledger::Tier::Spot,
            micros_per_hour: Some(360_000),
        },
        1,
    );
    s.apply(
        &Command::SetNodeReplicas {
            node_id: "n1".into(),
            replicas: vec![ReplicaRecord {
                id: "static-0".into(),
                model: "wan-video".into(),
                device: "GPU-9".into(),
                state: "ready".into(),
                endpoint: "h:1".into(),
            }],
        },
        2,
    );
    s.apply(&Command::SubmitJob(sub("a", "t", None, "1")), 3);
    assign(&mut s, "a", "n1", "static-0", 4);
    s.apply(
        &Command::FinishJob {
            job_id: "a".into(),
            token: 4,
            completion: ok_result("a", 4),
            at_ms: 6,
        },
        5,
    );
    let row = s.ledger.minutes.values().flatten().next().expect("metered");
    assert_eq!((row.key.product.as_str(), row.key.tier.as_str()), ("L4", "spot"));
    // 45 GPU-seconds at $0.36/h.
    assert_eq!(row.counts.cost_nanos, 4_500_000);
}

/// An agent's report is held to the attempt: the result must be the one this attempt was
/// told to write (not another tenant's), of a plain media type, and the GPU time it meters
/// is capped at what the attempt's wall time allows.
#[test]
fn a_result_is_bound_to_its_attempt_and_its_gpu_time_to_the_wall_clock() {
    let mut j = Jobs::default();
    j.submit(&sub("a", "t", None, "1"), None, 1).unwrap();
    j.submit(&sub("b", "other", None, "2"), None, 2).unwrap();
    j.assign("a", "n1", "r1", 5, 10_000).unwrap();
    let theirs = Completion::Succeeded(JobResult {
        key: "jobs/b/6".into(),
        bytes: 10,
        gpu_us: 1,
        content_type: "application/json".into(),
    });
    let e = j.finish("a", 5, &theirs, 11_000).unwrap_err();
    assert!(e.message().contains("this attempt's result is jobs/a/5"), "{e}");
    let html = Completion::Succeeded(JobResult {
        key: "jobs/a/5".into(),
        bytes: 10,
        gpu_us: 1,
        content_type: "text/html\r\nSet-Cookie: x".into(),
    });
    assert!(j
        .finish("a", 5, &html, 11_000)
        .unwrap_err()
        .message()
        .contains("content type"));
    let inflated = Completion::Succeeded(JobResult {
        key: "jobs/a/5".into(),
        bytes: 10,
        gpu_us: u64::MAX,
        content_type: "application/json; charset=utf-8".into(),
    });
    j.finish("a", 5, &inflated, 12_000).unwrap();
    let billed = j.get("a").unwrap().result.as_ref().unwrap().gpu_us;
    assert_eq!(
        billed,
        2_000 * 1000 * MAX_GPUS_PER_ATTEMPT,
        "2 s of the most GPUs one host has"
    );
}

/// The leader's clock stepped back between assignment and finish (or forward at the
/// assignment): the stamps measure nothing, and the reported GPU time is billed, capped at the
/// longest attempt the default timeout allows, never as zero.
#[test]
fn gpu_time_is_billed_when_the_leaders_clock_went_back_during_the_attempt() {
    let mut j = Jobs::default();
    j.submit(&sub("a", "t", None, "1"), None, 1).unwrap();
    j.submit(&sub("b", "t", None, "2"), None, 2).unwrap();
    j.assign("a", "n1", "r1", 5, 10_000_000).unwrap();
    j.assign("b", "n1", "r1", 6, 10_000_000).unwrap();
    let done = |key: &str, gpu_us: u64| {
        Completion::Succeeded(JobResult {
            key: key.into(),
            bytes: 10,
            gpu_us,
            content_type: "application/json".into(),
        })
    };
    // An hour back by the clock that stamped the finish.
    j.finish("a", 5, &done("jobs/a/5", 45_000), 10_000_000 - 3_600_000)
        .unwrap();
    assert_eq!(j.get("a").unwrap().result.as_ref().unwrap().gpu_us, 45_000);
    j.finish("b", 6, &done("jobs/b/6", u64::MAX), 9_000_000).unwrap();
    assert_eq!(
        j.get("b").unwrap().result.as_ref().unwrap().gpu_us,
        DEFAULT_ATTEMPT_TIMEOUT_MS * 1000 * MAX_GPUS_PER_ATTEMPT
    );
    // Within clock skew (a failover between two controllers' clocks), nothing is measured and
    // nothing is billed: an agent cannot turn skew into the long cap.
    j.submit(&sub("c", "t", None, "3"), None, 3).unwrap();
    j.assign("c", "n1", "r1", 7, 10_000_000).unwrap();
    j.finish("c", 7, &done("jobs/c/7", u64::MAX), 10_000_000 - CLOCK_STEP_MS + 1)
        .unwrap();
    assert_eq!(j.get("c").unwrap().result.as_ref().unwrap().gpu_us, 0);
}
