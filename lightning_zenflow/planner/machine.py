"""The machine a plan is for: its memory (given, or this machine's), and the rates the step-time model needs:
documented defaults, or measured here in a few seconds (``--measure``).

Defaults (:data:`GPU_DEFAULTS`) describe an H100/H200-class GPU on a PCIe Gen4 x16 link in a two-socket server, the
assumptions of docs/performance.md section 3: pinned copies at 25 GB/s each way (Gen5 reaches about 50), 3 TB/s of
device memory bandwidth for simple kernels, 400 TFLOP/s for forward and backward (about 40 % of the bf16 dense
peak), 50 GB/s of host memory bandwidth for the host step of all the machine's workers, 20 GB/s for the host add of
``accumulate_on="host"`` on all the machine's training processes, 50 GB/s between ranks, 25 GB/s out of each machine
to the others (one 200 Gb/s NIC: HDR InfiniBand or 200 GbE; a machine with a NIC per GPU reaches 8 x 50). On a CPU
(the stand-in, no GPU) the training process's cores play the device: copies there are memory copies on those cores.

The host's rates are the machine's, shared by its ranks: each rank's training process and worker get
``1/devices`` of its cores (``engine/ranks.py``), so a rank's host step, host add and unpack run at ``1/devices`` of
the machine's rate. ``--measure`` times them on this process's whole core split, which is the machine's.

``--measure`` (:func:`measure`): the engine's host step (``engine/host.py``'s ``host_adam_update``, the kernel the
worker runs, compiled where a compiler is found: the first run builds it) on the cores the machine's workers get, in
every host format a plan uses; the memory copy bandwidth of the training process's cores and the host add of
``accumulate_on="host"``; on a GPU, pinned copies each way, a device-to-device copy and a bf16 matrix product (half
of its rate is taken as forward and backward's).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine.layout import HostFormat
from lightning_zenflow.planner.sizes import PlanError

GB = 1e9
FP32, BF16 = torch.float32, torch.bfloat16
GPU_DEFAULTS = {
    "d2h_gbps": 25.0,
    "h2d_gbps": 25.0,
    "device_gbps": 3000.0,
    "device_tflops": 400.0,
    "host_step_gbps": 50.0,
    "host_add_gbps": 20.0,
    "copy_gbps": 20.0,
    "network_gbps": 50.0,
    "internode_gbps": 25.0,
}
CPU_DEFAULTS = {**GPU_DEFAULTS, "d2h_gbps": 10.0, "h2d_gbps": 10.0, "device_gbps": 10.0, "device_tflops": 0.05}
"""The CPU stand-in without ``--measure``: one core's memory copies and arithmetic, roughly."""
TRAINING_OVER_MATMUL = 0.5
"""Forward and backward reach about half the rate of one large matrix product (attention, norms, elementwise)."""


def host_step_bytes(host_format: HostFormat, weight_bytes: int) -> int:
    """Bytes per element the host step moves: the moments read and written, the window's sum read and the step
    written over it; with a master, the master read and written and the new weights staged instead of the step."""
    moments = 4 * torch.empty((), dtype=host_format.moments).element_size()
    window = torch.empty((), dtype=host_format.window).element_size()
    if host_format.master:
        return moments + window + 8 + weight_bytes
    return moments + 2 * window


