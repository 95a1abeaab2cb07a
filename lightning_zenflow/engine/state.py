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
from typing import TYPE_CHECKING

import torch

from lightning_zenflow.engine.layout import staging_view

if TYPE_CHECKING:
    from lightning_zenflow.engine.engine import ZenFlowEngine

STATE_VERSION = 2
"""2: the schedule is saved as ``Schedule.state_dict()`` and the open window as gradient sums."""
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
                    full.index_copy_(1, state.selected_host, device_tensor.cpu())
                entry[key] = full.view(slot.param.shape)
            entry.update(
                kind="matrix",
                device_step=state.step,
                host_step=int(host.step_shared[slot.index_in_group]),
                selected=state.selected_host.clone(),
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
    # wait for the host update in flight to finish computing; applying it now would change the run
    engine.wait_idle()
    params = _merged(engine)
    for name, window_sum in engine.window_sums().items():
        params[name]["grad_acc"] = window_sum
    if not include_moments:
        for entry in params.values():
            for key in MOMENTS:
                entry.pop(key)
    return {"version": STATE_VERSION, "params": params, "progress": engine.schedule.state_dict()}


def _param_names(engine: ZenFlowEngine) -> dict[str, torch.Tensor]:
    names = {}
    for group in engine.layout:
        for slot in group.matrices:
            names[slot.name] = slot.param
        for entry in group.device_only:
            names[entry.name] = entry.param
    return names


def _check_fresh(engine: ZenFlowEngine, what: str) -> None:
    if engine.closed:
        raise RuntimeError("the ZenFlowEngine is not running; call start() first (and not after close()).")
    if not engine.is_fresh():
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
        raise ValueError(
            f"unknown ZenFlow state version {state.get('version')!r}; expected {STATE_VERSION}. A checkpoint of an "
            "older lightning_zenflow resumes its weights only: load them into the module and start a new fit."
        )
    params = state["params"]
    # everything is validated before anything is written: a bad state leaves the engine untouched
    _validate_names(engine, params)
    moments = _moments_by_name(engine, torch_state) if torch_state is not None else {}

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
    selected, device_steps = [], []
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for slot in group.matrices:
            entry = params[slot.name]
            slot.view2d(host.master).copy_(entry["master"].reshape(slot.rows, slot.cols))
            slot.view2d(host.exp_avg).copy_(moment(slot.name, "exp_avg").reshape(slot.rows, slot.cols))
            slot.view2d(host.exp_avg_sq).copy_(moment(slot.name, "exp_avg_sq").reshape(slot.rows, slot.cols))
            host.step_shared[slot.index_in_group] = float(entry["host_step"])
            selected.append(entry["selected"].to(torch.long))
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
    engine.install_selection(selected, device_steps)
    engine.restore_window_sums({name: entry["grad_acc"] for name, entry in params.items() if "grad_acc" in entry})
    pending = engine.schedule.pending
    if pending is not None:
        # rebuild the staged upload of the computed update: the host master cast to the model dtype
        pending.computed = True
        for group_index, group in enumerate(engine.layout):
            host = engine.host_buffers[group_index]
            for index in pending.active[group_index]:
                slot = group.matrices[index]
                if slot.param.dtype == torch.float32:
                    continue  # fp32 weights are uploaded from the master itself
                staging_view(host.grad_acc(pending.slot), slot, slot.param.dtype).copy_(slot.view2d(host.master))
    engine.synchronize_device()


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
    engine.wait_idle()
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
            updater.selected[group_index][position].step = entry["step"]
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            if device_entry.name not in moments:
                continue
            entry = moments[device_entry.name]
            state_entry.exp_avg.copy_(entry["exp_avg"])
            state_entry.exp_avg_sq.copy_(entry["exp_avg_sq"])
            state_entry.step = entry["step"]
