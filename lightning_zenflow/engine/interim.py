"""Interim moves (``interim_step > 0``): the host columns move on the device at every step between host updates.

With the paper's rule a host column moves once per window of ``S`` steps, by one Adam step on the window's mean
gradient: it gets about ``1/S`` of AdamW's progress. Here, at every step after warm-up, each weight of an unselected
column also moves by ``c = interim_step * lr * (S - 1) / S`` times its gradient over an estimate of its RMS, clipped
to [-1, 1] (a bounded, sign-like step, as Adam's is), so over a window the column travels about as far as ``S`` AdamW
steps would. The RMS estimate is factored, as Adafactor's: an EMA of the mean squared gradient per row over the host
columns and per column over the rows, ``denom[i, j] = sqrt(row[i] / mean(row)) * sqrt(col[j] / (1 - decay)) + eps``:
O(rows + cols) fp32 per matrix on the device. The EMA takes one gradient per window (at the window's first step,
with ``beta2 ** S``), so its pass over the gradient costs ``1/S`` of one per step (docs/update_rule.md).

The moves are kept: the host's AdamW step is computed from its moments alone (the worker zeroes the master and
leaves ``-step`` there, see ``GroupJob.step_only``) and *added* when it lands, after the weight decay of its window
end, ``w <- w * (1 - lr * wd) + (-step)``. The model's weights are then the masters of the host columns: fp32, or
bf16 written with stochastic rounding (``engine/kernels.py``); before each selection the host masters are set from
them, so migration moves the right values. With ``S = 1`` the moves vanish; ``topk_ratio = 1`` has no host columns.

Cost per step on the device (``docs/performance.md``): one fused pass, 12 B per element of a matrix with fp32
weights (6 B with bf16), plus ``8/S`` B (``4/S``) for the statistics; no link traffic, no host work.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_zenflow.config import ZenFlowConfig, auto_interim_step
from lightning_zenflow.engine.device import HyperParams, SelectedState
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.kernels import Kernels
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import GroupLayout
from lightning_zenflow.engine.ranks import Ranks

_KEYS = ("interim_row", "interim_col", "interim_decay", "interim_moves", "interim_warm_col", "interim_warm_steps")
MOVED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes the moves write: fp32 as is, bf16 with stochastic rounding."""
_SEED_STRIDE = 40503


@dataclass
class MatrixStatistics:
    """One matrix's factored second-moment estimate (on the device) and what the moves derive from it."""

    row: torch.Tensor
    """``[rows]`` fp32: EMA of the mean squared gradient of each row over the host columns."""
    col: torch.Tensor
    """``[cols]`` fp32: EMA of the mean squared gradient of each host column over the rows (kept while selected)."""
    decay: torch.Tensor
    """fp32 scalar: the product of the EMA's decays so far (1: no statistics yet); bias correction ``1 - decay``."""
    moves: torch.Tensor
    """fp32 scalar: the moves made so far (seeds bf16's stochastic rounding)."""
    warm_col: torch.Tensor
    """``[cols]`` fp32: the warm-up's second moment per column, AdamW's ``exp_avg_sq`` at the end of the warm-up
    averaged over the rows (an EMA of the mean squared gradient with ``beta2`` per step, from 0, not bias-corrected).
    Nothing moves by it: the export restates the host columns' ``exp_avg_sq`` with it (``engine/export.py``)."""
    warm_steps: torch.Tensor
    """fp32 scalar: the warm-up steps the EMA took (a skipped step takes none)."""
    salt: int
    """From the matrix's name: two matrices never draw the same random bits."""
    row_offset: int = 0
    """FSDP2: where this rank's rows start in the whole matrix (``row`` covers every row, on every rank)."""
    host_mask: torch.Tensor | None = None
    """``[cols]`` fp32, 1 in the host columns of ``mask_of``."""
    mask_of: torch.Tensor | None = None
    """The ``unselected`` tensor the mask was built from (a selection replaces it)."""
    row_scale: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None
    move_mask: torch.Tensor | None = None
    """``host_mask``, zero while there are no statistics: what the move kernel multiplies by."""


