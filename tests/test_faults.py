"""Limits and faults of real machines: a small /dev/shm, a preemption notice (SIGTERM), a killed trainer (SIGKILL),
a corrupt or foreign checkpoint, a checkpoint saved with other knobs.

Each fault must end clearly (one error naming the figures or the file, and the fix) and leave nothing behind (no
process, no shared memory). Two tests run a training script in a child process, to signal or kill it as a cluster
would (about 5 s each); the rest run in this process.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning_helpers import RecordWorkerPid, TinyModule, assert_weights_equal, make_trainer, weights
from torch import nn

from lightning_zenflow import ZenFlowStrategy
from lightning_zenflow.checkpoints.hooks import CheckpointError
from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine import preflight as preflight_module
from lightning_zenflow.engine.layout import HostFormat, allocate_host_buffers, build_layout
from lightning_zenflow.engine.preflight import HostResourceError, MachineResources, check_host_resources

pytestmark = pytest.mark.usefixtures("no_leaked_children")

TESTS_DIR = pathlib.Path(__file__).parent
MiB = 1 << 20


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan whose new parent has not reaped it: it holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _shm_used() -> int:
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# --------------------------------------------------------------------------------------------- preflight
def _wide_engine(**knobs: Any) -> ZenFlowEngine:
    """A 4096 x 4096 matrix: 96 MiB of host state (6 B per element: bf16 moments and window row)."""
    layer = nn.Linear(4096, 4096)
    return ZenFlowEngine(torch.optim.AdamW(layer.parameters()), ZenFlowConfig(**{"full_warm_up_rounds": 0, **knobs}))


def _machine(**figures: Any) -> MachineResources:
    plenty = 1 << 40
    defaults = {
        "shm_free_bytes": plenty,
        "shm_total_bytes": plenty,
        "ram_available_bytes": plenty,
        "ram_source": "MemAvailable",
        "memlock_soft_bytes": None,
        "memlock_hard_bytes": None,
    }
    return MachineResources(**{**defaults, **figures})


def test_a_small_dev_shm_fails_before_anything_is_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_module, "measure_machine", lambda: _machine(shm_free_bytes=64 * MiB))
    engine = _wide_engine()
    with pytest.raises(HostResourceError) as raised:
        engine.start()
    message = str(raised.value)
    assert "96.0 MiB of shared memory" in message  # what it needs
    assert "x 6 B" in message  # per element of the host format
    assert "only 64.0 MiB free" in message  # what the machine has
    assert "--shm-size=2g" in message
    assert "/dev/shm" in message
    assert "RAM" not in message  # only what is short
    assert not hasattr(engine, "host_buffers"), "nothing may be allocated (and no worker started: see the fixture)"


def test_shared_memory_and_ram_shortfalls_are_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    short = _machine(shm_free_bytes=10 * MiB, ram_available_bytes=50 * MiB, ram_source="the container's limit")
    monkeypatch.setattr(preflight_module, "measure_machine", lambda: short)
    with pytest.raises(HostResourceError) as raised:
        _wide_engine().start()
    message = str(raised.value)
    assert message.count("ZenFlow cannot start") == 1
    assert "only 10.0 MiB free" in message
    assert "only 50.0 MiB is available (the container's limit)" in message
    needed_ram = float(message.split(" of RAM")[0].split("need ")[-1].split()[0])
    assert 96 < needed_ram < 96 + 2 * 64 + 16 + 1, "RAM need: the host state plus the worker's fixed buffers"
    monkeypatch.setenv(preflight_module.SKIP_ENV, "1")  # the escape hatch the message names
    assert preflight_module.SKIP_ENV in message
    check_host_resources(_wide_engine().layout, torch.device("cpu"))


def test_pinning_limit_is_raised_to_the_hard_limit_or_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA only pins, but the decision needs no GPU: the layout and the device type are enough."""
    calls = []
    monkeypatch.setattr(preflight_module.resource, "setrlimit", lambda which, limits: calls.append(limits))
    layout = _wide_engine().layout
    cuda = torch.device("cuda")
    pinned = 2 * 4096 * 4096  # the bf16 window row: the moments are never copied asynchronously
    # a soft limit below the need, an unlimited hard one: raised quietly
    check_host_resources(layout, cuda, _machine(memlock_soft_bytes=64 * 1024, memlock_hard_bytes=None))
    assert calls == [(pinned, preflight_module.resource.RLIM_INFINITY)]
    # the hard limit is below the need too: raised as far as allowed, and a warning with both figures and the fix
    calls.clear()
    with pytest.warns(UserWarning, match=r"page-locks 32\.0 MiB.*ulimit -l\) is 8\.0 MiB.*ulimit -l unlimited"):
        check_host_resources(layout, cuda, _machine(memlock_soft_bytes=64 * 1024, memlock_hard_bytes=8 * MiB))
    assert calls == [(8 * MiB, 8 * MiB)]
    # the CPU pins nothing
    calls.clear()
    check_host_resources(layout, torch.device("cpu"), _machine(memlock_soft_bytes=0, memlock_hard_bytes=0))
    assert calls == []


