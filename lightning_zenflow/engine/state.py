"""Engine state: the exact-resume state dict, and conversion to and from torch's AdamW format.

The engine state is keyed by parameter name and validated on load (names and shapes). For every trainable
parameter it holds the fp32 master, the moments and the per-side step counts, merged from the device
(selected columns, device-only parameters) and the host (the other columns); for matrices also the
selected columns and, mid-window, the open window's accumulated gradient. ``progress`` holds the position
in the rule: step, window, accumulator slot, the host update that is computed but not yet applied.

Taking the state waits for a host update in flight to finish computing and never applies it early, so a
run continued from the state is bitwise the uninterrupted run. The staged upload of a computed update is
not stored: it is the master cast to the model dtype, and is rebuilt on load.

Loading checks everything first (:func:`check_state`: names, shapes, the selection, the progress) and writes
nothing when a check fails; the strategy runs the same checks on a checkpoint file before Lightning loads any of
it (:func:`state_dict_mismatch` for the model weights, :func:`unreadable_checkpoint` for a file torch cannot read).
A state saved with another ``topk_ratio`` is loaded with the new one (``docs/update_rule.md``, "Resuming with
other knobs").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from lightning_zenflow.config import num_selected_columns
from lightning_zenflow.engine.layout import MatrixSlot, staging_view

if TYPE_CHECKING:
    from lightning_zenflow.engine.engine import ZenFlowEngine

STATE_VERSION = 2
"""2: the schedule is saved as ``Schedule.state_dict()`` and the open window as gradient sums."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def _merged_once(engine: ZenFlowEngine, include_moments: bool) -> dict[str, dict]:
    """:func:`_merged`, taken once per point of the run: a checkpoint asks for the torch-format state and then for
    the engine's (without moments), and the second reuses the first's merge (12 B per element of clones on rank 0,
    and under data parallel 3 broadcasts per matrix, not twice). Cleared at the next step (``engine.merge_cache``).
    Entries are copied shallowly, so callers may drop keys."""
    key = engine.state_point()
    cached = engine.merge_cache
    if cached is not None and cached[0] == key and (cached[1] or not include_moments):
        merged = cached[2]
    else:
        merged = _merged(engine, include_moments=include_moments)
        engine.merge_cache = (key, include_moments, merged)
    return {name: dict(entry) for name, entry in merged.items()}


def _merged(engine: ZenFlowEngine, row_blocks: bool = False, include_moments: bool = True) -> dict[str, dict]:
    """Per parameter name: fp32 master and moments (device values for device columns) and counts.

    Blocking device -> host copies: a synchronisation point on CUDA, taken only at checkpoints. Data parallel:
    every rank's host rows are gathered to rank 0 (collectives: every rank calls this at the same point), so the
    state is the same whatever the number of ranks, and any number of ranks can resume it; the other ranks take
    part and get an empty dict (the convention of Lightning's consolidated optimizer states). ``row_blocks``: each
    matrix as this rank's row block instead, no collective, on every rank.
    """
    engine.synchronize_device()
    keep = row_blocks or engine.ranks.rank == 0
    merged = {}
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for state in engine.device_updater.selected[group_index]:
            slot = state.slot
            entry = {}
            rows = [("master", host.master, state.master)]
            if include_moments:
                rows += [("exp_avg", host.exp_avg, state.exp_avg), ("exp_avg_sq", host.exp_avg_sq, state.exp_avg_sq)]
            for key, host_row, device_tensor in rows:
                if row_blocks:
                    value = slot.view2d(host_row).clone()
                    device_tensor = device_tensor[slot.row_start : slot.row_stop]
                else:
                    value = engine.ranks.gather_rows(slot.view2d(host_row), slot.rows, engine.device)
                    if value is None:
                        continue
                if state.k:
                    value.index_copy_(1, state.selected_host, device_tensor.cpu())
                entry[key] = value if row_blocks else value.view(slot.param.shape)
            if not keep:
                continue
            entry.update(
                kind="matrix",
                device_step=state.step,
                host_step=int(host.step_shared[slot.index_in_group]),
                selected=state.selected_host.clone(),
            )
            if engine.interim is not None:
                entry.update(engine.interim.state_of(slot.name))
            merged[slot.name] = entry
        if not keep:
            continue
        for state, device_entry in zip(engine.device_updater.device_only[group_index], group.device_only):
            merged[device_entry.name] = {
                "kind": "device",
                "master": state.master.detach().cpu().clone(),
                "device_step": state.step,
                "host_step": 0,
            }
            if include_moments:
                merged[device_entry.name]["exp_avg"] = state.exp_avg.cpu().clone()
                merged[device_entry.name]["exp_avg_sq"] = state.exp_avg_sq.cpu().clone()
    return merged


