"""Stochastic rounding to bf16 with reproducible random numbers, in plain float arithmetic.

The compact host state (``host_state="bf16"``) keeps the window's gradient sum and the second moment in bf16. A value
rounded to nearest loses every change below half a bf16 step (2**-9 relative): the second moment, whose per-update
change is ``1 - beta2`` (0.1 %) of itself, would stop moving. Rounding *stochastically* keeps the expectation: the
value rounds to the neighbour on the far side with the probability of its distance, so small changes survive on
average (Zamirai et al., arXiv 2010.06192; ``background/bf16_and_fusion.md``).

:func:`round_bf16` is written with float operations only (no bit reinterpretation, no bf16 round trip): the bf16
spacing ``d`` at ``|x|`` (a power of two) from Rump's "unit in the first place" (three multiplications and a
subtraction), then ``|x| + u * d`` floored to a multiple of ``d`` by adding and subtracting ``1.5 * 2**23 * d``
(after taking ``d / 2`` off: round-to-nearest becomes a floor), and the sign put back. The result lies on the bf16
grid, so its conversion is exact; it is the upper neighbour with the probability of the part cut off, so the
expectation is ``x`` (to fp32's own rounding of ``|x| + u * d``; across a power of two too, where a noisy value below
it would meet the finer grid). Every step is one IEEE operation: compiled (inductor, Triton) and eager give the same
bits, with no conversion for a compiler to drop (an earlier form's ``float -> bf16 -> float`` round trips were dropped
by inductor, which made the compiled rounding round-to-nearest) and nothing for it to contract (``engine/compiled.py``
builds with ``emulate_precision_casts``, which also turns FMA contraction off on Triton). About 12 vector operations
per element, against about 30 for the neighbour search it replaced (whose round trips cost a conversion each): the
host step went from 25 to 15 ms per 16 M elements on one core. Values of ``|x| >= 2**100`` (where the spacing's
product would overflow), infinities and NaN are rounded to nearest; bf16 subnormals too (their spacing is not
``2**-7`` of the unit in the first place).

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

_PHI = 2.0**23 + 1.0
"""Rump's constant for binary32: with ``q = phi * a``, ``|q - (1 - 2**-24) * q|`` is the unit in the first place of
``a`` (the power of two at or below it)."""
_ONE_MINUS_U = 1.0 - 2.0**-24
_BF16_SPACING = 2.0**-7
"""bf16 keeps 8 significant bits: its spacing is ``2**-7`` of the unit in the first place."""
_MAGIC = 1.5 * 2.0**23
"""``(y + M * d) - M * d`` rounds ``y`` to a multiple of ``d`` (``|y| < 2**22 * d``)."""
_LARGEST = 2.0**100
"""Above this the unit in the first place's product would overflow: such values (and inf, NaN) round to nearest."""
_MASK64 = (1 << 64) - 1
PURPOSE_ACCUMULATE = 1
"""The device's window sum (one rounding per step)."""
PURPOSE_EXP_AVG_SQ = 2
"""The host's second moment (one rounding per host update)."""
PURPOSE_EXP_AVG = 3
"""The host's first moment (one rounding per host update)."""


def round_bf16(value: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to bf16 with uniform numbers ``u`` in [0, 1) (broadcastable)."""
    magnitude = value.abs()
    q = magnitude * _PHI
    spacing = (q - q * _ONE_MINUS_U).abs() * _BF16_SPACING  # the bf16 spacing at |value|; 0 at 0
    magic = spacing * _MAGIC
    # floor(|value| + u * spacing) on the grid: round-to-nearest of a value half a spacing lower
    floored = ((magnitude + u * spacing - spacing * 0.5) + magic) - magic
    return torch.where(magnitude < _LARGEST, floored, magnitude).copysign(value).to(torch.bfloat16)


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
