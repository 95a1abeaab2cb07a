"""The engine's elementwise kernels (the interim moves, their statistics, the landing, the window's sum), written
once in plain torch ops: the definition of their numbers.

They run fused where a compiler is found: on CUDA ``torch.compile`` turns each function into one Triton kernel, built
ahead of time (``engine/compiled.py``); on a CPU (the stand-in for the device) ``lightning_zenflow/native``'s C++
kernels, bit for bit the eager functions' (the statistics' sums aside: they add in another order). Without a compiler
the functions run eagerly, slower and with temporaries, to the same rule. Cost model, per element of a matrix
(``docs/performance.md``):

- :func:`moves_fp32_`: reads the gradient and the weight, writes the weight: 12 B (fp32), 6 B (bf16 gradient and
  weight, :func:`moves_bf16_`). No temporaries, no gather: host columns are a mask over the whole matrix (the
  selected columns get a zero move and are restored from their device masters anyway).
- :func:`row_col_sums`: reads the gradient once (4 B fp32, 2 B bf16), once per window (``engine/interim.py``).
- :func:`landing_add_`: a landing under interim moves, ``w <- w * scale + step``: reads both, writes the weight.

bf16 weights are written with stochastic rounding: the fp32 result's low 16 bits get a random 16-bit number added
before they are cut, so the weight rounds up with a probability equal to the part cut off, and its expectation is
the fp32 value. A move below half a bf16 step would otherwise vanish every time (rounding to nearest). The random
bits are a hash of the element's global row and column and a seed that the caller derives from the run's position (a
matrix's move count, a landing's step), so they are the same in eager and compiled code, on every device, after a
resume, and under FSDP2's row shards.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections.abc import Callable
from typing import Literal

import torch

from lightning_zenflow.engine.compiled import CompiledFunction, aot_available
from lightning_zenflow.engine.cuda_guard import keep_cuda_guard
from lightning_zenflow.engine.notices import notice_once
from lightning_zenflow.engine.rounding import lattice_bits, round_bf16

KERNELS_ENV = "LIGHTNING_ZENFLOW_KERNELS"
"""Overrides ``interim_kernel="auto"``: ``eager``, ``compiled`` (native C++ on a CPU, Triton on CUDA) or ``inductor``
(``torch.compile`` on a CPU too: the CUDA path's way of building, for its tests). The test suite runs eager by
default."""
KERNEL_OVERRIDES = ("compiled", "eager", "inductor")
KERNEL_MODES = ("auto", "compiled", "eager")
_ROW_MULTIPLIER = 0x2C1B3C6D
_COL_MULTIPLIER = 0x297A2D39
_MIX_MULTIPLIER = 0x5BD1E995


# ---------------------------------------------------------------------------------------------- the functions
def row_col_sums(grad2d: torch.Tensor, host_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of the squared gradient over the host columns: per row ``[rows]`` and per column ``[cols]`` (zero in
    the columns that are not host-bound), fp32, from one read of the gradient (one fused reduction when compiled: a GPU
    reduces columns with coalesced loads; the CPU runs ``lightning_zenflow/native``'s)."""
    squared = grad2d.float().square() * host_mask
    return squared.sum(1), squared.sum(0)


def _bounded_move(
    grad2d: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    host_mask: torch.Tensor,
    eps: float,
    coefficient: float,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    """``-coefficient * clip(g / (row_scale_i * col_scale_j + eps), -1, 1)`` on the host columns, 0 elsewhere."""
    ratio = grad2d.float() / (row_scale[:, None] * col_scale[None, :] + eps)
    # the sign on the tensor, not on the float: torch <= 2.11's dynamo specializes ``-coefficient`` (one graph per
    # learning rate); negation is exact, so the move has the same bits either way
    move = ratio.clamp(-1.0, 1.0) * (host_mask * coefficient).neg()[None, :]
    if keep is not None:
        move = move * keep
    return move


def moves_fp32_(
    grad2d: torch.Tensor,
    weight2d: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    host_mask: torch.Tensor,
    eps: float,
    coefficient: float,
    keep: torch.Tensor | None,
) -> None:
    """The move of one step, added to fp32 weights in place."""
    weight2d.add_(_bounded_move(grad2d, row_scale, col_scale, host_mask, eps, coefficient, keep))


def _random_low_bits(shape: tuple[int, int], row_offset: int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """16 random bits per element (int32): a hash of the element's global row and column and ``seed`` (a scalar
    below 2**31). int32 arithmetic that wraps on overflow, as torch's integer ops do on every backend (64-bit
    products cost twice as much on a CPU without 64-bit vector multiplies); ``>>`` is arithmetic on int32, so each
    shift is masked to act as a logical one."""
    rows, cols = shape
    row = torch.arange(rows, device=device, dtype=torch.int32) + row_offset
    col = torch.arange(cols, device=device, dtype=torch.int32)
    x = row[:, None] * _ROW_MULTIPLIER + col[None, :] * _COL_MULTIPLIER + seed.to(torch.int32)
    x = (x ^ ((x >> 15) & 0x1FFFF)) * _MIX_MULTIPLIER
    x = (x ^ ((x >> 13) & 0x7FFFF)) * _COL_MULTIPLIER
    return (x ^ ((x >> 16) & 0xFFFF)) & 0xFFFF


def stochastic_round_bf16(value: torch.Tensor, row_offset: int, seed: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, cols]`` to bf16, rounded up with the probability of the part cut off (expectation kept): the
    rounding of ``engine/rounding.py`` with the random bits of the element's global row and column."""
    return round_bf16(value, _random_low_bits(value.shape, row_offset, seed, value.device))


def moves_bf16_(
    grad2d: torch.Tensor,
    weight2d: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    host_mask: torch.Tensor,
    eps: float,
    coefficient: float,
    keep: torch.Tensor | None,
    row_offset: int,
    seed: torch.Tensor,
) -> None:
    """The move of one step, added to bf16 weights in place with stochastic rounding. The selected columns (zero
    move) keep their bits: a bf16 value in fp32 has zero low bits, and the cut removes what the random bits add."""
    moved = weight2d.float() + _bounded_move(grad2d, row_scale, col_scale, host_mask, eps, coefficient, keep)
    weight2d.copy_(stochastic_round_bf16(moved, row_offset, seed))


def landing_add_(
    weight2d: torch.Tensor, step2d: torch.Tensor, scale: float, row_offset: int, seed: torch.Tensor
) -> None:
    """A landing under interim moves, ``w <- w * scale + step`` in place; bf16 weights are rounded stochastically."""
    landed = weight2d.float() * scale + step2d.float()
    if weight2d.dtype == torch.bfloat16:
        weight2d.copy_(stochastic_round_bf16(landed, row_offset, seed))
    else:
        weight2d.copy_(landed)


def accumulate_bf16_(
    acc2d: torch.Tensor,
    grad2d: torch.Tensor,
    row_r: torch.Tensor,
    col_r: torch.Tensor,
    offset: torch.Tensor,
    first: bool,
) -> None:
    """The compact state's window sum on the device: ``acc <- round(acc + g)`` (``first``: ``round(g)``), bf16 with
    stochastic rounding (``engine/rounding.py``: the lattice of ``row_r`` and ``col_r`` and the step's ``offset``, a
    0-d int32). Reads the gradient and the bf16 sum and writes the sum: 4 + b B per element (b: the gradient's
    bytes)."""
    total = grad2d.float() if first else acc2d.float() + grad2d.float()
    acc2d.copy_(round_bf16(total, lattice_bits(row_r, col_r, offset)))


# --------------------------------------------------------------------------------------------- compilation
def compiler_missing(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` here, or None when it can."""
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - every torch with CUDA has it
            return "torch.utils._triton is missing"
        return None if has_triton() else "Triton is not installed (pip install triton)"
    if device.type == "cpu":
        import torch._inductor.config as inductor_config

        candidates = inductor_config.cpp.cxx
        names = [c for c in (candidates if isinstance(candidates, tuple) else (candidates,)) if c]
        if any(shutil.which(name) for name in names) or os.environ.get("CXX") and shutil.which(os.environ["CXX"]):
            return None
        return "no C++ compiler on PATH (install g++, e.g. apt-get install g++)"
    return f"torch.compile has no backend for {device.type} here"


def resolve_kernel_mode(
    mode: str, device: torch.device, elements: int | None = None
) -> tuple[Literal["compiled", "eager"], str | None]:
    """``interim_kernel`` as used: ``(mode, reason)``. ``"auto"`` takes ``LIGHTNING_ZENFLOW_KERNELS`` when set, else
    compiles where a compiler is found and the matrices are large enough to repay the builds (``elements``, see
    :data:`AUTO_COMPILE_MIN_ELEMENTS`; the reason for eager where no compiler is found); ``"compiled"`` without one is
    refused."""
    if mode == "auto":
        override = kernel_override()
        mode = "compiled" if override == "inductor" else (override or "auto")
        if mode == "auto" and elements is not None and elements < AUTO_COMPILE_MIN_ELEMENTS:
            return "eager", None
    if mode == "eager":
        return "eager", None
    if device.type == "cpu" and kernel_override() != "inductor":
        missing = native_compiler_missing()
    else:
        missing = compiler_missing(device) or aot_available()
    if missing is None:
        return "compiled", None
    if mode == "compiled":
        from lightning_zenflow.engine.errors import UnsupportedSetupError

        how = "its C++ compiler" if device.type == "cpu" else "torch.compile"
        raise UnsupportedSetupError(
            f"interim_kernel='compiled' needs {how} on {device.type}, but {missing}. Install it, or set "
            "interim_kernel='eager' (the same rule, slower: about ten passes instead of one)."
        )
    return "eager", missing


def kernel_override() -> str | None:
    """``LIGHTNING_ZENFLOW_KERNELS`` (checked), or None when unset."""
    override = os.environ.get(KERNELS_ENV, "").strip().lower()
    if override and override not in KERNEL_OVERRIDES:
        raise ValueError(f"{KERNELS_ENV}={override!r} is not one of {list(KERNEL_OVERRIDES)}; unset it for the default")
    return override or None


def native_compiler_missing() -> str | None:
    """Why ``lightning_zenflow/native`` cannot be built here, or None."""
    from lightning_zenflow.native.build import find_compiler

    return None if find_compiler() is not None else "no C++ compiler on PATH (install g++, e.g. apt-get install g++)"


KERNEL_BUILD_NOTICE = (
    "building ZenFlow's fused kernels before their first use (the interim moves, the window's sum and the landing in "
    "the training process; the AdamW step in the host worker, which runs it eagerly until the build is ready): about "
    "1-3 s each with torch's compile cache warm, 5-20 s each with it empty; a process builds each kind once and later "
    "fits reuse them. interim_kernel='eager' skips the builds (the same numbers, several passes per step instead of "
    "one)."
)
AUTO_COMPILE_MIN_ELEMENTS = 1 << 22
"""``interim_kernel="auto"`` builds compiled kernels only when this rank's host-bound matrices hold at least this many
elements (4 M): below it the eager passes cost less per run than the builds (seconds) would save."""
_WARNED: set[str] = set()


class Kernels:
    """The functions above as used by one engine: built ahead of time and never compiled where they run
    (``engine/compiled.py``), or eager. On the CPU every elementwise kernel gives the eager function's bits, so a call
    that no build accepts (a matrix of one row) runs eagerly and changes no number; the statistics' sums
    (``row_col_sums``) round differently when compiled, so they are built before their first call is issued.

    ``elements``: the host-bound matrix elements of this rank, for ``"auto"``'s size rule; ``owner``: the thread that
    builds (by default the one creating this object)."""

    def __init__(
        self, mode: str, device: torch.device, elements: int | None = None, owner: int | None | bool = True
    ) -> None:
        self.requested = mode
        self.mode, reason = resolve_kernel_mode(mode, device, elements)
        self.native = None
        """``lightning_zenflow/native``'s kernels where they run this engine's (a CPU, compiled)."""
        if self.mode == "compiled" and device.type == "cpu" and kernel_override() != "inductor":
            self.native = _native_or_refuse(self.requested == "compiled")
            if self.native is None:
                self.mode = "eager"  # the library said once why (a failed build)
        self.threads = torch.get_num_threads()
        """The native kernels' threads: the training process's (set again once its cores are bound)."""
        self.native_fallbacks = 0
        """Native calls that ran eagerly for arguments the library does not take (rows that are not contiguous)."""
        if reason is not None and reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(
                f"lightning_zenflow: the interim moves run eagerly (about ten passes over each host gradient "
                f"instead of one) because {reason}. Install it for the fused kernels, or set interim_kernel='eager' "
                "to choose this knowingly.",
                stacklevel=3,
            )
        if self.mode == "compiled" and self.native is None:
            keep_cuda_guard()  # torch 2.11, no CUDA device: a build after a building thread ended crashed
        self.owner = threading.get_ident() if owner is True else (None if owner is False else owner)
        self.functions: list[CompiledFunction] = []
        self.row_col_sums = self.wrap(row_col_sums, strict=True)
        self.moves_fp32_ = self.wrap(moves_fp32_)
        self.moves_bf16_ = self.wrap(moves_bf16_)
        self.landing_add_ = self.wrap(landing_add_)
        self.accumulate_bf16_ = self.wrap(accumulate_bf16_)

    def wrap(self, fn: Callable, strict: bool = False) -> Callable:
        """``fn`` as this engine runs it: native (a CPU), built ahead of time (``engine/compiled.py``) or eager."""
        if self.mode == "eager":
            return fn
        if self.native is not None:
            return self._native_call(fn)
        compiled = CompiledFunction(
            fn, self.owner, strict=strict, on_build=_announce, required=self.requested == "compiled"
        )
        self.functions.append(compiled)
        return compiled

    def _native_call(self, fn: Callable) -> Callable:
        """``fn``'s native kernel with this engine's threads; eager for arguments the library does not take (the same
        bits for an elementwise kernel; for the statistics' sums, the same call is always the same path)."""
        from lightning_zenflow.native import NativeArgumentError

        native_fn = getattr(self.native, fn.__name__)

        def call(*args: object) -> object:
            try:
                return native_fn(*args, threads=self.threads)
            except NativeArgumentError:
                self.native_fallbacks += 1
                with torch.no_grad():
                    return fn(*args)

        call.__name__ = fn.__name__
        return call

    def native_or_eager(self, fn: Callable) -> Callable:
        """``fn``'s native kernel where this engine runs them (a CPU), else ``fn`` itself: for work that CUDA runs as
        torch ops, never built (the device update's column gather and write-back, ``engine/device.py``)."""
        return self._native_call(fn) if self.native is not None else fn

    @staticmethod
    def prepare(kernel: Callable, *args: object) -> None:
        """Build ``kernel`` for calls like ``kernel(*args)`` before such a call is issued to a lane (no-op eagerly)."""
        if isinstance(kernel, CompiledFunction):
            kernel.prepare(*args)

    def hand_builds_to(self, owner: int) -> None:
        """From now on only thread ``owner`` builds (the host worker's builder thread)."""
        self.owner = owner
        for function in self.functions:
            function.owner = owner

    @property
    def eager_calls(self) -> int:
        """Calls of a compiled kernel that ran eagerly because no build (or native kernel) accepted their arguments."""
        return sum(f.eager_calls for f in self.functions) + self.native_fallbacks


def _native_or_refuse(required: bool):  # noqa: ANN202 - NativeKernels | None, imported lazily
    """The native kernels, or None (their loader said why, once); ``required`` (``interim_kernel="compiled"``): a
    failed build is raised."""
    from lightning_zenflow.native import native_kernels, native_unavailable

    native = native_kernels()
    if native is None and required:
        from lightning_zenflow.engine.errors import UnsupportedSetupError

        raise UnsupportedSetupError(
            f"interim_kernel='compiled' runs lightning_zenflow's native kernels on a CPU, but {native_unavailable()}. "
            "Fix the build, or set interim_kernel='eager' (the same rule, slower)."
        )
    return native


def _announce(name: str) -> None:
    notice_once("kernel_build", KERNEL_BUILD_NOTICE)
