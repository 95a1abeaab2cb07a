"""One lane and its events: a CUDA stream, a CPU thread, or the calling thread (``engine/lanes.py`` holds the set of
lanes of a device and says what a lane is for; DESIGN section 6).

- :class:`CudaLane`: a CUDA stream; ``run`` issues the work inside the stream's context, an event is a CUDA event.
- :class:`ThreadLane`: a thread that runs its queued work in order; an event is a marker the thread sets when its work
  reaches it, and a wait on another lane is a real dependency queued in order.
- :class:`InlineLane`: the calling thread; its work is done when issued (the CPU ``compute`` lane, and every lane of
  the ``inline`` mode); its waits may be deferred to :meth:`InlineLane.settle`, as a CUDA stream's are GPU-side.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

DROPPED_WAITS: frozenset[str] = frozenset()
"""Test hook (the mutation test): waits whose label is here are skipped, to show that the adversarial lanes turn a
missing wait into a wrong number. Every wait the engine issues has a label (``WAIT_LABELS``)."""
WAIT_LABELS = (
    "side after compute",
    "compute after update",
    "compute after gradients read",
    "window added",
    "window copied",
    "ring gathered",
    "ring copied",
    "upload read",
    "launch: window copied",
)
"""The engine's waits, by what each one waits for (see where each is issued)."""
_CUDA_SLEEP_CYCLES_PER_S = 1.5e9
"""``torch.cuda._sleep`` spins for a number of GPU clock cycles; about this many per second on current GPUs."""
_WAIT_POLL_S = 0.5
"""A host wait on a CPU lane checks this often that the lane's thread is still alive (it never dies silently)."""


class LaneError(RuntimeError):
    """Work queued on a lane raised; the lane skips its later work (as a CUDA error is sticky) and every later host
    wait re-raises this."""


class LaneSet(Protocol):
    """What a lane and an event need of the set of lanes they belong to (``engine/lanes.py``'s ``Lanes``)."""

    device: torch.device
    is_cuda: bool

    def count_host_sync(self) -> None: ...

    def delay_s(self, stage: str, rng: random.Random | None) -> float: ...

    def rng(self, stage: str) -> random.Random | None: ...


class Event:
    """A point in one lane's work. CUDA: a CUDA event (blocking, so a host wait sleeps instead of spinning). CPU: a
    marker that the lane sets when its work reaches the point; never recorded counts as done, as on CUDA."""

    def __init__(self, lanes: LaneSet, timing: bool = False) -> None:
        self._lanes = lanes
        self._cuda = torch.cuda.Event(blocking=True, enable_timing=timing) if lanes.is_cuda else None
        self._marker: _Marker | None = None

    def record(self, lane: Lane) -> None:
        lane.record(self)

    def synchronize(self) -> None:
        """Host wait until the work before the latest record is done (a host sync when the training thread waits)."""
        self._lanes.count_host_sync()
        self.wait_here()

    def wait_here(self, label: str | None = None) -> None:
        """The calling thread waits for the event without counting a host sync (the helper thread's waits, and a
        CPU compute lane's wait, which is GPU-side on CUDA)."""
        if label in DROPPED_WAITS:
            return
        if self._cuda is not None:
            self._cuda.synchronize()
            return
        marker = self._marker
        if marker is not None:
            marker.wait()

    def query(self) -> bool:
        if self._cuda is not None:
            return self._cuda.query()
        return self._marker is None or self._marker.is_set()

    def elapsed_s(self, end: Event) -> float:
        """Seconds from this event to ``end``, both done (CUDA: timing events)."""
        if self._cuda is not None:
            return self._cuda.elapsed_time(end._cuda) / 1000.0
        if self._marker is None or end._marker is None:
            return 0.0
        return max(0.0, end._marker.at - self._marker.at)

    @property
    def cuda_event(self) -> torch.cuda.Event | None:
        return self._cuda


