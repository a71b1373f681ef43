//! The openraft side of the state machine: applying entries, building and installing
//! snapshots.

use super::*;

/// Builds snapshots from the state tables as they are when the build starts.
pub struct SnapshotBuilder {
    store: StateMachineStore,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let store = self.store.clone();
        // Copying a large state (a long job queue runs to tens of MB) takes a good part of a
        // second of CPU, and decoding and encoding it for a JSON snapshot several: off the
        // async workers, so requests and applies on them do not stall behind it, and at a
        // lower CPU priority, so that on a busy host it takes what the heartbeats, votes and
        // appends leave (three members building at once used to starve them past openraft's
        // RPC deadline and set off elections).
        //
        // What was applied and not yet flushed goes to the tables first (a brief write lock,
        // at normal priority), so the snapshot covers everything applied when it was asked for.
        let began = tokio::time::Instant::now();
        let flushing = store.clone();
        tokio::task::spawn_blocking(move || flushing.flush())
            .await
            .map_err(|e| sm_err("flush before a snapshot", e))?
            .map_err(|e| sm_err("flush before a snapshot", e))?;
        let flushed = began.elapsed();
        let build = move || -> Result<_, StorageError> {
            // Each step timed, for the log line below: where a slow snapshot spends its time.
            let mut steps = SnapshotSteps::default();
            let cpu_began = crate::background::thread_cpu_time();
            let mut step = tokio::time::Instant::now();
            let mut lap = |into: &mut std::time::Duration| {
                *into = step.elapsed();
                step = tokio::time::Instant::now();
            };
            // From the state tables in one read transaction rather than a copy of the state
            // in memory: no lock that applies and the router's reads would wait on, so a
            // snapshot of a long job queue stalls nothing. The snapshot lock is taken only to
            // finish the file and move the pointer.
            let rows = {
                let inner = store.read();
                let setting = inner.state.settings.get(laneway_core::command::FORMAT_SETTING);
                laneway_core::command::allowed_format(setting.map(String::as_str)) >= snapshot_file::ROWS_COMMAND_FORMAT
            };
            let db_path = store.snapshot_dir.with_file_name(STATE_DB_FILE);
            let (meta, built) = if rows {
                // The rows as stored, copied straight into the file a slice at a time (paced):
                // no decoding nor encoding of the state, and no copy of all of it in memory.
                // Without the snapshot lock, so installs and `get_current_snapshot` (both on
                // openraft's state machine worker, ahead of applies) do not wait for the copy.
                // An install meanwhile may remove the unfinished file; it then also moves the
                // pointer past this build (openraft installs only snapshots past what this
                // member committed), so the check below drops the build.
                let (meta, file) = rows_snapshot(&store.db, &db_path, |meta| {
                    PacedFile::create(&store.snapshot_dir, &snapshot_file::file_name(meta))
                })
                .map_err(|e| sm_err("building a row snapshot", e))?;
                lap(&mut steps.read);
                (meta, Built::Rows(file))
            } else {
                // Some member may not read row snapshots yet: the whole state, as JSON.
                let StateTables {
                    state,
                    last_applied,
                    last_membership,
                    ..
                } = read_tables(&store.db, &db_path).map_err(|e| sm_err("reading the state for a snapshot", e))?;
                lap(&mut steps.read);
                let file = SnapshotFile {
                    format: JSON_FORMAT,
                    meta: SnapshotMeta {
                        snapshot_id: new_snapshot_id(last_applied),
                        last_log_id: last_applied,
                        last_membership,
                    },
                    state,
                };
                let bytes = file.encode();
                lap(&mut steps.encode);
                (file.meta, Built::Json(bytes))
            };
            let _guard = store.lock_snapshots();
            // An install (or a later build) may have moved the pointer past this snapshot while
            // it was being built; never move it back. A row build's unfinished file is removed
            // as it is dropped.
            let current = store.read().snapshot.as_ref().and_then(|p| p.meta.last_log_id);
            if current.is_some() && current >= meta.last_log_id {
                return Ok((meta, 0, None));
            }
            let (name, bytes) = match built {
                Built::Rows(file) => {
                    let bytes = file.written();
                    file.finish().map_err(|e| sm_err("writing snapshot file", e))?;
                    (snapshot_file::file_name(&meta), bytes)
                }
                Built::Json(bytes) => (store.save_snapshot(&meta, &bytes)?.file, bytes.len() as u64),
            };
            lap(&mut steps.write);
            let pointer = SnapshotPointer {
                meta: meta.clone(),
                file: name,
            };
            store
                .commit_pointer(&pointer)
                .map_err(|e| sm_err("recording snapshot", e))?;
            lap(&mut steps.commit);
            store.write().snapshot = Some(pointer.clone());
            snapshot_file::remove_all_but(&store.snapshot_dir, Some(&pointer.file))
                .map_err(|e| sm_err("removing old snapshots", e))?;
            lap(&mut steps.drop);
            steps.cpu = crate::background::thread_cpu_time().saturating_sub(cpu_began);
            Ok((meta, bytes, Some(steps)))
        };
        let (meta, bytes, steps) = crate::background::run("laneway-snapshot", build)
            .await
            .map_err(|e| sm_err("snapshot task", e))??;
        if let Some(s) = steps {
            let ms = |d: std::time::Duration| d.as_millis() as u64;
            tracing::info!(
                index = meta.last_log_id.map_or(0, |l| l.index),
                bytes,
                total_ms = ms(began.elapsed()),
                flush_ms = ms(flushed),
                read_ms = ms(s.read),
                encode_ms = ms(s.encode),
                write_ms = ms(s.write),
                commit_ms = ms(s.commit),
                drop_ms = ms(s.drop),
                cpu_ms = ms(s.cpu),
                "snapshot built"
            );
        }
        // The data stays in the file, served by `get_current_snapshot` when a follower needs
        // it: openraft 0.9.25 keeps only a built snapshot's meta (its state machine worker
        // and its start-up helper; its own storage suite reads the data back through
        // `get_current_snapshot`). Check this again before moving off that version.
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(Vec::new())),
        })
    }
}

