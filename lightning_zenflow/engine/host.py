"""The host worker: one spawned process per engine that runs AdamW over the shared host rows.

Protocol (one duplex pipe, one command at a time, at most one update in flight):

    main -> worker   ("update", seq, slot, [group jobs])                    run one AdamW step
                     ("attach", [window rows per group])                   use these window rows from now on
                     ("stop",)                                              exit cleanly
                     ("release",) then ("adopt", spec)                      become a spare, then serve the next
                                                                            engine (``keep_spare_workers``)
    worker -> main   ("ready", pid)                                         after start-up (or an adoption)
                     ("attached",)                                          after an attach
                     ("released",)                                          a spare, holding nothing
                     ("done", seq, compute_seconds)                         after an update
                     ("error", seq, traceback_text)                         the update raised

The step itself is ``engine/host_step.py``: one source in torch ops over the host layout (fp32 or bf16 moments, the
window row, a master where there is one), compiled into a fused C++ loop where a compiler is found. The worker builds
it right after it says "ready", while the training process runs its first steps. A heartbeat thread stamps a shared
clock every 0.2 s, so the main process notices a worker that died *or* stopped answering (frozen, stopped, swapped
out) within ``worker_timeout_s``, never hanging.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

import lightning_zenflow.engine.handoff as handoff
import lightning_zenflow.engine.spares as spares
from lightning_zenflow.engine.host_step import (
    UNPACK_SCRATCH_ELEMENTS,
    GroupJob,
    MatrixExtent,
    StepKernels,
    WorkerGroup,
    host_adam_update,
    unpack_accumulators,
)

__all__ = [
    "UNPACK_SCRATCH_ELEMENTS",
    "GroupJob",
    "HostWorker",
    "HostWorkerError",
    "MatrixExtent",
    "StepKernels",
    "WorkerGroup",
    "WorkerSpec",
    "host_adam_update",
    "unpack_accumulators",
]

HEARTBEAT_PERIOD_S = 0.2
WORKER_ENV = "LIGHTNING_ZENFLOW_HOST_WORKER"
_POLL_S = 0.05
DEATH_WAIT_S = 10.0
"""After the pipe to the worker broke, how long to wait for its exit status before reporting the broken pipe."""


class HostWorkerError(RuntimeError):
    """The host worker failed: it raised, died, or stopped answering."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process needs at start-up (picklable; tensors travel as shared memory)."""

    groups: tuple[WorkerGroup, ...]
    extents: tuple[tuple[MatrixExtent, ...], ...]
    heartbeat: torch.Tensor
    threads: int
    cores: tuple[int, ...] | None
    unselected: tuple[torch.Tensor, ...] = ()
    """Per group, shared int64: each matrix's host-bound column indices at its ``col_offset`` (host mode)."""
    kernel_mode: str = "auto"
    """How the step runs: ``interim_kernel``'s values (``engine/kernels.py``)."""
    delay_s: float = 0.0
    """Test hook: sleep this long before each update (a deliberately slow worker)."""
    fail_at_update: int | None = None
    """Test hook: raise inside the worker at this update (1-based), to exercise error propagation."""


