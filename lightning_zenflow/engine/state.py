"""Engine state: the exact-resume state dict, and conversion to and from torch's AdamW format.

The engine state is keyed by parameter name and validated on load (names and shapes). For every trainable
parameter it holds the fp32 master, the moments and the per-side step counts, merged from the device
(selected columns, device-only parameters) and the host (the other columns); for matrices also the
selected columns and, mid-window, the open window's accumulated gradient. ``progress`` holds the position
in the rule: step, window, accumulator slot, the host update that is computed but not yet applied.

Taking the state waits for a host update in flight to finish computing and never applies it early, so a
run continued from the state is bitwise the uninterrupted run. The staged upload of a computed update is
not stored: it is the master cast to the model dtype, and is rebuilt on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from lightning_zenflow.engine.device import HyperParams, SelectedState
from lightning_zenflow.engine.layout import staging_view

if TYPE_CHECKING:
    from lightning_zenflow.engine.engine import ZenFlowEngine

STATE_VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")


def _merged(engine: ZenFlowEngine) -> dict[str, dict]:
    """Per parameter name: full fp32 master and moments (device values for device columns) and counts.

    Blocking device -> host copies: a synchronisation point on CUDA, taken only at checkpoints.
    """
    engine.synchronize_device()
    merged = {}
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for state in engine.device_updater.selected[group_index]:
            slot = state.slot
            entry = {}
            for key, host_row, device_tensor in (
                ("master", host.master, state.master),
                ("exp_avg", host.exp_avg, state.exp_avg),
                ("exp_avg_sq", host.exp_avg_sq, state.exp_avg_sq),
            ):
                full = slot.view2d(host_row).clone()
                if state.k:
                    full.index_copy_(1, state.selected.cpu(), device_tensor.cpu())
                entry[key] = full.view(slot.param.shape)
            entry.update(
                kind="matrix",
                device_step=state.step,
                host_step=int(host.step_shared[slot.index_in_group]),
                selected=state.selected.cpu().clone(),
            )
            merged[slot.name] = entry
        for state, device_entry in zip(engine.device_updater.device_only[group_index], group.device_only):
            merged[device_entry.name] = {
                "kind": "device",
                "master": state.master.detach().cpu().clone(),
                "exp_avg": state.exp_avg.cpu().clone(),
                "exp_avg_sq": state.exp_avg_sq.cpu().clone(),
                "device_step": state.step,
                "host_step": 0,
            }
    return merged


def engine_state_dict(engine: ZenFlowEngine, include_moments: bool) -> dict:
    engine._require_started()
    # wait for the host update in flight to finish computing; applying it now would change the run
    engine._timed_wait(engine._await_pending)
    engine._timed_wait(engine._drain_transfers)
    params = _merged(engine)
    if engine._steps_in_window > 0:
        for group_index, group in enumerate(engine.layout):
            accumulator = engine.host_buffers[group_index].grad_acc(engine._slot)
            for slot in group.matrices:
                params[slot.name]["grad_acc"] = slot.view2d(accumulator).clone().view(slot.param.shape)
    if not include_moments:
        for entry in params.values():
            for key in MOMENTS:
                entry.pop(key)
    progress = {
        "t": engine.t,
        "steps_in_window": engine._steps_in_window,
        "window_grads": [list(c) for c in engine._window_grads],
        "window_length": engine._window_length,
        "slot": engine._slot,
        "pending_slot": engine._pending_slot,
        "pending_active": [list(a) for a in engine._pending_active] if engine._pending_slot is not None else None,
        "last_select_t": engine._last_select_t,
        "selections": engine._selections,
        "update_interval": engine._interval,
        "interval_decided": engine._interval_decided,
        "last_hparams": [asdict(h) for h in engine._last_hparams] if engine._last_hparams else None,
    }
    return {"version": STATE_VERSION, "params": params, "progress": progress}


def _param_names(engine: ZenFlowEngine) -> dict[str, torch.Tensor]:
    names = {}
    for group in engine.layout:
        for slot in group.matrices:
            names[slot.name] = slot.param
        for entry in group.device_only:
            names[entry.name] = entry.param
    return names


def _check_fresh(engine: ZenFlowEngine, what: str) -> None:
    engine._require_started()
    if engine.t != 0 or engine._pending_slot is not None or engine._steps_in_window:
        raise RuntimeError(f"{what} needs an engine that has not stepped yet; build a new engine to restore into.")


def _validate_names(engine: ZenFlowEngine, params: Mapping[str, Mapping]) -> None:
    expected = _param_names(engine)
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    if missing or unexpected:
        raise ValueError(
            "the ZenFlow state does not match the model's trainable parameters: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. "
            "Load it into the same model (same parameter names and requires_grad), or resume with "
            "only the model weights (e.g. ckpt_path=None and load_state_dict on the module)."
        )
    for name, param in expected.items():
        entry = params[name]
        for key in ("master", *MOMENTS, "grad_acc"):
            if key in entry and tuple(entry[key].shape) != tuple(param.shape):
                raise ValueError(
                    f"parameter {name} has shape {tuple(param.shape)} but its saved {key} has "
                    f"{tuple(entry[key].shape)}; the checkpoint belongs to a different model."
                )
        if "selected" in entry:
            cols = param.numel() // param.shape[0]
            selected = entry["selected"]
            if selected.ndim != 1 or (selected.numel() and (int(selected.min()) < 0 or int(selected.max()) >= cols)):
                raise ValueError(f"the saved selected columns of {name} are not indices into its {cols} columns.")


def load_engine_state_dict(engine: ZenFlowEngine, state: Mapping, torch_state: Mapping | None) -> None:
    _check_fresh(engine, "load_state_dict")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unknown ZenFlow state version {state.get('version')!r}; expected {STATE_VERSION}.")
    params = state["params"]
    # everything is validated before anything is written: a bad state leaves the engine untouched
    _validate_names(engine, params)
    moments = _moments_by_name(engine, torch_state) if torch_state is not None else {}
    progress = state["progress"]
    slot_index = int(progress["slot"])

    def moment(name: str, key: str) -> torch.Tensor:
        if key in params[name]:
            return params[name][key]
        if name in moments:
            return moments[name][key]
        raise ValueError(f"the ZenFlow state has no {key} for {name} and no torch optimizer state supplies it.")

    updater = engine.device_updater
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for position, slot in enumerate(group.matrices):
            entry = params[slot.name]
            slot.view2d(host.master).copy_(entry["master"].reshape(slot.rows, slot.cols))
            slot.view2d(host.exp_avg).copy_(moment(slot.name, "exp_avg").reshape(slot.rows, slot.cols))
            slot.view2d(host.exp_avg_sq).copy_(moment(slot.name, "exp_avg_sq").reshape(slot.rows, slot.cols))
            host.step_shared[slot.index_in_group] = float(entry["host_step"])
            accumulator = slot.view2d(host.grad_acc(slot_index))
            if "grad_acc" in entry:
                accumulator.copy_(entry["grad_acc"].reshape(slot.rows, slot.cols))
            else:
                accumulator.zero_()
            old_state = updater.selected[group_index][position]
            old_state.step = int(entry["device_step"])
            updater.selected[group_index][position] = engine._take_from_host(
                old_state, entry["selected"].to(torch.long), host
            )
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            entry = params[device_entry.name]
            with torch.no_grad():
                state_entry.master.copy_(entry["master"])
                state_entry.exp_avg.copy_(moment(device_entry.name, "exp_avg"))
                state_entry.exp_avg_sq.copy_(moment(device_entry.name, "exp_avg_sq"))
                if state_entry.separate_master:
                    state_entry.param.data.copy_(state_entry.master)
            state_entry.step = int(entry["device_step"])
    engine.synchronize_device()
    engine.t = int(progress["t"])
    engine._steps_in_window = int(progress["steps_in_window"])
    engine._window_grads = [list(map(int, c)) for c in progress["window_grads"]]
    engine._window_length = int(progress["window_length"])
    engine._slot = slot_index
    engine._last_select_t = progress["last_select_t"]
    engine._selections = int(progress["selections"])
    engine._interval = int(progress["update_interval"])
    engine._interval_decided = bool(progress["interval_decided"]) or engine.config.update_interval != "auto"
    if engine.config.update_interval != "auto":
        engine._interval = int(engine.config.update_interval)
    hparams = progress["last_hparams"]
    engine._last_hparams = [HyperParams(**h) for h in hparams] if hparams else None
    pending_slot = progress["pending_slot"]
    if pending_slot is not None:
        # rebuild the staged upload of the computed update: the host master cast to the model dtype
        active = [tuple(a) for a in progress["pending_active"]]
        for group_index, group in enumerate(engine.layout):
            accumulator = engine.host_buffers[group_index].grad_acc(pending_slot)
            for index in active[group_index]:
                slot = group.matrices[index]
                if slot.param.dtype == torch.float32:
                    continue  # fp32 weights are uploaded from the master itself
                staged = staging_view(accumulator, slot, slot.param.dtype)
                staged.copy_(slot.view2d(engine.host_buffers[group_index].master))
        engine._pending_slot = int(pending_slot)
        engine._pending_active = active
        engine._pending_computed = True


def _moments_by_name(engine: ZenFlowEngine, torch_state: Mapping) -> dict[str, dict[str, torch.Tensor]]:
    """Map a torch optimizer state dict (indexed by position in the param groups) to parameter names."""
    names = {id(slot.param): slot.name for group in engine.layout for slot in group.matrices}
    names.update({id(entry.param): entry.name for group in engine.layout for entry in group.device_only})
    groups = torch_state.get("param_groups", [])
    if len(groups) != len(engine.optimizer.param_groups):
        raise ValueError(
            f"the optimizer state has {len(groups)} param groups but the optimizer has "
            f"{len(engine.optimizer.param_groups)}; configure_optimizers must build the same groups to resume."
        )
    by_name = {}
    per_param_state = torch_state.get("state", {})
    for saved_group, group in zip(groups, engine.optimizer.param_groups):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError(
                f"a saved param group has {len(saved_group['params'])} parameters but the optimizer's has "
                f"{len(group['params'])}; configure_optimizers must build the same groups to resume."
            )
        for index, param in zip(saved_group["params"], group["params"]):
            entry = per_param_state.get(index)
            if entry is None or id(param) not in names:
                continue
            for key in (*MOMENTS, "step"):
                if key not in entry:
                    raise ValueError(f"the optimizer state of {names[id(param)]} has no {key!r}; is it Adam/AdamW?")
            for key in MOMENTS:
                if tuple(entry[key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"the optimizer state of {names[id(param)]} has {key} of shape {tuple(entry[key].shape)}, "
                        f"the parameter {tuple(param.shape)}; the checkpoint belongs to a different model."
                    )
            by_name[names[id(param)]] = {
                "exp_avg": entry["exp_avg"].float(),
                "exp_avg_sq": entry["exp_avg_sq"].float(),
                "step": int(float(entry["step"])),
            }
    return by_name


def torch_state_dict(engine: ZenFlowEngine) -> dict:
    engine._require_started()
    engine._timed_wait(engine._await_pending)
    merged = _merged(engine)
    by_id = {id(param): name for name, param in _param_names(engine).items()}
    layout_state = engine.optimizer.state_dict()
    state = {}
    position = 0
    for group in engine.optimizer.param_groups:
        for param in group["params"]:
            name = by_id.get(id(param))
            if name is not None:
                entry = merged[name]
                state[position] = {
                    "step": torch.tensor(float(max(entry["device_step"], entry["host_step"])), dtype=torch.float32),
                    "exp_avg": entry["exp_avg"],
                    "exp_avg_sq": entry["exp_avg_sq"],
                }
            position += 1
    return {"state": state, "param_groups": layout_state["param_groups"]}


def load_torch_state_dict(engine: ZenFlowEngine, torch_state: Mapping) -> None:
    _check_fresh(engine, "load_torch_state_dict")
    moments = _moments_by_name(engine, torch_state)
    updater = engine.device_updater
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for position, slot in enumerate(group.matrices):
            if slot.name not in moments:
                continue
            entry = moments[slot.name]
            slot.view2d(host.exp_avg).copy_(entry["exp_avg"].reshape(slot.rows, slot.cols))
            slot.view2d(host.exp_avg_sq).copy_(entry["exp_avg_sq"].reshape(slot.rows, slot.cols))
            host.step_shared[slot.index_in_group] = float(entry["step"])
            state: SelectedState = updater.selected[group_index][position]
            state.step = entry["step"]
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            if device_entry.name not in moments:
                continue
            entry = moments[device_entry.name]
            state_entry.exp_avg.copy_(entry["exp_avg"])
            state_entry.exp_avg_sq.copy_(entry["exp_avg_sq"])
            state_entry.step = entry["step"]
