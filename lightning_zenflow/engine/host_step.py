"""The host worker's AdamW step over the host layout (``engine/layout.py``): one source, compiled or eager.

Two functions, written once in plain torch ops and run through :class:`~lightning_zenflow.engine.kernels.Kernels`
(``torch.compile`` into one C++ loop with OpenMP where a compiler is found, the same functions eagerly elsewhere):

- :func:`adam_step_`: the weights are the masters. From the window's sum and the moments it writes the new moments
  and the step ``-lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` into the window row it read (no weight decay: the
  device applies it when the step lands, ``w <- w * (1 - lr * wd) + step``).
- :func:`adam_master_step_`: the host keeps fp32 masters (``HostFormat.master``): AdamW (decoupled decay) or Adam
  (L2 decay in the gradient) on the master, as torch's fused kernel computes it.

Stored moments: fp32 as computed; bf16 (``host_state="bf16"``) with the first moment rounded to nearest (its change
per update is ``1 - beta1`` = 10 % of the distance to the gradient, far above half a bf16 step) and the second
stochastically (its change is ``1 - beta2`` = 0.1 %, below half a step: rounded to nearest it would stop moving),
with the lattice numbers of ``engine/rounding.py`` and the matrix's host update count as the offset's step.

Memory traffic per element (the worker is bound by it; docs/performance.md): fp32 state 24 B (read g, m, v; write m,
v, step), bf16 state 12 B, against 28 B (+4 to zero a master) for torch's fused AdamW over fp32 state. Each region
is processed in row blocks of about :data:`CHUNK_ELEMENTS` elements, so the eager functions' temporaries stay small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_zenflow.engine.rounding import PURPOSE_EXP_AVG_SQ, lattice, offset_of, round_bf16, unit_table

CHUNK_ELEMENTS = 1 << 22
"""Elements per call of a step function (16 MiB of fp32): the eager temporaries' bound."""
COLUMN_SALT = 0x5BD1E995
"""Mixed into a matrix's salt for its column numbers (rows and columns draw from different tables)."""
SCALARS = (
    "inverse divisor",
    "beta1",
    "1 - beta1",
    "beta2",
    "1 - beta2",
    "lr / bc1",
    "sqrt(bc2)",
    "eps",
    "lattice offset",
    "L2 decay",
    "decoupled decay factor",
)
"""The step functions' ``scalars``, in order: computed in double on the host, then held in fp32 (``1 - beta2`` is
computed before the rounding: fp32's ``1 - 0.999`` is 1.3e-5 off)."""


def _moments(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scalars: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new moments (fp32) and the step, torch's fused AdamW's arithmetic."""
    m = exp_avg.float()
    m = m + (grad - m) * scalars[2]
    v = exp_avg_sq.float() * scalars[3] + grad * grad * scalars[4]
    step = -scalars[5] * m / (v.sqrt() / scalars[6] + scalars[7])
    return m, v, step


def _store_moments(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    row_u: torch.Tensor,
    col_u: torch.Tensor,
    scalars: torch.Tensor,
    stochastic: bool,
) -> None:
    exp_avg.copy_(m)
    if stochastic:
        exp_avg_sq.copy_(round_bf16(v, lattice(row_u, col_u, scalars[8])))
    else:
        exp_avg_sq.copy_(v)


def adam_step_(
    grad2d: torch.Tensor,
    exp_avg2d: torch.Tensor,
    exp_avg_sq2d: torch.Tensor,
    row_u: torch.Tensor,
    col_u: torch.Tensor,
    scalars: torch.Tensor,
    stochastic: bool,
) -> None:
    """One AdamW step from the window's sum ``grad2d`` (the mean is ``sum * scalars[0]``): the moments in place, and
    the step written over ``grad2d``. ``stochastic``: the second moment is bf16, rounded stochastically."""
    grad = grad2d.float() * scalars[0]
    m, v, step = _moments(grad, exp_avg2d, exp_avg_sq2d, scalars)
    _store_moments(exp_avg2d, exp_avg_sq2d, m, v, row_u, col_u, scalars, stochastic)
    grad2d.copy_(step)


def adam_master_step_(
    master2d: torch.Tensor,
    grad2d: torch.Tensor,
    exp_avg2d: torch.Tensor,
    exp_avg_sq2d: torch.Tensor,
    row_u: torch.Tensor,
    col_u: torch.Tensor,
    scalars: torch.Tensor,
    stochastic: bool,
) -> None:
    """One Adam/AdamW step on an fp32 master: ``scalars[9]`` is Adam's L2 decay (added to the gradient),
    ``scalars[10]`` AdamW's factor ``1 - lr * wd`` (applied to the master before the step)."""
    grad = grad2d.float() * scalars[0] + master2d * scalars[9]
    m, v, step = _moments(grad, exp_avg2d, exp_avg_sq2d, scalars)
    _store_moments(exp_avg2d, exp_avg_sq2d, m, v, row_u, col_u, scalars, stochastic)
    master2d.copy_(master2d * scalars[10] + step)


@dataclass(frozen=True)
class StepHyperParams:
    """What one matrix's host step needs besides its tensors."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    count: int
    """The matrix's host update count after this update (its bias correction)."""
    divisor: float
    """The window's kept gradients: the sum over this is the mean."""

    def scalars(self, salt: int, with_master: bool) -> torch.Tensor:
        """The step functions' ``scalars`` (fp32): with a master, the decay is applied on the host; without one the
        device applies it at the landing."""
        bias_correction1 = 1.0 - self.beta1**self.count
        bias_correction2 = 1.0 - self.beta2**self.count
        l2 = self.weight_decay if with_master and not self.decoupled else 0.0
        decay = 1.0 - self.lr * self.weight_decay if with_master and self.decoupled else 1.0
        values = [
            1.0 / self.divisor,
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            self.lr / bias_correction1,
            math.sqrt(bias_correction2),
            self.eps,
            offset_of(salt, PURPOSE_EXP_AVG_SQ, self.count),
            l2,
            decay,
        ]
        return torch.tensor(values, dtype=torch.float32)


class NoiseTables:
    """Per matrix: the lattice's row and column numbers (``engine/rounding.py``), built at first use."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, salt: int, row_start: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (salt, row_start, rows, cols)
        tables = self._tables.get(key)
        if tables is None:
            tables = (unit_table(salt, row_start, rows), unit_table(salt ^ COLUMN_SALT, 0, cols))
            self._tables[key] = tables
        return tables


def step_region(
    step_fn: Callable[..., None],
    master_fn: Callable[..., None],
    grad2d: torch.Tensor,
    exp_avg2d: torch.Tensor,
    exp_avg_sq2d: torch.Tensor,
    master2d: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor],
    scalars: torch.Tensor,
) -> None:
    """One matrix's host step (its ``[host_rows, cols]`` views), in row blocks of about :data:`CHUNK_ELEMENTS`."""
    rows, cols = grad2d.shape
    stochastic = exp_avg_sq2d.dtype == torch.bfloat16
    row_u, col_u = tables
    block = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        part = slice(start, stop)
        if master2d is None:
            step_fn(grad2d[part], exp_avg2d[part], exp_avg_sq2d[part], row_u[part], col_u, scalars, stochastic)
        else:
            master_fn(
                master2d[part],
                grad2d[part],
                exp_avg2d[part],
                exp_avg_sq2d[part],
                row_u[part],
                col_u,
                scalars,
                stochastic,
            )
