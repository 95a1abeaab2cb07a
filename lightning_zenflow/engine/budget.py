"""What an engine holds, in bytes, from the shapes alone: ``engine.device_bytes()`` and ``engine.host_bytes()`` as
formulas, for a model that has not been built (the planner, the docs' tables) and checked against a running engine
by ``tests/test_budget.py``, byte for byte.

Per rank, after the first selection (the steady state; during the warm-up nothing is selected yet):

- **host** (``engine/layout.py``'s :class:`HostFormat`): per matrix element this rank holds, the two moments and the
  window rows (and a master where there is one); per matrix a 4 B step count; per matrix column an 8 B index of the
  host-bound columns; host mode adds its two pinned staging slots and a 4 MiB conversion buffer;
- **device**: per selected element 16 B (fp32 master, two moments, the gathered gradient) and per matrix column 8 B of
  indices; per 1-D parameter its two fp32 moments (and an fp32 master when it is not fp32); device mode the window's
  accumulator (2 B per element in the compact state, 4 B in the exact one) and, in the compact state, 4 B per row
  and per column of the rounding's numbers; host mode its two staging slots; on CUDA, the landing's buffer of at
  most 64 MiB where steps land; with interim moves, their statistics (O(rows + columns) per matrix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine.accumulate import CONVERT_CHUNK_ELEMENTS, STAGING_SLOT_BYTES
from lightning_zenflow.engine.device import HyperParams
from lightning_zenflow.engine.interim import resolve_interim_scale
from lightning_zenflow.engine.landing import LANDING_CHUNK_BYTES
from lightning_zenflow.engine.layout import GroupLayout, HostFormat, MatrixSlot, resolve_host_format
from lightning_zenflow.engine.migrate import peak_chunk_elements

CONVERT_BUFFER_BYTES = 4 * CONVERT_CHUNK_ELEMENTS
"""Host mode's fp32 conversion buffer (``engine/accumulate.py``)."""


@dataclass(frozen=True)
class MatrixShape:
    """A matrix parameter as one rank's engine sees it."""

    rows: int
    """Rows the engine sees (FSDP2: this rank's shard)."""
    cols: int
    host_rows: int
    """Rows whose host state this rank holds (data parallel: its row block; else ``rows``)."""
    weight_bytes: int
    """Bytes per element of the weight (and of its gradient)."""
    group: int = 0
    whole_rows: int | None = None
    """FSDP2: the whole matrix's rows (the interim moves keep statistics per whole row); None: ``rows``."""

    @property
    def host_numel(self) -> int:
        return self.host_rows * self.cols


@dataclass(frozen=True)
class VectorShape:
    """A parameter with ``ndim <= 1`` (device-only)."""

    numel: int
    weight_bytes: int


def may_go_to_host(config: ZenFlowConfig, matrix: MatrixShape) -> bool:
    return config.full_warm_up_rounds > 0 or num_selected_columns(matrix.cols, config.topk_ratio) < matrix.cols


def resolve_format(
    config: ZenFlowConfig,
    weight_dtype: torch.dtype,
    accumulate_on: str,
    weight_decay: float = 0.0,
    decoupled: bool = True,
) -> tuple[HostFormat, bool]:
    """The host format an engine takes for matrices of ``weight_dtype`` (under AdamW, or Adam's L2 decay when not
    ``decoupled``) in an accumulation mode (``"device"`` or ``"host"``), and whether it runs the interim moves: the
    engine's own rules (``resolve_interim_scale``, ``resolve_host_format``) applied to a one-matrix stand-in.

    Raises:
        UnsupportedSetupError: a knob the engine refuses for such a model (``interim_step > 0`` with L2 decay).
    """
    weight = torch.empty((1, 1), dtype=weight_dtype, device="meta")
    slot = MatrixSlot(param=weight, name="matrix", group_index=0, index_in_group=0, rows=1, cols=1, offset=0)
    layout = [GroupLayout(index=0, matrices=[slot])]
    hparams = [HyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, decoupled=decoupled)]
    interim = resolve_interim_scale(config, layout, hparams) != 0
    return resolve_host_format(config, layout, hparams, interim).for_mode(accumulate_on), interim


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def host_bytes(
    matrices: Sequence[MatrixShape], config: ZenFlowConfig, host_format: HostFormat, groups: int | None = None
) -> int:
    """``engine.host_bytes()``: the shared rows of every group, the step counts, the column indices, host mode's
    staging. ``host_format``: the format for the accumulation mode in use (``HostFormat.for_mode``)."""
    return sum(host_parts(matrices, config, host_format, groups).values())


def host_parts(
    matrices: Sequence[MatrixShape], config: ZenFlowConfig, host_format: HostFormat, groups: int | None = None
) -> dict[str, int]:
    """:func:`host_bytes` by kind: ``state`` (the moments and any master), ``window`` (the window rows), ``small``
    (4 B per matrix of step count, 8 B per column of index) and ``staging`` (host mode's pinned slots and conversion
    buffer)."""
    count = groups if groups is not None else 1 + max((m.group for m in matrices), default=0)
    members = [m for m in matrices if m.group < count]
    elements = sum(m.host_numel for m in members)
    parts = {
        "state": host_format.state_bytes * elements,
        "window": host_format.window_bytes * elements,
        "small": 4 * len(members) + 8 * sum(m.cols for m in members),
        "staging": 0,
    }
    if host_format.window_rows == 2:  # host mode
        parts["staging"] = 2 * host_slot_bytes(matrices, config) + CONVERT_BUFFER_BYTES
    return parts


