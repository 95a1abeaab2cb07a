"""``ZenFlowAdamW``: ZenFlow as a ``torch.optim.Optimizer``, for any training loop.

A plain PyTorch loop, Lightning Fabric (and litgpt, which takes ``--optimizer`` as a class path), the Hugging Face
``Trainer`` (``optimizers=(opt, None)``), accelerate, or a LightningModule under ``strategy="auto"`` (a GAN's two
optimizers under manual optimization): each calls ``step()``, ``zero_grad()``, ``state_dict()``, and reads
``param_groups``. This class is a ``torch.optim.AdamW`` whose ``step`` hands the gradients to the same engine the
Lightning strategy drives (:class:`~lightning_zenflow.engine.ZenFlowEngine`); there is no second copy of the rule.

- ``param_groups`` are read at every step, so any LR scheduler works; ``add_param_group`` and ``requires_grad_``
  flips are followed at the next step.
- ``step(closure)`` runs the closure (with gradients enabled) first, as AdamW does, and returns its loss. Clip
  (``clip_grad_norm_``) and unscale before ``step``, as with AdamW. ``torch.amp.GradScaler.step(opt)`` hands over its
  overflow flag and scale on the device (``_step_supports_amp_scaling``): an overflowed step is skipped, with no host
  read. A step with no gradient to apply (nothing requires grad, or no ``.grad`` yet) changes nothing, as AdamW's,
  and starts no engine; the step hooks (``register_step_pre_hook``, ...) run around every step.
- AdamW's keywords are accepted at the values ZenFlow runs: ``maximize`` (either value: the gradients of a
  ``maximize=True`` group are negated for the engine and put back after), ``foreach`` and ``fused`` (any value, no
  effect: they choose torch's implementation, not the numbers, and ZenFlow's kernels are always fused; a script that
  passes ``fused=True`` on CUDA runs unchanged), ``amsgrad=False``, ``capturable=False``, ``differentiable=False``;
  ``True`` for these three is refused by name, since it would change what is computed.
- ``state_dict()`` is torch AdamW's format (full fp32 moments and a step per parameter, loadable by a plain
  ``torch.optim.AdamW``) plus the engine's exact extras under ``"zenflow"`` (the fp32 masters, the selection, the
  open window and a host update in flight), so a save and load continues bitwise. ``load_state_dict`` takes either.
  The extras are keyed by position (``group0.param0``, as torch keys ``state``), so an optimizer built from
  ``model.named_parameters()`` and one built from ``model.parameters()`` give the same state dict apart from torch's
  ``param_names``; a state is checked by name on load when both optimizers were built with names, and by position
  (group, index) and shape always.
- ``copy.deepcopy(optimizer)`` (or pickling) gives an optimizer over the copied parameters that continues from the
  original's state: it starts its own engine and worker at its first step (nothing of the original's is shared).
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal

import torch

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.notices import notice_once
from lightning_zenflow.engine.prestart import prestart_worker
from lightning_zenflow.engine.ranks import Ranks
from lightning_zenflow.matrices import matrix_columns
from lightning_zenflow.optim_state import (
    STATE_KEY,
    check_fits,
    extras_by_engine_name,
    extras_by_position,
    positional_name,
)

LIGHTNING_ONLY_KNOBS = ("sync_on", "log_telemetry", "checkpoint_format")
"""ZenFlowConfig fields that concern Lightning's Trainer only (its boundaries, loggers and checkpoint files)."""
FACADE_KNOBS = tuple(f.name for f in fields(ZenFlowConfig) if f.name not in LIGHTNING_ONLY_KNOBS)
"""The ZenFlow knobs ``ZenFlowAdamW`` takes: every ``ZenFlowConfig`` field but the Trainer's."""
IMPLEMENTATION_OPTIONS = ("foreach", "fused")
"""torch.optim.AdamW's keywords that choose an implementation of the same numbers: accepted with any value, no effect
(ZenFlow's kernels are always fused, on the device and on the host). torch's own checks of them still run."""
TORCH_OPTIONS: dict[str, tuple[tuple[object, ...], str]] = {
    "amsgrad": ((False,), "ZenFlow keeps no running maximum of the second moment; leave amsgrad unset (False)"),
    "capturable": (
        (False,),
        "ZenFlowAdamW's step hands work to a host worker process, which a CUDA graph cannot capture; leave "
        "capturable unset (False)",
    ),
    "differentiable": (
        (False,),
        "ZenFlowAdamW's update runs outside autograd (fused kernels, a host worker); leave differentiable unset "
        "(False)",
    ),
}
"""torch.optim.AdamW's keywords that change what is computed, which ZenFlowAdamW accepts only at these values, and why
(``maximize`` takes either value; :data:`IMPLEMENTATION_OPTIONS` any)."""


