"""A Lightning fit run as a script, for the data-parallel tests: Lightning's subprocess launcher re-runs
``sys.argv`` for every other rank, so a data-parallel fit cannot start inside pytest itself.

    python tests/ddp_script.py OUT_DIR '{"devices": 2, "strategy": {...}, ...}'

Every rank writes ``OUT_DIR/rank{global_rank}.pt`` after the fit: its final weights, its engine's host bytes
and link bytes, its worker's pid. Options (JSON): ``accelerator`` (default ``"cpu"``), ``devices``, ``strategy``
(knobs of ``ZenFlowStrategy``, or ``"adamw"`` for Lightning's plain DDP/single-device AdamW), ``batch_size``,
``max_steps``, ``max_epochs`` (default 100), ``accumulate_grad_batches``, ``ckpt_path`` (resume), ``checkpoint_every``
(Lightning's ModelCheckpoint writes ``OUT_DIR/step=N.ckpt`` every N steps), ``kill_worker_at`` (the worker of rank
``fault_rank``, default 1, is killed at that step), ``fail_at`` (that rank raises at that step), ``save_after``
(``trainer.save_checkpoint(OUT_DIR/after.ckpt)`` once the fit has ended), ``fsdp`` (the module applies FSDP2's
``fully_shard`` in ``configure_model``; the strategy is ``ZenFlowFSDPStrategy``, or Lightning's
ModelParallelStrategy for ``"adamw"``; ``shard`` names what is sharded: ``"all"`` (default), ``"none"``, ``"offload"``
(with ``CPUOffloadPolicy``)), ``entry`` (another fit with these options instead, ``"module:function"``: see
:func:`fit_of`), ``experts`` (the sharded module with a mixture-of-experts layer, :class:`ExpertsModule`).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pathlib
import signal
import sys
from collections.abc import Callable

import lightning
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from lightning_helpers import IN_FEATURES, OUT_FEATURES, SEED, TinyModule, make_dataset, weights  # noqa: E402


class InOrderModule(TinyModule):
    """Rank r takes samples r, r + world, ... in order: 2 ranks with batch b see the same global batches as 1 rank
    with batch 2b (Lightning's own distributed sampler shuffles the training data)."""

    out_features = OUT_FEATURES

    def train_dataloader(self) -> DataLoader:
        dataset = make_dataset(self.samples, seed=0, out_features=self.out_features)
        sampler = DistributedSampler(
            dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class ShardedModule(InOrderModule):
    """The in-order module, 8 -> 24 -> 6 (every row count splits evenly over 1, 2 and 3 ranks), under FSDP2:
    ``fully_shard`` on each linear layer, then on the root (docs/distributed.md). ``shard="none"`` leaves it
    unsharded (for the one-process strategies, and refused by ``zenflow_fsdp``), ``"offload"`` adds
    ``CPUOffloadPolicy`` (refused)."""

    out_features = 6

    def __init__(self, shard: str = "all", **kwargs: object) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(SEED)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(IN_FEATURES, 24), torch.nn.Tanh(), torch.nn.Linear(24, self.out_features)
        )
        self.shard = shard

    def configure_model(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if self.shard == "none":
            return
        if self.shard == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"), use_orig_params=True)
            return
        extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if self.shard == "offload" else {}
        # zenflow_fsdp's own mesh (2-D under HSDP); Lightning's ModelParallelStrategy has only its data-parallel one
        mesh = getattr(self.trainer.strategy, "shard_mesh", None) or self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, **extra)
        fully_shard(self, mesh=mesh, **extra)


class Experts(torch.nn.Module):
    """A mixture-of-experts layer as transformers 5 builds one: the experts fused in one ``[E, out, in]`` parameter used
    with ``F.linear`` and declared so (``is_transposed``, as transformers' experts modules say it); each sample goes to
    one expert by its first features, so some experts see no sample in a step (a zero gradient slice)."""

    is_transposed = False

    def __init__(self, experts: int = 4, features: int = 24) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, features, features) * 0.3)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        route = hidden[:, : self.weight.shape[0]].argmax(dim=1)
        mixed = torch.zeros_like(hidden)
        for expert in range(self.weight.shape[0]):
            chosen = route == expert
            if bool(chosen.any()):
                mixed[chosen] = torch.nn.functional.linear(hidden[chosen], self.weight[expert])
        return hidden + torch.tanh(mixed)


