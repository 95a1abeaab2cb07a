"""Stochastic rounding to bf16 with reproducible random numbers, in plain float arithmetic.

The compact host state (``host_state="bf16"``) keeps the window's gradient sum and the second moment in bf16. A value
rounded to nearest loses every change below half a bf16 step (2**-9 relative): the second moment, whose per-update
change is ``1 - beta2`` (0.1 %) of itself, would stop moving. Rounding *stochastically* keeps the expectation: the
value rounds to the neighbour on the far side with the probability of its distance, so small changes survive on
average (Zamirai et al., arXiv 2010.06192; ``background/bf16_and_fusion.md``).

:func:`round_bf16` is written with float operations only (no bit reinterpretation): the nearest bf16 value ``n``,
the residual ``r = x - n``, and the neighbour on the residual's side, found by rounding ``n +- 0.55 * 2**-7 * |n|``
(between 0.55 and 1.1 bf16 steps away, so it lands on the adjacent value in every binade, across a power of two
included). The result is the neighbour when ``u * |neighbour - n| < |r|``: probability ``|r| / step``, expectation
``x``. Float-only code vectorises on every backend that ``torch.compile`` targets (a bit cast does not on the C++
backend of the CPU, where it is about three times slower) and runs eagerly unchanged. It relies on the round trip
``float -> bf16 -> float`` being kept: inductor drops such pairs unless ``emulate_precision_casts`` is on (its
compiled rounding was then round-to-nearest), so the engine builds its kernels with it on (``engine/compiled.py``),
and compiled and eager give the same bits.

The uniform numbers are a lattice: ``u = frac(row_u[i] + col_u[j] + offset)``, where ``row_u`` and ``col_u`` are
fixed per matrix (a hash of the matrix's salt, :func:`salt_of`, and the *global* row or column index, so every rank
and every shard of a matrix draws the same numbers) and ``offset`` is a hash of the salt, the purpose and the step.
For one element, ``u`` over the steps is uniform and independent from step to step (the offsets are), which is
what keeps each element's expectation; within a step the elements share ``offset``. Nothing depends on timing or on the
backend: the same numbers on a CPU and a GPU, eager and compiled, after a resume.
"""

from __future__ import annotations

import zlib

import torch

_NEIGHBOUR = 0.55 * 2.0**-7
"""Relative distance that reaches the adjacent bf16 value from a bf16 value (see the module docstring)."""
_MASK64 = (1 << 64) - 1
PURPOSE_ACCUMULATE = 1
"""The device's window sum (one rounding per step)."""
PURPOSE_EXP_AVG_SQ = 2
"""The host's second moment (one rounding per host update)."""
PURPOSE_EXP_AVG = 3
"""The host's first moment (one rounding per host update)."""


def round_bf16(value: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to bf16 with uniform numbers ``u`` in [0, 1) (broadcastable)."""
    nearest = value.to(torch.bfloat16).float()
    residual = value - nearest
    # towards the residual's side (an exact zero residual counts as positive); a ``where`` between two Python floats
    # here stopped ahead-of-time builds (their scalar analysis cannot restart)
    neighbour = (nearest + (nearest.abs() * _NEIGHBOUR).copysign(residual)).to(torch.bfloat16).float()
    far = u * (neighbour - nearest).abs() < residual.abs()
    return torch.where(far, neighbour, nearest).to(torch.bfloat16)


def lattice(row_u: torch.Tensor, col_u: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``u[i, j] = frac(row_u[i] + col_u[j] + offset)``: ``[rows, cols]`` uniform numbers from ``[rows]`` and
    ``[cols]`` tables and a 0-d offset."""
    total = row_u[:, None] + col_u[None, :] + offset
    return total - total.floor()


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (64-bit wrap-around)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def unit(*parts: int) -> float:
    """A number in [0, 1) from integers (a salt, a purpose, a step): 24 bits of a hash, exact in fp32."""
    x = 0
    for part in parts:
        x = _mix((x ^ (int(part) & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64)
    return (x >> 40) / float(1 << 24)


def unit_table(salt: int, start: int, count: int) -> torch.Tensor:
    """``[count]`` fp32 numbers in [0, 1): :func:`unit` of ``(salt, index)`` for the indices ``start ...``, on the
    CPU. Built once per matrix (O(rows + columns))."""
    index = torch.arange(start, start + count, dtype=torch.int64)
    # the same hash as unit(salt, index), vectorised in int64 (torch's integer arithmetic wraps on overflow)
    x = _mix_tensor(torch.full_like(index, _signed((0 ^ salt) + 0x9E3779B97F4A7C15 & _MASK64)))
    x = _mix_tensor(_wrap_add(x ^ index, 0x9E3779B97F4A7C15))
    return (_shift_right(x, 40).double() / float(1 << 24)).float()


def salt_of(group_index: int, index_in_group: int) -> int:
    """A matrix's salt, from its place among the optimizer's matrices (param group, position among the group's
    matrices): two matrices never draw the same numbers, and an optimizer built from ``named_parameters()`` draws what
    one built from ``parameters()`` draws."""
    return zlib.crc32(f"{group_index}:{index_in_group}".encode())


def offset_of(salt: int, purpose: int, step: int) -> float:
    """The lattice offset of one rounding: of this matrix, for this purpose, at this step (or host update)."""
    return unit(salt, purpose, step)


# ------------------------------------------------------------------------------- int64 helpers for unit_table
def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (``>>`` is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _wrap_add(x: torch.Tensor, constant: int) -> torch.Tensor:
    return x + _signed(constant & _MASK64)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)
