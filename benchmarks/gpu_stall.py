"""Stall check at realistic sizes: does the training thread wait for ZenFlow, and what does each step move?

A model of M weight matrices (default eight [8192, 2048] bf16 ``nn.Parameter``s on the GPU, 134 M parameters, plus a
bias each). Forward and backward are replaced by ``torch.cuda._sleep`` on the compute stream for ``--compute-ms``
(calibrated in cycles per millisecond with CUDA events once), and the gradients by a fixed random bank (generated once,
fixed seed, column magnitudes that differ so the selection means something) multiplied by a per-step factor into fresh
tensors, as a backward allocates them. So the step time is the stand-in's plus whatever the optimizer adds.

One step, as a training loop does it::

    engine.wait_for_update()          # GPU-side: the "forward" waits for the device update
    compute stand-in                  # torch.cuda._sleep on the compute stream (time.sleep on the CPU)
    p.grad = bank * factor            # the "backward"
    engine.step()                     # or optimizer.step() for no-offload
    p.grad = None                     # zero_grad(set_to_none=True)
    event on the compute stream, synchronize on it   # like a loss.item() per step: the host waits for the
                                      # compute stream only; the engine's copies on its own streams go on

Configurations (the default order puts the ZenFlow rows first, so a run cut short still has them):

- ``zenflow-device``: ZenFlow defaults (``topk_ratio=0.1, update_interval=4``, overlap on), ``accumulate_on="device"``;
- ``zenflow-host``: the same with ``accumulate_on="host"``;
- ``no-offload``: ``torch.optim.AdamW(fused=True)`` on the device;
- ``compute-only``: the stand-in and the gradients, no optimizer (the floor; its memory delta is the gradients');
- ``sync-offload``: ``topk_ratio=0, update_interval=1, overlap_step=False, accumulate_on="host"`` (ZeRO-Offload-like).

``--configs`` picks and orders them; ``zenflow-auto`` (``accumulate_on`` and ``update_interval`` both ``"auto"``) is
available too. Per configuration: median step, p99/median, stall share (sum of ``StepStats.stall_s`` / sum of step
times), the largest single stall, d2h and h2d bytes per step (whole windows) and the bandwidth they need at the median
step, the peak ``torch.cuda.max_memory_allocated`` above the weights and the gradient bank, and the engine's
``device_bytes`` / ``host_bytes``. Output: JSON lines (``--out``), a header row (machine: GPU, driver, CPU cores,
``/dev/shm`` size, ``ulimit -l``; settings; calibration) then one row per configuration written as soon as it finishes
(a killed run keeps what it finished), a footer row at the end; and a table on stdout.

    python benchmarks/gpu_stall.py                          # one GPU, about 2 minutes
    python benchmarks/gpu_stall.py --device cpu --quick     # tiny CPU smoke run, < 20 s
    python benchmarks/gpu_stall.py --profile trace.json     # a Chrome trace of a few steps of zenflow (auto mode)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import pathlib
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import bench_train
import bench_utils
import torch

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "gpu_stall.jsonl"
CONFIG_NAMES = ("zenflow-device", "zenflow-host", "no-offload", "compute-only", "sync-offload", "zenflow-auto")
DEFAULT_CONFIGS = CONFIG_NAMES[:5]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CALIBRATION_CYCLES = 20_000_000
"""``torch.cuda._sleep`` cycles timed to find cycles per millisecond (about 10-20 ms on current GPUs)."""


# ------------------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        out_help="JSON-lines output (overwritten).",
        quick="tiny sizes and few steps (four [256, 128] fp32 matrices on the CPU).",
        seed="",
        device=("cuda", "cpu"),
    )
    parser.add_argument("--matrices", type=int, default=None, help="weight matrices M (default 8; quick 4).")
    parser.add_argument("--rows", type=int, default=None, help="rows of each matrix (default 8192; quick 256).")
    parser.add_argument("--cols", type=int, default=None, help="columns of each matrix (default 2048; quick 128).")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="model dtype (default bf16; quick fp32).")
    parser.add_argument(
        "--compute-ms", type=float, default=None, help="forward+backward stand-in per step (default 30; quick 5)."
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=None, help="steps before timing, extended to a window end (default 8)."
    )
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 32; quick 8).")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop measuring a configuration after this many seconds, at a window end (default 40; quick 5).",
    )
    parser.add_argument("--topk-ratio", type=float, default=0.1, help="topk_ratio of the ZenFlow rows.")
    parser.add_argument("--update-interval", type=int, default=4, help="update_interval of the ZenFlow rows.")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--configs", nargs="+", choices=CONFIG_NAMES, default=list(DEFAULT_CONFIGS), help="rows to run, in order."
    )
    parser.add_argument(
        "--profile",
        type=pathlib.Path,
        default=None,
        help="instead of the table: run zenflow (accumulate_on='auto') for the warm-up steps, then profile "
        "--profile-steps steps with torch.profiler and write a Chrome trace to this path.",
    )
    parser.add_argument("--profile-steps", type=int, default=8)
    args = bench_utils.apply_quick_defaults(
        parser.parse_args(argv),
        {
            "matrices": (8, 4),
            "rows": (8192, 256),
            "cols": (2048, 128),
            "dtype": ("bf16", "fp32"),
            "compute_ms": (30.0, 5.0),
            "warmup_steps": (8, 4),
            "steps": (32, 8),
            "budget_s": (40.0, 5.0),
        },
    )
    missing = bench_utils.cuda_missing(args.device, "; run with --device cpu --quick for the CPU smoke run.")
    if missing:
        parser.error(missing)
    for name in ("matrices", "rows", "cols", "steps", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1.")
    if args.warmup_steps < 0 or args.compute_ms < 0 or args.budget_s <= 0:
        parser.error("--warmup-steps and --compute-ms must be >= 0, --budget-s > 0.")
    return args


# ------------------------------------------------------------------------------------------------- the machine
def system_limits(device: torch.device) -> dict[str, Any]:
    """What decides whether the engine can allocate and pin its host memory, and what it runs on."""
    info: dict[str, Any] = {
        "cores_available": len(bench_utils.available_cores()),
        "cpu_count": os.cpu_count(),
        "dev_shm_bytes": None,
        "dev_shm_free_bytes": None,
        "ulimit_l": None,
        "nvidia_smi": None,
    }
    with contextlib.suppress(OSError):
        usage = shutil.disk_usage("/dev/shm")
        info["dev_shm_bytes"], info["dev_shm_free_bytes"] = usage.total, usage.free
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info["ulimit_l"] = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    if shutil.which("nvidia-smi"):
        query = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            result = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            info["nvidia_smi"] = {"query": query, "output": result.stdout.strip() or result.stderr.strip()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


# ----------------------------------------------------------------------------------------- compute stand-in
@dataclasses.dataclass
class ComputeStandIn:
    """Forward and backward: ``torch.cuda._sleep`` queued on the compute stream (CUDA), ``time.sleep`` (CPU)."""

    device: torch.device
    ms: float
    cycles: int = 0
    cycles_per_ms: float | None = None
    measured_ms: float | None = None

    def calibrate(self) -> ComputeStandIn:
        if self.device.type != "cuda" or self.ms == 0:
            return self
        torch.cuda._sleep(1000)  # load the kernel
        samples = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()  # calibration only: wait for the timed sleep
            samples.append(start.elapsed_time(end))
        self.cycles_per_ms = CALIBRATION_CYCLES / statistics.median(samples)
        self.cycles = int(self.ms * self.cycles_per_ms)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self()
        end.record()
        end.synchronize()  # calibration only: check the stand-in's duration once
        self.measured_ms = start.elapsed_time(end)
        return self

    def __call__(self) -> None:
        if self.device.type == "cuda":
            if self.cycles:
                torch.cuda._sleep(self.cycles)
        elif self.ms:
            time.sleep(self.ms / 1000.0)


# ---------------------------------------------------------------------------------------------- model and data
@dataclasses.dataclass
class Workload:
    """The shapes, the gradient bank and the per-step factors every configuration shares."""

    device: torch.device
    dtype: torch.dtype
    shapes: list[tuple[int, ...]]
    names: list[str]
    bank: list[torch.Tensor]
    factors: list[float]
    seed: int

    def build_params(self) -> list[torch.nn.Parameter]:
        """The same initial weights for every configuration (matrices ~N(0, 0.02), biases zero)."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        params = []
        for shape in self.shapes:
            if len(shape) == 2:
                value = torch.randn(shape, generator=generator, device=self.device).mul_(0.02).to(self.dtype)
            else:
                value = torch.zeros(shape, device=self.device, dtype=self.dtype)
            params.append(torch.nn.Parameter(value))
        return params

    def set_gradients(self, params: list[torch.nn.Parameter], step: int) -> None:
        """The stand-in backward: fresh gradient tensors on the compute stream (bank x this step's factor)."""
        factor = self.factors[step % len(self.factors)]
        for param, grad in zip(params, self.bank):
            param.grad = grad * factor


