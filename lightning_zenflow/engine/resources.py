"""What an engine holds on the machine beyond its buffers: pinned pages, the host worker, the cores it runs on.

:func:`pin_host_buffers` registers the rows of the shared blocks that asynchronous copies touch (CUDA only);
:func:`start_worker` splits the cores between the training process and the worker and spawns the worker;
:class:`CoreBinding` restores the training process's cores and threads when the engine closes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine.host import HostWorker, MatrixExtent, WorkerGroup, WorkerSpec
from lightning_zenflow.engine.layout import GroupHostBuffers, GroupLayout
from lightning_zenflow.engine.notices import notice_once
from lightning_zenflow.engine.ranks import Ranks


def pin_host_buffers(
    layout: Sequence[GroupLayout], host_buffers: Sequence[GroupHostBuffers], device: torch.device
) -> list[tuple[torch.Tensor, int]]:
    """Register in place (cudaHostRegister) the rows that asynchronous copies touch: the window rows (copies down,
    the steps or staged weights going up, a selection's staging), and the master of a group with an fp32 matrix
    where the host keeps masters (its weights go up from the master). ``pin_memory()`` would copy them out of shared
    memory; the moments are never copied asynchronously and stay unpinned.

    Returns (row, address) of every registered span: the row keeps its pages mapped until unregistered."""
    rows = []
    for group, host in zip(layout, host_buffers):
        rows += list(host.windows)
        if host.master is not None and any(slot.param.dtype == torch.float32 for slot in group.matrices):
            rows.append(host.master)
    return pin_rows(rows, device)


def pin_rows(rows: Sequence[torch.Tensor], device: torch.device) -> list[tuple[torch.Tensor, int]]:
    """Register each of ``rows`` in place (cudaHostRegister); on a failure, unregister what was and raise. The calls
    are made on ``device``, the engine's: on the current device they would create a CUDA context there (about 0.5 GiB
    on GPU 0 for every rank that did not call ``torch.cuda.set_device``)."""
    cudart = torch.cuda.cudart()
    pinned: list[tuple[torch.Tensor, int]] = []
    with torch.cuda.device(device):
        for tensor in rows:
            if tensor.numel() == 0:
                continue
            pointer, nbytes = tensor.data_ptr(), tensor.nbytes
            code = cudart.cudaHostRegister(pointer, nbytes, 1)  # 1: cudaHostRegisterPortable
            if int(code) != 0:
                unpin(pinned, device)
                raise RuntimeError(
                    f"cudaHostRegister failed with code {int(code)} for {nbytes} bytes of host state. Pinning "
                    "is limited by the locked-memory limit: raise it (`ulimit -l unlimited`, or the container's "
                    "--ulimit memlock=-1), or use fewer host bytes (a smaller model share per process)."
                )
            pinned.append((tensor, pointer))
    return pinned


def unpin(pinned: list[tuple[torch.Tensor, int]], device: torch.device | None) -> None:
    """Unregister every span :func:`pin_host_buffers` registered (and forget them), on the engine's ``device``."""
    if pinned:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            for _, pointer in pinned:
                cudart.cudaHostUnregister(pointer)
    pinned.clear()


class CoreBinding:
    """The training process's cores and torch threads before the engine narrowed them, restored at close."""

    def __init__(self) -> None:
        self._saved_affinity: set[int] | None = None
        self._saved_threads: int | None = None

    def narrow(self, cores: Sequence[int]) -> None:
        self._saved_affinity = os.sched_getaffinity(0)
        self._saved_threads = torch.get_num_threads()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))

    def restore(self) -> None:
        if self._saved_affinity is not None:
            os.sched_setaffinity(0, self._saved_affinity)
            self._saved_affinity = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None


def _spans(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    spans, start, previous = [], None, None
    for core in sorted(cores):
        if start is None:
            start = previous = core
        elif core == previous + 1:
            previous = core
        else:
            spans.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = previous = core
    if start is not None:
        spans.append(f"{start}-{previous}" if previous != start else f"{start}")
    return ",".join(spans)


def own_cores(ranks: Ranks) -> list[int] | None:
    """This rank's share of the cores it may run on (None where affinity cannot be read)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return ranks.own_cores(sorted(os.sched_getaffinity(0)), os.cpu_count() or 1)


def worker_extents(group: GroupLayout, row_offsets: Mapping[str, int] | None = None) -> list[MatrixExtent]:
    """Where each matrix of ``group`` lies in the group's host rows, as the worker reads it. ``row_offsets``
    (FSDP2): where each matrix's local rows start in the whole matrix."""
    extents, col_offset = [], 0
    for slot in group.matrices:
        row_start = (row_offsets or {}).get(slot.name, 0) + slot.row_start
        extents.append(
            MatrixExtent(slot.offset, slot.host_numel, slot.param.dtype, slot.cols, col_offset, slot.salt, row_start)
        )
        col_offset += slot.cols
    return extents


def worker_groups(host_buffers: Sequence[GroupHostBuffers]) -> tuple[WorkerGroup, ...]:
    """The shared rows of every group, as the worker receives them."""
    return tuple(WorkerGroup(h.exp_avg, h.exp_avg_sq, h.step_shared, h.master, tuple(h.windows)) for h in host_buffers)


def start_worker(
    config: ZenFlowConfig,
    ranks: Ranks,
    layout: Sequence[GroupLayout],
    host_buffers: Sequence[GroupHostBuffers],
    unselected_shared: Sequence[torch.Tensor],
    binding: CoreBinding,
    stage_delays: Mapping[str, float],
    fail_at_update: int | None,
    row_offsets: Mapping[str, int] | None = None,
) -> HostWorker:
    """Split the cores (``bind_cores``: the training process keeps its share, recorded in ``binding``) and spawn the
    host worker over the shared blocks."""
    train_cores, host_cores = config.core_split(own_cores(ranks))
    if config.bind_cores and hasattr(os, "sched_setaffinity") and train_cores != host_cores:
        binding.narrow(train_cores)
        notice_once(
            "bind_cores",
            f"this process now runs on cores {_spans(train_cores)} with {len(train_cores)} torch thread(s), the host "
            f"worker on {_spans(host_cores)}, until the optimizer is closed (the script's own work between steps "
            "runs there too); bind_cores=False leaves the process as it is (pt_reserved_cores_perc sets the split).",
        )
        worker_cores: tuple[int, ...] | None = tuple(host_cores)
    else:
        worker_cores = None
    threads = config.host_threads or max(1, len(host_cores))
    spec = WorkerSpec(
        groups=worker_groups(host_buffers),
        extents=tuple(tuple(worker_extents(g, row_offsets)) for g in layout),
        heartbeat=torch.zeros(1, dtype=torch.float64).share_memory_(),
        threads=threads,
        cores=worker_cores,
        unselected=tuple(unselected_shared),
        kernel_mode=config.interim_kernel,
        delay_s=stage_delays.get("worker", 0.0),
        fail_at_update=fail_at_update,
    )
    # its "ready" is awaited at its first use: the worker's start overlaps the warm-up's steps
    return HostWorker(spec, timeout_s=config.worker_timeout_s, wait_ready=False)
