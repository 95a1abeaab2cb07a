"""The Hugging Face ``Trainer`` with :class:`~lightning_zenflow.ZenFlowAdamW`.

    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data,
        optimizers=(ZenFlowAdamW(model.parameters(), lr=args.learning_rate, topk_ratio=0.1), None),
        callbacks=[ZenFlowCallback()],
    )

The Trainer builds the LR schedule over the optimizer's param groups, clips (``max_grad_norm``) before ``step``,
saves ``optimizer.state_dict()`` in every checkpoint (torch AdamW's format with ZenFlow's exact extras) and loads it
at ``resume_from_checkpoint``, so a resumed run continues bitwise. What it does not know is that ZenFlow holds up to a
window of updates in flight: :class:`ZenFlowCallback` applies them when training ends (before the Trainer saves and
evaluates the final model) and stops the host worker.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from lightning_zenflow.optim import ZenFlowAdamW


def _zenflow_optimizers(optimizer: Any) -> list[ZenFlowAdamW]:
    # accelerate wraps the optimizer (AcceleratedOptimizer.optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    return [inner] if isinstance(inner, ZenFlowAdamW) else []


class ZenFlowCallback(TrainerCallback):
    """At the end of training: every host update applied (the final weights hold every gradient), worker stopped."""

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        for zenflow in _zenflow_optimizers(optimizer):
            zenflow.flush()
            zenflow.close()
