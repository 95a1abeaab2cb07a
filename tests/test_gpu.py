"""GPU tests of the CUDA path: streams, events, pinned host memory, no host waits, numbers equal to the CPU engine's.

Skipped without CUDA. ``scripts/gpu_checks.sh`` runs every test marked ``gpu`` (``pytest tests/ -m gpu``) together
with the GPU benchmarks in one short run.

``LIGHTNING_ZENFLOW_GPU_TESTS_ON=cpu`` rehearses them on the CPU (``scripts/gpu_dryrun.sh``, and the slow tier's
``tests/test_gpu_checks.py``): every test that is not about CUDA itself (streams, pinned pages, synchronisations,
NCCL, CUDA's allocator) runs with the CPU as its device, so a test that has gone stale (an attribute the engine no
longer has, an expectation the rule no longer meets) fails here, not in the first minutes of a GPU machine.

Races need work to race with. ``_run`` trains a toy model whose "backward" reads the current weights (each gradient
is a fixed random tensor plus half the weight), so a forward that does not wait for the engine's writes, or a
gradient freed while a side stream still reads it, changes the result; the delay tests slow each asynchronous stage
(``torch.cuda._sleep`` on its stream, sleeps on the host) to open those windows and compare bitwise with an undelayed
run. Comparisons with the CPU engine use the fixed gradients alone (the same on both devices).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_helpers import (
    TinyModule,
    assert_weights_close,
    assert_weights_equal,
    fit,
    make_trainer,
    weights,
)

from lightning_zenflow import ZenFlowPrecision, ZenFlowStrategy
from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine

REHEARSAL = os.environ.get("LIGHTNING_ZENFLOW_GPU_TESTS_ON", "").strip().lower() == "cpu"
"""The CPU rehearsal of these tests (the module docstring)."""
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not REHEARSAL and not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("no_leaked_children"),
]
cuda_only = pytest.mark.skipif(REHEARSAL, reason="about CUDA itself: not rehearsed on the CPU")

DEVICE = "cpu" if REHEARSAL else "cuda"
MODES = ["device", "host"]
STAGE_DELAYS = {"side": 0.02, "d2h": 0.02, "h2d": 0.02, "helper": 0.02, "worker": 0.05}
CPU_TOLERANCE = 1e-5
"""CUDA against the CPU engine: the same rule and the same host worker; only the device kernels' roundings differ."""


# ------------------------------------------------------------------------------------------------------ helpers
def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.LayerNorm(96),
        torch.nn.GELU(),
        torch.nn.Linear(96, 48),
        torch.nn.Linear(48, 8),
    )
    return model.to(dtype)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}], lr=1e-3
    )


