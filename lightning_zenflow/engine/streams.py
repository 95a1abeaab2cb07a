"""What differs between CUDA and the CPU, in one place: streams, events, pinned memory, stage delays.

Every other engine module issues the same operations in the same order on both; they reach streams and events
only through :class:`Lanes`. On CUDA a lane is a stream and an event is a CUDA event. On the CPU a lane is the
calling thread (work runs when issued) and an event is complete when recorded, so a wait on it returns at once.
The helper thread and the host worker process are real on both.

Test hook: ``Lanes(delays={stage: seconds})`` delays each asynchronous stage before its work (a sleep on the
CPU, ``torch.cuda._sleep`` queued on the stage's stream on CUDA). Results must not change: the determinism
tests compare a delayed run with an undelayed one bitwise.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

import torch

STAGES = ("side", "d2h", "h2d", "helper", "worker")
"""The asynchronous stages: the device update (side stream), gradient copies down, weight copies up, the
helper thread's host adds and job launches, and the host worker's update."""

_CUDA_SLEEP_CYCLES_PER_S = 1.5e9
"""``torch.cuda._sleep`` spins for a number of GPU clock cycles; about this many per second on current GPUs."""


class Event:
    """A point in a lane's work. CUDA: a CUDA event. CPU: done when recorded (the work ran when issued)."""

    def __init__(self, cuda: bool) -> None:
        self._event = torch.cuda.Event() if cuda else None

    def record(self, stream: torch.cuda.Stream | None) -> None:
        if self._event is not None:
            self._event.record(stream)

    def synchronize(self) -> None:
        """Host wait until the recorded work is done (CPU: it is)."""
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        return self._event is None or self._event.query()

    @property
    def cuda_event(self) -> torch.cuda.Event | None:
        return self._event


class Lanes:
    """The engine's streams on one device: ``side`` (device updates, accumulation, the landing of uploads),
    ``d2h`` (copies down) and ``h2d`` (copies up). Plain calls on the CPU."""

    def __init__(self, device: torch.device, delays: Mapping[str, float] | None = None) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        unknown = sorted(set(delays or {}) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown} to delay; the stages are {list(STAGES)}.")
        self.delays = dict(delays or {})
        # created here, at engine start, never in a strategy's __init__ (strategies get pickled)
        self.side = torch.cuda.Stream(device) if self.is_cuda else None
        self.d2h = torch.cuda.Stream(device) if self.is_cuda else None
        self.h2d = torch.cuda.Stream(device) if self.is_cuda else None

    def event(self) -> Event:
        return Event(self.is_cuda)

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None, stage: str | None = None) -> Iterator[None]:
        """Issue the enclosed work on ``stream`` (CUDA) or inline (CPU), after the stage's test delay."""
        if stream is None:
            self.delay(stage)
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self.delay(stage)
            yield

    def delay(self, stage: str | None) -> None:
        seconds = self.delays.get(stage, 0.0) if stage is not None else 0.0
        if not seconds:
            return
        if self.is_cuda and stage not in ("helper", "worker"):
            torch.cuda._sleep(int(seconds * _CUDA_SLEEP_CYCLES_PER_S))  # queued on the current stream
        else:
            time.sleep(seconds)

    def wait_compute(self, stream: torch.cuda.Stream | None) -> None:
        """GPU-side: ``stream`` waits for the work issued so far on the compute (current) stream."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_waits(self, event: Event) -> None:
        """GPU-side: the compute (current) stream waits for ``event``; no host wait."""
        if event.cuda_event is not None:
            torch.cuda.current_stream(self.device).wait_event(event.cuda_event)

    @staticmethod
    def stream_waits(stream: torch.cuda.Stream | None, event: Event) -> None:
        """GPU-side: ``stream`` waits for ``event``; no host wait."""
        if stream is not None and event.cuda_event is not None:
            stream.wait_event(event.cuda_event)

    def keep_for(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Tell the caching allocator that ``stream`` reads ``tensor`` (made on another stream): its memory is
        not reused before that work is done, even if the owner frees it first (``zero_grad``)."""
        if stream is not None:
            tensor.record_stream(stream)

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer: pinned on CUDA (for asynchronous copies), plain memory on the CPU."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.is_cuda)

    def synchronize(self) -> None:
        """Host wait for every stream of the device (CUDA); used only at selections and state transfers."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int:
        """Device memory still free for the engine: CUDA's free memory plus what the caching allocator holds
        unused; on the CPU, the machine's available memory."""
        if self.is_cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            unused_cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return int(free + unused_cached)
        return available_host_bytes()


def available_host_bytes() -> int:
    """The machine's available memory (Linux ``MemAvailable``; total memory elsewhere as a fallback)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
