"""Compiled kernels that are built before they run, on the thread that owns them, and never compile where they run.

``torch.compile`` compiles at the first call of a function and again whenever a guard fails. Both are wrong for the
engine's lanes. A lane is a thread on the CPU (``engine/lanes.py``) whose work overlaps the next forward, and dynamo
saves and restores the process's torch RNG state and default dtype around a compile (``preserve_global_state`` in
``torch/_dynamo/convert_frame.py``): a compile on a lane thread that spans the forward rewinds the RNG that dropout
draws from, and under ``precision="bf16-true"`` (which sets the default dtype to bf16 during the forward) every lane
call fails dynamo's guard on the default dtype, compiles again, and its restore leaves bf16 as the default. A run's
numbers then depended on thread timing.

So a kernel is built *ahead of time* (dynamo's ``aot_compile_fullgraph``: ``torch.compile(...).aot_compile`` where
torch has it, called directly on torch 2.11, whose ``torch.compile`` does not expose it):
:meth:`CompiledFunction.prepare` runs on the owning thread (the training thread, or the host worker's builder) with
the arguments the lane will pass, and returns at once when an equivalent build exists. A call, on any thread, runs the
build whose guards accept the arguments (dtypes, ranks, contiguity), or else the eager function: it never compiles.
The guards on process-wide state that a lane cannot control and the kernels do not read (the default dtype, grad
mode) are dropped; every call runs under ``no_grad``.

Each build is made from stand-in arguments of the same dtypes and ranks with generic sizes (every distinct size of
the real arguments mapped to a distinct size of at least 2048, duck sizing off), so one build serves every matrix of
a model. Which build (or eager) a call runs is therefore a function of its arguments and of the builds prepared so far
for that kind of call, which the engine prepares in program order on the training thread: never of timing.

The kernels themselves are built to eager's numerics: ``emulate_precision_casts`` (without it inductor drops a ``float
-> bf16 -> float`` round trip and lets the C++ or Triton compiler contract ``a * b + c`` into an FMA), Triton's
division rounded as IEEE's (``eager_numerics.division_rounding``: Triton's ``/`` is an approximate division, one ulp
off eager's in places) and subnormals kept (``eager_numerics.disable_ftz``). With these, every elementwise kernel gives
the eager function's bits (``tests/test_kernels.py`` on the CPU, ``tests/test_gpu.py`` on CUDA), so an eager fallback
changes no number. And nothing is timed at a kernel's first call, which on CUDA would run inside a lane (a
synchronisation, a flush buffer and a clone of the arguments, none of it budgeted) and, for a reduction, choose the
summation order by timing: pointwise kernels are built with one launch configuration
(``triton.autotune_pointwise=False``) and reductions with the one inductor picks without benchmarking
(``deterministic``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zenflow.engine.notices import notice_once

DROPPED_GUARDS = ("GLOBAL_STATE", "GRAD_MODE")
"""Guards a build does without: process-wide state (default dtype, grad mode, ...) that the kernels never read."""
GENERIC_SIZE = 2048
"""Stand-in sizes start here. A build takes its choices from the stand-ins' sizes (inductor parallelises a CPU loop
over threads only above a size, measured: a host step built on 64 x 71 stand-ins ran 1.45x slower on 16 M elements
with 2 threads than one built on 2048 x 2055), and they are above every size a kernel branches on."""


@functools.cache
def aot_available() -> str | None:
    """Why ahead-of-time builds are unavailable in this torch, or None."""
    if hasattr(torch.compile(lambda: None), "aot_compile"):
        return None
    try:
        from torch._dynamo.aot_compile import aot_compile_fullgraph  # noqa: F401
        from torch._dynamo.hooks import Hooks  # noqa: F401
    except ImportError:
        return (
            f"torch {torch.__version__} has no ahead-of-time build (torch.compile(...).aot_compile, or "
            "torch._dynamo.aot_compile.aot_compile_fullgraph: torch >= 2.11 has them)"
        )
    return None


BUILD_OPTIONS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
    "triton.autotune_pointwise": False,
    "deterministic": True,
    "compile_threads": 1,
}
"""Inductor's options for every build (the module docstring says why); an option this torch lacks is left out."""


