"""FSDP2 for :class:`~lightning_zenflow.llm.CausalLMFineTune` under ``zenflow_fsdp``: the Hugging Face model is
sharded by ``fully_shard`` on every decoder block, then on the whole model (the recipe of docs/distributed.md), over
the mesh :func:`shard_mesh` names; :func:`load_sharded` builds, shards and reads it with each rank reading its own rows
(``sharded_load.py``; mixture-of-experts files too, each rank reading its own experts: ``conversions.py``); the sample
after fit gathers it whole on rank 0 (:func:`whole_model`).

The blocks are the modules the model names in ``_no_split_modules`` (Hugging Face's own unit of sharding:
``LlamaDecoderLayer``, ...). The root's ``fully_shard`` takes every parameter outside them: the embeddings, the final
norm and the output layer. Tied input and output embeddings are one parameter in that one group, so they stay tied
(one shard, one gradient, one ZenFlow state).
"""

from __future__ import annotations

from typing import Any

import torch


def shard_mesh(module: Any) -> Any:
    """The device mesh ``fully_shard`` shards the model over: the strategy's ``shard_mesh`` where it has one (a 2-D
    replicate x shard mesh for HSDP), else the ``"data_parallel"`` dimension of the module's mesh. The one place that
    chooses it."""
    strategy_mesh = getattr(module.trainer.strategy, "shard_mesh", None)
    return strategy_mesh if strategy_mesh is not None else module.device_mesh["data_parallel"]


def load_sharded(model: torch.nn.Module, folder: str, mesh: Any, device: torch.device) -> int:
    """Shard ``model`` (built by :func:`~lightning_zenflow.llm.sharded_load.structure`: parameters on meta, buffers on
    the host) over ``mesh``, materialise this rank's shards on ``device`` and read its rows from ``folder``; the bytes
    this rank read from the files.

    Each rank allocates and reads its own rows only (of a fused mixture-of-experts parameter: its experts' file
    tensors, ``conversions.py``); the buffers the files do not hold (rotary tables) get back the values the
    constructor computed; tied parameters stay one parameter. The reads are planned from the files' headers first, so
    :class:`~lightning_zenflow.llm.sharded_load.ShardedLoadError` (naming the fix) comes before anything is allocated
    for a folder it cannot read (``pytorch_model.bin``, quantized weights, a missing tensor) or a conversion that
    cannot be done per row."""
    from lightning_zenflow.llm.sharded_load import host_buffers, load_rows, plan_folder, restore_buffers

    plan = plan_folder(model, folder)  # the headers alone: every refusal comes before a weight is allocated
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    buffers = host_buffers(model)  # to_empty replaces them with uninitialised memory
    shard_blocks(model, mesh)
    model.to_empty(device=device)  # this rank's rows of every parameter, uninitialised
    restore_buffers(model, buffers)
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        # FSDP2's DTensors keep their identity through to_empty (swapped in place), plain parameters do not
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("the tied embeddings came apart when the shards were materialised")
    return load_rows(model, folder, plan)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``model`` itself."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_blocks(model: torch.nn.Module, mesh: Any) -> None:
    """``fully_shard`` every block of ``model`` (its ``_no_split_modules`` classes), then ``model``, over ``mesh``.
    A model already sharded is left as it is (Lightning calls ``configure_model`` again for every ``fit``,
    ``validate``, ...)."""
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in block_classes]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no blocks to shard (`_no_split_modules` is {sorted(block_classes)} and "
            "no module is of those classes). Shard it in your own configure_model, or use strategy `zenflow`."
        )
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def whole_model(model: torch.nn.Module, is_global_zero: bool) -> Any:
    """The model to sample from: ``model`` itself when it is not sharded; under FSDP2 a plain copy with the whole
    weights on the CPU of rank 0, ``None`` on the other ranks (rank 0's host holds the whole model: only the sample
    after fit, ``sample_prompt``, takes this path; the export is written a tensor at a time, ``sharded_export.py``).

    Sharded, this is a collective: every rank must call it (each parameter is all-gathered, one at a time, to rank
    0's CPU). Rank 0 then holds the gathered weights and a copy of the model built from its config on the meta
    device, then given the gathered weights and the model's buffers; tied embeddings are tied in the copy, as in the
    config."""
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_global_zero:
        return None
    dtype = next(value.dtype for value in state.values() if value.is_floating_point())
    with torch.device("meta"):  # no random initialisation of weights that are overwritten next (minutes at 7 B)
        copy = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    copy.to_empty(device="cpu")
    copy.load_state_dict(state, strict=True)
    copy.tie_weights()
    for name, buffer in model.named_buffers():  # FSDP2 leaves buffers whole: the rotary tables, ...
        copy.get_buffer(name).copy_(buffer)
    copy.train(model.training)
    return copy