def _names(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    return {p: n for n, p in model.named_parameters()}


def _gradients(steps: int) -> list[dict[str, torch.Tensor]]:
    """A fixed fp32 gradient stream on the CPU; column magnitudes change from step to step, so refreshes move
    columns."""
    model = _model()
    generator = torch.Generator().manual_seed(1)
    stream = []
    for _ in range(steps):
        stream.append(
            {
                name: torch.randn(p.shape, generator=generator)
                * torch.rand(p.shape[-1:], generator=generator).pow(3).mul(4)
                for name, p in model.named_parameters()
            }
        )
    return stream


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()  # test only: every stream's work is done before the host reads results


def _train(
    engine: ZenFlowEngine,
    model: torch.nn.Module,
    grads: list[dict[str, torch.Tensor]],
    coupled: bool,
    host_times: list[float] | None = None,
) -> list[Any]:
    """One engine step per entry of ``grads`` (already on the model's device and dtype).

    ``coupled``: each gradient is ``grad + 0.5 * weight``, read on the compute stream after
    ``wait_for_update()``, so a forward that does not wait for the engine's writes changes the result.
    ``host_times``: appends the training thread's seconds inside ``engine.step()``.
    """
    stats = []
    for step_grads in grads:
        engine.wait_for_update()  # GPU-side: the "forward" below reads the weights the engine writes
        for name, p in model.named_parameters():
            p.grad = step_grads[name] + 0.5 * p.detach() if coupled else step_grads[name].clone()
        started = time.perf_counter()
        stats.append(engine.step())
        if host_times is not None:
            host_times.append(time.perf_counter() - started)
        engine.optimizer.zero_grad(set_to_none=True)
    return stats


@dataclass
class Result:
    initial: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    masters: dict[str, torch.Tensor]
    state: dict
    stats: list[Any]


def _run(
    device: str,
    config: ZenFlowConfig,
    steps: int = 11,
    dtype: torch.dtype = torch.float32,
    coupled: bool = True,
    **hooks: Any,
) -> Result:
    model = _model(dtype).to(device)
    initial = weights(model)
    grads = [{n: g.to(device=device, dtype=dtype) for n, g in step.items()} for step in _gradients(steps)]
    optimizer = _optimizer(model)
    with ZenFlowEngine(optimizer, config, param_names=_names(model), **hooks) as engine:
        stats = _train(engine, model, grads, coupled)
        engine.flush()
        engine.wait_for_update()
        _synchronize(device)
        masters = {
            name: entry["master"].clone() for name, entry in engine.state_dict(include_moments=False)["params"].items()
        }
        state = engine.torch_state_dict()
    return Result(initial, weights(model), masters, state, stats)


def _assert_bitwise(first: Result, second: Result) -> None:
    for name, weight in first.weights.items():
        assert torch.equal(second.weights[name], weight), f"weight {name}"
        assert torch.equal(second.masters[name], first.masters[name]), f"master {name}"
    for index, entry in first.state["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(second.state["state"][index][key], entry[key]), f"{key} of parameter {index}"


def _assert_moved(result: Result, at_least: float) -> None:
    """Every parameter's fp32 master moved by more than ``at_least`` somewhere: the comparison means something."""
    for name, master in result.masters.items():
        moved = (master.float() - result.initial[name]).abs().max().item()
        assert moved > at_least, f"{name} moved only {moved:.2e}"


# ------------------------------------------------------------------------------------ numbers: CUDA against CPU
_REFRESH_EVERY_WINDOW = {"topk_ratio": 0.1, "update_interval": 3, "select_strategy": "step", "select_interval": 3}
CONFIGS = [
    *(ZenFlowConfig(full_warm_up_rounds=0, accumulate_on=mode, **_REFRESH_EVERY_WINDOW) for mode in ("device", "host")),
    ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.5, update_interval=1, overlap_step=False),
    ZenFlowConfig(topk_ratio=0.0, update_interval=2, full_warm_up_rounds=2),
    ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=1.0, update_interval=4),
    ZenFlowConfig(full_warm_up_rounds=2, topk_ratio=0.25, update_interval=2, overlap_after=6),  # then overlap
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"rho{c.topk_ratio}-S{c.update_interval}-{c.accumulate_on}")
def test_cuda_engine_equals_cpu_engine(config: ZenFlowConfig) -> None:
    # uncoupled: the gradients are the same on both devices whatever the last bits of the weights
    on_cpu = _run("cpu", config, coupled=False)
    on_cuda = _run(DEVICE, config, coupled=False)
    _assert_moved(on_cpu, 100 * CPU_TOLERANCE)
    for name, expected in on_cpu.masters.items():
        torch.testing.assert_close(on_cuda.masters[name], expected, atol=CPU_TOLERANCE, rtol=0, msg=name)
        torch.testing.assert_close(on_cuda.weights[name], on_cpu.weights[name], atol=CPU_TOLERANCE, rtol=0, msg=name)
    for index, entry in on_cpu.state["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                on_cuda.state["state"][index][key], entry[key], atol=CPU_TOLERANCE, rtol=CPU_TOLERANCE
            )


def test_bf16_model_on_cuda_equals_the_cpu_engine_in_bf16() -> None:
    """The fp32 masters of a bf16 model match the CPU engine's run in bf16 far below the distance they moved, and
    the bf16 weights are exactly the masters rounded."""
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.5, update_interval=2)
    on_cpu = _run("cpu", config, dtype=torch.bfloat16, coupled=False)
    on_cuda = _run(DEVICE, config, dtype=torch.bfloat16, coupled=False)
    _assert_moved(on_cpu, 100 * CPU_TOLERANCE)
    for name, expected in on_cpu.masters.items():
        assert on_cuda.masters[name].dtype == torch.float32
        torch.testing.assert_close(on_cuda.masters[name], expected, atol=CPU_TOLERANCE, rtol=0, msg=name)
        for result in (on_cpu, on_cuda):
            rounded = result.masters[name].to(torch.bfloat16).float()
            assert torch.equal(result.weights[name], rounded), name
        assert not torch.equal(on_cuda.weights[name], on_cuda.initial[name]), f"{name} did not train"


