"""Which parameters and columns go where, and the shared host buffers that hold the host side.

A trainable parameter with ``ndim >= 2`` is a *matrix*: it is viewed as ``[shape[0], numel // shape[0]]`` (or with
the columns its caller gives: a stack of expert matrices ``[E, out, in]`` is ``[E x out, in]``,
``lightning_zenflow/matrices.py``) and split by column between the device (the selected columns) and the host (the
rest). Parameters with
``ndim <= 1`` are *device-only*. Frozen parameters are ignored.

Per optimizer param group, the host holds flat shared-memory rows of ``n`` elements, where ``n`` is the number of
matrix elements in the group that this rank owns: all of them on one rank; under data parallel, the row block of
every matrix that ``Ranks.own_rows`` gives it (``engine/ranks.py``). Which rows, in which dtype, is the
:class:`HostFormat` (``host_state``, docs/performance.md):

- ``exp_avg`` and ``exp_avg_sq``: fp32, or bf16 (``host_state="bf16"``: the first moment rounded to nearest, the
  second stochastically, ``engine/rounding.py``);
- the window's gradient sum: one row in device mode (the device's accumulator is copied down into it once per
  window; fp32, or bf16 in the compact state), two fp32 rows in host mode (the helper thread fills one window while
  the worker reads the other);
- an fp32 ``master`` only where the weights cannot be the masters of the host columns (``HostFormat.master``).

Everywhere else the model's weights *are* the masters: the worker computes the AdamW step of the host columns from
their moments alone and writes it into the window row it just read; the device adds it to the weights when it lands
(``w <- w * (1 - lr * wd) + step``). With a master, the worker updates the master and writes the new weights, cast
to the model dtype, into the bytes of the window row (the staging area of the upload).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.rounding import salt_of
from lightning_zenflow.engine.shm import shared_memory_error, shared_zeros

HOST_STATES = ("fp32", "bf16")
"""The host state's precisions (``ZenFlowConfig.host_state``)."""


@dataclass(frozen=True)
class HostFormat:
    """What the host holds per matrix element, in which dtype (resolved once per engine at start)."""

    moments: torch.dtype
    """dtype of ``exp_avg`` and ``exp_avg_sq`` (fp32, or bf16 for ``host_state="bf16"``)."""
    window: torch.dtype
    """dtype of the window's gradient sum in device mode, on both sides (fp32, or bf16 for the compact state);
    host mode sums in fp32."""
    master: bool
    """An fp32 master of every host element: where the weights cannot be the masters (``docs/update_rule.md``)."""
    window_rows: int = 1
    """1 in device mode (one row, refilled once per window), 2 in host mode (double-buffered)."""

    @classmethod
    def resolve(cls, host_state: str, master: bool, accumulate_on: str) -> HostFormat:
        compact = host_state != "fp32"
        host_mode = accumulate_on == "host"
        return cls(
            moments=torch.bfloat16 if compact else torch.float32,
            window=torch.float32 if host_mode or not compact else torch.bfloat16,
            master=master,
            window_rows=2 if host_mode else 1,
        )

    def for_mode(self, accumulate_on: str) -> HostFormat:
        """This format with the window rows of an accumulation mode (``"device"`` or ``"host"``)."""
        compact = self.moments != torch.float32
        if accumulate_on == "host":
            return dataclasses.replace(self, window=torch.float32, window_rows=2)
        return dataclasses.replace(self, window=torch.bfloat16 if compact else torch.float32, window_rows=1)

    @property
    def state_bytes(self) -> int:
        """Bytes per element of the state that persists: the moments and the master."""
        return 2 * _itemsize(self.moments) + (4 if self.master else 0)

    @property
    def window_bytes(self) -> int:
        """Bytes per element of the window rows."""
        return self.window_rows * _itemsize(self.window)

    @property
    def bytes_per_element(self) -> int:
        return self.state_bytes + self.window_bytes


