"""Checkpoints under ZenFlow (CPU): the file format, saving after fit, exact resume, and resume across strategies.

Run A of each configuration is an uninterrupted 4-epoch fit that saves a checkpoint at every epoch end; run B is
a fresh Trainer that resumes from A's second checkpoint to the same ``max_epochs``. B's final weights must be
bitwise A's. ``ALIGNED`` saves on window ends and syncs there (``sync_on`` opted in); ``MID_WINDOW`` saves in the middle
of a window with a host update computed but not applied (``sync_on=()``, overlap on), the hardest case.
"""

from __future__ import annotations

import copy
import pathlib
from dataclasses import dataclass
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_helpers import TinyModule, assert_weights_close, assert_weights_equal, make_trainer, weights

from lightning_zenflow import ZenFlowStrategy

pytestmark = pytest.mark.usefixtures("no_leaked_children")

MAX_EPOCHS = 4
ALIGNED: dict[str, Any] = {"topk_ratio": 0.25, "update_interval": 2, "sync_on": ("validation", "checkpoint")}
"""8 steps per epoch, windows of 2: every checkpoint lands on a window end (and syncs)."""
MID_WINDOW: dict[str, Any] = {
    "topk_ratio": 0.25,
    "update_interval": 4,
    "sync_on": (),
    "select_strategy": "step",
    "select_interval": 100,
}
"""5 steps per epoch, windows of 4: the epoch-2 checkpoint (step 10) is 2 steps into a window, with the update of
the window that ended at step 8 computed but not applied (no refresh, which would apply it, before step 100)."""


@dataclass
class Run:
    module: TinyModule
    trainer: lightning.Trainer
    checkpoints: list[pathlib.Path]


