"""An activation estimate: what autograd keeps for the backward pass, counted by running the model's forward on the
meta device (shapes only, no memory, well under a second for a 70 B model).

Every tensor saved for backward passes through a ``saved_tensors_hooks`` pack hook; the estimate is the bytes of
the distinct storages among them that are not parameters or buffers (a view saved by several operations counts
once). The attention of a Hugging Face model runs as :data:`ATTENTION`, which saves
what a fused attention kernel saves (query, key, value, output and the fp32 log-sum-exp per row) instead of the
sequence-squared probabilities of the eager path; the routed experts of a mixture of experts run as :data:`EXPERTS`,
which saves what transformers' default ``grouped_mm`` path saves (the tokens x experts-per-token routed rows going
into each product, the gate's inputs), in any dtype. With activation checkpointing each decoder block keeps only its
input, and one block's activations come back during its backward: the estimate is what the model saves outside
the blocks, plus every block's input, plus the largest block's saved bytes. On top of either comes the largest
saved tensor once more, for the gradient of it that the backward holds beside it (the logits' gradient of a
language model). Estimates: the caching allocator's fragmentation and the kernels' workspaces are not in it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zenflow.planner.experts import expert_modules

ATTENTION = "zenflow_planned"
"""The attention the meta model runs: what a fused attention kernel saves."""
EXPERTS = "zenflow_planned"
"""The routed experts the meta model runs: what transformers' grouped product of the routed rows saves."""
_REGISTERED = False


class _FusedAttention(torch.autograd.Function):
    """Shapes of a fused attention: output ``[batch, seq, heads, value dim]`` (the value's width, which DeepSeek's
    attention makes narrower than the query's); saves q, k, v, the output and the log-sum-exp, as FlashAttention and
    torch's efficient SDPA kernels do."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        batch, heads, sequence, _ = query.shape
        output = query.new_empty(batch, sequence, heads, value.shape[-1])
        logsumexp = query.new_empty(query.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # pragma: no cover - never run
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any):
    return _FusedAttention.apply(query, key, value), None


class _GroupedProduct(torch.autograd.Function):
    """Shapes of the product of the routed rows (sorted by expert) with their experts' weights, ``[experts, out, in]``
    or, transposed, ``[experts, in, out]``: output ``[rows, out]``; saves the rows, as ``grouped_mm`` does (the weight
    is a parameter). Transformers' own product takes bf16 only on the meta device."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        return rows.new_empty(rows.shape[0], weight.shape[2] if transposed else weight.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # pragma: no cover - never run
        rows, weight = ctx.saved_tensors
        return torch.zeros_like(rows), torch.zeros_like(weight), None


def _experts(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A fused experts module's forward as transformers' ``grouped_mm`` path runs it, its products by
    :class:`_GroupedProduct`: each token's rows for its chosen experts, sorted by expert; the up (and gate) product
    and its bias; the gate or the activation; the down product and its bias; the routing weights; back in token order,
    summed per token. Every shape is the routing's count (tokens x experts per token), whichever experts are chosen,
    so the meta device runs it."""
    per_token = top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[order // per_token]
    routing_weights = top_k_weights.reshape(-1)[order]
    gated = module.has_gate
    up = _GroupedProduct.apply(rows, module.gate_up_proj if gated else module.up_proj, module.is_transposed)
    if module.has_bias:
        up = up + (module.gate_up_proj_bias if gated else module.up_proj_bias)[expert_ids]
    up = module._apply_gate(up) if gated else module.act_fn(up)
    down = _GroupedProduct.apply(up, module.down_proj, module.is_transposed)
    if module.has_bias:
        down = down + module.down_proj_bias[expert_ids]
    if module.has_post_expert_norm:
        down = module.post_expert_norm(down)
    weighted = down * routing_weights.unsqueeze(-1)
    token_order = torch.empty_like(order)
    token_order[order] = torch.arange(order.shape[0], device=order.device)
    per_expert = weighted[token_order].view(-1, per_token, weighted.shape[-1])
    return per_expert.sum(dim=1).to(hidden_states.dtype)


def register_planned() -> None:
    """Register :data:`ATTENTION` and :data:`EXPERTS` with transformers' attention and experts functions (once;
    transformers 4 has no experts functions: it builds each expert as a module of its own)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        pass
    else:
        ExpertsInterface.register(EXPERTS, _experts)
    _REGISTERED = True


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps per rank at the end of a forward (one micro-batch)."""

    saved: int
    """Everything saved, without activation checkpointing."""
    outside_blocks: int
    """Saved outside the decoder blocks (embeddings, final norm, logits and loss)."""
    block_inputs: int
    """The blocks' inputs, summed (what checkpointing keeps of them)."""
    largest_block: int
    """The most one block saves."""
    largest_tensor: int
    """The largest single saved storage (its gradient sits beside it in the backward)."""

    def bytes(self, checkpointing: bool) -> int:
        kept = self.outside_blocks + self.block_inputs + self.largest_block if checkpointing else self.saved
        return kept + self.largest_tensor


