"""What the interim moves cost: the step of the defaults against the paper's rule and synchronous offload, and the
moves' own passes against one fused AdamW step over the same parameters, side by side in one run.

The CPU stand-in for the GPU regime: a stack of ``--layers`` square ``--width`` x ``--width`` fp32 ``Linear``
layers (default four 2048 x 2048, 16.8 M parameters), fed ``--batch`` x ``--tokens`` rows per step; the training
process runs on one core and the host worker on the other (``bind_cores``), and the in-process rows (``fwd+bwd``,
``adamw``) run pinned to the training core with one thread. Every configuration runs ``--repeats`` times,
interleaved (A B C ... A B C ...), so a drift of the machine reaches them all alike.

Table 1, the step (median ms over the measured steps of all repeats; mean too, since the moves' statistics take one
step of each window):

- ``fwd+bwd``        forward and backward only;
- ``adamw``          ``torch.optim.AdamW(fused=True)`` in the training process;
- ``sync-offload``   the engine with ``topk_ratio=0, update_interval=1, overlap_step=False``;
- ``paper``          the engine's defaults with ``interim_step=0`` (the paper's rule);
- ``defaults``       the engine's defaults (interim moves, compiled kernels where a compiler is found);
- ``defaults eager`` the same with ``interim_kernel="eager"``.

Table 2, the passes alone on the training core (median ms per step; one window of ``S`` steps is one statistics
pass and ``S`` moves): one fused AdamW step over the matrices; the moves compiled and eager, fp32 and bf16 weights
(bf16 gradients), the compiled ones also split into their move pass and their statistics pass; and the rule before
this version (ten unfused passes with a gather and a scatter, every step).

On CUDA (``--device cuda``) only table 2 runs, on the GPU (default eight 4096 x 4096 matrices, 134 M elements): the
kernels built by Triton from the same source, against torch's fused AdamW on the GPU.

    python benchmarks/moves_bench.py                 # about 1 minute on 2 cores
    python benchmarks/moves_bench.py --quick         # smoke run, < 1 minute
    python benchmarks/moves_bench.py --device cuda   # the passes on one GPU, < 1 minute
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time
from typing import Any

import bench_train
import bench_utils
import torch

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.engine.interim import MatrixStatistics, derive_scales, update_statistics
from lightning_zenflow.engine.kernels import Kernels, compiler_missing

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "moves_bench.json"


def parse_args(argv: list[str] | None = None) -> Any:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="small layers, few steps: a smoke run.",
        seed="",
        device=("cpu", "cuda"),
        device_help="cpu: both tables on the CPU stand-in; cuda: the passes on the GPU.",
    )
    parser.add_argument("--layers", type=int, default=None, help="square Linear layers (default 4; quick 2).")
    parser.add_argument("--width", type=int, default=None, help="their width (default 2048; quick 256).")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None, help="rows per sequence (default 16; quick 4).")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 32; quick 8).")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs per row (default 2; quick 1).")
    parser.add_argument("--interval", type=int, default=4, help="update_interval S of the engine rows.")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.quick:
        args.layers = args.layers or 8
        args.width = args.width or 4096
    return bench_utils.apply_quick_defaults(
        args,
        {"layers": (4, 2), "width": (2048, 256), "tokens": (16, 4), "steps": (32, 8), "repeats": (2, 1)},
    )


def build_model(args: Any) -> torch.nn.Sequential:
    torch.manual_seed(args.seed)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def batches(args: Any, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.tokens, args.width)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(count)]


def configs(args: Any) -> dict[str, ZenFlowConfig | None]:
    base = ZenFlowConfig(full_warm_up_rounds=0, update_interval=args.interval, bind_cores=True)
    return {
        "fwd+bwd": None,
        "adamw": None,
        "sync-offload": base.replace(topk_ratio=0.0, update_interval=1, overlap_step=False, accumulate_on="host"),
        "paper": base.replace(interim_step=0),
        "defaults": base,
        "defaults eager": base.replace(interim_kernel="eager"),
    }


def run_row(name: str, config: ZenFlowConfig | None, args: Any, data: list, warmup: int) -> list[float]:
    """Train ``warmup + steps`` steps; the step times (s) of the last ``steps``."""
    model = build_model(args)
    loss_fn = torch.nn.functional.mse_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times: list[float] = []
    if config is None:
        with bench_utils.pinned([0], threads=1):
            for index, (x, y) in enumerate(data):
                started = time.perf_counter()
                loss_fn(model(x), y).backward()
                if name == "adamw":
                    optimizer.step()
                optimizer.zero_grad()
                if index >= warmup:
                    times.append(time.perf_counter() - started)
        return times
    names = {p: n for n, p in model.named_parameters()}
    with ZenFlowEngine(optimizer, config, param_names=names) as engine:
        for index, (x, y) in enumerate(data):
            started = time.perf_counter()
            engine.wait_for_update()  # the forward reads the weights the last update wrote
            loss_fn(model(x), y).backward()
            engine.step()
            optimizer.zero_grad()
            if index >= warmup:
                times.append(time.perf_counter() - started)
        engine.flush()
    return times


def pass_times(args: Any, device: torch.device) -> dict[str, float]:
    """Median ms per step of each pass over the model's matrices: on one core with one thread, or on the GPU."""
    shapes = [(args.width, args.width)] * args.layers
    generator = torch.Generator().manual_seed(args.seed)
    grads = [(torch.randn(shape, generator=generator) * 1e-3).to(device) for shape in shapes]
    weights = [(torch.randn(shape, generator=generator) * 0.02).to(device) for shape in shapes]
    k = max(1, round(0.1 * args.width))
    unselected = torch.arange(k, args.width, device=device)
    cuda = device.type == "cuda"
    interval = args.interval
    results: dict[str, float] = {}

    def timed(fn: Any, repeats: int = 10) -> float:
        return bench_train.time_median(fn, repeats, warmups=2, device=device) * 1e3

    with bench_utils.pinned([0], threads=1) if not cuda else contextlib.nullcontext():
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
        results["fused AdamW step"] = timed(adamw.step)
        modes = ("compiled", "eager") if compiler_missing(device) is None else ("eager",)  # no compiler: eager only
        for mode in modes:
            kernels = Kernels(mode, device)
            for dtype in (torch.float32, torch.bfloat16):
                if dtype == torch.bfloat16 and mode == "eager" and not args.quick and not cuda:
                    continue  # minutes of bf16 elementwise work on this CPU; the compiled row is the one used
                g = [x.to(dtype) for x in grads]
                w = [x.to(dtype) for x in weights]
                stats = [_statistics(shape, unselected, device) for shape in shapes]
                seed = torch.zeros((), dtype=torch.int64, device=device)
                keep = torch.ones((), device=device)  # the engine's keep without a loss scaler

                def window(g=g, w=w, stats=stats, kernels=kernels, seed=seed, keep=keep) -> None:
                    for step in range(interval):
                        for grad2d, weight2d, st in zip(g, w, stats):
                            if step == 0:
                                update_statistics(kernels, grad2d, st, int(unselected.numel()), 0.999**interval, keep)
                                derive_scales(st)
                            args_ = (grad2d, weight2d, st.row_scale, st.col_scale, st.move_mask, 1e-8, 1e-4, keep)
                            if weight2d.dtype == torch.bfloat16:
                                kernels.moves_bf16_(*args_, 0, seed)
                            else:
                                kernels.moves_fp32_(*args_)

                label = f"moves {mode} {'fp32' if dtype == torch.float32 else 'bf16'}"
                results[label] = timed(window, repeats=5) / interval
                if mode == "compiled":
                    # the two parts of that mean: one move pass (every step), one statistics pass (once a window)
                    def move_only(g=g, w=w, stats=stats, kernels=kernels, seed=seed, keep=keep) -> None:
                        for grad2d, weight2d, st in zip(g, w, stats):
                            args_ = (grad2d, weight2d, st.row_scale, st.col_scale, st.move_mask, 1e-8, 1e-4, keep)
                            if weight2d.dtype == torch.bfloat16:
                                kernels.moves_bf16_(*args_, 0, seed)
                            else:
                                kernels.moves_fp32_(*args_)

                    def sums_only(g=g, stats=stats, kernels=kernels) -> None:
                        for grad2d, st in zip(g, stats):
                            kernels.row_col_sums(grad2d, st.host_mask)

                    results[f"{label}: the move pass"] = timed(move_only)
                    results[f"{label}: the statistics pass (once a window)"] = timed(sums_only)
        rows = [torch.zeros(args.width, device=device) for _ in shapes]
        cols = [torch.zeros(args.width, device=device) for _ in shapes]

        def previous_rule() -> None:
            for grad2d, weight2d, row, col in zip(grads, weights, rows, cols):
                _previous_moves(grad2d, weight2d, unselected, row, col)

        results["moves before (unfused, every step)"] = timed(previous_rule, repeats=5)
    return results


