"""The way back to AdamW, measured: the exported ``exp_avg_sq`` of each weight matrix against what plain AdamW holds
after the same steps on the same data, at betas (0.9, 0.999) and (0.9, 0.95).

The demo GPT (default shape, 0.9 M parameters, from one seeded initialisation) trains ``--steps`` steps on byte
blocks of the Python standard library's sources (the main job's corpus), once with ``torch.optim.AdamW`` and once with
``ZenFlowAdamW`` at its defaults (compact host state, interim moves, 10 warm-up steps, S = 4), the same batches in the
same order, constant lr after a short warm-up. ZenFlow is flushed and exported (``state_dict()``, ``engine/export.py``).
Per weight matrix (the 1-D parameters are updated on the device every step: AdamW's own), the ratio
``sum(exported exp_avg_sq) / sum(AdamW's exp_avg_sq)``; the table shows their minimum, median and maximum over the
matrices, for the export as it ships and for two variants computed from the same engine state:

- ``counts only``: the host columns' moments restated at the optimizer step (the bias-correction counts), no
  single-step scale;
- ``single-step scale, whole v``: the scale the export used before, applied to the whole host ``exp_avg_sq``
  (its warm-up share included).

Target (issue: "the way back to AdamW"): every matrix within [0.8, 1.25] at both betas.

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
from lightning_zenflow.engine import export as export_module

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "export_moments.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(parser, out=DEFAULT_OUT, quick="smoke run (24 steps).", seed="")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 150; quick 24).")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of both runs.")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--kernels", default="auto", choices=("auto", "compiled", "eager"))
    args = parser.parse_args(argv)
    return bench_utils.apply_quick_defaults(args, {"steps": (150, 24)})


def batches(steps: int, batch: int, block: int, seed: int) -> list[torch.Tensor]:
    from lightning_zenflow.demo.data import load_corpus_bytes

    corpus = load_corpus_bytes(None, 4_000_000)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - block - 1, (steps, batch), generator=generator)
    return [torch.stack([corpus[s : s + block + 1] for s in row.tolist()]).long() for row in starts]


def model_from(seed: int) -> torch.nn.Module:
    from lightning_zenflow.demo.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig())


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], warmup: int) -> None:
    base = [group["lr"] for group in optimizer.param_groups]
    for step, tokens in enumerate(data, start=1):
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * min(1.0, step / warmup)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def ratios(exported: dict, adamw: dict, matrices: list[int]) -> list[float]:
    return [
        float(exported[index]["exp_avg_sq"].double().sum() / adamw[index]["exp_avg_sq"].double().sum())
        for index in matrices
    ]


def variant_states(engine: Any, betas: tuple[float, float]) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """The export's variants from the engine's merged state: as shipped, counts only, the scale on the whole v."""
    merged = engine.state_dict(include_moments=True)["params"]
    states: dict[str, dict[int, dict[str, torch.Tensor]]] = {"counts only": {}}
    for name, entry in merged.items():
        position = int(name.rsplit("param", 1)[1])  # ZenFlowAdamW names a parameter by its place: groupG.paramP
        states["counts only"][position] = export_module.adamw_state(
            {k: v for k, v in entry.items() if k not in ("interim_row", "interim_decay")}, betas
        )
    return states


def run(args: argparse.Namespace, betas: tuple[float, float]) -> dict[str, Any]:
    data = batches(args.steps, args.batch, args.block, args.seed + 1)
    adamw_model = model_from(args.seed)
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=args.lr, betas=betas, weight_decay=0.0)
    train(adamw_model, adamw, data, warmup=10)
    model = model_from(args.seed)
    matrices = [index for index, param in enumerate(model.parameters()) if param.ndim >= 2]
    with ZenFlowAdamW(
        model.parameters(), lr=args.lr, betas=betas, weight_decay=0.0, interim_kernel=args.kernels
    ) as zenflow:
        train(model, zenflow, data, warmup=10)
        zenflow.flush()
        states = variant_states(zenflow.engine, betas)
        shipped = copy.deepcopy(zenflow.state_dict()["state"])
    adamw_state = adamw.state_dict()["state"]
    result = {name: ratios(state, adamw_state, matrices) for name, state in states.items()}
    result["state_dict()"] = ratios(shipped, adamw_state, matrices)
    return result


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
    args.out.write_text(json.dumps({"machine": info, "settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
