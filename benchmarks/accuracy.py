"""Quality parity: fine-tune the same pre-trained GPT with AdamW, ZenFlow and synchronous offload, side by side.

1. Pre-train the demo GPT on the first half of the embedded corpus (the Python standard library's sources, byte
   level) with plain ``torch.optim.AdamW`` for ``--pretrain-steps`` steps, seeded; save it.
2. Fine-tune three copies of it on the second half, same seed, same batches in the same order:
   - ``adamw``         plain ``torch.optim.AdamW`` (the control);
   - ``zenflow``       the engine with its defaults (``topk_ratio=0.1, update_interval=4``, overlap on);
   - ``sync-offload``  the engine with ``topk_ratio=0, update_interval=1, overlap_step=False`` (ZeRO-Offload semantics,
     which the design says equals AdamW to float tolerance: a built-in sanity check of the harness).
3. Every ``--eval-every`` steps, the held-out loss on the second half's validation split (the same fixed batches).
   Before each evaluation the engine is synced (host work in flight is applied), as ``ZenFlowStrategy`` does at
   validation by default; at the end it is flushed, so the final weights hold every gradient.

A manual training loop (forward, backward, ``engine.step()``, ``engine.wait_for_update()`` before each forward) keeps
the data order identical across the runs. All three fine-tunes run on the same cores with the same thread count (the
engine's training-process share), so matmul reductions match too.

    python benchmarks/accuracy.py            # a few minutes on 2 cores
    python benchmarks/accuracy.py --quick    # smoke run, < 60 s
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from typing import Any

import bench_train
import bench_utils
import torch

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.demo import GPT, ByteCorpusDataModule

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "accuracy.json"
PARITY_TOLERANCE = 0.01
"""ZenFlow's final eval loss should be within 1 % of AdamW's (project target 7)."""
RUNS = ("adamw", "zenflow", "sync-offload")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="tiny model and few steps: a < 60 s smoke run.",
        plot="also write a PNG of the eval-loss curves.",
        seed="",
    )
    parser.add_argument("--pretrain-steps", type=int, default=None, help="default 300 (quick 30).")
    parser.add_argument("--finetune-steps", type=int, default=None, help="default 200 (quick 24).")
    parser.add_argument("--eval-every", type=int, default=None, help="default 25 (quick 8).")
    parser.add_argument("--eval-batches", type=int, default=None, help="held-out batches per evaluation (16; quick 4).")
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 (quick 8).")
    parser.add_argument("--block-size", type=int, default=None, help="default 128 (quick 64).")
    parser.add_argument("--n-layer", type=int, default=None, help="default 4 (quick 2).")
    parser.add_argument("--n-embd", type=int, default=None, help="default 128 (quick 64).")
    parser.add_argument("--n-head", type=int, default=None, help="default 4 (quick 2).")
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--finetune-lr", type=float, default=3e-4)
    parser.add_argument("--max-bytes", type=int, default=None, help="corpus bytes read (default 2 MB; quick 400 kB).")
    parser.add_argument("--topk-ratio", type=float, default=0.1, help="ZenFlow run: topk_ratio (default 0.1).")
    parser.add_argument("--update-interval", type=int, default=4, help="ZenFlow run: update_interval (default 4).")
    parser.add_argument(
        "--no-overlap", action="store_true", help="ZenFlow run: overlap_step=False (host update applied at once)."
    )
    parser.add_argument(
        "--warm-up",
        type=int,
        default=None,
        help="ZenFlow run: full_warm_up_rounds (default: the engine's, 10; 0 is the paper's rule).",
    )
    parser.add_argument(
        "--select-interval",
        type=int,
        default=None,
        help="ZenFlow run: refresh the selection every N steps (select_strategy='step'); default: the engine's "
        "default, which outside a Trainer selects once, at step 1.",
    )
    return bench_utils.apply_quick_defaults(
        parser.parse_args(argv),
        {
            "pretrain_steps": (300, 30),
            "finetune_steps": (200, 24),
            "eval_every": (25, 8),
            "eval_batches": (16, 4),
            "batch_size": (16, 8),
            "block_size": (128, 64),
            "n_layer": (4, 2),
            "n_embd": (128, 64),
            "n_head": (4, 2),
            "max_bytes": (2_000_000, 400_000),
        },
    )


def zenflow_config(args: argparse.Namespace) -> ZenFlowConfig:
    """The ZenFlow run's knobs: the engine's defaults unless the command line changes them."""
    select: dict[str, int | str] = {}
    if args.warm_up is not None:
        select["full_warm_up_rounds"] = args.warm_up
    if args.select_interval is not None:
        select = {"select_strategy": "step", "select_interval": args.select_interval}
    return ZenFlowConfig(
        topk_ratio=args.topk_ratio, update_interval=args.update_interval, overlap_step=not args.no_overlap, **select
    )


def data_module(args: argparse.Namespace, part: str, steps: int) -> ByteCorpusDataModule:
    """The corpus half ``part``, one epoch of ``steps`` batches; every ``train_dataloader()`` yields the same order."""
    module = ByteCorpusDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_bytes=args.max_bytes,
        part=part,
        seed=args.seed,
        samples_per_epoch=max(steps, 1) * args.batch_size,
    )
    module.setup("fit")
    return module


def pretrain(args: argparse.Namespace, data: ByteCorpusDataModule) -> tuple[GPT, list[float], float]:
    torch.manual_seed(args.seed)
    model = bench_train.demo_gpt(args)
    optimizer = bench_train.demo_adamw(model.parameters(), args.pretrain_lr)
    started = time.perf_counter()
    curve = bench_train.train(
        model, optimizer, bench_train.AdamWStep(optimizer), data.train_dataloader(), steps=args.pretrain_steps
    )
    return model, curve.train_loss, time.perf_counter() - started


def finetune(
    run: str,
    args: argparse.Namespace,
    pretrained_path: pathlib.Path,
    data: ByteCorpusDataModule,
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
    train_cores: list[int],
) -> dict[str, Any]:
    """One fine-tune from the saved weights; the loss on ``eval_batches`` at step 0, every K steps and at the end."""
    torch.manual_seed(args.seed)
    model = bench_train.demo_gpt(args)
    model.load_state_dict(torch.load(pretrained_path, weights_only=True))
    optimizer = bench_train.demo_adamw(model.parameters(), args.finetune_lr)
    engine_config = None
    if run != "adamw":
        engine_config = (
            zenflow_config(args)
            if run == "zenflow"
            else ZenFlowConfig(topk_ratio=0.0, update_interval=1, overlap_step=False)
        )

    def engine() -> ZenFlowEngine:
        return ZenFlowEngine(optimizer, engine_config, param_names={p: n for n, p in model.named_parameters()})

    with bench_train.stepping(optimizer, None if engine_config is None else engine, train_cores) as stepper:
        curve = bench_train.train(
            model,
            optimizer,
            stepper,
            data.train_dataloader(),
            steps=args.finetune_steps,
            eval_every=args.eval_every,
            evaluate=lambda: bench_train.evaluate(model, eval_batches),
        )
        used = getattr(stepper, "engine", None)
    return {
        "run": run,
        "config": None
        if used is None
        else {
            "topk_ratio": used.config.topk_ratio,
            "update_interval": used.config.update_interval,
            "overlap_step": used.config.overlap_step,
            "select_strategy": used.config.select_strategy,
            "select_interval": used.config.select_interval,
        },
        "eval_steps": curve.eval_steps,
        "eval_loss": curve.eval_loss,
        "train_loss": curve.train_loss,
        "final_eval_loss": curve.eval_loss[-1],
        "wall_s": time.perf_counter() - curve.started,
        "stall_s": curve.stall_s,
        "weights_checksum": float(sum(p.detach().double().abs().sum() for p in model.parameters())),
    }


def plot(results: dict[str, dict[str, Any]], path: pathlib.Path, title: str) -> None:
    plt = bench_utils.matplotlib_pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(6.5, 4.2))
    for run, style in zip(RUNS, ("-o", "-s", "--^")):
        axes.plot(results[run]["eval_steps"], results[run]["eval_loss"], style, label=run, markersize=4)
    axes.set_xlabel("fine-tuning step")
    axes.set_ylabel("held-out loss (nats per byte)")
    bench_utils.save_figure(plt, figure, axes, path, title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = bench_utils.announce(
        "accuracy: fine-tuning parity of ZenFlow and synchronous offload against AdamW, one run, same data order",
        torch.device("cpu"),
    )
    train_cores, host_cores = ZenFlowConfig().core_split()
    print(
        f"model: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} block={args.block_size}; "
        f"batch {args.batch_size}; seed {args.seed}; corpus: Python stdlib sources, first {args.max_bytes} bytes, "
        "byte level"
    )
    print(
        f"pre-train: {args.pretrain_steps} AdamW steps on the first half, lr {args.pretrain_lr}. fine-tune: "
        f"{args.finetune_steps} steps on the second half, lr {args.finetune_lr}; held-out loss on "
        f"{args.eval_batches} fixed validation batches of the second half every {args.eval_every} steps"
    )
    print(f"cores: fine-tunes run on {train_cores} with {len(train_cores)} thread(s); the host worker on {host_cores}")
    zenflow = zenflow_config(args)
    print(
        f"zenflow run: topk_ratio={zenflow.topk_ratio}, update_interval={zenflow.update_interval}, overlap_step="
        f"{zenflow.overlap_step}, select_strategy={zenflow.select_strategy!r}, select_interval="
        f"{zenflow.select_interval!r}" + (" (selects once, at step 1)" if args.select_interval is None else "")
    )

    model, pretrain_losses, pretrain_s = pretrain(args, data_module(args, "first_half", args.pretrain_steps))
    n_params = model.num_parameters()
    pretrained_path = args.out.with_name(args.out.stem + "_pretrained.pt")
    pretrained_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), pretrained_path)
    print(
        f"pre-trained {n_params / 1e6:.3f}M parameters in {pretrain_s:.1f} s: train loss "
        f"{pretrain_losses[0]:.3f} -> {pretrain_losses[-1]:.3f}; saved {pretrained_path}"
    )
    del model

    finetune_data = data_module(args, "second_half", args.finetune_steps)
    validation = finetune_data.val_dataloader()
    eval_batches = []
    for batch in validation:
        if len(eval_batches) == args.eval_batches:
            break
        eval_batches.append(batch)
    if len(eval_batches) < args.eval_batches:
        print(f"note: the validation split holds only {len(eval_batches)} batches; evaluating on those.")

    results = {}
    for run in RUNS:
        print(f"[{run}] fine-tuning ...", end="", flush=True)
        results[run] = finetune(run, args, pretrained_path, finetune_data, eval_batches, train_cores)
        print(f" final held-out loss {results[run]['final_eval_loss']:.4f} ({results[run]['wall_s']:.1f} s)")

    reference = results["adamw"]
    rows = []
    for index, step in enumerate(reference["eval_steps"]):
        rows.append(
            [step]
            + [results[run]["eval_loss"][index] for run in RUNS]
            + [100 * (results[run]["eval_loss"][index] / reference["eval_loss"][index] - 1) for run in RUNS[1:]]
        )
    bench_utils.print_table(
        "\nHeld-out loss (nats per byte) during fine-tuning",
        ["step", *RUNS, "zenflow gap %", "sync-offload gap %"],
        rows,
        digits=5,
    )
    gaps = {run: 100 * (results[run]["final_eval_loss"] / reference["final_eval_loss"] - 1) for run in RUNS}
    bench_utils.print_table(
        "\nFinal held-out loss",
        ["run", "final loss", "gap vs adamw %", "wall s", "stall s"],
        [
            [run, results[run]["final_eval_loss"], gaps[run], results[run]["wall_s"], results[run]["stall_s"]]
            for run in RUNS
        ],
        digits=5,
    )
    within = abs(gaps["zenflow"]) <= 100 * PARITY_TOLERANCE
    verdict = (
        f"ZenFlow's final held-out loss is within {100 * PARITY_TOLERANCE:.0f} % of AdamW's ({gaps['zenflow']:+.3f} %)."
        if within
        else f"ZenFlow's final held-out loss is NOT within {100 * PARITY_TOLERANCE:.0f} % of AdamW's: "
        f"{gaps['zenflow']:+.3f} % ({results['zenflow']['final_eval_loss']:.4f} vs "
        f"{reference['final_eval_loss']:.4f}). Target missed at these settings."
    )
    print("\n" + verdict)
    sync_curve_gap = max(abs(a - b) / b for a, b in zip(results["sync-offload"]["eval_loss"], reference["eval_loss"]))
    sync_ok = sync_curve_gap <= 1e-4
    print(
        f"sync-offload vs AdamW (should agree to float tolerance): largest relative difference on the curve "
        f"{sync_curve_gap:.2e} -> {'ok' if sync_ok else 'LARGER THAN 1e-4: the offload path differs from AdamW'}"
    )

    payload = bench_utils.payload(
        "accuracy",
        info,
        settings=bench_utils.settings_of(args),
        n_params=n_params,
        cores={"training_process": train_cores, "host_worker": host_cores},
        pretrain={
            "steps": args.pretrain_steps,
            "train_loss_first": pretrain_losses[0],
            "train_loss_last": pretrain_losses[-1],
            "seconds": pretrain_s,
            "checkpoint": str(pretrained_path),
        },
        runs=results,
        final_gap_percent=gaps,
        parity_tolerance_percent=100 * PARITY_TOLERANCE,
        zenflow_within_tolerance=within,
        sync_offload_max_relative_difference=sync_curve_gap,
        sync_offload_matches_adamw=sync_ok,
    )
    bench_utils.write_results(args.out, payload)
    if args.plot:
        title = (
            f"GPT {n_params / 1e6:.2f}M, fine-tune {args.finetune_steps} steps after {args.pretrain_steps} "
            f"pre-training steps; {info['date']}"
        )
        plot(results, args.out.with_suffix(".png"), title)
    if not all(math.isfinite(results[run]["final_eval_loss"]) for run in RUNS):
        print("a run diverged (non-finite loss).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
