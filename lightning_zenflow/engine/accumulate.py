"""Where the window's host-bound gradients are summed: the two accumulation modes, and the choice between them.

``DeviceAccumulation`` (``accumulate_on="device"``): one ``[rows, cols]`` accumulator per matrix on the device, added to
on the side lane at every step; at a window end it is copied down once, straight into the host's window row that the
worker reads. Its dtype is the host format's (``engine/layout.py``): bf16 in the compact state (``host_state="bf16"``),
each addition rounded stochastically (``engine/rounding.py``, ``engine/kernels.py``'s ``accumulate_bf16_``): 2 B per
matrix element; fp32 in the exact state, one exact conversion and one rounding per addition: 4 B. Nothing
model-sized runs in the training process per step. Link: 2 (or 4) B per matrix element per window down.

``HostAccumulation`` (``accumulate_on="host"``): at every step the unselected columns of each gradient are
gathered on the device into a fixed-size device slot, copied down into a pinned slot, and added in fp32 by the helper
thread into the host accumulator, where each matrix's unselected columns are kept *packed* (``[rows, n]``
contiguous, so the add is a plain contiguous add at memory bandwidth). Device memory: the two slots, whatever
the model size. Link: (1 - rho) x model bytes per step. The training thread waits only when both slots are
still being added (the host add is the throughput limit of this mode; see docs/performance.md).

With the exact state both modes sum in fp32, in the same order: the worker receives bit-identical sums. With the
compact state the device mode's sum is rounded at every step and the host mode's is not: their numbers differ by
that rounding.

:func:`choose_accumulation` builds one of them at the first step (``"auto"``: the device when its buffers fit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.host_step import COLUMN_SALT
from lightning_zenflow.engine.kernels import Kernels
from lightning_zenflow.engine.landing import Uploads, landing_ring_bytes
from lightning_zenflow.engine.lanes import Event, Lanes
from lightning_zenflow.engine.layout import GroupHostBuffers, GroupLayout, HostFormat, MatrixSlot
from lightning_zenflow.engine.migrate import peak_chunk_elements
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.rounding import PURPOSE_ACCUMULATE, bits_table, offset_of
from lightning_zenflow.engine.transfer import Helper, copy_all

STAGING_SLOT_BYTES = 64 * 1024 * 1024
"""Bytes per slot of the host mode's staging ring (two slots on the device, two pinned on the host)."""
CONVERT_CHUNK_ELEMENTS = 1 << 20
"""Host add of a non-fp32 gradient: converted to fp32 in cache-sized pieces (4 MiB) before the add."""


AUTO_DEVICE_MARGIN = 1.25
"""``accumulate_on="auto"`` takes the device when its buffers need at most 1/1.25 of the free device memory."""


def packed_view(row: torch.Tensor, slot: MatrixSlot, columns: int) -> torch.Tensor:
    """``[host_rows, columns]`` contiguous at the start of ``slot``'s region of a host row (host mode's
    accumulator)."""
    return row[slot.offset : slot.offset + slot.host_rows * columns].view(slot.host_rows, columns)


def _gather_columns(rows: torch.Tensor, columns: torch.Tensor, out: torch.Tensor) -> None:
    """Lane work: the ``columns`` of ``rows`` into ``out``."""
    torch.index_select(rows, 1, columns, out=out)


