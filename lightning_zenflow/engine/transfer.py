"""What moves data between the lanes and the host: the copy helpers the lanes run, and the helper thread.

The helper thread runs the host-side stages in order (host-mode adds, job launches); real on the CPU too, so the
CPU tests run the same concurrency as a GPU run.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence

import torch

from lightning_zenflow.engine.lanes import Lanes


def copy_all(copies: Sequence[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool) -> None:
    """Lane work: ``target.copy_(source)`` for each pair (asynchronous between pinned host memory and CUDA)."""
    for target, source in copies:
        target.copy_(source, non_blocking=non_blocking)


class Helper:
    """One helper thread that runs host-side stages in order (FIFO): host adds, job launches. Real on the CPU
    too, so the CPU tests run the same concurrency. Failures surface in the training thread at the next call."""

    def __init__(self, lanes: Lanes) -> None:
        self.lanes = lanes
        # CUDA: the thread's event waits and copies belong to the engine's device, not to device 0 (a context there)
        initializer = (lambda: torch.cuda.set_device(lanes.device)) if lanes.is_cuda else None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zenflow-helper", initializer=initializer
        )
        self._futures: list[concurrent.futures.Future] = []
        self._rng = lanes.rng("helper")

    def submit(self, fn: Callable[..., None], *args: object) -> concurrent.futures.Future:
        self.raise_failures()

        def run() -> None:
            seconds = self.lanes.delay_s("helper", self._rng)
            if seconds:
                time.sleep(seconds)
            fn(*args)

        future = self._executor.submit(run)
        self._futures.append(future)
        return future

    def raise_failures(self) -> None:
        """Re-raise the first failure of a finished job; forget finished ones."""
        while self._futures and self._futures[0].done():
            self._futures.pop(0).result()

    def wait(self, upto: concurrent.futures.Future | None = None) -> None:
        """Helper-thread queue wait, in order, up to ``upto`` (inclusive; everything when None)."""
        self.raise_failures()
        if upto is not None and upto.done():
            upto.result()
            return
        while self._futures:
            future = self._futures.pop(0)
            future.result()
            if future is upto:
                return

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._futures = []
