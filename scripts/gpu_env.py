"""What the GPU machine has, what the project needs there, and what must travel as wheels.

The GPU machine (``scripts/gpu_machine.txt``) reaches no package registry: whatever ``pyproject.toml`` needs there and
its image lacks travels as wheels (``scripts/gpu_wheels.txt``, downloaded by ``scripts/gpu_wheels.sh``). This file
reads the three, and checks an environment against them::

    python scripts/gpu_env.py found      every requirement of pyproject.toml (dependencies and extras): the version
                                         installed here, or missing, and whether it meets the specifier; exit 1 when
                                         one the checks need is missing or too old
    python scripts/gpu_env.py machine    the versions gpu_machine.txt pins against those installed here (exit 1 on a
                                         difference), and the installed packages that it does not name
    python scripts/gpu_env.py needed     what pyproject.toml needs on the GPU machine beyond its image (dependencies
                                         of dependencies included, followed through this environment's metadata)

Standard library and ``packaging`` only (both are on the GPU machine). ``tests/test_gpu_checks.py`` imports it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MACHINE_FILE = ROOT / "scripts" / "gpu_machine.txt"
WHEELS_FILE = ROOT / "scripts" / "gpu_wheels.txt"

TARGET_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}
"""The GPU machine, as environment markers: requirements are evaluated for it, not for the Python running this."""

CHECKS_EXTRAS = ("test", "llm")
"""The extras gpu_checks.sh needs besides the dependencies: the test suite's and lightning_zenflow.llm's."""


def _pins(path: Path) -> dict[str, str | None]:
    """``name -> version`` (None for a bare name) of a list file: one ``name==version`` or ``name`` a line."""
    pins: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        pins[canonicalize_name(name.strip())] = version.strip() or None
    return pins


def machine_packages(path: Path = MACHINE_FILE) -> dict[str, str | None]:
    """The GPU machine's packages (its ``python`` line included): name -> version, None where only the name is known."""
    return _pins(path)


def carried_wheels(path: Path = WHEELS_FILE) -> dict[str, str]:
    """The wheels that travel: name -> version (every line pins one)."""
    wheels = _pins(path)
    unpinned = sorted(name for name, version in wheels.items() if version is None)
    if unpinned:
        raise ValueError(f"{path.name}: pin a version for {', '.join(unpinned)} (name==version)")
    return {name: str(version) for name, version in wheels.items()}


def not_carried(path: Path = WHEELS_FILE) -> set[str]:
    """Packages the list leaves behind on purpose (``# no-carry: name`` lines)."""
    names = set()
    for line in path.read_text().splitlines():
        if line.strip().startswith("# no-carry:"):
            names.add(canonicalize_name(line.split(":", 1)[1].strip()))
    return names


