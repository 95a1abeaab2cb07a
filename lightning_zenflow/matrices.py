"""How each weight becomes the engine's ``[rows, columns]`` matrix, where its own shape does not say.

The engine splits a matrix by column, and ZenFlow's premise is about input channels: a few input channels carry most
of a gradient's norm, and the same ones from step to step. A 2-D weight used with ``F.linear`` (``[out, in]``) has its
input channels as columns in the engine's default view ``[shape[0], numel // shape[0]]``; so does a convolution's
``[out, in, kernel...]`` (its columns are the input features ``in x kernel``).

A mixture-of-experts layer of transformers 5 holds its experts as one fused 3-D parameter, and the default view would
make each weight *position* across the experts a column (``[E, out x in]``: 3 M "columns" per tensor for Qwen3-30B-A3B
instead of 2048 input channels, with per-column state to match). Such a parameter is a stack of ``E`` matrices, and
the engine views it as ``[E x out, in]`` (rows: every expert's output channels; columns: the input channels the
experts share), which is ``[numel // shape[-1], shape[-1]]``:

- ``"out_in"``: ``[E, out, in]``, used with ``F.linear`` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek, ...): the
  columns are the input channels.
- ``"in_out"``: ``[E, in, out]``, used with ``bmm`` / ``x @ W`` (GPT-OSS): its contiguous ``[E x in, out]`` view has
  the *output* channels as columns, and that is what the engine selects (a view whose columns were the input channels
  would be strided, which the engine's in-place row blocks cannot take). docs/llm.md says what that costs.

Where the layout comes from: transformers declares it on each experts module (``use_experts_implementation(...,
is_transposed=...)`` sets ``is_transposed`` on the module: ``False`` is ``"out_in"``, ``True`` is ``"in_out"``); the
knob ``expert_layouts`` names others (a module class name, or a pattern of parameter names, to a layout). A parameter
of three or more dimensions that is neither a convolution's nor named keeps the default view, said once with the knob
to set.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from torch import nn

from lightning_zenflow.engine.notices import notice_once

EXPERT_LAYOUTS = ("out_in", "in_out")
"""The layouts of a stack of expert matrices ``[E, a, b]``: ``"out_in"`` (``F.linear``) or ``"in_out"`` (``bmm``)."""
_CONVOLUTIONS = (nn.modules.conv._ConvNd,)


def check_expert_layouts(expert_layouts: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> dict[str, str]:
    """``expert_layouts`` as a dict, every layout checked (a clear error naming the choices)."""
    if expert_layouts is None:
        return {}
    pairs = dict(expert_layouts.items() if isinstance(expert_layouts, Mapping) else expert_layouts)
    for key, layout in pairs.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"expert_layouts keys are module class names or parameter name patterns, got {key!r}.")
        if layout not in EXPERT_LAYOUTS:
            raise ValueError(
                f"expert_layouts[{key!r}]={layout!r} is not one of {list(EXPERT_LAYOUTS)}: 'out_in' for experts "
                "stored [experts, out, in] and used with F.linear, 'in_out' for [experts, in, out] used with bmm."
            )
    return pairs


def expert_layout(
    module: nn.Module, parameter_name: str, expert_layouts: Mapping[str, str] | None = None
) -> str | None:
    """The layout of ``module``'s parameter (``parameter_name``: its full name in the model), or None: the user's
    ``expert_layouts`` first (the module's class name, then a pattern of parameter names), then transformers'
    declaration on the module."""
    for key, layout in (expert_layouts or {}).items():
        if key == type(module).__name__ or fnmatch.fnmatchcase(parameter_name, key):
            return layout
    transposed = getattr(module, "is_transposed", None)
    if isinstance(transposed, bool):
        return "in_out" if transposed else "out_in"
    return None


def matrix_columns(model: nn.Module, expert_layouts: Mapping[str, str] | None = None) -> dict[str, int]:
    """Per parameter name, the columns of the engine's view of each parameter of three or more dimensions that is a
    stack of expert matrices (``shape[-1]``); parameters not listed keep the default view. A parameter whose layout is
    unknown (not a convolution's, not declared, not named) is said once, naming the knob."""
    columns: dict[str, int] = {}
    unknown: list[str] = []
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dim() < 3:
                continue
            full = f"{module_name}.{name}" if module_name else name
            layout = expert_layout(module, full, expert_layouts)
            if layout is not None:
                columns[full] = int(param.shape[-1])
            elif not isinstance(module, _CONVOLUTIONS):
                unknown.append(f"{full} {tuple(param.shape)} in {type(module).__name__}")
    if unknown:
        notice_once(
            "unknown_matrix_layout:" + ",".join(sorted(unknown)),
            f"ZenFlow does not know how these parameters map to matrices of input channels: {', '.join(unknown)}; "
            "each is split as [shape[0], the rest] (its columns are weight positions, not input channels). If they "
            "are stacks of expert matrices, name their layout: expert_layouts={'<module class or parameter "
            "pattern>': 'out_in'} for [experts, out, in] used with F.linear, 'in_out' for [experts, in, out] used "
            "with bmm.",
        )
    return columns
