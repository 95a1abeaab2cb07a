"""What the Lightning Trainer strategies share: the engine's lifecycle, the sync boundaries, the checkpoint hooks
(``checkpoints/hooks.py``, a base of this one).

:class:`ZenFlowStrategyBase` is mixed into the one-device strategy (``strategies/single.py``), the data-parallel one
(``strategies/ddp.py``) and FSDP2's (``strategies/fsdp.py``); the engine does the rest. The user's torch optimizer
stays the object Lightning sees; its ``step()`` is never called: ``ZenFlowPrecision.optimizer_step`` hands the
gradients to the engine instead.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import fields
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_zenflow.checkpoints.hooks import CheckpointHooks
from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import UnsupportedSetupError, ZenFlowEngine, spares
from lightning_zenflow.engine.optimizers import SUPPORTED_OPTIMIZERS, check_optimizer
from lightning_zenflow.engine.prestart import prestart_worker
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.matrices import matrix_columns
from lightning_zenflow.strategies.boundaries import SyncBoundaries as _SyncBoundaries
from lightning_zenflow.strategies.manual import ManualOptimizers
from lightning_zenflow.strategies.optimizer_view import OptimizerStateView
from lightning_zenflow.strategies.precision import ZenFlowPrecision
from lightning_zenflow.strategies.telemetry import ZenFlowTelemetry

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""Default bound on any collective of the multi-rank strategies: a rank that stopped answering (its process died,
or it hangs) fails the others after this long instead of Lightning's 30 minutes. Raise it when a rank may
legitimately lag that long (e.g. rank 0 writing a large checkpoint to a slow disk while the others wait at a
barrier)."""


