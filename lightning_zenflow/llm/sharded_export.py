"""The Hugging Face export of an FSDP2-sharded model, written one tensor at a time (no rank holds the model).

Every rank knows every tensor's name, global shape and dtype (a DTensor carries them), so the files are planned before
anything is gathered: the tensors ``save_pretrained`` writes, in its order, a new file whenever the next tensor would
take the current one past ``max_shard_size`` (a tensor larger than the limit gets a file of its own), each file's
safetensors header computed up front. Rank 0 writes a file's header, then for each of its tensors every rank takes
part in one all-gather (``DTensor.full_tensor``) and rank 0 appends the bytes. At any moment a rank holds its shards
plus one whole tensor.

Where ``transformers`` converts between the files' tensors and the module's (``conversions.py``: a mixture of experts'
fused 3-D parameters), the tensors written are the files' own, as ``save_pretrained`` writes them: the plan runs its
reversed rules on meta tensors of the global shapes, and at the write rank 0 runs them on each gathered group (one
fused parameter, cut into its experts' tensors). Rank 0 then holds one fused parameter and its experts' copies (a
``Chunk`` copies): twice that parameter at most. The split into files follows the tensors one by one, where
``save_pretrained`` keeps the experts cut from one fused parameter in one file (they share its memory): the same
tensors, possibly in other files under a small ``max_shard_size``.

The folder is what ``save_pretrained`` writes for the same weights: ``model-0000k-of-0000n.safetensors`` files with
the ``model.safetensors.index.json`` that maps every name to its file (written for one file too), ``config.json``
(``dtype`` and ``architectures`` set as ``save_pretrained`` sets them) and ``generation_config.json``; tied weights
are written once under the name ``save_pretrained`` keeps, and the ``_keys_to_ignore_on_save`` are left out. Tested
bitwise against ``save_pretrained`` of the same weights in one process (``tests/test_llm_sharded_load.py``).
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_zenflow.llm.conversions import save_groups, saved_tensors
from lightning_zenflow.llm.sharded_load import SAFETENSORS_DTYPES, SAFETENSORS_INDEX

HEADER_ALIGNMENT = 8
"""safetensors pads its header with spaces to a multiple of 8 bytes, so every tensor's data is 8-byte aligned."""
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass
class PlannedFile:
    """One safetensors file of the export: its tensors in order (name, shape, dtype) and their bytes."""

    name: str = ""
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    nbytes: int = 0

    def header(self) -> bytes:
        """The file's header: its length (8 bytes, little-endian), then the JSON padded to ``HEADER_ALIGNMENT``."""
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in self.tensors:
            size = _nbytes(shape, dtype)
            entries[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-(len(text) + 8) % HEADER_ALIGNMENT)
        return struct.pack("<Q", len(text)) + text


def _whole(tensor: torch.Tensor, dtensor_class: type) -> torch.Tensor:
    """``tensor`` whole: a DTensor all-gathered (a collective: every rank calls it), else itself."""
    return tensor.full_tensor() if isinstance(tensor, dtensor_class) else tensor


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"`` or ``"2GiB"`` (``save_pretrained``'s
    ``max_shard_size``)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"export_max_shard_size must be positive, got {size} (--model.export_max_shard_size).")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", size, re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"export_max_shard_size {size!r} is not a size: write bytes or a number with KB, MB, GB (or KiB, MiB, "
            "GiB), e.g. 5GB (--model.export_max_shard_size)."
        )
    number, unit = float(match.group(1)), match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(number * base**power)


def saved_names(model: Any, state: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``state`` that ``save_pretrained`` writes, in order: the ``_keys_to_ignore_on_save`` out, and of
    each group of tied names one, preferring a name the model does not declare as tied to another (the embeddings'
    over the output layer's)."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        if name not in ignored:
            groups.setdefault(id(tensor), []).append(name)
    kept = set()
    for names in groups.values():
        sources = [name for name in names if name not in tied_targets]
        kept.add((sources or names)[0])
    return [name for name in state if name in kept]


def plan_files(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int) -> list[PlannedFile]:
    """The export's files: ``tensors`` in order, a new file when the next would pass ``max_shard_size``."""
    files: list[PlannedFile] = [PlannedFile()]
    for name, shape, dtype in tensors:
        size = _nbytes(shape, dtype)
        if files[-1].tensors and files[-1].nbytes + size > max_shard_size:
            files.append(PlannedFile())
        files[-1].tensors.append((name, shape, dtype))
        files[-1].nbytes += size
    for number, planned in enumerate(files, start=1):
        planned.name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
    return files


@torch.no_grad()
def write_sharded(model: Any, export_dir: str | Path, max_shard_size: int, is_global_zero: bool) -> None:
    """Write ``model``'s weights, config and generation config into ``export_dir`` (rank 0 writes).

    A collective: every rank must call it, in the same order of tensors (each all-gather takes every rank)."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict(keep_vars=True)  # DTensors for the sharded parameters, plain tensors for buffers
    groups = save_groups(model, saved_names(model, state))
    # what save_pretrained writes for each group, planned on meta tensors of the global shapes
    planned_groups = [
        saved_tensors(
            model, {name: torch.empty(state[name].shape, dtype=state[name].dtype, device="meta") for name in group}
        )
        for group in groups
    ]
    planned = [
        (name, tuple(tensor.shape), tensor.dtype) for outputs in planned_groups for name, tensor in outputs.items()
    ]
    for name, _, dtype in planned:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"the export cannot write {name} of dtype {dtype} to safetensors.")
    files = plan_files(planned, max_shard_size)
    file_of = {name: planned_file for planned_file in files for name, _, _ in planned_file.tensors}
    folder = Path(export_dir)
    if is_global_zero:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("model*.safetensors"):  # a former export's files would mix into the index
            stale.unlink()
    with contextlib.ExitStack() as closing:  # the file being written, closed on the way out too
        writing: PlannedFile | None = None
        sink: Any = None
        for group, outputs_planned in zip(groups, planned_groups):
            # every rank takes part in each all-gather; only rank 0 keeps the whole tensors past this group
            whole = {name: _whole(state[name], DTensor) for name in group}
            if not is_global_zero:
                del whole
                continue
            outputs = saved_tensors(model, {name: tensor.detach().to("cpu") for name, tensor in whole.items()})
            del whole
            if [(name, tensor.shape) for name, tensor in outputs.items()] != [
                (name, tensor.shape) for name, tensor in outputs_planned.items()
            ]:
                raise RuntimeError(f"transformers' reversed conversion of {group} wrote other tensors than planned")
            for name, tensor in outputs.items():
                if file_of[name] is not writing:  # the plan's next file: the tensors come in its order
                    closing.close()  # the former file is whole
                    writing = file_of[name]
                    sink = closing.enter_context(open(folder / writing.name, "wb"))
                    sink.write(writing.header())
                host = tensor.contiguous()
                sink.write(memoryview(host.view(-1).view(torch.uint8).numpy()))
            del outputs
    if not is_global_zero:
        return
    index = {
        "metadata": {
            "total_parameters": sum(param.numel() for param in model.parameters()),
            "total_size": sum(planned.nbytes for planned in files),
        },
        "weight_map": {name: planned.name for planned in files for name, _, _ in planned.tensors},
    }
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    # the config as save_pretrained writes it: the weights' dtype and the model's class
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
