"""Lightning Fabric: ``Fabric(strategy="zenflow", devices=N)`` runs :class:`~lightning_zenflow.ZenFlowAdamW` data
parallel, the host state sharded by rows across the ranks as in the DDP strategy.

On one device Fabric needs nothing from this module: ``fabric.setup(model, ZenFlowAdamW(...))`` under any
single-device strategy works as with AdamW. On several, this strategy is Fabric's DDP (the gradients are all-reduced
in backward) that hands each ZenFlowAdamW the ranks of its process group and refuses any other optimizer (an AdamW
would silently run without ZenFlow). ``fabric.save`` takes the optimizer's state on every rank (the host rows are
gathered to rank 0), with the update in flight carried, not applied.
``import lightning_zenflow`` registers the names ``"zenflow"`` (the script is relaunched per rank, as Fabric's
``"ddp"``) and ``"zenflow_spawn"`` (ranks spawned, as ``"ddp_spawn"``).
"""

from __future__ import annotations

import os

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from typing_extensions import override

from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.optim import ZenFlowAdamW


class ZenFlowFabricStrategy(DDPStrategy):
    """Fabric's DDP for :class:`~lightning_zenflow.ZenFlowAdamW` (every keyword of Fabric's ``DDPStrategy``)."""

    strategy_name = "zenflow"

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not isinstance(optimizer, ZenFlowAdamW):
            raise UnsupportedSetupError(
                f"Fabric(strategy='zenflow') trains lightning_zenflow.ZenFlowAdamW, got {type(optimizer).__name__}: "
                "build the optimizer as ZenFlowAdamW(model.parameters(), lr=..., topk_ratio=...) before "
                "fabric.setup(model, optimizer)."
            )
        if optimizer.engine is None:
            # the engine starts at the first step; it shards its host state over this strategy's ranks
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", len(self.parallel_devices or [None])))
            optimizer._zenflow.ranks = Ranks.from_process_group(
                local_rank=self.local_rank, local_world=max(local_world, self.local_rank + 1)
            )
        return super().setup_optimizer(optimizer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("zenflow", "popen"), ("zenflow_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"ZenFlowAdamW data parallel, host state sharded by rows ({start_method!r})",
                    start_method=start_method,
                )
