"""Nothing left behind: after a fit, a failed fit, a fit whose host worker was killed and a training process killed
outright, no process of theirs runs, no shared-memory segment of theirs stays in ``/dev/shm`` and no
``pymp-*`` folder (multiprocessing's listener sockets) stays in their temporary folder.

Each case runs in a process of its own whose ``TMPDIR`` is a fresh folder of the test: whatever multiprocessing or
the engine puts there is the case's, whatever else runs on the machine."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import json, os, signal, sys, time
import torch
from torch import nn
from lightning_zenflow import ZenFlowAdamW

case = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
optimizer = ZenFlowAdamW(model.parameters(), lr=1e-2, full_warm_up_rounds=0, update_interval=2)
for step in range(1, 13):
    nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 4:
        print(json.dumps({"pid": os.getpid(), "worker": optimizer.engine.worker_pid}), flush=True)
        if case == "failed":
            raise RuntimeError("a failure in the training loop")
        if case == "killed_worker":
            os.kill(optimizer.engine.worker_pid, signal.SIGKILL)
        if case == "killed_trainer":
            time.sleep(60)  # the test kills this process now
optimizer.close()
"""
CASES = {"fit": 0, "failed": 1, "killed_worker": 1, "killed_trainer": -signal.SIGKILL}
"""Each case and its exit status."""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: ended, awaiting its parent
    except OSError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc") or not os.path.isdir("/dev/shm"), reason="needs Linux /proc, /dev/shm")
@pytest.mark.parametrize("case", list(CASES))
def test_nothing_is_left_behind(case: str, tmp_path: pathlib.Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        announced = json.loads(child.stdout.readline() or "{}")  # a pipe wait: the script prints at step 4
        if case == "killed_trainer":
            child.kill()
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert announced, f"the script did not reach step 4: {stderr[-3000:]}"
    assert child.returncode == CASES[case], stderr[-3000:]
    if case == "killed_worker":
        assert "HostWorkerError" in stderr
    family = {announced["pid"], announced["worker"]}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(pid) for pid in family):
        time.sleep(0.05)  # the worker follows a killed trainer within a second (PR_SET_PDEATHSIG)
    assert all(_gone(pid) for pid in family), f"still running: {[pid for pid in family if not _gone(pid)]}"
    segments = [name for name in os.listdir("/dev/shm") if any(f"torch_{pid}_" in name for pid in family)]
    assert not segments, segments
    left = sorted(path.name for path in temporary.iterdir() if path.name.startswith("pymp-"))
    assert not left, f"multiprocessing's folders left in TMPDIR: {left}"
