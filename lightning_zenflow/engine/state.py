"""Engine state: the exact-resume state dict, and conversion to and from torch's AdamW format.

The engine state is keyed by parameter name and validated on load (names and shapes). For every trainable
parameter it holds the fp32 master, the moments and the per-side step counts, merged from the device
(selected columns, device-only parameters) and the host (the other columns); for matrices also the
selected columns and, mid-window, the open window's accumulated gradient. ``progress`` holds the position
in the rule: step, window, accumulator slot, the host update that is computed but not yet applied.

Taking the state waits for a host update in flight to finish computing and never applies it early, so a
run continued from the state is bitwise the uninterrupted run. The staged upload of a computed update is
not stored: it is the master cast to the model dtype, and is rebuilt on load.

Loading checks everything first (:func:`check_state`: names, shapes, the selection, the progress) and writes
nothing when a check fails; the strategy runs the same checks on a checkpoint file before Lightning loads any of
it (:func:`state_dict_mismatch` for the model weights, :func:`unreadable_checkpoint` for a file torch cannot read).
A state saved with another ``topk_ratio`` is loaded with the new one (``docs/update_rule.md``, "Resuming with
other knobs").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine.device import DeviceUpdater
from lightning_zenflow.engine.export import adamw_state, add_exact_inverses, restore_exported
from lightning_zenflow.engine.interim import InterimMoves
from lightning_zenflow.engine.layout import GroupHostBuffers, GroupLayout, MatrixSlot
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.schedule import Schedule
from lightning_zenflow.engine.state_checks import MOMENTS, STATE_VERSION, check_progress, check_state, moments_by_name
from lightning_zenflow.engine.state_masters import (
    absorb_steps,
    device_state_from,
    load_interim,
    pending_steps,
    selection_changes,
    selection_for_ratio,
    stage_pending,
    steps_across_a_new_selection,
    weights_from_masters,
    without_leaving,
)


class ZenFlowEngine(Protocol):
    """What this module reads and calls of the engine (``engine/engine.py``): its public surface, nothing private."""

    optimizer: torch.optim.Optimizer
    config: ZenFlowConfig
    ranks: Ranks
    device: torch.device
    layout: list[GroupLayout]
    schedule: Schedule
    host_buffers: list[GroupHostBuffers]
    device_updater: DeviceUpdater
    interim: InterimMoves | None
    merge_cache: tuple | None
    parked: dict[str, dict]

    @property
    def closed(self) -> bool: ...
    def wait_idle(self) -> None: ...
    def flush(self) -> None: ...
    def rebuild(self, relayout: bool) -> None: ...
    def restart(self) -> None: ...
    def is_fresh(self) -> bool: ...
    def state_point(self) -> tuple[int, int, int, int]: ...
    def synchronize_device(self) -> None: ...
    def install_selection(self, selected: list[torch.Tensor], device_steps: list[int]) -> None: ...
    def window_sums(self, row_blocks: bool = False) -> dict[str, torch.Tensor]: ...
    def restore_window_sums(self, sums: Mapping[str, torch.Tensor], row_blocks: bool = False) -> None: ...


def _merged_once(engine: ZenFlowEngine, include_moments: bool) -> dict[str, dict]:
    """:func:`_merged`, taken once per point of the run: a checkpoint asks for the torch-format state and then for
    the engine's (without moments), and the second reuses the first's merge (12 B per element of clones on rank 0,
    and under data parallel 3 broadcasts per matrix, not twice). Cleared at the next step (``engine.merge_cache``).
    Entries are copied shallowly, so callers may drop keys."""
    key = engine.state_point()
    cached = engine.merge_cache
    if cached is not None and cached[0] == key and (cached[1] or not include_moments):
        merged = cached[2]
    else:
        merged = _merged(engine, include_moments=include_moments)
        engine.merge_cache = (key, include_moments, merged)
    return {name: dict(entry) for name, entry in merged.items()}


def _merged(engine: ZenFlowEngine, row_blocks: bool = False, include_moments: bool = True) -> dict[str, dict]:
    """Per parameter name: fp32 master and moments (device values for device columns) and counts.

    Blocking device -> host copies: a synchronisation point on CUDA, taken only at checkpoints. Data parallel:
    every rank's host rows are gathered to rank 0 (collectives: every rank calls this at the same point), so the
    state is the same whatever the number of ranks, and any number of ranks can resume it; the other ranks take
    part and get an empty dict (the convention of Lightning's consolidated optimizer states). ``row_blocks``: each
    matrix as this rank's row block instead, no collective, on every rank.
    """
    engine.synchronize_device()
    keep = row_blocks or engine.ranks.rank == 0
    pending = engine.schedule.pending
    merged = {}
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        stepping = set(pending.active[group_index]) if pending is not None and host.master is None else set()
        for index, state in enumerate(engine.device_updater.selected[group_index]):
            slot = state.slot
            entry = {}
            rows = [("master", _host_masters(slot, host), state.master)]
            if include_moments:
                rows += [("exp_avg", host.exp_avg, state.exp_avg), ("exp_avg_sq", host.exp_avg_sq, state.exp_avg_sq)]
            if index in stepping:
                # a computed step that has not landed: the worker wrote it over the window's sum
                rows.append(("step", host.grad_acc(pending.slot), None))
            for key, host_row, device_tensor in rows:
                own = host_row if host_row.dim() == 2 else slot.view2d(host_row)
                if row_blocks:
                    value = own.float().clone()
                else:
                    value = engine.ranks.gather_rows(own.float(), slot.rows, engine.device)
                    if value is None:
                        continue
                if state.k and device_tensor is not None:
                    device_rows = device_tensor[slot.row_start : slot.row_stop] if row_blocks else device_tensor
                    value.index_copy_(1, state.selected_host, device_rows.cpu())
                elif state.k:
                    value.index_fill_(1, state.selected_host, 0.0)  # a step of parked columns is never landed
                entry[key] = value if row_blocks else value.view(slot.param.shape)
            if not keep:
                continue
            entry.update(
                kind="matrix",
                columns=slot.cols,  # the matrix view's (a stack of expert matrices: not numel // shape[0])
                device_step=state.step,
                host_step=int(host.step_shared[slot.index_in_group]),
                selected=state.selected_host.clone(),
            )
            if engine.interim is not None:
                entry.update(engine.interim.state_of(slot.name))
            merged[slot.name] = entry
        if not keep:
            continue
        for state, device_entry in zip(engine.device_updater.device_only[group_index], group.device_only):
            merged[device_entry.name] = {
                "kind": "device",
                "master": state.master.detach().cpu().clone(),
                "device_step": state.step,
                "host_step": 0,
            }
            if include_moments:
                merged[device_entry.name]["exp_avg"] = state.exp_avg.cpu().clone()
                merged[device_entry.name]["exp_avg_sq"] = state.exp_avg_sq.cpu().clone()
    return merged


def _host_masters(slot: MatrixSlot, host: GroupHostBuffers) -> torch.Tensor:
    """This rank's rows of a matrix's masters as the host side holds them: the host's fp32 masters, or the weights
    (where they are the masters of the host columns)."""
    if host.master is not None:
        return slot.view2d(host.master)
    return slot.own(slot.param.detach()).cpu()


def engine_row_blocks(engine: ZenFlowEngine) -> dict:
    """The engine state with each matrix as this rank's row block (``[host_rows, cols]``: master, moments, the open
    window's sum), no collective: the sharded checkpoint format. ``row_blocks`` marks it; it loads only into an
    engine whose rank owns the same rows (the sharded checkpoint reader reshards before it loads)."""
    engine.wait_idle()
    params = _merged(engine, row_blocks=True)
    for name, block in engine.window_sums(row_blocks=True).items():
        params[name]["grad_acc"] = block
    return {
        "version": STATE_VERSION,
        "params": params,
        "progress": engine.schedule.state_dict(),
        "row_blocks": True,
        # FSDP2: every parameter (vectors too) is this rank's rows of a sharded one
        **({"rows_local": True} if engine.ranks.rows_local else {}),
        **_rule(engine),
    }


def carried_entries(engine: ZenFlowEngine) -> dict[str, dict]:
    """Every parameter's exact state as this rank holds it (row blocks of matrices; no collective), to carry into
    a new layout of the same engine (:func:`carry_into`). Taken with nothing in flight and no open window."""
    engine.wait_idle()
    return _merged(engine, row_blocks=True)


def carry_into(engine: ZenFlowEngine, entries: Mapping[str, dict], from_weights: set[str] = frozenset()) -> None:
    """Put carried states (:func:`carried_entries`) into a started engine with a new layout, by name. Parameters
    without one start as AdamW starts them (zero moments and counts, the weights as master, on the host). Names in
    ``from_weights`` take their master from the current weights instead of the carried one."""
    updater = engine.device_updater
    selected, device_steps, saved = [], [], {}
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for slot in group.matrices:
            entry = entries.get(slot.name)
            if entry is None or entry.get("kind") != "matrix":
                selected.append(torch.empty(0, dtype=torch.long))
                device_steps.append(0)
                continue
            saved[slot.name] = {key: entry[key] for key in MOMENTS}
            if slot.name not in from_weights:
                saved[slot.name]["master"] = entry["master"]
                if host.master is not None:
                    slot.view2d(host.master).copy_(entry["master"].reshape(slot.host_rows, slot.cols))
            else:
                saved[slot.name]["master"] = slot.own(slot.param.detach()).float().cpu()
            for key in MOMENTS:
                slot.view2d(getattr(host, key)).copy_(entry[key].reshape(slot.host_rows, slot.cols))
            host.step_shared[slot.index_in_group] = float(entry["host_step"])
            selected.append(entry["selected"].to(torch.long))
            device_steps.append(int(entry["device_step"]))
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            entry = entries.get(device_entry.name)
            if entry is None or entry.get("kind") != "device":
                continue
            with torch.no_grad():
                if device_entry.name not in from_weights:
                    state_entry.master.copy_(entry["master"])
                state_entry.exp_avg.copy_(entry["exp_avg"])
                state_entry.exp_avg_sq.copy_(entry["exp_avg_sq"])
                if state_entry.separate_master:
                    state_entry.param.data.copy_(state_entry.master)
            state_entry.step = int(entry["device_step"])
    engine.install_selection(selected, device_steps)
    device_state_from(engine, saved, row_blocks=True)
    load_interim(engine, entries)
    engine.synchronize_device()


def follow_param_groups(engine: ZenFlowEngine) -> None:
    """The optimizer's param groups or the set of trainable parameters changed (``add_param_group``, a
    ``requires_grad_`` flip): a sync boundary. The host work in flight and the open window are applied
    (``flush``), every parameter's exact state (fp32 master, moments, per-side counts, selection) is carried into a
    layout built from the groups as they are now, and the parameters that stopped training keep theirs (in
    ``engine.parked``) for when they train again. New parameters start as AdamW starts them; after warm-up, this
    step chooses every matrix's columns again (a refresh)."""
    engine.flush()
    current = carried_entries(engine)
    returning = set(engine.parked)
    carried = {**engine.parked, **current}
    old = engine.schedule
    engine.rebuild(relayout=True)
    names = {slot.name for group in engine.layout for slot in group.matrices}
    names |= {entry.name for group in engine.layout for entry in group.device_only}
    engine.parked = {name: entry for name, entry in carried.items() if name not in names}
    # a matrix new to the engine, or carried with a selection of another size (taken before the first selection,
    # parked while frozen), is chosen again: at this step, for every matrix (after warm-up)
    new_matrices = any(
        slot.name not in carried
        or carried[slot.name]["selected"].numel() != num_selected_columns(slot.cols, engine.config.topk_ratio)
        for group in engine.layout
        for slot in group.matrices
    )
    schedule = engine.schedule
    schedule.t, schedule.selections = old.t, old.selections
    schedule.interval, schedule.interval_decided = old.interval, old.interval_decided
    schedule.last_select_t = None if new_matrices else old.last_select_t
    # a parameter that trains again starts from its weights as they are (frozen, nothing moved them but the user)
    carry_into(engine, carried, from_weights=returning)


