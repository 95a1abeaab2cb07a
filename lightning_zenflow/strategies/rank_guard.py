"""A rank that waits in a collective when SIGTERM arrives ends in about a second, not at the collective's timeout.

Python runs a signal handler only between bytecodes of the main thread. A rank whose main thread waits inside a
collective (gloo's or NCCL's wait, in C++) for a rank that failed never gets there: Lightning's SIGTERM handler, and
its teardown, wait with it, until the collective times out or the launcher kills the process. :class:`StuckRankGuard`
watches for SIGTERM from a thread: C's signal trampoline writes the signal number to Python's wakeup file
descriptor at once, whatever the main thread does. If the main thread has not run the handler within
:data:`STUCK_GRACE_S`, the guard stops the rank's host worker and ends the process (exit status 143, as a SIGTERM
does). Nothing leaks: the host state's shared memory is unlinked when it is made (freed with its last user), and the
worker dies with its parent anyway. A rank whose main thread runs Python handles the signal as before (Lightning's
``SIGTERMException``, a checkpoint if asked, the teardown), and the guard stands down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

STUCK_GRACE_S = 1.0
"""How long the main thread has to run its SIGTERM handler before the guard ends the process."""
EXIT_STATUS = 128 + signal.SIGTERM


class StuckRankGuard:
    """Installed by a data-parallel rank for the fit (the main thread only); :meth:`remove` undoes it."""

    def __init__(self, stop_worker: Callable[[], None], grace_s: float = STUCK_GRACE_S) -> None:
        self._stop_worker = stop_worker
        self._grace_s = grace_s
        self._handled = threading.Event()
        self._closed = threading.Event()
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        previous = self._previous_handler

        def on_sigterm(signum: int, frame: Any) -> None:
            self._handled.set()  # the main thread runs Python: the usual handling goes on
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                raise SystemExit(EXIT_STATUS)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._thread = threading.Thread(target=self._watch, name="zenflow-rank-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                received = os.read(self._read_fd, 64)  # blocks until a signal arrives (or remove() writes)
            except OSError:
                return
            if self._closed.is_set() or not received:
                return
            if signal.SIGTERM in received and not self._handled.wait(self._grace_s) and not self._closed.is_set():
                # the main thread is stuck in C++ (a collective): end the rank, its worker first
                with contextlib.suppress(Exception):
                    self._stop_worker()
                os._exit(EXIT_STATUS)

    def remove(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_fd)
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGTERM, self._previous_handler)
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")  # wakes the thread, which sees the guard closed
        self._thread.join(timeout=1.0)  # thread join: it returns at once after the wake-up byte
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
