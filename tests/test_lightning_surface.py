"""Lightning's surface: AdamW's numbers, or a clear refusal, never a silent difference (CPU, tiny models).

The exact settings (``DEVICE_ONLY``: every column on the device; ``HOST_SYNC``: every matrix on the host, synchronous)
must equal plain Lightning with AdamW; at the defaults, an observer (a checkpoint, validation) must leave the weights
bitwise as they are without it; what ZenFlow cannot honour is refused before training, in one line that names it.
"""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys
import textwrap

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback, ModelCheckpoint
from lightning_helpers import TinyModule, assert_weights_close, assert_weights_equal, fit, weights
from torch import nn

from lightning_zenflow import UnsupportedSetupError, ZenFlowStrategy

pytestmark = pytest.mark.usefixtures("no_leaked_children")

DEVICE_ONLY = {"full_warm_up_rounds": 0, "topk_ratio": 1.0}
HOST_SYNC = {
    "full_warm_up_rounds": 0,
    "topk_ratio": 0.0,
    "update_interval": 1,
    "overlap_step": False,
    "host_state": "fp32",
}
EXACT = pytest.mark.parametrize("knobs", [DEVICE_ONLY, HOST_SYNC], ids=["device_only", "host_sync"])


# ---------------------------------------------------------------------------------- changes mid-fit are followed
class _FreezeFirstLayer(BaseFinetuning):
    """Lightning's fine-tuning callback: the first layer frozen, then unfrozen at epoch 1 (``add_param_group``)."""

    def freeze_before_training(self, pl_module: lightning.LightningModule) -> None:
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module: lightning.LightningModule, epoch: int, optimizer) -> None:  # noqa: ANN001
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=5e-3, train_bn=True)


class _FinetuneModule(TinyModule):
    """Hands the optimizer only what trains at the start, as BaseFinetuning asks."""

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@EXACT
def test_base_finetuning_adds_a_param_group_mid_fit(knobs: dict) -> None:
    control, _ = fit("auto", _FinetuneModule(), max_epochs=3, callbacks=[_FreezeFirstLayer()])
    zenflow, trainer = fit(ZenFlowStrategy(**knobs), _FinetuneModule(), max_epochs=3, callbacks=[_FreezeFirstLayer()])
    assert trainer.global_step == 24
    assert len(trainer.optimizers[0].param_groups) == 2
    assert not torch.equal(weights(zenflow)["net.0.weight"], weights(TinyModule())["net.0.weight"]), "it trained"
    assert_weights_close(weights(zenflow), weights(control))


class _UnfreezeAt(Callback):
    """A parameter handed to the optimizer frozen, made trainable at step ``at`` (``requires_grad_(True)``), frozen
    again at ``refreeze`` and trainable again at ``back``: AdamW keeps its moments across the pause."""

    def __init__(self, at: int, refreeze: int, back: int) -> None:
        self.at, self.refreeze, self.back = at, refreeze, back

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        pl_module.net[2].weight.requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step in (self.at, self.back):
            pl_module.net[2].weight.requires_grad_(True)
        elif trainer.global_step == self.refreeze:
            pl_module.net[2].weight.requires_grad_(False)


@EXACT
def test_requires_grad_flips_mid_fit_are_followed(knobs: dict) -> None:
    flips = {"at": 3, "refreeze": 7, "back": 11}
    control, _ = fit("auto", callbacks=[_UnfreezeAt(**flips)])
    zenflow, _ = fit(ZenFlowStrategy(**knobs), callbacks=[_UnfreezeAt(**flips)])
    moved = (weights(control)["net.2.weight"] - weights(TinyModule())["net.2.weight"]).abs().max()
    assert moved > 1e-2, "the control trained the parameter once it was unfrozen"
    assert_weights_close(weights(zenflow), weights(control))


def test_a_param_group_added_at_the_defaults_keeps_training() -> None:
    """At the defaults the change is a sync boundary (docs/update_rule.md): the run goes on, every parameter trains."""
    zenflow, trainer = fit(ZenFlowStrategy(), _FinetuneModule(), max_epochs=3, callbacks=[_FreezeFirstLayer()])
    initial = weights(TinyModule())
    for name, value in weights(zenflow).items():
        assert not torch.equal(value, initial[name]), f"{name} did not train"
    assert trainer.global_step == 24


