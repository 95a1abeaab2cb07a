"""One line, once per process, for each thing the library does to the user's process or time.

The engine changes the training process where a user would not look for it: it pins the process to its share of
the cores with as many torch threads (``bind_cores``), so the script's own work between steps (an evaluation, a data
pipeline) runs on those only until the optimizer is closed; and the first steps build its fused
kernels with ``torch.compile`` (seconds, up to about half a minute with an empty compile cache). Each is said once, as
a :class:`ZenFlowNotice` (a ``UserWarning``), with how to change it.
``warnings.filterwarnings("ignore", category=ZenFlowNotice)`` silences them all.
"""

from __future__ import annotations

import warnings

_SAID: set[str] = set()


class ZenFlowNotice(UserWarning):
    """What lightning_zenflow does to the training process or its time (core pinning, a kernel build): said once."""


def notice_once(key: str, message: str) -> None:
    """Say ``message`` the first time ``key`` comes up in this process."""
    if key in _SAID:
        return
    _SAID.add(key)
    warnings.warn(f"lightning_zenflow: {message}", ZenFlowNotice, stacklevel=3)
