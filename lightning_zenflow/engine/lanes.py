"""The engine's lanes: in-order queues of device work, and the one place where CUDA and the CPU differ.

A *lane* is an in-order queue of work: ``side`` (the device update, the accumulation, the landing of uploads),
``d2h`` (copies down), ``h2d`` (copies up), and ``compute``, the caller's own (where Lightning runs forward and
backward). An *event* marks a point in a lane's work. The engine reaches devices only through them, with the same
calls on both kinds of machine (DESIGN section 6):

- ``lane.run(fn, *args)`` issues ``fn`` on the lane; ``lane.record(event)`` marks the point; ``lane.wait(event)``
  and ``lane.wait_lane(other)`` order the lane after another lane's work without blocking the caller;
- ``event.synchronize()``, ``lane.synchronize()``, ``lanes.synchronize()`` and ``lanes.read(lane, tensor)`` are the
  host waits; each one the training thread makes is counted in ``Lanes.host_syncs``.

On CUDA a lane is a stream (``compute`` is the current stream), an event is a CUDA event, ``run`` calls ``fn`` at
once inside the stream's context (its kernels queue on the stream). On the CPU, ``side``, ``d2h`` and ``h2d`` are
each a thread that runs its queued work in order, an event is a real completion marker, and a wait is a real
dependency: work runs later than it is issued, concurrently with the caller and with the other lanes, as kernels
queued on streams do. So a missing wait shows as a wrong number in a CPU test. ``compute`` is the calling thread:
its work is done when issued, so a lane's wait on it is satisfied at once. Its own wait on an event is deferred, as
on CUDA, where it is GPU-side and the host runs on: the engine's bookkeeping after it goes ahead, and the calling
thread blocks in ``lanes.settle()``, which the engine calls before it returns control to its caller (not counted as
a host sync). What the CPU lanes cannot model is listed in ``docs/performance.md``.

What ``fn`` may do: read and write tensors it was handed. Which tensors, which states and which gradients are
decided by the caller when it issues the work (on CUDA the host runs ahead of the device the same way); ``fn`` must
not read ``param.grad`` or the engine's Python state itself, since they may have changed by the time it runs.

``LIGHTNING_ZENFLOW_LANES`` chooses the CPU lanes: ``threads`` (the default), ``adversarial`` (threads that sleep
a random 0-``ADVERSARIAL_MAX_DELAY_S`` before each piece of work, the helper thread included, seeded by
``LIGHTNING_ZENFLOW_LANES_SEED``; on CUDA the same delays are queued on the streams), or ``inline`` (work runs when
issued, on the calling thread: the lanes without their concurrency, for profiling). Numbers never depend on it.

Test hook: ``Lanes(delays={stage: seconds})`` delays every piece of work of a stage (``side``, ``d2h``, ``h2d``; the
``helper`` thread; the ``worker`` process is delayed by the engine). On CUDA the delay is ``torch.cuda._sleep``
queued on the stream.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping

import torch

STAGES = ("side", "d2h", "h2d", "helper", "worker")
"""The asynchronous stages: the device update (side lane), gradient copies down, weight copies up, the helper
thread's host adds and job launches, and the host worker's update."""
LANES_ENV = "LIGHTNING_ZENFLOW_LANES"
LANES_SEED_ENV = "LIGHTNING_ZENFLOW_LANES_SEED"
LANE_MODES = ("threads", "adversarial", "inline")
ADVERSARIAL_MAX_DELAY_S = 0.003
"""The adversarial lanes sleep a uniformly random time up to this before each piece of work."""
_CUDA_SLEEP_CYCLES_PER_S = 1.5e9
"""``torch.cuda._sleep`` spins for a number of GPU clock cycles; about this many per second on current GPUs."""
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
_WAIT_POLL_S = 0.5
"""A host wait on a CPU lane checks this often that the lane's thread is still alive (it never dies silently)."""


class LaneError(RuntimeError):
    """Work queued on a lane raised; the lane skips its later work (as a CUDA error is sticky) and every later host
    wait re-raises this."""