def test_a_real_64_mib_dev_shm(tmp_path: pathlib.Path) -> None:
    """Docker's default /dev/shm, for real: a private mount namespace with a 64 MiB tmpfs on /dev/shm."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"):
        pytest.skip("needs root and unshare(1) to mount a small tmpfs on /dev/shm in a private mount namespace")
    script = tmp_path / "start.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            import torch
            from lightning_zenflow.config import ZenFlowConfig
            from lightning_zenflow.engine import ZenFlowEngine
            layer = torch.nn.Linear(4096, 4096)
            for skip in ("", "1"):  # with the check, then without it
                os.environ["{preflight_module.SKIP_ENV}"] = skip
                try:
                    ZenFlowEngine(torch.optim.AdamW(layer.parameters()), ZenFlowConfig(full_warm_up_rounds=0)).start()
                except Exception as error:
                    print(type(error).__name__, error)
            """
        )
    )
    run = f'mount -t tmpfs -o size=64m tmpfs /dev/shm && "{sys.executable}" {script}'
    result = subprocess.run(["unshare", "-m", "sh", "-c", run], capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "mount" in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    checked, unchecked = result.stdout.strip().splitlines()
    # with the check: the figures and the fix, before torch tries
    assert checked.startswith("HostResourceError ZenFlow cannot start"), checked
    assert "96.0 MiB of shared memory" in checked
    assert "64.0 MiB free of 64.0 MiB" in checked
    # without it, torch's own failure still comes out as one clear error (never a half-built engine)
    assert unchecked.startswith("HostResourceError ZenFlow could not allocate 64.0 MiB"), unchecked
    # torch's own words: "No space left on device" (torch 2.13), "unable to allocate shared memory" (torch 2.11)
    assert "No space left on device" in unchecked or "unable to allocate shared memory" in unchecked, unchecked
    assert "--shm-size" in unchecked


# ----------------------------------------------------------------------------------- built in place, once
def test_host_state_is_built_in_shared_memory_without_a_private_copy() -> None:
    """The peak resident memory of building a 48 MiB host state (the exact state with a master: fp32 moments and
    master) stays well under its size (only the master row is written); ``torch.zeros(...).share_memory_()``,
    measured the same way, doubles it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM, the peak resident set, to the current one
    except OSError:
        pytest.skip("needs /proc/self/clear_refs to reset the peak resident set")
    weight = nn.Parameter(torch.randn(2048, 2048))
    layout = build_layout([{"params": [weight]}], {id(weight): "weight"})
    host_format = HostFormat.resolve("fp32", master=True, accumulate_on="device")
    block_bytes = host_format.state_bytes * weight.numel()

    def peak_growth(build) -> tuple[int, Any]:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        before = _status_bytes("VmHWM")
        built = build()
        return _status_bytes("VmHWM") - before, built

    growth, (host,) = peak_growth(lambda: allocate_host_buffers(layout, host_format))
    rows = (host.master, host.exp_avg, host.exp_avg_sq)
    assert all(row.is_shared() for row in rows)
    assert sum(row.nbytes for row in rows) == block_bytes
    assert torch.equal(host.master.view(2048, 2048), weight.detach())
    assert torch.count_nonzero(host.exp_avg) == torch.count_nonzero(host.exp_avg_sq) == 0  # read as zeros
    assert growth < 0.5 * block_bytes, f"building the block peaked {growth / MiB:.0f} MiB above where it started"
    del host
    # the control: the old recipe, a private tensor then a shared copy, is seen by the same measurement
    control, block = peak_growth(lambda: torch.zeros(3, weight.numel()).share_memory_())
    assert control > 1.8 * block_bytes, f"the control peaked only {control / MiB:.0f} MiB"
    del block


# ----------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A ZenFlow checkpoint of TinyModule after 2 epochs (16 steps)."""
    directory = tmp_path_factory.mktemp("saved")
    checkpoint = ModelCheckpoint(dirpath=directory, filename="good", save_top_k=1)
    trainer = make_trainer(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=3),
        root_dir=directory,
        enable_checkpointing=True,
        callbacks=[checkpoint],
    )
    trainer.fit(TinyModule())
    return directory / "good.ckpt"