@dataclass
class Machine:
    """Memory and rates of the machine (per machine unless said; ``devices`` GPUs on each of ``nodes``)."""

    device_type: str
    """``"cuda"`` or ``"cpu"`` (the CPU stand-in: the device is the training process's cores)."""
    device_memory: int
    """Bytes per device."""
    host_memory: int
    """Bytes of RAM per machine."""
    devices: int = 1
    nodes: int = 1
    cores: int = 1
    d2h_gbps: float = GPU_DEFAULTS["d2h_gbps"]
    h2d_gbps: float = GPU_DEFAULTS["h2d_gbps"]
    device_gbps: float = GPU_DEFAULTS["device_gbps"]
    device_tflops: float = GPU_DEFAULTS["device_tflops"]
    host_step_gbps: float = GPU_DEFAULTS["host_step_gbps"]
    """Host memory bandwidth the host step reaches on all the machine's worker cores (a default's rates derive from
    it: :func:`host_step_bytes`)."""
    host_add_gbps: float = GPU_DEFAULTS["host_add_gbps"]
    copy_gbps: float = GPU_DEFAULTS["copy_gbps"]
    network_gbps: float = GPU_DEFAULTS["network_gbps"]
    internode_gbps: float = GPU_DEFAULTS["internode_gbps"]
    """Bytes per second out of one machine to the others (the gradients' all-reduce of data parallel and of HSDP)."""
    host_step_rates: dict[tuple[str, str, bool], float] = field(default_factory=dict)
    """Measured host step, elements per second on all the worker cores, by (moments, window, master)."""
    host_add_rates: dict[str, float] = field(default_factory=dict)
    """Measured host add, gradient elements per second, by gradient dtype."""
    device_steps: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    """Measured device work of the engine's steady step in device mode (selected columns' AdamW, interim moves,
    the window's accumulation), by (host state, weight bytes): (seconds per step, seconds per matrix element)."""
    measured: dict[str, float] = field(default_factory=dict)
    """What ``--measure`` timed (rates as above, the copies in GB/s)."""

    @property
    def ranks(self) -> int:
        return self.devices * self.nodes

    def host_step_rate(self, host_format: HostFormat, weight_bytes: int) -> float:
        """Elements per second of the host step for one rank (its share of the machine's workers)."""
        key = _format_key(host_format)
        rate = self.host_step_rates.get(key)
        if rate is None:
            rate = self.host_step_gbps * GB / host_step_bytes(host_format, weight_bytes)
        return rate / self.devices

    def device_step_seconds(self, host_state: str, weight_bytes: int, elements: int) -> float | None:
        """The engine's measured device work of a device-mode step over ``elements`` matrix elements (None: not
        measured)."""
        measured = self.device_steps.get((host_state, weight_bytes))
        return None if measured is None else measured[0] + measured[1] * elements

    def host_add_rate(self, weight_bytes: int) -> float:
        """Gradient elements per second one rank's training process adds into the host accumulator (host mode):
        its share of the machine's training cores."""
        key = "fp32" if weight_bytes == 4 else "bf16"
        rate = self.host_add_rates.get(key) or self.host_add_gbps * GB / (weight_bytes + 8)
        return rate / self.devices

    def describe(self) -> str:
        what = "measured" if self.measured else "defaults"
        kind = "GPU" if self.device_type == "cuda" else "CPU stand-in"
        devices = f"{self.devices} {kind}{'s' if self.devices > 1 else ''}"
        where = f"{self.nodes} machines of {devices}" if self.nodes > 1 else devices
        between = f", between machines {self.internode_gbps:.3g} GB/s" if self.nodes > 1 else ""
        return (
            f"{where} ({self.device_memory / GB:.1f} GB each), {self.host_memory / GB:.1f} GB RAM per machine; "
            f"rates ({what}): "
            f"link {self.d2h_gbps:.3g}/{self.h2d_gbps:.3g} GB/s down/up, device {self.device_gbps:.3g} GB/s and "
            f"{self.device_tflops:.3g} TFLOP/s, host step {self.host_step_gbps:.3g} GB/s, host add "
            f"{self.host_add_gbps:.3g} GB/s{between}"
        )


def _format_key(host_format: HostFormat) -> tuple[str, str, bool]:
    return (str(host_format.moments), str(host_format.window), host_format.master)


def this_machine(device_memory: int | None, host_memory: int | None, devices: int, nodes: int) -> Machine:
    """A :class:`Machine` with the given sizes, or this machine's GPU memory and RAM where one is not given; the
    rates are the defaults (GPU ones when a size for the device was given or CUDA is available)."""
    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda or device_memory is not None else "cpu"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device_memory is None:
        device_memory = torch.cuda.get_device_properties(0).total_memory if cuda else ram
    defaults = GPU_DEFAULTS if device_type == "cuda" else CPU_DEFAULTS
    return Machine(
        device_type=device_type,
        device_memory=device_memory,
        host_memory=host_memory if host_memory is not None else ram,
        devices=devices,
        nodes=nodes,
        cores=len(os.sched_getaffinity(0)),
        **defaults,
    )


