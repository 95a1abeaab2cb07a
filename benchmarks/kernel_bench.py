"""The engine's kernels against fused torch AdamW, same sizes and threads: the host worker's AdamW step, the host add
of ``accumulate_on="host"``, and the interim moves' passes on the training core (or the GPU).

Table 1, the host AdamW step. For each size (parameters, split into matrices of ``--chunk`` elements like a model's
layers) and thread count:

- ``engine``: ``lightning_zenflow.engine.host.host_adam_update`` called in this process on shared host rows in the
  host format of ``--host-state`` (``engine/layout.py``), as the host worker runs it: one AdamW step from a window's
  sum (divisor 1 here), the weights as the masters, so the step is written over the window row it read
  (``engine/host_step.py``; compiled by ``torch.compile`` where a compiler is found: ``LIGHTNING_ZENFLOW_KERNELS``
  says which);
- ``worker``: the same update through a spawned ``HostWorker`` (its reported compute time, and submit-to-answer wall
  time, pipe included);
- ``native``: the same update with the step functions swapped for the native library's (``lightning_zenflow/native``:
  C++ built on first use, AVX-512 or AVX2, bit for bit the eager step): what the engine runs once it takes them;
- ``fused AdamW``: ``torch.optim.AdamW(fused=True).step()`` on fp32 parameters of the same sizes: the yardstick;
- ``DeepSpeedCPUAdam``: DeepSpeed's CPU Adam (AdamW mode) on the same fp32 parameters, where ``deepspeed`` is installed
  (an optional extra; the row says why it is missing otherwise);
- ``copy``: ``dst.copy_(src)`` of a large fp32 tensor, the machine's copy bandwidth in the same run; and ``add_``:
  ``dst.add_(src)``, an in-place stream like AdamW's (read both, write ``dst`` back; no write-allocate traffic).

Bytes counted per parameter (what each kernel must move at least once):

- engine, ``host_state="bf16"``: reads the bf16 window sum, exp_avg and exp_avg_sq, writes them back (the step over
  the sum): 6 x 2 = 12 B; ``"fp32"``: the same six streams in fp32, 24 B;
- fused AdamW: reads master, grad, exp_avg, exp_avg_sq and writes master, exp_avg, exp_avg_sq: 28 B;
- copy: 8 B per fp32 element (read 4, write 4); add_: 12 B (read 4 + 4, write 4).

The ratio to fused AdamW compares parameters per second on the same cores (target >= 1.2 for the engine's default bf16
state: it moves less than half the bytes; >= 1.5 for the native step); the fractions of copy and add_ bandwidth compare
bytes per second. ``limit`` is the memory's limit for the engine's bytes, this run's ``add_`` bandwidth (same threads)
over the bytes per parameter: how far the native step is from being bound by memory alone. The rows are timed in turns
(a round calls each once), and on one thread the native ratio is also given from the thread's CPU time (``by CPU
time``): on a machine shared with other work, wall time counts what the others took.

Table 2, the host add of ``accumulate_on="host"`` (``HostAccumulation.add_staged``, what the helper thread runs per
staged chunk into the packed accumulator), in elements per second against a plain contiguous fp32 ``acc.add_(src)``
of the same element count (target >= 0.8x), for an fp32 and a bf16 gradient, and the path it replaced (``index_add_``
of strided columns with ``alpha=1/S``, ATen's serial loop) on the same data.

Table 3, the interim moves' passes (``engine/kernels.py``) over ``--moves-layers`` square ``--moves-width`` matrices
(default four 2048 x 2048; eight 4096 x 4096 on a GPU), S = 4, median ms per step (one window of S steps is one
statistics pass and S moves) against one fused AdamW step over the same matrices: compiled, native and eager, fp32
and bf16 weights, the compiled and native ones also split into their move pass and their statistics pass. Beside them,
the device update's data movement over the same matrices (``engine/device.py``): the gather of the selected gradient
columns and the write of their masters back into the weights, for a sorted random 10 % of the columns (spread as a
selection is: most cache lines of a row hold one), with the native kernels (what the CPU stand-in runs) and torch's
``index_select`` / ``index_copy_`` (eager, and CUDA's). On the CPU they run on one core with one thread (the training
process's share); with ``--device cuda`` only this table runs, on the GPU (the kernels Triton builds from the same
source).

    python benchmarks/kernel_bench.py                     # 1M, 16M, 64M parameters; 1 and 2 threads; bf16 state
    python benchmarks/kernel_bench.py --host-state fp32   # the exact state
    python benchmarks/kernel_bench.py --device cuda       # the moves' passes on one GPU, < 1 minute
    python benchmarks/kernel_bench.py --quick             # smoke run, < 60 s
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import bench_utils
import torch

from lightning_zenflow.engine.device import HyperParams, gather_columns, write_columns
from lightning_zenflow.engine.host import (
    GroupJob,
    HostWorker,
    MatrixExtent,
    StepKernels,
    WorkerGroup,
    WorkerSpec,
    host_adam_update,
)
from lightning_zenflow.engine.interim import MatrixStatistics, derive_scales, update_statistics
from lightning_zenflow.engine.kernels import KERNELS_ENV, Kernels, compiler_missing, resolve_kernel_mode
from lightning_zenflow.native import native_kernels, native_unavailable

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "kernel_bench.json"
TARGET_RATIO = 1.2
NATIVE_TARGET_RATIO = 1.5

HPARAMS = HyperParams(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ENGINE_BYTES = {"bf16": 12, "fp32": 24}
"""Bytes per parameter the engine's step moves at least once (see the module docstring)."""
STEP_COLUMNS = {
    "threads": ("threads", 1),
    "engine_s": ("engine ms", 1e3),
    "engine_params_per_s": ("engine Mparam/s", 1e-6),
    "engine_gb_per_s": ("engine GB/s", 1),
    "worker_compute_s": ("worker ms", 1e3),
    "worker_wall_s": ("worker wall ms", 1e3),
    "fused_adamw_s": ("AdamW ms", 1e3),
    "ratio_to_fused_adamw": ("engine/AdamW", 1),
    "copy_gb_per_s": ("copy GB/s", 1),
    "engine_fraction_of_copy_bandwidth": ("engine/copy", 1),
    "add_gb_per_s": ("add_ GB/s", 1),
    "engine_fraction_of_add_bandwidth": ("engine/add_", 1),
}
"""Table 1's columns: the record's key, its header and the scale it is printed at."""
NATIVE_COLUMNS = {
    "threads": ("threads", 1),
    "fused_adamw_params_per_s": ("AdamW Mparam/s", 1e-6),
    "native_params_per_s": ("native Mparam/s", 1e-6),
    "native_ratio_to_fused_adamw": ("native/AdamW", 1),
    "native_cpu_ratio_to_fused_adamw": ("by CPU time", 1),
    "memory_limit_params_per_s": ("limit Mparam/s", 1e-6),
    "native_fraction_of_memory_limit": ("native/limit", 1),
    "deepspeed_params_per_s": ("DS CPUAdam Mparam/s", 1e-6),
    "engine_params_per_s": ("engine Mparam/s", 1e-6),
}
"""Table 1b: the native step beside fused AdamW, the memory's limit for its bytes and DeepSpeed's CPU Adam."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="small sizes, one thread count: a < 60 s smoke run.",
        device=("cpu", "cuda"),
        device_help="cpu: every table; cuda: the moves' passes on the GPU.",
    )
    parser.add_argument(
        "--sizes", type=float, nargs="*", default=None, help="millions of parameters (default 1 16 64; quick 1 4)."
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=None,
        help="thread counts (default 1 2, capped at the usable cores; quick 1).",
    )
    parser.add_argument("--chunk", type=float, default=4.0, help="millions of parameters per matrix (default 4).")
    parser.add_argument(
        "--host-state",
        choices=tuple(STATE_DTYPES),
        default="bf16",
        help="the host state's precision: bf16 (the default, 6 B per parameter) or fp32 (the exact state).",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per measurement (7; quick 3).")
    parser.add_argument("--copy-mb", type=int, default=None, help="size of the copy test in MB (256; quick 64).")
    parser.add_argument("--moves-layers", type=int, default=None, help="matrices of table 3 (4; 8 on CUDA; quick 2).")
    parser.add_argument("--moves-width", type=int, default=None, help="their width (2048; 4096 on CUDA; quick 256).")
    parser.add_argument(
        "--no-worker",
        action="store_true",
        help="skip the spawned-worker measurement (--quick measures it at the smallest size only).",
    )
    usable = len(bench_utils.available_cores())
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args = bench_utils.apply_quick_defaults(
        args,
        {
            "sizes": ([1, 16, 64], [1, 4]),
            "threads": ([t for t in (1, 2) if t <= usable], [1]),
            "repeats": (7, 3),
            "copy_mb": (256, 64),
            "moves_layers": (8 if cuda else 4, 2),
            "moves_width": (4096 if cuda else 2048, 256),
        },
    )
    too_many = [t for t in args.threads if t > usable]
    if too_many:
        parser.error(f"--threads {too_many} exceed the {usable} usable cores of this machine.")
    return args


def time_median(fn: Callable[[], Any], repeats: int, prepare: Callable[[], None] | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after two untimed ones (``prepare()`` untimed before each)."""
    return bench_utils.time_median(fn, repeats, warmups=2, prepare=prepare)


