"""Stand-in host worker entry points that break the protocol on purpose (module level: the spawned child
imports them by name). Each takes ``(conn, spec)`` like ``lightning_zenflow.engine.host.worker_main``."""

from __future__ import annotations

import os
import time

import lightning_zenflow.engine.handoff as handoff


def never_ready(conn, spec) -> None:
    time.sleep(60)


def says_hello(conn, spec) -> None:
    conn.send(("hello", os.getpid()))
    time.sleep(60)


def answers_the_wrong_update(conn, spec) -> None:
    conn.send(("ready", os.getpid()))
    _, seq, _slot, _jobs = handoff.receive(conn)
    conn.send(("done", seq + 41, 0.0))
    time.sleep(60)


def exits_on_update(conn, spec) -> None:
    conn.send(("ready", os.getpid()))
    handoff.receive(conn)
    conn.close()
