"""Gradients down, weights up: the two accumulation modes and the upload of a host update.

The window's host-bound gradient columns are summed in fp32, one exact addition per step, in the same order in
both modes, so the host worker receives bit-identical sums (the worker divides by the count: the mean):

``DeviceAccumulation`` (``accumulate_on="device"``): an fp32 ``[rows, cols]`` accumulator per matrix on the
device, added to on the side stream at every step; at a window end it is copied down once, straight into the
host block's accumulator row that the worker reads. Nothing model-sized runs in the training process per step.
Link: 4 B per matrix element per window down.

``HostAccumulation`` (``accumulate_on="host"``): at every step the unselected columns of each gradient are
gathered on the device into a fixed-size device slot, copied down into a pinned slot, and added by the helper
thread into the host accumulator, where each matrix's unselected columns are kept *packed* (``[rows, n]``
contiguous, so the add is a plain contiguous add at memory bandwidth). Device memory: the two slots, whatever
the model size. Link: (1 - rho) x model bytes per step. The training thread waits only when both slots are
still being added (the host add is the throughput limit of this mode; see docs/performance.md).

``Uploads``: after the worker's update, the new weights (the fp32 master, or the model-dtype copy the worker
staged in the consumed accumulator) go up. With a device buffer (device mode) they are copied up on the h2d
stream as soon as the worker is done and swapped in at the landing step by a device copy; without one (host
mode) they are copied straight into the parameters at the landing step.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence

import torch

from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.lanes import Event, Lanes
from lightning_zenflow.engine.layout import GroupHostBuffers, MatrixSlot, staging_view
from lightning_zenflow.engine.ranks import Ranks

STAGING_SLOT_BYTES = 64 * 1024 * 1024
"""Bytes per slot of the host mode's staging ring (two slots on the device, two pinned on the host)."""
CONVERT_CHUNK_ELEMENTS = 1 << 20
"""Host add of a non-fp32 gradient: converted to fp32 in cache-sized pieces (4 MiB) before the add."""


def packed_view(row: torch.Tensor, slot: MatrixSlot, columns: int) -> torch.Tensor:
    """``[host_rows, columns]`` contiguous at the start of ``slot``'s region of a host row (host mode's
    accumulator)."""
    return row[slot.offset : slot.offset + slot.host_rows * columns].view(slot.host_rows, columns)


def _gather_columns(rows: torch.Tensor, columns: torch.Tensor, out: torch.Tensor) -> None:
    """Lane work: the ``columns`` of ``rows`` into ``out``."""
    torch.index_select(rows, 1, columns, out=out)


def _write_selected_all(states: Sequence[SelectedState]) -> None:
    """Lane work: the selected columns of each matrix back from their device masters."""
    for state in states:
        DeviceUpdater.write_selected(state)


