"""What the library does to the user's process or time is said in one line, once per process (``engine/notices.py``):
the core pinning (with how to turn it off) and the first build of the interim moves' kernels (CPU)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from lightning_zenflow import ZenFlowAdamW
from lightning_zenflow.engine import compiled as compiled_module
from lightning_zenflow.engine import kernels, notices
from lightning_zenflow.engine.notices import ZenFlowNotice

pytestmark = pytest.mark.usefixtures("no_leaked_children")


@pytest.fixture
def fresh_process_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: nothing said yet."""
    monkeypatch.setattr(notices, "_SAID", set())


def _steps(optimizer: torch.optim.Optimizer, model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores to split")
@pytest.mark.usefixtures("fresh_process_notices")
def test_the_core_pinning_is_said_once_with_how_to_turn_it_off() -> None:
    model = nn.Linear(8, 4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):  # a second optimizer in the same process says nothing more
            with ZenFlowAdamW(model.parameters(), full_warm_up_rounds=0) as optimizer:
                _steps(optimizer, model, 2)
        with ZenFlowAdamW(model.parameters(), full_warm_up_rounds=0, bind_cores=False) as optimizer:
            _steps(optimizer, model, 2)
    lines = [str(w.message) for w in said if issubclass(w.category, ZenFlowNotice)]
    assert len(lines) == 1, lines
    assert "this process now runs on cores" in lines[0]
    assert "bind_cores=False" in lines[0]
    assert "\n" not in lines[0]


@pytest.mark.usefixtures("fresh_process_notices")
def test_bind_cores_false_says_nothing() -> None:
    model = nn.Linear(8, 4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with ZenFlowAdamW(model.parameters(), full_warm_up_rounds=0, bind_cores=False) as optimizer:
            _steps(optimizer, model, 2)
    assert not [w for w in said if issubclass(w.category, ZenFlowNotice)]


@pytest.mark.usefixtures("fresh_process_notices")
def test_the_first_kernel_build_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernels' first call builds them (``engine/compiled.py``; stood in for here, no compiler needed):
    one line before it, none for later calls or later engines."""

    class Built:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def guard_check(self, *args: object) -> bool:
            return True

    monkeypatch.setenv(kernels.KERNELS_ENV, "inductor")  # torch.compile's builds (the CPU's are native otherwise)
    monkeypatch.setattr(compiled_module, "_REGISTRY", {})
    monkeypatch.setattr(compiled_module, "_build", lambda fn, args: Built(fn))
    monkeypatch.setattr(kernels, "resolve_kernel_mode", lambda mode, device, elements=None: ("compiled", None))
    grad, host_mask = torch.ones(3, 2), torch.ones(2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            built = kernels.Kernels("compiled", torch.device("cpu"))
            for _ in range(2):
                built.row_col_sums(grad, host_mask)
    lines = [str(w.message) for w in said if issubclass(w.category, ZenFlowNotice)]
    assert lines == [f"lightning_zenflow: {kernels.KERNEL_BUILD_NOTICE}"]
    assert "interim_kernel='eager'" in lines[0]