def measure_forward(model: nn.Module, run: Callable[[], Any], blocks: list[nn.Module] | None = None) -> Activations:
    """Run ``run()`` (a forward of ``model``) with the pack hook and sum the saved storages, by block."""
    own = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, tuple[torch.UntypedStorage, int, int]] = {}
    current = [-1]
    inputs: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in own and key not in seen:
            seen[key] = (storage, storage.nbytes(), current[0])  # holding the storage keeps its key unique
        return tensor

    def enter(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            current[0] = index
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor):
                inputs[index] = hidden.numel() * hidden.element_size()

        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        current[0] = -1

    handles = []
    for index, block in enumerate(blocks or []):
        handles.append(block.register_forward_pre_hook(enter(index), with_kwargs=True))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
    finally:
        for handle in handles:
            handle.remove()
    by_block: dict[int, int] = {}
    for _, nbytes, block in seen.values():
        by_block[block] = by_block.get(block, 0) + nbytes
    return Activations(
        saved=sum(by_block.values()),
        outside_blocks=by_block.get(-1, 0),
        block_inputs=sum(inputs.values()),
        largest_block=max((n for b, n in by_block.items() if b >= 0), default=0),
        largest_tensor=max((n for _, n, _ in seen.values()), default=0),
    )


def causal_lm_activations(model: nn.Module, batch_size: int, block_size: int) -> Activations:
    """A Hugging Face causal LM's activations for ``batch_size`` sequences of ``block_size`` tokens with labels (the
    loss included), on a copy of its structure on the meta device."""

    planned = getattr(model.config, "_attn_implementation", None) == ATTENTION
    meta = model if planned and _on_meta(model) else _meta_copy(model)
    _planned_experts(meta)
    meta.train()
    block_classes = set(getattr(meta, "_no_split_modules", None) or ())
    blocks = [m for m in meta.modules() if type(m).__name__ in block_classes]
    ids = torch.zeros(batch_size, block_size, dtype=torch.long, device="meta")
    with torch.enable_grad():
        return measure_forward(meta, lambda: meta(input_ids=ids, labels=ids), blocks)


def module_activations(model: nn.Module, example: Any) -> Activations:
    """Any module's activations for ``example`` (a tensor or a tuple of positional arguments), run where the module
    is (on the meta device, no memory; elsewhere, a real forward)."""
    args = example if isinstance(example, tuple) else (example,)
    with torch.enable_grad():
        return measure_forward(model, lambda: model(*args))


def _on_meta(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


def _meta_copy(model: nn.Module) -> nn.Module:
    """The same Hugging Face architecture built from a copy of its config on the meta device, with the planned
    attention: ``from_config`` keeps the config it is given and sets the attention on it, which would switch the
    user's own model to the planner's shapes-only attention."""
    from transformers import AutoModelForCausalLM

    register_planned()
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype, attn_implementation=ATTENTION)


def _planned_experts(model: nn.Module) -> None:
    """Run a mixture of experts' routed experts as :data:`EXPERTS`: transformers' eager loop asks which experts were
    chosen (``nonzero``), which a tensor without values cannot answer, and its ``grouped_mm`` takes bf16 only there.
    Only transformers 5's fused experts modules take another implementation (``use_experts_implementation`` gives
    them their layout's flags, such as ``is_transposed``)."""
    fused = any(hasattr(module, "is_transposed") for _, module in expert_modules(model))
    if fused and getattr(model.config, "_experts_implementation", None) != EXPERTS:
        register_planned()
        model.set_experts_implementation(EXPERTS)
