"""Landing a host update: the worker's result up to the device, and the host update in flight until it lands.

``Uploads``: at the landing step, on the side lane, each active matrix's result goes up from the host's window row
(pinned on CUDA) straight into the parameters, in row blocks: nothing model-sized on the device. Where the weights are
the masters (the default) the result is a step, added as ``w <- w * (1 - lr * wd) + step`` (bf16 weights rounded
stochastically, ``engine/kernels.py``'s ``landing_add_``) through one reused device buffer of at most
:data:`LANDING_CHUNK_BYTES`; where the host keeps masters it is the new weights, copied into the parameters. The next
forward waits for the landing (docs/performance.md: b B per matrix element over the link, once per window, on the
critical path).

``Landing``: the host update in flight (the schedule's ``pending``), from its launch on the helper thread to its
landing: polled without blocking at every step, awaited at a checkpoint, landed at the step the rule says.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence

import torch

from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.host import HostWorker
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import GroupHostBuffers, MatrixSlot, staging_view
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.schedule import PendingUpdate
from lightning_zenflow.engine.transfer import Helper, copy_all

LANDING_CHUNK_BYTES = 64 * 1024 * 1024
"""The device buffer that steps go up through (rows of one matrix at a time, never more than this)."""


def landing_ring_bytes(slots: Sequence[MatrixSlot]) -> int:
    """Device bytes of the landing's buffer for these matrices: at most :data:`LANDING_CHUNK_BYTES`, and never more
    than the largest matrix's fp32 rows need."""
    largest = max((4 * slot.host_numel for slot in slots), default=0)
    return min(LANDING_CHUNK_BYTES, largest)


def _write_selected_all(updater: DeviceUpdater, states: Sequence[SelectedState]) -> None:
    """Lane work: the selected columns of each matrix back from their device masters."""
    for state in states:
        updater.write_selected(state)


def _land_steps(
    additions: Sequence[tuple[torch.Tensor, torch.Tensor, float, int, torch.Tensor]],
    ring: torch.Tensor | None,
    non_blocking: bool,
    landing_add: Callable[..., None],
) -> None:
    """Lane work: ``dst <- dst * scale + src`` for each ``(dst, src, scale, row_offset, seed)``, a host ``src`` copied
    up through ``ring`` first (in this lane's order, so the next block's copy waits for this block's add)."""
    for dst, src, scale, row_offset, seed in additions:
        if src.device != dst.device:
            staged = ring.view(torch.uint8)[: src.nbytes].view(src.dtype).view(src.shape)
            staged.copy_(src, non_blocking=non_blocking)
            src = staged
        landing_add(dst, src, scale, row_offset, seed.to(dst.device, non_blocking=non_blocking))


def landing_call_like(
    dst: torch.Tensor, src_shape: torch.Size, src_dtype: torch.dtype, scale: float, row_offset: int
) -> tuple:
    """Arguments like those of the lane's ``landing_add`` call, to build the kernel with: the weights' rows, the step
    as the lane passes it (on the weights' device, shaped like the source: staged up through the ring on CUDA, the
    host row itself on the CPU), the scale, the row offset and the seed copied up (0-d int64 on the device). Made from
    the source's shape and dtype only, so a build never depends on where the source lives (a host source once gave a
    build a ``[1, 1]`` step beside ``[rows, cols]`` weights: a trace that can only fail, on CUDA alone)."""
    step_like = dst.new_empty((), dtype=src_dtype).expand(src_shape)
    seed_like = dst.new_zeros((), dtype=torch.int64)
    return dst, step_like, scale, row_offset, seed_like


