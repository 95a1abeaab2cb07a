"""Exact resume: a run continued from ``state_dict()`` is bitwise the uninterrupted run; loads are validated;
the state converts to and from torch's Adam/AdamW format.

One uninterrupted run (a slowed host worker, so a host update is really in flight after a window end) takes
snapshots at four points, each with a copy of the model's visible weights:
    step 1   during warm-up;
    step 5   mid-window, with the previous window's host update in flight;
    step 6   right after a window end, its host update in flight (and nothing else pending);
    step 9   mid-window with nothing in flight (the refresh at step 8 applied everything).
A new engine on each copy continues with the same batches (the loss depends on the weights, so any difference
would compound) through a refresh (steps 8 and 13), a flush mid-run (after step 11) and a final flush.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.compiled import aot_available
from lightning_zenflow.engine.export import adamw_state
from lightning_zenflow.engine.kernels import compiler_missing

pytestmark = pytest.mark.usefixtures("no_leaked_children")  # every engine's host worker is joined

STEPS, FLUSH_AFTER = 14, 11
SNAPSHOTS = (1, 5, 6, 9)
HOST_DELAY_S = 1.2
"""Long enough that the snapshots at steps 5 and 6 come while the worker still computes, on a busy machine too."""
CONFIG = ZenFlowConfig(
    topk_ratio=0.3,
    update_interval=2,
    full_warm_up_rounds=2,
    overlap_step=True,
    select_strategy="step",
    select_interval=4,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _optimizer(model: Net) -> torch.optim.AdamW:
    """Plain AdamW, two groups with different betas and weight decay."""
    return torch.optim.AdamW(
        [
            {"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
            {"params": [model.fc1.bias, model.norm.weight, model.norm.bias, model.fc2.bias], "betas": (0.8, 0.99)},
        ],
        lr=1e-2,
        weight_decay=0.0,
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(STEPS)]


BATCHES = _batches()


def _train_step(engine: ZenFlowEngine, model: Net, opt: torch.optim.Optimizer, t: int):
    for group in opt.param_groups:  # a scheduler: lr depends on the step only
        group["lr"] = 1e-2 / (1.0 + 0.2 * t)
    x, y = BATCHES[t - 1]
    nn.functional.mse_loss(model(x), y).backward()
    stats = engine.step()
    opt.zero_grad()
    return stats


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _maybe_flush(engine: ZenFlowEngine, model: Net, t: int, record: dict) -> None:
    if t == FLUSH_AFTER:
        engine.flush()
        record["flush"] = _weights(model)


@dataclass
class Uninterrupted:
    history: dict = field(default_factory=dict)
    """step -> visible weights after it; "flush" -> after the mid-run flush; "final" -> after the last flush."""
    snapshots: dict = field(default_factory=dict)
    """step -> (engine state, copy of the model)."""
    final_state: dict | None = None
    final_torch_state: dict | None = None
    final_model: Net | None = None
    in_flight_checks: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def uninterrupted() -> Uninterrupted:
    run = Uninterrupted()
    model = _net()
    opt = _optimizer(model)
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, CONFIG, param_names=names, host_delay_s=HOST_DELAY_S) as engine:
        for t in range(1, STEPS + 1):
            stats = _train_step(engine, model, opt, t)
            run.history[t] = _weights(model)
            if t in SNAPSHOTS:
                in_flight = engine.host_in_flight
                started = time.perf_counter()
                state = engine.state_dict()
                waited_s = time.perf_counter() - started
                unchanged = all(torch.equal(v, run.history[t][k]) for k, v in model.state_dict().items())
                run.in_flight_checks[t] = (in_flight, waited_s, engine.host_in_flight, unchanged, stats)
                run.snapshots[t] = (copy.deepcopy(state), copy.deepcopy(model))
            _maybe_flush(engine, model, t, run.history)
        engine.flush()
        run.history["final"] = _weights(model)
        run.final_state = copy.deepcopy(engine.state_dict())
        run.final_torch_state = copy.deepcopy(engine.torch_state_dict())
        run.final_model = copy.deepcopy(model)
    return run


def test_snapshots_are_where_they_should_be(uninterrupted: Uninterrupted) -> None:
    progress = {t: state["progress"] for t, (state, _) in uninterrupted.snapshots.items()}
    assert progress[1]["last_select_t"] is None  # warm-up
    assert (progress[5]["steps_in_window"], progress[5]["pending"] is not None) == (1, True)
    assert (progress[6]["steps_in_window"], progress[6]["pending"] is not None) == (0, True)
    assert (progress[9]["steps_in_window"], progress[9]["pending"] is not None) == (1, False)
    assert progress[9]["last_select_t"] == 8  # the refresh at step 8 happened
    for t in (5, 6):
        in_flight, waited_s, still_in_flight, unchanged, _ = uninterrupted.in_flight_checks[t]
        assert in_flight, f"step {t}: a host update should be in flight"
        # the slowed worker was still computing: state_dict() had to wait for it ...
        assert waited_s > 0.1, f"step {t}: state_dict returned after {waited_s:.3f} s"
        # ... and did not apply it early
        assert still_in_flight, f"step {t}: state_dict() applied the update in flight"
        assert unchanged, f"step {t}: state_dict() changed the model's weights"
    assert uninterrupted.in_flight_checks[6][4].window_end


@pytest.mark.parametrize("snapshot_step", SNAPSHOTS)
def test_resume_is_bitwise_the_uninterrupted_run(uninterrupted: Uninterrupted, snapshot_step: int) -> None:
    state, saved_model = uninterrupted.snapshots[snapshot_step]
    model = copy.deepcopy(saved_model)  # the visible weights at the snapshot
    opt = _optimizer(model)
    names = {param: name for name, param in model.named_parameters()}
    record: dict = {}
    with ZenFlowEngine(opt, CONFIG, param_names=names) as engine:
        engine.load_state_dict(copy.deepcopy(state))
        assert engine.host_in_flight == (state["progress"]["pending"] is not None)
        refreshed_at = []
        for t in range(snapshot_step + 1, STEPS + 1):
            if _train_step(engine, model, opt, t).refreshed:
                refreshed_at.append(t)
            for name, value in model.state_dict().items():
                assert torch.equal(value, uninterrupted.history[t][name]), f"{name} after step {t}"
            _maybe_flush(engine, model, t, record)
        engine.flush()
        for name, value in model.state_dict().items():
            assert torch.equal(record["flush"][name], uninterrupted.history["flush"][name]), f"{name} mid-run flush"
            assert torch.equal(value, uninterrupted.history["final"][name]), f"{name} after the final flush"
        final_state = engine.state_dict()
        final_torch_state = engine.torch_state_dict()
    assert 13 in refreshed_at
    for name, entry in uninterrupted.final_state["params"].items():
        resumed = final_state["params"][name]
        assert resumed.keys() == entry.keys()
        assert {"master", "exp_avg", "exp_avg_sq", "device_step"} <= entry.keys()
        for key, value in entry.items():  # masters, moments, selected columns, per-side counts
            if isinstance(value, torch.Tensor):
                assert torch.equal(resumed[key], value), f"{key} of {name}"
            else:
                assert resumed[key] == value, f"{key} of {name}"
    assert final_state["progress"] == uninterrupted.final_state["progress"]
    for index, entry in uninterrupted.final_torch_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(final_torch_state["state"][index][key], entry[key])


@pytest.mark.slow  # builds its kernels (the eager resume tests above take the same path through the compact state)
def test_a_resume_mid_window_with_compiled_kernels_is_bitwise() -> None:
    """The compact state with its kernels compiled (built ahead of time, never on a lane): a snapshot in the middle
    of a window with the previous window's update in flight, resumed, equals the uninterrupted run to the bit."""
    if compiler_missing(torch.device("cpu")) is not None or aot_available() is not None:
        pytest.skip("no C++ compiler for torch.compile, or no ahead-of-time builds in this torch")
    config = dataclasses.replace(CONFIG, interim_kernel="compiled")
    assert config.host_state == "bf16"
    history, snapshot = {}, None
    model = _net()
    opt = _optimizer(model)
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in model.named_parameters()}) as engine:
        for t in range(1, STEPS + 1):
            _train_step(engine, model, opt, t)
            history[t] = _weights(model)
            if t == 5:
                snapshot = (copy.deepcopy(engine.state_dict()), copy.deepcopy(model))
        assert engine.kernels.mode == "compiled"
        engine.flush()
        history["final"] = _weights(model)
    state, saved_model = snapshot
    assert (state["progress"]["steps_in_window"], state["progress"]["pending"] is not None) == (1, True)
    model = copy.deepcopy(saved_model)
    opt = _optimizer(model)
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in model.named_parameters()}) as engine:
        engine.load_state_dict(copy.deepcopy(state))
        for t in range(6, STEPS + 1):
            _train_step(engine, model, opt, t)
            for name, value in model.state_dict().items():
                assert torch.equal(value, history[t][name]), f"{name} after step {t}"
        engine.flush()
        for name, value in model.state_dict().items():
            assert torch.equal(value, history["final"][name]), f"{name} after the final flush"


