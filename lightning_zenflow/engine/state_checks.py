"""Checking a saved state before anything of it is loaded: the engine state, a torch optimizer state, a checkpoint.

Every check reads only and says what differs and the fix; ``engine/state.py`` runs them all before it writes
anything, and the strategies run :func:`check_state`, :func:`state_dict_mismatch` and :func:`unreadable_checkpoint`
on a checkpoint file before Lightning loads any of it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import torch

from lightning_zenflow.engine.layout import GroupLayout

STATE_VERSION = 3
"""3: the weights are the masters of host columns (a host update in flight is saved as its ``step``); 2: the schedule
is saved as ``Schedule.state_dict()`` and the open window as gradient sums."""
MOMENTS = ("exp_avg", "exp_avg_sq")

MATRIX_KEYS = ("master", "device_step", "host_step", "selected")
DEVICE_ONLY_KEYS = ("master", "device_step", "host_step")
PROGRESS_KEYS = ("t", "steps_in_window", "slot", "window_counts", "pending", "last_select_t", "selections", "interval")
_SHOWN = 5


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_state(state: object, shapes: Mapping[str, tuple[int, ...]], require_all: bool = True) -> None:
    """Raise ``ValueError`` saying what differs when the engine state ``state`` does not fit a model whose trainable
    parameters have ``shapes`` (``{name: shape}``). Reads only; every check runs before anything is loaded.

    ``require_all=False`` accepts a state that covers only some of ``shapes`` (the strategy checks a checkpoint
    against the module before the optimizer, which may hold a subset of the parameters, exists).
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, Mapping) else None
        raise ValueError(
            f"unknown ZenFlow state version {version!r}; expected {STATE_VERSION}. A checkpoint of an older "
            "lightning_zenflow resumes its weights only: load them into the module and start a new fit."
        )
    params, progress = state.get("params"), state.get("progress")
    if not isinstance(params, Mapping) or not isinstance(progress, Mapping):
        raise ValueError("the ZenFlow state has no 'params' or no 'progress' section; it is incomplete.")
    missing = sorted(set(shapes) - set(params)) if require_all else []
    unexpected = sorted(set(params) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            "the ZenFlow state does not match the model's trainable parameters: "
            + "; ".join(
                part
                for part in (
                    f"the model has {_listed(missing)}, the checkpoint does not" if missing else "",
                    f"the checkpoint has {_listed(unexpected)}, the model does not" if unexpected else "",
                )
                if part
            )
            + ". Load it into the same model (same parameter names and requires_grad), or resume with only the "
            "model weights (e.g. ckpt_path=None and load_state_dict on the module)."
        )
    differences = []
    for name in sorted(set(params) & set(shapes)):
        entry, shape = params[name], tuple(shapes[name])
        if not isinstance(entry, Mapping):
            raise ValueError(f"the saved state of {name} is a {type(entry).__name__}, not a dict; it is corrupt.")
        required = MATRIX_KEYS if len(shape) >= 2 else DEVICE_ONLY_KEYS
        absent = [key for key in required if key not in entry]
        if absent:
            raise ValueError(f"the saved state of {name} lacks {absent}; it is incomplete.")
        for key in ("master", *MOMENTS, "grad_acc", "step"):
            if key not in entry:
                continue
            value = entry[key]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise ValueError(f"the saved {key} of {name} is not a floating-point tensor; it is corrupt.")
            if state.get("row_blocks") and (len(shape) >= 2 or state.get("rows_local")):
                continue  # a rank's row block; its reader checked the whole matrix's shape
            if tuple(value.shape) != shape:
                differences.append(f"{name} ({key}): checkpoint {tuple(value.shape)}, model {shape}")
        if "selected" in entry and len(shape) >= 2 and not differences:
            columns = entry.get("columns")  # the matrix view's (a stack of expert matrices), else numel // shape[0]
            _check_selected(name, entry["selected"], int(columns) if columns is not None else math.prod(shape[1:]))
    if differences:
        raise ValueError(
            "the ZenFlow state was saved for parameters of other shapes: "
            + "; ".join(differences[:_SHOWN])
            + (f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else "")
            + ". The checkpoint belongs to a different model."
        )
    absent = [key for key in PROGRESS_KEYS if key not in progress]
    if absent:
        raise ValueError(f"the ZenFlow state's progress lacks {absent}; it is incomplete.")


