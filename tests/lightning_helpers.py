"""Shared pieces of the Lightning integration tests: a tiny model, its data, trainers and weight comparisons.

The model is a 2-layer MLP (8 -> 16 -> 4 plus biases, 228 parameters) on fixed random regression data, so a
fit takes about a second, most of it the host worker's start-up. Every run builds the same initial weights
from ``torch.manual_seed(SEED)``, and the data is never shuffled, so a ZenFlow run and its plain-Lightning
control see identical batches.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import lightning
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234
IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 16, 4


def make_dataset(samples: int, seed: int = 0, out_features: int = OUT_FEATURES) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, IN_FEATURES, generator=generator)
    targets = torch.randn(samples, out_features, generator=generator)
    return TensorDataset(inputs, targets)


class TinyModule(LightningModule):
    """A 2-layer MLP regression model whose optimizer setup the tests vary.

    Args:
        samples: training samples; with ``batch_size`` this fixes the batches per epoch.
        batch_size: samples per batch.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"two"`` (two AdamW optimizers).
        amsgrad: passed to AdamW.
        scheduler: ``None``, ``"step"`` or ``"epoch"``: a StepLR at that interval.
        fail_at_step: raise ``fail_with`` in ``training_step`` when ``global_step`` reaches this value.
        fail_with: the exception class to raise.
    """

    def __init__(
        self,
        samples: int = 32,
        batch_size: int = 4,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
        optimizer: str = "adamw",
        amsgrad: bool = False,
        scheduler: str | None = None,
        fail_at_step: int | None = None,
        fail_with: type[BaseException] = RuntimeError,
    ) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))
        self.samples = samples
        self.batch_size = batch_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.optimizer_kind = optimizer
        self.amsgrad = amsgrad
        self.scheduler_kind = scheduler
        self.fail_at_step = fail_at_step
        self.fail_with = fail_with
        self.train_losses: list[float] = []

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def _loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        prediction = self(inputs.to(self.net[0].weight.dtype))
        return nn.functional.mse_loss(prediction.float(), targets.float())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise self.fail_with(f"injected failure at step {self.global_step}")
        loss = self._loss(batch)
        self.train_losses.append(float(loss.detach()))
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        if self.optimizer_kind == "two":
            return [
                torch.optim.AdamW(self.net[0].parameters(), lr=self.lr),
                torch.optim.AdamW(self.net[2].parameters(), lr=self.lr),
            ]
        optimizer_class = torch.optim.Adam if self.optimizer_kind == "adam" else torch.optim.AdamW
        optimizer = optimizer_class(params, lr=self.lr, weight_decay=self.weight_decay, amsgrad=self.amsgrad)
        if self.scheduler_kind is None:
            return optimizer
        step_size = 3 if self.scheduler_kind == "step" else 1
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_kind}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(self.samples, seed=0), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(8, seed=1), batch_size=4, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(8, seed=2), batch_size=4, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(8, seed=3), batch_size=4, shuffle=False)


def make_trainer(
    strategy: Any = "auto", root_dir: pathlib.Path | str | None = None, **overrides: Any
) -> lightning.Trainer:
    """A quiet CPU trainer; keyword arguments override the defaults."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }
    if root_dir is not None:
        settings["default_root_dir"] = str(root_dir)
    settings.update(overrides)
    return lightning.Trainer(strategy=strategy, **settings)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 CPU copy of the module's parameters."""
    return {name: param.detach().float().cpu().clone() for name, param in module.named_parameters()}


def assert_weights_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-6, rtol: float = 0.0
) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(
            actual[name], expected[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_weights_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert torch.equal(actual[name], expected[name]), (
            f"{name} differs by {(actual[name] - expected[name]).abs().max()}"
        )


def process_gone(pid: int) -> bool:
    """True when no process with this pid exists any more (no psutil: signal 0 only checks existence)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class RecordWorkerPid(Callback):
    """Remembers the host worker's pid while fitting (to check afterwards that it is gone)."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def on_train_start(self, trainer: lightning.Trainer, pl_module: LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and engine.worker_pid is not None:
            self.pids.append(engine.worker_pid)


def fit(
    strategy: Any = "auto", module: TinyModule | None = None, **trainer_kwargs: Any
) -> tuple[TinyModule, lightning.Trainer]:
    """Fit ``module`` (default: a fresh ``TinyModule()``) with ``make_trainer(strategy, **trainer_kwargs)``."""
    module = module if module is not None else TinyModule()
    trainer = make_trainer(strategy, **trainer_kwargs)
    trainer.fit(module)
    return module, trainer
