"""Building the kernels with torch.compile (CUDA's way; here on the CPU, ``LIGHTNING_ZENFLOW_KERNELS=inductor``): one
graph per kernel and dtype whatever the learning rate or the matrix's shape (an lr schedule must not recompile until
dynamo's limit and then run eagerly), and no crash when a kernel is built after a lane thread that built one has ended
(``engine/cuda_guard.py``: torch 2.11 without a CUDA device)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import pytest
import torch

from lightning_zenflow.engine import cuda_guard
from lightning_zenflow.engine import kernels as kernels_module
from lightning_zenflow.engine.host_step import NoiseTables, StepHyperParams, adam_master_step_, adam_step_, step_region
from lightning_zenflow.engine.kernels import Kernels

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    kernels_module.compiler_missing(CPU) is not None, reason="no C++ compiler for torch.compile on this machine"
)
pytestmark = pytest.mark.slow  # torch.compile's builds, seconds each with an empty compile cache (the CUDA path's way)


@pytest.fixture(autouse=True)
def built_by_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are torch.compile's builds (on a CPU the engine runs the native kernels otherwise)."""
    monkeypatch.setenv(kernels_module.KERNELS_ENV, "inductor")


def _moves(dtype: torch.dtype) -> Callable[[Kernels, float, tuple[int, int]], None]:
    def run(kernels: Kernels, lr: float, shape: tuple[int, int]) -> None:
        rows, cols = shape
        grad, weight = torch.randn(rows, cols).to(dtype), torch.randn(rows, cols).to(dtype)
        args = (grad, weight, torch.rand(rows) + 0.5, torch.rand(cols), torch.ones(cols), 1e-8, lr, torch.ones(()))
        if dtype == torch.bfloat16:
            kernels.moves_bf16_(*args, 0, torch.tensor(3))
        else:
            kernels.moves_fp32_(*args)

    return run


def _landing(dtype: torch.dtype) -> Callable[[Kernels, float, tuple[int, int]], None]:
    def run(kernels: Kernels, lr: float, shape: tuple[int, int]) -> None:
        weight, step = torch.randn(shape).to(dtype), torch.randn(shape)
        kernels.landing_add_(weight, step, 1.0 - lr * 0.01, 0, torch.tensor(5))

    return run


def _sums(kernels: Kernels, lr: float, shape: tuple[int, int]) -> None:
    kernels.row_col_sums(torch.randn(shape).bfloat16(), torch.ones(shape[1]))


def _window_sum(kernels: Kernels, lr: float, shape: tuple[int, int]) -> None:
    rows, cols = shape
    acc, grad = torch.zeros(rows, cols, dtype=torch.bfloat16), torch.randn(rows, cols).bfloat16()
    kernels.accumulate_bf16_(acc, grad, torch.rand(rows), torch.rand(cols), torch.rand(()), False)


def _host_step(state: torch.dtype, master: bool) -> Callable[[Kernels, float, tuple[int, int]], None]:
    def run(kernels: Kernels, lr: float, shape: tuple[int, int]) -> None:
        rows, cols = shape
        grad = torch.randn(rows, cols)
        m, v = torch.zeros(rows, cols, dtype=state), torch.rand(rows, cols).to(state)
        master2d = torch.randn(rows, cols) if master else None
        hp = StepHyperParams(lr, 0.9, 0.999, 1e-8, 0.01, True, 3, 2.0)
        step_fn, master_fn = kernels.wrap(adam_step_), kernels.wrap(adam_master_step_)
        tables = NoiseTables().of(7, 0, rows, cols)
        step_region(step_fn, master_fn, grad, m, v, master2d, tables, hp.scalars(7, master))

    return run


KERNELS = {
    "statistics sums": _sums,
    "window sum bf16": _window_sum,
    "moves fp32": _moves(torch.float32),
    "moves bf16": _moves(torch.bfloat16),
    "landing fp32": _landing(torch.float32),
    "landing bf16": _landing(torch.bfloat16),
    "host step fp32 state": _host_step(torch.float32, master=False),
    "host step bf16 state": _host_step(torch.bfloat16, master=False),
    "host step fp32 state, master": _host_step(torch.float32, master=True),
    "host step bf16 state, master": _host_step(torch.bfloat16, master=True),
}


@needs_compiler
@pytest.mark.parametrize("name", list(KERNELS))
def test_a_new_learning_rate_or_shape_builds_no_new_kernel(name: str) -> None:
    """The second call, with another learning rate and another matrix shape, must run the graph the first one built:
    dynamo raises on any recompile here."""
    kernels, run = Kernels("compiled", CPU), KERNELS[name]
    torch.manual_seed(0)
    run(kernels, 1e-3, (40, 24))
    with torch._dynamo.config.patch(error_on_recompile=True):
        run(kernels, 3.7e-4, (40, 24))
        run(kernels, 2e-5, (72, 56))


BUILD_AFTER_A_THREAD = """
    import threading
    import torch
    from lightning_zenflow.engine.kernels import Kernels

    def build():
        return Kernels("compiled", torch.device("cpu"))

    if {in_thread}:
        built = []
        maker = threading.Thread(target=lambda: built.append(build()))
        maker.start()
        maker.join()
        kernels = built[0]
    else:
        kernels = build()
    weight = torch.zeros(6, 4)
    lane = threading.Thread(target=kernels.landing_add_, args=(weight, torch.ones(6, 4), 0.5, 0, torch.tensor(1)))
    lane.start()
    lane.join()
    grad = torch.randn(6, 4)
    kernels.moves_fp32_(grad, weight, torch.ones(6), torch.ones(4), torch.ones(4), 1e-8, 1e-3, None)
    print("built", float(weight.sum()) > 0)
"""


@needs_compiler
@pytest.mark.parametrize("in_thread", [False, True], ids=["kernels of the main thread", "kernels of a thread"])
def test_a_kernel_built_after_a_lane_thread_ended_does_not_crash(in_thread: bool) -> None:
    """A lane thread builds a kernel and ends; then the main thread builds another. Without the guard kept alive,
    torch 2.11 (a CUDA build, no CUDA device) died here with a segmentation fault."""
    code = textwrap.dedent(BUILD_AFTER_A_THREAD.format(in_thread=in_thread))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "built True" in result.stdout


def test_the_guard_is_installed_once_from_a_thread_that_lives_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[threading.Thread] = []
    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet", lambda: calls.append(threading.current_thread()))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cuda_guard, "_DONE", False)
    caller = threading.Thread(target=cuda_guard.keep_cuda_guard)
    caller.start()
    caller.join()
    cuda_guard.keep_cuda_guard()
    assert len(calls) == 1
    assert calls[0].name == "zenflow-cuda-guard"
    assert calls[0].is_alive()  # the guard it installed is not freed while the process runs
    monkeypatch.setattr(cuda_guard, "_DONE", False)
    cuda_guard.keep_cuda_guard()  # from the main thread: installed there
    assert calls[1] is threading.main_thread()


def test_no_guard_is_installed_where_torch_sees_a_cuda_device_or_has_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet", lambda: calls.append(1), raising=False)
    for cuda, available in (("13.0", True), (None, False)):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        monkeypatch.setattr(cuda_guard, "_DONE", False)
        cuda_guard.keep_cuda_guard()
    assert calls == []
