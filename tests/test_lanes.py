"""The CPU lanes run as CUDA streams do, and the adversarial schedule turns a missing wait into a wrong number.

Three tiers: the lanes themselves (order, events, waits, failures, the host-sync count); the engine under
``LIGHTNING_ZENFLOW_LANES=adversarial`` with several seeds, which must give bitwise the default schedule's numbers
(both accumulation modes, warm-up, refresh and migration, ``land_after``, a 16-mixed overflow, a resume with an
update in flight, two ranks); and the mutation test: with any one of the engine's waits removed, or the kept-count
wait put back on the event of two windows ago, the numbers change.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from distributed_helpers import SmallNet, lanes_rank, load_results, run_ranks
from test_engine_resume import CONFIG as RESUME_CONFIG
from test_engine_resume import STEPS as RESUME_STEPS
from test_engine_resume import _maybe_flush as resume_maybe_flush
from test_engine_resume import _optimizer as resume_optimizer
from test_engine_resume import _train_step as resume_train_step
from test_engine_resume import uninterrupted  # noqa: F401  (the module-scoped fixture)
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine import lane as lane_module
from lightning_zenflow.engine import lanes as lanes_module
from lightning_zenflow.engine.interim import InterimMoves
from lightning_zenflow.engine.lane import LaneError, StrictLaneError
from lightning_zenflow.engine.lanes import Lanes, lane_mode
from lightning_zenflow.engine.window import WindowEnd

pytestmark = pytest.mark.usefixtures("no_leaked_children")  # every engine's host worker is joined

SEEDS = (0, 1, 2, 3, 4)
CPU = torch.device("cpu")


@pytest.fixture
def lanes():
    made = Lanes(CPU, mode="threads")
    yield made
    made.close(quiet=True)


def _blocked(lane, log: list, name: str) -> threading.Event:
    """Queue on ``lane`` a piece of work that waits for a gate, then logs ``name``; returns the gate."""
    gate = threading.Event()
    lane.run(gate.wait)
    lane.run(log.append, name)
    return gate


# ---------------------------------------------------------------------------------------------- the lanes
def test_a_lane_runs_its_work_in_order_after_it_is_issued(lanes) -> None:
    log: list = []
    gate = _blocked(lanes.side, log, "first")
    lanes.side.run(log.append, "second")
    assert log == [], "the work runs on the lane's thread, not when it is issued"
    gate.set()
    lanes.side.synchronize()
    assert log == ["first", "second"]


def test_a_wait_on_an_event_orders_one_lane_after_another(lanes, monkeypatch) -> None:
    def run(drop: bool) -> list:
        monkeypatch.setattr(lane_module, "DROPPED_WAITS", frozenset({"window added"} if drop else ()))
        log: list = []
        gate = _blocked(lanes.side, log, "side")
        done = lanes.event()
        lanes.side.record(done)
        lanes.d2h.wait(done, "window added")
        lanes.d2h.run(log.append, "d2h")
        if drop:
            lanes.d2h.synchronize()  # it finishes while the side lane is still blocked
            assert log == ["d2h"]
        gate.set()
        lanes.synchronize()
        return log

    assert run(drop=False) == ["side", "d2h"]
    assert run(drop=True) == ["d2h", "side"], "without the wait the two lanes are not ordered"


def test_a_wait_takes_the_record_it_sees_when_it_is_issued(lanes) -> None:
    """As ``cudaStreamWaitEvent``: a later record of the same event does not move a wait already issued, and an
    event never recorded counts as done."""
    never = lanes.event()
    assert never.query()
    lanes.d2h.wait(never, "window added")
    lanes.d2h.synchronize()  # returns: nothing to wait for
    log: list = []
    event = lanes.event()
    lanes.side.record(event)  # recorded before the side lane blocks: done at once
    lanes.side.synchronize()
    lanes.d2h.wait(event, "window added")
    gate = _blocked(lanes.side, log, "side")
    lanes.side.record(event)  # a new record, behind the gate
    lanes.d2h.run(log.append, "d2h")
    lanes.d2h.synchronize()
    assert log == ["d2h"], "the d2h lane waited for the first record only"
    assert not event.query()
    gate.set()
    event.synchronize()
    assert log == ["d2h", "side"]


def test_wait_lane_orders_after_everything_issued_so_far(lanes) -> None:
    log: list = []
    gate = _blocked(lanes.h2d, log, "h2d")
    lanes.side.wait_lane(lanes.h2d, "side after compute")
    lanes.side.run(log.append, "side")
    gate.set()
    lanes.synchronize()
    assert log == ["h2d", "side"]


def test_the_compute_lane_defers_its_waits_until_it_settles(lanes) -> None:
    """The compute lane's wait is GPU-side on CUDA: the caller runs on until ``settle()``; a lane that waits for the
    compute lane inherits what it still waits for."""
    log: list = []
    gate = _blocked(lanes.side, log, "side")
    done = lanes.event()
    lanes.side.record(done)
    lanes.compute.wait(done, "compute after update")
    log.append("caller ran on")
    lanes.h2d.wait_lane(lanes.compute, "side after compute")
    lanes.h2d.run(log.append, "h2d")
    gate.set()
    lanes.settle()
    lanes.synchronize()
    assert log == ["caller ran on", "side", "h2d"]


def test_a_failure_on_a_lane_is_raised_at_the_next_host_wait_and_later_work_is_skipped(lanes) -> None:
    log: list = []
    lanes.side.run(lambda: 1 / 0)
    lanes.side.run(log.append, "after the failure")
    done = lanes.event()
    lanes.side.record(done)
    done.wait_here()  # markers still pass: nothing waiting on the lane hangs
    with pytest.raises(LaneError, match="side lane failed: ZeroDivisionError"):
        lanes.synchronize()
    with pytest.raises(LaneError):
        lanes.raise_failures()
    assert log == [], "a lane skips its work after a failure, as a CUDA error is sticky"


def test_host_syncs_count_the_training_threads_waits_only(lanes) -> None:
    event = lanes.event()
    lanes.side.record(event)
    before = lanes.host_syncs
    event.synchronize()
    lanes.side.synchronize()
    lanes.synchronize()
    lanes.read(lanes.side, torch.zeros(2))
    assert lanes.host_syncs == before + 4
    event.wait_here()  # the helper thread's kind of wait: not counted
    lanes.settle()  # the compute lane's deferred waits: GPU-side on CUDA, not counted
    other = threading.Thread(target=event.synchronize)
    other.start()
    other.join()
    assert lanes.host_syncs == before + 4


def test_the_lane_mode_and_seed_come_from_the_environment() -> None:
    assert lane_mode({}) == ("threads", 0)
    assert lane_mode({"LIGHTNING_ZENFLOW_LANES": "adversarial", "LIGHTNING_ZENFLOW_LANES_SEED": "7"}) == (
        "adversarial",
        7,
    )
    with pytest.raises(ValueError, match="LIGHTNING_ZENFLOW_LANES='slow' is not one of"):
        lane_mode({"LIGHTNING_ZENFLOW_LANES": "slow"})
    with pytest.raises(ValueError, match="not an integer seed"):
        lane_mode({"LIGHTNING_ZENFLOW_LANES_SEED": "x"})


def test_adversarial_delays_are_seeded_per_stage() -> None:
    def delays(seed: int, stage: str) -> list[float]:
        made = Lanes(CPU, mode="adversarial", seed=seed)
        try:
            rng = made.rng(stage)
            return [made.delay_s(stage, rng) for _ in range(5)]
        finally:
            made.close()

    assert delays(3, "side") == delays(3, "side")
    assert delays(3, "side") != delays(4, "side")
    assert delays(3, "side") != delays(3, "d2h")
    assert all(0.0 <= d <= lanes_module.ADVERSARIAL_MAX_DELAY_S for d in delays(3, "helper"))


def test_closing_the_lanes_stops_their_threads() -> None:
    made = Lanes(CPU, mode="threads")
    made.side.run(lambda: None)
    made.close()
    assert [lane.alive() for lane in made.asynchronous] == [False, False, False]


# ----------------------------------------------------------------------------------------- strict lanes
@pytest.fixture
def strict_lanes():
    made = Lanes(CPU, mode="threads", strict=True, delays={"side": 0.02})
    yield made
    made.close(quiet=True)


def test_a_strict_lane_refuses_a_tensor_freed_before_its_work_ran(strict_lanes) -> None:
    """On CUDA a tensor the training thread frees goes back to the caching allocator at once; a strict lane holds
    only a weak reference, so the work that reads it after the free fails instead of reading someone else's memory."""
    target = torch.zeros(4)
    temporary = torch.ones(4)
    strict_lanes.side.run(target.add_, temporary)
    del temporary  # the lane sleeps 20 ms before its work: the free comes first
    with pytest.raises(StrictLaneError, match="freed before the lane ran its work"):
        strict_lanes.side.synchronize()


