"""Ranks forked from a process that imported Lightning once, for the data-parallel tests' numeric fits.

A two-rank fit through Lightning's subprocess launcher starts two interpreters, each importing torch and Lightning
(about 7 s of CPU each on 2 cores). The fits that only compare numbers start their ranks here instead: one zygote
process per test process imports ``ddp_script`` (Lightning, torch, the package) and, per request, forks one process
per rank with the environment a cluster launcher (torchrun, SLURM) gives it (``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``), so Lightning sees processes created externally and launches none.
Each rank runs ``ddp_script.run`` (a batch of fits) and writes its output to ``OUT_DIR/rank{r}.log``. The ranks'
host workers are spawned, as any rank's are. The tests of Lightning's own launcher, of faults and of signals run
``ddp_script.py`` as a script.

    python tests/rank_zygote.py      # reads one JSON request per line, answers one JSON line per request
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).parent
GRACE_S = 10.0
"""After a rank fails, how long the others get to fail or finish on their own before they are killed."""


def _run_rank(rank: int, world: int, port: int, out: pathlib.Path, options: dict) -> int:
    """In a forked child: become rank ``rank`` of ``world`` and run the fits; the exit status."""
    import ddp_script

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a rank dies with the zygote, never outlives it
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    try:
        ddp_script.run(out, options)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _serve_one(request: dict) -> dict:
    out, world, options = pathlib.Path(request["out"]), int(request["world"]), request["options"]
    out.mkdir(parents=True, exist_ok=True)
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_rank(rank, world, int(request["port"]), out, options)
            finally:
                os._exit(code)  # never return into this loop: the child's work is done
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + float(request["timeout_s"])
    failed_at = None
    while len(codes) < len(pids):
        for pid in pids:
            done, status = (0, 0) if pid in codes else os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        if failed_at is None and any(code != 0 for code in codes.values()):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)
    return {"codes": [codes[pid] for pid in pids], "logs": [str(out / f"rank{rank}.log") for rank in range(world)]}


def serve() -> None:
    import ddp_script  # noqa: F401  (imported once here; every rank is forked with it)

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_serve_one(json.loads(line))), flush=True)


class Zygote:
    """The test process's side: one zygote started on first use, stopped at exit (or when this process dies: it reads
    end-of-file on its stdin)."""

    _process: subprocess.Popen | None = None

    @classmethod
    def run(cls, out: pathlib.Path, options: dict, world: int, timeout_s: float) -> dict:
        """Fork ``world`` ranks that run ``ddp_script.run(out, options)``; their exit codes and log paths."""
        from distributed_helpers import free_port

        process = cls._started()
        assert process.stdin is not None
        assert process.stdout is not None
        request = {"out": str(out), "options": options, "world": world, "port": free_port(), "timeout_s": timeout_s}
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            answer = process.stdout.readline()
        except BaseException:
            cls.stop()  # interrupted mid-request: its answer would be read by the next request
            raise
        if not answer:
            cls._process = None
            raise RuntimeError(f"the rank zygote exited with status {process.wait()}")
        return json.loads(answer)

    @classmethod
    def _started(cls) -> subprocess.Popen:
        if cls._process is not None and cls._process.poll() is None:
            return cls._process
        env = {
            key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")
        }
        env.pop("PYTEST_CURRENT_TEST", None)
        cls._process = subprocess.Popen(
            [sys.executable, str(HERE / "rank_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(HERE.parent),
        )
        assert cls._process.stdout is not None
        ready = cls._process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the rank zygote did not start (exit status {cls._process.wait()})")
        atexit.register(cls.stop)
        return cls._process

    @classmethod
    def stop(cls) -> None:
        process, cls._process = cls._process, None
        if process is None:
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    serve()
