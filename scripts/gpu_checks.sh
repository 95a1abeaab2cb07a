#!/usr/bin/env bash
# Every GPU check in one short run (about 6 minutes on one H200): the GPU tests, then the GPU benchmark.
# Outputs go to $OUT (or ./gpu_out). Needs python3 with a CUDA build of torch and lightning.
#
#   bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
PY
status=0
timeout 240 python3 -m pytest tests/test_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout 330 python3 benchmarks/offload_bench.py --device cuda --out "$out/offload_bench_cuda.json" 2>&1 \
  | tee "$out/offload_bench_cuda.txt" || status=1
exit $status
