"""ZenFlowEngine: the update rule of DESIGN section 4, composed from layout, selection, device, host, transfer.

The caller (the Lightning precision plugin, or a plain training loop) does backward and clipping, then
calls :meth:`ZenFlowEngine.step`; before the next forward it calls :meth:`wait_for_update`. The engine
never calls ``optimizer.step()``: the torch optimizer only carries the param groups, whose hyperparameters
are read at every step (so LR schedulers work unchanged).

The exact rule is written in ``docs/update_rule.md``, the cost of each stage in ``docs/performance.md``.
The :class:`~lightning_zenflow.engine.schedule.Schedule` says what happens at each step; this class does it.
CPU and CUDA run the same code: only :class:`~lightning_zenflow.engine.lanes.Lanes` differs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine import state as engine_state
from lightning_zenflow.engine.device import DeviceUpdater, HyperParams
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.host import GroupJob, HostWorker, MatrixExtent, WorkerSpec
from lightning_zenflow.engine.interim import InterimMoves
from lightning_zenflow.engine.lanes import Lanes
from lightning_zenflow.engine.layout import (
    ROW_GRAD_ACC,
    ROW_MASTER,
    GroupHostBuffers,
    allocate_host_buffers,
    build_layout,
)
from lightning_zenflow.engine.migrate import migrate
from lightning_zenflow.engine.preflight import check_host_resources
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.engine.schedule import (
    AUTO_INITIAL_INTERVAL,
    AUTO_MARGIN,
    AUTO_MAX_INTERVAL,
    PendingUpdate,
    Schedule,
    choose_update_interval,
)
from lightning_zenflow.engine.selection import SelectionDiagnostics, column_scores, diagnose, top_columns
from lightning_zenflow.engine.transfer import (
    STAGING_SLOT_BYTES,
    DeviceAccumulation,
    Helper,
    HostAccumulation,
    Uploads,
    copy_all,
)

__all__ = [
    "AUTO_INITIAL_INTERVAL",
    "AUTO_MARGIN",
    "AUTO_MAX_INTERVAL",
    "StepStats",
    "ZenFlowEngine",
    "check_optimizer",
    "choose_update_interval",
]

AUTO_DEVICE_MARGIN = 1.25
"""``accumulate_on="auto"`` takes the device when its buffers need at most 1/1.25 of the free device memory."""


@dataclass
class StepStats:
    """Telemetry of one optimizer step, as the engine saw it. Times are seconds; None when not measured."""

    step: int
    stall_s: float
    """Time the calling thread was blocked inside the engine since the previous step (host waits, drains)."""
    device_update_s: float | None
    """Device update time (CUDA: from events of the last finished step; CPU: measured inline)."""
    host_update_s: float | None
    """Compute time of the most recent finished host update."""
    update_interval: int
    d2h_bytes: int
    h2d_bytes: int
    device_bytes: int
    host_bytes: int
    window_end: bool
    refreshed: bool
    selection_overlap: float | None = None
    selection_captured: float | None = None
    accumulate_on: str | None = None
    """The accumulation mode in use (``"device"`` or ``"host"``; decided at the first step under ``"auto"``)."""
    host_syncs: int = 0
    """Times the training thread blocked on device work since the previous step (event or lane synchronisation, a
    device-to-host read): 0 at steady-state device-mode steps; selections, checkpoints and the ``"auto"`` choices
    wait by design."""


class ZenFlowEngine:
    """The framework-free ZenFlow optimizer engine for one torch Adam/AdamW optimizer.

    Args:
        optimizer: a ``torch.optim.Adam`` or ``torch.optim.AdamW``; its param groups are read at every step.
        config: the ZenFlow knobs.
        param_names: optional ``{param: name}`` (e.g. from ``model.named_parameters()``) for checkpoints.
        steps_per_epoch: optimizer steps per epoch, needed by ``select_strategy="epoch"`` / ``"auto"``.
        host_delay_s: test hook, the host worker sleeps this long before each update.
        host_fail_at: test hook, the host worker raises at this update (1-based).
        stage_delays: test hook, ``{stage: seconds}`` delays each asynchronous stage (see ``engine/lanes.py``).
        ranks: the data-parallel ranks (``engine/ranks.py``); the host state is sharded across them by rows. The
            gradients must be the same on every rank (all-reduced) when :meth:`step` is called.
    """

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
    ) -> None:
        check_optimizer(optimizer)
        self.optimizer = optimizer
        self.config = config
        self.ranks = ranks or Ranks()
        self._decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        self._names = {id(p): n for p, n in (param_names or {}).items()}
        self._steps_per_epoch = steps_per_epoch
        self._build_layout()
        self._stage_delays = dict(stage_delays or {})
        if host_delay_s:
            self._stage_delays["worker"] = host_delay_s
        self._host_fail_at = host_fail_at
        self._worker: HostWorker | None = None
        self._started = False
        self._closed = False
        self.interim: InterimMoves | None = None
        self._parked: dict[str, dict] = {}
        """The carried state of parameters that stopped training (frozen mid-fit), kept for when they come back."""
        self._reset_run_state()

    def _build_layout(self) -> None:
        """The layout and a fresh schedule from the optimizer's param groups as they are now."""
        for group_index, group in enumerate(self.optimizer.param_groups):
            for position, param in enumerate(group["params"]):
                if isinstance(param, torch.Tensor) and id(param) not in self._names:
                    self._names[id(param)] = _unique(f"group{group_index}.param{position}", self._names.values())
        self.layout = build_layout(self.optimizer.param_groups, self._names, self.ranks)
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
        self.schedule.refresh_every = self._refresh_period(self._steps_per_epoch)
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
        self._launch_future: concurrent.futures.Future | None = None
        # telemetry
        self._stall_s = 0.0
        self._step_intervals: list[float] = []
        self._last_step_end: float | None = None
        self._stall_at_last_end = 0.0
        self._stall_at_last_stats = 0.0
        self._syncs_at_last_stats = 0
        self._last_host_s: float | None = None
        self._diagnostics: SelectionDiagnostics | None = None
        self._refresh_bytes = [0, 0]
        self.last_stats: StepStats | None = None
        self._saved_affinity: set[int] | None = None
        self._saved_threads: int | None = None
        self._landings = 0
        self.merge_cache: tuple | None = None
        """``engine/state.py``'s merge of the state at one point of the run (a checkpoint takes two views of it)."""

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> ZenFlowEngine:
        """Allocate the host buffers, pin them (CUDA), and spawn the host worker. Idempotent."""
        if self._closed:
            raise RuntimeError("this ZenFlowEngine was closed; build a new one.")
        if self._started:
            return self
        self.interim_scale = self._resolve_interim()
        self.lanes = Lanes(self.device, self._stage_delays)
        # shared memory and RAM first: one clear error if short (for every rank on this machine)
        check_host_resources(self.layout, self.device, ranks_per_host=self.ranks.local_world)
        self.host_buffers: list[GroupHostBuffers] = allocate_host_buffers(self.layout)
        # per group: each matrix's host-bound column indices, for the worker to unpack host-mode accumulators
        self.unselected_shared = [
            torch.zeros(sum(s.cols for s in g.matrices), dtype=torch.long).share_memory_() for g in self.layout
        ]
        self._pinned: list[tuple[torch.Tensor, int]] = []
        """(block, address) of every registered span: the block keeps its pages mapped until unregistered."""
        self.device_updater = DeviceUpdater(self.layout, self.lanes)
        self.interim = InterimMoves(self.lanes, self.interim_scale) if self.interim_scale > 0 else None
        self.helper = Helper(self.lanes)
        # per matrix (layout order): gradients the open window kept (16-mixed skips an overflowed one on the
        # device, unknown to the host); copied down with the window, they are the worker's mean divisors
        n_matrices = sum(len(g.matrices) for g in self.layout)
        self._kept_device = torch.zeros(n_matrices, dtype=torch.float32, device=self.device)
        # per accumulator slot: the counts of the window that closed in it, and the event recorded on the d2h lane
        # after that window's copies down (its accumulators in device mode, and its counts)
        self._kept_host = [self.lanes.empty_host(n_matrices, torch.float32) for _ in range(2)]
        self._window_copied = [self.lanes.event() for _ in range(2)]
        self._present_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._worker: HostWorker | None = None
        self._started = True
        self._guard_zero_grad()
        try:
            if self.device.type == "cuda":
                self._pin_host_buffers()
            if self.needs_host():
                self._start_worker()
        except BaseException:
            self.close(quiet=True)
            raise
        return self

    def _guard_zero_grad(self) -> None:
        """While the engine runs, the optimizer's ``zero_grad`` first waits (GPU-side) until the engine's device work
        has read the gradients: ``zero_grad(set_to_none=False)`` zeroes them in place. Undone at close."""
        optimizer = self.optimizer
        self._own_zero_grad = "zero_grad" in vars(optimizer)
        self._saved_zero_grad = optimizer.zero_grad

        def zero_grad(*args: object, **kwargs: object) -> None:
            self.wait_for_gradients()
            return self._saved_zero_grad(*args, **kwargs)

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def _unguard_zero_grad(self) -> None:
        saved = getattr(self, "_saved_zero_grad", None)
        if saved is None:
            return
        if self._own_zero_grad:
            self.optimizer.zero_grad = saved  # type: ignore[method-assign]
        else:
            vars(self.optimizer).pop("zero_grad", None)
        self._saved_zero_grad = None

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

    def _pin_host_buffers(self) -> None:
        """Register in place (cudaHostRegister) the rows of the shared blocks that asynchronous copies touch: the
        two accumulator rows (copies down, staged uploads, a selection's staging), and the master row of a group
        with an fp32 matrix (its weights go up from the master). ``pin_memory()`` would copy them out of shared
        memory; the moments are never copied asynchronously, so 8 B of the 20 B per element are pinned (12 with
        fp32 weights), which also shortens the registration at start-up."""
        cudart = torch.cuda.cudart()
        for group, host in zip(self.layout, self.host_buffers):
            tensor = host.block_shared
            if tensor.numel() == 0:
                continue
            row_bytes = tensor.shape[1] * tensor.element_size()
            spans = [(ROW_GRAD_ACC * row_bytes, 2 * row_bytes)]
            if any(slot.param.dtype == torch.float32 for slot in group.matrices):
                spans.append((ROW_MASTER * row_bytes, row_bytes))
            for start, nbytes in spans:
                pointer = tensor.data_ptr() + start
                code = cudart.cudaHostRegister(pointer, nbytes, 1)  # 1: cudaHostRegisterPortable
                if int(code) != 0:
                    raise RuntimeError(
                        f"cudaHostRegister failed with code {int(code)} for {nbytes} bytes of host state. Pinning "
                        "is limited by the locked-memory limit: raise it (`ulimit -l unlimited`, or the container's "
                        "--ulimit memlock=-1), or use fewer host bytes (a smaller model share per process)."
                    )
                self._pinned.append((tensor, pointer))

    def _start_worker(self) -> None:
        train_cores, host_cores = self.config.core_split(self._own_cores())
        if self.config.bind_cores and hasattr(os, "sched_setaffinity") and train_cores != host_cores:
            self._saved_affinity = os.sched_getaffinity(0)
            self._saved_threads = torch.get_num_threads()
            os.sched_setaffinity(0, train_cores)
            torch.set_num_threads(len(train_cores))
            worker_cores: tuple[int, ...] | None = tuple(host_cores)
        else:
            worker_cores = None
        threads = self.config.host_threads or max(1, len(host_cores))
        spec = WorkerSpec(
            blocks=tuple(h.block_shared for h in self.host_buffers),
            steps=tuple(h.step_shared for h in self.host_buffers),
            extents=tuple(tuple(self._extents(g)) for g in self.layout),
            heartbeat=torch.zeros(1, dtype=torch.float64).share_memory_(),
            threads=threads,
            cores=worker_cores,
            unselected=tuple(self.unselected_shared),
            delay_s=self._stage_delays.get("worker", 0.0),
            fail_at_update=self._host_fail_at,
        )
        self._worker = HostWorker(spec, timeout_s=self.config.worker_timeout_s)

    def _own_cores(self) -> list[int] | None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        return self.ranks.own_cores(sorted(os.sched_getaffinity(0)), os.cpu_count() or 1)

    @staticmethod
    def _extents(group) -> list[MatrixExtent]:
        extents, col_offset = [], 0
        for slot in group.matrices:
            extents.append(MatrixExtent(slot.offset, slot.host_numel, slot.param.dtype, slot.cols, col_offset))
            col_offset += slot.cols
        return extents

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
        """Everything :meth:`start` made, released; the engine can be started again (:meth:`_rebuild`)."""
        if not self._started:
            return
        self._started = False
        self._unguard_zero_grad()
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
            if self._pinned:
                cudart = torch.cuda.cudart()
                for _, pointer in self._pinned:
                    cudart.cudaHostUnregister(pointer)
                self._pinned = []
            if self._saved_affinity is not None:
                os.sched_setaffinity(0, self._saved_affinity)
                self._saved_affinity = None
            if self._saved_threads is not None:
                torch.set_num_threads(self._saved_threads)
                self._saved_threads = None
            # drop every reference to the shared blocks so their pages are unmapped now, not at garbage collection
            self.host_buffers = []
            self.unselected_shared = []
            self.accumulation = None
            self.uploads = None

    def _rebuild(self, relayout: bool) -> None:
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
        self._parked = {}
        self._rebuild(relayout=self._groups_signature() != self._layout_signature)

    def _follow_param_groups(self) -> None:
        """The optimizer's param groups or the set of trainable parameters changed (``add_param_group``, a
        ``requires_grad_`` flip): a sync boundary. The host work in flight and the open window are applied
        (:meth:`flush`), every parameter's exact state (fp32 master, moments, per-side counts, selection) is
        carried into a layout built from the groups as they are now, and the parameters that stopped training keep
        theirs for when they train again. New parameters start as AdamW starts them; after warm-up, this step
        chooses every matrix's columns again (a refresh)."""
        check_optimizer(self.optimizer)
        self.flush()
        current = engine_state.carried_entries(self)
        returning = set(self._parked)
        carried = {**self._parked, **current}
        old = self.schedule
        self._rebuild(relayout=True)
        names = {slot.name for group in self.layout for slot in group.matrices}
        names |= {entry.name for group in self.layout for entry in group.device_only}
        self._parked = {name: entry for name, entry in carried.items() if name not in names}
        # a matrix new to the engine, or carried with a selection of another size (taken before the first selection,
        # parked while frozen), is chosen again: at this step, for every matrix (after warm-up)
        new_matrices = any(
            slot.name not in carried
            or carried[slot.name]["selected"].numel() != num_selected_columns(slot.cols, self.config.topk_ratio)
            for group in self.layout
            for slot in group.matrices
        )
        schedule = self.schedule
        schedule.t, schedule.selections = old.t, old.selections
        schedule.interval, schedule.interval_decided = old.interval, old.interval_decided
        schedule.last_select_t = None if new_matrices else old.last_select_t
        # a parameter that trains again starts from its weights as they are (frozen, nothing moved them but the user)
        engine_state.carry_into(self, carried, from_weights=returning)

    def __enter__(self) -> ZenFlowEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ the step
    def step(self, found_inf: torch.Tensor | None = None) -> StepStats:
        """One optimizer step with the current ``.grad`` of every parameter (already unscaled and clipped).

        ``found_inf`` (16-mixed): the loss scaler's overflow flag, a device scalar. When it is 1 the step is skipped
        on the device without a host read: no device update, no count, and the gradient adds nothing to the
        window and is not counted in its mean (the step still advances the schedule; see docs/update_rule.md).
        """
        self._require_started()
        self.merge_cache = None  # the state moves on
        self.helper.raise_failures()
        self.lanes.raise_failures()
        if self._groups_signature() != self._layout_signature:
            self._follow_param_groups()
        if self.accumulation is None:
            self._check_dense_gradients()
            self._choose_accumulation()
        d2h_before, h2d_before = self._link_bytes()
        self._diagnostics = None
        hparams = self.read_hparams()
        if self.interim is not None:
            _check_interim_decay(hparams)
        self.schedule.last_hparams = [asdict(h) for h in hparams]
        # torch's LR schedulers warn unless optimizer.step() ran first; this call is that step
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        plan = self.schedule.begin_step()
        refreshed = False
        if plan.select_first:
            self._select_and_migrate()
            refreshed = True
        updater = self.device_updater
        states = updater.matrix_states()
        if found_inf is not None:
            # on the compute lane, before the side lane's wait below orders it after everything issued there
            found_inf = found_inf.reshape(()).to(device=self.device, dtype=torch.float32)
        updater.begin_step()
        with torch.profiler.record_function("zenflow.device_update"):
            updater.update(hparams, found_inf)
            if plan.warm_up:
                # a warm-up step updates every column: it counts as an update on both sides
                counts = [state.step_count for state in states if state.slot.param.grad is not None]
                self.lanes.side.run(_count_updates, counts, found_inf)
            self._count_kept(states, plan.first_in_window, found_inf)
        if self.interim is not None and not plan.warm_up:
            # before the accumulation: the next forward waits for these weights, not for the accumulation's reads
            with torch.profiler.record_function("zenflow.interim"):
                self.interim.step(updater.selected, hparams, self.schedule.interval, found_inf)
                updater.weights_written()
        with torch.profiler.record_function("zenflow.accumulate"):
            stalled_before = self._accumulation_stall()
            self.accumulation.add(
                states, self.schedule.slot, plan.first_in_window, self.helper, self.uploads.source_read
            )
            self._stall_s += self._accumulation_stall() - stalled_before
        updater.end_step()
        self.schedule.add_gradients([[slot.param.grad is not None for slot in group.matrices] for group in self.layout])
        self._poll_pending()
        pending = self.schedule.pending
        if pending is not None and pending.land_at == plan.t:
            self._timed_wait(self._land_pending)  # land_after: L steps after its window closed
        window_end = self.schedule.window_ends(plan)
        if window_end:
            overlap = self.config.overlap_step and not plan.warm_up and plan.t > self.config.overlap_after
            self._close_window(hparams, overlap=overlap)
            if not plan.warm_up and self.schedule.refresh_due():
                self._refresh()
                refreshed = True
        # control goes back to the caller next, whose work runs on the compute lane after everything it waits for
        self.lanes.settle()
        device_s = updater.finished_update_seconds()
        self._record_step_interval()
        d2h_after, h2d_after = self._link_bytes()
        stall_at_stats = self._stall_s
        syncs_at_stats = self.lanes.host_syncs
        self.last_stats = StepStats(
            step=plan.t,
            stall_s=self._stall_s - self._stall_at_last_stats,
            device_update_s=device_s,
            host_update_s=self._last_host_s,
            update_interval=self.schedule.interval,
            d2h_bytes=d2h_after - d2h_before,
            h2d_bytes=h2d_after - h2d_before,
            device_bytes=self.device_bytes(),
            host_bytes=self.host_bytes(),
            window_end=window_end,
            refreshed=refreshed,
            selection_overlap=self._diagnostics.overlap if self._diagnostics else None,
            selection_captured=self._diagnostics.captured_share if self._diagnostics else None,
            accumulate_on=self.accumulation.mode,
            host_syncs=syncs_at_stats - self._syncs_at_last_stats,
        )
        self._stall_at_last_stats = stall_at_stats
        self._syncs_at_last_stats = syncs_at_stats
        return self.last_stats

    def read_hparams(self) -> list[HyperParams]:
        return [HyperParams.from_group(g, self._decoupled_default) for g in self.optimizer.param_groups]

    def wait_for_update(self) -> None:
        """Before the next forward: the compute lane waits (GPU-side, no host sync) for the weights the engine
        wrote (the device update, a landing)."""
        if self._started and not self._closed:
            self.lanes.compute.wait(self.device_updater.weights_done, "compute after update")
            self.lanes.settle()

    def wait_for_gradients(self) -> None:
        """Before the gradients are written again (``zero_grad``, the next backward): the compute lane waits
        (GPU-side, no host sync) until the engine's device work has read them. The optimizer's ``zero_grad`` does
        this by itself while the engine runs; a loop that keeps gradients between steps (accumulating into them, or
        DDP's bucket views) calls it before backward, as the precision plugin does."""
        if self._started and not self._closed:
            self.lanes.compute.wait(self.device_updater.update_done, "compute after gradients read")
            self.lanes.settle()

    def sync(self) -> None:
        """Apply the host update in flight, if any, so the model holds every finished update. Leaves the open
        window's accumulated gradients pending (they belong to the next window end)."""
        self._require_started()
        if self.schedule.pending is not None:
            self._timed_wait(self._land_pending)
        self.lanes.settle()

    def adopt_weights(self) -> None:
        """Make the model's weights as they are now the engine's fp32 masters, on both sides: call it after editing
        parameters in place (a WGAN's weight clamp, a projection, a manual re-initialisation), which the engine's
        masters would otherwise overwrite at the next update of each column.

        A sync boundary: the host update in flight is applied first (its result is then edited too). The open
        window's gradients stay. A model that is not fp32 gives masters rounded to its dtype. Data parallel: every
        rank calls it, after the same edit."""
        self._require_started()
        self.sync()
        self.wait_idle()
        self.host_masters_from_weights(device_too=True)
        with torch.no_grad():
            for group_index in range(len(self.layout)):
                for state in self.device_updater.device_only[group_index]:
                    if state.separate_master:
                        state.master.copy_(state.param.detach())
        self.merge_cache = None
        self.lanes.synchronize()

    def host_masters_from_weights(self, device_too: bool = False) -> None:
        """Set every matrix's host master (this rank's rows) from the model's weights, and (``device_too``) the
        selected columns' device masters. Blocking device -> host copies, with nothing in flight: at a selection
        (``interim_step``) or an explicit boundary only."""
        self.lanes.synchronize()
        with torch.no_grad():
            for group_index, host in enumerate(self.host_buffers):
                for state in self.device_updater.selected[group_index]:
                    slot = state.slot
                    weights2d = slot.param.detach().view(slot.rows, slot.cols)
                    slot.view2d(host.master).copy_(weights2d[slot.row_start : slot.row_stop])
                    if device_too and state.k:
                        state.master.copy_(weights2d.index_select(1, state.selected))
        self.merge_cache = None

    def _resolve_interim(self) -> float:
        """``interim_step`` as a number: an explicit one is checked against the model (fp32 weights, AdamW-style
        decay); ``"auto"`` is 1 where those hold and windows are longer than one step, else 0 (the paper's rule)."""
        value = self.config.interim_step
        odd = sorted({str(s.param.dtype) for g in self.layout for s in g.matrices if s.param.dtype != torch.float32})
        hparams = self.read_hparams()
        if value == "auto":
            applies = (
                self.config.update_interval != 1
                and self.config.topk_ratio < 1
                and not odd
                and all(hp.decoupled or not hp.weight_decay for hp in hparams)
            )
            return 1.0 if applies else 0.0
        value = float(value)
        if value <= 0:
            return 0.0
        _check_interim_decay(hparams)
        if odd and self.config.topk_ratio < 1:
            raise UnsupportedSetupError(
                f"interim_step={self.config.interim_step} moves the weights of host columns in place, which needs "
                f"fp32 weights; this model has matrices in {', '.join(odd)}. Train with fp32 weights (precision "
                "'32-true' or '16-mixed'/'bf16-mixed', which keep them), or set interim_step=0."
            )
        return value

    def flush(self) -> None:
        """End of training: apply what is in flight, then close the open window early (mean over the steps it
        holds) and apply it, so the weights contain every gradient. The next step starts a new window."""
        self._require_started()
        self.sync()
        if self.schedule.steps_in_window > 0 and self.schedule.last_hparams is not None:
            self._close_window([HyperParams(**h) for h in self.schedule.last_hparams], overlap=False)
        self.lanes.settle()

    # ------------------------------------------------------------------------------------ accumulation mode
    def _choose_accumulation(self) -> None:
        """Build the accumulation mode (``"auto"``: device when its buffers fit, measured now, after the first
        backward has allocated the gradients)."""
        slots = [s for g in self.layout for s in g.matrices if self._may_go_to_host(s)]
        need = sum(s.host_numel * (4 + s.param.element_size()) for s in slots)  # fp32 accumulator + upload buffer
        need += self._selection_device_bytes()
        mode = self.config.accumulate_on
        if mode == "auto":
            free = self.lanes.free_bytes()
            fits = need * AUTO_DEVICE_MARGIN <= free
            # every rank takes the same mode (the results are equal either way; the telemetry is easier to read)
            mode = "device" if self.ranks.agree(float(fits), self.device, op="min") else "host"
            self.accumulate_on_reason = (
                f"accumulate_on='auto' chose {mode!r}: the device buffers need {need / 2**20:.1f} MiB, "
                f"{free / 2**20:.1f} MiB free"
            )
        else:
            self.accumulate_on_reason = f"accumulate_on={mode!r} (configured)"
        if mode == "device":
            self.accumulation = DeviceAccumulation(self.lanes, slots, self.host_buffers)
            self.uploads = Uploads(self.lanes, self.device_updater, self.host_buffers, slots, self.ranks)
        else:
            # a slot never larger than the largest gradient it would carry (a small model needs no 64 MiB ring)
            largest = max((s.host_numel * s.param.element_size() for s in slots), default=1)
            self.accumulation = HostAccumulation(
                self.lanes, self.host_buffers, max(1, min(STAGING_SLOT_BYTES, largest))
            )
            self.uploads = Uploads(self.lanes, self.device_updater, self.host_buffers, None, self.ranks)
        if self._restored_window_sums is not None:
            self._restore_window_sums(self._restored_window_sums)
            self._restored_window_sums = None

    def _check_dense_gradients(self) -> None:
        """At the first step (and after a new layout): a sparse gradient cannot be split by columns."""
        for group in self.layout:
            for entry in (*group.matrices, *group.device_only):
                grad = entry.param.grad
                if grad is not None and grad.is_sparse:
                    raise UnsupportedSetupError(
                        f"parameter {entry.name} has a sparse gradient (an nn.Embedding(sparse=True)?), which "
                        "ZenFlow's column split cannot take; build the module with sparse=False, or freeze it."
                    )

    def _selection_device_bytes(self) -> int:
        """Device bytes the selected columns still need beyond what is held now: their fp32 master, two moments and
        gather buffer (16 B per selected element) and indices (8 B per column), plus the peak of a migration (the
        arriving columns and the old state beside the new one: 24 B per selected element; 12 more under data
        parallel, where the entering columns' rows from every rank meet in one buffer)."""
        transient = 36 if self.ranks.sharded else 24
        total = 0
        for group in self.layout:
            for slot in group.matrices:
                k = num_selected_columns(slot.cols, self.config.topk_ratio)
                total += (16 + transient) * slot.rows * k + 8 * slot.cols
        held = sum(
            4 * state.master.nbytes + state.selected.nbytes + state.unselected.nbytes
            for state in self.device_updater.matrix_states()
        )
        return max(0, total - held)

    def _may_go_to_host(self, slot) -> bool:
        return (
            self.config.full_warm_up_rounds > 0 or num_selected_columns(slot.cols, self.config.topk_ratio) < slot.cols
        )

    @property
    def accumulate_on(self) -> str | None:
        """``"device"`` or ``"host"`` once decided (at the first step), else None."""
        return self.accumulation.mode if self.accumulation is not None else None

    def _accumulation_stall(self) -> float:
        return getattr(self.accumulation, "stall_s", 0.0)

    # ------------------------------------------------------------------------------------------------ windows
    def _count_kept(self, states, first_in_window: bool, found_inf: torch.Tensor | None) -> None:
        """Side lane: count this step's gradients into the window's kept counts (an overflowed 16-mixed step
        counts nothing) and, under 16-mixed, zero the host-bound gradients of an overflowed step in place."""
        lanes = self.lanes
        if first_in_window:
            # side waits (GPU-side) for the copies down of the window that just closed before it zeroes the counts
            # and overwrites the accumulators: the event of that window, not of the one before it
            lanes.side.wait(self._closed_window_copied(), "window copied")
        present = tuple(i for i, state in enumerate(states) if state.slot.param.grad is not None)
        index = None
        if present and len(present) < len(states):
            index = self._present_index.get(present)
            if index is None:
                # once per pattern of missing gradients (a small upload, a sync on CUDA), then reused every step
                index = torch.tensor(present, dtype=torch.long, device=self.device)
                if len(self._present_index) < 64:
                    self._present_index[present] = index
        overflow_masked = []
        if found_inf is not None:
            for state in states:
                grad = state.slot.param.grad
                if grad is not None and state.k < state.slot.cols:
                    overflow_masked.append(grad)
        lanes.side.run(
            _count_kept, self._kept_device, first_in_window, bool(present), index, found_inf, overflow_masked
        )

    def _closed_window_copied(self):
        """The event of the last closed window's copies down (its slot is the other one: the open window's slot
        flipped when it closed)."""
        return self._window_copied[self.schedule.slot ^ 1]

    def _close_window(self, hparams: list[HyperParams], overlap: bool) -> None:
        slot = self.schedule.slot
        counts = self.schedule.close_window()
        jobs = self._host_jobs(hparams, counts)
        if overlap and self.schedule.pending is not None:
            self._timed_wait(self._land_pending)
        active = [list(job.active) for job in jobs]
        if any(active):
            lanes = self.lanes
            # d2h waits (GPU-side) for the side lane's last add and count of this window before they go down
            lanes.d2h.wait_lane(lanes.side, "window added")
            self.accumulation.finish_window(slot, active)
            lanes.d2h.run(copy_all, [(self._kept_host[slot], self._kept_device)], lanes.is_cuda)
            lanes.d2h.record(self._window_copied[slot])
            land_after = self.config.land_after
            land_at = None
            if overlap and land_after is not None and land_after < self.schedule.interval:
                land_at = self.schedule.t + land_after
            scales = None
            if self.interim is not None:
                # the weights are the host columns' masters: the window end's weight decay lands with the step
                # (per active matrix; the launch sets 1 where every gradient of the window was skipped)
                scales = [[1.0 - job.hparams.lr * job.hparams.weight_decay] * len(job.active) for job in jobs]
            pending = PendingUpdate(slot=slot, active=active, land_at=land_at, scales=scales)
            self.schedule.pending = pending
            # queued after this window's adds on the helper thread (host mode); it waits for the copy down
            self._launch_future = self.helper.submit(self._launch, slot, jobs, pending)
            if not overlap:
                self._timed_wait(self._land_pending)
        self._maybe_decide_interval()

    def _launch(self, slot: int, jobs: list[GroupJob], pending: PendingUpdate) -> None:
        if self._worker is None:
            raise RuntimeError("internal error: host work was scheduled but no host worker is running.")
        # helper-thread wait: the window's accumulators and kept counts have landed on the host. That copy down
        # waited for the side lane's work up to this window's end, which includes the landing of the last upload
        # (issued before it, after that upload's copy up): so the last upload has read its host source too, and
        # the worker may rewrite the master (and, for a model that is not fp32, stage its weights in the slot)
        self._window_copied[slot].wait_here("launch: window copied")
        kept = self._kept_host[slot].tolist()
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
        self._worker.submit(slot, with_divisors)

    def _host_jobs(self, hparams: list[HyperParams], counts: list[list[int]]) -> list[GroupJob]:
        """Per group: the matrices with columns on the host that got gradients in the window, and how many."""
        host_mode = isinstance(self.accumulation, HostAccumulation)
        jobs = []
        for group_index, group_states in enumerate(self.device_updater.selected):
            window_counts = counts[group_index]
            active = tuple(
                i for i, state in enumerate(group_states) if state.k < state.slot.cols and window_counts[i] > 0
            )
            jobs.append(
                GroupJob(
                    hparams=hparams[group_index],
                    active=active,
                    mean_divisors=tuple(float(window_counts[i]) for i in active),
                    packed_columns=(
                        tuple(group_states[i].slot.cols - group_states[i].k for i in active) if host_mode else None
                    ),
                    step_only=self.interim is not None,
                )
            )
        return jobs

    def _poll_pending(self) -> None:
        """Without blocking: if the host update in flight has finished, start its copy up (device mode)."""
        pending = self.schedule.pending
        if pending is None or pending.computed or self._worker is None:
            return
        if self._launch_future is not None and not self._launch_future.done():
            return
        self.helper.raise_failures()
        self._launch_future = None
        host_s = self._worker.poll()
        if host_s is None:
            return
        self._last_host_s = host_s
        pending.computed = True
        self.uploads.prefetch(pending.slot, pending.active)

    def _await_pending(self) -> None:
        """Wait (without applying) until the host update in flight has finished computing."""
        pending = self.schedule.pending
        if pending is None or pending.computed:
            return
        # the launch may still sit on the helper thread, behind this window's host adds: wait for it, not for
        # work queued after it (the next window's adds)
        if self._launch_future is not None:
            self.helper.wait(self._launch_future)
            self._launch_future = None
        self._last_host_s = self._worker.wait()
        pending.computed = True

    def _land_pending(self) -> None:
        self._await_pending()
        pending = self.schedule.pending
        if self.uploads is None:
            # a restored update applied before the first step (a sync right after a load): no upload buffers yet,
            # so it goes up from the host as in host mode
            self.uploads = Uploads(self.lanes, self.device_updater, self.host_buffers, None, self.ranks)
        self.uploads.land(pending.slot, pending.active, pending.scales)
        self.device_updater.weights_written()
        self.device_updater.end_step()
        self.schedule.pending = None
        self._landings += 1

    def _drain_helper(self) -> None:
        # helper-thread queue wait: every host add and launch issued so far has finished (or raised)
        self.helper.wait()
        self._launch_future = None

    def _timed_wait(self, wait: Callable[[], None]) -> None:
        """Run a blocking wait, counting its time as stall; it shows in the profiler as ``zenflow.wait:<name>``."""
        started = time.perf_counter()
        try:
            with torch.profiler.record_function(f"zenflow.wait:{wait.__name__.lstrip('_')}"):
                wait()
        finally:
            self._stall_s += time.perf_counter() - started

    def wait_idle(self) -> None:
        """Block until no engine work is running: the host update in flight has finished computing (it is not
        applied) and the helper thread is idle. Counted as stall. Checkpoints call this."""
        self._require_started()
        self._timed_wait(self._await_pending)
        self._timed_wait(self._drain_helper)
        self.lanes.synchronize()
        kept, first = self._kept_device.tolist(), 0
        self.schedule.window_kept = []
        for group in self.layout:
            self.schedule.window_kept.append([int(k) for k in kept[first : first + len(group.matrices)]])
            first += len(group.matrices)

    # ---------------------------------------------------------------------------------------------- selection
    def _refresh_period(self, steps_per_epoch: int | None) -> int | None:
        strategy = self.config.select_strategy
        if strategy == "step":
            return int(self.config.select_interval)
        epochs = 1 if strategy == "auto" else int(self.config.select_interval)
        if steps_per_epoch is None:
            return None
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1.")
        return epochs * steps_per_epoch

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Tell an epoch-based selection how long an epoch is (optimizer steps); the strategy does this at fit."""
        self._steps_per_epoch = steps_per_epoch
        self.schedule.refresh_every = self._refresh_period(steps_per_epoch)

    @property
    def refresh_every(self) -> int | None:
        return self.schedule.refresh_every

    def _refresh(self) -> None:
        self._timed_wait(self._land_pending_and_drain)
        self._select_and_migrate()

    def _land_pending_and_drain(self) -> None:
        if self.schedule.pending is not None:
            self._land_pending()
        self._drain_helper()

    def _select_and_migrate(self) -> None:
        """Choose each matrix's columns from the current gradient and move only the columns that change side.

        Runs only with no host work in flight. Two host reads of small tensors (the new indices and the score
        sums, one transfer each) and one synchronisation after the batched copies: a full sync point on CUDA.
        """
        started = time.perf_counter()
        with torch.profiler.record_function("zenflow.select"):
            states = self.device_updater.matrix_states()
            previous = [state.selected_host for state in states] if self.schedule.last_select_t is not None else None
            lanes = self.lanes
            work = []
            for state in states:
                grad = state.slot.param.grad
                grad2d = None if grad is None else grad.view(state.slot.rows, state.slot.cols)
                work.append((grad2d, state.slot.cols, num_selected_columns(state.slot.cols, self.config.topk_ratio)))
            k_sizes = [k for _, _, k in work]
            col_sizes = [cols for _, cols, _ in work]
            box: dict[str, torch.Tensor] = {}
            # side waits (GPU-side) for the compute lane's gradients
            lanes.side.wait_lane(lanes.compute, "side after compute")
            lanes.side.run(_score_and_choose, box, work, self.config.importance, self.device)
            # data parallel: rank 0's choice everywhere (equal gradients, but ties must not split the ranks)
            lanes.collective(lanes.side, lambda: self.ranks.broadcast_(box["indices"]))
            # one host read each for all matrices: a device sync, at a selection only
            flat_indices = lanes.read(lanes.side, lambda: box["indices"])
            flat_scores = lanes.read(lanes.side, lambda: box["scores"])
            new_selected = list(torch.split(flat_indices, k_sizes))
            scores_host = list(torch.split(flat_scores, col_sizes))
            if self.interim is not None:
                self.host_masters_from_weights()  # the weights are the host columns' masters
            moved = migrate(self.lanes, self.device_updater, self.host_buffers, new_selected, self.ranks)
            self._refresh_bytes[0] += moved.d2h_bytes
            self._refresh_bytes[1] += moved.h2d_bytes
            self._write_unselected()
            self._diagnostics = diagnose(previous, new_selected, scores_host)
            self.schedule.selected()
        self._stall_s += time.perf_counter() - started

    def _write_unselected(self) -> None:
        """Publish each matrix's host-bound columns to the worker (it unpacks host-mode accumulators with them)."""
        for group_index, group_states in enumerate(self.device_updater.selected):
            col_offset = 0
            for state in group_states:
                keep = torch.ones(state.slot.cols, dtype=torch.bool)
                keep[state.selected_host] = False
                host_columns = keep.nonzero().flatten()
                self.unselected_shared[group_index][col_offset : col_offset + host_columns.numel()] = host_columns
                col_offset += state.slot.cols

    def synchronize_device(self) -> None:
        """Wait for all device work of the engine (CUDA); used only at selections and state transfers."""
        self.lanes.synchronize()

    # ------------------------------------------------------------------------------------------ auto interval
    def _record_step_interval(self) -> None:
        now = time.perf_counter()
        if self._last_step_end is not None:
            # device step time: the caller's forward + backward + this step, minus the time it was stalled here
            stalled = self._stall_s - self._stall_at_last_end
            self._step_intervals.append(max(0.0, now - self._last_step_end - stalled))
            del self._step_intervals[:-64]
        self._last_step_end = now
        self._stall_at_last_end = self._stall_s

    def _maybe_decide_interval(self) -> None:
        # decided after the first landing: a point of the rule every rank reaches at the same step (the first
        # host time is known by then everywhere), so the ranks can agree on the largest choice
        if (
            self.schedule.interval_decided
            or self._landings == 0
            or self._last_host_s is None
            or not self._step_intervals
        ):
            return
        choice = self.schedule.propose_interval(self._last_host_s, statistics.median(self._step_intervals))
        self.schedule.fix_interval(int(self.ranks.agree(choice, self.device)))  # the largest rank's choice

    # ---------------------------------------------------------------------------------------------- telemetry
    def _link_bytes(self) -> tuple[int, int]:
        d2h = self._refresh_bytes[0] + (self.accumulation.d2h_bytes if self.accumulation is not None else 0)
        h2d = self._refresh_bytes[1] + (self.uploads.h2d_bytes if self.uploads is not None else 0)
        return d2h, h2d

    def device_bytes(self) -> int:
        """Device bytes the engine holds: optimizer state, work buffers, accumulators, upload buffers, ring."""
        if not self._started or self._closed:
            return 0
        total = self.device_updater.bytes_held()
        if self.accumulation is not None:
            total += self.accumulation.bytes_held() + self.uploads.bytes_held()
        return total

    def host_bytes(self) -> int:
        """Host bytes the engine holds in the training process: the shared blocks and the pinned staging."""
        if not self._started or self._closed:
            return 0
        own = sum(h.block_shared.nbytes + h.step_shared.nbytes for h in self.host_buffers)
        own += sum(t.nbytes for t in self.unselected_shared)
        if isinstance(self.accumulation, HostAccumulation):
            own += self.accumulation.host_staging_bytes()
        return own

    @property
    def update_interval(self) -> int:
        return self.schedule.interval

    @property
    def t(self) -> int:
        return self.schedule.t

    @property
    def host_in_flight(self) -> bool:
        return self.schedule.pending is not None

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the ZenFlowEngine is not running; call start() first (and not after close()).")

    # ------------------------------------------------------------------------------------------------- state
    def window_sums(self, row_blocks: bool = False) -> dict[str, torch.Tensor]:
        """The open window's accumulated gradient sums, ``{name: fp32 tensor shaped like the parameter}``, on
        the CPU (empty when no window is open). Call after :meth:`wait_idle`; data parallel: on rank 0 (the rows
        are gathered; every rank must call it), empty on the others. ``row_blocks``: this rank's rows of each sum
        (``[host_rows, cols]``), no collective."""
        if self.schedule.steps_in_window == 0 or self.accumulation is None:
            return {}
        sums = {}
        for state in self.device_updater.matrix_states():
            slot = state.slot
            if not self._may_go_to_host(slot):
                continue
            unselected = _complement(state.selected_host, slot.cols)
            own = self.accumulation.window_sum(slot, self.schedule.slot, unselected)
            if row_blocks:
                sums[slot.name] = own
                continue
            total = self.ranks.gather_rows(own, slot.rows, self.device)
            if total is not None:
                sums[slot.name] = total.reshape(slot.param.shape)
        return sums

    def restore_window_sums(self, sums: Mapping[str, torch.Tensor], row_blocks: bool = False) -> None:
        """Put saved window sums back (before the first step: kept until the accumulation mode is chosen), and the
        window's kept counts from the restored schedule. ``row_blocks``: the sums are this rank's rows only."""
        if self.schedule.window_kept is not None:
            flat = [float(k) for group in self.schedule.window_kept for k in group]
            self._kept_device.copy_(torch.tensor(flat, dtype=torch.float32))
        by_rows = {}
        for state in self.device_updater.matrix_states():
            slot = state.slot
            if slot.name in sums:
                # on the CPU until the accumulation mode is chosen (a sharded checkpoint's blocks may arrive on the
                # device; host accumulation indexes them with CPU indices)
                value = sums[slot.name].detach().float().cpu()
                by_rows[slot.name] = value.reshape(slot.host_rows, slot.cols) if row_blocks else slot.own(value)
        if self.accumulation is None:
            self._restored_window_sums = by_rows
        else:
            self._restore_window_sums(by_rows)

    def _restore_window_sums(self, sums: Mapping[str, torch.Tensor]) -> None:
        """``sums``: this rank's rows of each matrix's window sum."""
        for state in self.device_updater.matrix_states():
            slot = state.slot
            if slot.name in sums and self._may_go_to_host(slot):
                unselected = _complement(state.selected_host, slot.cols)
                own = sums[slot.name]
                self.accumulation.restore_window_sum(slot, self.schedule.slot, unselected, own)

    def state_dict(self, include_moments: bool = True) -> dict:
        """Everything needed to continue exactly, keyed by parameter name (see ``engine/state.py``).

        Waits for a host update in flight to finish computing, but never applies it early. Data parallel: every
        rank must call it (the host rows are gathered); the parameters' entries are on rank 0 only.
        """
        return engine_state.engine_state_dict(self, include_moments)

    def row_block_state_dict(self) -> dict:
        """:meth:`state_dict` with each matrix as this rank's row block, without a collective (sharded checkpoints,
        ``engine/state.py``); :meth:`load_state_dict` takes it back into an engine whose rank owns the same rows."""
        return engine_state.engine_row_blocks(self)

    def load_state_dict(self, state_dict: Mapping, torch_state: Mapping | None = None) -> None:
        """Restore :meth:`state_dict` into a started engine that has not stepped yet. Moments missing from
        ``state_dict`` are taken from ``torch_state`` (a torch AdamW-format optimizer state dict)."""
        engine_state.load_engine_state_dict(self, state_dict, torch_state)

    def torch_state_dict(self) -> dict:
        """The optimizer state in ``torch.optim.AdamW`` format: full fp32 moments and a step per parameter,
        merged from the device (selected columns) and the host (the rest). Data parallel: every rank must call it;
        the per-parameter state is on rank 0 only (empty elsewhere)."""
        return engine_state.torch_state_dict(self)

    def load_torch_state_dict(self, torch_state: Mapping) -> None:
        """Start from a plain torch Adam/AdamW state dict (moments and steps; the weights come from the model)."""
        engine_state.load_torch_state_dict(self, torch_state)

    def install_selection(self, selected: list[torch.Tensor], device_steps: list[int]) -> None:
        """Set every matrix's selected columns (CPU index tensors, in layout order) and device step counts,
        taking their master and moments from the host block. For restoring state into a fresh engine."""
        updater = self.device_updater
        for state, steps in zip(updater.matrix_states(), device_steps):
            state.step = int(steps)
        migrate(self.lanes, updater, self.host_buffers, [s.to(torch.long).cpu() for s in selected], self.ranks)
        self._write_unselected()

    def state_point(self) -> tuple[int, int, int, int]:
        """Where the run stands, for caching a state taken there: anything that changes the state changes this."""
        return (self.schedule.t, self._landings, self.schedule.selections, self.schedule.steps_in_window)

    def is_fresh(self) -> bool:
        return self.schedule.t == 0 and self.schedule.pending is None and self.schedule.steps_in_window == 0


