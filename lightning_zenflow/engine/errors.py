"""The errors a setup that ZenFlow cannot honour raises before training starts."""

from __future__ import annotations


class UnsupportedSetupError(ValueError):
    """Something the engine would silently not honour (an optimizer whose ``step`` is its own, sparse gradients,
    float64 parameters): refused at setup, in one line that names it and the fix."""


class HostResourceError(RuntimeError):
    """The machine lacks the shared memory or RAM the host state needs; the message gives the figures and the fix."""