def _resume(path: pathlib.Path, module: lightning.LightningModule | None = None, **knobs: Any) -> Any:
    module = module if module is not None else TinyModule()
    trainer = make_trainer(ZenFlowStrategy(**{"full_warm_up_rounds": 0, **knobs}), max_epochs=3)
    trainer.fit(module, ckpt_path=path)
    return trainer


def _damaged(kind: str, good: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    data = good.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(bytes(range(256)) * 8)
    else:  # a torch file, but not a Lightning checkpoint
        torch.save({"weights": torch.zeros(3)}, path)
    return path


@pytest.mark.parametrize("kind", ["truncated", "empty", "garbage", "not_lightning"])
def test_unreadable_checkpoint_names_the_file_and_touches_nothing(
    kind: str, saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = _damaged(kind, saved, tmp_path / f"{kind}.ckpt")
    module = TinyModule()
    before = weights(module)
    with pytest.raises(CheckpointError) as raised:
        _resume(path, module)
    message = str(raised.value)
    assert str(path) in message
    if kind == "not_lightning":
        assert "not a Lightning checkpoint" in message
    else:
        assert f"({path.stat().st_size} bytes)" in message
        assert "truncated or corrupt" in message
        assert "Resume from another checkpoint" in message
    assert_weights_equal(weights(module), before)


class _Wider(TinyModule):
    """TinyModule with 32 hidden units instead of 16, and its last layer renamed."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(inputs))


def test_checkpoint_of_another_model_says_what_differs(saved: pathlib.Path) -> None:
    module = _Wider()
    before = weights(module)
    with pytest.raises(CheckpointError) as raised:
        _resume(saved, module)
    message = str(raised.value)
    assert str(saved) in message
    assert "the model has head.bias, head.weight that the checkpoint lacks" in message
    assert "the checkpoint has net.2.bias, net.2.weight that the model lacks" in message
    assert "net.0.weight: checkpoint (16, 8), model (32, 8)" in message
    assert_weights_equal(weights(module), before)


def _edited(saved: pathlib.Path, path: pathlib.Path, edit) -> pathlib.Path:
    checkpoint = torch.load(saved, weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c["zenflow"]["params"].pop("net.2.weight"), None),  # the engine's load names it (below)
        (
            lambda c: c["zenflow"]["params"].__setitem__("extra.weight", c["zenflow"]["params"]["net.0.weight"]),
            "the checkpoint has extra.weight, the model does not",
        ),
        (
            lambda c: c["zenflow"]["params"]["net.0.weight"].__setitem__("master", torch.zeros(8, 16)),
            "net.0.weight (master): checkpoint (8, 16), model (16, 8)",
        ),
        (
            lambda c: c["zenflow"]["params"]["net.0.weight"].__setitem__("selected", torch.tensor([3, 1])),
            "selected columns of net.0.weight are not ascending distinct indices",
        ),
        (lambda c: c["zenflow"]["progress"].pop("pending"), "progress lacks ['pending']"),
    ],
    ids=["missing", "unexpected", "shape", "selection", "progress"],
)
def test_engine_state_that_does_not_fit_is_refused_before_loading(
    edit, expected: str | None, saved: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = _edited(saved, tmp_path / "edited.ckpt", edit)
    module = TinyModule()
    before = weights(module)
    record = RecordWorkerPid()
    trainer = make_trainer(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=3), callbacks=[record]
    )
    with pytest.raises(CheckpointError) as raised:
        trainer.fit(module, ckpt_path=path)
    message = str(raised.value)
    assert message.startswith(f"cannot resume from {path}: ")
    if expected is None:
        # a missing entry cannot be told from a subset optimizer before the optimizer exists: the engine's load
        # (which validates everything before it writes) refuses it, naming the file too
        assert "the model has net.2.weight, the checkpoint does not" in message
    else:
        assert expected in message
        assert_weights_equal(weights(module), before)  # refused before Lightning loaded the weights
    assert not record.pids, "the fit never reached training"


# ------------------------------------------------------------------------------------- knobs on resume
COLUMNS = 20
# the paper's rule (interim_step=0) in the exact state: these check that moving state between the sides loses nothing
# (tests/test_interim.py: the interim moves; in the compact state a column leaving the device rounds its moments)
BASE = {
    "update_interval": 4,
    "select_strategy": "step",
    "select_interval": 100,
    "accumulate_on": "device",
    "interim_step": 0,
    "host_state": "fp32",
}


def _knob_engine(topk_ratio: float, **knobs: Any) -> tuple[nn.Linear, ZenFlowEngine]:
    torch.manual_seed(0)
    layer = nn.Linear(COLUMNS, 16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    names = {param: name for name, param in layer.named_parameters()}
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=topk_ratio, **{**BASE, **knobs})
    return layer, ZenFlowEngine(optimizer, config, param_names=names).start()


def _random_step(layer: nn.Linear, engine: ZenFlowEngine, generator: torch.Generator, scale: float = 1.0):
    layer.weight.grad = scale * torch.randn(layer.weight.shape, generator=generator)
    layer.bias.grad = scale * torch.randn(layer.bias.shape, generator=generator)
    return engine.step()


@pytest.fixture(scope="module")
def mid_window_state() -> dict:
    """rho 0.5 (10 of 20 columns), S 4, after 6 steps: 2 steps into a window, the last window's update pending."""
    layer, engine = _knob_engine(0.5)
    generator = torch.Generator().manual_seed(0)
    with engine:
        for _ in range(6):
            _random_step(layer, engine, generator)
        state = engine.state_dict()
    assert state["progress"]["steps_in_window"] == 2
    assert state["progress"]["pending"] is not None
    return state


def _weight_state(engine: ZenFlowEngine) -> dict:
    return engine.state_dict()["params"]["weight"]


def test_a_smaller_topk_ratio_keeps_the_strongest_saved_columns(mid_window_state: dict) -> None:
    saved = mid_window_state["params"]["weight"]
    layer, engine = _knob_engine(0.25)
    with engine:
        engine.load_state_dict(copy.deepcopy(mid_window_state))
        state = _weight_state(engine)
        k = num_selected_columns(COLUMNS, 0.25)
        chosen = state["selected"]
        assert chosen.numel() == k == 5
        # the saved columns with the largest second moments, ascending
        score = saved["exp_avg_sq"].sum(dim=0)
        expected = saved["selected"][torch.sort(score[saved["selected"]], descending=True, stable=True).indices[:k]]
        assert torch.equal(chosen, torch.sort(expected).values)
        # nothing of the optimizer state changed, only which side holds it
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved[key]), key
        assert (state["device_step"], state["host_step"]) == (saved["device_step"], saved["host_step"])
        # the columns that left the device start the open window from zero: their gradients are applied already
        layer.weight.grad = torch.zeros_like(layer.weight)
        layer.bias.grad = torch.zeros_like(layer.bias)
        engine.step()  # adds nothing to the window (and does not end it)
        engine.wait_idle()
        window = engine.window_sums()["weight"]
        leaving = saved["selected"][~torch.isin(saved["selected"], chosen)]
        staying_on_host = torch.ones(COLUMNS, dtype=torch.bool)
        staying_on_host[saved["selected"]] = False
        assert torch.count_nonzero(window[:, leaving]) == 0
        assert torch.equal(window[:, staying_on_host], saved["grad_acc"][:, staying_on_host])


def test_a_larger_topk_ratio_and_a_new_update_interval_take_effect_at_once(mid_window_state: dict) -> None:
    saved = mid_window_state["params"]["weight"]
    layer, engine = _knob_engine(0.75, update_interval=2)
    generator = torch.Generator().manual_seed(1)
    with engine:
        engine.load_state_dict(copy.deepcopy(mid_window_state))
        state = _weight_state(engine)
        assert state["selected"].numel() == num_selected_columns(COLUMNS, 0.75) == 15
        assert torch.isin(saved["selected"], state["selected"]).all(), "a larger k keeps every saved column"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved[key]), key
        # the columns entering the device take the step in flight into their masters at once (the weights are the
        # masters of host columns: the step would have landed on them); every other master is as saved
        scale = mid_window_state["progress"]["pending"]["scales"][0][0]
        entering = ~torch.isin(state["selected"], saved["selected"])
        columns = state["selected"][entering]
        expected = saved["master"].clone()
        expected[:, columns] = saved["master"][:, columns] * scale + saved["step"][:, columns]
        torch.testing.assert_close(state["master"], expected, rtol=0, atol=1e-7)
        # S = 2 now: the window open at the save (2 steps) closes at the next step, then every 2 steps
        stats = [_random_step(layer, engine, generator) for _ in range(5)]
        assert [s.window_end for s in stats] == [True, False, True, False, True]
        assert all(s.update_interval == 2 for s in stats)
        engine.flush()
        assert all(torch.isfinite(p).all() for p in layer.parameters())


