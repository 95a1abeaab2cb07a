"""The parts of the exact-resume state (``engine/state.py``) that depend on where the masters of host columns live:
the weights and the selected columns' device state at a load, the host update in flight at a load, the selection when
a run resumes with another ``topk_ratio``, and the interim moves' statistics.

Where the weights are the masters (the default, ``docs/update_rule.md``), a computed host update that has not landed
is a *step* in the window row, saved as the parameter's ``"step"`` and added at its landing; where the host keeps
fp32 masters, it is the updated master itself, and its staged weights are rebuilt at a load. A state saved one way
loads the other way too (another ``host_state``, interim moves switched): the step becomes a master
(``weights * scale + step``) or the master a step (``master - weights``, landing with scale 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_zenflow.config import num_selected_columns
from lightning_zenflow.engine.layout import MatrixSlot, staging_view
from lightning_zenflow.engine.state_checks import MOMENTS

ZenFlowEngine = Any
"""The engine (``engine/state.py``'s ``ZenFlowEngine`` protocol; not imported: state.py imports this room)."""


def _weights_rows(slot: Any) -> torch.Tensor:
    return slot.param.detach().view(slot.rows, slot.cols)[slot.row_start : slot.row_stop].float().cpu()


def pending_steps(
    engine: ZenFlowEngine,
    pending: Any,
    params: Mapping[str, Mapping],
    own: Callable[[Any, torch.Tensor], torch.Tensor],
) -> dict[tuple[int, int], torch.Tensor]:
    """The saved host update in flight as this engine lands it. Step landings: ``{(group, matrix): this rank's rows of
    the step}`` (a state saved with masters gives ``master - weights``, landing with scale 1). Master landings (the
    host keeps masters): the saved step is applied to the host's masters here (after they were loaded), and nothing
    is returned. Before the selection is installed (it reads the host masters)."""
    if pending is None:
        return {}
    steps = {}
    saved_steps = pending.scales is not None
    for group_index, (group, host) in enumerate(zip(engine.layout, engine.host_buffers)):
        for position, index in enumerate(pending.active[group_index]):
            slot = group.matrices[index]
            entry = params[slot.name]
            if host.master is None:
                if saved_steps:
                    steps[(group_index, index)] = own(slot, entry["step"]).float()
                else:
                    steps[(group_index, index)] = own(slot, entry["master"]).float() - _weights_rows(slot)
            elif saved_steps:
                scale = pending.scales[group_index][position]
                master = slot.view2d(host.master)
                master.copy_(_weights_rows(slot) * scale + own(slot, entry["step"]).float())
    hosts = engine.host_buffers
    if all(host.master is None for host in hosts) and not saved_steps:
        pending.scales = [[1.0] * len(active) for active in pending.active]
    elif any(host.master is not None for host in hosts):
        pending.scales = None
    return steps


def stage_pending(engine: ZenFlowEngine, pending: Any, steps: Mapping[tuple[int, int], torch.Tensor]) -> None:
    """Put the host update in flight where its landing reads it: each step into the window row it was computed in,
    or, with masters, the weights staged from them (for a model that is not fp32; fp32 weights go up from the
    master itself)."""
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for index in pending.active[group_index]:
            slot = group.matrices[index]
            if host.master is None:
                slot.view2d(host.grad_acc(pending.slot)).copy_(steps[(group_index, index)])
            elif slot.param.dtype != torch.float32:
                staging_view(host.grad_acc(pending.slot), slot, slot.param.dtype).copy_(slot.view2d(host.master))


def steps_across_a_new_selection(
    engine: ZenFlowEngine, pending: Any, steps: dict[tuple[int, int], torch.Tensor], params: Mapping[str, Mapping]
) -> None:
    """A step in flight loaded with another selection than it was computed with (``topk_ratio`` changed): a column
    that enters the device takes its step into its device master now (the landing restores device columns from
    their masters), and a column that leaves it gets the step that leaves its weight as it is (its step was computed
    while it was parked, and the landing decays every column of the rows it lands)."""
    for group_index, (indices, scales) in enumerate(zip(pending.active, pending.scales)):
        for index, scale in zip(indices, scales):
            step = steps.get((group_index, index))
            if step is None:
                continue
            state = engine.device_updater.selected[group_index][index]
            slot = state.slot
            saved_selected = params[slot.name]["selected"].to(torch.long)
            leaving = saved_selected[~torch.isin(saved_selected, state.selected_host)]
            if leaving.numel():
                weights = _weights_rows(slot).index_select(1, leaving)
                step.index_copy_(1, leaving, weights - weights * scale)
            entering = ~torch.isin(state.selected_host, saved_selected)
            if entering.any() and slot.row_stop - slot.row_start == slot.rows:
                positions = entering.nonzero().flatten()
                columns = state.selected_host.index_select(0, positions)
                with torch.no_grad():
                    masters = state.master.index_select(1, positions.to(state.master.device))
                    landed = masters * scale + step.index_select(1, columns).to(masters.device)
                    state.master.index_copy_(1, positions.to(state.master.device), landed)


def absorb_steps(
    engine: ZenFlowEngine,
    pending: Any,
    all_on_device: list,
    steps: Mapping[tuple[int, int], torch.Tensor],
    params: Mapping[str, Mapping],
) -> None:
    """A saved step in flight of a matrix that is now entirely on the device (a resume with ``topk_ratio=1``) lands
    at the load: the weights decayed plus the step, the saved device columns as they were, into the weights and the
    device masters (as a migration takes a host master into the device's)."""
    states = engine.device_updater.selected
    with torch.no_grad():
        for group_index, (indices, scales) in enumerate(zip(pending.active, pending.scales)):
            for index, scale in zip(indices, scales):
                if not all_on_device[group_index][index] or (group_index, index) not in steps:
                    continue
                state = states[group_index][index]
                slot = state.slot
                weights2d = slot.param.data.view(slot.rows, slot.cols)
                own = weights2d[slot.row_start : slot.row_stop]
                step = steps[(group_index, index)].to(own.device)
                saved_selected = params[slot.name]["selected"].to(device=own.device, dtype=torch.long)
                kept = own.index_select(1, saved_selected)
                own.copy_(own.float() * scale + step)
                own.index_copy_(1, saved_selected, kept)
                engine.ranks.share_rows_many([weights2d])
                was_host = ~torch.isin(state.selected_host, saved_selected.cpu())
                if was_host.any():
                    positions = was_host.nonzero().flatten().to(state.master.device)
                    columns = state.selected.index_select(0, positions)
                    state.master.index_copy_(1, positions, weights2d.index_select(1, columns).float())


def load_interim(engine: ZenFlowEngine, entries: Mapping[str, Mapping]) -> None:
    """``interim_step``: the moves' statistics by name (a state without them starts them afresh)."""
    if engine.interim is None:
        return
    for state in engine.device_updater.matrix_states():
        engine.interim.load(entries.get(state.slot.name, {}), state)


def device_state_from(engine: ZenFlowEngine, saved: Mapping[str, Mapping[str, torch.Tensor]], row_blocks: bool) -> None:
    """The selected columns' device masters and moments from the saved fp32 values (``{name: {key: [rows, cols]}}``,
    or this rank's ``[host_rows, cols]`` with ``row_blocks``), where the host holds them narrower than the saved
    values: a migration took them from there (bf16 moments), or from the weights (the weights are the masters of host
    columns, rounded to the model's dtype). Data parallel row blocks: the rows of every rank, one sum all-reduce per
    value (collective: every rank calls this)."""
    for group_index, host in enumerate(engine.host_buffers):
        keys = [] if host.master is not None else ["master"]
        keys += [key for key in MOMENTS if getattr(host, key).dtype != torch.float32]
        if not keys:
            continue
        for state in engine.device_updater.selected[group_index]:
            slot = state.slot
            values = saved.get(slot.name)
            if values is None or not state.k:
                continue
            for key in keys:
                columns = values[key].reshape(-1, slot.cols).index_select(1, state.selected_host).float()
                if row_blocks and engine.ranks.sharded:
                    whole = torch.zeros(slot.rows, state.k, dtype=torch.float32)
                    whole[slot.row_start : slot.row_stop] = columns
                    columns = engine.ranks.all_reduce_sum(whole, engine.device)
                with torch.no_grad():
                    getattr(state, key).copy_(columns.to(state.master.device))
            with torch.no_grad():
                engine.device_updater.write_selected(state)


def weights_from_masters(engine: ZenFlowEngine, params: Mapping, row_blocks: bool) -> None:
    """Where the weights are the masters of host columns, the saved masters go into the weights: the state is
    authoritative, as a host master would be (in a checkpoint they are the weights saved beside it, so this writes
    what is there already). Data parallel row blocks: each rank writes its rows, then the ranks share them
    (collective: every rank calls this)."""
    for group_index, group in enumerate(engine.layout):
        if engine.host_buffers[group_index].master is not None:
            continue
        for slot in group.matrices:
            saved = params[slot.name]["master"]
            with torch.no_grad():
                weights2d = slot.param.data.view(slot.rows, slot.cols)
                if row_blocks:
                    own_rows = weights2d[slot.row_start : slot.row_stop]
                    own_rows.copy_(saved.reshape(slot.host_rows, slot.cols).to(own_rows.device))
                    if engine.ranks.sharded:
                        engine.ranks.share_rows_many([weights2d])
                else:
                    weights2d.copy_(saved.reshape(slot.rows, slot.cols).to(weights2d.device))


def selection_changes(engine: ZenFlowEngine, slot: MatrixSlot, saved: torch.Tensor) -> bool:
    """Whether a resume with the configured ``topk_ratio`` chooses other columns than the saved ones."""
    if engine.schedule.last_select_t is None:
        return False
    return num_selected_columns(slot.cols, engine.config.topk_ratio) != saved.numel()


def selection_for_ratio(
    engine: ZenFlowEngine, slot: MatrixSlot, saved: torch.Tensor, score: torch.Tensor
) -> torch.Tensor:
    """The columns to select after a resume: the saved ones, unless the run now has another ``topk_ratio``.

    Then each matrix gets the configured k at once (device memory follows the new ratio from the first step),
    changing as few columns as possible: a smaller k keeps the saved columns with the largest second moment
    (``score``: ``exp_avg_sq`` summed over the column, the running mean of its squared gradient, i.e. of its L2
    score); a larger k adds the unselected columns with the largest. Ties go to the lower index. The next refresh
    chooses from the gradient again. Before the first selection (warm-up) there is nothing to keep.
    """
    if engine.schedule.last_select_t is None:
        return saved
    k = num_selected_columns(slot.cols, engine.config.topk_ratio)
    if saved.numel() == k:
        return saved
    if k < saved.numel():
        ranked = torch.sort(score[saved], descending=True, stable=True).indices
        chosen = saved[ranked[:k]]
    else:
        others = torch.ones(slot.cols, dtype=torch.bool)
        others[saved] = False
        candidates = others.nonzero().flatten()
        ranked = torch.sort(score[candidates], descending=True, stable=True).indices
        chosen = torch.cat([saved, candidates[ranked[: k - saved.numel()]]])
    return torch.sort(chosen).values


def without_leaving(
    window_sum: torch.Tensor, slot: MatrixSlot, saved: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """The open window's sum for a matrix whose selection changed at load. Columns that leave the device had their
    gradients of this window applied there already: their sum starts from zero (it may hold them, whole rows are
    accumulated on the device). Columns that enter the device drop theirs: the device update cannot take a sum."""
    leaving = saved[~torch.isin(saved, chosen)]
    result = window_sum.reshape(-1, slot.cols).clone()
    result[:, leaving] = 0.0
    return result.reshape(window_sum.shape)
