"""``ZenFlowAdamW`` in plain loops: AdamW's numbers in the exact settings, the strategy's at the defaults, exact
save and load, GradScaler, param groups added mid-run, and its lifecycle (CPU)."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import spawned_children
from lightning_helpers import TinyModule, assert_weights_close, assert_weights_equal, fit, weights
from torch import nn

from lightning_zenflow import ZenFlowAdamW, ZenFlowConfig, ZenFlowStrategy
from lightning_zenflow.optim import LIGHTNING_ONLY_KNOBS

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


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(steps)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 4))


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, batches, clip: float | None = 0.5, schedule=True):
    """A plain loop: forward, backward, clipping, step, an LR schedule, zero_grad."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7) if schedule else None
    for inputs, targets in batches:
        nn.functional.mse_loss(model(inputs), targets).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()


def test_every_engine_knob_is_a_keyword() -> None:
    import inspect

    keywords = set(inspect.signature(ZenFlowAdamW).parameters)
    knobs = {field.name for field in ZenFlowConfig.__dataclass_fields__.values()} - set(LIGHTNING_ONLY_KNOBS)
    assert knobs <= keywords
    with pytest.raises(ValueError, match="topk_ratio=2 is outside"):
        ZenFlowAdamW(_model().parameters(), topk_ratio=2)


@EXACT
def test_a_plain_loop_equals_torch_adamw(knobs: dict) -> None:
    batches = _batches(10)
    control = _model()
    _loop(control, torch.optim.AdamW(control.parameters(), lr=1e-2, weight_decay=0.05), batches)
    model = _model()
    with ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.05, **knobs) as optimizer:
        _loop(model, optimizer, batches)
    assert_weights_close(weights(model), weights(control))
    assert not torch.equal(weights(model)["0.weight"], weights(_model())["0.weight"])


def test_a_plain_loop_at_the_defaults_equals_the_lightning_strategy() -> None:
    """TinyModule's data and steps, by hand: the same numbers as ``Trainer(strategy="zenflow")`` bitwise."""
    strategy_module, trainer = fit(ZenFlowStrategy(), max_epochs=3)
    module = TinyModule()
    loader = module.train_dataloader()
    optimizer = ZenFlowAdamW(
        module.named_parameters(), lr=module.lr, weight_decay=module.weight_decay, steps_per_epoch=len(loader)
    )
    with optimizer:
        for _ in range(3):
            for batch in loader:
                module._loss(batch).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert trainer.global_step == 3 * len(loader)
    assert_weights_equal(weights(module), weights(strategy_module))


@pytest.mark.parametrize("knobs", [{}, {"full_warm_up_rounds": 2, "update_interval": 3}], ids=["defaults", "short"])
def test_save_and_load_mid_window_continue_bitwise(knobs: dict) -> None:
    """A state saved mid-window, a host update in flight, loads into a new optimizer on a copy of the model and
    continues exactly as the uninterrupted run; plain AdamW takes the same state."""
    batches = _batches(24)
    reference = _model()
    with ZenFlowAdamW(reference.parameters(), lr=1e-2, **knobs) as optimizer:
        _loop(reference, optimizer, batches, schedule=False)
    model = _model()
    first = ZenFlowAdamW(model.parameters(), lr=1e-2, **knobs)
    _loop(model, first, batches[:15], schedule=False)
    saved = copy.deepcopy(first.state_dict())
    first.close()
    assert saved["zenflow"]["progress"]["steps_in_window"] > 0
    resumed = copy.deepcopy(model)
    with ZenFlowAdamW(resumed.parameters(), lr=1e-2, **knobs) as second:
        second.load_state_dict(saved)
        _loop(resumed, second, batches[15:], schedule=False)
    assert_weights_equal(weights(resumed), weights(reference))
    plain = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2)
    plain.load_state_dict(saved)  # torch AdamW's format: the extras are ignored
    assert plain.state_dict()["state"][0]["exp_avg"].shape == model[0].weight.shape


def test_load_into_an_optimizer_that_stepped_rebuilds_it() -> None:
    batches = _batches(8)
    model = _model()
    with ZenFlowAdamW(model.parameters(), lr=1e-2, **DEVICE_ONLY) as optimizer:
        _loop(model, optimizer, batches[:3], schedule=False)
        saved = copy.deepcopy(optimizer.state_dict())
        at_save = copy.deepcopy(model.state_dict())
        _loop(model, optimizer, batches[3:5], schedule=False)
        model.load_state_dict(at_save)
        optimizer.load_state_dict(saved)  # back to step 3 (a Tuner's restore does this)
        _loop(model, optimizer, batches[3:], schedule=False)
    control = _model()
    _loop(control, torch.optim.AdamW(control.parameters(), lr=1e-2), batches, schedule=False)
    assert_weights_close(weights(model), weights(control))


