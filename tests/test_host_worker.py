"""Tests of the host worker (engine/host.py): its AdamW arithmetic in-process, and through a real engine its
failure modes (raise, SIGKILL, SIGSTOP), teardown, shared memory, "auto" window sizing and core binding.

Every engine here spawns a real worker process (about 1.5 s), so each test builds at most one, with tiny tensors.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import time
import weakref

import pytest
import torch
import worker_fakes
from reference import RefHyperParams, compact_update, hash_bits

from lightning_zenflow.config import AUTO_INTERIM_STEP, ZenFlowConfig, auto_interim_step
from lightning_zenflow.engine import HostWorkerError, ZenFlowEngine, choose_update_interval, spares
from lightning_zenflow.engine import schedule as schedule_module
from lightning_zenflow.engine.device import HyperParams
from lightning_zenflow.engine.host import GroupJob, HostWorker, MatrixExtent, WorkerGroup, WorkerSpec, host_adam_update
from lightning_zenflow.engine.host_step import COLUMN_SALT

pytestmark = pytest.mark.usefixtures("no_leaked_children")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_no_worker_left(pid: int) -> None:
    assert not _pid_exists(pid), f"the host worker (pid {pid}) still exists after close()"
    assert multiprocessing.active_children() == []


def _tiny_engine(config: ZenFlowConfig, **hooks: object) -> tuple[torch.nn.Linear, ZenFlowEngine]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    names = {p: n for n, p in layer.named_parameters()}
    return layer, ZenFlowEngine(optimizer, config, param_names=names, **hooks).start()


def _step(layer: torch.nn.Linear, engine: ZenFlowEngine):
    layer.weight.grad = torch.randn_like(layer.weight)
    layer.bias.grad = torch.randn_like(layer.bias)
    return engine.step()


def _step_until_error(layer: torch.nn.Linear, engine: ZenFlowEngine, budget_s: float) -> HostWorkerError:
    """Keep training until the engine raises HostWorkerError; fail if it does not within budget_s."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        try:
            _step(layer, engine)
        except HostWorkerError as error:
            return error
        time.sleep(0.01)
    raise AssertionError(f"no HostWorkerError within {budget_s} s")


# ----------------------------------------------------------------------------------------- host_adam_update
def _group(numel: int, moments: torch.dtype, window: torch.dtype, master: bool) -> WorkerGroup:
    return WorkerGroup(
        exp_avg=torch.zeros(numel, dtype=moments),
        exp_avg_sq=torch.zeros(numel, dtype=moments),
        steps=torch.zeros(2),
        master=torch.zeros(numel) if master else None,
        windows=(torch.zeros(numel, dtype=window),),
    )


@pytest.mark.parametrize(
    ("optimizer_class", "options"),
    [(torch.optim.AdamW, {"fused": True}), (torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {})],
)
def test_host_adam_update_with_masters_equals_torch_on_the_window_mean(optimizer_class, options):
    """The exact state with host masters: two matrices with different window counts (3 and 2 gradients), three
    windows; masters and moments equal torch's (to float rounding: the worker's step is its own fused loop), and the
    new weights are staged in the window row in the model's dtype."""
    torch.manual_seed(0)
    shapes, counts, model_dtypes = [(4, 6), (3, 5)], (3, 2), (torch.bfloat16, torch.float16)
    decoupled = optimizer_class is torch.optim.AdamW
    hparams = HyperParams(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, decoupled=decoupled)
    reference = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    optimizer = optimizer_class(reference, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, **options)
    extents, offset = [], 0
    for param, dtype in zip(reference, model_dtypes):
        extents.append(MatrixExtent(offset, param.numel(), dtype, param.shape[1], 0, salt=7 + offset))
        offset += param.numel()
    group = _group(offset, torch.float32, torch.float32, master=True)
    for param, extent in zip(reference, extents):
        group.master[extent.offset : extent.offset + extent.numel] = param.detach().flatten()
    job = GroupJob(hparams=hparams, active=(0, 1), mean_divisors=tuple(float(c) for c in counts))
    window_row = group.windows[0]
    for window in range(3):
        for param, extent, count in zip(reference, extents, counts):
            accumulated = sum(torch.randn(param.shape) for _ in range(count))
            window_row[extent.offset : extent.offset + extent.numel] = accumulated.flatten()
            param.grad = accumulated / count  # the window's mean
        optimizer.step()
        host_adam_update(group, extents, window, job)
        for index, (param, extent) in enumerate(zip(reference, extents)):
            region = slice(extent.offset, extent.offset + extent.numel)
            state = optimizer.state[param]
            for key, host, expected in (
                ("master", group.master, param.detach()),
                ("exp_avg", group.exp_avg, state["exp_avg"]),
                ("exp_avg_sq", group.exp_avg_sq, state["exp_avg_sq"]),
            ):
                torch.testing.assert_close(host[region].view(param.shape), expected, rtol=1e-6, atol=1e-7, msg=key)
            assert group.steps[index].item() == window + 1
            staged_bytes = window_row[region].view(torch.uint8)[: extent.numel * extent.dtype.itemsize]
            staged = staged_bytes.view(extent.dtype).view(param.shape)
            assert torch.equal(staged, group.master[region].view(param.shape).to(extent.dtype))


