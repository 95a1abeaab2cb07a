"""Which parameters and columns go where, and the flat shared host buffers that hold the host side.

A trainable parameter with ``ndim >= 2`` is a *matrix*: it is viewed as ``[shape[0], numel // shape[0]]``
and split by column between the device (the selected columns) and the host (the rest). Parameters with
``ndim <= 1`` are *device-only*. Frozen parameters are ignored.

Per optimizer param group, the host holds one shared-memory block ``[5, n]`` of fp32, where ``n`` is the
number of matrix elements in the group that this rank owns: all of them on one rank; under data parallel, the row
block of every matrix that ``Ranks.own_rows`` gives it (``engine/ranks.py``). Its rows are the master weights,
``exp_avg``, ``exp_avg_sq`` and two gradient accumulators (double-buffered: the device fills one window while the
host updates with the other). That is 20 bytes per matrix element, all the host memory the engine needs per
parameter (divided by the number of ranks under data parallel).

A consumed accumulator doubles as the staging area for the upload: after its AdamW step the host worker
writes the new weights, already cast to the model dtype, into the bytes of the accumulator it just read;
the device copies them from there (one model-dtype copy per window instead of an fp32 one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.shm import shared_memory_error, shared_zeros

HOST_ROWS = 5
"""Rows of a group's host block: master, exp_avg, exp_avg_sq, grad_acc[0], grad_acc[1]."""
ROW_MASTER, ROW_EXP_AVG, ROW_EXP_AVG_SQ, ROW_GRAD_ACC = 0, 1, 2, 3
HOST_BYTES_PER_ELEMENT = HOST_ROWS * 4


@dataclass
class MatrixSlot:
    """A matrix parameter and where its elements live in its group's flat host buffers."""

    param: torch.Tensor
    name: str
    group_index: int
    index_in_group: int
    rows: int
    cols: int
    offset: int
    """Where this rank's rows of the matrix start in its group's flat host rows."""
    row_start: int = 0
    row_stop: int = -1
    """The row block ``[row_start, row_stop)`` whose host state this rank owns (-1: every row)."""

    def __post_init__(self) -> None:
        if self.row_stop < 0:
            self.row_stop = self.rows

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def host_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def host_numel(self) -> int:
        """Elements of the matrix this rank holds on the host: its row block."""
        return self.host_rows * self.cols

    def view2d(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[host_rows, cols]`` of the slot inside a group's flat host row."""
        return tensor[self.offset : self.offset + self.host_numel].view(self.host_rows, self.cols)

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's row block of a whole-matrix tensor (anything that views as ``[rows, cols]``)."""
        return tensor.reshape(self.rows, self.cols)[self.row_start : self.row_stop]


@dataclass
class DeviceOnlySlot:
    """A parameter with ndim <= 1: updated on the device every step, never offloaded."""

    param: torch.Tensor
    name: str
    group_index: int


@dataclass
class GroupLayout:
    """One optimizer param group split into matrices (host + device) and device-only parameters."""

    index: int
    matrices: list[MatrixSlot] = field(default_factory=list)
    device_only: list[DeviceOnlySlot] = field(default_factory=list)

    @property
    def host_numel(self) -> int:
        return sum(slot.host_numel for slot in self.matrices)


def build_layout(
    param_groups: Sequence[Mapping[str, object]],
    names: Mapping[int, str] | None = None,
    ranks: Ranks | None = None,
) -> list[GroupLayout]:
    """Split the trainable parameters of ``param_groups`` into matrices and device-only parameters.

    Args:
        param_groups: the torch optimizer's ``param_groups`` (each a dict with a ``"params"`` list).
        names: optional ``id(param) -> name`` map, used in checkpoints and error messages.
        ranks: the data-parallel ranks; each matrix's host state covers this rank's row block only.
    """
    names = names or {}
    ranks = ranks or Ranks()
    seen: set[int] = set()
    layout = []
    for group_index, group in enumerate(param_groups):
        group_layout = GroupLayout(index=group_index)
        offset = 0
        for position, param in enumerate(group["params"]):  # type: ignore[union-attr]
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"param group {group_index} holds a {type(param).__name__}, expected tensors.")
            if id(param) in seen:
                raise ValueError(
                    f"parameter {names.get(id(param), f'{group_index}.{position}')} appears twice in the optimizer's "
                    "param groups; pass each parameter once."
                )
            seen.add(id(param))
            if not param.requires_grad:
                continue
            name = names.get(id(param), f"group{group_index}.param{position}")
            if not param.is_floating_point():
                raise TypeError(f"parameter {name} has dtype {param.dtype}; only floating-point parameters train.")
            if param.dtype == torch.float64:
                raise UnsupportedSetupError(
                    f"parameter {name} is float64; ZenFlow keeps fp32 master weights, moments and host state, which "
                    "would round its updates. Train it in float32 (model.float(), or Trainer(precision='32-true') "
                    "with float32 weights), or freeze it."
                )
            if param.ndim >= 2:
                if not param.is_contiguous():
                    # the device update and the landings write the weights through param.data.view(rows, cols): a
                    # strided tensor has no such view, and writing into a copy (reshape) would never reach the model
                    raise ValueError(
                        f"parameter {name} is not contiguous (shape {tuple(param.shape)}, strides {param.stride()}): "
                        "ZenFlow updates each matrix in place through a [rows, columns] view of its memory, which a "
                        "non-contiguous tensor does not have. Make it contiguous before building the optimizer "
                        "(strategy: before fit): `param.data = param.data.contiguous()` for each such parameter, or "
                        "keep the model in torch.contiguous_format (a model moved to channels_last has such weights)."
                    )
                rows = param.shape[0]
                row_start, row_stop = ranks.own_rows(rows)
                slot = MatrixSlot(
                    param=param,
                    name=name,
                    group_index=group_index,
                    index_in_group=len(group_layout.matrices),
                    rows=rows,
                    cols=param.numel() // rows,
                    offset=offset,
                    row_start=row_start,
                    row_stop=row_stop,
                )
                offset += slot.host_numel
                group_layout.matrices.append(slot)
            else:
                group_layout.device_only.append(DeviceOnlySlot(param=param, name=name, group_index=group_index))
        layout.append(group_layout)
    return layout