def test_grad_scaler_skips_an_overflowed_step_as_adamw_does() -> None:
    """``GradScaler.step(opt)`` on the CPU, gradients left scaled (no ``unscale_``): ZenFlowAdamW takes the overflow
    flag and the scale on the device; the overflowed step leaves every weight as it was."""

    def run(make):
        model = _model()
        optimizer = make(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        seen = []
        for step, (inputs, targets) in enumerate(_batches(8)):
            loss = nn.functional.mse_loss(model(inputs), targets)
            scaler.scale(loss).backward()
            if step == 4:
                model[0].weight.grad[0, 0] = float("inf")
            before = weights(model)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            seen.append(all(torch.equal(before[n], v) for n, v in weights(model).items()))
        if isinstance(optimizer, ZenFlowAdamW):
            optimizer.close()
        return model, seen

    control, control_seen = run(lambda p: torch.optim.AdamW(p, lr=1e-2))
    model, seen = run(lambda p: ZenFlowAdamW(p, lr=1e-2, **DEVICE_ONLY))
    assert seen == control_seen == [False] * 4 + [True] + [False] * 3
    assert_weights_close(weights(model), weights(control))


@EXACT
def test_a_param_group_added_mid_run_equals_adamw(knobs: dict) -> None:
    batches = _batches(10)

    def run(make):
        model = _model()
        optimizer = make(list(model[0].parameters()))
        for step, (inputs, targets) in enumerate(batches):
            if step == 4:
                optimizer.add_param_group({"params": list(model[3].parameters()), "lr": 3e-3})
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        if isinstance(optimizer, ZenFlowAdamW):
            optimizer.close()
        return model

    control = run(lambda p: torch.optim.AdamW(p, lr=1e-2))
    model = run(lambda p: ZenFlowAdamW(p, lr=1e-2, **knobs))
    assert_weights_close(weights(model), weights(control))
    assert not torch.equal(weights(model)["3.weight"], weights(_model())["3.weight"])


def test_the_context_manager_flushes_on_success_and_closes_on_an_exception() -> None:
    model = _model()
    before = spawned_children()
    optimizer = ZenFlowAdamW(model.parameters(), lr=1e-2)
    running = []

    def train_then_fail() -> None:
        with optimizer:
            _loop(model, optimizer, _batches(3), schedule=False)
            running.append(bool(spawned_children() - before))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train_then_fail()
    assert running == [True], "a host worker ran"
    assert optimizer.engine is None
    assert not spawned_children() - before
    with pytest.raises(RuntimeError, match="was closed"):
        optimizer.step()


def test_a_script_that_never_closes_leaves_no_process_behind(tmp_path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from lightning_zenflow import ZenFlowAdamW
            model = torch.nn.Linear(8, 4)
            optimizer = ZenFlowAdamW(model.parameters(), lr=1e-2, full_warm_up_rounds=0)
            for _ in range(3):
                model(torch.randn(2, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            print("pid", optimizer.engine.worker_pid)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split("pid")[1])
    import os

    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_gan_trains_with_zenflow_adamw_under_manual_optimization() -> None:
    """The advice the strategy gives a GAN: ``strategy="auto"`` with a ZenFlowAdamW per optimizer."""
    import lightning

    class GAN(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            first, second = self.optimizers()
            loss = self._loss(batch)
            self.manual_backward(loss)
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()

        def configure_optimizers(self):  # noqa: ANN201
            return [
                ZenFlowAdamW(self.net[0].parameters(), lr=self.lr, **DEVICE_ONLY),
                ZenFlowAdamW(self.net[2].parameters(), lr=self.lr, **DEVICE_ONLY),
            ]

        def on_train_end(self) -> None:
            for optimizer in self.optimizers():
                optimizer.optimizer.close()

    module, trainer = fit("auto", GAN())
    assert trainer.global_step == 32  # two optimizers stepped per batch
    control, _ = fit("auto", TinyModule())
    assert_weights_close(weights(module), weights(control))
    assert isinstance(trainer, lightning.Trainer)