# --------------------------------------------------------------------------------- numbers: CUDA against CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_and_host_accumulation_are_bitwise_equal_on_cuda(dtype: torch.dtype) -> None:
    # the exact state: both modes sum in fp32 in the same order (the compact state's device sum is rounded at every
    # step, the host mode's is not: docs/update_rule.md)
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=0.25,
        update_interval=3,
        select_strategy="step",
        select_interval=6,
        host_state="fp32",
    )
    device = _run(DEVICE, config.replace(accumulate_on="device"), dtype=dtype)
    host = _run(DEVICE, config.replace(accumulate_on="host"), dtype=dtype)
    assert {s.accumulate_on for s in device.stats} == {"device"}
    assert {s.accumulate_on for s in host.stats} == {"host"}
    assert sum(s.window_end for s in device.stats) >= 3
    _assert_moved(device, 1e-3)
    _assert_bitwise(device, host)


@pytest.mark.parametrize("accumulate_on", MODES)
def test_delayed_stages_give_bitwise_the_undelayed_result_on_cuda(accumulate_on: str) -> None:
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=0.25,
        update_interval=3,
        select_strategy="step",
        select_interval=6,
        accumulate_on=accumulate_on,
    )
    undelayed = _run(DEVICE, config)
    delayed = _run(DEVICE, config, stage_delays=STAGE_DELAYS)
    _assert_moved(undelayed, 1e-3)
    _assert_bitwise(undelayed, delayed)
    # the delays were real: the slow worker made the training thread wait at some window ends
    assert sum(s.stall_s for s in delayed.stats) > sum(s.stall_s for s in undelayed.stats)


def test_a_slow_copy_down_does_not_change_the_window_divisors_on_cuda() -> None:
    """The review's N1: only the copy down slowed (0.3 s per piece of work on the d2h stream), device mode with
    overlap: the next window's first step must not zero the kept counts before they went down. Bitwise the
    undelayed run, and every host update divides by the window's length."""
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, accumulate_on="device")
    divisors: list = []

    def recording(engine: ZenFlowEngine) -> None:
        submit = engine._worker.submit

        def record(slot, jobs):
            divisors.extend(d for job in jobs for d in job.mean_divisors)
            return submit(slot, jobs)

        engine._worker.submit = record

    undelayed = _run(DEVICE, config, steps=7)
    model = _model().to(DEVICE)
    grads = [{n: g.to(DEVICE) for n, g in step.items()} for step in _gradients(7)]
    with ZenFlowEngine(_optimizer(model), config, param_names=_names(model), stage_delays={"d2h": 0.3}) as engine:
        recording(engine)
        _train(engine, model, grads, coupled=True)
        engine.flush()
        engine.wait_for_update()
        _synchronize(DEVICE)
    assert divisors
    assert all(d in (2.0, 1.0) for d in divisors), divisors  # 1.0: the flush's partial window
    assert divisors.count(2.0) >= 3
    assert_weights_equal(weights(model), undelayed.weights)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("accumulate_on", MODES)
def test_adversarial_streams_give_bitwise_the_default_on_cuda(accumulate_on: str, seed: int, monkeypatch) -> None:
    """``LIGHTNING_ZENFLOW_LANES=adversarial`` on CUDA queues random sleeps on every stream before each piece of
    work: the numbers must not move."""
    config = ZenFlowConfig(
        full_warm_up_rounds=1,
        topk_ratio=0.25,
        update_interval=3,
        land_after=1,
        select_strategy="step",
        select_interval=4,
        accumulate_on=accumulate_on,
    )
    default = _run(DEVICE, config, dtype=torch.bfloat16)
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES_SEED", str(seed))
    adversarial = _run(DEVICE, config, dtype=torch.bfloat16)
    _assert_moved(default, 1e-3)
    _assert_bitwise(default, adversarial)


@cuda_only
def test_a_host_block_dtensor_stays_on_the_host_under_a_cuda_mesh(tmp_path: pathlib.Path) -> None:
    """The review's N3, on one GPU: the sharded checkpoint's DTensor of a CPU row block keeps it on the CPU (and
    shares its memory) even though the mesh is a CUDA one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zenflow.checkpoints.sharded import host_resident_dtensor

    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        block = torch.arange(12.0).reshape(3, 4)
        sharded = host_resident_dtensor(block, init_device_mesh("cuda", (1,)), 3, 4)
        assert sharded.to_local().device.type == "cpu"
        assert sharded.to_local().data_ptr() == block.data_ptr()
    finally:
        dist.destroy_process_group()


class _SyncWatch(Callback):
    """Counts CUDA synchronisations (``set_sync_debug_mode("warn")``) between the start and the end of each training
    batch after the first ``skip`` (the first selection is a documented sync point)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.syncs: list[int] = []
        self._catcher = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step < self.skip:
            return
        import warnings

        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self._catcher is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(None, None, None)
        self.syncs.append(sum("synchroniz" in str(w.message) for w in self._records))
        self._catcher = None