@pytest.mark.parametrize("host_state", ["fp32", "bf16"])
def test_host_adam_update_without_masters_writes_the_step(host_state):
    """The weights are the masters: the window row gets AdamW's step without decay (the device decays when it lands),
    fp32 or, in the compact state, rounded to nearest into the bf16 row; the compact moments are the reference's
    (``tests/reference.py``: the first rounded to nearest, the second stochastically), bit for bit."""
    torch.manual_seed(1)
    compact = host_state == "bf16"
    dtype = torch.bfloat16 if compact else torch.float32
    rows, cols, count = 4, 6, 3
    hparams = HyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    ref_hp = RefHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    extent = MatrixExtent(0, rows * cols, torch.float32, cols, 0, salt=12345, row_start=2)
    group = _group(rows * cols, dtype, dtype, master=False)
    row_u = torch.tensor([hash_bits(12345, 2 + i) for i in range(rows)])
    col_u = torch.tensor([hash_bits(12345 ^ COLUMN_SALT, j) for j in range(cols)])
    m = torch.zeros(rows, cols)
    v = torch.zeros(rows, cols)
    weights = torch.randn(rows, cols)
    torch_weights = torch.nn.Parameter(weights.clone())
    torch_opt = torch.optim.AdamW([torch_weights], lr=1e-2, weight_decay=0.0)
    for window in range(1, 4):
        sums = sum(torch.randn(rows, cols) for _ in range(count)).to(dtype)
        group.windows[0].copy_(sums.flatten())
        job = GroupJob(hparams=hparams, active=(0,), mean_divisors=(float(count),))
        host_adam_update(group, [extent], 0, job)
        step = group.windows[0].view(rows, cols).float()
        if compact:
            m, v, expected = compact_update(sums, m, v, ref_hp, window, count, (row_u, col_u, 12345), None, True)
            assert torch.equal(step, expected.to(torch.bfloat16).float())
            assert torch.equal(group.exp_avg.view(rows, cols).float(), m)
            assert torch.equal(group.exp_avg_sq.view(rows, cols).float(), v)
        else:
            before = torch_weights.detach().clone()
            torch_weights.grad = sums.float() / count
            torch_opt.step()
            # the delta of weights near 1 carries their rounding (1e-7): atol covers it
            torch.testing.assert_close(step, torch_weights.detach() - before, rtol=1e-5, atol=1e-6)
        assert group.steps[0].item() == window


