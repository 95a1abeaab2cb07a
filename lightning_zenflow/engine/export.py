"""The way back to AdamW: what ``torch.optim.AdamW`` should load for one parameter of a ZenFlow run.

A ZenFlow matrix has two histories. Its device columns took an AdamW step every optimizer step: their moments and
count are AdamW's. Its host columns took one AdamW step per window, on the window's *mean* gradient, with their own
bias-correction count ``n`` (the host's updates), which is smaller than the optimizer step ``t``. torch's format has
one ``step`` per parameter, and AdamW divides by ``1 - beta ** step``: loaded as they are with ``step = t``, the host
moments are read as if filled over ``t`` updates, and with ``beta2`` near 1 their second moment is a fraction of what
AdamW would hold (``(1 - beta2 ** n) / (1 - beta2 ** t)``). AdamW's first steps on those columns then come out too
large, for about ``1 / (1 - beta2)`` steps.

:func:`adamw_state` states everything at ``step = t`` and rescales the host columns' moments to that count, so that
AdamW's bias-corrected estimates are the ones the host side had: ``m * (1 - beta1 ** t) / (1 - beta1 ** n)``, and the
same with ``beta2`` for ``v``. A window's mean has a smaller mean square than the single-step gradients AdamW sees
(its noise is averaged over the window), and the warm-up's large first gradients weigh in AdamW's ``v`` for about
``1 / (1 - beta2)`` steps. Where the interim moves' statistics measured the host columns' single-step mean square (one
gradient per window) and the warm-up's second moment per column (``engine/interim.py``), the host ``v`` is scaled,
per matrix, to the mean AdamW's would have from the two.
The device columns and 1-D parameters are exported as they are. docs/checkpoints.md has the measurements.

The same state is ZenFlow's own checkpoint, which must resume bitwise: the engine's part of it keeps, per matrix, the
two factors and the last-bit differences of dividing them out again (:func:`exact_inverse`, int8: 2 B per element),
and a resume restores the moments the engine held exactly (:func:`restore_moments`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SCALES_KEY, RESIDUALS_KEY = "adamw_export_scales", "adamw_export_residuals"
"""The engine state's keys (per matrix) of what undoes the export's rescaling exactly: the host columns' factors of
``exp_avg`` and ``exp_avg_sq`` (float64 ``[2]``), and the last-bit differences of dividing them out again (int8
``[2, *shape]``; int32 in the rare case one does not fit). A ZenFlow resume restores the moments bitwise from them
(2 B per matrix element)."""


def adamw_state(entry: Mapping[str, object], betas: tuple[float, float]) -> dict[str, torch.Tensor]:
    """torch AdamW's state for one parameter, from the engine's merged entry (``engine/state.py``): fp32 ``exp_avg``
    and ``exp_avg_sq`` shaped like the parameter, ``device_step``, ``host_step``, for a matrix ``selected`` (its device
    columns) and, with interim moves, ``interim_row`` and ``interim_decay``. Returns ``{"step", "exp_avg",
    "exp_avg_sq"}`` (new tensors where anything changed; the entry is not modified)."""
    step = max(int(entry["device_step"]), int(entry["host_step"]))  # type: ignore[call-overload]
    state = {"step": torch.tensor(float(step), dtype=torch.float32)}
    scales = _host_scales(entry, betas)
    for key, scale in zip(("exp_avg", "exp_avg_sq"), scales or (None, None)):
        moment = torch.as_tensor(entry[key])
        state[key] = moment if scale is None else _scaled(moment, _host_mask(entry), scale)
    return state


def exact_inverse(entry: Mapping[str, object], betas: tuple[float, float]) -> dict[str, torch.Tensor]:
    """What :func:`restore_moments` needs to get ``entry``'s moments back bitwise from :func:`adamw_state`'s (empty
    where the export changed nothing)."""
    scales = _host_scales(entry, betas)
    if scales is None:
        return {}
    host = _host_mask(entry)
    residuals = []
    for key, scale in zip(("exp_avg", "exp_avg_sq"), scales):
        moment = torch.as_tensor(entry[key]).float()
        back = _scaled(_scaled(moment, host, scale), host, 1.0 / scale, divide=scale)
        residuals.append(moment.view(torch.int32).long() - back.view(torch.int32).long())
    stacked = torch.stack(residuals)
    small = bool(stacked.abs().max() <= torch.iinfo(torch.int8).max)
    return {
        SCALES_KEY: torch.tensor(scales, dtype=torch.float64),
        RESIDUALS_KEY: stacked.to(torch.int8 if small else torch.int32),
    }


def restore_moments(moments: dict[str, torch.Tensor], entry: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The moments as the engine held them, from the exported ones and the entry's :data:`SCALES_KEY` and
    :data:`RESIDUALS_KEY` (a state without them, saved before the export rescaled anything or by plain AdamW, is taken
    as it is)."""
    scales, residuals = entry.get(SCALES_KEY), entry.get(RESIDUALS_KEY)
    if not isinstance(scales, torch.Tensor) or not isinstance(residuals, torch.Tensor):
        return moments
    host = _host_mask(entry, like=moments["exp_avg"])
    restored = dict(moments)
    for index, key in enumerate(("exp_avg", "exp_avg_sq")):
        scale = float(scales[index])
        back = _scaled(moments[key].float(), host, 1.0 / scale, divide=scale)
        bits = back.view(torch.int32).long() + residuals[index].long()
        restored[key] = bits.to(torch.int32).view(torch.float32).view_as(moments[key])
    return restored