def build_options() -> dict[str, object]:
    """:data:`BUILD_OPTIONS` that this torch's inductor knows."""
    import torch._inductor.config as inductor_config

    known = {}
    for key, value in BUILD_OPTIONS.items():
        owner = inductor_config
        *path, last = key.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, last):
            known[key] = value
    return known


def _keep_guard(entries: Any) -> list[bool]:
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return [
        not (entry.is_global or entry.guard_type in unsupported or entry.guard_type in DROPPED_GUARDS)
        for entry in entries
    ]


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """The torch RNG states and the default dtype as they were, whatever the block does (dynamo restores them too,
    on its own thread; this says so where the engine builds)."""
    dtype = torch.get_default_dtype()
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def kind_of(args: tuple) -> tuple:
    """What a build depends on besides sizes: per argument its dtype, device and rank, or its type (a bool's value)."""
    kind = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            kind.append((arg.dtype, arg.device.type, arg.dim()))
        elif isinstance(arg, bool) or arg is None:
            kind.append(arg)
        else:
            kind.append(type(arg))
    return tuple(kind)


def _kind_now(args: tuple) -> tuple:
    """The kind of a call and, for a CPU call, torch's thread count: a CPU build takes its parallel loops from the
    thread count of its moment (one built with one thread runs on one), so another count needs a build of its own. A
    CUDA build does not depend on it."""
    on_cpu = any(isinstance(arg, torch.Tensor) and arg.device.type == "cpu" for arg in args)
    return (kind_of(args), torch.get_num_threads() if on_cpu else None)


def stand_ins(args: tuple) -> tuple:
    """Arguments like ``args`` with generic sizes: equal sizes stay equal (a row table has the matrix's rows),
    distinct sizes stay distinct; contiguous fresh tensors; ints other than 0 and 1 (which dynamo would specialise
    on)."""
    sizes: dict[int, int] = {}
    out = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            shape = [sizes.setdefault(size, GENERIC_SIZE + 7 * len(sizes)) for size in arg.shape]
            # never written nor read (a build traces fake copies): on the CPU no page of it becomes resident
            out.append(torch.empty(shape, dtype=arg.dtype, device=arg.device))
        elif isinstance(arg, int) and not isinstance(arg, bool):
            out.append(arg if arg > 1 else 5)
        else:
            out.append(arg)
    return tuple(out)


@dataclass
class BuildLog:
    """What the builds of one process cost (the start-up table of ``docs/performance.md`` reads it)."""

    builds: list[tuple[str, float]] = field(default_factory=list)
    """``(kernel name, seconds)`` of every build, in order."""
    failures: list[str] = field(default_factory=list)


BUILD_LOG = BuildLog()
_REGISTRY: dict[tuple, Any] = {}
"""Every build of this process, by kernel and kind: engines share them (a second fit builds nothing)."""
_REGISTRY_LOCK = threading.Lock()


def _build(fn: Callable, args: tuple) -> Any:
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    # under no_grad, as every call runs; the compile's own save and restore of the RNG and the default dtype happen
    # on this (the owning) thread, with no other work of this engine in between
    with (
        torch.no_grad(),
        process_state_kept(),
        # compile_threads=1: no pool of compile processes (and their semaphores) outliving the build
        inductor_config.patch(build_options()),
        # sizes may be 1 (a row block of one row, a rank's single row): no specialisation on 0 and 1
        fx_config.patch(use_duck_shape=False, backed_size_oblivious=True),
    ):
        example = (stand_ins(args), {})
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, options={"guard_filter_fn": _keep_guard})
        if hasattr(compiled, "aot_compile"):
            return compiled.aot_compile(example)
        # torch 2.11: the same build, through the function torch.compile(...).aot_compile calls in later releases
        from torch._dynamo.aot_compile import aot_compile_fullgraph
        from torch._dynamo.hooks import Hooks

        backend = torch._TorchCompileInductorWrapper(None, None, True)
        return aot_compile_fullgraph(
            fn, example, hooks=Hooks(guard_filter_fn=_keep_guard), backend=backend, dynamic=True
        )


