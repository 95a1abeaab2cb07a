"""The GPU run's preparation, checked without a GPU or a network: the wheels that travel cover what the GPU machine
lacks, the download script fetches exactly them, the checks' first step installs them and nothing else, the scripts
are shellcheck-clean, and the versions the README and docs/development.md claim are pyproject.toml's floors."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _gpu_env():
    spec = importlib.util.spec_from_file_location("gpu_env", SCRIPTS / "gpu_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_env = _gpu_env()


# ------------------------------------------------------------------------------------------- what travels
def _needed_on_the_machine(machine: dict[str, str | None]) -> tuple[dict[str, list[str]], list[str]]:
    requirements = [requirement for _, requirement in gpu_env.project_requirements()]
    return gpu_env.needed_beyond_machine(machine, requirements)


def test_the_carried_wheels_are_what_pyproject_needs_and_the_gpu_machine_lacks() -> None:
    machine = gpu_env.machine_packages()
    needed, unknown = _needed_on_the_machine(machine)
    left_behind = gpu_env.not_carried()
    assert not set(unknown) - left_behind, (
        f"not installed here, so their dependencies could not be followed: {unknown} (pip install -e '.[test]')"
    )
    carried = set(gpu_env.carried_wheels())
    missing = set(needed) - carried - left_behind
    assert not missing, {name: needed[name] for name in sorted(missing)}
    assert not carried - set(needed), f"carried but not needed there: {sorted(carried - set(needed))}"
    assert not carried & set(machine), "a carried wheel shadows the machine's own package"


def test_the_carried_versions_meet_every_requirement_that_pulls_them_in() -> None:
    needed, _ = _needed_on_the_machine(gpu_env.machine_packages())
    for name, version in gpu_env.carried_wheels().items():
        for pulled_by in needed[name]:
            requirement = Requirement(pulled_by.split(": ", 1)[1])
            assert requirement.specifier.contains(Version(version), prereleases=True), (name, version, pulled_by)


def test_the_closure_finds_a_dependency_of_a_dependency() -> None:
    """Without pyyaml on the machine, jsonargparse (a dependency) pulls it in: the check can fail."""
    machine = dict(gpu_env.machine_packages())
    machine.pop("pyyaml")
    needed, _ = _needed_on_the_machine(machine)
    assert any(parent.startswith("jsonargparse:") for parent in needed["pyyaml"])
    assert "docstring-parser" in needed  # through jsonargparse's "signatures" extra


def test_the_gpu_machines_versions_are_within_pyprojects_ranges() -> None:
    machine = gpu_env.machine_packages()
    for _, requirement in gpu_env.project_requirements():
        version = machine.get(canonicalize_name(requirement.name))
        if version is not None:
            assert requirement.specifier.contains(Version(version)), (str(requirement), version)
    assert machine["python"].startswith("3.12")


def test_a_list_line_without_a_version_is_refused(tmp_path: Path) -> None:
    listing = tmp_path / "wheels.txt"
    listing.write_text("# a comment\njsonargparse==4.53.0\ngguf\n")
    with pytest.raises(ValueError, match="pin a version for gguf"):
        gpu_env.carried_wheels(listing)


# ------------------------------------------------------------------------------------------- the download
FAKE_PIP = """#!/usr/bin/env bash
# stands in for `python -m pip download ... -d DEST SPEC...`: records the arguments, writes one empty wheel per spec
# (and a stray one, which the script must remove)
echo "$@" >> "$FAKE_PIP_LOG"
shift 2
dest=""; specs=()
while (($#)); do
  case "$1" in
    -d) dest="$2"; shift 2 ;;
    --platform|--python-version|--implementation|--only-binary) shift 2 ;;
    --*) shift ;;
    *) specs+=("$1"); shift ;;
  esac
done
for spec in "${specs[@]}"; do
  name="${spec%%==*}"; version="${spec#*==}"
  : > "$dest/$(tr 'A-Z.-' 'a-z__' <<<"$name")-$version-py3-none-any.whl"