def test_topk_ratio_one_takes_the_pending_update_into_the_device_masters(mid_window_state: dict) -> None:
    layer, engine = _knob_engine(1.0)
    generator = torch.Generator().manual_seed(2)
    with engine:
        assert engine.worker_pid is None, "rho = 1 needs no host worker"
        engine.load_state_dict(copy.deepcopy(mid_window_state))
        assert engine.schedule.pending is None, "nothing is left on the host to land"
        state = _weight_state(engine)
        assert torch.equal(state["selected"], torch.arange(COLUMNS))
        # the step in flight landed at the load on the saved host columns (the weights are their masters), as it
        # would have at its landing; the saved device columns are as they were
        saved = mid_window_state["params"]["weight"]
        scale = mid_window_state["progress"]["pending"]["scales"][0][0]
        landed = saved["master"] * scale + saved["step"]
        was_device = torch.zeros(COLUMNS, dtype=torch.bool)
        was_device[saved["selected"]] = True
        expected = torch.where(was_device, saved["master"], landed)
        torch.testing.assert_close(state["master"], expected, rtol=0, atol=1e-7)
        for _ in range(3):
            _random_step(layer, engine, generator)
        engine.flush()
        assert torch.equal(layer.weight.detach(), engine.state_dict()["params"]["weight"]["master"])


