"""The two accumulation modes, the delayed asynchronous stages, the refresh and the worker's own entry point.

``accumulate_on="device"`` and ``"host"`` must give bitwise the same numbers (only speed and memory differ),
whatever the speed of each asynchronous stage; a refresh moves only the columns that change side.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine import lanes as lanes_module
from lightning_zenflow.engine.host import GroupJob, MatrixExtent, unpack_accumulators

pytestmark = pytest.mark.usefixtures("no_leaked_children")  # every engine's host worker is joined

DELAYS = {"side": 0.01, "d2h": 0.01, "h2d": 0.01, "helper": 0.01, "worker": 0.05}


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 5)).to(dtype)


def _run(
    accumulate_on: str,
    dtype: torch.dtype = torch.float32,
    delays: dict | None = None,
    steps: int = 11,
    **knobs: object,
) -> tuple[list[dict], dict, list]:
    """A weight-dependent loss (every gradient depends on what the engine left in the model), a warm-up step,
    a refresh, a sync boundary, an uneven learning rate and a partial window closed by flush()."""
    model = _net(dtype)
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[3].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, model[2].weight, model[2].bias, model[3].bias], "lr": 3e-3},
        ],
        lr=1e-2,
    )
    config = ZenFlowConfig(
        **{
            "topk_ratio": 0.25,
            "update_interval": 2,
            "full_warm_up_rounds": 1,
            "select_strategy": "step",
            "select_interval": 4,
            "accumulate_on": accumulate_on,
            **knobs,
        }
    )
    generator = torch.Generator().manual_seed(1)
    history, stats = [], []
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, config, param_names=names, stage_delays=delays) as engine:
        for t in range(1, steps + 1):
            engine.wait_for_update()
            x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            loss.backward()
            for group in opt.param_groups:
                group["lr"] *= 0.9
            stats.append(engine.step())
            opt.zero_grad()
            if t == 6:
                engine.sync()
            history.append(copy.deepcopy(model.state_dict()))
        engine.flush()
        history.append(copy.deepcopy(model.state_dict()))
        state = engine.state_dict()["params"]
    return history, state, stats


def _assert_same(first: tuple, second: tuple) -> None:
    first_history, first_state, _ = first
    second_history, second_state, _ = second
    for step, (a, b) in enumerate(zip(first_history, second_history), start=1):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name} after step {step}"
    for name, entry in first_state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], second_state[name][key]), f"{key} of {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap_step", [True, False])
def test_device_and_host_accumulation_are_bitwise_equal(dtype, overlap_step):
    """In the exact state both modes sum in fp32 in the same order (the compact state rounds the device's sum)."""
    device = _run("device", dtype, overlap_step=overlap_step, host_state="fp32")
    host = _run("host", dtype, overlap_step=overlap_step, host_state="fp32")
    assert {s.accumulate_on for s in device[2]} == {"device"}
    assert {s.accumulate_on for s in host[2]} == {"host"}
    _assert_same(device, host)
    # the run trained, on both sides of every matrix
    first, last = device[0][0], device[0][-1]
    assert not torch.equal(first["0.weight"], last["0.weight"])
    selected = device[1]["0.weight"]["selected"]
    assert 0 < selected.numel() < 6


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_delayed_asynchronous_stages_change_nothing_bitwise(accumulate_on):
    undelayed = _run(accumulate_on)
    delayed = _run(accumulate_on, delays=DELAYS)
    _assert_same(undelayed, delayed)
    # the delays were real: every host update the delayed run timed took at least the worker's delay (a count, not a
    # comparison of two runs' timings, which a loaded machine can turn around)
    host_seconds = [s.host_update_s for s in delayed[2] if s.host_update_s is not None]
    assert host_seconds
    assert min(host_seconds) >= DELAYS["worker"]


def test_unknown_stage_to_delay_is_refused():
    layer = nn.Linear(4, 3)
    engine = ZenFlowEngine(
        torch.optim.AdamW(layer.parameters()), ZenFlowConfig(full_warm_up_rounds=0), stage_delays={"gpu": 1.0}
    )
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['gpu'\]"):
        engine.start()


def test_link_bytes_per_mode_follow_the_cost_model():
    """Device mode (compact state): the bf16 accumulator down and the bf16 step up once per window. Host mode: the
    unselected columns down every step (model dtype), the fp32 step up once per window."""
    torch.manual_seed(0)
    results = {}
    for mode in ("device", "host"):
        weight = nn.Parameter(torch.randn(8, 20, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([weight], lr=1e-3)
        config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.1, update_interval=4, accumulate_on=mode)
        with ZenFlowEngine(opt, config) as engine:
            stats = []
            for _ in range(12):
                weight.grad = torch.randn_like(weight)
                stats.append(engine.step())
            engine.flush()
        results[mode] = stats
    # k = 2 of 20 columns; the first step's selection moves 2 columns x 8 rows x 2 bf16 moments up (the master
    # comes from the weights, on the device)
    refresh_up = 2 * 8 * 2 * 2
    device_down = [s.d2h_bytes for s in results["device"]]
    assert device_down == [0, 0, 0, 8 * 20 * 2] * 3
    host_down = [s.d2h_bytes for s in results["host"]]
    assert host_down == [8 * 18 * 2] * 12
    for mode, step_bytes in (("device", 2), ("host", 4)):
        up = [s.h2d_bytes for s in results[mode]]
        assert up[0] == refresh_up
        # windows close at 4, 8, 12; with overlap each lands a window later: 8 and 12 upload 8 x 20 steps
        assert sum(up[1:]) == 2 * 8 * 20 * step_bytes


@pytest.mark.parametrize("host_state", ["bf16", "fp32"])
def test_refresh_moves_only_the_columns_that_change_side(host_state):
    layer = nn.Linear(10, 3, bias=False)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=0.3,
        update_interval=2,
        select_strategy="step",
        select_interval=2,
        host_state=host_state,
    )

    def gradient(hot: tuple[int, ...]) -> torch.Tensor:
        grad = torch.full((3, 10), 0.01)
        grad[:, list(hot)] = 0.1
        return grad

    with ZenFlowEngine(opt, config) as engine:
        stats = []
        for hot in [(1, 4, 7)] * 4 + [(1, 4, 8)] * 2 + [(0, 2, 9)] * 2:
            layer.weight.grad = gradient(hot)
            stats.append(engine.step())
    refreshes = [s for s in stats if s.refreshed]
    assert [s.step for s in refreshes] == [1, 4, 6, 8]
    # one column: 3 rows x (exp_avg, exp_avg_sq) in the host's dtype; the fp32 weights are the masters (none moves)
    itemsize = 2 if host_state == "bf16" else 4
    column_moves = 3 * 2 * itemsize
    accumulator_down = 3 * 10 * itemsize  # device mode: the window's accumulator goes down at each window end
    # the same columns again at step 4: nothing moves; 7 -> 8 at step 6: one column each way; all three at step 8
    migrated_down = {s.step: s.d2h_bytes - accumulator_down for s in refreshes[1:]}
    assert migrated_down == {4: 0, 6: column_moves, 8: 3 * column_moves}


def test_a_migration_in_chunks_changes_no_value(monkeypatch):
    """Selections move the matrices chunk by chunk (engine/migrate.py, a bounded device transient): with chunks of one
    selected element every matrix goes alone, and the weights equal those of one chunk per selection bit for bit."""
    from lightning_zenflow.engine import migrate as migrate_module

    original = migrate_module._migrate_group

    def run(limit: int) -> tuple[list[torch.Tensor], list[int]]:
        chunks = []

        def spy(lanes, updater, host, plans, ranks, moved):
            chunks.append(len(plans))
            return original(lanes, updater, host, plans, ranks, moved)

        monkeypatch.setattr(migrate_module, "MIGRATION_CHUNK_ELEMENTS", limit)
        monkeypatch.setattr(migrate_module, "_migrate_group", spy)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = ZenFlowConfig(
            full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=3
        )
        with ZenFlowEngine(opt, config) as engine:
            for _ in range(10):
                model.zero_grad()
                model(torch.randn(4, 16)).pow(2).sum().backward()
                engine.step()
            engine.flush()
        return [p.detach().clone() for p in model.parameters()], chunks

    whole, whole_chunks = run(1 << 30)
    alone, alone_chunks = run(1)
    assert whole_chunks
    assert set(whole_chunks) == {2}
    assert set(alone_chunks) == {1}
    assert len(alone_chunks) == 2 * len(whole_chunks)
    for a, b in zip(whole, alone, strict=True):
        assert torch.equal(a, b)


def test_migration_chunks_bound_the_selected_elements_of_each_chunk():
    from lightning_zenflow.engine.migrate import migration_chunks, peak_chunk_elements

    assert migration_chunks([5, 5, 5, 20, 1, 1], 10) == [[0, 1], [2], [3], [4, 5]]
    assert peak_chunk_elements([5, 5, 5, 20, 1, 1], 10) == 20  # a matrix larger than the limit goes alone
    assert peak_chunk_elements([5, 5, 5], 100) == 15
    assert migration_chunks([], 10) == []
    assert peak_chunk_elements([], 10) == 0


def test_auto_takes_the_device_when_it_fits_and_the_host_when_not(monkeypatch):
    from lightning_zenflow.engine import lanes

    def run(free_bytes: int) -> ZenFlowEngine:
        layer = nn.Linear(32, 16)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        monkeypatch.setattr(lanes.Lanes, "free_bytes", lambda self: free_bytes)
        with ZenFlowEngine(opt, ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25)) as engine:
            layer(torch.randn(2, 32)).sum().backward()
            engine.step()
            return engine.accumulate_on, engine.accumulate_on_reason

    # fp32 accumulator + upload buffer, 8 B per element; the selected columns (k = 8 of 32): their state and gather
    # buffer (16 B) and a migration's peak (24 B) per selected element, and 8 B of indices per column
    need = 16 * 32 * (4 + 4) + (16 + 24) * 16 * 8 + 8 * 32
    assert run(10 * need) == (
        "device",
        f"accumulate_on='auto' chose 'device': the device buffers need "
        f"{need / 2**20:.1f} MiB, {10 * need / 2**20:.1f} MiB free",
    )
    mode, reason = run(need)  # fits, but not with the 25 % margin
    assert mode == "host"
    assert "chose 'host'" in reason


