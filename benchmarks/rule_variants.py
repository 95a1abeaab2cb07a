"""Candidate changes to ZenFlow's update rule, measured on the fine-tune benchmark of ``finetune_quality.py``.

``RuleOptimizer`` is the rule of ``docs/update_rule.md`` written densely in one process (like ``tests/reference.py``:
no worker, no flat buffers), with each candidate change as a knob whose default is the paper's rule:

- ``score``: what the selection ranks columns by: ``"grad"`` (the paper: Σ_i g_t[i, j]² of the selection step),
  ``"window"`` (that score summed over every step since the last selection), ``"ema"`` (an exponential average of it,
  ``ema_beta`` per step), ``"adam"`` (Σ_i |m[i, j]| / (√v[i, j] + ε), the size of the column's Adam update, from the
  moments the model currently shows: the device's for selected columns, the last *landed* host update's for the rest);
- ``refresh``: ``"none"`` (one selection), ``"sync"`` (the paper's refresh: at the first window end ``refresh_interval``
  steps after the last selection, apply everything in flight, then migrate), ``"window"`` (every window end, without
  a sync: columns that enter the device take the host update just computed for them on the device, see ``_reselect``);
- ``land_after``: L, the host update of a window lands L steps after the window closes (the paper: L = S with overlap);
- ``share``: ``"fixed"`` (k = ⌈ρ·cols⌉ per matrix) or ``"adaptive"`` (the same element budget Σ rows·k spread over the
  matrices: the columns with the largest score relative to their matrix's mean column score, taken globally);
- ``matched_betas``: the host update of a window of n steps uses (β1ⁿ, β2ⁿ) instead of (β1, β2);
- ``extrapolate``: a landed host update is shown as ``master + (L/S)·Δ``, where Δ is that update (the model shows a
  prediction of where the pending update will put the weights); sync, refresh and flush show the plain master.

Then it fine-tunes the benchmark's base with AdamW, the paper's rule and each variant, and prints the gap to AdamW
(paired by seed) and what each variant keeps on the device and needs from the host.

    python benchmarks/rule_variants.py --list-rows
    python benchmarks/rule_variants.py --rows adamw paper extrapolate --seeds 2     # ~1 min per fine-tune, 2 cores
    python benchmarks/rule_variants.py --quick                                      # smoke run, < 30 s
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import pathlib
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import bench_utils
import finetune_quality as fq
import torch

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "rule_variants.json"
SCORES = ("grad", "window", "ema", "adam")
REFRESHES = ("none", "sync", "window")
SHARES = ("fixed", "adaptive")


@dataclasses.dataclass(frozen=True)
class Rule:
    """The knobs of ``RuleOptimizer``; the defaults are the engine's defaults (the paper's rule)."""

    ratio: float = 0.1
    interval: int = 4
    overlap: bool = True
    warm_up: int = 0
    refresh: str = "none"
    refresh_interval: int = 16
    land_after: int | None = None
    """L in 0..S (overlap only); None: S, the paper's."""
    score: str = "grad"
    ema_beta: float = 0.9
    share: str = "fixed"
    extrapolate: bool = False
    matched_betas: bool = False
    """The host update of an n-step window uses (β1ⁿ, β2ⁿ): its moments' time constants, counted in steps, are
    AdamW's (with β per window they are S times longer)."""

    def __post_init__(self) -> None:
        if self.score not in SCORES or self.refresh not in REFRESHES or self.share not in SHARES:
            raise ValueError(f"score in {SCORES}, refresh in {REFRESHES}, share in {SHARES}; got {self}")
        if self.land_after is not None and not 0 <= self.land_after <= self.interval:
            raise ValueError(f"land_after={self.land_after} must be in 0..update interval {self.interval}")

    @property
    def lag(self) -> int:
        """Steps between a window's end and the step at whose end its host update lands."""
        if not self.overlap:
            return 0
        return self.interval if self.land_after is None else self.land_after


def num_columns(cols: int, ratio: float) -> int:
    """The engine's k: ceil(ratio * cols - 1e-9), 0 for ratio 0, cols for ratio 1, at least 1 otherwise."""
    if ratio <= 0:
        return 0
    if ratio >= 1:
        return cols
    return min(cols, max(1, math.ceil(ratio * cols - 1e-9)))


