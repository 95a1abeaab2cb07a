"""Native CPU kernels for the engine's elementwise work: the host worker's AdamW step over the compact state, and the
CPU stand-in's window sum, interim moves, statistics and landing, bit for bit equal to their eager torch definitions.

Why: the host step compiled by inductor ran at 0.4-0.6x of torch's fused AdamW although it moves less than half the
bytes (scalar loops for its bit casts); this library does it in AVX-512 or AVX2 (``zenflow_cpu.cpp``: its cost
model, and why its bits are eager torch's). It is built on first use with the machine's C++ compiler (``build.py``,
seconds, cached per user) and loaded with ``ctypes``.

    kernels = native_kernels()          # NativeKernels, or None (then native_unavailable() says why)
    kernels.adam_step_(grad2d, exp_avg2d, exp_avg_sq2d, row_r, col_r, scalars, stochastic)

``LIGHTNING_ZENFLOW_NATIVE=0`` turns the library off (callers run their eager functions, silently);
``LIGHTNING_ZENFLOW_NATIVE_ISA`` forces a variant (``portable``, ``avx2``, ``avx512``, ``avx512_bf16``). A missing
compiler or a failed build is said once (a :class:`~lightning_zenflow.engine.notices.ZenFlowNotice`) with the reason
and the fix, and callers fall back to the eager functions (the same numbers, slower).
"""

from __future__ import annotations

import ctypes
import os
import threading

from lightning_zenflow.engine.notices import notice_once
from lightning_zenflow.native.build import BuildError, ensure_built, find_compiler, library_path
from lightning_zenflow.native.wrappers import NativeArgumentError, NativeKernels, declare

__all__ = [
    "NATIVE_ENV",
    "VARIANT_ENV",
    "VARIANTS",
    "NativeArgumentError",
    "NativeKernels",
    "native_built",
    "native_kernels",
    "native_unavailable",
    "supported_variants",
]

NATIVE_ENV = "LIGHTNING_ZENFLOW_NATIVE"
"""``0`` (or ``false``, ``off``): no native kernels; the engine runs its eager ones."""
VARIANT_ENV = "LIGHTNING_ZENFLOW_NATIVE_ISA"
"""Forces the instruction-set variant of every call (tests and comparisons); unset: the best this machine runs."""
VARIANTS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
"""The library's variants (``ZF_VARIANT`` in ``zenflow_cpu.cpp``), from the most portable to the fastest."""
_SILENCE = "LIGHTNING_ZENFLOW_NATIVE=0 chooses the eager kernels without this notice."
_NO_COMPILER = "no C++ compiler was found (CXX, g++, c++, clang++)"
_FIXES = {
    _NO_COMPILER: "Install one (e.g. apt-get install g++) or point CXX at one; " + _SILENCE,
    "build": "Please report the compiler's output above with its --version; " + _SILENCE,
}

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str | None, object, float | None] | None = None
"""``(library, reason it is missing, path, seconds this process spent building)`` once loaded or failed."""
_by_variant: dict[str, NativeKernels] = {}
"""Per variant name (and ``"best"``), the one object handed out."""


def _disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "off", "no")


def _load() -> tuple[ctypes.CDLL | None, str | None, object, float | None]:
    """Build (or find) and load the library once per process; a failure is kept, with its reason."""
    global _loaded
    with _lock:  # one thread builds and loads; the lanes that call at the same time wait for it
        if _loaded is None:
            compiler = find_compiler()
            if compiler is None:
                _loaded = (None, _NO_COMPILER, None, None)
            else:
                try:
                    path, seconds = ensure_built(compiler)
                except BuildError as error:
                    _loaded = (None, f"their build with {compiler} failed: {error}", None, None)
                    return _loaded
                try:
                    library = ctypes.CDLL(str(path))
                    declare(library)
                except (OSError, AttributeError) as error:  # a damaged cache entry: removing it rebuilds
                    _loaded = (None, f"loading {path} failed ({error}); delete {path.parent} to rebuild", None, None)
                    return _loaded
                _loaded = (library, None, path, seconds)
        return _loaded


def native_unavailable() -> str | None:
    """Why :func:`native_kernels` returns None (the switch, the compiler, the build), or None when it does not."""
    if _disabled():
        return f"{NATIVE_ENV}=0 turned them off"
    return _load()[1]


def native_built() -> bool:
    """Whether :func:`native_kernels` would hand out the kernels without building them: loaded in this process, or
    built in the cache by an earlier one (and not switched off)."""
    if _disabled():
        return False
    if _loaded is not None:
        return _loaded[0] is not None
    compiler = find_compiler()
    return compiler is not None and library_path(compiler).is_file()


def supported_variants() -> tuple[str, ...]:
    """The variants this machine runs, most portable first (empty when the library is unavailable)."""
    library = None if _disabled() else _load()[0]
    if library is None:
        return ()
    return tuple(name for name, number in VARIANTS.items() if library.zf_variant_supported(number))


def native_kernels(variant: str | None = None) -> NativeKernels | None:
    """The native kernels (the best variant this machine runs, or ``variant``, or ``$LIGHTNING_ZENFLOW_NATIVE_ISA``),
    or None: switched off (silently), or no compiler or a failed build (said once, with the fix; the callers run
    their eager functions). The first call in a process builds or loads the library (seconds once per machine)."""
    if _disabled():
        return None
    library, reason, path, seconds = _load()
    if library is None:
        fix = _FIXES.get(reason, _FIXES["build"])
        notice_once(
            "native_kernels",
            f"the native CPU kernels are off because {reason}. The engine runs its eager kernels instead (the same "
            f"numbers, slower). {fix}",
        )
        return None
    wanted = variant or os.environ.get(VARIANT_ENV, "").strip().lower() or "best"
    kernels = _by_variant.get(wanted)
    if kernels is not None:
        return kernels  # the engine may ask at every setup: no ctypes call then
    supported = supported_variants()
    if wanted == "best":
        kernels = _by_variant["best"] = native_kernels(supported[-1])
        return kernels
    if wanted not in VARIANTS:
        raise ValueError(
            f"unknown native variant {wanted!r} (from {VARIANT_ENV} or the argument); one of {list(VARIANTS)}"
        )
    if wanted not in supported:
        raise ValueError(f"this machine does not run the native variant {wanted!r}; it runs {list(supported)}.")
    kernels = _by_variant[wanted] = NativeKernels(library, wanted, VARIANTS[wanted], path, seconds)
    return kernels


def _reset_for_tests() -> None:
    """Forget the loaded library (tests that build into a fresh cache or take the compiler away)."""
    global _loaded
    with _lock:
        _loaded = None
        _by_variant.clear()


def _set_limits(tile: int, parallel_min: int, sum_block: int, sum_span: int) -> None:
    """Tests: the elementwise tile and the size below which a call stays on its thread (no bits depend on them), and
    row_col_sums' block and span (its bits do: fixed by the shape otherwise). Defaults: 65536, 131072, 65536, 4096."""
    library = _load()[0]
    if library is not None:
        library.zf_set_limits(tile, parallel_min, sum_block, sum_span)
