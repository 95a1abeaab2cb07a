"""An activation estimate: what autograd keeps for the backward pass, counted by running the model's forward on the
meta device (shapes only, no memory, well under a second for a 70 B model).

Every tensor saved for backward passes through a ``saved_tensors_hooks`` pack hook; the estimate is the bytes of
the distinct storages among them that are not parameters or buffers (a view saved by several operations counts
once). The attention of a Hugging Face model runs as :data:`ATTENTION`, which saves
what a fused attention kernel saves (query, key, value, output and the fp32 log-sum-exp per row) instead of the
sequence-squared probabilities of the eager path. With activation checkpointing each decoder block keeps only its
input, and one block's activations come back during its backward: the estimate is what the model saves outside
the blocks, plus every block's input, plus the largest block's saved bytes. On top of either comes the largest
saved tensor once more, for the gradient of it that the backward holds beside it (the logits' gradient of a
language model). Estimates: the caching allocator's fragmentation and the kernels' workspaces are not in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ATTENTION = "zenflow_planned"
"""The attention the meta model runs: what a fused attention kernel saves."""
_REGISTERED = False


class _FusedAttention(torch.autograd.Function):
    """Shapes of a fused attention: output ``[batch, seq, heads, dim]``; saves q, k, v, the output and the
    log-sum-exp, as FlashAttention and torch's efficient SDPA kernels do."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(query.transpose(1, 2))
        logsumexp = query.new_empty(query.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # pragma: no cover - never run
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any):
    return _FusedAttention.apply(query, key, value), None


def register_attention() -> None:
    """Register :data:`ATTENTION` with transformers' attention functions (once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
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
    """The same Hugging Face architecture built from its config on the meta device, with the planned attention."""
    from transformers import AutoModelForCausalLM

    register_attention()
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.config, dtype=dtype, attn_implementation=ATTENTION)