def _check_selected(name: str, selected: object, cols: int) -> None:
    ok = isinstance(selected, torch.Tensor) and selected.ndim == 1 and not selected.is_floating_point()
    if ok and selected.numel():
        ok = int(selected.min()) >= 0 and int(selected.max()) < cols
        ok = ok and (selected.numel() == 1 or bool((selected[1:] > selected[:-1]).all()))
    if not ok:
        raise ValueError(
            f"the saved selected columns of {name} are not ascending distinct indices into its {cols} columns."
        )


def check_progress(progress: Mapping, per_group: Sequence[int]) -> None:
    """The schedule's shape against the engine's layout (``per_group``: matrices per param group), checked before
    anything is loaded."""
    per_group = list(per_group)
    counts = progress["window_counts"]
    if [len(c) for c in counts] != per_group:
        raise ValueError(
            f"the saved schedule counts matrices per param group {[len(c) for c in counts]}, this model has "
            f"{per_group}; the checkpoint belongs to a different model or optimizer setup."
        )
    pending = progress["pending"]
    if pending is None:
        return
    active = pending.get("active") if isinstance(pending, Mapping) else None
    if (
        int(pending.get("slot", -1)) not in (0, 1)
        or active is None
        or len(active) != len(per_group)
        or any(int(i) < 0 or int(i) >= n for indices, n in zip(active, per_group) for i in indices)
    ):
        raise ValueError("the saved pending host update does not fit this model's param groups; it is corrupt.")
    scales = pending.get("scales")
    if scales is not None and (
        len(scales) != len(active) or any(len(s) != len(indices) for s, indices in zip(scales, active))
    ):
        raise ValueError("the saved pending host update's decay factors do not fit its matrices; it is corrupt.")


def unreadable_checkpoint(path: object, error: BaseException) -> str:
    """The message for a checkpoint file that torch could not load: the file, its size, the error, the fix."""
    message = str(error).strip() or type(error).__name__
    if "Weights only load failed" in message and "Unsupported global" in message:
        # readable, but holds objects that torch's safe loading refuses: torch's message says what to do
        # (other "weights only" failures, e.g. "Unsupported operand", are bytes that are not a pickle at all)
        return f"cannot resume from {path}: torch refused to load it safely. {message}"
    try:
        size = f"{os.path.getsize(path)} bytes"
    except OSError:
        size = "size unknown"
    first_line = message.splitlines()[0]
    return (
        f"cannot resume from {path} ({size}): it could not be read ({type(error).__name__}: {first_line}). The file "
        "is truncated or corrupt (a save that was interrupted, a full disk, an incomplete copy) or is not a PyTorch "
        "checkpoint. Resume from another checkpoint (ModelCheckpoint keeps several with save_top_k and save_last), "
        "or start without ckpt_path."
    )


def state_dict_mismatch(saved: Mapping[str, object], expected: Mapping[str, object], strict: bool) -> str | None:
    """How a checkpoint's model ``state_dict`` differs from the module's (None: it fits): names when ``strict``,
    shapes always (torch's ``load_state_dict`` would copy the matching tensors before it raised on the rest)."""
    parts = []
    if strict:
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing:
            parts.append(f"the model has {_listed(missing)} that the checkpoint lacks")
        if unexpected:
            parts.append(f"the checkpoint has {_listed(unexpected)} that the model lacks")
    shapes = [
        f"{name}: checkpoint {tuple(saved[name].shape)}, model {tuple(value.shape)}"
        for name, value in expected.items()
        if name in saved
        and isinstance(saved[name], torch.Tensor)
        and isinstance(value, torch.Tensor)
        and tuple(saved[name].shape) != tuple(value.shape)
    ]
    if shapes:
        parts.append("shapes differ: " + _listed(shapes))
    if not parts:
        return None
    return (
        "its weights belong to a different model: "
        + "; ".join(parts)
        + ". Resume it with the model it was saved from (same architecture and sizes)."
    )


def moments_by_name(
    layout: Sequence[GroupLayout], optimizer: torch.optim.Optimizer, torch_state: Mapping
) -> dict[str, dict[str, torch.Tensor]]:
    """Map a torch optimizer state dict (indexed by position in the param groups) to parameter names."""
    names = {id(slot.param): slot.name for group in layout for slot in group.matrices}
    names.update({id(entry.param): entry.name for group in layout for entry in group.device_only})
    groups = torch_state.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer state has {len(groups)} param groups but the optimizer has "
            f"{len(optimizer.param_groups)}; configure_optimizers must build the same groups to resume."
        )
    by_name = {}
    per_param_state = torch_state.get("state", {})
    for saved_group, group in zip(groups, optimizer.param_groups):
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
