"""Selective AdamW on the device: the selected columns of every matrix and all device-only parameters.

Whatever the model dtype, the device keeps an fp32 master copy of what it updates, fp32 moments and exact
step counts (a bf16 model must not lose small updates to rounding, and a bf16 step counter stops at 256). The
update is issued on the side lane (a CUDA stream; a thread on the CPU), ordered with events, so the training
thread never waits for it on the host. The selected columns are gathered from the gradient and written back into the
weights by :func:`gather_columns` and :func:`write_columns`: torch's ``index_select`` and ``index_copy_`` on CUDA,
and on a CPU standing in for the device ``lightning_zenflow/native``'s kernels, which give the same bits.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zenflow.engine.lanes import Event, Lanes
from lightning_zenflow.engine.layout import GroupLayout, MatrixSlot

if TYPE_CHECKING:
    from lightning_zenflow.engine.kernels import Kernels


@dataclass(frozen=True)
class HyperParams:
    """The hyperparameters of one param group, read from the torch optimizer at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    """True for AdamW (decoupled weight decay), False for Adam (L2 penalty added to the gradient)."""

    @classmethod
    def from_group(cls, group: Mapping[str, object], decoupled_default: bool) -> HyperParams:
        beta1, beta2 = group["betas"]  # type: ignore[misc]
        return cls(
            lr=float(group["lr"]),  # type: ignore[arg-type]
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),  # type: ignore[arg-type]
            weight_decay=float(group.get("weight_decay", 0.0)),  # type: ignore[arg-type]
            decoupled=bool(group.get("decoupled_weight_decay", decoupled_default)),
        )


def adam_update_(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: HyperParams,
    found_inf: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW step, in place, on fp32 tensors of one device, with torch's fused kernel (the kernel of
    ``torch.optim.AdamW(fused=True)``; the device and the host worker both use it). ``steps``: fp32 scalar count
    tensors on the same device, incremented here.

    ``grad_scale``: the kernel divides each gradient by it as it reads (the host's window mean: sum / count).
    ``found_inf`` (16-mixed): a device scalar, 1.0 when this step's gradients overflowed. The kernel then leaves
    masters and moments untouched and the counts are decremented back, all on the device: no host read.
    """
    if not masters:
        return
    torch._foreach_add_(steps, 1.0)
    fused = torch._fused_adamw_ if hp.decoupled else torch._fused_adam_
    fused(
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=hp.lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        eps=hp.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


def gather_columns(grad2d: torch.Tensor, selected: torch.Tensor, out: torch.Tensor) -> None:
    """``out <- grad2d[:, selected]`` in fp32: the selected columns of a gradient into a reused ``[rows, k]`` buffer
    (a bf16 gradient widened exactly)."""
    if grad2d.dtype == torch.float32:
        torch.index_select(grad2d, 1, selected, out=out)
    else:
        out.copy_(grad2d.index_select(1, selected))


def write_columns(weight2d: torch.Tensor, selected: torch.Tensor, master: torch.Tensor) -> None:
    """``weight2d[:, selected] <- master`` in the weights' dtype (``.to``'s rounding: to nearest even into bf16)."""
    weight2d.index_copy_(1, selected, master.to(weight2d.dtype))


class _DeviceStepCount:
    """``step``: the ``step_count`` device scalar as an int (a device read: checkpoints only)."""

    step_count: torch.Tensor

    @property
    def step(self) -> int:
        return int(self.step_count.item())

    @step.setter
    def step(self, value: int) -> None:
        self.step_count.fill_(float(value))


@dataclass
class DeviceOnlyState(_DeviceStepCount):
    param: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step_count: torch.Tensor
    """How many device updates this parameter has had: an fp32 scalar on the device."""
    separate_master: bool = True
    """False when the parameter is fp32 and is its own master (no copy, no write-back)."""


@dataclass
class SelectedState(_DeviceStepCount):
    """The device side of one matrix: its selected columns and their fp32 master and moments."""

    slot: MatrixSlot
    selected: torch.Tensor
    """Selected column indices (ascending, int64, on the device)."""
    unselected: torch.Tensor
    """The other columns (ascending, int64, on the device): the host-bound gradient columns."""
    selected_host: torch.Tensor
    """``selected`` on the CPU (refreshes and checkpoints read it without a device sync)."""
    master: torch.Tensor
    """``[rows, k]`` fp32."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step_count: torch.Tensor
    """How many device updates this matrix has had: an fp32 scalar on the device (read back at checkpoints)."""
    scratch: torch.Tensor | None = None
    """The reused ``[rows, k]`` fp32 buffer the selected gradient is gathered into."""

    @property
    def k(self) -> int:
        return int(self.selected.numel())