def test_unpack_turns_packed_accumulators_into_whole_rows_in_place():
    torch.manual_seed(0)
    rows_a, cols_a, rows_b, cols_b = 5, 7, 3, 4
    grad_a, grad_b = torch.randn(rows_a, cols_a), torch.randn(rows_b, cols_b)
    host_a, host_b = torch.tensor([0, 2, 3, 6]), torch.tensor([0, 1, 2, 3])  # b: every column host-bound
    row = torch.full((rows_a * cols_a + rows_b * cols_b,), float("nan"))
    row[: rows_a * 4] = grad_a[:, host_a].reshape(-1)
    row[rows_a * cols_a :] = grad_b.reshape(-1)
    unselected = torch.cat([host_a, torch.zeros(3, dtype=torch.long), host_b])
    extents = [
        MatrixExtent(0, rows_a * cols_a, torch.float32, cols_a, 0),
        MatrixExtent(rows_a * cols_a, rows_b * cols_b, torch.float32, cols_b, cols_a),
    ]
    job = GroupJob(hparams=None, active=(0, 1), mean_divisors=(1.0, 1.0), packed_columns=(4, 4))
    # a scratch of two rows: several row blocks, moved last to first
    unpack_accumulators(row, extents, job, unselected, torch.empty(2 * cols_a))
    expected_a = torch.zeros(rows_a, cols_a)
    expected_a[:, host_a] = grad_a[:, host_a]
    assert torch.equal(row[: rows_a * cols_a].view(rows_a, cols_a), expected_a)
    assert torch.equal(row[rows_a * cols_a :].view(rows_b, cols_b), grad_b)