# ------------------------------------------------------------------------------------------- validation
def _device_only_engine(model: Net) -> ZenFlowEngine:
    """rho=1 and no warm-up: no host worker to spawn; loading validates the same way."""
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=1.0, update_interval=1)
    return ZenFlowEngine(_optimizer(model), config, param_names={p: n for n, p in model.named_parameters()})


def test_load_validates_names_and_shapes(uninterrupted: Uninterrupted) -> None:
    state, _ = uninterrupted.snapshots[6]
    model = _net()
    before = _weights(model)
    with _device_only_engine(model) as engine:
        renamed = copy.deepcopy(state)
        renamed["params"]["fc1.weight_renamed"] = renamed["params"].pop("fc1.weight")
        with pytest.raises(ValueError, match=r"fc1\.weight"):
            engine.load_state_dict(renamed)
        reshaped = copy.deepcopy(state)
        reshaped["params"]["fc2.weight"]["master"] = torch.zeros(3, 9)
        with pytest.raises(ValueError, match=r"fc2\.weight"):
            engine.load_state_dict(reshaped)
        missing = copy.deepcopy(state)
        del missing["params"]["norm.bias"]
        with pytest.raises(ValueError, match=r"norm\.bias"):
            engine.load_state_dict(missing)
        # the failed loads changed nothing, and a correct one still works afterwards
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        engine.load_state_dict(copy.deepcopy(state))
        assert engine.state_dict()["progress"]["t"] == 6