def engine_row_blocks(engine: ZenFlowEngine) -> dict:
    """The engine state with each matrix as this rank's row block (``[host_rows, cols]``: master, moments, the open
    window's sum), no collective: the sharded checkpoint format. ``row_blocks`` marks it; it loads only into an
    engine whose rank owns the same rows (the sharded checkpoint reader reshards before it loads)."""
    engine.wait_idle()
    params = _merged(engine, row_blocks=True)
    for name, block in engine.window_sums(row_blocks=True).items():
        params[name]["grad_acc"] = block
    return {
        "version": STATE_VERSION,
        "params": params,
        "progress": engine.schedule.state_dict(),
        "row_blocks": True,
        **_rule(engine),
    }


def carried_entries(engine: ZenFlowEngine) -> dict[str, dict]:
    """Every parameter's exact state as this rank holds it (row blocks of matrices; no collective), to carry into
    a new layout of the same engine (:func:`carry_into`). Taken with nothing in flight and no open window."""
    engine.wait_idle()
    return _merged(engine, row_blocks=True)


def carry_into(engine: ZenFlowEngine, entries: Mapping[str, dict], from_weights: set[str] = frozenset()) -> None:
    """Put carried states (:func:`carried_entries`) into a started engine with a new layout, by name. Parameters
    without one start as AdamW starts them (zero moments and counts, the weights as master, on the host). Names in
    ``from_weights`` take their master from the current weights instead of the carried one."""
    updater = engine.device_updater
    selected, device_steps = [], []
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for slot in group.matrices:
            entry = entries.get(slot.name)
            if entry is None or entry.get("kind") != "matrix":
                selected.append(torch.empty(0, dtype=torch.long))
                device_steps.append(0)
                continue
            if slot.name not in from_weights:
                slot.view2d(host.master).copy_(entry["master"].reshape(slot.host_rows, slot.cols))
            for key in MOMENTS:
                slot.view2d(getattr(host, key)).copy_(entry[key].reshape(slot.host_rows, slot.cols))
            host.step_shared[slot.index_in_group] = float(entry["host_step"])
            selected.append(entry["selected"].to(torch.long))
            device_steps.append(int(entry["device_step"]))
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            entry = entries.get(device_entry.name)
            if entry is None or entry.get("kind") != "device":
                continue
            with torch.no_grad():
                if device_entry.name not in from_weights:
                    state_entry.master.copy_(entry["master"])
                state_entry.exp_avg.copy_(entry["exp_avg"])
                state_entry.exp_avg_sq.copy_(entry["exp_avg_sq"])
                if state_entry.separate_master:
                    state_entry.param.data.copy_(state_entry.master)
            state_entry.step = int(entry["device_step"])
    engine.install_selection(selected, device_steps)
    _load_interim(engine, entries)
    engine.synchronize_device()


def _masters_from_interim_state(engine: ZenFlowEngine, group_index: int, pending: object, params: Mapping) -> None:
    """A state saved with interim moves, loaded under the paper's rule: its host masters are set from the weights,
    where they live under interim moves, and a step in flight becomes the new masters it lands as
    (``weights * decay + step``), so it lands by the paper's copy. Before the selection is installed."""
    host = engine.host_buffers[group_index]
    landing = {}
    if pending is not None and pending.scales is not None:
        landing = dict(zip(pending.active[group_index], pending.scales[group_index]))
        pending.scales[group_index] = []
    with torch.no_grad():
        for index, slot in enumerate(engine.layout[group_index].matrices):
            own = slot.param.detach().view(slot.rows, slot.cols)[slot.row_start : slot.row_stop].cpu()
            master = slot.view2d(host.master)
            if index in landing:
                scale = landing[index]
                saved_selected = params[slot.name]["selected"].to(torch.long)
                device_columns = master.index_select(1, saved_selected)  # the saved device masters
                master.copy_((own if scale == 1.0 else own * scale) + master)
                master.index_copy_(1, saved_selected, device_columns)
            else:
                master.copy_(own)
    if pending is not None and pending.scales is not None and not any(pending.scales):
        pending.scales = None


