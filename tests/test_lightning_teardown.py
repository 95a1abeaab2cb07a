"""The host worker's lifecycle under Lightning (CPU): no process is left after a normal fit, an exception, a
KeyboardInterrupt or a killed worker, and a Trainer can fit twice."""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import time

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning_helpers import RecordWorkerPid, TinyModule, assert_weights_equal, make_trainer, process_gone, weights

from lightning_zenflow import HostWorkerError, ZenFlowStrategy
from lightning_zenflow.strategies.base import _SyncBoundaries
from lightning_zenflow.strategies.telemetry import ZenFlowTelemetry

pytestmark = pytest.mark.usefixtures("no_leaked_children")

HOST_EVERY_STEP = {"topk_ratio": 0.25, "update_interval": 1, "overlap_step": False}
"""The engine talks to the host worker at every step, so a dead worker is noticed at the next one."""


def _assert_worker_gone(record: RecordWorkerPid) -> None:
    assert record.pids, "the fit should have started a host worker"
    for pid in record.pids:
        assert process_gone(pid), f"host worker {pid} is still alive"
    assert not multiprocessing.active_children()


def test_normal_fit_leaves_no_process_and_restores_the_cores() -> None:
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    record = RecordWorkerPid()
    trainer = make_trainer(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **HOST_EVERY_STEP}), max_epochs=1, callbacks=[record]
    )
    trainer.fit(TinyModule())
    _assert_worker_gone(record)
    assert trainer.strategy.engine is None
    assert os.sched_getaffinity(0) == affinity
    assert torch.get_num_threads() == threads
    assert not any(isinstance(c, (_SyncBoundaries, ZenFlowTelemetry)) for c in trainer.callbacks)


def test_exception_in_training_step_leaves_no_process() -> None:
    record = RecordWorkerPid()
    trainer = make_trainer(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **HOST_EVERY_STEP}), callbacks=[record])
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        trainer.fit(TinyModule(fail_at_step=3))
    _assert_worker_gone(record)
    assert trainer.strategy.engine is None
    assert trainer.state.status == "interrupted"


def test_keyboard_interrupt_leaves_no_process() -> None:
    record = RecordWorkerPid()
    trainer = make_trainer(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **HOST_EVERY_STEP}), callbacks=[record])
    sigint_handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning 2.6.6 catches it, tears down, then calls sys.exit(1) (and ignores SIGINT from then on)
        with pytest.raises(SystemExit) as raised:
            trainer.fit(TinyModule(fail_at_step=3, fail_with=KeyboardInterrupt))
    finally:
        signal.signal(signal.SIGINT, sigint_handler)
    assert raised.value.code == 1
    _assert_worker_gone(record)
    assert trainer.strategy.engine is None


class _KillWorker(Callback):
    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch
        self.killed_at: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx == self.at_batch:
            os.kill(trainer.strategy.engine.worker_pid, signal.SIGKILL)
            self.killed_at = time.monotonic()


def test_killed_worker_fails_the_fit_quickly() -> None:
    record, kill = RecordWorkerPid(), _KillWorker(at_batch=3)
    trainer = make_trainer(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **HOST_EVERY_STEP}, worker_timeout_s=5.0), callbacks=[record, kill]
    )
    with pytest.raises(HostWorkerError, match=r"host worker.*(died|signal 9)"):
        trainer.fit(TinyModule())
    assert time.monotonic() - kill.killed_at < 10.0
    _assert_worker_gone(record)
    assert trainer.strategy.engine is None


class _RecordCallbacks(Callback):
    def __init__(self) -> None:
        self.own_callbacks: list[int] = []

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.own_callbacks.append(sum(isinstance(c, (_SyncBoundaries, ZenFlowTelemetry)) for c in trainer.callbacks))

    def on_train_epoch_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.own_callbacks.append(sum(isinstance(c, (_SyncBoundaries, ZenFlowTelemetry)) for c in trainer.callbacks))


def test_the_same_trainer_fits_twice() -> None:
    record, callbacks = RecordWorkerPid(), _RecordCallbacks()
    module = TinyModule()
    trainer = make_trainer(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2),
        max_epochs=1,
        callbacks=[record, callbacks],
    )
    trainer.fit(module)
    after_first = weights(module)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module)
    assert trainer.global_step == 16
    assert len(module.train_losses) == 16
    assert all(not value.equal(after_first[name]) for name, value in weights(module).items()), "second fit trained"
    assert len(set(record.pids)) == 2, "each fit starts its own host worker"
    # none at on_fit_start (trainer.callbacks as plain Lightning has them), two while training, never stacked
    assert callbacks.own_callbacks == [0, 2, 0, 2]
    _assert_worker_gone(record)


class _DeepCopies(Callback):
    """Deep-copies the Trainer's callbacks, the LightningModule and the optimizers during the fit, as Lightning's
    own tests and callbacks (SWA, EMA) do."""

    def __init__(self) -> None:
        self.copies: list[object] = []
        self.worker_pids: list[int] = []

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.copies.append(copy.deepcopy(trainer.callbacks))

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.copies += [copy.deepcopy(trainer.callbacks), copy.deepcopy(pl_module)]
        self.worker_pids.append(trainer.strategy.engine.worker_pid)