def project_requirements(extras: tuple[str, ...] | None = None) -> list[tuple[str, Requirement]]:
    """``(group, requirement)`` for pyproject.toml's dependencies (group "dependencies") and the named extras (all of
    them by default), in file order."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    groups = [("dependencies", project.get("dependencies", []))]
    names = extras if extras is not None else tuple(optional)
    groups += [(name, optional[name]) for name in names if name in optional]
    return [(group, Requirement(spec)) for group, specs in groups for spec in specs]


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether ``requirement`` is needed on the GPU machine when its parent was asked for with ``extras``."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**TARGET_MARKERS, "extra": extra}) for extra in extras | {""})


def needed_beyond_machine(
    machine: dict[str, str | None], requirements: list[Requirement]
) -> tuple[dict[str, list[str]], list[str]]:
    """Follow ``requirements`` through this environment's package metadata, stopping at packages the machine has.

    Returns ``(needed, unknown)``: needed maps every package the machine lacks to the requirements that pulled it in;
    unknown names those not installed here, whose own dependencies could therefore not be followed."""
    needed: dict[str, list[str]] = {}
    unknown: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    queue = [(requirement, "pyproject.toml") for requirement in requirements if _applies(requirement, set())]
    while queue:
        requirement, parent = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in machine:
            continue
        pulled_by = needed.setdefault(name, [])
        if f"{parent}: {requirement}" not in pulled_by:
            pulled_by.append(f"{parent}: {requirement}")
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            children = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            unknown.append(name)
            continue
        for spec in children:
            child = Requirement(spec)
            if _applies(child, set(requirement.extras)):
                queue.append((child, name))
    return needed, sorted(set(unknown))


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _found() -> int:
    """The ``found`` command: one line per requirement of pyproject.toml and per carried wheel; exit 1 when one the
    checks need is missing or out of range."""
    print(f"python {platform.python_version()} ({sys.executable}) on {platform.machine()}")
    skipped = not_carried()
    groups: dict[str, list[str]] = {}
    for group, requirement in project_requirements():
        if _applies(requirement, set()):
            groups.setdefault(str(requirement), []).append(group)
    failures = []
    for spec, in_groups in groups.items():
        requirement = Requirement(spec)
        version = installed_version(requirement.name)
        if version is None:
            verdict = "MISSING"
        elif requirement.specifier and not requirement.specifier.contains(Version(version), prereleases=True):
            verdict = f"OUT OF RANGE ({requirement.specifier})"
        else:
            verdict = "ok"
        needed_here = bool({"dependencies", *CHECKS_EXTRAS} & set(in_groups))
        if verdict != "ok" and needed_here and canonicalize_name(requirement.name) in skipped:
            verdict += ", not carried on purpose (scripts/gpu_wheels.txt)"
        elif verdict != "ok" and needed_here:
            failures.append(requirement.name)
        elif verdict != "ok":
            verdict += ", not needed by the checks"
        print(f"  {spec:<32} {version or '-':<14} {verdict:<10} [{', '.join(in_groups)}]")
    for name, version in carried_wheels().items():
        here = installed_version(name)
        verdict = "ok" if here is not None and Version(here) == Version(version) else "MISSING OR ANOTHER VERSION"
        if verdict != "ok":
            failures.append(name)
        print(f"  {name + '==' + version:<32} {here or '-':<14} {verdict:<10} [carried: scripts/gpu_wheels.txt]")
    if failures:
        failed = ", ".join(dict.fromkeys(failures))
        print(f"missing or out of range: {failed} (bash scripts/gpu_wheels.sh downloads the carried ones)")
        return 1
    print("every requirement the checks need is met")
    return 0


def _machine() -> int:
    """The ``machine`` command: this environment against gpu_machine.txt (the dry run's stand-in for the machine)."""
    machine = machine_packages()
    status = 0
    python = machine.pop("python", None)
    if python and platform.python_version_tuple()[:2] != tuple(python.split(".")[:2]):
        print(f"python {platform.python_version()} here, {python} there")
        status = 1
    for name, version in sorted(machine.items()):
        here = installed_version(name)
        if version is not None and here is not None and Version(here) != Version(version):
            print(f"  {name}: {here} here, {version} there")
            status = 1
        elif version is not None and here is None:
            print(f"  {name}: missing here, {version} there")
            status = 1
    extra = sorted(
        {canonicalize_name(dist.metadata["Name"]) for dist in importlib.metadata.distributions()}
        - set(machine)
        - {"pip", "lightning-zenflow"}
        - set(carried_wheels())
    )
    if extra:
        print(f"  installed here, not named in gpu_machine.txt (dependencies its list leaves out): {', '.join(extra)}")
    print("the pinned versions match" if status == 0 else "the pinned versions differ")
    return status


def _needed() -> int:
    """The ``needed`` command: the packages to carry, each with what pulled it in."""
    requirements = [requirement for _, requirement in project_requirements()]
    needed, unknown = needed_beyond_machine(machine_packages(), requirements)
    for name, parents in sorted(needed.items()):
        print(f"{name}: {'; '.join(parents)}")
    if unknown:
        print(f"not installed here, their dependencies not followed: {', '.join(unknown)}")
        return 1
    return 0


def main(argv: list[str]) -> int:
    commands = {"found": _found, "machine": _machine, "needed": _needed}
    if len(argv) != 1 or argv[0] not in commands:
        print(__doc__.split("::", 1)[1].split("Standard library", 1)[0].rstrip(), file=sys.stderr)
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