# ------------------------------------------------------------------------ observation never changes the numbers
@pytest.mark.parametrize(
    "observer",
    ["checkpoint_every_4_steps", "validation_every_4_steps"],
)
def test_observing_a_run_at_the_defaults_leaves_its_weights_bitwise(observer: str, tmp_path: pathlib.Path) -> None:
    """The defaults (warm-up 10, windows of 4, overlap): 32 steps. With a checkpoint every 4 training steps, or a
    validation every 4 batches, the final weights are bitwise those of the run without them."""
    module_args = {"samples": 64}
    plain, _ = fit(ZenFlowStrategy(), TinyModule(**module_args), max_epochs=2)
    if observer == "checkpoint_every_4_steps":
        every_4 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
        observed, trainer = fit(
            ZenFlowStrategy(),
            TinyModule(**module_args),
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[every_4],
            default_root_dir=tmp_path,
        )
        assert len(list(tmp_path.glob("*.ckpt"))) == 8
    else:
        observed, trainer = fit(
            ZenFlowStrategy(), TinyModule(**module_args), max_epochs=2, limit_val_batches=2, val_check_interval=4
        )
        assert "val_loss" in trainer.callback_metrics
    assert trainer.global_step == 32
    assert_weights_equal(weights(observed), weights(plain))


def test_the_opt_in_boundaries_do_change_the_numbers(tmp_path: pathlib.Path) -> None:
    """The control for the test above: ``sync_on=["checkpoint"]`` lands the update in flight at each checkpoint."""
    plain, _ = fit(ZenFlowStrategy(), TinyModule(samples=64), max_epochs=2)
    synced, _ = fit(
        ZenFlowStrategy(sync_on=["checkpoint"]),
        TinyModule(samples=64),
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)],
        default_root_dir=tmp_path,
    )
    assert not torch.equal(weights(synced)["net.0.weight"], weights(plain)["net.0.weight"])


# -------------------------------------------------------------------------------------- refused, by name
class _OwnStepAdamW(torch.optim.AdamW):
    def step(self, closure=None):  # noqa: ANN001
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    param.mul_(0.99)  # extra work that ZenFlow would skip
        return super().step(closure)


class _OwnStepModule(TinyModule):
    def configure_optimizers(self):  # noqa: ANN201
        return _OwnStepAdamW(self.parameters(), lr=self.lr)


class _Float64Module(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = self.net.double()

    def _loss(self, batch):  # noqa: ANN001, ANN202
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs.double()), targets.double())


class _SparseEmbeddingModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8, sparse=True)

    def _loss(self, batch):  # noqa: ANN001, ANN202
        inputs, targets = batch
        hidden = inputs + self.embedding(torch.zeros(inputs.shape[0], dtype=torch.long))
        return nn.functional.mse_loss(self(hidden), targets)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (_OwnStepModule, "_OwnStepAdamW overrides step of AdamW, which ZenFlow never calls"),
        (_Float64Module, "parameter net.0.weight is float64"),
        (_SparseEmbeddingModule, "embedding is an Embedding with sparse=True"),
    ],
    ids=["step_overridden", "float64", "sparse_embedding"],
)
def test_what_cannot_be_honoured_is_refused_before_training(module: type, message: str) -> None:
    instance = module()
    with pytest.raises(UnsupportedSetupError, match=message):
        fit(ZenFlowStrategy(**DEVICE_ONLY), instance)
    assert instance.train_losses == [], "refused before the first training step"


def test_a_subclass_that_keeps_adamws_step_is_accepted() -> None:
    class Renamed(torch.optim.AdamW):
        pass

    class RenamedModule(TinyModule):
        def configure_optimizers(self):  # noqa: ANN201
            return Renamed(self.parameters(), lr=self.lr)

    control, _ = fit("auto")
    zenflow, _ = fit(ZenFlowStrategy(**DEVICE_ONLY), RenamedModule())
    assert_weights_close(weights(zenflow), weights(control))


class _GAN(TinyModule):
    """Two optimizers: Lightning needs manual optimization for them."""

    def __init__(self) -> None:
        super().__init__(optimizer="two")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        first, second = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()


def test_a_gan_trains_under_the_strategy_with_an_engine_per_optimizer() -> None:
    """Manual optimization with two optimizers (``strategies/manual.py``): each is a ZenFlowAdamW, both train."""
    initial = weights(TinyModule())
    module, trainer = fit(ZenFlowStrategy(topk_ratio=0.25, update_interval=2), _GAN())
    assert [type(opt).__name__ for opt in trainer.optimizers] == ["ZenFlowAdamW", "ZenFlowAdamW"]
    assert all(not value.equal(initial[name]) for name, value in weights(module).items())


