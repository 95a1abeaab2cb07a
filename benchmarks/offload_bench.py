"""Step time, stall, traffic and memory of ZenFlow against no offload and synchronous offload, side by side.

One run, one model, one batch sequence, one seed, every configuration in turn:

- ``fwd+bwd``       forward and backward only, no optimizer step (the floor);
- ``no-offload``    plain ``torch.optim.AdamW(fused=True)`` in the training process;
- ``sync-offload``  the engine with ``topk_ratio=0, update_interval=1, overlap_step=False`` in the exact fp32 host
  state (ZeRO-Offload semantics: every matrix updated on the host at every step, the device waits);
- ``zenflow``       the engine with its defaults (``topk_ratio=0.1, update_interval=4``, overlap on,
  ``accumulate_on="auto"``, which takes the device here, interim moves on, the compact bf16 host state);
- ``zenflow fp32``  the same in the exact fp32 host state;
- ``zenflow no-moves``  the same with ``interim_step=0`` (the paper's rule for the host columns);
- ``zenflow host``  the same with ``accumulate_on="host"`` (per-step copies down, host adds);
- ``zenflow rho=... S=...``  a sweep over ``--rhos`` x ``--intervals``;
- ``torchao-offload`` (CUDA only, when ``torchao`` is importable) torchao's ``CPUOffloadOptimizer``.

Training is a manual loop (forward, backward, ``engine.step()``, ``engine.wait_for_update()`` before the next forward),
so the overheads measured are the engine's, not Lightning's.

CPU surrogate (the default, ``--device cpu``): no GPU, so the training process plays the device and the host worker
plays the CPU. They get disjoint cores (``bind_cores=True, pt_reserved_cores_perc=0.5``), and the no-offload and
fwd+bwd baselines run pinned to the training process's cores with its thread count, so every configuration has the
same compute for forward and backward. The model is fp32 and is shaped so that one full AdamW step costs about as
much as forward+backward or more (on a GPU the CPU step is the bottleneck: 4.6 s against 0.65 s in the paper): a
wide GPT fed few tokens per step. The script calibrates the tokens per step on this machine first and prints the
ratio it reached.

    python benchmarks/offload_bench.py                  # CPU surrogate, full sweep (a few minutes on 2 quiet cores)
    python benchmarks/offload_bench.py --quick          # smoke run, < 60 s
    python benchmarks/offload_bench.py --device cuda    # 1.2B bf16 GPT on one GPU, < 5 minutes
    python benchmarks/offload_bench.py --device cuda --profile trace.json   # a Chrome trace of the zenflow row

``--profile PATH`` runs the ``zenflow`` row alone and its measured steps under ``torch.profiler`` (CPU and CUDA
activities), prints the busiest operators and writes a Chrome trace (chrome://tracing, Perfetto) to PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import pathlib
import sys
import time
from typing import Any

import bench_utils
import torch
from offload_report import plot, print_report, summarize, target_checks

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.demo import GPT, GPTConfig, load_corpus_bytes

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "offload_bench.json"
TARGET_HOST_OVER_FWD_BWD = 1.0
"""The CPU surrogate wants one full host AdamW step to cost at least this many forward+backward passes."""


# ------------------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="small model, few steps, no sweep: a < 60 s smoke run.",
        plot="also write a PNG of step times next to the JSON.",
        seed="",
        device=("cpu", "cuda"),
        device_help="cpu: the CPU surrogate.",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps excluded from statistics "
        "(default: one longest window, 8; rounded up to a multiple of every S in the run).",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per configuration "
        "(default 32 CPU / 16 CUDA / 8 quick; rounded up to a multiple of every S in the run).",
    )
    parser.add_argument(
        "--rhos",
        type=float,
        nargs="*",
        default=None,
        help="sweep topk_ratio values (default 0.05 0.1 0.2 CPU; 0.1 CUDA; none with --quick).",
    )
    parser.add_argument(
        "--intervals",
        type=int,
        nargs="*",
        default=None,
        help="sweep update_interval values (default 2 4 8 CPU; 2 8 CUDA; none with --quick).",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the rho x S sweep.")
    parser.add_argument(
        "--select-interval",
        type=int,
        default=None,
        help="refresh the selection every N steps (select_strategy='step'); default: the engine's "
        "default, which outside a Trainer selects once.",
    )
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--n-embd", type=int, default=None)
    parser.add_argument("--n-head", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="with --block-size: skip the calibration.")
    parser.add_argument("--block-size", type=int, default=None, help="with --batch-size: skip the calibration.")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--profile", type=pathlib.Path, default=None, help="the zenflow row alone, its steps traced to this path."
    )
    args = parser.parse_args(argv)
    if (args.batch_size is None) != (args.block_size is None):
        parser.error("give --batch-size and --block-size together (or neither, to calibrate tokens per step).")
    return args


@dataclasses.dataclass
class ModelShape:
    n_layer: int
    n_embd: int
    n_head: int
    max_block: int
    dtype: torch.dtype


def model_shape(args: argparse.Namespace) -> ModelShape:
    if args.device == "cuda":
        shape = ModelShape(n_layer=24, n_embd=2048, n_head=16, max_block=1024, dtype=torch.bfloat16)
    elif args.quick:
        shape = ModelShape(n_layer=2, n_embd=256, n_head=4, max_block=64, dtype=torch.float32)
    else:
        # wide matrices (4096 x 1024 MLP weights, 16 MB each in fp32) and few layers: cheap to run with few tokens
        shape = ModelShape(n_layer=2, n_embd=1024, n_head=8, max_block=64, dtype=torch.float32)
    if args.n_layer is not None:
        shape.n_layer = args.n_layer
    if args.n_embd is not None:
        shape.n_embd = args.n_embd
    if args.n_head is not None:
        shape.n_head = args.n_head
    if args.block_size is not None:
        shape.max_block = max(shape.max_block, args.block_size)
    return shape


# ------------------------------------------------------------------------------------------------ configurations
@dataclasses.dataclass
class Spec:
    """One configuration of the comparison."""

    name: str
    kind: str
    """'fwd+bwd', 'no-offload', 'engine' or 'torchao'."""
    config: ZenFlowConfig | None = None

    @property
    def rho(self) -> float | None:
        return None if self.config is None else float(self.config.topk_ratio)

    @property
    def interval(self) -> int | None:
        return None if self.config is None else int(self.config.update_interval)


def build_specs(args: argparse.Namespace) -> list[Spec]:
    select = {}
    if args.select_interval is not None:
        select = {"select_strategy": "step", "select_interval": args.select_interval}
    # the host worker and the training process get disjoint cores; these are ZenFlowConfig's defaults, spelled out.
    # No warm-up: the steady state is measured (the warm-up is 10 synchronous-offload steps once per run).
    base = ZenFlowConfig(full_warm_up_rounds=0, bind_cores=True, pt_reserved_cores_perc=0.5, **select)
    specs = [
        Spec("fwd+bwd", "fwd+bwd"),
        Spec("no-offload", "no-offload"),
        Spec(
            "sync-offload",
            "engine",
            base.replace(
                topk_ratio=0.0,
                update_interval=1,
                overlap_step=False,
                select_strategy="auto",
                select_interval="auto",
                accumulate_on="host",
                host_state="fp32",
            ),
        ),
        Spec("zenflow", "engine", base),
        Spec("zenflow fp32", "engine", base.replace(host_state="fp32")),
        Spec("zenflow no-moves", "engine", base.replace(interim_step=0)),
        Spec("zenflow host", "engine", base.replace(accumulate_on="host")),
    ]
    if args.device == "cuda":
        specs.append(Spec("torchao-offload", "torchao"))
    if args.profile is not None:
        return [spec for spec in specs if spec.name == "zenflow"]
    if args.no_sweep:
        return specs
    rhos = (
        args.rhos
        if args.rhos is not None
        else ([] if args.quick else [0.05, 0.1, 0.2] if args.device == "cpu" else [0.1])
    )
    intervals = (
        args.intervals
        if args.intervals is not None
        else ([] if args.quick else [2, 4, 8] if args.device == "cpu" else [2, 8])
    )
    for rho in rhos:
        for interval in intervals:
            config = base.replace(topk_ratio=rho, update_interval=interval)
            if config == base:
                continue  # the default point is the 'zenflow' row
            specs.append(Spec(f"zenflow rho={rho:g} S={interval}", "engine", config))
    return specs


# ---------------------------------------------------------------------------------------------- model and data
def gpt_config(shape: ModelShape, block: int) -> GPTConfig:
    return GPTConfig(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head, block_size=block)


def build_model(shape: ModelShape, block: int, seed: int, device: torch.device) -> GPT:
    """The same initial weights for every configuration, built directly on ``device`` (a 1.2B model is slow on CPU)."""

    def build() -> GPT:
        with torch.device(device):
            return GPT(gpt_config(shape, block))

    return bench_utils.build_seeded(build, seed).to(dtype=shape.dtype)


def count_parameters(shape: ModelShape, block: int) -> int:
    with torch.device("meta"):
        return GPT(gpt_config(shape, block)).num_parameters()


def make_optimizer(model: torch.nn.Module, lr: float, fused: bool) -> torch.optim.AdamW:
    """The demo's AdamW over its two groups (matrices with weight decay, biases and norms without)."""
    return bench_utils.demo_adamw(model.parameters(), lr, fused=fused)