def add_exact_inverses(params: Mapping[str, dict], engine: Any) -> None:
    """Add :func:`exact_inverse` to each matrix entry of an engine state (``engine/state.py``), before its moments
    are left out of it (they travel in the torch-format state, rescaled)."""
    betas = {id(param): tuple(group["betas"]) for group in engine.optimizer.param_groups for param in group["params"]}
    for group in engine.layout:
        for slot in group.matrices:
            entry = params.get(slot.name)
            if entry is not None and "exp_avg" in entry and id(slot.param) in betas:
                entry.update(exact_inverse(entry, betas[id(slot.param)]))


def restore_exported(moments: Mapping[str, dict], params: Mapping[str, Mapping]) -> dict[str, dict]:
    """:func:`restore_moments` for every parameter of a torch-format state taken with an engine state."""
    return {name: restore_moments(entry, params.get(name, {})) for name, entry in moments.items()}


def _host_mask(entry: Mapping[str, object], like: torch.Tensor | None = None) -> torch.Tensor:
    """The host columns of a matrix (those not ``selected``), for a moment shaped as ``like`` (the entry's own)."""
    like = torch.as_tensor(entry["exp_avg"]) if like is None else like
    host = torch.ones(_columns(entry, like), dtype=torch.bool)
    host[torch.as_tensor(entry["selected"], dtype=torch.long)] = False
    return host


def _columns(entry: Mapping[str, object], like: torch.Tensor) -> int:
    """The columns of a matrix's view: the entry's own (a stack of expert matrices), else ``numel // shape[0]`` (a
    state saved before the entries said)."""
    columns = entry.get("columns")
    return int(columns) if columns is not None else like.numel() // max(1, like.shape[0])


def _host_scales(entry: Mapping[str, object], betas: tuple[float, float]) -> tuple[float, float] | None:
    """The factors of the host columns' ``exp_avg`` and ``exp_avg_sq`` (None: nothing to rescale)."""
    device_step, host_step = int(entry["device_step"]), int(entry["host_step"])  # type: ignore[call-overload]
    step = max(device_step, host_step)
    if entry.get("kind") != "matrix" or host_step in (0, step) or not bool(_host_mask(entry).any()):
        return None  # no host columns, or they count every step (synchronous offload: AdamW's own numbers)
    beta1, beta2 = betas
    exp_avg_sq = torch.as_tensor(entry["exp_avg_sq"])
    host = _host_mask(entry)
    host_v = exp_avg_sq.reshape(-1, host.numel())[:, host]
    counts_v = (1.0 - beta2**step) / (1.0 - beta2**host_step)
    return (1.0 - beta1**step) / (1.0 - beta1**host_step), _host_v_factor(entry, host, host_v, beta2, step) or counts_v


def _scaled(moment: torch.Tensor, host: torch.Tensor, scale: float, divide: float | None = None) -> torch.Tensor:
    """``moment`` with its host columns times ``scale`` (or divided by ``divide``), computed in float64 and rounded
    once to fp32: the same bits on every machine."""
    result = moment.reshape(-1, host.numel()).clone()
    host_part = result[:, host].double()
    result[:, host] = (host_part / divide if divide is not None else host_part * scale).float()
    return result.view_as(moment)


def _host_v_factor(
    entry: Mapping[str, object], host: torch.Tensor, host_v: torch.Tensor, beta2: float, step: int
) -> float | None:
    """The factor that gives the host columns' ``exp_avg_sq`` the mean AdamW's would have at ``step``, from the interim
    moves' statistics (None where there are none, or they hold nothing usable: then the counts alone restate it).

    AdamW's second moment after ``step`` steps, of which the first ``W`` were the warm-up, is
    ``beta2 ** (step - W) * v_W + (1 - beta2 ** (step - W)) * a`` where ``v_W`` is the warm-up's (recorded per column
    during the warm-up, ``interim_warm_col``) and ``a`` the single-step mean square since (the row statistics'
    bias-corrected mean). The host's own ``exp_avg_sq`` took one window mean per window instead (a smaller mean
    square, fewer decays): its mean is scaled to that value.
    """
    row, decay = entry.get("interim_row"), entry.get("interim_decay")
    if not isinstance(row, torch.Tensor) or not isinstance(decay, torch.Tensor):
        return None
    correction = 1.0 - float(decay)
    held = float(host_v.double().mean())
    if correction <= 0.0 or not (0.0 < held < math.inf):
        return None
    late = float(row.double().mean()) / correction
    warm_col, warm_steps = entry.get("interim_warm_col"), entry.get("interim_warm_steps")
    warm, since_warm = 0.0, step
    if isinstance(warm_col, torch.Tensor) and isinstance(warm_steps, torch.Tensor) and float(warm_steps) > 0:
        warm = float(warm_col.double()[host].mean())
        since_warm = max(0, step - int(warm_steps))
    target = beta2**since_warm * warm + (1.0 - beta2**since_warm) * late
    factor = target / held
    # statistics that hold nothing usable (no gradient yet, an overflow) leave the moments as the counts state them
    return factor if math.isfinite(factor) and factor > 0.0 else None
