"""The degenerate cases of DESIGN section 4 equal plain torch Adam/AdamW (to float rounding), in the exact state
(``host_state="fp32"``; the compact state's degenerate cases are in ``tests/test_host_state.py``).

- rho=1, any S: every column on the device, so the engine is AdamW (also after a host-side warm-up);
- rho=0, S=1, overlap off: every matrix on the host, updated every step, synchronously: AdamW;
- rho=0, S=1, overlap on: AdamW whose matrix updates reach the model one step late; flush() catches up.

The first two are checked with a weight-dependent loss (a tiny conv + MLP on random data, gradients taken
from the engine-updated weights, against torch on a copy) so that any drift would compound; the third with
a gradient stream independent of the weights, because there the trajectories differ by design.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")  # every engine's host worker is joined

ATOL, RTOL = 1e-6, 1e-5
STEPS = 12


class TinyNet(nn.Module):
    """4-D conv weight, 2-D linear weights, 1-D biases and norm parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 2)
        self.fc1 = nn.Linear(27, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.norm(self.fc1(hidden))))


def _model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet()
    with torch.no_grad():  # LayerNorm starts at 1 / 0: move it so its own update is visible
        model.norm.weight.add_(0.1 * torch.randn(8))
        model.norm.bias.add_(0.1 * torch.randn(8))
    return model


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": matrices, "lr": 2e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
        {"params": vectors, "lr": 5e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
    ]
    if kind == "adamw":
        return torch.optim.AdamW(groups)
    groups[1]["weight_decay"] = 0.05  # Adam's L2 penalty on both groups
    return torch.optim.Adam(groups)


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.3 * step))


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 1, 4, 4, generator=generator), torch.randn(16, 3, generator=generator)) for _ in range(steps)
    ]


def _backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()


def _assert_params_close(actual: nn.Module, expected: nn.Module, where: str) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=ATOL, rtol=RTOL, msg=f"{name} {where}")


@pytest.mark.parametrize(
    ("kind", "ratio", "interval", "warm_up", "overlap"),
    [
        ("adamw", 1.0, 1, 0, True),
        ("adamw", 1.0, 4, 0, True),
        ("adamw", 1.0, 4, 3, True),  # warm-up on the host, then the device continues with the same counts
        ("adamw", 0.0, 1, 0, False),  # the ZeRO-Offload baseline
        ("adam-l2", 1.0, 2, 0, True),
        ("adam-l2", 0.0, 1, 0, False),
    ],
)
def test_tracks_torch_on_a_weight_dependent_loss(kind: str, ratio: float, interval: int, warm_up: int, overlap: bool):
    model = _model()
    twin = copy.deepcopy(model)
    opt, twin_opt = _optimizer(model, kind), _optimizer(twin, kind)
    schedulers = [_scheduler(opt), _scheduler(twin_opt)]
    config = ZenFlowConfig(
        topk_ratio=ratio,
        update_interval=interval,
        full_warm_up_rounds=warm_up,
        overlap_step=overlap,
        select_strategy="step",
        select_interval=max(interval, 3),  # refreshes happen and must change nothing
        host_state="fp32",  # the exact state: the compact one equals AdamW with its compression (test_host_state.py)
    )
    names = {param: name for name, param in model.named_parameters()}
    start = copy.deepcopy(model)
    with ZenFlowEngine(opt, config, param_names=names) as engine:
        for t, batch in enumerate(_batches(STEPS), start=1):
            _backward(model, batch)
            _backward(twin, batch)
            engine.step()
            twin_opt.step()
            for scheduler in schedulers:
                scheduler.step()
            opt.zero_grad()
            twin_opt.zero_grad()
            _assert_params_close(model, twin, f"after step {t}")
        engine.flush()
        _assert_params_close(model, twin, "after flush")
        moments = engine.torch_state_dict()["state"]
    twin_state = twin_opt.state_dict()["state"]
    for index, entry in moments.items():
        torch.testing.assert_close(entry["exp_avg"], twin_state[index]["exp_avg"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(entry["exp_avg_sq"], twin_state[index]["exp_avg_sq"], atol=ATOL, rtol=RTOL)
        assert float(entry["step"]) == float(twin_state[index]["step"]) == STEPS
    # the comparison is not vacuous: every parameter moved well beyond the tolerance
    for (name, param), initial in zip(model.named_parameters(), start.parameters()):
        assert (param - initial).abs().max() > 1e-3, name


def test_rho_zero_with_overlap_is_adamw_one_step_late() -> None:
    """Matrices show AdamW's iterate of the previous step, 1-D parameters the current one; sync() and flush()
    catch up. Gradients are a fixed random stream (the trajectories would otherwise differ by design)."""
    model = _model()
    twin = copy.deepcopy(model)
    opt, twin_opt = _optimizer(model, "adamw"), _optimizer(twin, "adamw")
    schedulers = [_scheduler(opt), _scheduler(twin_opt)]
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=0.0, update_interval=1, overlap_step=True, host_state="fp32"
    )
    names = {param: name for name, param in model.named_parameters()}
    generator = torch.Generator().manual_seed(2)
    iterates = [copy.deepcopy(twin.state_dict())]  # iterates[t] = AdamW after t steps
    sync_after = 4
    with ZenFlowEngine(opt, config, param_names=names) as engine:
        for t in range(1, STEPS + 1):
            for param, twin_param in zip(model.parameters(), twin.parameters()):
                grad = torch.randn(param.shape, generator=generator)
                param.grad, twin_param.grad = grad.clone(), grad.clone()
            engine.step()
            twin_opt.step()
            for scheduler in schedulers:
                scheduler.step()
            iterates.append(copy.deepcopy(twin.state_dict()))
            for name, param in model.named_parameters():
                lagged = iterates[t - 1] if param.ndim >= 2 else iterates[t]
                torch.testing.assert_close(param.detach(), lagged[name], atol=ATOL, rtol=RTOL, msg=f"{name} at {t}")
                if param.ndim >= 2:  # really one step behind, not already current
                    assert not torch.allclose(param.detach(), iterates[t][name], atol=1e-4), f"{name} at {t}"
            if t == sync_after:
                engine.sync()
                for name, param in model.named_parameters():
                    torch.testing.assert_close(param.detach(), iterates[t][name], atol=ATOL, rtol=RTOL, msg=name)
        engine.flush()
        assert not engine.host_in_flight
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), iterates[STEPS][name], atol=ATOL, rtol=RTOL, msg=f"{name} flush")
