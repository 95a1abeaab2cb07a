"""Spare host workers: a closed engine's worker kept for the next engine of this process.

Spawning a worker imports torch in the new process: more than a second, which every ``Trainer.fit`` paid again. With
:func:`keep_spare_workers` on, a worker whose engine closed cleanly drops every reference to that engine's buffers,
says so, and waits here (idle, holding no shared block) until the next engine adopts it with its own spec
(``engine/host.py``, the ``release`` and ``adopt`` commands): a notebook's second ``fit``, a learning-rate finder, a
sweep of short runs start at once. Spares die with this process (``PR_SET_PDEATHSIG``) and are stopped at exit; a
worker that failed, or closed with an update in flight, is stopped, never kept.

Undecided (the default) until something decides: the Lightning strategy turns spares on for its process
(:func:`keep_spare_workers_by_default`) unless the program chose with :func:`keep_spare_workers` first;
``ZenFlowAdamW`` and a bare ``ZenFlowEngine`` leave the choice alone, so a plain loop's closed engine leaves no
process behind.

Such a process can also opt in with :func:`start_workers_preloaded`: new workers are then forked from
multiprocessing's fork server, which imported the worker's modules once for this process, so a start costs a fork
(milliseconds) instead of a fresh interpreter importing torch. The server starts with the first worker, keeps the
environment and CPU affinity this process had at that moment (every worker forked from it starts with them), and
exits with this process. Off by default (workers are spawned).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
from collections.abc import Sequence

import lightning_zenflow.engine.handoff as handoff

MAX_SPARES = 2
_spares: list[tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]] = []
_prestarted: set[int] = set()
"""The pids of spares started ahead of any engine (``host.prestart_worker``): adopted even while the program has not
decided on spares (a plain loop's first engine takes the worker started for it)."""
_wanted: bool | None = None
"""Whether closed engines' workers are kept: None until the program (or the Lightning strategy) decides."""
_preloaded = False
WORKER_MODULE = "lightning_zenflow.engine.host"


def keep_spare_workers(enabled: bool) -> None:
    """Opt in (``True``) to keeping closed engines' workers as spares for the next engines of this process;
    ``False`` stops the spares kept so far."""
    global _wanted
    _wanted = bool(enabled)
    if not enabled:
        stop_spare_workers()


def keep_spare_workers_by_default() -> None:
    """Keep spares unless the program has decided with :func:`keep_spare_workers` (the Lightning strategy's default:
    the next ``fit`` of this process adopts the worker instead of spawning one)."""
    global _wanted
    if _wanted is None:
        _wanted = True


def start_workers_preloaded(enabled: bool, also_preload: Sequence[str] = ()) -> None:
    """Opt in (``True``) to forking new host workers from multiprocessing's fork server (see the module's docstring)
    instead of spawning them. ``also_preload``: more modules for the server to import, for a process that forks
    processes of its own from the same server (the server's import list is one per process, read when it starts)."""
    global _preloaded
    _preloaded = bool(enabled) and "forkserver" in multiprocessing.get_all_start_methods()
    if _preloaded:
        multiprocessing.set_forkserver_preload([WORKER_MODULE, *also_preload])


def start_method() -> str:
    """How a new worker starts: ``"forkserver"`` once :func:`start_workers_preloaded` opted in, else ``"spawn"``."""
    return "forkserver" if _preloaded else "spawn"


def wanted() -> bool:
    return bool(_wanted) and len(_spares) < MAX_SPARES


def keep(
    process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection, prestarted: bool = False
) -> None:
    """A released worker (it answered ``released``), or one started ahead of its engine (``prestarted``), becomes a
    spare."""
    _spares.append((process, conn))
    if prestarted and process.pid is not None:
        _prestarted.add(process.pid)


def may_prestart() -> bool:
    """Whether a worker may be started ahead of its engine: the program has not turned spares off, no spare waits
    already, and this is a main program (not a host worker, not a child of another process)."""
    return (
        _wanted is not False
        and not _spares
        and os.environ.get("LIGHTNING_ZENFLOW_HOST_WORKER") != "1"
        and multiprocessing.parent_process() is None
    )


def adopt(command: tuple) -> tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection] | None:
    """Send ``command`` (the adoption, with the new engine's spec) to a live spare and return it; None if none."""
    while _spares and (bool(_wanted) or _spares[-1][0].pid in _prestarted):
        process, conn = _spares.pop()
        _prestarted.discard(process.pid)
        try:
            if not process.is_alive():
                raise OSError("the spare exited")
            handoff.send(conn, command)
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
    _prestarted.clear()


def _stop(process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection) -> None:
    with contextlib.suppress(OSError, ValueError):
        handoff.send(conn, ("stop",))
    process.join(2.0)  # process join: a spare exits as soon as it reads "stop"
    if process.is_alive():
        process.kill()
        process.join(2.0)  # process join: reap the killed spare
    conn.close()
    process.close()


atexit.register(stop_spare_workers)


def spawned_children() -> set[int]:
    """Pids of the processes this process started through multiprocessing (the ZenFlow host worker is one): its
    children that ``spawn`` started, those the fork server forked for it (``start_workers_preloaded``), plus any
    child left as a zombie (exited but never joined).

    The resource tracker that ``spawn`` starts once per session is a child too, and so is the fork server: neither is
    a ``spawn_main`` process nor a zombie, so neither is counted.
    """
    if not os.path.isdir("/proc"):
        return set()
    me = os.getpid()
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
                state, ppid = stat_file.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline_file:
                table[int(entry)] = (state, int(ppid), cmdline_file.read())
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
    servers = {pid for pid, (_, ppid, cmdline) in table.items() if ppid == me and b"forkserver" in cmdline}
    found = set()
    for pid, (state, ppid, cmdline) in table.items():
        if (ppid == me and (state == "Z" or b"spawn_main" in cmdline)) or ppid in servers:
            found.add(pid)
    return found


def reap_children_since(before: set[int]) -> list[int]:
    """Kill and reap the host workers this process started since ``before`` (a :func:`spawned_children` result),
    spare workers excepted: what a test left behind. Returns their pids, sorted."""
    leaked = sorted(spawned_children() - before - set(spare_worker_pids()))
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return leaked