def _die_with_parent() -> None:
    """Linux: get SIGKILL if the main process dies (a SIGKILLed trainer must not leave this worker behind).
    SIGKILL, since this worker ignores SIGTERM (see :func:`worker_main`)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the pipe's EOF still ends the worker once it is idle


def _heartbeat(heartbeat: torch.Tensor, stop: threading.Event) -> None:
    while not stop.is_set():
        heartbeat[0] = time.monotonic()
        stop.wait(HEARTBEAT_PERIOD_S)


def worker_main(conn: multiprocessing.connection.Connection, spec: WorkerSpec | None) -> None:
    """Entry point of the spawned worker process: serve one engine, then (a spare) the next, until told to stop."""
    # Ctrl-C reaches the whole process group, and so does a cluster's SIGTERM (SLURM signals every process of the
    # job): the main process handles both (Lightning saves, if asked, then tears down) and stops this worker itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    all_cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    # the spec travels in a box so that no frame but the serving one holds it: a spare drops its engine's shared
    # blocks while it waits
    box = [spec] if spec is not None else []
    del spec
    try:
        if not box:
            # the engine's spec comes through the pipe, so no frame of the start-up keeps it (see HostWorker)
            box.append(_wait_for_adoption(conn))
        # no local name holds a spec here: _serve takes it out of the box, and returns the next engine's (or None)
        while box[-1] is not None:
            box.append(_serve(conn, box, all_cores))
    finally:
        conn.close()
    # stopped by its engine: every thread is joined and the shared blocks belong to the main process; run
    # multiprocessing's finalizers (a semaphore the compiler made is unregistered), then skip the interpreter's
    # teardown of torch (about half a second at the end of every fit)
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(
    conn: multiprocessing.connection.Connection, box: list[WorkerSpec], all_cores: set[int] | None
) -> WorkerSpec | None:
    """Run one engine's updates. Returns the next engine's spec when this worker was released as a spare and then
    adopted, None when it should exit."""
    spec = box.pop()
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
    elif all_cores is not None:
        os.sched_setaffinity(0, all_cores)
    torch.set_num_threads(spec.threads)
    scratch = torch.empty(UNPACK_SCRATCH_ELEMENTS, dtype=torch.float32) if spec.unselected else None
    groups = spec.groups
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(spec.heartbeat, stop), daemon=True)
    beat.start()
    conn.send(("ready", os.getpid()))
    elements = sum(extent.numel for extents in spec.extents for extent in extents)
    # the step's build (seconds when compiled) runs on a thread of its own and overlaps the training's first steps:
    # this loop answers at once, and an update before the build is ready runs eagerly (the same bits) or waits
    kernels = StepKernels(spec.kernel_mode, elements, background=True)
    kernels.warm(groups)
    try:
        while True:
            # blocks until the main process sends the next command (or closes the pipe)
            try:
                command = handoff.receive(conn)
            except EOFError:
                return None
            if command[0] == "stop":
                return None
            if command[0] == "release":
                # the engine closed and keeps this process as a spare: drop every reference to its buffers
                stop.set()
                beat.join()  # thread join: the heartbeat no longer writes the released engine's clock
                spec = scratch = groups = None  # the kernels hold no engine buffer (their builds are kept)
                gc.collect()  # and any cycle that still holds one: the blocks are unmapped now
                conn.send(("released",))
                return _wait_for_adoption(conn)
            if command[0] == "builds":
                kernels.before_update(None)  # thread wait: the builder thread's builds in progress finish
                conn.send(("built",))
                continue
            if command[0] == "attach":
                # the accumulation mode was chosen: the window rows it sums into (their dtype may need a build)
                groups = tuple(dataclasses.replace(g, windows=tuple(w)) for g, w in zip(groups, command[1]))
                kernels.warm(groups)
                conn.send(("attached",))
                continue
            _, seq, slot, jobs = command
            try:
                started = time.perf_counter()
                if spec.delay_s:
                    time.sleep(spec.delay_s)  # inside the timed region: a slow host, as update_interval="auto" sees it
                if spec.fail_at_update is not None and seq == spec.fail_at_update:
                    raise RuntimeError(f"injected failure at host update {seq} (test hook fail_at_update)")
                for group_index, job in enumerate(jobs):
                    host_adam_update(
                        groups[group_index],
                        spec.extents[group_index],
                        slot,
                        job,
                        spec.unselected[group_index] if spec.unselected else None,
                        scratch,
                        kernels,
                    )
                conn.send(("done", seq, time.perf_counter() - started))
            except Exception:
                conn.send(("error", seq, traceback.format_exc()))
    finally:
        stop.set()
        # thread join (at most one clock write): a daemon thread still inside a torch op when the interpreter exits
        # is ended with pthread_exit, whose unwinding through C++ frames aborts the process ("terminate called
        # without an active exception", SIGABRT) after a clean stop
        beat.join()
        kernels.close()  # the same for a build in progress (its builder thread is joined)


def _wait_for_adoption(conn: multiprocessing.connection.Connection) -> WorkerSpec | None:
    """A spare: block until the next engine in the main process adopts this worker (its spec), or it is stopped."""
    while True:
        try:
            command = handoff.receive(conn)
        except EOFError:
            return None
        if command[0] == "adopt":
            return command[1]
        if command[0] == "stop":
            return None


def spawn_process(
    target: Callable[[multiprocessing.connection.Connection, WorkerSpec | None], None], spec: WorkerSpec | None
) -> tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]:
    """Start a worker process running ``target(conn, spec)`` (spawned, or forked from the fork server once
    ``spares.start_workers_preloaded`` opted in); its process and this end of its pipe."""
    ctx = torch.multiprocessing.get_context(spares.start_method())
    conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(target=target, args=(child_conn, spec), name="zenflow-host", daemon=True)
    # the child inherits the environment at start: tell the package's __init__ to skip importing Lightning
    previous = os.environ.get(WORKER_ENV)
    os.environ[WORKER_ENV] = "1"
    try:
        with _without_user_main():
            process.start()
    finally:
        if previous is None:
            os.environ.pop(WORKER_ENV, None)
        else:
            os.environ[WORKER_ENV] = previous
    child_conn.close()
    return process, conn


@contextlib.contextmanager
def _without_user_main() -> Iterator[None]:
    """Start the worker from this module alone, never from the user's script.

    ``spawn`` makes the child re-import the parent's ``__main__`` (by path or module name) before it unpickles
    the target: a script without an ``if __name__ == "__main__":`` guard would train again inside the worker,
    and every script would pay for its imports. While the child is started, ``__main__`` is a bare module with
    neither a path nor a spec, so the child imports only ``lightning_zenflow.engine.host`` (the target's module).
    """
    user_main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if user_main is not None:
            sys.modules["__main__"] = user_main


class HostWorker:
    """The main-process handle of the worker: start, submit, wait, close. Not thread-safe by design:
    one thread talks to it."""

    def __init__(
        self,
        spec: WorkerSpec,
        timeout_s: float,
        start_timeout_s: float = 120.0,
        target: Callable[[multiprocessing.connection.Connection, WorkerSpec], None] | None = None,
        wait_ready: bool = True,
    ) -> None:
        """Spawn the worker (or adopt a spare) and wait for its "ready": at once, or (``wait_ready=False``, the
        engine's way) at its first use, so that its start (a new interpreter importing torch, about a second) overlaps
        the training's first steps. ``target``: test hook, another entry point (a module-level function) to exercise
        the protocol's error paths."""
        self._timeout_s = timeout_s
        self._seq = 0
        self._in_flight: int | None = None
        self.last_compute_s = 0.0
        self._failed = False
        self._spare_eligible = target is None
        self._heartbeat = spec.heartbeat
        self._heartbeat[0] = time.monotonic()
        if not (self._spare_eligible and self._adopt_spare(spec)):
            if target is None:
                # the spec follows through the pipe (an adoption, as a spare gets it): the child's start-up
                # arguments would keep its shared blocks mapped for the life of the process
                self._spawn(None, worker_main)
                handoff.send(self._conn, ("adopt", spec))
            else:
                self._spawn(spec, target)
        self.pid: int = self._process.pid
        self._ready = False
        self._start_deadline = time.monotonic() + start_timeout_s
        self._start_timeout_s = start_timeout_s
        if wait_ready:
            self._ensure_ready()

    def _ensure_ready(self) -> None:
        """Wait (bounded by the start-up timeout) for the worker's "ready", once: its start-up imports torch."""
        if self._ready:
            return
        try:
            message = self._receive(max(0.0, self._start_deadline - time.monotonic()), self._start_timeout_s)
            if message[0] != "ready":
                raise HostWorkerError(f"host worker sent {message[0]!r} instead of 'ready' at start-up.")
        except BaseException:
            self.close()  # a worker that failed to start is stopped, never left behind
            raise
        self._ready = True
        self._heartbeat[0] = time.monotonic()  # start-up is over: from now on the worker's own beat counts

    def _spawn(
        self,
        spec: WorkerSpec | None,
        target: Callable[[multiprocessing.connection.Connection, WorkerSpec], None],
    ) -> None:
        self._process, self._conn = spawn_process(target, spec)

    def _adopt_spare(self, spec: WorkerSpec) -> bool:
        """Take a spare worker (``engine/spares.py``), handing it this engine's spec; False if none is kept."""
        taken = spares.adopt(("adopt", spec))  # its shared blocks travel as handles, as at a spawn
        if taken is None:
            return False
        self._process, self._conn = taken
        return True

    def _release_as_spare(self) -> bool:
        """At close: hand a healthy, idle worker back to the spares instead of stopping it (if they are kept)."""
        if not (self._spare_eligible and spares.wanted()) or self._failed or self._in_flight is not None:
            return False
        if not self._process.is_alive():
            return False
        try:
            self._ensure_ready()
            handoff.send(self._conn, ("release",))
            message = self._receive(10.0)
        except (OSError, HostWorkerError):
            return False
        if message != ("released",):
            return False
        spares.keep(self._process, self._conn)
        return True

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def process(self) -> torch.multiprocessing.Process:
        return self._process

    def attach(self, windows: Sequence[Sequence[torch.Tensor]]) -> None:
        """Hand the worker new window rows (per group), with nothing in flight; waits for its answer."""
        if self._in_flight is not None:
            raise HostWorkerError("internal error: window rows attached while a host update is in flight.")
        self._ensure_ready()
        self._check_alive()
        try:
            handoff.send(self._conn, ("attach", [list(rows) for rows in windows]))
        except OSError as error:
            self._raise_dead(error)
        message = self._receive(None)
        if message != ("attached",):
            raise HostWorkerError(f"host worker protocol error: expected ('attached',), got {message[:2]!r}.")

    def wait_for_builds(self) -> None:
        """Block until the worker's compiled step is built (it runs the step eagerly until then: the same numbers,
        more time per update), with nothing in flight. A benchmark calls it before it measures."""
        if self._in_flight is not None:
            raise HostWorkerError("internal error: waited for the builds while a host update is in flight.")
        self._ensure_ready()
        self._check_alive()
        try:
            handoff.send(self._conn, ("builds",))
        except OSError as error:
            self._raise_dead(error)
        message = self._receive(None)
        if message != ("built",):
            raise HostWorkerError(f"host worker protocol error: expected ('built',), got {message[:2]!r}.")

    def submit(self, slot: int, jobs: Sequence[GroupJob]) -> None:
        if self._in_flight is not None:
            raise HostWorkerError("a host update is already in flight; wait for it before submitting another.")
        self._ensure_ready()
        self._seq += 1
        self._check_alive()
        try:
            handoff.send(self._conn, ("update", self._seq, slot, list(jobs)))
        except OSError as error:
            self._raise_dead(error)
        self._in_flight = self._seq

    def poll(self) -> float | None:
        """Without blocking: the compute time of the update in flight if it has finished (then nothing is in
        flight any more), else None."""
        if self._in_flight is None or not self._conn.poll():
            return None
        return self.wait()

    def wait(self) -> float:
        """Block until the update in flight finishes; returns its compute time in seconds (0 if none)."""
        if self._in_flight is None:
            return 0.0
        self._failed = True  # until the answer proves otherwise
        message = self._receive(None)
        seq = self._in_flight
        self._in_flight = None
        if message[0] == "error":
            raise HostWorkerError(f"the host worker raised during update {message[1]}:\n{message[2]}")
        if message[0] != "done" or message[1] != seq:
            raise HostWorkerError(f"host worker protocol error: expected ('done', {seq}), got {message[:2]!r}.")
        self.last_compute_s = float(message[2])
        self._failed = False
        return self.last_compute_s

    def _check_alive(self) -> None:
        if not self._process.is_alive():
            code = self._process.exitcode
            raise HostWorkerError(
                f"the host worker process (pid {self._process.pid}) died with exit code {code}"
                + (f" (signal {-code})" if code is not None and code < 0 else "")
                + ". Its error output (stderr) above says why; the host optimizer state is lost, so restart from the "
                "last checkpoint."
            )

    def _receive(self, budget_s: float | None, start_timeout_s: float | None = None) -> tuple:
        deadline = None if budget_s is None else time.monotonic() + budget_s
        # a pipe wait in short slices, checking between slices that the worker is alive and beating
        while not self._conn.poll(_POLL_S):
            self._check_alive()
            silent_s = time.monotonic() - float(self._heartbeat[0])
            if budget_s is None and silent_s > self._timeout_s:
                raise HostWorkerError(
                    f"the host worker (pid {self._process.pid}) has not answered for {silent_s:.1f} s "
                    f"(worker_timeout_s={self._timeout_s}); it is stopped or frozen."
                )
            if deadline is not None and time.monotonic() > deadline:
                raise HostWorkerError(f"the host worker did not start within {start_timeout_s or budget_s:.0f} s.")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as error:
            self._raise_dead(error)

    def _raise_dead(self, error: BaseException) -> NoReturn:
        """The pipe broke: the worker is dying. Wait for it to be reaped so the error says how it died (its exit code
        or signal), whichever of the two this process happens to see first."""
        # process join, bounded: a dying worker closes its pipe before it can be reaped, and on a busy machine the
        # exit can lag the pipe's end by more than a moment
        self._process.join(DEATH_WAIT_S)
        self._check_alive()
        raise HostWorkerError(
            f"lost the pipe to the host worker (pid {self._process.pid}), which is still running {DEATH_WAIT_S:.0f} s "
            f"later: {error!r}. The host optimizer state is lost; restart from the last checkpoint."
        ) from error

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the worker: ask, wait, then kill. Idempotent; safe after a failure."""
        process = getattr(self, "_process", None)
        if process is None:
            return
        if self._release_as_spare():
            self._process = None
            self._in_flight = None
            return
        if process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                handoff.send(self._conn, ("stop",))
            # process join: give it time to finish an update and exit on its own
            process.join(timeout_s)
        if process.is_alive():
            # SIGKILL, not SIGTERM: a stopped (SIGSTOP) worker would leave SIGTERM pending forever
            process.kill()
            process.join(timeout_s)
        self._conn.close()
        process.close()
        self._process = None
        self._in_flight = None
