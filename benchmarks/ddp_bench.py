"""Data-parallel ZenFlow: two ranks against one, same model, same global batch, same seed, side by side in one run.

The engine shards its host state by rows across data-parallel ranks (``lightning_zenflow/engine/ranks.py``): each
rank keeps, updates and moves only its row block of every matrix. This script measures what that buys per rank and
per machine. Two launches, one after the other, each running both accumulation modes (``device`` and ``host``) with
the ZenFlow defaults (``topk_ratio=0.1, update_interval=4``, overlap on):

- 1 rank:  the whole global batch (2b samples) per step;
- 2 ranks: b samples each (rank r takes the r-th half), gloo, the gradients all-reduced in one flat bucket and
  divided by the number of ranks, as DDP averages them; the engine gets ``Ranks.from_process_group(...)``.

Ranks are processes started with ``torch.multiprocessing`` (spawn), with a deadline: a rank that fails or hangs ends
the launch, and every rank still alive is killed. Each rank writes its records to a file; this process prints the
tables and writes the JSON. The model is a residual stack of MLP blocks (fp32, about 19.5 M parameters by default;
no Lightning import in the ranks), fed random inputs and regression targets that a seed fixes per step.

Reported per configuration and rank: host bytes the engine holds (and per machine: the sum over the ranks on it),
bytes per step down (d2h) and up (h2d) counted at the engine's copy sites (mean over the measured steps, and as a
fraction of the model's bytes), median and p99 step time, the all-reduce's median, the stall share; then the
2-rank / 1-rank ratios. The first steps are warm-up and excluded; the measured steps are whole windows.

What a 2-core CPU can say: the bytes are exact (they do not depend on the machine). The step times are not a GPU
prediction: with one rank the training process and its host worker each get a core; with two ranks each rank is
bound to one core, and its training thread and its host worker share it, so both ranks and both workers contend for
the same two cores, the gloo all-reduce runs on them too, and the "device" work (forward, backward, the device
update of the selected columns) is replicated CPU work. Read the times as a check that nothing stalls or
serializes, not as a speed-up.

    python benchmarks/ddp_bench.py            # about 19.5 M parameters, 8 warm-up + 32 measured steps (a few minutes)
    python benchmarks/ddp_bench.py --quick    # smoke run: device mode, 1.1 M parameters, < 60 s
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import bench_utils
import torch
import torch.multiprocessing as mp
from torch import nn

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "ddp_bench.json"
MODES = ("device", "host")
WORLDS = (1, 2)
HELD_OUT_STEP = 10**6
"""The held-out batch is the one a step of this number would see (no run gets there)."""
GROUP_TIMEOUT = datetime.timedelta(seconds=120)
"""A collective that waits longer than this fails the rank (the other rank died or hung)."""


# ------------------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(parser, out=DEFAULT_OUT, quick="small model, few steps: a < 60 s smoke run.", seed="")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=None,
        help="accumulation modes (default both; device with --quick).",
    )
    parser.add_argument("--width", type=int, default=None, help="block width d (default 768; 256 with --quick).")
    parser.add_argument("--layers", type=int, default=None, help="MLP blocks (default 4; 2 with --quick).")
    parser.add_argument("--batch", type=int, default=4, help="samples per rank at 2 ranks (b); 1 rank takes 2b.")
    parser.add_argument("--tokens", type=int, default=8, help="positions per sample.")
    parser.add_argument("--warmup-steps", type=int, default=None, help="excluded steps (default 8; 4 quick).")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 32; 8 quick).")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--deadline-s", type=float, default=None, help="per launch (default 900; 240 quick).")
    args = bench_utils.apply_quick_defaults(
        parser.parse_args(argv),
        {
            "modes": (list(MODES), ["device"]),
            "width": (768, 256),
            "layers": (4, 2),
            "warmup_steps": (8, 4),
            "steps": (32, 8),
            "deadline_s": (900.0, 240.0),
        },
    )
    interval = 4  # ZenFlowConfig's default update_interval: warm-up and measurement are whole windows
    args.warmup_steps = bench_utils.whole_windows(args.warmup_steps, interval)
    args.steps = bench_utils.whole_windows(max(args.steps, 1), interval)
    return args


# ---------------------------------------------------------------------------------------------- model and data
class MLPStack(nn.Module):
    """Residual MLP blocks (LayerNorm, d -> 4d, GELU, 4d -> d) and a d -> d head: a transformer's MLP half."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = inputs
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(self.norm(hidden))