def time_in_turns(
    runs: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds and median CPU seconds of this thread for each ``(fn, prepare)``, the rows taken in turns
    (one call of each per round, after two untimed rounds; ``prepare()`` untimed before each call): a change in the
    machine's other load lands on every row alike. On one thread, every row runs on this thread: its CPU time leaves
    out the time the machine's other users took (a shared machine's wall time does not)."""
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(repeats + 2):
        for name, (fn, prepare) in runs.items():
            if prepare is not None:
                prepare()
            started, started_cpu = time.perf_counter(), time.thread_time()
            fn()
            if round_index >= 2:
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.thread_time() - started_cpu)
    median = statistics.median
    return {name: median(v) for name, v in wall.items()}, {name: median(v) for name, v in cpu.items()}


class HostProblem:
    """One size: the engine's shared host rows with a job over all its matrices, and fused-AdamW tensors."""

    def __init__(self, numel: int, chunk: int, state_dtype: torch.dtype, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        # matrices of 4096 columns, as a model's layers are (a size that 4096 does not divide is rounded up to rows
        # of 4096: 1M is 256 rows, 16M 3907 rows in four matrices)
        cols = 4096
        numel = cols * -(-numel // cols)
        chunk = cols * max(1, chunk // cols)
        sizes = [min(chunk, numel - start) for start in range(0, numel, chunk)]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.extents = tuple(
            MatrixExtent(o, n, torch.bfloat16, cols, 0, salt=i) for i, (o, n) in enumerate(zip(offsets, sizes))
        )
        # the engine's host format: the moments and one window row, in the state's dtype, each its own shared row
        rows = [torch.zeros(numel, dtype=state_dtype).share_memory_() for _ in range(3)]
        self.group = WorkerGroup(rows[0], rows[1], torch.zeros(len(sizes)).share_memory_(), None, (rows[2],))
        self.master = torch.randn(numel, generator=generator) * 0.02
        self.grad_source = (torch.randn(numel, generator=generator) * 1e-3).to(state_dtype)
        # a full window: the window row holds the mean, divisor 1
        self.job = GroupJob(hparams=HPARAMS, active=tuple(range(len(sizes))), mean_divisors=(1.0,) * len(sizes))
        self.numel = numel
        self.kernels = StepKernels(resolve_kernel_mode("auto", torch.device("cpu"))[0])
        self.native = native_step_kernels()

    def refill_grads(self) -> None:
        """Restore the window row: the previous update wrote its step over it."""
        self.group.windows[0].copy_(self.grad_source)

    def engine_step(self) -> None:
        host_adam_update(self.group, self.extents, 0, self.job, kernels=self.kernels)

    def native_step(self) -> None:
        host_adam_update(self.group, self.extents, 0, self.job, kernels=self.native)

    def fused_adamw(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            self.fp32_params(),
            lr=HPARAMS.lr,
            betas=(HPARAMS.beta1, HPARAMS.beta2),
            eps=HPARAMS.eps,
            weight_decay=HPARAMS.weight_decay,
            fused=True,
        )

    def deepspeed_adam(self) -> tuple[torch.optim.Optimizer | None, str | None]:
        """DeepSpeed's CPU Adam in AdamW mode on fp32 parameters like fused AdamW's, or why there is none."""
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as error:
            return None, f"deepspeed is not installed ({error}); pip install deepspeed adds the row"
        try:
            hp = HPARAMS
            adam = DeepSpeedCPUAdam(self.fp32_params(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                    weight_decay=hp.weight_decay, adamw_mode=True)  # fmt: skip
        except Exception as error:  # its op builder compiles on first use: say why it failed
            return None, f"DeepSpeedCPUAdam could not be built here ({type(error).__name__}: {error})"
        return adam, None

    def fp32_params(self) -> list[torch.Tensor]:
        params = []
        for extent in self.extents:
            param = self.master[extent.offset : extent.offset + extent.numel].clone()
            param.grad = self.grad_source[extent.offset : extent.offset + extent.numel].float()
            params.append(param)
        return params


def native_step_kernels() -> StepKernels | None:
    """The engine's step functions swapped for the native library's (None, and why once, where it is unavailable)."""
    native = native_kernels()
    if native is None:
        return None
    kernels = StepKernels("eager")
    kernels.step_, kernels.master_step_ = native.adam_step_, native.adam_master_step_
    kernels.chunk_elements = 1 << 62  # as the engine calls it: a region at once (the library tiles it over threads)
    return kernels


def stream_bandwidth(megabytes: int, threads: int, cores: list[int], repeats: int) -> tuple[float, float]:
    """GB/s of ``dst.copy_(src)`` (8 B per fp32 element counted) and of ``dst.add_(src)`` (12 B counted) for
    ``megabytes`` of fp32 on ``threads`` pinned cores."""
    source = torch.randn(megabytes * 2**20 // 4)
    destination = torch.zeros_like(source)
    with bench_utils.pinned(cores[:threads], threads):
        copy_s = time_median(lambda: destination.copy_(source), repeats)
        add_s = time_median(lambda: destination.add_(source), repeats)
    return 2 * source.nbytes / copy_s / 1e9, 3 * source.nbytes / add_s / 1e9


def measure_worker(problem: HostProblem, threads: int, cores: list[int], repeats: int) -> tuple[float, float]:
    """(median compute seconds reported by the worker, median submit-to-answer seconds) over ``repeats`` updates."""
    spec = WorkerSpec(
        groups=(problem.group,),
        extents=(problem.extents,),
        heartbeat=torch.zeros(1, dtype=torch.float64).share_memory_(),
        threads=threads,
        cores=tuple(cores),
        kernel_mode=problem.kernels.kernels.mode,
    )
    worker = HostWorker(spec, timeout_s=60.0)
    compute, wall = [], []
    try:
        worker.wait_for_builds()  # the steady state: its compiled step is built (it runs eagerly until then)
        for index in range(repeats + 2):
            problem.refill_grads()
            started = time.perf_counter()
            worker.submit(0, [problem.job])
            seconds = worker.wait()  # pipe wait for the worker's answer: the update has finished
            if index >= 2:
                wall.append(time.perf_counter() - started)
                compute.append(seconds)
    finally:
        worker.close()
    return statistics.median(compute), statistics.median(wall)


HOST_ADD_TARGET = 0.8


def host_add_rates(numel: int, threads: int, cores: list[int], repeats: int) -> dict[str, float]:
    """Elements per second of the host mode's add (fp32 and bf16 staged chunks) and of references, on ``threads``."""
    from lightning_zenflow.engine.accumulate import STAGING_SLOT_BYTES, HostAccumulation
    from lightning_zenflow.engine.lanes import Lanes

    accumulation = HostAccumulation(Lanes(torch.device("cpu")), [], STAGING_SLOT_BYTES)
    cols = 4096
    rows = numel // cols
    acc = torch.zeros(rows, cols)
    sources = {"fp32": torch.randn(rows, cols), "bf16": torch.randn(rows, cols).to(torch.bfloat16)}
    rates = {}

    def staged_add(source: torch.Tensor) -> None:
        rows_per_chunk = max(1, STAGING_SLOT_BYTES // (cols * source.element_size()))
        for start in range(0, rows, rows_per_chunk):
            stop = min(rows, start + rows_per_chunk)
            accumulation.add_staged(0, source[start:stop], acc[start:stop], False)

    with bench_utils.pinned(cores[:threads], threads):
        rates["plain_add"] = acc.numel() / time_median(lambda: acc.add_(sources["fp32"]), repeats)
        for name, source in sources.items():
            rates[f"engine_{name}"] = acc.numel() / time_median(lambda source=source: staged_add(source), repeats)
        # the path it replaced: 90 % of the columns of a parameter-shaped accumulator, strided, alpha = 1/S
        columns = torch.arange(cols)[torch.arange(cols) % 10 != 0]
        small_rows = max(1, min(rows, (1 << 22) // cols))  # the serial loop is slow: a 4M-element slice
        strided_acc = torch.zeros(small_rows, cols)
        payload = torch.randn(small_rows, columns.numel())
        rates["index_add_alpha"] = payload.numel() / time_median(
            lambda: strided_acc.index_add_(1, columns, payload, alpha=0.25), max(1, repeats // 2)
        )
    return rates


def host_tables(args: argparse.Namespace) -> dict[str, Any]:
    """Tables 1 and 2 (the host step, the host add), printed; their records for the JSON."""
    state_dtype = STATE_DTYPES[args.host_state]
    engine_bytes_per_param = ENGINE_BYTES[args.host_state]
    adamw_bytes_per_param = 28
    cores = bench_utils.available_cores()
    chunk = int(args.chunk * 1e6)
    kernel_mode = resolve_kernel_mode("auto", torch.device("cpu"))[0]
    print(
        f"bytes per parameter: engine {engine_bytes_per_param} (host_state={args.host_state}, its step {kernel_mode}), "
        f"fused AdamW {adamw_bytes_per_param}, copy 8 and add_ 12 per fp32 element; matrices of "
        f"{args.chunk:g}M parameters; median of {args.repeats} repetitions after 2 warm-ups; each thread count "
        "pinned to that many cores"
    )

    bandwidth = {threads: stream_bandwidth(args.copy_mb, threads, cores, args.repeats) for threads in args.threads}
    copy_gbps = {threads: copy for threads, (copy, _) in bandwidth.items()}
    add_gbps = {threads: add for threads, (_, add) in bandwidth.items()}

    native = native_kernels()
    native_note = native_unavailable() or f"variant {native.variant}, first build {_seconds(native.build_seconds)}"
    print(f"native step: {native_note}")
    rows, native_rows, records = [], [], []
    deepspeed_reason = None
    for size in args.sizes:
        problem = HostProblem(int(size * 1e6), chunk, state_dtype)
        numel = problem.numel
        optimizer = problem.fused_adamw()
        deepspeed, deepspeed_reason = problem.deepspeed_adam()
        for threads in args.threads:
            with bench_utils.pinned(cores[:threads], threads):
                runs = {"engine": (problem.engine_step, problem.refill_grads), "adamw": (optimizer.step, None)}
                if problem.native is not None:
                    runs["native"] = (problem.native_step, problem.refill_grads)
                if deepspeed is not None:
                    runs["deepspeed"] = (deepspeed.step, None)
                seconds, cpu_seconds = time_in_turns(runs, args.repeats)
            engine_s, adamw_s = seconds["engine"], seconds["adamw"]
            native_s, deepspeed_s = seconds.get("native"), seconds.get("deepspeed")
            worker_compute_s = worker_wall_s = None
            # --quick spawns one worker only (the smallest size): a spawn costs seconds
            if not args.no_worker and not (args.quick and size != args.sizes[0]):
                worker_compute_s, worker_wall_s = measure_worker(problem, threads, cores[:threads], args.repeats)
            gb_per_s = {"engine": numel * engine_bytes_per_param / engine_s / 1e9}
            gb_per_s["fused_adamw"] = numel * adamw_bytes_per_param / adamw_s / 1e9
            record = {
                "params": numel,
                "threads": threads,
                "engine_s": engine_s,
                "engine_params_per_s": numel / engine_s,
                "engine_gb_per_s": gb_per_s["engine"],
                "worker_compute_s": worker_compute_s,
                "worker_wall_s": worker_wall_s,
                "worker_ratio_to_fused_adamw": adamw_s / worker_compute_s if worker_compute_s else None,
                "fused_adamw_s": adamw_s,
                "fused_adamw_params_per_s": numel / adamw_s,
                "fused_adamw_gb_per_s": gb_per_s["fused_adamw"],
                "ratio_to_fused_adamw": adamw_s / engine_s,
                "native_s": native_s,
                "native_params_per_s": numel / native_s if native_s else None,
                "native_ratio_to_fused_adamw": adamw_s / native_s if native_s else None,
                "native_cpu_ratio_to_fused_adamw": (
                    cpu_seconds["adamw"] / cpu_seconds["native"] if native_s and threads == 1 else None
                ),
                "memory_limit_params_per_s": add_gbps[threads] * 1e9 / engine_bytes_per_param,
                "native_fraction_of_memory_limit": (
                    numel / native_s / (add_gbps[threads] * 1e9 / engine_bytes_per_param) if native_s else None
                ),
                "deepspeed_params_per_s": numel / deepspeed_s if deepspeed_s else None,
                "copy_gb_per_s": copy_gbps[threads],
                "engine_fraction_of_copy_bandwidth": gb_per_s["engine"] / copy_gbps[threads],
                "fused_adamw_fraction_of_copy_bandwidth": gb_per_s["fused_adamw"] / copy_gbps[threads],
                "add_gb_per_s": add_gbps[threads],
                "engine_fraction_of_add_bandwidth": gb_per_s["engine"] / add_gbps[threads],
            }
            records.append(record)
            row = [scale * (record[key] or math.nan) for key, (_, scale) in STEP_COLUMNS.items()]
            rows.append([f"{size:g}M", *row])
            row = [scale * (record[key] or math.nan) for key, (_, scale) in NATIVE_COLUMNS.items()]
            native_rows.append([f"{size:g}M", *row])
            native_ms = f", native {native_s * 1e3:.1f}" if native_s else ""
            print(f"  {size:g}M params, {threads} thread(s): engine {engine_s * 1e3:.1f}{native_ms}, ", end="")
            print(f"AdamW {adamw_s * 1e3:.1f} ms")
        del problem, optimizer, deepspeed
        gc.collect()

    bench_utils.print_table("\nHost AdamW throughput", ["size", *(name for name, _ in STEP_COLUMNS.values())], rows)
    worst = min(r["ratio_to_fused_adamw"] for r in records)
    print(
        f"\nengine/AdamW = fused AdamW time / engine time (parameters per second), target >= {TARGET_RATIO}: "
        f"lowest {worst:.2f} -> {'met' if worst >= TARGET_RATIO else 'NOT met'} over every size and thread count. "
        "engine/copy, engine/add_ = engine GB/s / copy or add_ GB/s (same thread count). worker ms = compute time "
        "the worker reports; worker wall ms = submit to answer, pipe included."
    )
    title = f"\nHost AdamW step: native against fused AdamW, the memory's limit at {engine_bytes_per_param} B"
    bench_utils.print_table(title, ["size", *(name for name, _ in NATIVE_COLUMNS.values())], native_rows)
    native_ratios = [r["native_ratio_to_fused_adamw"] for r in records if r["native_ratio_to_fused_adamw"]]
    if native_ratios:
        lowest = min(native_ratios)
        print(
            f"native/AdamW target >= {NATIVE_TARGET_RATIO}: lowest {lowest:.2f} -> "
            f"{'met' if lowest >= NATIVE_TARGET_RATIO else 'NOT met'}; by CPU time = the same ratio from this thread's "
            "CPU time (one thread: what the machine's other users took is left out); limit = add_ GB/s / "
            f"{engine_bytes_per_param} B (the memory's limit for the engine's bytes); native/limit = how close the "
            "native step runs to it."
        )
    else:
        print(f"native: no row ({native_unavailable()})")
    print(f"DS CPUAdam: {deepspeed_reason or 'DeepSpeedCPUAdam, AdamW mode, fp32 state (28 B)'}")
    add_rows, add_records = [], []
    for size in args.sizes:
        numel = int(size * 1e6)
        for threads in args.threads:
            rates = host_add_rates(numel, threads, cores, args.repeats)
            record = {"params": numel, "threads": threads, **{f"{k}_elements_per_s": v for k, v in rates.items()}}
            for dtype in ("fp32", "bf16"):
                record[f"engine_{dtype}_ratio_to_plain_add"] = rates[f"engine_{dtype}"] / rates["plain_add"]
            add_records.append(record)
            add_rows.append(
                [f"{size:g}M", threads, rates["plain_add"] / 1e9, rates["engine_fp32"] / 1e9]
                + [record["engine_fp32_ratio_to_plain_add"], rates["engine_bf16"] / 1e9]
                + [record["engine_bf16_ratio_to_plain_add"], rates["index_add_alpha"] / 1e9]
            )
    bench_utils.print_table(
        "\nHost add of accumulate_on='host' (G elements/s; packed contiguous accumulator)",
        ["size", "threads", "plain add_", "engine fp32", "/add_", "engine bf16", "/add_", "old index_add_"],
        add_rows,
    )
    lowest_add = min(min(r["engine_fp32_ratio_to_plain_add"], r["engine_bf16_ratio_to_plain_add"]) for r in add_records)
    print(
        f"engine/add_ target >= {HOST_ADD_TARGET}: lowest {lowest_add:.2f} -> "
        f"{'met' if lowest_add >= HOST_ADD_TARGET else 'NOT met'}; old index_add_ = the strided alpha=1/S path "
        "this replaced (90 % of the columns)."
    )
    return {
        "host_state": args.host_state,
        "kernel_mode": kernel_mode,
        "native": {
            "variant": native.variant if native else None,
            "unavailable": native_unavailable(),
            "build_s": native.build_seconds if native else None,
            "target_ratio_to_fused_adamw": NATIVE_TARGET_RATIO,
        },
        "deepspeed_missing": deepspeed_reason,
        "bytes_per_param": {
            "engine": engine_bytes_per_param,
            "fused_adamw": adamw_bytes_per_param,
            "copy": 8,
            "add_": 12,
        },
        "chunk_params": chunk,
        "copy_gb_per_s": {str(t): v for t, v in copy_gbps.items()},
        "add_gb_per_s": {str(t): v for t, v in add_gbps.items()},
        "results": records,
        "target_ratio_to_fused_adamw": TARGET_RATIO,
        "lowest_ratio_to_fused_adamw": worst,
        "target_met": worst >= TARGET_RATIO,
        "host_add": add_records,
        "host_add_target_ratio": HOST_ADD_TARGET,
        "host_add_lowest_ratio": lowest_add,
    }


# ------------------------------------------------------------------------------------------ table 3: the moves
def pass_times(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Median ms per step of each pass over the matrices: on one core with one thread, or on the GPU."""
    width, interval = args.moves_width, 4
    shapes = [(width, width)] * args.moves_layers
    generator = torch.Generator().manual_seed(0)
    grads = [(torch.randn(shape, generator=generator) * 1e-3).to(device) for shape in shapes]
    weights = [(torch.randn(shape, generator=generator) * 0.02).to(device) for shape in shapes]
    unselected = torch.arange(max(1, round(0.1 * width)), width, device=device)  # the host columns at rho = 0.1
    # the device update's columns: as many, spread over the row as a selection is
    selected = torch.randperm(width, generator=generator)[: max(1, round(0.1 * width))].sort().values.to(device)
    results: dict[str, float] = {}

    def timed(fn: Callable[[], Any], repeats: int = 10) -> float:
        return bench_utils.time_median(fn, repeats, warmups=2, device=device) * 1e3

    cuda = device.type == "cuda"
    with bench_utils.pinned([0], threads=1) if not cuda else contextlib.nullcontext():
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        results["fused AdamW step"] = timed(torch.optim.AdamW(params, lr=1e-4, fused=True).step)
        # on CUDA: Triton's builds ("compiled") and eager; on a CPU: the native kernels (what "compiled" runs there),
        # torch.compile's builds (the CUDA path's way of building, LIGHTNING_ZENFLOW_KERNELS=inductor) and eager
        built = compiler_missing(device) is None
        if cuda:
            modes = [*(["compiled"] if built else []), "eager"]
        else:
            modes = ["native", *(["torch.compile"] if built else []), "eager"]
        for mode in modes:
            if mode == "native" and native_kernels() is None:
                continue
            override = {"native": "compiled", "torch.compile": "inductor"}.get(mode)
            with bench_utils.environment({KERNELS_ENV: override} if override else {}):
                kernels = Kernels("eager" if mode == "eager" else "compiled", device)
            kernels.threads = 1  # one core, one thread: the training process's share on a CPU
            for dtype in (torch.float32, torch.bfloat16):
                # minutes of bf16 elementwise work on a CPU; the compiled row is the one used
                skip_moves = dtype == torch.bfloat16 and mode == "eager" and not args.quick and not cuda
                g, w = [x.to(dtype) for x in grads], [x.to(dtype) for x in weights]
                stats = [_statistics(shape, unselected, device) for shape in shapes]
                seed = torch.zeros((), dtype=torch.int64, device=device)
                keep = torch.ones((), device=device)  # the engine's keep without a loss scaler

                def moves(g=g, w=w, stats=stats, kernels=kernels, seed=seed, keep=keep) -> None:
                    for grad2d, weight2d, st in zip(g, w, stats):
                        args_ = (grad2d, weight2d, st.row_scale, st.col_scale, st.move_mask, 1e-8, 1e-4, keep)
                        if weight2d.dtype == torch.bfloat16:
                            kernels.moves_bf16_(*args_, 0, seed)
                        else:
                            kernels.moves_fp32_(*args_)

                def statistics(g=g, stats=stats, kernels=kernels, keep=keep) -> None:
                    for grad2d, st in zip(g, stats):
                        update_statistics(kernels, grad2d, st, int(unselected.numel()), 0.999**interval, keep)
                        derive_scales(st)

                def window(moves=moves, statistics=statistics) -> None:
                    statistics()  # at a window's first step; then a move at each of its steps
                    for _ in range(interval):
                        moves()

                def sums(g=g, stats=stats, kernels=kernels) -> None:
                    for grad2d, st in zip(g, stats):
                        kernels.row_col_sums(grad2d, st.host_mask)

                label = f"moves {mode} {'fp32' if dtype == torch.float32 else 'bf16'}"
                if not skip_moves:
                    results[label] = timed(window, repeats=5) / interval
                if mode != "eager":  # the two parts of that mean
                    results[f"{label}: the move pass"] = timed(moves)
                    results[f"{label}: the statistics pass (once a window)"] = timed(sums)
                if mode != "torch.compile":  # its data movement is torch's ops, as eager's
                    gather, write = kernels.native_or_eager(gather_columns), kernels.native_or_eager(write_columns)
                    masters = [torch.randn(width, selected.numel(), device=device) * 0.02 for _ in shapes]
                    gathered = [torch.empty_like(master) for master in masters]

                    def columns(g=g, w=w, gather=gather, write=write, masters=masters, gathered=gathered) -> None:
                        for grad2d, weight2d, master, out in zip(g, w, masters, gathered):
                            gather(grad2d, selected, out)
                            write(weight2d, selected, master)

                    name = "torch ops" if mode == "eager" else mode
                    dtype_name = "fp32" if dtype == torch.float32 else "bf16"
                    results[f"selected columns {name} {dtype_name}: gather + write-back"] = timed(columns)
    return results


def _seconds(value: float | None) -> str:
    return "found in the cache" if value is None else f"{value:.1f} s"


def _statistics(shape: tuple[int, int], unselected: torch.Tensor, device: torch.device) -> MatrixStatistics:
    stats = MatrixStatistics(
        row=torch.zeros(shape[0], device=device),
        col=torch.zeros(shape[1], device=device),
        decay=torch.ones((), device=device),
        moves=torch.zeros((), device=device),
        warm_col=torch.zeros(shape[1], device=device),
        warm_steps=torch.zeros((), device=device),
        salt=0,
    )
    stats.host_mask = torch.zeros(shape[1], device=device).index_fill_(0, unselected, 1.0)
    stats.mask_of = unselected
    return stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = bench_utils.cuda_missing(args.device, "; run it with --device cpu for every table.")
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    device = torch.device(args.device)
    info = bench_utils.announce("kernel_bench: the engine's kernels against fused torch AdamW, same sizes", device)
    host = host_tables(args) if device.type == "cpu" else {}
    passes = pass_times(args, device)
    adamw = passes["fused AdamW step"]
    where = "on the GPU" if device.type == "cuda" else "one core, one thread"
    shape = f"{args.moves_layers} x [{args.moves_width}, {args.moves_width}]"
    bench_utils.print_table(
        f"\nThe interim moves' passes, {shape}, {where} (ms per step)",
        ["pass", "ms per step", "x fused AdamW step"],
        [[name, value, value / adamw] for name, value in passes.items()],
        digits=2,
    )
    bench_utils.write_results(
        args.out,
        bench_utils.payload(
            "kernel_bench", info, revision=True, settings=bench_utils.settings_of(args), **host, moves_pass_ms=passes
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
