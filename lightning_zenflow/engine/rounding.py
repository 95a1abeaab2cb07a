"""Stochastic rounding to bf16 with reproducible random numbers, in integer arithmetic.

The compact host state (``host_state="bf16"``) keeps the window's gradient sum and the second moment in bf16. A value
rounded to nearest loses every change below half a bf16 step (2**-9 relative): the second moment, whose per-update
change is ``1 - beta2`` (0.1 %) of itself, would stop moving. Rounding *stochastically* keeps the expectation: the
value rounds to the neighbour on the far side with the probability of its distance, so small changes survive on
average (Zamirai et al., arXiv 2010.06192; ``background/bf16_and_fusion.md``).

:func:`round_bf16` adds a random 16-bit integer ``r`` to the fp32 bit pattern and cuts the low 16 bits: bf16 keeps the
high half of an fp32 pattern, so the cut value is the lower neighbour on the bf16 grid (towards zero) unless the
carry of ``pattern_low16 + r`` reaches bit 16, which happens with probability ``pattern_low16 / 2**16``: exactly the
part cut off. The expectation is the fp32 value, for every finite value, subnormals included (the bf16 subnormals are
the fp32 ones with zero low bits), across a power of two (the carry moves into the exponent), and for both signs (the
pattern holds the magnitude). Infinities have zero low bits and stay; a finite value within one bf16 step of the
largest one rounds up to infinity with the probability of its distance, as a rounding with a finer grid above would.
NaN stays NaN (its payload may sit in the low bits only, which the cut would turn into an infinity). Two integer
operations per element, the same bits on every backend: no floating-point operation a compiler could reorder or
contract.

The random numbers are a lattice: ``r[i, j] = (row_r[i] + col_r[j] + offset) mod 2**16``, where ``row_r`` and
``col_r`` are 16-bit numbers fixed per matrix (a hash of the matrix's salt, :func:`salt_of`, and the *global* row or
column index, so every rank and every shard of a matrix draws the same numbers) and ``offset`` is a 16-bit hash of the
salt, the purpose and the step. For one element, ``r`` over the steps is uniform on ``[0, 2**16)`` and independent
from step to step (the offsets are), which is what keeps each element's expectation; within a step the elements share
``offset``. Nothing depends on timing or on the backend: the same numbers on a CPU and a GPU, eager, compiled and
native (``lightning_zenflow/native``), after a resume.
"""

from __future__ import annotations

import zlib

import torch

_MASK64 = (1 << 64) - 1
PURPOSE_ACCUMULATE = 1
"""The device's window sum (one rounding per step)."""
PURPOSE_EXP_AVG_SQ = 2
"""The host's second moment (one rounding per host update)."""
PURPOSE_EXP_AVG = 3
"""The host's first moment (one rounding per host update)."""


def round_bf16(value: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded stochastically to bf16 with random 16-bit integers ``r`` (int32 in ``[0, 2**16)``,
    broadcastable): ``(pattern + r)`` with the low 16 bits cut; NaN stays NaN."""
    pattern = value.view(torch.int32) + r
    # int32 arithmetic: a negative value's pattern is a negative int32 whose low bits hold the magnitude's; the sum
    # wraps only for NaN patterns, which the where() below keeps as they are
    cut = (pattern & -65536).view(torch.float32)
    return torch.where(value.isnan(), value, cut).to(torch.bfloat16)


def lattice_bits(row_r: torch.Tensor, col_r: torch.Tensor, offset: torch.Tensor | int) -> torch.Tensor:
    """``r[i, j] = (row_r[i] + col_r[j] + offset) mod 2**16``: ``[rows, cols]`` int32 random numbers from int32
    ``[rows]`` and ``[cols]`` tables of 16-bit numbers and a 16-bit ``offset`` (an int, or a 0-d tensor of any dtype
    that holds it exactly)."""
    if isinstance(offset, torch.Tensor):
        offset = offset.to(torch.int32)
    return (row_r[:, None] + col_r[None, :] + offset) & 0xFFFF


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (64-bit wrap-around)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _chain(*parts: int) -> int:
    """A 64-bit splitmix64 chain over integers (a salt, a purpose, a step)."""
    x = 0
    for part in parts:
        x = _mix((x ^ (int(part) & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64)
    return x


def bits_table(salt: int, start: int, count: int) -> torch.Tensor:
    """``[count]`` int32 numbers in ``[0, 2**16)``: the top 16 bits of the hash of ``(salt, index)`` for the indices
    ``start ...``, on the CPU. Built once per matrix (O(rows + columns))."""
    index = torch.arange(start, start + count, dtype=torch.int64)
    # the same hash as _chain(salt, index), vectorised in int64 (torch's integer arithmetic wraps on overflow)
    x = _mix_tensor(torch.full_like(index, _signed((0 ^ salt) + 0x9E3779B97F4A7C15 & _MASK64)))
    x = _mix_tensor(_wrap_add(x ^ index, 0x9E3779B97F4A7C15))
    return _shift_right(x, 48).to(torch.int32)


def salt_of(group_index: int, index_in_group: int) -> int:
    """A matrix's salt, from its place among the optimizer's matrices (param group, position among the group's
    matrices): two matrices never draw the same numbers, and an optimizer built from ``named_parameters()`` draws what
    one built from ``parameters()`` draws."""
    return zlib.crc32(f"{group_index}:{index_in_group}".encode())


def offset_of(salt: int, purpose: int, step: int) -> int:
    """The lattice offset of one rounding, in ``[0, 2**16)``: of this matrix, for this purpose, at this step (or host
    update)."""
    return _chain(salt, purpose, step) >> 48


# ------------------------------------------------------------------------------- int64 helpers for bits_table
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