def build_model(args: argparse.Namespace) -> MLPStack:
    # the same initial weights at every rank count
    return bench_utils.build_seeded(lambda: MLPStack(args.width, args.layers), args.seed)


def global_batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2b samples of step ``step`` (the same at every rank count)."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    shape = (2 * args.batch, args.tokens, args.width)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


# ------------------------------------------------------------------------------------------------------- a rank
def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    """One rank (a module-level target, so spawn can pickle it): every mode in turn, records to ``out_dir``."""
    import torch.distributed as dist

    records: list[dict[str, Any]] = []
    path = pathlib.Path(out_dir) / f"world{world}_rank{rank}.json"
    try:
        cores = bench_utils.available_cores()
        if world > 1 and len(cores) >= world:
            # what a launcher's binding does: rank r gets the r-th slice; its training thread and worker share it
            share = len(cores) // world
            os.sched_setaffinity(0, cores[rank * share : (rank + 1) * share])
        torch.set_num_threads(len(bench_utils.available_cores()))
        if world > 1:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=GROUP_TIMEOUT
            )
        for mode in args.modes:
            records.append(run_mode(rank, world, mode, args))
            write_records(path, records)  # after each mode: a launch killed later keeps what finished
    except BaseException:
        records.append({"rank": rank, "world": world, "error": traceback.format_exc()})
        write_records(path, records)
        raise
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def write_records(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(records))
    partial.replace(path)