def test_what_the_engine_keeps_survives_on_a_strict_lane(strict_lanes) -> None:
    """Kept for the lane (``keep_for``, CUDA's ``record_stream``), or pinned host staging (``empty_host``, kept by
    CUDA's host allocator until its copy is done): the work reads it after the owner let go."""
    target = torch.zeros(4)
    kept, staged = torch.ones(4), strict_lanes.empty_host(4, torch.float32)
    staged.fill_(2.0)
    strict_lanes.keep_for(kept, strict_lanes.side)
    strict_lanes.side.run(target.add_, kept)
    strict_lanes.side.run(target.add_, staged)
    del kept, staged
    strict_lanes.side.synchronize()
    assert target.tolist() == [3.0] * 4
    side = strict_lanes.side
    side.run(lambda: None)  # a later piece of work lets the lane look at its kept storages again
    side.synchronize()
    assert side._kept == [], "a kept storage is released once its owner let go and the lane ran past it"


def test_a_strict_lane_refuses_a_tensor_made_on_compute_after_its_last_wait() -> None:
    """Decided when the work is issued, whatever the timing: the side lane's last wait on the compute lane came
    before the tensor was made, so on CUDA its fill is unordered with the side stream's read."""
    lanes = Lanes(CPU, mode="threads", strict=True)
    try:
        before = lanes.made_on_compute(torch.zeros(3))
        lanes.side.wait_lane(lanes.compute, "side after compute")
        lanes.side.run(torch.Tensor.add_, before, 1.0)  # made before the wait: fine
        after = lanes.made_on_compute(torch.zeros(3))
        with pytest.raises(StrictLaneError, match="made after the side lane's last wait"):
            lanes.side.run(torch.Tensor.add_, after, 1.0)
        lanes.side.wait_lane(lanes.compute, "side after compute")
        lanes.side.run(torch.Tensor.add_, after, 1.0)
        lanes.side.synchronize()
        assert after.tolist() == [1.0] * 3
    finally:
        lanes.close(quiet=True)


