"""The demo LightningModule around the small GPT of ``demo/gpt.py`` (``demo/hf.py`` wraps a Hugging Face causal LM).

Both consume the ``(x, y)`` byte batches of :class:`~lightning_zenflow.demo.data.ByteCorpusDataModule` and train
with a plain ``torch.optim.AdamW`` (or ``Adam``) over two parameter groups, so an optimizer plugin sees the same
setup a user's model would give it. Every parameter is a distinct tensor (no weight tying): the ZenFlow optimizer
splits each matrix by column, and a tensor shared by two modules would be updated twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_zenflow.demo.base import PretrainRecipe, load_base_weights, load_or_pretrain_base
from lightning_zenflow.demo.gpt import GPT, GPTConfig, WarmupSchedule

__all__ = ["GPT", "CausalLMModule", "GPTConfig", "WarmupSchedule"]


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
