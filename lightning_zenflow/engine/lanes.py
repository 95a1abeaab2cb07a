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
a host sync). What the CPU lanes cannot model is listed in ``docs/performance.md``. The three kinds of lane and
the event are ``engine/lane.py``; this module holds the set of them on one device.

What ``fn`` may do: read and write tensors it was handed. Which tensors, which states and which gradients are
decided by the caller when it issues the work (on CUDA the host runs ahead of the device the same way); ``fn`` must
not read ``param.grad`` or the engine's Python state itself, since they may have changed by the time it runs.

``LIGHTNING_ZENFLOW_STRICT_LANES=1`` makes the CPU thread lanes strict (``engine/lane.py``): they keep only what
CUDA's caching allocator would keep for a stream (the engine's buffers, :meth:`Lanes.keep_for`, pinned host staging)
and refuse a tensor the compute lane made after their last wait on it (:meth:`Lanes.made_on_compute`). The test suite
runs with it on.

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
import random
import threading
from collections.abc import Callable, Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_zenflow.engine.lane import CudaLane, Event, InlineLane, Lane, ThreadLane

STAGES = ("side", "d2h", "h2d", "helper", "worker")
"""The asynchronous stages: the device update (side lane), gradient copies down, weight copies up, the helper
thread's host adds and job launches, and the host worker's update."""
LANES_ENV = "LIGHTNING_ZENFLOW_LANES"
LANES_SEED_ENV = "LIGHTNING_ZENFLOW_LANES_SEED"
STRICT_ENV = "LIGHTNING_ZENFLOW_STRICT_LANES"
LANE_MODES = ("threads", "adversarial", "inline")
ADVERSARIAL_MAX_DELAY_S = 0.003
"""The adversarial lanes sleep a uniformly random time up to this before each piece of work."""


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


