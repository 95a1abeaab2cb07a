"""``transformers``' weight conversions, done per row: which tensors of the weight files fill which rows of the model
(the sharded reader, ``sharded_load.py``), and which tensors ``save_pretrained`` writes for the model's (the sharded
export, ``sharded_export.py``).

``transformers`` 5 builds some modules with other parameters than their files hold and converts between the two with
rules of the model class (its conversion mapping: a ``WeightRenaming`` renames a file tensor, a ``WeightConverter``
combines file tensors with a chain of operations); ``save_pretrained`` applies the reversed rules. Mixture-of-experts
layers are the main case. Qwen3-MoE's files hold one ``mlp.experts.{e}.gate_proj.weight`` ``[inter, hidden]`` (and
``up_proj``, ``down_proj``) per expert; its module holds ``mlp.experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``,
made by ``MergeModulelist(dim=0)`` (the experts stacked, in the natural order of their names) and ``Concatenate(dim=1)``
(gate above up), and ``mlp.experts.down_proj`` ``[experts, hidden, inter]`` by the stacking alone. Mixtral's rule is
the same over other names (``block_sparse_moe.experts.{e}.w1``, ``w3``, ``w2``, with a rename); GPT-OSS's files hold
the fused tensors as its module does (``[experts, in, out]``), and need no rule.

FSDP2 shards a parameter by its first dimension, the experts of a fused one: a rank's rows are a block of whole
experts. Stacking along dimension 0, then concatenating along a later one, keeps rows apart: row ``e`` of the fused
parameter is made from the ``e``-th file tensor of each source pattern and nothing else. So each rank reads the file
tensors of its own experts only, straight into their slice of its rows (:func:`plan_reads`), and the result is what
``from_pretrained`` builds, bitwise (each piece is converted to the parameter's dtype on its own there too). A rule
whose operations mix rows (a ``Chunk`` or a ``Transpose`` of dimension 0, a permutation for rotary embeddings, a
quantizer's) cannot be read per row: it is refused with the rule and the fix before anything is allocated.

The names, the order of the experts and the rules are ``transformers``' own (its ``rename_source_key``,
``dot_natural_key``, the model's ``get_model_conversion_mapping``), so the architectures that share a rule (OLMoE,
DeepSeek-V3, GLM-4-MoE, ... use Qwen's) follow without a line here. ``transformers`` 4 has no conversions: there a
file tensor is matched by the module's name, with or without the base model's prefix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException


class ShardedLoadError(ValueError, MisconfigurationException):
    """A model folder or model that the sharded reader cannot load; the message names the fix. Raised in
    ``configure_model``, before training starts: a refusal of the setup, which the CLI prints as one ``error:`` line
    (as Lightning's own ``MisconfigurationException``) instead of a traceback."""


def load_fix() -> str:
    """The ways round a refusal of the sharded reader, the end of every :class:`ShardedLoadError`."""
    return (
        "or pass --model.load_weights now (every rank then reads the whole model into its host memory before it is "
        "sharded), or train it under strategy zenflow_ddp"
    )


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: its name there, its header entry and where the file's data starts."""

    path: Path
    key: str
    entry: Mapping[str, Any]
    data_start: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry["shape"])


@dataclass(frozen=True)
class Read:
    """One file tensor and where it goes: the model tensor ``target`` (a ``state_dict`` name) and, for a fused target,
    the one row of it that the file tensor fills (``row``: an expert), or a slice of that row (``dim``, ``offset``:
    the file tensor's extent along the row's dimension ``dim``, from ``offset``). ``row`` None: the file tensor is
    the target, row for row (each rank reads its own rows of it)."""

    source: FileTensor
    target: str
    row: int | None = None
    dim: int = 0
    offset: int = 0


@dataclass
class ReadPlan:
    """What the sharded reader reads, planned from the files' headers before any weight is allocated: every
    :class:`Read` (each model tensor once, tied ones under one name), the file tensors the model has no place for, and
    the conversion rules that matched a file tensor (``None`` under ``transformers`` 4, which has none)."""

    reads: list[Read] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    conversions: list[Any] | None = None


# ------------------------------------------------------------------------------------------- transformers' rules
@functools.cache
def _transformers_rules() -> SimpleNamespace | None:
    """The parts of ``transformers``' conversions used here, or ``None`` (version 4: no conversions)."""
    try:
        from transformers import core_model_loading as loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    return SimpleNamespace(
        mapping=get_model_conversion_mapping,
        rename_source_key=loading.rename_source_key,
        apply_converters=loading.apply_converters,
        revert_weight_conversion=loading.revert_weight_conversion,
        dot_natural_key=loading.dot_natural_key,
        WeightRenaming=loading.WeightRenaming,
        WeightConverter=loading.WeightConverter,
        PrefixChange=loading.PrefixChange,
        MergeModulelist=loading.MergeModulelist,
        Concatenate=loading.Concatenate,
    )


