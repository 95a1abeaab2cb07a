"""The checkpoint hooks of the Lightning strategies: what a ``.ckpt`` file (or a sharded directory) holds, and its
checks before anything is loaded.

- **Saving**: ``checkpoint_format="full"`` writes one Lightning file: the moments in torch AdamW's format under
  ``optimizer_states`` (so plain AdamW resumes from it), the engine's own state (masters, selection, the open window,
  the update in flight) under :data:`CHECKPOINT_KEY`. ``"sharded"`` writes a directory that every rank writes its
  share of (``checkpoints/sharded.py``). A checkpoint saved after fit reads the state the closing engine left.
- **Loading**: the file is read and checked against the module (parameter names and shapes, the engine state against
  every parameter) before Lightning loads anything from it; what does not fit is a :class:`CheckpointError` naming
  the file and what differs. The optimizer state then goes into the engine, which validates it before it writes.

:class:`CheckpointHooks` is a mixin of :class:`~lightning_zenflow.strategies.base.ZenFlowStrategyBase`: it reads the
strategy's engine, knobs and ranks, and ``super()`` reaches the Lightning strategy class.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_zenflow.checkpoints.sharded import (
    FORMAT_KEY,
    META_FILE,
    is_sharded_checkpoint,
    load_sharded,
    matrix_shapes,
    save_sharded,
)
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.state_checks import check_state, state_dict_mismatch, unreadable_checkpoint

CHECKPOINT_KEY = "zenflow"
"""Top-level checkpoint key of the engine's own state (the moments live in ``optimizer_states``)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, or saved for another model. The message names the file
    and what differs; it is raised before anything from the file is loaded into the model or the optimizer."""


class CheckpointHooks:
    """Lightning's checkpoint hooks for a ZenFlow strategy: full files and sharded directories (module docstring)."""

    engine: ZenFlowEngine | None
    _final_state: tuple[dict | None, dict, dict | None] | None
    """After fit: (torch state or None, engine state, matrix shapes or None), for ``trainer.save_checkpoint``."""
    _checkpoint_path: str | None

    def _final_state_of(self, engine: ZenFlowEngine) -> tuple[dict | None, dict, dict | None]:
        """What a checkpoint saved after fit needs of a closing engine: (torch state, engine state, shapes)."""
        if self._sharded_checkpoints:
            return (None, engine.row_block_state_dict(), matrix_shapes(engine))
        return (engine.torch_state_dict(), engine.state_dict(include_moments=False), None)

    @property
    def _sharded_checkpoints(self) -> bool:
        return self.zenflow_config.checkpoint_format == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        trainer = getattr(self.lightning_module, "_trainer", None)  # None: a module connected without a Trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if "checkpoint" in self.zenflow_config.sync_on and fitting:
            self.sync()
        if self.engine is not None:
            self.engine.wait_for_update()  # the weights are read (copied to the CPU) on the compute stream next
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        manual_state = self._manual.state_of(optimizer) if self._manual is not None else None
        if manual_state is not None:
            return manual_state
        if self._sharded_checkpoints and (self.engine is not None or self._final_state is not None):
            # the moments go into the sharded directory (save_checkpoint), not into one consolidated dict
            return {"state": {}, "param_groups": torch.optim.Optimizer.state_dict(optimizer)["param_groups"]}
        if self.engine is not None:
            return self.engine.torch_state_dict()
        if self._final_state is not None:
            return self._final_state[0]
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if "optimizer_states" in checkpoint and self._sharded_checkpoints:
            if self.engine is not None:
                state, shapes = self.engine.row_block_state_dict(), matrix_shapes(self.engine)
                self._save_sharded(checkpoint, filepath, state, shapes)
                return
            if self._final_state is not None:
                self._save_sharded(checkpoint, filepath, self._final_state[1], self._final_state[2])
                return
        if "optimizer_states" in checkpoint:
            if self.engine is not None:
                checkpoint[CHECKPOINT_KEY] = self.engine.state_dict(include_moments=False)
            elif self._final_state is not None:
                checkpoint[CHECKPOINT_KEY] = self._final_state[1]
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _save_sharded(
        self, checkpoint: dict[str, Any], filepath: Any, state: dict, shapes: dict[str, tuple[int, int]]
    ) -> None:
        """``checkpoint_format="sharded"``: every rank writes its share of a directory (``sharded.py``)."""
        path = self.broadcast(str(filepath))  # every rank writes into rank 0's directory
        save_sharded(
            path,
            checkpoint,
            state,
            shapes,
            self._engine_ranks(),
            write_meta=lambda meta, file: self.checkpoint_io.save_checkpoint(meta, file),
            device_type=self.root_device.type,
            mesh=self._checkpoint_mesh(),
            writes_meta=self.is_global_zero,
        )

    def _checkpoint_mesh(self) -> object | None:
        """The mesh a sharded directory's row blocks are placed on (None: one dimension over the engine's ranks)."""
        return None

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Read a checkpoint file (or a sharded directory) and check it against the module before Lightning loads
        anything from it.

        A file that cannot be read (truncated, corrupt, not a checkpoint) or that was saved for another model
        (parameter names or shapes) fails here, with the file named and what differs.
        """
        self._checkpoint_path = str(checkpoint_path)
        if is_sharded_checkpoint(checkpoint_path):
            return self._load_sharded(checkpoint_path, *args, **kwargs)
        try:
            checkpoint = self._read_checkpoint_file(checkpoint_path, *args, **kwargs)
        except FileNotFoundError:
            raise  # Lightning's own message names the path
        except Exception as error:
            raise CheckpointError(unreadable_checkpoint(checkpoint_path, error)) from error
        problem = self._checkpoint_mismatch(checkpoint)
        if problem is not None:
            raise CheckpointError(f"cannot resume from {checkpoint_path}: {problem}")
        return checkpoint

    def _read_checkpoint_file(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One checkpoint file, read as the Lightning strategy reads it (the checkpoint IO's ``torch.load``)."""
        return super().load_checkpoint(path, *args, **kwargs)  # type: ignore[misc]

    def _sharded_model_targets(self) -> Mapping[str, torch.Tensor] | None:
        """Where a sharded directory's weights are read into (None: new whole tensors, loaded by Lightning)."""
        return None

    def _load_sharded(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        meta_file = pathlib.Path(path) / META_FILE
        try:
            meta = self._read_checkpoint_file(meta_file, *args, **kwargs)
        except Exception as error:
            raise CheckpointError(unreadable_checkpoint(meta_file, error)) from error
        if meta.get("zenflow", {}).get("rows_local") and not self._engine_ranks().rows_local:
            raise CheckpointError(
                f"cannot resume from {path}: this sharded directory was written by zenflow_fsdp, whose vectors are "
                "sharded by rows too; resume it with strategy='zenflow_fsdp', or save it there with "
                "checkpoint_format='full', which every strategy reads."
            )
        module = self.lightning_module
        written = meta.get(FORMAT_KEY, {}).get("model", {})
        shapes_only = {key: torch.empty(shape, device="meta") for key, shape in written.items()}
        problem = state_dict_mismatch(shapes_only, module.state_dict(), strict=getattr(module, "strict_loading", True))
        if problem is not None:
            raise CheckpointError(f"cannot resume from {path}: {problem}")
        param_shapes = {name: tuple(param.shape) for name, param in module.named_parameters()}
        try:
            checkpoint = load_sharded(
                path,
                meta,
                module.state_dict(),
                param_shapes,
                self._engine_ranks(),
                self.root_device.type,
                model_targets=self._sharded_model_targets(),
                mesh=self._checkpoint_mesh(),
            )
        except Exception as error:
            raise CheckpointError(unreadable_checkpoint(path, error)) from error
        problem = self._checkpoint_mismatch(checkpoint)
        if problem is not None:
            raise CheckpointError(f"cannot resume from {path}: {problem}")
        return checkpoint

    def _checkpoint_mismatch(self, checkpoint: object) -> str | None:
        """What makes ``checkpoint`` unfit for this module (None: nothing). Reads only."""
        if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
            return "it is not a Lightning checkpoint (it has no 'state_dict'); pass a .ckpt file that Lightning saved."
        module = self.lightning_module
        if module is None:
            return None
        problem = state_dict_mismatch(
            checkpoint["state_dict"], module.state_dict(), strict=getattr(module, "strict_loading", True)
        )
        if problem is not None:
            return problem
        fitting = module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitting and CHECKPOINT_KEY in checkpoint:
            # the optimizer does not exist yet: check the engine state against every parameter of the module
            shapes = {name: tuple(param.shape) for name, param in module.named_parameters()}
            try:
                check_state(checkpoint[CHECKPOINT_KEY], shapes, require_all=False)
            except ValueError as error:
                return str(error)
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self._manual is not None:
            self._manual.load(checkpoint["optimizer_states"], f"cannot resume from {self._checkpoint_path or 'it'}")
            return
        if self.engine is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        where = f"cannot resume from {self._checkpoint_path or 'the checkpoint'}"
        optimizer_states = checkpoint["optimizer_states"]
        if not optimizer_states:
            # a weights-only export (no optimizer state): as Lightning does, train on with a fresh optimizer; the
            # engine started from the checkpoint's weights, which Lightning restored before the strategy's setup
            source = self._checkpoint_path or "the checkpoint"
            rank_zero_info(f"ZenFlow: {source} holds no optimizer state; the optimizer starts fresh from its weights.")
            return
        if len(optimizer_states) != 1:
            raise CheckpointError(
                f"{where}: it holds {len(optimizer_states)} optimizer states; ZenFlow resumes from exactly one."
            )
        torch_state = optimizer_states[0]
        optimizer = self.optimizers[0]
        if len(torch_state["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(
                f"{where}: it has {len(torch_state['param_groups'])} param groups, configure_optimizers built "
                f"{len(optimizer.param_groups)}; resume with the same optimizer setup."
            )
        # the groups as they are now (a callback such as BaseFinetuning may have re-added some since the setup)
        self.engine.follow_optimizer()
        # the engine validates everything before it writes anything: a failed load leaves it untouched
        try:
            self._load_engine_state(checkpoint, torch_state)
        except ValueError as error:
            raise CheckpointError(f"{where}: {error}") from error
        # hyperparameters only: loading the moments into the torch optimizer would duplicate them on the device
        for group, saved in zip(optimizer.param_groups, torch_state["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def _load_engine_state(self, checkpoint: Mapping[str, Any], torch_state: Mapping[str, Any]) -> None:
        """The checkpoint's optimizer state into the engine: ZenFlow's own state, or a plain torch AdamW one."""
        if CHECKPOINT_KEY in checkpoint:
            self.engine.load_state_dict(checkpoint[CHECKPOINT_KEY], torch_state=torch_state)
        else:
            self.engine.load_torch_state_dict(torch_state)