class _QuietModule(TinyModule):
    """TinyModule without its per-step ``float(loss)`` (a host read of the loss: the test's own sync)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss


@cuda_only
def test_a_lightning_fit_makes_no_host_sync_per_step_on_cuda() -> None:
    """The review's N2: the telemetry's progress-bar value was a Python float, which Lightning turns into a device
    tensor with a blocking copy every step. Steady-state steps of a fit (no refresh, no progress bar reading the
    metrics) make no synchronising call at all, the engine's and the strategy's included."""
    watch = _SyncWatch(skip=2)
    strategy = ZenFlowStrategy(
        full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=1000
    )
    _cuda_fit(strategy, _QuietModule(), max_epochs=1, callbacks=[watch], enable_progress_bar=False)
    assert watch.syncs, "no step was watched"
    assert watch.syncs == [0] * len(watch.syncs), watch.syncs


def test_slow_worker_is_bitwise_equal_on_cuda() -> None:
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.2, update_interval=2)
    fast = _run(DEVICE, config, steps=9)
    slow = _run(DEVICE, config, steps=9, host_delay_s=0.2)
    _assert_bitwise(fast, slow)


@pytest.mark.parametrize("accumulate_on", MODES)
def test_cuda_resume_with_update_in_flight_is_exact(accumulate_on: str) -> None:
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.2, update_interval=2, accumulate_on=accumulate_on)
    grads = [{n: g.to(DEVICE) for n, g in step.items()} for step in _gradients(10)]
    reference = _model().to(DEVICE)
    with ZenFlowEngine(_optimizer(reference), config, param_names=_names(reference)) as engine:
        _train(engine, reference, grads, coupled=True)
        engine.flush()
    model = _model().to(DEVICE)
    with ZenFlowEngine(_optimizer(model), config, param_names=_names(model), host_delay_s=0.3) as first:
        _train(first, model, grads[:4], coupled=True)
        assert first.host_in_flight
        state = first.state_dict()
    resumed = copy.deepcopy(model)
    with ZenFlowEngine(_optimizer(resumed), config, param_names=_names(resumed)) as second:
        second.load_state_dict(state)
        _train(second, resumed, grads[4:], coupled=True)
        second.flush()
        second.wait_for_update()
    _synchronize(DEVICE)
    assert_weights_equal(weights(resumed), weights(reference))


@cuda_only
# ------------------------------------------------------------------------------ streams, pinning, host waits
@pytest.mark.parametrize("accumulate_on", MODES)
def test_streams_events_and_pinned_host_memory(accumulate_on: str) -> None:
    model = _model(torch.bfloat16).to(DEVICE)
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, accumulate_on=accumulate_on)
    with ZenFlowEngine(_optimizer(model), config, param_names=_names(model)) as engine:
        lanes = engine.lanes
        streams = [lanes.side.stream, lanes.d2h.stream, lanes.h2d.stream]
        assert all(isinstance(stream, torch.cuda.Stream) for stream in streams)
        handles = {stream.cuda_stream for stream in streams} | {torch.cuda.current_stream().cuda_stream}
        assert len(handles) == 4, "side, d2h and h2d are three streams apart from the compute stream"
        assert lanes.compute.stream == torch.cuda.current_stream()
        assert isinstance(engine.device_updater.update_done.cuda_event, torch.cuda.Event)
        # the accumulation (and its window rows) is chosen at the first step, once the gradients exist; a landing
        # allocates the buffer the steps go up through
        for _ in range(3):
            engine.wait_for_update()
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            assert engine.step().accumulate_on == accumulate_on
        engine.flush()
        for host in engine.host_buffers:
            # the window rows registered in place with cudaHostRegister: still shared with the worker, now also
            # pinned; the moments are never copied asynchronously and stay unpinned
            assert all(row.is_shared() and row.is_pinned() for row in host.windows)
            assert len(host.windows) == (2 if accumulate_on == "host" else 1)
            for moments in (host.exp_avg, host.exp_avg_sq):
                assert moments.is_shared()
                assert not moments.is_pinned()
        accumulation = engine.accumulation
        if accumulate_on == "host":
            assert all(t.is_pinned() for t in accumulation.ring_host)
            assert all(t.is_cuda for t in accumulation.ring_device)
        else:
            window = engine.host_format.window  # bf16 in the compact state, the default
            assert all(t.is_cuda and t.dtype == window for t in accumulation.acc_device.values())
        assert engine.uploads.ring_device is not None
        assert engine.uploads.ring_device.is_cuda
        assert all(t.is_pinned() for t in engine.window.kept_host)


@cuda_only
@pytest.mark.parametrize("accumulate_on", MODES)
def test_no_host_synchronisation_on_the_hot_path(accumulate_on: str) -> None:
    """Steps that are not refreshes, window ends included, make no synchronising CUDA call."""
    model = _model().to(DEVICE)
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=0.1,
        update_interval=2,
        select_strategy="step",
        select_interval=1000,
        accumulate_on=accumulate_on,
    )
    grads = [{n: g.to(DEVICE) for n, g in step.items()} for step in _gradients(7)]
    with ZenFlowEngine(_optimizer(model), config, param_names=_names(model)) as engine:
        _train(engine, model, grads[:1], coupled=True)  # the first selection is a documented sync point
        for step_grads in grads[1:]:
            engine.wait_for_update()
            for name, p in model.named_parameters():
                p.grad = step_grads[name] + 0.5 * p.detach()
            torch.cuda.set_sync_debug_mode("error")
            try:
                stats = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not stats.refreshed
            assert stats.host_syncs == 0
            engine.optimizer.zero_grad(set_to_none=True)
        engine.flush()


@cuda_only
def test_device_mode_steps_between_window_ends_never_wait_for_the_gpu() -> None:
    """The training thread, timed: with every step's side-stream work slowed by ``delay`` on the GPU, device-mode
    steps that are neither refreshes nor window ends return in a fraction of it. ``set_sync_debug_mode`` does not
    see event waits, queue waits or pipe waits; the clock does. (Host mode waits for a ring slot by design.)"""
    delay = 0.2
    model = _model().to(DEVICE)
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=0.25,
        update_interval=4,
        select_strategy="step",
        select_interval=1000,
        accumulate_on="device",
    )
    grads = [{n: g.to(DEVICE) for n, g in step.items()} for step in _gradients(8)]
    host_s: list[float] = []
    with ZenFlowEngine(_optimizer(model), config, param_names=_names(model), stage_delays={"side": delay}) as engine:
        stats = _train(engine, model, grads, coupled=False, host_times=host_s)
        engine.flush()
    free = [s for s, stat in zip(host_s, stats) if not stat.window_end and not stat.refreshed]
    assert len(free) == 5  # steps 2, 3, 5, 6, 7
    assert max(free) < delay / 4, f"host seconds per step: {[round(s, 4) for s in host_s]}"


@pytest.mark.parametrize("accumulate_on", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_bytes_follow_the_memory_model(accumulate_on: str, dtype: torch.dtype) -> None:
    """What the engine holds on the device after the first selection and a landing is, byte for byte, what
    ``engine/budget.py`` (the planner's model, docs/performance.md) says: the selected columns' state, the 1-D
    parameters' state, the accumulation's buffers (device mode: the bf16 window sum and its rounding's numbers; host
    mode: two staging slots), the landing's buffer on CUDA, the interim moves' statistics."""
    from lightning_zenflow.engine.budget import MatrixShape, VectorShape, device_bytes

    model = _model(dtype).to(DEVICE)
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, accumulate_on=accumulate_on)
    optimizer = _optimizer(model)
    with ZenFlowEngine(optimizer, config, param_names=_names(model)) as engine:
        for _ in range(5):
            engine.wait_for_update()
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            engine.step()
        engine.flush()
        held = engine.device_bytes()
        host_format, interim = engine.host_format, engine.interim is not None
    matrices, vectors = [], []
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.ndim >= 2:
                rows, cols = p.shape[0], p.numel() // p.shape[0]
                matrices.append(MatrixShape(rows, cols, rows, p.element_size(), group_index))
            else:
                vectors.append(VectorShape(p.numel(), p.element_size()))
    assert held == device_bytes(matrices, vectors, config, host_format, torch.device(DEVICE).type, interim)


# ------------------------------------------------------------------------------------------- Lightning on CUDA
def _cuda_fit(strategy: Any = "auto", module: TinyModule | None = None, **trainer_kwargs: Any):
    return fit(strategy, module, accelerator=DEVICE, **trainer_kwargs)


def test_lightning_fit_bf16_true_on_cuda(tmp_path: pathlib.Path) -> None:
    from lightning_zenflow.demo import ByteCorpusDataModule, CausalLMModule

    before = torch.cuda.memory_allocated() if not REHEARSAL else 0
    model = CausalLMModule(n_layer=2, n_embd=128, block_size=64, seed_model=0)
    data = ByteCorpusDataModule(block_size=64, batch_size=8, max_bytes=400_000, samples_per_epoch=400)
    trainer = lightning.Trainer(
        strategy="zenflow",
        accelerator=DEVICE,
        devices=1,
        precision="bf16-true",
        max_steps=40,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    assert trainer.callback_metrics["train_loss"] < 5.0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    checkpoint = torch.load(tmp_path / "final.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].dtype == torch.float32
    if REHEARSAL:
        return
    # the data module keeps the trainer (datamodule.trainer), the trainer the model: drop all three, collect cycles
    del trainer, model, data
    gc.collect()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per stream and handle in the caching allocator for good (torch's own leak checks
    # clear them before measuring); the first matmuls of this session happened in this fit
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() <= before + 1024 * 1024


def test_lightning_bf16_mixed_on_cuda() -> None:
    control, _ = _cuda_fit("auto", precision="bf16-mixed")
    everything_on_device, _ = _cuda_fit(ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=1.0), precision="bf16-mixed")
    assert_weights_close(weights(everything_on_device), weights(control))
    initial = weights(TinyModule())
    module, trainer = _cuda_fit(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2), precision="bf16-mixed"
    )
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    assert all(p.dtype == torch.float32 for p in module.parameters()), "bf16-mixed keeps fp32 weights"
    assert module.train_losses[-1] < module.train_losses[0]
    for name, value in weights(module).items():
        assert not torch.equal(value, initial[name]), f"{name} did not train"


class _InjectInf(Callback):
    """Makes one gradient inf at optimizer step ``at_step``; records per batch (step, weights unchanged, scale
    before, scale after)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.records: list[tuple[int, bool, float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        scaler = trainer.strategy.precision_plugin.scaler
        self._before = (weights(pl_module), scaler.get_scale())

    def on_after_backward(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        if trainer.global_step == self.at_step:
            pl_module.net[0].weight.grad[0, 0] = math.inf

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        before_weights, before_scale = self._before
        after = weights(pl_module)
        unchanged = all(torch.equal(after[name], before_weights[name]) for name in after)
        scale = trainer.strategy.precision_plugin.scaler.get_scale()
        self.records.append((trainer.global_step, unchanged, before_scale, scale))


def test_lightning_16_mixed_skips_a_step_with_inf_gradients_on_cuda() -> None:
    inject = _InjectInf(at_step=3)
    plugin = ZenFlowPrecision("16-mixed", device=DEVICE)
    # every matrix on the host, synchronously: a step that ran changes the weights before the batch ends
    strategy = ZenFlowStrategy(
        full_warm_up_rounds=0, topk_ratio=0.25, update_interval=1, overlap_step=False, precision_plugin=plugin
    )
    module, _ = _cuda_fit(strategy, max_epochs=1, callbacks=[inject])
    assert len(inject.records) == 8
    for global_step, unchanged, scale_before, scale_after in inject.records:
        if global_step == inject.at_step + 1:  # Lightning counts the skipped step too
            assert unchanged, "a step with inf gradients must leave every weight as it was"
            assert scale_after == scale_before / 2
        else:
            assert not unchanged, f"step {global_step} changed no weight"
            assert scale_after == scale_before
    assert all(torch.isfinite(value).all() for value in weights(module).values())


class _RecordEngineSteps(Callback):
    def __init__(self) -> None:
        self.engine_t: int | None = None

    def on_train_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.engine_t = trainer.strategy.engine.t


def test_lightning_accumulate_grad_batches_on_cuda() -> None:
    # 7 batches per epoch with accumulate_grad_batches=2: Lightning also steps on the odd last batch of each epoch
    control, control_trainer = _cuda_fit("auto", TinyModule(samples=28), accumulate_grad_batches=2)
    on_device, _ = _cuda_fit(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=1.0), TinyModule(samples=28), accumulate_grad_batches=2
    )
    assert_weights_close(weights(on_device), weights(control))
    steps = _RecordEngineSteps()
    _, trainer = _cuda_fit(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2),
        TinyModule(samples=28),
        accumulate_grad_batches=2,
        callbacks=[steps],
    )
    assert trainer.global_step == control_trainer.global_step == 8
    assert steps.engine_t == trainer.global_step


class _ProbeValidationStart(Callback):
    """At each validation start: is host work in flight, and do the weights equal the engine's fp32 masters?"""

    def __init__(self) -> None:
        self.in_flight: list[bool] = []
        self.weights_current: list[bool] = []

    def on_validation_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        engine = trainer.strategy.engine
        self.in_flight.append(engine.host_in_flight)
        masters = engine.state_dict(include_moments=False)["params"]
        self.weights_current.append(
            all(torch.equal(p.detach().cpu(), masters[name]["master"]) for name, p in pl_module.named_parameters())
        )


def test_lightning_validation_sees_every_finished_host_update_on_cuda() -> None:
    probe = _ProbeValidationStart()
    _, trainer = _cuda_fit(
        ZenFlowStrategy(
            full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, overlap_step=True, sync_on=["validation"]
        ),
        limit_val_batches=2,
        val_check_interval=3,
        num_sanity_val_steps=1,
        callbacks=[probe],
    )
    assert len(probe.in_flight) == 5  # the sanity check, then every 3 training batches in each of the 2 epochs
    assert probe.in_flight == [False] * 5
    assert probe.weights_current == [True] * 5
    assert "val_loss" in trainer.callback_metrics


MID_WINDOW: dict[str, Any] = {
    "topk_ratio": 0.25,
    "update_interval": 4,
    "sync_on": (),
    "select_strategy": "step",
    "select_interval": 100,
}
"""5 steps per epoch (20 samples), windows of 4: the epoch-2 checkpoint (step 10) is 2 steps into a window, with a
computed host update not yet applied."""


def _checkpointed_fit(
    knobs: dict[str, Any], directory: pathlib.Path, ckpt_path: pathlib.Path | None = None
) -> tuple[TinyModule, list[pathlib.Path]]:
    """A 4-epoch fit on CUDA that saves a checkpoint at every epoch end."""
    module = TinyModule(samples=20)
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)
    trainer = make_trainer(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **knobs}),
        root_dir=directory,
        accelerator=DEVICE,
        max_epochs=4,
        enable_checkpointing=True,
        callbacks=[checkpoint],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, sorted(directory.glob("*.ckpt"))


