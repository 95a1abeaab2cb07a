"""Interim moves (``interim_step > 0``): the host columns move on the device at every step between host updates.

With the paper's rule a host column moves once per window of ``S`` steps, by one Adam step on the window's mean
gradient: it gets about ``1/S`` of AdamW's progress. Here, at every step after warm-up, each weight of an unselected
column also moves by ``c = interim_step * lr * (S - 1) / S`` times its gradient over an estimate of its RMS, clipped
to [-1, 1] (a bounded, sign-like step, as Adam's is), so over a window the column travels about as far as ``S`` AdamW
steps would. The RMS estimate is factored, as Adafactor's: an EMA (the group's ``beta2``) of the mean squared
gradient per row over the host columns and per column over the rows, bias-corrected with the matrix's own count,
``denom[i, j] = sqrt(row[i] / mean(row)) * sqrt(col[j]) + eps``: O(rows + cols) fp32 per matrix on the device.

The moves are kept: the host's AdamW step is computed from its moments alone (the worker zeroes the master and
leaves ``-step`` there, see ``GroupJob.step_only``) and *added* when it lands, after the weight decay of its window
end, ``w <- w * (1 - lr * wd) + (-step)``. The model's fp32 weights are then the masters of the host columns (hence
fp32 weights only); before each selection the host masters are set from them, so migration moves the right values.
With ``S = 1`` the moves vanish and the rule is the paper's; ``topk_ratio = 1`` has no host columns.

Cost per step on the device (``docs/performance.md``): about 40 B of traffic per host element with these unfused
ops, two temporaries of a matrix's host columns at once, on the side lane. No link traffic; no host work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine.device import HyperParams, SelectedState
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import GroupLayout

_KEYS = ("interim_row", "interim_col", "interim_count")


class InterimMoves:
    """The factored second-moment estimate of every matrix and the per-step move of its host columns."""

    def __init__(self, lanes: Lanes, scale: float) -> None:
        self.lanes = lanes
        self.scale = float(scale)
        self._stats: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _stats_of(self, state: SelectedState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slot = state.slot
        stats = self._stats.get(slot.name)
        if stats is None:
            device = self.lanes.device
            # allocated and zeroed on the calling thread, before any lane work reads them
            stats = (
                torch.zeros(slot.rows, dtype=torch.float32, device=device),
                torch.zeros(slot.cols, dtype=torch.float32, device=device),
                torch.zeros((), dtype=torch.float32, device=device),
            )
            self._stats[slot.name] = stats
        return stats

    def step(
        self,
        groups: Sequence[Sequence[SelectedState]],
        hparams: Sequence[HyperParams],
        interval: int,
        found_inf: torch.Tensor | None,
    ) -> None:
        """Issue this step's statistics and moves on the side lane (after the device update and the accumulation,
        which read the same gradients; the moves write only host columns)."""
        work = []
        for group_states, hp in zip(groups, hparams):
            coefficient = self.scale * hp.lr * (interval - 1) / interval
            for state in group_states:
                grad = state.slot.param.grad
                if grad is None or state.k == state.slot.cols:
                    continue
                self.lanes.keep_for(grad, self.lanes.side)
                work.append((state, grad, self._stats_of(state), hp, coefficient))
        if work:
            self.lanes.side.run(_moves, work, found_inf)

    # ---------------------------------------------------------------------------------------------- state
    def state_of(self, name: str) -> dict[str, torch.Tensor]:
        stats = self._stats.get(name)
        if stats is None:
            return {}
        return {key: value.detach().cpu().clone() for key, value in zip(_KEYS, stats)}

    def load(self, entry: Mapping[str, object], state: SelectedState) -> None:
        """Restore :meth:`state_of` (a state without it starts the statistics afresh). Nothing may be in flight."""
        if "interim_row" not in entry:
            self._stats.pop(state.slot.name, None)
            return
        row, col, count = self._stats_of(state)
        row.copy_(entry["interim_row"])
        col.copy_(entry["interim_col"])
        count.copy_(entry["interim_count"])

    def forget(self) -> None:
        self._stats = {}


def factored_moves(
    grad2d: torch.Tensor,
    unselected: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    count: torch.Tensor,
    beta2: float,
    eps: float,
    coefficient: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Update the statistics with this gradient's host columns (in place) and return the move of those columns,
    ``[rows, len(unselected)]`` fp32, or None when ``coefficient`` is 0. ``keep`` (16-mixed): a device scalar, 0 when
    the step overflowed, which then changes nothing."""
    g = grad2d.index_select(1, unselected).float()
    squared = g.square()
    row_mean = squared.mean(dim=1)
    col_mean = squared.mean(dim=0)
    del squared  # at most two matrix-sized temporaries at once: g and the denominator
    new_row = row * beta2 + row_mean * (1.0 - beta2)
    new_col = col.index_select(0, unselected) * beta2 + col_mean * (1.0 - beta2)
    if keep is None:
        row.copy_(new_row)
        col.index_copy_(0, unselected, new_col)
        count.add_(1.0)
    else:
        kept = keep > 0
        row.copy_(torch.where(kept, new_row, row))
        col.index_copy_(0, unselected, torch.where(kept, new_col, col.index_select(0, unselected)))
        count.add_(keep)
    if coefficient == 0.0:
        return None
    correction = 1.0 - torch.pow(beta2, count)  # a Python base: no host-to-device copy on CUDA
    row_hat = row / correction
    col_hat = col.index_select(0, unselected) / correction
    row_scale = (row_hat / row_hat.mean().clamp_min(1e-30)).sqrt()
    denom = torch.outer(row_scale, col_hat.sqrt()).add_(eps)
    move = g.div_(denom).clamp_(-1.0, 1.0).mul_(-coefficient)
    if keep is not None:
        move = torch.where(keep > 0, move, torch.zeros_like(move))
    return move


