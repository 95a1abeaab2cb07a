"""Moving optimizer state between the sides when the selection changes: only the columns that change side.

For each matrix, with the old and the new selected columns (both ascending):

- *staying* columns keep their device master and moments (a device-side gather into the new state);
- *leaving* columns go down: their device master and moments overwrite the parked host values;
- *entering* columns come up: their host master and moments (current: they were host-bound) go to the device.

All matrices' leaving columns are gathered on the device into one buffer and copied down with one copy, all
entering columns are gathered on the host into one pinned buffer and copied up with one copy; one
synchronisation waits for both before the host scatters the leaving values (no per-matrix syncs). Entering and
leaving columns are disjoint, so the host gather and the host scatter never touch the same values.

Under data parallel a rank holds the host state of its own rows only: it copies down its rows of the leaving
columns and up its rows of the entering ones; the entering columns' other rows come from their owners through
one sum all-reduce of a zero-filled buffer (each element has exactly one non-zero contributor, so the sum is
exact), the refresh's only collective besides the selection's broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.layout import GroupHostBuffers
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.streams import Lanes

_ROWS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class Moved:
    d2h_bytes: int = 0
    h2d_bytes: int = 0


@dataclass
class _Plan:
    state: SelectedState
    new_selected: torch.Tensor
    stay_old: torch.Tensor
    stay_new: torch.Tensor
    leave_old: torch.Tensor
    leaving: torch.Tensor
    enter_new: torch.Tensor
    entering: torch.Tensor


def _plan(state: SelectedState, new_selected: torch.Tensor) -> _Plan:
    cols = state.slot.cols
    old_selected = state.selected_host
    in_new = torch.zeros(cols, dtype=torch.bool)
    in_new[new_selected] = True
    in_old = torch.zeros(cols, dtype=torch.bool)
    in_old[old_selected] = True
    stays_old = in_new[old_selected]
    stays_new = in_old[new_selected]
    return _Plan(
        state=state,
        new_selected=new_selected,
        stay_old=stays_old.nonzero().flatten(),
        stay_new=stays_new.nonzero().flatten(),
        leave_old=(~stays_old).nonzero().flatten(),
        leaving=old_selected[~stays_old],
        enter_new=(~stays_new).nonzero().flatten(),
        entering=new_selected[~stays_new],
    )


def migrate(
    lanes: Lanes,
    updater: DeviceUpdater,
    host_buffers: Sequence[GroupHostBuffers],
    new_selected: Sequence[torch.Tensor],
    ranks: Ranks | None = None,
) -> Moved:
    """Install ``new_selected`` (per matrix in layout order: ascending CPU int64 indices) as the selection.

    Runs with no host work in flight. Replaces each matrix's :class:`SelectedState`; counts do not move.
    """
    device = lanes.device
    ranks = ranks or Ranks()
    plans = [_plan(state, selected) for state, selected in zip(updater.matrix_states(), new_selected)]
    moved = Moved()
    leave_total = sum(p.state.slot.host_rows * p.leaving.numel() for p in plans)
    enter_total = sum(p.state.slot.host_rows * p.entering.numel() for p in plans)
    # one pinned host buffer each way, [3, elements]: master, exp_avg, exp_avg_sq (this rank's rows)
    leaving_host = lanes.empty_host(3 * leave_total, torch.float32).view(3, leave_total)
    entering_host = lanes.empty_host(3 * enter_total, torch.float32).view(3, enter_total)
    # host gather of the entering columns (current host values: those columns were host-bound)
    position = 0
    for plan in plans:
        numel = plan.state.slot.host_rows * plan.entering.numel()
        if numel:
            host = host_buffers[plan.state.slot.group_index]
            for row_index, name in enumerate(_ROWS):
                source = plan.state.slot.view2d(getattr(host, name)).index_select(1, plan.entering)
                entering_host[row_index, position : position + numel].copy_(source.reshape(-1))
        position += numel
    lanes.wait_compute(lanes.side)
    with lanes.on(lanes.side):
        # device gather of the leaving columns, one copy down; one copy up of the entering columns
        leaving_device = torch.empty(3, leave_total, dtype=torch.float32, device=device)
        position = 0
        for plan in plans:
            slot = plan.state.slot
            numel = slot.host_rows * plan.leaving.numel()
            if numel:
                leave_old = plan.leave_old.to(device)
                for row_index, name in enumerate(_ROWS):
                    columns = getattr(plan.state, name)[slot.row_start : slot.row_stop].index_select(1, leave_old)
                    leaving_device[row_index, position : position + numel].copy_(columns.reshape(-1))
            position += numel
        leaving_host.copy_(leaving_device, non_blocking=lanes.is_cuda)
        entering_device = entering_host.to(device, non_blocking=lanes.is_cuda)
        moved.d2h_bytes += leaving_host.nbytes
        moved.h2d_bytes += entering_host.nbytes
        if ranks.sharded:
            entering_device = _share_entering(entering_device, plans, ranks)
        position = 0
        for plan in plans:
            state = plan.state
            rows, k = state.slot.rows, plan.new_selected.numel()
            numel = rows * plan.entering.numel()
            stay_old, stay_new = plan.stay_old.to(device), plan.stay_new.to(device)
            enter_new = plan.enter_new.to(device)
            new_tensors = {}
            for row_index, name in enumerate(_ROWS):
                tensor = torch.empty(rows, k, dtype=torch.float32, device=device)
                if stay_new.numel():
                    tensor.index_copy_(1, stay_new, getattr(state, name).index_select(1, stay_old))
                if numel:
                    arrived = entering_device[row_index, position : position + numel].view(rows, -1)
                    tensor.index_copy_(1, enter_new, arrived)
                new_tensors[name] = tensor
            position += numel
            keep = torch.ones(state.slot.cols, dtype=torch.bool)
            keep[plan.new_selected] = False
            replacement = SelectedState(
                slot=state.slot,
                selected=plan.new_selected.to(device),
                unselected=keep.nonzero().flatten().to(device),
                selected_host=plan.new_selected.clone(),
                step_count=state.step_count,
                **new_tensors,
            )
            updater.selected[state.slot.group_index][state.slot.index_in_group] = replacement
    # host wait for the copies both ways (the pinned buffers must outlive them; the host scatter needs the values)
    lanes.synchronize()
    position = 0
    for plan in plans:
        numel = plan.state.slot.host_rows * plan.leaving.numel()
        if numel:
            host = host_buffers[plan.state.slot.group_index]
            for row_index, name in enumerate(_ROWS):
                values = leaving_host[row_index, position : position + numel].view(plan.state.slot.host_rows, -1)
                plan.state.slot.view2d(getattr(host, name)).index_copy_(1, plan.leaving, values)
        position += numel
    return moved


def _share_entering(own: torch.Tensor, plans: Sequence[_Plan], ranks: Ranks) -> torch.Tensor:
    """Data parallel: from this rank's rows of the entering columns (``[3, own elements]``, plan by plan) to all
    rows (``[3, all elements]``, plan by plan, each ``[rows, entering]``) on every rank: one sum all-reduce."""
    import torch.distributed as dist

    total = sum(p.state.slot.rows * p.entering.numel() for p in plans)
    full = torch.zeros(3, total, dtype=torch.float32, device=own.device)
    own_position = full_position = 0
    for plan in plans:
        slot, n = plan.state.slot, plan.entering.numel()
        own_numel = slot.host_rows * n
        if own_numel:
            start = full_position + slot.row_start * n
            full[:, start : start + own_numel].copy_(own[:, own_position : own_position + own_numel])
        own_position += own_numel
        full_position += slot.rows * n
    if total:
        dist.all_reduce(full, group=ranks.group)
    return full
