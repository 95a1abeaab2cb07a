"""What the engine reports about each step (:class:`StepStats`), and the step clock of ``update_interval="auto"``."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass
class StepStats:
    """Telemetry of one optimizer step, as the engine saw it. Times are seconds; None when not measured."""

    step: int
    stall_s: float
    """Time the calling thread was blocked inside the engine since the previous step (host waits, drains)."""
    device_update_s: float | None
    """Device update time (CUDA: from events of the last finished step; CPU: measured inline)."""
    host_update_s: float | None
    """Compute time of the most recent finished host update."""
    update_interval: int
    d2h_bytes: int
    h2d_bytes: int
    device_bytes: int
    host_bytes: int
    window_end: bool
    refreshed: bool
    selection_overlap: float | None = None
    selection_captured: float | None = None
    accumulate_on: str | None = None
    """The accumulation mode in use (``"device"`` or ``"host"``; decided at the first step under ``"auto"``)."""
    host_syncs: int = 0
    """Times the training thread blocked on device work since the previous step (event or lane synchronisation, a
    device-to-host read): 0 at steady-state device-mode steps; selections, checkpoints and the ``"auto"`` choices
    wait by design."""


class StepClock:
    """Device step times (the caller's forward and backward plus the engine's step, less the time the engine
    stalled), the last 64 of them, for ``update_interval="auto"``."""

    def __init__(self) -> None:
        self.intervals: list[float] = []
        self._last_end: float | None = None
        self._stall_at_last_end = 0.0

    def step_ended(self, stall_s: float) -> None:
        """Record the end of a step; ``stall_s``: the engine's total stall so far."""
        now = time.perf_counter()
        if self._last_end is not None:
            stalled = stall_s - self._stall_at_last_end
            self.intervals.append(max(0.0, now - self._last_end - stalled))
            del self.intervals[:-64]
        self._last_end = now
        self._stall_at_last_end = stall_s

    def median(self) -> float:
        return statistics.median(self.intervals)
