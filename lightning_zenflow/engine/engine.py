"""ZenFlowEngine: the update rule of DESIGN section 4, composed from layout, selection, device, host, transfer.

The caller (the Lightning precision plugin, or a plain training loop) does backward and clipping, then
calls :meth:`ZenFlowEngine.step`; before the next forward it calls :meth:`wait_for_update`. The engine
never calls ``optimizer.step()``: the torch optimizer only carries the param groups, whose hyperparameters
are read at every step (so LR schedulers work unchanged).

The exact rule, with every choice this implementation makes, is written in ``docs/update_rule.md``.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine import state as engine_state
from lightning_zenflow.engine.device import DeviceUpdater, HyperParams, SelectedState
from lightning_zenflow.engine.host import GroupJob, HostWorker, MatrixExtent, WorkerSpec
from lightning_zenflow.engine.layout import GroupHostBuffers, allocate_host_buffers, build_layout
from lightning_zenflow.engine.selection import SelectionDiagnostics, column_scores, diagnose, top_columns
from lightning_zenflow.engine.transfer import Transfers

AUTO_INITIAL_INTERVAL = 4
"""Window length used by ``update_interval="auto"`` until the first host update has been timed."""
AUTO_MAX_INTERVAL = 64
AUTO_MARGIN = 1.25
"""``"auto"`` sizes the window so that S device steps last this many times one host update."""


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


class ZenFlowEngine:
    """The framework-free ZenFlow optimizer engine for one torch Adam/AdamW optimizer.

    Args:
        optimizer: a ``torch.optim.Adam`` or ``torch.optim.AdamW``; its param groups are read at every step.
        config: the ZenFlow knobs.
        param_names: optional ``{param: name}`` (e.g. from ``model.named_parameters()``) for checkpoints.
        steps_per_epoch: optimizer steps per epoch, needed by ``select_strategy="epoch"`` / ``"auto"``.
        host_delay_s: test hook, the host worker sleeps this long before each update.
        host_fail_at: test hook, the host worker raises at this update (1-based).
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
    ) -> None:
        check_optimizer(optimizer)
        self.optimizer = optimizer
        self.config = config
        self._decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        names = {id(p): n for p, n in (param_names or {}).items()}
        self.layout = build_layout(optimizer.param_groups, names)
        params = [s.param for g in self.layout for s in g.matrices] + [
            s.param for g in self.layout for s in g.device_only
        ]
        if not params:
            raise ValueError("the optimizer has no trainable parameters (every parameter has requires_grad=False).")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}.")
        self.device = devices.pop()
        self.refresh_every = self._refresh_period(steps_per_epoch)
        self._host_delay_s = host_delay_s
        self._host_fail_at = host_fail_at
        self._started = False
        self._closed = False
        # progress of the update rule (all of it goes into state_dict)
        self.t = 0
        self._steps_in_window = 0
        self._slot = 0
        self._pending_slot: int | None = None
        self._pending_computed = False
        self._last_select_t: int | None = None
        self._selections = 0
        self._interval = AUTO_INITIAL_INTERVAL if config.update_interval == "auto" else config.update_interval
        self._interval_decided = config.update_interval != "auto"
        self._last_hparams: list[HyperParams] | None = None
        self._window_grads = [[0] * len(group.matrices) for group in self.layout]
        """Per matrix: gradients accumulated in the open window."""
        self._window_length = 1
        # telemetry
        self._stall_s = 0.0
        self._step_intervals: list[float] = []
        self._last_step_end: float | None = None
        self._stall_at_last_end = 0.0
        self._stall_at_last_stats = 0.0
        self._last_host_s: float | None = None
        self._diagnostics: SelectionDiagnostics | None = None
        self.last_stats: StepStats | None = None
        self._saved_affinity: set[int] | None = None
        self._saved_threads: int | None = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> ZenFlowEngine:
        """Allocate the host buffers, pin them (CUDA), and spawn the host worker. Idempotent."""
        if self._closed:
            raise RuntimeError("this ZenFlowEngine was closed; build a new one.")
        if self._started:
            return self
        self.host_buffers: list[GroupHostBuffers] = allocate_host_buffers(self.layout)
        self._pinned: list[torch.Tensor] = []
        if self.device.type == "cuda":
            self._pin_host_buffers()
        self.device_updater = DeviceUpdater(self.layout, self.device)
        self.transfers = Transfers(self.device_updater, self.host_buffers, self.device)
        self._transfer_futures: list[concurrent.futures.Future] = []
        self._launch_future: concurrent.futures.Future | None = None
        self._worker: HostWorker | None = None
        self._started = True
        if self.needs_host():
            try:
                self._start_worker()
            except BaseException:
                self.close()
                raise
        return self

    def needs_host(self) -> bool:
        """False only when no step can ever put work on the host (every column on the device, no warm-up)."""
        if self.config.full_warm_up_rounds > 0:
            return True
        return any(
            num_selected_columns(slot.cols, self.config.topk_ratio) < slot.cols
            for group in self.layout
            for slot in group.matrices
        )

    def _pin_host_buffers(self) -> None:
        # register the shared pages in place (cudaHostRegister); pin_memory() would copy them out of shared memory
        cudart = torch.cuda.cudart()
        for host in self.host_buffers:
            for tensor in (host.block_shared,):
                if tensor.numel() == 0:
                    continue
                code = cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 1)  # 1: cudaHostRegisterPortable
                if int(code) != 0:
                    raise RuntimeError(f"cudaHostRegister failed with code {int(code)} for {tensor.nbytes} bytes.")
                self._pinned.append(tensor)

    def _start_worker(self) -> None:
        train_cores, host_cores = self.config.core_split()
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
            extents=tuple(
                tuple(MatrixExtent(s.offset, s.numel, s.param.dtype) for s in g.matrices) for g in self.layout
            ),
            heartbeat=torch.zeros(1, dtype=torch.float64).share_memory_(),
            threads=threads,
            cores=worker_cores,
            delay_s=self._host_delay_s,
            fail_at_update=self._host_fail_at,
        )
        self._worker = HostWorker(spec, timeout_s=self.config.worker_timeout_s)

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def close(self) -> None:
        """Stop the worker, unpin and drop the buffers, restore the process's cores. Idempotent; safe on error."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        transfers = getattr(self, "transfers", None)
        if transfers is not None:
            transfers.shutdown()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self.device.type == "cuda":
            # the side stream may still read pinned pages or write weights: wait for it before releasing anything
            torch.cuda.synchronize(self.device)
        if self._pinned:
            cudart = torch.cuda.cudart()
            for tensor in self._pinned:
                cudart.cudaHostUnregister(tensor.data_ptr())
            self._pinned = []
        if self._saved_affinity is not None:
            os.sched_setaffinity(0, self._saved_affinity)
            self._saved_affinity = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
        # drop every reference to the shared blocks so their pages are unmapped now, not at garbage collection
        self.host_buffers = []
        if transfers is not None:
            transfers.host_buffers = []
        self._transfer_futures = []

    def __enter__(self) -> ZenFlowEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ the step
    def step(self) -> StepStats:
        """One optimizer step with the current ``.grad`` of every parameter (already unscaled and clipped)."""
        self._require_started()
        d2h_before, h2d_before = self.transfers.d2h_bytes, self.transfers.h2d_bytes
        self._diagnostics = None
        hparams = self.read_hparams()
        self._last_hparams = hparams
        # torch's LR schedulers warn unless optimizer.step() ran first; this call is that step
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self.t += 1
        warm_up = self.t <= self.config.full_warm_up_rounds
        refreshed = False
        if not warm_up and self._last_select_t is None:
            with torch.profiler.record_function("zenflow.select"):
                self._select_and_migrate()
            refreshed = True
        self.device_updater.begin_step()
        device_started = time.perf_counter()
        with self.device_updater.on_side_stream(), torch.profiler.record_function("zenflow.device_update"):
            self.device_updater.update(hparams)
            if warm_up:
                # a warm-up step updates every column: it counts as an update on both sides
                for state in self._matrix_states():
                    if state.slot.param.grad is not None:
                        state.step += 1
            payloads, gathered_event = self.transfers.gather(self.device_updater.selected)
        self.device_updater.end_step()
        if self.device.type == "cuda":
            device_s = self.device_updater.finished_update_seconds()  # from events; never waits
        else:
            device_s = time.perf_counter() - device_started
        first_in_window = self._steps_in_window == 0
        if first_in_window:
            # the window's planned length: each gradient is added pre-scaled by 1/S (see GroupJob.mean_divisors)
            self._window_length = 1 if warm_up else self._interval
        for group_index, group in enumerate(self.layout):
            for index, slot in enumerate(group.matrices):
                if slot.param.grad is not None:
                    self._window_grads[group_index][index] += 1
        with torch.profiler.record_function("zenflow.accumulate"):
            self._submit_transfer(
                self.transfers.accumulate,
                payloads,
                gathered_event,
                self._slot,
                first_in_window,
                1.0 / self._window_length,
            )
        del payloads
        self._steps_in_window += 1
        window_end = warm_up or self._steps_in_window >= self._interval
        if window_end:
            self._close_window(hparams, overlap=self.config.overlap_step and not warm_up)
            if not warm_up and self._refresh_due():
                self._refresh()
                refreshed = True
        self._record_step_interval()
        stall_at_stats = self._stall_s
        self.last_stats = StepStats(
            step=self.t,
            stall_s=self._stall_s - self._stall_at_last_stats,
            device_update_s=device_s,
            host_update_s=self._last_host_s,
            update_interval=self._interval,
            d2h_bytes=self.transfers.d2h_bytes - d2h_before,
            h2d_bytes=self.transfers.h2d_bytes - h2d_before,
            device_bytes=self.device_bytes(),
            host_bytes=self.host_bytes(),
            window_end=window_end,
            refreshed=refreshed,
            selection_overlap=self._diagnostics.overlap if self._diagnostics else None,
            selection_captured=self._diagnostics.captured_share if self._diagnostics else None,
        )
        self._stall_at_last_stats = stall_at_stats
        return self.last_stats

    def read_hparams(self) -> list[HyperParams]:
        return [HyperParams.from_group(g, self._decoupled_default) for g in self.optimizer.param_groups]

    def wait_for_update(self) -> None:
        """Order the next forward after the last device update and upload (GPU-side wait; no-op on CPU)."""
        if self._started and not self._closed:
            self.device_updater.wait_for_update()

    def before_backward(self) -> None:
        """Wait until the previous step's gradient payloads were copied down, so they are freed before the next
        backward allocates new gradients (bounded device memory). A no-op on the CPU."""
        if self._started and not self._closed and self.device.type == "cuda":
            self._timed_wait(self._drain_transfers)

    def sync(self) -> None:
        """Apply the host update in flight, if any, so the model holds every finished update. Leaves the open
        window's accumulated gradients pending (they belong to the next window end)."""
        self._require_started()
        if self._pending_slot is not None:
            self._timed_wait(self._finish_pending)

    def flush(self) -> None:
        """End of training: apply what is in flight, then close the open window early (mean over the steps it
        holds) and apply it, so the weights contain every gradient. The next step starts a new window."""
        self._require_started()
        self.sync()
        if self._steps_in_window > 0 and self._last_hparams is not None:
            self._close_window(self._last_hparams, overlap=False)

    # ------------------------------------------------------------------------------------------------ windows
    def _close_window(self, hparams: list[HyperParams], overlap: bool) -> None:
        slot = self._slot
        jobs = self._host_jobs(hparams)
        if overlap and self._pending_slot is not None:
            self._timed_wait(self._finish_pending)
        if any(job.active for job in jobs):
            # in order after this window's accumulation on the helper thread (CUDA) or at once (CPU)
            self._launch_future = self._submit_transfer(self._worker_submit, slot, jobs)
            self._pending_slot = slot
            self._pending_computed = False
            self._pending_active = [job.active for job in jobs]
            if not overlap:
                self._timed_wait(self._finish_pending)
        self._slot ^= 1
        self._steps_in_window = 0
        self._window_grads = [[0] * len(counts) for counts in self._window_grads]
        self._maybe_decide_interval()

    def _worker_submit(self, slot: int, jobs: list[GroupJob]) -> None:
        if self._worker is None:
            raise RuntimeError("internal error: host work was scheduled but no host worker is running.")
        self.transfers.wait_upload()
        self._worker.submit(slot, jobs)

    def _submit_transfer(self, fn: Callable[..., None], *args: object) -> concurrent.futures.Future | None:
        """Run ``fn`` in order with the other transfers: on the helper thread (CUDA) or now (CPU)."""
        while self._transfer_futures and self._transfer_futures[0].done():
            self._transfer_futures.pop(0).result()  # raise an earlier failure now
        future = self.transfers.executor.submit(fn, *args)
        if future.done():
            future.result()  # raise a failure at once
            return None
        self._transfer_futures.append(future)
        return future

    def _wait_transfers(self, upto: concurrent.futures.Future | None) -> None:
        """Helper-thread queue wait, in order, up to ``upto`` (inclusive; everything when None)."""
        while self._transfer_futures:
            future = self._transfer_futures.pop(0)
            future.result()
            if future is upto:
                return

    def _await_pending(self) -> None:
        """Wait (without applying) until the host update in flight has finished computing."""
        if self._pending_slot is None or self._pending_computed:
            return
        # the submit may still sit on the helper thread, behind its window's last d2h: wait for it, not for
        # copies queued after it (they belong to the next window and may overlap the upload)
        if self._launch_future is not None:
            self._wait_transfers(self._launch_future)
            self._launch_future = None
        self._last_host_s = self._worker.wait()
        self._pending_computed = True

    def _finish_pending(self) -> None:
        self._await_pending()
        self.transfers.upload(self._pending_slot, self._pending_active)
        self._pending_slot = None
        self._pending_computed = False

    def _drain_transfers(self) -> None:
        # helper-thread queue wait: every d2h copy, host add and submit issued so far has finished (or raised)
        self._wait_transfers(None)
        self._launch_future = None

    def _timed_wait(self, wait: Callable[[], None]) -> None:
        """Run a blocking wait, counting its time as stall; it shows in the profiler as ``zenflow.wait:<name>``."""
        started = time.perf_counter()
        try:
            with torch.profiler.record_function(f"zenflow.wait:{wait.__name__.lstrip('_')}"):
                wait()
        finally:
            self._stall_s += time.perf_counter() - started

    def _host_jobs(self, hparams: list[HyperParams]) -> list[GroupJob]:
        """Per group: the matrices with columns on the host that got gradients in the window, and how many."""
        jobs = []
        for group_index, group_states in enumerate(self.device_updater.selected):
            counts = self._window_grads[group_index]
            active = tuple(i for i, state in enumerate(group_states) if state.unselected.numel() > 0 and counts[i] > 0)
            divisors = tuple(counts[i] / self._window_length for i in active)
            jobs.append(GroupJob(hparams=hparams[group_index], active=active, mean_divisors=divisors))
        return jobs

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
        self.refresh_every = self._refresh_period(steps_per_epoch)

    def _refresh_due(self) -> bool:
        return self.refresh_every is not None and self.t - self._last_select_t >= self.refresh_every

    def _matrix_states(self) -> list[SelectedState]:
        return [state for group_states in self.device_updater.selected for state in group_states]

    def _refresh(self) -> None:
        self._timed_wait(self._finish_pending_and_drain)
        with torch.profiler.record_function("zenflow.select"):
            self._select_and_migrate()

    def _finish_pending_and_drain(self) -> None:
        if self._pending_slot is not None:
            self._finish_pending()
        self._drain_transfers()

    def _select_and_migrate(self) -> None:
        """Choose each matrix's columns from the current gradient and move state between the sides.

        Runs only with no host work in flight. Every device column first goes back to the host (master and
        moments), so the host is complete; then the new columns are gathered from it. No moment is zeroed.
        A full synchronisation point on CUDA: the copies are blocking.
        """
        started = time.perf_counter()
        self.synchronize_device()
        states = self._matrix_states()
        previous = [state.selected for state in states] if self._last_select_t is not None else None
        self._return_to_host(states)
        new_indices, scores = [], []
        for state in states:
            grad = state.slot.param.grad
            k = num_selected_columns(state.slot.cols, self.config.topk_ratio)
            if grad is None:
                score = torch.zeros(state.slot.cols, device=self.device)
            else:
                score = column_scores(grad.view(state.slot.rows, state.slot.cols), self.config.importance)
            new_indices.append(top_columns(score, k))
            scores.append(score)
        flat_index = 0
        for group_index, group_states in enumerate(self.device_updater.selected):
            host = self.host_buffers[group_index]
            for position, old_state in enumerate(group_states):
                group_states[position] = self._take_from_host(old_state, new_indices[flat_index], host)
                flat_index += 1
        self._diagnostics = diagnose(previous, new_indices, scores)
        self.synchronize_device()
        self._last_select_t = self.t
        self._selections += 1
        self._stall_s += time.perf_counter() - started

    def synchronize_device(self) -> None:
        """Wait for all device work of the engine (CUDA); used only at selections and state transfers, which
        read or replace device tensors that the side stream writes."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _return_to_host(self, states: list[SelectedState]) -> None:
        for state in states:
            if state.k == 0:
                continue
            host = self.host_buffers[state.slot.group_index]
            selected_cpu = state.selected.cpu()
            for host_row, device_tensor in (
                (host.master, state.master),
                (host.exp_avg, state.exp_avg),
                (host.exp_avg_sq, state.exp_avg_sq),
            ):
                state.slot.view2d(host_row).index_copy_(1, selected_cpu, device_tensor.cpu())
                self.transfers.d2h_bytes += device_tensor.nbytes

    def _take_from_host(self, state: SelectedState, selected: torch.Tensor, host: GroupHostBuffers) -> SelectedState:
        selected_cpu = selected.cpu()
        unselected_cpu = torch.ones(state.slot.cols, dtype=torch.bool)
        unselected_cpu[selected_cpu] = False
        unselected_cpu = unselected_cpu.nonzero().flatten()

        def gather(host_row: torch.Tensor) -> torch.Tensor:
            columns = state.slot.view2d(host_row).index_select(1, selected_cpu)
            self.transfers.h2d_bytes += columns.nbytes
            return columns.to(self.device)

        return SelectedState(
            slot=state.slot,
            selected=selected_cpu.to(self.device),
            unselected=unselected_cpu.to(self.device),
            unselected_host=unselected_cpu,
            master=gather(host.master),
            exp_avg=gather(host.exp_avg),
            exp_avg_sq=gather(host.exp_avg_sq),
            step=state.step,
        )

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
        if self._interval_decided or self._last_host_s is None or not self._step_intervals:
            return
        device_step_s = statistics.median(self._step_intervals)
        self._interval = choose_update_interval(self._last_host_s, device_step_s)
        self._interval_decided = True

    # ---------------------------------------------------------------------------------------------- telemetry
    def device_bytes(self) -> int:
        return self.device_updater.bytes_held() if self._started else 0

    def host_bytes(self) -> int:
        if not self._started:
            return 0
        own = sum(h.block_shared.nbytes + h.step_shared.nbytes for h in self.host_buffers)
        return own + self.transfers.bytes_held()

    @property
    def update_interval(self) -> int:
        return self._interval

    @property
    def host_in_flight(self) -> bool:
        return self._pending_slot is not None

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the ZenFlowEngine is not running; call start() first (and not after close()).")

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self, include_moments: bool = True) -> dict:
        """Everything needed to continue exactly, keyed by parameter name (see ``engine/state.py``).

        Waits for a host update in flight to finish computing, but never applies it early.
        """
        return engine_state.engine_state_dict(self, include_moments)

    def load_state_dict(self, state_dict: Mapping, torch_state: Mapping | None = None) -> None:
        """Restore :meth:`state_dict` into a started engine that has not stepped yet. Moments missing from
        ``state_dict`` are taken from ``torch_state`` (a torch AdamW-format optimizer state dict)."""
        engine_state.load_engine_state_dict(self, state_dict, torch_state)

    def torch_state_dict(self) -> dict:
        """The optimizer state in ``torch.optim.AdamW`` format: full fp32 moments and a step per parameter,
        merged from the device (selected columns) and the host (the rest)."""
        return engine_state.torch_state_dict(self)

    def load_torch_state_dict(self, torch_state: Mapping) -> None:
        """Start from a plain torch Adam/AdamW state dict (moments and steps; the weights come from the model)."""
        engine_state.load_torch_state_dict(self, torch_state)


def choose_update_interval(host_update_s: float, device_step_s: float) -> int:
    """``update_interval="auto"``: the smallest S whose S device steps cover one host update with a margin.

    S = ceil(AUTO_MARGIN * host_update_s / device_step_s), clamped to [1, AUTO_MAX_INTERVAL].
    """
    if device_step_s <= 0:
        return AUTO_MAX_INTERVAL
    return int(min(AUTO_MAX_INTERVAL, max(1, math.ceil(AUTO_MARGIN * host_update_s / device_step_s))))


SUPPORTED_OPTIMIZERS = "torch.optim.AdamW and torch.optim.Adam"


def check_optimizer(optimizer: object) -> None:
    """Raise a clear error for an optimizer the engine cannot run."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"ZenFlow runs {SUPPORTED_OPTIMIZERS} only, got {type(optimizer).__module__}.{type(optimizer).__name__}. "
            "Return torch.optim.AdamW(...) (or Adam) from configure_optimizers."
        )
    for index, group in enumerate(optimizer.param_groups):
        for flag, fix in (("amsgrad", "amsgrad=False"), ("maximize", "maximize=False (negate the loss instead)")):
            if group.get(flag, False):
                raise ValueError(f"param group {index} sets {flag}=True, which ZenFlow does not support; use {fix}.")