def make_batches(
    corpus: torch.Tensor, count: int, batch: int, block: int, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of random windows of the corpus, the same for every configuration."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - block - 1, (count, batch), generator=generator)
    return [tuple(part.to(device) for part in bench_utils.windows(corpus, row, block)) for row in starts]


# ------------------------------------------------------------------------------------------------ calibration
def calibrate(
    shape: ModelShape, corpus: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> tuple[int, int, dict[str, Any]]:
    """Pick (batch, block): the most tokens per step whose fwd+bwd costs at most one fused AdamW step (CPU).

    Returns the choice and a record of every candidate measured. With ``--batch-size/--block-size`` (and on CUDA)
    nothing is chosen, only measured.
    """
    if args.batch_size is not None:
        candidates = [(args.batch_size, args.block_size)]
    elif device.type == "cuda":
        candidates = [(8, 1024)]
    else:
        token_counts = [16, 1] if args.quick else [256, 64, 16, 4, 2, 1]
        candidates = [
            (max(1, tokens // min(tokens, shape.max_block)), min(tokens, shape.max_block)) for tokens in token_counts
        ]
    model = build_model(shape, shape.max_block, args.seed, device)
    optimizer = make_optimizer(model, args.lr, fused=True)
    repeats = 3 if args.quick else 5
    # the fused AdamW step does not depend on the tokens: measure it once (its first call allocates the moments)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    adamw_s = bench_utils.time_median(optimizer.step, repeats, device=device)
    model.zero_grad(set_to_none=True)
    rows = []
    chosen = None
    for batch, block in candidates:
        ((x, y),) = make_batches(corpus, 1, batch, block, args.seed, device)

        def fwd_bwd(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            model.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()

        fwd_bwd_s = bench_utils.time_median(fwd_bwd, repeats, device=device)
        ratio = adamw_s / fwd_bwd_s
        rows.append(
            {
                "batch": batch,
                "block": block,
                "tokens": batch * block,
                "fwd_bwd_s": fwd_bwd_s,
                "adamw_s": adamw_s,
                "adamw_over_fwd_bwd": ratio,
            }
        )
        if ratio >= TARGET_HOST_OVER_FWD_BWD and chosen is None:
            chosen = (batch, block)
            break
    reached = chosen is not None
    if chosen is None:
        best = max(rows, key=lambda row: row["adamw_over_fwd_bwd"])
        chosen = (best["batch"], best["block"])
    record = {
        "candidates": rows,
        "chosen_batch": chosen[0],
        "chosen_block": chosen[1],
        "target_adamw_over_fwd_bwd": TARGET_HOST_OVER_FWD_BWD,
        "target_reached": reached,
        "skipped_search": args.batch_size is not None or device.type == "cuda",
    }
    return chosen[0], chosen[1], record


# ---------------------------------------------------------------------------------------------------- the runs
class Clock:
    """Step boundaries (``mark``) and spans (``span``, the no-offload baseline's optimizer step). CPU: ``perf_counter``
    (the loop runs synchronously). CUDA: events recorded on the compute stream, read after one
    ``torch.cuda.synchronize()`` at the end of the measurement window, so the timed loop has no host sync of its own;
    a gap between two events is GPU time, idle time included (a device waiting for the host shows as a longer step).
    """

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.spans: list[tuple[Any, Any]] = []

    def now(self) -> Any:
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.marks.append(self.now())

    @contextlib.contextmanager
    def span(self) -> Any:
        start = self.now()
        yield
        self.spans.append((start, self.now()))

    def seconds(self, pairs: Any) -> list[float]:
        return [a.elapsed_time(b) / 1000.0 if self.is_cuda else b - a for a, b in pairs]


def torchao_bytes(optimizer: Any) -> tuple[int | None, int | None]:
    """(device, host) bytes of a torchao CPUOffloadOptimizer: host params, grads and state; device optimizer."""
    try:
        host = 0
        for p_host in optimizer.param_d2h_map.values():
            host += p_host.nbytes + (p_host.grad.nbytes if p_host.grad is not None else 0)
        for inner in optimizer.optim_dict.values():
            host += bench_utils.optimizer_state_bytes(inner)
        device = bench_utils.optimizer_state_bytes(optimizer.d_opt) if optimizer.d_opt is not None else 0
    except AttributeError:
        return None, None
    return device, host


def run_spec(
    spec: Spec,
    shape: ModelShape,
    block: int,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    args: argparse.Namespace,
    device: torch.device,
    train_cores: list[int],
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps with one configuration; statistics cover the last ``steps`` only."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = build_model(shape, block, args.seed, device)
    if device.type == "cuda":
        # the peak from here on: weights, optimizer state, gradients, activations (not the fp32 build transient)
        torch.cuda.reset_peak_memory_stats(device)
    n_params = sum(p.numel() for p in model.parameters())
    engine: ZenFlowEngine | None = None
    optimizer: Any = None
    pin = None
    started = time.perf_counter()
    if spec.kind == "engine":
        # the engine pins itself to its training cores and starts the worker on the others
        optimizer = make_optimizer(model, args.lr, fused=False)  # only carries the param groups
        engine = ZenFlowEngine(optimizer, spec.config, param_names={p: n for n, p in model.named_parameters()})
        engine.start()
    elif spec.kind == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        optimizer = CPUOffloadOptimizer(
            bench_utils.decay_groups(model.parameters()),
            torch.optim.AdamW,
            offload_gradients=False,
            lr=args.lr,
            betas=(0.9, 0.95),
            fused=True,
        )
    elif spec.kind == "no-offload":
        optimizer = make_optimizer(model, args.lr, fused=True)
    if spec.kind in ("no-offload", "fwd+bwd") and device.type == "cpu":
        # the baselines get the training process's cores and threads, as the engine gives itself
        pin = bench_utils.pinned(train_cores)
        pin.__enter__()
    setup_s = time.perf_counter() - started
    clock = Clock(device)
    stats = []
    profiler = contextlib.nullcontext()
    if args.profile is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
    try:
        wall_s = 0.0
        for index, (x, y) in enumerate(batches):
            if index == warmup:
                if engine is not None:
                    # the steady state: the worker's compiled step is built (it runs eagerly until then)
                    engine.wait_for_builds()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # start of the measurement window: warm-up work has finished
                profiler.__enter__()
                wall_started = time.perf_counter()
            if engine is not None:
                engine.wait_for_update()  # the forward reads weights the last device update / upload wrote
            if index >= warmup:
                clock.mark()
            _, loss = model(x, y)
            loss.backward()
            if engine is not None:
                step_stats = engine.step()
                if index >= warmup:
                    stats.append(step_stats)
            elif optimizer is not None:
                if index >= warmup:
                    with clock.span():
                        optimizer.step()
                else:
                    optimizer.step()
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        if engine is not None:
            engine.wait_for_update()
        clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # end of the measurement window: every step's work has finished
        wall_s = time.perf_counter() - wall_started
        profiler.__exit__(None, None, None)
        if engine is not None:
            engine.flush()
    finally:
        if pin is not None:
            pin.__exit__(None, None, None)
        device_bytes = host_bytes = None
        if engine is not None:
            device_bytes, host_bytes = engine.device_bytes(), engine.host_bytes()
            engine.close()
    if args.profile is not None:
        sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort_by, row_limit=25))
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(args.profile))
        print(f"wrote a Chrome trace of {len(stats)} steps of {spec.name} to {args.profile}")
    step_s = clock.seconds(zip(clock.marks, clock.marks[1:]))
    result: dict[str, Any] = {
        "name": spec.name,
        "kind": spec.kind,
        "topk_ratio": spec.rho,
        "update_interval": spec.interval,
        "overlap_step": None if spec.config is None else spec.config.overlap_step,
        "interim_step": None if spec.config is None else spec.config.interim_step,
        "host_state": None if spec.config is None else spec.config.host_state,
        "setup_s": setup_s,
        "n_params": n_params,
        "step_s": step_s,
        "wall_s": wall_s,
        "final_loss": float(loss.detach().float()),
    }
    if spec.kind == "no-offload":
        result["device_update_s"] = clock.seconds(clock.spans)
        device_bytes, host_bytes = bench_utils.optimizer_state_bytes(optimizer), 0
    elif spec.kind == "torchao":
        device_bytes, host_bytes = torchao_bytes(optimizer)
    elif spec.kind == "engine":
        result["accumulate_on"] = stats[-1].accumulate_on if stats else None
        result["stall_s"] = [s.stall_s for s in stats]
        result["device_update_s"] = [s.device_update_s for s in stats if s.device_update_s is not None]
        result["host_update_s"] = [s.host_update_s for s in stats if s.host_update_s is not None]
        result["d2h_bytes"] = [s.d2h_bytes for s in stats]
        result["h2d_bytes"] = [s.h2d_bytes for s in stats]
        result["window_end"] = [s.window_end for s in stats]
        result["refreshed"] = [s.refreshed for s in stats]
    result["device_bytes"] = device_bytes
    result["host_bytes"] = host_bytes
    if device.type == "cuda":
        result["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    del model, optimizer, engine
    gc.collect()
    return result


# --------------------------------------------------------------------------------------------------------- main
def _span(cores: list[int]) -> str:
    """``[0..7]`` for a contiguous range of cores, the list otherwise."""
    if cores and cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 2:
        return f"[{cores[0]}..{cores[-1]}]"
    return str(cores)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = bench_utils.cuda_missing(
        args.device,
        ". Run without --device for the CPU surrogate, or on a machine with a GPU and a CUDA build of torch.",
    )
    if missing:
        raise SystemExit(missing)
    if args.device == "cuda" and args.quick:
        print("note: --quick with --device cuda keeps the 1.2B model and only shortens the run.")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    shape = model_shape(args)
    try:
        specs = build_specs(args)
    except (ValueError, TypeError) as error:  # ZenFlowConfig's validation names the option and the fix
        raise SystemExit(f"offload_bench: invalid engine settings: {error}") from None
    if args.device == "cuda":
        specs.sort(key=lambda spec: spec.name != "zenflow")  # the ZenFlow row first: a run cut short still has it
    intervals = sorted({s.interval for s in specs if s.interval is not None})
    lcm = math.lcm(*intervals) if intervals else 1
    bench_utils.apply_quick_defaults(args, {"warmup_steps": (8, 4), "steps": (16 if args.device == "cuda" else 32, 8)})
    # whole windows only, aligned with window ends, so bytes per step and stall are window averages
    warmup = bench_utils.whole_windows(args.warmup_steps, lcm)
    steps = bench_utils.whole_windows(max(args.steps, 1), lcm)

    info = bench_utils.announce(
        "offload_bench: ZenFlow vs no offload vs synchronous offload, one run, same model, data and seed", device
    )
    # the split every engine configuration makes (bind_cores=True, pt_reserved_cores_perc=0.5)
    train_cores, host_cores = ZenFlowConfig(bind_cores=True, pt_reserved_cores_perc=0.5).core_split()
    surrogate = device.type == "cpu"
    if surrogate:
        print(
            "CPU SURROGATE: there is no GPU. The training process plays the device and the host worker plays the CPU;\n"
            f"  they are pinned to disjoint cores: training process {train_cores} ({len(train_cores)} thread(s)), "
            f"host worker {host_cores} ({len(host_cores)} thread(s)).\n"
            f"  For a fair comparison the no-offload and fwd+bwd baselines also run on {train_cores} with "
            f"{len(train_cores)} thread(s). Model dtype fp32. 'PCIe' bytes are the bytes that would cross the link\n"
            "  (counted at the engine's copy sites); on the CPU they are memory copies."
        )
        if len(train_cores) == len(host_cores) == 1 and train_cores == host_cores:
            print("  WARNING: only one core is usable: both sides share it, and the comparison means little.")
    else:
        print(
            f"GPU run on {info['device_name']}: bf16 model. The engine pins the training process to cores "
            f"{_span(train_cores)} and the host worker to {_span(host_cores)} ({len(host_cores)} threads).\n"
            "  no-offload is torch.optim.AdamW(fused=True) on the bf16 parameters (bf16 moments on the device); "
            "torchao-offload is CPUOffloadOptimizer (bf16 host copies, fused CPU AdamW, synchronous step)."
        )

    corpus = load_corpus_bytes(None, 1_000_000)
    calibration_started = time.perf_counter()
    context = bench_utils.pinned(train_cores) if surrogate else contextlib.nullcontext()
    with context:
        batch, block, calibration = calibrate(shape, corpus, args, device)
    gc.collect()  # free the calibration model before the runs
    calibration["seconds"] = time.perf_counter() - calibration_started
    bench_utils.print_table(
        f"\nCalibration ({'fused AdamW step and fwd+bwd on the training cores' if surrogate else 'measured'}):",
        ["batch", "block", "tokens", "fwd+bwd ms", "AdamW ms", "AdamW/fwd+bwd"],
        [
            [c["batch"], c["block"], c["tokens"], c["fwd_bwd_s"] * 1e3, c["adamw_s"] * 1e3, c["adamw_over_fwd_bwd"]]
            for c in calibration["candidates"]
        ],
    )
    ratio = next(
        c["adamw_over_fwd_bwd"] for c in calibration["candidates"] if (c["batch"], c["block"]) == (batch, block)
    )
    print(
        f"chosen: batch {batch} x block {block} = {batch * block} tokens per step; "
        f"AdamW / fwd+bwd = {ratio:.2f} (target >= {TARGET_HOST_OVER_FWD_BWD})"
    )
    if surrogate and not calibration["target_reached"] and not calibration["skipped_search"]:
        print(
            f"  NOTE: no candidate reached AdamW/fwd+bwd >= {TARGET_HOST_OVER_FWD_BWD} on this machine; the "
            "surrogate under-represents the host bottleneck of a real GPU run (took the best ratio)."
        )

    n_params = count_parameters(shape, block)
    dtype_size = torch.empty((), dtype=shape.dtype).element_size()
    model_bytes = n_params * dtype_size
    print(
        f"\nmodel: GPT n_layer={shape.n_layer} n_embd={shape.n_embd} n_head={shape.n_head} block={block}, "
        f"{n_params / 1e6:.2f}M parameters, {str(shape.dtype).removeprefix('torch.')} "
        f"({model_bytes / 2**20:.1f} MiB); lr {args.lr}; seed {args.seed}"
    )
    print(
        f"steps: {warmup} warm-up steps excluded from the statistics, then {steps} measured steps per "
        f"configuration (multiples of every S in the run: {intervals})"
    )
    if args.select_interval is None:
        print("selection: the engine's default (select_strategy='auto'); outside a Trainer it selects once, at step 1")
    else:
        print(f"selection: refreshed every {args.select_interval} steps (select_strategy='step')")
    cuda_timing = "CUDA events on the compute stream at each step boundary, one synchronize per measurement window"
    print(f"timing: {'perf_counter at each step boundary (the CPU loop is synchronous)' if surrogate else cuda_timing}")

    batches = make_batches(corpus, warmup + steps, batch, block, args.seed + 1, device)
    # each configuration's raw record as it finishes (JSON lines), so a run killed by a timeout keeps its rows
    rows_path = args.out.with_suffix(".rows.jsonl")
    rows_path.unlink(missing_ok=True)
    bench_utils.append_jsonl(
        rows_path,
        {
            "record": "header",
            **bench_utils.payload(
                "offload_bench", info, batch=batch, block=block, warmup_steps=warmup, measured_steps=steps
            ),
        },
    )
    results: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    for spec in specs:
        if spec.kind == "torchao":
            try:
                import torchao.optim  # noqa: F401
            except ImportError:
                print(f"[{spec.name}] skipped: torchao is not importable (pip install torchao).")
                skipped.append({"name": spec.name, "reason": "torchao is not importable"})
                continue
        result, failure = bench_utils.attempt(
            spec.name, lambda spec=spec: run_spec(spec, shape, block, batches, warmup, args, device, train_cores)
        )
        if failure is not None:
            failures.append(failure)
            bench_utils.append_jsonl(rows_path, {"record": "failure", **failure})
            gc.collect()
            continue
        print(
            f" median {bench_utils.median(result['step_s']) * 1e3:.1f} ms "
            f"(setup {result['setup_s']:.1f} s, final loss {result['final_loss']:.3f})"
        )
        results.append(result)
        bench_utils.append_jsonl(rows_path, {"record": "row", **result})
    summary = summarize(results, model_bytes, n_params)
    print_report(results, summary, device.type == "cuda")
    ideal = next(iter(summary.values()))["ideal_speedup_over_sync_offload"] if summary else math.nan
    ideal_text = f"{ideal:.2f}x" if math.isfinite(ideal) else "- (this run has not both rows)"
    print(
        f"\nideal speedup over sync-offload = sync-offload / no-offload = {ideal_text}; 'of ideal' = speedup / ideal "
        "(= no-offload / step); 'gain recovered' = (speedup - 1) / (ideal - 1)."
    )
    print(
        "stall % = sum of StepStats.stall_s / wall time of the measured steps. step/(fb+dev) = median step over "
        "(median fwd+bwd + median device update of that row); for no-offload the device update is the AdamW step."
    )
    checks = target_checks(summary)
    if checks:
        print("targets (zenflow row): " + "; ".join(f"{k} = {bench_utils.fmt(v)}" for k, v in checks.items()))
    payload = bench_utils.payload(
        "offload_bench",
        info,
        cpu_surrogate=surrogate,
        surrogate_note=(
            "CPU surrogate: the training process plays the device and the host worker the CPU, pinned to disjoint "
            "cores; no-offload and fwd+bwd baselines run on the training cores with the same thread count; fp32 model "
            "shaped so that a full AdamW step costs at least one fwd+bwd (see calibration)."
            if surrogate
            else None
        ),
        timing_method="cuda_events_per_step" if not surrogate else "perf_counter_per_step",
        model={
            **{key: getattr(shape, key) for key in ("n_layer", "n_embd", "n_head")},
            **{"block": block, "batch": batch, "tokens_per_step": batch * block, "n_params": n_params},
            **{"dtype": str(shape.dtype).removeprefix("torch."), "model_bytes": model_bytes},
        },
        cores={"training_process": train_cores, "host_worker": host_cores},
        calibration=calibration,
        warmup_steps=warmup,
        measured_steps=steps,
        select_interval=args.select_interval,
        configs=[{**r, "summary": summary[r["name"]]} for r in results],
        targets=checks,
        failures=failures,
        skipped=skipped,
    )
    bench_utils.write_results(args.out, payload)
    if args.plot:
        title = (
            f"{'CPU surrogate' if surrogate else info['device_name']}: GPT {n_params / 1e6:.1f}M params, "
            f"{batch}x{block} tokens/step, {info['date']}"
        )
        plot(results, summary, args.out.with_suffix(".png"), title)
    return bench_utils.report_failures(failures, "configuration(s)", lambda f: f["name"])


if __name__ == "__main__":
    sys.exit(main())
