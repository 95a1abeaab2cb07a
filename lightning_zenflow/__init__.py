"""lightning_zenflow: ZenFlow offloaded fine-tuning as a PyTorch Lightning strategy.

``import lightning_zenflow`` registers the strategy names ``"zenflow"``, ``"zenflow_ddp"``,
``"zenflow_ddp_spawn"`` and ``"zenflow_fsdp"`` (Lightning has no entry-point discovery for strategies, so the import
is what makes ``Trainer(strategy="zenflow")`` work), and Fabric's ``"zenflow"``: at once when Lightning is imported
already, else when it is. ``lightning_zenflow.ZenFlowAdamW`` is ZenFlow as a torch optimizer, for any other training
loop; importing it (or ``lightning_zenflow.engine``) imports no Lightning module. The Lightning classes
(``ZenFlowStrategy``, ...) load at their first use. ``lightning_zenflow.plan`` says whether a model fits a machine,
with which knobs, and how fast (``lightning-zenflow plan``).
"""

import importlib
from typing import Any

from lightning_zenflow import registration
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
    "CheckpointError": "lightning_zenflow.checkpoints.hooks",
    "ZenFlowFabricStrategy": "lightning_zenflow.integrations.fabric",
    "ZenFlowDDPStrategy": "lightning_zenflow.strategies.ddp",
    "ZenFlowFSDPStrategy": "lightning_zenflow.strategies.fsdp",
    "ZenFlowPrecision": "lightning_zenflow.strategies.precision",
    "ZenFlowStrategy": "lightning_zenflow.strategies.single",
    "ZenFlowTelemetry": "lightning_zenflow.strategies.telemetry",
}

# Lightning loads only when used: the names above import no Lightning module (nor jsonargparse), and the strategy
# names are registered when the lightning package is imported, now or later (registration.py).
registration.install()


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        return getattr(importlib.import_module(_LIGHTNING_NAMES[name]), name)
    raise AttributeError(f"module 'lightning_zenflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIGHTNING_NAMES})


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