class CompiledFunction:
    """One kernel function as an engine runs it: its builds (one per kind of call) and the eager function.

    ``owner``: the thread that may build (``prepare``, or a call that finds no build of its kind). Calls on other
    threads run eagerly when no build fits. A ``strict`` kernel (a reduction: its eager and compiled sums differ in
    rounding) raises when a call comes before any build of its kind was prepared, since when that build would have
    been made depends on timing; a call whose shape the build does not accept runs eagerly, always the same way.
    ``owner=None``: any thread builds (a process with one thread that calls)."""

    def __init__(
        self,
        fn: Callable,
        owner: int | None,
        strict: bool = False,
        on_build: Callable | None = None,
        required: bool = False,
    ) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.owner = owner
        self.strict = strict
        self.required = required
        """Asked for by name (``interim_kernel="compiled"``): a failed build is raised, not run eagerly."""
        self.on_build = on_build
        self._builds: dict[tuple, Any] = {}
        """This engine's builds by kind: only these run, so a call's choice never depends on another engine's."""
        self._fits: dict[tuple, Any] = {}
        """Per exact argument metadata: the build that accepts it, or None (eager)."""
        self.broken = False
        self.eager_calls = 0
        """Calls that ran eagerly for want of a build that fits (a shape the builds do not cover, or none built)."""

    @property
    def kinds_built(self) -> int:
        """How many kinds of call this engine has a build for."""
        return len(self._builds)

    # ------------------------------------------------------------------------------------------ building
    def prepare(self, *args: object) -> None:
        """Make sure a build exists for the kind of ``args`` (on the owning thread; a no-op when it exists)."""
        kind = _kind_now(args)
        if kind in self._builds or self.broken:
            return
        if self.owner is not None and threading.get_ident() != self.owner:
            raise RuntimeError(f"internal error: {self.name} prepared on a thread that does not own its builds.")
        key = (self.fn.__module__, self.fn.__qualname__, kind)
        with _REGISTRY_LOCK:
            built = _REGISTRY.get(key)
        if built is None:
            if self.on_build is not None:
                self.on_build(self.name)
            started = time.perf_counter()
            try:
                built = _build(self.fn, args)
            except Exception as error:  # noqa: BLE001 - any build failure: this kernel runs eagerly
                if self.required:
                    raise
                self._fail(error)
                return
            BUILD_LOG.builds.append((self.name, time.perf_counter() - started))
            with _REGISTRY_LOCK:
                built = _REGISTRY.setdefault(key, built)
        self._builds[kind] = built

    def _fail(self, error: Exception) -> None:
        self.broken = True
        BUILD_LOG.failures.append(f"{self.name}: {type(error).__name__}: {error}")
        notice_once(
            f"build_failed:{self.name}",
            f"torch.compile could not build {self.name} ({type(error).__name__}: {str(error)[:300]}); it runs eagerly "
            "(the same numbers, several passes instead of one). Set interim_kernel='eager' to skip the attempt.",
        )

    # ------------------------------------------------------------------------------------------ running
    def _fitting(self, args: tuple) -> Any:
        meta = (torch.get_num_threads(),) + tuple(
            (a.dtype, a.device, a.shape, a.stride(), a.storage_offset())
            if isinstance(a, torch.Tensor)
            else (type(a), a if a is None or isinstance(a, bool) or (isinstance(a, int) and a < 2) else None)
            for a in args
        )
        if meta in self._fits:
            return self._fits[meta]
        built = self._builds.get(_kind_now(args))
        if built is None:
            return None  # not remembered: a build of this kind may still come (a worker builds on a thread)
        fit = built if built.guard_check(*args) else None
        self._fits[meta] = fit
        return fit

    def __call__(self, *args: object) -> object:
        if (self.owner is None or threading.get_ident() == self.owner) and not self.broken:
            self.prepare(*args)
        fit = self._fitting(args) if self._builds else None
        with torch.no_grad():
            if fit is not None:
                return fit.fn(*args)
            if self.strict and not self.broken and _kind_now(args) not in self._builds:
                # a build of this kind would have been prepared later, at a point that depends on timing
                raise RuntimeError(
                    f"internal error: {self.name} runs before its build was prepared, and its eager sums round "
                    "differently; prepare it on the owning thread before the call is issued."
                )
            self.eager_calls += 1
            return self.fn(*args)
