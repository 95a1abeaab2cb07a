"""The demo language models: a small GPT written here, and a wrapper that fine-tunes a Hugging Face causal LM.

Both consume the ``(x, y)`` byte batches of :class:`~lightning_zenflow.demo.data.ByteCorpusDataModule` and train
with a plain ``torch.optim.AdamW`` (or ``Adam``) over two parameter groups, so an optimizer plugin sees the same
setup a user's model would give it. Every parameter is a distinct tensor (no weight tying): the ZenFlow optimizer
splits each matrix by column, and a tensor shared by two modules would be updated twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

_TRANSFORMERS_INSTALL_HINT = "pip install 'lightning-zenflow[transformers]'"


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


def _validate_optimizer_args(
    learning_rate: float, weight_decay: float, betas: tuple[float, float], eps: float, warmup_steps: int
) -> None:
    if learning_rate <= 0:
        raise ValueError(f"learning_rate={learning_rate} must be positive.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay} must be 0 or more.")
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas={betas} must be two numbers in [0, 1).")
    if eps <= 0:
        raise ValueError(f"eps={eps} must be positive.")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be 0 or more.")


def _build_optimizer_and_schedule(module: LightningModule, parameters: Iterable[nn.Parameter]) -> Any:
    """The ``configure_optimizers`` result shared by both demo modules, from ``module.hparams``.

    Two groups: matrices and embeddings (``ndim >= 2``) get weight decay; biases and LayerNorm weights do not.
    """
    hparams = module.hparams
    trainable = [param for param in parameters if param.requires_grad]
    decay_params = [param for param in trainable if param.ndim >= 2]
    no_decay_params = [param for param in trainable if param.ndim < 2]
    param_groups = [
        {"params": decay_params, "weight_decay": hparams.weight_decay},
        {"params": no_decay_params, "weight_decay": 0.0},
    ]
    optimizer_class = torch.optim.AdamW if hparams.optimizer == "adamw" else torch.optim.Adam
    optimizer = optimizer_class(param_groups, lr=hparams.learning_rate, betas=tuple(hparams.betas), eps=hparams.eps)
    if hparams.warmup_steps == 0 and hparams.lr_schedule == "constant":
        return optimizer

    total_steps: int | None = None
    if hparams.lr_schedule == "cosine":
        total_steps = hparams.max_steps_for_schedule
        if total_steps is None:
            estimated = module.trainer.estimated_stepping_batches
            if not math.isfinite(estimated):
                raise ValueError(
                    "lr_schedule='cosine' needs the length of training, and the Trainer has no max_steps or "
                    "max_epochs. Pass max_steps_for_schedule=... (`--model.max_steps_for_schedule`) or set max_steps."
                )
            total_steps = int(estimated)
    schedule = WarmupSchedule(hparams.warmup_steps, hparams.lr_schedule, total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def _predict_output(logits: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor | dict[str, torch.Tensor]:
    predictions = logits.argmax(dim=-1)
    if loss is None:
        return predictions
    return {"predictions": predictions, "loss": loss}


class CausalLMModule(LightningModule):
    """Trains :class:`GPT` on next-byte prediction with AdamW (or Adam) and an optional warmup/cosine schedule."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        optimizer: Literal["adamw", "adam"] = "adamw",
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        max_steps_for_schedule: int | None = None,
        seed_model: int | None = None,
        base_checkpoint: str | None = None,
        pretrain_steps: int = 0,
        pretrain_data_path: str | None = None,
        pretrain_max_bytes: int = 4_000_000,
        pretrain_batch_size: int = 16,
        pretrain_learning_rate: float = 2e-3,
        pretrain_cache_dir: str | None = None,
    ) -> None:
        """Build the model (see :class:`GPTConfig` for its shape arguments), and say what it starts from.

        It starts from ``base_checkpoint`` if given (loaded and checked here); else, with ``pretrain_steps > 0``, from
        a base pre-trained with plain AdamW when training starts (:mod:`lightning_zenflow.demo.base`: made once, then
        loaded from ``pretrain_cache_dir``); else from a fresh initialisation.

        Args:
            vocab_size: token ids (256 for the byte-level data module).
            block_size: context length; must be at least the data module's ``block_size``.
            n_layer: transformer blocks.
            n_head: attention heads; must divide ``n_embd``.
            n_embd: width of the residual stream.
            dropout: dropout probability (0 keeps runs bit-comparable).
            learning_rate: peak learning rate.
            weight_decay: decay of matrices and embeddings; biases and LayerNorm weights get none.
            betas: Adam's moment coefficients.
            eps: Adam's denominator epsilon.
            optimizer: ``"adamw"`` (decoupled weight decay) or ``"adam"`` (weight decay added to the gradient).
            warmup_steps: optimizer steps of linear warmup from ``learning_rate / warmup_steps``.
            lr_schedule: after warmup, ``"constant"`` or ``"cosine"`` decay to 10% of ``learning_rate``.
            max_steps_for_schedule: length of the cosine schedule in optimizer steps; ``None`` takes the Trainer's
                estimate (``max_steps``, or ``max_epochs`` times the batches per epoch).
            seed_model: seed of the weight initialisation alone (the global RNG is left as it was), so two runs
                start from the same weights whatever else they seed; ``None`` uses the global RNG.
            base_checkpoint: fine-tune from these weights: a Lightning ``.ckpt`` of a ``CausalLMModule`` run, or a
                file saved with ``torch.save(gpt.state_dict(), path)``; the model's shape must match. The
                ``pretrain_*`` arguments are then ignored. It is saved among the hyperparameters, so
                ``load_from_checkpoint`` reads it again: pass ``base_checkpoint=None`` there if the file has moved.
            pretrain_steps: without ``base_checkpoint``: pre-train a base for this many AdamW steps first (0: train
                from a fresh initialisation). The base is cached and reused by every run with the same model shape
                and ``pretrain_*`` values.
            pretrain_data_path: text file or folder to pre-train on; ``None``: the standard library's code with its
                docstrings removed (a different distribution from ``stdlib_text: docs``, which the main job
                fine-tunes on).
            pretrain_max_bytes: bytes of text read for pre-training.
            pretrain_batch_size: blocks of ``block_size`` bytes per pre-training step.
            pretrain_learning_rate: peak pre-training learning rate (warm-up, then cosine to 10 %).
            pretrain_cache_dir: folder of cached bases; ``None``: ``base_cache`` under the Trainer's
                ``default_root_dir``.
        """
        super().__init__()
        _validate_optimizer_args(learning_rate, weight_decay, betas, eps, warmup_steps)
        if max_steps_for_schedule is not None and max_steps_for_schedule < 1:
            raise ValueError(f"max_steps_for_schedule={max_steps_for_schedule} must be at least 1 (or None).")
        if pretrain_steps < 0:
            raise ValueError(f"pretrain_steps={pretrain_steps} must be 0 (no pre-training) or more.")
        self.save_hyperparameters()
        config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
        )
        if seed_model is None:
            self.model = GPT(config)
        else:
            # fork_rng restores the global CPU RNG afterwards; devices=[] because init runs on the CPU only.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed_model)
                self.model = GPT(config)
        # a function-level import: base.py builds GPTs, so it imports this module
        from lightning_zenflow.demo.base import PretrainRecipe, load_base_weights

        self._pretrain_recipe: PretrainRecipe | None = None
        if base_checkpoint is not None:
            # loaded now, not at setup: a wrong file is a configuration error, reported before anything runs
            self.model.load_state_dict(load_base_weights(base_checkpoint, self.model))
        elif pretrain_steps > 0:
            # checked now (a wrong path or value fails before anything runs); the pre-training itself waits for setup
            self._pretrain_recipe = PretrainRecipe(
                data_path=pretrain_data_path,
                max_bytes=pretrain_max_bytes,
                steps=pretrain_steps,
                batch_size=pretrain_batch_size,
                learning_rate=pretrain_learning_rate,
            )

    def setup(self, stage: str) -> None:
        """Load (or pre-train, then cache) the base model before the first stage runs, if one is asked for.

        Lightning calls this before the strategy builds the optimizer and ZenFlow's engine, on the CPU copy of the
        model; the pre-training runs on the Trainer's device. A later ``ckpt_path`` load replaces these weights.
        """
        if self._pretrain_recipe is None:
            return
        from lightning_zenflow.demo.base import load_or_pretrain_base

        cache_dir = self.hparams.pretrain_cache_dir or os.path.join(self.trainer.default_root_dir, "base_cache")
        state = load_or_pretrain_base(
            self.model.config, self._pretrain_recipe, cache_dir, device=self.trainer.strategy.root_device
        )
        self.model.load_state_dict(state)
        self._pretrain_recipe = None  # once: fit then validate in one process keeps the fine-tuned weights

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint's weights win: no base is loaded over them at ``setup`` (``load_from_checkpoint`` then
        ``trainer.validate``, or a resumed fit)."""
        self._pretrain_recipe = None

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, loss)`` of the wrapped :class:`GPT`."""
        return self.model(idx, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        _, loss = self.model(idx, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        _, loss = self.model(idx, targets)
        self.log("val_loss", loss, prog_bar=True, on_epoch=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        _, loss = self.model(idx, targets)
        self.log("test_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def predict_step(
        self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The most likely next byte at every position; with ``(x, y)`` batches, a dict that adds the loss."""
        idx, targets = (batch, None) if isinstance(batch, torch.Tensor) else batch
        logits, loss = self.model(idx, targets)
        return _predict_output(logits, loss)

    def configure_optimizers(self) -> Any:
        return _build_optimizer_and_schedule(self, self.model.parameters())


def _untie_output_embeddings(model: nn.Module) -> None:
    """Give the output head its own copy of the input embedding if the two share one tensor."""
    input_embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    if output_embeddings is None or output_embeddings.weight is not input_embeddings.weight:
        return
    output_embeddings.weight = nn.Parameter(input_embeddings.weight.detach().clone())
    # Without this, transformers re-ties the two on save/load or resize_token_embeddings.
    model.config.tie_word_embeddings = False


class HFCausalLMModule(LightningModule):
    """Fine-tunes a Hugging Face causal LM on ``(x, y)`` batches (needs ``transformers``).

    ``y`` is already ``x`` shifted by one, so the loss is computed here from the logits rather than passing
    ``labels=`` to the model (which would shift a second time).
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        config_overrides: dict[str, Any] | None = None,
        learning_rate: float = 5e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        optimizer: Literal["adamw", "adam"] = "adamw",
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        max_steps_for_schedule: int | None = None,
        seed_model: int | None = None,
    ) -> None:
        """Load or build the model.

        Args:
            model_name_or_path: a Hugging Face model id or local folder, loaded with ``from_pretrained`` (an id
                needs the files cached locally or a network). ``None`` builds a small randomly initialised GPT-2 for
                byte tokens (vocabulary 256, 128 positions, width 64, 2 layers, 2 heads, no dropout): offline.
            config_overrides: ``GPT2Config`` fields that replace those defaults (only with ``model_name_or_path=None``).
            learning_rate: peak learning rate.
            weight_decay: decay of matrices and embeddings; biases and LayerNorm weights get none.
            betas: Adam's moment coefficients.
            eps: Adam's denominator epsilon.
            optimizer: ``"adamw"`` or ``"adam"``.
            warmup_steps: optimizer steps of linear warmup.
            lr_schedule: after warmup, ``"constant"`` or ``"cosine"`` decay to 10% of ``learning_rate``.
            max_steps_for_schedule: length of the cosine schedule; ``None`` takes the Trainer's estimate.
            seed_model: seed of the random initialisation alone (global RNG untouched); ``None`` uses the global RNG.

        The input embedding and the output head are untied so every parameter is a distinct tensor.
        """
        super().__init__()
        try:
            import transformers
        except ImportError as error:
            raise ImportError(
                f"HFCausalLMModule needs the `transformers` package: {_TRANSFORMERS_INSTALL_HINT}"
            ) from error
        _validate_optimizer_args(learning_rate, weight_decay, betas, eps, warmup_steps)
        if model_name_or_path is not None and config_overrides:
            raise ValueError(
                "config_overrides applies only to the random GPT-2 built when model_name_or_path is None; "
                f"got model_name_or_path={model_name_or_path!r}. Drop config_overrides or model_name_or_path."
            )
        self.save_hyperparameters()
        with torch.random.fork_rng(devices=[], enabled=seed_model is not None):
            if seed_model is not None:
                torch.manual_seed(seed_model)
            if model_name_or_path is None:
                config_fields: dict[str, Any] = {
                    "vocab_size": 256,
                    "n_positions": 128,
                    "n_embd": 64,
                    "n_layer": 2,
                    "n_head": 2,
                    # Byte tokens have no special ids; GPT-2's 50256 would lie outside the 256-entry vocabulary.
                    "bos_token_id": None,
                    "eos_token_id": None,
                    # No dropout, like CausalLMModule's default, so runs that differ only in the optimizer compare.
                    "resid_pdrop": 0.0,
                    "embd_pdrop": 0.0,
                    "attn_pdrop": 0.0,
                    "tie_word_embeddings": False,
                    **(config_overrides or {}),
                }
                config = transformers.GPT2Config(**config_fields)
                self.model = transformers.AutoModelForCausalLM.from_config(config)
            else:
                self.model = transformers.AutoModelForCausalLM.from_pretrained(model_name_or_path)
        _untie_output_embeddings(self.model)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, loss)`` like :meth:`GPT.forward`: ``targets`` are the next tokens, already shifted."""
        logits = self.model(input_ids=idx).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self(*batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self(*batch)
        self.log("val_loss", loss, prog_bar=True, on_epoch=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self(*batch)
        self.log("test_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def predict_step(
        self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The most likely next token at every position; with ``(x, y)`` batches, a dict that adds the loss."""
        idx, targets = (batch, None) if isinstance(batch, torch.Tensor) else batch
        logits, loss = self(idx, targets)
        return _predict_output(logits, loss)

    def configure_optimizers(self) -> Any:
        return _build_optimizer_and_schedule(self, self.model.parameters())
