"""Sharded checkpoints (``checkpoint_format="sharded"``): a directory that every rank writes its share of.

For models whose consolidated optimizer state does not fit one host. The directory holds:

- ``meta.pt``, written by rank 0: the Lightning checkpoint without the tensors (loops, callbacks, hyperparameters,
  the optimizer's param groups), the engine's schedule and, per parameter, its step counts and selected columns;
- the files of ``torch.distributed.checkpoint`` (DCP): the model's weights (written once), and per parameter the
  fp32 master and moments (and the open window's gradient sum) — each matrix as a row-sharded ``DTensor`` that
  every rank writes its own row block of, straight from its host state (no gather, no consolidated copy).

Reading reshards: each rank asks DCP for the rows it owns at the new number of ranks (any number, one included), so
nobody holds more than its share. Every tensor is saved with its global shape (the whole matrix's rows); what the meta
file holds per parameter (step counts, the selected columns, the interim moves' statistics, which span the whole
matrix) is the same on every rank, so rank 0's copy is everyone's.

HSDP (a 2-D ``("replicate", "shard")`` mesh): the row blocks are DTensors placed ``(Replicate(), Shard(0))`` on it,
as FSDP2 places the weights; DCP's planner keeps one writer per block (replicas hold equal blocks), so each block is
written once, and the directory reads back at any number of ranks, with or without HSDP.

A directory resumes under ZenFlow only (its optimizer state is not in torch's
format; resume it under ZenFlow once and save with ``checkpoint_format="full"`` for plain AdamW).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.ranks import Ranks

META_FILE = "meta.pt"
FORMAT_KEY = "zenflow_sharded"
"""Key of the meta file's own section: how the tensors were written (shapes, keys, the number of ranks)."""
TENSOR_KEYS = ("master", "exp_avg", "exp_avg_sq", "grad_acc", "step")


def is_sharded_checkpoint(path: Any) -> bool:
    """A directory with a ``meta.pt``: a checkpoint written with ``checkpoint_format="sharded"``."""
    try:
        candidate = pathlib.Path(path)
    except TypeError:
        return False
    return candidate.is_dir() and (candidate / META_FILE).is_file()


_MESHES: dict[tuple[str, int], object] = {}


def _mesh(ranks: Ranks, device_type: str) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, ranks.world)
    if key not in _MESHES:
        # one dimension over every rank: the default process group, no new one. On GPUs a CUDA mesh whose local
        # tensors stay on the CPU (host_resident_dtensor), as FSDP2's CPU offloading makes them
        _MESHES[key] = init_device_mesh(device_type, (ranks.world,))
    return _MESHES[key]


def _row_sharded(
    block: torch.Tensor, rows: int, cols: int, ranks: Ranks, device_type: str, mesh: object | None = None
) -> torch.Tensor:
    """This rank's ``block`` of a ``[rows, cols]`` matrix as DCP sees it: the whole matrix with one rank, else a
    DTensor sharded by rows (the same blocks as ``Ranks.row_range``: ``torch.chunk`` semantics) on ``mesh`` (its last
    dimension splits the rows, the others replicate them: HSDP), or on a 1-D mesh over ``ranks``."""
    if mesh is not None and mesh.size() > 1:
        return host_resident_dtensor(block, mesh, rows, cols)
    if not ranks.spans:
        return block
    return host_resident_dtensor(block, _mesh(ranks, device_type), rows, cols)


