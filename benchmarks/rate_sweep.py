"""What the quality benchmarks share for rows of one's own and learning-rate sweeps (``finetune_quality.py``,
``real_lm.py``): the ``--row NAME=JSON`` flag and best against best.

A sweep's record is one fine-tune: ``optimizer`` (the row's name), ``lr`` (its peak rate), ``seed``,
``final_eval_loss`` (held-out loss of the final weights) and ``eval_loss`` (the held-out curve, the same evaluation
steps in every record, the base's loss first). Not a benchmark itself; it imports nothing heavy (the engine's spawned
host worker re-imports the running script's top level).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import bench_utils

TAIL_EVALS = 4
"""The evaluations averaged for the tail gap: with a constant rate the final evaluation alone is noisy."""


def row_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``--row NAME=JSON`` (``NAME='{"update_interval": 8}'``) as its name and knobs; ValueError if malformed."""
    name, _, text = spec.partition("=")
    try:
        knobs = json.loads(text)
    except json.JSONDecodeError:
        knobs = None
    if not name or name == "adamw" or not isinstance(knobs, dict):
        raise ValueError(f"--row {spec!r} must be NAME=JSON (not adamw), a JSON dict of ZenFlow knobs.")
    return name, knobs


def tail_mean(curve: Sequence[float]) -> float:
    return statistics.fmean(curve[-TAIL_EVALS:])


def best_of_rates(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: the mean final loss at each rate, its best rate (the lowest mean over seeds), its gap at that rate to
    AdamW at AdamW's best (paired by seed), the same gap for the mean of the last ``TAIL_EVALS`` evaluations, and the
    largest ratio of its held-out loss to AdamW's at the same rate, seed and evaluation."""
    finals: dict[str, dict[float, dict[int, float]]] = {}
    curves = {(r["optimizer"], r["lr"], r["seed"]): r["eval_loss"] for r in records}
    for record in records:
        finals.setdefault(record["optimizer"], {}).setdefault(record["lr"], {})[record["seed"]] = record[
            "final_eval_loss"
        ]

    def mean(losses: dict[int, float]) -> float:
        return statistics.fmean(losses.values()) if all(math.isfinite(v) for v in losses.values()) else math.inf

    best = {name: min(per_rate, key=lambda lr: mean(per_rate[lr])) for name, per_rate in finals.items()}
    adamw = finals["adamw"][best["adamw"]]
    result = {}
    for name, per_rate in finals.items():
        chosen = per_rate[best[name]]
        paired = [seed for seed in chosen if seed in adamw]
        reference = {seed: curves["adamw", best["adamw"], seed] for seed in paired}
        worst = {}
        for lr in per_rate:
            ratios = [
                own / ref
                for seed in per_rate[lr]
                for own, ref in zip(curves[name, lr, seed], curves.get(("adamw", lr, seed), []))
            ]
            worst[lr] = max(ratios) if ratios else None
        result[name] = {
            "mean_by_lr": {lr: mean(losses) for lr, losses in sorted(per_rate.items())},
            "best_lr": best[name],
            "best_gap_percent": [100 * (chosen[seed] / adamw[seed] - 1) for seed in paired],
            "best_tail_gap_percent": [
                100 * (tail_mean(curves[name, best[name], seed]) / tail_mean(reference[seed]) - 1) for seed in paired
            ],
            "worst_ratio_to_adamw_by_lr": worst,
        }
    return result


def print_best_of_rates(best: Mapping[str, Mapping[str, Any]], digits: int = 4) -> None:
    """The per-rate table and the best-against-best table of ``best_of_rates``."""
    rates = sorted({lr for entry in best.values() for lr in entry["mean_by_lr"]})
    bench_utils.print_table(
        "\nFinal held-out loss per peak rate (mean over seeds); worst: the largest held-out loss / AdamW's at the "
        "same rate, seed and step",
        ["row", *[f"lr {lr:g}" for lr in rates], *[f"worst {lr:g}" for lr in rates]],
        [
            [name, *[entry["mean_by_lr"].get(lr) for lr in rates]]
            + [entry["worst_ratio_to_adamw_by_lr"].get(lr) for lr in rates]
            for name, entry in best.items()
        ],
        digits=digits,
    )
    bench_utils.print_table(
        "\nBest against best: each row at its best rate, gap to AdamW at AdamW's best (paired by seed)",
        ["row", "best lr", "final held-out loss", "vs AdamW's best", f"last {TAIL_EVALS} evals vs AdamW's best"],
        [
            [
                name,
                f"{entry['best_lr']:g}",
                entry["mean_by_lr"][entry["best_lr"]],
                bench_utils.pm(entry["best_gap_percent"], 2, " %") if name != "adamw" else "-",
                bench_utils.pm(entry["best_tail_gap_percent"], 2, " %") if name != "adamw" else "-",
            ]
            for name, entry in best.items()
        ],
        digits=digits,
    )
