"""Fine-tune a local Hugging Face causal LM on :class:`~lightning_zenflow.llm.data.CausalLMDataModule` batches and
export the result as a Hugging Face folder (model and tokenizer) that ``from_pretrained`` loads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lightning_zenflow.llm.data import LLM_INSTALL_HINT, load_tokenizer


class CausalLMFineTune(LightningModule):
    """Fine-tunes ``AutoModelForCausalLM`` with AdamW (decay on matrices only), linear warm-up then cosine to 10 %.

    Export happens in ``on_fit_end``, not ``on_train_end``: Lightning calls the LightningModule's ``on_train_end``
    before the strategy's (``FitLoop.on_run_end``), and ZenFlow applies its pending host updates in the strategy's
    ``on_train_end``; ``on_fit_end`` runs after it, so the exported weights hold every update.
    """

    def __init__(
        self,
        model_path: str,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        export_dir: str | None = None,
        sample_prompt: str | None = None,
        sample_tokens: int = 32,
        tokenizer_path: str | None = None,
    ) -> None:
        """Load the model (float32).

        Args:
            model_path: a local folder with the model's config and weights.
            lr: peak learning rate.
            weight_decay: AdamW's decay of the matrices (``ndim >= 2``: linear layers and embeddings); vectors get none.
            warmup_steps: optimizer steps of linear warm-up, then a cosine decay to 10 % of ``lr`` at the end of fit.
            export_dir: where to save the fine-tuned model and its tokenizer after fit (``save_pretrained``).
            sample_prompt: after export, generate ``sample_tokens`` greedily from this prompt and print them.
            sample_tokens: how many tokens the sample generates.
            tokenizer_path: the tokenizer folder for the export and the sample; ``None`` takes the datamodule's
                ``tokenizer_path``, else ``model_path``.
        """
        super().__init__()
        if not Path(model_path).is_dir():
            raise ValueError(
                f"model_path {model_path!r} is not a folder. Pass a local folder with the model's config.json and "
                "weights (--model.model_path); fetch a Hub model with `hf download <id> --local-dir <folder>`."
            )
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr} (--model.lr).")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay} (--model.weight_decay).")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps} (--model.warmup_steps).")
        if sample_tokens < 1:
            raise ValueError(f"sample_tokens must be at least 1, got {sample_tokens} (--model.sample_tokens).")
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as error:
            raise ImportError(f"CausalLMFineTune needs `transformers`: {LLM_INSTALL_HINT}") from error
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()  # from_pretrained returns the model in eval mode, and Lightning keeps submodules' modes
        self.val_loss_mean = MeanMetric()
        self.last_sample: str | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's loss on a batch (mean over the label tokens that are not -100)."""
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"]
        ).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].size(0))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        # weighted by sequences, like Lightning's own epoch mean; the metric syncs across ranks on compute()
        self.val_loss_mean.update(loss.detach(), weight=batch["input_ids"].size(0))
        return loss

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss_mean.compute()
        self.val_loss_mean.reset()
        self.log("val_loss", val_loss, prog_bar=True)
        self.log("val_ppl", torch.exp(val_loss))

    def configure_optimizers(self) -> Any:
        trainable = [param for param in self.model.parameters() if param.requires_grad]  # tied weights appear once
        param_groups = [
            {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(param_groups, lr=self.hparams.lr)
        total_steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(total_steps):
            raise ValueError("the cosine schedule needs the length of training: set --trainer.max_steps or max_epochs.")
        schedule = warmup_cosine(self.hparams.warmup_steps, int(total_steps))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self) -> None:
        # after the strategy's on_train_end (ZenFlow's flush of every pending update) and its teardown
        if not self.trainer.is_global_zero:
            return
        if self.hparams.export_dir is None and self.hparams.sample_prompt is None:
            return
        tokenizer = load_tokenizer(self._tokenizer_path())
        if self.hparams.export_dir is not None:
            export(self.model, tokenizer, self.hparams.export_dir)
        if self.hparams.sample_prompt is not None:
            self.last_sample = generate_sample(
                self.model, tokenizer, self.hparams.sample_prompt, self.hparams.sample_tokens
            )
            print(f"sample: {self.hparams.sample_prompt!r} -> {self.last_sample!r}")

    def _tokenizer_path(self) -> str:
        if self.hparams.tokenizer_path is not None:
            return self.hparams.tokenizer_path
        datamodule = getattr(self.trainer, "datamodule", None)
        return getattr(datamodule, "tokenizer_path", None) or self.hparams.model_path


def warmup_cosine(warmup_steps: int, total_steps: int) -> Any:
    """The learning-rate factor at an optimizer step: linear to 1 over ``warmup_steps``, then cosine to 0.1."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def export(model: Any, tokenizer: Any, export_dir: str) -> None:
    """Save ``model`` and ``tokenizer`` with ``save_pretrained``; tied input and output embeddings stay tied."""
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    if tied and not model.config.tie_word_embeddings:
        raise RuntimeError(
            "the embeddings share one tensor but config.tie_word_embeddings is False; reload would split"
        )
    Path(export_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(export_dir)
    tokenizer.save_pretrained(export_dir)


@torch.no_grad()
def generate_sample(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` (the new tokens only, decoded)."""
    was_training = model.training
    model.eval()
    encoded = tokenizer(prompt, return_tensors="pt").to(model.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    output = model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    model.train(was_training)
    return tokenizer.decode(output[0, encoded["input_ids"].size(1) :], skip_special_tokens=True)
