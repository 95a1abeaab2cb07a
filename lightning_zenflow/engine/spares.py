"""Spare host workers: a closed engine's worker kept for the next engine of this process (opt-in).

Spawning a worker imports torch in the new process: seconds. A process that builds many engines one after another
(a test suite, a notebook re-running a cell) can opt in with :func:`keep_spare_workers`: a worker whose engine
closed cleanly drops every reference to that engine's buffers, says so, and waits here until the next engine
adopts it with its own spec (``engine/host.py``, the ``release`` and ``adopt`` commands). Off by default: then a
closed engine leaves no process behind. Spares die with this process (``PR_SET_PDEATHSIG``) and are stopped at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection
import multiprocessing.process

MAX_SPARES = 2
_spares: list[tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]] = []
_wanted = False


def keep_spare_workers(enabled: bool) -> None:
    """Opt in (``True``) to keeping closed engines' workers as spares for the next engines of this process;
    ``False`` stops the spares kept so far."""
    global _wanted
    _wanted = bool(enabled)
    if not enabled:
        stop_spare_workers()


def wanted() -> bool:
    return _wanted and len(_spares) < MAX_SPARES


def keep(process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection) -> None:
    """A released worker (it answered ``released``) becomes a spare."""
    _spares.append((process, conn))


def adopt(command: tuple) -> tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection] | None:
    """Send ``command`` (the adoption, with the new engine's spec) to a live spare and return it; None if none."""
    while _wanted and _spares:
        process, conn = _spares.pop()
        try:
            if not process.is_alive():
                raise OSError("the spare exited")
            conn.send(command)
        except (OSError, ValueError):
            _stop(process, conn)
            continue
        return process, conn
    return None


def spare_worker_pids() -> list[int]:
    """The pids of the spare workers waiting for an engine."""
    return [process.pid for process, _ in _spares if process.pid is not None]


def stop_spare_workers() -> None:
    """Stop every spare worker (also at interpreter exit)."""
    while _spares:
        _stop(*_spares.pop())


def _stop(process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(("stop",))
    process.join(2.0)  # process join: a spare exits as soon as it reads "stop"
    if process.is_alive():
        process.kill()
        process.join(2.0)  # process join: reap the killed spare
    conn.close()
    process.close()


atexit.register(stop_spare_workers)