def copy_all(copies: Sequence[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool) -> None:
    """Lane work: ``target.copy_(source)`` for each pair (asynchronous between pinned host memory and CUDA)."""
    for target, source in copies:
        target.copy_(source, non_blocking=non_blocking)


def add_all(additions: Sequence[tuple[torch.Tensor, torch.Tensor, float]], non_blocking: bool) -> None:
    """``dst <- dst * scale + src`` for each (a landing under ``interim_step``); a host source goes up first."""
    for dst, src, scale in additions:
        if src.device != dst.device:
            src = src.to(dst.device, non_blocking=non_blocking)
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


class DeviceAccumulation:
    """``accumulate_on="device"``: fp32 accumulators on the device, copied down once per window."""

    mode = "device"

    def __init__(self, lanes: Lanes, slots: Sequence[MatrixSlot], host_buffers: Sequence[GroupHostBuffers]) -> None:
        self.lanes = lanes
        self.host_buffers = host_buffers
        # this rank's rows only: the other rows' host state lives on other ranks
        self.acc_device = {
            (s.group_index, s.index_in_group): torch.zeros(
                s.host_rows, s.cols, dtype=torch.float32, device=lanes.device
            )
            for s in slots
        }
        self._offsets = {(s.group_index, s.index_in_group): s.offset for s in slots}
        self.d2h_bytes = 0

    def add(
        self, states: Sequence[SelectedState], slot: int, first_in_window: bool, helper: Helper, upload_read: Event
    ) -> None:
        """Add this step's gradients (whole rows), on the side lane after the device update."""
        lanes = self.lanes
        # the window's first add overwrites the accumulators: the engine's side-lane wait "window copied", issued
        # before this, orders it after the last window's copy down
        work = []
        for state in states:
            acc = self.acc_device.get((state.slot.group_index, state.slot.index_in_group))
            if acc is None:
                continue
            grad = state.slot.param.grad
            if grad is None:
                if first_in_window:
                    work.append((acc, None))
                continue
            # made on the compute lane, read on the side lane: keep it alive past zero_grad
            lanes.keep_for(grad, lanes.side)
            work.append((acc, state.slot.own(grad)))
        lanes.side.run(self._add_all, work, first_in_window)

    @staticmethod
    def _add_all(work: Sequence[tuple[torch.Tensor, torch.Tensor | None]], first_in_window: bool) -> None:
        for acc, grad2d in work:
            if grad2d is None:
                acc.zero_()
            elif first_in_window:
                acc.copy_(grad2d)  # the window's first gradient overwrites: no zeroing pass
            else:
                acc.add_(grad2d)  # fp32 + (model dtype cast to fp32): one exact conversion, one rounding

    def finish_window(self, slot: int, active: Sequence[Sequence[int]]) -> None:
        """Issue on the d2h lane the copies of the active matrices' accumulators into host accumulator ``slot``.

        The engine orders them: d2h waits for the side lane's adds first (its wait "window added"), and records the
        window's copy-down event after them. No wait for an upload that reads this slot (a model that is not fp32
        stages its weights here): the update staged in it was landed, on the side lane after the upload's copy up,
        by the end of the window in between, so the wait for the side lane covers it."""
        copies = []
        for group_index, indices in enumerate(active):
            host_row = self.host_buffers[group_index].grad_acc(slot)
            for index in indices:
                acc = self.acc_device[(group_index, index)]
                offset = self._offsets[(group_index, index)]
                copies.append((host_row[offset : offset + acc.numel()].view(acc.shape), acc))
                self.d2h_bytes += acc.nbytes
        self.lanes.d2h.run(copy_all, copies, self.lanes.is_cuda)

    def window_sum(self, slot: MatrixSlot, host_slot: int, unselected: torch.Tensor) -> torch.Tensor:
        """The open window's sum of this rank's rows of one matrix, ``[host_rows, cols]`` fp32 on the CPU."""
        return self.acc_device[(slot.group_index, slot.index_in_group)].cpu()

    def restore_window_sum(
        self, slot: MatrixSlot, host_slot: int, unselected: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Put back this rank's rows (``[host_rows, cols]``) of a saved window sum."""
        self.acc_device[(slot.group_index, slot.index_in_group)].copy_(value)

    def bytes_held(self) -> int:
        return sum(t.nbytes for t in self.acc_device.values())


class HostAccumulation:
    """``accumulate_on="host"``: per-step copies down through a fixed two-slot ring, added on the helper thread."""

    mode = "host"

    def __init__(self, lanes: Lanes, host_buffers: Sequence[GroupHostBuffers], slot_bytes: int = STAGING_SLOT_BYTES):
        self.lanes = lanes
        self.host_buffers = host_buffers
        self.slot_bytes = slot_bytes
        self.ring_device = [torch.empty(slot_bytes, dtype=torch.uint8, device=lanes.device) for _ in range(2)]
        self.ring_host = [lanes.empty_host(slot_bytes, torch.uint8) for _ in range(2)]
        self.copied = [lanes.event() for _ in range(2)]
        """Per ring slot: recorded on the d2h stream after its copy down."""
        self.gathered = [lanes.event() for _ in range(2)]
        self._free = [threading.Event() for _ in range(2)]
        for free in self._free:
            free.set()
        self._next = 0
        self.convert_fp32 = torch.empty(CONVERT_CHUNK_ELEMENTS, dtype=torch.float32)
        """The helper thread's reused fp32 buffer for converting a non-fp32 chunk before the add."""
        self.d2h_bytes = 0
        self.stall_s = 0.0

    def add(
        self, states: Sequence[SelectedState], slot: int, first_in_window: bool, helper: Helper, upload_read: Event
    ) -> None:
        """Gather (side lane), copy down (d2h lane) and add (helper thread) this step's unselected columns, after
        the device update; the training thread blocks only while both ring slots are still being added."""
        lanes = self.lanes
        if first_in_window:
            # the open window's accumulator may be the source of the last upload (staged weights): the helper
            # thread waits for that copy up before it writes there
            helper.submit(upload_read.wait_here, "upload read")
        for state in states:
            grad = state.slot.param.grad
            n_unselected = state.slot.cols - state.k
            if n_unselected == 0:
                continue
            acc2d = packed_view(self.host_buffers[state.slot.group_index].grad_acc(slot), state.slot, n_unselected)
            if grad is None:
                if first_in_window:
                    helper.submit(acc2d.zero_)
                continue
            # made on the compute lane, read on the side lane: keep it alive past zero_grad
            lanes.keep_for(grad, lanes.side)
            grad2d = grad.view(state.slot.rows, state.slot.cols)
            row_bytes = n_unselected * grad.element_size()
            if row_bytes > self.slot_bytes:
                raise ValueError(
                    f"a row of {state.slot.name} has {row_bytes} bytes of host-bound gradient, more than the "
                    f"{self.slot_bytes}-byte staging slot; use accumulate_on='device'."
                )
            rows_per_chunk = self.slot_bytes // row_bytes
            first_row = state.slot.row_start
            for row_start in range(first_row, state.slot.row_stop, rows_per_chunk):
                row_stop = min(state.slot.row_stop, row_start + rows_per_chunk)
                ring = self._acquire()
                shape = (row_stop - row_start, n_unselected)
                numel = shape[0] * shape[1]
                chunk_device = self.ring_device[ring][: numel * grad.element_size()].view(grad.dtype).view(shape)
                chunk_host = self.ring_host[ring][: numel * grad.element_size()].view(grad.dtype).view(shape)
                # no wait for the earlier copy down from this ring slot: it was acquired only after the helper
                # thread had added its previous contents, which it does after that copy (its wait "ring copied")
                lanes.side.run(_gather_columns, grad2d[row_start:row_stop], state.unselected, chunk_device)
                lanes.side.record(self.gathered[ring])
                # d2h waits (GPU-side) for the gather into the ring slot
                lanes.d2h.wait(self.gathered[ring], "ring gathered")
                lanes.d2h.run(copy_all, [(chunk_host, chunk_device)], lanes.is_cuda)
                lanes.d2h.record(self.copied[ring])
                self.d2h_bytes += numel * grad.element_size()
                acc_rows = acc2d[row_start - first_row : row_stop - first_row]
                helper.submit(self.add_staged, ring, chunk_host, acc_rows, first_in_window)

    def _acquire(self) -> int:
        """The next ring slot, once the helper thread has finished adding its previous contents."""
        ring = self._next
        self._next ^= 1
        free = self._free[ring]
        if not free.is_set():
            started = time.perf_counter()
            free.wait()  # training-thread wait: the host add is behind (this mode's throughput limit)
            self.stall_s += time.perf_counter() - started
        free.clear()
        return ring

    def add_staged(self, ring: int, chunk_host: torch.Tensor, acc_rows: torch.Tensor, overwrite: bool) -> None:
        """Helper thread: add (or, at a window's first step, write) one staged chunk into packed accumulator rows,
        then free its ring slot. ``acc_rows`` is contiguous: a plain streaming add."""
        try:
            # helper-thread wait for this chunk's copy down to land in the pinned slot
            self.copied[ring].wait_here("ring copied")
            if chunk_host.dtype == torch.float32:
                if overwrite:
                    acc_rows.copy_(chunk_host)
                else:
                    acc_rows.add_(chunk_host)
                return
            # a non-fp32 gradient: convert in cache-sized pieces into a reused fp32 buffer, then add (exactly the
            # arithmetic of the device mode: one exact conversion, one rounding)
            flat_acc = acc_rows.reshape(-1) if acc_rows.is_contiguous() else None
            flat_src = chunk_host.reshape(-1)
            if flat_acc is None:
                raise RuntimeError("internal error: a packed accumulator view is not contiguous.")
            for start in range(0, flat_src.numel(), CONVERT_CHUNK_ELEMENTS):
                stop = min(flat_src.numel(), start + CONVERT_CHUNK_ELEMENTS)
                if overwrite:
                    flat_acc[start:stop].copy_(flat_src[start:stop])
                else:
                    work = self.convert_fp32[: stop - start]
                    work.copy_(flat_src[start:stop])
                    flat_acc[start:stop].add_(work)
        finally:
            self._free[ring].set()

    def finish_window(self, slot: int, active: Sequence[Sequence[int]]) -> None:
        """Nothing to copy: the helper thread's adds are queued before the launch that follows."""

    def window_sum(self, slot: MatrixSlot, host_slot: int, unselected: torch.Tensor) -> torch.Tensor:
        """The open window's sum of this rank's rows of one matrix, ``[host_rows, cols]`` fp32 (zero in the
        selected columns)."""
        full = torch.zeros(slot.host_rows, slot.cols, dtype=torch.float32)
        packed = packed_view(self.host_buffers[slot.group_index].grad_acc(host_slot), slot, unselected.numel())
        full.index_copy_(1, unselected.cpu(), packed)
        return full

    def restore_window_sum(
        self, slot: MatrixSlot, host_slot: int, unselected: torch.Tensor, value: torch.Tensor
    ) -> None:
        packed = packed_view(self.host_buffers[slot.group_index].grad_acc(host_slot), slot, unselected.numel())
        packed.copy_(value.index_select(1, unselected.cpu()))

    def bytes_held(self) -> int:
        """Device bytes: the two staging slots."""
        return sum(t.nbytes for t in self.ring_device)

    def host_staging_bytes(self) -> int:
        """Host bytes: the two pinned staging slots and the helper's fp32 conversion buffer."""
        return sum(t.nbytes for t in self.ring_host) + self.convert_fp32.nbytes


class Uploads:
    """The new weights of a host update, up to the device. ``prefetch``: through a device buffer of the model's
    size (device mode), copied as soon as the worker is done, landed by a device copy.

    Under data parallel each rank uploads its own rows; at the landing step the ranks share them
    (:meth:`Ranks.share_rows`, in place in the parameters) before the selected columns are restored."""

    def __init__(
        self,
        lanes: Lanes,
        device_updater: DeviceUpdater,
        host_buffers: Sequence[GroupHostBuffers],
        prefetch_slots: Sequence[MatrixSlot] | None,
        ranks: Ranks | None = None,
    ) -> None:
        self.lanes = lanes
        self.device_updater = device_updater
        self.host_buffers = host_buffers
        self.ranks = ranks or Ranks()
        self.buffers_device = (
            {
                (s.group_index, s.index_in_group): torch.empty(
                    s.host_rows, s.cols, dtype=s.param.dtype, device=lanes.device
                )
                for s in prefetch_slots
            }
            if prefetch_slots is not None
            else None
        )
        self.source_read = lanes.event()
        """Recorded after the last upload's copy up: its host source (master, staged slot) may be rewritten."""
        self._prefetched: tuple[int, tuple] | None = None
        self.h2d_bytes = 0

    def _source(self, group_index: int, state: SelectedState, slot: int) -> torch.Tensor:
        host = self.host_buffers[group_index]
        dtype = state.slot.param.dtype
        if dtype == torch.float32:
            return state.slot.view2d(host.master)  # fp32 weights go up from the master itself
        return staging_view(host.grad_acc(slot), state.slot, dtype)

    def prefetch(self, slot: int, active: Sequence[Sequence[int]]) -> None:
        """Device mode: start copying the finished update up into the device buffers (h2d lane). No-op
        without buffers or when already started.

        Issued by the training thread once the worker is done, which is after the previous landing's side-lane
        reads of these buffers: the worker started only when the window's copy down had landed, and that copy
        waited for the side lane's work up to this window's end, the previous landing included."""
        if self.buffers_device is None or self._prefetched is not None:
            return
        lanes = self.lanes
        copies = []
        for group_index, indices in enumerate(active):
            states = self.device_updater.selected[group_index]
            for index in indices:
                source = self._source(group_index, states[index], slot)
                copies.append((self.buffers_device[(group_index, index)], source))
                self.h2d_bytes += source.nbytes
        lanes.h2d.run(copy_all, copies, lanes.is_cuda)
        lanes.h2d.record(self.source_read)
        self._prefetched = (slot, tuple(tuple(a) for a in active))

    def land(self, slot: int, active: Sequence[Sequence[int]], scales: Sequence[Sequence[float]] | None = None) -> None:
        """Write the update into the parameters, then restore the selected columns from the device masters.
        Issued on the side lane; the compute lane waits for it before the next forward. ``scales``
        (``interim_step``): per group and active matrix, the weights are scaled by it and the uploaded step is added."""
        lanes = self.lanes
        self.prefetch(slot, active)
        # side waits (GPU-side) for the compute lane: callbacks may have read the weights
        lanes.side.wait_lane(lanes.compute, "side after compute")
        if self.buffers_device is not None:
            # side waits (GPU-side) for the copy up into the device buffers
            lanes.side.wait(self.source_read, "upload arrived")
        copies, shared, states = [], [], []
        for group_index, indices in enumerate(active):
            group_states = self.device_updater.selected[group_index]
            copies_in_group: list[int] = []
            for index in indices:
                state = group_states[index]
                param2d = state.slot.param.data.view(state.slot.rows, state.slot.cols)
                own_rows = param2d[state.slot.row_start : state.slot.row_stop]
                if self.buffers_device is not None:
                    source = self.buffers_device[(group_index, index)]
                else:
                    source = self._source(group_index, state, slot)
                    self.h2d_bytes += source.nbytes
                if scales is None:
                    copies.append((own_rows, source))
                else:
                    copies.append((own_rows, source, scales[group_index][len(copies_in_group)]))
                copies_in_group.append(index)
                shared.append(param2d)
                states.append(state)
        if scales is None:
            lanes.side.run(copy_all, copies, lanes.is_cuda)
        else:
            # host mode: each step goes up through a temporary (allocated in the side lane's order)
            lanes.side.run(add_all, copies, lanes.is_cuda)
        if self.buffers_device is None:
            # host mode: the side lane's copies read the host source (the master, or the staged weights)
            lanes.side.record(self.source_read)
        if self.ranks.sharded:
            # data parallel: every rank's rows, on every rank, in the side lane's order
            lanes.collective(lanes.side, self.ranks.share_rows_many, shared)
        lanes.side.run(_write_selected_all, states)
        self._prefetched = None

    def bytes_held(self) -> int:
        return sum(t.nbytes for t in self.buffers_device.values()) if self.buffers_device is not None else 0