def host_slot_bytes(matrices: Sequence[MatrixShape], config: ZenFlowConfig) -> int:
    """Host mode's staging slot: 64 MiB, or the largest gradient it carries if smaller."""
    largest = max((m.host_numel * m.weight_bytes for m in matrices if may_go_to_host(config, m)), default=1)
    return max(1, min(STAGING_SLOT_BYTES, largest))


def device_bytes(
    matrices: Sequence[MatrixShape],
    vectors: Sequence[VectorShape],
    config: ZenFlowConfig,
    host_format: HostFormat,
    device_type: str = "cuda",
    interim: bool = False,
) -> int:
    """``engine.device_bytes()`` after the first selection: the selected columns' state, the 1-D parameters' state,
    the accumulation mode's buffers, the landing's buffer (CUDA), the interim moves' statistics."""
    return sum(device_parts(matrices, vectors, config, host_format, device_type, interim).values())


def device_parts(
    matrices: Sequence[MatrixShape],
    vectors: Sequence[VectorShape],
    config: ZenFlowConfig,
    host_format: HostFormat,
    device_type: str = "cuda",
    interim: bool = False,
) -> dict[str, int]:
    """:func:`device_bytes` by kind: the optimizer state (``selected``: the selected columns' master, moments and
    gradient buffer with every matrix's column indices; ``vectors``: the 1-D parameters' moments and masters) and the
    buffers (``window``: device mode's accumulator; ``rounding``: its row and column numbers; ``staging``: host
    mode's two device slots; ``landing``: the buffer steps land through on CUDA; ``interim``: the moves'
    statistics)."""
    parts = dict.fromkeys(("selected", "vectors", "window", "rounding", "staging", "landing", "interim"), 0)
    for vector in vectors:
        parts["vectors"] += 4 * vector.numel * (2 if vector.weight_bytes == 4 else 3)
    for matrix in matrices:
        k = num_selected_columns(matrix.cols, config.topk_ratio)
        parts["selected"] += 16 * matrix.rows * k + 8 * matrix.cols
    going = [m for m in matrices if may_go_to_host(config, m)]
    if host_format.window_rows == 2:  # host mode: the device half of the staging ring
        parts["staging"] = 2 * host_slot_bytes(matrices, config)
    else:
        parts["window"] = sum(_itemsize(host_format.window) * m.host_numel for m in going)
        if host_format.window == torch.bfloat16:
            parts["rounding"] = sum(4 * (m.host_rows + m.cols) for m in going)  # the row and column numbers
    if device_type == "cuda" and not host_format.master:
        parts["landing"] = landing_buffer_bytes(going, host_format)
    if interim:
        parts["interim"] = interim_bytes(matrices, config)
    return parts


def landing_buffer_bytes(matrices: Sequence[MatrixShape], host_format: HostFormat) -> int:
    """The device buffer steps go up through: whole rows of one matrix, at most :data:`LANDING_CHUNK_BYTES`."""
    largest = 0
    for matrix in matrices:
        if matrix.host_numel == 0:
            continue
        row_bytes = _itemsize(host_format.window) * matrix.cols
        rows = min(matrix.host_rows, max(1, LANDING_CHUNK_BYTES // max(1, row_bytes)))
        largest = max(largest, rows * row_bytes)
    return largest


def interim_bytes(matrices: Sequence[MatrixShape], config: ZenFlowConfig) -> int:
    """The interim moves' statistics: per matrix with host columns its row and column EMAs, their scales, the host
    mask, the warm-up's column record and three scalars (fp32), and one shared scalar."""
    total = 4
    for matrix in matrices:
        if num_selected_columns(matrix.cols, config.topk_ratio) == matrix.cols:
            continue
        whole_rows = matrix.whole_rows if matrix.whole_rows is not None else matrix.rows
        total += 4 * (2 * whole_rows + 5 * matrix.cols + 3)
    return total


SELECTION_TRANSIENT_BYTES = 24
"""Device bytes per selected element that a selection holds for a moment beyond the state it installs (the arriving
columns, the old state beside the new): the allowance ``engine/accumulate.py``'s ``selection_device_bytes`` makes."""
SELECTION_TRANSIENT_SHARDED_BYTES = 36
"""The same under data parallel, where the entering columns' rows from every rank meet in one buffer."""


def selection_transient_bytes(matrices: Sequence[MatrixShape], config: ZenFlowConfig, sharded: bool = False) -> int:
    """Device bytes a selection (the first, and each refresh) holds for a moment on top of the steady state: the
    engine's own allowance per selected element (:data:`SELECTION_TRANSIENT_BYTES`) of the largest chunk the
    migration moves at once (``engine/migrate.py``: a constant, or one matrix where a matrix alone is larger)."""
    per_element = SELECTION_TRANSIENT_SHARDED_BYTES if sharded else SELECTION_TRANSIENT_BYTES
    selected = [m.rows * num_selected_columns(m.cols, config.topk_ratio) for m in matrices]
    return per_element * peak_chunk_elements(selected)


def per_parameter(total_bytes: int, parameters: int) -> float:
    """Bytes per parameter of a total."""
    return total_bytes / max(1, parameters)
