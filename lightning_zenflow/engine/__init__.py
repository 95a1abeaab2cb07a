"""The framework-free ZenFlow core: torch only, no Lightning import."""

from lightning_zenflow.engine.device import HyperParams
from lightning_zenflow.engine.engine import StepStats, ZenFlowEngine, check_optimizer, choose_update_interval
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.engine.host import HostWorkerError
from lightning_zenflow.engine.preflight import HostResourceError

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
