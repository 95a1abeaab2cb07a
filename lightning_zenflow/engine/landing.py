"""Landing a host update: the new weights up to the device, and the host update in flight until it lands.

``Uploads``: after the worker's update, the new weights (the fp32 master, or the model-dtype copy the worker
staged in the consumed accumulator) go up. With a device buffer (device mode) they are copied up on the h2d
stream as soon as the worker is done and swapped in at the landing step by a device copy; without one (host
mode) they are copied straight into the parameters at the landing step.

``Landing``: the host update in flight (the schedule's ``pending``), from its launch on the helper thread to its
landing: polled without blocking at every step, awaited at a checkpoint, landed at the step the rule says.
"""

from __future__ import annotations

import concurrent.futures
import zlib
from collections.abc import Callable, Sequence

import torch

from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.host import HostWorker
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import GroupHostBuffers, MatrixSlot, staging_view
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.schedule import PendingUpdate
from lightning_zenflow.engine.transfer import Helper, add_all, copy_all


def _write_selected_all(states: Sequence[SelectedState]) -> None:
    """Lane work: the selected columns of each matrix back from their device masters."""
    for state in states:
        DeviceUpdater.write_selected(state)


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
        self.landing_add: Callable[..., None] | None = None
        """``interim_step``: the kernel that lands a step on bf16 weights (``engine/kernels.py``), set by the engine."""

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

    def land(
        self,
        slot: int,
        active: Sequence[Sequence[int]],
        scales: Sequence[Sequence[float]] | None = None,
        seed: int = 0,
    ) -> None:
        """Write the update into the parameters, then restore the selected columns from the device masters.
        Issued on the side lane; the compute lane waits for it before the next forward. ``scales``
        (``interim_step``): per group and active matrix, the weights are scaled by it and the uploaded step is added
        (bf16 weights with stochastic rounding, seeded by ``seed``, the landing's step)."""
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
                    scale = scales[group_index][len(copies_in_group)]
                    salt = zlib.crc32(state.slot.name.encode()) & 0xFFFF
                    copies.append((own_rows, source, scale, state.slot.row_start, salt))
                copies_in_group.append(index)
                shared.append(param2d)
                states.append(state)
        if scales is None:
            lanes.side.run(copy_all, copies, lanes.is_cuda)
        else:
            # host mode: each step goes up through a temporary (allocated in the side lane's order)
            lanes.side.run(add_all, copies, lanes.is_cuda, self.landing_add, seed)
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
        """Without blocking: if the host update in flight has finished, start its copy up (device mode)."""
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
        uploads.prefetch(pending.slot, pending.active)

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
