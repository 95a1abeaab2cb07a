"""ZenFlowFSDPStrategy: ZenFlow on FSDP2's shards (``fully_shard``), through Lightning's ModelParallelStrategy.

FSDP2 splits every parameter by rows (dim 0, ``torch.chunk`` blocks): each rank holds whole columns of its rows,
all-gathers the weights for forward and backward and reduce-scatters the gradients into its shard. ZenFlow works
on the shards: the engine's parameters are plain tensors that share each sharded parameter's local memory
(:class:`LocalShards`), so the device update of the selected columns, the window's accumulation, the host worker's
update and the landing all touch this rank's rows only, and nothing is gathered beyond FSDP2's own collectives.
Device bytes for the weights, gradients and ZenFlow's state fall as ``1/W``, and so do each rank's host bytes.

- **Selection is global**: at a refresh every rank scores its rows' columns and one all-reduce sums the scores
  (``Ranks.sum_scores_``), so every rank chooses the columns one process would choose from the same gradient.
- **Interim moves** run on each rank's rows: their statistics are sums over *all* rows of a matrix, which FSDP2's
  shards split, so at each window's first step one all-reduce (the rows' and the columns' sums of every matrix,
  O(rows + columns) floats) gives every rank the statistics one process would hold (``engine/interim.py``).
- **HSDP** (``shard_size``): the ranks form a 2-D mesh ``("replicate", "shard")``; FSDP2 shards every parameter over
  the shard group and all-reduces its gradients across the replicas. ZenFlow's host state is split over the shard
  group (replicas hold the same rows and compute the same updates, one worker per rank); the column scores and the
  interim moves' sums are reduced over the shard group, the agreed numbers and the selection over every rank.
- **Checkpoints**: ``checkpoint_format="sharded"`` (the default) writes a ``torch.distributed.checkpoint`` directory
  in which the weights are FSDP2's DTensors and every parameter's ZenFlow state (master, moments, window sum) is a
  row-sharded DTensor over the rank's host memory, with the parameter's global shape: no rank holds more than its
  share, and it resumes at any number of ranks, with or without HSDP (DCP writes a replicated block once).
  ``"full"`` gathers everything to rank 0 into the format of the other strategies: one ``.ckpt`` that resumes under
  :class:`~lightning_zenflow.ZenFlowStrategy`, the data-parallel strategy, plain AdamW, or this one (for models whose
  whole state fits rank 0's host). Both are ``checkpoints/fsdp.py``.

The recipe (docs/distributed.md, "FSDP2" and "HSDP"): ``Trainer(strategy="zenflow_fsdp", devices=N, num_nodes=M)``,
and in the LightningModule's ``configure_model`` apply ``fully_shard(block, mesh=self.trainer.strategy.shard_mesh)``
to each block and then to the module that holds them all, so that every trainable parameter is sharded. FSDP1
wrappers, tensor parallelism, meshes other than ``shard_mesh`` and ``CPUOffloadPolicy`` are refused with the fix
named.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_zenflow.checkpoints.fsdp import FSDPCheckpointHooks
from lightning_zenflow.checkpoints.fsdp_state import is_dtensor
from lightning_zenflow.engine import UnsupportedSetupError
from lightning_zenflow.engine.optimizers import ZeroGradGuard
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.strategies.base import COLLECTIVE_TIMEOUT, ZenFlowStrategyBase, zenflow_knobs


def _fix() -> str:
    return (
        "apply fully_shard(module, mesh=self.trainer.strategy.shard_mesh) in configure_model to every block and "
        "then to the module that holds them, so that every trainable parameter is an FSDP2 shard"
    )


def check_shard_size(shard_size: object) -> None:
    """``shard_size`` is one of the values it takes (raised at construction, before any Trainer exists)."""
    if shard_size in ("all", "auto"):
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise MisconfigurationException(
            f"zenflow_fsdp: shard_size={shard_size!r} is not 'all' (FSDP over every rank), 'auto' (HSDP, one "
            "machine per shard group) or a positive number of ranks per shard group."
        )


def resolve_shard_size(shard_size: int | str, world: int, per_machine: int) -> int:
    """The number of ranks that split every parameter's rows (``shard_size``; module notes): all ``world`` ranks for
    ``"all"``, one machine's ``per_machine`` ranks for ``"auto"``, or the number given, which must divide ``world``."""
    check_shard_size(shard_size)
    if shard_size == "all":
        return world
    if shard_size == "auto":
        return per_machine if world % per_machine == 0 else world
    if world % shard_size:
        raise MisconfigurationException(
            f"zenflow_fsdp: shard_size={shard_size} does not divide the {world} ranks into equal shard groups; pass "
            f"a divisor of {world}, or shard_size='auto' (one machine per shard group: devices={per_machine})."
        )
    return shard_size