class InterimMoves:
    """The factored second-moment estimate of every matrix and the per-step move of its host columns.

    ``ranks`` (FSDP2, ``rows_local``): the matrices are this rank's row shards. The statistics stay whole on every
    rank (``row`` has one entry per row of the whole matrix): at a statistics step each rank adds its rows' sums into
    a vector of the whole matrix's rows and columns, and one all-reduce per step sums them, so every rank holds what
    one process would (the column sums to float rounding); a shard moves with its rows of the scales."""

    def __init__(
        self, lanes: Lanes, scale: float | Literal["auto"], kernels: Kernels, ranks: Ranks | None = None
    ) -> None:
        self.lanes = lanes
        self.scale = scale if scale == "auto" else float(scale)
        """``interim_step``: a number, or ``"auto"`` (``auto_interim_step`` of each step's window)."""
        self.kernels = kernels
        self.ranks = ranks or Ranks()
        self.shard_rows: dict[str, tuple[int, int]] = {}
        """FSDP2: per matrix name, ``(row_offset, whole_rows)`` of this rank's shard (set by the strategy)."""
        self._stats: dict[str, MatrixStatistics] = {}
        self._keep_all = torch.ones((), dtype=torch.float32, device=lanes.device)
        """The kernels' ``keep`` when no step can overflow: one compiled graph whether or not a loss scaler runs."""
        self._prepared: set[tuple] = set()
        """Kinds of lane work whose kernels are built (gradient and weight dtypes, statistics or not)."""
        self._made_new = False
        """Statistics were made on the compute lane since the side lane last waited for it (``_order_new``)."""

    def scale_at(self, interval: int) -> float:
        """The moves' size at a window of ``interval`` steps (``update_interval="auto"`` changes it once)."""
        return auto_interim_step(interval) if self.scale == "auto" else self.scale

    def _stats_of(self, state: SelectedState) -> MatrixStatistics:
        slot = state.slot
        stats = self._stats.get(slot.name)
        if stats is None:
            device = self.lanes.device
            row_offset, whole_rows = self.shard_rows.get(slot.name, (0, slot.rows))
            # allocated and filled on the compute lane; the caller orders the side lane after them (_order_new)
            self._made_new = True
            stats = MatrixStatistics(
                row=torch.zeros(whole_rows, dtype=torch.float32, device=device),
                col=torch.zeros(slot.cols, dtype=torch.float32, device=device),
                decay=torch.ones((), dtype=torch.float32, device=device),
                moves=torch.zeros((), dtype=torch.float32, device=device),
                warm_col=torch.zeros(slot.cols, dtype=torch.float32, device=device),
                warm_steps=torch.zeros((), dtype=torch.float32, device=device),
                salt=zlib.crc32(slot.name.encode()) & 0xFFFF,
                row_offset=row_offset,
            )
            for tensor in (stats.row, stats.col, stats.decay, stats.moves, stats.warm_col, stats.warm_steps):
                self.lanes.made_on_compute(tensor)
            self._stats[slot.name] = stats
        return stats

    def _order_new(self) -> None:
        """When this step made statistics, the side lane waits (GPU-side) for the compute lane's fills of them: they
        were made after the step's first wait (``DeviceUpdater.begin_step``), and a CUDA side stream would otherwise
        read them unfilled."""
        if self._made_new:
            self._made_new = False
            self.lanes.side.wait_lane(self.lanes.compute, "side after compute")

    def step(
        self,
        groups: Sequence[Sequence[SelectedState]],
        hparams: Sequence[HyperParams],
        interval: int,
        found_inf: torch.Tensor | None,
        first_in_window: bool,
    ) -> None:
        """Issue this step's statistics (at a window's first step) and moves on the side lane (after the device
        update, which reads the same gradients; the moves write only host columns)."""
        work = []
        for group_states, hp in zip(groups, hparams):
            coefficient = self.scale_at(interval) * hp.lr * (interval - 1) / interval
            for state in group_states:
                grad = state.slot.param.grad
                if grad is None or state.k == state.slot.cols:
                    continue
                self.lanes.keep_for(grad, self.lanes.side)
                beta = hp.beta2**interval if first_in_window else None
                work.append((state, grad, self._stats_of(state), beta, hp.eps, coefficient))
        if not work:
            return
        self._order_new()
        measured = [item for item in work if item[3] is not None]
        self._prepare_kernels(work, measured, self._keep_all)
        # found_inf (kept for the side lane by the engine) becomes ``keep`` on the side lane itself: a tensor made here
        # on the compute lane would be freed when this call returns, while the side stream still reads it
        if measured:
            sums: dict[str, torch.Tensor] = {}
            self.lanes.side.run(_local_sums, self.kernels, measured, sums)
            if self.ranks.rows_local and self.ranks.spans:
                # one all-reduce of every matrix's row and column sums, in the side lane's order
                self.lanes.collective(self.lanes.side, _sum_over_shards, self.ranks, sums)
            self.lanes.side.run(_take_sums, measured, sums, found_inf, self._keep_all)
        self.lanes.side.run(_moves, self.kernels, work, found_inf, self._keep_all)

    def warm_up_step(
        self, groups: Sequence[Sequence[SelectedState]], hparams: Sequence[HyperParams], found_inf: torch.Tensor | None
    ) -> None:
        """A warm-up step (plain AdamW on every column): record each matrix's squared gradient per column into
        ``warm_col`` (one pass over the gradient on the side lane, and under FSDP2 one all-reduce of the column sums).
        The moves use none of it; the warm-up is ``full_warm_up_rounds`` steps, so the passes are a fixed cost."""
        work = []
        for group_states, hp in zip(groups, hparams):
            for state in group_states:
                grad = state.slot.param.grad
                if grad is None or state.k == state.slot.cols:
                    continue
                self.lanes.keep_for(grad, self.lanes.side)
                work.append((state, grad, self._stats_of(state), hp.beta2))
        if not work:
            return
        self._order_new()
        for state, grad, stats, _beta in work:
            kind = (grad.dtype, True, torch.get_num_threads())  # the statistics' kernel, on every column
            if self.kernels.mode != "eager" and kind not in self._prepared:
                self._prepared.add(kind)
                ones = torch.ones_like(stats.col)
                self.kernels.prepare(self.kernels.row_col_sums, grad.view(state.slot.rows, -1), ones)
        sums: dict[str, torch.Tensor] = {}
        self.lanes.side.run(_warm_sums, self.kernels, work, sums)
        if self.ranks.rows_local and self.ranks.spans:
            self.lanes.collective(self.lanes.side, _sum_over_shards, self.ranks, sums)
        self.lanes.side.run(_take_warm_sums, work, sums, found_inf, self._keep_all)

    def _prepare_kernels(self, work: list, measured: list, keep: torch.Tensor) -> None:
        """Build, on this (the training) thread, the kernels the lane will run for ``work`` (``engine/compiled.py``):
        arguments of the lane's dtypes and ranks (the sizes do not matter to a build)."""
        kernels = self.kernels
        if kernels.mode == "eager":
            return
        measured_ids = {id(item[0]) for item in measured}
        for state, grad, stats, _beta, eps, coefficient in work:
            slot = state.slot
            # a build is per thread count too (engine/compiled.py): a program may change it between steps
            kind = (
                grad.dtype,
                slot.param.dtype,
                id(state) in measured_ids,
                coefficient == 0.0,
                torch.get_num_threads(),
            )
            if kind in self._prepared:
                continue
            self._prepared.add(kind)
            grad2d = grad.view(slot.rows, slot.cols)
            if id(state) in measured_ids:
                kernels.prepare(kernels.row_col_sums, grad2d, stats.col)
            if coefficient == 0.0:
                continue
            weight2d = slot.param.data.view(slot.rows, slot.cols)
            rows_like = stats.row.new_empty(slot.rows)
            args = (grad2d, weight2d, rows_like, stats.col, stats.col, eps, coefficient, keep)
            if weight2d.dtype == torch.bfloat16:
                seed_like = torch.zeros((), dtype=torch.int64, device=grad.device)
                kernels.prepare(kernels.moves_bf16_, *args, stats.row_offset, seed_like)
            else:
                kernels.prepare(kernels.moves_fp32_, *args)

    def bytes_held(self) -> int:
        """Device bytes of the statistics and what the moves derive from them (O(rows + columns) per matrix)."""
        total = self._keep_all.nbytes
        for stats in self._stats.values():
            tensors = (stats.row, stats.col, stats.decay, stats.moves, stats.host_mask, stats.row_scale)
            tensors += (stats.col_scale, stats.move_mask, stats.warm_col, stats.warm_steps)
            total += sum(t.nbytes for t in tensors if t is not None)
        return total

    # ---------------------------------------------------------------------------------------------- state
    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        stats = self._stats.get(name)
        if stats is None:
            return {}
        values = (stats.row, stats.col, stats.decay, stats.moves, stats.warm_col, stats.warm_steps)
        return {key: value.detach().cpu().clone() for key, value in zip(_KEYS, values)}

    def load(self, entry: Mapping[str, object], state: SelectedState) -> None:
        """Restore :meth:`state_of` (a state without it, or saved by an earlier rule, starts the statistics afresh).
        Nothing may be in flight."""
        if "interim_decay" not in entry:
            self._stats.pop(state.slot.name, None)
            return
        stats = self._stats_of(state)
        values = (stats.row, stats.col, stats.decay, stats.moves, stats.warm_col, stats.warm_steps)
        for key, value in zip(_KEYS, values):
            if key in entry:  # a state saved before the warm-up record: none (the export restates without it)
                value.copy_(entry[key])
            else:
                value.zero_()
        stats.mask_of = None  # the scales are derived again at the next move

    def forget(self) -> None:
        self._stats = {}


