"""One row of a plan: a way of training the model on the machine, its memory per rank and per machine, and its step
time from the cost model of docs/performance.md (section 2, "Step time and the stall-free conditions").

The engine's bytes are ``engine/budget.py``'s (exact: what ``engine.device_bytes()`` and ``engine.host_bytes()``
count); around them, estimates: the model's weights and gradients in the training dtype, plain AdamW's fp32 state,
the activations (``planner/activations.py``), FSDP2's gathered blocks, and on the host the system and the training
processes (:data:`HOST_RESERVE_BYTES`, :data:`PROCESS_BYTES`), the loading peak (a weight file per rank at a time, or
under FSDP2 the whole model on every device before it is sharded, as ``lightning_zenflow.llm`` loads it) and the
export's (FSDP2: the whole model gathered to rank 0's host, and a copy of it). Device memory counts weights,
gradients, optimizer state, buffers and activations together: an upper bound of the peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine.accumulate import AUTO_DEVICE_MARGIN
from lightning_zenflow.engine.budget import (
    device_parts,
    host_parts,
    may_go_to_host,
    resolve_format,
    selection_transient_bytes,
)
from lightning_zenflow.engine.landing import LANDING_CHUNK_BYTES
from lightning_zenflow.engine.layout import HostFormat
from lightning_zenflow.planner.machine import GB, Machine
from lightning_zenflow.planner.shapes import ModelShapes, engine_shapes, local_numel

HOST_RESERVE_BYTES = 4 * 2**30
"""Host memory for the system, per machine."""
PROCESS_BYTES = 3 * 2**30
"""Host memory per training process and its worker beyond the engine's state (Python, torch, CUDA's context)."""
DEFAULT_WEIGHT_FILE_BYTES = 5 * 10**9
"""The largest weight file when the model's files are not on this machine (Hugging Face's shards are 5 GB or less)."""
DEFAULT_INTERVAL = ZenFlowConfig().update_interval
"""The window a row takes at least when ``update_interval`` is not given."""
MAX_INTERVAL = 256
"""The longest window the planner tries when looking for one that hides the host step."""
PRECISIONS = {
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "32-true": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}
"""Lightning's ``precision``: (the weights' dtype, the activations' dtype)."""


@dataclass(frozen=True)
class Setting:
    """A way of training: plain AdamW (fp32 state, no offload) or ZenFlow with some knobs, on one device, data
    parallel (``"ddp"``) or FSDP2 (``"fsdp2"``)."""

    name: str
    kind: str
    layout: str
    knobs: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Workload:
    """What is trained: precision, the batch each rank runs, activation checkpointing, the optimizer's decay."""

    precision: str = "bf16-true"
    batch_size: int = 8
    block_size: int = 1024
    activation_checkpointing: bool = False
    weight_decay: float = 0.0
    l2_decay: bool = False
    """Adam with an L2 term (``torch.optim.Adam(weight_decay=...)``) instead of AdamW's decoupled decay."""
    export: bool = True
    """The fine-tune exports a Hugging Face folder at the end (configs/llm.yaml does)."""
    checkpoints: bool = False
    """The fit saves checkpoints: each takes the engine's state merged in fp32 (master and two moments, 12 B per
    parameter) in rank 0's host memory on top of the engine's own (``engine/state.py``)."""
    fwd_bwd_s: float | None = None
    """Forward and backward of one step, measured elsewhere; None: estimated from the FLOPs."""

    @property
    def weight_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision][0]

    @property
    def weight_bytes(self) -> int:
        return self.weight_dtype.itemsize


