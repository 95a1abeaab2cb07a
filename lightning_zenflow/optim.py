"""``ZenFlowAdamW``: ZenFlow as a ``torch.optim.Optimizer``, for any training loop.

A plain PyTorch loop, Lightning Fabric (and litgpt, which takes ``--optimizer`` as a class path), the Hugging Face
``Trainer`` (``optimizers=(opt, None)``), accelerate, or a LightningModule under ``strategy="auto"`` (a GAN's two
optimizers under manual optimization): each calls ``step()``, ``zero_grad()``, ``state_dict()``, and reads
``param_groups``. This class is a ``torch.optim.AdamW`` whose ``step`` hands the gradients to the same engine the
Lightning strategy drives (:class:`~lightning_zenflow.engine.ZenFlowEngine`); there is no second copy of the rule.

- ``param_groups`` are read at every step, so any LR scheduler works; ``add_param_group`` and ``requires_grad_``
  flips are followed at the next step.
- ``step(closure)`` runs the closure (with gradients enabled) first, as AdamW does. Clip (``clip_grad_norm_``) and
  unscale before ``step``, as with AdamW. ``torch.amp.GradScaler.step(opt)`` hands over its overflow flag and scale
  on the device (``_step_supports_amp_scaling``): an overflowed step is skipped, with no host read.
- ``state_dict()`` is torch AdamW's format (full fp32 moments and a step per parameter, loadable by a plain
  ``torch.optim.AdamW``) plus the engine's exact extras under ``"zenflow"`` (the fp32 masters, the selection, the
  open window and a host update in flight), so a save and load continues bitwise. ``load_state_dict`` takes either.
- ``flush()`` applies everything in flight (the end of training: call it before saving the final model);
  ``close()`` stops the worker; as a context manager it flushes on a clean exit and closes either way. A worker that
  nobody closed is stopped at interpreter exit (and ends by itself when its parent process does), leaving no process
  or shared memory.
- Data parallel (DDP, or Fabric's ``strategy="zenflow"``): with torch.distributed initialised and more than one rank,
  the host state is sharded by rows across the ranks, as in the DDP strategy; the gradients must be all-reduced
  when ``step`` runs (DDP does that in backward).

The engine starts at the first ``step`` (or ``load_state_dict``), once the parameters sit on their device.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, Literal

import torch

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.ranks import Ranks

STATE_KEY = "zenflow"
"""Where ``state_dict()`` keeps the engine's exact extras beside torch AdamW's ``state`` and ``param_groups``."""
LIGHTNING_ONLY_KNOBS = ("sync_on", "log_telemetry", "checkpoint_format")
"""ZenFlowConfig fields that concern Lightning's Trainer only (its boundaries, loggers and checkpoint files)."""


