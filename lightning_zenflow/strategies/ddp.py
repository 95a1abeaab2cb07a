"""ZenFlowDDPStrategy: data-parallel ZenFlow on Lightning's DDP launchers and torch.distributed.

Every rank runs the same model on its share of the batches. torch's ``DistributedDataParallel`` all-reduces the
gradients during backward (skipped under ``accumulate_grad_batches`` by Lightning's ``no_sync``), so every rank
steps the engine with the same gradient: the selected columns and the 1-D parameters are updated on every rank
(replicated, like DDP's optimizer state), the host state is *sharded by rows* (``engine/ranks.py``): each rank's
worker updates its rows of every matrix, and at each landing the ranks broadcast their rows to each other. Host
memory per machine is that of one model whatever the number of ranks on it, and each rank's link carries its
share of the bytes.

Launchers are Lightning's own (its subprocess launcher, ``spawn``, torchrun/TorchElastic, SLURM); the process group
is Lightning's: NCCL on GPUs, gloo on CPUs. ``Trainer(strategy="zenflow", devices=N)`` arrives here through
:meth:`ZenFlowStrategy._become_data_parallel`; the names ``"zenflow_ddp"`` and ``"zenflow_ddp_spawn"`` choose it
directly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import suppress
from datetime import timedelta
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.strategies.base import COLLECTIVE_TIMEOUT, ZenFlowStrategyBase, zenflow_knobs
from lightning_zenflow.strategies.rank_guard import StuckRankGuard

SIBLING_GRACE_S = 10.0
"""After a failure, the launching rank lets the ranks it started end cleanly this long before it kills them."""


def _kill(pid: int | None) -> None:
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


class ZenFlowDDPStrategy(ZenFlowStrategyBase, DDPStrategy):
    """Data-parallel ZenFlow: DDP for the gradients, the host state sharded by rows across the ranks.

    The ZenFlow knobs are those of :class:`~lightning_zenflow.ZenFlowStrategy` (docs/knobs.md); the rest are
    Lightning's DDP options.

    Args:
        topk_ratio: fraction of columns of each matrix updated on the device every step.
        update_interval: steps per host window S, or ``"auto"`` (the ranks agree on the largest choice).
        select_strategy: ``"auto"``, ``"step"`` or ``"epoch"``: when the important columns are re-chosen.
        select_interval: refresh period in the unit of ``select_strategy``, or ``"auto"``.
        full_warm_up_rounds: first steps run as plain synchronous AdamW.
        overlap_step: run the host update in the background (its result lands one window later).
        land_after: with overlap, land the host update this many steps after its window (None: a window later).
        overlap_after: windows closing at steps up to this land at once (the device waits); later ones overlap.
        interim_step: move host columns between host updates (``"auto"``: 1.5, less past windows of 4; 0: the paper).
        interim_kernel: the moves' passes ``"compiled"`` (torch.compile, one fused kernel) or ``"eager"``; ``"auto"``
            compiles where a compiler is found.
        accumulate_on: where the window's host-bound gradients are summed: ``"device"``, ``"host"`` or ``"auto"``.
        host_state: precision of the host's optimizer state: ``"bf16"`` (6 B per parameter) or ``"fp32"`` (exact).
        importance: column score, ``"l2"`` (squared norm) or ``"l1"``.
        expert_layouts: how 3-D expert parameters are split where transformers does not say: a module class
            name or parameter pattern to ``"out_in"`` (``[experts, out, in]``) or ``"in_out"``.
        sync_on: opt-in boundaries at which host work in flight is applied early: ``"validation"``,
            ``"epoch_end"``, ``"checkpoint"`` (none by default: observing a run does not change its numbers).
        host_threads: threads of each rank's host worker (``None``: its share of the rank's cores).
        pt_reserved_cores_perc: share of a rank's cores kept for its training process.
        bind_cores: pin each rank's training process and host worker to disjoint cores.
        worker_timeout_s: a host worker silent this long fails the run (on every rank).
        log_telemetry: log ``zenflow/*`` metrics and show the stall share in the progress bar.
        checkpoint_format: ``"full"`` (one ``.ckpt`` file) or ``"sharded"`` (a directory, every rank its share).
        accelerator: passed to Lightning.
        parallel_devices: passed to Lightning (normally filled from ``Trainer(devices=...)``).
        cluster_environment: passed to Lightning (normally detected: SLURM, torchrun, Lightning's own).
        checkpoint_io: passed to Lightning.
        precision_plugin: passed to Lightning; any plugin is converted to :class:`ZenFlowPrecision`.
        process_group_backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs) by default.
        timeout: bound on every collective (see :data:`COLLECTIVE_TIMEOUT`).
        start_method: ``"popen"`` (Lightning's subprocess launcher, the default) or ``"spawn"``.
        find_unused_parameters: passed to ``DistributedDataParallel``.
        static_graph: passed to ``DistributedDataParallel``.
    """

    strategy_name = "zenflow_ddp"

    def __init__(
        self,
        topk_ratio: float = 0.1,
        update_interval: int | Literal["auto"] = 4,
        select_strategy: Literal["auto", "step", "epoch"] = "auto",
        select_interval: int | Literal["auto"] = "auto",
        full_warm_up_rounds: int = 10,
        overlap_step: bool = True,
        land_after: int | None = None,
        overlap_after: int = 0,
        interim_step: float | Literal["auto"] = "auto",
        interim_kernel: Literal["auto", "compiled", "eager"] = "auto",
        accumulate_on: Literal["auto", "device", "host"] = "auto",
        host_state: Literal["fp32", "bf16"] = "bf16",
        importance: Literal["l2", "l1"] = "l2",
        expert_layouts: dict[str, Literal["out_in", "in_out"]] | None = None,
        sync_on: tuple[str, ...] | list[str] = (),
        host_threads: int | None = None,
        pt_reserved_cores_perc: float = 0.5,
        bind_cores: bool = True,
        worker_timeout_s: float = 10.0,
        log_telemetry: bool = True,
        checkpoint_format: Literal["full", "sharded"] = "full",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = COLLECTIVE_TIMEOUT,
        start_method: Literal["popen", "spawn"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
    ) -> None:
        self._init_zenflow(zenflow_knobs(locals()))
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            # the reduced gradients are the buckets themselves: no second copy of every gradient
            gradient_as_bucket_view=True,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in ((cls.strategy_name, "popen"), (f"{cls.strategy_name}_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"ZenFlow offloaded AdamW, data parallel (start_method {start_method!r})",
                    start_method=start_method,
                )

    @override
    def _engine_ranks(self) -> Ranks:
        return Ranks.from_process_group(local_rank=self.local_rank, local_world=self.num_processes)

    @override
    def setup_environment(self) -> None:
        self._check_accelerator()
        super().setup_environment()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Built on the current stream, not on a side stream as Lightning does: DDP's constructor broadcasts rank 0's
        # weights, and the engine copies the weights into its host masters right after; on a side stream nothing
        # orders that copy after the broadcast.
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        engine = self.engine
        if engine is not None and self.world_size > 1 and threading.current_thread() is threading.main_thread():
            # a SIGTERM while this rank waits in a collective ends it in about a second (strategies/rank_guard.py)
            self._rank_guard = StuckRankGuard(lambda: _kill(engine.worker_pid))

    @override
    def teardown(self) -> None:
        self._remove_rank_guard()
        super().teardown()

    def _remove_rank_guard(self) -> None:
        guard = getattr(self, "_rank_guard", None)
        if guard is not None:
            guard.remove()
            self._rank_guard = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._end_started_ranks()

    def _end_started_ranks(self) -> None:
        """The rank that launched the others on this machine (Lightning's subprocess launcher) ends them: they may
        wait in a collective for this rank, which will never come. SIGTERM first (Lightning's handler tears each
        down: its worker stopped, its shared memory freed), SIGKILL after :data:`SIBLING_GRACE_S`."""
        procs = list(getattr(self.launcher, "procs", None) or [])
        if not procs:
            return
        for proc in procs:
            with suppress(OSError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + SIBLING_GRACE_S
        for proc in procs:
            with suppress(Exception):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.poll() is None:
                with suppress(OSError):
                    proc.kill()