def _host_mask(stats: MatrixStatistics, unselected: torch.Tensor) -> None:
    if stats.mask_of is unselected:
        return
    mask = torch.zeros_like(stats.col)
    mask.index_fill_(0, unselected, 1.0)
    stats.host_mask = mask
    stats.mask_of = unselected
    stats.row_scale = None


def update_statistics(
    kernels: Kernels,
    grad2d: torch.Tensor,
    stats: MatrixStatistics,
    host_columns: int,
    beta: float,
    keep: torch.Tensor,
) -> None:
    """The EMA of the factored second moment takes this gradient's host columns (in place), in one process; with
    ``keep`` 0 (a 16-mixed overflow) nothing changes."""
    row_sums, col_sums = kernels.row_col_sums(grad2d, stats.host_mask)
    ema_(stats, row_sums, col_sums, grad2d.shape[0], host_columns, beta, keep)


def ema_(
    stats: MatrixStatistics,
    row_sums: torch.Tensor,
    col_sums: torch.Tensor,
    whole_rows: int,
    host_columns: int,
    beta: float,
    keep: torch.Tensor,
) -> None:
    """One EMA step of the statistics with the whole matrix's sums of squares (per row over the host columns, per
    column over the rows)."""
    kept = keep > 0
    new_row = stats.row * beta + row_sums * ((1.0 - beta) / host_columns)
    new_col = stats.col * beta + col_sums * ((1.0 - beta) / whole_rows)
    stats.row.copy_(torch.where(kept, new_row, stats.row))
    stats.col.copy_(torch.where(kept & (stats.host_mask > 0), new_col, stats.col))
    stats.decay.copy_(torch.where(kept, stats.decay * beta, stats.decay))
    stats.row_scale = None


