"""A host worker started ahead of the engine that will adopt it.

The worker's start is a new interpreter importing torch (about a second here). Started when the strategy or
``ZenFlowAdamW`` is built, it overlaps whatever the program does before the engine needs it: building the Trainer and
the model, the fit's set-up, the first steps (the engine waits for the worker's "ready" at its first use, not at its
start: ``engine/host.py``). It waits as a spare (``engine/spares.py``) and is stopped at exit if nobody adopts it.
"""

from __future__ import annotations

import lightning_zenflow.engine.spares as spares
from lightning_zenflow.engine.host import spawn_process, worker_main


def prestart_worker() -> None:
    """Start a worker now for this process's next engine. Nothing when the program turned spares off, a spare waits
    already, or this is not a main program (a host worker, a child of another process)."""
    if not spares.may_prestart():
        return
    process, conn = spawn_process(worker_main, None)
    spares.keep(process, conn, prestarted=True)
