"""The parts of the exact-resume state (``engine/state.py``) that depend on where the masters of host columns live:
the host update in flight at a load, and the interim moves' statistics.

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

from lightning_zenflow.engine.layout import staging_view

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