def derive_scales(stats: MatrixStatistics) -> None:
    """``row_scale``, ``col_scale`` and ``move_mask`` from the statistics (O(rows + cols), once per window)."""
    correction = 1.0 - stats.decay
    stats.row_scale = (stats.row / stats.row.mean().clamp_min(1e-30)).sqrt()
    stats.col_scale = (stats.col / correction.clamp_min(1e-30)).sqrt()
    stats.move_mask = stats.host_mask * (correction > 0)


def _local_sums(kernels: Kernels, measured: list, sums: dict[str, torch.Tensor]) -> None:
    """Lane work: this rank's sums of squares of every measured matrix, into one flat vector per step: the whole
    matrix's rows (this rank's block filled, zeros elsewhere) and then its columns."""
    parts = []
    with torch.no_grad():
        for state, grad, stats, _beta, _eps, _coefficient in measured:
            slot = state.slot
            _host_mask(stats, state.unselected)
            row_sums, col_sums = kernels.row_col_sums(grad.view(slot.rows, slot.cols), stats.host_mask)
            if slot.rows != stats.row.numel():
                whole = torch.zeros_like(stats.row)
                whole[stats.row_offset : stats.row_offset + slot.rows] = row_sums
                row_sums = whole
            parts += [row_sums, col_sums]
        sums["flat"] = torch.cat(parts)