done
: > "$dest/stray-1.0-py3-none-any.whl"
"""


def test_gpu_wheels_sh_downloads_exactly_the_list_for_python_312(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PIP)
    fake.chmod(0o755)
    dest = tmp_path / "wheels"
    log = tmp_path / "pip.log"
    process = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_wheels.sh"), str(dest)],
        env={**os.environ, "PYTHON": str(fake), "FAKE_PIP_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    arguments = log.read_text()
    for flag in ("download", "--no-deps", "--only-binary=:all:", "--python-version 3.12", "--implementation cp"):
        assert flag in arguments
    expected = {f"{name.replace('-', '_')}-{version}" for name, version in gpu_env.carried_wheels().items()}
    assert {"-".join(path.name.split("-")[:2]) for path in dest.glob("*.whl")} == expected
    assert "removing stray-1.0-py3-none-any.whl" in process.stdout


# ------------------------------------------------------------------------------------------- the first step
def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (one module), built by hand: the checks install it without an index."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": b"VALUE = 42\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(content)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, content in files.items():
            archive.writestr(path, content)
    return wheel


def _setup_step(tmp_path: Path, wheels: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    results, site = tmp_path / "results", tmp_path / "site"
    environment = {
        **os.environ,
        "GPU_CHECKS_ONLY": "setup",
        "GPU_CHECKS_DIR": str(results),
        "GPU_WHEELS": str(wheels),
        "GPU_SITE": str(site),
        "PYTHON": sys.executable,
        "PIP_NO_INDEX": "1",
    }
    environment.pop("OUT", None)
    process = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_checks.sh")], env=environment, capture_output=True, text=True, timeout=180
    )
    return process, results, site


@pytest.mark.skipif(importlib.util.find_spec("jsonargparse") is None, reason="needs the project's requirements")
def test_the_first_step_prints_what_it_found_and_installs_only_the_carried_wheels(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "zf_carried_probe", "1.2.3")
    process, results, site = _setup_step(tmp_path, wheels)
    log = (results / "setup.txt").read_text()
    assert process.returncode == 0, process.stdout + process.stderr
    assert "--- found (before the install)" in log
    assert "--- found (after the install)" in log
    assert re.search(r"torch>=\S+\s+\S+\s+ok", log), log
    assert "--- installed: zf_carried_probe-1.2.3" in log
    assert (site / "zf_carried_probe.py").is_file()
    steps = (results / "steps.txt").read_text().splitlines()
    assert len(steps) == 1, steps
    assert steps[0].startswith("setup: exit 0"), steps


def test_the_first_step_without_wheels_says_skipped_and_why(tmp_path: Path) -> None:
    process, results, site = _setup_step(tmp_path, tmp_path / "no-wheels-here")
    log = (results / "setup.txt").read_text()
    assert "--- install: skipped: no wheels in" in log
    assert "bash scripts/gpu_wheels.sh" in log
    assert not site.exists()


# ------------------------------------------------------------------------------------------- the scripts
SHELL_SCRIPTS = sorted(SCRIPTS.glob("*.sh")) + [ROOT / ".ci" / "run"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: path.name)
def test_shell_scripts_parse(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck (apt-get install shellcheck)")
def test_shell_scripts_are_shellcheck_clean() -> None:
    process = subprocess.run(
        ["shellcheck", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert process.returncode == 0, process.stdout


def test_every_check_step_is_accounted_for_by_the_dry_run() -> None:
    """The dry run's list of steps is read off gpu_checks.sh: every step is started by run_step or skip_step."""
    checks = (SCRIPTS / "gpu_checks.sh").read_text()
    steps = set(re.findall(r"^\s*(?:run_step|skip_step) ([a-z_]+)", checks, flags=re.M))
    assert {"setup", "env", "gpu_tests_engine", "gpu_tests_nccl", "offload_bench_cuda"} <= steps
    first = re.search(r"^\s*run_step ([a-z_]+)", checks, flags=re.M).group(1)
    assert first == "setup"
    assert "--no-index" in checks
    assert "--no-deps" in checks


# ------------------------------------------------------------------------------------------- the claims
def _floor(name: str) -> str:
    for _, requirement in gpu_env.project_requirements(()):
        if canonicalize_name(requirement.name) == name:
            (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            return bound
    raise AssertionError(f"{name} is not a dependency")


def test_the_readme_claims_pyprojects_floors() -> None:
    readme = (ROOT / "README.md").read_text()
    torch_floor, lightning_floor = _floor("torch"), _floor("lightning")
    assert f"torch ≥ {torch_floor}" in readme, f"README should say which torch works: torch ≥ {torch_floor}"
    assert f"Lightning ≥ {lightning_floor}" in readme, f"README should say Lightning ≥ {lightning_floor}"


def test_docs_development_records_the_floors_as_a_tested_row() -> None:
    development = (ROOT / "docs" / "development.md").read_text()
    section = development.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    oldest = next(line for line in section.splitlines() if line.startswith("| oldest"))
    assert f"torch {_floor('torch')}" in oldest, oldest
    assert f"Lightning {_floor('lightning')}" in oldest, oldest


def test_the_matrix_oldest_row_installs_pyprojects_floors() -> None:
    """scripts/version_matrix.sh reads its oldest row's pins off pyproject.toml: raising a floor moves the row."""
    script = (SCRIPTS / "version_matrix.sh").read_text()
    floor_function = re.search(r"^floor\(\) \{\n.*?^\}\n", script, flags=re.M | re.S).group(0)
    for name in ("torch", "lightning"):
        process = subprocess.run(
            ["bash", "-c", f"{floor_function}\nfloor {name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        assert process.stdout.strip() == _floor(name)