def test_the_strict_lanes_catch_a_temporary_made_for_the_side_lane(monkeypatch) -> None:
    """Finding 2 of the CUDA review put back: the interim moves given a tensor made on the compute lane for this step
    (``keep = 1 - found_inf`` was one) that nobody keeps. The default lanes give the right numbers (the closure keeps
    it); strict lanes fail, as a CUDA stream could have read reused memory."""
    original = InterimMoves.step

    def step_with_a_temporary(self, groups, hparams, interval, found_inf, first_in_window):
        temporary = None if found_inf is None else found_inf.clone()  # made here, freed when this returns
        return original(self, groups, hparams, interval, temporary, first_in_window)

    monkeypatch.setattr(InterimMoves, "step", step_with_a_temporary)
    monkeypatch.setenv(lanes_module.STRICT_ENV, "0")
    relaxed = _run("device", torch.float32, delays={"side": 0.02}, steps=6, update_interval=2)
    assert _differences(relaxed, _run("device", torch.float32, steps=6, update_interval=2)) == []
    monkeypatch.setenv(lanes_module.STRICT_ENV, "1")
    with pytest.raises(StrictLaneError, match="freed before the lane ran its work"):
        _run("device", torch.float32, delays={"side": 0.02}, steps=6, update_interval=2)