def _warm_sums(kernels: Kernels, work: list, sums: dict[str, torch.Tensor]) -> None:
    """Lane work: this rank's sums of squares of every column of every matrix of a warm-up step, in one vector."""
    with torch.no_grad():
        every_column = [torch.ones_like(stats.col) for _state, _grad, stats, _beta in work]
        parts = [
            kernels.row_col_sums(grad.view(state.slot.rows, -1), ones)[1]
            for (state, grad, _stats, _beta), ones in zip(work, every_column)
        ]
        sums["flat"] = torch.cat(parts)


def _keep(found_inf: torch.Tensor | None, keep_all: torch.Tensor) -> torch.Tensor:
    """Lane work's ``keep``: 0 for a 16-mixed overflow, else 1 (a device scalar, made on the lane that reads it)."""
    return keep_all if found_inf is None else 1.0 - found_inf


def _take_warm_sums(
    work: list, sums: dict[str, torch.Tensor], found_inf: torch.Tensor | None, keep_all: torch.Tensor
) -> None:
    """Lane work: the warm record's EMA step from the summed column sums (the whole matrix's, on every rank)."""
    keep = _keep(found_inf, keep_all)
    flat = sums.pop("flat")
    offset = 0
    with torch.no_grad():
        for _state, _grad, stats, beta in work:
            cols = stats.warm_col.numel()
            mean_square = flat[offset : offset + cols] / stats.row.numel()
            offset += cols
            kept = keep > 0
            stats.warm_col.copy_(torch.where(kept, stats.warm_col * beta + mean_square * (1.0 - beta), stats.warm_col))
            stats.warm_steps.add_(kept.float())


def _sum_over_shards(ranks: Ranks, sums: dict[str, torch.Tensor]) -> None:
    ranks.sum_scores_(sums["flat"])  # every rank's rows and column partial sums: the whole matrix's


def _take_sums(
    measured: list, sums: dict[str, torch.Tensor], found_inf: torch.Tensor | None, keep_all: torch.Tensor
) -> None:
    """Lane work: the statistics' EMA from the summed vector (the same on every rank)."""
    keep = _keep(found_inf, keep_all)
    flat = sums.pop("flat")
    offset = 0
    with torch.no_grad():
        for state, _grad, stats, beta, _eps, _coefficient in measured:
            rows, cols = stats.row.numel(), stats.col.numel()
            row_sums, col_sums = flat[offset : offset + rows], flat[offset + rows : offset + rows + cols]
            offset += rows + cols
            ema_(stats, row_sums, col_sums, rows, int(state.unselected.numel()), beta, keep)


