"""Running a few data-parallel ranks on the CPU (gloo) inside a test: module-level targets, results in files.

Ranks are spawned processes (a test's local function cannot be pickled; assertions that need a rank's objects run
inside it and the results come back as files). Every launch has a deadline: a hung rank fails the test, and every
rank still alive is killed, never left behind.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine, spares
from lightning_zenflow.engine.ranks import Ranks

GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> list[int]:
    """Run ``target(rank, world, port, *args)`` in ``world`` new processes (with ``env`` added to their
    environment); their exit codes. The processes start as the host workers do (``spares.start_method()``: forked
    from the fork server when the test process opted in, else spawned)."""
    context = mp.get_context(spares.start_method())
    port = free_port()
    saved = dict(os.environ)
    # the ranks run the engine only: skip the package's Lightning import (seconds per rank), as its worker does
    os.environ["LIGHTNING_ZENFLOW_HOST_WORKER"] = "1"
    os.environ.update(env or {})
    # a forked rank starts with the fork server's environment: it takes this one over first
    environ = dict(os.environ)
    processes = [
        context.Process(target=_in_environment, args=(environ, target, rank, world, port, *args))
        for rank in range(world)
    ]
    try:
        for process in processes:
            process.start()
    finally:
        restore_env(saved)
    try:
        for process in processes:
            process.join(timeout_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
    return [process.exitcode for process in processes]


def _in_environment(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def init_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=GROUP_TIMEOUT
        )


class SmallNet(nn.Module):
    """Two matrices with row counts that 2 and 3 ranks do not divide evenly, a bias, and a 3-D weight."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 9)
        self.mixer = nn.Parameter(torch.randn(5, 3, 3) * 0.2)
        self.second = nn.Linear(9, 4, bias=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(inputs))
        mixed = hidden + torch.tanh(hidden[:, :5] @ self.mixer.reshape(5, 9))
        return self.second(mixed)


def start_engine(
    rank: int, world: int, config: dict, host_delay_s: float = 0.0, weights: dict | None = None
) -> tuple[SmallNet, torch.optim.Optimizer, ZenFlowEngine]:
    """:class:`SmallNet` (seed 0, or ``weights``), its AdamW and a started engine over this rank's share."""
    torch.manual_seed(0)
    model = SmallNet()
    if weights is not None:
        model.load_state_dict(weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    engine = ZenFlowEngine(
        optimizer,
        ZenFlowConfig(**{"full_warm_up_rounds": 0, **config}, host_threads=1, bind_cores=False),
        param_names={param: name for name, param in model.named_parameters()},
        ranks=Ranks.from_process_group(local_rank=rank, local_world=world),
        host_delay_s=host_delay_s,
    ).start()
    return model, optimizer, engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 12, generator=generator), torch.randn(12, 4, generator=generator)


def engine_ranks(rank: int, world: int, port: int, jobs: list[tuple]) -> None:
    """Run every job (the arguments of :func:`_train` after ``world``) one after another in one process group;
    every engine after the first adopts the host worker the one before it closed (``engine/spares.py``), as engines
    of a sweep in one process may."""
    import torch.distributed as dist

    init_group(rank, world, port)
    spares.keep_spare_workers(len(jobs) > 1)
    try:
        for job in jobs:
            _train(rank, world, *job)
    finally:
        spares.keep_spare_workers(False)
    if world > 1:
        dist.destroy_process_group()


