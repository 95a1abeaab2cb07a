#!/usr/bin/env bash
# The GPU machine's first contact, rehearsed on a CPU: run it before calling any change to the GPU path done.
#
#   1. a fresh virtual environment (.venvs/dryrun, git-ignored) with Python 3.12 and only what the GPU machine has
#      (the pinned lines of scripts/gpu_machine.txt: torch 2.11.0, Lightning 2.6.6, transformers 5.17.0, ..., and
#      the unpinned pytest, pytest-xdist, pytest-timeout, pyyaml, psutil), checked against that list
#      (scripts/gpu_env.py machine). torch's Linux wheel on the package index is a CUDA build: it runs on a CPU.
#   2. the carried wheels, downloaded by scripts/gpu_wheels.sh into .whl/
#   3. scripts/gpu_checks.sh with that environment's python, without a network (a network namespace with only the
#      loopback, where `unshare -n` is allowed; else PIP_NO_INDEX and the Hugging Face offline switches), results
#      in gpu_out/dryrun/
#   4. its steps.txt checked: every step that gpu_checks.sh names ran and exited 0, or says "skipped: why" for a
#      reason of the machine (not "no time left")
#
#   bash scripts/gpu_dryrun.sh            # about 6 minutes on 2 cores (the install 1.5 from pip's cache)
#
# Environment: PYTHON312 (default python3.12), DRYRUN_REUSE=1 keeps an existing .venvs/dryrun. Exit status 0 when
# the checks exited 0 and every step is accounted for.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
venv=.venvs/dryrun
results=gpu_out/dryrun
python312="${PYTHON312:-python3.12}"

echo "=== 1. $venv: Python 3.12 and the GPU machine's packages"
if [[ "${DRYRUN_REUSE:-0}" != 1 || ! -x "$venv/bin/python" ]]; then
  rm -rf "$venv"
  mkdir -p .venvs
  "$python312" -m venv "$venv" || exit 1
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip || exit 1
  mapfile -t machine < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' scripts/gpu_machine.txt |
    grep '==' | grep -v '^python==')
  # the machine's pins, whatever constraints file pip is configured with here
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "${machine[@]}" pytest pytest-xdist pytest-timeout pyyaml psutil || exit 1
fi
"$venv/bin/python" scripts/gpu_env.py machine || exit 1

echo "=== 2. the carried wheels"
bash scripts/gpu_wheels.sh || exit 1

echo "=== 3. scripts/gpu_checks.sh, offline"
rm -rf "$results"
mkdir -p "$results"
checks=(env GPU_CHECKS_DIR="$results" PYTHON="$PWD/$venv/bin/python" GPU_SITE="$PWD/.venvs/dryrun-site"
  PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 bash scripts/gpu_checks.sh)
started=$SECONDS
if unshare -n true 2>/dev/null; then
  echo "(in a network namespace with only the loopback)"
  unshare -n bash -c 'ip link set lo up 2>/dev/null || true; exec "$@"' _ "${checks[@]}"
else
  echo "(unshare -n is not allowed here: offline by PIP_NO_INDEX and the Hugging Face switches only)"
  "${checks[@]}"
fi
rc=$?
echo "gpu_checks.sh: exit $rc after $((SECONDS - started))s"

echo "=== 4. every step accounted for"
missing=0
mapfile -t steps < <(grep -oE '^ *(run_step|skip_step) [a-z_]+' scripts/gpu_checks.sh | awk '{print $2}' | sort -u)
for step in "${steps[@]}"; do
  line="$(grep -E "^$step: " "$results/steps.txt")"
  if [[ "$line" =~ ^$step:\ exit\ 0\  || ("$line" =~ ^$step:\ skipped:\  && ! "$line" =~ "no time left") ]]; then
    echo "  ok   $line"
  else
    echo "  FAIL $step: ${line:-not in steps.txt}"
    missing=1
  fi
done
if ((rc != 0 || missing)); then
  echo "dry run FAILED (results in $results/)"
  exit 1
fi
echo "dry run passed: ${#steps[@]} steps, results in $results/"