def zenflow_knobs(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The ZenFlow knobs among a strategy's ``__init__`` arguments (``locals()``), as :class:`ZenFlowConfig` takes
    them."""
    knobs = {field.name: arguments[field.name] for field in fields(ZenFlowConfig) if field.name in arguments}
    knobs["sync_on"] = tuple(knobs["sync_on"])
    return knobs


class ZenFlowStrategyBase(CheckpointHooks):
    """What the one-device and the data-parallel ZenFlow strategies share: the engine's lifecycle, the sync
    boundaries, the optimizer step (through :class:`ZenFlowPrecision`) and checkpoints.

    A mixin ahead of a Lightning strategy class in the bases (``ZenFlowStrategy(ZenFlowStrategyBase,
    SingleDeviceStrategy)``): ``super()`` here reaches the Lightning class.
    """

    zenflow_config: ZenFlowConfig

    def _init_zenflow(self, knobs: Mapping[str, Any]) -> None:
        # validated here, before any Trainer exists: a bad knob fails at construction with the fix named
        self.zenflow_config = ZenFlowConfig(**knobs)
        # the host worker's start (a new interpreter importing torch, about a second) overlaps the Trainer's and the
        # model's construction and the fit's set-up: the fit's engine adopts it (the strategy itself holds nothing)
        prestart_worker()
        self.engine: ZenFlowEngine | None = None
        # after fit: (torch state or None, engine state, matrix shapes or None), for trainer.save_checkpoint
        self._final_state: tuple[dict | None, dict, dict | None] | None = None
        self._manual: ManualOptimizers | None = None
        self._checkpoint_path: str | None = None
        self._own_callbacks: list[Callback] = []

    def __deepcopy__(self, memo: dict) -> ZenFlowStrategyBase:
        """A copy holds no running engine (its worker's pipe, its shared memory and its threads belong to this one):
        where the copy would reach it, it has None. Lightning's own tests deep-copy ``trainer.callbacks`` (a progress
        bar refers to the Trainer, and so to this strategy), at ``on_fit_start`` too; plain Lightning copies its
        strategy whole there. A manually optimized module's ``ZenFlowAdamW`` copies carry its state (each starts its
        own engine if it ever steps)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        if self.engine is not None:
            memo[id(self.engine)] = None
        # Lightning's own pickling state (it leaves out the LightningOptimizer wrappers and rebuilds them)
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def _engine_ranks(self) -> Ranks:
        """The data-parallel ranks the engine shards its host state across (one here)."""
        return Ranks()

    def _engine_row_offsets(self) -> dict[str, int] | None:
        """Where each parameter's rows start in the whole parameter, where the engine sees a shard (FSDP2)."""
        return None

    def _matrix_columns(self) -> dict[str, int]:
        """The columns of each stack of expert matrices' view (``lightning_zenflow/matrices.py``), by name."""
        return matrix_columns(self.lightning_module, self.zenflow_config.expert_layouts)

    def _engine_parameters(self) -> tuple[torch.optim.Optimizer, dict[torch.Tensor, str]]:
        """The optimizer the engine runs and the names of its parameters: the user's, with the module's names."""
        names = {param: name for name, param in self.lightning_module.named_parameters()}
        return self.optimizers[0], names

    @property  # type: ignore[override]
    def precision_plugin(self) -> ZenFlowPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = ZenFlowPrecision("32-true", device=self.root_device.type)
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector hands any strategy chosen by name a generic plugin: wrap it
        self._precision_plugin = None if plugin is None else ZenFlowPrecision.from_plugin(plugin)

    def _check_accelerator(self) -> None:
        if self.root_device.type not in ("cpu", "cuda"):
            raise MisconfigurationException(
                f"ZenFlow supports the 'cuda' and 'cpu' accelerators, got {self.root_device.type!r}."
            )

    # ---------------------------------------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_module(trainer.lightning_module)
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._final_state = None
        self._manual = None
        # the next fit of this process adopts this one's worker instead of spawning one (engine/spares.py)
        spares.keep_spare_workers_by_default()
        if not trainer.lightning_module.automatic_optimization:
            self._setup_manual(trainer)
            return
        self._check_optimizers(trainer)
        optimizer, names = self._engine_parameters()
        self.engine = ZenFlowEngine(
            optimizer,
            self.zenflow_config,
            param_names=names,
            ranks=self._engine_ranks(),
            row_offsets=self._engine_row_offsets(),
            matrix_columns=self._matrix_columns(),
        ).start()
        self.precision_plugin.engine = self.engine
        if optimizer is self.optimizers[0] and self.engine.ranks.world == 1:
            # one process: the optimizer Lightning hands out shows the engine's state (a gather under data
            # parallel would need every rank, so there it keeps torch's own, empty, state)
            self._state_view = OptimizerStateView(optimizer, self)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as error:
            # Lightning's own message sends the user to manual optimization, which ZenFlow cannot run
            if "multiple optimizers" not in str(error):
                raise
            raise MisconfigurationException(
                "ZenFlowStrategy supports exactly one optimizer under automatic optimization; configure_optimizers "
                "returned several. Return a single torch.optim.AdamW, with one param group per setting if the "
                "parameters need different hyperparameters, or step them yourself (automatic_optimization=False: "
                "each optimizer then gets its own engine)."
            ) from error

    def _check_module(self, module: pl.LightningModule) -> None:
        for name, submodule in module.named_modules():
            sparse = isinstance(submodule, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and submodule.sparse
            if sparse and submodule.weight.requires_grad:
                raise UnsupportedSetupError(
                    f"{name or type(submodule).__name__} is an {type(submodule).__name__} with sparse=True: its "
                    "gradient is a sparse tensor, which ZenFlow's column split cannot take. Build it with "
                    "sparse=False (dense gradients; AdamW needs them anyway), or freeze it."
                )

    def _check_optimizers(self, trainer: pl.Trainer) -> None:
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"ZenFlowStrategy supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}. Return a single torch.optim.AdamW (param groups are fine)."
            )
        optimizer = self.optimizers[0]
        if type(optimizer).__name__ == "_MockOptimizer":  # Lightning's stand-in when configure_optimizers returns None
            raise MisconfigurationException(
                "configure_optimizers returned None (Lightning would train without an optimizer); ZenFlow is an "
                "optimizer. Return torch.optim.AdamW(...) from configure_optimizers, or train this module with "
                "strategy='auto'."
            )
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise MisconfigurationException(
                f"ZenFlowStrategy runs {SUPPORTED_OPTIMIZERS} only; configure_optimizers returned "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}. Return torch.optim.AdamW(...) instead."
            )
        for index, group in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag, False):
                    raise MisconfigurationException(
                        f"param group {index} sets {flag}=True, which ZenFlow does not support; set {flag}=False."
                    )
        check_optimizer(optimizer)  # an Adam/AdamW subclass whose step or state methods would be skipped
        if trainer.gradient_clip_algorithm not in (None, "norm", "value"):
            raise MisconfigurationException(f"unknown gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}.")

    def _setup_manual(self, trainer: pl.Trainer) -> None:
        """Manual optimization: every optimizer becomes a ZenFlowAdamW with its own engine (``manual.py``)."""
        if self.world_size > 1 or not self._manual_supported:
            raise MisconfigurationException(
                f"{type(self).__name__} runs manual optimization (automatic_optimization=False) on one device only; "
                "train it with strategy='zenflow' on one device, or let Lightning call backward and step (automatic "
                "optimization) to train data parallel."
            )
        if self._sharded_checkpoints:
            raise MisconfigurationException(
                "checkpoint_format='sharded' is for one engine's row blocks; with manual optimization each optimizer "
                "saves its state in the checkpoint file: use checkpoint_format='full'."
            )
        names = {param: name for name, param in trainer.lightning_module.named_parameters()}
        steps = trainer.num_training_batches
        steps_per_epoch = steps if isinstance(steps, int) and steps > 0 else None
        self._manual = ManualOptimizers(self.optimizers, self.zenflow_config, names, steps_per_epoch)
        self.optimizers = self._manual.facades
        self.precision_plugin.manual = self._manual

    _manual_supported = True
    """False where manual optimization is refused (FSDP2)."""

    def _install_callbacks(self, trainer: pl.Trainer) -> None:
        """ZenFlow's callbacks join the Trainer's at the start of training (this strategy's ``on_train_start``, which
        Lightning calls after the callbacks' own) and leave at teardown: before and after, ``trainer.callbacks`` is
        what plain Lightning has (Lightning's own tests compare copies taken at ``on_fit_start`` and after the fit).
        Before training starts there is nothing to sync (the sanity check runs before any step)."""
        self._own_callbacks = [_SyncBoundaries(self)]
        if self.zenflow_config.log_telemetry and not any(isinstance(c, ZenFlowTelemetry) for c in trainer.callbacks):
            self._own_callbacks.append(ZenFlowTelemetry())
        # ahead of the user's callbacks: the boundary sync must run before e.g. checkpointing sees the model
        trainer.callbacks[:0] = self._own_callbacks
        for callback in self._own_callbacks:
            callback.on_train_start(trainer, trainer.lightning_module)  # Lightning called the others' already

    def _remove_callbacks(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            trainer.callbacks[:] = [c for c in trainer.callbacks if all(c is not own for own in self._own_callbacks)]
        self._own_callbacks = []

    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        if self.engine is not None:
            steps = trainer.num_training_batches
            if isinstance(steps, int) and steps > 0:
                self.engine.set_steps_per_epoch(math.ceil(steps / max(1, trainer.accumulate_grad_batches)))
        installed = any(c is own for own in self._own_callbacks for c in trainer.callbacks)
        # not during the learning-rate finder's run (it reads its own callback back as the first); installed again
        # for the fit after it, which gets the Trainer's callbacks back as they were before the finder
        tuning = any(type(c).__name__ == "_LRCallback" for c in trainer.callbacks)
        if (self.engine is not None or self._manual is not None) and not installed and not tuning:
            self._install_callbacks(trainer)
        super().on_train_start()

    @override
    def on_train_end(self) -> None:
        # the end of training closes the open window and applies everything: the weights hold every gradient
        if self.engine is not None:
            self.engine.flush()
            self.engine.wait_for_update()
        if self._manual is not None:
            self._manual.flush()
        super().on_train_end()

    def adopt_weights(self) -> None:
        """After editing parameters in place during fit (a weight clamp in ``on_train_batch_end``, say): make the
        edited weights the engine's masters (:meth:`ZenFlowEngine.adopt_weights`); a no-op outside fit."""
        if self.engine is not None:
            self.engine.adopt_weights()
            self.engine.wait_for_update()
        if self._manual is not None:
            self._manual.adopt_weights()

    def sync(self) -> None:
        """Apply the host update in flight (if fitting); the model then holds every finished update."""
        if self.engine is not None:
            self.engine.sync()
            # GPU-side: whatever reads the weights next on the compute stream runs after the side stream's writes
            self.engine.wait_for_update()
        if self._manual is not None:
            self._manual.sync()

    @override
    def on_validation_start(self) -> None:
        # normally a no-op by now: _SyncBoundaries synced before the callbacks ran (Lightning calls the
        # strategy's hook last); kept for a Trainer whose callback list was rebuilt after setup
        if "validation" in self.zenflow_config.sync_on:
            self.sync()
        super().on_validation_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            # every forward passes here, also the accumulating micro-batches that bypass optimizer_step
            self.engine.wait_for_update()
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            self.engine.wait_for_update()
        return super().validation_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # stop the worker at once (no flush): teardown follows and must not wait on a broken run
        self._close_engine(cache_state=False)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._close_engine(cache_state=True)
        self._remove_callbacks()
        super().teardown()

    def _close_engine(self, cache_state: bool) -> None:
        if self._manual is not None:
            self.precision_plugin.manual = None
            self._manual.close(cache_state)  # its states stay readable for a checkpoint saved after the fit
        view = getattr(self, "_state_view", None)
        if view is not None:
            view.remove()
            self._state_view = None
        engine = self.engine
        if engine is None:
            return
        self.engine = None
        self.precision_plugin.engine = None
        try:
            if cache_state and not engine.closed:
                # trainer.save_checkpoint() after fit must still find the optimizer state
                self._final_state = self._final_state_of(engine)
        finally:
            engine.close()