SCRIPT_WITHOUT_MAIN_GUARD = """
import pathlib, sys, torch
from lightning_zenflow import ZenFlowConfig, ZenFlowEngine

marker = pathlib.Path(sys.argv[1])
marker.write_text(marker.read_text() + "top level ran\\n" if marker.exists() else "top level ran\\n")
layer = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=1, overlap_step=False)
with ZenFlowEngine(opt, config) as engine:
    for _ in range(3):
        layer(torch.randn(2, 8)).sum().backward()
        engine.step()
        layer.zero_grad()
print("trained", engine.last_stats.step)
"""


def test_a_script_without_a_main_guard_trains_and_runs_once(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(SCRIPT_WITHOUT_MAIN_GUARD))
    marker = tmp_path / "marker.txt"
    result = subprocess.run(
        [sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained 3" in result.stdout
    assert marker.read_text() == "top level ran\n", "the worker must not re-run the user's script"


def test_python_dash_c_trains(tmp_path):
    code = SCRIPT_WITHOUT_MAIN_GUARD.replace("sys.argv[1]", repr(str(tmp_path / "marker.txt")))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained 3" in result.stdout


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_an_overflowed_step_is_skipped_on_the_device_without_a_host_read(accumulate_on):
    """16-mixed: ``step(found_inf=...)`` with the flag set leaves device state and counts alone, and the host
    update of the window is AdamW on the mean of the other gradients (every matrix on the host: rho = 0)."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    initial = {name: p.detach().clone() for name, p in layer.named_parameters()}
    grads = [{name: torch.randn_like(p) for name, p in layer.named_parameters()} for _ in range(4)]
    grads[1] = {name: torch.full_like(p, float("nan")) for name, p in layer.named_parameters()}
    flags = [0.0, 1.0, 0.0, 0.0]
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=0.0,
        update_interval=4,
        overlap_step=False,
        accumulate_on=accumulate_on,
        interim_step=0,  # the paper's rule: one host step per window (the interim moves: the next test)
        host_state="fp32",  # compared with torch's AdamW to float rounding
    )
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in layer.named_parameters()}) as engine:
        for step_grads, flag in zip(grads, flags):
            for name, param in layer.named_parameters():
                param.grad = step_grads[name].clone()
            engine.step(found_inf=torch.tensor(flag))
        saved = engine.state_dict()["params"]
    kept = [g for g, flag in zip(grads, flags) if not flag]
    # the weight: one host AdamW step on the mean of the three kept gradients
    weight = nn.Parameter(initial["weight"].clone())
    weight.grad = sum(g["weight"] for g in kept) / 3
    torch.optim.AdamW([weight], lr=1e-2, weight_decay=0.1).step()
    # the bias (device-only): three device AdamW steps, the overflowed one skipped
    bias = nn.Parameter(initial["bias"].clone())
    bias_opt = torch.optim.AdamW([bias], lr=1e-2, weight_decay=0.1)
    for g in kept:
        bias.grad = g["bias"].clone()
        bias_opt.step()
    torch.testing.assert_close(layer.weight.detach(), weight.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.bias.detach(), bias.detach(), atol=1e-6, rtol=1e-5)
    assert (saved["weight"]["host_step"], saved["bias"]["device_step"]) == (1, 3)
    assert all(torch.isfinite(entry["exp_avg_sq"]).all() for entry in saved.values())


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_an_overflowed_step_makes_no_interim_move(accumulate_on):
    """With ``interim_step``, an overflowed step moves no host column and leaves the moves' statistics alone (the
    third step opens a window, where the statistics would take its gradient)."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, interim_step=1.0, accumulate_on=accumulate_on
    )
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in layer.named_parameters()}) as engine:
        for flag in (0.0, 0.0, 1.0):
            for param in layer.parameters():
                param.grad = torch.randn_like(param) if not flag else torch.full_like(param, float("nan"))
            before = layer.weight.detach().clone()
            stats_before = engine.interim.state_of("weight")
            engine.step(found_inf=torch.tensor(flag))
            engine.wait_for_update()
            moved = not torch.equal(layer.weight.detach(), before)
            assert moved == (not flag), f"flag {flag}"
        after = engine.interim.state_of("weight")
        for key, value in stats_before.items():
            assert torch.equal(after[key], value), key
        assert float(after["interim_moves"]) == 2.0  # step 1 had no statistics before its own: both steps moved
        assert float(after["interim_decay"]) == pytest.approx(0.999**2)  # one window's statistics
        assert torch.isfinite(layer.weight).all()


