"""An independent reference implementation of ``docs/update_rule.md``, written for obviousness, not speed.

One process, no worker, no shared memory, no flat buffers: every matrix keeps dense ``[rows, cols]`` fp32
tensors for each side and a dense boolean column mask for the selection. Values that the rule says are
never read are set to NaN (device values of unselected columns, host values of parked columns), so a
mistake here that reads them shows up as NaN in the comparison instead of passing by accident.

The host update of a window is computed at once when the window closes (nothing can touch the host state
before it is applied, so computing it later would give the same numbers); what overlap changes is only
*when the model shows it*, which ``_shown`` models: the host master of the last applied host update.

The host state's precision (``host_state``): ``"fp32"`` keeps every host value in fp32; ``"bf16"`` is modelled value by
value as docs/update_rule.md states it (the window's sum rounded stochastically at every addition in device mode, the
first moment rounded to nearest and the second stochastically at every host update, the step rounded to nearest
into the bf16 window row), with the same lattice of random numbers, written again here from the docs' formula.

This file imports torch only: nothing from ``lightning_zenflow`` except the config dataclass it reads.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_zenflow.config import AUTO_SELECT_STEPS, ZenFlowConfig


@dataclass(frozen=True)
class RefHyperParams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @classmethod
    def read(cls, group: Mapping) -> RefHyperParams:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group["decoupled_weight_decay"]),
        )


def adam_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    hp: RefHyperParams,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam/AdamW update, as written in the doc; ``count`` is the count after this update. Returns new tensors."""
    grad = grad.float()
    if hp.decoupled:
        master = master * (1.0 - hp.lr * hp.weight_decay)
    else:
        grad = grad + hp.weight_decay * master
    exp_avg = exp_avg + (1.0 - hp.beta1) * (grad - exp_avg)
    exp_avg_sq = hp.beta2 * exp_avg_sq + (1.0 - hp.beta2) * grad * grad
    bias_correction1 = 1.0 - hp.beta1**count
    bias_correction2 = 1.0 - hp.beta2**count
    denominator = exp_avg_sq.sqrt() / math.sqrt(bias_correction2) + hp.eps
    master = master - (hp.lr / bias_correction1) * exp_avg / denominator
    return master, exp_avg, exp_avg_sq


def num_columns(cols: int, ratio: float) -> int:
    """k = ceil(ratio * cols - 1e-9); 0 for ratio 0, cols for ratio 1, at least 1 for any ratio > 0."""
    if ratio == 0:
        return 0
    if ratio == 1:
        return cols
    return min(cols, max(1, math.ceil(ratio * cols - 1e-9)))


def column_scores(grad2d: torch.Tensor | None, cols: int, importance: str) -> list[float]:
    if grad2d is None:
        return [0.0] * cols
    grad2d = grad2d.float()
    scores = (grad2d * grad2d).sum(dim=0) if importance == "l2" else grad2d.abs().sum(dim=0)
    return scores.tolist()


def choose_columns(scores: list[float], k: int) -> torch.Tensor:
    """Dense boolean mask of the k highest scores; ties go to the lower column index."""
    ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    mask = torch.zeros(len(scores), dtype=torch.bool)
    mask[ranked[:k]] = True
    return mask


def _nan_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


# ------------------------------------------------------------------- the compact state's rounding (docs/update_rule.md)
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
COLUMN_SALT = 0x5BD1E995
PURPOSE_ACCUMULATE, PURPOSE_EXP_AVG_SQ = 1, 2


