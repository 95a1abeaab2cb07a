"""The data-parallel ranks an engine shares its host state with, and the few collectives it needs.

Data parallel ZenFlow (DESIGN section 2): every rank holds the same all-reduced gradient and updates the selected
columns itself (the device state is replicated), while the host state is *sharded by rows*: of every matrix, rank
``r`` owns the row block ``Ranks.row_range(rows)[r]`` (``torch.chunk`` semantics: blocks of ``ceil(rows / world)``,
the last ones shorter or empty). Its host block, its worker and its transfers cover only those rows, so host memory
and link bytes per rank drop by the number of ranks.

Rows owned elsewhere reach a rank through three collectives, all issued by the training thread at points of the
rule that every rank reaches in the same order (window landings, refreshes, checkpoints, the ``"auto"`` choices):

- :meth:`Ranks.share_rows` / :meth:`Ranks.share_rows_many`: each rank holds its own rows of a tensor; afterwards
  every rank holds all of them (in place: one broadcast per owner, or one all-gather per packed chunk of many);
- :meth:`Ranks.broadcast_`: rank 0's selection to every rank (ties in top-k must not split the ranks);
- :meth:`Ranks.agree`: one number agreed by all ranks (max or min), for choices that depend on timing or memory.

FSDP2 (``rows_local``): the parameters themselves are each rank's row shards (``fully_shard`` splits dim 0 with the
same ``torch.chunk`` blocks), so the engine's matrices are the local shards, its host state covers all of their rows
and nothing is shared at landings; only the refresh's column scores (:meth:`Ranks.sum_scores_`), the agreed numbers
and the checkpoints' gathers cross ranks.

HSDP (FSDP2 on a 2-D mesh, ``replicas > 1``): ``rank``, ``world`` and ``group`` are this rank's *shard group* (the
ranks that split the rows between them); ``replicas`` groups like it hold the same rows and, since FSDP2 all-reduces
the gradients across them, compute the same updates. Everything about rows (the column scores, the interim moves'
sums, the checkpoints' gathers) runs over the shard group; what every rank must choose alike (:meth:`Ranks.agree`,
the selection's :meth:`Ranks.broadcast_`) runs over ``everyone``, all ``world * replicas`` ranks.

One rank (``world == 1``) makes every collective a no-op: the single-device engine is this code with one rank.
The engine module imports no Lightning; the process group is torch.distributed's, made by whoever launched the
ranks (Lightning's DDP strategy, torchrun, a test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SHARE_CHUNK_ELEMENTS = 1 << 24
""":meth:`Ranks.share_rows_many` packs row blocks into chunks of about this many elements per rank (32 MiB of bf16)."""


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the data-parallel ranks.

    Args:
        rank: this process's global rank.
        world: the number of ranks.
        local_rank: its rank among the ranks on this machine (they share its cores and memory).
        local_world: the number of ranks on this machine.
        group: the torch.distributed process group the rows are split over (None: the default group).
        rows_local: the parameters the engine sees are already this rank's row shards (FSDP2), not replicas.
        replicas: how many groups like ``group`` hold the same rows (HSDP's replicate dimension; 1 otherwise).
        everyone: the process group of all ``world * replicas`` ranks, for the choices they must make alike
            (None: the default group). Used only when ``replicas > 1``; otherwise those choices run over ``group``.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    group: object | None = None
    rows_local: bool = False
    replicas: int = 1
    everyone: object | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas={self.replicas} must be at least 1.")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world} ranks.")
        if not 0 <= self.local_rank < self.local_world:
            raise ValueError(f"local rank {self.local_rank} is outside {self.local_world} local ranks.")

    @classmethod
    def from_process_group(
        cls,
        local_rank: int = 0,
        local_world: int = 1,
        group: object | None = None,
        rows_local: bool = False,
        replicas: int = 1,
    ) -> Ranks:
        """The ranks of torch.distributed's (initialised) default group, or of ``group`` (HSDP: the shard group, one
        of ``replicas``; the agreed choices then span the default group)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls(local_rank=0, local_world=1, rows_local=rows_local)
        return cls(
            rank=dist.get_rank(group),
            world=dist.get_world_size(group),
            local_rank=local_rank,
            local_world=local_world,
            group=group,
            rows_local=rows_local,
            replicas=replicas,
        )

    @property
    def sharded(self) -> bool:
        """The host state of replicated parameters is split by rows across the ranks (data parallel)."""
        return self.world > 1 and not self.rows_local

    @property
    def spans(self) -> bool:
        """More than one rank splits the rows: the collectives over the rows (scores, sums, gathers) communicate."""
        return self.world > 1

    @property
    def agrees(self) -> bool:
        """More than one rank in all (replicas included): the agreed numbers and the selection communicate."""
        return self.world * self.replicas > 1

    def _agreement_group(self) -> object | None:
        return self.everyone if self.replicas > 1 else self.group

    def _global_rank(self, rank: int, group: object | None) -> int:
        """torch.distributed's global rank of ``group``'s rank ``rank`` (collectives name their source globally)."""
        if group is None:
            return rank
        import torch.distributed as dist

        return dist.get_global_rank(group, rank)

    def row_range(self, rows: int) -> list[tuple[int, int]]:
        """``[(start, stop)]`` per rank: the row block each rank owns of a matrix with ``rows`` rows."""
        per_rank = max(1, math.ceil(rows / self.world))
        ranges = []
        for rank in range(self.world):
            start = min(rows, rank * per_rank)
            ranges.append((start, min(rows, start + per_rank)))
        return ranges

    def own_rows(self, rows: int) -> tuple[int, int]:
        """The rows of a matrix the engine sees (``rows`` of them) whose host state this rank holds: its block of a
        replicated matrix, or all of a local shard (``rows_local``)."""
        if self.rows_local:
            return (0, rows)
        return self.row_range(rows)[self.rank]

    def block_of(self, rows: int) -> tuple[int, int]:
        """This rank's block of a whole ``[rows, ...]`` tensor (``torch.chunk`` semantics, FSDP2's too)."""
        return self.row_range(rows)[self.rank]

    def own_cores(self, affinity: list[int], machine_cores: int) -> list[int]:
        """The cores this rank splits between its training process and its worker.

        Its whole ``affinity`` when a launcher bound it (SLURM ``--cpu-bind``, numactl, taskset: the affinity is then
        at most its share of the machine); otherwise (every rank sees every core) the ``local_rank``-th of
        ``local_world`` equal slices of it, so the ranks on one machine do not pin their workers to the same cores.
        """
        share = max(1, machine_cores // self.local_world)
        if self.local_world == 1 or len(affinity) <= share:
            return list(affinity)
        per_rank = max(1, len(affinity) // self.local_world)
        start = min(self.local_rank * per_rank, len(affinity) - per_rank)
        return list(affinity[start : start + per_rank])

    # ------------------------------------------------------------------------------------------- collectives
    def share_rows(self, tensor: torch.Tensor) -> None:
        """Every rank holds its own row block of ``tensor`` (``[rows, ...]``, contiguous, on the collective's
        device); afterwards every rank holds every row. In place: one broadcast per owner of a non-empty block."""
        if self.sharded:
            self._broadcast_blocks(tensor)

    def _broadcast_blocks(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        for owner, (start, stop) in enumerate(self.row_range(tensor.shape[0])):
            if stop > start:
                dist.broadcast(tensor[start:stop], src=self._global_rank(owner, self.group), group=self.group)

    def share_rows_many(self, tensors: list[torch.Tensor], budget_elements: int = SHARE_CHUNK_ELEMENTS) -> None:
        """:meth:`share_rows` for many tensors at once: their row blocks packed into padded chunks (one dtype each,
        about ``budget_elements`` per rank, or one tensor when it is larger), one all-gather per chunk instead of one
        broadcast per owner per tensor. Device memory: the chunk's send and receive buffers."""
        if not self.sharded:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for same_dtype in by_dtype.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for tensor in same_dtype:
                padded = self._padded_block(tensor)
                if chunk and size + padded > budget_elements:
                    self._all_gather_rows(chunk)
                    chunk, size = [], 0
                chunk.append(tensor)
                size += padded
            if chunk:
                self._all_gather_rows(chunk)

    def _padded_block(self, tensor: torch.Tensor) -> int:
        """Elements of a row block of ``tensor`` padded to the largest block (``ceil(rows / world)`` rows)."""
        per_rank = max(1, math.ceil(tensor.shape[0] / self.world))
        return per_rank * (tensor.numel() // max(1, tensor.shape[0]))

    def _all_gather_rows(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        sizes = [self._padded_block(t) for t in tensors]
        total = sum(sizes)
        send = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
        position = 0
        for tensor, size in zip(tensors, sizes):
            start, stop = self.own_rows(tensor.shape[0])
            own = tensor[start:stop].reshape(-1)
            send[position : position + own.numel()].copy_(own)
            position += size
        received = torch.empty(self.world * total, dtype=send.dtype, device=send.device)
        # torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(received, send, group=self.group)
        for owner in range(self.world):
            if owner == self.rank:
                continue
            position = owner * total
            for tensor, size in zip(tensors, sizes):
                start, stop = self.row_range(tensor.shape[0])[owner]
                block = tensor[start:stop]
                if block.numel():
                    block.copy_(received[position : position + block.numel()].view(block.shape))
                position += size

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """The ``src``-th rank's ``tensor`` on every rank (in place), replicas included (HSDP: over ``everyone``)."""
        if self.agrees:
            import torch.distributed as dist

            group = self._agreement_group()
            dist.broadcast(tensor, src=self._global_rank(src, group), group=group)
        return tensor

    def agree(self, value: float, device: torch.device, op: str = "max") -> float:
        """The maximum (or minimum) of ``value`` over all ranks, replicas included (HSDP: over ``everyone``)."""
        if not self.agrees:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
        op_ = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN
        dist.all_reduce(tensor, op=op_, group=self._agreement_group())
        return float(tensor.item())

    def all_reduce_sum(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The sum of ``tensor`` (on the CPU) over the ranks that split the rows (``group``), on the CPU (run on
        ``device``)."""
        if not self.spans:
            return tensor
        import torch.distributed as dist

        total = tensor.to(device=device, copy=True)
        dist.all_reduce(total, group=self.group)
        return total.cpu()

    def sum_scores_(self, scores: torch.Tensor) -> torch.Tensor:
        """FSDP2: every rank's column scores of its rows summed in place over the shard group (the whole matrix's
        scores, so every rank chooses the same columns; HSDP's replicas hold the same rows and the same gradients,
        so their sums are the same); a no-op for replicated parameters, whose scores are already whole."""
        if self.rows_local and self.spans:
            import torch.distributed as dist

            dist.all_reduce(scores, group=self.group)
        return scores

    def gather_rows(self, shard: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor | None:
        """The whole ``[rows, ...]`` tensor, on the CPU of rank 0, from each rank's row block ``shard`` (on the CPU);
        None on the other ranks, which only take part. The exchange runs on ``device`` (NCCL needs CUDA tensors),
        one matrix at a time: one full matrix of device memory at the peak, and host memory for the whole state
        on rank 0 only. Used at checkpoints. ``shard`` is this rank's :meth:`block_of` ``rows``."""
        if not self.spans:
            return shard.clone()
        start, stop = self.block_of(rows)
        full = torch.zeros((rows, *shard.shape[1:]), dtype=shard.dtype, device=device)
        full[start:stop].copy_(shard)
        self._broadcast_blocks(full)
        return full.cpu() if self.rank == 0 else None