def _moves(kernels: Kernels, work: list, found_inf: torch.Tensor | None, keep_all: torch.Tensor) -> None:
    """Lane work: this step's move of every matrix's host columns."""
    keep = _keep(found_inf, keep_all)
    with torch.no_grad():
        for state, grad, stats, _beta, eps, coefficient in work:
            slot = state.slot
            _host_mask(stats, state.unselected)
            if coefficient == 0.0:
                continue
            if stats.row_scale is None:
                derive_scales(stats)
            row_scale = stats.row_scale
            if slot.rows != row_scale.numel():
                row_scale = row_scale[stats.row_offset : stats.row_offset + slot.rows]
            grad2d = grad.view(slot.rows, slot.cols)
            weight2d = slot.param.data.view(slot.rows, slot.cols)
            args = (grad2d, weight2d, row_scale, stats.col_scale, stats.move_mask, eps, coefficient, keep)
            if weight2d.dtype == torch.bfloat16:
                seed = (stats.moves.to(torch.int64) * _SEED_STRIDE + stats.salt) & 0x7FFFFFFF
                kernels.moves_bf16_(*args, stats.row_offset, seed)
            else:
                kernels.moves_fp32_(*args)
            stats.moves.add_(keep)


def resolve_interim_scale(
    config: ZenFlowConfig, layout: Sequence[GroupLayout], hparams: Sequence[HyperParams]
) -> float | Literal["auto"]:
    """``interim_step`` for this model: 0 for no moves (the paper's rule); an explicit number, checked against the
    model (fp32 or bf16 weights, AdamW-style decay, eps > 0); ``"auto"`` where those hold and windows are longer than
    one step (the size then follows each step's window, ``auto_interim_step``), else 0."""
    value = config.interim_step
    odd = sorted({str(s.param.dtype) for g in layout for s in g.matrices if s.param.dtype not in MOVED_DTYPES})
    if value == "auto":
        applies = (
            config.update_interval != 1
            and config.topk_ratio < 1
            and not odd
            and all(hp.decoupled or not hp.weight_decay for hp in hparams)
            and all(hp.eps > 0 for hp in hparams)
        )
        return "auto" if applies else 0.0
    value = float(value)
    if value <= 0:
        return 0.0
    check_interim_hparams(hparams)
    if odd and config.topk_ratio < 1:
        raise UnsupportedSetupError(
            f"interim_step={config.interim_step} moves the weights of host columns in place, which needs "
            f"fp32 or bf16 weights; this model has matrices in {', '.join(odd)}. Train with fp32 weights (precision "
            "'32-true' or '16-mixed'/'bf16-mixed', which keep them) or bf16 ones ('bf16-true'), or set "
            "interim_step=0."
        )
    return value


def check_interim_hparams(hparams: Sequence[HyperParams]) -> None:
    """Refused, naming the group: Adam's L2 weight decay (in the gradient), which the moves cannot combine, and
    ``eps=0``, with which a column whose gradient has been exactly 0 divides 0 by 0 (a NaN weight)."""
    for index, hp in enumerate(hparams):
        if hp.eps <= 0:
            raise UnsupportedSetupError(
                f"param group {index} has eps={hp.eps}; interim_step's moves divide by the factored RMS plus eps, "
                "which is 0 for a column whose gradients were all 0 (0 / 0: a NaN weight). Set eps > 0 (AdamW's "
                "default is 1e-8) or interim_step=0."
            )
        if not hp.decoupled and hp.weight_decay:
            raise UnsupportedSetupError(
                f"param group {index} runs Adam with weight_decay={hp.weight_decay} (an L2 term in the gradient), "
                "which interim_step cannot combine with its moves; use torch.optim.AdamW (decoupled decay) or set "
                "interim_step=0."
            )