@pytest.mark.parametrize(
    ("name", "key", "shape"),
    [("norm.bias", "exp_avg", (1,)), ("fc1.weight", "exp_avg_sq", (6, 10))],  # fc1.weight is [10, 6]
)
def test_load_validates_moment_shapes(uninterrupted: Uninterrupted, name: str, key: str, shape: tuple) -> None:
    state = copy.deepcopy(uninterrupted.snapshots[6][0])
    state["params"][name][key] = torch.ones(shape)
    with _device_only_engine(_net()) as engine, pytest.raises(ValueError, match=re.escape(name)):
        engine.load_state_dict(state)


def test_load_torch_state_dict_validates_exp_avg_sq_shape() -> None:
    model = _net()
    plain_opt = _optimizer(model)
    nn.functional.mse_loss(model(BATCHES[0][0]), BATCHES[0][1]).backward()
    plain_opt.step()
    torch_state = copy.deepcopy(plain_opt.state_dict())
    # torch numbers the parameters in param-group order, not in named_parameters order
    bias = dict(model.named_parameters())["norm.bias"]
    in_group_order = [p for group in plain_opt.param_groups for p in group["params"]]
    norm_bias_index = next(i for i, p in enumerate(in_group_order) if p is bias)
    torch_state["state"][norm_bias_index]["exp_avg_sq"] = torch.ones(1)
    with _device_only_engine(model) as engine, pytest.raises(ValueError, match=re.escape("norm.bias")):
        engine.load_torch_state_dict(torch_state)


