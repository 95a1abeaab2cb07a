"""Precisions under ZenFlow (CPU): 32-true elsewhere; here bf16-mixed, bf16-true and the 16-mixed loss-scaling path."""

from __future__ import annotations

import math

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_helpers import TinyModule, assert_weights_close, fit, weights

from lightning_zenflow import ZenFlowPrecision, ZenFlowStrategy

pytestmark = pytest.mark.usefixtures("no_leaked_children")


def test_from_plugin_wraps_the_connector_plugins() -> None:
    assert ZenFlowPrecision.from_plugin(Precision()).precision == "32-true"
    assert ZenFlowPrecision.from_plugin(MixedPrecision("bf16-mixed", device="cpu")).precision == "bf16-mixed"
    assert ZenFlowPrecision.from_plugin(HalfPrecision("bf16-true")).precision == "bf16-true"
    own = ZenFlowPrecision("bf16-mixed", device="cpu")
    assert ZenFlowPrecision.from_plugin(own) is own
    with pytest.raises(MisconfigurationException, match="16-true"):
        ZenFlowPrecision.from_plugin(HalfPrecision("16-true"))


def test_bf16_mixed_rho1_equals_lightning() -> None:
    control, _ = fit("auto", precision="bf16-mixed")
    zenflow, trainer = fit(ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=1.0), precision="bf16-mixed")
    assert isinstance(trainer.strategy.precision_plugin, ZenFlowPrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    assert_weights_close(weights(zenflow), weights(control))


class _CheckMasters(Callback):
    """During fit: the model holds bf16 weights, the engine fp32 masters and moments of every parameter."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx != 5:
            return
        engine = trainer.strategy.engine
        state = engine.state_dict()["params"]
        torch_state = engine.torch_state_dict()["state"]
        for name, param in pl_module.named_parameters():
            assert param.dtype == torch.bfloat16, name
            assert state[name]["master"].dtype == torch.float32, name
            assert state[name]["exp_avg"].dtype == torch.float32, name
        assert all(entry["exp_avg_sq"].dtype == torch.float32 for entry in torch_state.values())
        self.checked += 1


def test_bf16_true_keeps_fp32_masters_and_trains() -> None:
    check = _CheckMasters()
    module, _ = fit(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2),
        TinyModule(lr=3e-2),
        precision="bf16-true",
        callbacks=[check],
    )
    assert check.checked == 2
    first_epoch, last_epoch = module.train_losses[:8], module.train_losses[-8:]
    assert sum(last_epoch) < 0.9 * sum(first_epoch)
    assert all(param.dtype == torch.bfloat16 for param in module.parameters())


class _InjectInf(Callback):
    """Makes one gradient inf at optimizer step ``at_step`` and records what each step did."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.records: list[tuple[int, bool, bool, float, float]] = []
        self._before: tuple[dict, int, float] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        scaler = trainer.strategy.precision_plugin.scaler
        self._before = (weights(pl_module), trainer.strategy.engine.t, scaler.get_scale())

    def on_after_backward(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        if trainer.global_step == self.at_step:
            pl_module.net[0].weight.grad[0, 0] = math.inf

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        before_weights, before_t, before_scale = self._before
        after = weights(pl_module)
        unchanged = all(torch.equal(after[name], before_weights[name]) for name in after)
        advanced = trainer.strategy.engine.t == before_t + 1
        scale = trainer.strategy.precision_plugin.scaler.get_scale()
        self.records.append((trainer.global_step, unchanged, advanced, before_scale, scale))


def test_16_mixed_skips_a_step_with_inf_gradients() -> None:
    inject = _InjectInf(at_step=3)
    plugin = ZenFlowPrecision("16-mixed", device="cpu")
    assert plugin.scaler is not None
    # every matrix on the host, synchronously: a step that ran changes the weights before the batch ends
    strategy = ZenFlowStrategy(
        full_warm_up_rounds=0, topk_ratio=0.25, update_interval=1, overlap_step=False, precision_plugin=plugin
    )
    module, trainer = fit(strategy, max_epochs=1, callbacks=[inject])
    assert trainer.strategy.precision_plugin is plugin
    assert len(inject.records) == 8
    for global_step, unchanged, advanced, scale_before, scale_after in inject.records:
        # the engine learns of the overflow on the device only: the step advances its schedule, changes nothing
        assert advanced
        if global_step == inject.at_step + 1:  # Lightning counts the skipped step too
            assert unchanged, "a step with inf gradients must leave every weight as it was"
            assert scale_after == scale_before / 2
        else:
            assert not unchanged
            assert scale_after == scale_before
    assert all(torch.isfinite(value).all() for value in weights(module).values())