def strict_lanes(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``LIGHTNING_ZENFLOW_STRICT_LANES`` asks for strict CPU thread lanes."""
    environ = os.environ if environ is None else environ
    value = environ.get(STRICT_ENV, "0").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"{STRICT_ENV}={value!r} is not 0 or 1.")
    return value in ("1", "true", "yes")


class Lanes:
    """The engine's lanes on one device: ``compute``, ``side``, ``d2h``, ``h2d`` (see the module docstring).

    Args:
        device: the device the engine trains on.
        delays: test hook, ``{stage: seconds}`` to delay every piece of a stage's work.
        mode: the CPU lanes' mode (``threads``, ``adversarial``, ``inline``); None: from ``LIGHTNING_ZENFLOW_LANES``.
        seed: the adversarial delays' seed; None: from ``LIGHTNING_ZENFLOW_LANES_SEED``.
        strict: strict CPU thread lanes (``engine/lane.py``); None: from ``LIGHTNING_ZENFLOW_STRICT_LANES``.
    """

    def __init__(
        self,
        device: torch.device,
        delays: Mapping[str, float] | None = None,
        mode: str | None = None,
        seed: int | None = None,
        strict: bool | None = None,
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
        self.strict = (strict_lanes() if strict is None else strict) and not self.is_cuda and self.mode != "inline"
        self._clock = 0
        """Strict: counts the tensors the compute lane made (``made_on_compute``)."""
        self._stamps: dict[int, tuple[StorageWeakRef, int]] = {}
        """Strict: per storage, the compute clock at which the compute lane made it."""
        self._staging: dict[int, StorageWeakRef] = {}
        """Strict: pinned host staging (``empty_host``), which CUDA's host allocator keeps until its copies are done."""
        self.delays = dict(delays or {})
        self.host_syncs = 0
        """Host waits on device work made by the training thread (the thread that built the lanes)."""
        self._owner = threading.get_ident()
        # created here, at engine start, never in a strategy's __init__ (strategies get pickled)
        if self.is_cuda:
            self.compute: Lane = CudaLane(self, "compute", None)
            self.side: Lane = CudaLane(self, "side", torch.cuda.Stream(device))
            self.d2h: Lane = CudaLane(self, "d2h", torch.cuda.Stream(device))
            self.h2d: Lane = CudaLane(self, "h2d", torch.cuda.Stream(device))
        else:
            self.compute = InlineLane(self, "compute", defer=self.mode != "inline")
            make = InlineLane if self.mode == "inline" else ThreadLane
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
            if isinstance(lane, ThreadLane):
                lane.drain()
        self.settle()

    def settle(self) -> None:
        """Before control returns to the caller: the compute lane's deferred waits are done (CPU; a no-op on CUDA,
        where the compute stream waits by itself). Not a host sync."""
        if isinstance(self.compute, InlineLane):
            self.compute.settle()

    def read(self, lane: Lane, tensor: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
        """A CPU copy of ``tensor`` once ``lane``'s work so far is done: a host wait (counted). ``tensor`` may be a
        function that returns it, for a tensor that the lane's queued work creates."""
        self.count_host_sync()
        if isinstance(lane, ThreadLane):
            lane.drain()
        value = tensor() if callable(tensor) else tensor
        if isinstance(lane, CudaLane):
            with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
                return value.to("cpu")  # a blocking copy on the lane's stream: waits for its work
        return value.detach().clone()

    def collective(self, lane: Lane, fn: Callable[..., object], *args: object) -> None:
        """Issue a torch.distributed collective in ``lane``'s order. CUDA: on the lane's stream (NCCL orders it
        after the stream's work). CPU: the calling thread waits for the lane and runs it (gloo) itself, so every
        rank issues its collectives from one thread in one order. ``fn`` runs after the lane's earlier work has been
        issued (CUDA) or done (CPU), so it may look up tensors that work created."""
        if isinstance(lane, ThreadLane):
            lane.drain()  # not a host sync: on CUDA the collective is queued, not waited for
            fn(*args)
            return
        lane.run(fn, *args)

    def raise_failures(self) -> None:
        """Re-raise the first failure of work on a CPU lane (CUDA reports its own errors at the next sync)."""
        for lane in self.asynchronous:
            if isinstance(lane, ThreadLane):
                lane.raise_failure()

    # ------------------------------------------------------------------------------------------- memory
    def keep_for(self, tensor: torch.Tensor, lane: Lane) -> None:
        """Tell the caching allocator that ``lane`` reads ``tensor`` (made on another stream): its memory is not
        reused before that work is done, even if the owner frees it first (``zero_grad``). On the CPU a strict lane
        keeps it the same way; the default lanes' queued work holds a reference to it, which does too."""
        if isinstance(lane, CudaLane) and lane._own_stream is not None:
            tensor.record_stream(lane._own_stream)
        elif isinstance(lane, ThreadLane) and lane.strict:
            lane.keep(tensor)

    def made_on_compute(self, tensor: torch.Tensor) -> torch.Tensor:
        """Say that the compute lane (the calling thread) made ``tensor`` now, on the device: a lane given it before
        its next wait on the compute lane is refused when strict (on CUDA its fill would be unordered with that
        lane). Returns ``tensor``. Nothing to do on CUDA, where streams order it."""
        if self.strict:
            self._clock += 1
            storage = tensor.untyped_storage()
            self._stamps[storage._cdata] = (StorageWeakRef(storage), self._clock)
            if len(self._stamps) > 4096:
                self._stamps = {key: entry for key, entry in self._stamps.items() if not entry[0].expired()}
        return tensor

    def compute_clock(self) -> int:
        return self._clock

    def stamp_of(self, tensor: torch.Tensor) -> int:
        """Strict: the compute clock at which the compute lane made ``tensor`` (0: before anything was stamped)."""
        if not self._stamps:
            return 0
        entry = self._stamps.get(tensor.untyped_storage()._cdata)
        if entry is None or entry[0].expired():
            return 0
        return entry[1]

    def host_staging(self, tensor: torch.Tensor) -> bool:
        """Strict: whether ``tensor`` is pinned host staging made by :meth:`empty_host`."""
        entry = self._staging.get(tensor.untyped_storage()._cdata)
        return entry is not None and not entry.expired()

    @contextlib.contextmanager
    def allocating_on(self, lane: Lane):
        """Allocate the enclosed tensors for ``lane`` (CUDA: from its stream's pool, so their memory is reused only
        in that stream's order)."""
        if isinstance(lane, CudaLane):
            with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
                yield
        else:
            yield

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer: pinned on CUDA (for asynchronous copies), plain memory on the CPU."""
        staging = torch.empty(numel, dtype=dtype, pin_memory=self.is_cuda)
        if self.strict:
            storage = staging.untyped_storage()
            self._staging[storage._cdata] = StorageWeakRef(storage)
            if len(self._staging) > 4096:
                self._staging = {key: ref for key, ref in self._staging.items() if not ref.expired()}
        return staging

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
                if isinstance(lane, ThreadLane):
                    lane.stop()


def available_host_bytes() -> int:
    """The machine's available memory (Linux ``MemAvailable``; total memory elsewhere as a fallback)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