def _renamer(model: Any, targets: Mapping[str, torch.Tensor]) -> tuple[Callable[[str], tuple[str, Any]], list | None]:
    """``rename(file key) -> (model name, the converter that takes it or None)`` as ``from_pretrained`` renames, and
    the rules it applies (which record their own use)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    rules = _transformers_rules()
    if rules is None:

        def rename_by_prefix(key: str) -> tuple[str, Any]:
            return (key if key in targets or not prefix else f"{prefix}.{key}"), None

        return rename_by_prefix, None
    # the rules from_pretrained loads with: the model's own, the fused modules', the legacy renames of old files
    mapping = rules.mapping(model)
    renamings = [rule for rule in mapping if isinstance(rule, rules.WeightRenaming)]
    converters = [rule for rule in mapping if isinstance(rule, rules.WeightConverter)]
    by_pattern = {pattern: rule for rule in converters for pattern in rule.source_patterns}

    def rename(key: str) -> tuple[str, Any]:
        name, pattern = rules.rename_source_key(key, renamings, converters, prefix or None, targets)
        if name not in targets and key in targets:  # a rule renamed a tensor the model holds under its file name
            name, pattern = rules.rename_source_key(key, [], [], prefix or None, targets)
        return name, (None if pattern is None else (by_pattern[pattern], pattern))

    return rename, mapping


def _row_concat_dim(converter: Any, ndim: int) -> int | None:
    """The dimension of a fused tensor's row along which ``converter`` concatenates its source patterns (0 when it
    only stacks them), or ``None`` when its operations are not a stacking of rows along dimension 0 (then optionally a
    concatenation along a later dimension): those cannot be read per row."""
    rules = _transformers_rules()
    operations = list(getattr(converter, "operations", ()))
    if not operations or type(operations[0]) is not rules.MergeModulelist or operations[0].dim != 0:
        return None
    if len(operations) == 1:
        return 0 if len(converter.source_patterns) == 1 else None
    if len(operations) == 2 and type(operations[1]) is rules.Concatenate:
        dim = operations[1].dim % ndim
        return dim - 1 if dim >= 1 else None
    return None


def describe_rule(converter: Any) -> str:
    """A converter as text: its patterns and operations (``WeightConverter``'s own repr leaves the operations out)."""
    operations = ", ".join(repr(operation) for operation in getattr(converter, "operations", ()))
    return f"{converter!r} with operations [{operations}]"


# ---------------------------------------------------------------------------------------------------- loading
def plan_reads(model: Any, files: list[tuple[Path, dict[str, Any], int]]) -> ReadPlan:
    """Where every tensor of ``files`` (``(path, header, data_start)`` of each safetensors file) goes in ``model``.

    ``model`` may be on meta: only names and shapes are read. Raises :class:`ShardedLoadError`, naming the fix, for a
    conversion that cannot be done per row, a model tensor that no file holds (or an expert that is missing), and a
    file tensor of another shape than its place in the model."""
    targets = model.state_dict(keep_vars=True)  # parameters and persistent buffers, tied ones under each name
    rename, mapping = _renamer(model, targets)
    tensors = [
        FileTensor(path, key, entry, data_start) for path, header, data_start in files for key, entry in header.items()
    ]
    rules = _transformers_rules()
    if rules is not None:  # from_pretrained's order: the experts of a fused tensor are stacked in this order
        tensors.sort(key=lambda tensor: rules.dot_natural_key(tensor.key))
    plan = ReadPlan()
    fused: dict[str, tuple[Any, dict[str, list[FileTensor]]]] = {}
    placed: dict[int, str] = {}  # model tensor -> the name it is read under (tied weights: one of their names)
    for tensor in tensors:
        name, converted = rename(tensor.key)
        target = targets.get(name)
        if target is None:
            plan.unexpected.append(tensor.key)
            continue
        if converted is not None:
            converter, pattern = converted
            fused.setdefault(name, (converter, {}))[1].setdefault(pattern, []).append(tensor)
            continue
        if placed.setdefault(id(target), name) != name:  # the second name of a tied weight
            continue
        _check_shape(tensor, name, tuple(target.shape))
        plan.reads.append(Read(tensor, name))
    for name, (converter, by_pattern) in fused.items():
        if placed.setdefault(id(targets[name]), name) == name:
            plan.reads.extend(_fused_reads(model, name, tuple(targets[name].shape), converter, by_pattern))
    missing = [name for name, target in targets.items() if id(target) not in placed]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        also = f"; the files hold {', '.join(plan.unexpected[:3])}, ... instead" if plan.unexpected else ""
        folder = files[0][0].parent if files else "the folder"
        raise ShardedLoadError(
            f"the safetensors files in {folder} hold no {shown}{also}: check that the folder's config and weights are "
            f"of one model (--model.model_path), {load_fix()}."
        )
    if mapping is not None:
        plan.conversions = [rule for rule in mapping if rule.was_used()]  # what from_pretrained keeps for the save
    return plan


def _check_shape(tensor: FileTensor, name: str, expected: tuple[int, ...]) -> None:
    """A file tensor of another shape than its place in the model (``name``: a tensor, or a row of a fused one) is
    refused: the config and the files are not of one model."""
    if tensor.shape != expected:
        raise ShardedLoadError(
            f"{tensor.path.name}: {tensor.key} has shape {tensor.shape}, the model's {name} {expected}; the config "
            f"does not describe these weights: check --model.model_path, {load_fix()}."
        )


def _fused_reads(
    model: Any, name: str, shape: tuple[int, ...], converter: Any, by_pattern: dict[str, list[FileTensor]]
) -> list[Read]:
    """The reads that fill the fused tensor ``name`` (``shape``) from the file tensors ``converter`` takes (by source
    pattern, in ``from_pretrained``'s order): the ``e``-th tensor of each pattern fills row ``e``, the patterns one
    after another along the row's concatenated dimension."""
    dim = _row_concat_dim(converter, len(shape))
    if dim is None:
        first = next(iter(by_pattern.values()))[0]
        raise ShardedLoadError(
            f"{type(model).__name__}'s file tensor {first.key} (and the others of its rule) becomes {name} by "
            f"transformers' rule {describe_rule(converter)}, which the sharded reader does not read per row: it reads "
            "the rules that stack experts (MergeModulelist(dim=0), then may concatenate them along a later dimension, "
            "Concatenate(dim>=1)), whose rows FSDP2 shards are whole experts. Convert the folder once to the module's "
            "own tensors (AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder, "
            f"save_original_format=False), then --model.model_path new_folder), {load_fix()}."
        )
    rows, row_shape = shape[0], shape[1:]
    reads, offset = [], 0
    for pattern in converter.source_patterns:
        pieces = by_pattern.get(pattern, [])
        if len(pieces) != rows:
            held = ", ".join(piece.key for piece in pieces[:2]) or "none of them"
            raise ShardedLoadError(
                f"the files hold {len(pieces)} tensors of the pattern {pattern} ({held}, ...) where {name} "
                f"{shape} stacks {rows}: experts are missing or the config counts others; check --model.model_path, "
                f"{load_fix()}."
            )
        expected = list(row_shape)
        if row_shape and len(pieces[0].shape) == len(row_shape):
            expected[dim] = pieces[0].shape[dim]  # this pattern's extent along the concatenated dimension
        extent = expected[dim] if row_shape else 0
        for row, piece in enumerate(pieces):
            _check_shape(piece, f"{name}[{row}]", tuple(expected))
            reads.append(Read(piece, name, row=row, dim=dim, offset=offset))
        offset += extent
    if row_shape and offset != row_shape[dim]:
        raise ShardedLoadError(
            f"the tensors of {', '.join(converter.source_patterns)} fill {offset} of the {row_shape[dim]} entries of "
            f"dimension {dim + 1} of {name} {shape}; the config does not describe these weights: check "
            f"--model.model_path, {load_fix()}."
        )
    return reads


# ---------------------------------------------------------------------------------------------------- export
def _save_rules(model: Any) -> tuple[Any, list | None]:
    """The rules ``save_pretrained`` reverses for ``model``, as ``transformers``' ``revert_weight_conversion`` picks
    them: those its load used (``_weight_conversions``, which the sharded reader sets too), else the class's own
    without prefix changes; ``None`` when there are none (the names are written as the module's)."""
    rules = _transformers_rules()
    if rules is None:
        return None, None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        mapping = rules.mapping(model, add_legacy=False)
        conversions = [rule for rule in mapping if not isinstance(rule, rules.PrefixChange)] or None
    return rules, conversions


def save_groups(model: Any, names: list[str]) -> list[list[str]]:
    """``names`` (the model tensors ``save_pretrained`` writes) in the groups its reversed rules take together (the
    two fused expert tensors of a layer each alone, say; a tensor no rule takes alone), in its order: the state
    dict's where no rule applies, else the natural order of the names, a group where its first name comes."""
    rules, conversions = _save_rules(model)
    if conversions is None:
        return [[name] for name in names]
    reversed_rules = [rule.reverse_transform() for rule in conversions[::-1]]
    converters = [rule for rule in reversed_rules if isinstance(rule, rules.WeightConverter)]
    groups: dict[tuple[str, str], list[str]] = {}
    for name in sorted(names, key=rules.dot_natural_key):
        renamed, pattern = rules.apply_converters(name, converters)
        groups.setdefault(("rule", renamed) if pattern is not None else ("name", name), []).append(name)
    return list(groups.values())


def saved_tensors(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``tensors`` (one of :func:`save_groups`' groups, whole): its reversed
    rules applied (an expert's tensors cut out of a fused one, renamed as the files name them), or ``tensors`` as they
    are. Works on meta tensors too: the export plans its files with it before anything is gathered."""
    rules, conversions = _save_rules(model)
    if conversions is None:
        return tensors
    return rules.revert_weight_conversion(model, tensors)
