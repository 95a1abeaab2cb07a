"""Validation during fit: by default validation sees the weights as they stand (host work stays in flight, so the
run's numbers do not change); the opt-in ``"validation"`` boundary applies it before any hook or
``validation_step`` reads the weights (CPU, overlapped host updates)."""

from __future__ import annotations

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning_helpers import fit

from lightning_zenflow import ZenFlowStrategy

pytestmark = pytest.mark.usefixtures("no_leaked_children")

OVERLAPPED = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True, "interim_step": 0}
"""A host update is in flight for most of every window (8 steps per epoch, windows of 2). The paper's rule, whose
host masters are the weights once everything landed (with interim moves the weights are the masters always)."""


class _ProbeValidationStart(Callback):
    """At each validation start (a user callback, so Lightning calls it before the strategy's own hook) records
    whether host work is in flight and whether the model weights show every finished host update: the masters, each
    with its computed step landed where one is in flight (the weights are the masters of the host columns; a host
    update in flight is a step, landed as ``w * scale + step``)."""

    def __init__(self) -> None:
        self.in_flight: list[bool] = []
        self.weights_current: list[bool] = []
        self.steps: list[int] = []

    def on_validation_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        engine = trainer.strategy.engine
        self.in_flight.append(engine.host_in_flight)
        # state_dict() waits for the update in flight to finish computing but never applies it
        state = engine.state_dict(include_moments=False)
        pending = state["progress"]["pending"]
        scales = {}
        if pending is not None:
            names = [[slot.name for slot in group.matrices] for group in engine.layout]
            for group_index, (active, group_scales) in enumerate(zip(pending["active"], pending["scales"])):
                scales.update({names[group_index][i]: scale for i, scale in zip(active, group_scales)})
        finished = {}
        for name, entry in state["params"].items():
            finished[name] = entry["master"] * scales[name] + entry["step"] if name in scales else entry["master"]
        self.weights_current.append(
            all(torch.equal(param.detach(), finished[name]) for name, param in pl_module.named_parameters())
        )
        self.steps.append(trainer.global_step)


def test_validation_sees_every_finished_host_update() -> None:
    probe = _ProbeValidationStart()
    module, trainer = fit(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **OVERLAPPED}, sync_on=["validation"]),
        limit_val_batches=2,
        val_check_interval=3,
        check_val_every_n_epoch=1,
        num_sanity_val_steps=1,
        callbacks=[probe],
    )
    # the sanity check before the first step, then every 3 training batches in each of the 2 epochs
    assert probe.steps == [0, 3, 6, 11, 14]
    assert probe.in_flight == [False] * 5
    assert probe.weights_current == [True] * 5
    assert "val_loss" in trainer.callback_metrics


def test_without_the_validation_boundary_host_work_stays_in_flight() -> None:
    # the default, and the control for the test above: the probe does see in-flight work when nobody syncs
    probe = _ProbeValidationStart()
    _, trainer = fit(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **OVERLAPPED}),
        max_epochs=2,
        limit_val_batches=2,
        check_val_every_n_epoch=2,
        callbacks=[probe],
    )
    assert probe.steps == [16], "one validation, at the end of the second epoch"
    assert probe.in_flight == [True]
    assert probe.weights_current == [False]
    assert trainer.global_step == 16
