"""A window's end: the gradients it kept, what goes down to the host, and the launch of its host update.

Over a window the side lane counts, per matrix, the gradients the window kept (an overflowed 16-mixed step keeps
none: the device skips it without a host read, so the host learns it from these counts, which are the worker's
mean divisors). At the window's end the d2h lane copies the accumulators (device mode) and the counts down, and
records the window's event; the launch, on the helper thread, waits for that event and hands the jobs to the
worker. The two accumulator slots alternate: the next window fills one while the worker reads the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lightning_zenflow.engine.device import HyperParams, SelectedState
from lightning_zenflow.engine.host import GroupJob, HostWorker
from lightning_zenflow.engine.lanes import Event, Lanes
from lightning_zenflow.engine.layout import GroupLayout
from lightning_zenflow.engine.schedule import PendingUpdate
from lightning_zenflow.engine.transfer import copy_all


class WindowEnd:
    """Per accumulator slot, the kept counts of the window that closed in it and the event of its copies down."""

    def __init__(self, lanes: Lanes, layout: Sequence[GroupLayout]) -> None:
        self.lanes = lanes
        self.layout = layout
        n_matrices = sum(len(g.matrices) for g in layout)
        self.kept_device = torch.zeros(n_matrices, dtype=torch.float32, device=lanes.device)
        """Per matrix (layout order): gradients the open window kept."""
        self.kept_host = [lanes.empty_host(n_matrices, torch.float32) for _ in range(2)]
        self.copied = [lanes.event() for _ in range(2)]
        """Per slot: recorded on the d2h lane after the copies down of the window that closed in it."""
        self._present_index: dict[tuple[int, ...], torch.Tensor] = {}

    def closed_window_copied(self, open_slot: int) -> Event:
        """The event of the last closed window's copies down (its slot is the other one: the open window's slot
        flipped when it closed)."""
        return self.copied[open_slot ^ 1]

    def count(
        self, states: Sequence[SelectedState], open_slot: int, first_in_window: bool, found_inf: torch.Tensor | None
    ) -> None:
        """Side lane: count this step's gradients into the window's kept counts (an overflowed 16-mixed step
        counts nothing) and, under 16-mixed, zero the host-bound gradients of an overflowed step in place."""
        lanes = self.lanes
        if first_in_window:
            # side waits (GPU-side) for the copies down of the window that just closed before it zeroes the counts
            # and overwrites the accumulators: the event of that window, not of the one before it
            lanes.side.wait(self.closed_window_copied(open_slot), "window copied")
        present = tuple(i for i, state in enumerate(states) if state.slot.param.grad is not None)
        index = None
        if present and len(present) < len(states):
            index = self._present_index.get(present)
            if index is None:
                # once per pattern of missing gradients (a small upload, a sync on CUDA), then reused every step
                # (a blocking copy from pageable memory: filled when it returns, so no wait orders the side lane)
                index = torch.tensor(present, dtype=torch.long, device=lanes.device)
                if len(self._present_index) < 64:
                    self._present_index[present] = index
            # past 64 patterns it is not cached: the side lane reads it after this call has dropped it
            lanes.keep_for(index, lanes.side)
        overflow_masked = []
        if found_inf is not None:
            for state in states:
                grad = state.slot.param.grad
                if grad is not None and state.k < state.slot.cols:
                    overflow_masked.append(grad)
        lanes.side.run(_count_kept, self.kept_device, first_in_window, bool(present), index, found_inf, overflow_masked)

    def copy_down(self, slot: int, accumulation: object, active: Sequence[Sequence[int]]) -> None:
        """Issue the window's copies down into host slot ``slot`` (accumulators of ``active`` matrices, the counts)
        and record its event."""
        lanes = self.lanes
        # d2h waits (GPU-side) for the side lane's last add and count of this window before they go down
        lanes.d2h.wait_lane(lanes.side, "window added")
        accumulation.finish_window(slot, active)  # type: ignore[attr-defined]
        lanes.d2h.run(copy_all, [(self.kept_host[slot], self.kept_device)], lanes.is_cuda)
        lanes.d2h.record(self.copied[slot])

    def launch(self, worker: HostWorker | None, slot: int, jobs: Sequence[GroupJob], pending: PendingUpdate) -> None:
        """Helper thread: give the worker the window's jobs, with the kept counts as their mean divisors."""
        if worker is None:
            raise RuntimeError("internal error: host work was scheduled but no host worker is running.")
        # helper-thread wait: the window's accumulators and kept counts have landed on the host. That copy down
        # waited for the side lane's work up to this window's end, which includes the landing of the last upload
        # (issued before it, after that upload's copy up): so the last upload has read its host source too, and
        # the worker may rewrite the master (and, for a model that is not fp32, stage its weights in the slot)
        self.copied[slot].wait_here("launch: window copied")
        kept = self.kept_host[slot].tolist()
        first = 0
        with_divisors = []
        for group_index, (group, job) in enumerate(zip(self.layout, jobs)):
            divisors = tuple(float(kept[first + i]) for i in job.active)
            with_divisors.append(dataclasses.replace(job, mean_divisors=divisors))
            first += len(group.matrices)
            if pending.scales is not None:
                # a matrix whose every gradient was skipped (16-mixed) is not updated, and so not decayed either;
                # read at the landing, which waits for this launch first
                pending.scales[group_index] = [
                    1.0 if divisor == 0.0 else scale for divisor, scale in zip(divisors, pending.scales[group_index])
                ]
        worker.submit(slot, with_divisors)

    def kept_counts(self) -> list[list[int]]:
        """The open window's kept counts per group (a host read: after the lanes are synchronised)."""
        kept, first, counts = self.kept_device.tolist(), 0, []
        for group in self.layout:
            counts.append([int(k) for k in kept[first : first + len(group.matrices)]])
            first += len(group.matrices)
        return counts

    def restore_kept(self, window_kept: Sequence[Sequence[int]]) -> None:
        flat = [float(k) for group in window_kept for k in group]
        self.kept_device.copy_(torch.tensor(flat, dtype=torch.float32))


