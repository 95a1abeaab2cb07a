"""Each rank reads its own rows of a Hugging Face model's safetensors files into FSDP2's shards (``zenflow_fsdp``).

The model is built from its config with the parameters on the meta device and the buffers on the host
(:func:`structure`), so no weight is allocated and the buffers that are computed rather than stored (the rotary
tables, ``inv_freq``) hold what the constructor computed, the values ``from_pretrained`` gives them too.
``configure_model`` then shards it (``fully_shard``, blocks then root), materialises the shards on the training device
(``to_empty``: this rank's rows only, uninitialised), puts those buffers back and calls :func:`load_rows`.

:func:`load_rows` reads the files itself: a safetensors file is an 8-byte header length, a JSON header (every tensor's
dtype, shape and byte range) and the tensors' bytes, row-major. FSDP2's shard of a parameter is a contiguous block of
its rows (``torch.chunk`` along dim 0), so this rank's part of a tensor is one contiguous byte range, read with plain
``read`` calls straight into the shard's memory when the dtype and device allow it, else through one reusable host
buffer of 4 MiB (:data:`STAGING_BYTES`) and converted from there. No file is memory-mapped, so the page cache never
counts in the rank's resident memory: each rank's peak above the model built and sharded on meta is its share of the
weights plus at most that buffer (and a few MiB of bookkeeping), measured in ``tests/test_llm_sharded_memory.py``.

A file's tensor is matched to the model by its ``state_dict`` name, or that name without the base model's prefix (as
a file of the bare model names it). Architectures whose files name their weights otherwise than their modules do
(``transformers``' weight conversions: fused experts, renamed blocks) are refused with the fix, as are
``pytorch_model.bin`` folders; tensors the model does not have are skipped (``from_pretrained`` warns of them).
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
READ_CHUNK_BYTES = 64 << 20
"""The largest single ``read`` (the kernel caps one read at 2 GiB anyway)."""
STAGING_BYTES = 4 << 20
"""The host buffer that rows go through when they need a conversion (another dtype, a GPU)."""


class ShardedLoadError(ValueError):
    """A model folder or model that the sharded reader cannot load; the message names the fix."""


def _fix() -> str:
    return (
        "or pass --model.load_weights now (every rank then reads the whole model into its host memory before it is "
        "sharded), or train it under strategy zenflow_ddp"
    )


# ------------------------------------------------------------------------------------------- the structure
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay where they are made (the host).

    Patches ``torch.nn.Module.register_parameter`` for the duration (a model is built in one thread)."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def structure(config: Any, dtype: torch.dtype) -> Any:
    """``AutoModelForCausalLM.from_config(config)`` with its parameters on the meta device (no memory, no random
    initialisation: ``torch.empty`` on meta) and its buffers on the host, as the constructor computed them."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def host_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s buffers that are not meta (``to_empty`` replaces every buffer with empty memory)."""
    return {name: buffer.clone() for name, buffer in model.named_buffers() if not buffer.is_meta}


@torch.no_grad()
def restore_buffers(model: torch.nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Put ``saved`` (from :func:`host_buffers`) back into ``model``'s buffers, on their current device."""
    for name, value in saved.items():
        model.get_buffer(name).copy_(value)


def checkpoint_renames(model: Any) -> list[str]:
    """The weight conversions ``transformers`` applies between this architecture's files and its modules (besides
    the renames of legacy files), as text; empty where the files name every weight as the module does."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: no conversions
        return []
    return [repr(c) for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


# ------------------------------------------------------------------------------------------------ the files
def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a model folder, in the order their index lists them (or the one file)."""
    path = Path(folder)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in dict.fromkeys(weight_map.values())]
    if (path / SAFETENSORS_FILE).is_file():
        return [path / SAFETENSORS_FILE]
    if any(path.glob("pytorch_model*.bin")):
        raise ShardedLoadError(
            f"{folder} holds pytorch_model.bin weights, which each rank cannot read a part of (a pickle is read "
            "whole). Convert the folder once to safetensors (AutoModelForCausalLM.from_pretrained(folder)"
            f".save_pretrained(new_folder), then --model.model_path new_folder), {_fix()}."
        )
    raise ShardedLoadError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {folder}: pass a model folder, {_fix()}.")


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data starts."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def _read_into(file: Any, offset: int, target: torch.Tensor) -> None:
    """``target.nbytes`` bytes of ``file`` from ``offset`` into ``target`` (contiguous, on the host)."""
    view = memoryview(target.view(-1).view(torch.uint8).numpy())
    file.seek(offset)
    done = 0
    while done < len(view):
        count = file.readinto(view[done : min(len(view), done + READ_CHUNK_BYTES)])
        if not count:
            raise ShardedLoadError(f"{file.name} ends early (at byte {offset + done}): the file is truncated.")
        done += count