class LocalShards:
    """The engine's view of an FSDP2 model: for every sharded parameter of the user's optimizer a plain
    ``nn.Parameter`` that shares the memory of its local shard, in an optimizer of the same class and groups.

    The engine writes the shards in place through them (the weights FSDP2 all-gathers next). Before each engine step
    :meth:`before_step` hands them the local shards of the reduce-scattered gradients and the groups' current
    hyperparameters (a scheduler sets them on the user's optimizer); :meth:`release` drops the gradients again."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str], ranks: Ranks) -> None:
        self.optimizer = optimizer
        self.ranks = ranks
        self.pairs: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
        self.names: dict[torch.Tensor, str] = {}
        groups = []
        for group in optimizer.param_groups:
            locals_ = []
            for param in group["params"]:
                shadow = torch.nn.Parameter(_local(param), requires_grad=param.requires_grad)
                self.pairs.append((param, shadow))
                self.names[shadow] = names[param]
                locals_.append(shadow)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": locals_})
        kind = torch.optim.AdamW if isinstance(optimizer, torch.optim.AdamW) else torch.optim.Adam
        self.local_optimizer = kind(groups)

    def before_step(self) -> None:
        for group, local_group in zip(self.optimizer.param_groups, self.local_optimizer.param_groups):
            local_group.update({key: value for key, value in group.items() if key != "params"})
        for param, shadow in self.pairs:
            local = _local(param)
            if local.data_ptr() != shadow.data_ptr() or local.shape != shadow.shape:
                raise UnsupportedSetupError(
                    f"the FSDP2 shard of a parameter with {tuple(param.shape)} elements was replaced after ZenFlow "
                    "started (a module.to(), a load_state_dict(assign=True) or a second fully_shard during fit); "
                    "change the model before fit, in configure_model."
                )
            if shadow.requires_grad != param.requires_grad:
                shadow.requires_grad_(param.requires_grad)
            grad = param.grad
            shadow.grad = None if grad is None else _local(grad)

    def release(self) -> None:
        for _, shadow in self.pairs:
            shadow.grad = None

    def row_blocks(self, matrix_columns: Mapping[str, int] | None = None) -> dict[str, tuple[int, int]]:
        """Per parameter name: where this rank's shard starts in the rows of the whole parameter's matrix view, and
        how many rows that view has (FSDP2's ``torch.chunk`` blocks of the first dimension, ``Ranks.block_of``; a
        stack of expert matrices viewed ``[E x out, in]`` (``matrix_columns``) has ``out`` rows per expert)."""
        blocks = {}
        for param, shadow in self.pairs:
            name = self.names[shadow]
            rows = param.shape[0] if param.dim() else 1
            per_slice = 1
            if matrix_columns and name in matrix_columns:
                per_slice = (param.numel() // max(1, rows)) // matrix_columns[name]
            blocks[name] = (self.ranks.block_of(rows)[0] * per_slice, rows * per_slice)
        return blocks


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor object FSDP2 keeps, not an autograd view of it)."""
    with torch.no_grad():
        return tensor.to_local()


