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


def add_all(
    additions: Sequence[tuple[torch.Tensor, torch.Tensor, float, int, int]],
    non_blocking: bool,
    landing_add: Callable[..., None] | None = None,
    seed: int = 0,
) -> None:
    """``dst <- dst * scale + src`` for each ``(dst, src, scale, row_offset, salt)`` (a landing under
    ``interim_step``); a host source goes up first. bf16 weights go through ``landing_add`` (stochastic rounding, its
    random bits seeded by ``seed``, the landing's step, and the matrix's ``salt``)."""
    for dst, src, scale, row_offset, salt in additions:
        if src.device != dst.device:
            src = src.to(dst.device, non_blocking=non_blocking)
        if dst.dtype == torch.bfloat16 and landing_add is not None:
            seed_device = torch.tensor((seed * 40503 + salt + 1) & 0x7FFFFFFF, dtype=torch.int64, device=dst.device)
            landing_add(dst, src, scale, row_offset, seed_device)
            continue
        if scale != 1.0:
            dst.mul_(scale)
        dst.add_(src)


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
