"""The host worker's AdamW step over the host layout (``engine/layout.py``): one source, compiled or eager.

Two functions, written once in plain torch ops and run through :class:`~lightning_zenflow.engine.kernels.Kernels`
(``torch.compile`` into one C++ loop with OpenMP where a compiler is found, the same functions eagerly elsewhere):

- :func:`adam_step_`: the weights are the masters. From the window's sum and the moments it writes the new moments
  and the step ``-lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` into the window row it read (no weight decay: the
  device applies it when the step lands, ``w <- w * (1 - lr * wd) + step``).
- :func:`adam_master_step_`: the host keeps fp32 masters (``HostFormat.master``): AdamW (decoupled decay) or Adam
  (L2 decay in the gradient) on the master, as torch's fused kernel computes it.

Stored moments: fp32 as computed; bf16 (``host_state="bf16"``) with the first moment rounded to nearest (its change
per update is ``1 - beta1`` = 10 % of the distance to the gradient, far above half a bf16 step) and the second
stochastically (its change is ``1 - beta2`` = 0.1 %, below half a step: rounded to nearest it would stop moving),
with the lattice numbers of ``engine/rounding.py`` and the matrix's host update count as the offset's step.

Memory traffic per element (the worker is bound by it; docs/performance.md): fp32 state 24 B (read g, m, v; write m,
v, step), bf16 state 12 B, against 28 B (+4 to zero a master) for torch's fused AdamW over fp32 state. Each region
is processed in row blocks of about :data:`CHUNK_ELEMENTS` elements, so the eager functions' temporaries stay small.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.engine.device import HyperParams
from lightning_zenflow.engine.kernels import Kernels, kernel_override, resolve_kernel_mode
from lightning_zenflow.engine.rounding import PURPOSE_EXP_AVG_SQ, bits_table, lattice_bits, offset_of, round_bf16
from lightning_zenflow.native import native_built, native_kernels

CHUNK_ELEMENTS = 1 << 22
"""Elements per call of a step function (16 MiB of fp32): the eager temporaries' bound."""
COLUMN_SALT = 0x5BD1E995
"""Mixed into a matrix's salt for its column numbers (rows and columns draw from different tables)."""
SCALARS = (
    "inverse divisor",
    "beta1",
    "1 - beta1",
    "beta2",
    "1 - beta2",
    "lr / bc1",
    "1 / sqrt(bc2)",
    "eps",
    "lattice offset",
    "L2 decay",
    "decoupled decay factor",
)
"""The step functions' ``scalars``, in order: computed in double on the host, then held in fp32 (``1 - beta2`` is
computed before the rounding: fp32's ``1 - 0.999`` is 1.3e-5 off)."""


