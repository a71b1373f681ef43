#!/usr/bin/env bash
# A GPU host's check in one command: the real-NVML tests, the inventory the agent sees, and a
# CUDA process pinned the way the agent pins replicas (CUDA_VISIBLE_DEVICES=<GPU UUID>) seen by
# NVML on that GPU, its GPU time read from NVML's process accounting. On a host without NVIDIA
# GPUs it says what it skipped and exits 0. Run from a checkout: deploy/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

failed=0
step() { printf '== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*"; failed=1; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  step "no NVIDIA GPU here (nvidia-smi -L fails or is missing)"
  echo "skipped: NVML tests (cargo test -p laneway-agent -- --ignored nvml), laneway-agent gpus, the pinned CUDA process"
  echo "the simulated backend covers the rest: cargo test --workspace"
  exit 0
fi
nvidia-smi -L

step "real-NVML tests (the MIG one runs when LANEWAY_MIG_TEST_GPU names an idle MIG-capable GPU; it needs root)"
filter=nvml_inventory
[ -n "${LANEWAY_MIG_TEST_GPU:-}" ] && filter=nvml
cargo test --release -p laneway-agent --lib -- --ignored "$filter" || fail "NVML tests"

step "laneway-agent gpus (what the agent registers)"
cargo build --release -q -p laneway-agent --bin laneway-agent || fail "build laneway-agent"
target/release/laneway-agent gpus || fail "laneway-agent gpus"

step "a CUDA process pinned to one GPU, as the agent pins replicas"
gpu="$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1 | tr -d ' ')"
python="${LANEWAY_GPU_PYTHON:-python3}"
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "skipped: no PyTorch with CUDA for $python (LANEWAY_GPU_PYTHON=/path/to/venv/bin/python to use another)"
else
  CUDA_VISIBLE_DEVICES="$gpu" "$python" - <<'PY' &
import time, torch
x = torch.randn(4096, 4096, device="cuda")
end = time.time() + 8
while time.time() < end:
    x = (x @ x).tanh()
torch.cuda.synchronize()
PY
  pid=$!
  sleep 4
  seen="$(nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader | tr -d ' ' | grep "^$pid,")"
  if [ "${seen#*,}" = "$gpu" ]; then echo "NVML sees pid $pid on $gpu, the GPU it was pinned to"; else fail "pid $pid not on $gpu (NVML: ${seen:-nothing})"; fi
  wait "$pid" || fail "the CUDA process failed"
  # GPU time of the process from NVML's accounting (needs `nvidia-smi -am 1`, root).
  acct="$(nvidia-smi --query-accounted-apps=pid,time,gpu_util --format=csv,noheader 2>/dev/null | tr -d ' ' | grep "^$pid," || true)"
  if [ -n "$acct" ]; then echo "NVML accounting (pid, ms, GPU util %): $acct  (the process ran ~8 s)"; else echo "NVML process accounting is off (root: nvidia-smi -am 1) or unsupported: GPU time not read"; fi
fi

if [ "$failed" -ne 0 ]; then echo "gpu-check: FAILED"; exit 1; fi
echo "gpu-check: ok"