# ----------------------------------------------------------------------------------------- this rank's rows
def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The memory of this rank's part of ``tensor`` and the rows ``[start, stop)`` of the whole tensor it holds.

    A DTensor placed ``Shard(0)`` on one mesh dimension (FSDP2's row blocks, ``torch.chunk``) and ``Replicate()`` on any
    other (HSDP's replicas); a plain tensor is whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0, tensor.shape[0] if tensor.dim() else 1
    local = tensor.to_local()
    rows = tensor.shape[0]
    start, stop = 0, rows
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise ShardedLoadError(
                f"a parameter is placed {tuple(tensor.placements)}; the sharded reader reads FSDP2's row shards "
                f"(Shard(0), Replicate() across replicas) only: shard with fully_shard, {_fix()}."
            )
        size, coordinate = tensor.device_mesh.size(dim), tensor.device_mesh.get_local_rank(dim)
        block = math.ceil((stop - start) / size)
        start, stop = min(stop, start + coordinate * block), min(stop, start + (coordinate + 1) * block)
    if local.shape[0] != stop - start:
        raise ShardedLoadError(
            f"a shard holds {local.shape[0]} rows where FSDP2's blocks give this rank {stop - start} of {rows}: "
            f"shard without a custom shard_placement_fn, {_fix()}."
        )
    return local, start, stop


@torch.no_grad()
def load_rows(model: torch.nn.Module, folder: str | Path) -> None:
    """Read this rank's rows of every parameter and persistent buffer of ``model`` from ``folder``'s safetensors.

    Converts to each target's dtype (``--model.dtype``). Tied parameters are one tensor, read once (from whichever of
    their names the files hold). Raises :class:`ShardedLoadError` for a weight of the model that no file holds, or a
    file's tensor of another shape than the model's."""
    targets = model.state_dict(keep_vars=True)  # parameters and persistent buffers, tied ones under each name
    prefix = getattr(model, "base_model_prefix", "")
    loaded: set[int] = set()
    unexpected: list[str] = []
    staging = _Staging()
    for path in weight_files(folder):
        header, data_start = read_header(path)
        with open(path, "rb", buffering=0) as file:
            for key, entry in header.items():
                name = key if key in targets else f"{prefix}.{key}"
                target = targets.get(name)
                if target is None:
                    unexpected.append(key)
                    continue
                if id(target) in loaded:  # the second name of a tied weight
                    continue
                shape = tuple(entry["shape"])
                if shape != tuple(target.shape):
                    raise ShardedLoadError(
                        f"{path.name}: {key} has shape {shape}, the model's {name} {tuple(target.shape)}; the config "
                        f"does not describe these weights: check --model.model_path, {_fix()}."
                    )
                _read_tensor_rows(file, data_start, entry, target, staging)
                loaded.add(id(target))
    missing = [name for name, target in targets.items() if id(target) not in loaded]
    if unexpected and not missing:
        shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        warnings.warn(f"the safetensors files in {folder} also hold {shown}, unused by the model", stacklevel=2)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        also = f"; the files hold {', '.join(unexpected[:3])}, ... instead" if unexpected else ""
        raise ShardedLoadError(
            f"the safetensors files in {folder} hold no {shown}{also}: check that the folder's config and weights are "
            f"of one model (--model.model_path), {_fix()}."
        )


def _read_tensor_rows(
    file: Any, data_start: int, entry: Mapping[str, Any], target: torch.Tensor, staging: _Staging
) -> None:
    """Read the rows of one file tensor that this rank's part of ``target`` holds, into it."""
    file_dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if file_dtype is None:
        raise ShardedLoadError(
            f"{file.name}: dtype {entry['dtype']} is not one the sharded reader converts "
            f"({', '.join(SAFETENSORS_DTYPES)}), {_fix()}."
        )
    local, start, stop = local_rows(target)
    if stop == start:
        return
    shape = tuple(entry["shape"])
    row_shape = shape[1:]
    row_bytes = math.prod(row_shape) * file_dtype.itemsize
    offset = data_start + entry["data_offsets"][0] + start * row_bytes
    if local.dtype == file_dtype and local.device.type == "cpu" and local.is_contiguous():
        _read_into(file, offset, local)  # straight into the shard's memory
        return
    # another dtype or device: through the host staging buffer, a few MiB of rows at a time; copy_ converts (and, to
    # a GPU, copies synchronously: the buffer is free again when it returns)
    rows = local.view(-1, *row_shape) if shape else local.view(1)
    step = max(1, STAGING_BYTES // max(1, row_bytes))
    for first in range(0, stop - start, step):
        count = min(step, stop - start - first)
        rows_host = staging.rows(count, row_shape, file_dtype)
        _read_into(file, offset + first * row_bytes, rows_host)
        rows[first : first + count].copy_(rows_host)


class _Staging:
    """One reusable host buffer for the rows that need a conversion: a fixed size, so converting adds at most
    ``STAGING_BYTES`` (or one row, if larger) to the rank's peak, allocated once per load."""

    def __init__(self) -> None:
        self.bytes_host = torch.empty(0, dtype=torch.uint8)

    def rows(self, count: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = count * math.prod(row_shape) * dtype.itemsize
        if self.bytes_host.numel() < nbytes:
            self.bytes_host = torch.empty(max(nbytes, STAGING_BYTES), dtype=torch.uint8)
        return self.bytes_host[:nbytes].view(dtype).view(count, *row_shape)
