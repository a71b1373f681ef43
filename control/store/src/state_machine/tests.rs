use super::*;

fn put(k: &str, v: &str) -> Command {
    Command::PutSetting {
        key: k.into(),
        value: v.into(),
    }
}

fn submission(id: &str) -> laneway_core::jobs::JobSubmission {
    laneway_core::jobs::JobSubmission {
        id: id.into(),
        tenant: "t".into(),
        model: "m".into(),
        class: "video".into(),
        input: Some("{}".into()),
        input_uri: None,
        idempotency_key: None,
        body_sha256: "sha".into(),
        max_attempts: 1,
        at_ms: 1,
    }
}

fn entry(index: u64, command: Command) -> Entry {
    Entry {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(laneway_core::command::CommandEnvelope::new(command)),
    }
}

/// Applies the setting `a` = `1` at index 1 and the job `j1` at index 2.
async fn apply_a_setting_and_a_job(sm: &mut StateMachineStore) {
    let entries = vec![entry(1, put("a", "1")), entry(2, Command::SubmitJob(submission("j1")))];
    sm.apply(entries).await.unwrap();
}

/// Applies reach redb in the write-behind flush: a store reopened after a flush has every
/// applied change and the index it was applied at; one reopened before has the last
/// flushed state (openraft re-applies the rest from the log).
#[tokio::test]
async fn the_write_behind_flush_persists_every_applied_change() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut sm = StateMachineStore::open(dir.path()).unwrap();
        apply_a_setting_and_a_job(&mut sm).await;
        sm.flush().unwrap();
        sm.apply(vec![
            entry(3, put("a", "2")),
            entry(4, Command::SubmitJob(submission("j2"))),
        ])
        .await
        .unwrap();
        // Not flushed yet (the delayed flush has not run): a crash here loses 3 and 4
        // from the state database only.
    }
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(2));
    assert_eq!(sm.get_setting("a").0.as_deref(), Some("1"));
    assert!(sm.job("j1").is_some() && sm.job("j2").is_none());
    sm.apply(vec![
        entry(3, put("a", "2")),
        entry(4, Command::SubmitJob(submission("j2"))),
    ])
    .await
    .unwrap();
    // The scheduled flush runs by itself.
    tokio::time::sleep(FLUSH_DELAY * 4).await;
    drop(sm);
    let sm = StateMachineStore::open(dir.path()).unwrap();
    assert_eq!(sm.applied_index(), 4);
    assert_eq!(sm.get_setting("a").0.as_deref(), Some("2"));
    assert_eq!(sm.job("j2").map(|j| j.seq), Some(4));
}

/// A built snapshot is recorded durably in the pointer file, not by a durable commit of the
/// state database: a crash may take the database back to its last durable commit (here, the
/// one `open` made), and the reopened store restores itself from the snapshot, whose log
/// entries may already be purged.
#[tokio::test]
async fn a_snapshot_survives_a_crash_that_loses_every_non_durable_commit() {
    let dir = tempfile::tempdir().unwrap();
    let db_path = dir.path().join(STATE_DB_FILE);
    let before = dir.path().join("state.redb.before");
    {
        let mut sm = StateMachineStore::open(dir.path()).unwrap();
        // What the disk holds of the database if no later commit is ever synced.
        std::fs::copy(&db_path, &before).unwrap();
        apply_a_setting_and_a_job(&mut sm).await;
        assert_eq!(sm.snapshot_bytes(), None, "no snapshot yet");
        let mut builder = sm.get_snapshot_builder().await;
        let snapshot = builder.build_snapshot().await.unwrap();
        assert_eq!(snapshot.meta.last_log_id.map(|l| l.index), Some(2));
        let current = sm
            .get_current_snapshot()
            .await
            .unwrap()
            .expect("the snapshot just built");
        assert_eq!(current.meta, snapshot.meta);
        assert_eq!(
            sm.snapshot_bytes(),
            Some(current.snapshot.get_ref().len() as u64),
            "the snapshot policy weighs the log against the file's size"
        );
        sm.apply(vec![entry(3, put("a", "2"))]).await.unwrap();
    }
    std::fs::rename(&before, &db_path).unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(2), "restored from the snapshot");
    assert_eq!(sm.get_setting("a").0.as_deref(), Some("1"));
    assert!(sm.job("j1").is_some());
    let current = sm
        .get_current_snapshot()
        .await
        .unwrap()
        .expect("the snapshot is still there");
    assert_eq!(current.meta.last_log_id.map(|l| l.index), Some(2));
    assert_eq!(
        sm.snapshot_bytes(),
        Some(current.snapshot.get_ref().len() as u64),
        "after a restart"
    );
}