def test_a_window_whose_every_gradient_overflowed_changes_nothing():
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    initial = {name: p.detach().clone() for name, p in layer.named_parameters()}
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, overlap_step=False)
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in layer.named_parameters()}) as engine:
        for _ in range(2):
            for param in layer.parameters():
                param.grad = torch.full_like(param, float("inf"))
            engine.step(found_inf=torch.tensor(1.0))
        saved = engine.state_dict()["params"]
    for name, param in layer.named_parameters():
        assert torch.equal(param.detach(), initial[name]), name
    assert (saved["weight"]["host_step"], saved["weight"]["device_step"], saved["bias"]["device_step"]) == (0, 0, 0)


def _resume_run(
    mode: str, steps: range, model: nn.Module, state: dict | None, snapshot_at: int | None, host_state: str = "bf16"
):
    """Train ``model`` (bf16) over ``steps`` with a fresh engine (restored from ``state`` if given); returns the
    weights after each step, the state taken at ``snapshot_at`` (with a model copy) and the final weights."""
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[3].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, model[2].weight, model[2].bias, model[3].bias], "lr": 3e-3},
        ],
        lr=1e-2,
    )
    config = ZenFlowConfig(
        topk_ratio=0.25,
        update_interval=3,
        full_warm_up_rounds=1,
        select_strategy="step",
        select_interval=6,
        accumulate_on=mode,
        host_state=host_state,
    )
    history, snapshot = {}, None
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, config, param_names=names, host_delay_s=0.05) as engine:
        if state is not None:
            engine.load_state_dict(state)
        for t in steps:
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (1.0 + 0.1 * t)
            generator = torch.Generator().manual_seed(t)
            x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)
            engine.wait_for_update()
            nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
            engine.step()
            opt.zero_grad()
            history[t] = copy.deepcopy(model.state_dict())
            if t == snapshot_at:
                snapshot = (copy.deepcopy(engine.state_dict()), copy.deepcopy(model))
        engine.flush()
        history["final"] = copy.deepcopy(model.state_dict())
    return history, snapshot


