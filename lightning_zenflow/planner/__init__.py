"""Will a model fit a machine, with which knobs, and how fast: ``lightning-zenflow plan`` and
:func:`lightning_zenflow.plan` (``plan.py``), from the engine's own byte counts (``engine/budget.py``) and the cost
model of docs/performance.md. Imports torch only: Lightning and transformers are imported where a model source needs
them. A mixture of experts' compute counts the parameters one token runs through, its memory every expert
(``experts.py``)."""

from lightning_zenflow.planner.machine import Machine
from lightning_zenflow.planner.plan import Plan, plan
from lightning_zenflow.planner.sizes import PlanError, parse_size

__all__ = ["Machine", "Plan", "PlanError", "parse_size", "plan"]