/// The cluster's own settings hold in apply whatever the admin API let through: the
/// command format is never deleted nor lowered (that would refuse revocations and token
/// commands from then on), and the refused write is not persisted either.
#[tokio::test]
async fn the_command_format_is_never_deleted_nor_lowered() {
    let dir = tempfile::tempdir().unwrap();
    let f = laneway_core::command::FORMAT_SETTING;
    {
        let mut sm = StateMachineStore::open(dir.path()).unwrap();
        let r = sm
            .apply(vec![
                entry(1, put(f, "9")),
                entry(2, Command::DeleteSetting { key: f.into() }),
                entry(3, put(f, "5")),
                entry(4, put(f, "10")),
            ])
            .await
            .unwrap();
        assert!(r[0].rejected.is_none(), "{:?}", r[0]);
        assert!(
            r[1].rejected.as_deref().unwrap().contains("never deleted"),
            "{:?}",
            r[1]
        );
        assert!(
            r[2].rejected.as_deref().unwrap().contains("never lowered"),
            "{:?}",
            r[2]
        );
        assert!(r[3].rejected.is_none(), "{:?}", r[3]);
        assert_eq!(sm.get_setting(f).0.as_deref(), Some("10"));
        sm.flush().unwrap();
    }
    let sm = StateMachineStore::open(dir.path()).unwrap();
    assert_eq!(sm.get_setting(f).0.as_deref(), Some("10"));
}

/// A token hash that is not hex (any replica could be handed one by a buggy or hostile
/// proposer) is refused on propose, and apply answers it without panicking: a panic there
/// would stop every replica at the same index.
#[tokio::test]
async fn token_commands_with_odd_hashes_never_panic_apply() {
    let odd = format!("a{}", "é".repeat(10));
    let consume = Command::ConsumeJoinToken {
        sha256: odd.clone(),
        node_id: "gpu-1".into(),
        key_sha256: String::new(),
        at_ms: 1,
    };
    let e = consume.validate().unwrap_err().to_string();
    assert!(e.contains("64 lowercase hex digits"), "{e}");
    assert!(Command::RevokeToken { sha256: odd.clone() }.validate().is_err());
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    let r = sm
        .apply(vec![entry(1, consume), entry(2, Command::RevokeToken { sha256: odd })])
        .await
        .unwrap();
    assert!(r.iter().all(|r| r.rejected.is_some()), "{r:?}");
}

/// A controller certificate counts only for a member: a node never added, or one removed
/// (ids are never reused), is refused; before any membership is applied (a node being
/// added) nobody is.
#[tokio::test]
async fn only_members_speak_as_controllers() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    sm.may_speak_as_controller(7).expect("no membership applied yet");
    let membership = |ids: &[u64]| {
        let nodes: BTreeMap<u64, ControllerNode> = ids
            .iter()
            .map(|id| {
                (
                    *id,
                    ControllerNode {
                        addr: format!("c{id}:7000"),
                    },
                )
            })
            .collect();
        openraft::Membership::new(vec![ids.iter().copied().collect()], nodes)
    };
    let m = |index: u64, ids: &[u64]| Entry {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Membership(membership(ids)),
    };
    sm.apply(vec![m(1, &[1, 2, 3]), m(2, &[1, 2])]).await.unwrap();
    sm.may_speak_as_controller(1).unwrap();
    let e = sm.may_speak_as_controller(3).unwrap_err();
    assert!(e.contains("was removed"), "{e}");
    let e = sm.may_speak_as_controller(9).unwrap_err();
    assert!(e.contains("not a member"), "{e}");
}

