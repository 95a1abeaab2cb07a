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

A file's tensor is matched to the model as ``from_pretrained`` matches it: by its ``state_dict`` name, with or without
the base model's prefix, after ``transformers``' renames; the tensors that ``transformers`` fuses (a mixture of
experts' per-expert tensors into one 3-D parameter) are planned by ``conversions.py``, each rank reading the file
tensors of its own experts into its rows. All of it is planned from the files' headers first (:func:`plan_folder`), so
what cannot be read (a conversion rule it does not read per row, a missing tensor, another shape,
``pytorch_model.bin`` folders, quantized ones) is refused with the fix before any weight is allocated; tensors the
model does not have are skipped (``from_pretrained`` warns of them).
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

from lightning_zenflow.llm.conversions import Read, ReadPlan, ShardedLoadError, load_fix, plan_reads

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
            f".save_pretrained(new_folder), then --model.model_path new_folder), {load_fix()}."
        )
    raise ShardedLoadError(
        f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {folder}: pass a model folder, {load_fix()}."
    )


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
                f"(Shard(0), Replicate() across replicas) only: shard with fully_shard, {load_fix()}."
            )
        size, coordinate = tensor.device_mesh.size(dim), tensor.device_mesh.get_local_rank(dim)
        block = math.ceil((stop - start) / size)
        start, stop = min(stop, start + coordinate * block), min(stop, start + (coordinate + 1) * block)
    if local.shape[0] != stop - start:
        raise ShardedLoadError(
            f"a shard holds {local.shape[0]} rows where FSDP2's blocks give this rank {stop - start} of {rows}: "
            f"shard without a custom shard_placement_fn, {load_fix()}."
        )
    return local, start, stop


def plan_folder(model: Any, folder: str | Path) -> ReadPlan:
    """What :func:`load_rows` reads of ``folder`` into ``model`` (which may still be on meta), from the files' headers
    alone (``conversions.py``'s :func:`~lightning_zenflow.llm.conversions.plan_reads`). Raises
    :class:`ShardedLoadError`, naming the fix, for anything it cannot read: so a caller that plans first refuses before
    it allocates a weight."""
    quantization = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else type(quantization).__name__
        raise ShardedLoadError(
            f"{folder}'s config.json holds a quantization_config ({method}); the sharded reader reads float tensors "
            "only. Save a de-quantized copy once (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, "
            "plus the quantizer's dequantize option, such as quantization_config=Mxfp4Config(dequantize=True))"
            f".save_pretrained(new_folder), then --model.model_path new_folder), {load_fix()}."
        )
    return plan_reads(model, [(path, *read_header(path)) for path in weight_files(folder)])


@torch.no_grad()
def load_rows(model: torch.nn.Module, folder: str | Path, plan: ReadPlan | None = None) -> int:
    """Read this rank's rows of every parameter and persistent buffer of ``model`` from ``folder``'s safetensors, as
    ``plan`` (:func:`plan_folder`, made here when ``None``) places the file tensors; the bytes read from the files.

    Converts to each target's dtype (``--model.dtype``). Tied parameters are one tensor, read once (from whichever of
    their names the files hold). A fused parameter's row that another rank holds (an expert) is not read at all.
    Records the conversions that matched as ``model._weight_conversions``, as ``from_pretrained`` does: the export
    writes the files' format back from them. Raises :class:`ShardedLoadError` (from the plan) for a weight of the
    model that no file holds, or a file tensor of another shape than its place."""
    if plan is None:
        plan = plan_folder(model, folder)
    targets = model.state_dict(keep_vars=True)
    reads_by_file: dict[Path, list[Read]] = {}
    for read in plan.reads:
        reads_by_file.setdefault(read.source.path, []).append(read)
    staging = _Staging()
    read_bytes = 0
    for path, reads in reads_by_file.items():
        reads.sort(key=lambda read: read.source.entry["data_offsets"][0])  # forward through the file
        with open(path, "rb", buffering=0) as file:
            for read in reads:
                read_bytes += _read_placed(file, read, targets[read.target], staging)
    if plan.unexpected:
        shown = ", ".join(plan.unexpected[:5])
        more = f" and {len(plan.unexpected) - 5} more" if len(plan.unexpected) > 5 else ""
        warnings.warn(f"the safetensors files in {folder} also hold {shown}{more}, unused by the model", stacklevel=2)
    if plan.conversions is not None:
        model._weight_conversions = plan.conversions
    return read_bytes


def _read_placed(file: Any, read: Read, target: torch.Tensor, staging: _Staging) -> int:
    """Read what this rank holds of ``read``'s file tensor into its part of ``target``; the bytes read.

    A plain tensor: this rank's rows of it, one contiguous byte range. A piece of a fused tensor (an expert): the
    whole file tensor when this rank holds its row, into the row's slice; else nothing."""
    source = read.source
    file_dtype = SAFETENSORS_DTYPES.get(source.entry["dtype"])
    if file_dtype is None:
        raise ShardedLoadError(
            f"{file.name}: dtype {source.entry['dtype']} is not one the sharded reader converts "
            f"({', '.join(SAFETENSORS_DTYPES)}), {load_fix()}."
        )
    local, start, stop = local_rows(target)
    offset = source.data_start + source.entry["data_offsets"][0]
    if read.row is None:
        if stop == start:
            return 0
        row_shape = source.shape[1:]
        rows = local.view(-1, *row_shape) if source.shape else local.view(1)
        return _read_rows(file, offset + start * math.prod(row_shape) * file_dtype.itemsize, rows, file_dtype, staging)
    if not start <= read.row < stop:  # another rank's expert: not a byte of it is read here
        return 0
    destination = local[read.row - start]
    if destination.dim() == 0:
        return _read_rows(file, offset, destination.view(1), file_dtype, staging)
    destination = destination.narrow(read.dim, read.offset, source.shape[read.dim])  # its slice of the row
    return _read_rows(file, offset, destination, file_dtype, staging)


def _read_rows(file: Any, offset: int, rows: torch.Tensor, file_dtype: torch.dtype, staging: _Staging) -> int:
    """Read ``rows`` (a view ``[count, *row_shape]`` of a target, its file bytes contiguous from ``offset``) from
    ``file``; the bytes read."""
    row_shape = tuple(rows.shape[1:])
    row_bytes = math.prod(row_shape) * file_dtype.itemsize
    if rows.dtype == file_dtype and rows.device.type == "cpu" and rows.is_contiguous():
        _read_into(file, offset, rows)  # straight into the shard's memory
        return rows.shape[0] * row_bytes
    # another dtype or device, or a strided slice: through the host staging buffer, a few MiB of rows at a time;
    # copy_ converts (and, to a GPU, copies synchronously: the buffer is free again when it returns)
    step = max(1, STAGING_BYTES // max(1, row_bytes))
    for first in range(0, rows.shape[0], step):
        count = min(step, rows.shape[0] - first)
        rows_host = staging.rows(count, row_shape, file_dtype)
        _read_into(file, offset + first * row_bytes, rows_host)
        rows[first : first + count].copy_(rows_host)
    return rows.shape[0] * row_bytes


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
