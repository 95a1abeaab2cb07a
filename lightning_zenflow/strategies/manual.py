"""Manual optimization under ZenFlow (``automatic_optimization = False``): one engine per optimizer.

A LightningModule that steps its optimizers itself (a GAN's generator and discriminator, several Adams) returns
them from ``configure_optimizers`` as usual. At setup each ``torch.optim.Adam``/``AdamW`` becomes a
:class:`~lightning_zenflow.ZenFlowAdamW` with the strategy's knobs over the *same* param-group dicts (so an LR
scheduler built on the original optimizer, which writes those dicts, drives it), and ``self.optimizers()`` hands
those out: ``self.manual_backward(loss)``, ``opt.step()`` and ``opt.zero_grad()`` run ZenFlow's rule, each optimizer
with its own engine and host worker. A ``ZenFlowAdamW`` returned by ``configure_optimizers`` is taken as it is.

Checkpoints hold each optimizer's state as ``ZenFlowAdamW.state_dict()`` gives it (torch AdamW's format plus the
engine's exact extras under ``"zenflow"``): plain Lightning and AdamW read it, and ZenFlow resumes it exactly. The end
of ``fit`` applies everything in flight. One process only (data parallel and FSDP2 are refused for now).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine.optimizers import SUPPORTED_OPTIMIZERS
from lightning_zenflow.optim import ZenFlowAdamW

_FACADE_KNOBS = {
    "topk_ratio",
    "update_interval",
    "select_strategy",
    "select_interval",
    "full_warm_up_rounds",
    "overlap_step",
    "land_after",
    "overlap_after",
    "interim_step",
    "interim_kernel",
    "accumulate_on",
    "importance",
    "host_threads",
    "pt_reserved_cores_perc",
    "bind_cores",
    "worker_timeout_s",
}
"""The knobs of ``ZenFlowConfig`` that ``ZenFlowAdamW`` takes (the rest are the Trainer's business)."""


class ManualOptimizers:
    """The ``ZenFlowAdamW`` of each optimizer of a manually optimized module, and their states after the fit."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        config: ZenFlowConfig,
        names: dict[torch.Tensor, str],
        steps_per_epoch: int | None,
    ) -> None:
        self.originals = list(optimizers)
        self.facades = [
            _facade_of(optimizer, index, config, names, steps_per_epoch) for index, optimizer in enumerate(optimizers)
        ]
        self._final_states: dict[int, dict[str, Any]] = {}

    def state_of(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """A facade's state (while it trains, or as the fit left it), or None for an optimizer not ours."""
        if id(optimizer) in self._final_states:
            return self._final_states[id(optimizer)]
        if any(optimizer is facade for facade in self.facades):
            return optimizer.state_dict()
        return None

    def load(self, optimizer_states: Sequence[dict[str, Any]], where: str) -> None:
        """A checkpoint's optimizer states, one per optimizer in order (none: every optimizer starts fresh)."""
        if not optimizer_states:
            return
        if len(optimizer_states) != len(self.facades):
            raise MisconfigurationException(
                f"{where}: it holds {len(optimizer_states)} optimizer states, configure_optimizers returned "
                f"{len(self.facades)}; resume with the same optimizers."
            )
        for facade, state in zip(self.facades, optimizer_states):
            facade.load_state_dict(state)

    def wait_for_gradients(self) -> None:
        """Before a backward writes the gradients: every engine has read them (GPU-side, no host sync)."""
        for facade in self.facades:
            if facade.engine is not None:
                facade.engine.wait_for_gradients()

    def flush(self) -> None:
        for facade in self.facades:
            facade.flush()

    def sync(self) -> None:
        for facade in self.facades:
            facade.sync()

    def adopt_weights(self) -> None:
        for facade in self.facades:
            facade.adopt_weights()

    def close(self, cache_state: bool) -> None:
        """Stop every engine; ``cache_state``: keep each one's state for a checkpoint saved after the fit."""
        try:
            if cache_state:
                for facade in self.facades:
                    if facade.engine is not None and not facade.engine.closed:
                        self._final_states[id(facade)] = facade.state_dict()
        finally:
            for facade in self.facades:
                facade.close()


def _facade_of(
    optimizer: torch.optim.Optimizer,
    index: int,
    config: ZenFlowConfig,
    names: dict[torch.Tensor, str],
    steps_per_epoch: int | None,
) -> ZenFlowAdamW:
    if isinstance(optimizer, ZenFlowAdamW):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise MisconfigurationException(
            f"optimizer {index} of configure_optimizers is {type(optimizer).__module__}.{type(optimizer).__name__}; "
            f"ZenFlow runs {SUPPORTED_OPTIMIZERS} (or lightning_zenflow.ZenFlowAdamW) only. Return one of those."
        )
    for group_index, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad", False):
            raise MisconfigurationException(
                f"optimizer {index}, param group {group_index} sets amsgrad=True, which ZenFlow does not support; "
                "set amsgrad=False."
            )
    knobs = {name: getattr(config, name) for name in _FACADE_KNOBS}
    params = [{"params": list(group["params"])} for group in optimizer.param_groups]
    facade = ZenFlowAdamW(params, **knobs, steps_per_epoch=steps_per_epoch)
    for group_index, group in enumerate(optimizer.param_groups):
        # checkpoints key the engine's extras by the module's names (positions where a parameter has none)
        fallback = f"optimizer{index}.group{group_index}.param"
        group.setdefault(
            "param_names", [names.get(param, f"{fallback}{position}") for position, param in enumerate(group["params"])]
        )
    # the same dicts: a scheduler built on the original optimizer (or anything that edits its groups) drives this one;
    # an Adam's groups carry decoupled_weight_decay=False, which the engine reads, so an Adam stays Adam
    facade.param_groups = optimizer.param_groups

    return facade


def rebind_schedulers(configs: Sequence[Any], originals: Sequence[torch.optim.Optimizer], facades: Sequence) -> None:
    """Each LR scheduler built on an original optimizer now names its ZenFlowAdamW (the same param-group dicts):
    Lightning's ``LearningRateMonitor`` and the scheduler's own checks see one optimizer, the one that steps."""
    for config in configs:
        scheduler = config.scheduler
        for original, facade in zip(originals, facades):
            if getattr(scheduler, "optimizer", None) is original and facade is not original:
                scheduler.optimizer = facade
                _track_steps(facade)


def _track_steps(facade: ZenFlowAdamW) -> None:
    """What a scheduler does to the optimizer it is built on (torch marks ``step`` and counts its calls), for the
    facade it now names, so that it does not warn that ``step`` was replaced or not called."""
    if getattr(facade.step, "_wrapped_by_lr_sched", False):
        return
    step = facade.step

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        facade._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    facade.step = tracked_step  # type: ignore[method-assign]
