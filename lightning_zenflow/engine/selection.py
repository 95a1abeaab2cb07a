"""Column importance, per-matrix top-k, and the diagnostics of a selection.

The score of column j of a gradient ``G[rows, cols]`` is ``sum_i G[i, j]**2`` ("l2", the paper's squared
norm) or ``sum_i |G[i, j]|`` ("l1", DeepSpeed's code). Each matrix keeps its own ``k`` best columns; ties go to
the lower column index (a stable sort), so the choice is the same on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.config import num_selected_columns


def column_scores(grad2d: torch.Tensor, importance: str) -> torch.Tensor:
    """Per-column importance of a ``[rows, cols]`` gradient, in fp32, on the gradient's device."""
    grad_fp32 = grad2d.float()
    if importance == "l2":
        return grad_fp32.square().sum(dim=0)
    if importance == "l1":
        return grad_fp32.abs().sum(dim=0)
    raise ValueError(f"importance={importance!r} is not one of 'l2' or 'l1'.")


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending, int64) of the ``k`` highest scores; ties go to the lower index."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    if k >= scores.numel():
        return torch.arange(scores.numel(), device=scores.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def select_columns(grad2d: torch.Tensor, ratio: float, importance: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected columns of one matrix and their scores: ``(indices, scores)``."""
    scores = column_scores(grad2d, importance)
    return top_columns(scores, num_selected_columns(grad2d.shape[1], ratio)), scores


def complement(indices: torch.Tensor, cols: int) -> torch.Tensor:
    """The columns of ``range(cols)`` not in ``indices`` (ascending, int64)."""
    keep = torch.ones(cols, dtype=torch.bool, device=indices.device)
    keep[indices] = False
    return keep.nonzero().flatten()


@dataclass(frozen=True)
class SelectionDiagnostics:
    """How a new selection relates to the previous one and to the gradient it was chosen from."""

    overlap: float | None
    """Jaccard overlap |old & new| / |old | new| over all matrices; None at the first selection."""
    captured_share: float
    """Share of the total column score held by the selected columns (all matrices together)."""


def diagnose(
    previous: Sequence[torch.Tensor] | None, current: Sequence[torch.Tensor], scores: Sequence[torch.Tensor]
) -> SelectionDiagnostics:
    """Diagnostics of a selection across all matrices.

    This reads small reductions back to the host (a device sync on CUDA); it runs only at a refresh,
    which is already a full synchronisation point.
    """
    captured = torch.zeros((), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for index, score in zip(current, scores):
        captured += score[index].sum().double().cpu()
        total += score.sum().double().cpu()
    share = float(captured / total) if float(total) > 0 else 1.0
    if previous is None:
        return SelectionDiagnostics(overlap=None, captured_share=share)
    intersection = union = 0
    for old, new, score in zip(previous, current, scores):
        old_mask = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
        new_mask = torch.zeros_like(old_mask)
        old_mask[old] = True
        new_mask[new] = True
        intersection += int((old_mask & new_mask).sum())
        union += int((old_mask | new_mask).sum())
    return SelectionDiagnostics(overlap=intersection / union if union else 1.0, captured_share=share)