def _check_interim_decay(hparams: Sequence[HyperParams]) -> None:
    for index, hp in enumerate(hparams):
        if not hp.decoupled and hp.weight_decay:
            raise UnsupportedSetupError(
                f"param group {index} runs Adam with weight_decay={hp.weight_decay} (an L2 term in the gradient), "
                "which interim_step cannot combine with its moves; use torch.optim.AdamW (decoupled decay) or set "
                "interim_step=0."
            )


def _score_and_choose(box: dict, work: list, importance: str, device: torch.device) -> None:
    """Side lane: every matrix's column scores and top-k columns, concatenated (``box["scores"]``, ``["indices"]``)."""
    indices, scores = [], []
    for grad2d, cols, k in work:
        score = torch.zeros(cols, device=device) if grad2d is None else column_scores(grad2d, importance)
        indices.append(top_columns(score, k))
        scores.append(score)
    box["indices"] = torch.cat(indices) if indices else torch.empty(0, dtype=torch.long, device=device)
    box["scores"] = torch.cat(scores) if scores else torch.empty(0, device=device)


def _innermost(function: object) -> object:
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


def _unique(name: str, taken: object) -> str:
    taken = set(taken)  # type: ignore[arg-type]
    candidate, suffix = name, 1
    while candidate in taken:
        candidate, suffix = f"{name}.{suffix}", suffix + 1
    return candidate