def engine_state_dict(engine: ZenFlowEngine, include_moments: bool) -> dict:
    # wait for the host update in flight to finish computing; applying it now would change the run
    engine.wait_idle()
    params = _merged_once(engine, include_moments)
    for name, window_sum in engine.window_sums().items():
        if name in params:  # data parallel: rank 0 only
            params[name]["grad_acc"] = window_sum
    add_exact_inverses(params, engine)  # the torch-format moments are rescaled (export.py): a resume undoes it
    if not include_moments:
        for entry in params.values():
            for key in MOMENTS:
                entry.pop(key, None)
    return {"version": STATE_VERSION, "params": params, "progress": engine.schedule.state_dict(), **_rule(engine)}


def _rule(engine: ZenFlowEngine) -> dict:
    """Marks a state saved with interim moves (their statistics are in it) and one whose host update in flight is a
    step (the weights are the masters of the host columns; docs/update_rule.md)."""
    marks = {"interim": True} if engine.interim is not None else {}
    if not any(host.master is not None for host in engine.host_buffers):
        marks["weights_are_masters"] = True
    return marks


def _param_names(engine: ZenFlowEngine) -> dict[str, torch.Tensor]:
    names = {}
    for group in engine.layout:
        for slot in group.matrices:
            names[slot.name] = slot.param
        for entry in group.device_only:
            names[entry.name] = entry.param
    return names