def _run(
    strategy_knobs: dict[str, Any] | None,
    module_kwargs: dict[str, Any],
    directory: pathlib.Path,
    ckpt_path: pathlib.Path | None = None,
    callbacks: list[Callback] | None = None,
) -> Run:
    """One 4-epoch fit that checkpoints every epoch; ``strategy_knobs=None`` is plain Lightning."""
    strategy = "auto" if strategy_knobs is None else ZenFlowStrategy(**{"full_warm_up_rounds": 0, **strategy_knobs})
    module = TinyModule(**module_kwargs)
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)
    trainer = make_trainer(
        strategy,
        root_dir=directory,
        max_epochs=MAX_EPOCHS,
        enable_checkpointing=True,
        callbacks=[checkpoint, *(callbacks or [])],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return Run(module, trainer, sorted(directory.glob("*.ckpt")))


def _load(path: pathlib.Path) -> dict[str, Any]:
    # what Lightning's resume does in torch >= 2.6: safe loading, tensors and primitives only
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(None, {"scheduler": "step"}, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def aligned_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(ALIGNED, {"scheduler": "step"}, tmp_path_factory.mktemp("aligned"))


# ------------------------------------------------------------------------------------------------------- format


def test_checkpoint_holds_adamw_state_and_the_engine_state(aligned_run: Run) -> None:
    assert [path.name for path in aligned_run.checkpoints] == [
        f"epoch={epoch}-step={8 * (epoch + 1)}.ckpt" for epoch in range(MAX_EPOCHS)
    ]
    assert all(path.is_file() for path in aligned_run.checkpoints), "one single-file checkpoint per save"
    checkpoint = _load(aligned_run.checkpoints[1])
    assert checkpoint["global_step"] == 16
    optimizer_state = checkpoint["optimizer_states"][0]
    shapes = [param.shape for param in aligned_run.module.parameters()]
    assert sorted(optimizer_state["state"]) == list(range(len(shapes)))
    for index, shape in enumerate(shapes):
        entry = optimizer_state["state"][index]
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.float32
        assert entry["exp_avg"].shape == entry["exp_avg_sq"].shape == shape
        assert float(entry["step"]) == 16
        assert entry["exp_avg_sq"].abs().sum() > 0
    assert optimizer_state["param_groups"][0]["params"] == list(range(len(shapes)))
    assert optimizer_state["param_groups"][0]["lr"] == checkpoint["lr_schedulers"][0]["_last_lr"][0]
    engine_state = checkpoint["zenflow"]
    assert engine_state["progress"]["t"] == 16
    assert set(engine_state["params"]) == {name for name, _ in aligned_run.module.named_parameters()}
    for entry in engine_state["params"].values():
        assert not {"exp_avg", "exp_avg_sq"} & set(entry), "moments live in optimizer_states only"
        assert entry["master"].dtype == torch.float32


def test_save_checkpoint_after_fit_holds_the_final_state(aligned_run: Run, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "after_fit.ckpt"
    aligned_run.trainer.save_checkpoint(path)
    final = _load(path)
    last_epoch = _load(aligned_run.checkpoints[-1])
    assert final["global_step"] == 32
    for index, entry in final["optimizer_states"][0]["state"].items():
        assert float(entry["step"]) == 32
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], last_epoch["optimizer_states"][0]["state"][index][key])
    assert final["zenflow"]["progress"]["t"] == 32
    for name, value in weights(aligned_run.module).items():
        assert torch.equal(final["state_dict"][name], value)


def test_validate_test_predict_after_fit(aligned_run: Run) -> None:
    trainer = aligned_run.trainer
    trainer.limit_val_batches = 1.0  # the fit ran without validation
    (validated,) = trainer.validate(aligned_run.module, verbose=False)
    (tested,) = trainer.test(aligned_run.module, verbose=False)
    predictions = trainer.predict(aligned_run.module)
    assert validated["val_loss"] > 0
    assert tested["test_loss"] > 0
    assert [prediction.shape for prediction in predictions] == [torch.Size([4, 4])] * 2
    assert trainer.strategy.engine is None


# ----------------------------------------------------------------------------------------------------- exact resume


def test_plain_lightning_resumes_exactly(plain_run: Run, tmp_path: pathlib.Path) -> None:
    resumed = _run(None, {"scheduler": "step"}, tmp_path, ckpt_path=plain_run.checkpoints[1])
    assert resumed.trainer.global_step == plain_run.trainer.global_step == 32
    assert_weights_equal(weights(resumed.module), weights(plain_run.module))


def test_zenflow_resumes_exactly_at_a_window_end(aligned_run: Run, tmp_path: pathlib.Path) -> None:
    resumed = _run(ALIGNED, {"scheduler": "step"}, tmp_path, ckpt_path=aligned_run.checkpoints[1])
    assert resumed.trainer.global_step == 32
    assert_weights_equal(weights(resumed.module), weights(aligned_run.module))


def test_zenflow_resumes_exactly_mid_window_with_host_work_pending(tmp_path: pathlib.Path) -> None:
    uninterrupted = _run(MID_WINDOW, {"samples": 20}, tmp_path / "a")
    checkpoint = _load(uninterrupted.checkpoints[1])
    progress = checkpoint["zenflow"]["progress"]
    assert checkpoint["global_step"] == 10
    assert progress["steps_in_window"] == 2, "the checkpoint must fall inside a window"
    assert progress["pending"] is not None, "a computed host update must be waiting to be applied"
    resumed = _run(MID_WINDOW, {"samples": 20}, tmp_path / "b", ckpt_path=uninterrupted.checkpoints[1])
    assert resumed.trainer.global_step == 20
    assert_weights_equal(weights(resumed.module), weights(uninterrupted.module))


# ------------------------------------------------------------------------------------------- across strategies


class _CaptureRestoredState(Callback):
    """Right after the restore (at train start): the optimizer state as the strategy now holds it."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        # a deep copy: a torch optimizer's state_dict() shares the tensors that its next step updates in place
        state = engine.torch_state_dict() if engine is not None else trainer.optimizers[0].state_dict()
        self.state = copy.deepcopy(state)


def _assert_same_moments(restored: dict[str, Any], saved: dict[str, Any], host_bf16: bool = False) -> None:
    """``host_bf16``: the moments went into the compact host state (rounded to bf16 to nearest)."""
    assert sorted(restored["state"]) == sorted(saved["state"])
    for index, entry in saved["state"].items():
        assert float(restored["state"][index]["step"]) == float(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            expected = entry[key].to(torch.bfloat16).float() if host_bf16 and entry[key].dim() >= 2 else entry[key]
            assert torch.equal(restored["state"][index][key], expected), (index, key)
    assert restored["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]


def test_zenflow_checkpoint_resumes_under_plain_lightning(aligned_run: Run, tmp_path: pathlib.Path) -> None:
    capture = _CaptureRestoredState()
    resumed = _run(None, {"scheduler": "step"}, tmp_path, ckpt_path=aligned_run.checkpoints[1], callbacks=[capture])
    assert resumed.trainer.global_step == 32
    _assert_same_moments(capture.state, _load(aligned_run.checkpoints[1])["optimizer_states"][0])
    assert resumed.module.train_losses[-1] < resumed.module.train_losses[0]


def test_plain_checkpoint_resumes_under_zenflow(plain_run: Run, tmp_path: pathlib.Path) -> None:
    capture = _CaptureRestoredState()
    resumed = _run(ALIGNED, {"scheduler": "step"}, tmp_path, ckpt_path=plain_run.checkpoints[1], callbacks=[capture])
    assert resumed.trainer.global_step == 32
    # the default compact state holds the matrices' moments in bf16 on the host: rounded to nearest as they load
    _assert_same_moments(capture.state, _load(plain_run.checkpoints[1])["optimizer_states"][0], host_bf16=True)
    assert resumed.module.train_losses[-1] < resumed.module.train_losses[0]


@pytest.mark.parametrize("saved_by", ["plain", "zenflow"])
def test_a_checkpoint_without_optimizer_state_resumes_with_a_fresh_optimizer(
    plain_run: Run, aligned_run: Run, tmp_path: pathlib.Path, saved_by: str
) -> None:
    """A weights-only export (``optimizer_states`` empty, as some tools write it): Lightning trains on with a fresh
    optimizer from the checkpoint's weights, and so does ZenFlow. In an exact setting (every column on the device)
    the two resumed runs are equal."""
    source = (plain_run if saved_by == "plain" else aligned_run).checkpoints[1]
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["optimizer_states"] = []
    checkpoint["lr_schedulers"] = []
    checkpoint.pop("zenflow", None)
    weights_only = tmp_path / "weights_only.ckpt"
    torch.save(checkpoint, weights_only)
    plain = _run(None, {}, tmp_path / "plain", ckpt_path=weights_only)
    zenflow = _run({"topk_ratio": 1.0}, {}, tmp_path / "zenflow", ckpt_path=weights_only)
    assert zenflow.trainer.global_step == plain.trainer.global_step == 32
    assert_weights_close(weights(zenflow.module), weights(plain.module))
    trained = _run({"topk_ratio": 1.0}, {}, tmp_path / "from_start")  # not the run from the start: resumed weights
    assert any(not weights(trained.module)[k].equal(v) for k, v in weights(zenflow.module).items())


class _OptimizerStateAtTrainStart(Callback):
    """What ``trainer.optimizers[0].state_dict()`` shows when training starts and at each epoch end."""

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.states.append(copy.deepcopy(trainer.optimizers[0].state_dict()))

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.states.append(copy.deepcopy(trainer.optimizers[0].state_dict()))


def test_the_optimizer_lightning_hands_out_shows_the_engine_state(aligned_run: Run, tmp_path: pathlib.Path) -> None:
    """After ``fit(ckpt_path=...)`` the optimizer's ``state_dict()`` holds the checkpoint's moments and steps (as
    under plain Lightning); reading it during the fit changes no number; after the fit the optimizer is torch's
    again."""
    saved = _load(aligned_run.checkpoints[1])["optimizer_states"][0]
    capture = _OptimizerStateAtTrainStart()
    resumed = _run(
        ALIGNED, {"scheduler": "step"}, tmp_path / "watched", ckpt_path=aligned_run.checkpoints[1], callbacks=[capture]
    )
    start = capture.states[0]
    assert set(start["state"]) == set(saved["state"])
    assert start["state"]
    for position, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(start["state"][position][key], value), (position, key)
    assert [g["lr"] for g in start["param_groups"]] == [g["lr"] for g in saved["param_groups"]]
    assert len(capture.states) == 3
    assert not torch.equal(capture.states[1]["state"][0]["exp_avg"], start["state"][0]["exp_avg"])
    unwatched = _run(ALIGNED, {"scheduler": "step"}, tmp_path / "unwatched", ckpt_path=aligned_run.checkpoints[1])
    assert_weights_equal(weights(resumed.module), weights(unwatched.module))
    assert "state_dict" not in vars(resumed.trainer.optimizers[0])


class _Backboned(TinyModule):
    """A ``backbone`` (the first layer) that ``BackboneFinetuning`` freezes, then unfreezes into a new param group."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.net[0]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@pytest.mark.parametrize("knobs", [{"topk_ratio": 1.0}, {"topk_ratio": 0.25, "update_interval": 2}], ids=str)
def test_a_backbone_finetuning_run_resumes_after_the_unfreeze(tmp_path: pathlib.Path, knobs: dict) -> None:
    """Lightning's ``BackboneFinetuning`` re-adds the backbone's param group when a fit resumes (after the engine was
    built, before the optimizer state is loaded), with the backbone frozen again: the state of every parameter the
    checkpoint holds is taken, and the fit goes on. With every column on the device it equals plain Lightning."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    def fit_twice(strategy: Any, directory: pathlib.Path) -> TinyModule:
        saver = ModelCheckpoint(dirpath=directory, save_last=True)
        first = make_trainer(
            strategy(),
            root_dir=directory,
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[saver, BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
        )
        first.fit(_Backboned())
        module = _Backboned()
        second = make_trainer(
            strategy(), root_dir=directory, max_epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]
        )
        second.fit(module, ckpt_path=saver.last_model_path)
        assert second.global_step == 24
        return module

    zenflow = fit_twice(lambda: ZenFlowStrategy(full_warm_up_rounds=0, **knobs), tmp_path / "zenflow")
    plain = fit_twice(lambda: "auto", tmp_path / "plain")
    if knobs["topk_ratio"] == 1.0:
        assert_weights_close(weights(zenflow), weights(plain))


def test_the_module_state_of_a_module_connected_without_a_trainer() -> None:
    """``strategy.connect(module)`` without a Trainer (as Lightning's checkpoint tests do): its state is the
    module's, with nothing to sync."""
    strategy = ZenFlowStrategy(sync_on=("checkpoint",))
    module = TinyModule()
    strategy.connect(module)
    state = strategy.lightning_module_state_dict()
    assert state.keys() == module.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())