class ZenFlowFSDPStrategy(ZenFlowStrategyBase, FSDPCheckpointHooks, ModelParallelStrategy):
    """ZenFlow on FSDP2: every rank's engine and host worker hold only the rows of its shards.

    The ZenFlow knobs are those of :class:`~lightning_zenflow.ZenFlowStrategy` (docs/knobs.md), with
    interim moves on every rank's rows (see the module's notes); the rest are Lightning's ModelParallelStrategy options.

    Args:
        topk_ratio: fraction of columns of each matrix updated on the device every step.
        update_interval: steps per host window S, or ``"auto"`` (the ranks agree on the largest choice).
        select_strategy: ``"auto"``, ``"step"`` or ``"epoch"``: when the important columns are re-chosen.
        select_interval: refresh period in the unit of ``select_strategy``, or ``"auto"``.
        full_warm_up_rounds: first steps run as plain synchronous AdamW.
        overlap_step: run the host update in the background (its result lands one window later).
        land_after: with overlap, land the host update this many steps after its window (None: a window later).
        overlap_after: windows closing at steps up to this land at once (the device waits); later ones overlap.
        interim_step: move host columns between host updates (``"auto"``: 1.5, less past windows of 4; 0: the paper).
        interim_kernel: the moves' passes ``"compiled"`` or ``"eager"``; ``"auto"`` compiles where it can.
        accumulate_on: where the window's host-bound gradients are summed: ``"device"``, ``"host"`` or ``"auto"``.
        host_state: precision of the host's optimizer state: ``"bf16"`` (6 B per parameter) or ``"fp32"`` (exact).
        importance: column score, ``"l2"`` (squared norm) or ``"l1"``.
        expert_layouts: how 3-D expert parameters are split where transformers does not say: a module class
            name or parameter pattern to ``"out_in"`` (``[experts, out, in]``) or ``"in_out"``.
        sync_on: opt-in boundaries at which host work in flight is applied early: ``"validation"``,
            ``"epoch_end"``, ``"checkpoint"`` (none by default: observing a run does not change its numbers).
        host_threads: threads of each rank's host worker (``None``: its share of the rank's cores).
        pt_reserved_cores_perc: share of a rank's cores kept for its training process.
        bind_cores: pin each rank's training process and host worker to disjoint cores.
        worker_timeout_s: a host worker silent this long fails the run (on every rank).
        log_telemetry: log ``zenflow/*`` metrics and show the stall share in the progress bar.
        checkpoint_format: ``"sharded"`` (the default: a directory, every rank writes its share) or ``"full"`` (one
            ``.ckpt`` file gathered to rank 0, which every strategy and plain AdamW resume; for small models).
        shard_size: ranks that split every parameter: ``"all"`` (the default: FSDP over every rank), ``"auto"``
            (HSDP with one machine per shard group: ``devices`` ranks), or a number of ranks that divides the world;
            the rest of the world is replicas (HSDP). ``fully_shard`` takes :attr:`shard_mesh`.
        data_parallel_size: ranks the data is split over (``"auto"``: all of them; the only supported value is all).
        process_group_backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs) by default.
        timeout: bound on every collective (see ``strategies/base.py``'s ``COLLECTIVE_TIMEOUT``).
    """

    _manual_supported = False  # manual optimization: one device only (strategies/manual.py)
    strategy_name = "zenflow_fsdp"

    def __init__(
        self,
        topk_ratio: float = 0.1,
        update_interval: int | Literal["auto"] = 4,
        select_strategy: Literal["auto", "step", "epoch"] = "auto",
        select_interval: int | Literal["auto"] = "auto",
        full_warm_up_rounds: int = 10,
        overlap_step: bool = True,
        land_after: int | None = None,
        overlap_after: int = 0,
        interim_step: float | Literal["auto"] = "auto",
        interim_kernel: Literal["auto", "compiled", "eager"] = "auto",
        accumulate_on: Literal["auto", "device", "host"] = "auto",
        host_state: Literal["fp32", "bf16"] = "bf16",
        importance: Literal["l2", "l1"] = "l2",
        expert_layouts: dict[str, Literal["out_in", "in_out"]] | None = None,
        sync_on: tuple[str, ...] | list[str] = (),
        host_threads: int | None = None,
        pt_reserved_cores_perc: float = 0.5,
        bind_cores: bool = True,
        worker_timeout_s: float = 10.0,
        log_telemetry: bool = True,
        checkpoint_format: Literal["full", "sharded"] = "sharded",
        shard_size: int | Literal["all", "auto"] = "all",
        data_parallel_size: int | Literal["auto"] = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = COLLECTIVE_TIMEOUT,
    ) -> None:
        knobs = zenflow_knobs(locals())
        self._init_zenflow(knobs)
        check_shard_size(shard_size)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=checkpoint_format == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._shards: LocalShards | None = None
        self._zero_grad_guard: ZeroGradGuard | None = None
        self._shard_size = shard_size
        self._hsdp_mesh: object | None = None  # the ("replicate", "shard") mesh under HSDP

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="ZenFlow offloaded AdamW on FSDP2 shards")

    @override
    def setup_environment(self) -> None:
        self._check_accelerator()
        world = self.num_nodes * self.num_processes
        if self._data_parallel_size == "auto":
            self._data_parallel_size = world
        if self._data_parallel_size != world:
            raise MisconfigurationException(
                f"zenflow_fsdp splits the data over every rank; data_parallel_size={self._data_parallel_size} leaves "
                f"{world} ranks in other mesh dimensions (tensor parallelism), which ZenFlow does not support. "
                "Leave data_parallel_size='auto' (for HSDP, pass shard_size='auto' or a number of ranks instead)."
            )
        shard_size = resolve_shard_size(self._shard_size, world, self.num_processes)
        self._hsdp_mesh = None
        super().setup_environment()  # the process group, and Lightning's ("data_parallel", "tensor_parallel") mesh
        if shard_size < world:
            from torch.distributed.device_mesh import init_device_mesh

            # collective (every rank builds it, here): one process group per replica group and per shard group
            self._hsdp_mesh = init_device_mesh(
                self.root_device.type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
            )

    @property
    def shard_mesh(self) -> object:
        """The mesh to give ``fully_shard`` in ``configure_model``: 1-D over every rank (FSDP, the same as
        ``self.device_mesh["data_parallel"]``), or 2-D ``("replicate", "shard")`` under HSDP (``shard_size``)."""
        if self._hsdp_mesh is not None:
            return self._hsdp_mesh
        return self.device_mesh["data_parallel"]

    @override
    def _engine_ranks(self) -> Ranks:
        if self._hsdp_mesh is None:
            return Ranks.from_process_group(local_rank=self.local_rank, local_world=self.num_processes, rows_local=True)
        # the shard group splits the rows; the replicas (the default group spans them all) agree on the choices
        return Ranks.from_process_group(
            local_rank=self.local_rank,
            local_world=self.num_processes,
            group=self._hsdp_mesh["shard"].get_group(),
            rows_local=True,
            replicas=self._hsdp_mesh["replicate"].size(),
        )

    # --------------------------------------------------------------------------------------- the local shards
    @override
    def _engine_parameters(self) -> tuple[torch.optim.Optimizer, dict[torch.Tensor, str]]:
        module = self.lightning_module
        _lazy_init(module)  # FSDP2 may re-pad and replace a shard at its first forward: before ZenFlow holds them
        optimizer = self.optimizers[0]
        names = {param: name for name, param in module.named_parameters()}
        ranks = self._engine_ranks()
        _check_no_cpu_offload(module)  # first: offloaded shards would fail the device check with a vaguer message
        for group in optimizer.param_groups:
            for param in group["params"]:
                _check_shard(param, names.get(param, "a parameter"), self.shard_mesh, ranks, self.root_device)
        self._shards = LocalShards(optimizer, names, ranks)
        return self._shards.local_optimizer, self._shards.names

    @override
    def _engine_row_offsets(self) -> dict[str, int] | None:
        if self._shards is None:
            return None
        return {name: offset for name, (offset, _) in self._shards.row_blocks(self._matrix_columns()).items()}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.engine is None or self._shards is None:
            return
        shards, engine = self._shards, self.engine
        if engine.interim is not None:
            # before the first step makes the statistics
            engine.interim.shard_rows = shards.row_blocks(engine.matrix_columns)

        def before_zero_grad() -> None:
            engine.wait_for_gradients()
            shards.release()

        # Lightning zeroes the user's optimizer: first the engine reads the gradients, then the views are dropped
        self._zero_grad_guard = ZeroGradGuard(self.optimizers[0], before_zero_grad)
        self.precision_plugin.before_engine_step = shards.before_step

    @override
    def _close_engine(self, cache_state: bool) -> None:
        try:
            super()._close_engine(cache_state)
        finally:
            if self._zero_grad_guard is not None:
                self._zero_grad_guard.remove()
                self._zero_grad_guard = None
            if self._shards is not None:
                self._shards.release()


