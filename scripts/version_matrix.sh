#!/usr/bin/env bash
# The test suite on the versions the project claims (docs/development.md, "Supported versions"): each row in its own
# virtual environment under .venvs/ (git-ignored), the README's test command in each, one row after another.
#
#   oldest   the floors of pyproject.toml: its lowest Python (3.11), torch and lightning at their lowest allowed
#            versions (read from pyproject.toml), the rest of ".[test]" as pip resolves it
#   gpu      Python 3.12, the GPU machine's versions (the pinned lines of scripts/gpu_machine.txt: torch 2.11,
#            Lightning 2.6.6, transformers 5.17, ...) and the wheels that travel there (scripts/gpu_wheels.txt)
#   newest   Python 3.13, the newest torch and lightning the package index offers, the rest of ".[test]" too
#
#   bash scripts/version_matrix.sh [ROW...]          default: oldest gpu newest
#
# Writes matrix_out/ROW.install.log and ROW.log (pytest's output), and a line per row to matrix_out/summary.tsv:
# date, row, Python, torch, lightning, transformers, pytest's closing line, exit status, install and test seconds.
# Exit status: 0 when every row's tests passed.
#
# Linux wheels of torch on the package index are CUDA builds, several GB each with their libraries: they run on a
# CPU. Disk: about 5 GB per row. Environment: PYTHON311, PYTHON312, PYTHON313 (the interpreters, default
# python3.11, python3.12, python3.13); MATRIX_WORKERS (pytest -n, default 3); MATRIX_CLEAN=1 removes a row's
# environment after its run. A constraints file that pip is configured with is not applied to the rows
# (PIP_CONSTRAINT=/dev/null): each row names its own versions.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=matrix_out
mkdir -p "$out" .venvs
[[ -f "$out/summary.tsv" ]] ||
  printf 'date\trow\tpython\ttorch\tlightning\ttransformers\tresult\texit\tinstall_s\ttest_s\n' >"$out/summary.tsv"
workers="${MATRIX_WORKERS:-3}"
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

# floor NAME: the lowest version pyproject.toml allows for NAME (its ">=" bound)
floor() {
  grep -oE "\"$1>=[0-9][0-9.]*" pyproject.toml | head -n1 | cut -d= -f2
}

# the pinned lines of a list file (name==version), without comments and without the python line
pins() {
  sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$1" | grep '==' | grep -v '^python=='
}

row_spec() {
  case "$1" in
    oldest)
      python="${PYTHON311:-python3.11}"
      install=("torch==$(floor torch)" "lightning==$(floor lightning)" -e ".[test]")
      ;;
    gpu)
      python="${PYTHON312:-python3.12}"
      mapfile -t machine < <(pins scripts/gpu_machine.txt)
      mapfile -t carried < <(pins scripts/gpu_wheels.txt)
      # the machine's test runner and its extras (unpinned there), then the project itself without dependencies
      install=("${machine[@]}" "${carried[@]}" pytest pytest-xdist pytest-timeout pyyaml psutil)
      ;;
    newest)
      python="${PYTHON313:-python3.13}"
      install=(--upgrade torch lightning -e ".[test]")
      ;;
    *)
      echo "unknown row $1 (oldest, gpu, newest)" >&2
      return 1
      ;;
  esac
}

status=0
rows=("$@")
((${#rows[@]})) || rows=(oldest gpu newest)
for row in "${rows[@]}"; do
  row_spec "$row" || exit 2
  venv=".venvs/matrix-$row"
  echo "=== $row: $python, pip install ${install[*]}"
  started=$SECONDS
  rm -rf "$venv"
  if ! { "$python" -m venv "$venv" &&
    "$venv/bin/python" -m pip install --quiet --upgrade pip &&
    "$venv/bin/python" -m pip install "${install[@]}" &&
    { [[ "$row" != gpu ]] || "$venv/bin/python" -m pip install --no-deps -e .; }; } >"$out/$row.install.log" 2>&1; then
    echo "$row: the install failed (see $out/$row.install.log)"
    tail -n 5 "$out/$row.install.log"
    printf '%s\t%s\t%s\t-\t-\t-\tinstall failed\t-\t%s\t-\n' "$(date -u +%F)" "$row" "$python" \
      $((SECONDS - started)) >>"$out/summary.tsv"
    status=1
    continue
  fi
  install_s=$((SECONDS - started))
  versions="$("$venv/bin/python" - <<'PY'
import importlib.metadata as metadata
import platform

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"

print(platform.python_version(), version("torch"), version("lightning"), version("transformers"), sep="\t")
PY
  )"
  echo "$row: $(tr '\t' ' ' <<<"$versions") (install ${install_s}s)"
  started=$SECONDS
  # the README's test command (docs/development.md), with the row's interpreter
  # the environment's bin first on PATH, as its activation does (the console script is run by tests)
  PATH="$PWD/$venv/bin:$PATH" VIRTUAL_ENV="$PWD/$venv" "$venv/bin/python" -m pytest -n "$workers" --dist loadfile \
    -p no:cacheprovider >"$out/$row.log" 2>&1
  rc=$?
  test_s=$((SECONDS - started))
  result="$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$out/$row.log" | tail -n1 | tr -d '=' | xargs)"
  echo "$row: ${result:-no pytest summary} (exit $rc, ${test_s}s)"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%F)" "$row" "$versions" "${result:-no summary}" "$rc" \
    "$install_s" "$test_s" >>"$out/summary.tsv"
  ((rc == 0)) || status=1
  if [[ "${MATRIX_CLEAN:-0}" == 1 ]]; then
    rm -rf "$venv"
  fi
done
exit $status