def test_lightning_checkpoints_sync_and_resume_exactly_on_cuda(tmp_path: pathlib.Path) -> None:
    # with the checkpoint boundary (sync_on opted in): the saved weights hold every finished update
    synced, synced_checkpoints = _checkpointed_fit(
        {"topk_ratio": 0.25, "update_interval": 2, "sync_on": ("checkpoint",)}, tmp_path / "synced"
    )
    saved = torch.load(synced_checkpoints[1], map_location="cpu", weights_only=True)
    for name, entry in saved["zenflow"]["params"].items():
        assert torch.equal(saved["state_dict"][name], entry["master"]), name
    # without it, mid-window with host work computed but not applied: a resume is still bitwise the full run
    uninterrupted, checkpoints = _checkpointed_fit(MID_WINDOW, tmp_path / "a")
    progress = torch.load(checkpoints[1], map_location="cpu", weights_only=True)["zenflow"]["progress"]
    assert progress["steps_in_window"] == 2, "the checkpoint must fall inside a window"
    assert progress["pending"] is not None, "a computed host update must be waiting to be applied"
    resumed, _ = _checkpointed_fit(MID_WINDOW, tmp_path / "b", ckpt_path=checkpoints[1])
    assert_weights_equal(weights(resumed), weights(uninterrupted))
    assert not torch.equal(weights(synced)["net.0.weight"], weights(TinyModule(samples=20))["net.0.weight"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_equal_one_gpu_with_the_doubled_batch(tmp_path: pathlib.Path) -> None:
    """Data parallel on NCCL: 2 GPUs with batch 4 follow 1 GPU with batch 8; the replicas are identical."""
    from test_lightning_ddp import KNOBS, results, run_script

    runs = {}
    for devices, batch_size in ((2, 4), (1, 8)):
        out = tmp_path / f"gpus{devices}"
        done = run_script(out, accelerator="gpu", devices=devices, strategy=KNOBS, batch_size=batch_size)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[devices] = results(out, devices)
    assert runs[2][0]["strategy"] == "ZenFlowDDPStrategy"
    assert_weights_equal(runs[2][1]["weights"], runs[2][0]["weights"])
    assert_weights_close(runs[2][0]["weights"], runs[1][0]["weights"], atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_fsdp2_equal_model_parallel_adamw_and_one_gpu(tmp_path: pathlib.Path) -> None:
    """FSDP2 on NCCL: ``zenflow_fsdp`` at exact settings follows Lightning's ModelParallelStrategy with AdamW, and at
    the test knobs one ``ZenFlowStrategy`` GPU on the same global batch (selection is global)."""
    from test_lightning_ddp import results, run_script
    from test_lightning_fsdp import GLOBAL_BATCH, KNOBS

    def fit(name: str, devices: int, **options: object) -> list[dict]:
        out = tmp_path / name
        options = {"accelerator": "gpu", "devices": devices, "samples": 48, **options}
        done = run_script(out, batch_size=GLOBAL_BATCH // devices, **options)
        assert done.returncode == 0, done.stderr[-3000:]
        return results(out, devices)

    exact = fit("exact", 2, fsdp=True, strategy={"topk_ratio": 1.0})
    adamw = fit("adamw", 2, fsdp=True, strategy="adamw")
    assert [r["strategy"] for r in exact] == ["ZenFlowFSDPStrategy"] * 2
    assert_weights_close(exact[0]["weights"], adamw[0]["weights"], atol=1e-5, rtol=0.0)
    two = fit("two", 2, fsdp=True, strategy=KNOBS)
    one = fit("one", 1, wide=True, strategy={**KNOBS, "interim_step": 0})
    assert one[0]["strategy"] == "ZenFlowStrategy"
    assert_weights_equal(two[1]["weights"], two[0]["weights"])
    assert_weights_close(two[0]["weights"], one[0]["weights"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("devices", "shard_size"),
    [
        pytest.param(2, 1, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")),
        pytest.param(4, 2, marks=pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")),
    ],
    ids=["two_gpus", "four_gpus"],
)
def test_hsdp_on_gpus_equals_fsdp2_and_one_gpu(tmp_path: pathlib.Path, devices: int, shard_size: int) -> None:
    """HSDP on NCCL (one machine: ``shard_size`` ranks shard, the groups replicate): equal to FSDP2 over every GPU and
    to one ``ZenFlowStrategy`` GPU on the same global batch, the replicas' weights equal."""
    from test_lightning_ddp import results, run_script
    from test_lightning_fsdp import GLOBAL_BATCH, KNOBS

    def fit(name: str, count: int, **options: object) -> list[dict]:
        out = tmp_path / name
        options = {"accelerator": "gpu", "devices": count, "samples": 48, **options}
        done = run_script(out, batch_size=GLOBAL_BATCH // count, **options)
        assert done.returncode == 0, done.stderr[-3000:]
        return results(out, count)

    knobs = {**KNOBS, "interim_step": 0}  # as the FSDP2 test above: one GPU's wide model runs without the moves
    hsdp = fit("hsdp", devices, fsdp=True, strategy={**knobs, "shard_size": shard_size})
    fsdp = fit("fsdp", devices, fsdp=True, strategy=knobs)
    one = fit("one", 1, wide=True, strategy=knobs)
    assert_weights_equal(hsdp[-1]["weights"], hsdp[0]["weights"])
    assert_weights_close(hsdp[0]["weights"], fsdp[0]["weights"], atol=1e-5, rtol=1e-4)
    assert_weights_close(hsdp[0]["weights"], one[0]["weights"], atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_llm_sharded_load_and_export_equal_one_process(tmp_path: pathlib.Path) -> None:
    """The LLM recipe's sharded loading onto two GPUs (NCCL): each rank's rows read from the files straight into its
    CUDA shard, the gathered weights bitwise ``from_pretrained``'s; the export, a tensor at a time, is the one
    ``save_pretrained`` writes."""
    pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")
    from llm_helpers import save_tiny_llama
    from test_llm_sharded_load import ONE_FILE, assert_loaded_as_from_pretrained, launch, tensors_of
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_llama(tmp_path / "model")
    ranks = launch(tmp_path / "ranks", model_dir, world=2, device="cuda", export_limits=[ONE_FILE])
    assert_loaded_as_from_pretrained(ranks, model_dir)
    for dtype_name in ("float32", "bfloat16"):
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
        exported = tensors_of(tmp_path / "ranks" / f"export-{dtype_name}-{ONE_FILE}")
        for name, tensor in reference.state_dict().items():
            if name != "lm_head.weight":  # tied: written once, under the embeddings' name
                assert torch.equal(exported[name], tensor), f"{dtype_name} {name}"
