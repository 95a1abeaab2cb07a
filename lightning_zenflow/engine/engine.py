"""ZenFlowEngine: the update rule of DESIGN section 4, composed from the engine's rooms.

The caller (the Lightning precision plugin, or a plain training loop) does backward and clipping, then
calls :meth:`ZenFlowEngine.step`; before the next forward it calls :meth:`wait_for_update`. The engine
never calls ``optimizer.step()``: the torch optimizer only carries the param groups, whose hyperparameters
are read at every step (so LR schedulers work unchanged).

The :class:`~lightning_zenflow.engine.schedule.Schedule` says *when* (warm-up, window ends, refreshes); the rooms say
*how*: ``device.py`` (the selected columns' AdamW), ``accumulate.py`` (the window's host-bound gradients),
``window.py`` (a window's end and the launch of its host update), ``host.py`` (the worker), ``landing.py`` (the
update back into the parameters), ``refresh.py`` and ``migrate.py`` (choosing columns again), ``interim.py``,
``state.py`` (checkpoints). This class owns their lifecycle and calls them in the rule's order. The exact rule is
written in ``docs/update_rule.md``, the cost of each stage in ``docs/performance.md``. CPU and CUDA run the same
code: only :class:`~lightning_zenflow.engine.lanes.Lanes` differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict

import torch

import lightning_zenflow.engine.state as engine_state
from lightning_zenflow.engine.accumulate import (
    HostAccumulation,
    check_dense_gradients,
    choose_accumulation,
    restore_window_sums_into,
    window_sums_of,
)
from lightning_zenflow.engine.device import HyperParams
from lightning_zenflow.engine.interim import check_interim_hparams
from lightning_zenflow.engine.landing import Uploads
from lightning_zenflow.engine.lifecycle import EngineLifecycle
from lightning_zenflow.engine.migrate import migrate
from lightning_zenflow.engine.optimizers import SUPPORTED_OPTIMIZERS, check_optimizer
from lightning_zenflow.engine.refresh import choose_columns, refresh_period, write_unselected
from lightning_zenflow.engine.schedule import (
    AUTO_INITIAL_INTERVAL,
    AUTO_MARGIN,
    AUTO_MAX_INTERVAL,
    PendingUpdate,
    choose_update_interval,
)
from lightning_zenflow.engine.selection import diagnose
from lightning_zenflow.engine.stats import StepStats
from lightning_zenflow.engine.window import count_updates, host_jobs

__all__ = [
    "AUTO_INITIAL_INTERVAL",
    "AUTO_MARGIN",
    "AUTO_MAX_INTERVAL",
    "SUPPORTED_OPTIMIZERS",
    "StepStats",
    "ZenFlowEngine",
    "check_optimizer",
    "choose_update_interval",
]


class ZenFlowEngine(EngineLifecycle):
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
        guard_zero_grad: make the optimizer's ``zero_grad`` wait until the engine has read the gradients (an instance
            attribute, removed at ``close``). ``False``: its own ``zero_grad`` calls :meth:`wait_for_gradients`
            (``ZenFlowAdamW``'s does).
        maximize_by_caller: accept ``maximize=True`` param groups: the caller negates their gradients before
            :meth:`step` (``ZenFlowAdamW.step`` does); otherwise they are refused.
        row_offsets, matrix_columns: FSDP2's local rows' start per matrix name; a matrix view's columns per name
            where not ``numel // shape[0]`` (experts ``[E, out, in]`` are ``[E x out, in]``: ``matrices.py``).
    """

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
        self.follow_optimizer()
        if self.accumulation is None:
            check_dense_gradients(self.layout)
            self._choose_accumulation()
        d2h_before, h2d_before = self._link_bytes()
        self._diagnostics = None
        hparams = self.read_hparams()
        if self.interim is not None:
            check_interim_hparams(hparams)
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
            # on the compute lane, before the side lane's wait below orders it after everything issued there; the side
            # lane reads it this step (the device update, the counts, the moves), after the caller may have freed it
            found_inf = found_inf.reshape(()).to(device=self.device, dtype=torch.float32)
            self.lanes.keep_for(found_inf, self.lanes.side)
        updater.begin_step()
        with torch.profiler.record_function("zenflow.device_update"):
            updater.update(hparams, found_inf)
            if plan.warm_up:
                # a warm-up step updates every column: it counts as an update on both sides
                counts = [state.step_count for state in states if state.slot.param.grad is not None]
                self.lanes.side.run(count_updates, counts, found_inf)
            self.window.count(states, self.schedule.slot, plan.first_in_window, found_inf)
        if self.interim is not None:
            # before the accumulation: the next forward waits for these weights, not for the accumulation's reads
            with torch.profiler.record_function("zenflow.interim"):
                if plan.warm_up:
                    self.interim.warm_up_step(updater.selected, hparams, found_inf)  # reads, moves nothing
                else:
                    interval, first = self.schedule.interval, plan.first_in_window
                    self.interim.step(updater.selected, hparams, interval, found_inf, first)
                    updater.weights_written()
        with torch.profiler.record_function("zenflow.accumulate"):
            stalled_before = self._accumulation_stall()
            self.accumulation.add(
                states, self.schedule.slot, plan.first_in_window, self.helper, self.uploads.source_read, plan.t
            )
            self._stall_s += self._accumulation_stall() - stalled_before
        updater.end_step()
        self.schedule.add_gradients([[slot.param.grad is not None for slot in group.matrices] for group in self.layout])
        self.landing.poll(self.schedule.pending, self._worker, self.uploads)
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
        self._clock.step_ended(self._stall_s)
        d2h_after, h2d_after = self._link_bytes()
        stall_at_stats = self._stall_s
        syncs_at_stats = self.lanes.host_syncs
        self.last_stats = StepStats(
            step=plan.t,
            stall_s=self._stall_s - self._stall_at_last_stats,
            device_update_s=device_s,
            host_update_s=self.landing.last_host_s,
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

    def wait_for_builds(self) -> None:
        """Block until the host worker's compiled step is built. Until then the worker runs its step eagerly (the same
        numbers, more time per update): a benchmark that measures the steady state calls this first. The update in
        flight, if any, finishes computing first (it is not applied)."""
        self._require_started()
        if self._worker is not None:
            self._await_pending()
            self._worker.wait_for_builds()

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
        """Set every matrix's host master (this rank's rows, where the host keeps masters) from the model's weights,
        and (``device_too``) the selected columns' device masters. Blocking device -> host copies, with nothing in
        flight: at an explicit boundary only."""
        self.lanes.synchronize()
        with torch.no_grad():
            for group_index, host in enumerate(self.host_buffers):
                for state in self.device_updater.selected[group_index]:
                    slot = state.slot
                    weights2d = slot.param.detach().view(slot.rows, slot.cols)
                    if host.master is not None:
                        slot.view2d(host.master).copy_(weights2d[slot.row_start : slot.row_stop])
                    if device_too and state.k:
                        state.master.copy_(weights2d.index_select(1, state.selected))
        self.merge_cache = None

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
        """Build the accumulation mode at the first step (``engine/accumulate.py``)."""
        self.accumulation, self.uploads, self.accumulate_on_reason = choose_accumulation(
            self.config,
            self.lanes,
            self.layout,
            self.host_buffers,
            self.device_updater,
            self.ranks,
            self.host_format,
            self.kernels,
            self.row_offsets,
        )
        self.use_window_rows(self.accumulation.mode)
        if self._restored_window_sums is not None:
            self._restore_window_sums(self._restored_window_sums)
            self._restored_window_sums = None

    @property
    def accumulate_on(self) -> str | None:
        """``"device"`` or ``"host"`` once decided (at the first step), else None."""
        return self.accumulation.mode if self.accumulation is not None else None

    def _accumulation_stall(self) -> float:
        return getattr(self.accumulation, "stall_s", 0.0)

    # ------------------------------------------------------------------------------------------------ windows
    def _close_window(self, hparams: list[HyperParams], overlap: bool) -> None:
        """The window ends (``engine/window.py``): its gradients go down, the host update is launched; without
        overlap (or the previous update still in flight) the device waits for a landing here."""
        slot = self.schedule.slot
        counts = self.schedule.close_window()
        host_mode = isinstance(self.accumulation, HostAccumulation)
        jobs = host_jobs(self.device_updater.selected, hparams, counts, host_mode)
        if overlap and self.schedule.pending is not None:
            self._timed_wait(self._land_pending)
        active = [list(job.active) for job in jobs]
        if any(active):
            self.window.copy_down(slot, self.accumulation, active)
            land_after = self.config.land_after
            land_at = None
            if overlap and land_after is not None and land_after < self.schedule.interval:
                land_at = self.schedule.t + land_after
            scales = None
            if not self.host_format.master:
                # the weights are the host columns' masters: the window end's weight decay lands with the step
                # (per active matrix; the launch sets 1 where every gradient of the window was skipped)
                scales = [[1.0 - job.hparams.lr * job.hparams.weight_decay] * len(job.active) for job in jobs]
            pending = PendingUpdate(slot=slot, active=active, land_at=land_at, scales=scales)
            self.schedule.pending = pending
            # queued after this window's adds on the helper thread (host mode); it waits for the copy down
            self.landing.launch_future = self.helper.submit(self.window.launch, self._worker, slot, jobs, pending)
            if not overlap:
                self._timed_wait(self._land_pending)
        self._maybe_decide_interval()

    def _await_pending(self) -> None:
        """Wait (without applying) until the host update in flight has finished computing."""
        self.landing.await_computed(self.schedule.pending, self._worker)

    def _land_pending(self) -> None:
        pending = self.schedule.pending
        if self.uploads is None:
            # a restored update applied before the first step (a sync right after a load)
            self.uploads = Uploads(self.lanes, self.device_updater, self.host_buffers, self.ranks, self.row_offsets)
        self.uploads.landing_add = self.kernels.landing_add_
        self.uploads.prepare = self.kernels.prepare
        self.landing.land(pending, self._worker, self.uploads, self.device_updater, seed=self.schedule.t)
        self.schedule.pending = None

    def _drain_helper(self) -> None:
        self.landing.drain()

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
        self.schedule.window_kept = self.window.kept_counts()

    # ---------------------------------------------------------------------------------------------- selection
    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Tell an epoch-based selection how long an epoch is (optimizer steps); the strategy does this at fit."""
        self._steps_per_epoch = steps_per_epoch
        self.schedule.refresh_every = refresh_period(self.config, steps_per_epoch)

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
        """Choose each matrix's columns from the current gradient and move only the columns that change side
        (``engine/refresh.py``, ``engine/migrate.py``). Runs only with no host work in flight: a full sync point on
        CUDA (two small host reads, one synchronisation after the batched copies)."""
        started = time.perf_counter()
        with torch.profiler.record_function("zenflow.select"):
            states = self.device_updater.matrix_states()
            previous = [state.selected_host for state in states] if self.schedule.last_select_t is not None else None
            new_selected, scores_host = choose_columns(self.lanes, states, self.config, self.ranks)
            moved = migrate(self.lanes, self.device_updater, self.host_buffers, new_selected, self.ranks)
            self._refresh_bytes[0] += moved.d2h_bytes
            self._refresh_bytes[1] += moved.h2d_bytes
            write_unselected(self.device_updater, self.unselected_shared)
            self._diagnostics = diagnose(previous, new_selected, scores_host)
            self.schedule.selected()
        self._stall_s += time.perf_counter() - started

    def synchronize_device(self) -> None:
        """Wait for all device work of the engine (CUDA); used only at selections and state transfers."""
        self.lanes.synchronize()

    def _maybe_decide_interval(self) -> None:
        # decided after the first landing: a point of the rule every rank reaches at the same step (the first
        # host time is known by then everywhere), so the ranks can agree on the largest choice
        if (
            self.schedule.interval_decided
            or self.landing.landings == 0
            or self.landing.last_host_s is None
            or not self._clock.intervals
        ):
            return
        choice = self.schedule.propose_interval(self.landing.last_host_s, self._clock.median())
        self.schedule.fix_interval(int(self.ranks.agree(choice, self.device)))  # the largest rank's choice

    # ------------------------------------------------------------------------------------------------- state
    def window_sums(self, row_blocks: bool = False) -> dict[str, torch.Tensor]:
        """The open window's accumulated gradient sums, ``{name: fp32 tensor shaped like the parameter}``, on
        the CPU (empty when no window is open). Call after :meth:`wait_idle`; data parallel: on rank 0 (the rows
        are gathered; every rank must call it), empty on the others. ``row_blocks``: this rank's rows of each sum
        (``[host_rows, cols]``), no collective."""
        if self.schedule.steps_in_window == 0 or self.accumulation is None:
            return {}
        own = window_sums_of(self.accumulation, self.config, self.device_updater, self.schedule.slot)
        if row_blocks:
            return own
        sums = {}
        for state in self.device_updater.matrix_states():
            slot = state.slot
            if slot.name in own:
                total = self.ranks.gather_rows(own[slot.name], slot.rows, self.device)
                if total is not None:
                    sums[slot.name] = total.reshape(slot.param.shape)
        return sums

    def restore_window_sums(self, sums: Mapping[str, torch.Tensor], row_blocks: bool = False) -> None:
        """Put saved window sums back (before the first step: kept until the accumulation mode is chosen), and the
        window's kept counts from the restored schedule. ``row_blocks``: the sums are this rank's rows only."""
        if self.schedule.window_kept is not None:
            self.window.restore_kept(self.schedule.window_kept)
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
        restore_window_sums_into(self.accumulation, self.config, self.device_updater, self.schedule.slot, sums)

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

    def follow_optimizer(self) -> None:
        """Take the optimizer's param groups and trainable parameters as they are now, if they changed (each step does
        this first). Before a state is loaded, after something changed the groups (Lightning's ``BaseFinetuning``
        re-adds the groups it unfroze when a fit resumes, before the optimizer state is loaded)."""
        if self._groups_signature() != self._layout_signature:
            check_optimizer(self.optimizer, allow_maximize=self._maximize_by_caller)
            engine_state.follow_param_groups(self)

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
        write_unselected(self.device_updater, self.unselected_shared)

    def state_point(self) -> tuple[int, int, int, int]:
        """Where the run stands, for caching a state taken there: anything that changes the state changes this."""
        return (self.schedule.t, self.landing.landings, self.schedule.selections, self.schedule.steps_in_window)

    def is_fresh(self) -> bool:
        return self.schedule.t == 0 and self.schedule.pending is None and self.schedule.steps_in_window == 0
