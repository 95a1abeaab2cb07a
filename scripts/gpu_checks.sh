#!/usr/bin/env bash
# Every GPU check in one run of at most 8 minutes on one H200. Each step runs under its own `timeout`, cut to what
# is left of the 8 minutes, and writes into $OUT (or ./gpu_out) as it goes, so a failed or killed step still leaves
# the results of the others (and its own partial output):
#
#   env.txt                   the machine: nvidia-smi, driver, torch and CUDA versions, cores, memory, /dev/shm, ulimit -l
#   gpu_stall.jsonl / .txt    benchmarks/gpu_stall.py at realistic sizes, ZenFlow rows first (one JSON line per row)
#   gpu_tests_engine.txt/.xml    every test marked gpu, in every test file (pytest -m gpu), but Lightning's; -v: one
#                                line per test as it finishes, so a timeout keeps what ran
#   gpu_tests_lightning.txt/.xml the Lightning fits on CUDA
#   gpu_tests_nccl.txt/.xml      on 2+ GPUs only: data parallel and FSDP2 (zenflow_fsdp) over NCCL
#   gpu_stall_trace.json      a torch.profiler Chrome trace of a few ZenFlow steps (open in chrome://tracing, Perfetto)
#   moves_bench_cuda.*        benchmarks/moves_bench.py --device cuda: the interim moves' kernels against fused AdamW
#   offload_bench_cuda.*      benchmarks/offload_bench.py --device cuda, 1.2B bf16 GPT (.rows.jsonl: one row each),
#                             the defaults (interim moves on) beside "zenflow no-moves"
#   steps.txt                 each step's exit status and seconds (124: it hit its timeout)
#
# Exit status: 0 when every step passed, 1 otherwise. Needs python with a CUDA build of torch, lightning and pytest
# ($PYTHON, default python3).
#
#   bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$((SECONDS + 460)) # 8 minutes less a margin: the last step's SIGKILL grace (10 s) and the summary
status=0
: >"$out/steps.txt"

# run_step NAME CAP_SECONDS COMMAND...: run COMMAND under `timeout` (at most CAP_SECONDS and what is left before the
# deadline), output to the terminal and to $out/NAME.txt; record the exit status; never stop the script
run_step() {
  local name="$1" cap="$2"
  shift 2
  local left=$((deadline - SECONDS))
  local limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    echo "$name: skipped, no time left" | tee -a "$out/steps.txt"
    status=1
    return
  fi
  echo "=== $name (timeout ${limit}s): $*"
  local started=$SECONDS
  # SIGTERM at the limit (the benchmarks unwind and close their host workers), SIGKILL 10 s later
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc after $((SECONDS - started))s (limit ${limit}s)" | tee -a "$out/steps.txt"
  if ((rc != 0)); then
    status=1
  fi
}

machine() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "--- nvidia-smi"
  timeout 20 nvidia-smi || echo "nvidia-smi failed or is missing"
  echo "--- nvidia-smi query"
  timeout 20 nvidia-smi --format=csv \
    --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm \
    || echo "nvidia-smi query failed"
  echo "--- nvidia-smi topo -m"
  timeout 20 nvidia-smi topo -m || true
  echo "--- versions"
  timeout 60 "$python" - <<'PY' || echo "python/torch import failed"
import platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
try:
    import lightning
    print("lightning", lightning.__version__)
except ImportError as error:
    print("lightning not importable:", error)
PY
  echo "--- nproc: $(nproc) (all: $(nproc --all))"
  echo "--- lscpu"
  lscpu 2>/dev/null | grep -E '^(Model name|Socket|Core|Thread|NUMA|CPU\(s\))' || true
  echo "--- free -g"
  free -g || true
  echo "--- df -h /dev/shm"
  df -h /dev/shm || true
  echo "--- ulimit -l: $(ulimit -l)"
}
export -f machine
export python
run_step env 90 bash -c machine

# the tests first, in two steps (the engine's, then Lightning's), each test's result written as it finishes (-v
# through tee), so a step cut off by its timeout still leaves the name and outcome of every test that ran
run_step gpu_tests_engine 200 "$python" -m pytest tests/ -m gpu -k "not lightning and not two_gpus" -v -rs \
  --durations=15 \
  -p no:cacheprovider --junitxml="$out/gpu_tests_engine.xml"

run_step gpu_tests_lightning 150 "$python" -m pytest tests/ -m gpu -k lightning -v -rs --durations=15 \
  -p no:cacheprovider --junitxml="$out/gpu_tests_lightning.xml"

# NCCL: data parallel and FSDP2 on two GPUs (tests/test_gpu.py, "two_gpus"), where the machine has them
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if ((gpus >= 2)); then
  run_step gpu_tests_nccl 150 "$python" -m pytest tests/test_gpu.py -m gpu -k two_gpus -v -rs \
    -p no:cacheprovider --junitxml="$out/gpu_tests_nccl.xml"
else
  echo "gpu_tests_nccl: skipped, ${gpus:-0} GPU(s) here (needs 2)" | tee -a "$out/steps.txt"
fi

run_step gpu_stall 120 "$python" benchmarks/gpu_stall.py --device cuda --budget-s 25 --out "$out/gpu_stall.jsonl"

run_step gpu_stall_profile 60 "$python" benchmarks/gpu_stall.py --device cuda --warmup-steps 8 --profile-steps 8 \
  --profile "$out/gpu_stall_trace.json"

# the interim moves' kernels (Triton, from the same source as the CPU's) against fused AdamW on the GPU
run_step moves_bench_cuda 60 "$python" benchmarks/moves_bench.py --device cuda --out "$out/moves_bench_cuda.json"

# what is left of the 8 minutes: the ZenFlow row runs first and every row is written as it finishes
run_step offload_bench_cuda 400 "$python" benchmarks/offload_bench.py --device cuda --no-sweep --warmup-steps 8 \
  --steps 8 --out "$out/offload_bench_cuda.json"

echo "=== done: $(tr '\n' ';' <"$out/steps.txt")"
exit $status