def run_mode(rank: int, world: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``warmup + steps`` steps in one accumulation mode; statistics cover the last ``steps`` only."""
    import torch.distributed as dist

    from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
    from lightning_zenflow.engine.ranks import Ranks

    model = build_model(args)
    params = list(model.parameters())
    # only carries the param groups and hyperparameters (torch's default betas); the engine steps
    optimizer = torch.optim.AdamW(bench_utils.decay_groups(params), lr=args.lr)
    engine = ZenFlowEngine(
        optimizer,
        # the defaults otherwise (topk_ratio 0.1, update_interval 4, overlap on), without the warm-up: the steady state
        ZenFlowConfig(full_warm_up_rounds=0, accumulate_on=mode),
        param_names={p: n for n, p in model.named_parameters()},
        ranks=Ranks.from_process_group(local_rank=rank, local_world=world),
    ).start()
    flat_grad = torch.empty(sum(p.numel() for p in params))
    step_marks: list[float] = []
    allreduce_s: list[float] = []
    stats = []
    try:
        training_cores = sorted(os.sched_getaffinity(0))
        worker_cores = sorted(os.sched_getaffinity(engine.worker_pid)) if engine.worker_pid else None
        for index in range(args.warmup_steps + args.steps):
            if index == args.warmup_steps:
                engine.wait_for_builds()  # the steady state: the worker's compiled step is built
                if world > 1:
                    dist.barrier()  # waits for the other rank: both start the measured window together
            engine.wait_for_update()  # the forward reads weights the last device update / upload wrote
            if index >= args.warmup_steps:
                step_marks.append(time.perf_counter())
            inputs, targets = global_batch(args, index)
            rows = slice(rank * args.batch * 2 // world, (rank + 1) * args.batch * 2 // world)
            loss = (model(inputs[rows]) - targets[rows]).square().mean()
            loss.backward()
            if world > 1:
                started = time.perf_counter()
                torch.cat([p.grad.reshape(-1) for p in params], out=flat_grad)
                # waits for every rank's gradient: DDP's bucket all-reduce, here one bucket after the backward
                dist.all_reduce(flat_grad)
                flat_grad /= world
                offset = 0
                for p in params:
                    p.grad.copy_(flat_grad[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                if index >= args.warmup_steps:
                    allreduce_s.append(time.perf_counter() - started)
            step_stats = engine.step()
            if index >= args.warmup_steps:
                stats.append(step_stats)
            optimizer.zero_grad(set_to_none=True)
        engine.wait_for_update()
        step_marks.append(time.perf_counter())
        engine.flush()
        engine.wait_for_update()
        with torch.no_grad():
            inputs, targets = global_batch(args, HELD_OUT_STEP)  # the same at every rank count
            eval_loss = float((model(inputs) - targets).square().mean())
            checksum = float(sum(p.double().sum() for p in params))
        host_bytes, device_bytes = engine.host_bytes(), engine.device_bytes()
    finally:
        engine.close()
    return {
        "rank": rank,
        "world": world,
        "mode": mode,
        "accumulate_on": stats[-1].accumulate_on,
        "samples_per_step": args.batch * 2 // world,
        "training_cores": training_cores,
        "worker_cores": worker_cores,
        "host_bytes": host_bytes,
        "device_bytes": device_bytes,
        "step_s": [b - a for a, b in zip(step_marks, step_marks[1:])],
        "wall_s": step_marks[-1] - step_marks[0],
        "stall_s": [s.stall_s for s in stats],
        "d2h_bytes": [s.d2h_bytes for s in stats],
        "h2d_bytes": [s.h2d_bytes for s in stats],
        "window_end": [s.window_end for s in stats],
        "allreduce_s": allreduce_s,
        "eval_loss": eval_loss,
        "weights_checksum": checksum,
    }


# ------------------------------------------------------------------------------------------------------ launches
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def engine_only_imports() -> Iterator[None]:
    """Set ``LIGHTNING_ZENFLOW_HOST_WORKER=1`` here and in every rank started inside, restore the environment after.

    The ranks run the engine only: the package then skips its Lightning import (seconds per process)."""
    saved = dict(os.environ)
    os.environ["LIGHTNING_ZENFLOW_HOST_WORKER"] = "1"
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def launch(world: int, args: argparse.Namespace, out_dir: pathlib.Path) -> dict[str, Any]:
    """Run ``world`` ranks; their records, exit codes and wall time. Ends (kills) every rank by the deadline."""
    context = mp.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=rank_main, args=(rank, world, port, args, str(out_dir))) for rank in range(world)
    ]
    started = time.perf_counter()
    for process in processes:
        process.start()
    deadline = started + args.deadline_s
    try:
        # waits for the ranks to exit; a rank that fails ends the launch at once (the others would wait for it)
        while time.perf_counter() < deadline and any(p.is_alive() for p in processes):
            if any(p.exitcode not in (None, 0) for p in processes):
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(10)  # waits for the killed or finished rank to be reaped
    records, errors = [], []
    for rank in range(world):
        path = out_dir / f"world{world}_rank{rank}.json"
        for record in json.loads(path.read_text()) if path.exists() else []:
            (errors if "error" in record else records).append(record)
    codes = [p.exitcode for p in processes]
    timed_out = time.perf_counter() >= deadline and codes != [0] * world
    return {"world": world, "exit_codes": codes, "timed_out": timed_out, "wall_s": time.perf_counter() - started,
            "records": records, "errors": errors}  # fmt: skip


# ------------------------------------------------------------------------------------------------------- summary
def summarize(record: dict[str, Any], model_bytes: int) -> dict[str, Any]:
    steps = record["step_s"]
    d2h = sum(record["d2h_bytes"]) / len(record["d2h_bytes"])
    h2d = sum(record["h2d_bytes"]) / len(record["h2d_bytes"])
    return {
        "host_bytes": record["host_bytes"],
        "device_bytes": record["device_bytes"],
        "d2h_bytes_per_step": d2h,
        "h2d_bytes_per_step": h2d,
        "d2h_over_model_bytes": d2h / model_bytes,
        "h2d_over_model_bytes": h2d / model_bytes,
        "median_step_s": bench_utils.median(steps),
        "p99_step_s": bench_utils.percentile(steps, 99),
        "median_allreduce_s": bench_utils.median(record["allreduce_s"]) if record["allreduce_s"] else None,
        "stall_share": sum(record["stall_s"]) / record["wall_s"],
    }


def ratios(one: list[dict[str, Any]], two: list[dict[str, Any]]) -> dict[str, float]:
    """2 ranks / 1 rank for one mode: per rank (the mean of the two ranks), per machine (the sum), step times (the
    slowest rank: the job waits for it)."""

    def mean(key: str) -> float:
        return sum(s[key] for s in two) / len(two)

    base = one[0]
    return {
        "host_bytes_per_rank": mean("host_bytes") / base["host_bytes"],
        "host_bytes_per_machine": sum(s["host_bytes"] for s in two) / base["host_bytes"],
        "device_bytes_per_rank": mean("device_bytes") / base["device_bytes"],
        "d2h_per_rank": mean("d2h_bytes_per_step") / base["d2h_bytes_per_step"],
        "h2d_per_rank": mean("h2d_bytes_per_step") / base["h2d_bytes_per_step"],
        "median_step": max(s["median_step_s"] for s in two) / base["median_step_s"],
        "p99_step": max(s["p99_step_s"] for s in two) / base["p99_step_s"],
    }


def print_tables(summary: dict[str, dict[str, Any]], ratio_rows: dict[str, dict[str, float]]) -> None:
    mib = 2**20
    rows = []
    for s in summary.values():
        rows.append(
            [
                s["mode"], s["world"], s["rank"], s["samples_per_step"], s["host_bytes"] / mib,
                s["device_bytes"] / mib, s["d2h_bytes_per_step"] / mib, s["h2d_bytes_per_step"] / mib,
                s["d2h_over_model_bytes"], s["h2d_over_model_bytes"], s["median_step_s"] * 1e3,
                s["p99_step_s"] * 1e3, None if s["median_allreduce_s"] is None else s["median_allreduce_s"] * 1e3,
                100 * s["stall_share"], s["eval_loss"],
            ]
        )  # fmt: skip
    headers = ["mode", "ranks", "rank", "samples", "host MiB", "device MiB", "d2h MiB/step", "h2d MiB/step",
               "d2h/model", "h2d/model", "median ms", "p99 ms", "all-reduce ms", "stall %", "eval loss"]  # fmt: skip
    bench_utils.print_table(
        "\nPer rank (link bytes: mean over the measured steps, counted at the engine's copy sites):", headers, rows
    )
    machine_rows = []
    for mode, r in ratio_rows.items():
        one = summary[f"{mode} 1/0"]
        two = [s for s in summary.values() if s["mode"] == mode and s["world"] == 2]
        machine_rows.append(
            [
                mode, one["host_bytes"] / mib, sum(s["host_bytes"] for s in two) / mib, r["host_bytes_per_rank"],
                r["host_bytes_per_machine"], r["device_bytes_per_rank"], r["d2h_per_rank"], r["h2d_per_rank"],
                r["median_step"], r["p99_step"], r["eval_loss_relative_difference"],
                r["weights_sum_relative_difference"],
            ]
        )  # fmt: skip
    headers = ["mode", "host MiB 1 rank", "host MiB 2 ranks (sum)", "host/rank", "host/machine", "device/rank",
               "d2h/rank", "h2d/rank", "median step", "p99 step", "eval loss diff", "weight sum diff"]  # fmt: skip
    bench_utils.print_table(
        "\nPer machine and 2 ranks / 1 rank (per rank: mean of the ranks; step times: the slower rank):",
        headers,
        machine_rows,
    )


# --------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with engine_only_imports():
        return run(args)


def run(args: argparse.Namespace) -> int:
    info = bench_utils.announce(
        "ddp_bench: data-parallel ZenFlow, 2 ranks (gloo, CPU) against 1 rank, same global batch, model and seed",
        torch.device("cpu"),
    )
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = n_params * 4
    del model
    print(
        f"model: {args.layers} MLP blocks of width {args.width} and a head, {n_params / 1e6:.2f}M parameters, fp32 "
        f"({model_bytes / 2**20:.1f} MiB); global batch {2 * args.batch} x {args.tokens} positions (1 rank: all of "
        f"it; 2 ranks: {args.batch} samples each, gradients all-reduced and averaged); lr {args.lr}; seed {args.seed}"
    )
    print(
        f"ZenFlow defaults (topk_ratio 0.1, update_interval 4, overlap on), modes {args.modes}; {args.warmup_steps} "
        f"warm-up steps excluded, then {args.steps} measured steps (whole windows)"
    )
    print(
        "CPU ONLY: the bytes are exact; the times are not a GPU prediction. 1 rank: training process and host\n"
        "  worker on their own cores (the engine's split). 2 ranks: each bound to its share of the cores, its\n"
        "  training thread and its host worker sharing it; forward, backward and the device update are replicated."
    )
    launches, failures = [], []
    with tempfile.TemporaryDirectory(prefix="ddp_bench_") as out_dir:
        for world in WORLDS:
            print(f"[{world} rank{'s' if world > 1 else ''}] running ...", end="", flush=True)
            result = launch(world, args, pathlib.Path(out_dir))
            print(f" {result['wall_s']:.1f} s, exit codes {result['exit_codes']}")
            launches.append(result)
            if result["exit_codes"] != [0] * world:
                why = "deadline passed" if result["timed_out"] else f"exit codes {result['exit_codes']}"
                detail = "; ".join(e["error"].strip().splitlines()[-1] for e in result["errors"])
                failures.append({"world": world, "error": f"{why}: {detail}" if detail else why})
                print(f"  FAILED: {failures[-1]['error']}")
    records = sorted((r for launch_ in launches for r in launch_["records"]), key=lambda r: (r["mode"], r["world"]))
    summary = {
        f"{r['mode']} {r['world']}/{r['rank']}": {
            **{k: r[k] for k in ("mode", "world", "rank", "samples_per_step", "eval_loss", "weights_checksum")},
            **summarize(r, model_bytes),
        }
        for r in records
    }
    ratio_rows = {}
    for mode in args.modes:
        one = [s for s in summary.values() if s["mode"] == mode and s["world"] == 1]
        two = [s for s in summary.values() if s["mode"] == mode and s["world"] == 2]
        if one and len(two) == 2:
            ratio_rows[mode] = ratios(one, two)
            # the same training up to the order of float additions (the all-reduce's average, per-rank kernels)
            ratio_rows[mode]["eval_loss_relative_difference"] = abs(two[0]["eval_loss"] / one[0]["eval_loss"] - 1)
            ratio_rows[mode]["weights_sum_relative_difference"] = abs(
                two[0]["weights_checksum"] / one[0]["weights_checksum"] - 1
            )
    if summary:
        print_tables(summary, ratio_rows)
    print(
        "\ndiffs: relative, 2 ranks against 1, of the held-out loss and of the sum of all weights after the flush.\n"
        "host MiB: engine.host_bytes() of each rank (its row blocks of the host state, plus the pinned staging in\n"
        "host mode); the worker maps the same shared pages. Link bytes cross the host-device link only; the rows a\n"
        "rank receives from the others at each window landing (Ranks.share_rows, gloo here) are not in them."
    )
    load = info["load_average_at_end"] = bench_utils.load_average()
    if load:
        print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    payload = bench_utils.payload(
        "ddp_bench",
        info,
        note=(
            "CPU only, gloo. Bytes are exact. Times: 1 rank has the training process and the host worker on their "
            "own cores; 2 ranks share the same cores (each rank's training thread and worker on one core), so step "
            "times are not a GPU prediction."
        ),
        settings={
            **bench_utils.settings_of(args, skip=("out", "steps")),
            **{"n_params": n_params, "model_bytes": model_bytes, "dtype": "float32", "global_batch": 2 * args.batch},
            **{"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True, "measured_steps": args.steps},
        },
        launches=[{k: v for k, v in launch_.items() if k != "records"} for launch_ in launches],
        records=records,
        summary=summary,
        ratios_2_over_1=ratio_rows,
        failures=failures,
    )
    bench_utils.write_results(args.out, payload)
    return bench_utils.report_failures(failures, "launch(es)", lambda f: f"{f['world']} ranks")


if __name__ == "__main__":
    sys.exit(main())