def make_workload(args: argparse.Namespace, device: torch.device) -> Workload:
    dtype = DTYPES[args.dtype]
    shapes: list[tuple[int, ...]] = []
    names = []
    for index in range(args.matrices):
        shapes += [(args.rows, args.cols), (args.rows,)]
        names += [f"layer{index}.weight", f"layer{index}.bias"]
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    bank = []
    for shape in shapes:
        grad = torch.randn(shape, generator=generator, device=device)
        if len(shape) == 2:
            # a few columns much larger than the rest, as in real gradients: the top-k selection has something to find
            column_scale = torch.rand(shape[1], generator=generator, device=device).pow_(3).mul_(4).add_(0.05)
            grad.mul_(column_scale)
        bank.append(grad.mul_(1e-3).to(dtype))
    factors_generator = torch.Generator().manual_seed(args.seed + 2)
    factors = (0.5 + torch.rand(64, generator=factors_generator, dtype=torch.float64)).tolist()
    return Workload(device, dtype, shapes, names, bank, factors, args.seed)


def engine_config(name: str, args: argparse.Namespace) -> ZenFlowConfig | None:
    # no warm-up: the steady state is measured (the warm-up is 10 synchronous-offload steps once per run)
    base = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=args.topk_ratio, update_interval=args.update_interval)
    if name == "zenflow-device":
        return base.replace(accumulate_on="device")
    if name == "zenflow-host":
        return base.replace(accumulate_on="host")
    if name == "zenflow-auto":
        return base.replace(accumulate_on="auto", update_interval="auto")
    if name == "sync-offload":
        return base.replace(topk_ratio=0.0, update_interval=1, overlap_step=False, accumulate_on="host")
    return None


