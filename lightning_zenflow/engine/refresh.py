"""A refresh: choose every matrix's columns again from the current gradient.

The schedule says when (``select_strategy`` / ``select_interval``, the first step after warm-up); this room says
how: the column scores and top-k on the side lane (under FSDP2 the scores of every rank's rows summed first, one
all-reduce of all matrices' scores), rank 0's choice on every rank, two small host reads, then
``engine/migrate.py`` moves only the columns that change side, and the worker learns the new host columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_zenflow.config import AUTO_SELECT_STEPS, ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.selection import column_scores, top_columns


def refresh_period(config: ZenFlowConfig, steps_per_epoch: int | None) -> int | None:
    """Steps between refreshes. ``"auto"``: one epoch where its length is known, else :data:`AUTO_SELECT_STEPS`
    steps (a plain loop, an endless data stream); None (never) while ``"epoch"`` does not know the epoch's length."""
    strategy = config.select_strategy
    if strategy == "step":
        return int(config.select_interval)
    epochs = 1 if strategy == "auto" else int(config.select_interval)
    if steps_per_epoch is None:
        return AUTO_SELECT_STEPS if strategy == "auto" else None
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1.")
    return epochs * steps_per_epoch


def choose_columns(
    lanes: Lanes, states: Sequence[SelectedState], config: ZenFlowConfig, ranks: Ranks
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every matrix's new top-k columns and its column scores, as CPU tensors (layout order).

    Two host reads of small tensors (the indices and the scores, one transfer each for all matrices): a device
    synchronisation, at a selection only."""
    work = []
    for state in states:
        grad = state.slot.param.grad
        grad2d = None if grad is None else grad.view(state.slot.rows, state.slot.cols)
        work.append((grad2d, state.slot.cols, num_selected_columns(state.slot.cols, config.topk_ratio)))
    k_sizes = [k for _, _, k in work]
    col_sizes = [cols for _, cols, _ in work]
    box: dict[str, torch.Tensor] = {}
    # side waits (GPU-side) for the compute lane's gradients
    lanes.side.wait_lane(lanes.compute, "side after compute")
    if ranks.rows_local and ranks.spans:
        # FSDP2: each rank scores its rows; the sum is the whole matrix's score, the same on every rank
        lanes.side.run(_score, box, work, config.importance, lanes.device)
        lanes.collective(lanes.side, lambda: ranks.sum_scores_(box["scores"]))
        lanes.side.run(_choose, box, work)
    else:
        lanes.side.run(_score_and_choose, box, work, config.importance, lanes.device)
    # data parallel: rank 0's choice everywhere (equal gradients, but ties must not split the ranks)
    lanes.collective(lanes.side, lambda: ranks.broadcast_(box["indices"]))
    flat_indices = lanes.read(lanes.side, lambda: box["indices"])
    flat_scores = lanes.read(lanes.side, lambda: box["scores"])
    return list(torch.split(flat_indices, k_sizes)), list(torch.split(flat_scores, col_sizes))


def write_unselected(device_updater: DeviceUpdater, unselected_shared: Sequence[torch.Tensor]) -> None:
    """Publish each matrix's host-bound columns to the worker (it unpacks host-mode accumulators with them)."""
    for group_index, group_states in enumerate(device_updater.selected):
        col_offset = 0
        for state in group_states:
            keep = torch.ones(state.slot.cols, dtype=torch.bool)
            keep[state.selected_host] = False
            host_columns = keep.nonzero().flatten()
            unselected_shared[group_index][col_offset : col_offset + host_columns.numel()] = host_columns
            col_offset += state.slot.cols


def _score(box: dict, work: list, importance: str, device: torch.device) -> None:
    """Side lane: every matrix's column scores, concatenated (``box["scores"]``)."""
    scores = [
        torch.zeros(cols, device=device) if grad2d is None else column_scores(grad2d, importance)
        for grad2d, cols, _ in work
    ]
    box["scores"] = torch.cat(scores) if scores else torch.empty(0, device=device)


def _choose(box: dict, work: list) -> None:
    """Side lane: every matrix's top-k columns from ``box["scores"]``, concatenated (``box["indices"]``)."""
    scores = torch.split(box["scores"], [cols for _, cols, _ in work])
    indices = [top_columns(score, k) for score, (_, _, k) in zip(scores, work)]
    device = box["scores"].device
    box["indices"] = torch.cat(indices) if indices else torch.empty(0, dtype=torch.long, device=device)


def _score_and_choose(box: dict, work: list, importance: str, device: torch.device) -> None:
    """Side lane: every matrix's column scores and top-k columns, concatenated (``box["scores"]``, ``["indices"]``)."""
    indices, scores = [], []
    for grad2d, cols, k in work:
        score = torch.zeros(cols, device=device) if grad2d is None else column_scores(grad2d, importance)
        indices.append(top_columns(score, k))
        scores.append(score)
    box["indices"] = torch.cat(indices) if indices else torch.empty(0, dtype=torch.long, device=device)
    box["scores"] = torch.cat(scores) if scores else torch.empty(0, device=device)
