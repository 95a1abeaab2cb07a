"""ZenFlowStrategy: ZenFlow on one device (CPU or CUDA), and the name ``"zenflow"`` that becomes data parallel.

The user's torch optimizer stays the object Lightning sees (schedulers and ``LearningRateMonitor`` work unchanged); its
``step()`` is never called: ``ZenFlowPrecision.optimizer_step`` hands the gradients to the engine instead. What the
one-device and the data-parallel strategies share (lifecycle, sync boundaries, checkpoints) is ``strategies/base.py``.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_zenflow.strategies.base import ZenFlowStrategyBase, zenflow_knobs
from lightning_zenflow.strategies.ddp import ZenFlowDDPStrategy


class ZenFlowStrategy(ZenFlowStrategyBase, SingleDeviceStrategy):
    """Train with ZenFlow: the important columns of every weight matrix on the device, the rest on a CPU worker.

    Every knob is documented in :class:`lightning_zenflow.config.ZenFlowConfig` (and docs/knobs.md); the
    device comes from ``Trainer(accelerator=..., devices=...)`` unless ``device`` is given. With more than one
    device or node (``Trainer(strategy="zenflow", devices=N, num_nodes=M)``) Lightning's connector hands this
    object the devices and it becomes a :class:`~lightning_zenflow.ZenFlowDDPStrategy` with the same knobs.

    Args:
        topk_ratio: fraction of columns of each matrix updated on the device every step.
        update_interval: steps per host window S, or ``"auto"``.
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
        host_threads: threads of the host worker (``None``: its share of the cores).
        pt_reserved_cores_perc: share of the cores kept for the training process.
        bind_cores: pin the training process and the host worker to disjoint cores.
        worker_timeout_s: a host worker silent this long fails the run.
        log_telemetry: log ``zenflow/*`` metrics and show the stall share in the progress bar.
        checkpoint_format: ``"full"`` (one ``.ckpt`` file) or ``"sharded"`` (a directory, every rank its share).
        device: the device to train on; default: the one the Trainer's accelerator flags choose.
        accelerator: passed to Lightning.
        checkpoint_io: passed to Lightning.
        precision_plugin: passed to Lightning; any plugin is converted to :class:`ZenFlowPrecision`.
    """

    strategy_name = "zenflow"

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
        device: str | torch.device | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        knobs = zenflow_knobs(locals())
        self._init_zenflow(knobs)
        self._knobs = knobs
        self._explicit_device = device is not None
        self._parallel_devices: list[torch.device] | None = None
        super().__init__(
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Lightning's connector fills this (for a data-parallel run: see parallel_devices)
        self.cluster_environment: ClusterEnvironment | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="ZenFlow offloaded AdamW (one device; data parallel on several)"
            )

    # ---------------------------------------------------------------------------------------------- devices
    @property
    @override
    def root_device(self) -> torch.device:
        if not self._explicit_device and self.parallel_devices:
            return self.parallel_devices[0]
        return self._root_device

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices of ``Trainer(accelerator=..., devices=...)``, filled by Lightning's accelerator connector."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices
        if devices is not None and len(devices) > 1:
            self._become_data_parallel()

    @property
    def num_nodes(self) -> int:
        """``Trainer(num_nodes=...)``, filled by Lightning's accelerator connector."""
        return getattr(self, "_num_nodes", 1)

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        self._num_nodes = value
        if value > 1:
            self._become_data_parallel()

    def _become_data_parallel(self) -> None:
        """Turn this object into a :class:`~lightning_zenflow.strategies.ddp.ZenFlowDDPStrategy` with the same knobs.

        Lightning's connector builds the strategy a name stands for before it knows the devices, then hands the
        object the devices (this setter), the number of nodes, the ranks and the launcher, in that order. Taking
        the data-parallel class here, before any of the rest, is what makes ``Trainer(strategy="zenflow",
        devices=N, num_nodes=M)`` and ``Trainer(strategy=ZenFlowStrategy(...), devices=N)`` data parallel: the
        connector then configures the object as any DDP strategy (world ranks, launcher, distributed sampler).
        """
        if self._explicit_device:
            raise MisconfigurationException(
                f"ZenFlowStrategy(device={str(self._root_device)!r}) trains on that one device, but "
                f"devices={len(self._parallel_devices or [])} and num_nodes={self.num_nodes} were requested. Leave "
                "out `device` (the Trainer's accelerator and devices choose them) or use Trainer(devices=1)."
            )
        replacement = ZenFlowDDPStrategy(
            **self._knobs,
            accelerator=self._accelerator,
            parallel_devices=self._parallel_devices,
            cluster_environment=self.cluster_environment,
            checkpoint_io=self._checkpoint_io,
            precision_plugin=self._precision_plugin,
        )
        replacement._num_nodes = self.num_nodes
        self.__class__ = ZenFlowDDPStrategy  # type: ignore[assignment]
        self.__dict__.clear()
        self.__dict__.update(replacement.__dict__)

    @override
    def setup_environment(self) -> None:
        self._check_accelerator()
        super().setup_environment()