def _train(
    rank: int,
    world: int,
    config: dict,
    steps: int,
    out: str,
    same_batch: bool,
    checkpoint_at: int | None,
    slow_rank: int | None = None,
) -> None:
    """One rank: train :class:`SmallNet` with the engine, gradients averaged over the ranks (as DDP does); write
    the weights, the consolidated states and the per-rank host and link bytes to ``out/rank{rank}.pt``.

    ``same_batch``: every rank sees the whole batch (gradients then equal the one-rank run's bit for bit);
    otherwise rank r takes rows r, r + world, ... of it. ``checkpoint_at``: also save the states after that step.
    ``slow_rank``: that rank's worker sleeps 0.3 s before each update (timings differ between the ranks).
    """
    import torch.distributed as dist

    model, optimizer, engine = start_engine(rank, world, config, host_delay_s=0.3 if rank == slow_rank else 0.0)
    result: dict[str, Any] = {"link": [], "host_bytes": engine.host_bytes()}
    try:
        for step in range(1, steps + 1):
            inputs, targets = batch(step)
            if not same_batch:
                inputs, targets = inputs[rank::world], targets[rank::world]
            loss = (model(inputs) - targets).square().mean()
            loss.backward()
            if world > 1 and not same_batch:
                for param in model.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world
            stats = engine.step()
            engine.wait_for_update()
            result["link"].append((stats.d2h_bytes, stats.h2d_bytes))
            optimizer.zero_grad()
            if step == checkpoint_at:
                result["checkpoint"] = {
                    "step": step,
                    "engine": engine.state_dict(),
                    "torch": engine.torch_state_dict(),
                    "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                }
        engine.flush()
        engine.wait_for_update()
        result["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result["torch_state"] = engine.torch_state_dict()
        result["accumulate_on"] = engine.accumulate_on
        result["interval"] = engine.update_interval
    finally:
        engine.close()
    torch.save(result, pathlib.Path(out) / f"rank{rank}.pt")


def lanes_rank(
    rank: int, world: int, port: int, config: dict, steps: int, out: str, schedules: list[tuple[str, int]]
) -> None:
    """One rank: for each ``(mode, seed)`` of the CPU lanes (``LIGHTNING_ZENFLOW_LANES``), train :class:`SmallNet`
    from the same start on the whole batch; write ``{(mode, seed): weights}``."""
    import torch.distributed as dist

    init_group(rank, world, port)
    results = {}
    for mode, seed in schedules:
        os.environ.update(LIGHTNING_ZENFLOW_LANES=mode, LIGHTNING_ZENFLOW_LANES_SEED=str(seed))
        model, optimizer, engine = start_engine(rank, world, config)
        try:
            for step in range(1, steps + 1):
                inputs, targets = batch(step)
                (model(inputs) - targets).square().mean().backward()
                engine.step()
                engine.wait_for_update()
                optimizer.zero_grad()
            engine.flush()
            engine.wait_for_update()
            results[(mode, seed)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        finally:
            engine.close()
    torch.save(results, pathlib.Path(out) / f"rank{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


def resume_rank(rank: int, world: int, port: int, config: dict, checkpoint: str, steps: int, out: str) -> None:
    """One rank: restore a consolidated engine state (saved at any number of ranks), train ``steps`` more steps on
    the whole batch, write the weights."""
    import torch.distributed as dist

    init_group(rank, world, port)
    saved = torch.load(checkpoint, weights_only=False)
    model, optimizer, engine = start_engine(rank, world, config, weights=saved["weights"])
    try:
        if "engine" in saved:
            engine.load_state_dict(saved["engine"], torch_state=saved["torch"])
        else:
            engine.load_torch_state_dict(saved["torch"])
        first = saved.get("step", 0) + 1
        for step in range(first, first + steps):
            inputs, targets = batch(step)
            (model(inputs) - targets).square().mean().backward()
            engine.step()
            engine.wait_for_update()
            optimizer.zero_grad()
        engine.flush()
        engine.wait_for_update()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    torch.save({"weights": weights}, pathlib.Path(out) / f"rank{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


def load_results(out: pathlib.Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def restore_env(saved: dict[str, str]) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


# ------------------------------------------------------------------------------------- Lightning fits across "machines"
_GLOBAL_RANK: int | None = None
"""This forked rank's global rank (``tests/rank_zygote.py`` gives it as ``LOCAL_RANK``, all on "machine" 0)."""


def as_machine(devices: int) -> None:
    """Give this rank the environment a launcher gives the ``LOCAL_RANK``-th process of a job of ``devices`` ranks per
    machine (torchrun and SLURM's variables as Lightning reads them): ``NODE_RANK`` = rank // devices, ``LOCAL_RANK``
    = rank % devices. The ranks stay processes of this machine; Lightning sees ``world // devices`` machines."""
    global _GLOBAL_RANK
    if _GLOBAL_RANK is None:
        _GLOBAL_RANK = int(os.environ["LOCAL_RANK"])
    os.environ.update(NODE_RANK=str(_GLOBAL_RANK // devices), LOCAL_RANK=str(_GLOBAL_RANK % devices))


def hsdp_fit(out: pathlib.Path, options: dict) -> None:
    """``tests/ddp_script.py``'s fit over ``options["num_nodes"]`` machines of ``options["devices"]`` ranks (a rank of
    ``rank_zygote``'s, ``"entry": "distributed_helpers:hsdp_fit"``), with the wider module of :class:`MeshModule`
    (every row count splits over 1, 2 and 4 ranks). ``strategy``: ZenFlowFSDPStrategy's knobs (``shard_size`` among
    them), or ``"adamw"``: Lightning's ModelParallelStrategy with torch AdamW, the module sharded on the mesh of
    ``options["mesh"]`` (``[replicas, shard]``: HSDP's 2-D mesh; absent: every rank). One rank and ``"fsdp": False``:
    ZenFlowStrategy on the whole module. ``"launched"``: the rank was started by a launcher (torchrun), which set
    its environment. Writes ``out/rank{r}.pt`` as ddp_script's fit does."""
    import ddp_script
    import lightning

    import lightning_zenflow

    devices, num_nodes = int(options.get("devices", 1)), int(options.get("num_nodes", 1))
    if devices * num_nodes > 1 and not options.get("launched"):
        as_machine(devices)  # a rank of rank_zygote's; a launcher (torchrun, ``"launched"``) set the variables itself
    knobs = options.get("strategy", {})
    timeout = datetime.timedelta(seconds=60)
    fsdp = options.get("fsdp", True)
    if knobs == "adamw":
        strategy: Any = lightning.pytorch.strategies.ModelParallelStrategy(
            data_parallel_size=devices * num_nodes, tensor_parallel_size=1, timeout=timeout
        )
    else:
        knobs = {"full_warm_up_rounds": 0, "host_threads": 1, "bind_cores": False, **knobs}
        if fsdp:
            strategy = lightning_zenflow.ZenFlowFSDPStrategy(timeout=timeout, **knobs)
        else:
            strategy = lightning_zenflow.ZenFlowStrategy(**knobs)
    record = ddp_script.Record(None, None, 1, out)
    callbacks: list[Any] = [record]
    if options.get("checkpoint_every"):
        callbacks.append(
            lightning.pytorch.callbacks.ModelCheckpoint(
                dirpath=out, filename="{step}", every_n_train_steps=options["checkpoint_every"], save_top_k=-1
            )
        )
    module = MeshModule(
        mesh_shape=options.get("mesh"),
        lightning_mesh=bool(options.get("lightning_mesh")),
        shard="all" if fsdp else "none",
        samples=options.get("samples", 48),
        batch_size=options["batch_size"],
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=options.get("max_steps", 8),
        gradient_clip_val=options.get("gradient_clip_val"),
        max_epochs=100,
        logger=False,
        enable_checkpointing=bool(options.get("checkpoint_every")),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        use_distributed_sampler=False,
        default_root_dir=str(out),
    )
    trainer.fit(module, ckpt_path=options.get("ckpt_path"))
    mesh = getattr(trainer.strategy, "shard_mesh", None) if fsdp and knobs != "adamw" else None
    result = {
        "weights": ddp_script.full_weights(module) if fsdp else ddp_script.weights(module),
        "global_step": trainer.global_step,
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "mesh_shape": None if mesh is None else tuple(mesh.shape),
        "placements": module.placements,
        "engine_ranks": module.engine_ranks,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


def _mesh_module_class() -> type:
    import ddp_script

    class _MeshModule(ddp_script.ShardedModule):
        """ddp_script's sharded module, 8 -> 24 -> 8, sharded on the strategy's ``shard_mesh`` (ZenFlow), on the
        ``[replicas, shard]`` mesh ``mesh_shape`` (torch AdamW's HSDP control), or on Lightning's
        ``device_mesh["data_parallel"]`` (every rank; also with ``lightning_mesh``, as a module written for FSDP)."""

        out_features = 8

        def __init__(self, mesh_shape: list[int] | None = None, lightning_mesh: bool = False, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.mesh_shape = mesh_shape
            self.lightning_mesh = lightning_mesh
            self.placements: list[str] = []
            self.engine_ranks: dict | None = None

        def configure_model(self) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if self.shard == "none":
                return
            mesh = getattr(self.trainer.strategy, "shard_mesh", None)
            if self.mesh_shape is not None:
                mesh = init_device_mesh("cpu", tuple(self.mesh_shape), mesh_dim_names=("replicate", "shard"))
            elif mesh is None or self.lightning_mesh:
                mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)
            self.placements = [str(tuple(param.placements)) for param in self.parameters()]

        def on_train_start(self) -> None:
            engine = getattr(self.trainer.strategy, "engine", None)
            if engine is not None:
                ranks = engine.ranks
                self.engine_ranks = {"rank": ranks.rank, "world": ranks.world, "replicas": ranks.replicas}

    return _MeshModule


def MeshModule(**kwargs: Any) -> Any:  # noqa: N802  (a class, built on first use: it needs ddp_script's imports)
    global _MESH_MODULE
    if _MESH_MODULE is None:
        _MESH_MODULE = _mesh_module_class()
    return _MESH_MODULE(**kwargs)


_MESH_MODULE: type | None = None


def hsdp_ranks_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of HSDP's ``(world // 2) x 2`` groups: what :class:`Ranks`' collectives return over the shard group
    (``group``) and over every rank (``everyone``); written to ``out/rank{rank}.pt``."""
    import torch.distributed as dist

    init_group(rank, world, port)
    shard_groups = [dist.new_group([first, first + 1]) for first in range(0, world, 2)]  # every rank makes each
    ranks = Ranks.from_process_group(group=shard_groups[rank // 2], rows_local=True, replicas=world // 2)
    device = torch.device("cpu")
    scores = torch.full((3,), float(rank + 1))
    ranks.sum_scores_(scores)
    selection = torch.full((2,), float(rank))
    ranks.broadcast_(selection)
    whole = ranks.gather_rows(torch.full((ranks.block_of(5)[1] - ranks.block_of(5)[0], 2), float(rank)), 5, device)
    result = {
        "rank": ranks.rank,
        "world": ranks.world,
        "agreed": ranks.agree(float(rank), device),
        "scores": scores,
        "selection": selection,
        "gathered": whole,
        "summed": ranks.all_reduce_sum(torch.tensor([1.0]), device),
    }
    torch.save(result, pathlib.Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()