def top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest scores; ties go to the lower column index (a stable descending sort)."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[torch.sort(scores, descending=True, stable=True).indices[:k]] = True
    return mask


def adam_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
          group: Mapping, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """docs/update_rule.md's Adam arithmetic, in ``tests/reference.py``'s order; returns new tensors."""
    lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if group.get("decoupled_weight_decay", True):
        master = master * (1.0 - lr * decay)
    else:
        grad = grad + decay * master
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denominator = exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**count) + eps
    return master - (lr / (1.0 - beta1**count)) * exp_avg / denominator, exp_avg, exp_avg_sq


def update_size(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float) -> torch.Tensor:
    """Per column: Σ_i |m| / (√v + ε), the moments as stored (not bias-corrected: a side's count would otherwise
    decide the comparison; corrected, every column is exactly 1 per element after its first update)."""
    return (exp_avg.abs() / (exp_avg_sq.sqrt() + eps)).sum(dim=0)


@dataclasses.dataclass
class _Matrix:
    """A matrix viewed as [rows, cols]. ``master``/moments hold the device's values for selected columns and the
    host's for the rest (each column lives on one side); ``shown`` is what the model shows for unselected columns."""

    param: torch.Tensor
    group: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    shown: torch.Tensor
    window_sum: torch.Tensor
    selected: torch.Tensor
    landed_size: torch.Tensor
    """Host side, per column: the update size of the last landed host update ("adam" score)."""
    score_acc: torch.Tensor | None = None
    window_grads: int = 0
    device_count: int = 0
    host_count: int = 0

    @classmethod
    def of(cls, param: torch.Tensor, group: int) -> _Matrix:
        master = param.detach().float().reshape(param.shape[0], -1).clone()
        cols = master.shape[1]
        zeros = torch.zeros_like(master)
        return cls(param, group, master, zeros, zeros.clone(), master.clone(), zeros.clone(),
                   torch.zeros(cols, dtype=torch.bool), torch.zeros(cols))  # fmt: skip

    def write_model(self) -> None:
        self.param.data.copy_(torch.where(self.selected, self.master, self.shown).reshape(self.param.shape))


@dataclasses.dataclass
class _Pending:
    """A host update computed at a window end, not yet shown: per matrix the columns it updated and its Δ."""

    lands_at: int
    columns: dict[int, torch.Tensor]
    delta: dict[int, torch.Tensor]
    size: dict[int, torch.Tensor]