def test_load_into_an_engine_that_already_stepped_restarts_it(uninterrupted: Uninterrupted) -> None:
    """A restore into an engine that has run (the Tuner's restore, a retry) drops that run and continues exactly
    as a fresh engine would from the state: bitwise the uninterrupted run."""
    state, saved_model = uninterrupted.snapshots[6]
    model = copy.deepcopy(saved_model)
    opt = _optimizer(model)
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, CONFIG, param_names=names) as engine:
        for t in (1, 2, 3):  # a run of its own first, with host work of its own
            _train_step(engine, model, opt, t)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(dict(saved_model.named_parameters())[name])
        engine.load_state_dict(copy.deepcopy(state))
        assert engine.host_in_flight  # the snapshot's update in flight, not the dropped run's
        for t in range(7, 10):
            _train_step(engine, model, opt, t)
            for name, value in model.state_dict().items():
                assert torch.equal(value, uninterrupted.history[t][name]), f"{name} after step {t}"


def test_torch_state_dict_loads_into_plain_adamw(uninterrupted: Uninterrupted) -> None:
    model = copy.deepcopy(uninterrupted.final_model)
    opt = _optimizer(model)
    opt.load_state_dict(copy.deepcopy(uninterrupted.final_torch_state))
    saved = uninterrupted.final_state["params"]
    for name, param in model.named_parameters():
        state = opt.state[param]
        # the engine's moments, the host columns' stated at the exported step (engine/export.py)
        betas = next(group["betas"] for group in opt.param_groups if any(p is param for p in group["params"]))
        exported = adamw_state(saved[name], betas)
        assert torch.equal(state["exp_avg"], exported["exp_avg"]), name
        assert torch.equal(state["exp_avg_sq"], exported["exp_avg_sq"]), name
        assert float(state["step"]) == max(saved[name]["device_step"], saved[name]["host_step"]) == STEPS
    # and the plain optimizer runs from it
    before = _weights(model)
    nn.functional.mse_loss(model(BATCHES[0][0]), BATCHES[0][1]).backward()
    opt.step()
    assert not torch.equal(model.fc1.weight.detach(), before["fc1.weight"])


@pytest.mark.parametrize(("ratio", "overlap"), [(1.0, True), (0.0, False)])
def test_load_torch_state_dict_continues_plain_adamw(ratio: float, overlap: bool) -> None:
    """A plain AdamW run's moments and steps go into a fresh engine; in a degenerate configuration (equal to
    AdamW) the engine then continues exactly like the plain optimizer."""
    plain = _net()
    plain_opt = _optimizer(plain)
    for t in range(1, 4):
        nn.functional.mse_loss(plain(BATCHES[t][0]), BATCHES[t][1]).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    model = copy.deepcopy(plain)
    opt = _optimizer(model)
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=ratio, update_interval=1, overlap_step=overlap, host_state="fp32"
    )
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, config, param_names=names) as engine:
        engine.load_torch_state_dict(copy.deepcopy(plain_opt.state_dict()))
        loaded = engine.torch_state_dict()["state"]
        for index, entry in plain_opt.state_dict()["state"].items():
            assert torch.equal(loaded[index]["exp_avg"], entry["exp_avg"])
            assert torch.equal(loaded[index]["exp_avg_sq"], entry["exp_avg_sq"])
            assert float(loaded[index]["step"]) == float(entry["step"]) == 3
        for t in range(4, 8):
            for net, optimizer in ((model, None), (plain, plain_opt)):
                nn.functional.mse_loss(net(BATCHES[t][0]), BATCHES[t][1]).backward()
                if optimizer is not None:
                    optimizer.step()
            engine.step()
            opt.zero_grad()
            plain_opt.zero_grad()
            for (name, param), plain_param in zip(model.named_parameters(), plain.parameters()):
                torch.testing.assert_close(param.detach(), plain_param.detach(), atol=1e-6, rtol=1e-5, msg=name)
