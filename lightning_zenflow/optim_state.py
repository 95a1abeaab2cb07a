"""The state dict of :class:`~lightning_zenflow.ZenFlowAdamW`: torch AdamW's format (``state``, ``param_groups``), plus
the engine's exact extras under :data:`STATE_KEY`, keyed by each parameter's position (``group0.param0``), so that an
optimizer built with names (``model.named_parameters()``) and one built without give the same state.

Loading matches a saved state to the optimizer's parameters by name where both sides have names, by position (param
group, index in it) otherwise, and checks the groups, their sizes and every shape first (:func:`check_fits`): a
mismatch is an error that names it, raised before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_zenflow.engine import ZenFlowEngine

STATE_KEY = "zenflow"
"""Where ``state_dict()`` keeps the engine's exact extras beside torch AdamW's ``state`` and ``param_groups``."""


def positional_name(group_index: int, position: int) -> str:
    """A parameter's name in the engine's state when the optimizer was built without names."""
    return f"group{group_index}.param{position}"


def _label(groups: list[dict[str, Any]], group_index: int, position: int) -> str:
    names = groups[group_index].get("param_names")
    return repr(names[position]) if names else f"param group {group_index} index {position}"


def check_fits(state_dict: Mapping[str, Any], groups: list[dict[str, Any]]) -> None:
    """Raise ``ValueError`` naming what differs when ``state_dict`` was saved for other parameters than ``groups``: the
    groups and their sizes, the names where both sides have them, the shapes. Reads only."""
    saved_groups = state_dict["param_groups"]
    sizes = [len(group["params"]) for group in groups]
    saved_sizes = [len(group["params"]) for group in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"the saved optimizer state has {len(saved_sizes)} param group(s) of {saved_sizes} parameters, this "
            f"optimizer {len(sizes)} of {sizes}: build it over the same parameters, in the same param groups and "
            "order, as the optimizer that saved the state."
        )
    if all("param_names" in group for group in saved_groups + groups):
        renamed = [
            f"{saved!r} (saved) is {own!r} here"
            for saved_group, group in zip(saved_groups, groups)
            for saved, own in zip(saved_group["param_names"], group["param_names"])
            if saved != own
        ]
        if renamed:
            raise ValueError(
                "the saved optimizer state names other parameters than this optimizer, position by position: "
                + "; ".join(renamed[:5])
                + (f"; and {len(renamed) - 5} more" if len(renamed) > 5 else "")
                + ". Build the optimizer from the same model's named_parameters(), in the same order; to load by "
                "position instead, build it from model.parameters()."
            )
    saved_state = state_dict.get("state", {})
    extras = state_dict.get(STATE_KEY, {}).get("params", {})
    differences = []
    for group_index, (saved_group, group) in enumerate(zip(saved_groups, groups)):
        for position, (saved_id, param) in enumerate(zip(saved_group["params"], group["params"])):
            key = _saved_key(extras, saved_group, group_index, position)
            entry = extras[key] if key is not None else None
            saved = [
                saved_state.get(saved_id, {}).get("exp_avg"),
                entry.get("master") if isinstance(entry, Mapping) else None,
            ]
            shapes = {tuple(value.shape) for value in saved if isinstance(value, torch.Tensor)}
            if shapes - {tuple(param.shape)}:
                differences.append(
                    f"{_label(groups, group_index, position)}: saved {sorted(shapes)[0]}, here {tuple(param.shape)}"
                )
    if differences:
        raise ValueError(
            "the saved optimizer state is for parameters of other shapes: "
            + "; ".join(differences[:5])
            + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
            + ". It belongs to a different model."
        )


def _saved_key(
    extras: Mapping[str, Any], saved_group: Mapping[str, Any], group_index: int, position: int
) -> str | None:
    """Where the engine's extras keep a saved parameter: under its position (what ``state_dict()`` writes), or its
    name (states saved before the extras were keyed by position)."""
    names = saved_group.get("param_names")
    for key in [positional_name(group_index, position)] + ([names[position]] if names else []):
        if key in extras:
            return key
    return None


def _names_by_id(engine: ZenFlowEngine) -> dict[int, str]:
    """``id(param)``: the name the engine keys that parameter's state by."""
    names = {id(slot.param): slot.name for group in engine.layout for slot in group.matrices}
    names.update({id(entry.param): entry.name for group in engine.layout for entry in group.device_only})
    return names


def extras_by_position(
    extras: Mapping[str, Any], groups: list[dict[str, Any]], engine: ZenFlowEngine
) -> dict[str, Any]:
    """The engine's extras keyed by each parameter's position (``group0.param0``) instead of the engine's names: the
    same state gives the same dict whether the optimizer was built with names or not (torch's ``param_names`` are
    optional and must not change a state dict). Entries of parameters no longer in the groups keep their key."""
    engine_names = _names_by_id(engine)
    keyed, used = {}, set()
    for group_index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            name = engine_names.get(id(param))
            if name is not None and name in extras:
                keyed[positional_name(group_index, position)] = extras[name]
                used.add(name)
    for name, entry in extras.items():
        if name not in used:
            keyed.setdefault(name, entry)
    return keyed


def extras_by_engine_name(
    extras: Mapping[str, Any], saved_groups: list[Mapping[str, Any]], engine: ZenFlowEngine
) -> dict[str, Any]:
    """The saved extras re-keyed by the names of ``engine`` (its optimizer's parameters at the same positions, checked
    by :func:`check_fits`). Entries left over stay under their own key, for the engine's check to report them (a
    parameter trainable on one side only)."""
    engine_names = _names_by_id(engine)
    renamed, used = {}, set()
    for group_index, (saved_group, group) in enumerate(zip(saved_groups, engine.optimizer.param_groups)):
        for position, param in enumerate(group["params"]):
            key = _saved_key(extras, saved_group, group_index, position)
            if key is not None and id(param) in engine_names:
                renamed[engine_names[id(param)]] = extras[key]
                used.add(key)
    for key, entry in extras.items():
        if key not in used:
            renamed.setdefault(key, entry)
    return renamed