@dataclass
class Row:
    """One setting evaluated: bytes per rank (the largest rank) and per machine (the first), fit, time."""

    setting: Setting
    device: dict[str, int]
    host: dict[str, int]
    device_loading: int
    """The device's peak while the weights load (FSDP2: the whole model on every device before sharding)."""
    device_selection: int
    """The device's peak at a selection (after the backward: weights, gradients, the engine's bytes and its
    transient)."""
    host_loading: int
    host_export: int
    device_capacity: int
    host_capacity: int
    host_checkpoint: int = 0
    """Host bytes a checkpoint adds on the first machine for a moment (the merged fp32 state)."""
    engine_device: int = 0
    """The engine's device bytes (``engine.device_bytes()``) of the largest rank."""
    engine_host: int = 0
    """The engine's host bytes (``engine.host_bytes()``), summed over the first machine's ranks."""
    config: ZenFlowConfig | None = None
    accumulate_on: str | None = None
    host_format: HostFormat | None = None
    interim: bool = False
    interval: int | None = None
    interval_needed: int | None = None
    """The shortest window that hides the host step (D1 or H1); None: none up to :data:`MAX_INTERVAL`."""
    step_s: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    setting_devices: int = 1
    """Devices per machine (on the CPU stand-in they share the host's memory)."""

    @property
    def name(self) -> str:
        return self.setting.name

    @property
    def device_peak(self) -> int:
        return max(sum(self.device.values()), self.device_loading, self.device_selection)

    @property
    def host_peak(self) -> int:
        steady = self.host["engine"] + self.host["staging"] + self.host_checkpoint
        return self.host["reserve"] + max(steady, self.host_loading, self.host_export)

    @property
    def device_margin(self) -> int:
        if self.device_capacity == 0:  # the CPU stand-in: device and host share the RAM
            return self.host_margin
        return self.device_capacity - self.device_peak

    @property
    def host_margin(self) -> int:
        shared = self.device_peak * self.setting_devices if self.device_capacity == 0 else 0
        return self.host_capacity - self.host_peak - shared

    @property
    def fits(self) -> bool:
        return self.device_margin >= 0 and self.host_margin >= 0

    @property
    def limit(self) -> str:
        """What runs out first (or would): ``"device"`` or ``"host"``."""
        return "device" if self.device_margin <= self.host_margin else "host"


def evaluate(shapes: ModelShapes, setting: Setting, machine: Machine, work: Workload, activations: int) -> Row:
    """The row of ``setting``: memory and (for every row) the step time."""
    world, local = machine.ranks, machine.devices
    b = work.weight_bytes
    cpu = machine.device_type == "cpu"
    numel = [local_numel(shapes, setting.layout, world, r) for r in range(local)]
    trainable = [local_numel(shapes, setting.layout, world, r, trainable_only=True) for r in range(local)]
    device = {"weights": b * max(numel), "gradients": b * max(trainable), "optimizer": 0, "buffers": 0}
    host = {"engine": 0, "staging": 0, "reserve": HOST_RESERVE_BYTES + PROCESS_BYTES * local}
    row = Row(
        setting,
        device,
        host,
        device_loading=0,
        device_selection=0,
        host_loading=0,
        host_export=0,
        device_capacity=0 if cpu else machine.device_memory,
        host_capacity=machine.host_memory,
        setting_devices=local,
    )
    if setting.kind == "adamw":
        # fp32 weights, gradients and moments: bf16-true runs it as bf16-mixed
        device.update(weights=4 * max(numel), gradients=4 * max(trainable), optimizer=8 * max(trainable))
    else:
        _engine_bytes(row, shapes, setting, machine, work)
    device["activations"] = activations + _gathered(shapes, setting, work)
    whole_weights = b * shapes.parameters
    weight_file = min(shapes.largest_file_bytes or DEFAULT_WEIGHT_FILE_BYTES, whole_weights)
    loads_on_host = cpu  # lightning_zenflow.llm reads the weights into host memory without CUDA
    row.host_loading = local * (whole_weights if loads_on_host else weight_file)
    if setting.layout == "fsdp2" and not cpu:
        row.device_loading = whole_weights  # the whole model on every device, then sharded
    if setting.kind == "zenflow" and work.checkpoints:
        row.host_checkpoint = 12 * shapes.parameters  # gathered on rank 0 (checkpoint_format="full")
    if setting.layout == "fsdp2" and work.export:
        row.host_export = 2 * whole_weights  # gathered to rank 0's host, and a copy of the model given them
    _step_time(row, shapes, machine, work)
    return row


