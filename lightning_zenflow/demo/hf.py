"""The demo wrapper that fine-tunes a Hugging Face causal LM (needs ``transformers``) on the byte batches."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_zenflow.demo.model import _build_optimizer_and_schedule, _predict_output, _validate_optimizer_args

_TRANSFORMERS_INSTALL_HINT = "pip install 'lightning-zenflow[transformers]'"


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
