"""Shared test fixtures: a leak check for spawned processes, the environment restored after every test, spare host
workers for the modules that build many engines, and the skip of GPU tests on machines without CUDA."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from lightning_zenflow.engine import spares
from lightning_zenflow.engine.kernels import KERNELS_ENV
from lightning_zenflow.engine.lanes import STRICT_ENV
from lightning_zenflow.engine.spares import spawned_children

# The interim moves run eagerly in the suite (the same functions; building compiled kernels takes seconds per
# process and per rank). tests/test_kernels.py checks the compiled kernels against these, and the rule.
os.environ.setdefault(KERNELS_ENV, "eager")
# The CPU lanes keep only what CUDA's caching allocator would keep for a stream (engine/lane.py): a missing keep-alive
# or a tensor made after a lane's last wait fails here, not on a GPU.
os.environ.setdefault(STRICT_ENV, "1")


def _active_children() -> dict[int, str]:
    return {child.pid: child.name for child in multiprocessing.active_children()}


@pytest.fixture
def no_leaked_children():
    """Fail the test if it leaves a spawned process (e.g. a ``zenflow-host`` worker) or an unjoined zombie behind.

    Opt in per module with ``pytestmark = pytest.mark.usefixtures("no_leaked_children")``; only processes that
    appeared during the test count, so children left by other tests never fail this one.
    """
    spawned_before = spawned_children()
    active_before = _active_children()
    yield
    # scan /proc before active_children(): active_children() joins finished children and would hide a zombie
    kept = set(spares.spare_worker_pids())  # idle spares (see spare_workers below) are kept on purpose
    leaked_pids = spawned_children() - spawned_before - kept
    leaked_active = {
        pid: name for pid, name in _active_children().items() if pid not in active_before and pid not in kept
    }
    for pid in leaked_pids | set(leaked_active):
        # clean up what this test started so one leak does not fail the tests after it
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert not leaked_pids, f"the test left spawned child processes (or zombies) behind: pids {sorted(leaked_pids)}"
    assert not leaked_active, f"the test left multiprocessing children running: {leaked_active}"


@pytest.fixture(autouse=True)
def restore_environment():
    """Every test leaves ``os.environ`` as it found it: a data-parallel Trainer sets ``MASTER_PORT``, ``LOCAL_RANK``
    and friends, and a leaked one makes the next Trainer believe it was launched by a cluster."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


LONGEST_FILES_FIRST = (
    "test_lightning_ddp.py",
    "test_lanes.py",
    "test_plan_budget.py",
    "test_distributed_engine.py",
    "test_host_worker.py",
    "test_lightning_fsdp.py",
    "test_cli.py",
    "test_plan.py",
    "test_benchmarks.py",
    "test_engine_modes.py",
    "test_kernels.py",
    "test_faults.py",
    "test_integrations.py",
    "test_optim.py",
)
"""The test files that take longest (half a minute or more, measured), longest first. pytest-xdist hands the files to
the test processes in collection order (see ``pytest_configure``), so the longest ones start first and the short ones
fill in after them: the processes finish together instead of one running the longest file alone at the end."""


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist hands out the files with the most tests first unless told otherwise; here they go out in
    collection order, where ``LONGEST_FILES_FIRST`` puts the files that take longest."""
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FILES_FIRST``; the order within a file is kept), and skip tests marked
    ``@pytest.mark.gpu`` when no CUDA device is available."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files and tests keep their order
    import torch

    if torch.cuda.is_available():
        return
    # tests/test_gpu.py rehearsed on the CPU: its own marks skip what is about CUDA itself
    rehearsal = os.environ.get("LIGHTNING_ZENFLOW_GPU_TESTS_ON", "").strip().lower() == "cpu"
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not (rehearsal and item.path.name == "test_gpu.py"):
            item.add_marker(skip_gpu)


SPARE_WORKER_MODULES = frozenset(
    {
        "test_benchmarks",
        "test_engine_degenerate",
        "test_engine_determinism",
        "test_engine_modes",
        "test_engine_profiler",
        "test_engine_reference",
        "test_engine_resume",
        "test_integrations",
        "test_interim",
        "test_lanes",
        "test_layout_selection",
        "test_lightning_checkpoint",
        "test_lightning_ddp",
        "test_lightning_equivalence",
        "test_lightning_fsdp",
        "test_lightning_precision",
        "test_lightning_surface",
        "test_lightning_telemetry",
        "test_lightning_validation",
    }
)
"""Modules whose engines may adopt a closed engine's host worker (``engine/spares.py``) instead of spawning one: they
check numbers, not process lifecycles (the data-parallel and FSDP2 modules' multi-rank fits run in scripts, whose
batches keep spares of their own). Every other module (faults, teardown, the worker protocol, the optimizer facade's
lifecycle) runs with fresh workers and no spares, as a user's process does by default."""


@pytest.fixture(autouse=True)
def spare_workers(request: pytest.FixtureRequest) -> None:
    """Spare host workers on for the modules in ``SPARE_WORKER_MODULES``, off (and none left) for all others.

    Host workers, and the engine-only ranks of ``distributed_helpers``, start from a fork server that imported them
    once per test process (``spares.start_workers_preloaded``): a start is a fork, not a fresh interpreter importing
    torch. Tests marked ``spawned_workers`` spawn theirs, as a user's process does by default: they watch the worker as
    this process's own child (its exit status, its reaping, its start-up). The tests' scripts, their ranks and their
    workers start as a user's do (spawned)."""
    name = request.module.__name__.rpartition(".")[2]
    spares.keep_spare_workers(name in SPARE_WORKER_MODULES)
    spawned = request.node.get_closest_marker("spawned_workers") is not None
    spares.start_workers_preloaded(not spawned, also_preload=("distributed_helpers",))
