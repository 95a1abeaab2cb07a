"""While ZenFlow trains, the optimizer Lightning hands out (``trainer.optimizers[0]``) shows the engine's state."""

from __future__ import annotations

from typing import Any

import torch


class OptimizerStateView:
    """While ZenFlow trains, the user's optimizer's ``state_dict()`` is the engine's state in torch AdamW's format
    (the moments and steps a checkpoint holds; reading it waits for the update in flight to finish computing and
    changes nothing), and its ``load_state_dict()`` loads into the engine. Undone by :meth:`remove`."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Any) -> None:
        # strategy: the ZenFlowStrategyBase that owns the engine (not imported: base.py imports this room)
        self.optimizer = optimizer

        def state_dict() -> dict[str, Any]:
            return strategy.optimizer_state(optimizer)

        def load_state_dict(state_dict: dict[str, Any]) -> None:
            if strategy.engine is None:
                return torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
            strategy.engine.load_torch_state_dict(state_dict)
            for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
                group.update({key: value for key, value in saved.items() if key != "params"})
            return None

        optimizer.state_dict = state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]

    def remove(self) -> None:
        for name in ("state_dict", "load_state_dict"):
            vars(self.optimizer).pop(name, None)
