"""Candidate changes to ZenFlow's update rule, measured on the fine-tune benchmark of ``finetune_quality.py``.

Fine-tunes ``finetune_quality.py``'s base with AdamW, with the paper's rule and with each variant, all written as
``rule_optimizer.RuleOptimizer`` (the rule in one process, each candidate change a knob: see that module), on the
same batches, schedule and evaluations as ``finetune_quality.py``; prints the final gap to AdamW (paired by seed), the
gap at the first evaluation, the device state each variant keeps and what it needs from the host, and when.

    python benchmarks/rule_variants.py --list-rows
    python benchmarks/rule_variants.py --rows paper extrapolate --seeds 0 1 --jobs 2   # ~1 min per fine-tune
    python benchmarks/rule_variants.py --quick                                         # smoke run, < 30 s
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import pathlib
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import bench_train
import bench_utils
import finetune_quality as fq
import torch
from rule_optimizer import Rule, RuleOptimizer

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "rule_variants.json"


# ------------------------------------------------------------------------------------------------------- rows
@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    rule: Rule | None
    """None: torch.optim.AdamW."""
    what: str


ROWS = (
    Row("adamw", None, "torch.optim.AdamW (fused=False), the reference"),
    Row("paper", Rule(), "the engine's defaults: rho 0.1, S 4, overlap on, one selection, g_t l2 score"),
    Row("no-overlap", Rule(overlap=False), "the paper's rule, overlap off (lands at its own window end)"),
    Row("refresh-sync-16", Rule(refresh="sync", refresh_interval=16), "the paper's refresh every 16 steps (syncs)"),
    Row("land-1", Rule(land_after=1), "(c) the host update lands 1 step after its window closes"),
    Row("land-2", Rule(land_after=2), "(c) lands 2 steps after"),
    Row("refresh-window", Rule(refresh="window"), "(f) re-select at every window end, no sync; g_t score"),
    Row("score-window", Rule(refresh="window", score="window"), "(b) + (f): score summed over the window"),
    Row("score-ema", Rule(refresh="window", score="ema"), "(b) + (f): EMA of the per-step score, beta 0.9"),
    Row("score-adam", Rule(refresh="window", score="adam"), "(a) + (f): |m|/(sqrt v + eps) summed over rows"),
    Row("adaptive", Rule(share="adaptive"), "(d) one selection, element budget shared by relative score"),
    Row("adaptive+refresh-window", Rule(share="adaptive", refresh="window"), "(d) + (f)"),
    Row("extrapolate", Rule(extrapolate=True), "(e) a landed update is shown as master + delta"),
    Row("extrapolate+refresh-window", Rule(extrapolate=True, refresh="window"), "(e) + (f)"),
    Row("extrapolate+score-window", Rule(extrapolate=True, refresh="window", score="window"), "(e) + (f) + (b)"),
    Row("extrapolate+score-adam", Rule(extrapolate=True, refresh="window", score="adam"), "(e) + (f) + (a)"),
    Row("extrapolate+land-2", Rule(extrapolate=True, land_after=2), "(e) + (c), shown as master + delta/2"),
    Row(
        "matched-betas", Rule(matched_betas=True), "host update with (beta1^S, beta2^S): moment time constants in steps"
    ),
    Row("extrapolate+matched-betas", Rule(extrapolate=True, matched_betas=True), "(e) + matched betas"),
    Row("land-1+score-window", Rule(land_after=1, refresh="window", score="window"), "(c) + (f) + (b)"),
    Row("matched-betas+score-window", Rule(matched_betas=True, refresh="window", score="window"), "+ (f) + (b)"),
    Row("refresh-window+S=8", Rule(refresh="window", interval=8), "(f) with a window of 8"),
    Row("extrapolate+S=8", Rule(extrapolate=True, interval=8), "(e) with a window of 8"),
    Row("warm-up-10", Rule(warm_up=10), "first 10 steps full synchronous AdamW"),
    Row("warm-up-10+refresh-window", Rule(warm_up=10, refresh="window"), "warm-up 10 + (f)"),
    Row("host-lr-2", Rule(host_lr_scale=2.0), "host step size 2x (sqrt S)"),
    Row("warm-up-10+host-lr-2", Rule(warm_up=10, host_lr_scale=2.0), "warm-up 10 + host step 2x"),
    Row("no-overlap+host-lr-2", Rule(overlap=False, host_lr_scale=2.0), "window cost alone, host step 2x"),
    Row("warm-up-10+host-lr-2+refresh-window", Rule(warm_up=10, host_lr_scale=2.0, refresh="window"), "all three"),
    Row("warm-up-10+matched-betas", Rule(warm_up=10, matched_betas=True), "warm-up 10 + matched betas"),
    Row("matched-beta1", Rule(matched_beta1=True), "host update with (beta1^S, beta2)"),
    Row("warm-up-10+matched-beta1", Rule(warm_up=10, matched_beta1=True), "warm-up 10 + (beta1^S, beta2)"),
    Row("no-overlap+host-lr-0.5", Rule(overlap=False, host_lr_scale=0.5), "window cost alone, host step 0.5x"),
    Row("no-overlap+matched-beta1", Rule(overlap=False, matched_beta1=True), "window cost alone, (beta1^S, beta2)"),
    Row("warm-up-5", Rule(warm_up=5), "first 5 steps full synchronous AdamW"),
    Row("warm-up-20", Rule(warm_up=20), "first 20 steps full synchronous AdamW"),
    Row("warm-up-40", Rule(warm_up=40), "first 40 steps full synchronous AdamW"),
    Row("overlap-after-16", Rule(overlap_after=16), "windows closing at steps <= 16 land at once"),
    Row("overlap-after-40", Rule(overlap_after=40), "windows closing at steps <= 40 land at once"),
    Row("warm-up-10+rho=0.15", Rule(warm_up=10, ratio=0.15), "rho 0.15: the device bytes of rho 0.1 without a master"),
    Row("warm-up-10+rho=0.3", Rule(warm_up=10, ratio=0.3), "rho 0.3"),
    Row(
        "warm-up-10+rho=0.3+bf16",
        Rule(warm_up=10, ratio=0.3, device_moments="bf16"),
        "rho 0.3 with bf16 device moments and no master: the device bytes of rho 0.1",
    ),
    Row(
        "warm-up-10+warm-up-score",
        Rule(warm_up=10, score="window", warm_up_score=True),
        "warm-up 10; the one selection ranks by the squared gradient summed over the warm-up",
    ),
    Row(
        "warm-up-10+warm-up-score+refresh-window",
        Rule(warm_up=10, score="window", warm_up_score=True, refresh="window"),
        "and re-selected at every window end by the window's summed score",
    ),
    Row("warm-up-10+window-decay", Rule(warm_up=10, window_decay=True), "warm-up 10; host decay x n per n-step window"),
    Row(
        "warm-up-10+refresh-sync-16",
        Rule(warm_up=10, refresh="sync", refresh_interval=16),
        "warm-up 10 + the paper's refresh every 16 steps",
    ),
    Row("warm-up-10+S=2", Rule(warm_up=10, interval=2), "warm-up 10, window of 2"),
    Row("warm-up-10+S=8", Rule(warm_up=10, interval=8), "warm-up 10, window of 8"),
    Row("warm-up-10+no-overlap", Rule(warm_up=10, overlap=False), "warm-up 10, overlap off (for reference)"),
    Row("warm-up-10+land-1", Rule(warm_up=10, land_after=1), "warm-up 10, lands 1 step after its window"),
    Row(
        "extrapolate+adaptive+refresh-window",
        Rule(extrapolate=True, share="adaptive", refresh="window"),
        "(e) + (d) + (f)",
    ),
)
QUICK_ROWS = ("adamw", "paper", "extrapolate+score-adam", "adaptive+refresh-window", "land-1")


class RuleStep:
    """``bench_train``'s stepper for ``RuleOptimizer``: its step, sync and flush run without autograd."""

    def __init__(self, rule_optimizer: RuleOptimizer) -> None:
        self.rule_optimizer = rule_optimizer

    def before_forward(self) -> None:
        pass

    def step(self) -> float:
        with torch.no_grad():
            self.rule_optimizer.step()
        return 0.0

    def settle(self, last: bool) -> None:
        with torch.no_grad():
            self.rule_optimizer.flush() if last else self.rule_optimizer.sync()