def _check_fresh(engine: ZenFlowEngine, what: str) -> None:
    """Loading replaces the whole state: an engine that has stepped (a Tuner's restore, a reload mid-fit) is rebuilt
    fresh first, its work in flight dropped, its worker restarted."""
    if engine.closed:
        raise RuntimeError(f"{what}: the ZenFlowEngine is not running; call start() first (and not after close()).")
    if not engine.is_fresh():
        engine.restart()


def _param_shapes(engine: ZenFlowEngine) -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in _param_names(engine).items()}


def _frozen_in_groups(engine: ZenFlowEngine, state: Mapping) -> list[torch.Tensor]:
    """Parameters that ``state`` holds and that are in the optimizer's groups but frozen now (Lightning's
    ``BaseFinetuning`` re-adds the groups of a backbone it unfroze when a fit resumes, with the backbone frozen
    again). Plain AdamW keeps their state; so does the engine (:func:`load_engine_state_dict`)."""
    saved = state.get("params") if isinstance(state, Mapping) else None
    if not isinstance(saved, Mapping):
        return []
    return [
        param
        for group in engine.optimizer.param_groups
        for param in group["params"]
        if not param.requires_grad and engine._names.get(id(param)) in saved
    ]


def load_engine_state_dict(engine: ZenFlowEngine, state: Mapping, torch_state: Mapping | None) -> None:
    _check_fresh(engine, "load_state_dict")
    frozen = _frozen_in_groups(engine, state)
    if not frozen:
        _load_engine_state_dict(engine, state, torch_state)
        return
    # loaded as saved, with those parameters trainable; at the next step the engine follows the groups as they are
    # (a sync boundary): the frozen ones are parked with their exact state, for when they train again
    for param in frozen:
        param.requires_grad_(True)
    try:
        engine.follow_optimizer()
        _load_engine_state_dict(engine, state, torch_state)
    finally:
        for param in frozen:
            param.requires_grad_(False)


