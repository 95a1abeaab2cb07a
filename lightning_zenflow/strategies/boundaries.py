"""The callback that applies host work in flight at the ``sync_on`` boundaries Lightning reaches through callbacks
(validation start, epoch end); ``strategies/base.py`` installs it while training runs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class SyncBoundaries(Callback):
    """Applies host work in flight at the ``sync_on`` boundaries that Lightning reaches through callbacks.

    It is the first callback of the Trainer while training runs, so the sync runs before the user's callbacks (and
    before the LightningModule's and the strategy's own hooks, which Lightning calls after the callbacks) see the model.
    """

    def __init__(self, strategy: Any) -> None:
        # strategy: the ZenFlowStrategyBase that owns the engine (not imported: base.py imports this room)
        self.strategy = strategy

    def __deepcopy__(self, memo: dict) -> SyncBoundaries:
        # a copy of the Trainer's callbacks (Lightning's own tests take one) refers to the same strategy: copying it
        # would copy the running engine, its worker's pipe and shared memory, whose copies then close their handles
        return type(self)(self.strategy)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "validation" in self.strategy.zenflow_config.sync_on:
            self.strategy.sync()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "epoch_end" in self.strategy.zenflow_config.sync_on:
            self.strategy.sync()
