"""The planner's step time against measured steps, on the CPU stand-in of ``offload_bench.py``, side by side.

One run: ``offload_bench.py``'s stand-in (a wide fp32 GPT fed few tokens, the training process on half of the cores
playing the device, the host worker on the other half), its calibration of the tokens per step, then three of its
configurations trained as it trains them: forward and backward alone (T_fb, the one input the cost model does not
predict), synchronous offload and ZenFlow's defaults. The planner (``lightning_zenflow.plan``) then predicts the
step of both from the model's shapes, the measured T_fb and this machine's rates measured by ``plan --measure``
(``lightning_zenflow/planner/machine.py``: the engine's host step on the worker's cores, the memory copies and the
host add on the training process's). The target: each prediction within 25 % of the measured median.

    python benchmarks/plan_bench.py            # a few minutes on 2 quiet cores
    python benchmarks/plan_bench.py --quick    # small model, few steps, rates measured briefly: a smoke run
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time

import bench_utils
import offload_bench
import torch

from lightning_zenflow import plan
from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.demo import load_corpus_bytes
from lightning_zenflow.planner import Machine
from lightning_zenflow.planner.costs import Setting, Workload, evaluate
from lightning_zenflow.planner.machine import measure
from lightning_zenflow.planner.plan import _formats
from lightning_zenflow.planner.shapes import shapes_of

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "plan_bench.json"
TARGET = 0.25
"""Each predicted step within this fraction of the measured median."""
COMPARED = ("sync-offload", "zenflow")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="small model, few steps; the host step timed on 1M elements, the engine's device work not timed (the "
        "planner's estimate instead): a smoke run.",
        seed="",
    )
    parser.add_argument("--steps", type=int, default=None, help="measured steps per configuration (32; quick 8).")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps excluded (8; quick 4).")
    args = parser.parse_args(argv)
    return bench_utils.apply_quick_defaults(args, {"steps": (32, 8), "warmup_steps": (8, 4)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_args = offload_bench.parse_args(
        ["--no-sweep", "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    )
    bench_args.seed = args.seed
    device = torch.device("cpu")
    info = bench_utils.announce("plan_bench: the planner's step time against measured steps (CPU stand-in)", device)
    shape = offload_bench.model_shape(bench_args)
    train_cores, host_cores = ZenFlowConfig(bind_cores=True, pt_reserved_cores_perc=0.5).core_split()
    corpus = load_corpus_bytes(None, 1_000_000)
    with bench_utils.pinned(train_cores):
        batch, block, calibration = offload_bench.calibrate(shape, corpus, bench_args, device)
    gc.collect()
    specs = [s for s in offload_bench.build_specs(bench_args) if s.name in ("fwd+bwd", *COMPARED)]
    warmup = bench_utils.whole_windows(args.warmup_steps, 4)
    steps = bench_utils.whole_windows(args.steps, 4)
    batches = offload_bench.make_batches(corpus, warmup + steps, batch, block, args.seed + 1, device)
    measured: dict[str, float] = {}
    for spec in specs:
        result = offload_bench.run_spec(spec, shape, block, batches, warmup, bench_args, device, train_cores)
        measured[spec.name] = bench_utils.median(result["step_s"])
        print(f"  {spec.name}: median step {measured[spec.name] * 1e3:.1f} ms")
        gc.collect()

    model = offload_bench.build_model(shape, block, args.seed, torch.device("meta"))
    shapes = shapes_of(model)
    memory = 64 * 2**30
    started = time.perf_counter()
    machine = measure(
        Machine(device_type="cpu", device_memory=memory, host_memory=memory),
        _formats(ZenFlowConfig(), Workload("32-true")),
        **({"elements": 1 << 20, "device_work": False} if args.quick else {}),
    )
    measure_s = time.perf_counter() - started
    work = Workload("32-true", batch, block, fwd_bwd_s=measured["fwd+bwd"])
    rows = []
    for spec in specs[1:]:
        knobs = {k: getattr(spec.config, k) for k in ("topk_ratio", "update_interval", "overlap_step", "host_state")}
        knobs.update(accumulate_on=spec.config.accumulate_on, full_warm_up_rounds=0)
        row = evaluate(shapes, Setting(spec.name, "zenflow", "single", knobs), machine, work, 0)
        error = row.step_s / measured[spec.name] - 1
        rows.append(
            {
                "name": spec.name,
                "measured_s": measured[spec.name],
                "predicted_s": row.step_s,
                "error": error,
                "within_target": abs(error) <= TARGET,
                "accumulate_on": row.accumulate_on,
                "terms_s": row.times,
                "update_interval": row.interval,
            }
        )
    bench_utils.print_table(
        f"\nPredicted against measured step (T_fb measured: {measured['fwd+bwd'] * 1e3:.1f} ms; "
        f"{batch} x {block} tokens; fp32 GPT, {shapes.parameters / 1e6:.1f} M parameters)",
        ["setting", "measured ms", "predicted ms", "error", f"within {TARGET:.0%}", "worker ms", "copy down ms"],
        [
            [
                r["name"],
                r["measured_s"] * 1e3,
                r["predicted_s"] * 1e3,
                f"{r['error']:+.1%}",
                "yes" if r["within_target"] else "NO",
                r["terms_s"].get("worker", 0.0) * 1e3,
                r["terms_s"].get("copy_down", 0.0) * 1e3,
            ]
            for r in rows
        ],
    )
    print(f"rates measured by plan --measure ({measure_s:.1f} s):")
    for name, value in machine.measured.items():
        print(f"  {name}: {value:.4g}")
    # the plan's own table for this model on this machine, with the measured rates and T_fb
    table = plan(
        model, machine=machine, precision="32-true", batch_size=batch, block_size=block, fwd_bwd_s=measured["fwd+bwd"]
    )
    print("\n" + table.table())
    bench_utils.write_results(
        args.out,
        bench_utils.payload(
            "plan_bench",
            info,
            cores={"training_process": train_cores, "host_worker": host_cores},
            calibration=calibration,
            batch=batch,
            block=block,
            warmup_steps=warmup,
            measured_steps=steps,
            measured_s=measured,
            rates=machine.measured,
            rows=rows,
            target=TARGET,
        ),
    )
    return 0 if all(r["within_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