def _check_columns(engine: ZenFlowEngine, params: Mapping[str, Mapping]) -> None:
    """A state's matrices were viewed with the columns this engine views them with (a stack of expert matrices is
    ``[E x out, in]``; a state taken under another view holds its selection in other columns)."""
    for group in engine.layout:
        for slot in group.matrices:
            saved = params[slot.name].get("columns")
            if saved is not None and int(saved) != slot.cols:
                raise ValueError(
                    f"the ZenFlow state views {slot.name} {tuple(slot.param.shape)} as a matrix of {int(saved)} "
                    f"columns, this run as one of {slot.cols}: it was saved under another expert_layouts (or by "
                    "another transformers version's experts). Resume with the same expert_layouts."
                )


def _load_engine_state_dict(engine: ZenFlowEngine, state: Mapping, torch_state: Mapping | None) -> None:
    engine.merge_cache = None
    # everything is validated before anything is written: a bad state leaves the engine untouched
    check_state(state, _param_shapes(engine))
    params = state["params"]
    check_progress(state["progress"], [len(group.matrices) for group in engine.layout])
    _check_columns(engine, params)
    moments = moments_by_name(engine.layout, engine.optimizer, torch_state) if torch_state is not None else {}
    moments = restore_exported(moments, params)  # the moments as the engine held them, bitwise (export.py)
    row_blocks = bool(state.get("row_blocks"))

    def own(slot: MatrixSlot, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(slot.host_rows, slot.cols) if row_blocks else slot.own(tensor)

    def moment(name: str, key: str) -> torch.Tensor:
        if key in params[name]:
            return params[name][key]
        if name in moments:
            return moments[name][key]
        raise ValueError(f"the ZenFlow state has no {key} for {name} and no torch optimizer state supplies it.")

    for group in engine.layout:
        for slot in group.matrices:
            for key in MOMENTS:
                moment(slot.name, key)
        for entry in group.device_only:
            for key in MOMENTS:
                moment(entry.name, key)
    engine.schedule.load_state_dict(
        state["progress"],
        keep_interval=None if engine.config.update_interval == "auto" else int(engine.config.update_interval),
    )
    updater = engine.device_updater
    selected, device_steps, saved_values = [], [], {}
    window_sums = {name: entry["grad_acc"] for name, entry in params.items() if "grad_acc" in entry}
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for slot in group.matrices:
            entry = params[slot.name]
            saved_values[slot.name] = {"master": entry["master"], **{key: moment(slot.name, key) for key in MOMENTS}}
            if host.master is not None:
                slot.view2d(host.master).copy_(own(slot, entry["master"]))
            slot.view2d(host.exp_avg).copy_(own(slot, moment(slot.name, "exp_avg")))
            exp_avg_sq = moment(slot.name, "exp_avg_sq").reshape(-1, slot.cols)
            slot.view2d(host.exp_avg_sq).copy_(own(slot, exp_avg_sq))
            host.step_shared[slot.index_in_group] = float(entry["host_step"])
            saved = entry["selected"].to(torch.long)
            score = exp_avg_sq.sum(dim=0)
            if row_blocks and selection_changes(engine, slot, saved):
                score = engine.ranks.all_reduce_sum(score, engine.device)  # every rank's rows
            chosen = selection_for_ratio(engine, slot, saved, score)
            if slot.name in window_sums and not torch.equal(chosen, saved):
                window_sums[slot.name] = without_leaving(window_sums[slot.name], slot, saved, chosen)
            selected.append(chosen)
            device_steps.append(int(entry["device_step"]))
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            entry = params[device_entry.name]
            with torch.no_grad():
                state_entry.master.copy_(entry["master"])
                state_entry.exp_avg.copy_(moment(device_entry.name, "exp_avg"))
                state_entry.exp_avg_sq.copy_(moment(device_entry.name, "exp_avg_sq"))
                if state_entry.separate_master:
                    state_entry.param.data.copy_(state_entry.master)
            state_entry.step = int(entry["device_step"])
    weights_from_masters(engine, params, row_blocks)
    pending = engine.schedule.pending
    steps = pending_steps(engine, pending, params, own)
    engine.install_selection(selected, device_steps)
    device_state_from(engine, saved_values, row_blocks=row_blocks)
    if pending is not None and pending.scales is not None:
        steps_across_a_new_selection(engine, pending, steps, params)
    load_interim(engine, params)
    engine.restore_window_sums(window_sums, row_blocks=row_blocks)
    if pending is not None:
        # a matrix now entirely on the device takes the computed update at once: nothing left to land
        flat = iter(selected)
        all_on_device = [[next(flat).numel() == slot.cols for slot in group.matrices] for group in engine.layout]
        if pending.scales is not None:
            absorb_steps(engine, pending, all_on_device, steps, params)
            pending.scales = [
                [scale for i, scale in zip(a, pending.scales[g]) if not all_on_device[g][i]]
                for g, a in enumerate(pending.active)
            ]
        pending.active = [[i for i in a if not all_on_device[g][i]] for g, a in enumerate(pending.active)]
        if not any(pending.active):
            engine.schedule.pending = None
    pending = engine.schedule.pending
    if pending is not None:
        pending.computed = True
        # after the selection's migration, which staged through the window rows: the update's result goes there
        stage_pending(engine, pending, steps)
    engine.synchronize_device()


def torch_state_dict(engine: ZenFlowEngine) -> dict:
    engine.wait_idle()
    merged = _merged_once(engine, include_moments=True)
    by_id = {id(param): name for name, param in _param_names(engine).items()}
    # torch's own state_dict for the param groups (an optimizer built on the engine overrides state_dict with this)
    layout_state = torch.optim.Optimizer.state_dict(engine.optimizer)
    state = {}
    position = 0
    for group in engine.optimizer.param_groups:
        for param in group["params"]:
            name = by_id.get(id(param))
            if name is not None and name in merged:  # data parallel: rank 0 only
                state[position] = adamw_state(merged[name], group["betas"])  # the host side's count made AdamW's
            position += 1
    return {"state": state, "param_groups": layout_state["param_groups"]}


def load_torch_state_dict(engine: ZenFlowEngine, torch_state: Mapping) -> None:
    _check_fresh(engine, "load_torch_state_dict")
    engine.merge_cache = None
    moments = moments_by_name(engine.layout, engine.optimizer, torch_state)
    updater = engine.device_updater
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for position, slot in enumerate(group.matrices):
            if slot.name not in moments:
                continue
            entry = moments[slot.name]
            slot.view2d(host.exp_avg).copy_(slot.own(entry["exp_avg"]))
            slot.view2d(host.exp_avg_sq).copy_(slot.own(entry["exp_avg_sq"]))
            host.step_shared[slot.index_in_group] = float(entry["step"])
            updater.selected[group_index][position].step = entry["step"]
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            if device_entry.name not in moments:
                continue
            entry = moments[device_entry.name]
            state_entry.exp_avg.copy_(entry["exp_avg"])
            state_entry.exp_avg_sq.copy_(entry["exp_avg_sq"])
            state_entry.step = entry["step"]