def test_the_strict_lanes_catch_statistics_made_after_the_side_lanes_wait(monkeypatch) -> None:
    """Finding 3 of the CUDA review put back: the interim statistics are made and zeroed on the compute lane after the
    step's wait, and the side lane is not ordered after them again."""
    monkeypatch.setattr(InterimMoves, "_order_new", lambda self: None)
    monkeypatch.setenv(lanes_module.STRICT_ENV, "1")
    with pytest.raises(StrictLaneError, match="made after the side lane's last wait"):
        _run("device", torch.float32, steps=4, update_interval=2)


# ------------------------------------------------------------------------------------- the engine, adversarial
def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 5)).to(dtype)


SCENARIOS = {
    # device accumulation, fp32, a window of 3 landing one step after it closes, a refresh every 4 steps
    "device-fp32-land_after": ("device", torch.float32, {"update_interval": 3, "land_after": 1}),
    # host accumulation, bf16 (staged uploads in the consumed accumulator), a window of 2
    "host-bf16": ("host", torch.bfloat16, {"update_interval": 2}),
}
COMPILED_SCENARIO = ("device", torch.bfloat16, {"update_interval": 3, "interim_kernel": "compiled"})
"""The compact state's kernels as they run by default on a large model: built ahead of time and compiled (the window's
bf16 sum, the bf16 moves and landings on the side lane, the worker's step)."""
OVERFLOW_STEP = 7
"""A 16-mixed overflow (``found_inf`` = 1) mid-window: skipped on the device, not counted in the window's mean."""


def _run(
    accumulate_on: str,
    dtype: torch.dtype,
    delays: dict | None = None,
    steps: int = 12,
    set_to_none: bool = True,
    **knobs,
) -> dict:
    """A weight-dependent loss with a 1-step warm-up, the first selection, refreshes, an overflowed step, a sync
    boundary, an uneven learning rate and a partial window closed by flush(); returns every visible state."""
    model = _net(dtype)
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[3].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, model[2].weight, model[2].bias, model[3].bias], "lr": 3e-3},
        ],
        lr=1e-2,
    )
    config = ZenFlowConfig(
        topk_ratio=0.25,
        full_warm_up_rounds=1,
        select_strategy="step",
        select_interval=4,
        accumulate_on=accumulate_on,
        **knobs,
    )
    generator = torch.Generator().manual_seed(1)
    history, divisors = [], []
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, config, param_names=names, stage_delays=delays) as engine:
        submit = engine._worker.submit

        def recording_submit(slot, jobs):
            divisors.append([job.mean_divisors for job in jobs])
            return submit(slot, jobs)

        engine._worker.submit = recording_submit
        for t in range(1, steps + 1):
            engine.wait_for_update()
            x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)
            nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            for group in opt.param_groups:
                group["lr"] *= 0.9
            found_inf = torch.tensor(1.0 if t == OVERFLOW_STEP else 0.0)
            engine.step(found_inf=found_inf)
            opt.zero_grad(set_to_none=set_to_none)
            if t == 9:
                engine.sync()
            history.append(copy.deepcopy(model.state_dict()))
        engine.flush()
        history.append(copy.deepcopy(model.state_dict()))
        state = engine.state_dict()["params"]
        host_syncs = engine.lanes.host_syncs
    return {"history": history, "state": state, "divisors": divisors, "host_syncs": host_syncs}