/// What `fuzz/fuzz_targets/command_sequence.rs` checks of arbitrary sequences, on one
/// known sequence in every test run: two copies agree, and so does a copy restored from
/// a snapshot, also on what it applies next.
#[test]
fn a_sequence_applies_the_same_on_copies_and_after_a_snapshot() {
    let (fleet, registry) = laneway_core::fixtures::test_fixture();
    let seeded = AppState {
        fleet,
        registry,
        ..AppState::default()
    };
    let commands = [
        Command::SubmitJob(submission("j1")),
        Command::AssignJobs {
            assignments: vec![laneway_core::jobs::dispatch::Assignment {
                job_id: "j1".into(),
                node_id: "n1".into(),
                replica_id: "a".into(),
            }],
            at_ms: 10,
        },
        Command::FinishJob {
            job_id: "j1".into(),
            token: 2,
            completion: laneway_core::jobs::Completion::Succeeded(laneway_core::jobs::JobResult {
                key: "jobs/j1/2".into(),
                bytes: 1,
                gpu_us: u64::MAX,
                content_type: "application/json".into(),
            }),
            at_ms: 20,
        },
        Command::SetNodeStatic {
            node_id: "n1".into(),
            allowed: false,
        },
        put(laneway_core::command::FORMAT_SETTING, "10"),
        Command::DeleteSetting {
            key: laneway_core::command::FORMAT_SETTING.into(),
        },
        Command::RevokeToken {
            sha256: "é".repeat(40)
        },
    ];
    let (mut a, mut b) = (seeded.clone(), seeded);
    for (i, c) in commands.iter().enumerate() {
        assert_eq!(a.apply(c, i as u64 + 1), b.apply(c, i as u64 + 1), "command {i}");
    }
    assert_eq!(a.state_hash(), b.state_hash());
    let mut restored: AppState = serde_json::from_slice(&serde_json::to_vec(&a).unwrap()).unwrap();
    restored.fleet.rebuild_index();
    restored.jobs.rebuild_index();
    assert_eq!(restored.state_hash(), a.state_hash());
    let next = Command::SubmitJob(submission("j2"));
    assert_eq!(restored.apply(&next, 100), a.apply(&next, 100));
    assert_eq!(restored.state_hash(), a.state_hash());
    assert_eq!(
        a.jobs.get("j1").unwrap().result.as_ref().unwrap().gpu_us,
        10 * 1000 * 16,
        "capped"
    );
}

/// Versions, a rollout and the serving pointer are written by the flush and read back on
/// open: a restarted controller (or a new leader) judges the step that was committed.
#[tokio::test]
async fn versions_and_rollouts_are_persisted_by_the_flush() {
    use laneway_core::registry::rollout::{RolloutAction, RolloutRequest};
    let dir = tempfile::tempdir().unwrap();
    let (fleet, reg) = laneway_core::fixtures::test_fixture();
    let node = fleet.nodes["n1"].registration.clone();
    let class = reg.classes["speech"].clone();
    let v1 = reg.models["whisper"].clone();
    let v2 = laneway_core::registry::Model {
        version: "2".into(),
        ..v1.clone()
    };
    {
        let mut sm = StateMachineStore::open(dir.path()).unwrap();
        sm.apply(vec![
            entry(1, Command::PutClass(class)),
            entry(2, Command::DeployVersion(v1)),
            entry(3, Command::DeployVersion(v2)),
        ])
        .await
        .unwrap();
        let rollout = sm.with_registry(|r| {
            RolloutRequest {
                strategy: Default::default(),
                model: "whisper".into(),
                version: "2".into(),
                steps: vec![50, 100],
                bake_s: 10,
                guards: Default::default(),
            }
            .rollout(r, 1_000, "admin:test")
            .unwrap()
        });
        sm.apply(vec![
            entry(4, Command::StartRollout(rollout)),
            entry(
                5,
                Command::UpdateRollout {
                    model: "whisper".into(),
                    expect_step: Some(0),
                    action: RolloutAction::Advance,
                    at_ms: 2_000,
                    message: "passed".into(),
                },
            ),
        ])
        .await
        .unwrap();
        sm.flush().unwrap();
    }
    let sm = StateMachineStore::open(dir.path()).unwrap();
    let reg = sm.registry();
    assert_eq!(reg.models["whisper@2"].serves.as_deref(), Some("whisper"));
    let r = &reg.rollouts["whisper"];
    assert_eq!((r.step, r.weight(), r.step_started_ms), (1, 100, 2_000));
    assert!(reg.is_placed(&reg.models["whisper@2"]));
    drop(sm);
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    // A promotion needs a ready replica of the new version.
    let ready = laneway_core::registry::ReplicaRecord {
        id: "b".into(),
        model: "whisper@2".into(),
        device: "GPU-1".into(),
        state: "ready".into(),
        endpoint: "127.0.0.1:9".into(),
    };
    sm.apply(vec![
        entry(6, Command::RegisterNode(node)),
        entry(
            7,
            Command::SetNodeReplicas {
                node_id: "n1".into(),
                replicas: vec![ready],
            },
        ),
    ])
    .await
    .unwrap();
    sm.apply(vec![entry(
        8,
        Command::UpdateRollout {
            model: "whisper".into(),
            expect_step: Some(1),
            action: RolloutAction::Promote,
            at_ms: 3_000,
            message: "promoted".into(),
        },
    )])
    .await
    .unwrap();
    sm.flush().unwrap();
    drop(sm);
    let sm = StateMachineStore::open(dir.path()).unwrap();
    assert_eq!(sm.registry().serving_entry("whisper"), "whisper@2");
}

