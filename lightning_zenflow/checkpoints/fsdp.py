"""The checkpoint hooks of :class:`~lightning_zenflow.ZenFlowFSDPStrategy`: each rank's engine holds the row blocks
of its FSDP2 shards, so a checkpoint is gathered or written by rows.

- ``checkpoint_format="sharded"`` (the default) writes a ``torch.distributed.checkpoint`` directory
  (``checkpoints/sharded.py``) in which the weights are FSDP2's DTensors and every parameter's ZenFlow state a
  row-sharded DTensor over the rank's host memory, placed on FSDP2's mesh (HSDP: ``(Replicate(), Shard(0))`` on the
  2-D mesh, so a replicated block is written once): no rank gathers anything, and it resumes at any number of ranks,
  with or without HSDP.
- ``"full"`` gathers everything to rank 0 into the other strategies' format (``checkpoints/fsdp_state.py``'s
  ``consolidate``, over each shard group): one ``.ckpt`` that resumes under ``ZenFlowStrategy``, the data-parallel
  strategy, plain AdamW, or this one. Loading cuts a whole state to this rank's rows. For models whose whole state
  fits rank 0's host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from typing_extensions import override

from lightning_zenflow.checkpoints.fsdp_state import (
    ROW_KEYS,
    consolidate,
    is_dtensor,
    local_row_state,
    local_torch_state,
    local_vector,
)
from lightning_zenflow.checkpoints.hooks import CHECKPOINT_KEY, CheckpointHooks
from lightning_zenflow.checkpoints.sharded import save_sharded
from lightning_zenflow.engine import ZenFlowEngine


class FSDPCheckpointHooks(CheckpointHooks):
    """The checkpoint hooks over FSDP2's row shards (module docstring), ahead of :class:`CheckpointHooks` in the
    strategy's bases."""

    _consolidated: tuple[object, dict, dict] | None = None
    """The consolidated state and the point of the run it was taken at (taken once per point of the run)."""

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True  # the optimizer state goes to the engine (load_optimizer_state_dict), not loaded in place

    @override
    def _final_state_of(self, engine: ZenFlowEngine) -> tuple[dict | None, dict, dict | None]:
        return (None, engine.row_block_state_dict(), None)

    def _row_state(self) -> dict | None:
        if self.engine is not None:
            return self.engine.row_block_state_dict()
        return None if self._final_state is None else self._final_state[1]

    def _global_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (rows, cols)}`` of every parameter as a whole (a vector: ``(n, 1)``)."""
        shapes = {}
        for name, param in self.lightning_module.named_parameters():
            rows = param.shape[0] if param.dim() else 1
            shapes[name] = (rows, param.numel() // max(1, rows))
        return shapes

    def _consolidate(self) -> tuple[dict, dict] | None:
        """The whole state on rank 0 in the other strategies' format: (torch AdamW state, ZenFlow state without
        moments); ``({"state": {}, ...}, {})`` on the other ranks. Collective: every rank gathers each tensor of its
        rows (one whole tensor of device memory at a time). Taken once per point of the run."""
        key = self.engine.state_point() if self.engine is not None else None
        if self._consolidated is not None and self._consolidated[0] == key and key is not None:
            return self._consolidated[1], self._consolidated[2]
        row_state = self._row_state()
        if row_state is None:
            return None
        torch_state, state = consolidate(
            row_state, self.optimizers[0], self.lightning_module, self._engine_ranks(), self.root_device
        )
        self._consolidated = (key, torch_state, state)
        return torch_state, state

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.engine is None and self._final_state is None:
            return super().optimizer_state(optimizer)
        if self._sharded_checkpoints:
            return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
        consolidated = self._consolidate()
        return consolidated[0]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        row_state = None
        if "optimizer_states" in checkpoint:
            row_state = self._row_state() if self._sharded_checkpoints else None
            if not self._sharded_checkpoints and (self.engine is not None or self._final_state is not None):
                checkpoint[CHECKPOINT_KEY] = self._consolidate()[1]
        if row_state is None:
            ModelParallelStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)
            return
        shapes = self._global_shapes()
        flat = {
            **row_state,
            "params": {
                name: {
                    key: (value.reshape(-1, shapes[name][1]) if key in ROW_KEYS else value)
                    for key, value in entry.items()
                }
                for name, entry in row_state["params"].items()
            },
        }
        save_sharded(
            self.broadcast(str(filepath)),
            checkpoint,
            flat,
            {name: shapes[name] for name in flat["params"]},
            self._engine_ranks(),
            write_meta=lambda meta, file: self.checkpoint_io.save_checkpoint(meta, file),
            device_type=self.root_device.type,
            mesh=self._checkpoint_mesh(),
            writes_meta=self.is_global_zero,  # HSDP: one meta file, though every replica group has a rank 0
        )

    @override
    def _checkpoint_mesh(self) -> object | None:
        return self.shard_mesh  # FSDP2's mesh (HSDP: the 2-D one; DCP writes a replicated row block once)

    @override
    def _read_checkpoint_file(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # a plain read: ModelParallelStrategy's own reader would load the moments into the torch optimizer
        return Strategy.load_checkpoint(self, path, *args, **kwargs)

    @override
    def _sharded_model_targets(self) -> Mapping[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)  # this rank's shards, read in place

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state_dict = checkpoint["state_dict"]
        whole = not any(is_dtensor(value) for value in state_dict.values())
        options = StateDictOptions(full_state_dict=whole, strict=strict)
        set_model_state_dict(self.model, state_dict, options=options)
        if self.engine is not None:
            self.engine.adopt_weights()  # the engine started from the weights before the checkpoint replaced them

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.engine is None:
            return  # evaluation: no optimizer state to restore
        super().load_optimizer_state_dict(checkpoint)

    @override
    def _load_engine_state(self, checkpoint: Mapping[str, Any], torch_state: Mapping[str, Any]) -> None:
        shapes = {name: tuple(param.shape) for name, param in self.lightning_module.named_parameters()}
        state = checkpoint.get(CHECKPOINT_KEY)
        ranks = self._engine_ranks()
        local_shapes = {name: tuple(shadow.shape) for shadow, name in self._shards.names.items()}
        if state is not None and state.get("row_blocks"):
            params = {}
            for name, entry in state["params"].items():
                if entry.get("kind") == "device":
                    # a vector as this rank's rows: a whole one (a data-parallel directory) is cut to them
                    entry = {
                        key: (
                            local_vector(value, shapes[name], local_shapes[name], ranks) if key in ROW_KEYS else value
                        )
                        for key, value in entry.items()
                    }
                params[name] = entry
            self.engine.load_state_dict({**state, "params": params})
            return
        names = [self._shards.names[shadow] for _, shadow in self._shards.pairs]
        if state is None:
            self.engine.load_torch_state_dict(local_torch_state(torch_state, names, shapes, ranks))
            return
        self.engine.load_state_dict(local_row_state(state, torch_state, names, shapes, local_shapes, ranks))