def _statistics(shape: tuple[int, int], unselected: torch.Tensor, device: torch.device) -> MatrixStatistics:
    stats = MatrixStatistics(
        row=torch.zeros(shape[0], device=device),
        col=torch.zeros(shape[1], device=device),
        decay=torch.ones((), device=device),
        moves=torch.zeros((), device=device),
        salt=0,
    )
    stats.host_mask = torch.zeros(shape[1], device=device).index_fill_(0, unselected, 1.0)
    stats.mask_of = unselected
    return stats


def _previous_moves(
    grad2d: torch.Tensor, weight2d: torch.Tensor, unselected: torch.Tensor, row: torch.Tensor, col: torch.Tensor
) -> None:
    """The moves as the previous version ran them at every step: gather, statistics, denominator, scatter."""
    g = grad2d.index_select(1, unselected).float()
    squared = g.square()
    row.mul_(0.999).add_(squared.mean(dim=1) * 0.001)
    col_host = col.index_select(0, unselected) * 0.999 + squared.mean(dim=0) * 0.001
    col.index_copy_(0, unselected, col_host)
    del squared
    row_scale = (row / row.mean().clamp_min(1e-30)).sqrt()
    denom = torch.outer(row_scale, col_host.sqrt()).add_(1e-8)
    weight2d.index_add_(1, unselected, g.div_(denom).clamp_(-1.0, 1.0).mul_(-1e-4))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    missing = bench_utils.cuda_missing(args.device, "; run it with --device cpu for the CPU stand-in.")
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    info = bench_utils.announce("moves_bench: the interim moves' cost, side by side", device)
    if device.type == "cuda":
        passes = pass_times(args, device)
        _print_passes(passes, f"{args.layers} x [{args.width}, {args.width}] on the GPU")
        bench_utils.write_results(
            args.out,
            bench_utils.payload(
                "moves_bench", info, revision=True, settings=bench_utils.settings_of(args), pass_ms=passes
            ),
        )
        return 0
    warmup = 2 * args.interval
    data = batches(args, warmup + args.steps)
    rows = configs(args)
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for repeat in range(args.repeats):
        for name, config in rows.items():
            print(f"[{name}] run {repeat + 1} ...", flush=True)
            samples[name] += run_row(name, config, args, data, warmup)
    n_params = args.layers * args.width * args.width
    paper = bench_utils.median(samples["paper"])
    sync = bench_utils.median(samples["sync-offload"])
    step_rows = []
    for name, values in samples.items():
        med = bench_utils.median(values)
        mean = sum(values) / len(values)
        step_rows.append([name, med * 1e3, mean * 1e3, med / paper, sync / med])
    bench_utils.print_table(
        f"\nThe step, {args.layers} x [{args.width}, {args.width}] fp32 ({n_params / 1e6:.1f} M parameters), batch "
        f"{args.batch} x {args.tokens}, S = {args.interval}, {args.repeats} interleaved runs of {args.steps} steps",
        ["row", "median ms", "mean ms", "x paper", "speed-up over sync"],
        step_rows,
        digits=2,
    )
    passes = pass_times(args, device)
    _print_passes(passes, "one core, one thread")
    step_ms = {
        name: {"median": bench_utils.median(v) * 1e3, "mean": sum(v) / len(v) * 1e3} for name, v in samples.items()
    }
    bench_utils.write_results(
        args.out,
        bench_utils.payload(
            "moves_bench", info, revision=True, settings=bench_utils.settings_of(args), step_ms=step_ms, pass_ms=passes
        ),
    )
    return 0


def _print_passes(passes: dict[str, float], where: str) -> None:
    adamw = passes["fused AdamW step"]
    bench_utils.print_table(
        f"\nThe passes alone, {where} (ms per step)",
        ["pass", "ms per step", "x fused AdamW step"],
        [[name, value, value / adamw] for name, value in passes.items()],
        digits=2,
    )


if __name__ == "__main__":
    raise SystemExit(main())