def _mix(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def hash_bits(*parts: int) -> int:
    """The top 16 bits of a splitmix64 chain over the parts."""
    x = 0
    for part in parts:
        x = _mix((x ^ (part & _MASK64)) + _GOLDEN & _MASK64)
    return x >> 48


def round_bf16(value: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp32 ``value`` to bf16 (returned as fp32): the unsigned 32-bit pattern plus the random
    16-bit ``r``, shifted down by 16 (the carry into bit 16 rounds the magnitude up); NaN stays NaN."""
    pattern = value.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((pattern + r.to(torch.int64)) >> 16) & 0xFFFF
    rounded = (high << 16).to(torch.int64)
    as_float = torch.where(rounded >= 1 << 31, rounded - (1 << 32), rounded).to(torch.int32).view(torch.float32)
    return torch.where(value.isnan(), value, as_float)


def lattice(row_r: torch.Tensor, col_r: torch.Tensor, offset: int) -> torch.Tensor:
    """``(row_r[i] + col_r[j] + offset) mod 2**16`` (int64)."""
    return (row_r.to(torch.int64)[:, None] + col_r.to(torch.int64)[None, :] + int(offset)) % 65536


def compact_update(
    sums: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hp: RefHyperParams,
    count: int,
    divisor: float,
    u: tuple[torch.Tensor, torch.Tensor, int],
    master: torch.Tensor | None,
    stochastic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One host update as the worker computes it (fp32 arithmetic with fp32 scalars), returning the stored moments
    and either the new master (``master`` given) or the step. ``u``: the matrix's row and column numbers and salt."""
    with_master = master is not None
    row_u, col_u, salt = u
    scalars = torch.tensor(
        [
            1.0 / divisor,
            hp.beta1,
            1.0 - hp.beta1,
            hp.beta2,
            1.0 - hp.beta2,
            hp.lr / (1.0 - hp.beta1**count),
            1.0 / math.sqrt(1.0 - hp.beta2**count),
            hp.eps,
            hash_bits(salt, PURPOSE_EXP_AVG_SQ, count),
            hp.weight_decay if with_master and not hp.decoupled else 0.0,
            1.0 - hp.lr * hp.weight_decay if with_master and hp.decoupled else 1.0,
        ],
        dtype=torch.float32,
    )
    grad = sums.float() * scalars[0]
    if with_master:
        grad = grad + master * scalars[9]
    m = exp_avg.float()
    m = m + (grad - m) * scalars[2]
    v = exp_avg_sq.float() * scalars[3] + grad * grad * scalars[4]
    # sqrt rounded correctly (in fp64, then once to fp32), as the worker's step computes it, compiled or eager
    step = -scalars[5] * m / (v.double().sqrt().float() * scalars[6] + scalars[7])
    if stochastic:
        m = m.to(torch.bfloat16).float()
        v = round_bf16(v, lattice(row_u, col_u, int(scalars[8])))
    result = master * scalars[10] + step if with_master else step
    return m, v, result


class _DeviceOnly:
    """A parameter with ndim <= 1: fp32 master and moments on the device side, one count."""

    def __init__(self, name: str, param: torch.Tensor, group: int) -> None:
        self.name, self.group, self.shape, self.dtype = name, group, tuple(param.shape), param.dtype
        self.master = param.detach().float().clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.count = 0

    def update(self, grad: torch.Tensor, hp: RefHyperParams) -> None:
        self.count += 1
        self.master, self.exp_avg, self.exp_avg_sq = adam_update(
            self.master, self.exp_avg, self.exp_avg_sq, grad, hp, self.count
        )


@dataclass(frozen=True)
class HostPolicy:
    """How the host side of every matrix is kept (docs/update_rule.md, "The host state's precision")."""

    compact: bool
    """``host_state="bf16"``: bf16 moments (first rounded to nearest, second stochastically)."""
    steps: bool
    """The weights are the masters of the host columns: a host update is a step, landed as ``w * decay + step``."""
    bf16_sums: bool
    """Device-mode accumulation in the compact state: the window's sum rounded stochastically at every addition,
    and the step rounded to nearest into the bf16 window row."""


class _Matrix:
    """A parameter with ndim >= 2, viewed as [shape[0], numel // shape[0]], split by column."""

    def __init__(self, name: str, param: torch.Tensor, group: int, index_in_group: int, policy: HostPolicy) -> None:
        self.name, self.group, self.shape, self.dtype = name, group, tuple(param.shape), param.dtype
        self.policy = policy
        self.rows = param.shape[0]
        self.cols = param.numel() // self.rows
        initial = param.detach().float().reshape(self.rows, self.cols).clone()
        # host side: every column (parked columns are NaN while selected)
        self.host_master = initial.clone()
        self.host_exp_avg = torch.zeros_like(initial)
        self.host_exp_avg_sq = torch.zeros_like(initial)
        self.host_count = 0
        # device side: only the selected columns hold numbers
        self.device_master = _nan_like(initial)
        self.device_exp_avg = _nan_like(initial)
        self.device_exp_avg_sq = _nan_like(initial)
        self.device_count = 0
        self.selected = torch.zeros(self.cols, dtype=torch.bool)
        # what the model shows for unselected columns: the host master of the last applied host update
        self.shown = initial.clone()
        # the open window
        self.window_sum = torch.zeros_like(initial)
        self.window_grads = 0
        # interim_step: the factored second-moment estimate of the host columns' gradients
        self.interim_row = torch.zeros(self.rows)
        self.interim_col = torch.zeros(self.cols)
        self.interim_decay = torch.ones(())
        # the compact state's random numbers: per row and per column of this matrix, and its salt (from its place
        # among the group's matrices)
        self.salt = zlib.crc32(f"{group}:{index_in_group}".encode())
        self.row_u = torch.tensor([hash_bits(self.salt, i) for i in range(self.rows)])
        self.col_u = torch.tensor([hash_bits(self.salt ^ COLUMN_SALT, j) for j in range(self.cols)])

    def grad2d(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if grad is None else grad.detach().float().reshape(self.rows, self.cols)

    def summed(self, total: torch.Tensor, t: int) -> torch.Tensor:
        """A window's running sum as the device keeps it after the addition of step ``t``."""
        if not self.policy.bf16_sums:
            return total
        return round_bf16(total, lattice(self.row_u, self.col_u, hash_bits(self.salt, PURPOSE_ACCUMULATE, t)))

    def _host_step(self, sums: torch.Tensor, divisor: int, hp: RefHyperParams, cols: torch.Tensor | None) -> None:
        """One host update of the columns ``cols`` (all when None) from the window's ``sums``; the count is already
        incremented. Leaves the step (steps) or the new master in ``host_master``."""
        index = slice(None) if cols is None else cols
        policy = self.policy
        if policy.compact:
            master = None if policy.steps else self.host_master[:, index]
            m, v, result = compact_update(
                sums[:, index],
                self.host_exp_avg[:, index],
                self.host_exp_avg_sq[:, index],
                hp,
                self.host_count,
                float(divisor),
                (self.row_u, self.col_u[index], self.salt),
                master,
                stochastic=True,
            )
            if policy.steps and policy.bf16_sums:
                result = result.to(torch.bfloat16).float()  # written into the bf16 window row
        else:
            mean = sums[:, index] / divisor
            start = torch.zeros_like(mean) if policy.steps else self.host_master[:, index]
            hp_used = _no_decay(hp) if policy.steps else hp
            result, m, v = adam_update(
                start, self.host_exp_avg[:, index], self.host_exp_avg_sq[:, index], mean, hp_used, self.host_count
            )
        self.host_master[:, index] = result
        self.host_exp_avg[:, index] = m
        self.host_exp_avg_sq[:, index] = v

    def full_host_update(self, grad2d: torch.Tensor, hp: RefHyperParams, t: int) -> None:
        """Warm-up: every element, synchronous, both counts +1 (a window of one step). With steps the host computes
        the step alone (no decay) and the model decays and adds it."""
        self.host_count += 1
        self.device_count += 1
        self._host_step(self.summed(grad2d, t), 1, hp, None)
        if self.policy.steps:
            self.shown = _landed(self.shown, self.host_master, 1.0 - hp.lr * hp.weight_decay)
        else:
            self.shown = self.host_master.clone()

    def device_update(self, grad2d: torch.Tensor, hp: RefHyperParams) -> None:
        cols = self.selected
        self.device_count += 1
        master, exp_avg, exp_avg_sq = adam_update(
            self.device_master[:, cols],
            self.device_exp_avg[:, cols],
            self.device_exp_avg_sq[:, cols],
            grad2d[:, cols],
            hp,
            self.device_count,
        )
        self.device_master[:, cols] = master
        self.device_exp_avg[:, cols] = exp_avg
        self.device_exp_avg_sq[:, cols] = exp_avg_sq

    def accumulate(self, grad2d: torch.Tensor, t: int) -> None:
        cols = ~self.selected
        self.window_sum[:, cols] = self.summed(self.window_sum + grad2d, t)[:, cols]
        self.window_grads += 1

    def host_window_update(self, hp: RefHyperParams) -> bool:
        """Close the window on the host side: one update of the unselected columns with the mean. True if it ran.
        With steps: from a zero master without decay, which leaves minus the step in the host master."""
        cols = ~self.selected
        ran = bool(cols.any()) and self.window_grads > 0
        if ran:
            self.host_count += 1
            self._host_step(self.window_sum, self.window_grads, hp, cols)
        self.window_sum = torch.zeros_like(self.window_sum)
        self.window_grads = 0
        return ran

    def interim_move(
        self, grad2d: torch.Tensor, hp: RefHyperParams, coefficient: float, first_in_window: bool, interval: int
    ) -> None:
        """``interim_step``: at a window's first step, update the factored estimate with the host columns of this
        gradient (decay ``beta2 ** S``); then move the weights of those columns by
        ``-coefficient * clip(g / denom, -1, 1)`` (docs/update_rule.md)."""
        host = (~self.selected).nonzero().flatten()
        if host.numel() == 0:
            return
        g = grad2d[:, host]
        if first_in_window:
            beta = hp.beta2**interval
            squared = g * g
            self.interim_row = self.interim_row * beta + squared.mean(dim=1) * (1.0 - beta)
            self.interim_col[host] = self.interim_col[host] * beta + squared.mean(dim=0) * (1.0 - beta)
            self.interim_decay = self.interim_decay * beta
        if coefficient == 0.0 or float(self.interim_decay) == 1.0:
            return
        correction = 1.0 - self.interim_decay
        row_scale = torch.sqrt(self.interim_row / torch.clamp(self.interim_row.mean(), min=1e-30))
        col_scale = torch.sqrt(self.interim_col[host] / correction)
        denom = row_scale[:, None] * col_scale[None, :] + hp.eps
        move = torch.clamp(g / denom, -1.0, 1.0) * (-coefficient)
        self.shown[:, host] = self.shown[:, host] + move

    def migrate(self, new_selected: torch.Tensor) -> None:
        """Columns that leave the device go back to the host, columns that enter it come from the host; staying
        columns keep their device state. Counts do not move. The compact state's host moments take the leaving
        columns' device moments rounded to nearest. With steps the weights are the masters of host columns: a leaving
        column's weight is its device master, an entering column's device master is its weight."""
        old, new = self.selected, new_selected.clone()
        leaving, entering = old & ~new, new & ~old
        for host, device in ((self.host_exp_avg, self.device_exp_avg), (self.host_exp_avg_sq, self.device_exp_avg_sq)):
            values = device[:, leaving]
            host[:, leaving] = values.to(torch.bfloat16).float() if self.policy.compact else values
        if self.policy.steps:
            self.shown[:, leaving] = self.device_master[:, leaving]
        else:
            self.host_master[:, leaving] = self.device_master[:, leaving]
            # nothing is in flight: the model now shows exactly the complete host state
            self.shown = self.host_master.clone()
        masters = self.shown if self.policy.steps else self.host_master
        for host, device in (
            (masters, self.device_master),
            (self.host_exp_avg, self.device_exp_avg),
            (self.host_exp_avg_sq, self.device_exp_avg_sq),
        ):
            device[:, entering] = host[:, entering]
            device[:, ~new] = float("nan")  # never read while the column is on the host
        for host in (self.host_master, self.host_exp_avg, self.host_exp_avg_sq):
            host[:, new] = float("nan")  # parked: never read until the column leaves the selection
        self.selected = new

    def merged(self, host: torch.Tensor, device: torch.Tensor) -> torch.Tensor:
        return torch.where(self.selected, device, host).reshape(self.shape)


def _no_decay(hp: RefHyperParams) -> RefHyperParams:
    return dataclasses.replace(hp, weight_decay=0.0)


def _landed(shown: torch.Tensor, step: torch.Tensor, scale: float) -> torch.Tensor:
    """Where the weights are the masters: a host update lands by scaling the weights with its decay and adding its
    step."""
    return (shown if scale == 1.0 else shown * scale) + step


@dataclass
class RefStepInfo:
    """What happened at one reference step (compared with the engine's ``StepStats``)."""

    window_end: bool
    selected: bool
    """A selection was made at this step (the first one at W+1, or a refresh)."""
    selection_changed: bool


class ReferenceZenFlow:
    """The ZenFlow update rule in one process, for differential tests.

    Args:
        param_groups: the torch optimizer's ``param_groups`` (lists of dicts with ``"params"`` and the
            hyperparameters); they are read at every step, so changing ``group["lr"]`` works as a scheduler.
        names: ``{param: name}``; frozen parameters are ignored.
        config: the ZenFlow knobs (only the update-rule ones are read; ``update_interval`` must be an int).
        steps_per_epoch: optimizer steps per epoch, for ``select_strategy`` ``"epoch"`` / ``"auto"``.
    """

    def __init__(
        self,
        param_groups: Sequence[Mapping],
        names: Mapping[torch.Tensor, str],
        config: ZenFlowConfig,
        steps_per_epoch: int | None = None,
    ) -> None:
        if not isinstance(config.update_interval, int):
            raise ValueError("the reference needs an integer update_interval")
        self.param_groups = param_groups
        self.config = config
        self.ratio = float(config.topk_ratio)
        self.interval = config.update_interval
        self.warm_up = config.full_warm_up_rounds
        names_by_id = {id(param): name for param, name in names.items()}
        trainable = [
            (group_index, param)
            for group_index, group in enumerate(param_groups)
            for param in group["params"]
            if param.requires_grad
        ]
        matrix_dtypes = [param.dtype for _, param in trainable if param.ndim >= 2]
        self.interim_step = self._interim_step(param_groups, config, matrix_dtypes)
        self.interim = self.interim_step > 0
        self.policy = self._policy(param_groups, config, trainable)
        self.matrices: list[_Matrix] = []
        self.device_only: list[_DeviceOnly] = []
        for group_index, param in trainable:
            name = names_by_id[id(param)]
            if param.ndim >= 2:
                index = sum(matrix.group == group_index for matrix in self.matrices)
                self.matrices.append(_Matrix(name, param, group_index, index, self.policy))
            else:
                self.device_only.append(_DeviceOnly(name, param, group_index))
        if config.select_strategy == "step":
            self.refresh_period: int | None = int(config.select_interval)
        else:
            epochs = 1 if config.select_strategy == "auto" else int(config.select_interval)
            self.refresh_period = None if steps_per_epoch is None else epochs * steps_per_epoch
            if steps_per_epoch is None and config.select_strategy == "auto":
                self.refresh_period = AUTO_SELECT_STEPS  # an epoch of unknown length: a step cadence
        self.t = 0
        self.t_select: int | None = None
        self.steps_in_window = 0
        self.last_hparams: list[RefHyperParams] | None = None
        self.pending: dict[str, torch.Tensor] | None = None
        """Overlap on: the host masters computed at the last window end, not yet shown by the model."""
        self.land_at: int | None = None
        """``land_after``: the step at whose end ``pending`` is shown (None: the next window end)."""
        self.selection_changes = 0

    def _interim_step(self, param_groups: Sequence[Mapping], config: ZenFlowConfig, dtypes: list) -> float:
        """``"auto"``: with windows longer than one step, host columns, fp32 or bf16 matrices, no Adam L2 term and
        eps > 0, 1.5 at windows of up to 4 steps and 1.5 * 4 / S at longer ones (written here as numbers, not read
        from the package: docs/update_rule.md states them)."""
        if config.interim_step != "auto":
            return float(config.interim_step)
        groups = [RefHyperParams.read(group) for group in param_groups]
        applies = (
            config.update_interval != 1
            and self.ratio < 1
            and all(dtype in (torch.float32, torch.bfloat16) for dtype in dtypes)
            and all(hp.decoupled or hp.weight_decay == 0 for hp in groups)
            and all(hp.eps > 0 for hp in groups)
        )
        return 1.5 * min(1.0, 4 / self.interval) if applies else 0.0

    def _policy(self, param_groups: Sequence[Mapping], config: ZenFlowConfig, trainable: list) -> HostPolicy:
        """docs/update_rule.md: the host keeps fp32 masters only without interim moves, for Adam's L2 decay or, in the
        exact state, for matrices that are not fp32; otherwise the weights are the masters."""
        compact = config.host_state != "fp32"
        groups = [RefHyperParams.read(group) for group in param_groups]
        with_matrices = {index for index, param in trainable if param.ndim >= 2}
        l2 = any(not groups[index].decoupled and groups[index].weight_decay for index in with_matrices)
        narrow = any(param.dtype != torch.float32 for _, param in trainable if param.ndim >= 2)
        masters = not self.interim and (l2 or (not compact and narrow))
        return HostPolicy(compact=compact, steps=not masters, bf16_sums=compact and config.accumulate_on != "host")

    # ------------------------------------------------------------------------------------------- the rule
    def step(self, grads: Mapping[str, torch.Tensor | None]) -> RefStepInfo:
        self.t += 1
        hparams = [RefHyperParams.read(group) for group in self.param_groups]
        self.last_hparams = hparams
        if self.t <= self.warm_up:
            for vector in self.device_only:
                if grads.get(vector.name) is not None:
                    vector.update(grads[vector.name], hparams[vector.group])
            for matrix in self.matrices:
                grad2d = matrix.grad2d(grads.get(matrix.name))
                if grad2d is not None:
                    matrix.full_host_update(grad2d, hparams[matrix.group], self.t)
            return RefStepInfo(window_end=True, selected=False, selection_changed=False)

        selected = changed = False
        if self.t_select is None:
            changed = self._select(grads)
            selected = True
        for vector in self.device_only:
            if grads.get(vector.name) is not None:
                vector.update(grads[vector.name], hparams[vector.group])
        for matrix in self.matrices:
            grad2d = matrix.grad2d(grads.get(matrix.name))
            if grad2d is None:
                continue
            if matrix.selected.any():
                matrix.device_update(grad2d, hparams[matrix.group])
            matrix.accumulate(grad2d, self.t)
            if self.interim:
                hp = hparams[matrix.group]
                coefficient = self.interim_step * hp.lr * (self.interval - 1) / self.interval
                matrix.interim_move(grad2d, hp, coefficient, self.steps_in_window == 0, self.interval)
        self.steps_in_window += 1
        if self.pending is not None and self.land_at == self.t:
            self.sync()  # land_after: shown L steps after its window closed
        window_end = self.steps_in_window == self.interval
        if window_end:
            self._close_window(hparams, apply_now=not self.config.overlap_step or self.t <= self.config.overlap_after)
            if self.refresh_period is not None and self.t - self.t_select >= self.refresh_period:
                self.sync()
                changed = self._select(grads)
                selected = True
        return RefStepInfo(window_end=window_end, selected=selected, selection_changed=changed)

    def _close_window(self, hparams: list[RefHyperParams], apply_now: bool) -> None:
        if not apply_now:
            self.sync()  # the previous window's update reaches the model first
        computed = {}
        for matrix in self.matrices:
            if matrix.host_window_update(hparams[matrix.group]):
                hp = hparams[matrix.group]
                computed[matrix.name] = (matrix.host_master.clone(), 1.0 - hp.lr * hp.weight_decay)
        self.steps_in_window = 0
        self.pending = computed
        land_after = self.config.land_after
        self.land_at = self.t + land_after if land_after is not None and land_after < self.interval else None
        if apply_now:
            self.sync()

    def _select(self, grads: Mapping[str, torch.Tensor | None]) -> bool:
        assert self.pending is None, "migration needs every host update applied"
        changed = False
        for matrix in self.matrices:
            scores = column_scores(matrix.grad2d(grads.get(matrix.name)), matrix.cols, self.config.importance)
            new_selected = choose_columns(scores, num_columns(matrix.cols, self.ratio))
            if self.t_select is not None and not torch.equal(new_selected, matrix.selected):
                changed = True
            matrix.migrate(new_selected)
        self.t_select = self.t
        self.selection_changes += int(changed)
        return changed

    def sync(self) -> None:
        """Apply the host update in flight, if any; the open window stays open."""
        if self.pending is None:
            return
        by_name = {matrix.name: matrix for matrix in self.matrices}
        for name, (master, scale) in self.pending.items():
            matrix = by_name[name]
            matrix.shown = _landed(matrix.shown, master, scale) if self.policy.steps else master
        self.pending = None

    def flush(self) -> None:
        """Apply what is in flight, then close the open window early with the last step's hparams, at once."""
        self.sync()
        if self.steps_in_window > 0 and self.last_hparams is not None:
            self._close_window(self.last_hparams, apply_now=True)

    # ----------------------------------------------------------------------------------------- read-outs
    def weights(self) -> dict[str, torch.Tensor]:
        """The model weights the rule says the model shows now, in the model dtype and shape."""
        out = {}
        for matrix in self.matrices:
            out[matrix.name] = matrix.merged(matrix.shown, matrix.device_master).to(matrix.dtype)
        for vector in self.device_only:
            out[vector.name] = vector.master.to(vector.dtype)
        return out

    def masters(self) -> dict[str, torch.Tensor]:
        """The current fp32 master of every parameter (device values for selected columns, host for the rest)."""
        out = {
            m.name: m.merged(m.shown if self.policy.steps else m.host_master, m.device_master) for m in self.matrices
        }
        out.update({v.name: v.master.clone() for v in self.device_only})
        return out

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(exp_avg, exp_avg_sq)`` of every parameter, merged the same way."""
        out = {
            m.name: (m.merged(m.host_exp_avg, m.device_exp_avg), m.merged(m.host_exp_avg_sq, m.device_exp_avg_sq))
            for m in self.matrices
        }
        out.update({v.name: (v.exp_avg.clone(), v.exp_avg_sq.clone()) for v in self.device_only})
        return out

    def counts(self) -> dict[str, tuple[int, int]]:
        """``(device count, host count)`` per parameter; device-only parameters have host count 0."""
        out = {m.name: (m.device_count, m.host_count) for m in self.matrices}
        out.update({v.name: (v.count, 0) for v in self.device_only})
        return out

    def selected_columns(self) -> dict[str, torch.Tensor]:
        """Ascending int64 indices of each matrix's selected columns."""
        return {m.name: m.selected.nonzero().flatten() for m in self.matrices}