class ZenFlowAdamW(torch.optim.AdamW):
    """AdamW with ZenFlow: the important columns of each matrix updated on the device, the rest on a CPU worker.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW`` (``model.named_parameters()`` names the
            checkpoint entries; otherwise they are named by position).
        lr, betas, eps, weight_decay: AdamW's, per param group.
        topk_ratio ... worker_timeout_s: the ZenFlow knobs, documented in
            :class:`~lightning_zenflow.config.ZenFlowConfig` (the README's table).
        ranks: the data-parallel ranks; ``None``: torch.distributed's default group when it is initialised with more
            than one rank (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` say which share of the machine is this rank's).
    """

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` hands this optimizer ``found_inf`` (and ``grad_scale``) instead of reading the
    overflow flag on the host."""
    zenflow_facade = True
    """The engine's check of overridden optimizer methods accepts this class: its ``step`` drives the engine."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
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
        importance: Literal["l2", "l1"] = "l2",
        host_threads: int | None = None,
        pt_reserved_cores_perc: float = 0.5,
        bind_cores: bool = True,
        worker_timeout_s: float = 10.0,
        steps_per_epoch: int | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        knobs = {
            name: value
            for name, value in locals().items()
            if name in {f.name for f in fields(ZenFlowConfig)} and name not in LIGHTNING_ONLY_KNOBS
        }
        # validated before anything else: a wrong knob is a clear error at construction
        config = ZenFlowConfig(**knobs)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._zenflow = _FacadeState(config=config, ranks=ranks, steps_per_epoch=steps_per_epoch)

    # ------------------------------------------------------------------------------------------ the engine
    @property
    def zenflow_config(self) -> ZenFlowConfig:
        return self._zenflow.config

    @property
    def engine(self) -> ZenFlowEngine | None:
        """The running engine (``None`` before the first step and after ``close()``); ``engine.last_stats`` is the
        last step's telemetry."""
        return self._zenflow.engine

    def _ensure_engine(self) -> ZenFlowEngine:
        facade = self._zenflow
        if facade.closed:
            raise RuntimeError("this ZenFlowAdamW was closed; build a new optimizer to train on.")
        if facade.engine is None:
            names = {}
            for group_index, group in enumerate(self.param_groups):
                for position, param in enumerate(group["params"]):
                    given = group.get("param_names")
                    names[param] = given[position] if given else f"group{group_index}.param{position}"
            engine = ZenFlowEngine(
                self,
                facade.config,
                param_names=names,
                steps_per_epoch=facade.steps_per_epoch,
                ranks=facade.ranks or _default_ranks(),
            )
            facade.engine = engine.start()
            _LIVE_ENGINES.add(engine)  # stopped at interpreter exit if nobody closed it
        return facade.engine

    # ------------------------------------------------------------------------------------------ optimizer API
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._ensure_engine()
        # torch.amp.GradScaler.step hands these over on the device (_step_supports_amp_scaling)
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            # gradients still scaled (GradScaler.step without unscale_ first): unscale them on the device
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, grad_scale.to(grads[0].device))
        engine.step(found_inf)
        return loss

    def flush(self) -> None:
        """Apply everything in flight and close the open window: the weights then hold every gradient. Call it at the
        end of training, before the final weights are saved or evaluated."""
        engine = self._zenflow.engine
        if engine is not None:
            engine.flush()
            engine.wait_for_update()

    def sync(self) -> None:
        """Apply the host update in flight (the open window stays open)."""
        engine = self._zenflow.engine
        if engine is not None:
            engine.sync()
            engine.wait_for_update()

    def adopt_weights(self) -> None:
        """After editing parameters in place (a weight clamp): the edited weights become the engine's masters."""
        engine = self._zenflow.engine
        if engine is not None:
            engine.adopt_weights()
            engine.wait_for_update()

    def close(self) -> None:
        """Stop the host worker and release the engine's memory (nothing is flushed). Idempotent."""
        facade = self._zenflow
        facade.closed = True
        engine, facade.engine = facade.engine, None
        if engine is not None:
            _LIVE_ENGINES.discard(engine)
            engine.close()

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self.close()

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch AdamW's format, plus the engine's exact extras under ``"zenflow"`` (not read by plain AdamW).
        Data parallel: every rank calls it (the host rows are gathered); the per-parameter state is on rank 0."""
        engine = self._zenflow.engine
        if engine is None:
            return super().state_dict()
        torch_state = engine.torch_state_dict()
        torch_state[STATE_KEY] = engine.state_dict(include_moments=False)
        return torch_state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a state saved by ``state_dict()`` (exact: it continues bitwise) or a plain torch Adam/AdamW state
        (moments and steps taken over; the selection starts afresh). The param groups' hyperparameters are restored
        too. An engine that has stepped is rebuilt first."""
        groups_only = {"state": {}, "param_groups": state_dict["param_groups"]}
        super().load_state_dict(groups_only)
        engine = self._ensure_engine()
        if STATE_KEY in state_dict:
            engine.load_state_dict(state_dict[STATE_KEY], torch_state=state_dict)
        else:
            engine.load_torch_state_dict(state_dict)

    # ------------------------------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_zenflow_config"] = self._zenflow.config
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict calls this too (with state and param_groups only): the running facade stays
        config = state.pop("_zenflow_config", None)
        super().__setstate__(state)
        if "_zenflow" not in vars(self):  # unpickled: a new facade, its engine started at the first step
            self._zenflow = _FacadeState(config=config or ZenFlowConfig(), ranks=None, steps_per_epoch=None)

    def __repr__(self) -> str:
        return f"ZenFlowAdamW({self._zenflow.config!r}, {len(self.param_groups)} param groups)"


class _FacadeState:
    """What the facade keeps beside torch's optimizer state (kept out of ``param_groups`` and ``defaults``)."""

    def __init__(self, config: ZenFlowConfig, ranks: Ranks | None, steps_per_epoch: int | None) -> None:
        self.config = config
        self.ranks = ranks
        self.steps_per_epoch = steps_per_epoch
        self.engine: ZenFlowEngine | None = None
        self.closed = False


def _default_ranks() -> Ranks:
    """torch.distributed's default group when it has more than one rank; one rank otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return Ranks()
    return Ranks.from_process_group(
        local_rank=int(os.environ.get("LOCAL_RANK", 0)), local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    )


_LIVE_ENGINES: weakref.WeakSet[ZenFlowEngine] = weakref.WeakSet()


def _close_quietly(engine: ZenFlowEngine) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit: nothing left to report to
        engine.close(quiet=True)


@atexit.register
def _close_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        _close_quietly(engine)