class RuleOptimizer:
    """ZenFlow's rule with the candidate knobs of ``Rule``, in one process; ``step()`` reads ``p.grad``."""

    def __init__(self, param_groups: Sequence[Mapping], rule: Rule) -> None:
        self.param_groups, self.rule = param_groups, rule
        self.matrices: list[_Matrix] = []
        self.vectors: list[tuple[torch.Tensor, int, dict[str, Any]]] = []
        for index, group in enumerate(param_groups):
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                if param.ndim >= 2:
                    self.matrices.append(_Matrix.of(param, index))
                else:
                    state = {"exp_avg": torch.zeros_like(param, dtype=torch.float32), "count": 0}
                    self.vectors.append((param, index, {**state, "exp_avg_sq": state["exp_avg"].clone()}))
        self.t = 0
        self.t_select: int | None = None
        self.steps_in_window = 0
        self.last_groups: list[Mapping] | None = None
        self.pending: _Pending | None = None
        self.selections: list[dict[str, Any]] = []
        self.max_selected_share = 0.0
        self.last_delta: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.delta_cosines: list[tuple[int, float]] = []
        """With extrapolation: cosine of each matrix's host update with its previous one (same columns)."""

    # ------------------------------------------------------------------------------------------------ the rule
    def step(self) -> None:
        rule, groups = self.rule, self.param_groups
        self.t += 1
        self.last_groups = [dict(group) for group in groups]
        for param, index, state in self.vectors:  # device-only parameters: AdamW every step
            if param.grad is not None:
                state["count"] += 1
                param.data, state["exp_avg"], state["exp_avg_sq"] = adam_(
                    param.data.float(), state["exp_avg"], state["exp_avg_sq"], param.grad.float(), groups[index],
                    state["count"])  # fmt: skip
        grads = [None if m.param.grad is None else m.param.grad.detach().float().reshape(m.master.shape)
                 for m in self.matrices]  # fmt: skip
        if self.t <= rule.warm_up:
            for matrix, grad in zip(self.matrices, grads):
                if grad is not None:  # warm-up: every element, synchronous, both counts +1
                    matrix.host_count += 1
                    matrix.device_count += 1
                    matrix.master, matrix.exp_avg, matrix.exp_avg_sq = adam_(
                        matrix.master, matrix.exp_avg, matrix.exp_avg_sq, grad, groups[matrix.group], matrix.host_count
                    )
                    matrix.shown = matrix.master.clone()
                    matrix.write_model()
            return
        for matrix, grad in zip(self.matrices, grads):
            if grad is not None and rule.score in ("window", "ema"):
                now = (grad * grad).sum(dim=0)
                if matrix.score_acc is None:
                    matrix.score_acc = now
                elif rule.score == "window":
                    matrix.score_acc = matrix.score_acc + now
                else:
                    matrix.score_acc = rule.ema_beta * matrix.score_acc + (1.0 - rule.ema_beta) * now
        if self.t_select is None:
            self._select(grads, cheap=False)
        for matrix, grad in zip(self.matrices, grads):
            if grad is None:
                continue
            cols = matrix.selected
            if cols.any():  # device update of the selected columns
                matrix.device_count += 1
                master, exp_avg, exp_avg_sq = adam_(
                    matrix.master[:, cols], matrix.exp_avg[:, cols], matrix.exp_avg_sq[:, cols], grad[:, cols],
                    groups[matrix.group], matrix.device_count)  # fmt: skip
                matrix.master[:, cols], matrix.exp_avg[:, cols], matrix.exp_avg_sq[:, cols] = (master, exp_avg,
                                                                                               exp_avg_sq)  # fmt: skip
            matrix.window_sum[:, ~cols] += grad[:, ~cols]
            matrix.window_grads += 1
        self.steps_in_window += 1
        if self.pending is not None and self.pending.lands_at == self.t:
            self._land(extrapolate=rule.extrapolate)
        if self.steps_in_window == rule.interval:
            self._close_window(groups, lag=rule.lag)
            if rule.refresh == "window":
                self._select(grads, cheap=True)
            elif rule.refresh == "sync" and self.t - self.t_select >= rule.refresh_interval:
                self.sync()  # the paper's refresh: everything in flight is applied first (a wait for the host)
                self._select(grads, cheap=False)
        for matrix in self.matrices:
            matrix.write_model()

    def _close_window(self, groups: Sequence[Mapping], lag: int) -> None:
        """One host update of every matrix's unselected columns with the window's mean gradient."""
        pending = _Pending(self.t + lag, {}, {}, {})
        for index, matrix in enumerate(self.matrices):
            cols = ~matrix.selected
            if cols.any() and matrix.window_grads > 0:
                matrix.host_count += 1
                group = groups[matrix.group]
                if self.rule.matched_betas:  # moments that average over as many steps as the device's do
                    beta1, beta2 = group["betas"]
                    group = {**group, "betas": (beta1**matrix.window_grads, beta2**matrix.window_grads)}
                mean = matrix.window_sum[:, cols] / matrix.window_grads
                before = matrix.master[:, cols]
                master, exp_avg, exp_avg_sq = adam_(
                    before, matrix.exp_avg[:, cols], matrix.exp_avg_sq[:, cols], mean, group, matrix.host_count
                )
                matrix.master[:, cols], matrix.exp_avg[:, cols], matrix.exp_avg_sq[:, cols] = (master, exp_avg,
                                                                                               exp_avg_sq)  # fmt: skip
                pending.columns[index] = cols
                if self.rule.extrapolate:
                    pending.delta[index] = master - before
                    previous = self.last_delta.get(index)
                    if previous is not None and torch.equal(previous[0], cols):  # same columns: how alike are they
                        cosine = torch.nn.functional.cosine_similarity(
                            previous[1].flatten(), master.flatten() - before.flatten(), dim=0
                        )
                        self.delta_cosines.append((self.t, float(cosine)))
                    self.last_delta[index] = (cols.clone(), master - before)
                if self.rule.score == "adam":
                    pending.size[index] = update_size(exp_avg, exp_avg_sq, group["eps"])
            matrix.window_sum.zero_()
            matrix.window_grads = 0
        self.steps_in_window = 0
        self.pending = pending
        if lag == 0:
            self._land(extrapolate=False)

    def _land(self, extrapolate: bool) -> None:
        """The model shows the pending host update (plus (L/S)·Δ with extrapolation)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        factor = self.rule.lag / self.rule.interval
        for index, cols in pending.columns.items():
            matrix = self.matrices[index]
            cols = cols & ~matrix.selected  # columns that entered the device since show the device master
            shown = matrix.master[:, cols]
            if extrapolate:
                shown = shown + factor * pending.delta[index][:, cols[pending.columns[index]]]
            matrix.shown[:, cols] = shown
            if index in pending.size:
                matrix.landed_size[cols] = pending.size[index][cols[pending.columns[index]]]

    def sync(self) -> None:
        """Apply what is in flight; the model shows every host master as it is (no extrapolation)."""
        self._land(extrapolate=False)
        for matrix in self.matrices:
            matrix.shown = matrix.master.clone()
            matrix.write_model()

    def flush(self) -> None:
        """Sync, then close the open window with the last step's hyperparameters and apply it at once."""
        self.sync()
        if self.steps_in_window > 0 and self.last_groups is not None:
            self._close_window(self.last_groups, lag=0)
        self.sync()

    # ---------------------------------------------------------------------------------------------- selection
    def _scores(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        out = []
        for matrix, grad in zip(self.matrices, grads):
            cols = matrix.master.shape[1]
            if self.rule.score in ("window", "ema") and matrix.score_acc is not None:
                out.append(matrix.score_acc)
            elif self.rule.score == "adam" and matrix.device_count + matrix.host_count > 0:
                eps = self.param_groups[matrix.group]["eps"]
                if self.t_select is None:  # after a warm-up: both sides hold the same moments
                    out.append(update_size(matrix.exp_avg, matrix.exp_avg_sq, eps))
                    continue
                device = update_size(matrix.exp_avg, matrix.exp_avg_sq, eps)
                out.append(torch.where(matrix.selected, device, matrix.landed_size))
            else:
                out.append(torch.zeros(cols) if grad is None else (grad * grad).sum(dim=0))
        return out

    def _choose(self, scores: list[torch.Tensor]) -> list[torch.Tensor]:
        ratio = self.rule.ratio
        if self.rule.share == "fixed":
            return [top_mask(s, num_columns(s.numel(), ratio)) for s in scores]
        # adaptive: the columns with the largest score relative to their matrix's mean, within the same element budget
        rows = [m.master.shape[0] for m in self.matrices]
        budget = sum(r * num_columns(s.numel(), ratio) for r, s in zip(rows, scores))
        ranked = []
        for index, s in enumerate(scores):
            mean = float(s.double().mean())
            relative = (s.double() / mean) if mean > 0 else torch.zeros_like(s, dtype=torch.float64)
            ranked += [(-value, index, column) for column, value in enumerate(relative.tolist())]
        masks = [torch.zeros(s.numel(), dtype=torch.bool) for s in scores]
        used = 0
        for _, index, column in sorted(ranked):
            if used + rows[index] <= budget:
                masks[index][column] = True
                used += rows[index]
        return masks

    def _select(self, grads: Sequence[torch.Tensor | None], cheap: bool) -> None:
        """Choose the columns; ``cheap``: without a sync (only a refresh at a window end can be cheap)."""
        scores = self._scores(grads)
        new = self._choose(scores)
        changed, jaccards, captured = 0, [], []
        for index, (matrix, mask) in enumerate(zip(self.matrices, new)):
            old = matrix.selected
            total = float(scores[index].sum())
            captured.append(float(scores[index][mask].sum()) / total if total > 0 else 0.0)
            if self.t_select is not None:
                union = int((old | mask).sum())
                jaccards.append(int((old & mask).sum()) / union if union else 1.0)
                changed += int(not torch.equal(old, mask))
            if cheap:
                # leaving columns: the device master and moments go to the host, and the model shows that master;
                # entering columns took this window's host update (just computed, not landed) on the device
                leaving = old & ~mask
                matrix.shown[:, leaving] = matrix.master[:, leaving]
                if self.rule.score == "adam" and leaving.any():
                    eps = self.param_groups[matrix.group]["eps"]
                    size = update_size(matrix.exp_avg[:, leaving], matrix.exp_avg_sq[:, leaving], eps)
                    matrix.landed_size[leaving] = size
            else:
                matrix.shown = matrix.master.clone()  # nothing is in flight: the model shows the host state
            matrix.selected = mask
            if self.rule.score == "window":
                matrix.score_acc = None
        elements = sum(m.master.numel() for m in self.matrices)
        share = sum(m.master.shape[0] * int(m.selected.sum()) for m in self.matrices) / max(1, elements)
        self.max_selected_share = max(self.max_selected_share, share)
        jaccard = statistics.fmean(jaccards) if jaccards else None
        self.selections.append(
            {
                "step": self.t,
                "changed": changed,
                "captured": statistics.fmean(captured),
                "jaccard": jaccard,
                "share": share,
            }
        )
        self.t_select = self.t

    def device_cost(self) -> dict[str, float]:
        """Device optimizer state per matrix element, bytes: fp32 master + 2 moments of the selected columns (the
        largest selection of the run), the fp32 window accumulator of the rest, and per-column score vectors."""
        elements = sum(m.master.numel() for m in self.matrices)
        columns = sum(m.master.shape[1] for m in self.matrices)
        score_floats = columns if self.rule.score in ("window", "ema", "adam") else 0
        return {
            "selected_share": self.max_selected_share,
            "state_bytes": 12 * self.max_selected_share,
            "accumulator_bytes": 4 * (1 - self.max_selected_share),
            "score_bytes": 4 * score_floats / elements,
        }


# ------------------------------------------------------------------------------------------------------- rows
@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    rule: Rule | None
    """None: torch.optim.AdamW."""
    what: str


ROWS = (
    Row("adamw", None, "torch.optim.AdamW (fused=False), the reference"),
    Row("paper", Rule(), "the engine's defaults: rho 0.1, S 4, overlap on, one selection, g_t l2 score"),
    Row("no-overlap", Rule(overlap=False), "the paper's rule, overlap off (lands at its own window end)"),
    Row("refresh-sync-16", Rule(refresh="sync", refresh_interval=16), "the paper's refresh every 16 steps (syncs)"),
    Row("land-1", Rule(land_after=1), "(c) the host update lands 1 step after its window closes"),
    Row("land-2", Rule(land_after=2), "(c) lands 2 steps after"),
    Row("refresh-window", Rule(refresh="window"), "(f) re-select at every window end, no sync; g_t score"),
    Row("score-window", Rule(refresh="window", score="window"), "(b) + (f): score summed over the window"),
    Row("score-ema", Rule(refresh="window", score="ema"), "(b) + (f): EMA of the per-step score, beta 0.9"),
    Row("score-adam", Rule(refresh="window", score="adam"), "(a) + (f): |m|/(sqrt v + eps) summed over rows"),
    Row("adaptive", Rule(share="adaptive"), "(d) one selection, element budget shared by relative score"),
    Row("adaptive+refresh-window", Rule(share="adaptive", refresh="window"), "(d) + (f)"),
    Row("extrapolate", Rule(extrapolate=True), "(e) a landed update is shown as master + delta"),
    Row("extrapolate+refresh-window", Rule(extrapolate=True, refresh="window"), "(e) + (f)"),
    Row("extrapolate+score-window", Rule(extrapolate=True, refresh="window", score="window"), "(e) + (f) + (b)"),
    Row("extrapolate+score-adam", Rule(extrapolate=True, refresh="window", score="adam"), "(e) + (f) + (a)"),
    Row("extrapolate+land-2", Rule(extrapolate=True, land_after=2), "(e) + (c), shown as master + delta/2"),
    Row(
        "matched-betas", Rule(matched_betas=True), "host update with (beta1^S, beta2^S): moment time constants in steps"
    ),
    Row("extrapolate+matched-betas", Rule(extrapolate=True, matched_betas=True), "(e) + matched betas"),
    Row("land-1+score-window", Rule(land_after=1, refresh="window", score="window"), "(c) + (f) + (b)"),
    Row("matched-betas+score-window", Rule(matched_betas=True, refresh="window", score="window"), "+ (f) + (b)"),
    Row("refresh-window+S=8", Rule(refresh="window", interval=8), "(f) with a window of 8"),
    Row("extrapolate+S=8", Rule(extrapolate=True, interval=8), "(e) with a window of 8"),
    Row(
        "extrapolate+adaptive+refresh-window",
        Rule(extrapolate=True, share="adaptive", refresh="window"),
        "(e) + (d) + (f)",
    ),
)
QUICK_ROWS = ("adamw", "paper", "extrapolate+score-adam", "adaptive+refresh-window", "land-1")


def finetune(row: Row, seed: int, setting: fq.Setting) -> dict[str, Any]:
    """``finetune_quality.finetune`` with ``RuleOptimizer`` in place of the engine: the same model, batches, lr
    schedule, evaluations (after a sync; after a flush at the end) and thread count."""
    from lightning_zenflow.demo import GPT, GPTConfig

    args = setting.args
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size))
    model.load_state_dict(setting.base)
    optimizer = fq.make_optimizer(model, args.finetune_lr)
    scheduler = fq.lr_schedule(optimizer, args.finetune_warmup, args.finetune_schedule, args.finetune_steps)
    starts = fq.random_batches(
        setting.corpora.prose_train, args.finetune_steps, args.finetune_batch, args.block_size, seed, "fine"
    )
    rule_optimizer = None if row.rule is None else RuleOptimizer(optimizer.param_groups, row.rule)
    # RuleOptimizer steps in place of optimizer.step(), which the LR scheduler would otherwise warn about
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    eval_steps, eval_loss, train_loss = [0], [fq.evaluate(model, setting.eval_batches)], []
    started = time.perf_counter()
    for step, step_starts in enumerate(starts, start=1):
        _, loss = model(*fq.windows(setting.corpora.prose_train, step_starts, args.block_size))
        loss.backward()
        if rule_optimizer is None:
            optimizer.step()
        else:
            with torch.no_grad():
                rule_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        train_loss.append(loss.item())
        last = step == args.finetune_steps
        if step % args.eval_every == 0 or last:
            if rule_optimizer is not None:
                with torch.no_grad():
                    rule_optimizer.flush() if last else rule_optimizer.sync()
            eval_steps.append(step)
            eval_loss.append(fq.evaluate(model, setting.eval_batches))
    return {
        "row": row.name,
        "seed": seed,
        "rule": None if row.rule is None else dataclasses.asdict(row.rule),
        "eval_steps": eval_steps,
        "eval_loss": eval_loss,
        "final_eval_loss": eval_loss[-1],
        "train_loss": train_loss,
        "seconds": time.perf_counter() - started,
        "selections": [] if rule_optimizer is None else rule_optimizer.selections,
        "device_cost": None if rule_optimizer is None else rule_optimizer.device_cost(),
        "update_cosines": None if rule_optimizer is None else rule_optimizer.delta_cosines,
    }