def resolve_host_format(
    config: object, layout: Sequence[GroupLayout], hparams: Sequence[object], interim: bool
) -> HostFormat:
    """The host format of an engine: ``config.host_state``'s precision, and a master only where the weights cannot be
    the masters of the host columns: without interim moves, for Adam's L2 decay (it needs the master in the
    gradient) and, with ``host_state="fp32"``, for weights that are not fp32 (the exact setting keeps what they
    round)."""
    host_state = getattr(config, "host_state", "bf16")
    accumulate_on = getattr(config, "accumulate_on", "auto")
    groups_with_matrices = [hp for hp, group in zip(hparams, layout) if group.matrices]
    l2 = any(not getattr(hp, "decoupled", True) and getattr(hp, "weight_decay", 0.0) for hp in groups_with_matrices)
    narrow = any(slot.param.dtype != torch.float32 for group in layout for slot in group.matrices)
    master = not interim and (l2 or (host_state == "fp32" and narrow))
    return HostFormat.resolve(host_state, master, accumulate_on)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    def salt(self) -> int:
        """Seeds this matrix's stochastic rounding (``engine/rounding.py``)."""
        return salt_of(self.group_index, self.index_in_group)

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
    columns: Mapping[int, int] | None = None,
) -> list[GroupLayout]:
    """Split the trainable parameters of ``param_groups`` into matrices and device-only parameters.

    Args:
        param_groups: the torch optimizer's ``param_groups`` (each a dict with a ``"params"`` list).
        names: optional ``id(param) -> name`` map, used in checkpoints and error messages.
        ranks: the data-parallel ranks; each matrix's host state covers this rank's row block only.
        columns: optional ``id(param) -> columns`` of a matrix's view where it is not ``numel // shape[0]`` (a stack
            of expert matrices: ``shape[-1]``).
    """
    names = names or {}
    columns = columns or {}
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
                cols = columns.get(id(param), param.numel() // max(1, param.shape[0]))
                if cols < 1 or param.numel() % cols:
                    raise ValueError(
                        f"parameter {name} {tuple(param.shape)} cannot be viewed as a matrix of {cols} columns."
                    )
                rows = param.numel() // cols
                row_start, row_stop = ranks.own_rows(rows)
                slot = MatrixSlot(
                    param=param,
                    name=name,
                    group_index=group_index,
                    index_in_group=len(group_layout.matrices),
                    rows=rows,
                    cols=cols,
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
    """The shared host rows of one group (each ``[n]``, in shared memory; the window rows pinned in place on CUDA)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step_shared: torch.Tensor
    """``[n_matrices]`` fp32: how many host updates each matrix has had (its host-side bias-correction count)."""
    master: torch.Tensor | None = None
    """fp32 masters of every host element, where the format has them (else the weights are the masters)."""
    windows: list[torch.Tensor] = field(default_factory=list)
    """The window rows: one (device mode) or two (host mode); empty until the accumulation mode is known."""

    def grad_acc(self, slot: int) -> torch.Tensor:
        """The window row that window ``slot`` (0 or 1, alternating) is summed into; one row serves both slots in
        device mode (the landing of the update read from it comes before the next window's copy down)."""
        return self.windows[slot % len(self.windows)]

    @property
    def nbytes(self) -> int:
        rows = [self.exp_avg, self.exp_avg_sq, self.step_shared, *self.windows]
        return sum(row.nbytes for row in rows) + (self.master.nbytes if self.master is not None else 0)


def allocate_host_buffers(layout: Sequence[GroupLayout], host_format: HostFormat) -> list[GroupHostBuffers]:
    """Allocate every group's moments (and masters, filled with the current weights) in shared memory; the window
    rows come with the accumulation mode (:func:`allocate_window_rows`).

    Shared memory first, then (on CUDA) pinned in place by the caller: ``pin_memory()`` would copy, and
    ``pin_memory().share_memory_()`` silently loses the pinning. The engine checks beforehand that the machine
    has room (``engine/preflight.py``); if the allocation fails anyway, the error says how much was needed.
    """
    buffers = []
    for group in layout:
        n = group.host_numel
        try:
            host = GroupHostBuffers(
                exp_avg=shared_zeros((n,), host_format.moments),
                exp_avg_sq=shared_zeros((n,), host_format.moments),
                step_shared=shared_zeros((len(group.matrices),)),
                master=shared_zeros((n,)) if host_format.master else None,
            )
        except RuntimeError as error:
            needed = sum(host_format.state_bytes * g.host_numel for g in layout)
            raise shared_memory_error(needed, error) from error
        if host.master is not None:
            for slot in group.matrices:
                # a blocking device -> host copy, once at start-up; the only pages of the block written now
                slot.view2d(host.master).copy_(slot.own(slot.param.detach()))
        buffers.append(host)
    return buffers


def allocate_window_rows(
    layout: Sequence[GroupLayout], host_buffers: Sequence[GroupHostBuffers], host_format: HostFormat
) -> None:
    """Give every group the window rows of ``host_format`` (replacing any it had)."""
    for group, host in zip(layout, host_buffers):
        try:
            rows = [shared_zeros((group.host_numel,), host_format.window) for _ in range(host_format.window_rows)]
        except RuntimeError as error:
            needed = sum(host_format.window_bytes * g.host_numel for g in layout)
            raise shared_memory_error(needed, error) from error
        host.windows = rows


def staging_view(grad_acc_row: torch.Tensor, slot: MatrixSlot, dtype: torch.dtype) -> torch.Tensor:
    """The model-dtype weights of ``slot`` written into the bytes of a consumed window row, as ``[host_rows, cols]``.

    The row's region has at least as many bytes per element as any model dtype it stages (a master exists only for
    weights that are not fp32, and the window row of a bf16 model is at least bf16)."""
    region = grad_acc_row[slot.offset : slot.offset + slot.host_numel]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return region.view(torch.uint8)[: slot.host_numel * itemsize].view(dtype).view(slot.host_rows, slot.cols)