def _differences(run: dict, expected: dict) -> list[str]:
    found = []
    for step, (actual, wanted) in enumerate(zip(run["history"], expected["history"]), start=1):
        found += [f"{name} after step {step}" for name in wanted if not torch.equal(actual[name], wanted[name])]
    for name, entry in expected["state"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if not torch.equal(run["state"][name][key], entry[key]):
                found.append(f"{key} of {name}")
    if run["divisors"] != expected["divisors"]:
        found.append(f"divisors {run['divisors']} != {expected['divisors']}")
    return found


@pytest.fixture(scope="module")
def default_runs() -> dict[str, dict]:
    """Each scenario once on the default lanes (``threads``)."""
    return {name: _run(mode, dtype, **knobs) for name, (mode, dtype, knobs) in SCENARIOS.items()}


def test_the_scenarios_exercise_what_they_are_for(default_runs) -> None:
    for name, run in default_runs.items():
        divisors = [d for job in run["divisors"] for d in job]
        # the overflowed step is not counted: one window's mean divides by one gradient less
        interval = SCENARIOS[name][2]["update_interval"]
        assert any(any(0 < float(v) < interval for v in d) for d in divisors if d), name
        assert not torch.equal(run["history"][0]["0.weight"], run["history"][-1]["0.weight"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_adversarial_lanes_give_the_default_numbers_bitwise(default_runs, scenario, seed, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES_SEED", str(seed))
    mode, dtype, knobs = SCENARIOS[scenario]
    run = _run(mode, dtype, **knobs)
    assert _differences(run, default_runs[scenario]) == []


@pytest.mark.slow  # builds the compiled kernels (seconds each with an empty compile cache)
def test_adversarial_lanes_give_the_default_numbers_bitwise_with_compiled_kernels(monkeypatch) -> None:
    mode, dtype, knobs = COMPILED_SCENARIO
    expected = _run(mode, dtype, **knobs)
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    for seed in SEEDS:
        monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES_SEED", str(seed))
        assert _differences(_run(mode, dtype, **knobs), expected) == [], seed


@pytest.mark.parametrize("seed", SEEDS)
def test_a_resume_with_an_update_in_flight_is_bitwise_under_adversarial_lanes(
    uninterrupted,  # noqa: F811
    seed,
    monkeypatch,
) -> None:
    """The snapshot after a window end, its host update in flight, resumed on adversarial lanes."""
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES_SEED", str(seed))
    state, saved_model = uninterrupted.snapshots[6]
    assert state["progress"]["pending"] is not None
    model = copy.deepcopy(saved_model)
    opt = resume_optimizer(model)
    with ZenFlowEngine(opt, RESUME_CONFIG, param_names={p: n for n, p in model.named_parameters()}) as engine:
        engine.load_state_dict(copy.deepcopy(state))
        for t in range(7, RESUME_STEPS + 1):
            engine.wait_for_update()
            resume_train_step(engine, model, opt, t)
            for name, value in model.state_dict().items():
                assert torch.equal(value, uninterrupted.history[t][name]), f"{name} after step {t}"
            resume_maybe_flush(engine, model, t, {})
        engine.flush()
        for name, value in model.state_dict().items():
            assert torch.equal(value, uninterrupted.history["final"][name]), f"{name} after the final flush"


@pytest.mark.slow  # two ranks (45 s): the default suite keeps the one-process scenarios
def test_two_ranks_under_adversarial_lanes_equal_the_default(tmp_path) -> None:
    """Two ranks (gloo), on the default lanes and then on adversarial lanes with each seed, in one launch."""
    config = {"topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step", "select_interval": 4}
    schedules = [("threads", 0)] + [("adversarial", seed) for seed in SEEDS]
    codes = run_ranks(lanes_rank, 2, config, 9, str(tmp_path), schedules, timeout_s=240.0)
    assert codes == [0, 0], f"ranks exited with {codes}"
    ranks = load_results(tmp_path, 2)
    torch.manual_seed(0)
    initial = SmallNet().state_dict()
    for rank, runs in enumerate(ranks):
        expected = runs[("threads", 0)]
        assert not torch.equal(expected["first.weight"], initial["first.weight"]), "the run trained"
        for schedule in schedules[1:]:
            for name, value in expected.items():
                assert torch.equal(runs[schedule][name], value), f"rank {rank}, {schedule}: {name}"


# ------------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_steady_state_steps_make_no_host_sync(accumulate_on: str) -> None:
    """After warm-up and the first selection, ordinary steps and window ends wait on nothing the device does; only
    selections (refreshes) read the device. The telemetry says so per step."""
    model = _net(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ZenFlowConfig(
        topk_ratio=0.25,
        update_interval=2,
        full_warm_up_rounds=1,
        select_strategy="step",
        select_interval=6,
        accumulate_on=accumulate_on,
    )
    generator = torch.Generator().manual_seed(1)
    stats = []
    with ZenFlowEngine(opt, config) as engine:
        for _ in range(10):
            engine.wait_for_update()
            nn.functional.mse_loss(model(torch.randn(8, 6, generator=generator)), torch.zeros(8, 5)).backward()
            stats.append(engine.step())
            opt.zero_grad()
    steady = [s for s in stats if s.step > 2 and not s.refreshed]
    assert len(steady) >= 5
    assert any(s.window_end for s in steady)
    assert [s.host_syncs for s in steady] == [0] * len(steady)
    assert all(s.host_syncs > 0 for s in stats if s.refreshed), "a selection reads scores and indices back"


# ------------------------------------------------------------------------------------------ the mutations
MUTATIONS = {
    # a wait removed -> the scenario, the producer lane slowed to expose it, and how the loop zeroes gradients
    "compute after update": ("device", {"side": 0.02}, True),
    "compute after gradients read": ("device", {"side": 0.02}, False),  # zero_grad(set_to_none=False): in place
    "window added": ("device", {"side": 0.02}, True),
    "window copied": ("device", {"d2h": 0.02}, True),
    "ring gathered": ("host", {"side": 0.02}, True),
    "ring copied": ("host", {"d2h": 0.02}, True),
    "launch: window copied": ("device", {"d2h": 0.02}, True),
}
CPU_UNOBSERVABLE = {
    "side after compute": "the CPU compute lane is the calling thread: its work is done when issued",
    "upload read": "it orders the helper after a landing across a step boundary, where the CPU compute lane settles",
}


def test_every_wait_is_either_mutated_here_or_said_to_be_cpu_unobservable() -> None:
    assert set(MUTATIONS) | set(CPU_UNOBSERVABLE) == set(lane_module.WAIT_LABELS)
    assert not set(MUTATIONS) & set(CPU_UNOBSERVABLE)


@pytest.fixture(scope="module")
def mutation_baselines() -> dict[str, dict]:
    return {mode: _run(mode, torch.float32, update_interval=2) for mode in ("device", "host")}


@pytest.mark.parametrize("label", list(MUTATIONS))
def test_removing_a_wait_changes_the_numbers(mutation_baselines, label, monkeypatch) -> None:
    mode, delays, set_to_none = MUTATIONS[label]
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    monkeypatch.setattr(lane_module, "DROPPED_WAITS", frozenset({label}))
    try:
        run = _run(mode, torch.float32, delays=delays, set_to_none=set_to_none, update_interval=2)
    except LaneError:
        return  # the missing wait broke the run outright (a lane read what was not there yet)
    assert _differences(run, mutation_baselines[mode]), f"dropping {label!r} went unnoticed"


@pytest.mark.parametrize("mode", ["device", "host"])
def test_the_kept_count_wait_of_two_windows_ago_is_caught(mutation_baselines, mode, monkeypatch) -> None:
    """The review's N1: the side lane waited on the slot's event *after* the slot flipped, i.e. on the copy of
    two windows ago; a slow copy down then reads counts the next window has zeroed or recounted."""
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    monkeypatch.setattr(WindowEnd, "closed_window_copied", lambda self, open_slot: self.copied[open_slot])
    run = _run(mode, torch.float32, delays={"d2h": 0.02}, update_interval=2)
    differences = _differences(run, mutation_baselines[mode])
    assert any(d.startswith("divisors") for d in differences), differences


# ----------------------------------------------------------------------------- host state stays on the host
def test_a_sharded_checkpoint_block_is_never_moved_to_the_mesh_device(tmp_path, monkeypatch) -> None:
    """The review's N3: the row-sharded DTensor of a host block shares the block's memory (no ``from_local``, which
    would copy it to a CUDA mesh's device); a one-rank gloo group gives the mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_zenflow.checkpoints.sharded import host_resident_dtensor

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:

        def refuse(*args, **kwargs):
            raise AssertionError("DTensor.from_local moves the block to the mesh's device")

        monkeypatch.setattr(DTensor, "from_local", refuse)
        block = torch.arange(12.0).reshape(3, 4)
        sharded = host_resident_dtensor(block, init_device_mesh("cpu", (1,)), 3, 4)
        assert sharded.shape == (3, 4)
        assert sharded.to_local().data_ptr() == block.data_ptr()
        assert sharded.to_local().device.type == "cpu"
    finally:
        dist.destroy_process_group()