_SETTING: fq.Setting | None = None


def _init_worker(setting: fq.Setting, threads: int) -> None:
    global _SETTING
    _SETTING = setting
    torch.set_num_threads(threads)


def _run_one(job: tuple[Row, int]) -> dict[str, Any]:
    assert _SETTING is not None
    return finetune(job[0], job[1], _SETTING)


# ------------------------------------------------------------------------------------------------------ report
def host_needs(rule: Rule | None) -> str:
    """What the variant needs from the host and when (the critical-path column of the table)."""
    if rule is None:
        return "-"
    if not rule.overlap or rule.lag == 0:
        return "host update at its own window end: on the critical path"
    parts = [f"host update lands {rule.lag} step(s) after its window: T_host <= {rule.lag} x T_step"]
    if rule.refresh == "sync":
        parts.append(f"every refresh (>= {rule.refresh_interval} steps) waits for the window just closed")
    if rule.refresh == "window":
        parts.append("entering columns: host state as landed + a device catch-up step on their window sum")
    if rule.score == "adam":
        parts.append("per-column update sizes computed with each host update")
    if rule.extrapolate:
        parts.append("host sends master + (L/S)·delta instead of master")
    return "; ".join(parts)


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    reference = {run["seed"]: run["final_eval_loss"] for run in runs if run["row"] == "adamw"}
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        rows.setdefault(run["row"], {"runs": []})["runs"].append(run)
    adamw = {r["seed"]: r for r in runs if r["row"] == "adamw"}
    for entry in rows.values():
        row_runs = entry.pop("runs")
        gaps = [100 * (r["final_eval_loss"] / reference[r["seed"]] - 1) for r in row_runs if r["seed"] in reference]
        gap25 = [
            100 * (r["eval_loss"][1] / adamw[r["seed"]]["eval_loss"][1] - 1) for r in row_runs if r["seed"] in adamw
        ]
        jaccards = [s["jaccard"] for r in row_runs for s in r["selections"] if s["jaccard"] is not None]
        entry.update(
            seeds=[r["seed"] for r in row_runs],
            final_losses=[r["final_eval_loss"] for r in row_runs],
            gaps_percent=gaps,
            gap_mean_percent=statistics.fmean(gaps) if gaps else None,
            gap_spread_percent=(max(gaps) - min(gaps)) / 2 if len(gaps) > 1 else None,
            gap_first_eval_percent=statistics.fmean(gap25) if gap25 else None,
            selections=statistics.fmean(len(r["selections"]) for r in row_runs),
            selection_jaccard=statistics.fmean(jaccards) if jaccards else None,
            device_cost=row_runs[0]["device_cost"],
            seconds=statistics.fmean(r["seconds"] for r in row_runs),
        )
    return rows


