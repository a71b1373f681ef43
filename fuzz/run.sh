#!/usr/bin/env bash
# Runs every fuzz target for a while (default 60 s each) with cargo-fuzz:
#   cargo install cargo-fuzz && fuzz/run.sh [seconds]
# cargo-fuzz needs nightly-only compiler flags; on a stable toolchain RUSTC_BOOTSTRAP=1 lets
# it use them. Crashes land in fuzz/artifacts/<target>/ with the input that caused them.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
export RUSTC_BOOTSTRAP="${RUSTC_BOOTSTRAP:-1}"
for t in controller_config agent_config snapshot_decode command_apply; do
  echo "== $t (${secs}s)"
  cargo fuzz run "$t" -- -max_total_time="$secs" -rss_limit_mb=4096
done
