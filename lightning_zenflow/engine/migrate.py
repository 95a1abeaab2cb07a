"""Moving optimizer state between the sides when the selection changes: only the columns that change side.

For each matrix, with the old and the new selected columns (both ascending):

- *staying* columns keep their device master and moments (a device-side gather into the new state);
- *leaving* columns go down: their device moments overwrite the parked host values (rounded to nearest when the host
  keeps them in bf16), and so does their device master where the host keeps masters; elsewhere the weights are the
  masters of host columns, and the device update has written the master into them at every step;
- *entering* columns come up: their host moments (current: they were host-bound) go to the device, widened to fp32;
  their master comes from the host's master where there is one, else from the weights (on the device).

Per param group, matrices go in chunks of at most :data:`MIGRATION_CHUNK_ELEMENTS` selected elements (a matrix larger
than that alone): a chunk's leaving columns are gathered on the device into one buffer and copied down with one
copy, its entering columns are gathered on the host and copied up with one copy, and every index the device needs
goes up in one copy; one synchronisation waits for all of them before the host scatters the leaving values (no
per-matrix syncs). The chunks bound a selection's device transient (the arriving columns, the new state beside the
old) to a constant or one matrix's share, not the model's: the old state of a chunk's matrices is released before
the next chunk arrives. Chunks change no value: each matrix's migration is independent of the others'. The host
side stages through the group's window rows, idle at a selection (shared, and pinned on CUDA), so a selection
usually allocates no new pinned memory (:func:`staging_buffers`). Entering and leaving
columns are disjoint, so the host gather and the host scatter never touch the same values.

Under data parallel a rank holds the host state of its own rows only: it copies down its rows of the leaving
columns and up its rows of the entering ones; the entering columns' other rows come from their owners through
one sum all-reduce per param group of a zero-filled buffer (each element has exactly one non-zero contributor, so
the sum is exact), the refresh's only collectives besides the selection's broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import GroupHostBuffers
from lightning_zenflow.engine.ranks import Ranks

MIGRATION_CHUNK_ELEMENTS = 1 << 23
"""Selected elements (rows x selected columns) of the matrices one chunk of a migration moves at once: with the 24 B
(36 B under data parallel) a selected element holds for a moment, a transient of about 200 (300) MiB."""

MOMENT_ROWS = ("exp_avg", "exp_avg_sq")


def _rows(host: GroupHostBuffers) -> list[tuple[str, torch.dtype]]:
    """The host rows a migration moves, with their dtypes: the moments, and the master where there is one."""
    rows = [(name, getattr(host, name).dtype) for name in MOMENT_ROWS]
    return rows + ([("master", torch.float32)] if host.master is not None else [])


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

    Runs with no host work in flight (a selection is a synchronisation point: it waits for every lane first).
    Replaces each matrix's :class:`SelectedState`; counts do not move.
    """
    ranks = ranks or Ranks()
    plans = [_plan(state, selected) for state, selected in zip(updater.matrix_states(), new_selected)]
    moved = Moved()
    # host wait for every lane: the host block is read and written below, and nothing may still use it
    lanes.synchronize()
    by_group = [[p for p in plans if p.state.slot.group_index == index] for index in range(len(host_buffers))]
    del plans
    for host, group_plans in zip(host_buffers, by_group):
        for chunk in migration_chunks(
            [p.state.slot.rows * p.new_selected.numel() for p in group_plans], MIGRATION_CHUNK_ELEMENTS
        ):
            _migrate_group(lanes, updater, host, [group_plans[i] for i in chunk], ranks, moved)
            for i in chunk:  # the replaced state goes (the updater holds the new one): the next chunk reuses its memory
                group_plans[i].state = None  # type: ignore[assignment]
    return moved


def migration_chunks(selected_elements: Sequence[int], limit: int = MIGRATION_CHUNK_ELEMENTS) -> list[list[int]]:
    """Consecutive runs of matrices (their positions) whose selected elements sum to at most ``limit``, or one
    matrix alone where it is larger. Under data parallel every rank holds the same matrices' whole rows and the same
    selection, so every rank cuts the same chunks (their collectives match)."""
    chunks: list[list[int]] = []
    total = 0
    for index, size in enumerate(selected_elements):
        if not chunks or total + size > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(index)
        total += size
    return chunks