# ---------------------------------------------------------------------------------- Lightning's own tools
@pytest.mark.parametrize("tool", ["lr_find", "scale_batch_size"])
def test_the_tuner_restores_into_a_running_engine(tool: str, tmp_path: pathlib.Path) -> None:
    """``Tuner.lr_find`` and ``scale_batch_size`` save a checkpoint, train a few steps and restore it into the
    strategy, whose engine has stepped: the engine is rebuilt and takes the checkpoint; a fit then runs."""
    from lightning.pytorch.tuner import Tuner

    class Tunable(TinyModule):
        def __init__(self) -> None:
            super().__init__(samples=64)
            self.batch_size = 4

    module = Tunable()
    trainer = lightning.Trainer(
        strategy=ZenFlowStrategy(),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    tuner = Tuner(trainer)
    if tool == "lr_find":
        found = tuner.lr_find(module, min_lr=1e-4, max_lr=1e-1, num_training=30, early_stop_threshold=None)
        assert found is not None
        losses = torch.tensor(found.results["loss"])
        assert len(losses) >= 10  # one epoch of the trainer's max_epochs=1: 16 steps
        assert torch.isfinite(losses).all()
    else:
        size = tuner.scale_batch_size(module, mode="power", steps_per_trial=2, max_trials=3)
        assert size >= 4
    before = weights(module)
    trainer.fit(module)
    assert trainer.global_step > 0
    assert not torch.equal(weights(module)["net.0.weight"], before["net.0.weight"])


# --------------------------------------------------------------------------------------------- smaller things
class _ClampWeights(Callback):
    """A WGAN critic's clamp: every weight into [-0.05, 0.05] after each step. ``adopt``: tell ZenFlow."""

    def __init__(self, adopt: bool) -> None:
        self.adopt = adopt

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        with torch.no_grad():
            for param in pl_module.parameters():
                param.clamp_(-0.05, 0.05)
        if self.adopt and hasattr(trainer.strategy, "adopt_weights"):
            trainer.strategy.adopt_weights()


@EXACT
def test_in_place_edits_are_kept_when_the_engine_adopts_them(knobs: dict) -> None:
    control, _ = fit("auto", callbacks=[_ClampWeights(adopt=True)])
    zenflow, _ = fit(ZenFlowStrategy(**knobs), callbacks=[_ClampWeights(adopt=True)])
    assert all(value.abs().max() <= 0.05 for value in weights(zenflow).values())
    assert_weights_close(weights(zenflow), weights(control))


def test_in_place_edits_without_adopting_are_overwritten_by_the_masters() -> None:
    """What docs/usage.md says happens without ``adopt_weights()``: the engine's fp32 masters win at the next update."""
    control, _ = fit("auto", callbacks=[_ClampWeights(adopt=True)])
    zenflow, _ = fit(ZenFlowStrategy(**DEVICE_ONLY), callbacks=[_ClampWeights(adopt=False)])
    difference = max((weights(zenflow)[n] - weights(control)[n]).abs().max() for n in weights(control))
    assert difference > 1e-3


def test_your_own_lightning_cli_gets_a_hint_for_a_knob_on_the_short_name(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "own_cli.py"
    script.write_text(
        textwrap.dedent(
            """
            import lightning_zenflow  # registers the strategy names
            from lightning.pytorch.cli import LightningCLI
            from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

            LightningCLI(BoringModel, BoringDataModule)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script), "fit", "--trainer.strategy=zenflow", "--trainer.strategy.topk_ratio=0.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--trainer.strategy=lightning_zenflow.ZenFlowStrategy --trainer.strategy.topk_ratio=0.2" in done.stderr


def test_a_fit_is_quiet_and_its_summary_reads_the_logged_loss(caplog) -> None:
    """No status line per fit at the default log level; the closing summary shows where the module logged its loss
    (here as ``loss``, not ``train_loss``)."""

    class LogsLoss(TinyModule):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = self._loss(batch)
            self.log("loss", loss)
            return loss

    with caplog.at_level(logging.INFO):
        _, trainer = fit(ZenFlowStrategy(), LogsLoss())
    text = caplog.text
    assert "accumulate_on" not in text
    summary = [line for line in text.splitlines() if "ZenFlow run summary" in line]
    assert summary, text
    assert "final loss " in summary[0]
    assert "n/a" not in summary[0]


def test_a_model_with_only_vectors_starts_no_host_worker() -> None:
    class VectorsOnly(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.shift = nn.Parameter(torch.zeros(8))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            inputs, targets = batch
            return ((inputs * self.scale + self.shift)[:, :4] - targets).square().mean()

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):  # noqa: ANN201
            return TinyModule().train_dataloader()

    pids = []

    class RecordPid(Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            pids.append(trainer.strategy.engine.worker_pid)

    module = VectorsOnly()
    _, trainer = fit(ZenFlowStrategy(), module, callbacks=[RecordPid()])
    assert pids == [None]
    assert not torch.equal(module.scale.detach(), torch.ones(8))
