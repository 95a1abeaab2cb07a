"""``strategies/rank_guard.py``: a SIGTERM that finds the main thread waiting in C++ (as in a collective whose peer
failed) ends the process after the guard's grace, its worker stopped first; a main thread that runs Python handles
the signal itself and the guard stands down."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from lightning_zenflow.strategies.rank_guard import StuckRankGuard

    out = pathlib.Path(sys.argv[1])
    guard = StuckRankGuard(lambda: (out / "worker_stopped").write_text("yes"))
    (out / "ready").write_text("yes")
    if sys.argv[2] == "stuck":
        # the main thread waits in C++ for a key nobody sets, as a rank waits in a collective for a failed peer
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=120))
        store.get("never")
    else:
        while True:
            time.sleep(0.05)  # Python runs between the sleeps: the handler runs at once
    """
)


@pytest.mark.parametrize("where", ["stuck", "python"])
def test_a_sigterm_ends_the_process_whether_or_not_its_main_thread_runs_python(
    tmp_path: pathlib.Path, where: str
) -> None:
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), where], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the script did not start"
            time.sleep(0.05)
        time.sleep(0.5)  # the main thread is in its wait now
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)  # far more than the guard's grace: a hang fails here
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 128 + signal.SIGTERM
    # stuck: the guard ended it, the worker first; running Python: the default SIGTERM handling, no guard
    assert (tmp_path / "worker_stopped").exists() == (where == "stuck")
