"""Waiting costs time, never numbers; and a bf16 model does not lose updates below half a bf16 ulp."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")  # every engine's host worker is joined

SLOW_HOST_S = 0.2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 3))


def _run(host_delay_s: float, steps: int = 10) -> tuple[list[dict], dict, dict, float]:
    """A weight-dependent loss: every gradient comes from the weights the engine left in the model."""
    model = _net()
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[3].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, model[2].weight, model[2].bias, model[3].bias], "lr": 3e-3},
        ],
        lr=1e-2,
    )
    config = ZenFlowConfig(
        topk_ratio=0.25,
        update_interval=2,
        overlap_step=True,
        full_warm_up_rounds=1,
        select_strategy="step",
        select_interval=4,
    )
    names = {param: name for name, param in model.named_parameters()}
    generator = torch.Generator().manual_seed(1)
    history, stall_s = [], 0.0
    with ZenFlowEngine(opt, config, param_names=names, host_delay_s=host_delay_s) as engine:
        for t in range(1, steps + 1):
            x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
            nn.functional.mse_loss(model(x), y).backward()
            for group in opt.param_groups:
                group["lr"] *= 0.9
            stall_s += engine.step().stall_s
            opt.zero_grad()
            if t == 5:
                engine.sync()
            history.append(copy.deepcopy(model.state_dict()))
        engine.flush()
        history.append(copy.deepcopy(model.state_dict()))
        state = engine.state_dict()["params"]
        moments = engine.torch_state_dict()["state"]
    return history, state, moments, stall_s


def test_slow_host_worker_changes_nothing_bitwise() -> None:
    fast_history, fast_state, fast_moments, fast_stall = _run(0.0)
    slow_history, slow_state, slow_moments, slow_stall = _run(SLOW_HOST_S)
    # the slow worker really made the device wait: the warm-up update and the updates of the windows ending at
    # steps 3 and 7 are each waited for inside a later step() (the sync and the flush are not in StepStats)
    assert slow_stall > 2.5 * SLOW_HOST_S
    assert slow_stall > fast_stall + 2 * SLOW_HOST_S
    for step, (fast, slow) in enumerate(zip(fast_history, slow_history), start=1):
        for name in fast:
            assert torch.equal(fast[name], slow[name]), f"{name} after step {step}"
    for name, entry in fast_state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], slow_state[name][key]), f"{key} of {name}"
        assert (entry["device_step"], entry["host_step"]) == (
            slow_state[name]["device_step"],
            slow_state[name]["host_step"],
        )
    for index, entry in fast_moments.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(entry[key], slow_moments[index][key]), f"{key} of parameter {index}"
    # and the run trained: the weights moved
    assert not torch.equal(fast_history[0]["0.weight"], fast_history[-1]["0.weight"])


def test_bf16_model_keeps_updates_below_half_an_ulp() -> None:
    """Weights in [1, 2) (bf16 ulp 2**-7): an lr of 1e-3 moves each weight by ~1e-3 per step, under half an ulp.

    The engine's fp32 masters (the exact state keeps them on the host for a bf16 model) must follow an fp32 AdamW,
    and the bf16 weights must move once the masters have moved far enough, on the device columns, the host columns
    and the device-only bias alike. (The compact state's bf16 weights are the masters of host columns, rounded
    stochastically: tests/test_host_state.py.)
    """
    lr, steps = 1e-3, 10
    generator = torch.Generator().manual_seed(0)
    weight = nn.Parameter((1.0 + torch.rand(4, 6, generator=generator)).to(torch.bfloat16))
    bias = nn.Parameter((1.0 + torch.rand(4, generator=generator)).to(torch.bfloat16))
    # fixed signs and magnitudes: Adam then moves every element by ~lr per step
    grads = {
        "weight": (torch.randn(4, 6, generator=generator) + 0.5).to(torch.bfloat16),
        "bias": (torch.randn(4, generator=generator) - 0.5).to(torch.bfloat16),
    }
    initial = {"weight": weight.detach().clone(), "bias": bias.detach().clone()}
    opt = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=0.0)
    # the fp32 reference on fp32 copies of the same bf16 numbers
    reference = {name: nn.Parameter(value.float()) for name, value in initial.items()}
    reference_opt = torch.optim.AdamW(reference.values(), lr=lr, weight_decay=0.0)
    # the premise: plain AdamW on the bf16 weights loses every one of these updates
    naive = {name: nn.Parameter(value.clone()) for name, value in initial.items()}
    naive_opt = torch.optim.AdamW(naive.values(), lr=lr, weight_decay=0.0)
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=0.5, update_interval=1, overlap_step=False, host_state="fp32"
    )
    params = {"weight": weight, "bias": bias}
    with ZenFlowEngine(opt, config, param_names={weight: "weight", bias: "bias"}) as engine:
        for t in range(1, steps + 1):
            for name, param in params.items():
                param.grad = grads[name].clone()
                reference[name].grad = grads[name].float()
                naive[name].grad = grads[name].clone()
            engine.step()
            reference_opt.step()
            naive_opt.step()
            saved = engine.state_dict()["params"]
            for name, param in params.items():
                master = saved[name]["master"]
                assert master.dtype == torch.float32
                torch.testing.assert_close(master, reference[name].detach(), atol=1e-6, rtol=1e-6, msg=f"{name} {t}")
                moved = (master - initial[name].float()).abs()
                torch.testing.assert_close(moved, torch.full_like(moved, t * lr), atol=0, rtol=1e-2)
                if t == 1:
                    assert torch.equal(param.detach(), initial[name]), "the first update is below half an ulp"
        for name, param in params.items():
            assert (param.detach() != initial[name]).all(), f"{name}: bf16 weights never picked up the updates"
            # rounding to bf16 moves a value by at most half an ulp: 2**-7 for values up to 4
            torch.testing.assert_close(param.detach().float(), reference[name].detach(), atol=2.0**-7, rtol=0)
            assert torch.equal(naive[name].detach(), initial[name]), "premise: plain bf16 AdamW loses these updates"
        columns = saved["weight"]["selected"]
        assert 0 < columns.numel() < 6, "both the device and the host columns are exercised"
