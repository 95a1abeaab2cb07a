#!/usr/bin/env bash
# The peers' own test suites run against ZenFlow, outside the repository's test run (docs/peer_suites.md):
#
#   1. Lightning's tests/tests_pytorch (a slice, below) with Trainer(strategy="auto") on one CPU device resolved to
#      ZenFlowStrategy(<knobs>) and BoringModel returning AdamW (plugin: scripts/peer_suites/zenflow_lightning_plugin.py)
#   2. PyTorch's test/test_optim.py (the OptimizerInfo suite) with ZenFlowAdamW(<knobs>) as one more optimizer beside
#      torch.optim.AdamW (plugin: scripts/peer_suites/zenflow_torch_optim.py)
#
# each in three modes: topk1 (topk_ratio=1.0, full_warm_up_rounds=0) and topk0 (topk_ratio=0.0, update_interval=1,
# overlap_step=False, full_warm_up_rounds=0), whose numbers must equal AdamW's, and defaults (the shipped knobs).
# Then every Lightning test that failed in a mode runs again twice: without any plugin (plain Lightning) and with the
# optimizer swap only (mode control), to tell a ZenFlow difference from one of this machine or of the swap.
#
#   bash scripts/peer_suites.sh LIGHTNING_TESTS_DIR TORCH_TEST_OPTIM_PY [OUT_DIR]
#
# LIGHTNING_TESTS_DIR: tests/tests_pytorch of Lightning's sources at the installed version (2.6.5's tree was used
#   with lightning 2.6.6: no 2.6.6 tag exists), with tests/legacy beside it; TORCH_TEST_OPTIM_PY: PyTorch's
#   test/test_optim.py, or - to run Lightning's suite only (env.txt then says the torch suite was skipped). OUT_DIR (default peer_out/): per suite and mode <suite>_<mode>.xml (junit),
#   .outcomes.tsv (one line per test), .log; recheck_*.xml/.tsv; summary.txt and summary.json; classification.tsv
#   and .txt (every failure's class from scripts/peer_suites/known_failures.tsv, and those no row matches).
#
# Packages beyond the project's (pip install them into the environment first):
#   cloudpickle tensorboard pytest-timeout (Lightning's tests)   expecttest (torch.testing._internal)
#
# Time on 2 cores, -n 2: about 7.5 minutes in all. Each pytest run is bounded by `timeout` (PEER_RUN_TIMEOUT_S,
# default 1500) and each test by pytest-timeout (the .ini files beside the plugins). Environment: PYTHON (default
# python), PEER_WORKERS (default 2). Exit status 0 when the script ran to the end, whatever the tests said.
set -uo pipefail

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}
if (($# < 2 || $# > 3)); then
  usage
  exit 2
fi

repo="$(cd "$(dirname "$0")/.." && pwd)"
lightning_tests="$(cd "$1" && pwd)" || exit 2
if [[ "$2" == "-" ]]; then
  torch_test=""
else
  torch_test="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
fi
out="$(mkdir -p "${3:-peer_out}" && cd "${3:-peer_out}" && pwd)" || exit 2
python="${PYTHON:-python}"
workers="${PEER_WORKERS:-2}"
run_timeout="${PEER_RUN_TIMEOUT_S:-1500}"
helpers="$repo/scripts/peer_suites"
[[ -f "$lightning_tests/conftest.py" && (-z "$torch_test" || -f "$torch_test") ]] || {
  echo "expected Lightning's tests/tests_pytorch and PyTorch's test/test_optim.py, got: $1 $2" >&2
  exit 2
}
"$python" -c "import cloudpickle, tensorboard, pytest_timeout, xdist, expecttest" 2>/dev/null || {
  echo "missing packages: $python -m pip install cloudpickle tensorboard pytest-timeout pytest-xdist expecttest" >&2
  exit 2
}
export PYTHONPATH="$helpers${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# The slice of Lightning's suite: the places where a strategy's optimizer step, checkpoints, loops, hooks, logging and
# tuner meet. Left out (docs/peer_suites.md): multi-process tests (-k below: ZenFlow is swapped in for one device only,
# and each spawns processes for seconds); callbacks/test_spike.py (214 s, DDP-spawned runs) and
# tuner/test_scale_batch_size.py (130 s); checkpointing/test_legacy_checkpoints.py (downloads checkpoints);
# utilities/migration/test_utils.py and utilities/test_imports.py (they test the standalone `pytorch_lightning`
# package's imports in subprocesses; the former fails on plain Lightning here).
T="$lightning_tests"
lightning_slice=(
  "$T/models/test_restore.py" "$T/trainer/optimization" "$T/checkpointing" "$T/callbacks" "$T/tuner" "$T/loops"
  "$T/models/test_hooks.py" "$T/trainer/logging_" "$T/trainer/flags" "$T/accelerators/test_cpu.py" "$T/utilities"
  --ignore="$T/callbacks/test_spike.py" --ignore="$T/tuner/test_scale_batch_size.py"
  --ignore="$T/checkpointing/test_legacy_checkpoints.py" --ignore="$T/utilities/migration/test_utils.py"
  --ignore="$T/utilities/test_imports.py"
  -k "not ddp and not spawn"
)

# run_pytest NAME PLUGIN_ARGS... -- PYTEST_ARGS...: one bounded pytest run into $out/NAME.{xml,log,outcomes.tsv}
run_pytest() {
  local name="$1"
  shift
  local started=$SECONDS
  # pytest is run from $out: Lightning's conftest fails a test that leaves files in its tree, so nothing goes there
  (cd "$out" && timeout --kill-after=30 "$run_timeout" "$python" -m pytest -q -n "$workers" -r fE \
    --junitxml="$out/$name.xml" "$@") >"$out/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status, $((SECONDS - started)) s" | tee -a "$out/runs.txt"
  if [[ -f "$out/$name.xml" ]]; then
    "$python" "$helpers/summarize.py" outcomes "$out/$name.xml" "$out/$name.outcomes.tsv"
  fi
}

: >"$out/runs.txt"
# what was tested: the package's commit and uncommitted changes, the versions (the tree may change between runs)
{
  echo "started: $(date -u +%FT%TZ)"
  echo "lightning_zenflow: $(git -C "$repo" rev-parse HEAD 2>/dev/null) with $(git -C "$repo" status --short \
    -- lightning_zenflow 2>/dev/null | wc -l) changed paths under lightning_zenflow/"
  "$python" -c "import lightning, torch, sys; print('lightning', lightning.__version__, 'torch', torch.__version__, \
'python', sys.version.split()[0])"
  echo "cores: $(nproc)"
  [[ -n "$torch_test" ]] || echo "torch's test_optim.py: skipped (no file given)"
} >"$out/env.txt"
lightning_args=(-c "$helpers/lightning.ini" --rootdir="$T/..")
for mode in topk1 topk0 defaults; do
  ZENFLOW_PEER_MODE=$mode run_pytest "lightning_$mode" "${lightning_args[@]}" -p zenflow_lightning_plugin \
    "${lightning_slice[@]}"
done

if [[ -n "$torch_test" ]]; then
  torch_args=(-c "$helpers/torch.ini" --rootdir="$(dirname "$torch_test")" -p zenflow_torch_optim "$torch_test")
  for mode in topk1 topk0 defaults; do
    # AdamW's own tests run beside ZenFlowAdamW's: the same test on torch's class is the reference
    ZENFLOW_PEER_MODE=$mode run_pytest "torch_$mode" "${torch_args[@]}" -k "ZenFlowAdamW or AdamW_cpu"
  done
fi

# class (c) or (b): the Lightning tests that failed under ZenFlow, on plain Lightning and with the optimizer swap only
mapfile -t failed_ids < <("$python" "$helpers/summarize.py" failed "$T" "$out"/lightning_topk1.xml \
  "$out"/lightning_topk0.xml "$out"/lightning_defaults.xml)
if ((${#failed_ids[@]})); then
  run_pytest recheck_plain "${lightning_args[@]}" "${failed_ids[@]}"
  ZENFLOW_PEER_MODE=control run_pytest recheck_control "${lightning_args[@]}" -p zenflow_lightning_plugin \
    "${failed_ids[@]}"
fi

echo
"$python" "$helpers/summarize.py" table "$out"
echo
# each failure's class (a/b/c/d, scripts/peer_suites/known_failures.tsv); new failures are listed at the end
"$python" "$helpers/summarize.py" classify "$out" | tee "$out/classification.txt"
