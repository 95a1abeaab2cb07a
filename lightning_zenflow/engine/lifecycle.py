"""What an engine holds and how it is built and released: the layout, the buffers, the lanes, the worker.

:class:`EngineLifecycle` is the half of :class:`~lightning_zenflow.engine.engine.ZenFlowEngine` that owns resources:
it builds the layout from the optimizer's param groups, allocates and pins the host state, starts the lanes, the
helper thread and the worker (``start``), and releases all of it, on success and on failure (``close``), or
starts again (``rebuild``, ``restart``). It also answers what the engine holds (``device_bytes``, ``host_bytes``).
The update rule itself is ``engine/engine.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine.accumulate import DeviceAccumulation, HostAccumulation
from lightning_zenflow.engine.device import DeviceUpdater, HyperParams
from lightning_zenflow.engine.host import HostWorker
from lightning_zenflow.engine.interim import InterimMoves, resolve_interim_scale
from lightning_zenflow.engine.kernels import Kernels
from lightning_zenflow.engine.landing import Landing, Uploads
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import (
    GroupHostBuffers,
    allocate_host_buffers,
    allocate_window_rows,
    build_layout,
    resolve_host_format,
    staging_view,
)
from lightning_zenflow.engine.optimizers import ZeroGradGuard, check_optimizer
from lightning_zenflow.engine.preflight import check_host_resources
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.refresh import refresh_period
from lightning_zenflow.engine.resources import CoreBinding, pin_host_buffers, pin_rows, start_worker, unpin
from lightning_zenflow.engine.schedule import Schedule
from lightning_zenflow.engine.selection import SelectionDiagnostics
from lightning_zenflow.engine.stats import StepClock, StepStats
from lightning_zenflow.engine.transfer import Helper
from lightning_zenflow.engine.window import WindowEnd


class EngineLifecycle:
    """The engine's resources and their lifecycle (see the module docstring); the rule is in the subclass."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: ZenFlowConfig,
        *,
        param_names: Mapping[torch.Tensor, str] | None = None,
        steps_per_epoch: int | None = None,
        host_delay_s: float = 0.0,
        host_fail_at: int | None = None,
        stage_delays: Mapping[str, float] | None = None,
        ranks: Ranks | None = None,
        guard_zero_grad: bool = True,
        maximize_by_caller: bool = False,
        row_offsets: Mapping[str, int] | None = None,
        matrix_columns: Mapping[str, int] | None = None,
    ) -> None:
        check_optimizer(optimizer, allow_maximize=maximize_by_caller)
        self.optimizer = optimizer
        self._guard_zero_grad = guard_zero_grad
        self._maximize_by_caller = maximize_by_caller
        self.config = config
        self.ranks = ranks or Ranks()
        self._decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        self._names = {id(p): n for p, n in (param_names or {}).items()}
        self.row_offsets = dict(row_offsets or {})
        """FSDP2: where each matrix's local rows start in the whole matrix (rounding draws by global row)."""
        self.matrix_columns = dict(matrix_columns or {})
        """Per parameter name, the columns of its matrix view where they are not ``numel // shape[0]`` (a stack of
        expert matrices: ``lightning_zenflow/matrices.py``)."""
        self._steps_per_epoch = steps_per_epoch
        self._build_layout()
        self._stage_delays = dict(stage_delays or {})
        if host_delay_s:
            self._stage_delays["worker"] = host_delay_s
        self._host_fail_at = host_fail_at
        self._worker: HostWorker | None = None
        self._binding = CoreBinding()
        self._started = False
        self._closed = False
        self.interim: InterimMoves | None = None
        self.parked: dict[str, dict] = {}
        """The carried state of parameters that stopped training (frozen mid-fit), kept for when they come back."""
        self._reset_run_state()

    def _build_layout(self) -> None:
        """The layout and a fresh schedule from the optimizer's param groups as they are now."""
        for group_index, group in enumerate(self.optimizer.param_groups):
            for position, param in enumerate(group["params"]):
                if isinstance(param, torch.Tensor) and id(param) not in self._names:
                    self._names[id(param)] = _unique(f"group{group_index}.param{position}", self._names.values())
        by_id = {
            id(param): self.matrix_columns[self._names[id(param)]]
            for group in self.optimizer.param_groups
            for param in group["params"]
            if self._names.get(id(param)) in self.matrix_columns
        }
        self.layout = build_layout(self.optimizer.param_groups, self._names, self.ranks, by_id)
        params = [s.param for g in self.layout for s in g.matrices] + [
            s.param for g in self.layout for s in g.device_only
        ]
        if not params:
            raise ValueError("the optimizer has no trainable parameters (every parameter has requires_grad=False).")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}.")
        self.device = devices.pop()
        self.schedule = Schedule.create(
            [len(g.matrices) for g in self.layout], self.config.full_warm_up_rounds, self.config.update_interval
        )
        self.schedule.refresh_every = refresh_period(self.config, self._steps_per_epoch)
        self._layout_signature = self._groups_signature()

    def _groups_signature(self) -> tuple:
        """What the layout depends on: each group's parameters and which of them train."""
        return tuple(
            tuple((id(p), bool(p.requires_grad)) for p in group["params"]) for group in self.optimizer.param_groups
        )

    def _reset_run_state(self) -> None:
        self.accumulation: DeviceAccumulation | HostAccumulation | None = None
        self.uploads: Uploads | None = None
        self._restored_window_sums: dict[str, torch.Tensor] | None = None
        # telemetry
        self._stall_s = 0.0
        self._clock = StepClock()
        self._stall_at_last_stats = 0.0
        self._syncs_at_last_stats = 0
        self._diagnostics: SelectionDiagnostics | None = None
        self._refresh_bytes = [0, 0]
        self.last_stats: StepStats | None = None
        self.merge_cache: tuple | None = None
        """``engine/state.py``'s merge of the state at one point of the run (a checkpoint takes two views of it)."""

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> Self:
        """Allocate the host buffers, pin them (CUDA), and spawn the host worker. Idempotent."""
        if self._closed:
            raise RuntimeError("this ZenFlowEngine was closed; build a new one.")
        if self._started:
            return self
        hparams = self.read_hparams()
        interim_step = resolve_interim_scale(self.config, self.layout, hparams)
        self.host_format = resolve_host_format(self.config, self.layout, hparams, interim_step != 0)
        self.lanes = Lanes(self.device, self._stage_delays)
        # shared memory and RAM first: one clear error if short (for every rank on this machine)
        check_host_resources(
            self.layout, self.device, ranks_per_host=self.ranks.local_world, host_format=self.host_format
        )
        self.host_buffers: list[GroupHostBuffers] = allocate_host_buffers(self.layout, self.host_format)
        allocate_window_rows(self.layout, self.host_buffers, self.host_format)
        # per group: each matrix's host-bound column indices, for the worker to unpack host-mode accumulators
        self.unselected_shared = [
            torch.zeros(sum(s.cols for s in g.matrices), dtype=torch.long).share_memory_() for g in self.layout
        ]
        self._pinned: list[tuple[torch.Tensor, int]] = []
        # built on this (the training) thread before any lane runs them; the size rule of "auto" counts this rank's rows
        host_elements = sum(slot.host_numel for group in self.layout for slot in group.matrices)
        self.kernels = Kernels(self.config.interim_kernel, self.device, elements=host_elements)
        self.device_updater = DeviceUpdater(self.layout, self.lanes, self.kernels)
        self.interim = InterimMoves(self.lanes, interim_step, self.kernels, self.ranks) if interim_step != 0 else None
        self.helper = Helper(self.lanes)
        self.window = WindowEnd(self.lanes, self.layout)
        self.landing = Landing(self.helper)
        self._worker = None
        self._started = True
        self._zero_grad_guard = None
        if self._guard_zero_grad:
            self._zero_grad_guard = ZeroGradGuard(self.optimizer, self.wait_for_gradients)
        try:
            if self.device.type == "cuda":
                self._pinned = pin_host_buffers(self.layout, self.host_buffers, self.device)
            if self.needs_host():
                self._worker = start_worker(
                    self.config,
                    self.ranks,
                    self.layout,
                    self.host_buffers,
                    self.unselected_shared,
                    self._binding,
                    self._stage_delays,
                    self._host_fail_at,
                    self.row_offsets,
                )
            # the native kernels the lanes run use the training process's share of the cores, bound now
            self.kernels.threads = torch.get_num_threads()
        except BaseException:
            self.close(quiet=True)
            raise
        return self

    def use_window_rows(self, accumulate_on: str) -> None:
        """Give the host the window rows of an accumulation mode (``"device"``: one row, ``"host"``: two fp32
        rows), if it does not hold them yet: at the first step, when the mode is chosen, with nothing in flight."""
        wanted = self.host_format.for_mode(accumulate_on)
        if wanted == self.host_format:
            return
        # host wait for every lane: the old rows may still be read by a copy
        self.lanes.synchronize()
        windows = [row for host in self.host_buffers for row in host.windows]
        still_pinned = [(t, p) for t, p in self._pinned if not any(t is w for w in windows)]
        unpin([(t, p) for t, p in self._pinned if any(t is w for w in windows)], self.device)
        self._pinned = still_pinned
        check_host_resources(self.layout, self.device, ranks_per_host=self.ranks.local_world, host_format=wanted)
        pending = self.schedule.pending
        # a restored host update in flight waits in the old rows (its step, or its staged weights): it moves over
        old_rows = [host.grad_acc(pending.slot) for host in self.host_buffers] if pending is not None else None
        allocate_window_rows(self.layout, self.host_buffers, wanted)
        self.host_format = wanted
        if pending is not None:
            for group, host, old_row, active in zip(self.layout, self.host_buffers, old_rows, pending.active):
                for index in active:
                    slot = group.matrices[index]
                    if host.master is None:
                        slot.view2d(host.grad_acc(pending.slot)).copy_(slot.view2d(old_row))
                    elif slot.param.dtype != torch.float32:
                        staged = staging_view(host.grad_acc(pending.slot), slot, slot.param.dtype)
                        staged.copy_(slot.view2d(host.master))
        if self.device.type == "cuda":
            self._pinned += pin_rows([row for host in self.host_buffers for row in host.windows], self.device)
        if self._worker is not None:
            self._worker.attach([host.windows for host in self.host_buffers])

    def needs_host(self) -> bool:
        """False when no step can ever put work on the host: no matrix at all (only 1-D parameters), or every column on
        the device with no warm-up."""
        if not any(group.matrices for group in self.layout):
            return False
        if self.config.full_warm_up_rounds > 0:
            return True
        return any(
            num_selected_columns(slot.cols, self.config.topk_ratio) < slot.cols
            for group in self.layout
            for slot in group.matrices
        )

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, quiet: bool = False) -> None:
        """Stop the worker, unpin and drop the buffers, restore the process's cores. Idempotent; safe on error.

        ``quiet`` (failure paths): an error of the device or of a lane is not raised again while closing, so it
        cannot hide the error being handled; everything is still released."""
        if self._closed:
            return
        self._closed = True
        self._release(quiet)

    def _release(self, quiet: bool) -> None:
        """Everything :meth:`start` made, released; the engine can be started again (:meth:`rebuild`)."""
        if not self._started:
            return
        self._started = False
        if self._zero_grad_guard is not None:
            self._zero_grad_guard.remove()
        helper = getattr(self, "helper", None)
        if helper is not None:
            helper.shutdown()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        try:
            # the lanes may still read pinned pages or write weights: wait for them before releasing anything
            self.lanes.close(quiet=quiet)
        finally:
            unpin(self._pinned, self.device)
            self._binding.restore()
            # drop every reference to the shared blocks so their pages are unmapped now, not at garbage collection
            self.host_buffers = []
            self.unselected_shared = []
            self.accumulation = None
            self.uploads = None

    def rebuild(self, relayout: bool) -> None:
        """Release everything and start again with a fresh schedule, and (``relayout``) a layout built from the
        optimizer's param groups as they are now."""
        self._release(quiet=False)
        if relayout:
            self._build_layout()
        else:
            refresh_every = self.schedule.refresh_every
            self.schedule = Schedule.create(
                [len(g.matrices) for g in self.layout], self.config.full_warm_up_rounds, self.config.update_interval
            )
            self.schedule.refresh_every = refresh_every
        self._reset_run_state()
        self.start()

    def restart(self) -> None:
        """Drop the run (host work in flight, the open window, every moment) and start fresh from the model's weights
        as they are now: a new worker, new buffers, a new schedule. Loading a state into an engine that has stepped
        does this first."""
        self._require_started()
        self.parked = {}
        self.rebuild(relayout=self._groups_signature() != self._layout_signature)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_hparams(self) -> list[HyperParams]:
        return [HyperParams.from_group(g, self._decoupled_default) for g in self.optimizer.param_groups]

    # ---------------------------------------------------------------------------------------------- telemetry
    def _link_bytes(self) -> tuple[int, int]:
        d2h = self._refresh_bytes[0] + (self.accumulation.d2h_bytes if self.accumulation is not None else 0)
        h2d = self._refresh_bytes[1] + (self.uploads.h2d_bytes if self.uploads is not None else 0)
        return d2h, h2d

    def device_bytes(self) -> int:
        """Device bytes the engine holds: optimizer state, work buffers, the accumulators (or the host mode's ring), the
        landing's buffer, the interim moves' statistics (``engine/budget.py`` computes the same from the shapes)."""
        if not self._started or self._closed:
            return 0
        total = self.device_updater.bytes_held()
        if self.accumulation is not None:
            total += self.accumulation.bytes_held()
        if self.uploads is not None:
            total += self.uploads.bytes_held()
        if self.interim is not None:
            total += self.interim.bytes_held()
        return total

    def host_bytes(self) -> int:
        """Host bytes the engine holds in the training process: the shared rows and the pinned staging."""
        if not self._started or self._closed:
            return 0
        own = sum(h.nbytes for h in self.host_buffers)
        own += sum(t.nbytes for t in self.unselected_shared)
        if isinstance(self.accumulation, HostAccumulation):
            own += self.accumulation.host_staging_bytes()
        return own

    @property
    def update_interval(self) -> int:
        return self.schedule.interval

    @property
    def interim_scale(self) -> float:
        """The interim moves' size at the current window (``interim_step``; 0: no moves)."""
        return 0.0 if self.interim is None else self.interim.scale_at(self.update_interval)

    @property
    def t(self) -> int:
        return self.schedule.t

    @property
    def host_in_flight(self) -> bool:
        return self.schedule.pending is not None

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the ZenFlowEngine is not running; call start() first (and not after close()).")


def _unique(name: str, taken: object) -> str:
    taken = set(taken)  # type: ignore[arg-type]
    candidate, suffix = name, 1
    while candidate in taken:
        candidate, suffix = f"{name}.{suffix}", suffix + 1
    return candidate
