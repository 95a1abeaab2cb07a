"""Trainer-level numerics: the degenerate ZenFlow configurations equal plain Lightning + AdamW (CPU).

The control is ``Trainer(strategy="auto")`` with the same seed, data and Trainer flags. With ``topk_ratio=1`` every
column is on the device and no host worker starts; with ``topk_ratio=0, update_interval=1, overlap_step=False``
every matrix goes through the host worker at every step (the ZeRO-Offload baseline). Both must be AdamW.
"""

from __future__ import annotations

import csv
import pathlib
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning_helpers import TinyModule, assert_weights_close, fit, weights

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine, ZenFlowStrategy

pytestmark = pytest.mark.usefixtures("no_leaked_children")

DEVICE_ONLY = {"topk_ratio": 1.0, "host_state": "fp32"}
"""Every column on the device: no host worker."""
HOST_SYNC = {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}
"""Every matrix on the host, updated synchronously at every step."""


class _RecordEngineSteps(Callback):
    """Records the engine's step count at the end of training (before teardown closes it)."""

    def __init__(self) -> None:
        self.engine_t: int | None = None

    def on_train_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.engine_t = trainer.strategy.engine.t


def test_fit_changes_the_weights_and_rho1_equals_adamw() -> None:
    initial = weights(TinyModule())
    control, control_trainer = fit("auto")
    zenflow, trainer = fit(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **DEVICE_ONLY}))
    assert trainer.global_step == control_trainer.global_step == 16
    for name, value in weights(zenflow).items():
        assert not value.equal(initial[name]), f"{name} did not train"
    assert_weights_close(weights(zenflow), weights(control))
    assert zenflow.train_losses[-1] < zenflow.train_losses[0]


def test_everything_on_the_host_synchronously_equals_adamw() -> None:
    control, _ = fit("auto")
    zenflow, trainer = fit(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **HOST_SYNC}))
    assert trainer.global_step == 16
    assert_weights_close(weights(zenflow), weights(control))


def _manual_engine_loop(knobs: dict[str, Any], epochs: int) -> TinyModule:
    """The same training as ``fit`` without Lightning: backward, then one ``ZenFlowEngine.step`` per batch."""
    module = TinyModule()
    optimizer = module.configure_optimizers()
    names = {param: name for name, param in module.named_parameters()}
    loader = module.train_dataloader()
    config = ZenFlowConfig(**{"full_warm_up_rounds": 0, **knobs})
    with ZenFlowEngine(optimizer, config, param_names=names, steps_per_epoch=len(loader)) as engine:
        for _ in range(epochs):
            for batch in loader:
                optimizer.zero_grad(set_to_none=True)
                engine.wait_for_update()
                module._loss(batch).backward()
                engine.step()
        engine.flush()
    return module


def test_overlapped_zenflow_equals_a_manual_engine_loop() -> None:
    # the general case (columns split, overlapped windows, epoch-based refresh): Lightning must hand the engine
    # the same gradients at the same steps, tell it the epoch length, and flush at the end
    knobs = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": True, "sync_on": ()}
    zenflow, trainer = fit(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **knobs}))
    manual = _manual_engine_loop(knobs, epochs=2)
    assert trainer.global_step == 16
    assert_weights_close(weights(zenflow), weights(manual), atol=0.0)