class DeviceUpdater:
    """Owns the device-side optimizer state and applies the per-step device update.

    ``kernels``: the engine's (``engine/kernels.py``); where they are native (a CPU), the selected columns move with
    ``lightning_zenflow/native``'s kernels, else (CUDA, eager, none given) with torch's ops."""

    def __init__(self, layout: Sequence[GroupLayout], lanes: Lanes, kernels: Kernels | None = None) -> None:
        self.layout = layout
        self.lanes = lanes
        self.device = lanes.device
        self.gather_columns = kernels.native_or_eager(gather_columns) if kernels is not None else gather_columns
        self.write_columns = kernels.native_or_eager(write_columns) if kernels is not None else write_columns
        self.weights_done = lanes.event()
        """Recorded on the side lane after each write of the weights (the device update, a landing): the next
        forward waits for it."""
        self.update_done = lanes.event()
        """Recorded on the side lane after each step's device work (update, accumulation, landing): the gradients
        have been read; ``zero_grad`` and the next backward wait for it."""
        self._timing_events: collections.deque[tuple[Event, Event]] = collections.deque()
        self.device_only: list[list[DeviceOnlyState]] = []
        for group in layout:
            states = []
            for entry in group.device_only:
                param = entry.param
                # fp32 parameters are their own master; other dtypes get an fp32 copy
                separate_master = param.dtype != torch.float32
                master = param.detach().float() if separate_master else param.data
                states.append(
                    DeviceOnlyState(
                        param=param,
                        master=master,
                        exp_avg=torch.zeros_like(master),
                        exp_avg_sq=torch.zeros_like(master),
                        step_count=torch.zeros((), dtype=torch.float32, device=self.device),
                        separate_master=separate_master,
                    )
                )
            self.device_only.append(states)
        self.selected: list[list[SelectedState]] = [
            [self.empty_selection(slot) for slot in group.matrices] for group in layout
        ]

    def empty_selection(self, slot: MatrixSlot) -> SelectedState:
        empty = torch.empty(slot.rows, 0, dtype=torch.float32, device=self.device)
        return SelectedState(
            slot=slot,
            selected=torch.empty(0, dtype=torch.long, device=self.device),
            unselected=torch.arange(slot.cols, device=self.device),
            selected_host=torch.empty(0, dtype=torch.long),
            master=empty,
            exp_avg=empty.clone(),
            exp_avg_sq=empty.clone(),
            step_count=torch.zeros((), dtype=torch.float32, device=self.device),
        )

    def matrix_states(self) -> list[SelectedState]:
        return [state for group_states in self.selected for state in group_states]

    def begin_step(self) -> None:
        """Order the side lane after the gradients: a GPU-side wait for backward and clipping, no host sync."""
        # side waits (GPU-side) for the compute lane's backward, clipping and all-reduce
        self.lanes.side.wait_lane(self.lanes.compute, "side after compute")

    def weights_written(self) -> None:
        """Mark the side lane's writes of the weights issued so far (after the device update, after a landing)."""
        self.lanes.side.record(self.weights_done)

    def end_step(self) -> None:
        """Mark the end of this step's side-lane work. The compute lane waits (GPU-side) for the weights only: the
        next forward overlaps the accumulation, which reads the gradients; ``zero_grad`` and the next backward
        wait for that (:meth:`ZenFlowEngine.wait_for_gradients`)."""
        self.lanes.side.record(self.update_done)
        # compute waits (GPU-side) for the weights the side lane wrote, before the next forward reads them
        self.lanes.compute.wait(self.weights_done, "compute after update")

    def update(self, hparams: Sequence[HyperParams], found_inf: torch.Tensor | None = None) -> None:
        """Issue one device step for every group on the side lane: device-only parameters and the selected columns
        of matrices, with the gradients they have now. ``found_inf``: see :func:`adam_update_`."""
        lanes, side = self.lanes, self.lanes.side
        groups = []
        for group_index, hp in enumerate(hparams):
            device_only = [(s, s.param.grad) for s in self.device_only[group_index] if s.param.grad is not None]
            selected = [
                (s, s.slot.param.grad) for s in self.selected[group_index] if s.k and s.slot.param.grad is not None
            ]
            for _, grad in (*device_only, *selected):
                # made on the compute lane, read on the side lane: keep it alive past zero_grad
                lanes.keep_for(grad, side)
            for state, _ in selected:
                if state.scratch is None or state.scratch.shape != state.master.shape:
                    with lanes.allocating_on(side):
                        state.scratch = torch.empty_like(state.master)
            groups.append((hp, device_only, selected))
        started, finished = lanes.event(timing=True), lanes.event(timing=True)
        side.record(started)
        side.run(self._update_groups, groups, found_inf)
        side.record(finished)
        self._timing_events.append((started, finished))
        self.weights_written()

    def _update_groups(self, groups: Sequence, found_inf: torch.Tensor | None) -> None:
        """Side lane: the fused AdamW step of every group, then the masters cast back into the weights."""
        for hp, device_only, selected in groups:
            masters, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for state, grad in device_only:
                masters.append(state.master)
                grads.append(grad.float())
                exp_avgs.append(state.exp_avg)
                exp_avg_sqs.append(state.exp_avg_sq)
                steps.append(state.step_count)
            for state, grad in selected:
                masters.append(state.master)
                grads.append(self._gather_selected(state, grad.view(state.slot.rows, state.slot.cols)))
                exp_avgs.append(state.exp_avg)
                exp_avg_sqs.append(state.exp_avg_sq)
                steps.append(state.step_count)
            adam_update_(masters, grads, exp_avgs, exp_avg_sqs, steps, hp, found_inf)
            for state, _ in device_only:
                if state.separate_master:
                    state.param.data.copy_(state.master)
            for state, _ in selected:
                self.write_selected(state)

    def _gather_selected(self, state: SelectedState, grad2d: torch.Tensor) -> torch.Tensor:
        """The selected columns of a gradient, in fp32, in the state's reused buffer."""
        self.gather_columns(grad2d, state.selected, state.scratch)
        return state.scratch

    def finished_update_seconds(self) -> float | None:
        """Duration of the newest device update that has finished (timing events, queried without waiting)."""
        latest = None
        while self._timing_events and self._timing_events[0][1].query():
            start, end = self._timing_events.popleft()
            latest = start.elapsed_s(end)
        while len(self._timing_events) > 16:
            self._timing_events.popleft()  # bound the queue if nobody asks for a while
        return latest

    def write_selected(self, state: SelectedState) -> None:
        """Lane work: copy the fp32 master of the selected columns into the model weights (cast to the model dtype)."""
        if state.k == 0:
            return
        self.write_columns(state.slot.param.data.view(state.slot.rows, state.slot.cols), state.selected, state.master)

    def bytes_held(self) -> int:
        """Device bytes of optimizer state the engine holds (masters, moments, indices, work buffers)."""
        total = 0
        for group_states in self.device_only:
            for state in group_states:
                total += state.exp_avg.nbytes * (3 if state.separate_master else 2)
        for group_states in self.selected:
            for state in group_states:
                total += state.master.nbytes * 3 + state.selected.nbytes + state.unselected.nbytes
                total += state.scratch.nbytes if state.scratch is not None else 0
        return total
