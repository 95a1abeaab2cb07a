"""Before the host state is built: does this machine have room for it? If not, one error with the figures and the fix.

The engine's host state is shared memory (``engine/layout.py``): per param group the rows of its
:class:`~lightning_zenflow.engine.layout.HostFormat` (6 B per matrix element with the default ``host_state="bf16"``,
12 to 16 B with ``"fp32"``, 4 or 8 B more for host-mode accumulation), a step counter per matrix and an 8 B column
index per matrix column, plus an 8 B heartbeat. torch
puts shared memory in ``/dev/shm``, a tmpfs whose pages are RAM, and a container's ``/dev/shm`` is often small
(Docker's default is 64 MiB). Unchecked, a run that does not fit dies inside torch ("unable to allocate shared
memory(shm) ... No space left on device") or is killed by the kernel's OOM killer, and nothing says how much it needed.

:func:`check_host_resources` compares, from the layout alone (nothing is allocated yet):

- **shared memory**: the host state against the free space of ``/dev/shm``;
- **RAM**: the host state plus the fixed buffers of the worker and of host-side accumulation against the memory
  the machine has available (``MemAvailable``) and, in a container, what its memory cgroup still allows;
- **pinning** (CUDA only): the host blocks are page-locked in place (``cudaHostRegister``). A soft
  ``RLIMIT_MEMLOCK`` (``ulimit -l``) below their size is raised to the hard limit; if the hard limit is still below,
  a warning names both figures and the fix. It is not an error: whether the limit applies to ``cudaHostRegister``
  depends on the driver and the system, and a hard check would refuse runs that work.

Setting the environment variable ``LIGHTNING_ZENFLOW_SKIP_PREFLIGHT=1`` skips the check (for a machine whose figures
mislead it, e.g. memory that is overcommitted on purpose).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.engine.accumulate import STAGING_SLOT_BYTES
from lightning_zenflow.engine.errors import HostResourceError
from lightning_zenflow.engine.host import UNPACK_SCRATCH_ELEMENTS
from lightning_zenflow.engine.layout import GroupLayout, HostFormat
from lightning_zenflow.engine.shm import SHM_PATH, format_bytes, shm_size_flag, shm_space

SKIP_ENV = "LIGHTNING_ZENFLOW_SKIP_PREFLIGHT"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_UNLIMITED_CGROUP = 1 << 60
"""A cgroup v1 memory limit above this is the kernel's way of saying "no limit"."""


@dataclass(frozen=True)
class HostNeeds:
    """What the engine will allocate on the host, in bytes."""

    shared_bytes: int
    """Every shared-memory segment of the host state (each rounded up to whole pages)."""
    ram_bytes: int
    """``shared_bytes`` plus the worker's unpack scratch and the host-side accumulation staging (an upper bound)."""
    pinned_bytes: int
    """What CUDA page-locks in place: the window rows (and an fp32 master that uploads) (0 on the CPU)."""
    matrix_elements: int
    bytes_per_element: int = 0
    """Host bytes per matrix element of the format (``HostFormat.bytes_per_element``)."""


@dataclass(frozen=True)
class MachineResources:
    """What the machine offers, in bytes; None where it could not be measured (that check is then skipped)."""

    shm_free_bytes: int | None
    shm_total_bytes: int | None
    ram_available_bytes: int | None
    ram_source: str
    """Where ``ram_available_bytes`` comes from: ``"MemAvailable"`` or the container's memory cgroup."""
    memlock_soft_bytes: int | None
    """``RLIMIT_MEMLOCK`` soft limit; None when unlimited."""
    memlock_hard_bytes: int | None


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


DEFAULT_FORMAT = HostFormat.resolve("bf16", master=False, accumulate_on="auto")


def host_needs(layout: Sequence[GroupLayout], device: torch.device, host_format: HostFormat | None = None) -> HostNeeds:
    """The host bytes the engine will allocate for ``layout`` in ``host_format``, computed without allocating."""
    host_format = host_format or DEFAULT_FORMAT
    shared = _pages(8)  # the worker's heartbeat
    elements = largest_matrix = pinned = 0
    row_bytes = [torch.empty((), dtype=host_format.moments).element_size()] * 2
    row_bytes += [torch.empty((), dtype=host_format.window).element_size()] * host_format.window_rows
    row_bytes += [4] if host_format.master else []
    for group in layout:
        shared += sum(_pages(size * group.host_numel) for size in row_bytes)  # each row is its own segment
        shared += _pages(4 * len(group.matrices))  # host step counts
        shared += _pages(8 * sum(slot.cols for slot in group.matrices))  # host-bound column indices
        elements += group.host_numel
        largest_matrix = max([largest_matrix] + [s.numel * s.param.element_size() for s in group.matrices])
        pinned += host_format.window_bytes * group.host_numel
        if host_format.master and any(slot.param.dtype == torch.float32 for slot in group.matrices):
            pinned += 4 * group.host_numel
    # accumulate_on="host" (chosen at the first step): two staging slots in the training process; the worker's
    # scratch for unpacking them. Counted always: an upper bound that is small next to the host state.
    staging = 2 * min(STAGING_SLOT_BYTES, largest_matrix) + 4 * UNPACK_SCRATCH_ELEMENTS
    return HostNeeds(
        shared_bytes=shared,
        ram_bytes=shared + staging,
        pinned_bytes=pinned if device.type == "cuda" else 0,
        matrix_elements=elements,
        bytes_per_element=host_format.bytes_per_element,
    )