def _count_updates(counts: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
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


def _complement(selected: torch.Tensor, cols: int) -> torch.Tensor:
    keep = torch.ones(cols, dtype=torch.bool)
    keep[selected] = False
    return keep.nonzero().flatten()


SUPPORTED_OPTIMIZERS = "torch.optim.AdamW and torch.optim.Adam"


BYPASSED_METHODS = ("step", "state_dict", "load_state_dict")
"""Optimizer methods the engine (and the strategy's checkpoints) never call: a subclass's own version would be
silently skipped, so it is refused."""


def check_optimizer(optimizer: object) -> None:
    """Raise a clear error for an optimizer the engine cannot run."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"ZenFlow runs {SUPPORTED_OPTIMIZERS} only, got {type(optimizer).__module__}.{type(optimizer).__name__}. "
            "Return torch.optim.AdamW(...) (or Adam) from configure_optimizers."
        )
    base = torch.optim.AdamW if isinstance(optimizer, torch.optim.AdamW) else torch.optim.Adam
    for cls in type(optimizer).__mro__:
        if cls is base or vars(cls).get("zenflow_facade", False):
            break  # up to AdamW/Adam itself, or lightning_zenflow.ZenFlowAdamW, whose step drives this engine
        # torch wraps a class's step in a profiling hook at its first instance (also an inherited one): compare what
        # is inside the wrappers
        overridden = [
            name
            for name in BYPASSED_METHODS
            if name in vars(cls) and _innermost(vars(cls)[name]) is not _innermost(getattr(base, name))
        ]
        if overridden:
            raise UnsupportedSetupError(
                f"{cls.__module__}.{cls.__qualname__} overrides {', '.join(overridden)} of {base.__name__}, which "
                "ZenFlow never calls (its engine does the update and its state): that code would be skipped silently. "
                f"Use torch.optim.{base.__name__} itself, and put the extra work in a callback or the training step."
            )
    for index, group in enumerate(optimizer.param_groups):
        for flag, fix in (("amsgrad", "amsgrad=False"), ("maximize", "maximize=False (negate the loss instead)")):
            if group.get(flag, False):
                raise UnsupportedSetupError(
                    f"param group {index} sets {flag}=True, which ZenFlow does not support; use {fix}."
                )