class _SelectionSizes(Callback):
    def __init__(self) -> None:
        self.sizes: list[list[int]] = []

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.sizes.append([s.k for s in trainer.strategy.engine.device_updater.matrix_states()])


def test_lightning_resumes_with_other_knobs(saved: pathlib.Path) -> None:
    sizes = _SelectionSizes()
    module = TinyModule()
    trainer = make_trainer(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.5, update_interval=2), max_epochs=3, callbacks=[sizes]
    )
    trainer.fit(module, ckpt_path=saved)
    assert trainer.global_step == 24
    assert sizes.sizes == [[num_selected_columns(8, 0.5), num_selected_columns(16, 0.5)]]
    assert all(torch.isfinite(value).all() for value in weights(module).values())


# -------------------------------------------------------------------------------------------- SIGTERM
class _SigtermAt(Callback):
    """Sends this process SIGTERM, as a cluster's preemption notice would, when a batch starts at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


MID_WINDOW = {
    "topk_ratio": 0.25,
    "update_interval": 4,
    "sync_on": (),
    "select_strategy": "step",
    "select_interval": 100,
}
SYNC_AT_CHECKPOINT = {"topk_ratio": 0.25, "update_interval": 4, "sync_on": ("checkpoint", "validation")}


def _fit(knobs: dict, directory: pathlib.Path, callbacks: list[Callback], ckpt_path: pathlib.Path | None = None):
    module = TinyModule(samples=20)  # 5 steps per epoch
    every_epoch = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)
    trainer = make_trainer(
        ZenFlowStrategy(**{"full_warm_up_rounds": 0, **knobs}),
        root_dir=directory,
        max_epochs=4,
        enable_checkpointing=True,
        callbacks=[every_epoch, *callbacks],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("knobs", [MID_WINDOW, SYNC_AT_CHECKPOINT], ids=["mid_window_pending", "sync_on_checkpoint"])
def test_sigterm_ends_the_fit_cleanly_and_its_checkpoint_resumes_exactly(knobs: dict, tmp_path: pathlib.Path) -> None:
    """The notice arrives during the last batch of epoch 2: Lightning stops after it (a plain DataLoader restarts an
    interrupted epoch, so only an epoch boundary resumes exactly, with any strategy). With ``sync_on=()`` step 10
    is 2 steps into a window with a computed host update not yet applied; ``sync_on=("checkpoint", ...)`` applies it."""
    uninterrupted, _ = _fit(knobs, tmp_path / "a", [])
    handler_before = signal.getsignal(signal.SIGTERM)
    record = RecordWorkerPid()
    with pytest.raises(SIGTERMException):
        _fit(knobs, tmp_path / "b", [_SigtermAt(9), OnExceptionCheckpoint(tmp_path / "b"), record])
    assert record.pids
    assert all(_gone(pid) for pid in record.pids), "the host worker was stopped"
    assert signal.getsignal(signal.SIGTERM) == handler_before, "Lightning restored the SIGTERM handler"
    saved = tmp_path / "b" / "on_exception.ckpt"
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["global_step"] == 10
    progress = checkpoint["zenflow"]["progress"]
    assert progress["steps_in_window"] == 2
    assert (progress["pending"] is not None) == (knobs is MID_WINDOW)
    resumed, trainer = _fit(knobs, tmp_path / "c", [], ckpt_path=saved)
    assert trainer.global_step == 20
    assert_weights_equal(weights(resumed), weights(uninterrupted))


# -------------------------------------------------------------------------- a training process, signalled
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from torch import nn
from lightning_helpers import TinyModule, make_trainer
from lightning_zenflow import ZenFlowStrategy

class Wide(TinyModule):  # 1.1 M matrix elements: 6.3 MiB of host state in shared memory (6 B per element)
    def __init__(self):
        super().__init__(samples=100000)
        self.net = nn.Sequential(nn.Linear(8, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 4))

class Announce(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            print(json.dumps({"worker": trainer.strategy.engine.worker_pid}), flush=True)

strategy = ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.1, update_interval=2)
trainer = make_trainer(strategy, root_dir=sys.argv[1], max_epochs=1000, enable_checkpointing=True,
                       callbacks=[Announce(), OnExceptionCheckpoint(sys.argv[1])])
trainer.fit(Wide())
"""
HOST_STATE_BYTES = 6 * (1024 * 1024 + 8 * 1024 + 1024 * 4)
"""The compact state's bf16 moments and window row, 6 B per matrix element."""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    children.setdefault(int(stat.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found


def _announced_worker(child: subprocess.Popen, budget_s: float) -> int | None:
    """The host worker's pid, once the training script prints it (None if it does not within ``budget_s``)."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        # a pipe wait, bounded: the script may fail before it prints anything
        ready, _, _ = select.select([child.stdout], [], [], 0.5)
        if ready:
            line = child.stdout.readline()
            if not line:
                return None  # the script ended
            if line.startswith("{"):
                return json.loads(line)["worker"]
    return None


def _wait_until(condition, budget_s: float) -> float | None:
    """Seconds until ``condition()`` held (polled every 50 ms), or None if it did not within ``budget_s``."""
    started = time.monotonic()
    while time.monotonic() - started < budget_s:
        if condition():
            return time.monotonic() - started
        time.sleep(0.05)
    return None


@pytest.mark.skipif(not os.path.isdir("/proc") or not os.path.isdir("/dev/shm"), reason="needs Linux /proc, /dev/shm")
@pytest.mark.parametrize("how", ["sigterm_to_the_process_group", "sigkill"])
def test_a_signalled_training_process_leaves_no_process_and_no_shared_memory(how: str, tmp_path: pathlib.Path) -> None:
    """SIGTERM goes to the whole process group, as SLURM sends it (the host worker gets it too, and must leave the
    shutdown to the trainer); SIGKILL only to the trainer, whose worker must follow it within seconds."""
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr_file:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), str(TESTS_DIR)],
            stdout=subprocess.PIPE,
            stderr=stderr_file,  # a file, not a pipe: nobody reads it while the child runs
            text=True,
            start_new_session=True,  # its own process group, as a job step has
        )
    try:
        worker = _announced_worker(child, budget_s=120)
        assert worker is not None, f"the training script did not start: {stderr_path.read_text()[-3000:]}"
        family = _descendants(child.pid)
        assert worker in family
        with open(f"/proc/{worker}/maps") as maps:
            assert "/dev/shm/" in maps.read(), "the worker maps the shared host state"
        used_while_running = _shm_used()
        if how == "sigkill":
            os.kill(child.pid, signal.SIGKILL)
        else:
            os.killpg(child.pid, signal.SIGTERM)
        signalled_at = time.monotonic()
        returncode = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    stderr = stderr_path.read_text()
    all_gone_s = _wait_until(lambda: all(_gone(pid) for pid in family), budget_s=10)
    assert all_gone_s is not None, f"left behind: {[pid for pid in family if not _gone(pid)]}"
    released_s = _wait_until(lambda: _shm_used() <= used_while_running - 0.9 * HOST_STATE_BYTES, budget_s=10)
    assert released_s is not None, "the shared host state was not released"
    assert not [name for name in os.listdir("/dev/shm") if any(f"torch_{pid}_" in name for pid in family | {child.pid})]
    if how == "sigkill":
        assert returncode == -signal.SIGKILL
        assert time.monotonic() - signalled_at < 5.0, "the worker outlived its trainer by seconds"
    else:
        assert returncode == 0, stderr[-3000:]  # Lightning's SIGTERMException is a SystemExit without a code
        assert "HostWorkerError" not in stderr
        checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
        assert checkpoint["global_step"] >= 5
        assert "zenflow" in checkpoint
