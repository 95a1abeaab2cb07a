"""A hint for your own ``LightningCLI``: the short name ``zenflow`` takes no knob overrides there.

``--trainer.strategy=zenflow`` is a plain string to jsonargparse, and a string cannot take
``--trainer.strategy.topk_ratio=0.2`` on top of it; jsonargparse's message ("Expected a dot import path string:
zenflow") does not say what to write instead. ``import lightning_zenflow`` wraps the error of Lightning's argument
parser so that this one message gains a line naming the form that works. Any other message is left as it is.
(The package's own ``lightning-zenflow`` command rewrites the short name itself.)
"""

from __future__ import annotations

from typing import Any

HINT = (
    "tip: --trainer.strategy=zenflow is a plain string to LightningCLI and takes no --trainer.strategy.<knob>; "
    "name the class instead: --trainer.strategy=lightning_zenflow.ZenFlowStrategy --trainer.strategy.topk_ratio=0.2 "
    "(in YAML: strategy: {class_path: lightning_zenflow.ZenFlowStrategy, init_args: {topk_ratio: 0.2}})"
)
SHORT_NAMES = ("zenflow", "zenflow_ddp", "zenflow_ddp_spawn")


def needs_hint(message: str) -> bool:
    """jsonargparse's report of a knob set on the strategy's short name."""
    return "trainer.strategy" in message and any(
        f"Expected a dot import path string: {name}" in message for name in SHORT_NAMES
    )


def install() -> None:
    """Wrap ``LightningArgumentParser.error`` once (idempotent)."""
    from lightning.pytorch.cli import LightningArgumentParser

    original = LightningArgumentParser.error
    if getattr(original, "zenflow_hint", False):
        return

    def error(self: Any, message: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(message, str) and needs_hint(message):
            message = f"{message}\n{HINT}"
        return original(self, message, *args, **kwargs)

    error.zenflow_hint = True  # type: ignore[attr-defined]
    error.__doc__ = original.__doc__
    LightningArgumentParser.error = error  # type: ignore[method-assign]