/// Prices and usage are written by the flush and read back on open, folded buckets
/// included.
#[tokio::test]
async fn the_ledger_is_persisted_by_the_flush() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_800_000_000_000;
    let report = |seq: u64, at_ms: u64| {
        Command::RecordUsage(laneway_core::ledger::UsageReport {
            reporter: 1,
            incarnation: "i".into(),
            seq,
            at_ms,
            rows: vec![laneway_core::ledger::Usage {
                overflow_nanos: 0,
                class: "speech".into(),
                lane: "sync".into(),
                model: "whisper".into(),
                version: "1".into(),
                tenant: "acme".into(),
                node: None,
                product: None,
                mig_profile: None,
                requests: 10,
                ok: 9,
                gpu_us: 0,
                input_tokens: 0,
                output_tokens: 0,
                slow: 0,
            }],
        })
    };
    let before = {
        let mut sm = StateMachineStore::open(dir.path()).unwrap();
        sm.apply(vec![
            entry(
                1,
                Command::SetPrice {
                    product: "L4".into(),
                    tier: laneway_core::ledger::Tier::Spot,
                    micros_per_hour: Some(300_000),
                },
            ),
            entry(2, report(1, t0)),
            // The ledger's clock moves an hour per report at most.
            entry(3, report(2, t0 + laneway_core::ledger::HOUR_MS)),
            entry(4, report(3, t0 + 2 * laneway_core::ledger::HOUR_MS)),
            entry(5, report(4, t0 + 3 * laneway_core::ledger::HOUR_MS)),
            // A retry of seq 4 changes nothing.
            entry(6, report(4, t0 + 3 * laneway_core::ledger::HOUR_MS)),
        ])
        .await
        .unwrap();
        sm.flush().unwrap();
        sm.with_ledger(|l, _| l.clone())
    };
    assert_eq!(before.hours.len(), 1, "the first minute was folded into its hour");
    let sm = StateMachineStore::open(dir.path()).unwrap();
    let after = sm.with_ledger(|l, _| l.clone());
    assert_eq!(after, before);
    assert_eq!(after.price("L4", laneway_core::ledger::Tier::Spot), Some(300_000));
    let requests: u64 = after
        .minutes
        .values()
        .chain(after.hours.values())
        .flatten()
        .map(|r| r.counts.requests)
        .sum();
    assert_eq!(requests, 40);
}

/// A format-1 state database (jobs keyed by id) opens with its jobs moved to `(seq, id)`.
#[test]
fn a_format_1_database_keeps_its_jobs() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = Database::create(dir.path().join(STATE_DB_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(SM_META).unwrap();
            meta.insert(KEY_FORMAT, json(&1u32).as_slice()).unwrap();
            let mut jobs = txn.open_table(JOBS_BY_ID_V1).unwrap();
            let mut state = AppState::default();
            state.apply(&Command::SubmitJob(submission("old")), 7);
            jobs.insert("old", json(state.jobs.get("old").unwrap()).as_slice())
                .unwrap();
        }
        txn.commit().unwrap();
    }
    let sm = StateMachineStore::open(dir.path()).unwrap();
    assert_eq!(sm.job("old").map(|j| j.seq), Some(7));
    drop(sm);
    let db = Database::open(dir.path().join(STATE_DB_FILE)).unwrap();
    let r = db.begin_read().unwrap();
    assert!(r.open_table(JOBS_BY_ID_V1).is_err(), "the by-id table is gone");
    assert_eq!(r.open_table(JOBS).unwrap().iter().unwrap().count(), 1);
}