def test_host_adam_update_leaves_inactive_matrices_alone():
    torch.manual_seed(0)
    extents = [MatrixExtent(0, 6, torch.float32, 3), MatrixExtent(6, 4, torch.float32, 2)]
    group = _group(10, torch.float32, torch.float32, master=False)
    for row in (group.exp_avg, group.windows[0]):
        row.copy_(torch.randn(10))
    group.exp_avg_sq.copy_(torch.rand(10))  # never negative
    group.steps.copy_(torch.tensor([2.0, 5.0]))
    before = [row.clone() for row in (group.exp_avg, group.exp_avg_sq, group.windows[0])]
    hparams = HyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    host_adam_update(group, extents, 0, GroupJob(hparams=hparams, active=(0,), mean_divisors=(1.0,)))
    assert group.steps.tolist() == [3.0, 5.0]
    for row, saved in zip((group.exp_avg, group.exp_avg_sq, group.windows[0]), before):
        assert torch.equal(row[6:], saved[6:])  # matrix 1 untouched
        assert not torch.equal(row[:6], saved[:6])  # matrix 0 updated; its window row now holds the step
    # a job with no active matrix is a no-op
    after = [row.clone() for row in (group.exp_avg, group.exp_avg_sq, group.windows[0])]
    host_adam_update(group, extents, 0, GroupJob(hparams=hparams, active=(), mean_divisors=()))
    assert all(torch.equal(r, a) for r, a in zip((group.exp_avg, group.exp_avg_sq, group.windows[0]), after))
    assert group.steps.tolist() == [3.0, 5.0]


# ------------------------------------------------------------------------------------------- failure modes
def test_worker_exception_surfaces_with_its_traceback_and_close_restores_everything():
    affinity_before = os.sched_getaffinity(0)
    threads_before = torch.get_num_threads()
    layer, engine = _tiny_engine(ZenFlowConfig(full_warm_up_rounds=0, update_interval=1), host_fail_at=2)
    pid = engine.worker_pid
    try:
        error = _step_until_error(layer, engine, budget_s=20)
        message = str(error)
        assert "raised during update 2" in message
        assert "Traceback (most recent call last)" in message  # the worker's own traceback text
        assert "injected failure at host update 2" in message
        assert engine.t <= 4  # surfaced at the next wait, not many steps later
    finally:
        engine.close()
    engine.close()  # idempotent
    _assert_no_worker_left(pid)
    assert engine.host_buffers == []
    assert os.sched_getaffinity(0) == affinity_before
    assert torch.get_num_threads() == threads_before
    with pytest.raises(RuntimeError, match="call start"):
        _step(layer, engine)


def test_start_after_close_says_build_a_new_engine():
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    engine = ZenFlowEngine(optimizer, ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=1.0)).start()  # no worker needed
    engine.close()
    with pytest.raises(RuntimeError, match="was closed; build a new one"):
        engine.start()


@pytest.mark.spawned_workers
def test_sigkill_of_the_worker_is_detected_within_seconds():
    layer, engine = _tiny_engine(
        ZenFlowConfig(full_warm_up_rounds=0, update_interval=1, overlap_step=True), host_delay_s=0.02
    )
    pid = engine.worker_pid
    try:
        for _ in range(3):
            _step(layer, engine)
        assert engine.host_in_flight
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        error = _step_until_error(layer, engine, budget_s=15)
        detected_s = time.monotonic() - killed_at
        assert detected_s < 10.0, f"the dead worker was noticed only after {detected_s:.1f} s"
        message = str(error)
        if "lost the pipe" not in message:  # the exit race, see test_worker_death_seen_as_eof_reports_the_exit_status
            assert "died" in message
            assert "signal 9" in message
            assert str(pid) in message
            assert "restart from the last checkpoint" in message
    finally:
        engine.close()
    engine.close()
    _assert_no_worker_left(pid)