/// A built snapshot before it is recorded: a row snapshot's file, written but not yet renamed
/// into place, or a JSON snapshot's bytes, not yet written.
enum Built {
    Rows(PacedFile),
    Json(Vec<u8>),
}

/// How long each step of one snapshot build took (on its background thread).
#[derive(Default)]
struct SnapshotSteps {
    /// Reading the state from the tables (for a row snapshot, copying the rows into its
    /// unfinished file, paced: all of it).
    read: std::time::Duration,
    /// Encoding it (JSON snapshots only).
    encode: std::time::Duration,
    /// Writing the file and syncing it (for a row snapshot, its last sync and the rename).
    write: std::time::Duration,
    /// Recording the pointer to it (the pointer file, synced).
    commit: std::time::Duration,
    /// Removing the older files.
    drop: std::time::Duration,
    /// CPU time the build's thread used, all steps together (the wall times above stretch on
    /// a busy host, where the thread runs at a lower priority).
    cpu: std::time::Duration,
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership<u64, ControllerNode>), StorageError> {
        let inner = self.read();
        Ok((inner.last_applied, inner.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CommandResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        let started = tokio::time::Instant::now();
        let (fleet_changed, jobs_changed, schedule, nodes) = {
            let _timed = ObserveOnDrop(&self.apply_seconds, started);
            let mut inner = self.write();
            let inner = &mut *inner;
            let mut touched = Touched::default();
            let job_changes = inner.state.jobs.changes();
            for entry in entries {
                match entry.payload {
                    EntryPayload::Blank => replies.push(CommandResponse::default()),
                    EntryPayload::Normal(env) => {
                        // Chaos: the entry is committed, its effect not yet applied.
                        fail::fail_point!("sm::before_apply");
                        if env.format > COMMAND_FORMAT {
                            // Refuse rather than guess: a half-upgraded cluster must stop visibly.
                            return Err(StorageIOError::apply(
                                entry.log_id,
                                AnyError::error(format!(
                                    "command format {} is newer than this binary's {COMMAND_FORMAT}; upgrade laneway-control",
                                    env.format
                                )),
                            )
                            .into());
                        }
                        let reply = inner.state.apply(&env.command, entry.log_id.index);
                        record_touched(&env.command, &mut touched);
                        replies.push(reply);
                    }
                    EntryPayload::Membership(m) => {
                        let before = inner.last_membership.clone();
                        retire_removed(&mut inner.state, &before, &m);
                        inner.last_membership = StoredMembership::new(Some(entry.log_id), m);
                        touched.membership = true;
                        replies.push(CommandResponse::default());
                    }
                }
                inner.last_applied = Some(entry.log_id);
            }
            let fleet_changed = !touched.nodes.is_empty() || !touched.registry.is_empty();
            let jobs_changed = inner.state.jobs.changes() != job_changes;
            let mut nodes = inner.state.jobs.take_touched_nodes();
            nodes.extend(touched.nodes_told());
            inner.unflushed.merge(touched);
            let schedule = !std::mem::replace(&mut inner.flush_scheduled, true);
            (fleet_changed, jobs_changed, schedule, nodes)
        };
        self.nodes_changed.notify(nodes.iter().map(String::as_str));
        if fleet_changed {
            self.changed.send_modify(|v| *v += 1);
        }
        if jobs_changed {
            self.jobs_changed.send_modify(|v| *v += 1);
        }
        if schedule {
            // Weak handles: a pending flush must not keep a dropped store's database open
            // (what it would have written is in the log).
            let parts = (
                Arc::downgrade(&self.inner),
                Arc::downgrade(&self.db),
                Arc::downgrade(&self.persist_lock),
            );
            let lock_seconds = self.flush_lock_seconds.clone();
            tokio::spawn(async move {
                tokio::time::sleep(FLUSH_DELAY).await;
                let (Some(inner), Some(db), Some(lock)) = (parts.0.upgrade(), parts.1.upgrade(), parts.2.upgrade())
                else {
                    return;
                };
                let flushed = tokio::task::spawn_blocking(move || flush(&inner, &db, &lock, &lock_seconds)).await;
                match flushed {
                    Ok(Ok(())) => {}
                    // The state stays correct in memory and the log still holds every entry:
                    // a restart re-applies them. Say so loudly; the disk needs attention.
                    Ok(Err(e)) => {
                        tracing::error!(error = %e, "persisting applied state failed; a restart re-applies it from the Raft log")
                    }
                    Err(e) => tracing::error!(error = %e, "state flush task failed"),
                }
            });
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder { store: self.clone() }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        // Chaos: a snapshot arrived from the leader and is not installed yet.
        fail::fail_point!("sm::install_snapshot");
        let bytes = snapshot.into_inner();
        let store = self.clone();
        let meta = meta.clone();
        tokio::task::spawn_blocking(move || -> Result<(), StorageError> {
            let file = SnapshotFile::decode(&bytes).map_err(|e| sm_err("decoding received snapshot", e))?;
            let _guard = store.lock_snapshots();
            // Kept as received: the leader's format, which this member has just read. The
            // meta that counts is openraft's (the pointer's), not the file's copy of it.
            let pointer = store.save_snapshot(&meta, &bytes)?;
            store
                .replace_state(file.state, &meta, pointer.clone())
                .map_err(|e| sm_err("installing snapshot", e))?;
            snapshot_file::remove_all_but(&store.snapshot_dir, Some(&pointer.file))
                .map_err(|e| sm_err("removing old snapshots", e))?;
            Ok(())
        })
        .await
        .map_err(|e| sm_err("install task", e))?
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
            // Under the lock, so a finishing build cannot delete the file between reading the
            // pointer and reading the file.
            let _guard = store.lock_snapshots();
            let Some(pointer) = store.read().snapshot.clone() else {
                return Ok(None);
            };
            let path = store.snapshot_dir.join(&pointer.file);
            let bytes = std::fs::read(&path)
                .map_err(|e| StorageError::from(StorageIOError::read_snapshot(None, AnyError::new(&e))))?;
            Ok(Some(Snapshot {
                meta: pointer.meta,
                snapshot: Box::new(Cursor::new(bytes)),
            }))
        })
        .await
        .map_err(|e| sm_err("snapshot read task", e))?
    }
}
