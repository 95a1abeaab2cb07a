"""Moving data between the device and the host buffers: gradients down (d2h), weights up (h2d).

Per step, the gradient columns that stay on the host are gathered on the device (on the side stream) into
one contiguous payload per matrix, copied down and added into the window's fp32 accumulator. Only the
unselected columns cross the link, in the model dtype: (1 - rho) x model bytes per step.

Per window, the host worker leaves the new weights, cast to the model dtype, in the bytes of the
accumulator it consumed; they are copied up into the parameters in one piece and the selected columns are
then restored from the device's fp32 master: 1/S x model bytes per step.

On CUDA the down-copy and the host add run on a helper thread (so the training thread never blocks on
them), through a small pinned staging ring of fixed size, whatever the model size. On the CPU everything
runs inline and the device and host share memory.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.engine.device import DeviceUpdater, SelectedState
from lightning_zenflow.engine.layout import GroupHostBuffers, staging_view

STAGING_SLOT_BYTES = 32 * 1024 * 1024
"""Bytes per slot of the pinned d2h staging ring (two slots) on CUDA."""


class InlineExecutor:
    """``submit`` runs the job at once in the calling thread and returns a finished future."""

    def submit(self, fn: Callable[..., object], *args: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as error:
            future.set_exception(error)
        return future

    def shutdown(self) -> None:
        pass


@dataclass
class GradPayload:
    """The gradient columns of one matrix that go to the host at one step."""

    state: SelectedState
    columns_device: torch.Tensor
    """CUDA: ``[rows, n_unselected]`` gathered on the device, in the model dtype. CPU: the whole gradient."""


class Transfers:
    """The d2h accumulation and the h2d upload, with byte counters at the copy sites.

    The counters report what crosses the device link: on CUDA exactly what is copied; on the CPU, where
    device and host share memory and nothing is copied, what the CUDA path would copy for the same step.
    """

    def __init__(
        self, device_updater: DeviceUpdater, host_buffers: Sequence[GroupHostBuffers], device: torch.device
    ) -> None:
        self.device_updater = device_updater
        self.host_buffers = host_buffers
        self.is_cuda = device.type == "cuda"
        # one helper thread in order (FIFO) on CUDA; inline on the CPU
        self.executor = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-d2h")
            if self.is_cuda
            else InlineExecutor()
        )
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self._staging_pinned: list[torch.Tensor] = []
        self._staging_events: list[torch.cuda.Event] = []
        self._upload_event = torch.cuda.Event() if self.is_cuda else None
        # its own stream, so gradient copies down never queue behind the weight copies up on the side stream
        self.d2h_stream = torch.cuda.Stream(device) if self.is_cuda else None
        if self.is_cuda:
            for _ in range(2):
                self._staging_pinned.append(torch.empty(STAGING_SLOT_BYTES, dtype=torch.uint8, pin_memory=True))
                self._staging_events.append(torch.cuda.Event())

    def gather(self, groups: Sequence[Sequence[SelectedState]]) -> tuple[list[GradPayload], torch.cuda.Event | None]:
        """This step's gradient columns that stay on the host. Call on the side stream.

        Returns the payloads and, on CUDA, an event recorded after the gathers (the d2h copies wait on it).
        """
        payloads = []
        for group_states in groups:
            for state in group_states:
                grad = state.slot.param.grad
                if grad is None or state.unselected.numel() == 0:
                    continue
                grad2d = grad.view(state.slot.rows, state.slot.cols)
                self.d2h_bytes += state.slot.rows * state.unselected.numel() * grad.element_size()
                if not self.is_cuda:
                    # consumed inline, before anyone can touch the gradient; the host add takes whole rows
                    payloads.append(GradPayload(state=state, columns_device=grad2d.detach()))
                    continue
                # made on the compute stream, read here on the side stream: keep it alive for the side stream
                grad.record_stream(self.device_updater.side_stream)
                # a copy the helper thread owns: zero_grad may clear the gradient before the d2h runs
                columns = grad2d.index_select(1, state.unselected)
                columns.record_stream(self.d2h_stream)
                payloads.append(GradPayload(state=state, columns_device=columns))
        if not self.is_cuda:
            return payloads, None
        gathered_event = torch.cuda.Event()
        gathered_event.record(self.device_updater.side_stream)
        return payloads, gathered_event

    def accumulate(
        self,
        payloads: Sequence[GradPayload],
        gathered_event: torch.cuda.Event | None,
        slot: int,
        first_in_window: bool,
        scale: float,
    ) -> None:
        """Add the payloads, times ``scale`` (1/S), into accumulator ``slot`` (zeroed first at a window's first
        step). Runs in order."""
        if self.is_cuda:
            if first_in_window:
                # this accumulator may still be the source of the last upload: wait until it has been read
                self._upload_event.synchronize()
                for host in self.host_buffers:
                    host.grad_acc(slot).zero_()
            self._accumulate_cuda(payloads, gathered_event, slot, scale)
            return
        covered = set()
        for payload in payloads:
            # whole rows: the columns that are on the device accumulate too, into parked slots nobody reads
            # (cheaper than gathering the host's columns: one contiguous add instead of a gather and a scatter)
            slot_of_matrix = payload.state.slot
            acc2d = slot_of_matrix.view2d(self.host_buffers[slot_of_matrix.group_index].grad_acc(slot))
            if first_in_window:
                torch.mul(payload.columns_device, scale, out=acc2d)  # the window's first step overwrites
                covered.add((slot_of_matrix.group_index, slot_of_matrix.index_in_group))
            else:
                acc2d.add_(payload.columns_device, alpha=scale)
        if first_in_window:
            for group_states in self.device_updater.selected:
                for state in group_states:
                    if (state.slot.group_index, state.slot.index_in_group) not in covered:
                        state.slot.view2d(self.host_buffers[state.slot.group_index].grad_acc(slot)).zero_()

    def _accumulate_cuda(
        self, payloads: Sequence[GradPayload], gathered_event: torch.cuda.Event | None, slot: int, scale: float
    ) -> None:
        d2h_stream = self.d2h_stream
        with torch.cuda.device(d2h_stream.device):
            # GPU-side wait: the copies start once the side stream has gathered the columns
            d2h_stream.wait_event(gathered_event)
        pending: tuple | None = None
        ring = 0
        for payload in payloads:
            state = payload.state
            columns = payload.columns_device
            unselected_host = state.unselected_host
            row_bytes = columns.shape[1] * columns.element_size()
            rows_per_chunk = max(1, STAGING_SLOT_BYTES // max(row_bytes, 1))
            acc2d = state.slot.view2d(self.host_buffers[state.slot.group_index].grad_acc(slot))
            for row_start in range(0, state.slot.rows, rows_per_chunk):
                row_stop = min(state.slot.rows, row_start + rows_per_chunk)
                chunk = columns[row_start:row_stop]
                staging = self._staging_pinned[ring][: chunk.numel() * chunk.element_size()]
                staging = staging.view(chunk.dtype).view(chunk.shape)
                with torch.cuda.device(d2h_stream.device), torch.cuda.stream(d2h_stream):
                    staging.copy_(chunk, non_blocking=True)
                    self._staging_events[ring].record(d2h_stream)
                if pending is not None:
                    self._add_staged(*pending)
                pending = (ring, staging, acc2d[row_start:row_stop], unselected_host, scale)
                ring ^= 1
        if pending is not None:
            self._add_staged(*pending)

    def _add_staged(
        self, ring: int, staging: torch.Tensor, acc_rows: torch.Tensor, unselected: torch.Tensor, scale: float
    ) -> None:
        # helper-thread wait for this chunk's d2h copy to land in pinned memory; the training thread runs on
        self._staging_events[ring].synchronize()
        acc_rows.index_add_(1, unselected, staging.float(), alpha=scale)

    def upload(self, slot: int, active: Sequence[Sequence[int]]) -> None:
        """Copy the new weights of the active matrices up into the parameters, then restore the selected
        columns from the device master. Runs on the side stream.

        The source is the staged model-dtype copy in accumulator ``slot``, or, for fp32 weights, the host
        master itself (no staging pass; the next host update waits for this copy, see ``wait_upload``)."""
        with self.device_updater.on_side_stream():
            for group_index, group_states in enumerate(self.device_updater.selected):
                host = self.host_buffers[group_index]
                for index in active[group_index]:
                    state = group_states[index]
                    param2d = state.slot.param.data.view(state.slot.rows, state.slot.cols)
                    if param2d.dtype == torch.float32:
                        staged = state.slot.view2d(host.master)
                    else:
                        staged = staging_view(host.grad_acc(slot), state.slot, param2d.dtype)
                    param2d.copy_(staged, non_blocking=self.is_cuda)
                    self.h2d_bytes += staged.nbytes
                    self.device_updater.write_selected(state)
            if self._upload_event is not None:
                self._upload_event.record(self.device_updater.side_stream)
        self.device_updater.end_step()

    def wait_upload(self) -> None:
        """Block until the last upload has read its host source (CUDA; a no-op on the CPU, where it is a copy).

        The worker's next update rewrites the fp32 master that an upload may still be reading."""
        if self._upload_event is not None:
            # host wait on the helper thread, before the worker is told to start
            self._upload_event.synchronize()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def bytes_held(self) -> int:
        return sum(t.nbytes for t in self._staging_pinned)