def peak_chunk_elements(selected_elements: Sequence[int], limit: int = MIGRATION_CHUNK_ELEMENTS) -> int:
    """The selected elements of the largest chunk :func:`migration_chunks` cuts: what a selection's transient scales
    with."""
    return max(
        (sum(selected_elements[i] for i in chunk) for chunk in migration_chunks(selected_elements, limit)), default=0
    )


def staging_buffers(
    lanes: Lanes, host: GroupHostBuffers, leave_total: int, enter_total: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Host staging for one group's migration: per moved row, a ``[leave_total]`` and an ``[enter_total]`` view in its
    dtype.

    At a selection nothing is in flight, so the group's window rows are idle (the open window's sum is on the device,
    or, in host mode, its first step overwrites its own row; the other row's update has landed): they are the staging
    area, already shared and, on CUDA, pinned. Larger moves take a new pinned buffer (torch caches those for the rest
    of the run)."""
    rows = _rows(host)
    sizes = [torch.empty((), dtype=dtype).element_size() for _, dtype in rows]
    need = sum(size * (leave_total + enter_total) for size in sizes)
    idle = max((window.view(torch.uint8) for window in host.windows), key=torch.numel, default=None)
    flat = idle if idle is not None and need <= idle.numel() else lanes.empty_host(max(1, need), torch.uint8)
    leaving, entering, position = {}, {}, 0
    for (name, dtype), size in zip(rows, sizes):
        # every view starts at a multiple of its item size (the sizes come largest first: masters are last)
        leaving[name] = flat[position : position + size * leave_total].view(dtype)
        position += size * leave_total
        entering[name] = flat[position : position + size * enter_total].view(dtype)
        position += size * enter_total
    return leaving, entering


def _migrate_group(
    lanes: Lanes,
    updater: DeviceUpdater,
    host: GroupHostBuffers,
    plans: Sequence[_Plan],
    ranks: Ranks,
    moved: Moved,
) -> None:
    device = lanes.device
    rows = _rows(host)
    leave_total = sum(p.state.slot.host_rows * p.leaving.numel() for p in plans)
    enter_total = sum(p.state.slot.host_rows * p.entering.numel() for p in plans)
    leaving_host, entering_host = staging_buffers(lanes, host, leave_total, enter_total)
    # host gather of the entering columns (current host values: those columns were host-bound)
    position = 0
    for plan in plans:
        numel = plan.state.slot.host_rows * plan.entering.numel()
        if numel:
            for name, _ in rows:
                source = plan.state.slot.view2d(getattr(host, name)).index_select(1, plan.entering)
                entering_host[name][position : position + numel].copy_(source.reshape(-1))
        position += numel
    # every index the device needs, in one upload from pinned memory (not six small copies per matrix)
    index_parts = [part for p in plans for part in (p.leave_old, p.stay_old, p.stay_new, p.enter_new, p.new_selected)]
    index_parts += [_complement(p.new_selected, p.state.slot.cols) for p in plans]
    index_parts += [p.entering for p in plans]
    sizes = [int(part.numel()) for part in index_parts]
    indices_host = lanes.empty_host(max(1, sum(sizes)), torch.long)
    if sizes and sum(sizes):
        torch.cat(index_parts, out=indices_host[: sum(sizes)])
    moved.d2h_bytes += sum(view.nbytes for view in leaving_host.values())
    moved.h2d_bytes += sum(view.nbytes for view in entering_host.values())
    box: dict[str, object] = {}
    # side waits (GPU-side) for the compute lane's gradients and weights
    lanes.side.wait_lane(lanes.compute, "side after compute")
    lanes.side.run(_gather_and_copy, box, plans, indices_host, sizes, leaving_host, entering_host, device)
    if ranks.sharded:
        lanes.collective(lanes.side, _share_entering_into, box, plans, ranks)
    lanes.side.run(_install, box, plans, updater, device)
    # host wait for the copies both ways (the staging must outlive them; the host scatter needs the values)
    lanes.synchronize()
    position = 0
    for plan in plans:
        numel = plan.state.slot.host_rows * plan.leaving.numel()
        if numel:
            for name, _ in rows:
                values = leaving_host[name][position : position + numel].view(plan.state.slot.host_rows, -1)
                plan.state.slot.view2d(getattr(host, name)).index_copy_(1, plan.leaving, values)
        position += numel


def _gather_and_copy(
    box: dict,
    plans: Sequence[_Plan],
    indices_host: torch.Tensor,
    sizes: Sequence[int],
    leaving_host: dict[str, torch.Tensor],
    entering_host: dict[str, torch.Tensor],
    device: torch.device,
) -> None:
    """Side lane: the indices up, the leaving columns gathered and copied down, the entering columns copied up."""
    non_blocking = device.type == "cuda"
    indices = indices_host[: max(1, sum(sizes))].to(device, non_blocking=non_blocking)
    parts = iter(torch.split(indices[: sum(sizes)], list(sizes)))
    per_plan = [tuple(next(parts) for _ in range(5)) for _ in plans]
    unselected = [next(parts) for _ in plans]
    entering_columns = [next(parts) for _ in plans]
    box["indices"] = indices  # alive until the copies that read it are done
    box["per_plan"] = per_plan
    box["unselected"] = unselected
    box["entering_columns"] = entering_columns
    leaving_device = {}
    for name, host_view in leaving_host.items():
        leaving = torch.empty(host_view.numel(), dtype=host_view.dtype, device=device)
        position = 0
        for plan, (leave_old, _, _, _, _) in zip(plans, per_plan):
            slot = plan.state.slot
            numel = slot.host_rows * plan.leaving.numel()
            if numel:
                columns = getattr(plan.state, name)[slot.row_start : slot.row_stop].index_select(1, leave_old)
                leaving[position : position + numel].copy_(columns.reshape(-1))  # to the host's dtype: rounded
            position += numel
        host_view.copy_(leaving, non_blocking=non_blocking)
        leaving_device[name] = leaving
    box["leaving_device"] = leaving_device
    # the entering values arrive in the host's dtypes and are widened to fp32 here, one row of [kinds, total]
    arrived = [view.to(device, non_blocking=non_blocking).float() for view in entering_host.values()]
    box["entering"] = torch.stack(arrived) if arrived else torch.empty(0, 0, device=device)
    box["entering_names"] = list(entering_host)


def _share_entering_into(box: dict, plans: Sequence[_Plan], ranks: Ranks) -> None:
    box["entering"] = _share_entering(box["entering"], plans, ranks)


def _install(box: dict, plans: Sequence[_Plan], updater: DeviceUpdater, device: torch.device) -> None:
    """Side lane: each matrix's new state from its staying columns (device) and its entering ones (arrived; their
    master from the weights where the host keeps none)."""
    entering_device = box["entering"]
    names = box["entering_names"]
    position = 0
    for plan, (_, stay_old, stay_new, enter_new, selected), unselected, entering_columns in zip(
        plans, box["per_plan"], box["unselected"], box["entering_columns"]
    ):
        state = plan.state
        rows, k = state.slot.rows, plan.new_selected.numel()
        numel = rows * plan.entering.numel()
        new_tensors = {}
        for name in ("master", *MOMENT_ROWS):
            tensor = torch.empty(rows, k, dtype=torch.float32, device=device)
            if stay_new.numel():
                tensor.index_copy_(1, stay_new, getattr(state, name).index_select(1, stay_old))
            if numel:
                if name in names:
                    arrived = entering_device[names.index(name), position : position + numel].view(rows, -1)
                else:
                    # the weights are the masters of host columns
                    weights2d = state.slot.param.detach().view(rows, state.slot.cols)
                    arrived = weights2d.index_select(1, entering_columns).float()
                tensor.index_copy_(1, enter_new, arrived)
            new_tensors[name] = tensor
        position += numel
        replacement = SelectedState(
            slot=state.slot,
            selected=selected,
            unselected=unselected,
            selected_host=plan.new_selected.clone(),
            step_count=state.step_count,
            scratch=torch.empty(rows, k, dtype=torch.float32, device=device),
            **new_tensors,
        )
        updater.selected[state.slot.group_index][state.slot.index_in_group] = replacement


def _complement(selected: torch.Tensor, cols: int) -> torch.Tensor:
    keep = torch.ones(cols, dtype=torch.bool)
    keep[selected] = False
    return keep.nonzero().flatten()


def _share_entering(own: torch.Tensor, plans: Sequence[_Plan], ranks: Ranks) -> torch.Tensor:
    """Data parallel: from this rank's rows of the entering columns (``[kinds, own elements]``, plan by plan) to all
    rows (``[kinds, all elements]``, plan by plan, each ``[rows, entering]``) on every rank: one sum all-reduce."""
    import torch.distributed as dist

    total = sum(p.state.slot.rows * p.entering.numel() for p in plans)
    full = torch.zeros(own.shape[0], total, dtype=torch.float32, device=own.device)
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