def _engine_bytes(row: Row, shapes: ModelShapes, setting: Setting, machine: Machine, work: Workload) -> None:
    """The engine's bytes from ``engine/budget.py`` for the largest rank (device) and the first machine (host)."""
    knobs = dict(setting.knobs)
    mode = knobs.get("accumulate_on", "auto")
    config = ZenFlowConfig(**knobs)
    decay = (work.weight_decay, not work.l2_decay)
    world, local, b = machine.ranks, machine.devices, work.weight_bytes
    device_type = "cuda" if machine.device_type == "cuda" else "cpu"
    per_rank = [engine_shapes(shapes, b, setting.layout, world, r) for r in range(local)]
    if mode == "auto":
        mode = _auto_mode(row, config, per_rank[0][0], work, world > 1 and setting.layout == "ddp")
    host_format, interim = resolve_format(config, work.weight_dtype, mode, *decay)
    devices = [device_parts(m, v, config, host_format, device_type, interim) for m, v in per_rank]
    hosts = [host_parts(m, config, host_format) for m, _ in per_rank]
    largest = max(devices, key=lambda parts: sum(parts.values()))
    row.device["optimizer"] = largest["selected"] + largest["vectors"]
    row.device["buffers"] = sum(largest.values()) - row.device["optimizer"]
    row.host["engine"] = sum(h["state"] + h["window"] + h["small"] for h in hosts)
    row.host["staging"] = sum(h["staging"] for h in hosts)
    row.engine_device = sum(largest.values())
    sharded = world > 1 and setting.layout == "ddp"
    transient = max(selection_transient_bytes(m, config, sharded) for m, _ in per_rank)
    row.device_selection = row.device["weights"] + row.device["gradients"] + row.engine_device + transient
    row.engine_host = sum(sum(h.values()) for h in hosts)
    row.config, row.accumulate_on, row.host_format, row.interim = config, mode, host_format, interim


def _auto_mode(row: Row, config: ZenFlowConfig, matrices: list, work: Workload, sharded: bool) -> str:
    """``accumulate_on="auto"`` as the engine decides it after the first backward (``choose_accumulation``): the
    device when its accumulators, the landing's buffer and the selected columns' state (with a migration's peak) take
    at most 1/1.25 of what is free beside the weights and gradients."""
    if row.device_capacity == 0:
        return "device"
    host_format, _ = resolve_format(config, work.weight_dtype, "device")
    going = [m for m in matrices if may_go_to_host(config, m)]
    need = sum(m.host_numel * host_format.window.itemsize for m in going)
    need += min(LANDING_CHUNK_BYTES, max((4 * m.host_numel for m in going), default=0))
    need += sum(16 * m.rows * num_selected_columns(m.cols, config.topk_ratio) + 8 * m.cols for m in matrices)
    need += selection_transient_bytes(matrices, config, sharded)  # the largest chunk of a migration
    free = row.device_capacity - row.device["weights"] - row.device["gradients"]
    return "device" if need * AUTO_DEVICE_MARGIN <= free else "host"


def _gathered(shapes: ModelShapes, setting: Setting, work: Workload) -> int:
    """FSDP2's unsharded parameters during forward and backward: the root's (embeddings, head, final norm), two
    blocks (the one running and the one prefetched) and one block's unsharded gradients."""
    if setting.layout != "fsdp2" or not shapes.blocks:
        return 0
    sizes = {p.name: p.numel for p in shapes.params}
    in_blocks = {name for block in shapes.blocks for name in block}
    root = sum(n for name, n in sizes.items() if name not in in_blocks)
    block = max(sum(sizes[name] for name in names) for names in shapes.blocks)
    return work.weight_bytes * (root + 3 * block)


# ------------------------------------------------------------------------------------------------------- time
def fwd_bwd_seconds(shapes: ModelShapes, machine: Machine, work: Workload) -> float:
    """Forward and backward of one rank's batch: 6 FLOPs per parameter and token (8 with activation checkpointing)
    plus causal attention's 6 x layers x sequence x width per token, at the machine's rate; or as measured."""
    if work.fwd_bwd_s is not None:
        return work.fwd_bwd_s
    tokens = work.batch_size * work.block_size
    layers = getattr(shapes.config, "num_hidden_layers", 0) or 0
    width = getattr(shapes.config, "hidden_size", 0) or 0
    flops = 6 * shapes.parameters * tokens + 6 * layers * work.block_size * width * tokens
    if work.activation_checkpointing:
        flops *= 4 / 3
    return flops / (machine.device_tflops * 1e12)


