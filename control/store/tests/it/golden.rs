//! Golden formats: the JSON of commands (the Raft log's payload), of snapshot files, and what
//! applying a fixed sequence of commands answers and leaves behind, pinned byte for byte.
//!
//! `golden/snapshot.json` is a snapshot a `laneway-control dev` cluster wrote (classes, models
//! with versions and a rollout, tenants, nodes, replicas, MIG layouts and plan, prices, usage,
//! jobs). `golden/commands.input.jsonl` is one command a line: every kind the registry, capacity,
//! jobs, ledger and access areas apply, some of them refused on purpose. The other files are
//! what this binary must produce from them; a refactor that moves types between crates must
//! leave them untouched. A change that *means* to change a format bumps the format number
//! (`COMMAND_FORMAT`, `SNAPSHOT_FORMAT`) and rewrites them with
//! `LANEWAY_GOLDEN=write cargo test -p laneway-store --test golden`.

use std::path::PathBuf;

use laneway_core::command::{Command, CommandEnvelope};
use laneway_store::snapshot_file::SnapshotFile;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn read(name: &str) -> String {
    std::fs::read_to_string(golden(name)).unwrap_or_else(|e| panic!("{}: {e}", golden(name).display()))
}

/// Compares `actual` with the golden file `name`, or writes it when asked to.
fn check(name: &str, actual: &str) {
    if std::env::var("LANEWAY_GOLDEN").as_deref() == Ok("write") {
        std::fs::write(golden(name), actual).unwrap();
        return;
    }
    let expected = read(name);
    if expected != actual {
        let line = expected
            .lines()
            .zip(actual.lines())
            .position(|(e, a)| e != a)
            .map_or_else(|| "its length".to_string(), |i| format!("line {}", i + 1));
        panic!(
            "{name} differs from what this binary produces (first at {line}). A format changed: if \
             that is meant, bump the format number and rewrite the golden files with \
             LANEWAY_GOLDEN=write cargo test -p laneway-store --test golden"
        );
    }
}

fn commands() -> Vec<Command> {
    read("commands.input.jsonl")
        .lines()
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).unwrap_or_else(|e| panic!("commands.input.jsonl line {}: {e}", i + 1)))
        .collect()
}

#[test]
fn a_snapshot_file_reads_and_writes_back_byte_for_byte() {
    let bytes = std::fs::read(golden("snapshot.json")).unwrap();
    let file = SnapshotFile::decode(&bytes).expect("the golden snapshot decodes");
    assert_eq!(
        String::from_utf8(file.encode()).unwrap(),
        String::from_utf8(bytes).unwrap(),
        "a snapshot written by an earlier binary must re-encode to the same bytes"
    );
    check("snapshot.hash", &format!("{}\n", file.state.state_hash()));
}

#[test]
fn commands_encode_with_their_format_byte_for_byte() {
    let lines: String = commands()
        .into_iter()
        .map(|c| serde_json::to_string(&CommandEnvelope::new(c)).unwrap() + "\n")
        .collect();
    check("commands.jsonl", &lines);
    // What an older binary wrote reads back as the same command.
    for (i, line) in read("commands.jsonl").lines().enumerate() {
        let env: CommandEnvelope = serde_json::from_str(line).unwrap();
        assert_eq!(
            serde_json::to_string(&env).unwrap(),
            line,
            "commands.jsonl line {}",
            i + 1
        );
    }
}

#[test]
fn applying_the_commands_answers_and_ends_the_same() {
    let file = SnapshotFile::decode(&std::fs::read(golden("snapshot.json")).unwrap()).unwrap();
    let mut state = file.state;
    let mut out = String::new();
    for (i, command) in commands().iter().enumerate() {
        let reply = state.apply(command, 100 + i as u64);
        out.push_str(&serde_json::to_string(&reply).unwrap());
        out.push('\n');
    }
    out.push_str(&format!("state {}\n", state.state_hash()));
    check("applied.jsonl", &out);
}
