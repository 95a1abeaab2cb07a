"""Build ``zenflow_cpu.cpp`` with this machine's C++ compiler on first use, and cache the library per user.

As DeepSpeed's op builder and prime-rl build their CPU Adam (``background/cpu_kernels.md``), but without torch's
headers or ``cpp_extension``: the library is plain C++ over raw pointers, loaded with ``ctypes``, so a build is a few
seconds of ``g++`` and nothing in it depends on the torch version.

The source is compiled once per instruction set (portable C++, AVX2, AVX-512, AVX-512 with BF16; x86 only for the
last three), each with its own ``-m`` flags and never ``-march=native``, and the objects are linked into one library
that picks the variant at run time: a cached library stays valid on whatever machine shares the cache. The cache key
hashes the source, the flags, the compiler's path and its ``--version``, and the machine's architecture; the library
lives in ``$LIGHTNING_ZENFLOW_CACHE_DIR`` (or ``$XDG_CACHE_HOME/lightning_zenflow``, ``~/.cache/lightning_zenflow``)
under ``native/<key>/``. Several processes may start at once (pytest-xdist, data-parallel ranks): one builds under a
file lock, into a temporary name renamed into place, and the others wait for the lock and load what it built.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE = Path(__file__).with_name("zenflow_cpu.cpp")
LIBRARY_NAME = "libzenflow_cpu.so"
CACHE_ENV = "LIGHTNING_ZENFLOW_CACHE_DIR"
COMMON_FLAGS = (
    "-O2",  # the kernels are written in intrinsics: -O3 only vectorised their scalar tails, for 40 % more build time
    "-std=c++17",
    "-ffp-contract=off",  # no fused multiply-add: eager torch rounds each product
    "-fno-math-errno",  # sqrtf is the instruction (correctly rounded), not a libm call
    "-fPIC",
    "-fvisibility=hidden",
    "-pthread",
)
X86_VARIANTS = {
    1: ("-mavx2",),
    2: ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    3: ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
}
"""Variant number (``ZF_VARIANT`` in the source) to its flags; variant 0, the portable one, takes none."""


class BuildError(RuntimeError):
    """The library could not be built here; the message says why and what to do."""


def find_compiler() -> str | None:
    """``$CXX`` when set, else ``g++``, ``c++`` or ``clang++`` on ``PATH``: its path, or None."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_root() -> Path:
    """Where built libraries are kept (per user; a shared cache would need a lock its users all honour)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lightning_zenflow"


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def variants() -> dict[int, tuple[str, ...]]:
    """The objects to build on this architecture."""
    return {0: (), **(X86_VARIANTS if is_x86() else {})}


def cache_key(compiler: str) -> str:
    """The library's identity: the source, the flags, the compiler (path and version) and the architecture."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"the C++ compiler {compiler} does not run ({error})") from error
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr(COMMON_FLAGS), repr(variants()), compiler, version, platform.machine()):
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def library_path(compiler: str) -> Path:
    return cache_root() / "native" / cache_key(compiler) / LIBRARY_NAME


def ensure_built(compiler: str) -> tuple[Path, float | None]:
    """The cached library's path, building it first if no process has: ``(path, seconds this process spent
    building)``, None when it was found built (also after waiting for another process's build)."""
    path = library_path(compiler)
    if path.is_file():
        return path, None
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BuildError(
            f"cannot create the kernel cache {directory} ({error}); set {CACHE_ENV} to a writable directory"
        ) from error
    with _locked(directory / "build.lock"):  # file lock: waits while another process builds this key
        if path.is_file():
            return path, None
        started = time.perf_counter()
        _build(compiler, directory, path)
        return path, time.perf_counter() - started


def _build(compiler: str, directory: Path, path: Path) -> None:
    """Compile the variants side by side (each a separate ``g++``), link, and rename the library into place."""
    with tempfile.TemporaryDirectory(dir=directory, prefix="build-") as scratch:
        jobs = []
        for number, flags in variants().items():
            defines = [f"-DZF_VARIANT={number}"] + (["-DZF_WITH_X86_VARIANTS"] if number == 0 and is_x86() else [])
            obj = Path(scratch) / f"variant{number}.o"
            jobs.append(([compiler, *COMMON_FLAGS, *defines, *flags, "-c", str(SOURCE), "-o", str(obj)], obj))
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            for _ in pool.map(lambda job: _run(job[0]), jobs):
                pass
        built = Path(scratch) / LIBRARY_NAME
        _run([compiler, "-shared", "-pthread", *(str(obj) for _, obj in jobs), "-o", str(built)])
        os.replace(built, path)  # atomic: a reader sees no library or the whole one


def _run(command: Sequence[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"{command[0]} failed to run ({error})") from error
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise BuildError(f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}")


class _locked:
    """An exclusive ``flock`` on ``path`` for the ``with`` block (released by the kernel if the process dies)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.descriptor = -1

    def __enter__(self) -> None:
        import fcntl

        self.descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.descriptor, fcntl.LOCK_EX)  # blocks while another process builds

    def __exit__(self, *exc: object) -> None:
        import fcntl

        fcntl.flock(self.descriptor, fcntl.LOCK_UN)
        os.close(self.descriptor)
