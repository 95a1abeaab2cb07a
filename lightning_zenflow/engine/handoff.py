"""Commands to the host worker over its pipe, shared tensors included, with their file descriptors passed on the pipe.

A tensor in shared memory travels between processes as a file descriptor (torch's ``file_descriptor`` sharing). Sent
with ``Connection.send`` after the worker has started (an engine's spec to a spare, the window rows of an
accumulation mode), multiprocessing hands each descriptor over through its *resource sharer*: a listening socket in a
``/tmp/pymp-*`` folder of the sending process and a thread that serves it. The folder is removed when that process
exits through Python; a process that ends otherwise (SIGKILL, ``os._exit``, a data-parallel rank that Lightning kills
when another fails) leaves it behind, one per process.

So the engine passes them itself, on the socket the pipe already is (``Pipe(duplex=True)`` is a ``socketpair`` on
Linux and macOS): :func:`send` pickles the message with multiprocessing's pickler while a recorder stands in for a
spawning process (torch's reducer then asks it, not the resource sharer, for each descriptor), sends the pickle and
then the recorded descriptors (``SCM_RIGHTS``); :func:`receive` takes the pickle, then the descriptors, and unpickles
with them. No listener, no thread, no folder. Every command to the worker goes this way (the worker reads them all
with :func:`receive`); its answers carry no tensors and use the pipe as it is.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.reduction
import os
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct("!I")
"""The count of descriptors that follow the pickle."""
_received = threading.local()
"""The descriptors of the message being unpickled on this thread (:class:`_PassedFd` takes its own from them)."""


class _PassedFd:
    """What the pickle holds in place of a descriptor: its place among the message's descriptors."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        # a descriptor of its own for the caller to close (torch's rebuild closes what it is given)
        return os.dup(_received.fds[self.index])


class _Recorder:
    """Stands in for a spawning process while a message is pickled: it records the descriptors to pass."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1

    DupFd = _PassedFd


def _socket_of(conn: multiprocessing.connection.Connection) -> socket.socket:
    """The pipe's socket (a duplicate of its descriptor, closed by the caller)."""
    return socket.socket(fileno=os.dup(conn.fileno()))


def send(conn: multiprocessing.connection.Connection, message: Any) -> None:
    """Send ``message`` to the worker (see the module docstring)."""
    recorder = _Recorder()
    multiprocessing.context.set_spawning_popen(recorder)
    try:
        payload = multiprocessing.reduction.ForkingPickler.dumps(message)
    finally:
        multiprocessing.context.set_spawning_popen(None)
    conn.send_bytes(_HEADER.pack(len(recorder.fds)) + bytes(payload))
    if recorder.fds:
        with _socket_of(conn) as sock:
            multiprocessing.reduction.sendfds(sock, recorder.fds)


def receive(conn: multiprocessing.connection.Connection) -> Any:
    """Receive a message sent with :func:`send` (a pipe wait: blocks until it comes; ``EOFError`` when the other end
    closed)."""
    data = conn.recv_bytes()
    (count,) = _HEADER.unpack_from(data)
    fds: list[int] = []
    if count:
        with _socket_of(conn) as sock:
            fds = list(multiprocessing.reduction.recvfds(sock, count))
    _received.fds = fds
    try:
        return multiprocessing.reduction.ForkingPickler.loads(data[_HEADER.size :])
    finally:
        _received.fds = []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
