"""Shared memory: the segments the host state lives in, how much room ``/dev/shm`` has, and the error when it runs out.

torch puts shared memory in ``/dev/shm``, a tmpfs whose pages are RAM; a container's ``/dev/shm`` is often small
(Docker's default is 64 MiB). ``engine/preflight.py`` compares the host state's size against it before anything is
allocated; :func:`shared_memory_error` words the failure of an allocation that fails anyway.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import torch

from lightning_zenflow.engine.errors import HostResourceError

SHM_PATH = "/dev/shm"


def shared_zeros(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero tensor allocated directly in shared memory.

    ``torch.zeros(...).share_memory_()`` builds the tensor in private memory and then copies it into a new shared
    segment: twice its size at the peak, and every page touched twice. Here the segment is created first (torch
    reserves all of its pages at once, so a full ``/dev/shm`` fails now rather than at a later page fault) and the
    tensor is a view of it; a new segment reads as zeros, so nothing is written.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def shm_space(shm_path: str = SHM_PATH) -> tuple[int | None, int | None]:
    """(free, total) bytes of the filesystem torch's shared memory lives on; None where it cannot be told."""
    if torch.multiprocessing.get_sharing_strategy() in ("file_descriptor", "file_system") and os.path.isdir(shm_path):
        with contextlib.suppress(OSError):
            stat = os.statvfs(shm_path)
            return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    return None, None


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def shm_size_flag(needed: int) -> str:
    """``docker run --shm-size`` for ``needed`` bytes: whole GiB, with room left for what else uses ``/dev/shm``
    (DataLoader workers pass their batches through it)."""
    return f"{math.ceil(needed / (1 << 30)) + 1}g"


def shared_memory_error(nbytes: int, error: BaseException, shm_path: str = SHM_PATH) -> HostResourceError:
    """The error for a shared allocation that failed anyway (e.g. something else filled ``/dev/shm`` meanwhile)."""
    shm_free, _ = shm_space(shm_path)
    free = format_bytes(shm_free) if shm_free is not None else "an unknown amount"
    return HostResourceError(
        f"ZenFlow could not allocate {format_bytes(nbytes)} of shared memory for its host state ({error}); "
        f"{shm_path} now has {free} free. Give the container more shared memory (docker run "
        f"--shm-size={shm_size_flag(nbytes)}) or free space in {shm_path}."
    )