def _step_time(row: Row, shapes: ModelShapes, machine: Machine, work: Workload) -> None:
    setting, b = row.setting, work.weight_bytes
    cpu = machine.device_type == "cpu"
    t_fb = fwd_bwd_seconds(shapes, machine, work)
    device_rate = machine.device_gbps * GB
    if setting.kind == "adamw":
        t_opt = 28 * shapes.parameters / (machine.ranks if setting.layout == "fsdp2" else 1) / device_rate
        row.times = {"fwd_bwd": t_fb, "device": t_opt}
        row.step_s = t_fb + t_opt
        return
    config, host_format = row.config, row.host_format
    assert config is not None
    assert host_format is not None
    matrices, vectors = engine_shapes(shapes, b, setting.layout, machine.ranks, 0)
    rho = float(config.topk_ratio)
    local = sum(m.rows * m.cols for m in matrices)
    selected = sum(m.rows * num_selected_columns(m.cols, rho) for m in matrices)
    going = [m for m in matrices if may_go_to_host(config, m)]
    host_elements = sum(m.host_numel for m in going)
    unselected = sum(m.host_rows * (m.cols - num_selected_columns(m.cols, rho)) for m in going)
    window = host_format.window.itemsize
    t_sel = (38 * selected + 28 * sum(v.numel for v in vectors)) / device_rate
    device_mode = row.accumulate_on == "device"
    accumulate = (2 * window + b) * host_elements if device_mode else 2 * b * unselected
    down = window * host_elements if device_mode else b * unselected
    up = (b if host_format.master else window) * host_elements
    t_worker = host_elements / machine.host_step_rate(host_format, b)
    if not device_mode:  # the worker first unpacks packed accumulators: 8 B per element at copy speed
        packed = sum(m.host_numel for m in going if num_selected_columns(m.cols, rho) > 0)
        t_worker += 8 * packed / (machine.copy_gbps * GB / machine.devices)
    t_down, t_up = down / (machine.d2h_gbps * GB), up / (machine.h2d_gbps * GB)
    shared = (machine.ranks - 1) / machine.ranks * b * local if setting.layout == "ddp" else 0.0
    t_share = shared / (machine.network_gbps * GB)
    t_add = 0.0 if device_mode else unselected / machine.host_add_rate(b)

    measured = machine.device_step_seconds(config.host_state, b, local) if device_mode else None

    def device_seconds(interval: int) -> float:
        """The engine's device work per step: measured (``--measure``), or its bytes at the device's bandwidth."""
        if measured is not None:
            return measured
        t_dev = t_sel + (3 * b * local + accumulate) / device_rate
        if row.interim:
            t_dev += (3 * b + b / interval) * local / device_rate
        return t_dev

    def step(interval: int) -> tuple[float, float]:
        """(average step time, the step before any wait) at windows of ``interval`` steps."""
        t_dev = device_seconds(interval)
        base = t_fb + t_dev
        landing = t_up + t_share
        if not config.overlap_step:
            per_window = interval * base + t_down + t_worker + landing
            if not device_mode:
                per_window += interval * (t_down + t_add if cpu else max(t_down, t_add)) - t_down
            return per_window / interval, base
        if device_mode:
            exposed = t_down if cpu else max(0.0, t_down - t_fb - t_sel)  # CPU: copies share the training cores
            t_step = base + (landing + exposed) / interval
            ready = t_down + t_worker  # from the window end to the update being ready (D1's left side)
        else:
            t_step = base + (t_down + t_add if cpu else max(t_down, t_add)) + landing / interval
            ready = t_worker  # H1
        window_s = max(interval * t_step, ready + t_step)
        return window_s / interval, t_step

    row.interval_needed = next(
        (s for s in range(1, MAX_INTERVAL + 1) if not config.overlap_step or _hidden(step, s)), None
    )
    interval = config.update_interval
    if interval == "auto" or "update_interval" not in setting.knobs:
        # not given: the shortest window that hides the host step, and no shorter than the default
        interval = max(DEFAULT_INTERVAL, row.interval_needed or DEFAULT_INTERVAL)
    row.interval = int(interval)
    row.step_s, _ = step(row.interval)
    row.times = {
        "fwd_bwd": t_fb,
        "device": device_seconds(row.interval),
        "copy_down": t_down,
        "host_add": t_add,
        "worker": t_worker,
        "upload": t_up,
        "share": t_share,
    }


def _hidden(step: object, interval: int) -> bool:
    """Whether the host step is hidden at ``interval``: the window takes no longer than its steps."""
    average, t_step = step(interval)  # type: ignore[operator]
    return math.isclose(average, t_step, rel_tol=1e-9) or average <= t_step
