"""The way back to AdamW, measured: the exported ``exp_avg_sq`` of each weight matrix against what plain AdamW holds
after the same steps on the same data, at betas (0.9, 0.999) and (0.9, 0.95).

The demo GPT (default shape, 0.9 M parameters, from one seeded initialisation) trains ``--steps`` steps on byte
blocks of the Python standard library's sources (the main job's corpus), once with ``torch.optim.AdamW`` and once with
``ZenFlowAdamW`` at its defaults (compact host state, interim moves, 10 warm-up steps, S = 4), the same batches in the
same order, constant lr after a short warm-up. ZenFlow is flushed and exported (``state_dict()``, ``engine/export.py``).
Per weight matrix (the 1-D parameters are updated on the device every step: AdamW's own), the ratio
``sum(exported exp_avg_sq) / sum(AdamW's exp_avg_sq)``; the table shows their minimum, median and maximum over the
matrices, for the export as it ships and restated by the bias-correction counts only (no single-step scale).

Target: every matrix within [0.8, 1.25] at both betas.

    python benchmarks/export_moments.py                 # 150 steps, both betas, ~2 minutes on 2 cores
    python benchmarks/export_moments.py --quick         # smoke run, < 30 s
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import sys
from typing import Any

import bench_utils
import torch

from lightning_zenflow import ZenFlowAdamW
from lightning_zenflow.demo import GPT, GPTConfig, load_corpus_bytes
from lightning_zenflow.engine import export as export_module

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "export_moments.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(parser, out=DEFAULT_OUT, quick="smoke run (24 steps).", seed="")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 150; quick 24).")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of both runs.")
    args = parser.parse_args(argv)
    return bench_utils.apply_quick_defaults(args, {"steps": (150, 24)})


def batches(steps: int, batch: int, block: int, seed: int) -> list[torch.Tensor]:
    corpus = load_corpus_bytes(None, 4_000_000)
    starts = torch.randint(0, corpus.numel() - block - 1, (steps, batch), generator=torch.Generator().manual_seed(seed))
    return [torch.stack([corpus[s : s + block + 1] for s in row.tolist()]).long() for row in starts]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], warmup: int) -> None:
    base = [group["lr"] for group in optimizer.param_groups]
    for step, tokens in enumerate(data, start=1):
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * min(1.0, step / warmup)
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()  # the demo GPT returns (logits, loss)
        optimizer.step()
        optimizer.zero_grad()


def ratios(exported: dict, adamw: dict, matrices: list[int]) -> list[float]:
    return [float(exported[i]["exp_avg_sq"].double().sum() / adamw[i]["exp_avg_sq"].double().sum()) for i in matrices]


def counts_only(engine: Any, betas: tuple[float, float]) -> dict[int, dict[str, torch.Tensor]]:
    """The export restated at the optimizer step by the counts alone (the single-step scale left out)."""
    merged = engine.state_dict(include_moments=True)["params"]
    plain = {
        name: {k: v for k, v in entry.items() if k not in ("interim_row", "interim_decay")}
        for name, entry in merged.items()
    }
    # ZenFlowAdamW names a parameter by its place: groupG.paramP
    return {int(name.rsplit("param", 1)[1]): export_module.adamw_state(entry, betas) for name, entry in plain.items()}


def run(args: argparse.Namespace, betas: tuple[float, float]) -> dict[str, Any]:
    data = batches(args.steps, 8, 64, args.seed + 1)  # 8 blocks of 64 bytes a step
    adamw_model = torch.manual_seed(args.seed) and GPT(GPTConfig())
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=args.lr, betas=betas, weight_decay=0.0)
    train(adamw_model, adamw, data, warmup=10)
    model = torch.manual_seed(args.seed) and GPT(GPTConfig())
    matrices = [index for index, param in enumerate(model.parameters()) if param.ndim >= 2]
    with ZenFlowAdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=0.0) as zenflow:
        train(model, zenflow, data, warmup=10)
        zenflow.flush()
        counts = counts_only(zenflow.engine, betas)
        shipped = copy.deepcopy(zenflow.state_dict()["state"])
    reference = adamw.state_dict()["state"]
    return {"state_dict()": ratios(shipped, reference, matrices), "counts only": ratios(counts, reference, matrices)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = bench_utils.announce("export_moments", torch.device("cpu"))
    results = {}
    rows = []
    for betas in ((0.9, 0.999), (0.9, 0.95)):
        result = run(args, betas)
        results[str(betas)] = result
        for variant in ("state_dict()", "counts only"):
            values = result[variant]
            inside = all(0.8 <= v <= 1.25 for v in values)
            rows.append(
                [str(betas), variant, min(values), statistics.median(values), max(values), "yes" if inside else "no"]
            )
    bench_utils.print_table(
        f"exported exp_avg_sq / AdamW's, per weight matrix ({args.steps} steps, lr {args.lr})",
        ["betas", "export", "min", "median", "max", "all in [0.8, 1.25]"],
        rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": info, "settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