def print_table(summary: dict[str, dict[str, Any]], rows: Sequence[Row]) -> None:
    lines = []
    for row in rows:
        if row.name not in summary:
            continue
        entry = summary[row.name]
        cost = entry["device_cost"]
        gap = "-" if row.rule is None or not entry["gaps_percent"] else fq.pm(entry["gaps_percent"], 2, " %")
        lines.append([
            row.name, len(entry["seeds"]), fq.pm(entry["final_losses"], 4), gap,
            entry["gap_first_eval_percent"] if row.rule is not None else None,
            None if cost is None else 100 * cost["selected_share"],
            None if cost is None else cost["state_bytes"] + cost["accumulator_bytes"] + cost["score_bytes"],
            entry["selections"] if row.rule is not None else None, entry["selection_jaccard"],
        ])  # fmt: skip
    headers = ["row", "seeds", "final held-out loss", "vs AdamW (paired)", "gap @ 1st eval %", "device share %",
               "device B/elem", "selections", "Jaccard"]  # fmt: skip
    print("\nFinal held-out loss (nats per byte), mean ± std over seeds; gap to AdamW paired by seed")
    print(bench_utils.format_table(headers, lines, digits=4))
    print("\nWhat each variant needs from the host, and when")
    for row in rows:
        if row.name in summary and row.rule is not None:
            print(f"  {row.name:38s} {host_needs(row.rule)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=None, help="rows to run (default all; adamw is always run).")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="seeds (default 0 1; quick 0).")
    parser.add_argument("--jobs", type=int, default=1, help="fine-tunes run side by side, one thread each.")
    parser.add_argument("--list-rows", action="store_true", help="print the rows and exit.")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="JSON output path.")
    parser.add_argument("--cache", type=pathlib.Path, default=fq.DEFAULT_CACHE, help="finetune_quality's base cache.")
    parser.add_argument("--quick", action="store_true", help="finetune_quality's --quick model and steps.")
    parser.add_argument(
        "--merge", type=pathlib.Path, nargs="*", default=None, help="no runs: one table from these JSON files' runs."
    )
    args, rest = parser.parse_known_args(argv)
    args.fq = fq.parse_args([*rest, "--cache", str(args.cache), *(["--quick"] if args.quick else [])])
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1]
    names = [row.name for row in ROWS]
    chosen = args.rows if args.rows is not None else (list(QUICK_ROWS) if args.quick else names)
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown rows {unknown}; --list-rows prints the names.")
    args.rows = sorted({"adamw", *chosen}, key=names.index)
    return args


