"""Engine phases show in the PyTorch profiler as ``zenflow.*`` ranges, and StepStats carries the telemetry."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_engine_phases_are_profiler_ranges_and_stats_are_filled(accumulate_on: str) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, overlap_step=False, accumulate_on=accumulate_on
    )
    with ZenFlowEngine(optimizer, config, param_names={p: n for n, p in layer.named_parameters()}) as engine:
        with profile() as prof:
            stats = []
            for _ in range(4):
                layer(torch.randn(4, 16)).square().sum().backward()
                stats.append(engine.step())
                layer.zero_grad(set_to_none=True)
        names = {event.key for event in prof.key_averages()}
    for phase in ("zenflow.select", "zenflow.device_update", "zenflow.accumulate", "zenflow.wait:land_pending"):
        assert phase in names, f"{phase} missing from the profile"
    assert [s.step for s in stats] == [1, 2, 3, 4]
    assert [s.window_end for s in stats] == [False, True, False, True]
    assert stats[0].refreshed
    assert stats[0].selection_captured is not None
    assert all(s.update_interval == 2 for s in stats)
    if accumulate_on == "host":
        # every step sends the unselected columns down: the weight is [8, 16], 12 of its 16 columns, fp32
        assert all(s.d2h_bytes == 8 * 12 * 4 for s in stats)
    else:
        # the bf16 accumulator (the compact state) goes down once per window, whole rows
        assert [s.d2h_bytes for s in stats] == [0, 8 * 16 * 2, 0, 8 * 16 * 2]
    # window ends upload the matrix's step (all 16 columns: bf16 in device mode, fp32 in host mode) once
    assert [s.h2d_bytes for s in stats][1] >= 8 * 16 * (2 if accumulate_on == "device" else 4)
    assert all(s.accumulate_on == accumulate_on for s in stats)
    assert stats[1].host_update_s is not None
    assert stats[1].host_update_s > 0
    assert all(s.device_update_s is not None and s.device_update_s > 0 for s in stats)
    assert all(s.host_bytes >= 6 * 8 * 16 for s in stats)