def test_deep_copies_during_the_fit_change_nothing_and_leave_the_worker_alone() -> None:
    """A copy of ZenFlow's callbacks shares the strategy instead of copying its engine (whose copied pipe would
    close the worker's file descriptors and end the run); the fit's numbers are bitwise those of a fit without the
    copies, and the worker is the same process throughout."""
    knobs = {"topk_ratio": 0.25, "update_interval": 2, "full_warm_up_rounds": 0}
    plain = TinyModule()
    make_trainer(ZenFlowStrategy(**knobs), max_epochs=2).fit(plain)
    copier, pids = _DeepCopies(), RecordWorkerPid()
    module = TinyModule()
    trainer = make_trainer(ZenFlowStrategy(**knobs), max_epochs=2, callbacks=[copier, pids])
    trainer.fit(module)
    assert trainer.global_step == 16
    assert len(copier.copies) == 5
    assert set(copier.worker_pids) == set(pids.pids)
    assert len(pids.pids) == 1
    assert process_gone(pids.pids[0])
    assert not any(isinstance(c, _SyncBoundaries) for c in copier.copies[0]), "installed when training starts"
    copied_sync = [c for c in copier.copies[1] if isinstance(c, _SyncBoundaries)]
    assert copied_sync
    assert copied_sync[0].strategy is trainer.strategy
    for name, value in weights(module).items():
        assert torch.equal(value, weights(plain)[name]), name


class _CopyAtFitStart(Callback):
    """Lightning's ``test_restore.py::test_callbacks_state_fit_ckpt_path``: a copy of the Trainer's callbacks taken at
    ``on_fit_start``, where a progress bar already refers to the Trainer (and so to the strategy and its engine)."""

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.callbacks = copy.deepcopy(trainer.callbacks)
        self.engine_ran = trainer.strategy.engine is not None


@pytest.mark.parametrize(
    "knobs",
    [{"topk_ratio": 1.0, "full_warm_up_rounds": 0}, {"full_warm_up_rounds": 0, **HOST_EVERY_STEP}],
    ids=["device_only", "host"],
)
def test_a_copy_of_the_callbacks_at_fit_start_works_and_matches_the_callbacks_after_the_fit(knobs: dict) -> None:
    """The copy succeeds (the copied strategy holds no engine: none of the worker's handles is copied), the run is
    bitwise the run without it, and ``trainer.callbacks`` at ``on_fit_start`` and after the fit are the same list
    as in plain Lightning (ZenFlow's callbacks are there only while training runs)."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    plain = TinyModule()
    make_trainer(ZenFlowStrategy(**knobs)).fit(plain)
    capture, module = _CopyAtFitStart(), TinyModule()
    trainer = make_trainer(ZenFlowStrategy(**knobs), enable_progress_bar=True, callbacks=[capture, TQDMProgressBar()])
    trainer.fit(module)
    assert capture.engine_ran, "the engine runs at on_fit_start"
    copied_bar = next(c for c in capture.callbacks if isinstance(c, TQDMProgressBar))
    assert copied_bar.trainer is not trainer
    assert copied_bar.trainer.strategy.engine is None
    after = copy.deepcopy(trainer.callbacks)
    assert [type(c) for c in after] == [type(c) for c in capture.callbacks]
    assert_weights_equal(weights(module), weights(plain))


def test_the_learning_rate_finder_runs_and_the_fit_after_it_has_the_strategys_callbacks() -> None:
    """Lightning's learning-rate finder swaps the Trainer's callbacks for its own during its run and reads it back as
    the first; ZenFlow's callbacks stay out of that run and join the fit that follows."""
    from lightning.pytorch.tuner import Tuner

    callbacks, module = _RecordCallbacks(), TinyModule()
    trainer = make_trainer(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **HOST_EVERY_STEP}), callbacks=[callbacks])
    finder = Tuner(trainer).lr_find(module, min_lr=1e-4, max_lr=1e-1, num_training=6, early_stop_threshold=None)
    assert len(finder.results["lr"]) == 6
    trainer.fit(module)
    assert callbacks.own_callbacks[-2:] == [2, 2], "both epochs of the fit ran with ZenFlow's callbacks"


TWO_FITS = """
import lightning, torch, warnings
warnings.filterwarnings("ignore")
from lightning_helpers import RecordWorkerPid, TinyModule, make_trainer
from lightning_zenflow import ZenFlowStrategy
from lightning_zenflow.engine import spares
pids = []
for _ in range(2):
    record = RecordWorkerPid()
    make_trainer(ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25), max_epochs=1, callbacks=[record]).fit(
        TinyModule()
    )
    pids += record.pids
print("pids", *pids, "spares", *spares.spare_worker_pids())
"""


def test_a_second_fit_of_the_process_adopts_the_first_ones_worker_and_none_outlives_the_process() -> None:
    """In a process that has not chosen (a user's script), the strategy keeps the idle worker of a fit for the next
    fit (no second start: more than a second), and the worker ends with the process."""
    import subprocess
    import sys

    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-c", TWO_FITS], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split("pids", 1)[1].split()
    first, second, kept = int(words[0]), int(words[1]), [int(w) for w in words[3:]]
    assert first == second  # the second fit adopted the first one's worker
    assert kept == [first]  # idle after the second fit, as a spare
    deadline = time.monotonic() + 10
    while not process_gone(first) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(first), "the spare outlived its process"
