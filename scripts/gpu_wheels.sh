#!/usr/bin/env bash
# Downloads the wheels that travel with scripts/gpu_checks.sh to the GPU machine, which reaches no package registry:
# exactly the packages of scripts/gpu_wheels.txt, at its versions, built for that machine (CPython 3.12, x86-64
# Linux), into .whl/ (git-ignored; the checks' first step installs them from there and from nothing else). Wheels in
# .whl/ that the list does not name are removed, so the folder holds the list and nothing more.
#
#   bash scripts/gpu_wheels.sh [DIR]        DIR: default .whl
#
# Environment: PYTHON (default python3), the pip that downloads (any Python: the target is given to pip).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
dest="${1:-.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dest"

mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' scripts/gpu_wheels.txt)
if ((${#wanted[@]} == 0)); then
  echo "scripts/gpu_wheels.txt names no wheel" >&2
  exit 1
fi

# --no-deps: the list already names every package the machine lacks (tests/test_gpu_checks.py checks that)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${wanted[@]}"

# keep exactly the listed name==version wheels (a wheel's file name: name-version-tags.whl, name with underscores)
declare -A keep=()
for spec in "${wanted[@]}"; do
  name="${spec%%==*}"
  version="${spec#*==}"
  keep["$(tr 'A-Z.-' 'a-z__' <<<"$name")-$version"]=1
done
found=0
for wheel in "$dest"/*.whl; do
  [[ -e "$wheel" ]] || continue
  base="$(basename "$wheel")"
  IFS=- read -r name version _ <<<"$base"
  if [[ -n "${keep["$(tr 'A-Z.-' 'a-z__' <<<"$name")-$version"]:-}" ]]; then
    found=$((found + 1))
  else
    echo "removing $base: not in scripts/gpu_wheels.txt"
    rm -f "$wheel"
  fi
done
if ((found != ${#wanted[@]})); then
  echo "expected ${#wanted[@]} wheels in $dest, found $found" >&2
  exit 1
fi
kept=("$dest"/*.whl)
echo "$found wheels in $dest ($(du -sh "$dest" | cut -f1)): ${kept[*]##*/}"