def _moves(work: list, found_inf: torch.Tensor | None) -> None:
    keep = None if found_inf is None else 1.0 - found_inf
    with torch.no_grad():
        for state, grad, (row, col, count), hp, coefficient in work:
            slot = state.slot
            grad2d = grad.view(slot.rows, slot.cols)
            move = factored_moves(grad2d, state.unselected, row, col, count, hp.beta2, hp.eps, coefficient, keep)
            if move is not None:
                slot.param.data.view(slot.rows, slot.cols).index_add_(1, state.unselected, move)


def resolve_interim_scale(
    config: ZenFlowConfig, layout: Sequence[GroupLayout], hparams: Sequence[HyperParams]
) -> float:
    """``interim_step`` as a number: an explicit one is checked against the model (fp32 weights, AdamW-style decay);
    ``"auto"`` is 1 where those hold and windows are longer than one step, else 0 (the paper's rule)."""
    value = config.interim_step
    odd = sorted({str(s.param.dtype) for g in layout for s in g.matrices if s.param.dtype != torch.float32})
    if value == "auto":
        applies = (
            config.update_interval != 1
            and config.topk_ratio < 1
            and not odd
            and all(hp.decoupled or not hp.weight_decay for hp in hparams)
        )
        return 1.0 if applies else 0.0
    value = float(value)
    if value <= 0:
        return 0.0
    check_interim_decay(hparams)
    if odd and config.topk_ratio < 1:
        raise UnsupportedSetupError(
            f"interim_step={config.interim_step} moves the weights of host columns in place, which needs "
            f"fp32 weights; this model has matrices in {', '.join(odd)}. Train with fp32 weights (precision "
            "'32-true' or '16-mixed'/'bf16-mixed', which keep them), or set interim_step=0."
        )
    return value


def check_interim_decay(hparams: Sequence[HyperParams]) -> None:
    """Adam's L2 weight decay (in the gradient) cannot be combined with the moves: refused, naming the group."""
    for index, hp in enumerate(hparams):
        if not hp.decoupled and hp.weight_decay:
            raise UnsupportedSetupError(
                f"param group {index} runs Adam with weight_decay={hp.weight_decay} (an L2 term in the gradient), "
                "which interim_step cannot combine with its moves; use torch.optim.AdamW (decoupled decay) or set "
                "interim_step=0."
            )
