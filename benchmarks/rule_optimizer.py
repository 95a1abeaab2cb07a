"""The ZenFlow update rule with candidate changes as knobs, in one process (the optimizer of ``rule_variants.py``).

``RuleOptimizer`` is the rule of ``docs/update_rule.md`` written densely, like ``tests/reference.py`` (no worker, no
flat buffers; ``tests/test_rule_variants.py`` checks that the two agree): every matrix keeps one fp32 master and two
moments for all its columns, each column's values being those of the side that holds it, and ``shown``, what the model
shows for the unselected columns. Each candidate change is a knob of ``Rule`` whose default is the paper's rule
(``docs/update_rule.md``, "Candidate rule changes", specifies them for the engine):

- ``score``: what the selection ranks columns by: ``"grad"`` (the paper: Σ_i g_t[i, j]² of the selection step),
  ``"window"`` (that score summed over every step since the last selection), ``"ema"`` (an exponential average of it,
  ``ema_beta`` per step), ``"adam"`` (Σ_i |m[i, j]| / (√v[i, j] + ε), the size of the column's Adam update, from the
  moments the model currently shows: the device's for selected columns, the last *landed* host update's for the rest);
- ``refresh``: ``"none"`` (one selection), ``"sync"`` (the paper's refresh: at the first window end ``refresh_interval``
  steps after the last selection, apply everything in flight, then migrate), ``"window"`` (every window end, without
  a sync: columns that enter the device take the host update just computed for them on the device; see
  ``RuleOptimizer._select``);
- ``land_after``: L, the host update of a window lands L steps after the window closes (the paper: L = S with overlap);
- ``share``: ``"fixed"`` (k = ⌈ρ·cols⌉ per matrix) or ``"adaptive"`` (the same element budget Σ rows·k spread over the
  matrices: the columns with the largest score relative to their matrix's mean column score, taken globally);
- ``matched_betas``: the host update of a window of n steps uses (β1ⁿ, β2ⁿ) instead of (β1, β2);
- ``extrapolate``: a landed host update is shown as ``master + (L/S)·Δ``, where Δ is that update (the model shows a
  prediction of where the pending update will put the weights); sync, refresh and flush show the plain master;
- ``matched_beta1``: only β1 matched (β1ⁿ, β2);
- ``host_lr_scale``: the host update's learning rate times this factor (a longer host step for a window of S steps);
- ``window_decay``: the host update of an n-step window uses ``n × weight_decay``;
- ``device_moments``: ``"bf16"`` rounds the device's moments to bfloat16 after every device update (a compact
  device state: more columns in the same bytes);
- ``overlap_after``: windows that close at steps ``t <= overlap_after`` land at once (overlap off), later ones with
  the lag: a cheaper alternative to a synchronous warm-up (one wait per window instead of one per step).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

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
    overlap_after: int = 0
    """Windows that close at a step t <= overlap_after land at once (overlap off), later ones as ``lag`` says."""
    matched_beta1: bool = False
    """Only β1 matched: the host update of an n-step window uses (β1ⁿ, β2)."""
    warm_up_score: bool = False
    """With ``score="window"``: the warm-up's steps add to the score too, so the first selection ranks columns by
    their squared gradient summed over the warm-up and the selection step."""
    window_decay: bool = False
    """The host update of an n-step window decays the weights n times as much (``weight_decay × n``): AdamW's decay
    per step, where the paper's rule applies one step's decay per window."""
    device_moments: str = "fp32"
    """``"bf16"``: the device's moments are rounded to bfloat16 after every device update (half their bytes)."""
    host_lr_scale: float = 1.0
    """The host update of a window uses ``lr × host_lr_scale`` (1: the paper's)."""
    matched_betas: bool = False
    """The host update of an n-step window uses (β1ⁿ, β2ⁿ): its moments' time constants, counted in steps, are
    AdamW's (with β per window they are S times longer)."""

    def __post_init__(self) -> None:
        if self.score not in SCORES or self.refresh not in REFRESHES or self.share not in SHARES:
            raise ValueError(f"score in {SCORES}, refresh in {REFRESHES}, share in {SHARES}; got {self}")
        if self.land_after is not None and not 0 <= self.land_after <= self.interval:
            raise ValueError(f"land_after={self.land_after} must be in 0..update interval {self.interval}")
        if self.device_moments not in ("fp32", "bf16"):
            raise ValueError(f"device_moments must be 'fp32' or 'bf16', got {self.device_moments!r}")

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
            if rule.warm_up_score and rule.score == "window":
                for matrix, grad in zip(self.matrices, grads):
                    if grad is not None:
                        now = (grad * grad).sum(dim=0)
                        matrix.score_acc = now if matrix.score_acc is None else matrix.score_acc + now
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
                if rule.device_moments == "bf16":
                    exp_avg, exp_avg_sq = exp_avg.bfloat16().float(), exp_avg_sq.bfloat16().float()
                matrix.master[:, cols], matrix.exp_avg[:, cols], matrix.exp_avg_sq[:, cols] = (master, exp_avg,
                                                                                               exp_avg_sq)  # fmt: skip
            matrix.window_sum[:, ~cols] += grad[:, ~cols]
            matrix.window_grads += 1
        self.steps_in_window += 1
        if self.pending is not None and self.pending.lands_at == self.t:
            self._land(extrapolate=rule.extrapolate)
        if self.steps_in_window == rule.interval:
            self._close_window(groups, lag=0 if self.t <= rule.overlap_after else rule.lag)
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
                if self.rule.window_decay:
                    group = {**group, "weight_decay": group["weight_decay"] * matrix.window_grads}
                if self.rule.host_lr_scale != 1.0:
                    group = {**group, "lr": group["lr"] * self.rule.host_lr_scale}
                if self.rule.matched_beta1:
                    beta1, beta2 = group["betas"]
                    group = {**group, "betas": (beta1**matrix.window_grads, beta2)}
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