class DeviceAccumulation:
    """``accumulate_on="device"``: accumulators on the device (bf16 or fp32), copied down once per window."""

    mode = "device"

    def __init__(
        self,
        lanes: Lanes,
        slots: Sequence[MatrixSlot],
        host_buffers: Sequence[GroupHostBuffers],
        dtype: torch.dtype = torch.float32,
        kernels: Kernels | None = None,
        row_offsets: Mapping[str, int] | None = None,
    ) -> None:
        self.lanes = lanes
        self.host_buffers = host_buffers
        self.dtype = dtype
        self.kernels = kernels
        # this rank's rows only: the other rows' host state lives on other ranks
        self.acc_device = {
            (s.group_index, s.index_in_group): torch.zeros(s.host_rows, s.cols, dtype=dtype, device=lanes.device)
            for s in slots
        }
        self._offsets = {(s.group_index, s.index_in_group): s.offset for s in slots}
        self.noise: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        """bf16: per matrix, the rounding's row and column numbers on the device, and its salt."""
        if dtype == torch.bfloat16:
            for s in slots:
                row_start = (row_offsets or {}).get(s.name, 0) + s.row_start
                row_r = bits_table(s.salt, row_start, s.host_rows).to(lanes.device)
                col_r = bits_table(s.salt ^ COLUMN_SALT, 0, s.cols).to(lanes.device)
                self.noise[(s.group_index, s.index_in_group)] = (row_r, col_r, s.salt)
        self.d2h_bytes = 0
        self._offset_like: dict[torch.device, torch.Tensor] = {}
        """Per device: a 0-d int32 view like the lane's ``offsets[index]``, to build the window sum's kernel with."""

    def add(
        self,
        states: Sequence[SelectedState],
        slot: int,
        first_in_window: bool,
        helper: Helper,
        upload_read: Event,
        t: int = 0,
    ) -> None:
        """Add step ``t``'s gradients (whole rows), on the side lane after the device update."""
        lanes = self.lanes
        # the window's first add overwrites the accumulators: the engine's side-lane wait "window copied", issued
        # before this, orders it after the last window's copy down
        work = []
        for state in states:
            key = (state.slot.group_index, state.slot.index_in_group)
            acc = self.acc_device.get(key)
            if acc is None:
                continue
            grad = state.slot.param.grad
            if grad is None:
                if first_in_window:
                    work.append((acc, None, None))
                continue
            # made on the compute lane, read on the side lane: keep it alive past zero_grad
            lanes.keep_for(grad, lanes.side)
            work.append((acc, state.slot.own(grad), self.noise.get(key)))
        if self.dtype == torch.bfloat16:
            # the step's lattice offsets, one per matrix: one asynchronous copy up from pinned memory (the pinned
            # buffer is kept by the host allocator until the copy, issued on the side lane, is done)
            offsets_host = lanes.empty_host(max(1, len(work)), torch.int32)
            for index, (_, _, noise) in enumerate(work):
                offsets_host[index] = offset_of(noise[2], PURPOSE_ACCUMULATE, t) if noise is not None else 0
            if self.kernels is not None:
                self._prepare(work, first_in_window)
            lanes.side.run(self._add_all_bf16, work, first_in_window, offsets_host, self.kernels, lanes.is_cuda)
        else:
            lanes.side.run(self._add_all, work, first_in_window)

    def _prepare(self, work: Sequence[tuple], first_in_window: bool) -> None:
        """Build the window sum's kernel here, on the training thread, before the lane runs it (``engine/compiled.py``),
        with arguments as the lane passes them: ``offsets[index]`` is a 0-d int32 view on the device."""
        for acc, grad2d, noise in work:
            if grad2d is None:
                continue
            offset_like = self._offset_like.get(acc.device)
            if offset_like is None:
                offset_like = self._offset_like[acc.device] = torch.zeros(2, dtype=torch.int32, device=acc.device)[1]
            self.kernels.prepare(
                self.kernels.accumulate_bf16_, acc, grad2d, noise[0], noise[1], offset_like, first_in_window
            )

    @staticmethod
    def _add_all(work: Sequence[tuple], first_in_window: bool) -> None:
        for acc, grad2d, _ in work:
            if grad2d is None:
                acc.zero_()
            elif first_in_window:
                acc.copy_(grad2d)  # the window's first gradient overwrites: no zeroing pass
            else:
                acc.add_(grad2d)  # fp32 + (model dtype cast to fp32): one exact conversion, one rounding

    @staticmethod
    def _add_all_bf16(
        work: Sequence[tuple], first_in_window: bool, offsets_host: torch.Tensor, kernels: Kernels, is_cuda: bool
    ) -> None:
        if not work:
            return
        offsets = offsets_host.to(work[0][0].device, non_blocking=is_cuda)
        for index, (acc, grad2d, noise) in enumerate(work):
            if grad2d is None:
                acc.zero_()
                continue
            row_r, col_r, _ = noise
            kernels.accumulate_bf16_(acc, grad2d, row_r, col_r, offsets[index], first_in_window)

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
        return self.acc_device[(slot.group_index, slot.index_in_group)].float().cpu()

    def restore_window_sum(
        self, slot: MatrixSlot, host_slot: int, unselected: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Put back this rank's rows (``[host_rows, cols]``) of a saved window sum."""
        self.acc_device[(slot.group_index, slot.index_in_group)].copy_(value)

    def bytes_held(self) -> int:
        """The accumulators and (bf16) the rounding's row and column numbers (4 B per row and per column)."""
        tables = sum(row_r.nbytes + col_r.nbytes for row_r, col_r, _ in self.noise.values())
        return sum(t.nbytes for t in self.acc_device.values()) + tables


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
        self,
        states: Sequence[SelectedState],
        slot: int,
        first_in_window: bool,
        helper: Helper,
        upload_read: Event,
        t: int = 0,
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


def may_go_to_host(config: ZenFlowConfig, slot: MatrixSlot) -> bool:
    """Whether any column of ``slot`` can ever be updated on the host (a warm-up step puts all of them there)."""
    return config.full_warm_up_rounds > 0 or num_selected_columns(slot.cols, config.topk_ratio) < slot.cols


def check_dense_gradients(layout: Sequence[GroupLayout]) -> None:
    """At the first step (and after a new layout): a sparse gradient cannot be split by columns."""
    for group in layout:
        for entry in (*group.matrices, *group.device_only):
            grad = entry.param.grad
            if grad is not None and grad.is_sparse:
                raise UnsupportedSetupError(
                    f"parameter {entry.name} has a sparse gradient (an nn.Embedding(sparse=True)?), which "
                    "ZenFlow's column split cannot take; build the module with sparse=False, or freeze it."
                )


def selection_device_bytes(
    config: ZenFlowConfig, layout: Sequence[GroupLayout], device_updater: DeviceUpdater, ranks: Ranks
) -> int:
    """Device bytes the selected columns still need beyond what is held now: their fp32 master, two moments and
    gather buffer (16 B per selected element) and indices (8 B per column), plus the peak of a migration (the
    arriving columns and the old state beside the new one: 24 B per selected element of its largest chunk; 12 more
    under data parallel, where the entering columns' rows from every rank meet in one buffer)."""
    transient = 36 if ranks.sharded else 24
    total = peak = 0
    for group in layout:
        selected = [slot.rows * num_selected_columns(slot.cols, config.topk_ratio) for slot in group.matrices]
        total += sum(16 * n for n in selected) + sum(8 * slot.cols for slot in group.matrices)
        peak = max(peak, peak_chunk_elements(selected))  # migrate.py moves the matrices chunk by chunk
    total += transient * peak
    held = sum(
        4 * state.master.nbytes + state.selected.nbytes + state.unselected.nbytes
        for state in device_updater.matrix_states()
    )
    return max(0, total - held)


def choose_accumulation(
    config: ZenFlowConfig,
    lanes: Lanes,
    layout: Sequence[GroupLayout],
    host_buffers: Sequence[GroupHostBuffers],
    device_updater: DeviceUpdater,
    ranks: Ranks,
    host_format: HostFormat,
    kernels: Kernels | None = None,
    row_offsets: Mapping[str, int] | None = None,
) -> tuple[DeviceAccumulation | HostAccumulation, Uploads, str]:
    """Build the accumulation mode and its uploads (``"auto"``: device when its buffers fit, measured now, after the
    first backward has allocated the gradients). Returns them and a sentence saying why that mode."""
    slots = [s for g in layout for s in g.matrices if may_go_to_host(config, s)]
    window = host_format.for_mode("device").window
    itemsize = torch.empty((), dtype=window).element_size()
    need = sum(s.host_numel * itemsize for s in slots)  # the accumulators
    need += landing_ring_bytes(slots)
    need += selection_device_bytes(config, layout, device_updater, ranks)
    mode = config.accumulate_on
    if mode == "auto":
        free = lanes.free_bytes()
        fits = need * AUTO_DEVICE_MARGIN <= free
        # every rank takes the same mode (the telemetry is easier to read)
        mode = "device" if ranks.agree(float(fits), lanes.device, op="min") else "host"
        reason = (
            f"accumulate_on='auto' chose {mode!r}: the device buffers need {need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free"
        )
    else:
        reason = f"accumulate_on={mode!r} (configured)"
    uploads = Uploads(lanes, device_updater, host_buffers, ranks, row_offsets)
    if mode == "device":
        accumulation: DeviceAccumulation | HostAccumulation = DeviceAccumulation(
            lanes, slots, host_buffers, window, kernels, row_offsets
        )
        return accumulation, uploads, reason
    # a slot never larger than the largest gradient it would carry (a small model needs no 64 MiB ring)
    largest = max((s.host_numel * s.param.element_size() for s in slots), default=1)
    accumulation = HostAccumulation(lanes, host_buffers, max(1, min(STAGING_SLOT_BYTES, largest)))
    return accumulation, uploads, reason


def complement(selected: torch.Tensor, cols: int) -> torch.Tensor:
    """The columns of ``cols`` not in ``selected`` (CPU indices, ascending)."""
    keep = torch.ones(cols, dtype=torch.bool)
    keep[selected] = False
    return keep.nonzero().flatten()


def window_sums_of(
    accumulation: DeviceAccumulation | HostAccumulation,
    config: ZenFlowConfig,
    device_updater: DeviceUpdater,
    host_slot: int,
) -> dict[str, torch.Tensor]:
    """This rank's rows of each host-bound matrix's open window sum, ``{name: [host_rows, cols] fp32}``."""
    sums = {}
    for state in device_updater.matrix_states():
        slot = state.slot
        if may_go_to_host(config, slot):
            sums[slot.name] = accumulation.window_sum(slot, host_slot, complement(state.selected_host, slot.cols))
    return sums


def restore_window_sums_into(
    accumulation: DeviceAccumulation | HostAccumulation,
    config: ZenFlowConfig,
    device_updater: DeviceUpdater,
    host_slot: int,
    sums: Mapping[str, torch.Tensor],
) -> None:
    """Put back this rank's rows of each saved window sum (``sums``: ``{name: [host_rows, cols]}``)."""
    for state in device_updater.matrix_states():
        slot = state.slot
        if slot.name in sums and may_go_to_host(config, slot):
            unselected = complement(state.selected_host, slot.cols)
            accumulation.restore_window_sum(slot, host_slot, unselected, sums[slot.name])