def finetune(row: Row, seed: int, setting: fq.Setting) -> dict[str, Any]:
    """``finetune_quality.finetune`` with ``RuleOptimizer`` in place of the engine: the same model, batches, lr
    schedule, evaluations (after a sync; after a flush at the end) and thread count."""
    args = setting.args
    model, optimizer, scheduler, starts = setting.start(seed)
    rule_optimizer = None if row.rule is None else RuleOptimizer(optimizer.param_groups, row.rule)
    # RuleOptimizer steps in place of optimizer.step(), which the LR scheduler would otherwise warn about
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    curve = bench_train.train(
        model,
        optimizer,
        bench_train.AdamWStep(optimizer) if rule_optimizer is None else RuleStep(rule_optimizer),
        starts,
        steps=args.finetune_steps,
        eval_every=args.eval_every,
        evaluate=lambda: bench_train.evaluate(model, setting.eval_batches),
        scheduler=scheduler,
        batch_of=setting.batch,
    )
    return {
        "row": row.name,
        "seed": seed,
        "rule": None if row.rule is None else dataclasses.asdict(row.rule),
        "eval_steps": curve.eval_steps,
        "eval_loss": curve.eval_loss,
        "final_eval_loss": curve.eval_loss[-1],
        "train_loss": curve.train_loss,
        "seconds": time.perf_counter() - curve.started,
        "selections": [] if rule_optimizer is None else rule_optimizer.selections,
        "device_cost": None if rule_optimizer is None else rule_optimizer.device_cost(),
        "update_cosines": None if rule_optimizer is None else rule_optimizer.delta_cosines,
    }


