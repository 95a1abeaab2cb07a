"""lightning_zenflow: ZenFlow offloaded fine-tuning as a PyTorch Lightning strategy.

``import lightning_zenflow`` registers the strategy names ``"zenflow"``, ``"zenflow_ddp"``,
``"zenflow_ddp_spawn"`` and ``"zenflow_fsdp"`` (Lightning has no entry-point discovery for strategies, so the import
is what makes ``Trainer(strategy="zenflow")`` work). ``lightning_zenflow.ZenFlowAdamW`` is ZenFlow as a torch
optimizer, for any other training loop; ``lightning_zenflow.plan`` says whether a model fits a machine, with which
knobs, and how fast (``lightning-zenflow plan``).
"""

import importlib
import os
from typing import Any

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import (
    HostResourceError,
    HostWorkerError,
    StepStats,
    UnsupportedSetupError,
    ZenFlowEngine,
)
from lightning_zenflow.optim import ZenFlowAdamW
from lightning_zenflow.planner import plan

__version__ = "0.1.0"

_LIGHTNING_NAMES = {
    "CheckpointError": "lightning_zenflow.strategies.base",
    "ZenFlowFabricStrategy": "lightning_zenflow.integrations.fabric",
    "ZenFlowDDPStrategy": "lightning_zenflow.strategies.ddp",
    "ZenFlowFSDPStrategy": "lightning_zenflow.strategies.fsdp",
    "ZenFlowPrecision": "lightning_zenflow.strategies.precision",
    "ZenFlowStrategy": "lightning_zenflow.strategies.single",
    "ZenFlowTelemetry": "lightning_zenflow.strategies.telemetry",
}

# The spawned host worker imports this package only to reach lightning_zenflow.engine.host and needs no
# Lightning, whose import costs seconds; engine/host.py sets this variable for the child it starts. The
# Lightning names stay importable there, lazily.
if os.environ.get("LIGHTNING_ZENFLOW_HOST_WORKER") != "1":
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zenflow import cli_hint
    from lightning_zenflow.integrations.fabric import ZenFlowFabricStrategy
    from lightning_zenflow.strategies.base import CheckpointError
    from lightning_zenflow.strategies.ddp import ZenFlowDDPStrategy
    from lightning_zenflow.strategies.fsdp import ZenFlowFSDPStrategy
    from lightning_zenflow.strategies.precision import ZenFlowPrecision
    from lightning_zenflow.strategies.single import ZenFlowStrategy
    from lightning_zenflow.strategies.telemetry import ZenFlowTelemetry

    ZenFlowStrategy.register_strategies(StrategyRegistry)
    ZenFlowDDPStrategy.register_strategies(StrategyRegistry)
    ZenFlowFSDPStrategy.register_strategies(StrategyRegistry)
    ZenFlowFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    cli_hint.install()  # your own LightningCLI: a hint when a knob is set on the short name
else:

    def __getattr__(name: str) -> Any:
        if name in _LIGHTNING_NAMES:
            return getattr(importlib.import_module(_LIGHTNING_NAMES[name]), name)
        raise AttributeError(f"module 'lightning_zenflow' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "HostResourceError",
    "HostWorkerError",
    "StepStats",
    "UnsupportedSetupError",
    "ZenFlowAdamW",
    "ZenFlowConfig",
    "ZenFlowDDPStrategy",
    "ZenFlowFSDPStrategy",
    "ZenFlowEngine",
    "ZenFlowFabricStrategy",
    "ZenFlowPrecision",
    "ZenFlowStrategy",
    "ZenFlowTelemetry",
    "plan",
]
