"""ZenFlowAdamW beyond Lightning's Trainer: Lightning Fabric (one device, two ranks on gloo) and the Hugging Face
Trainer (train, save, resume), each against the numbers of a plain loop or of an uninterrupted run (CPU)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_zenflow import ZenFlowAdamW

pytestmark = pytest.mark.usefixtures("no_leaked_children")

ROOT = pathlib.Path(__file__).resolve().parents[1]
KNOBS = {"full_warm_up_rounds": 2, "update_interval": 3, "topk_ratio": 0.25}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(steps)]


def _plain_loop(steps: int) -> dict[str, torch.Tensor]:
    model = _model()
    with ZenFlowAdamW(model.parameters(), lr=1e-2, **KNOBS) as optimizer:
        for inputs, targets in _batches(steps):
            nn.functional.mse_loss(model(inputs), targets).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------- Fabric
def _fabric_run(tmp_path: pathlib.Path, steps: int, stop_at: int | None = None, resume: pathlib.Path | None = None):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = _model()
    model, optimizer = fabric.setup(model, ZenFlowAdamW(model.parameters(), lr=1e-2, **KNOBS))
    first = 0
    if resume is not None:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(resume, state)
        first = state["step"]
    for step, (inputs, targets) in enumerate(_batches(steps)):
        if step < first:
            continue
        fabric.backward(nn.functional.mse_loss(model(inputs), targets))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == stop_at:
            fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer, "step": step + 1})
            optimizer.optimizer.close()
            return None
    optimizer.optimizer.flush()
    optimizer.optimizer.close()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_fabric_on_one_device_equals_a_plain_loop_and_resumes_exactly(tmp_path: pathlib.Path) -> None:
    expected = _plain_loop(14)
    uninterrupted = _fabric_run(tmp_path, 14)
    for name, value in expected.items():
        assert torch.equal(uninterrupted[name], value), name
    _fabric_run(tmp_path, 14, stop_at=7)  # mid-window, a host update in flight
    resumed = _fabric_run(tmp_path, 14, resume=tmp_path / "state.ckpt")
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name


FABRIC_TWO_RANKS = """
import json, sys
import torch
from torch import nn
from lightning.fabric import Fabric
import lightning_zenflow
from lightning_zenflow import ZenFlowAdamW

sys.path.insert(0, {tests!r})
from test_integrations import KNOBS, _batches, _model


def train(fabric, out):
    model = _model()
    optimizer = ZenFlowAdamW(model.parameters(), lr=1e-2, **KNOBS)
    model, optimizer = fabric.setup(model, optimizer)
    for inputs, targets in _batches(14):
        # every rank sees the whole batch: DDP's average of equal gradients is that gradient
        fabric.backward(nn.functional.mse_loss(model(inputs), targets))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.optimizer.flush()
    host_bytes = optimizer.optimizer.engine.host_bytes()
    state = optimizer.state_dict()  # every rank takes part; rank 0 holds the consolidated moments
    optimizer.optimizer.close()
    weights = {{k: v.detach().tolist() for k, v in model.module.state_dict().items()}}
    with open(f"{{out}}/rank{{fabric.global_rank}}.json", "w") as file:
        json.dump({{"weights": weights, "host_bytes": host_bytes, "moments": len(state["state"])}}, file)


if __name__ == "__main__":
    Fabric(accelerator="cpu", devices=2, strategy="zenflow_spawn").launch(train, sys.argv[1])
"""


@pytest.mark.slow  # two ranks (25 s); the one-device Fabric test stays in the default suite
def test_fabric_two_ranks_with_the_zenflow_strategy_equal_one_process(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent(FABRIC_TWO_RANKS.format(tests=str(ROOT / "tests"))))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    expected = _plain_loop(14)
    for rank in ranks:
        for name, value in expected.items():
            assert torch.equal(torch.tensor(rank["weights"][name]), value), name
    model_bytes = sum(p.numel() for p in _model().parameters() if p.ndim >= 2) * 20
    assert all(rank["host_bytes"] < 0.75 * model_bytes for rank in ranks), "the host state is sharded by rows"
    assert ranks[0]["moments"] > 0
    assert ranks[1]["moments"] == 0


def test_fabric_zenflow_refuses_another_optimizer() -> None:
    from lightning_zenflow import UnsupportedSetupError
    from lightning_zenflow.integrations.fabric import ZenFlowFabricStrategy

    strategy = ZenFlowFabricStrategy.__new__(ZenFlowFabricStrategy)
    with pytest.raises(UnsupportedSetupError, match="trains lightning_zenflow.ZenFlowAdamW, got AdamW"):
        strategy.setup_optimizer(torch.optim.AdamW(_model().parameters()))


# ---------------------------------------------------------------------------------------- Hugging Face Trainer
def test_the_hugging_face_trainer_trains_saves_and_resumes_where_an_uninterrupted_run_ends(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_trainer
    finally:
        sys.path.pop(0)

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if state.global_step == 6:
                control.should_training_stop = True
            return control

    full = hf_trainer.build(str(tmp_path / "full"), max_steps=12, save_steps=6, knobs=KNOBS)
    full.train()
    interrupted = hf_trainer.build(str(tmp_path / "part"), max_steps=12, save_steps=6, knobs=KNOBS)
    interrupted.add_callback(StopAt())
    interrupted.train()
    assert interrupted.state.global_step == 6
    saved = torch.load(tmp_path / "part" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert saved["zenflow"]["progress"]["pending"] is not None, "a host update was in flight at the checkpoint"
    resumed = hf_trainer.build(str(tmp_path / "resumed"), max_steps=12, save_steps=6, knobs=KNOBS)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-6"))
    assert resumed.state.global_step == 12
    expected = full.model.state_dict()
    initial = hf_trainer.build(str(tmp_path / "initial"), max_steps=1, save_steps=6).model.state_dict()
    moved = 0
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
        moved += int(not torch.equal(value, initial[name]))
    assert moved > 10, "the model trained"