@pytest.mark.parametrize("samples", [32, 28], ids=["8-batches", "7-batches"])
def test_gradient_accumulation_steps_only_on_lightning_optimizer_steps(samples: int) -> None:
    # 7 batches per epoch with accumulate_grad_batches=2: Lightning also steps on the odd last batch of each epoch
    control, control_trainer = fit("auto", TinyModule(samples=samples), accumulate_grad_batches=2)
    steps = _RecordEngineSteps()
    zenflow, trainer = fit(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **DEVICE_ONLY}),
        TinyModule(samples=samples),
        accumulate_grad_batches=2,
        callbacks=[steps],
    )
    assert trainer.global_step == control_trainer.global_step == 2 * ((samples // 4 + 1) // 2)
    assert steps.engine_t == trainer.global_step
    assert_weights_close(weights(zenflow), weights(control))


def _clip_settings(algorithm: str) -> dict[str, Any]:
    # small enough that every step clips (checked below against an unclipped control)
    return {"gradient_clip_val": 0.05 if algorithm == "norm" else 0.005, "gradient_clip_algorithm": algorithm}


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("knobs", [DEVICE_ONLY, HOST_SYNC], ids=["rho1", "rho0-sync"])
def test_gradient_clipping_equals_lightning(algorithm: str, knobs: dict[str, Any]) -> None:
    control, _ = fit("auto", **_clip_settings(algorithm))
    unclipped, _ = fit("auto")
    zenflow, _ = fit(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **knobs}), **_clip_settings(algorithm))
    assert_weights_close(weights(zenflow), weights(control))
    differences = [(weights(control)[n] - weights(unclipped)[n]).abs().max() for n in weights(control)]
    assert max(differences) > 1e-3, "the clip value is too large to change anything"


def _logged_lrs(log_dir: pathlib.Path) -> list[tuple[int, float]]:
    with open(next(log_dir.rglob("metrics.csv"))) as metrics_file:
        rows = list(csv.DictReader(metrics_file))
    return [(int(row["step"]), float(row["lr-AdamW"])) for row in rows if row.get("lr-AdamW")]


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_lr_scheduler_and_lr_monitor_equal_lightning(interval: str, tmp_path: pathlib.Path) -> None:
    runs = {}
    for name, strategy in (
        ("control", "auto"),
        ("zenflow", ZenFlowStrategy(**{"full_warm_up_rounds": 0, **DEVICE_ONLY})),
    ):
        module, trainer = fit(
            strategy,
            TinyModule(scheduler=interval),
            max_epochs=3,
            logger=CSVLogger(tmp_path, name=name),
            log_every_n_steps=1,
            callbacks=[LearningRateMonitor(logging_interval=interval)],
        )
        runs[name] = (module, _logged_lrs(tmp_path / name), trainer.optimizers[0].param_groups[0]["lr"])
    control, control_lrs, control_final_lr = runs["control"]
    zenflow, zenflow_lrs, zenflow_final_lr = runs["zenflow"]
    assert zenflow_lrs == control_lrs
    assert len({lr for _, lr in zenflow_lrs}) >= 3, "the schedule should have decayed the lr several times"
    assert zenflow_final_lr == control_final_lr < 1e-2
    assert_weights_close(weights(zenflow), weights(control))


class _SkipsBatches(TinyModule):
    """``training_step`` returns None (Lightning's way to skip a batch) at every third batch."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx % 3 == 1:
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("knobs", [DEVICE_ONLY, HOST_SYNC], ids=["device_only", "host_sync"])
def test_a_skipped_batch_is_skipped_as_lightning_skips_it(knobs: dict) -> None:
    """A ``training_step`` that returns None skips its batch: in the exact settings the run equals plain Lightning's
    AdamW with the same skips (which changes nothing on those batches), and the engine takes only the other steps."""
    control, control_trainer = fit("auto", module=_SkipsBatches())
    record = _RecordEngineSteps()
    strategy = ZenFlowStrategy(**{"full_warm_up_rounds": 0, **knobs})
    zenflow, trainer = fit(strategy, module=_SkipsBatches(), callbacks=[record])
    assert trainer.global_step == control_trainer.global_step
    trained = len(zenflow.train_losses)
    assert record.engine_t == trained < trainer.global_step  # the skipped batches are no engine steps
    assert_weights_close(weights(zenflow), weights(control))
    assert not all(weights(zenflow)[k].equal(weights(TinyModule())[k]) for k in weights(zenflow))


def test_skipped_batches_under_the_defaults_train_to_the_end() -> None:
    record = _RecordEngineSteps()
    strategy = ZenFlowStrategy(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=1)
    module, trainer = fit(strategy, module=_SkipsBatches(), callbacks=[record])
    assert trainer.global_step == 16
    assert record.engine_t == len(module.train_losses) > 8
    initial = weights(TinyModule())
    assert all(not value.equal(initial[name]) for name, value in weights(module).items())
    assert all(torch.isfinite(value).all() for value in weights(module).values())
