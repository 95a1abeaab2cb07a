"""The demo's small GPT (written here, no download) and its learning-rate schedule.

Every parameter is a distinct tensor (no weight tying): the ZenFlow optimizer splits each matrix by column, and a
tensor shared by two modules would be updated twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of :class:`GPT`.

    The defaults give 875,264 parameters; a training step on 16 blocks of 128 bytes takes about 0.19 s on one CPU
    core and 0.12 s on two.
    """

    vocab_size: int = 256
    """Number of token ids (256 for byte-level text)."""

    block_size: int = 128
    """Longest sequence the model accepts (size of the learned position table)."""

    n_layer: int = 4
    """Transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 128
    """Width of the residual stream."""

    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (0 keeps runs bit-comparable)."""

    bias: bool = True
    """Biases in the Linear layers and LayerNorms (the lm_head never has one)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}.")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1).")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq_len, width = hidden.shape
        # (B, T, 3C) -> three (B, n_head, T, head_dim) tensors, the layout scaled_dot_product_attention expects.
        query, key, value = (
            part.view(batch, seq_len, self.n_head, width // self.n_head).transpose(1, 2)
            for part in self.qkv(hidden).split(width, dim=2)
        )
        attended = F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        attended = attended.transpose(1, 2).contiguous().view(batch, seq_len, width)
        return self.resid_dropout(self.proj(attended))


class MLP(nn.Module):
    """The position-wise feed-forward branch: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(hidden))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_attn(hidden))
        return hidden + self.mlp(self.ln_mlp(hidden))


class GPT(nn.Module):
    """A small decoder-only transformer with learned positions and an untied output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.n_embd, bias=config.bias)
        # No bias and no tie to token_embedding: every parameter stays a distinct tensor (see the module docstring).
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of scalar parameters (embeddings included)."""
        return sum(param.numel() for param in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits for every position, and their mean cross-entropy against ``targets`` if given.

        Args:
            idx: token ids, shape ``(batch, seq_len)`` with ``seq_len <= block_size``.
            targets: the token that follows each position, same shape as ``idx``.

        Returns:
            ``(logits, loss)``: logits of shape ``(batch, seq_len, vocab_size)``; ``loss`` is ``None`` without targets.
        """
        seq_len = idx.shape[1]
        if seq_len > self.config.block_size:
            raise ValueError(
                f"Sequence length {seq_len} exceeds block_size={self.config.block_size}; build the model with a "
                "larger block_size or feed shorter sequences."
            )
        positions = torch.arange(seq_len, device=idx.device)
        hidden = self.embedding_dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.lm_head(self.ln_final(hidden))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class WarmupSchedule:
    """LR factor for ``LambdaLR``: linear warmup to 1, then constant or a cosine decay to ``min_factor``.

    A class rather than a closure so that ``LambdaLR.state_dict()`` stores it and a resumed run continues the curve.
    """

    def __init__(self, warmup_steps: int, kind: Literal["constant", "cosine"], total_steps: int | None) -> None:
        self.warmup_steps = warmup_steps
        self.kind = kind
        self.total_steps = total_steps
        self.min_factor = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant" or self.total_steps is None:
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