class ZenFlowAdamW(torch.optim.AdamW):
    """AdamW with ZenFlow: the important columns of each matrix updated on the device, the rest on a CPU worker.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW`` (``model.named_parameters()`` names the
            checkpoint entries; otherwise they are named by position).
        lr, betas, eps, weight_decay: AdamW's, per param group.
        amsgrad, maximize, foreach, capturable, differentiable, fused: AdamW's keywords. ``foreach`` and ``fused``
            take any value and change nothing (:data:`IMPLEMENTATION_OPTIONS`); ``maximize=True`` is supported (per
            param group too); ``amsgrad``, ``capturable`` and ``differentiable`` only at False (:data:`TORCH_OPTIONS`).
        topk_ratio ... worker_timeout_s: the ZenFlow knobs, documented in
            :class:`~lightning_zenflow.config.ZenFlowConfig` (the table in docs/knobs.md).
        ranks: the data-parallel ranks; ``None``: torch.distributed's default group when it is initialised with more
            than one rank (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` say which share of the machine is this rank's).
        model: the model whose parameters these are, read once here for how its 3-D expert weights split into
            matrices of input channels (transformers' experts modules declare it; ``expert_layouts`` names others;
            ``lightning_zenflow/matrices.py``). Without it a 3-D parameter is split as ``[shape[0], the rest]``, said
            once. Not kept (a copy of the optimizer does not copy the model).
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
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
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
        host_threads: int | None = None,
        pt_reserved_cores_perc: float = 0.5,
        bind_cores: bool = True,
        worker_timeout_s: float = 10.0,
        steps_per_epoch: int | None = None,
        ranks: Ranks | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        knobs = {name: value for name, value in locals().items() if name in FACADE_KNOBS}
        # validated before anything else: a wrong knob is a clear error at construction
        config = ZenFlowConfig(**knobs)
        options = {name: value for name, value in locals().items() if name in (*TORCH_OPTIONS, *IMPLEMENTATION_OPTIONS)}
        _check_torch_options(options, where="")
        # before torch's __init__: it calls add_param_group, which reads this
        self._zenflow = _FacadeState(config=config, ranks=ranks, steps_per_epoch=steps_per_epoch)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize, **options)
        self._zenflow.columns = _expert_columns(self.param_groups, model, config)
        prestart_worker()  # its start overlaps the program's work until the first step adopts it

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
                given = group.get("param_names")
                for position, param in enumerate(group["params"]):
                    names[param] = given[position] if given else positional_name(group_index, position)
            columns = {
                names[param]: facade.columns[(group_index, position)]
                for group_index, group in enumerate(self.param_groups)
                for position, param in enumerate(group["params"])
                if (group_index, position) in facade.columns
            }
            engine = ZenFlowEngine(
                self,
                facade.config,
                param_names=names,
                matrix_columns=columns,
                steps_per_epoch=facade.steps_per_epoch,
                ranks=facade.ranks or _default_ranks(),
                guard_zero_grad=False,  # zero_grad below waits for the engine itself
                maximize_by_caller=True,  # step negates the gradients of maximize groups
            )
            facade.engine = engine.start()
            _LIVE_ENGINES.add(engine)  # stopped at interpreter exit if nobody closed it
            copied, facade.copied_state = facade.copied_state, None
            if copied is not None:
                self._load_into(engine, copied)
        return facade.engine

    # ------------------------------------------------------------------------------------------ optimizer API
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._zenflow.closed:
            raise RuntimeError("this ZenFlowAdamW was closed; build a new optimizer to train on.")
        groups = self.param_groups
        if not any(p.requires_grad and p.grad is not None for group in groups for p in group["params"]):
            # nothing to apply: AdamW's step changes nothing then; no engine (nor worker) is started for it, and one
            # that runs does not count it (its warm-up, windows and selection move with real steps only)
            return loss
        engine = self._ensure_engine()
        # torch.amp.GradScaler.step hands these over on the device (_step_supports_amp_scaling)
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            # gradients still scaled (GradScaler.step without unscale_ first): unscale them on the device
            grads = [p.grad for group in groups for p in group["params"] if p.grad is not None]
            torch._foreach_div_(grads, grad_scale.to(grads[0].device))
        # AdamW(maximize=True) is AdamW on the negated gradient: the engine reads negated copies, and each parameter
        # gets its own gradient back after (never written: torch's optimizers do not write into a gradient)
        maximized = [p for g in groups if g.get("maximize") for p in g["params"] if p.grad is not None]
        originals = [p.grad for p in maximized]
        for param, negated in zip(maximized, torch._foreach_neg(originals) if originals else ()):
            param.grad = negated
        engine.step(found_inf)
        if maximized:
            engine.wait_for_gradients()  # the compute lane waits (GPU-side) until the engine has read the copies
            for param, grad in zip(maximized, originals):
                param.grad = grad
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine = self._zenflow.engine
        if engine is not None:
            # zero_grad(set_to_none=False) writes the gradients in place: the compute lane waits (GPU-side, no host
            # sync) until the engine's device work has read them
            engine.wait_for_gradients()
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _check_torch_options(param_group, where=f"param group {len(self.param_groups)}: ")
        if self._zenflow.copied_state is not None:
            # the copied state belongs to the groups it was taken with: loaded now, the new group follows at the next
            # step as in the original
            self._ensure_engine()
        super().add_param_group(param_group)

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
        facade.copied_state = None
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
            copied = self._zenflow.copied_state
            if copied is not None:  # a copy before its first step: the state it continues from
                return {**copied, "param_groups": super().state_dict()["param_groups"]}
            return super().state_dict()
        torch_state = engine.torch_state_dict()
        extras = engine.state_dict(include_moments=False)
        extras["params"] = extras_by_position(extras["params"], self.param_groups, engine)
        torch_state[STATE_KEY] = extras
        return torch_state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a state saved by ``state_dict()`` (exact: it continues bitwise) or a plain torch Adam/AdamW state
        (moments and steps taken over; the selection starts afresh). The param groups' hyperparameters are restored
        too. An engine that has stepped is rebuilt first.

        The parameters are matched by name when both optimizers were built with names (``named_parameters()``), by
        position (param group, index in it) when either was not; the groups, their sizes and every shape must
        match. A mismatch is an error that names it, raised before anything is loaded."""
        if self._zenflow.closed:
            raise RuntimeError("this ZenFlowAdamW was closed; build a new optimizer to train on.")
        check_fits(state_dict, self.param_groups)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._zenflow.copied_state = None  # replaced by this state
        self._load_into(self._ensure_engine(), state_dict)

    def _load_into(self, engine: ZenFlowEngine, state_dict: Mapping[str, Any]) -> None:
        if STATE_KEY not in state_dict:
            engine.load_torch_state_dict(state_dict)
            return
        extras = dict(state_dict[STATE_KEY])
        extras["params"] = extras_by_engine_name(extras["params"], state_dict["param_groups"], engine)
        engine.load_state_dict(extras, torch_state=state_dict)

    # ------------------------------------------------------------------------------------------ copies, pickling
    def __getstate__(self) -> dict[str, Any]:
        facade = self._zenflow
        state = super().__getstate__()
        state["_zenflow_config"] = facade.config
        state["_zenflow_steps_per_epoch"] = facade.steps_per_epoch
        # what the copy continues from (the exact state, as a save would take it: the run is left as it is), never
        # the engine itself: its worker, pipes and shared memory belong to this optimizer
        copied = facade.copied_state
        if facade.engine is not None:
            if facade.engine.ranks.world > 1:
                raise RuntimeError(
                    "a ZenFlowAdamW that trains data parallel cannot be copied or pickled: its state is gathered from "
                    "every rank (a collective). Save optimizer.state_dict() on every rank instead, and load it into a "
                    "new ZenFlowAdamW."
                )
            copied = self.state_dict()
        state["_zenflow_copied_state"] = copied
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict calls this too (with state and param_groups only): the running facade stays
        config = state.pop("_zenflow_config", None)
        steps_per_epoch = state.pop("_zenflow_steps_per_epoch", None)
        copied = state.pop("_zenflow_copied_state", None)
        super().__setstate__(state)
        if "_zenflow" not in vars(self):  # a copy: a new facade, its engine started at its first step
            self._zenflow = _FacadeState(config=config or ZenFlowConfig(), ranks=None, steps_per_epoch=steps_per_epoch)
            self._zenflow.copied_state = copied

    def __repr__(self) -> str:
        """torch's listing of the param groups, then the ZenFlow knobs as the constructor takes them."""
        facade = self._zenflow
        knobs = [f"{name}={getattr(facade.config, name)!r}" for name in FACADE_KNOBS]
        if facade.steps_per_epoch is not None:
            knobs.append(f"steps_per_epoch={facade.steps_per_epoch!r}")
        listing = super().__repr__().rstrip()
        return f"{listing[:-1]}ZenFlow: {', '.join(knobs)}\n)"