def _median_seconds(fn: Callable[[], object], repeats: int = 3, prepare: Callable[[], None] | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one untimed call (``prepare()`` before each)."""
    times = []
    for index in range(repeats + 1):
        if prepare is not None:
            prepare()
        started = time.perf_counter()
        fn()
        if index:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(
    machine: Machine, formats: list[tuple[HostFormat, int]], elements: int = 1 << 24, device_work: bool = True
) -> Machine:
    """``machine`` with its rates measured on this machine (see the module docstring); ``formats``: the host formats
    (and weight bytes) whose host step to time. A few seconds; the first run also builds the compiled host step."""
    train_cores, worker_cores = ZenFlowConfig().core_split()
    measured: dict[str, float] = {}
    rates = {}
    with _threads(len(worker_cores)):
        for host_format, weight_bytes in formats:
            key = _format_key(host_format)
            if key not in rates:
                rates[key] = elements / _time_host_step(host_format, weight_bytes, elements)
                measured[f"host step {key[0]} {key[1]}{' master' if key[2] else ''}, elements/s"] = rates[key]
    step_gbps = [rates[_format_key(f)] * host_step_bytes(f, b) / GB for f, b in formats]
    with _threads(len(train_cores)):
        source = torch.randn(elements)
        target = torch.empty_like(source)
        copy_gbps = 2 * source.nbytes / _median_seconds(lambda: target.copy_(source)) / GB
        add_rates = {name: _host_add_rate(dtype, elements) for name, dtype in (("fp32", FP32), ("bf16", BF16))}
        flops = _matmul_flops(torch.device("cpu"), torch.float32) if machine.device_type == "cpu" else None
    measured.update({"copy GB/s": copy_gbps, **{f"host add {k}, elements/s": v for k, v in add_rates.items()}})
    changes: dict[str, object] = {
        "host_step_rates": rates,
        "host_add_rates": add_rates,
        "host_step_gbps": statistics.median(step_gbps) if step_gbps else machine.host_step_gbps,
        "host_add_gbps": add_rates["fp32"] * 12 / GB,
        "copy_gbps": copy_gbps,
    }
    if machine.device_type == "cpu":
        changes.update(d2h_gbps=copy_gbps, h2d_gbps=copy_gbps, device_gbps=copy_gbps)
        changes["device_tflops"] = TRAINING_OVER_MATMUL * flops / 1e12
        measured["matmul fp32 TFLOP/s"] = flops / 1e12
    elif torch.cuda.is_available():
        gpu = _measure_gpu()
        measured.update(gpu)
        changes.update(
            d2h_gbps=gpu["d2h GB/s"],
            h2d_gbps=gpu["h2d GB/s"],
            device_gbps=gpu["device copy GB/s"],
            device_tflops=TRAINING_OVER_MATMUL * gpu["matmul bf16 TFLOP/s"],
        )
    if device_work:
        weight_bytes = sorted({b for _, b in formats})
        steps = {
            (state, b): _device_work(state, b, machine.device_type) for state in ("bf16", "fp32") for b in weight_bytes
        }
        changes["device_steps"] = steps
        for (state, b), (fixed, per_element) in steps.items():
            measured[f"device step {state} state, {b} B weights: s + s/element"] = fixed
            measured[f"device step {state} state, {b} B weights: s/element"] = per_element
    return dataclasses.replace(machine, measured=measured, **changes)


class _threads:
    """torch's intra-op threads set for a block (the worker's or the training process's share), restored after."""

    def __init__(self, count: int) -> None:
        self.count = max(1, count)

    def __enter__(self) -> None:
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.saved)


def _time_host_step(host_format: HostFormat, weight_bytes: int, elements: int) -> float:
    from lightning_zenflow.engine.device import HyperParams
    from lightning_zenflow.engine.host import GroupJob, MatrixExtent, StepKernels, WorkerGroup, host_adam_update
    from lightning_zenflow.engine.kernels import resolve_kernel_mode

    cols = 4096
    chunk = 1 << 22  # matrices of 4 M elements, like a model's layers
    dtype = torch.bfloat16 if weight_bytes == 2 else torch.float32
    extents = tuple(
        MatrixExtent(offset, min(chunk, elements - offset), dtype, cols, 0, salt=index)
        for index, offset in enumerate(range(0, elements, chunk))
    )
    group = WorkerGroup(
        torch.zeros(elements, dtype=host_format.moments),
        torch.zeros(elements, dtype=host_format.moments),
        torch.zeros(len(extents)),
        torch.zeros(elements) if host_format.master else None,
        (torch.zeros(elements, dtype=host_format.window),),
    )
    hparams = HyperParams(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    job = GroupJob(hparams=hparams, active=tuple(range(len(extents))), mean_divisors=(4.0,) * len(extents))
    kernels = StepKernels(resolve_kernel_mode("auto", torch.device("cpu"))[0])
    gradient = (torch.randn(elements) * 1e-3).to(host_format.window)
    return _median_seconds(
        lambda: host_adam_update(group, extents, 0, job, kernels=kernels),
        prepare=lambda: group.windows[0].copy_(gradient),
    )


def _host_add_rate(dtype: torch.dtype, elements: int) -> float:
    """Gradient elements per second of host mode's add of staged chunks into the fp32 accumulator."""
    from lightning_zenflow.engine.accumulate import STAGING_SLOT_BYTES, HostAccumulation
    from lightning_zenflow.engine.lanes import Lanes

    accumulation = HostAccumulation(Lanes(torch.device("cpu")), [], STAGING_SLOT_BYTES)
    cols = 4096
    rows = elements // cols
    accumulator = torch.zeros(rows, cols)
    source = torch.randn(rows, cols).to(dtype)
    per_chunk = max(1, STAGING_SLOT_BYTES // (cols * source.element_size()))

    def add() -> None:
        for start in range(0, rows, per_chunk):
            stop = min(rows, start + per_chunk)
            accumulation.add_staged(0, source[start:stop], accumulator[start:stop], False)

    return rows * cols / _median_seconds(add)


def _matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024) -> float:
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)

    def product() -> None:
        torch.mm(left, right)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host wait: the product has finished

    return 2 * size**3 / _median_seconds(product)