def _absorb_interim_steps(engine: ZenFlowEngine, pending: object, all_on_device: list, params: Mapping) -> None:
    """Interim moves on both sides of a load, and a matrix with a saved step in flight now entirely on the device: the
    step lands at the load (weights decayed plus the step, the saved device columns as they were), into the weights
    and the device masters, as the paper's rule takes such an update into the device masters."""
    states = engine.device_updater.selected
    with torch.no_grad():
        for group_index, (indices, scales) in enumerate(zip(pending.active, pending.scales)):
            host = engine.host_buffers[group_index]
            for index, scale in zip(indices, scales):
                if not all_on_device[group_index][index]:
                    continue
                state = states[group_index][index]
                slot = state.slot
                weights2d = slot.param.data.view(slot.rows, slot.cols)
                own = weights2d[slot.row_start : slot.row_stop]
                step = slot.view2d(host.master).to(own.device)
                saved_selected = params[slot.name]["selected"].to(device=own.device, dtype=torch.long)
                kept = own.index_select(1, saved_selected)
                own.mul_(scale).add_(step)
                own.index_copy_(1, saved_selected, kept)
                engine.ranks.share_rows_many([weights2d])
                state.master.copy_(weights2d.index_select(1, state.selected))


def _load_interim(engine: ZenFlowEngine, entries: Mapping[str, Mapping]) -> None:
    """``interim_step``: the moves' statistics by name, and the selected columns' device masters from the weights
    (which are the masters there; a selection that changed at the load took host values)."""
    if engine.interim is None:
        return
    with torch.no_grad():
        for state in engine.device_updater.matrix_states():
            engine.interim.load(entries.get(state.slot.name, {}), state)
            if state.k:
                weights2d = state.slot.param.detach().view(state.slot.rows, state.slot.cols)
                state.master.copy_(weights2d.index_select(1, state.selected))


def engine_state_dict(engine: ZenFlowEngine, include_moments: bool) -> dict:
    # wait for the host update in flight to finish computing; applying it now would change the run
    engine.wait_idle()
    params = _merged_once(engine, include_moments)
    for name, window_sum in engine.window_sums().items():
        if name in params:  # data parallel: rank 0 only
            params[name]["grad_acc"] = window_sum
    if not include_moments:
        for entry in params.values():
            for key in MOMENTS:
                entry.pop(key, None)
    return {"version": STATE_VERSION, "params": params, "progress": engine.schedule.state_dict(), **_rule(engine)}


def _rule(engine: ZenFlowEngine) -> dict:
    """Marks a state saved with interim moves: its host masters are not the weights (docs/update_rule.md)."""
    return {"interim": True} if engine.interim is not None else {}


def _param_names(engine: ZenFlowEngine) -> dict[str, torch.Tensor]:
    names = {}
    for group in engine.layout:
        for slot in group.matrices:
            names[slot.name] = slot.param
        for entry in group.device_only:
            names[entry.name] = entry.param
    return names


def _check_fresh(engine: ZenFlowEngine, what: str) -> None:
    """Loading replaces the whole state: an engine that has stepped (a Tuner's restore, a reload mid-fit) is rebuilt
    fresh first, its work in flight dropped, its worker restarted."""
    if engine.closed:
        raise RuntimeError(f"{what}: the ZenFlowEngine is not running; call start() first (and not after close()).")
    if not engine.is_fresh():
        engine.restart()