#[test]
fn batch_applies_in_order_and_answers_each_command() {
    let mut state = AppState::default();
    let batch = Command::Batch(vec![
        put("a", "1"),
        put("a", "2"),
        Command::DeleteSetting { key: "a".into() },
        put("b", "3"),
    ]);
    let r = state.apply(&batch, 1);
    let previous: Vec<Option<&str>> = r.batch.iter().map(|r| r.previous.as_deref()).collect();
    assert_eq!(previous, vec![None, Some("1"), Some("2"), None]);
    assert_eq!(state.settings.get("a"), None);
    assert_eq!(state.settings.get("b").map(String::as_str), Some("3"));

    let mut touched = Touched::default();
    record_touched(&batch, &mut touched);
    assert_eq!(touched.settings.get("a"), Some(&None));
    assert_eq!(touched.settings.get("b"), Some(&Some("3".to_string())));
}

#[test]
fn state_hash_depends_only_on_content() {
    let mut a = AppState::default();
    let mut b = AppState::default();
    a.apply(&put("x", "1"), 1);
    a.apply(&put("y", "2"), 1);
    b.apply(&put("y", "2"), 1);
    b.apply(&put("x", "1"), 1);
    assert_eq!(a.state_hash(), b.state_hash());
    b.apply(&put("x", "3"), 1);
    assert_ne!(a.state_hash(), b.state_hash());
}

/// The golden snapshot (a `dev` cluster's whole state, as JSON), installed and then built
/// again as a row snapshot: the rows decode to the same state, byte for byte of its hash.
#[tokio::test]
async fn a_row_snapshot_holds_the_same_state_as_the_json_one() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/snapshot.json");
    let json = std::fs::read(golden).unwrap();
    let from_json = SnapshotFile::decode(&json).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    sm.install_snapshot(&from_json.meta, Box::new(Cursor::new(json.clone())))
        .await
        .unwrap();
    let (meta, rows) = rows_snapshot(&sm.db, &dir.path().join(STATE_DB_FILE), |_| Ok(Vec::new())).unwrap();
    assert!(snapshot_file::is_rows(&rows));
    assert_eq!(meta.last_log_id, from_json.meta.last_log_id);
    assert_eq!(meta.last_membership, from_json.meta.last_membership);
    let from_rows = SnapshotFile::decode(&rows).unwrap();
    assert_eq!(from_rows.format, snapshot_file::ROWS_FORMAT);
    assert_eq!(from_rows.state.state_hash(), from_json.state.state_hash());
    assert!(from_rows.state.jobs.jobs.len() > 1, "the golden state has jobs");

    // Installed on another member, it leaves the same state there, and is kept as received.
    let other = tempfile::tempdir().unwrap();
    let mut b = StateMachineStore::open(other.path()).unwrap();
    b.install_snapshot(&meta, Box::new(Cursor::new(rows.clone())))
        .await
        .unwrap();
    assert_eq!(b.state_hash().0, from_json.state.state_hash());
    let kept = b.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(kept.snapshot.into_inner(), rows);
    drop(b);
    let b = StateMachineStore::open(other.path()).unwrap();
    assert_eq!(b.state_hash().0, from_json.state.state_hash(), "after a restart too");
}

/// A row snapshot cut short or altered anywhere is refused, never half installed.
#[tokio::test]
async fn a_damaged_row_snapshot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    apply_a_setting_and_a_job(&mut sm).await;
    sm.flush().unwrap();
    let (_, rows) = rows_snapshot(&sm.db, &dir.path().join(STATE_DB_FILE), |_| Ok(Vec::new())).unwrap();
    assert!(SnapshotFile::decode(&rows).is_ok());
    for cut in [rows.len() - 1, rows.len() - 5, rows.len() / 2, 12] {
        let err = SnapshotFile::decode(&rows[..cut]).unwrap_err();
        assert!(err.to_string().contains("row snapshot"), "cut at {cut}: {err}");
    }
    for at in [9, rows.len() / 2, rows.len() - 6] {
        let mut altered = rows.clone();
        altered[at] ^= 0x20;
        let err = SnapshotFile::decode(&altered).unwrap_err();
        assert!(err.to_string().contains("checksum"), "byte {at}: {err}");
    }
}