class ExpertsModule(ShardedModule):
    """The sharded module with an experts layer between its two linear layers (``experts`` option): under FSDP2 the
    experts are sharded by their first dimension, a block of whole experts per rank."""

    def __init__(self, shard: str = "all", **kwargs: object) -> None:
        super().__init__(shard=shard, **kwargs)
        torch.manual_seed(SEED + 1)
        self.experts = Experts()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.experts(self.net[1](self.net[0](inputs))))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.shard != "none":
            mesh = getattr(self.trainer.strategy, "shard_mesh", None) or self.device_mesh["data_parallel"]
            fully_shard(self.experts, mesh=mesh)
        super().configure_model()


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2's shards all-gathered: every rank calls it), as an fp32 CPU copy."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in module.named_parameters():
        value = param.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.float().cpu().clone()
    return out


import memory_probe  # noqa: E402

import lightning_zenflow  # noqa: E402
from lightning_zenflow.engine import spares  # noqa: E402


class Record(Callback):
    def __init__(self, kill_worker_at: int | None, fail_at: int | None, fault_rank: int, out: pathlib.Path) -> None:
        self.kill_worker_at = kill_worker_at
        self.fail_at = fail_at
        self.fault_rank = fault_rank
        self.out = out
        self.host_bytes: int | None = None
        self.link: list[tuple[int, int]] = []
        self.worker_pid: int | None = None
        self.device_bytes: dict[str, int] = {}
        self.memory: dict[str, int | None] = {}
        self.segments_before: set[str] = set()

    def setup(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, stage: str) -> None:
        # before the strategy builds the engine: the shared segments that are not the engine's
        if os.path.exists("/proc/self/maps"):
            self.segments_before = set(memory_probe.shared_segments())

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        # what Ctrl-C will do here (the Ctrl-C test checks it before it signals): an inherited SIG_IGN would ignore it
        (self.out / f"sigint{trainer.global_rank}.txt").write_text(repr(signal.getsignal(signal.SIGINT)))
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.worker_pid = engine.worker_pid
            (self.out / f"worker{trainer.global_rank}.pid").write_text(str(engine.worker_pid))
        (self.out / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_before_optimizer_step(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, *_: object
    ) -> None:
        # this rank's device bytes: its weights and gradients (an FSDP2 shard's local part), the engine's state
        params = list(pl_module.parameters())
        self.device_bytes["weights"] = sum(_local_bytes(param) for param in params)
        self.device_bytes["gradients"] = sum(_local_bytes(param.grad) for param in params if param.grad is not None)

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: object) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or engine.last_stats is None:
            return
        self.device_bytes["zenflow"] = engine.last_stats.device_bytes
        self.host_bytes = engine.last_stats.host_bytes
        self.link.append((engine.last_stats.d2h_bytes, engine.last_stats.h2d_bytes))
        if os.path.exists("/proc/self/maps") and trainer.global_step == trainer.max_steps:
            # the last step: every window but the last two has landed, so the worker has run an update over every row
            self.memory = memory_probe.probe(engine, self.segments_before)
        if trainer.global_step == self.kill_worker_at and trainer.global_rank == self.fault_rank:
            os.kill(engine.worker_pid, signal.SIGKILL)
        if trainer.global_step == self.fail_at and trainer.global_rank == self.fault_rank:
            raise RuntimeError(f"a failure in rank {self.fault_rank}'s training step")