def _mean(grad2d: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
    """The window's mean gradient (fp32)."""
    return grad2d.float() * scalars[0]


def correctly_rounded_sqrt(value: torch.Tensor) -> torch.Tensor:
    """fp32 ``sqrt`` rounded correctly, compiled and eager alike. A compiled kernel's is (the vector instruction, or
    Triton's ``sqrt.rn``); eager ATen's fp32 ``sqrt`` on an x86 CPU is not always (it went 1 ulp off in 20 % of the
    elements here, through its vectorised math library), so eagerly it is taken in fp64 and rounded once, which is
    exact: the eager and compiled steps then have the same bits."""
    if torch.compiler.is_compiling():
        return value.sqrt()
    return value.double().sqrt().float()


def _moments(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scalars: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new moments (fp32) and the step, torch's fused AdamW's arithmetic."""
    m = exp_avg.float()
    m = m + (grad - m) * scalars[2]
    v = exp_avg_sq.float() * scalars[3] + grad * grad * scalars[4]
    step = -scalars[5] * m / (correctly_rounded_sqrt(v) * scalars[6] + scalars[7])
    return m, v, step


def _store_moments(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    row_r: torch.Tensor,
    col_r: torch.Tensor,
    scalars: torch.Tensor,
    stochastic: bool,
) -> None:
    exp_avg.copy_(m)
    if stochastic:
        exp_avg_sq.copy_(round_bf16(v, lattice_bits(row_r, col_r, scalars[8])))
    else:
        exp_avg_sq.copy_(v)


def adam_step_(
    grad2d: torch.Tensor,
    exp_avg2d: torch.Tensor,
    exp_avg_sq2d: torch.Tensor,
    row_r: torch.Tensor,
    col_r: torch.Tensor,
    scalars: torch.Tensor,
    stochastic: bool,
) -> None:
    """One AdamW step from the window's sum ``grad2d`` (the mean is ``sum * scalars[0]``): the moments in place, and
    the step written over ``grad2d``. ``stochastic``: the second moment is bf16, rounded stochastically with the
    lattice of ``row_r``, ``col_r`` and the offset ``scalars[8]`` (``engine/rounding.py``)."""
    grad = _mean(grad2d, scalars)
    m, v, step = _moments(grad, exp_avg2d, exp_avg_sq2d, scalars)
    _store_moments(exp_avg2d, exp_avg_sq2d, m, v, row_r, col_r, scalars, stochastic)
    grad2d.copy_(step)


def adam_master_step_(
    master2d: torch.Tensor,
    grad2d: torch.Tensor,
    exp_avg2d: torch.Tensor,
    exp_avg_sq2d: torch.Tensor,
    row_r: torch.Tensor,
    col_r: torch.Tensor,
    scalars: torch.Tensor,
    stochastic: bool,
) -> None:
    """One Adam/AdamW step on an fp32 master: ``scalars[9]`` is Adam's L2 decay (added to the gradient),
    ``scalars[10]`` AdamW's factor ``1 - lr * wd`` (applied to the master before the step)."""
    grad = _mean(grad2d, scalars) + master2d * scalars[9]
    m, v, step = _moments(grad, exp_avg2d, exp_avg_sq2d, scalars)
    _store_moments(exp_avg2d, exp_avg_sq2d, m, v, row_r, col_r, scalars, stochastic)
    master2d.copy_(master2d * scalars[10] + step)


@dataclass(frozen=True)
class StepHyperParams:
    """What one matrix's host step needs besides its tensors."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    count: int
    """The matrix's host update count after this update (its bias correction)."""
    divisor: float
    """The window's kept gradients: the sum over this is the mean."""

    def scalars(self, salt: int, with_master: bool) -> torch.Tensor:
        """The step functions' ``scalars`` (fp32): with a master, the decay is applied on the host; without one the
        device applies it at the landing."""
        bias_correction1 = 1.0 - self.beta1**self.count
        bias_correction2 = 1.0 - self.beta2**self.count
        l2 = self.weight_decay if with_master and not self.decoupled else 0.0
        decay = 1.0 - self.lr * self.weight_decay if with_master and self.decoupled else 1.0
        values = [
            1.0 / self.divisor,
            self.beta1,
            1.0 - self.beta1,
            self.beta2,
            1.0 - self.beta2,
            self.lr / bias_correction1,
            1.0 / math.sqrt(bias_correction2),
            self.eps,
            offset_of(salt, PURPOSE_EXP_AVG_SQ, self.count),
            l2,
            decay,
        ]
        return torch.tensor(values, dtype=torch.float32)


class NoiseTables:
    """Per matrix: the lattice's row and column numbers (int32, ``engine/rounding.py``), built at first use."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, salt: int, row_start: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (salt, row_start, rows, cols)
        tables = self._tables.get(key)
        if tables is None:
            tables = (bits_table(salt, row_start, rows), bits_table(salt ^ COLUMN_SALT, 0, cols))
            self._tables[key] = tables
        return tables


def step_region(
    step_fn: Callable[..., None],
    master_fn: Callable[..., None],
    grad2d: torch.Tensor,
    exp_avg2d: torch.Tensor,
    exp_avg_sq2d: torch.Tensor,
    master2d: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor],
    scalars: torch.Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> None:
    """One matrix's host step (its ``[host_rows, cols]`` views), in row blocks of about ``chunk_elements``."""
    rows, cols = grad2d.shape
    stochastic = exp_avg_sq2d.dtype == torch.bfloat16
    row_r, col_r = tables
    block = max(1, chunk_elements // max(cols, 1))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        part = slice(start, stop)
        if master2d is None:
            step_fn(grad2d[part], exp_avg2d[part], exp_avg_sq2d[part], row_r[part], col_r, scalars, stochastic)
        else:
            master_fn(
                master2d[part],
                grad2d[part],
                exp_avg2d[part],
                exp_avg_sq2d[part],
                row_r[part],
                col_r,
                scalars,
                stochastic,
            )


# ------------------------------------------------------------------------------- one host update of a group
@dataclass(frozen=True)
class MatrixExtent:
    """Where one matrix lives in its group's flat buffers, and its model dtype (for the staged upload)."""

    offset: int
    numel: int
    dtype: torch.dtype
    cols: int = 0
    """Columns of the ``[rows, cols]`` view (needed to unpack a packed accumulator)."""
    col_offset: int = 0
    """Where this matrix's columns start in its group's shared column-index buffer."""
    salt: int = 0
    """The matrix's salt (``engine/rounding.py``): its stochastic rounding draws its own numbers."""
    row_start: int = 0
    """The global index of the first row this rank holds (the rounding's numbers are by global row)."""


@dataclass(frozen=True)
class GroupJob:
    """The host work for one param group in one update."""

    hparams: HyperParams
    active: tuple[int, ...]
    """Indices (within the group) of the matrices that have columns on the host and got gradients."""
    mean_divisors: tuple[float, ...]
    """For each active matrix, what turns its accumulator into the window's mean gradient: the accumulator holds
    the sum of the window's gradients, so the divisor is their count (the fused kernel divides as it reads).
    0 when every one of them was skipped (16-mixed overflow): the matrix is not updated, only staged."""
    packed_columns: tuple[int, ...] | None = None
    """``accumulate_on="host"``: per active matrix, how many columns its accumulator holds packed (``[rows, n]``
    contiguous, the columns listed in the spec's ``unselected`` buffer); None: whole ``[rows, cols]`` rows."""


@dataclass(frozen=True)
class WorkerGroup:
    """One param group's shared host rows, as the worker uses them (``engine/layout.py``)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    """``[n_matrices]`` fp32: each matrix's host update count."""
    master: torch.Tensor | None
    """fp32 masters where the host keeps them; None: the weights are the masters, the worker writes steps."""
    windows: tuple[torch.Tensor, ...] = ()
    """The window rows (one, or two in host mode)."""

    def window(self, slot: int) -> torch.Tensor:
        return self.windows[slot % len(self.windows)]


def unpack_accumulators(
    grad_acc: torch.Tensor,
    extents: Sequence[MatrixExtent],
    job: GroupJob,
    unselected: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """Host mode: turn each active matrix's packed accumulator (``[rows, n]`` at the start of its region) into
    whole rows in place, zero in the columns that are not host-bound (their host values are parked).

    Rows are moved from the last to the first through ``scratch`` (one row block at a time), so a row is
    written only after every packed row it overlaps has been read.
    """
    if job.packed_columns is None:
        return
    for index, n_packed in zip(job.active, job.packed_columns):
        extent = extents[index]
        cols = extent.cols
        if n_packed == cols:
            continue  # every column is host-bound: the packed layout is the whole-row layout
        rows = extent.numel // cols
        region = grad_acc[extent.offset : extent.offset + extent.numel]
        columns = unselected[extent.col_offset : extent.col_offset + n_packed]
        block_rows = max(1, min(rows, scratch.numel() // max(cols, 1)))
        for stop in range(rows, 0, -block_rows):
            start = max(0, stop - block_rows)
            packed = region[start * n_packed : stop * n_packed].view(stop - start, n_packed)
            whole = scratch[: (stop - start) * cols].view(stop - start, cols)
            whole.zero_()
            # scatter_ with a broadcast index runs in parallel, about twice as fast here as index_copy_ on dim 1
            whole.scatter_(1, columns.expand(stop - start, n_packed), packed)
            region[start * cols : stop * cols].copy_(whole.view(-1))


UNPACK_SCRATCH_ELEMENTS = 1 << 22
"""The worker's fp32 scratch for unpacking host-mode accumulators (16 MiB)."""


EAGER_WHILE_BUILDING_ELEMENTS = 1 << 24
"""A worker whose step is still being built runs a region of at most this many elements eagerly (about half a second
on one core) instead of waiting for the build; a larger one waits. Both give the same bits (``engine/compiled.py``)."""


class StepKernels:
    """The step functions as the worker runs them and the rounding's tables.

    ``mode`` (``interim_kernel``; ``elements``: ``engine/kernels.py``'s size rule): anything but ``"eager"`` runs
    ``lightning_zenflow/native``'s step, bit for bit the eager functions' (several times their speed, and 1.4-1.6 times
    torch's fused AdamW over fp32 state here: RESULTS.md). The library is built once per machine (seconds) and cached:
    where it is not built yet and the mode asks for compiled kernels, the worker (``background``) builds it on a thread
    of its own while the step runs eagerly (the same bits), and takes it once loaded; elsewhere it builds now. With
    ``LIGHTNING_ZENFLOW_KERNELS=inductor`` the step is ``torch.compile``'s build instead, ahead of time (:meth:`warm`
    queues the dtypes a worker will meet; until a build is ready a small region runs eagerly and a large one waits)."""

    def __init__(self, mode: str = "eager", elements: int | None = None, background: bool = False) -> None:
        resolved, _ = resolve_kernel_mode(mode, torch.device("cpu"), elements)
        inductor = resolved == "compiled" and kernel_override() == "inductor"
        # in the worker only the builder thread builds; elsewhere (a benchmark, the planner) whichever thread calls
        self.kernels = Kernels(mode if inductor else "eager", torch.device("cpu"), elements, owner=False)
        self.step_ = self.kernels.wrap(adam_step_)
        self.master_step_ = self.kernels.wrap(adam_master_step_)
        self.chunk_elements = CHUNK_ELEMENTS
        """Elements per call of a step function: the eager functions' temporaries' bound (native: a region at once)."""
        self.noise = NoiseTables()
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._builder: threading.Thread | None = None
        if not inductor and mode != "eager" and kernel_override() != "eager":
            if native_built() or (resolved == "compiled" and not background):
                self._take_native()
            elif resolved == "compiled":
                # the first build on this machine (seconds): the step runs eagerly meanwhile, with the same bits
                self._builder = threading.Thread(target=self._take_native, name="zenflow-step-builder", daemon=True)
                self._builder.start()
        if self.kernels.mode == "compiled":
            import torch._inductor.config as inductor_config

            # build in this process: a pool of compile processes would outlive nothing but cost start-up and memory
            inductor_config.compile_threads = 1
            if background:
                self._builder = threading.Thread(target=self._build_loop, name="zenflow-step-builder", daemon=True)
                self._builder.start()
                self.kernels.hand_builds_to(self._builder.ident)

    def _take_native(self) -> None:
        """Run the native step from now on, if the library loads (it builds here if no process has: seconds)."""
        native = native_kernels()
        if native is None:
            return
        # the same bits as the eager step: which one a region runs never changes a number
        self.chunk_elements = 1 << 62
        self.master_step_ = native.adam_master_step_
        self.step_ = native.adam_step_

    def warm(self, groups: Sequence[WorkerGroup]) -> None:
        """Build the step for the dtypes of ``groups`` (on the builder thread when there is one; at once otherwise):
        ``torch.compile``'s builds only (the native step is one library for every dtype)."""
        if self.kernels.mode != "compiled":
            return
        kinds = []
        for group in groups:
            for window in group.windows:
                kinds.append((window.dtype, group.exp_avg.dtype, group.master is not None))
        if self._builder is None:
            self._build(kinds)
            return
        self._idle.clear()
        self._queue.put(tuple(kinds))

    def _build_loop(self) -> None:
        while True:
            kinds = self._queue.get()  # blocks until warm() queues dtypes, or close() a None
            if kinds is None:
                return
            try:
                self._build(kinds)
            finally:
                if self._queue.empty():
                    self._idle.set()

    def _build(self, kinds: Sequence[tuple]) -> None:
        for window_dtype, state_dtype, with_master in dict.fromkeys(kinds):
            grad = torch.zeros(2, 3, dtype=window_dtype)
            m, v = (torch.zeros(2, 3, dtype=state_dtype) for _ in range(2))
            row_r, col_r = self.noise.of(0, 0, 2, 3)
            scalars = StepHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1, 1.0).scalars(0, with_master)
            stochastic = state_dtype == torch.bfloat16
            if with_master:
                Kernels.prepare(self.master_step_, torch.zeros(2, 3), grad, m, v, row_r, col_r, scalars, stochastic)
            else:
                Kernels.prepare(self.step_, grad, m, v, row_r, col_r, scalars, stochastic)

    def before_update(self, elements: int | None) -> None:
        """A large region (or ``None``: any) waits for a build in progress; a small one runs eagerly meanwhile."""
        if elements is None or elements > EAGER_WHILE_BUILDING_ELEMENTS:
            self._idle.wait()  # thread wait: the builder thread finishes the step's build (seconds, once)

    def close(self) -> None:
        if self._builder is not None:
            self._queue.put(None)  # an inductor builder's end; a native one ends by itself
            self._builder.join()  # thread join: a build in progress finishes first (a daemon thread mid-compile
            self._builder = None  # at interpreter exit could abort the process)


def host_adam_update(
    group: WorkerGroup,
    extents: Sequence[MatrixExtent],
    slot: int,
    job: GroupJob,
    unselected: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    kernels: StepKernels | None = None,
) -> None:
    """One AdamW step on the active matrices of a group with the mean of window ``slot``.

    Without a master (the weights are the masters) the step is written over the window row it read; with one, the
    master is updated and the new weights of a matrix that is not fp32 are written, cast to its dtype, into the bytes
    of that row (the staging area of the upload; fp32 weights go up from the master itself). Runs in the worker; also
    importable for tests and benchmarks.
    """
    if not job.active:
        return
    kernels = kernels or StepKernels()
    kernels.before_update(sum(extents[index].numel for index in job.active))
    grad_acc = group.window(slot)
    if job.packed_columns is not None:
        if unselected is None:
            raise ValueError("a packed accumulator needs the host-bound column indices (unselected).")
        if scratch is None:
            scratch = torch.empty(UNPACK_SCRATCH_ELEMENTS, dtype=torch.float32)
        unpack_accumulators(grad_acc, extents, job, unselected, scratch)
    hp = job.hparams
    with_master = group.master is not None
    for index, divisor in zip(job.active, job.mean_divisors):
        extent = extents[index]
        window = slice(extent.offset, extent.offset + extent.numel)
        cols = extent.cols or extent.numel
        rows = extent.numel // cols if cols else 0  # 0: a data-parallel rank that holds no row of this matrix
        grad2d = grad_acc[window].view(rows, cols)
        if divisor == 0.0:
            # every gradient of the window was skipped (16-mixed overflow): no update; a zero step, or the weights
            # staged as they are
            if not with_master:
                grad2d.zero_()
        else:
            steps = group.steps[index : index + 1]
            steps.add_(1.0)
            step_hp = StepHyperParams(
                hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled, int(steps.item()), divisor
            )
            master2d = group.master[window].view(rows, cols) if with_master else None
            step_region(
                kernels.step_,
                kernels.master_step_,
                grad2d,
                group.exp_avg[window].view(rows, cols),
                group.exp_avg_sq[window].view(rows, cols),
                master2d,
                kernels.noise.of(extent.salt, extent.row_start, rows, cols),
                step_hp.scalars(extent.salt, with_master),
                kernels.chunk_elements,
            )
        if with_master and extent.dtype != torch.float32:
            itemsize = torch.empty((), dtype=extent.dtype).element_size()
            staged = grad_acc[window].view(torch.uint8)[: extent.numel * itemsize].view(extent.dtype)
            staged.copy_(group.master[window])