MATRIX_KEYS = ("master", "device_step", "host_step", "selected")
DEVICE_ONLY_KEYS = ("master", "device_step", "host_step")
PROGRESS_KEYS = ("t", "steps_in_window", "slot", "window_counts", "pending", "last_select_t", "selections", "interval")
_SHOWN = 5


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_state(state: object, shapes: Mapping[str, tuple[int, ...]], require_all: bool = True) -> None:
    """Raise ``ValueError`` saying what differs when the engine state ``state`` does not fit a model whose trainable
    parameters have ``shapes`` (``{name: shape}``). Reads only; every check runs before anything is loaded.

    ``require_all=False`` accepts a state that covers only some of ``shapes`` (the strategy checks a checkpoint
    against the module before the optimizer, which may hold a subset of the parameters, exists).
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, Mapping) else None
        raise ValueError(
            f"unknown ZenFlow state version {version!r}; expected {STATE_VERSION}. A checkpoint of an older "
            "lightning_zenflow resumes its weights only: load them into the module and start a new fit."
        )
    params, progress = state.get("params"), state.get("progress")
    if not isinstance(params, Mapping) or not isinstance(progress, Mapping):
        raise ValueError("the ZenFlow state has no 'params' or no 'progress' section; it is incomplete.")
    missing = sorted(set(shapes) - set(params)) if require_all else []
    unexpected = sorted(set(params) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            "the ZenFlow state does not match the model's trainable parameters: "
            + "; ".join(
                part
                for part in (
                    f"the model has {_listed(missing)}, the checkpoint does not" if missing else "",
                    f"the checkpoint has {_listed(unexpected)}, the model does not" if unexpected else "",
                )
                if part
            )
            + ". Load it into the same model (same parameter names and requires_grad), or resume with only the "
            "model weights (e.g. ckpt_path=None and load_state_dict on the module)."
        )
    differences = []
    for name in sorted(set(params) & set(shapes)):
        entry, shape = params[name], tuple(shapes[name])
        if not isinstance(entry, Mapping):
            raise ValueError(f"the saved state of {name} is a {type(entry).__name__}, not a dict; it is corrupt.")
        required = MATRIX_KEYS if len(shape) >= 2 else DEVICE_ONLY_KEYS
        absent = [key for key in required if key not in entry]
        if absent:
            raise ValueError(f"the saved state of {name} lacks {absent}; it is incomplete.")
        for key in ("master", *MOMENTS, "grad_acc"):
            if key not in entry:
                continue
            value = entry[key]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise ValueError(f"the saved {key} of {name} is not a floating-point tensor; it is corrupt.")
            if state.get("row_blocks") and len(shape) >= 2:
                continue  # a rank's row block; its reader checked the whole matrix's shape
            if tuple(value.shape) != shape:
                differences.append(f"{name} ({key}): checkpoint {tuple(value.shape)}, model {shape}")
        if "selected" in entry and len(shape) >= 2 and not differences:
            _check_selected(name, entry["selected"], math.prod(shape[1:]))
    if differences:
        raise ValueError(
            "the ZenFlow state was saved for parameters of other shapes: "
            + "; ".join(differences[:_SHOWN])
            + (f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else "")
            + ". The checkpoint belongs to a different model."
        )
    absent = [key for key in PROGRESS_KEYS if key not in progress]
    if absent:
        raise ValueError(f"the ZenFlow state's progress lacks {absent}; it is incomplete.")


def _check_selected(name: str, selected: object, cols: int) -> None:
    ok = isinstance(selected, torch.Tensor) and selected.ndim == 1 and not selected.is_floating_point()
    if ok and selected.numel():
        ok = int(selected.min()) >= 0 and int(selected.max()) < cols
        ok = ok and (selected.numel() == 1 or bool((selected[1:] > selected[:-1]).all()))
    if not ok:
        raise ValueError(
            f"the saved selected columns of {name} are not ascending distinct indices into its {cols} columns."
        )


def _check_progress(engine: ZenFlowEngine, progress: Mapping) -> None:
    """The schedule's shape against this engine's layout (checked before anything is loaded)."""
    per_group = [len(group.matrices) for group in engine.layout]
    counts = progress["window_counts"]
    if [len(c) for c in counts] != per_group:
        raise ValueError(
            f"the saved schedule counts matrices per param group {[len(c) for c in counts]}, this model has "
            f"{per_group}; the checkpoint belongs to a different model or optimizer setup."
        )
    pending = progress["pending"]
    if pending is None:
        return
    active = pending.get("active") if isinstance(pending, Mapping) else None
    if (
        int(pending.get("slot", -1)) not in (0, 1)
        or active is None
        or len(active) != len(per_group)
        or any(int(i) < 0 or int(i) >= n for indices, n in zip(active, per_group) for i in indices)
    ):
        raise ValueError("the saved pending host update does not fit this model's param groups; it is corrupt.")
    scales = pending.get("scales")
    if scales is not None and (
        len(scales) != len(active) or any(len(s) != len(indices) for s, indices in zip(scales, active))
    ):
        raise ValueError("the saved pending host update's decay factors do not fit its matrices; it is corrupt.")


def _param_shapes(engine: ZenFlowEngine) -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in _param_names(engine).items()}


def load_engine_state_dict(engine: ZenFlowEngine, state: Mapping, torch_state: Mapping | None) -> None:
    _check_fresh(engine, "load_state_dict")
    engine.merge_cache = None
    # everything is validated before anything is written: a bad state leaves the engine untouched
    check_state(state, _param_shapes(engine))
    params = state["params"]
    _check_progress(engine, state["progress"])
    moments = _moments_by_name(engine, torch_state) if torch_state is not None else {}
    row_blocks = bool(state.get("row_blocks"))

    def own(slot: MatrixSlot, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(slot.host_rows, slot.cols) if row_blocks else slot.own(tensor)

    def moment(name: str, key: str) -> torch.Tensor:
        if key in params[name]:
            return params[name][key]
        if name in moments:
            return moments[name][key]
        raise ValueError(f"the ZenFlow state has no {key} for {name} and no torch optimizer state supplies it.")

    for group in engine.layout:
        for slot in group.matrices:
            for key in MOMENTS:
                moment(slot.name, key)
        for entry in group.device_only:
            for key in MOMENTS:
                moment(entry.name, key)
    engine.schedule.load_state_dict(
        state["progress"],
        keep_interval=None if engine.config.update_interval == "auto" else int(engine.config.update_interval),
    )
    updater = engine.device_updater
    selected, device_steps = [], []
    window_sums = {name: entry["grad_acc"] for name, entry in params.items() if "grad_acc" in entry}
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for slot in group.matrices:
            entry = params[slot.name]
            slot.view2d(host.master).copy_(own(slot, entry["master"]))
            slot.view2d(host.exp_avg).copy_(own(slot, moment(slot.name, "exp_avg")))
            exp_avg_sq = moment(slot.name, "exp_avg_sq").reshape(-1, slot.cols)
            slot.view2d(host.exp_avg_sq).copy_(own(slot, exp_avg_sq))
            host.step_shared[slot.index_in_group] = float(entry["host_step"])
            saved = entry["selected"].to(torch.long)
            score = exp_avg_sq.sum(dim=0)
            if row_blocks and _selection_changes(engine, slot, saved):
                score = engine.ranks.all_reduce_sum(score, engine.device)  # every rank's rows
            chosen = _selection_for_ratio(engine, slot, saved, score)
            if slot.name in window_sums and not torch.equal(chosen, saved):
                window_sums[slot.name] = _without_leaving(window_sums[slot.name], slot, saved, chosen)
            selected.append(chosen)
            device_steps.append(int(entry["device_step"]))
        if state.get("interim") and engine.interim is None:
            _masters_from_interim_state(engine, group_index, engine.schedule.pending, params)
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            entry = params[device_entry.name]
            with torch.no_grad():
                state_entry.master.copy_(entry["master"])
                state_entry.exp_avg.copy_(moment(device_entry.name, "exp_avg"))
                state_entry.exp_avg_sq.copy_(moment(device_entry.name, "exp_avg_sq"))
                if state_entry.separate_master:
                    state_entry.param.data.copy_(state_entry.master)
            state_entry.step = int(entry["device_step"])
    engine.install_selection(selected, device_steps)
    _load_interim(engine, params)
    engine.restore_window_sums(window_sums, row_blocks=row_blocks)
    pending = engine.schedule.pending
    if pending is not None:
        # a matrix now entirely on the device took the computed update with its masters: nothing left to land
        flat = iter(selected)
        all_on_device = [[next(flat).numel() == slot.cols for slot in group.matrices] for group in engine.layout]
        if pending.scales is not None:
            if engine.interim is not None:
                _absorb_interim_steps(engine, pending, all_on_device, params)
            pending.scales = [
                [scale for i, scale in zip(a, pending.scales[g]) if not all_on_device[g][i]]
                for g, a in enumerate(pending.active)
            ]
        pending.active = [[i for i in a if not all_on_device[g][i]] for g, a in enumerate(pending.active)]
        if not any(pending.active):
            engine.schedule.pending = None
    pending = engine.schedule.pending
    if pending is not None:
        # rebuild the staged upload of the computed update: the host master cast to the model dtype
        pending.computed = True
        for group_index, group in enumerate(engine.layout):
            host = engine.host_buffers[group_index]
            for index in pending.active[group_index]:
                slot = group.matrices[index]
                if slot.param.dtype == torch.float32:
                    continue  # fp32 weights are uploaded from the master itself
                staging_view(host.grad_acc(pending.slot), slot, slot.param.dtype).copy_(slot.view2d(host.master))
    engine.synchronize_device()


def _selection_changes(engine: ZenFlowEngine, slot: MatrixSlot, saved: torch.Tensor) -> bool:
    """Whether a resume with the configured ``topk_ratio`` chooses other columns than the saved ones."""
    if engine.schedule.last_select_t is None:
        return False
    return num_selected_columns(slot.cols, engine.config.topk_ratio) != saved.numel()


def _selection_for_ratio(
    engine: ZenFlowEngine, slot: MatrixSlot, saved: torch.Tensor, score: torch.Tensor
) -> torch.Tensor:
    """The columns to select after a resume: the saved ones, unless the run now has another ``topk_ratio``.

    Then each matrix gets the configured k at once (device memory follows the new ratio from the first step),
    changing as few columns as possible: a smaller k keeps the saved columns with the largest second moment
    (``score``: ``exp_avg_sq`` summed over the column, the running mean of its squared gradient, i.e. of its L2
    score); a larger k adds the unselected columns with the largest. Ties go to the lower index. The next refresh
    chooses from the gradient again. Before the first selection (warm-up) there is nothing to keep.
    """
    if engine.schedule.last_select_t is None:
        return saved
    k = num_selected_columns(slot.cols, engine.config.topk_ratio)
    if saved.numel() == k:
        return saved
    if k < saved.numel():
        ranked = torch.sort(score[saved], descending=True, stable=True).indices
        chosen = saved[ranked[:k]]
    else:
        others = torch.ones(slot.cols, dtype=torch.bool)
        others[saved] = False
        candidates = others.nonzero().flatten()
        ranked = torch.sort(score[candidates], descending=True, stable=True).indices
        chosen = torch.cat([saved, candidates[ranked[: k - saved.numel()]]])
    return torch.sort(chosen).values


def _without_leaving(
    window_sum: torch.Tensor, slot: MatrixSlot, saved: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """The open window's sum for a matrix whose selection changed at load. Columns that leave the device had their
    gradients of this window applied there already: their sum starts from zero (it may hold them, whole rows are
    accumulated on the device). Columns that enter the device drop theirs: the device update cannot take a sum."""
    leaving = saved[~torch.isin(saved, chosen)]
    result = window_sum.reshape(-1, slot.cols).clone()
    result[:, leaving] = 0.0
    return result.reshape(window_sum.shape)


def unreadable_checkpoint(path: object, error: BaseException) -> str:
    """The message for a checkpoint file that torch could not load: the file, its size, the error, the fix."""
    message = str(error).strip() or type(error).__name__
    if "Weights only load failed" in message and "Unsupported global" in message:
        # readable, but holds objects that torch's safe loading refuses: torch's message says what to do
        # (other "weights only" failures, e.g. "Unsupported operand", are bytes that are not a pickle at all)
        return f"cannot resume from {path}: torch refused to load it safely. {message}"
    try:
        size = f"{os.path.getsize(path)} bytes"
    except OSError:
        size = "size unknown"
    first_line = message.splitlines()[0]
    return (
        f"cannot resume from {path} ({size}): it could not be read ({type(error).__name__}: {first_line}). The file "
        "is truncated or corrupt (a save that was interrupted, a full disk, an incomplete copy) or is not a PyTorch "
        "checkpoint. Resume from another checkpoint (ModelCheckpoint keeps several with save_top_k and save_last), "
        "or start without ckpt_path."
    )


def state_dict_mismatch(saved: Mapping[str, object], expected: Mapping[str, object], strict: bool) -> str | None:
    """How a checkpoint's model ``state_dict`` differs from the module's (None: it fits): names when ``strict``,
    shapes always (torch's ``load_state_dict`` would copy the matching tensors before it raised on the rest)."""
    parts = []
    if strict:
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing:
            parts.append(f"the model has {_listed(missing)} that the checkpoint lacks")
        if unexpected:
            parts.append(f"the checkpoint has {_listed(unexpected)} that the model lacks")
    shapes = [
        f"{name}: checkpoint {tuple(saved[name].shape)}, model {tuple(value.shape)}"
        for name, value in expected.items()
        if name in saved
        and isinstance(saved[name], torch.Tensor)
        and isinstance(value, torch.Tensor)
        and tuple(saved[name].shape) != tuple(value.shape)
    ]
    if shapes:
        parts.append("shapes differ: " + _listed(shapes))
    if not parts:
        return None
    return (
        "its weights belong to a different model: "
        + "; ".join(parts)
        + ". Resume it with the model it was saved from (same architecture and sizes)."
    )


def _moments_by_name(engine: ZenFlowEngine, torch_state: Mapping) -> dict[str, dict[str, torch.Tensor]]:
    """Map a torch optimizer state dict (indexed by position in the param groups) to parameter names."""
    names = {id(slot.param): slot.name for group in engine.layout for slot in group.matrices}
    names.update({id(entry.param): entry.name for group in engine.layout for entry in group.device_only})
    groups = torch_state.get("param_groups", [])
    if len(groups) != len(engine.optimizer.param_groups):
        raise ValueError(
            f"the optimizer state has {len(groups)} param groups but the optimizer has "
            f"{len(engine.optimizer.param_groups)}; configure_optimizers must build the same groups to resume."
        )
    by_name = {}
    per_param_state = torch_state.get("state", {})
    for saved_group, group in zip(groups, engine.optimizer.param_groups):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError(
                f"a saved param group has {len(saved_group['params'])} parameters but the optimizer's has "
                f"{len(group['params'])}; configure_optimizers must build the same groups to resume."
            )
        for index, param in zip(saved_group["params"], group["params"]):
            entry = per_param_state.get(index)
            if entry is None or id(param) not in names:
                continue
            for key in (*MOMENTS, "step"):
                if key not in entry:
                    raise ValueError(f"the optimizer state of {names[id(param)]} has no {key!r}; is it Adam/AdamW?")
            for key in MOMENTS:
                if tuple(entry[key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"the optimizer state of {names[id(param)]} has {key} of shape {tuple(entry[key].shape)}, "
                        f"the parameter {tuple(param.shape)}; the checkpoint belongs to a different model."
                    )
            by_name[names[id(param)]] = {
                "exp_avg": entry["exp_avg"].float(),
                "exp_avg_sq": entry["exp_avg_sq"].float(),
                "step": int(float(entry["step"])),
            }
    return by_name


def torch_state_dict(engine: ZenFlowEngine) -> dict:
    engine.wait_idle()
    merged = _merged_once(engine, include_moments=True)
    by_id = {id(param): name for name, param in _param_names(engine).items()}
    # torch's own state_dict for the param groups (an optimizer built on the engine overrides state_dict with this)
    layout_state = torch.optim.Optimizer.state_dict(engine.optimizer)
    state = {}
    position = 0
    for group in engine.optimizer.param_groups:
        for param in group["params"]:
            name = by_id.get(id(param))
            if name is not None and name in merged:  # data parallel: rank 0 only
                entry = merged[name]
                state[position] = {
                    "step": torch.tensor(float(max(entry["device_step"], entry["host_step"])), dtype=torch.float32),
                    "exp_avg": entry["exp_avg"],
                    "exp_avg_sq": entry["exp_avg_sq"],
                }
            position += 1
    return {"state": state, "param_groups": layout_state["param_groups"]}


def load_torch_state_dict(engine: ZenFlowEngine, torch_state: Mapping) -> None:
    _check_fresh(engine, "load_torch_state_dict")
    engine.merge_cache = None
    moments = _moments_by_name(engine, torch_state)
    updater = engine.device_updater
    for group_index, group in enumerate(engine.layout):
        host = engine.host_buffers[group_index]
        for position, slot in enumerate(group.matrices):
            if slot.name not in moments:
                continue
            entry = moments[slot.name]
            slot.view2d(host.exp_avg).copy_(slot.own(entry["exp_avg"]))
            slot.view2d(host.exp_avg_sq).copy_(slot.own(entry["exp_avg_sq"]))
            host.step_shared[slot.index_in_group] = float(entry["step"])
            updater.selected[group_index][position].step = entry["step"]
        for state_entry, device_entry in zip(updater.device_only[group_index], group.device_only):
            if device_entry.name not in moments:
                continue
            entry = moments[device_entry.name]
            state_entry.exp_avg.copy_(entry["exp_avg"])
            state_entry.exp_avg_sq.copy_(entry["exp_avg_sq"])
            state_entry.step = entry["step"]
