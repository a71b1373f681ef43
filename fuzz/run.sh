#!/usr/bin/env bash
# Runs every fuzz target for a while with cargo-fuzz:
#   cargo install cargo-fuzz && fuzz/run.sh [seconds]
# 60 s each (the default) after a change to a parser or to apply; 600 s each before a
# release. What each target checks is at the top of its file (docs/security.md lists them).
# cargo-fuzz needs nightly-only compiler flags; on a stable toolchain RUSTC_BOOTSTRAP=1 lets
# it use them. Crashes land in fuzz/artifacts/<target>/ with the input that caused them.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
export RUSTC_BOOTSTRAP="${RUSTC_BOOTSTRAP:-1}"
for t in controller_config agent_config snapshot_decode command_apply command_sequence router_parsers agent_messages raft_payload; do
  echo "== $t (${secs}s)"
  # fuzz/seeds/<target> (committed) starts the search from real inputs; fuzz/corpus keeps
  # what it finds.
  seeds=()
  [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/corpus/$t" "fuzz/seeds/$t") && mkdir -p "fuzz/corpus/$t"
  cargo fuzz run "$t" "${seeds[@]}" -- -max_total_time="$secs" -rss_limit_mb=4096
done
