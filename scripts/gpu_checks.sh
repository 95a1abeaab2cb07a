#!/usr/bin/env bash
# Every GPU check in one run of at most 8 minutes on one H200. Each step runs under its own `timeout`, cut to what
# is left of the 8 minutes, and writes into the results folder (gpu_out/, or $GPU_CHECKS_DIR) as it goes, so a failed
# or killed step still leaves the results of the others (and its own partial output):
#
#   setup.txt                 the first step: what the machine has (the version of every requirement of
#                             pyproject.toml), the wheels it installs from .whl/ (scripts/gpu_wheels.sh downloads
#                             them: the machine reaches no package index), and the same list after the install
#   env.txt                   the machine: nvidia-smi, driver, torch and CUDA versions, cores, memory, /dev/shm, ulimit -l
#   gpu_tests_engine.txt/.xml    every test marked gpu, in every test file (pytest -m gpu), but Lightning's; -v: one
#                                line per test as it finishes, so a timeout keeps what ran
#   gpu_tests_lightning.txt/.xml the Lightning fits on CUDA
#   gpu_tests_nccl.txt/.xml      on 2+ GPUs only: data parallel, FSDP2 and HSDP (zenflow_fsdp) over NCCL, the LLM
#                                recipe's sharded loading and export (4 GPUs: HSDP 2 x 2 too)
#   sanitizer.txt             scripts/gpu_sanitize.py under TORCH_CUDA_SANITIZER=1: the engine (bf16 weights with
#                             interim moves; fp32 with a 16-mixed overflow flag) and Lightning fits (bf16-true,
#                             16-mixed) for a few steps on adversarially delayed streams; any unordered access of one
#                             stream to another's memory fails it
#   offload_trace.json        offload_bench.py --profile: a torch.profiler Chrome trace of a few ZenFlow steps of the
#                             1.2B GPT (open in chrome://tracing, Perfetto); offload_profile.json: that row's numbers
#   plan_measure.txt          lightning-zenflow plan --measure --json: this machine's rates and the plan of Qwen2.5-14B
#   kernel_bench_cuda.*       benchmarks/kernel_bench.py --device cuda: the interim moves' kernels against fused AdamW
#   offload_bench_cuda.*      benchmarks/offload_bench.py --device cuda, 1.2B bf16 GPT (.rows.jsonl: one row each),
#                             the defaults (interim moves on) beside "zenflow no-moves"
#   steps.txt                 each step's exit status and seconds (124: it hit its timeout), or "skipped: why"
#
# Without a CUDA device (scripts/gpu_dryrun.sh runs it so, on a CPU) every step runs its CPU part instead: the test
# steps rehearse tests/test_gpu.py on the CPU (LIGHTNING_ZENFLOW_GPU_TESTS_ON=cpu: every test not about CUDA itself
# runs, so a stale one fails here) and the other GPU tests skip, the sanitizer's runs go on the CPU's strict lanes,
# the benchmarks run --device cpu --quick; a step that has no CPU part says "skipped: why". With OUT set to a folder, after every step OUT receives gpu_checks.tar.gz (the
# results folder so far) and steps.txt: two files, for a machine from which only a few files come back.
#
# Exit status: 0 when every step passed or was skipped for a reason of the machine (one GPU where a check wants
# two), 1 otherwise. Needs python with torch, lightning and pytest ($PYTHON, default python3); what else
# pyproject.toml needs comes from .whl/ ($GPU_WHEELS), installed with pip --no-index into a fresh folder
# ($GPU_SITE, default under $TMPDIR) put on PYTHONPATH. GPU_CHECKS_ONLY="setup env" runs only the steps named.
#
#   bash scripts/gpu_wheels.sh      # here, where the package index is reachable: .whl/
#   bash scripts/gpu_checks.sh      # there, with .whl/ beside the sources
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${GPU_CHECKS_DIR:-gpu_out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
wheels="${GPU_WHEELS:-.whl}"
site="${GPU_SITE:-${TMPDIR:-/tmp}/lightning_zenflow_gpu_site}"
# the sources first, then the carried wheels (installed by the setup step), then what the environment had
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$((SECONDS + 460)) # 8 minutes less a margin: the last step's SIGKILL grace (10 s) and the summary
status=0
: >"$out/steps.txt"

# bundle: with OUT set (and not the results folder itself), refresh OUT/gpu_checks.tar.gz and OUT/steps.txt
bundle() {
  [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || return 0
  [[ "$(cd "$OUT" && pwd)" != "$(cd "$out" && pwd)" ]] || return 0
  local packed
  packed="$(mktemp "${TMPDIR:-/tmp}/gpu_checks.XXXXXX")"
  tar -czf "$packed" -C "$out" . && mv -f "$packed" "$OUT/gpu_checks.tar.gz"
  rm -f "$packed"
  cp -f "$out/steps.txt" "$OUT/steps.txt"
}

# selected NAME: whether the step runs in this invocation (GPU_CHECKS_ONLY: the steps to run, by name; default all)
selected() {
  [[ -z "${GPU_CHECKS_ONLY:-}" || " $GPU_CHECKS_ONLY " == *" $1 "* ]]
}

# skip_step NAME WHY: a step that cannot run on this machine; not a failure
skip_step() {
  selected "$1" || return 0
  echo "$1: skipped: $2" | tee -a "$out/steps.txt"
  bundle
}

# run_step NAME CAP_SECONDS COMMAND...: run COMMAND under `timeout` (at most CAP_SECONDS and what is left before the
# deadline), output to the terminal and to $out/NAME.txt; record the exit status; never stop the script
run_step() {
  local name="$1" cap="$2"
  shift 2
  selected "$name" || return 0
  local left=$((deadline - SECONDS))
  local limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    echo "$name: skipped: no time left of the 8 minutes" | tee -a "$out/steps.txt"
    status=1
    bundle
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
  bundle
}

# the first step: what is here, the carried wheels installed (from $wheels and nothing else), what is here then
# shellcheck disable=SC2317 # called through `bash -c setup`
setup() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "python: $(command -v "$python") ($("$python" -V 2>&1)); pip: $("$python" -m pip --version 2>&1)"
  echo "--- found (before the install)"
  "$python" scripts/gpu_env.py found
  rm -rf "$site"
  shopt -s nullglob
  local carried=("$wheels"/*.whl)
  if ((${#carried[@]} == 0)); then
    echo "--- install: skipped: no wheels in $wheels/ (bash scripts/gpu_wheels.sh downloads them)"
  else
    echo "--- install into $site: ${carried[*]##*/}"
    # --no-index: nothing from a package index, only the carried files; --no-deps: the list is complete
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$site" "${carried[@]}" || echo "the install failed"
    local installed=("$site"/*.dist-info)
    installed=("${installed[@]##*/}")
    echo "--- installed: ${installed[*]%.dist-info}"
  fi
  echo "--- found (after the install)"
  "$python" scripts/gpu_env.py found
}
export -f setup
export python wheels site
run_step setup 90 bash -c setup

# shellcheck disable=SC2317 # called through `bash -c machine`
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
for name in ("lightning", "pytorch_lightning", "transformers", "triton"):
    try:
        print(name, __import__(name).__version__)
    except ImportError as error:
        print(name, "not importable:", error)
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

if "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  device=cuda
  gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  bench=(--device cuda)
else
  device=cpu
  gpus=0
  bench=(--device cpu --quick)
  # tests/test_gpu.py rehearsed on the CPU: what is not about CUDA itself runs, so a stale test fails here
  export LIGHTNING_ZENFLOW_GPU_TESTS_ON=cpu
  echo "no CUDA device: each step runs its CPU part (tests/test_gpu.py rehearsed on the CPU, the other GPU tests skip,"
  echo "the sanitizer's runs on strict CPU lanes, the benchmarks --device cpu --quick)"
fi

# the tests first, in two steps (the engine's, then Lightning's), each test's result written as it finishes (-v
# through tee), so a step cut off by its timeout still leaves the name and outcome of every test that ran; a test
# module that fails to import is reported and the others still run
run_step gpu_tests_engine 180 "$python" -m pytest tests/ -m gpu -k "not lightning and not two_gpus and not four_gpus" -v -rs \
  --durations=15 --continue-on-collection-errors \
  -p no:cacheprovider --junitxml="$out/gpu_tests_engine.xml"

# the stream sanitizer over a few steps of the engine and of Lightning fits (scripts/gpu_sanitize.py)
if [[ $device == cuda ]]; then
  run_step sanitizer 90 env TORCH_CUDA_SANITIZER=1 "$python" scripts/gpu_sanitize.py --device cuda
else
  run_step sanitizer 90 "$python" scripts/gpu_sanitize.py --device cpu
fi

# the benchmarks the project is judged by, before the slower checks: the interim moves' kernels (Triton, from the
# same source as the CPU's) against fused AdamW, then the offload benchmark (the ZenFlow row first, every row written
# as it finishes)
run_step kernel_bench_cuda 60 "$python" benchmarks/kernel_bench.py "${bench[@]}" --out "$out/kernel_bench_cuda.json"

if [[ $device == cuda ]]; then
  run_step offload_bench_cuda 150 "$python" benchmarks/offload_bench.py "${bench[@]}" --no-sweep --warmup-steps 8 \
    --steps 8 --out "$out/offload_bench_cuda.json"
else
  run_step offload_bench_cuda 150 "$python" benchmarks/offload_bench.py "${bench[@]}" \
    --out "$out/offload_bench_cuda.json"
fi

run_step gpu_tests_lightning 100 "$python" -m pytest tests/ -m gpu -k lightning -v -rs --durations=15 \
  --continue-on-collection-errors -p no:cacheprovider --junitxml="$out/gpu_tests_lightning.xml"

# NCCL: data parallel, FSDP2, HSDP (2 replicas of 1 shard; with 4 GPUs also 2 x 2) and the LLM recipe's sharded
# loading and export on two GPUs (tests/test_gpu.py, "two_gpus" / "four_gpus"), where the machine has them; a test
# that needs more GPUs than the machine has says so in its skip reason
if ((gpus >= 2)); then
  run_step gpu_tests_nccl 200 "$python" -m pytest tests/test_gpu.py -m gpu -k "two_gpus or four_gpus" -v -rs \
    -p no:cacheprovider --junitxml="$out/gpu_tests_nccl.xml"
else
  skip_step gpu_tests_nccl "$gpus CUDA device(s) here, the NCCL tests need 2"
fi

# the planner on this machine: the rates it measures (pinned copies each way, the host step, the device step) and its
# plan of Qwen2.5-14B with them, to set beside what the benchmarks above measured (configs/llm_gpu.yaml is that plan)
run_step plan_measure 120 "$python" -m lightning_zenflow.cli plan --model configs/models/Qwen2.5-14B.json \
  --activation-checkpointing --measure --json

run_step offload_profile 60 "$python" benchmarks/offload_bench.py "${bench[@]}" --warmup-steps 8 --steps 8 \
  --profile "$out/offload_trace.json" --out "$out/offload_profile.json"

echo "=== done: $(tr '\n' ';' <"$out/steps.txt")"
bundle
exit $status