# --------------------------------------------------------------------------------------------- measurements
def _read_int(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(path) as handle:
        text = handle.read().strip()
        return None if text == "max" else int(text)
    return None


def _stat_field(path: str, key: str) -> int:
    with contextlib.suppress(OSError, ValueError), open(path) as handle:
        for line in handle:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _cgroup_headroom() -> int | None:
    """What the memory cgroup of this process still allows (limit - usage + reclaimable file cache), or None.

    Shared memory pages are charged to the cgroup that touches them, so a container's limit applies to them
    even when the machine itself has plenty of memory.
    """
    headrooms = []
    # cgroup v2, then v1; inside a container the mount's root is the container's own group
    for base, limit_file, usage_file, stat_key in (
        ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        limit = _read_int(os.path.join(base, limit_file))
        usage = _read_int(os.path.join(base, usage_file))
        if limit is None or usage is None or limit >= _UNLIMITED_CGROUP:
            continue
        reclaimable = _stat_field(os.path.join(base, "memory.stat"), stat_key)
        headrooms.append(max(0, limit - usage + reclaimable))
    return min(headrooms) if headrooms else None


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _memlock() -> tuple[int | None, int | None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    return (None if soft == unlimited else soft), (None if hard == unlimited else hard)


def measure_machine(shm_path: str = SHM_PATH) -> MachineResources:
    """Measure free shared memory, available RAM (machine and container) and the locked-memory limits."""
    shm_free, shm_total = shm_space(shm_path)
    available, source = _mem_available(), "MemAvailable"
    headroom = _cgroup_headroom()
    if headroom is not None and (available is None or headroom < available):
        available, source = headroom, "the container's memory limit (cgroup)"
    soft, hard = _memlock()
    return MachineResources(
        shm_free_bytes=shm_free,
        shm_total_bytes=shm_total,
        ram_available_bytes=available,
        ram_source=source,
        memlock_soft_bytes=soft,
        memlock_hard_bytes=hard,
    )


# ------------------------------------------------------------------------------------------------- the check
def problems(needs: HostNeeds, machine: MachineResources, shm_path: str = SHM_PATH) -> list[str]:
    """The shortfalls of ``machine`` for ``needs``, each a sentence with both figures and its fix (empty: it fits)."""
    found = []
    what = f"the host state ({needs.matrix_elements / 1e6:.1f} M weight-matrix elements x {needs.bytes_per_element} B)"
    if machine.shm_free_bytes is not None and needs.shared_bytes > machine.shm_free_bytes:
        total = f" of {format_bytes(machine.shm_total_bytes)}" if machine.shm_total_bytes is not None else ""
        found.append(
            f"{what} needs {format_bytes(needs.shared_bytes)} of shared memory, but {shm_path} has only "
            f"{format_bytes(machine.shm_free_bytes)} free{total}. Give the container more shared memory "
            f"(docker run --shm-size={shm_size_flag(needs.shared_bytes)}; Kubernetes: an emptyDir volume with "
            f"medium: Memory mounted at {shm_path}), or free space in {shm_path}"
        )
    if machine.ram_available_bytes is not None and needs.ram_bytes > machine.ram_available_bytes:
        found.append(
            f"{what} and the worker's buffers need {format_bytes(needs.ram_bytes)} of RAM, but only "
            f"{format_bytes(machine.ram_available_bytes)} is available ({machine.ram_source}). Run on a machine "
            "(or in a container) with more memory, or stop what else uses it"
        )
    return found


def _check_memlock(needs: HostNeeds, machine: MachineResources) -> None:
    soft, hard = machine.memlock_soft_bytes, machine.memlock_hard_bytes
    if needs.pinned_bytes == 0 or soft is None or soft >= needs.pinned_bytes:
        return
    # raising the soft limit up to the hard one needs no privilege
    target = needs.pinned_bytes if hard is None else min(hard, needs.pinned_bytes)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (target, resource.RLIM_INFINITY if hard is None else hard))
        soft = target
    if soft >= needs.pinned_bytes:
        return
    warnings.warn(
        f"ZenFlow page-locks {format_bytes(needs.pinned_bytes)} of host memory for fast copies (cudaHostRegister), "
        f"but the locked-memory limit (ulimit -l) is {format_bytes(hard if hard is not None else soft)}. If pinning "
        "fails (whether the limit applies depends on the driver), raise it: ulimit -l unlimited, or docker run "
        "--ulimit memlock=-1.",
        stacklevel=3,
    )


def check_host_resources(
    layout: Sequence[GroupLayout],
    device: torch.device,
    machine: MachineResources | None = None,
    ranks_per_host: int = 1,
    *,
    host_format: HostFormat | None = None,
) -> HostNeeds:
    """Raise :class:`HostResourceError` if the host state of ``layout`` does not fit this machine; returns the needs.

    Runs before anything is allocated. ``machine``: the measured resources (measured now when None).
    ``ranks_per_host``: data-parallel ranks on this machine, each allocating a share like this one at the same
    time; the machine must hold all of them. ``host_format``: what the host holds per element (the default
    format when None).
    """
    needs = host_needs(layout, device, host_format)
    if ranks_per_host > 1:
        needs = dataclasses.replace(
            needs,
            shared_bytes=needs.shared_bytes * ranks_per_host,
            ram_bytes=needs.ram_bytes * ranks_per_host,
            pinned_bytes=needs.pinned_bytes,  # the locked-memory limit is per process
        )
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return needs
    machine = machine if machine is not None else measure_machine()
    found = problems(needs, machine)
    if found:
        raise HostResourceError(
            "ZenFlow cannot start: "
            + "; and ".join(found)
            + ". Fewer host bytes also help: a smaller model, or freezing parameters (requires_grad=False). "
            f"({SKIP_ENV}=1 skips this check.)"
        )
    _check_memlock(needs, machine)
    return needs
