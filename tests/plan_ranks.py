"""One rank of the planner's 2-rank checks (``tests/test_plan_budget.py``): engines over a tiny Llama with tied
embeddings, data parallel (every rank the whole model, the host state of its row block) or FSDP2 (``fully_shard`` on
every decoder layer and the model, the engine on the local shards as ``ZenFlowFSDPStrategy`` builds it), each stepped
past its first selection and a landing; the bytes each engine counts go to ``out/rank{r}.pt``."""

from __future__ import annotations

import pathlib

import torch
from distributed_helpers import init_group

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine, spares
from lightning_zenflow.engine.ranks import Ranks

STEPS = 5
"""A warm-up step, the first selection, a window end, a landing (windows of 2 steps)."""


def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    """Row counts 2 ranks do not all divide evenly (a vocabulary of 301), tied embeddings."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=301,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def optimizer_of(params: list[torch.nn.Parameter], weight_decay: float, l2: bool) -> torch.optim.Optimizer:
    """Matrices with the decay, vectors without (``CausalLMFineTune``'s groups); Adam's L2 decay or AdamW's."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kind = torch.optim.Adam if l2 else torch.optim.AdamW
    return kind(groups, lr=1e-3)


def run(rank: int, world: int, port: int, layout: str, dtype: torch.dtype, jobs: list[dict], out: str) -> None:
    """Every job (``knobs``, ``weight_decay``, ``l2``) one after another in one process group."""
    import torch.distributed as dist

    init_group(rank, world, port)
    spares.keep_spare_workers(True)
    results = []
    try:
        for job in jobs:
            results.append(_engine_bytes(rank, world, layout, dtype, job))
    finally:
        spares.keep_spare_workers(False)
    torch.save(results, pathlib.Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _engine_bytes(rank: int, world: int, layout: str, dtype: torch.dtype, job: dict) -> dict:
    model = tiny_llama(dtype)
    names = {param: name for name, param in model.named_parameters()}
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():  # the engine's parameters share the memory of the local shards
            shards = {name: torch.nn.Parameter(param.to_local()) for name, param in model.named_parameters()}
        params = list(shards.values())
        names = {param: name for name, param in shards.items()}
        ranks = Ranks.from_process_group(local_rank=rank, local_world=world, rows_local=True)
    else:
        params = list(model.parameters())
        ranks = Ranks.from_process_group(local_rank=rank, local_world=world)
    optimizer = optimizer_of(params, job["weight_decay"], job["l2"])
    config = ZenFlowConfig(**{"full_warm_up_rounds": 1, **job["knobs"]}, host_threads=1, bind_cores=False)
    engine = ZenFlowEngine(optimizer, config, param_names=names, ranks=ranks).start()
    if layout == "fsdp2" and engine.interim is not None:
        # the row blocks the strategy gives the moves (their statistics are over the whole matrix's rows)
        engine.interim.shard_rows = {
            name: (ranks.block_of(whole.shape[0])[0], whole.shape[0]) for whole, name in _whole(model).items()
        }
    generator = torch.Generator().manual_seed(rank)
    try:
        for _ in range(STEPS):
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator).to(dtype)
            engine.step()
            engine.wait_for_update()
        return {"device": engine.device_bytes(), "host": engine.host_bytes(), "accumulate_on": engine.accumulate_on}
    finally:
        engine.close()


def _whole(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    return {param: name for name, param in model.named_parameters()}
