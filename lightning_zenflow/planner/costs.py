"""One row of a plan: a way of training the model on the machine, its memory per rank and per machine, and its step
time from the cost model of docs/performance.md (section 2, "Step time and the stall-free conditions").

The engine's bytes are ``engine/budget.py``'s (exact: what ``engine.device_bytes()`` and ``engine.host_bytes()``
count); around them, estimates: the model's weights and gradients in the training dtype, plain AdamW's fp32 state,
the activations (``planner/activations.py``), FSDP2's gathered blocks, and on the host the system and the training
processes (:data:`HOST_RESERVE_BYTES`, :data:`PROCESS_BYTES`), and the peaks of loading, checkpoints and the
export. Device memory counts weights, gradients, optimizer state, buffers and activations together: an upper bound of
the peak.

Loading, checkpoints and export as ``lightning_zenflow.llm`` and the strategies do them:

- one device or data parallel: the weights are read a file at a time onto the device (the host holds one file per
  rank); a checkpoint merges the engine's state in fp32 on rank 0's host (``checkpoint_format="full"``); the export
  writes the live model from rank 0;
- FSDP2 (``zenflow_fsdp``): the model is built on the meta device, sharded, and each rank reads only its own rows,
  so a rank holds its share of the weights plus about the largest tensor, on the device and on the host
  (:data:`LOADING_TENSORS`); checkpoints are sharded (each rank writes its own share of the fp32 state, nothing is
  gathered); the export gathers one tensor at a time to rank 0's host and writes it (:data:`EXPORT_TENSORS`).

Under FSDP2 on several machines the layout is HSDP: FSDP2 shards over the devices of a machine and replicates across
machines, the engine's host state is sharded within the machine (each machine holds the whole model's), and the
gradients are all-reduced across machines once per step (``Machine.internode_gbps``).

Two peers are rows of their own where there are several ranks (:func:`peer_row`): FSDP2 with ``CPUOffloadPolicy``
and DeepSpeed ZeRO-3 with optimizer and parameter offload, with their documented bytes per parameter and their
step under the same machine rates (the host step of every parameter at every step, the weights and gradients over
the link at every step).
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
from lightning_zenflow.planner.shapes import ModelShapes, attention_width, engine_shapes, local_numel

HOST_RESERVE_BYTES = 4 * 2**30
"""Host memory for the system, per machine."""
PROCESS_BYTES = 3 * 2**30
"""Host memory per training process and its worker beyond the engine's state (Python, torch, CUDA's context)."""
DEFAULT_WEIGHT_FILE_BYTES = 5 * 10**9
"""The largest weight file when the model's files are not on this machine (Hugging Face's shards are 5 GB or less)."""
LOADING_TENSORS = 1
"""FSDP2's loading holds, beside the rank's share, at most this many of the model's largest tensor, on the device and
on the host of each rank: an upper bound. ``llm/sharded_load.py`` reads each tensor's rows straight into the shard, or
through a 4 MiB host buffer (``STAGING_BYTES``) where the dtype or the device need a conversion, so it holds less."""
EXPORT_TENSORS = 1
"""FSDP2's export holds on rank 0's host this many of the largest tensor: ``llm/sharded_export.py`` all-gathers one
tensor at a time (``DTensor.full_tensor``) and rank 0 appends its bytes to the current safetensors file."""
CHECKPOINT_BYTES = 12
"""Bytes per parameter of a checkpoint's merged fp32 state (master and two moments): on rank 0's host for a full
checkpoint, each rank its share for a sharded one (FSDP2's default)."""
FSDP_OFFLOAD_HOST_BYTES = 16
"""FSDP2 ``CPUOffloadPolicy``, host bytes per parameter: the sharded fp32 parameters (bf16 compute through
``MixedPrecisionPolicy``), their fp32 gradients and AdamW's two fp32 moments (PyTorch's FSDP2 docs: "offloads
parameters, gradients, and optimizer states to CPU"; background/memory.md)."""
FSDP_OFFLOAD_STEP_BYTES = 28
"""Host memory traffic per parameter of its CPU AdamW step, every step: fp32 parameter, m and v read and written,
the fp32 gradient read (torch's fused AdamW)."""
ZERO3_HOST_BYTES = 18
"""DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on the CPU, host bytes per parameter: fp32
master, m and v (12), fp32 gradients (4) and the fp16/bf16 parameters (2): the ZeRO-Offload paper (arXiv 2101.06840,
section 3) and DeepSpeed's own estimator (``estimate_zero3_model_states_mem_needs_all_live`` in
``deepspeed/runtime/zero/stage3.py``: ``total_params * 18 / num_nodes`` per machine, times a 1.5 safety factor this
table leaves out, and ``4 * largest_layer_params`` bytes on each GPU)."""
ZERO3_STEP_BYTES = 30
"""Host memory traffic per parameter of DeepSpeed's CPU Adam, every step: fp32 master, m and v read and written, the
fp32 gradient read, the 16-bit parameter written."""
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
    """A way of training: plain AdamW (fp32 state, no offload), ZenFlow with some knobs, or a peer's offload
    (``"fsdp_offload"``: FSDP2's ``CPUOffloadPolicy``; ``"zero3_offload"``: DeepSpeed ZeRO-3 offloading optimizer and
    parameters), on one device, data parallel (``"ddp"``) or FSDP2 (``"fsdp2"``; HSDP on several machines)."""

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
    """The device's peak while the weights load (FSDP2: the rank's share and about the largest tensor)."""
    device_selection: int
    """The device's peak at a selection (after the backward: weights, gradients, the engine's bytes and its
    transient)."""
    host_loading: int
    host_export: int
    device_capacity: int
    host_capacity: int
    host_checkpoint: int = 0
    """Host bytes a checkpoint adds on the first machine for a moment (the merged fp32 state: all of it on rank 0,
    or under FSDP2 each of the machine's ranks its share)."""
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


def shard_world(machine: Machine, layout: str) -> int:
    """The ranks a layout splits a parameter (FSDP2) or the host state (data parallel) across: FSDP2 shards within
    a machine (HSDP on several machines: replicated across them), data parallel splits the host state across all."""
    return machine.devices if layout == "fsdp2" else machine.ranks


def largest_tensor_bytes(shapes: ModelShapes, weight_bytes: int) -> int:
    """The largest parameter in the weights' dtype (an embedding or the output layer of a language model)."""
    return weight_bytes * max(p.numel for p in shapes.params)


def evaluate(shapes: ModelShapes, setting: Setting, machine: Machine, work: Workload, activations: int) -> Row:
    """The row of ``setting``: memory and (for every row) the step time."""
    if setting.kind in PEERS:
        return peer_row(shapes, setting, machine, work, activations)
    world, local = shard_world(machine, setting.layout), machine.devices
    b = work.weight_bytes
    cpu = machine.device_type == "cpu"
    fsdp = setting.layout == "fsdp2"
    numel = [local_numel(shapes, setting.layout, world, r) for r in range(local)]
    trainable = [local_numel(shapes, setting.layout, world, r, trainable_only=True) for r in range(local)]
    device = {"weights": b * max(numel), "gradients": b * max(trainable), "optimizer": 0, "buffers": 0}
    host = {"engine": 0, "staging": 0, "reserve": HOST_RESERVE_BYTES + PROCESS_BYTES * local}
    row = _empty_row(setting, device, host, machine)
    if setting.kind == "adamw":
        # fp32 weights, gradients and moments: bf16-true runs it as bf16-mixed
        device.update(weights=4 * max(numel), gradients=4 * max(trainable), optimizer=8 * max(trainable))
    else:
        _engine_bytes(row, shapes, setting, machine, work)
    device["activations"] = activations + _gathered(shapes, setting, work)
    whole_weights = b * shapes.parameters
    loaded = 4 if setting.kind == "adamw" else b  # plain AdamW runs bf16-mixed: fp32 weights
    largest = largest_tensor_bytes(shapes, loaded)
    if fsdp:
        # built on meta, sharded, each rank reads its own rows: its share and a tensor's slice at a time
        row.device_loading = 0 if cpu else device["weights"] + LOADING_TENSORS * largest
        on_host = device["weights"] if cpu else 0  # the CPU stand-in's "device" is the host
        row.host_loading = local * (on_host + LOADING_TENSORS * largest)
    else:
        weight_file = min(shapes.largest_file_bytes or DEFAULT_WEIGHT_FILE_BYTES, whole_weights)
        # lightning_zenflow.llm reads the weights into host memory without CUDA, file by file onto a GPU
        row.host_loading = local * (whole_weights if cpu else weight_file)
    if setting.kind == "zenflow" and work.checkpoints:
        share = sum(trainable) if fsdp else shapes.parameters  # sharded: each rank its rows; full: all on rank 0
        row.host_checkpoint = CHECKPOINT_BYTES * share
    if fsdp and work.export:
        row.host_export = EXPORT_TENSORS * largest  # a tensor at a time, gathered to rank 0's host
    _step_time(row, shapes, machine, work)
    return row


def _empty_row(setting: Setting, device: dict, host: dict, machine: Machine) -> Row:
    cpu = machine.device_type == "cpu"
    return Row(
        setting,
        device,
        host,
        device_loading=0,
        device_selection=0,
        host_loading=0,
        host_export=0,
        device_capacity=0 if cpu else machine.device_memory,
        host_capacity=machine.host_memory,
        setting_devices=machine.devices,
    )


PEERS = ("fsdp_offload", "zero3_offload")
"""The peers' kinds (:func:`peer_row`)."""


def peer_row(shapes: ModelShapes, setting: Setting, machine: Machine, work: Workload, activations: int) -> Row:
    """A peer's offload on this machine, from its documented bytes per parameter (:data:`FSDP_OFFLOAD_HOST_BYTES`,
    :data:`ZERO3_HOST_BYTES`) and the same rates as ZenFlow's rows.

    - FSDP2 ``CPUOffloadPolicy`` (HSDP on several machines, as ZenFlow's FSDP2 rows): the device holds no sharded
      state, only what FSDP2 gathers for forward and backward (:func:`_gathered`) and the activations; every
      parameter's fp32 AdamW runs on the host at every step, after the backward (FSDP2 keeps no state on the device
      to overlap it with); the fp32 shards go up for the forward's and the backward's all-gathers and the fp32
      gradients come down, overlapped with forward and backward.
    - DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` (device "cpu"): sharded over every rank of
      every machine; the device holds the largest layer's 16-bit parameters and gradients (DeepSpeed's estimator)
      and the activations; CPU Adam over the rank's partition at every step; 16-bit parameters up twice (forward and
      backward), 16-bit gradients down; across machines ZeRO-3 all-gathers the weights twice and reduce-scatters the
      gradients every step.
    """
    b = work.weight_bytes
    local, nodes = machine.devices, machine.nodes
    params = shapes.parameters
    largest = largest_tensor_bytes(shapes, b)
    device = {"weights": 0, "gradients": 0, "optimizer": 0, "buffers": 0}
    host = {"engine": 0, "staging": 0, "reserve": HOST_RESERVE_BYTES + PROCESS_BYTES * local}
    row = _empty_row(setting, device, host, machine)
    if setting.kind == "fsdp_offload":
        per_machine = params  # sharded within the machine, replicated across machines (HSDP)
        per_rank = math.ceil(params / local)
        host["engine"] = FSDP_OFFLOAD_HOST_BYTES * per_machine
        device["activations"] = activations + _gathered(shapes, Setting("", "", "fsdp2"), work)
        up, down, step_bytes = 2 * 4 * per_rank, 4 * per_rank, FSDP_OFFLOAD_STEP_BYTES
        internode = 2 * (nodes - 1) / nodes * 4 * per_machine  # HSDP's all-reduce of the fp32 gradient shards
    else:
        per_machine = math.ceil(params / nodes)  # sharded across every rank of every machine
        per_rank = math.ceil(params / machine.ranks)
        host["engine"] = ZERO3_HOST_BYTES * per_machine
        device["buffers"] = 2 * largest  # the largest layer's 16-bit parameters and gradients
        device["activations"] = activations
        up, down, step_bytes = 2 * b * per_rank, b * per_rank, ZERO3_STEP_BYTES
        internode = 3 * (nodes - 1) / nodes * b * params  # two all-gathers and a reduce-scatter, per machine
    row.device_loading = 0 if machine.device_type == "cpu" else largest  # both load by parts
    row.host_loading = local * largest
    t_fb = fwd_bwd_seconds(shapes, machine, work)
    t_link = max(up / (machine.h2d_gbps * GB), down / (machine.d2h_gbps * GB))
    t_net = internode / (machine.internode_gbps * GB)
    t_host = step_bytes * per_rank / (machine.host_step_gbps * GB / local)
    row.times = {"fwd_bwd": t_fb, "link": t_link, "internode": t_net, "worker": t_host}
    row.step_s = max(t_fb, t_link, t_net) + t_host  # the copies overlap the compute; the host step does not
    return row


def _engine_bytes(row: Row, shapes: ModelShapes, setting: Setting, machine: Machine, work: Workload) -> None:
    """The engine's bytes from ``engine/budget.py`` for the largest rank (device) and the first machine (host)."""
    knobs = dict(setting.knobs)
    mode = knobs.get("accumulate_on", "auto")
    config = ZenFlowConfig(**knobs)
    decay = (work.weight_decay, not work.l2_decay)
    world, local, b = shard_world(machine, setting.layout), machine.devices, work.weight_bytes
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
    """Forward and backward of one rank's batch: 6 FLOPs per active parameter (a mixture of experts: those a token
    runs through) and token (8 with activation checkpointing) plus causal attention's 6 x layers x sequence x width
    per token, at the machine's rate; or as measured."""
    if work.fwd_bwd_s is not None:
        return work.fwd_bwd_s
    tokens = work.batch_size * work.block_size
    layers = getattr(shapes.config, "num_hidden_layers", 0) or 0
    width = attention_width(shapes.config)
    flops = 6 * shapes.active_parameters * tokens + 6 * layers * work.block_size * width * tokens
    if work.activation_checkpointing:
        flops *= 4 / 3
    return flops / (machine.device_tflops * 1e12)


def _step_time(row: Row, shapes: ModelShapes, machine: Machine, work: Workload) -> None:
    setting, b = row.setting, work.weight_bytes
    cpu = machine.device_type == "cpu"
    world = shard_world(machine, setting.layout)
    t_compute = fwd_bwd_seconds(shapes, machine, work)
    t_net = internode_seconds(shapes, machine, 4 if setting.kind == "adamw" else b)
    t_fb = max(t_compute, t_net)  # the gradients' all-reduce across machines runs beside the backward
    device_rate = machine.device_gbps * GB
    if setting.kind == "adamw":
        t_opt = 28 * shapes.parameters / (world if setting.layout == "fsdp2" else 1) / device_rate
        row.times = {"fwd_bwd": t_compute, "device": t_opt, "internode": t_net}
        row.step_s = t_fb + t_opt
        return
    config, host_format = row.config, row.host_format
    assert config is not None
    assert host_format is not None
    matrices, vectors = engine_shapes(shapes, b, setting.layout, world, 0)
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
    t_add = 0.0 if device_mode else unselected / machine.host_add_rate(b)  # this rank's share of the machine

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
        "fwd_bwd": t_compute,
        "device": device_seconds(row.interval),
        "copy_down": t_down,
        "host_add": t_add,
        "worker": t_worker,
        "upload": t_up,
        "share": t_share,
        "internode": t_net,
    }


def internode_seconds(shapes: ModelShapes, machine: Machine, gradient_bytes: int) -> float:
    """Each step's all-reduce of the gradients across machines (data parallel, or HSDP's replicas of each shard):
    a ring all-reduce sends 2 (M - 1)/M of the model's gradients out of each machine; 0 on one machine."""
    nodes = machine.nodes
    if nodes == 1:
        return 0.0
    return 2 * (nodes - 1) / nodes * gradient_bytes * shapes.parameters / (machine.internode_gbps * GB)


def _hidden(step: object, interval: int) -> bool:
    """Whether the host step is hidden at ``interval``: the window takes no longer than its steps."""
    average, t_step = step(interval)  # type: ignore[operator]
    return math.isclose(average, t_step, rel_tol=1e-9) or average <= t_step
