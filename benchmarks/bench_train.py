"""Training pieces several benchmark scripts share: the demo's AdamW groups, the loop that trains and evaluates one
row (AdamW, the engine or another stepper, the same batches), held-out loss, optimizer bytes, a median timer.

Not a benchmark itself; imported as ``bench_train`` like ``bench_utils``. It imports torch only: the engine's spawned
host worker re-imports the running script's top level, which should stay cheap.

One row of a quality comparison::

    with bench_train.stepping(optimizer, engine_factory, train_cores) as stepper:   # None: the AdamW reference
        curve = bench_train.train(model, optimizer, stepper, batches, steps=200, eval_every=25,
                                  evaluate=lambda: bench_train.evaluate(model, eval_batches))
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import bench_utils
import torch

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------ optimizers
def decay_groups(params: Iterable[torch.Tensor]) -> list[dict[str, Any]]:
    """The demo's two groups: matrices and embeddings with weight decay 0.1, biases and norms without."""
    params = list(params)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def demo_adamw(params: Iterable[torch.Tensor], lr: float, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``decay_groups`` with the demo's betas (0.9, 0.95) and eps 1e-8."""
    return torch.optim.AdamW(decay_groups(params), lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (moments, step counts)."""
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))


# ------------------------------------------------------------------------------------------------ model and data
def build_seeded(build: Callable[[], T], seed: int) -> T:
    """``build()`` under ``torch.manual_seed(seed)``, the caller's random state untouched: the same initial weights
    for every configuration of a comparison."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # seeds the CUDA generator too
        return build()


def demo_gpt(args: Any) -> torch.nn.Module:
    """A fresh demo GPT of ``args``' shape (``n_layer``, ``n_embd``, ``n_head``, ``block_size``). Lightning is
    imported here, not at the top level of the scripts that use it."""
    from lightning_zenflow.demo import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size))


