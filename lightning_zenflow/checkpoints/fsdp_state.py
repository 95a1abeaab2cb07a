"""The checkpoint conversions of :class:`~lightning_zenflow.ZenFlowFSDPStrategy`: its row-block state gathered into
the other strategies' format (``consolidate``), and a whole state (theirs, or plain torch AdamW's) cut to a rank's
rows of FSDP2's shards (``local_torch_state``, ``local_row_state``).

A parameter's rows are split as FSDP2 splits them (``Ranks.block_of``, ``torch.chunk`` blocks); a vector's state is
kept in the parameter's own shape, a matrix's per-row tensors as ``[rows, rest]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_zenflow.engine.ranks import Ranks

ROW_KEYS = ("master", "exp_avg", "exp_avg_sq", "grad_acc", "step")
"""The per-row tensors of a parameter's ZenFlow state: sharded with the parameter's rows."""


def consolidate(
    row_state: Mapping[str, Any], optimizer: torch.optim.Optimizer, module: torch.nn.Module, ranks: Ranks, device: Any
) -> tuple[dict, dict]:
    """This rank's row blocks of every parameter's ZenFlow state (``row_block_state_dict``), gathered to rank 0
    and split as the other strategies save it: a torch AdamW state (moments, steps) and the ZenFlow state without
    moments. The other ranks take part and get an empty state (Lightning's consolidated convention)."""
    shapes = {name: tuple(param.shape) for name, param in module.named_parameters()}
    params = {}
    for name, entry in row_state["params"].items():
        rows = shapes[name][0] if shapes[name] else 1
        whole = dict(entry)
        for key in ROW_KEYS:
            if key in entry:
                block = entry[key].reshape(entry[key].shape[0] if entry[key].dim() else 1, -1).float().cpu()
                gathered = ranks.gather_rows(block, rows, device)
                whole[key] = None if gathered is None else gathered.reshape(shapes[name])
        params[name] = whole
    param_groups = optimizer.state_dict()["param_groups"]
    if ranks.rank != 0:
        return {"state": {}, "param_groups": param_groups}, {}
    names = {param: name for name, param in module.named_parameters()}
    torch_state = {}
    position = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = params.get(names.get(param, ""))
            if entry is not None:
                step = float(max(entry["device_step"], entry["host_step"]))
                torch_state[position] = {
                    "step": torch.tensor(step, dtype=torch.float32),
                    "exp_avg": entry["exp_avg"],
                    "exp_avg_sq": entry["exp_avg_sq"],
                }
            position += 1
    without_moments = {
        name: {key: value for key, value in entry.items() if key not in ("exp_avg", "exp_avg_sq")}
        for name, entry in params.items()
    }
    state = {key: value for key, value in row_state.items() if key not in ("params", "row_blocks")}
    state["params"] = without_moments
    return {"state": torch_state, "param_groups": param_groups}, state


def local_vector(
    value: torch.Tensor, shape: tuple[int, ...], local_shape: tuple[int, ...], ranks: Ranks
) -> torch.Tensor:
    rows = shape[0] if shape else 1
    if value.numel() == torch.Size(shape).numel() and torch.Size(shape).numel() != torch.Size(local_shape).numel():
        value = _block(value, rows, ranks)
    return value.reshape(local_shape)


def _block(tensor: torch.Tensor, rows: int, ranks: Ranks) -> torch.Tensor:
    """This rank's rows of a whole tensor (``rows`` of them), as ``[block_rows, rest]``."""
    start, stop = ranks.block_of(rows)
    return tensor.reshape(rows, -1)[start:stop].clone()


def local_torch_state(
    torch_state: Mapping[str, Any], names: list[str], shapes: Mapping[str, tuple[int, ...]], ranks: Ranks
) -> dict:
    """A whole torch AdamW state cut to this rank's rows (positions as in the optimizer, ``names`` by position)."""
    state = {}
    for position, entry in torch_state["state"].items():
        shape = shapes[names[int(position)]]
        rows = shape[0] if shape else 1
        local = dict(entry)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry:
                block = _block(entry[key], rows, ranks)
                local[key] = block.reshape(-1, *shape[1:]) if len(shape) > 1 else block.reshape(-1)
        state[position] = local
    return {"state": state, "param_groups": torch_state["param_groups"]}


def local_row_state(
    state: Mapping[str, Any],
    torch_state: Mapping[str, Any],
    names: list[str],
    shapes: Mapping[str, tuple[int, ...]],
    local_shapes: Mapping[str, tuple[int, ...]],
    ranks: Ranks,
) -> dict:
    """A whole ZenFlow state (and the torch state that holds its moments) as this rank's row blocks."""
    moments = {names[int(position)]: entry for position, entry in torch_state["state"].items()}
    params = {}
    for name, entry in state["params"].items():
        whole = {**{key: moments.get(name, {}).get(key) for key in ("exp_avg", "exp_avg_sq")}, **entry}
        rows = shapes[name][0] if shapes.get(name) else 1
        local = {key: value for key, value in whole.items() if value is not None}
        for key in ROW_KEYS:
            if local.get(key) is not None:
                block = _block(local[key], rows, ranks)
                local[key] = block.reshape(local_shapes[name]) if entry.get("kind") == "device" else block
        params[name] = local
    return {**state, "params": params, "row_blocks": True}


def is_dtensor(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
