"""Start-up: what a ``Trainer.fit`` costs beyond its steps with ZenFlow, against plain AdamW, side by side.

Each row runs in a process of its own: three fits of ``--steps`` steps in that process, timed from ``Trainer(...)`` to
the end of ``fit``; a fit's extra time is ZenFlow's minus AdamW's fit with the same index. ``small``: a two-layer
model (2.2 k parameters) whose kernels run eagerly under ``interim_kernel="auto"`` (nothing to build); ``large``: two
2048 x 2048 matrices, whose kernels "auto" compiles (``engine/compiled.py``), with torch's compile cache warm and
empty (a fresh ``TORCHINDUCTOR_CACHE_DIR``). Later fits adopt the first one's worker (``engine/spares.py``) and reuse
the builds. The second table breaks the first ZenFlow fit's start down: the worker's start, the host buffers, each
kernel build, the close.

    python benchmarks/startup_bench.py            # all rows, ~1.5 minutes on 2 cores
    python benchmarks/startup_bench.py --quick    # the small model only, < 30 s
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import bench_utils

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "startup_bench.json"
FITS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(parser, out=DEFAULT_OUT, quick="the small model only (< 30 s).")
    parser.add_argument("--steps", type=int, default=16, help="steps per fit (default 16).")
    parser.add_argument("--child", nargs=3, metavar=("STRATEGY", "SIZE", "STEPS"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(strategy: str, size: str, steps: int) -> dict[str, Any]:
    """Three fits in this process; prints their times and the first ZenFlow fit's breakdown as one JSON line."""
    import warnings

    warnings.filterwarnings("ignore")
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zenflow
    from lightning_zenflow.engine import compiled, host, lifecycle

    inputs, width, out = (32, 64, 1) if size == "small" else (2048, 2048, 2048)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, out))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = DataLoader(TensorDataset(torch.randn(16 * steps, inputs), torch.randn(16 * steps, out)), batch_size=16)
    clocks: dict[str, float] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = original(*args, **kwargs)
            clocks.setdefault(label, time.perf_counter() - started)  # the first fit's
            return result

        setattr(owner, name, wrapper)

    timed(host.HostWorker, "__init__", "worker start (spawn or adoption, imports, ready)")
    timed(lifecycle, "allocate_host_buffers", "host buffers (shared memory)")
    timed(host.HostWorker, "close", "worker close (stop, or release as a spare)")
    times = []
    for _ in range(FITS):
        started = time.perf_counter()
        chosen: Any = "auto" if strategy == "auto" else lightning_zenflow.ZenFlowStrategy(full_warm_up_rounds=2)
        quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
        trainer = L.Trainer(max_steps=steps, strategy=chosen, accelerator="cpu", devices=1, **quiet)
        trainer.fit(Model(), data)
        times.append(time.perf_counter() - started)
    builds = [(name, seconds) for name, seconds in compiled.BUILD_LOG.builds]
    return {"fits_s": times, "breakdown_s": clocks, "builds": builds}


def run_row(strategy: str, size: str, steps: int, cache: str | None) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "LIGHTNING_ZENFLOW_KERNELS"}  # "auto" decides
    env.update({"TORCHINDUCTOR_CACHE_DIR": cache} if cache is not None else {})
    command = [sys.executable, __file__, "--child", strategy, size, str(steps)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{strategy} {size} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:  # one row's process: its three fits
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    info = bench_utils.announce("startup_bench", __import__("torch").device("cpu"))
    rows = [("small", "warm")] if args.quick else [("small", "warm"), ("large", "warm"), ("large", "cold")]
    results, table, breakdown = {}, [], []
    with tempfile.TemporaryDirectory() as empty:
        for size, cache in rows:
            cold_dir = os.path.join(empty, size) if cache == "cold" else None
            adamw = run_row("auto", size, args.steps, None)
            zenflow = run_row("zenflow", size, args.steps, cold_dir)
            results[f"{size} {cache}"] = {"adamw": adamw, "zenflow": zenflow}
            extra = [z - a for z, a in zip(zenflow["fits_s"], adamw["fits_s"])]
            table.append([size, cache, *adamw["fits_s"], *zenflow["fits_s"], *extra])
            parts = [*zenflow["breakdown_s"].items(), *((f"build {name}", s) for name, s in zenflow["builds"])]
            breakdown += [[f"{size} {cache}", label, seconds] for label, seconds in parts]
    fits = [f"{what} fit {i + 1} s" for what in ("AdamW", "ZenFlow", "extra") for i in range(FITS)]
    headers = ["model", "compile cache", *fits]
    bench_utils.print_table(f"fits of {args.steps} steps, three in one process", headers, table, digits=2)
    bench_utils.print_table("where the first ZenFlow fit's start goes", ["row", "part", "seconds"], breakdown, digits=2)
    print("targets: extra fit 1 <= 1.5 s, extra fit 2 <= 1.0 s (warm cache)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": info, "settings": vars(args) | {"out": str(args.out)}, "results": results}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