/// A member builds row snapshots only once the cluster's command format says every member
/// reads them; before that, JSON (a member left on an older binary installs it).
#[tokio::test]
async fn row_snapshots_wait_for_the_cluster_command_format() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    let format = |v: u32| put(laneway_core::command::FORMAT_SETTING, &v.to_string());
    sm.apply(vec![entry(1, format(snapshot_file::ROWS_COMMAND_FORMAT - 1))])
        .await
        .unwrap();
    sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let built = sm.get_current_snapshot().await.unwrap().unwrap();
    assert!(
        !snapshot_file::is_rows(built.snapshot.get_ref()),
        "JSON below the format"
    );
    sm.apply(vec![entry(2, format(snapshot_file::ROWS_COMMAND_FORMAT))])
        .await
        .unwrap();
    sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let built = sm.get_current_snapshot().await.unwrap().unwrap();
    assert!(
        snapshot_file::is_rows(built.snapshot.get_ref()),
        "rows from the format on"
    );
    assert_eq!(built.meta.last_log_id.map(|l| l.index), Some(2));
}

/// A row snapshot of a state several times the size of one written slice is built straight
/// into its file, slice by slice: the file checks whole (magic to checksum), holds every job,
/// installs on another member with the same state, and no temporary file is left behind.
#[tokio::test]
async fn a_snapshot_of_many_slices_is_written_whole_and_installs_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    let format = snapshot_file::ROWS_COMMAND_FORMAT.to_string();
    sm.apply(vec![entry(1, put(laneway_core::command::FORMAT_SETTING, &format))])
        .await
        .unwrap();
    // About 5 MB of jobs: five slices or more.
    let jobs = 4_000u64;
    let input = format!("{{\"prompt\": \"{}\"}}", "x".repeat(1_250));
    let entries = (0..jobs)
        .map(|i| {
            let mut job = submission(&format!("j{i}"));
            job.input = Some(input.clone());
            entry(2 + i, Command::SubmitJob(job))
        })
        .collect::<Vec<_>>();
    sm.apply(entries).await.unwrap();
    let built = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    assert_eq!(built.meta.last_log_id.map(|l| l.index), Some(1 + jobs));

    let current = sm.get_current_snapshot().await.unwrap().unwrap();
    let bytes = current.snapshot.into_inner();
    assert!(bytes.len() > 4 << 20, "{} bytes: more than four slices", bytes.len());
    let file = SnapshotFile::decode(&bytes).expect("the file checks whole");
    assert_eq!(file.meta, built.meta);
    assert_eq!(file.state.jobs.jobs.len() as u64, jobs);
    assert_eq!(file.state.state_hash(), sm.state_hash().0);
    let names: Vec<String> = std::fs::read_dir(dir.path().join(SNAPSHOT_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec![snapshot_file::file_name(&built.meta)],
        "one file, no temporary one"
    );

    let other = tempfile::tempdir().unwrap();
    let mut b = StateMachineStore::open(other.path()).unwrap();
    b.install_snapshot(&current.meta, Box::new(Cursor::new(bytes)))
        .await
        .unwrap();
    assert_eq!(b.state_hash().0, sm.state_hash().0);
}

/// A build that an install overtook (the pointer is already past what it read) records
/// nothing and leaves no file behind, not even its unfinished one.
#[tokio::test]
async fn a_build_overtaken_by_a_newer_snapshot_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = StateMachineStore::open(dir.path()).unwrap();
    let format = snapshot_file::ROWS_COMMAND_FORMAT.to_string();
    sm.apply(vec![
        entry(1, put(laneway_core::command::FORMAT_SETTING, &format)),
        entry(2, Command::SubmitJob(submission("j1"))),
    ])
    .await
    .unwrap();
    // As an install of the leader's snapshot at index 9 leaves the pointer.
    let newer = SnapshotPointer {
        meta: SnapshotMeta {
            snapshot_id: "leaders".into(),
            last_log_id: Some(openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), 9)),
            last_membership: Default::default(),
        },
        file: "leaders.snap".into(),
    };
    sm.write().snapshot = Some(newer.clone());
    let built = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    assert_eq!(built.meta.last_log_id.map(|l| l.index), Some(2));
    let pointer = sm.read().snapshot.clone().map(|p| (p.meta, p.file));
    assert_eq!(pointer, Some((newer.meta, newer.file)), "the pointer never moves back");
    let left: Vec<_> = std::fs::read_dir(dir.path().join(SNAPSHOT_DIR))
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}