@pytest.mark.parametrize(("saved_in", "resumed_in"), [("device", "host"), ("host", "device"), ("host", "host")])
def test_bf16_resume_with_a_host_update_pending_is_bitwise_across_modes(saved_in, resumed_in):
    """A snapshot after step 5 (warm-up 1, S 3: windows end at steps 4 and 7): mid-window, the update of the window
    that ended at step 4 computed and not applied; on load its step goes back where the landing reads it, and the
    open window's sum and counts move into the other mode's accumulator. Across modes in the exact state (its sums
    are fp32 in both modes), in one mode in the compact state."""
    host_state = "bf16" if saved_in == resumed_in else "fp32"
    uninterrupted, snapshot = _resume_run(
        saved_in, range(1, 13), _net(torch.bfloat16), None, snapshot_at=5, host_state=host_state
    )
    state, model_copy = snapshot
    assert state["progress"]["steps_in_window"] == 1
    assert state["progress"]["pending"] is not None, "the snapshot must hold a computed, unapplied host update"
    assert model_copy[0].weight.dtype == torch.bfloat16
    resumed, _ = _resume_run(resumed_in, range(6, 13), model_copy, state, snapshot_at=None, host_state=host_state)
    for key in [*range(6, 13), "final"]:
        for name, value in uninterrupted[key].items():
            assert torch.equal(resumed[key][name], value), f"{name} after step {key}"
    assert not torch.equal(uninterrupted["final"]["0.weight"], uninterrupted[1]["0.weight"])


@pytest.mark.parametrize("host_state", ["bf16", "fp32"])
def test_a_pending_update_moves_into_the_host_rows_when_auto_takes_the_host_after_a_load(host_state, monkeypatch):
    """A state saved in device mode with an update in flight, loaded into an engine whose ``accumulate_on="auto"``
    takes the host at its first step (too little device memory): the engine starts with device mode's one window
    row, and the update in flight (a step where the weights are the masters) moves into the host mode's rows at the
    switch. It lands as in an engine configured for the host from the start: bitwise."""
    _, snapshot = _resume_run("device", range(1, 13), _net(torch.bfloat16), None, snapshot_at=5, host_state=host_state)
    state, model_copy = snapshot
    assert state["progress"]["pending"] is not None
    configured, _ = _resume_run(
        "host", range(6, 13), copy.deepcopy(model_copy), copy.deepcopy(state), None, host_state=host_state
    )
    monkeypatch.setattr(lanes_module.Lanes, "free_bytes", lambda self: 0)
    chosen, _ = _resume_run("auto", range(6, 13), model_copy, state, None, host_state=host_state)
    for key in [*range(6, 13), "final"]:
        for name, value in configured[key].items():
            assert torch.equal(chosen[key][name], value), f"{name} after step {key}"
