"""The framework-free ZenFlow core: torch only, no Lightning import."""

from lightning_zenflow.engine.device import HyperParams
from lightning_zenflow.engine.engine import ZenFlowEngine, choose_update_interval
from lightning_zenflow.engine.errors import HostResourceError, UnsupportedSetupError
from lightning_zenflow.engine.host import HostWorkerError
from lightning_zenflow.engine.optimizers import check_optimizer
from lightning_zenflow.engine.stats import StepStats

__all__ = [
    "HostResourceError",
    "HostWorkerError",
    "HyperParams",
    "StepStats",
    "UnsupportedSetupError",
    "ZenFlowEngine",
    "check_optimizer",
    "choose_update_interval",
]
