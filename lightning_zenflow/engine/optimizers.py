"""The torch optimizer the engine drives: which ones it runs, and the ``zero_grad`` guard it installs.

The engine never calls ``optimizer.step()``, ``state_dict()`` or ``load_state_dict()`` (it does the update and
keeps the state): an optimizer whose own versions of these would be skipped is refused up front.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_zenflow.engine.errors import UnsupportedSetupError

SUPPORTED_OPTIMIZERS = "torch.optim.AdamW and torch.optim.Adam"


BYPASSED_METHODS = ("step", "state_dict", "load_state_dict")
"""Optimizer methods the engine (and the strategy's checkpoints) never call: a subclass's own version would be
silently skipped, so it is refused."""


def check_optimizer(optimizer: object, allow_maximize: bool = False) -> None:
    """Raise a clear error for an optimizer the engine cannot run. ``allow_maximize``: the caller negates the gradients
    of ``maximize=True`` groups before the engine reads them (``ZenFlowAdamW.step`` does)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"ZenFlow runs {SUPPORTED_OPTIMIZERS} only, got {type(optimizer).__module__}.{type(optimizer).__name__}. "
            "Return torch.optim.AdamW(...) (or Adam) from configure_optimizers."
        )
    base = torch.optim.AdamW if isinstance(optimizer, torch.optim.AdamW) else torch.optim.Adam
    mro = type(optimizer).__mro__
    for position, cls in enumerate(mro):
        if cls is base or vars(cls).get("zenflow_facade", False):
            break  # up to AdamW/Adam itself, or lightning_zenflow.ZenFlowAdamW, whose step drives this engine
        overridden = [name for name in BYPASSED_METHODS if _overrides(cls, name, mro[position + 1 :])]
        if not overridden:
            continue
        facade = next((c for c in mro[position + 1 :] if vars(c).get("zenflow_facade", False)), None)
        if facade is not None:
            raise UnsupportedSetupError(
                f"{cls.__module__}.{cls.__qualname__} overrides {', '.join(overridden)} of {facade.__name__}, whose "
                "step, state_dict and load_state_dict drive ZenFlow's engine and keep its state: a subclass may preset "
                "knobs in __init__ only. Put the extra work around optimizer.step() in the training loop, or in a step "
                "hook (register_step_pre_hook / register_step_post_hook)."
            )
        raise UnsupportedSetupError(
            f"{cls.__module__}.{cls.__qualname__} overrides {', '.join(overridden)} of {base.__name__}, which "
            "ZenFlow never calls (its engine does the update and its state): that code would be skipped silently. "
            f"Use torch.optim.{base.__name__} itself, and put the extra work in a callback or the training step."
        )
    flags = [("amsgrad", "amsgrad=False")]
    if not allow_maximize:
        flags.append(("maximize", "maximize=False (negate the loss instead)"))
    for index, group in enumerate(optimizer.param_groups):
        for flag, fix in flags:
            if group.get(flag, False):
                raise UnsupportedSetupError(
                    f"param group {index} sets {flag}=True, which ZenFlow does not support; use {fix}."
                )


def _overrides(cls: type, name: str, later: tuple[type, ...]) -> bool:
    """Whether ``cls`` defines its own ``name``, not just a wrapper of the one it inherits from ``later`` (the rest of
    its MRO). torch wraps ``step`` in a profiling hook the first time a class is instantiated and stores the wrapper
    on that class: a subclass instantiated before its parent holds a wrapper of the parent's ``step``."""
    if name not in vars(cls):
        return False
    inherited = next((vars(c)[name] for c in later if name in vars(c)), None)
    return _innermost(vars(cls)[name]) is not _innermost(inherited)


class ZeroGradGuard:
    """While the engine runs, the optimizer's ``zero_grad`` first calls ``before`` (the engine's GPU-side wait until
    its device work has read the gradients: ``zero_grad(set_to_none=False)`` zeroes them in place). Undone by
    :meth:`remove`."""

    def __init__(self, optimizer: torch.optim.Optimizer, before: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self._own = "zero_grad" in vars(optimizer)
        self._saved: Callable[..., None] | None = optimizer.zero_grad

        def zero_grad(*args: object, **kwargs: object) -> None:
            before()
            return self._saved(*args, **kwargs)  # type: ignore[misc]

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._saved is None:
            return
        if self._own:
            self.optimizer.zero_grad = self._saved  # type: ignore[method-assign]
        else:
            vars(self.optimizer).pop("zero_grad", None)
        self._saved = None


def _innermost(function: object) -> object:
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function
