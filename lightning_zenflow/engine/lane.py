"""One lane and its events: a CUDA stream, a CPU thread, or the calling thread (``engine/lanes.py`` holds the set of
lanes of a device and says what a lane is for; DESIGN section 6).

- :class:`CudaLane`: a CUDA stream; ``run`` issues the work inside the stream's context, an event is a CUDA event.
- :class:`ThreadLane`: a thread that runs its queued work in order; an event is a marker the thread sets when its work
  reaches it, and a wait on another lane is a real dependency queued in order.
- :class:`InlineLane`: the calling thread; its work is done when issued (the CPU ``compute`` lane, and every lane of
  the ``inline`` mode); its waits may be deferred to :meth:`InlineLane.settle`, as a CUDA stream's are GPU-side.

*Strict* thread lanes (``LIGHTNING_ZENFLOW_STRICT_LANES=1``, on in the test suite) hold the memory of their work as
CUDA's caching allocator does, not as a Python closure does. A closure queued on a thread keeps every tensor it names
alive; on CUDA a tensor the training thread frees goes back to the allocator at once, and the next allocation on its
stream reuses the block, whatever a side stream still has to read. So a strict lane keeps only *weak* references to
the tensors its work is given (:class:`_Held`) and raises :class:`StrictLaneError` when one was freed before the work
ran: only what the engine keeps itself (its own buffers, ``Lanes.keep_for`` as ``record_stream`` does, pinned host
staging that the host allocator keeps until its copy is done) survives. A strict lane also refuses, when the work is
issued, a tensor that the compute lane made after this lane's last wait on it (``Lanes.made_on_compute``): on CUDA
the fill of such a tensor may not have run when the side stream reads it.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

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


class StrictLaneError(LaneError):
    """A strict lane's work was given memory that CUDA would not have kept for it (see the module docstring)."""


class LaneSet(Protocol):
    """What a lane and an event need of the set of lanes they belong to (``engine/lanes.py``'s ``Lanes``)."""

    device: torch.device
    is_cuda: bool

    strict: bool

    def count_host_sync(self) -> None: ...

    def delay_s(self, stage: str, rng: random.Random | None) -> float: ...

    def rng(self, stage: str) -> random.Random | None: ...

    def compute_clock(self) -> int: ...

    def stamp_of(self, tensor: torch.Tensor) -> int: ...

    def host_staging(self, tensor: torch.Tensor) -> bool: ...