@dataclass
class GroupHostBuffers:
    """The shared host block of one group and the named rows of it."""

    block_shared: torch.Tensor
    """``[5, n]`` fp32 in shared memory (pinned in place when a CUDA device is used)."""
    step_shared: torch.Tensor
    """``[n_matrices]`` fp32: how many host updates each matrix has had (its host-side bias-correction count)."""

    @property
    def master(self) -> torch.Tensor:
        return self.block_shared[ROW_MASTER]

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.block_shared[ROW_EXP_AVG]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.block_shared[ROW_EXP_AVG_SQ]

    def grad_acc(self, slot: int) -> torch.Tensor:
        return self.block_shared[ROW_GRAD_ACC + slot]


def allocate_host_buffers(layout: Sequence[GroupLayout]) -> list[GroupHostBuffers]:
    """Allocate every group's host block in shared memory and fill the master with the current weights.

    Shared memory first, then (on CUDA) pinned in place by the caller: ``pin_memory()`` would copy, and
    ``pin_memory().share_memory_()`` silently loses the pinning. The engine checks beforehand that the machine
    has room (``engine/preflight.py``); if the allocation fails anyway, the error says how much was needed.
    """
    buffers = []
    for group in layout:
        try:
            block_shared = shared_zeros((HOST_ROWS, group.host_numel))
            step_shared = shared_zeros((len(group.matrices),))
        except RuntimeError as error:
            needed = sum(HOST_BYTES_PER_ELEMENT * g.host_numel for g in layout)
            raise shared_memory_error(needed, error) from error
        host = GroupHostBuffers(block_shared=block_shared, step_shared=step_shared)
        for slot in group.matrices:
            # a blocking device -> host copy, once at start-up; the only pages of the block written now
            slot.view2d(host.master).copy_(slot.own(slot.param.detach()))
        buffers.append(host)
    return buffers


def staging_view(grad_acc_row: torch.Tensor, slot: MatrixSlot, dtype: torch.dtype) -> torch.Tensor:
    """The model-dtype weights of ``slot`` written into the bytes of a consumed accumulator, as ``[host_rows, cols]``.

    The slot's fp32 accumulator region has 4 bytes per element, enough for any model dtype.
    """
    region = grad_acc_row[slot.offset : slot.offset + slot.host_numel]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return region.view(torch.uint8)[: slot.host_numel * itemsize].view(dtype).view(slot.host_rows, slot.cols)