def host_jobs(
    selected: Sequence[Sequence[SelectedState]],
    hparams: Sequence[HyperParams],
    counts: Sequence[Sequence[int]],
    host_mode: bool,
) -> list[GroupJob]:
    """Per group: the matrices with columns on the host that got gradients in the window, and how many."""
    jobs = []
    for group_index, group_states in enumerate(selected):
        window_counts = counts[group_index]
        active = tuple(i for i, state in enumerate(group_states) if state.k < state.slot.cols and window_counts[i] > 0)
        jobs.append(
            GroupJob(
                hparams=hparams[group_index],
                active=active,
                mean_divisors=tuple(float(window_counts[i]) for i in active),
                packed_columns=(
                    tuple(group_states[i].slot.cols - group_states[i].k for i in active) if host_mode else None
                ),
            )
        )
    return jobs


def count_updates(counts: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
    """Side lane: one more update in each count (none for an overflowed 16-mixed step)."""
    for count in counts:
        count.add_(1.0 if found_inf is None else 1.0 - found_inf)


def _count_kept(
    kept: torch.Tensor,
    first_in_window: bool,
    any_present: bool,
    index: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    overflow_masked: list[torch.Tensor],
) -> None:
    """Side lane: the window's kept counts (``index``: the matrices with a gradient, None: all of them)."""
    if first_in_window:
        kept.zero_()
    keep = 1.0 if found_inf is None else 1.0 - found_inf
    if any_present:
        if index is None:
            kept.add_(keep)
        else:
            kept.index_add_(0, index, torch.ones(index.numel(), device=kept.device) * keep)
    if found_inf is not None:
        flag = found_inf.bool()
        for grad in overflow_masked:
            # one pass over the gradient, 16-mixed only: an overflowed step must add zeros, not inf/NaN
            grad.masked_fill_(flag, 0.0)