class Event:
    """A point in one lane's work. CUDA: a CUDA event (blocking, so a host wait sleeps instead of spinning). CPU: a
    marker that the lane sets when its work reaches the point; never recorded counts as done, as on CUDA."""

    def __init__(self, lanes: LaneSet, timing: bool = False) -> None:
        self._lanes = lanes
        self._cuda = torch.cuda.Event(blocking=True, enable_timing=timing) if lanes.is_cuda else None
        self._marker: _Marker | None = None
        self.compute_clock = 0
        """Strict lanes: the compute lane's clock at this event's latest record there (what a wait on it covers)."""

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
        event.compute_clock = self._lanes.compute_clock()

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
    """A CPU lane: one thread that runs the lane's queued work in order (strict: see the module docstring)."""

    def __init__(self, lanes: LaneSet, name: str) -> None:
        self._lanes = lanes
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rng = lanes.rng(name)
        self.failure: BaseException | None = None
        self.strict = lanes.strict
        self.synced_compute = 0
        """Strict: the compute lane's clock at this lane's latest wait on it (issue order, as a stream's wait)."""
        self._kept: list[_Kept] = []
        """Strict: storages kept for this lane's work (``keep``), as ``record_stream`` keeps a CUDA block."""
        self._kept_lock = threading.Lock()
        self._issued = 0
        self._done = 0
        self._thread = threading.Thread(target=self._serve, name=f"zenflow-lane-{name}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        if self.strict:
            where = _caller()
            args = tuple(self._hold(arg, where) for arg in args)
            kwargs = {key: self._hold(value, where) for key, value in kwargs.items()}
            with self._kept_lock:
                self._issued += 1
                self._release_kept()
        self._queue.put(("run", fn, args, kwargs))

    def mark(self) -> _Marker:
        marker = _Marker(self)
        self._queue.put(("set", marker, (), {}))
        return marker

    def record(self, event: Event) -> None:
        event._marker = self.mark()
        event.compute_clock = self.synced_compute  # a lane that waits for this event has waited for that much too

    def _wait(self, event: Event) -> None:
        self.synced_compute = max(self.synced_compute, event.compute_clock)
        marker = event._marker  # the latest record now, as a CUDA stream's wait takes it
        if marker is not None and not marker.is_set():
            self._queue.put(("wait", marker, (), {}))

    def _wait_lane(self, other: Lane) -> None:
        if isinstance(other, ThreadLane) and other is not self:
            self.synced_compute = max(self.synced_compute, other.synced_compute)
            self._queue.put(("wait", other.mark(), (), {}))
        elif isinstance(other, InlineLane):
            # the compute lane's work is done when issued; what it still waits for, this lane waits for too
            self.synced_compute = self._lanes.compute_clock()
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
            if isinstance(self.failure, StrictLaneError):
                raise StrictLaneError(f"work on the {self.name} lane failed: {self.failure}") from self.failure
            raise LaneError(f"work on the {self.name} lane failed: {self.failure!r}") from self.failure

    def stop(self) -> None:
        self._queue.put(("stop", None, (), {}))
        self._thread.join(timeout=30.0)

    # ------------------------------------------------------------------------------------- strict lanes
    def keep(self, tensor: torch.Tensor) -> None:
        """Strict: keep ``tensor``'s memory for the work issued on this lane until its owner has freed it and the
        lane has run everything issued before that (``record_stream``'s rule)."""
        with self._kept_lock:
            self._kept.append(_Kept(tensor.untyped_storage()))

    def _release_kept(self) -> None:
        # under _kept_lock: a storage whose owner let go (only our reference is left) is released once the lane has
        # run everything issued up to the moment that was seen
        kept = []
        for entry in self._kept:
            if entry.until is None and torch._C._storage_Use_Count(entry.storage._cdata) == 1:
                entry.until = self._issued
            if entry.until is None or self._done < entry.until:
                kept.append(entry)
        self._kept = kept

    def _hold(self, value: object, where: str) -> object:
        """Strict: the lane's reference to an argument of its work (tensors weak; lists and tuples looked into)."""
        if type(value) is torch.Tensor:
            self._check_made_before_wait(value, where)
            if self._lanes.host_staging(value):
                return value  # pinned host staging: CUDA's host allocator keeps it until its copies are done
            return _Held(value, where)
        if type(value) is list:
            return [self._hold(item, where) for item in value]
        if type(value) is tuple:
            return tuple(self._hold(item, where) for item in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # the engine's state objects: their tensors are the engine's own (kept), but may be new
            for field in dataclasses.fields(value):
                attribute = getattr(value, field.name)
                if type(attribute) is torch.Tensor:
                    self._check_made_before_wait(attribute, where)
        return value

    def _check_made_before_wait(self, tensor: torch.Tensor, where: str) -> None:
        if self._lanes.stamp_of(tensor) > self.synced_compute:
            raise StrictLaneError(
                f"{where} gives the {self.name} lane a tensor {tuple(tensor.shape)} that the compute lane made after "
                f"the {self.name} lane's last wait on it: on CUDA the {self.name} stream may read it before it is "
                "filled. Make it before that wait, or on the lane itself."
            )

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
                    if self.strict:
                        args = tuple(_resolve(arg, self.name) for arg in args)
                        kwargs = {key: _resolve(value, self.name) for key, value in kwargs.items()}
                    target(*args, **kwargs)
                except BaseException as error:  # kept for the next host wait; the lane must keep serving markers
                    self.failure = error
                finally:
                    args = kwargs = None  # the resolved tensors go before the kept storages are looked at
            if kind == "run" and self.strict:
                with self._kept_lock:
                    self._done += 1
                    self._release_kept()


class _Kept:
    """A storage kept for a strict lane, and the issue count after which it may go (None: its owner still holds it)."""

    __slots__ = ("storage", "until")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.until: int | None = None


class _Held:
    """A strict lane's weak reference to a tensor argument: its storage and its view (dtype, size, stride, offset)."""

    __slots__ = ("dtype", "offset", "ref", "shape", "stride", "where", "device")

    def __init__(self, tensor: torch.Tensor, where: str) -> None:
        self.ref = StorageWeakRef(tensor.untyped_storage())
        self.dtype, self.device = tensor.dtype, tensor.device
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()
        self.where = where

    def tensor(self, lane: str) -> torch.Tensor:
        storage = torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        if storage is None:
            raise StrictLaneError(
                f"{self.where} gave the {lane} lane a tensor {tuple(self.shape)} ({self.dtype}) that was freed before "
                f"the lane ran its work: on CUDA the caching allocator may hand its memory to the next allocation on "
                f"the stream that made it. Keep it for the lane (Lanes.keep_for, record_stream on CUDA), or make it on "
                "the lane."
            )
        with torch.no_grad():
            return torch.empty(0, dtype=self.dtype, device=self.device).set_(
                storage, self.offset, self.shape, self.stride
            )


def _resolve(value: object, lane: str) -> object:
    if type(value) is _Held:
        return value.tensor(lane)
    if type(value) is list:
        return [_resolve(item, lane) for item in value]
    if type(value) is tuple:
        return tuple(_resolve(item, lane) for item in value)
    return value


def _caller() -> str:
    """``file:line (function)`` of the engine code that issued lane work (for a strict lane's message)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(("lane.py", "lanes.py")):
        frame = frame.f_back
    if frame is None:
        return "engine code"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