def merge(paths: Sequence[pathlib.Path], out: pathlib.Path) -> int:
    """One table from the runs of several invocations (a run of a row and seed appears once: the first file's)."""
    payloads = [json.loads(path.read_text()) for path in paths]
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for payload in payloads:
        for run in payload["runs"]:
            runs.setdefault((run["row"], run["seed"]), run)
    names = [row.name for row in ROWS]
    ordered = sorted(runs.values(), key=lambda run: (names.index(run["row"]), run["seed"]))
    rows = [row for row in ROWS if any(run["row"] == row.name for run in ordered)]
    summary = summarise(ordered)
    print_table(summary, rows)
    merged = {
        "benchmark": "rule_variants",
        "merged_from": [
            {
                "path": path.name,
                "command": payload["command"],
                "revision": payload["revision"],
                "machine": payload["machine"],
            }
            for path, payload in zip(paths, payloads)
        ],  # fmt: skip
        "settings": payloads[0]["settings"],
        "rows": {
            row.name: {
                "rule": None if row.rule is None else dataclasses.asdict(row.rule),
                "what": row.what,
                "host_needs": host_needs(row.rule),
            }
            for row in rows
        },  # fmt: skip
        "runs": ordered,
        "summary": summary,
    }
    bench_utils.write_json(out, merged)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_rows:
        for row in ROWS:
            print(f"{row.name:38s} {row.what}")
        return 0
    if args.merge:
        return merge(args.merge, args.out)
    info = bench_utils.machine_info(torch.device("cpu"))
    print(f"rule_variants: candidate rule changes on finetune_quality's fine-tune\nmachine: "
          f"{bench_utils.describe_machine(info)}")  # fmt: skip
    started = time.perf_counter()
    corpora = fq.build_corpora(args.fq.max_files)
    base, base_record = fq.load_or_pretrain(args.fq, corpora)
    eval_batches = fq.eval_set(corpora.prose_heldout, args.fq.eval_blocks, args.fq.block_size, 16)
    steps_per_epoch = max(1, corpora.prose_train.numel() // (args.fq.finetune_batch * args.fq.block_size))
    train_cores, _ = fq.ZenFlowConfig().core_split()
    # the engine's training process runs len(train_cores) threads; matmul reductions match at the same count
    threads = len(train_cores)
    setting = fq.Setting(args.fq, base, corpora, eval_batches, train_cores, steps_per_epoch)
    rows = [row for row in ROWS if row.name in args.rows]
    plan = [(row, seed) for row in rows for seed in args.seeds]
    print(f"{len(plan)} fine-tunes of {args.fq.finetune_steps} steps, {threads} thread(s) each, {args.jobs} at a time")
    runs: list[dict[str, Any]] = []
    payload: dict[str, Any] = {
        "benchmark": "rule_variants",
        "command": bench_utils.command_line(),
        "revision": fq.git_revision(),
        "machine": info,
        "settings": {**{k: v for k, v in vars(args.fq).items() if not isinstance(v, pathlib.Path)}, "threads": threads},
        "base": base_record,
        "rows": {
            row.name: {
                "rule": None if row.rule is None else dataclasses.asdict(row.rule),
                "what": row.what,
                "host_needs": host_needs(row.rule),
            }
            for row in rows
        },  # fmt: skip
        "runs": runs,
    }
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(args.jobs, _init_worker, (setting, threads)) if args.jobs > 1 else None
    if pool is None:
        _init_worker(setting, threads)
    with pool if pool is not None else contextlib.nullcontext():
        results = pool.imap_unordered(_run_one, plan) if pool is not None else map(_run_one, plan)
        for run in results:
            runs.append(run)
            print(f"[{len(runs)}/{len(plan)}] {run['row']} seed {run['seed']}: held-out {run['eval_loss'][0]:.4f} -> "
                  f"{run['final_eval_loss']:.7f} ({run['seconds']:.0f} s)", flush=True)  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".partial.json").write_text(json.dumps(payload))
    runs.sort(key=lambda run: ([row.name for row in ROWS].index(run["row"]), run["seed"]))
    summary = summarise(runs)
    print_table(summary, rows)
    payload.update(summary=summary, total_s=time.perf_counter() - started)
    bench_utils.write_json(args.out, payload)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0 if all(math.isfinite(run["final_eval_loss"]) for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