class _Marker:
    """A CPU event's record: set by the lane when its work reaches it, with the time it was reached."""

    __slots__ = ("_done", "_lane", "at")

    def __init__(self, lane: ThreadLane | None) -> None:
        self._done = threading.Event()
        self._lane = lane
        self.at = 0.0

    def set(self) -> None:
        self.at = time.perf_counter()
        self._done.set()

    def is_set(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        # a wait on a lane's marker: the lane sets it even after a failure, but not if its thread is gone
        while not self._done.wait(_WAIT_POLL_S):
            if self._lane is not None and not self._lane.alive():
                raise LaneError(f"the {self._lane.name} lane stopped before reaching this point.")


_DONE = _Marker(None)
_DONE.set()


class Lane:
    """An in-order queue of device work (see the module docstring)."""

    name: str

    def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        raise NotImplementedError

    def record(self, event: Event) -> None:
        raise NotImplementedError

    def wait(self, event: Event, label: str) -> None:
        """This lane's later work waits for ``event``'s latest record (GPU-side: the caller does not block).
        ``label``: what it waits for (``WAIT_LABELS``)."""
        if label not in DROPPED_WAITS:
            self._wait(event)

    def wait_lane(self, other: Lane, label: str) -> None:
        """This lane's later work waits for everything issued so far on ``other`` (GPU-side)."""
        if label not in DROPPED_WAITS:
            self._wait_lane(other)

    def _wait(self, event: Event) -> None:
        raise NotImplementedError

    def _wait_lane(self, other: Lane) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Host wait for everything issued on this lane."""
        raise NotImplementedError


class CudaLane(Lane):
    def __init__(self, lanes: LaneSet, name: str, stream: torch.cuda.Stream | None) -> None:
        self._lanes = lanes
        self.name = name
        self._own_stream = stream
        self._rng = lanes.rng(name)

    @property
    def stream(self) -> torch.cuda.Stream:
        """The lane's stream; the compute lane's is whatever stream is current (Lightning's default stream)."""
        if self._own_stream is not None:
            return self._own_stream
        return torch.cuda.current_stream(self._lanes.device)

    def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        with torch.cuda.device(self._lanes.device), torch.cuda.stream(self.stream):
            seconds = self._lanes.delay_s(self.name, self._rng)
            if seconds:
                torch.cuda._sleep(int(seconds * _CUDA_SLEEP_CYCLES_PER_S))  # queued on this stream
            fn(*args, **kwargs)

    def record(self, event: Event) -> None:
        event._cuda.record(self.stream)

    def _wait(self, event: Event) -> None:
        self.stream.wait_event(event._cuda)

    def _wait_lane(self, other: Lane) -> None:
        if other is not self:
            self.stream.wait_stream(other.stream)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self._lanes.count_host_sync()
        self.stream.synchronize()


class InlineLane(Lane):
    """A CPU lane whose work runs when issued, on the calling thread: always the compute lane; every lane in the
    ``inline`` mode.

    ``defer`` (the compute lane beside thread lanes): a wait on an event does not block at once. As on CUDA, where
    the compute stream's wait is GPU-side and the host runs on, the engine's own bookkeeping after the wait (closing
    a window, launching the host update) goes ahead while the side lane still works; the calling thread blocks in
    :meth:`settle`, which the engine calls before it returns control to the caller (whose next forward, callbacks
    and reads of the weights run on the compute lane). A lane that waits for this one waits for those events too.
    """

    def __init__(self, lanes: LaneSet, name: str, defer: bool = False) -> None:
        self._lanes = lanes
        self.name = name
        self._defer = defer
        self.pending: list[Event] = []

    def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        self.settle()  # compute-lane work runs after the lane's earlier waits
        seconds = self._lanes.delay_s(self.name, None)
        if seconds:
            time.sleep(seconds)
        fn(*args, **kwargs)

    def record(self, event: Event) -> None:
        self.settle()
        event._marker = _DONE

    def _wait(self, event: Event) -> None:
        if self._defer:
            self.pending.append(event)
            return
        # the calling thread is this lane: waiting for the event is blocking it (on CUDA a GPU-side wait)
        event.wait_here()

    def _wait_lane(self, other: Lane) -> None:
        if isinstance(other, ThreadLane):
            self._wait(_recorded(self._lanes, other))

    def settle(self) -> None:
        """Block until the events this lane waits for are done (not a host sync: on CUDA these waits are GPU-side)."""
        while self.pending:
            self.pending.pop(0).wait_here()

    def synchronize(self) -> None:
        self._lanes.count_host_sync()
        self.settle()


def _recorded(lanes: LaneSet, lane: Lane) -> Event:
    event = Event(lanes)
    lane.record(event)
    return event


class ThreadLane(Lane):
    """A CPU lane: one thread that runs the lane's queued work in order."""

    def __init__(self, lanes: LaneSet, name: str) -> None:
        self._lanes = lanes
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rng = lanes.rng(name)
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"zenflow-lane-{name}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        self._queue.put(("run", fn, args, kwargs))

    def mark(self) -> _Marker:
        marker = _Marker(self)
        self._queue.put(("set", marker, (), {}))
        return marker

    def record(self, event: Event) -> None:
        event._marker = self.mark()

    def _wait(self, event: Event) -> None:
        marker = event._marker  # the latest record now, as a CUDA stream's wait takes it
        if marker is not None and not marker.is_set():
            self._queue.put(("wait", marker, (), {}))

    def _wait_lane(self, other: Lane) -> None:
        if isinstance(other, ThreadLane) and other is not self:
            self._queue.put(("wait", other.mark(), (), {}))
        elif isinstance(other, InlineLane):
            # the compute lane's work is done when issued; what it still waits for, this lane waits for too
            for event in other.pending:
                self._wait(event)

    def synchronize(self) -> None:
        self._lanes.count_host_sync()
        self.drain()

    def drain(self) -> None:
        """Wait for everything issued so far, without counting a host sync."""
        self.mark().wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise LaneError(f"work on the {self.name} lane failed: {self.failure!r}") from self.failure

    def stop(self) -> None:
        self._queue.put(("stop", None, (), {}))
        self._thread.join(timeout=30.0)

    def _serve(self) -> None:
        while True:
            kind, target, args, kwargs = self._queue.get()
            if kind == "stop":
                return
            if kind == "set":
                target.set()
            elif kind == "wait":
                target.wait()
            elif self.failure is None:  # after a failure the lane skips work but still passes its markers
                seconds = self._lanes.delay_s(self.name, self._rng)
                if seconds:
                    time.sleep(seconds)
                try:
                    target(*args, **kwargs)
                except BaseException as error:  # kept for the next host wait; the lane must keep serving markers
                    self.failure = error