class _FacadeState:
    """What the facade keeps beside torch's optimizer state (kept out of ``param_groups`` and ``defaults``)."""

    def __init__(self, config: ZenFlowConfig, ranks: Ranks | None, steps_per_epoch: int | None) -> None:
        self.config = config
        self.ranks = ranks
        self.steps_per_epoch = steps_per_epoch
        self.engine: ZenFlowEngine | None = None
        self.closed = False
        self.copied_state: dict[str, Any] | None = None
        """A copy's (``copy.deepcopy``, unpickling) state from the original, loaded when its engine starts."""
        self.columns: dict[tuple[int, int], int] = {}
        """Per (param group, position): the columns of a stack of expert matrices' view (``matrices.py``)."""


def _expert_columns(
    param_groups: Sequence[Mapping[str, Any]], model: torch.nn.Module | None, config: ZenFlowConfig
) -> dict[tuple[int, int], int]:
    """The columns of each stack of expert matrices among the groups' parameters, by (group, position): read from
    ``model`` (``matrices.py``); without a model, 3-D parameters are said once (they keep the default view)."""
    positions = {id(p): (g, i) for g, group in enumerate(param_groups) for i, p in enumerate(group["params"])}
    if model is None:
        stacked = [tuple(p.shape) for group in param_groups for p in group["params"] if p.dim() >= 3]
        if stacked:
            notice_once(
                "facade_without_model",
                f"ZenFlowAdamW has parameters of three or more dimensions {stacked[:4]} and no model to say how they "
                "split into matrices of input channels: each is split as [shape[0], the rest]. Pass "
                "ZenFlowAdamW(..., model=model) for mixture-of-experts models (transformers' experts modules say "
                "their layout; expert_layouts names others).",
            )
        return {}
    columns = matrix_columns(model, config.expert_layouts)
    return {
        positions[id(p)]: columns[name]
        for name, p in model.named_parameters()
        if name in columns and id(p) in positions
    }


def _check_torch_options(options: Mapping[str, object], where: str) -> None:
    for name, (accepted, fix) in TORCH_OPTIONS.items():
        if name in options and options[name] not in accepted:
            raise ValueError(f"{where}{name}={options[name]!r} is not supported: {fix}.")


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