# ------------------------------------------------------------------------------------------------ checks
def _check_shard(param: torch.Tensor, name: str, mesh: object, ranks: Ranks, device: torch.device) -> None:
    """``param`` is FSDP2's row shard on ``mesh`` (the strategy's :attr:`~ZenFlowFSDPStrategy.shard_mesh`): placed
    ``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on HSDP's, with this rank's row block."""
    from torch.distributed.tensor import Replicate, Shard

    if not is_dtensor(param):
        raise MisconfigurationException(f"zenflow_fsdp: parameter {name!r} is not sharded by FSDP2; {_fix()}.")
    placements = tuple(param.placements)
    wanted = (*(Replicate(),) * (mesh.ndim - 1), Shard(0))
    same_mesh = param.device_mesh.ndim == mesh.ndim and param.device_mesh.mesh.tolist() == mesh.mesh.tolist()
    if not same_mesh or placements != wanted:
        layout = "HSDP's (replicate, shard) mesh" if mesh.ndim == 2 else f"all {mesh.size()} ranks"
        raise MisconfigurationException(
            f"zenflow_fsdp: parameter {name!r} is placed {placements} on a mesh of shape "
            f"{tuple(param.device_mesh.shape)}; ZenFlow takes FSDP2's row shards over {layout} "
            f"{tuple(mesh.shape)}, placed {wanted} (no tensor parallelism, no other mesh): {_fix()}."
        )
    world = ranks.world
    rows = param.shape[0] if param.dim() else 1
    if any(start == stop for start, stop in ranks.row_range(rows)):
        raise MisconfigurationException(
            f"zenflow_fsdp: parameter {name!r} has {rows} rows, which FSDP2's blocks of ceil({rows} / {world}) rows "
            f"leave some of the {world} ranks none of; use fewer ranks, or a size that gives every rank a row."
        )
    local = _local(param)
    start, stop = ranks.block_of(rows)
    if local.shape[0] != stop - start or local.device.type != device.type:
        raise MisconfigurationException(
            f"zenflow_fsdp: the local shard of {name!r} has {local.shape[0]} rows on {local.device.type}; FSDP2's "
            f"row block of this rank is {stop - start} rows on {device.type}: {_fix()}, "
            "without a custom shard_placement_fn."
        )


def _check_no_cpu_offload(module: torch.nn.Module) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    for submodule in module.modules():
        get_state = getattr(submodule, "_get_fsdp_state", None)
        group = None if get_state is None else get_state()._fsdp_param_group
        if group is not None and isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
            raise MisconfigurationException(
                "zenflow_fsdp: fully_shard was given offload_policy=CPUOffloadPolicy(), which keeps every shard on "
                "the CPU and runs the whole step there; ZenFlow is the offload (the host state is already on the CPU "
                "and the important columns stay on the device). Remove offload_policy from fully_shard."
            )


def _lazy_init(module: torch.nn.Module) -> None:
    """FSDP2's lazy initialisation, which its first forward would run, for the outermost sharded modules."""
    inside: set[int] = set()
    for submodule in module.modules():
        if id(submodule) in inside or getattr(submodule, "_get_fsdp_state", None) is None:
            continue
        inside.update(id(m) for m in submodule.modules())
        lazy = getattr(submodule._get_fsdp_state(), "_lazy_init", None)
        if lazy is not None:
            lazy()