def _measure_gpu() -> dict[str, float]:
    device = torch.device("cuda")
    size = 1 << 28
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    other = torch.empty_like(on_device)

    def timed(copy: Callable[[], object]) -> float:
        def run() -> None:
            copy()
            torch.cuda.synchronize(device)  # host wait: the copy has finished

        return _median_seconds(run, repeats=5)

    return {
        "d2h GB/s": size / timed(lambda: pinned.copy_(on_device, non_blocking=True)) / GB,
        "h2d GB/s": size / timed(lambda: on_device.copy_(pinned, non_blocking=True)) / GB,
        "device copy GB/s": 2 * size / timed(lambda: other.copy_(on_device)) / GB,
        "matmul bf16 TFLOP/s": _matmul_flops(device, torch.bfloat16, 8192) / 1e12,
    }


DEVICE_WORK_SIZES = (1 << 23, 1 << 24)
"""Matrix elements of the two engines :func:`_device_work` times (a line through two points: a fixed cost per step,
and a cost per element)."""


def _device_work(host_state: str, weight_bytes: int, device_type: str) -> tuple[float, float]:
    """The engine's device work per steady device-mode step with ZenFlow's defaults otherwise (interim moves where
    they apply), timed on a real engine (its public API only) over one matrix of each of
    :data:`DEVICE_WORK_SIZES`: (seconds per step, seconds per element). CPU: the wall time of ``step()`` and
    ``wait_for_update()`` (the stand-in's device work runs there); CUDA: ``StepStats.device_update_s``."""
    from lightning_zenflow.engine import ZenFlowEngine, spares

    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    dtype = BF16 if weight_bytes == 2 else FP32
    seconds = []
    spares.keep_spare_workers(True)  # the second engine adopts the first one's worker
    try:
        for elements in DEVICE_WORK_SIZES:
            cols = 4096
            weight = torch.nn.Parameter(torch.randn(elements // cols, cols, device=device).to(dtype))
            weight.grad = (torch.randn_like(weight, dtype=FP32) * 1e-3).to(dtype)
            config = ZenFlowConfig(full_warm_up_rounds=0, accumulate_on="device", host_state=host_state)
            times = []
            with ZenFlowEngine(torch.optim.AdamW([weight], lr=1e-4), config) as engine:
                for step in range(1, 3 * config.update_interval):
                    started = time.perf_counter()
                    stats = engine.step()
                    engine.wait_for_update()
                    wall = time.perf_counter() - started
                    if step > 1 and not stats.window_end and step % config.update_interval != 1:
                        times.append(stats.device_update_s if device.type == "cuda" else wall)
            seconds.append(statistics.median(t for t in times if t is not None))
            del weight
    finally:
        spares.keep_spare_workers(False)
    small, large = DEVICE_WORK_SIZES
    per_element = max(0.0, (seconds[1] - seconds[0]) / (large - small))
    return max(0.0, seconds[0] - per_element * small), per_element


def check_machine(machine: Machine) -> None:
    """Refuse counts that make no machine."""
    for name in ("devices", "nodes"):
        value = getattr(machine, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"--{name} {value!r} must be a whole number >= 1.")