_SETTING: fq.Setting | None = None


def _init_worker(setting: fq.Setting, threads: int) -> None:
    global _SETTING
    _SETTING = setting
    torch.set_num_threads(threads)


def _run_one(job: tuple[Row, int]) -> dict[str, Any]:
    assert _SETTING is not None
    return finetune(job[0], job[1], _SETTING)


# ------------------------------------------------------------------------------------------------------ report
def host_needs(rule: Rule | None) -> str:
    """What the variant needs from the host and when (the critical-path column of the table)."""
    if rule is None:
        return "-"
    if not rule.overlap or rule.lag == 0:
        return "host update at its own window end: on the critical path"
    parts = [f"host update lands {rule.lag} step(s) after its window: T_host <= {rule.lag} x T_step"]
    if rule.refresh == "sync":
        parts.append(f"every refresh (>= {rule.refresh_interval} steps) waits for the window just closed")
    if rule.refresh == "window":
        parts.append("entering columns: host state as landed + a device catch-up step on their window sum")
    if rule.score == "adam":
        parts.append("per-column update sizes computed with each host update")
    if rule.extrapolate:
        parts.append("host sends master + (L/S)·delta instead of master")
    return "; ".join(parts)


def row_records(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Each row's rule, description and host requirement, as the JSON files record them."""
    return {
        row.name: {
            "rule": None if row.rule is None else dataclasses.asdict(row.rule),
            "what": row.what,
            "host_needs": host_needs(row.rule),
        }
        for row in rows
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    adamw = {r["seed"]: r for r in runs if r["row"] == "adamw"}
    for name, (row_runs, gaps) in fq.paired_gaps(runs).items():
        gap25 = [
            100 * (r["eval_loss"][1] / adamw[r["seed"]]["eval_loss"][1] - 1) for r in row_runs if r["seed"] in adamw
        ]
        jaccards = [s["jaccard"] for r in row_runs for s in r["selections"] if s["jaccard"] is not None]
        rows[name] = {
            "seeds": [r["seed"] for r in row_runs],
            "final_losses": [r["final_eval_loss"] for r in row_runs],
            "gaps_percent": gaps,
            "gap_mean_percent": statistics.fmean(gaps) if gaps else None,
            "gap_spread_percent": (max(gaps) - min(gaps)) / 2 if len(gaps) > 1 else None,
            "gap_first_eval_percent": statistics.fmean(gap25) if gap25 else None,
            "selections": statistics.fmean(len(r["selections"]) for r in row_runs),
            "selection_jaccard": statistics.fmean(jaccards) if jaccards else None,
            "device_cost": row_runs[0]["device_cost"],
            "seconds": statistics.fmean(r["seconds"] for r in row_runs),
        }
    return rows


def print_table(summary: dict[str, dict[str, Any]], rows: Sequence[Row]) -> None:
    lines = []
    for row in rows:
        if row.name not in summary:
            continue
        entry = summary[row.name]
        cost = entry["device_cost"]
        gap = "-" if row.rule is None or not entry["gaps_percent"] else bench_utils.pm(entry["gaps_percent"], 2, " %")
        lines.append([
            row.name, len(entry["seeds"]), bench_utils.pm(entry["final_losses"], 4), gap,
            entry["gap_first_eval_percent"] if row.rule is not None else None,
            None if cost is None else 100 * cost["selected_share"],
            None if cost is None else cost["state_bytes"] + cost["accumulator_bytes"] + cost["score_bytes"],
            entry["selections"] if row.rule is not None else None, entry["selection_jaccard"],
        ])  # fmt: skip
    headers = ["row", "seeds", "final held-out loss", "vs AdamW (paired)", "gap @ 1st eval %", "device share %",
               "device B/elem", "selections", "Jaccard"]  # fmt: skip
    bench_utils.print_table(
        "\nFinal held-out loss (nats per byte), mean ± std over seeds; gap to AdamW paired by seed",
        headers,
        lines,
        digits=4,
    )
    print("\nWhat each variant needs from the host, and when")
    for row in rows:
        if row.name in summary and row.rule is not None:
            print(f"  {row.name:38s} {host_needs(row.rule)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(parser, out=DEFAULT_OUT, quick="finetune_quality's --quick model and steps.")
    parser.add_argument("--rows", nargs="*", default=None, help="rows to run (default all; adamw is always run).")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="seeds (default 0 1; quick 0).")
    parser.add_argument("--jobs", type=int, default=1, help="fine-tunes run side by side, one thread each.")
    parser.add_argument("--list-rows", action="store_true", help="print the rows and exit.")
    parser.add_argument("--cache", type=pathlib.Path, default=fq.DEFAULT_CACHE, help="finetune_quality's base cache.")
    parser.add_argument(
        "--merge", type=pathlib.Path, nargs="*", default=None, help="no runs: one table from these JSON files' runs."
    )
    args, rest = parser.parse_known_args(argv)
    args.fq = fq.parse_args([*rest, "--cache", str(args.cache), *(["--quick"] if args.quick else [])])
    bench_utils.apply_quick_defaults(args, {"seeds": ([0, 1], [0])})
    names = [row.name for row in ROWS]
    chosen = args.rows if args.rows is not None else (list(QUICK_ROWS) if args.quick else names)
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown rows {unknown}; --list-rows prints the names.")
    args.rows = sorted({"adamw", *chosen}, key=names.index)
    return args


def merge(paths: Sequence[pathlib.Path], out: pathlib.Path) -> int:
    """One table from the runs of several invocations (a run of a row and seed appears once: the first file's)."""
    payloads = [json.loads(path.read_text()) for path in paths]
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for payload in payloads:
        for run in payload["runs"]:
            runs.setdefault((run["row"], run["seed"]), run)
    names = [row.name for row in ROWS]
    ordered = sorted(runs.values(), key=lambda run: (names.index(run["row"]), run["seed"]))
    rows = [row for row in ROWS if any(run["row"] == row.name for run in ordered)]
    summary = summarise(ordered)
    print_table(summary, rows)
    merged = {
        "benchmark": "rule_variants",
        "merged_from": [
            {
                "path": path.name,
                "command": payload["command"],
                "revision": payload["revision"],
                "machine": payload["machine"],
            }
            for path, payload in zip(paths, payloads)
        ],  # fmt: skip
        "settings": payloads[0]["settings"],
        "rows": row_records(rows),
        "runs": ordered,
        "summary": summary,
    }
    bench_utils.write_json(out, merged)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_rows:
        for row in ROWS:
            print(f"{row.name:38s} {row.what}")
        return 0
    if args.merge:
        return merge(args.merge, args.out)
    info = bench_utils.announce(
        "rule_variants: candidate rule changes on finetune_quality's fine-tune", torch.device("cpu")
    )
    started = time.perf_counter()
    corpora = fq.build_corpora(args.fq.max_files)
    base, base_record = fq.load_or_pretrain(args.fq, corpora)
    setting = fq.build_setting(args.fq, corpora, base)
    # the engine's training process runs len(train_cores) threads; matmul reductions match at the same count
    threads = len(setting.train_cores)
    rows = [row for row in ROWS if row.name in args.rows]
    plan = [(row, seed) for row in rows for seed in args.seeds]
    print(f"{len(plan)} fine-tunes of {args.fq.finetune_steps} steps, {threads} thread(s) each, {args.jobs} at a time")
    runs: list[dict[str, Any]] = []
    payload = bench_utils.payload(
        "rule_variants",
        info,
        revision=True,
        settings={**bench_utils.settings_of(args.fq, skip=("out", "cache")), "threads": threads},
        base=base_record,
        rows=row_records(rows),
        runs=runs,
    )
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(args.jobs, _init_worker, (setting, threads)) if args.jobs > 1 else None
    if pool is None:
        _init_worker(setting, threads)
    with pool if pool is not None else contextlib.nullcontext():
        results = pool.imap_unordered(_run_one, plan) if pool is not None else map(_run_one, plan)
        for run in results:
            runs.append(run)
            print(f"[{len(runs)}/{len(plan)}] {run['row']} seed {run['seed']}: held-out {run['eval_loss'][0]:.4f} -> "
                  f"{run['final_eval_loss']:.7f} ({run['seconds']:.0f} s)", flush=True)  # fmt: skip
            bench_utils.write_partial(args.out, payload)
    runs.sort(key=lambda run: ([row.name for row in ROWS].index(run["row"]), run["seed"]))
    summary = summarise(runs)
    print_table(summary, rows)
    payload.update(summary=summary, total_s=time.perf_counter() - started)
    bench_utils.write_results(args.out, payload)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0 if all(math.isfinite(run["final_eval_loss"]) for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
