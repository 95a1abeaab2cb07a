"""``engine/budget.py``: the bytes an engine holds, from the shapes alone, equal what a running engine counts
(``engine.device_bytes()``, ``engine.host_bytes()``) byte for byte, and what it counts is what the process holds:
the shared memory its host rows take in ``/dev/shm``."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from memory_probe import assert_holds_what_it_counts, probe, shared_rows, shared_segments
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.budget import MatrixShape, VectorShape, device_bytes, host_bytes

pytestmark = pytest.mark.usefixtures("no_leaked_children")


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 6)).to(dtype)


def _shapes(model: nn.Module, groups: list[list[nn.Parameter]]) -> tuple[list[MatrixShape], list[VectorShape]]:
    matrices, vectors = [], []
    for group_index, params in enumerate(groups):
        for param in params:
            if param.ndim >= 2:
                rows, cols = param.shape[0], param.numel() // param.shape[0]
                matrices.append(MatrixShape(rows, cols, rows, param.element_size(), group_index))
            else:
                vectors.append(VectorShape(param.numel(), param.element_size()))
    return matrices, vectors


SETTINGS = [
    ({}, torch.float32),
    ({}, torch.bfloat16),
    ({"host_state": "fp32"}, torch.float32),
    ({"host_state": "fp32", "interim_step": 0}, torch.bfloat16),  # the exact state keeps bf16 weights' masters
    ({"accumulate_on": "host"}, torch.bfloat16),
    ({"topk_ratio": 0.3, "update_interval": 2}, torch.float32),
]


@pytest.mark.parametrize(("knobs", "dtype"), SETTINGS, ids=lambda v: str(v))
def test_the_budget_equals_what_a_running_engine_holds(knobs: dict, dtype: torch.dtype) -> None:
    model = _model(dtype)
    matrices_params = [p for p in model.parameters() if p.ndim >= 2]
    vectors_params = [p for p in model.parameters() if p.ndim < 2]
    groups = [matrices_params, vectors_params]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=1e-3, weight_decay=0.1)
    config = ZenFlowConfig(**{"full_warm_up_rounds": 1, "update_interval": 3, **knobs})
    generator = torch.Generator().manual_seed(1)
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in model.named_parameters()}) as engine:
        for _ in range(7):  # the warm-up, the first selection, windows, a landing
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(dtype)
            engine.step()
        host_format = engine.host_format
        matrices, vectors = _shapes(model, groups)
        interim = engine.interim is not None
        assert engine.host_bytes() == host_bytes(matrices, config, host_format, groups=2)
        assert engine.device_bytes() == device_bytes(matrices, vectors, config, host_format, "cpu", interim)
        # the shared rows are what the process holds in /dev/shm: each a segment of its own bytes (whole pages)
        page = os.sysconf("SC_PAGE_SIZE")
        rows = shared_rows(engine)
        assert all(row.is_shared() for row in rows)
        segments = {row.untyped_storage().data_ptr(): row.untyped_storage().nbytes() for row in rows}
        assert sum(segments.values()) == sum(row.nbytes for row in rows)  # a row is its whole segment
        assert sum(-(-n // page) * page for n in segments.values()) >= sum(segments.values())


def test_bytes_per_parameter_of_the_default_and_the_exact_state() -> None:
    """The headline numbers (docs/performance.md), for a large bf16 matrix on CUDA: the default holds 6 B per
    parameter on the host and 16 rho + 2 B on the device (plus O(rows + columns) and the 64 MiB landing buffer);
    the exact state 12 and 16 rho + 4 (fp32 weights need no master)."""
    rows, cols = 8192, 8192
    matrix = [MatrixShape(rows, cols, rows, 2)]
    params = rows * cols
    for host_state, host_expected, window_device in (("bf16", 6, 2), ("fp32", 16, 4)):
        config = ZenFlowConfig(host_state=host_state, interim_step=0)
        master = host_state == "fp32"  # bf16 weights: the exact state keeps their masters
        from lightning_zenflow.engine.layout import HostFormat

        host_format = HostFormat.resolve(host_state, master=master, accumulate_on="device")
        host = host_bytes(matrix, config, host_format)
        assert host == host_expected * params + 4 + 8 * cols
        device = device_bytes(matrix, [], config, host_format, "cuda", interim=False)
        selected = 16 * rows * 820  # k = ceil(0.1 * 8192)
        small = 8 * cols + (4 * (rows + cols) if host_state == "bf16" else 0)
        landing = 0 if master else 64 * 1024 * 1024
        assert device == selected + window_device * params + small + landing
        assert (device - landing - small) / params == pytest.approx(16 * 0.1 + window_device, abs=0.002)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps to see shared mappings")
@pytest.mark.parametrize("host_state", ["bf16", "fp32"])
def test_the_shared_memory_the_process_maps_is_what_the_engine_counts(host_state: str) -> None:
    """A 2048 x 2048 bf16 matrix: the segments of /dev/shm this process maps for the engine (its own, read from
    /proc/self/maps, whatever else uses /dev/shm meanwhile) add up to the engine's count of its shared host bytes,
    each rounded up to whole pages (6 B per element in the compact state, 16 in the exact one with a master for the
    bf16 weights), the host worker holds them resident once it has run an update, and they are unmapped at close.
    The data-parallel and FSDP2 fits check the same per rank (test_lightning_ddp.py, test_lightning_fsdp.py)."""
    weight = nn.Parameter(torch.randn(2048, 2048).to(torch.bfloat16))
    opt = torch.optim.AdamW([weight], lr=1e-3)
    config = ZenFlowConfig(full_warm_up_rounds=0, host_state=host_state, interim_step=0)
    before = set(shared_segments())
    engine = ZenFlowEngine(opt, config, param_names={weight: "weight"}).start()
    try:
        for _ in range(8):  # two windows: the first window's update reads and writes every host row
            weight.grad = torch.randn_like(weight)
            engine.step()
        engine.wait_for_update()
        held = probe(engine, before)
        assert held["counted_host"] / weight.numel() == pytest.approx(6 if host_state == "bf16" else 16, abs=0.01)
        assert_holds_what_it_counts(held)
    finally:
        engine.close()
    gc.collect()
    assert not set(shared_segments()) - before, "a shared segment is still mapped after close()"