def windows(tokens: torch.Tensor, starts: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets: the ``block + 1`` tokens from each of ``starts``, shifted by one."""
    index = starts.reshape(-1, 1) + torch.arange(block + 1)
    window = tokens[index].long()
    return window[:, :-1], window[:, 1:]


# ----------------------------------------------------------------------------------------------------- steppers
class Stepper(Protocol):
    """What ``train`` calls around a step: AdamW, the engine, or any optimizer of the same rule."""

    def before_forward(self) -> None: ...

    def step(self) -> float:
        """The optimizer step with the current ``.grad``; the seconds the training thread stalled."""
        ...

    def settle(self, last: bool) -> None:
        """Before an evaluation: apply what is in flight (``last``: everything, the final weights)."""
        ...


class AdamWStep:
    """The reference: ``optimizer.step()`` in the training process."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def before_forward(self) -> None:
        pass

    def step(self) -> float:
        self.optimizer.step()
        return 0.0

    def settle(self, last: bool) -> None:
        pass


class EngineStep:
    """A started ``ZenFlowEngine``: waits for the device update before each forward, syncs before evaluations and
    flushes at the end (as ``ZenFlowStrategy`` does at validation and at the end of fit)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.selections: list[dict[str, Any]] = []
        self.t = 0

    def before_forward(self) -> None:
        self.engine.wait_for_update()  # the forward reads weights the last device update wrote

    def step(self) -> float:
        self.t += 1
        stats = self.engine.step()
        if stats.refreshed:
            self.selections.append(
                {"step": self.t, "overlap": stats.selection_overlap, "captured": stats.selection_captured}
            )
        return stats.stall_s

    def settle(self, last: bool) -> None:
        # apply host work in flight (sync) or everything (flush, at the end) before measuring the model
        self.engine.flush() if last else self.engine.sync()
        self.engine.wait_for_update()


@contextlib.contextmanager
def stepping(
    optimizer: torch.optim.Optimizer, engine: Callable[[], Any] | None, train_cores: Sequence[int]
) -> Iterator[AdamWStep | EngineStep]:
    """The row's stepper for the block: ``engine()`` builds an engine, started here and closed after; without one
    the AdamW reference runs pinned to ``train_cores`` with one thread each, as the engine pins its training
    process, so matmul reductions match across the rows."""
    if engine is None:
        with bench_utils.pinned(train_cores):
            yield AdamWStep(optimizer)
    else:
        with engine() as started:
            yield EngineStep(started)


# ------------------------------------------------------------------------------------------------------ the loop
@dataclasses.dataclass
class Curve:
    """What ``train`` records: the held-out loss at step 0, every ``eval_every`` steps and at the end, with the
    training time spent until then (evaluations and ``after_backward`` excluded), and every step's training loss."""

    eval_steps: list[int] = dataclasses.field(default_factory=list)
    eval_loss: list[float] = dataclasses.field(default_factory=list)
    eval_train_s: list[float] = dataclasses.field(default_factory=list)
    train_loss: list[float] = dataclasses.field(default_factory=list)
    train_s: float = 0.0
    stall_s: float = 0.0
    started: float = 0.0
    """``perf_counter()`` after the step-0 evaluation, when the first step began."""


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stepper: Stepper,
    batches: Iterable[Any],
    *,
    steps: int,
    eval_every: int | None = None,
    evaluate: Callable[[], float] | None = None,
    scheduler: Any = None,
    batch_of: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None,
    after_backward: Callable[[int], None] | None = None,
    log_every: int | None = None,
) -> Curve:
    """Train on ``batches`` (each ``(x, y)``, or ``batch_of(item)``; the model returns ``(logits, loss)``): forward,
    backward, ``stepper.step()``, ``zero_grad``, ``scheduler.step()``. With ``evaluate``: its value at step 0, every
    ``eval_every`` steps and at step ``steps``, each after ``stepper.settle()``. ``after_backward(step)`` runs between
    the backward and the step (its time not counted); ``log_every`` prints the mean training loss that often."""
    curve = Curve()
    if evaluate is not None:
        curve.eval_steps.append(0)
        curve.eval_loss.append(evaluate())
        curve.eval_train_s.append(0.0)
    curve.started = time.perf_counter()
    for step, item in enumerate(batches, start=1):
        started = time.perf_counter()
        stepper.before_forward()
        x, y = item if batch_of is None else batch_of(item)
        _, loss = model(x, y)
        loss.backward()
        if after_backward is not None:
            curve.train_s += time.perf_counter() - started
            after_backward(step)
            started = time.perf_counter()
        curve.stall_s += stepper.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        curve.train_loss.append(loss.item())
        curve.train_s += time.perf_counter() - started
        if log_every and step % log_every == 0:
            print(f"  step {step}: train loss {statistics.fmean(curve.train_loss[-log_every:]):.3f}", flush=True)
        last = step == steps
        if evaluate is not None and (step % eval_every == 0 or last):
            stepper.settle(last)
            curve.eval_steps.append(step)
            curve.eval_loss.append(evaluate())
            curve.eval_train_s.append(curve.train_s)
    return curve


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The mean loss over ``batches`` in eval mode (the model returns ``(logits, loss)``); back to train mode after."""
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


# -------------------------------------------------------------------------------------------------------- timing
def time_median(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmups: int = 1,
    prepare: Callable[[], None] | None = None,
    device: torch.device | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmups`` untimed ones; ``prepare()`` runs untimed
    before each call. On CUDA the clock waits for queued work before and after each call, so it sees ``fn`` alone."""
    cuda = device is not None and device.type == "cuda"
    times = []
    for index in range(warmups + repeats):
        if prepare is not None:
            prepare()
        if cuda:
            torch.cuda.synchronize(device)  # timing only: queued work has finished before the clock starts
        started = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)  # timing only: fn's kernels have finished
        if index >= warmups:
            times.append(time.perf_counter() - started)
    return statistics.median(times)