def lane_mode(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The CPU lanes' mode and seed from the environment (``LIGHTNING_ZENFLOW_LANES``, ``..._SEED``)."""
    environ = os.environ if environ is None else environ
    mode = environ.get(LANES_ENV, "threads").strip().lower() or "threads"
    if mode not in LANE_MODES:
        raise ValueError(f"{LANES_ENV}={mode!r} is not one of {list(LANE_MODES)}; unset it for the default 'threads'.")
    seed_text = environ.get(LANES_SEED_ENV, "0").strip() or "0"
    try:
        seed = int(seed_text)
    except ValueError:
        raise ValueError(f"{LANES_SEED_ENV}={seed_text!r} is not an integer seed.") from None
    return mode, seed


class Event:
    """A point in one lane's work. CUDA: a CUDA event (blocking, so a host wait sleeps instead of spinning). CPU: a
    marker that the lane sets when its work reaches the point; never recorded counts as done, as on CUDA."""

    def __init__(self, lanes: Lanes, timing: bool = False) -> None:
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

    def __init__(self, lane: _ThreadLane | None) -> None:
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


class _CudaLane(Lane):
    def __init__(self, lanes: Lanes, name: str, stream: torch.cuda.Stream | None) -> None:
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


class _InlineLane(Lane):
    """A CPU lane whose work runs when issued, on the calling thread: always the compute lane; every lane in the
    ``inline`` mode.

    ``defer`` (the compute lane beside thread lanes): a wait on an event does not block at once. As on CUDA, where
    the compute stream's wait is GPU-side and the host runs on, the engine's own bookkeeping after the wait (closing
    a window, launching the host update) goes ahead while the side lane still works; the calling thread blocks in
    :meth:`settle`, which the engine calls before it returns control to the caller (whose next forward, callbacks
    and reads of the weights run on the compute lane). A lane that waits for this one waits for those events too.
    """

    def __init__(self, lanes: Lanes, name: str, defer: bool = False) -> None:
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
        if isinstance(other, _ThreadLane):
            self._wait(_recorded(self._lanes, other))

    def settle(self) -> None:
        """Block until the events this lane waits for are done (not a host sync: on CUDA these waits are GPU-side)."""
        while self.pending:
            self.pending.pop(0).wait_here()

    def synchronize(self) -> None:
        self._lanes.count_host_sync()
        self.settle()


def _recorded(lanes: Lanes, lane: Lane) -> Event:
    event = Event(lanes)
    lane.record(event)
    return event


class _ThreadLane(Lane):
    """A CPU lane: one thread that runs the lane's queued work in order."""

    def __init__(self, lanes: Lanes, name: str) -> None:
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
        if isinstance(other, _ThreadLane) and other is not self:
            self._queue.put(("wait", other.mark(), (), {}))
        elif isinstance(other, _InlineLane):
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


class Lanes:
    """The engine's lanes on one device: ``compute``, ``side``, ``d2h``, ``h2d`` (see the module docstring).

    Args:
        device: the device the engine trains on.
        delays: test hook, ``{stage: seconds}`` to delay every piece of a stage's work.
        mode: the CPU lanes' mode (``threads``, ``adversarial``, ``inline``); None: from ``LIGHTNING_ZENFLOW_LANES``.
        seed: the adversarial delays' seed; None: from ``LIGHTNING_ZENFLOW_LANES_SEED``.
    """

    def __init__(
        self,
        device: torch.device,
        delays: Mapping[str, float] | None = None,
        mode: str | None = None,
        seed: int | None = None,
    ) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        unknown = sorted(set(delays or {}) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown} to delay; the stages are {list(STAGES)}.")
        env_mode, env_seed = lane_mode()
        self.mode = env_mode if mode is None else mode
        if self.mode not in LANE_MODES:
            raise ValueError(f"lane mode {self.mode!r} is not one of {list(LANE_MODES)}.")
        self.seed = env_seed if seed is None else seed
        self.delays = dict(delays or {})
        self.host_syncs = 0
        """Host waits on device work made by the training thread (the thread that built the lanes)."""
        self._owner = threading.get_ident()
        # created here, at engine start, never in a strategy's __init__ (strategies get pickled)
        if self.is_cuda:
            self.compute: Lane = _CudaLane(self, "compute", None)
            self.side: Lane = _CudaLane(self, "side", torch.cuda.Stream(device))
            self.d2h: Lane = _CudaLane(self, "d2h", torch.cuda.Stream(device))
            self.h2d: Lane = _CudaLane(self, "h2d", torch.cuda.Stream(device))
        else:
            self.compute = _InlineLane(self, "compute", defer=self.mode != "inline")
            make = _InlineLane if self.mode == "inline" else _ThreadLane
            self.side = make(self, "side")
            self.d2h = make(self, "d2h")
            self.h2d = make(self, "h2d")
        self._closed = False

    @property
    def asynchronous(self) -> tuple[Lane, Lane, Lane]:
        return (self.side, self.d2h, self.h2d)

    def rng(self, stage: str) -> random.Random | None:
        """The adversarial delays' generator of one stage (None outside the adversarial mode)."""
        if self.mode != "adversarial":
            return None
        return random.Random(f"{self.seed}:{stage}")

    def delay_s(self, stage: str, rng: random.Random | None) -> float:
        """The delay before one piece of a stage's work: the test hook's, plus the adversarial mode's."""
        seconds = self.delays.get(stage, 0.0)
        if rng is not None:
            seconds += rng.uniform(0.0, ADVERSARIAL_MAX_DELAY_S)
        return seconds

    def event(self, timing: bool = False) -> Event:
        return Event(self, timing)

    def count_host_sync(self) -> None:
        if threading.get_ident() == self._owner:
            self.host_syncs += 1

    # --------------------------------------------------------------------------------------- host waits
    def synchronize(self) -> None:
        """Host wait for every lane of the device; at selections, state transfers and teardown only."""
        self.count_host_sync()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            return
        for lane in self.asynchronous:
            if isinstance(lane, _ThreadLane):
                lane.drain()
        self.settle()

    def settle(self) -> None:
        """Before control returns to the caller: the compute lane's deferred waits are done (CPU; a no-op on CUDA,
        where the compute stream waits by itself). Not a host sync."""
        if isinstance(self.compute, _InlineLane):
            self.compute.settle()

    def read(self, lane: Lane, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
        """A CPU copy of ``tensor`` once ``lane``'s work so far is done: a host wait (counted). ``tensor`` may be a
        function that returns it, for a tensor that the lane's queued work creates."""
        self.count_host_sync()
        if isinstance(lane, _ThreadLane):
            lane.drain()
        value = tensor() if callable(tensor) else tensor
        if isinstance(lane, _CudaLane):
            with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
                return value.to("cpu")  # a blocking copy on the lane's stream: waits for its work
        return value.detach().clone()

    def collective(self, lane: Lane, fn: Callable[..., object], *args: object) -> None:
        """Issue a torch.distributed collective in ``lane``'s order. CUDA: on the lane's stream (NCCL orders it
        after the stream's work). CPU: the calling thread waits for the lane and runs it (gloo) itself, so every
        rank issues its collectives from one thread in one order. ``fn`` runs after the lane's earlier work has been
        issued (CUDA) or done (CPU), so it may look up tensors that work created."""
        if isinstance(lane, _ThreadLane):
            lane.drain()  # not a host sync: on CUDA the collective is queued, not waited for
            fn(*args)
            return
        lane.run(fn, *args)

    def raise_failures(self) -> None:
        """Re-raise the first failure of work on a CPU lane (CUDA reports its own errors at the next sync)."""
        for lane in self.asynchronous:
            if isinstance(lane, _ThreadLane):
                lane.raise_failure()

    # ------------------------------------------------------------------------------------------- memory
    def keep_for(self, tensor: torch.Tensor, lane: Lane) -> None:
        """Tell the caching allocator that ``lane`` reads ``tensor`` (made on another stream): its memory is not
        reused before that work is done, even if the owner frees it first (``zero_grad``). On the CPU the queued
        work holds a reference to the tensor, which does the same."""
        if isinstance(lane, _CudaLane) and lane._own_stream is not None:
            tensor.record_stream(lane._own_stream)

    @contextlib.contextmanager
    def allocating_on(self, lane: Lane):
        """Allocate the enclosed tensors for ``lane`` (CUDA: from its stream's pool, so their memory is reused only
        in that stream's order)."""
        if isinstance(lane, _CudaLane):
            with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
                yield
        else:
            yield

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer: pinned on CUDA (for asynchronous copies), plain memory on the CPU."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.is_cuda)

    def free_bytes(self) -> int:
        """Device memory still free for the engine: CUDA's free memory plus what the caching allocator holds
        unused; on the CPU, the machine's available memory."""
        if self.is_cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            unused_cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return int(free + unused_cached)
        return available_host_bytes()

    def close(self, quiet: bool = False) -> None:
        """Wait for the lanes and stop the CPU lanes' threads. ``quiet``: on a failure path, a lane's (or CUDA's
        sticky) error is not raised again here, so it cannot hide the error being handled."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        except Exception:
            if not quiet:
                raise
        finally:
            for lane in self.asynchronous:
                if isinstance(lane, _ThreadLane):
                    lane.stop()


def available_host_bytes() -> int:
    """The machine's available memory (Linux ``MemAvailable``; total memory elsewhere as a fallback)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
