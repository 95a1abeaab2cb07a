"""The interim moves' part of the exact-resume state (``engine/state.py``): a state saved under interim moves loaded
under the paper's rule, a step in flight absorbed by matrices now entirely on the device, and the moves' statistics
and the selected columns' device masters at a load. Their host masters are not the weights under interim moves:
``docs/update_rule.md``, "Interim moves"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

ZenFlowEngine = Any
"""The engine (``engine/state.py``'s ``ZenFlowEngine`` protocol; not imported: state.py imports this room)."""


def masters_from_interim_state(engine: ZenFlowEngine, group_index: int, pending: object, params: Mapping) -> None:
    """A state saved with interim moves, loaded under the paper's rule: its host masters are set from the weights,
    where they live under interim moves, and a step in flight becomes the new masters it lands as
    (``weights * decay + step``), so it lands by the paper's copy. Before the selection is installed."""
    host = engine.host_buffers[group_index]
    landing = {}
    if pending is not None and pending.scales is not None:
        landing = dict(zip(pending.active[group_index], pending.scales[group_index]))
        pending.scales[group_index] = []
    with torch.no_grad():
        for index, slot in enumerate(engine.layout[group_index].matrices):
            own = slot.param.detach().view(slot.rows, slot.cols)[slot.row_start : slot.row_stop].cpu()
            master = slot.view2d(host.master)
            if index in landing:
                scale = landing[index]
                saved_selected = params[slot.name]["selected"].to(torch.long)
                device_columns = master.index_select(1, saved_selected)  # the saved device masters
                master.copy_((own if scale == 1.0 else own * scale) + master)
                master.index_copy_(1, saved_selected, device_columns)
            else:
                master.copy_(own)
    if pending is not None and pending.scales is not None and not any(pending.scales):
        pending.scales = None


def absorb_interim_steps(engine: ZenFlowEngine, pending: object, all_on_device: list, params: Mapping) -> None:
    """Interim moves on both sides of a load, and a matrix with a saved step in flight now entirely on the device: the
    step lands at the load (weights decayed plus the step, the saved device columns as they were), into the weights
    and the device masters, as the paper's rule takes such an update into the device masters."""
    states = engine.device_updater.selected
    with torch.no_grad():
        for group_index, (indices, scales) in enumerate(zip(pending.active, pending.scales)):
            host = engine.host_buffers[group_index]
            for index, scale in zip(indices, scales):
                if not all_on_device[group_index][index]:
                    continue
                state = states[group_index][index]
                slot = state.slot
                weights2d = slot.param.data.view(slot.rows, slot.cols)
                own = weights2d[slot.row_start : slot.row_stop]
                step = slot.view2d(host.master).to(own.device)
                saved_selected = params[slot.name]["selected"].to(device=own.device, dtype=torch.long)
                kept = own.index_select(1, saved_selected)
                own.mul_(scale).add_(step)
                own.index_copy_(1, saved_selected, kept)
                engine.ranks.share_rows_many([weights2d])
                state.master.copy_(weights2d.index_select(1, state.selected))


def load_interim(engine: ZenFlowEngine, entries: Mapping[str, Mapping]) -> None:
    """``interim_step``: the moves' statistics by name, and the selected columns' device masters from the weights
    where the weights are the masters: every selected column with fp32 weights; with bf16 weights only the columns
    that were host columns when the state was saved (the others took their saved fp32 device masters at the
    migration, which the bf16 weights only round)."""
    if engine.interim is None:
        return
    with torch.no_grad():
        for state in engine.device_updater.matrix_states():
            entry = entries.get(state.slot.name, {})
            engine.interim.load(entry, state)
            if not state.k:
                continue
            weights2d = state.slot.param.detach().view(state.slot.rows, state.slot.cols)
            if weights2d.dtype == torch.float32 or "selected" not in entry:
                state.master.copy_(weights2d.index_select(1, state.selected))
                continue
            was_host = ~torch.isin(state.selected_host, entry["selected"].to(torch.long))
            if was_host.any():
                positions = was_host.nonzero().flatten().to(state.master.device)
                columns = state.selected.index_select(0, positions)
                state.master.index_copy_(1, positions, weights2d.index_select(1, columns).float())