class Uploads:
    """The results of host updates, up to the device at their landing.

    Under data parallel each rank lands its own rows; then the ranks share them (:meth:`Ranks.share_rows`, in place in
    the parameters) before the selected columns are restored."""

    def __init__(
        self,
        lanes: Lanes,
        device_updater: DeviceUpdater,
        host_buffers: Sequence[GroupHostBuffers],
        ranks: Ranks | None = None,
        row_offsets: Mapping[str, int] | None = None,
    ) -> None:
        self.lanes = lanes
        self.device_updater = device_updater
        self.host_buffers = host_buffers
        self.ranks = ranks or Ranks()
        self.row_offsets = dict(row_offsets or {})
        self.source_read = lanes.event()
        """Recorded after the last landing's reads of the host: its window rows (or masters) may be rewritten."""
        self.ring_device: torch.Tensor | None = None
        """The device buffer steps go up through (allocated at the first landing that needs it)."""
        self.h2d_bytes = 0
        self.landing_add: Callable[..., None] | None = None
        """The kernel that lands a step (``engine/kernels.py``'s ``landing_add_``), set by the engine."""
        self.prepare: Callable[..., None] | None = None
        """Builds ``landing_add`` ahead of a lane's call (``Kernels.prepare``), set by the engine."""

    def _source(self, group_index: int, state: SelectedState, slot: int) -> torch.Tensor:
        host = self.host_buffers[group_index]
        if host.master is None:
            # the worker wrote the step over the window's sum it read
            return state.slot.view2d(host.grad_acc(slot))
        dtype = state.slot.param.dtype
        if dtype == torch.float32:
            return state.slot.view2d(host.master)  # fp32 weights go up from the master itself
        return staging_view(host.grad_acc(slot), state.slot, dtype)

    def _ring(self, nbytes: int) -> torch.Tensor:
        if self.ring_device is None or self.ring_device.numel() < nbytes:
            with self.lanes.allocating_on(self.lanes.side):
                self.ring_device = torch.empty(nbytes, dtype=torch.uint8, device=self.lanes.device)
        return self.ring_device

    def land(
        self,
        slot: int,
        active: Sequence[Sequence[int]],
        scales: Sequence[Sequence[float]] | None = None,
        seed: int = 0,
    ) -> None:
        """Write the update into the parameters, then restore the selected columns from the device masters.
        Issued on the side lane; the compute lane waits for it before the next forward. ``scales`` (the weights are
        the masters): per group and active matrix, the weights are scaled by it and the uploaded step is added (bf16
        weights with stochastic rounding, seeded by ``seed``, the landing's step); None: the new weights are copied."""
        lanes = self.lanes
        # side waits (GPU-side) for the compute lane: callbacks may have read the weights
        lanes.side.wait_lane(lanes.compute, "side after compute")
        copies, additions, shared, states = [], [], [], []
        chunk_rows_bytes = 0
        seeds = []
        for group_index, indices in enumerate(active):
            group_states = self.device_updater.selected[group_index]
            for position, index in enumerate(indices):
                state = group_states[index]
                slot2d = state.slot
                param2d = slot2d.param.data.view(slot2d.rows, slot2d.cols)
                own_rows = param2d[slot2d.row_start : slot2d.row_stop]
                source = self._source(group_index, state, slot)
                self.h2d_bytes += source.nbytes
                if scales is None:
                    copies.append((own_rows, source))
                else:
                    scale = scales[group_index][position]
                    salt = slot2d.salt & 0xFFFF
                    row_offset = self.row_offsets.get(slot2d.name, 0) + slot2d.row_start
                    seeds.append((seed * 40503 + salt + 1) & 0x7FFFFFFF)
                    row_bytes = source.nbytes // max(1, source.shape[0])
                    block = max(1, LANDING_CHUNK_BYTES // max(1, row_bytes))
                    for start in range(0, source.shape[0], block):
                        stop = min(source.shape[0], start + block)
                        additions.append(
                            (own_rows[start:stop], source[start:stop], scale, row_offset + start, len(seeds) - 1)
                        )
                        chunk_rows_bytes = max(chunk_rows_bytes, (stop - start) * row_bytes)
                shared.append(param2d)
                states.append(state)
        if copies:
            lanes.side.run(copy_all, copies, lanes.is_cuda)
        if additions:
            # the seeds of the landing's stochastic rounding: one copy up from pinned memory, no host sync
            seeds_host = lanes.empty_host(len(seeds), torch.int64)
            seeds_host.copy_(torch.tensor(seeds, dtype=torch.int64))
            ring = self._ring(chunk_rows_bytes) if lanes.is_cuda else None
            additions = [(dst, src, scale, offset, seeds_host[i]) for dst, src, scale, offset, i in additions]
            if self.prepare is not None:
                # built on this (the training) thread before the lane runs it (engine/compiled.py)
                kinds = {(dst.dtype, src.dtype): (dst, src, scale, offset) for dst, src, scale, offset, _ in additions}
                for dst, src, scale, offset in kinds.values():
                    self.prepare(self.landing_add, *landing_call_like(dst, src.shape, src.dtype, scale, offset))
            lanes.side.run(_land_steps, additions, ring, lanes.is_cuda, self.landing_add)
        # the side lane's copies read the host source (the window rows, or the masters)
        lanes.side.record(self.source_read)
        if self.ranks.sharded:
            # data parallel: every rank's rows, on every rank, in the side lane's order
            lanes.collective(lanes.side, self.ranks.share_rows_many, shared)
        lanes.side.run(_write_selected_all, self.device_updater, states)

    def bytes_held(self) -> int:
        return self.ring_device.nbytes if self.ring_device is not None else 0


class Landing:
    """The host update in flight, from its launch on the helper thread to its landing in the parameters."""

    def __init__(self, helper: Helper) -> None:
        self.helper = helper
        self.launch_future: concurrent.futures.Future | None = None
        """The launch queued on the helper thread (behind the window's host adds), until it has run."""
        self.last_host_s: float | None = None
        """Compute time of the most recent finished host update."""
        self.landings = 0

    def poll(self, pending: PendingUpdate | None, worker: HostWorker | None, uploads: Uploads) -> None:
        """Without blocking: note whether the host update in flight has finished (its time, for the telemetry)."""
        if pending is None or pending.computed or worker is None:
            return
        if self.launch_future is not None and not self.launch_future.done():
            return
        self.helper.raise_failures()
        self.launch_future = None
        host_s = worker.poll()
        if host_s is None:
            return
        self.last_host_s = host_s
        pending.computed = True

    def await_computed(self, pending: PendingUpdate | None, worker: HostWorker | None) -> None:
        """Wait (without applying) until the host update in flight has finished computing."""
        if pending is None or pending.computed:
            return
        # the launch may still sit on the helper thread, behind this window's host adds: wait for it, not for
        # work queued after it (the next window's adds)
        if self.launch_future is not None:
            self.helper.wait(self.launch_future)
            self.launch_future = None
        self.last_host_s = worker.wait()
        pending.computed = True

    def land(
        self,
        pending: PendingUpdate,
        worker: HostWorker | None,
        uploads: Uploads,
        device_updater: DeviceUpdater,
        seed: int = 0,
    ) -> None:
        """Apply the host update in flight: its new weights (or steps) into the parameters, on the side lane."""
        self.await_computed(pending, worker)
        uploads.land(pending.slot, pending.active, pending.scales, seed)
        device_updater.weights_written()
        device_updater.end_step()
        self.landings += 1

    def drain(self) -> None:
        # helper-thread queue wait: every host add and launch issued so far has finished (or raised)
        self.helper.wait()
        self.launch_future = None