# ---------------------------------------------------------------------------------------------------- the runs
class StepLoop:
    """Runs steps of one configuration and times each (see the module docstring for what a step is)."""

    def __init__(
        self,
        workload: Workload,
        compute: ComputeStandIn,
        params: list[torch.nn.Parameter],
        engine: ZenFlowEngine | None,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.workload = workload
        self.compute = compute
        self.params = params
        self.engine = engine
        self.optimizer = optimizer
        self.is_cuda = workload.device.type == "cuda"
        self.t = 0

    def step(self) -> tuple[float, float | None, Any]:
        """One step: (wall seconds, GPU seconds between events on the compute stream or None, StepStats or None)."""
        started = time.perf_counter()
        if self.is_cuda:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        if self.engine is not None:
            self.engine.wait_for_update()  # GPU-side: the forward reads weights the device update writes
        self.compute()
        self.workload.set_gradients(self.params, self.t)
        stats = None
        if self.engine is not None:
            stats = self.engine.step()
        elif self.optimizer is not None:
            self.optimizer.step()
        for param in self.params:
            param.grad = None
        gpu_s = None
        if self.is_cuda:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record()
            # host wait for this step's compute stream only (a training loop's loss.item()); copies the engine
            # queued on its own streams go on
            end_event.synchronize()
            gpu_s = start_event.elapsed_time(end_event) / 1000.0
        self.t += 1
        return time.perf_counter() - started, gpu_s, stats


def run_config(name: str, workload: Workload, compute: ComputeStandIn, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up to a window end, then time whole windows until ``--steps`` or ``--budget-s``; one result row."""
    device = workload.device
    is_cuda = device.type == "cuda"
    params = workload.build_params()
    if is_cuda:
        torch.cuda.synchronize(device)  # the weights exist before the baseline is read
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    config = engine_config(name, args)
    engine = None
    optimizer: torch.optim.Optimizer | None = None
    started = time.perf_counter()
    if config is not None:
        # plain AdamW only carries the param groups for the engine
        optimizer = bench_train.demo_adamw(params, args.lr)
        names = dict(zip(params, workload.names))
        engine = ZenFlowEngine(optimizer, config, param_names=names).start()
    elif name == "no-offload":
        optimizer = bench_train.demo_adamw(params, args.lr, fused=True)
    setup_s = time.perf_counter() - started
    step_s: list[float] = []
    gpu_step_s: list[float] = []
    stats: list[Any] = []
    truncated = False
    try:
        loop = StepLoop(workload, compute, params, engine, optimizer)
        warmup_steps = 0
        while True:  # warm-up: at least --warmup-steps, then on to a window end (whole windows are timed)
            _, _, stat = loop.step()
            warmup_steps += 1
            if warmup_steps >= args.warmup_steps and (stat is None or stat.window_end):
                break
        measure_started = time.perf_counter()
        while True:
            wall, gpu, stat = loop.step()
            step_s.append(wall)
            if gpu is not None:
                gpu_step_s.append(gpu)
            if stat is not None:
                stats.append(stat)
            at_window_end = stat is None or stat.window_end
            if at_window_end and len(step_s) >= args.steps:
                break
            if at_window_end and time.perf_counter() - measure_started > args.budget_s:
                truncated = True
                break
        peak_delta = torch.cuda.max_memory_allocated(device) - baseline if is_cuda else None
        if engine is not None:
            device_bytes, host_bytes = engine.device_bytes(), engine.host_bytes()
        elif optimizer is not None:
            device_bytes, host_bytes = bench_train.optimizer_state_bytes(optimizer), 0
        else:
            device_bytes, host_bytes = 0, 0
    finally:
        if engine is not None:
            engine.close()
    return summarize(
        name=name,
        config=config,
        params=params,
        step_s=step_s,
        gpu_step_s=gpu_step_s,
        stats=stats,
        setup_s=setup_s,
        warmup_steps=warmup_steps,
        truncated=truncated,
        peak_delta=peak_delta,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        compute_ms=compute.ms,
    )


def summarize(
    *,
    name: str,
    config: ZenFlowConfig | None,
    params: list[torch.nn.Parameter],
    step_s: list[float],
    gpu_step_s: list[float],
    stats: list[Any],
    setup_s: float,
    warmup_steps: int,
    truncated: bool,
    peak_delta: int | None,
    device_bytes: int,
    host_bytes: int,
    compute_ms: float,
) -> dict[str, Any]:
    n = len(step_s)
    median = statistics.median(step_s)
    p99 = bench_utils.percentile(step_s, 99)
    stall = [s.stall_s for s in stats]
    d2h = [s.d2h_bytes for s in stats]
    h2d = [s.h2d_bytes for s in stats]
    n_params = sum(p.numel() for p in params)
    d2h_per_step = sum(d2h) / n if stats else 0.0
    h2d_per_step = sum(h2d) / n if stats else 0.0
    host_update = [s.host_update_s for s in stats if s.host_update_s is not None]
    device_update = [s.device_update_s for s in stats if s.device_update_s is not None]
    return {
        "kind": "row",
        "name": name,
        "accumulate_on": stats[-1].accumulate_on if stats else None,
        "topk_ratio": None if config is None else config.topk_ratio,
        "update_interval": stats[-1].update_interval if stats else None,
        "overlap_step": None if config is None else config.overlap_step,
        "n_params": n_params,
        "model_bytes": sum(p.nbytes for p in params),
        "setup_s": setup_s,
        "warmup_steps": warmup_steps,
        "measured_steps": n,
        "truncated_by_budget": truncated,
        "compute_ms": compute_ms,
        "median_step_ms": median * 1e3,
        "p99_step_ms": p99 * 1e3,
        "p99_over_median": p99 / median,
        "median_over_compute": median * 1e3 / compute_ms if compute_ms else None,
        "gpu_median_step_ms": statistics.median(gpu_step_s) * 1e3 if gpu_step_s else None,
        "stall_share": sum(stall) / sum(step_s) if stats else 0.0,
        "max_stall_ms": max(stall) * 1e3 if stats else 0.0,
        "stall_at_window_ends_s": sum(s.stall_s for s in stats if s.window_end),
        "d2h_bytes_per_step": d2h_per_step,
        "h2d_bytes_per_step": h2d_per_step,
        "d2h_bytes_per_param_per_step": d2h_per_step / n_params,
        "h2d_bytes_per_param_per_step": h2d_per_step / n_params,
        "d2h_gb_per_s_at_median_step": d2h_per_step / median / 1e9,
        "h2d_gb_per_s_at_median_step": h2d_per_step / median / 1e9,
        "peak_allocated_delta_bytes": peak_delta,
        "device_bytes": device_bytes,
        "host_bytes": host_bytes,
        "host_update_median_ms": statistics.median(host_update) * 1e3 if host_update else None,
        "device_update_median_ms": statistics.median(device_update) * 1e3 if device_update else None,
        "step_s": step_s,
        "gpu_step_s": gpu_step_s,
        "stall_s": stall,
        "window_end": [s.window_end for s in stats],
        "d2h_bytes": d2h,
        "h2d_bytes": h2d,
    }


# ---------------------------------------------------------------------------------------------------- profile
def profile(workload: Workload, compute: ComputeStandIn, args: argparse.Namespace) -> None:
    """A Chrome trace of ``--profile-steps`` steps of zenflow (``accumulate_on="auto"``) after the warm-up."""
    params = workload.build_params()
    optimizer = bench_train.demo_adamw(params, args.lr)
    config = ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=args.topk_ratio, update_interval=args.update_interval)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if workload.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with ZenFlowEngine(optimizer, config, param_names=dict(zip(params, workload.names))) as engine:
        loop = StepLoop(workload, compute, params, engine, optimizer)
        for _ in range(args.warmup_steps):
            loop.step()
        with torch.profiler.profile(activities=activities) as profiler:
            for index in range(args.profile_steps):
                with torch.profiler.record_function(f"train_step_{index}"):
                    _, _, stats = loop.step()
        accumulate_on = stats.accumulate_on
    args.profile.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(args.profile))
    sort_by = "self_cuda_time_total" if workload.device.type == "cuda" else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort_by, row_limit=25))
    print(
        f"profiled {args.profile_steps} steps of zenflow (accumulate_on='auto' chose {accumulate_on!r}) after "
        f"{args.warmup_steps} warm-up steps; wrote {args.profile}"
    )


# --------------------------------------------------------------------------------------------------------- main
def print_table(rows: list[dict[str, Any]]) -> None:
    headers = [
        "config",
        "acc",
        "S",
        "median ms",
        "p99/med",
        "GPU ms",
        "stall %",
        "max stall ms",
        "d2h MB/step",
        "h2d MB/step",
        "peak +MiB",
        "device MiB",
        "host MiB",
        "host upd ms",
        "steps",
    ]
    table = []
    for r in rows:
        peak = r["peak_allocated_delta_bytes"]
        table.append(
            [
                r["name"],
                r["accumulate_on"] or "-",
                r["update_interval"],
                r["median_step_ms"],
                r["p99_over_median"],
                r["gpu_median_step_ms"],
                100 * r["stall_share"],
                r["max_stall_ms"],
                r["d2h_bytes_per_step"] / 1e6,
                r["h2d_bytes_per_step"] / 1e6,
                None if peak is None else peak / 2**20,
                r["device_bytes"] / 2**20,
                r["host_bytes"] / 2**20,
                r["host_update_median_ms"],
                f"{r['measured_steps']}{'*' if r['truncated_by_budget'] else ''}",
            ]
        )
    bench_utils.print_table(None, headers, table)
    print(
        "median/p99: wall time of a whole step (stand-in, gradients, optimizer, host wait for the compute stream); "
        "GPU ms: CUDA events on the compute stream; stall %: sum of StepStats.stall_s / sum of step times; "
        "peak +MiB: max_memory_allocated above the weights and the gradient bank (fresh gradients included: "
        "compare with compute-only); * = cut short by --budget-s."
    )


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # a `timeout` kill: unwind, so the engine closes its worker and the rows written so far stay on disk
    raise SystemExit(f"gpu_stall: stopped by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller in the same process (a test) gets its handler back


def _main(args: Any) -> int:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    compute = ComputeStandIn(device, args.compute_ms).calibrate()
    workload = make_workload(args, device)
    if args.profile is not None:
        profile(workload, compute, args)
        return 0

    info = bench_utils.announce(
        "gpu_stall: ZenFlow's training-thread stall and link traffic at realistic sizes, side by side", device
    )
    limits = system_limits(device)
    matrix_params = args.matrices * args.rows * args.cols
    host_need = 20 * matrix_params  # the engine's shared host block: 20 B per matrix element
    print(
        f"  /dev/shm {bench_utils.fmt((limits['dev_shm_bytes'] or 0) / 2**30)} GiB "
        f"({bench_utils.fmt((limits['dev_shm_free_bytes'] or 0) / 2**30)} GiB free), ulimit -l {limits['ulimit_l']}, "
        f"{limits['cores_available']} usable cores"
        + (f"; nvidia-smi: {limits['nvidia_smi']['output']}" if limits["nvidia_smi"] else "")
    )
    if limits["dev_shm_free_bytes"] is not None and limits["dev_shm_free_bytes"] < host_need:
        print(
            f"  WARNING: the engine needs {host_need / 2**30:.2f} GiB of shared memory per configuration and "
            f"/dev/shm has {limits['dev_shm_free_bytes'] / 2**30:.2f} GiB free: the engine rows will fail "
            "(docker: --shm-size)."
        )
    n_params = sum(math.prod(s) for s in workload.shapes)
    if compute.cycles_per_ms:
        stand_in = f"torch.cuda._sleep({compute.cycles}) at {compute.cycles_per_ms:.0f} cycles/ms, measured "
        stand_in += f"{compute.measured_ms:.2f} ms"
    else:
        stand_in = "time.sleep" if device.type == "cpu" else "none"
    print(
        f"model: {args.matrices} x [{args.rows}, {args.cols}] {args.dtype} matrices + biases = {n_params / 1e6:.1f}M "
        f"parameters; compute stand-in {args.compute_ms} ms ({stand_in}); ZenFlow rows topk_ratio={args.topk_ratio}, "
        f"update_interval={args.update_interval}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    header = {
        "kind": "header",
        **bench_utils.payload(
            "gpu_stall",
            {**info, **limits},
            settings={
                "matrices": args.matrices,
                "rows": args.rows,
                "cols": args.cols,
                "dtype": args.dtype,
                "n_params": n_params,
                "compute_ms": args.compute_ms,
                "warmup_steps": args.warmup_steps,
                "steps": args.steps,
                "budget_s": args.budget_s,
                "topk_ratio": args.topk_ratio,
                "update_interval": args.update_interval,
                "lr": args.lr,
                "seed": args.seed,
                "configs": args.configs,
            },
            calibration={
                "cycles": compute.cycles,
                "cycles_per_ms": compute.cycles_per_ms,
                "measured_ms": compute.measured_ms,
            },
            timing_method=(
                "wall time per step with a host wait on a compute-stream event at its end; CUDA events for GPU ms"
                if device.type == "cuda"
                else "wall time per step (CPU: the engine's device work runs inline)"
            ),
        ),
    }
    bench_utils.append_jsonl(args.out, header)
    rows: list[dict[str, Any]] = []
    failures = []
    for name in args.configs:
        row, failure = bench_utils.attempt(name, lambda name=name: run_config(name, workload, compute, args))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if failure is not None:
            failure = {"kind": "failure", **failure}
            bench_utils.append_jsonl(args.out, failure)
            failures.append(failure)
            continue
        bench_utils.append_jsonl(args.out, row)
        rows.append(row)
        print(
            f" median {row['median_step_ms']:.1f} ms, stall {100 * row['stall_share']:.1f} %, "
            f"{row['measured_steps']} steps (setup {row['setup_s']:.1f} s)"
        )
    print()
    if rows:
        print_table(rows)
    bench_utils.append_jsonl(
        args.out, {"kind": "footer", "rows": [r["name"] for r in rows], "failures": [f["name"] for f in failures]}
    )
    print(f"wrote {args.out}")
    return bench_utils.report_failures(failures, "configuration(s)", lambda f: f["name"])


if __name__ == "__main__":
    sys.exit(main())