def fit(out: pathlib.Path, options: dict) -> None:
    """One fit with ``options`` (see the module docstring); every rank writes its results into ``out``. A one-device
    fit may run inside the calling process (the tests do that: no launcher is involved)."""
    devices = options.get("devices", 1)
    knobs = options.get("strategy", {})
    timeout = datetime.timedelta(seconds=60)
    fsdp = bool(options.get("fsdp"))
    if knobs == "adamw":
        strategy = "ddp" if devices > 1 else "auto"
        if fsdp:
            # Lightning's default mesh puts the processes in the tensor-parallel dimension: here they all shard
            strategy = lightning.pytorch.strategies.ModelParallelStrategy(
                data_parallel_size=devices, tensor_parallel_size=1, timeout=timeout
            )
        elif devices > 1:
            strategy = lightning.pytorch.strategies.DDPStrategy(timeout=timeout)
    elif fsdp:
        knobs = {"full_warm_up_rounds": 0, "host_threads": 1, "bind_cores": False, **knobs}
        strategy = lightning_zenflow.ZenFlowFSDPStrategy(timeout=timeout, **knobs)
    else:
        # the tests exercise the paper's rule unless they set the warm-up (their runs are a few steps long)
        knobs = {"full_warm_up_rounds": 0, "host_threads": 1, "bind_cores": False, **knobs}
        if devices > 1:
            # a hung peer fails a test within a minute (Trainer(strategy="zenflow", devices=2) is the console test's)
            strategy = lightning_zenflow.ZenFlowDDPStrategy(timeout=timeout, **knobs)
        else:
            strategy = lightning_zenflow.ZenFlowStrategy(**knobs)
    record = Record(options.get("kill_worker_at"), options.get("fail_at"), options.get("fault_rank", 1), out)
    callbacks: list[Callback] = [record]
    if options.get("checkpoint_every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=out, filename="{step}", every_n_train_steps=options["checkpoint_every"], save_top_k=-1
            )
        )
    samples, batch_size = options.get("samples", 32), options.get("batch_size", 4)
    if options.get("experts"):
        module = ExpertsModule(shard="all" if fsdp else "none", samples=samples, batch_size=batch_size)
    elif fsdp or options.get("wide"):
        shard = options.get("shard", "all") if fsdp else "none"
        module = ShardedModule(shard=shard, samples=samples, batch_size=batch_size)
    else:
        module = InOrderModule(samples=samples, batch_size=batch_size)
    trainer = lightning.Trainer(
        accelerator=options.get("accelerator", "cpu"),
        devices=devices,
        strategy=strategy,
        max_steps=options.get("max_steps", 8),
        accumulate_grad_batches=options.get("accumulate_grad_batches", 1),
        gradient_clip_val=options.get("gradient_clip_val"),
        max_epochs=options.get("max_epochs", 100),
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
    if options.get("save_after"):
        trainer.save_checkpoint(out / "after.ckpt")  # every rank calls it, as Lightning requires
    result = {
        "weights": full_weights(module) if fsdp else weights(module),
        "global_step": trainer.global_step,
        "host_bytes": record.host_bytes,
        "device_bytes": record.device_bytes,
        "memory": record.memory,
        "link": record.link,
        "worker_pid": record.worker_pid,
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


def fit_of(options: dict) -> Callable[[pathlib.Path, dict], None]:
    """The fit to run: :func:`fit`, or ``options["entry"]`` (``"module:function"``, a module of tests/, such as
    ``"llm_helpers:fit"``), called with the same arguments."""
    entry = options.get("entry")
    if entry is None:
        return fit
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    run(pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]))


def run(out: pathlib.Path, options: dict) -> None:
    """One fit, or with ``{"batch": [[OUT_DIR, OPTIONS], ...]}`` several one after another in the same processes (one
    launch, one process group: Lightning launches the ranks at the first fit and reuses them for the others; each fit's
    engine adopts the host worker of the fit before)."""
    runs = options.get("batch", [[str(out), options]])
    # every fit after the first adopts the host worker the one before it closed (engine/spares.py)
    spares.keep_spare_workers(len(runs) > 1)
    try:
        for path, each in runs:
            pathlib.Path(path).mkdir(parents=True, exist_ok=True)
            fit_of(each)(pathlib.Path(path), each)
    finally:
        spares.keep_spare_workers(False)


if __name__ == "__main__":
    main()