def _pretend_alive_while_exiting(monkeypatch: pytest.MonkeyPatch, engine: ZenFlowEngine, window_s: float) -> None:
    """Model the exit race of a killed worker: the kernel closes its end of the pipe first, and only a moment later
    is the process reapable, so ``Process.is_alive()`` still answers True for a short while (seen for real
    under load: the SIGKILL test then got "lost the pipe to the host worker: " with no exit status). A fix that
    waits for the process (``join``) or retries ``is_alive()`` for a moment sees the real exit status."""
    process = engine._worker.process
    real_is_alive = process.is_alive
    window_ends = time.monotonic() + window_s

    def is_alive() -> bool:
        # "alive" until the window has passed or someone has waited for the process (join reaps it)
        if time.monotonic() < window_ends and process._popen is not None and process._popen.returncode is None:
            return True
        return real_is_alive()

    monkeypatch.setattr(process, "is_alive", is_alive)


def _kill_and_wait_until_exited(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    # blocks until the worker has exited (its pipe end is closed) but leaves it unreaped for the engine to see
    # (ChildProcessError: already reaped by multiprocessing, its poll or a later Process.start's sweep: it has exited)
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


@pytest.mark.spawned_workers
def test_worker_death_seen_as_eof_reports_the_exit_status(monkeypatch):
    layer, engine = _tiny_engine(ZenFlowConfig(full_warm_up_rounds=0, update_interval=1), host_delay_s=5.0)
    pid = engine.worker_pid
    try:
        _step(layer, engine)  # update 1 in flight; the worker sleeps 5 s before computing it
        _kill_and_wait_until_exited(pid)
        _pretend_alive_while_exiting(monkeypatch, engine, window_s=0.2)
        with pytest.raises(HostWorkerError) as error:
            _step(layer, engine)  # waits for update 1: the pipe reads EOF
        assert "died" in str(error.value), str(error.value)
        assert "signal 9" in str(error.value)
    finally:
        engine.close()
    _assert_no_worker_left(pid)


@pytest.mark.spawned_workers
def test_worker_death_seen_at_submit_is_a_host_worker_error(monkeypatch):
    layer, engine = _tiny_engine(ZenFlowConfig(full_warm_up_rounds=0, update_interval=1))
    pid = engine.worker_pid
    try:
        _step(layer, engine)  # update 1 submitted
        time.sleep(1.0)  # ... and answered: its "done" is waiting in the pipe
        _kill_and_wait_until_exited(pid)
        _pretend_alive_while_exiting(monkeypatch, engine, window_s=0.2)
        with pytest.raises(HostWorkerError):  # noqa: PT012
            # reads update 1's answer, then the helper thread submits update 2 to the dead worker; its failure
            # surfaces at the next call into the engine
            _step(layer, engine)
            _step(layer, engine)
    finally:
        engine.close()
    _assert_no_worker_left(pid)


def test_stopped_worker_fails_the_run_after_worker_timeout():
    timeout_s = 2.0
    layer, engine = _tiny_engine(ZenFlowConfig(full_warm_up_rounds=0, update_interval=1, worker_timeout_s=timeout_s))
    pid = engine.worker_pid
    try:
        for _ in range(3):
            _step(layer, engine)
        time.sleep(0.3)  # the heartbeat has certainly been stamped since start-up
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        error = _step_until_error(layer, engine, budget_s=timeout_s + 10)
        detected_s = time.monotonic() - stopped_at
        # the detection itself is a heartbeat check every 50 ms; the margin is for a busy machine's scheduling
        assert detected_s <= timeout_s + 5.0, f"the frozen worker was noticed only after {detected_s:.1f} s"
        assert "not answered" in str(error)
        assert f"worker_timeout_s={timeout_s}" in str(error)
        # close() on the still-stopped worker: a stopped process ignores the stop command and SIGTERM
        closing_started = time.monotonic()
        engine.close()
        assert time.monotonic() - closing_started < 20.0
        engine.close()
        _assert_no_worker_left(pid)
    finally:
        if _pid_exists(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            engine.close()


def test_context_manager_exception_leaves_no_process():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    pid = None
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=2)
    # the raise must happen inside the engine's `with`
    with pytest.raises(ValueError, match="user code failed"), ZenFlowEngine(optimizer, config) as engine:  # noqa: PT012
        pid = engine.worker_pid
        assert pid is not None
        assert engine.host_buffers[0].exp_avg.is_shared()
        _step(layer, engine)
        raise ValueError("user code failed")
    _assert_no_worker_left(pid)
    assert engine.host_buffers == []


def test_close_leaves_no_files_in_dev_shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine: torch's shared memory does not live in files there")
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        pytest.skip(
            "torch's sharing strategy is not file_descriptor: its /dev/shm files are owned by torch_shm_manager"
        )

    def ours(names: set[str], pids: set[int]) -> set[str]:
        # torch names its segments torch_<pid>_...; other processes on this machine may create files meanwhile
        return {name for name in names if any(name.startswith(f"torch_{pid}_") for pid in pids)}

    before = set(os.listdir("/dev/shm"))
    layer, engine = _tiny_engine(ZenFlowConfig(full_warm_up_rounds=0, update_interval=2))
    pid = engine.worker_pid
    try:
        for _ in range(5):
            _step(layer, engine)
        engine.flush()
    finally:
        engine.close()
    _assert_no_worker_left(pid)
    assert engine.host_buffers == []
    assert ours(set(os.listdir("/dev/shm")) - before, {os.getpid(), pid}) == set()


def _shared_mappings() -> set[str]:
    """The torch shared-memory segments mapped into this process (listed in /proc/self/maps, even when unlinked)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[5] for line in maps if len(line.split()) > 5 and line.split()[5].startswith("/dev/shm/")}


def test_close_unmaps_the_shared_host_blocks():
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps to see shared mappings")
    layer = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    # topk_ratio=1 still allocates the host blocks but starts no worker: this test spawns nothing
    mapped_before = _shared_mappings()
    engine = ZenFlowEngine(optimizer, ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=1.0)).start()
    block_ref = weakref.ref(engine.host_buffers[0].exp_avg)
    ours = _shared_mappings() - mapped_before
    assert ours, "the host blocks should be mapped from /dev/shm while the engine runs"
    engine.close()
    gc.collect()
    assert engine.host_buffers == []
    assert block_ref() is None, "a shared host block is still referenced after close()"
    assert not (_shared_mappings() & ours)


# ------------------------------------------------------------------------------------- update_interval="auto"
def test_choose_update_interval_rule():
    assert choose_update_interval(1.0, 0.1) == 13  # ceil(1.25 * 10)
    assert choose_update_interval(0.3, 0.1) == 4  # ceil(3.75)
    assert choose_update_interval(1e-6, 0.1) == 1
    assert choose_update_interval(0.0, 0.1) == 1
    assert choose_update_interval(100.0, 0.1) == 64
    assert choose_update_interval(1.0, 0.0) == 64  # no measurable device time: the largest window


def test_auto_update_interval_grows_for_a_host_heavy_workload(monkeypatch):
    """topk_ratio=0: the device step only adds a 2M-element gradient into the accumulator, while the host runs a
    full AdamW over it and, to leave no doubt on a fast or busy machine, sleeps a second inside its timed region (a
    slow host, as "auto" sees it, that stays many device steps long even when a busy machine slows the device
    steps): the host update is many device steps long, so "auto" must widen the window."""
    decisions = []

    def spy(host_update_s: float, device_step_s: float) -> int:
        chosen = choose_update_interval(host_update_s, device_step_s)
        decisions.append((host_update_s, device_step_s, chosen))
        return chosen

    monkeypatch.setattr(schedule_module, "choose_update_interval", spy)
    weight = torch.nn.Parameter(torch.zeros(2048, 1024))
    weight.grad = torch.randn_like(weight)
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    stats = []
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.0, update_interval="auto")
    with ZenFlowEngine(optimizer, config, host_delay_s=1.0) as engine:
        # run until two windows after the decision at step 8 have closed (S <= 64, so at most 8 + 128 steps)
        while len(stats) < 8 + 2 * 64 and sum(s.window_end for s in stats[8:]) < 2:
            stats.append(engine.step())
    assert len(decisions) == 1, "S is decided once, after the first host update"
    host_s, device_s, chosen = decisions[0]
    # S = 4 until the first host update has been waited for: at the second window end (overlap_step=True)
    assert [s.update_interval for s in stats[:7]] == [4] * 7
    assert [s.step for s in stats[:8] if s.window_end] == [4, 8]
    decided_at = stats[7]
    assert decided_at.update_interval == chosen
    assert decided_at.host_update_s == host_s  # the worker's measured compute time of update 1
    assert 0 < device_s < host_s
    assert chosen > 4, f"host {host_s * 1e3:.2f} ms vs device step {device_s * 1e3:.2f} ms gave S={chosen}"
    assert all(s.update_interval == chosen for s in stats[8:])
    assert [s.step for s in stats[8:] if s.window_end] == [8 + chosen, 8 + 2 * chosen]
    assert engine.update_interval == chosen
    # interim_step="auto" follows the chosen window (smaller moves beyond 4 steps)
    assert engine.interim_scale == pytest.approx(auto_interim_step(chosen))
    assert engine.interim_scale < AUTO_INTERIM_STEP


def test_auto_interval_with_the_default_warm_up_decides_during_the_warm_up() -> None:
    """With the default warm-up (10 synchronous steps, each a host update of every element), "auto" is decided once
    the first warm-up update has landed, and the windows after the warm-up use the chosen S from its end."""
    weight = torch.nn.Parameter(torch.zeros(2048, 1024))
    weight.grad = torch.randn_like(weight)
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    config = ZenFlowConfig(topk_ratio=0.0, update_interval="auto")
    assert config.full_warm_up_rounds == 10
    with ZenFlowEngine(optimizer, config, host_delay_s=0.4) as engine:
        stats = [engine.step() for _ in range(10 + 2 * 64)]
    chosen = engine.update_interval
    assert isinstance(chosen, int)
    assert 1 <= chosen <= 64
    assert all(s.window_end for s in stats[:10])  # every warm-up step is a window of one
    assert all(s.update_interval == chosen for s in stats[9:])  # decided within the warm-up
    assert chosen > 1, "a 40 ms host update against a sub-millisecond step needs a window of several steps"
    assert [s.step for s in stats[10:] if s.window_end][:2] == [10 + chosen, 10 + 2 * chosen]


# ------------------------------------------------------------------------------ fixed S and core binding
@pytest.mark.spawned_workers
def test_fixed_update_interval_is_reported_and_bind_cores_off_leaves_affinity():
    affinity_before = os.sched_getaffinity(0)
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=3, overlap_step=False, bind_cores=False)
    layer, engine = _tiny_engine(config)
    pid = engine.worker_pid
    try:
        assert os.sched_getaffinity(0) == affinity_before
        stats = [_step(layer, engine) for _ in range(7)]
    finally:
        engine.close()
    _assert_no_worker_left(pid)
    assert [s.update_interval for s in stats] == [3] * 7
    assert engine.update_interval == 3
    assert [s.step for s in stats if s.window_end] == [3, 6]
    # overlap_step=False: the update is computed and applied at its own window end
    assert [s.host_update_s is not None for s in stats] == [False, False, True, True, True, True, True]
    assert os.sched_getaffinity(0) == affinity_before


@pytest.mark.spawned_workers
def test_bind_cores_pins_both_sides_and_close_restores():
    affinity_before = os.sched_getaffinity(0)
    if len(affinity_before) < 2:
        pytest.skip(f"needs at least 2 usable cores to bind disjointly, this process has {len(affinity_before)}")
    threads_before = torch.get_num_threads()
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=1, bind_cores=True)
    train_cores, host_cores = config.core_split(sorted(affinity_before))
    layer, engine = _tiny_engine(config)
    pid = engine.worker_pid
    try:
        assert os.sched_getaffinity(0) == set(train_cores)
        assert torch.get_num_threads() == len(train_cores)
        assert set(train_cores).isdisjoint(host_cores)
        if len(affinity_before) == 2:
            assert len(os.sched_getaffinity(0)) == 1
        for _ in range(3):
            _step(layer, engine)
        assert os.sched_getaffinity(0) == set(train_cores)
        # the worker pins itself when it takes its spec (its start overlaps the first steps): by its first update
        assert os.sched_getaffinity(pid) == set(host_cores)
    finally:
        engine.close()
    _assert_no_worker_left(pid)
    assert os.sched_getaffinity(0) == affinity_before
    assert torch.get_num_threads() == threads_before


# ------------------------------------------------------------------------------------ protocol error paths
def _spec() -> WorkerSpec:
    rows = [torch.zeros(4).share_memory_() for _ in range(3)]
    group = WorkerGroup(rows[0], rows[1], torch.zeros(1).share_memory_(), None, (rows[2],))
    return WorkerSpec(
        groups=(group,),
        extents=((MatrixExtent(0, 4, torch.float32, 4, 0),),),
        heartbeat=torch.zeros(1, dtype=torch.float64).share_memory_(),
        threads=1,
        cores=None,
    )


def _job() -> GroupJob:
    hparams = HyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    return GroupJob(hparams=hparams, active=(0,), mean_divisors=(1.0,))


def _children() -> set[int]:
    return {child.pid for child in multiprocessing.active_children()}


@pytest.mark.spawned_workers
@pytest.mark.parametrize(
    ("target", "start_timeout_s", "message"),
    [
        (worker_fakes.never_ready, 3.0, "did not start within 3 s"),
        # A spawned child imports torch before it can say anything, which takes seconds on a busy machine:
        # the wrong greeting gets a start-up limit it cannot run into.
        (worker_fakes.says_hello, 120.0, "sent 'hello' instead of 'ready'"),
    ],
)
def test_a_worker_that_does_not_start_properly_is_an_error_and_is_stopped(target, start_timeout_s, message):
    before = _children()
    with pytest.raises(HostWorkerError, match=message):
        HostWorker(_spec(), timeout_s=10.0, start_timeout_s=start_timeout_s, target=target)
    assert _children() <= before, "the failed worker must not be left running"


def test_an_answer_to_the_wrong_update_is_a_protocol_error():
    worker = HostWorker(_spec(), timeout_s=10.0, target=worker_fakes.answers_the_wrong_update)
    try:
        worker.submit(0, [_job()])
        with pytest.raises(HostWorkerError, match=r"protocol error: expected \('done', 1\)"):
            worker.wait()
    finally:
        worker.close()
    assert worker.process is None


@pytest.mark.spawned_workers
def test_a_worker_that_exits_mid_update_is_reported_with_its_exit_status():
    worker = HostWorker(_spec(), timeout_s=10.0, target=worker_fakes.exits_on_update)
    try:
        worker.submit(0, [_job()])
        with pytest.raises(HostWorkerError, match="died with exit code 0"):
            worker.wait()
    finally:
        worker.close()


def test_a_second_submit_while_one_is_in_flight_is_refused():
    worker = HostWorker(_spec(), timeout_s=10.0)
    try:
        worker.submit(0, [_job()])
        with pytest.raises(HostWorkerError, match="already in flight"):
            worker.submit(1, [_job()])
        assert worker.wait() >= 0.0
        assert worker.poll() is None  # nothing in flight any more
    finally:
        worker.close()


# ---------------------------------------------------------------------------------------------- spare workers
def _shared_segments(pid: int) -> int:
    """How many of torch's shared-memory segments process ``pid`` maps (unlinked ones included)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum("/torch_" in line for line in maps)


def _run_to_weights(config: ZenFlowConfig, steps: int, **hooks: object) -> tuple[torch.Tensor, int | None, int]:
    layer, engine = _tiny_engine(config, **hooks)
    torch.manual_seed(1)
    try:
        for _ in range(steps):
            _step(layer, engine)
        engine.flush()
        return layer.weight.detach().clone(), engine.worker_pid, _shared_segments(engine.worker_pid)
    finally:
        engine.close()


def _step_until_error_raised(layer: torch.nn.Linear, engine: ZenFlowEngine) -> None:
    for _ in range(8):
        _step(layer, engine)


def test_a_spare_worker_serves_the_next_engine_with_the_same_numbers() -> None:
    """With spares kept, a closed engine's worker is adopted by the next engine (same pid, no spawn), holds none of
    the first engine's buffers while it waits, and computes exactly what a fresh worker computes; without them a
    closed engine leaves no process behind."""
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=2, topk_ratio=0.25)
    fresh, fresh_pid, _ = _run_to_weights(config, steps=6)
    _assert_no_worker_left(fresh_pid)
    assert spares.spare_worker_pids() == []
    spares.keep_spare_workers(True)
    try:
        first, first_pid, mapped_while_running = _run_to_weights(config, steps=6)
        assert spares.spare_worker_pids() == [first_pid]
        assert mapped_while_running > 0  # the check below can see the engine's blocks
        assert _shared_segments(first_pid) == 0, "the spare still maps the closed engine's shared blocks"
        second, second_pid, _ = _run_to_weights(config, steps=6)
        assert second_pid == first_pid, "the second engine spawned a worker instead of adopting the spare"
        assert torch.equal(first, fresh)
        assert torch.equal(second, fresh)
        # a worker whose engine saw a failure is never kept
        layer, engine = _tiny_engine(config, host_fail_at=1)
        assert engine.worker_pid == first_pid  # the spare again
        with pytest.raises(HostWorkerError, match="injected failure"):
            _step_until_error_raised(layer, engine)
        engine.close()
        assert spares.spare_worker_pids() == []
        _assert_no_worker_left(first_pid)
    finally:
        spares.keep_spare_workers(False)
    assert spares.spare_worker_pids() == []


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat_file:
        return int(stat_file.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.spawned_workers
def test_a_worker_forked_from_the_preloaded_server_computes_what_a_spawned_one_does() -> None:
    """``start_workers_preloaded``: the worker is forked by the fork server (its child, with the server's command
    line: no new interpreter), gives the same numbers bitwise, and leaves no process behind at close."""
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=2, topk_ratio=0.25)
    spawned, spawned_pid, _ = _run_to_weights(config, steps=6)
    _assert_no_worker_left(spawned_pid)
    assert spares.start_method() == "spawn"
    spares.start_workers_preloaded(True)
    try:
        assert spares.start_method() == "forkserver"
        layer, engine = _tiny_engine(config)
        try:
            forked_pid = engine.worker_pid
            server = _parent_of(forked_pid)
            assert server != os.getpid(), "the worker is this process's child: it was spawned, not forked"
            with open(f"/proc/{forked_pid}/cmdline", "rb") as cmdline:
                assert b"forkserver" in cmdline.read(), "the worker runs a command line of its own"
            assert _parent_of(server) == os.getpid()
        finally:
            engine.close()
        _assert_no_worker_left(forked_pid)
        forked, second_pid, _ = _run_to_weights(config, steps=6)
        assert second_pid != forked_pid
        assert torch.equal(forked, spawned)
        _assert_no_worker_left(second_pid)
    finally:
        spares.start_workers_preloaded(False)
    assert spares.start_method() == "spawn"


@pytest.mark.spawned_workers
def test_a_stopped_worker_exits_with_status_zero() -> None:
    """A worker told to stop returns from its loop and joins its heartbeat thread before the interpreter exits: a
    daemon thread caught inside a torch op at exit is ended by pthread_exit, which once aborted a cleanly stopped
    worker (SIGABRT, "terminate called without an active exception"). Several stops, each with its exit status."""
    codes = []
    for _ in range(3):
        worker = HostWorker(_spec(), timeout_s=10.0)
        process = worker.process
        close_process = process.close

        def record_then_close(process=process, close_process=close_process) -> None:
            codes.append(process.exitcode)
            close_process()

        process.close = record_then_close
        worker.submit(0, [_job()])
        worker.wait()
        worker.close(timeout_s=60.0)  # time to exit on its own on a busy machine (2 s, the default, then a kill: -9)
    assert codes == [0, 0, 0]