def host_resident_dtensor(block: torch.Tensor, mesh: object, rows: int, cols: int) -> torch.Tensor:
    """A row-sharded DTensor over ``mesh`` whose local tensor *is* ``block``, wherever it lives.

    ``DTensor.from_local`` moves a local tensor to the mesh's device: with a CUDA mesh every host row block (up to
    16 B per element at a checkpoint) would be copied to the GPU, and read back by DCP's writer. Built from its spec
    instead, as FSDP2 builds its CPU-offloaded parameters, the DTensor shares ``block``'s memory (DCP reads only its
    bytes and placement)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor.placement_types import DTensorSpec, TensorMeta

    placements = (*(Replicate(),) * (mesh.ndim - 1), Shard(0))  # HSDP: the same rows on every replica
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size((rows, cols)), (cols, 1), block.dtype))
    return DTensor(block.view_as(block), spec, requires_grad=False)


def save_sharded(
    path: str | pathlib.Path,
    checkpoint: Mapping[str, Any],
    state: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, int]],
    ranks: Ranks,
    write_meta: Callable[[dict, pathlib.Path], None],
    device_type: str = "cpu",
    mesh: object | None = None,
    writes_meta: bool | None = None,
) -> None:
    """Write ``checkpoint`` (Lightning's, with the model's ``state_dict``) and ``state`` (this rank's row-block engine
    state, :meth:`ZenFlowEngine.row_block_state_dict`) as a sharded directory. Every rank calls it.

    ``shapes``: ``{name: (rows, cols)}`` of every matrix, and under FSDP2 of every parameter (a vector as
    ``(n, 1)``: its state is sharded by rows too); ``write_meta(obj, file)`` writes the meta file (rank 0);
    ``device_type``: the training device's type (``"cuda"`` or ``"cpu"``), the type of the DCP mesh; ``mesh``: the
    mesh the rows are split on (FSDP2's, HSDP's 2-D one; None: one dimension over ``ranks``); ``writes_meta``: this
    process writes the meta file (None: ``ranks.rank == 0``; under HSDP only the global rank 0 must).
    """
    import torch.distributed.checkpoint as dcp

    directory = pathlib.Path(path)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    small: dict[str, dict[str, Any]] = {}
    for name, entry in state["params"].items():
        small[name] = {key: value for key, value in entry.items() if key not in TENSOR_KEYS}
        tensors[name] = {}
        for key in TENSOR_KEYS:
            if key not in entry:
                continue
            value = entry[key]
            if name in shapes:
                rows, cols = shapes[name]
                value = _row_sharded(value.reshape(-1, cols), rows, cols, ranks, device_type, mesh)
            tensors[name][key] = value
    meta = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    meta["optimizer_states"] = [
        {"state": {}, "param_groups": optimizer_state.get("param_groups", [])}
        for optimizer_state in checkpoint.get("optimizer_states", [])
    ]
    meta["zenflow"] = {key: value for key, value in state.items() if key != "params"} | {"params": small}
    meta[FORMAT_KEY] = {
        "world": ranks.world * ranks.replicas,
        "shard_size": ranks.world,
        "matrices": {name: tuple(shape) for name, shape in shapes.items()},
        "keys": {name: sorted(entry) for name, entry in tensors.items()},
        "model": {key: tuple(value.shape) for key, value in checkpoint["state_dict"].items()},
    }
    if ranks.rank == 0 if writes_meta is None else writes_meta:
        directory.mkdir(parents=True, exist_ok=True)
        write_meta(meta, directory / META_FILE)
    dcp.save({"model": dict(checkpoint["state_dict"]), "zenflow": tensors}, checkpoint_id=directory)


def load_sharded(
    path: str | pathlib.Path,
    meta: Mapping[str, Any],
    model_state: Mapping[str, torch.Tensor],
    param_shapes: Mapping[str, tuple[int, ...]],
    ranks: Ranks,
    device_type: str = "cpu",
    model_targets: Mapping[str, torch.Tensor] | None = None,
    mesh: object | None = None,
) -> dict[str, Any]:
    """Read a sharded directory into a Lightning checkpoint dict for this rank: the model's ``state_dict`` whole, the
    engine state as this rank's row blocks at the current number of ranks (``row_blocks``).

    ``meta``: the directory's meta file, read by the caller; ``model_state``: the module's ``state_dict`` (the shapes
    to read into); ``param_shapes``: ``{name: shape}`` of its parameters; ``model_targets``: tensors to read the
    weights into instead of new whole ones (FSDP2: the module's own sharded ``DTensor`` state, read in place);
    ``mesh``: as :func:`save_sharded`'s, the mesh of the ranks reading it now (any shape: DCP reshards).
    """
    import torch.distributed.checkpoint as dcp

    written = meta[FORMAT_KEY]
    if model_targets is not None:
        model = {key: value for key, value in model_targets.items() if key in written["model"]}
    else:
        model = {
            key: torch.empty(tuple(shape), dtype=model_state[key].dtype)
            for key, shape in written["model"].items()
            if key in model_state
        }
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, keys in written["keys"].items():
        tensors[name] = {}
        for key in keys:
            if name in written["matrices"]:
                rows, cols = written["matrices"][name]
                start, stop = ranks.block_of(rows)
                block = torch.empty(stop - start, cols)
                tensors[name][key] = _row_sharded(block, rows, cols, ranks, device_type, mesh)
            else:
                tensors[name][key] = torch.empty(param_shapes.get(name, ()))
    dcp.load({"model": model, "zenflow": tensors}, checkpoint_id=pathlib.Path(path))
    checkpoint = {key: value for key, value in meta.items() if key != FORMAT_KEY}
    checkpoint["state_dict"] = model
    zenflow = dict(meta["zenflow"])
    params = {}
    for name, entry in zenflow["params"].items():
        loaded = {key: _local(value) for key, value in tensors.get(name, {}).items()}
        params[name] = {**entry, **loaded}
    zenflow["params"] = params
    checkpoint["zenflow"] = zenflow
    return checkpoint


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local block of a loaded DTensor, on the CPU (the host state never belongs on the device)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).cpu()


def matrix_shapes(engine: ZenFlowEngine) -> dict[str, tuple[int, int]]:
    """``{name: (rows, cols)}`` of the engine's matrices."""
    return {slot.name: (slot.rows, slot.cols) for group in engine.layout for slot in group.matrices}
