"""Fine-tune quality: AdamW, synchronous offload, ZenFlow and ablations of its rule, from one pre-trained base.

Stage 1 (cached). Pre-train the demo GPT with plain ``torch.optim.AdamW`` on **code**: the Python standard library's
``.py`` sources with their docstrings removed (comments kept), byte level. The base is saved under ``--cache``, keyed
by a hash of the settings and of the corpus bytes, and reused by every later run with the same key (the thread count
is not in the key: bases pre-trained with another one differ by float rounding).

Stage 2. Fine-tune copies of the base on a shifted distribution, **documentation prose**: the standard library's
docstrings plus the language reference text that Python ships in ``pydoc_data.topics``. Every 10th document is held
out; the held-out loss (fixed blocks, the same for every run) is measured every ``--eval-every`` steps, after
``engine.sync()`` (as ``ZenFlowStrategy`` does at validation) and, at the end, after ``engine.flush()``. Rows:

- ``adamw``: ``torch.optim.AdamW(foreach=False, fused=False)``, the reference;
- ``sync-offload``: the engine with ``topk_ratio=0, update_interval=1, overlap_step=False``, which the design says
  equals AdamW to float rounding (a check of the harness);
- ``zenflow``: the engine's defaults (rho 0.1, S 4, overlap on, selection per epoch, 10 warm-up steps, l2 importance);
- ``paper``: the paper's rule, the defaults without the warm-up;
- ablations: the paper's rule with one knob changed, plus ``delay-only`` and ``window-only`` (rho 0), which separate the
  two costs of the host path (``--list-rows`` prints them all).

Each seed fixes the order of the fine-tuning batches; every row sees the same batches for the same seed, so the gap
to AdamW is paired by seed. All fine-tunes run on the same cores with the same thread count (the engine's
training-process share; the AdamW rows are pinned the same way), so matmul reductions match.

The AdamW runs also record what the paper's premise is about: at every ``--probe-every`` steps, per weight matrix, the
share of the squared gradient norm in the top 1 % and top 10 % of its columns (k = ceil(fraction x columns), the
engine's rounding), the Jaccard overlap of the top-10 % set with the previous probe's, and the share that the
selection made at step 1 (what the default engine keeps) still captures.

    python benchmarks/finetune_quality.py            # 31 fine-tunes: 10-20 minutes on 2 cores, plus 3 for a new base
    python benchmarks/finetune_quality.py --quick    # smoke run, < 20 s
    python benchmarks/finetune_quality.py --lrs 5e-4 1e-3 2e-3 4e-3 --main-rows zenflow --ablations zenflow-S8 \
        --seeds 2 --finetune-schedule constant     # best against best: each optimizer at its best rate

``--lrs``: every chosen row runs at each rate (a factor of 2 apart, bracketing AdamW's best); the tables then give the
final held-out loss per rate and, per row, its best rate (lowest mean over seeds) against AdamW's best, paired by seed,
and the largest ratio of its held-out loss to AdamW's at the same rate, seed and evaluation step (a spike or a
divergence where AdamW has none shows there).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import bench_utils
import rate_sweep
import torch

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.config import num_selected_columns
from lightning_zenflow.demo.stdlib import split_docstrings
from lightning_zenflow.engine.selection import column_scores, top_columns

# The demo model is imported inside the functions that need it: it imports Lightning, and the engine's spawned host
# worker re-imports this script's top level, which should stay cheap.

DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "finetune_quality.json"
DEFAULT_CACHE = pathlib.Path(__file__).parent / "out" / "finetune_quality_cache"
HOLD_OUT_EVERY = 10
"""Every 10th document (a source file, a file's docstrings, a reference topic) is held out."""
CONCENTRATION_FRACTIONS = (0.01, 0.1)
STABILITY_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    knobs: dict[str, Any] | None
    """ZenFlowConfig changes from the defaults; None for the AdamW reference."""
    what: str


MAIN_ROWS = (
    Row("adamw", None, "torch.optim.AdamW (fused=False), the reference"),
    Row(
        "sync-offload",
        {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "host_state": "fp32"},
        "ZeRO-Offload semantics, the exact fp32 host state",
    ),
    Row("zenflow", {}, "engine defaults: rho 0.1, S 4, overlap on, select per epoch, 10 warm-up steps, l2, bf16 state"),
    Row("zenflow-fp32", {"host_state": "fp32"}, "the defaults with the exact fp32 host state (12 B/param, not 6)"),
    Row(
        "paper", {"full_warm_up_rounds": 0}, "the paper's rule (and DeepSpeed's defaults): the defaults without warm-up"
    ),
    Row("no-moves", {"interim_step": 0}, "the defaults without interim moves"),
)
PAPER = {"full_warm_up_rounds": 0}
"""The ablations change one knob of the paper's rule (measured before the defaults took a warm-up)."""
ABLATION_ROWS = (
    Row("S=1", {**PAPER, "update_interval": 1}, "window: host update every step (still one step late)"),
    Row("S=2", {**PAPER, "update_interval": 2}, "window of 2"),
    Row("S=8", {**PAPER, "update_interval": 8}, "window of 8"),
    Row("no-overlap", {**PAPER, "overlap_step": False}, "S 4, host update applied at its own window end"),
    Row("rho=0", {**PAPER, "topk_ratio": 0.0}, "no column on the device: every matrix on the delayed host path"),
    Row("rho=0.05", {**PAPER, "topk_ratio": 0.05}, "fewer device columns"),
    Row("rho=0.3", {**PAPER, "topk_ratio": 0.3}, "more device columns"),
    Row(
        "delay-only", {**PAPER, "topk_ratio": 0.0, "update_interval": 1}, "rho 0, S 1, overlap on: AdamW one step late"
    ),
    Row(
        "window-only",
        {**PAPER, "topk_ratio": 0.0, "overlap_step": False},
        "rho 0, S 4, overlap off: one AdamW step per window",
    ),
    Row("refresh-16", {**PAPER, "select_strategy": "step", "select_interval": 16}, "re-select every 16 steps"),
    Row("zenflow-S8", {"update_interval": 8}, "the defaults with a window of 8"),
    Row("zenflow-70b", {"topk_ratio": 0.05, "update_interval": 7}, "configs/llm_70b.yaml's setting: rho 0.05, S 7"),
    Row("warm-up-10", {**PAPER, "full_warm_up_rounds": 10}, "first 10 steps full synchronous AdamW"),
    Row("l1", {**PAPER, "importance": "l1"}, "column score: L1 sum instead of squared L2"),
    Row("land-after-1", {**PAPER, "land_after": 1}, "host update lands 1 step after its window, not a window later"),
    Row("land-after-2", {**PAPER, "land_after": 2}, "host update lands 2 steps after its window"),
    Row(
        "overlap-after-16",
        {**PAPER, "overlap_after": 16},
        "no warm-up; windows closing at steps <= 16 land at once (4 host waits), later ones overlap",
    ),
    Row(
        "select-once",
        {"select_strategy": "epoch", "select_interval": 1},
        "the defaults, selecting once per epoch: "
        "with --epoch-unknown one selection after warm-up, never refreshed (ZenFlowAdamW's default before the step "
        "cadence)",
    ),
    Row("refresh-32", {"select_strategy": "step", "select_interval": 32}, "the defaults, re-selecting every 32 steps"),
    Row("refresh-64", {"select_strategy": "step", "select_interval": 64}, "the defaults, re-selecting every 64 steps"),
    Row(
        "refresh-128", {"select_strategy": "step", "select_interval": 128}, "the defaults, re-selecting every 128 steps"
    ),
    Row("interim-1", {"interim_step": 1.0}, "the defaults with interim moves of the host columns (interim_step 1)"),
    Row("interim-0.5", {"interim_step": 0.5}, "the defaults with half-size interim moves"),
    Row("interim-1.5", {"interim_step": 1.5}, "the defaults with interim moves of 1.5 times the size"),
    Row("paper+interim-1", {**PAPER, "interim_step": 1.0}, "the paper's rule with interim moves"),
    Row(
        "warm-up-10+refresh-16",
        {**PAPER, "full_warm_up_rounds": 10, "select_strategy": "step", "select_interval": 16},
        "the two knobs that helped, together",
    ),
    Row(
        "warm-up-10+refresh-16+S=8",
        {**PAPER, "full_warm_up_rounds": 10, "select_strategy": "step", "select_interval": 16, "update_interval": 8},
        "and a window of 8",
    ),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="tiny model, few steps, one seed: a < 20 s smoke run.",
        plot="also write a PNG: held-out loss vs step and vs time.",
    )
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE, help="folder of cached base models.")
    parser.add_argument("--list-rows", action="store_true", help="print the rows and exit.")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the main rows (default 3; quick 1).")
    parser.add_argument("--ablation-seeds", type=int, default=None, help="seeds of each ablation (default 2; quick 1).")
    parser.add_argument("--sync-seeds", type=int, default=1, help="seeds of the sync-offload check row (default 1).")
    parser.add_argument(
        "--main-rows", nargs="*", default=None, help="main rows to run (default all; adamw is always run)."
    )
    parser.add_argument("--ablations", nargs="*", default=None, help="ablation rows to run (default all; quick none).")
    parser.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a row of your own, run as an ablation: the defaults with these ZenFlowConfig knobs (e.g. --row "
        """'S8-k2={"update_interval": 8, "interim_step": 2}'); may be given more than once.""",
    )
    parser.add_argument("--n-layer", type=int, default=None, help="default 4 (quick 2).")
    parser.add_argument("--n-embd", type=int, default=None, help="default 128 (quick 32).")
    parser.add_argument("--n-head", type=int, default=None, help="default 4 (quick 2).")
    parser.add_argument("--block-size", type=int, default=None, help="default 128 (quick 32).")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="default 800 (quick 40).")
    parser.add_argument("--pretrain-batch", type=int, default=None, help="default 16 (quick 8).")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3, help="peak lr; 50-step warm-up, cosine to 10 %%.")
    parser.add_argument(
        "--pretrain-threads",
        type=int,
        default=1,
        help="torch threads of the pre-training (default 1: steady on a shared machine; not part of the cache key).",
    )
    parser.add_argument("--finetune-steps", type=int, default=None, help="default 150 (quick 16).")
    parser.add_argument(
        "--weights-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the fine-tunes' weight dtype (the base is fp32). bfloat16: bf16 weights and compute, as 'bf16-true'; "
        "the reference is then sync-offload (AdamW with fp32 masters), the adamw row plain bf16 AdamW. bf16 matrix "
        "products are about 100x slower than fp32 on some CPUs: shrink the model (--n-embd 32 --n-layer 2).",
    )
    parser.add_argument("--finetune-batch", type=int, default=None, help="default 8 (quick 4).")
    parser.add_argument(
        "--finetune-text",
        choices=("prose", "man", "changelog"),
        default="prose",
        help="the fine-tune's text: the documentation prose (default), or the man pages' troff sources or the Debian "
        "changelogs of this machine (benchmarks/domains.py; the tables' 'prose' columns then mean that text).",
    )
    parser.add_argument("--finetune-lr", type=float, default=1e-3, help="peak lr (default 1e-3).")
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=None, help="a sweep: every chosen row at each of these peak rates."
    )
    parser.add_argument("--finetune-warmup", type=int, default=None, help="lr warm-up steps (default 10; quick 2).")
    parser.add_argument(
        "--finetune-schedule", choices=("cosine", "constant"), default="cosine", help="after warm-up (cosine to 10 %%)."
    )
    parser.add_argument("--eval-every", type=int, default=None, help="default 25 (quick 8).")
    parser.add_argument("--eval-blocks", type=int, default=None, help="held-out blocks per evaluation (128; quick 8).")
    parser.add_argument("--probe-every", type=int, default=None, help="gradient statistics period (16; quick 8).")
    parser.add_argument("--max-files", type=int, default=None, help="stdlib files read (default all; quick 40).")
    parser.add_argument(
        "--epoch-unknown",
        action="store_true",
        help="the engines are not told the epoch's length, as ZenFlowAdamW in a plain loop (select_strategy='auto' "
        "then re-selects on a step cadence; 'epoch' selects once).",
    )
    args = bench_utils.apply_quick_defaults(
        parser.parse_args(argv),
        {
            "seeds": (3, 1),
            "ablation_seeds": (2, 1),
            "n_layer": (4, 2),
            "n_embd": (128, 32),
            "n_head": (4, 2),
            "block_size": (128, 32),
            "pretrain_steps": (800, 40),
            "pretrain_batch": (16, 8),
            "finetune_steps": (150, 16),
            "finetune_batch": (8, 4),
            "finetune_warmup": (10, 2),
            "eval_every": (25, 8),
            "eval_blocks": (128, 8),
            "probe_every": (16, 8),
            "max_files": (None, 40),
        },
    )
    if args.ablations is None:
        args.ablations = [] if args.quick else [row.name for row in ABLATION_ROWS]
    if args.main_rows is None:
        args.main_rows = [row.name for row in MAIN_ROWS]
    args.main_rows = sorted({"adamw", *args.main_rows}, key=[row.name for row in MAIN_ROWS].index)
    args.custom = {}
    for spec in args.row:
        try:
            name, knobs = rate_sweep.row_spec(spec)
            ZenFlowConfig(**knobs)
        except (TypeError, ValueError) as err:
            parser.error(f"--row {spec!r}: {err}")
        if name in {row.name for row in (*MAIN_ROWS, *ABLATION_ROWS)}:
            parser.error(f"--row {spec!r}: a row of that name exists; --list-rows prints them.")
        args.custom[name] = knobs
    unknown = sorted(set(args.ablations) - {row.name for row in ABLATION_ROWS})
    unknown += sorted(set(args.main_rows) - {row.name for row in MAIN_ROWS})
    if unknown:
        parser.error(f"unknown rows {unknown}; --list-rows prints the names.")
    return args


# ------------------------------------------------------------------------------------------------- the loop
def demo_gpt(args: Any) -> torch.nn.Module:
    """A fresh demo GPT of ``args``' shape (``n_layer``, ``n_embd``, ``n_head``, ``block_size``). Lightning is
    imported here, not at the top level of the scripts that use it."""
    from lightning_zenflow.demo import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size))


class AdamWStep:
    """The reference: ``optimizer.step()`` in the training process."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def before_forward(self) -> None:
        pass

    def step(self) -> float:
        self.optimizer.step()
        return 0.0

    def settle(self, last: bool) -> None:
        pass


class EngineStep:
    """A started ``ZenFlowEngine``: waits for the device update before each forward, syncs before evaluations and
    flushes at the end (as ``ZenFlowStrategy`` does at validation and at the end of fit)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.selections: list[dict[str, Any]] = []
        self.t = 0

    def before_forward(self) -> None:
        self.engine.wait_for_update()  # the forward reads weights the last device update wrote

    def step(self) -> float:
        self.t += 1
        stats = self.engine.step()
        if stats.refreshed:
            self.selections.append(
                {"step": self.t, "overlap": stats.selection_overlap, "captured": stats.selection_captured}
            )
        return stats.stall_s

    def settle(self, last: bool) -> None:
        # apply host work in flight (sync) or everything (flush, at the end) before measuring the model
        self.engine.flush() if last else self.engine.sync()
        self.engine.wait_for_update()


@contextlib.contextmanager
def stepping(
    optimizer: torch.optim.Optimizer, engine: Callable[[], Any] | None, train_cores: Sequence[int]
) -> Iterator[AdamWStep | EngineStep]:
    """The row's stepper for the block: ``engine()`` builds an engine, started here and closed after; without one
    the AdamW reference runs pinned to ``train_cores`` with one thread each, as the engine pins its training
    process, so matmul reductions match across the rows."""
    if engine is None:
        with bench_utils.pinned(train_cores):
            yield AdamWStep(optimizer)
    else:
        with engine() as started:
            yield EngineStep(started)


@dataclasses.dataclass
class Curve:
    """What ``train`` records: the held-out loss at step 0, every ``eval_every`` steps and at the end, with the
    training time spent until then (evaluations and ``after_backward`` excluded), and every step's training loss."""

    eval_steps: list[int] = dataclasses.field(default_factory=list)
    eval_loss: list[float] = dataclasses.field(default_factory=list)
    eval_train_s: list[float] = dataclasses.field(default_factory=list)
    train_loss: list[float] = dataclasses.field(default_factory=list)
    train_s: float = 0.0
    stall_s: float = 0.0
    started: float = 0.0
    """``perf_counter()`` after the step-0 evaluation, when the first step began."""


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stepper: AdamWStep | EngineStep,
    batches: Iterable[Any],
    *,
    steps: int,
    eval_every: int | None = None,
    evaluate: Callable[[], float] | None = None,
    scheduler: Any = None,
    batch_of: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None,
    after_backward: Callable[[int], None] | None = None,
    log_every: int | None = None,
) -> Curve:
    """Train on ``batches`` (each ``(x, y)``, or ``batch_of(item)``; the model returns ``(logits, loss)``): forward,
    backward, ``stepper.step()``, ``zero_grad``, ``scheduler.step()``. With ``evaluate``: its value at step 0, every
    ``eval_every`` steps and at step ``steps``, each after ``stepper.settle()``. ``after_backward(step)`` runs between
    the backward and the step (its time not counted); ``log_every`` prints the mean training loss that often."""
    curve = Curve()
    if evaluate is not None:
        curve.eval_steps.append(0)
        curve.eval_loss.append(evaluate())
        curve.eval_train_s.append(0.0)
    curve.started = time.perf_counter()
    for step, item in enumerate(batches, start=1):
        started = time.perf_counter()
        stepper.before_forward()
        x, y = item if batch_of is None else batch_of(item)
        _, loss = model(x, y)
        loss.backward()
        if after_backward is not None:
            curve.train_s += time.perf_counter() - started
            after_backward(step)
            started = time.perf_counter()
        curve.stall_s += stepper.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        curve.train_loss.append(loss.item())
        curve.train_s += time.perf_counter() - started
        if log_every and step % log_every == 0:
            print(f"  step {step}: train loss {statistics.fmean(curve.train_loss[-log_every:]):.3f}", flush=True)
        last = step == steps
        if evaluate is not None and (step % eval_every == 0 or last):
            stepper.settle(last)
            curve.eval_steps.append(step)
            curve.eval_loss.append(evaluate())
            curve.eval_train_s.append(curve.train_s)
    return curve


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The mean loss over ``batches`` in eval mode (the model returns ``(logits, loss)``); back to train mode after."""
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------------------------------- corpora
@dataclasses.dataclass
class Corpora:
    code_train: torch.Tensor
    code_heldout: torch.Tensor
    prose_train: torch.Tensor
    prose_heldout: torch.Tensor
    files: int
    topics: int
    digest: str


def _tokens(documents: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n\n".join(documents)), dtype=torch.uint8).clone()


def _split(documents: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``HOLD_OUT_EVERY``-th document held out: (train tokens, held-out tokens)."""
    held = [d for i, d in enumerate(documents) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    kept = [d for i, d in enumerate(documents) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return _tokens(kept), _tokens(held)


def with_finetune_text(corpora: Corpora, text: str) -> Corpora:
    """``--finetune-text``: the fine-tune on another text than the prose, one ``domains.py`` reads from the machine
    (the man pages' troff, Debian changelogs; every 10th document held out). The base is the same (pre-trained on the
    code alone: its cache key does not change)."""
    if text == "prose":
        return corpora
    import domains

    read = {"man": domains.man_pages, "changelog": domains.debian_changelogs}[text]
    try:
        documents = [document.encode() for document in read()]
    except domains.DomainMissing as error:
        raise SystemExit(f"--finetune-text {text}: {error}") from error
    train, heldout = _split(documents)
    return dataclasses.replace(corpora, prose_train=train, prose_heldout=heldout)


def build_corpora(max_files: int | None) -> Corpora:
    """Code (docstrings removed) and prose (docstrings, reference topics), each split into train and held-out."""
    from lightning_zenflow.demo import default_corpus_files

    files = default_corpus_files()[:max_files]
    code: list[bytes] = []
    prose: list[bytes] = []
    for path in files:
        try:
            code_text, docstrings = split_docstrings(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        code.append(code_text.encode())
        if docstrings:
            prose.append("\n\n".join(docstrings).encode())
    topics = 0
    with contextlib.suppress(ImportError):  # some slim Pythons ship without pydoc_data
        from pydoc_data.topics import topics as reference

        chosen = sorted(reference)[: max(1, len(reference) * len(files) // 600)] if max_files else sorted(reference)
        prose.extend(reference[name].encode() for name in chosen)
        topics = len(chosen)

    code_train, code_heldout = _split(code)
    prose_train, prose_heldout = _split(prose)
    digest = hashlib.sha256()
    for part in (code_train, code_heldout, prose_train, prose_heldout):
        digest.update(part.numpy().tobytes())
    return Corpora(code_train, code_heldout, prose_train, prose_heldout, len(files), topics, digest.hexdigest())


def unigram_cross_entropy(train: torch.Tensor, heldout: torch.Tensor) -> float:
    """Nats per byte of ``heldout`` under the byte frequencies of ``train`` (add-one smoothed): the loss a model
    that ignores context would reach."""
    counts = torch.bincount(train.long(), minlength=256).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[heldout.long()].mean())


def random_batches(tokens: torch.Tensor, steps: int, batch: int, block: int, seed: int, tag: str) -> torch.Tensor:
    """Start offsets ``[steps, batch]`` of random windows, fixed by ``(seed, tag)``."""
    key = int.from_bytes(hashlib.blake2b(f"{tag}:{seed}".encode(), digest_size=8).digest(), "little") >> 1
    generator = torch.Generator().manual_seed(key)
    return torch.randint(0, tokens.numel() - block - 1, (steps, batch), generator=generator)


def eval_set(tokens: torch.Tensor, blocks: int, block: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``blocks`` windows spread evenly over ``tokens``, in batches of ``batch``."""
    starts = torch.linspace(0, tokens.numel() - block - 1, blocks).long()
    return [bench_utils.windows(tokens, chunk, block) for chunk in starts.split(batch)]


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """The demo's AdamW (``bench_utils.demo_adamw``) with the plain per-parameter loop (foreach and fused off)."""
    return bench_utils.demo_adamw(model.parameters(), lr, foreach=False, fused=False)


def lr_schedule(optimizer: torch.optim.Optimizer, warmup: int, kind: str, steps: int) -> Any:
    from lightning_zenflow.demo.model import WarmupSchedule

    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupSchedule(warmup, kind, steps))


# ---------------------------------------------------------------------------------------------- stage 1: base
def pretrain_settings(args: argparse.Namespace, corpora: Corpora) -> dict[str, Any]:
    return {
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "block_size": args.block_size,
        "steps": args.pretrain_steps,
        "batch": args.pretrain_batch,
        "lr": args.pretrain_lr,
        "warmup": min(50, args.pretrain_steps // 10),
        "schedule": "cosine",
        "seed": 0,
        "corpus_sha256": corpora.digest,
        "torch": torch.__version__.split("+")[0],
    }


def load_or_pretrain(args: argparse.Namespace, corpora: Corpora) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The base model's state dict and a record of how it was made; pre-trains and caches it when missing."""
    settings = pretrain_settings(args, corpora)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = args.cache / f"base_{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        record = json.loads(saved["record"])
        record.update(cached=True, path=str(path))
        print(f"base: cached {path.name} (pre-trained in {record['seconds']:.0f} s)")
        return saved["model"], record
    torch.manual_seed(settings["seed"])
    model = demo_gpt(args)
    optimizer = make_optimizer(model, args.pretrain_lr)
    scheduler = lr_schedule(optimizer, settings["warmup"], "cosine", args.pretrain_steps)
    starts = random_batches(corpora.code_train, args.pretrain_steps, args.pretrain_batch, args.block_size, 0, "pre")
    threads = args.pretrain_threads
    print(f"base: pre-training {args.pretrain_steps} steps on {threads} thread(s) (cached afterwards) ...", flush=True)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    started = time.perf_counter()
    try:
        losses = train(
            model,
            optimizer,
            AdamWStep(optimizer),
            starts,
            steps=args.pretrain_steps,
            scheduler=scheduler,
            batch_of=lambda step_starts: bench_utils.windows(corpora.code_train, step_starts, args.block_size),
            log_every=100,
        ).train_loss
    finally:
        torch.set_num_threads(saved_threads)
    seconds = time.perf_counter() - started
    record = {
        "settings": settings,
        "key": key,
        "seconds": seconds,
        "threads": threads,
        "train_loss_first": losses[0],
        "train_loss_last_50_mean": statistics.fmean(losses[-50:]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "record": json.dumps(record)}, path)
    record.update(cached=False, path=str(path))
    last = record["train_loss_last_50_mean"]
    print(f"base: pre-trained in {seconds:.0f} s, train loss {losses[0]:.3f} -> {last:.3f} (mean of the last 50)")
    return model.state_dict(), record


# ------------------------------------------------------------------------------------- gradient statistics
def matrix_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable matrix's gradient viewed as the engine views it: ``[shape[0], numel // shape[0]]``."""
    return {
        name: p.grad.reshape(p.shape[0], -1)
        for name, p in model.named_parameters()
        if p.requires_grad and p.ndim >= 2 and p.grad is not None
    }


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    a_set, b_set = set(a.tolist()), set(b.tolist())
    return len(a_set & b_set) / max(1, len(a_set | b_set))


def probe(grads: dict[str, torch.Tensor], previous: dict | None, first: dict | None) -> dict[str, dict[str, float]]:
    """Per matrix: top-1 %/10 % shares of the squared column norms, Jaccard of the top-10 % set with ``previous``'s,
    and the share the ``first`` probe's top-10 % set captures now."""
    out = {}
    for name, grad in grads.items():
        scores = column_scores(grad, "l2").double()
        total = float(scores.sum()) or 1.0
        record: dict[str, Any] = {}
        for fraction in CONCENTRATION_FRACTIONS:
            k = num_selected_columns(grad.shape[1], fraction)
            record[f"top{fraction:g}"] = float(scores[top_columns(scores, k)].sum()) / total
        selected = top_columns(scores, num_selected_columns(grad.shape[1], STABILITY_FRACTION))
        record["selected"] = selected
        record["jaccard_prev"] = None if previous is None else jaccard(previous[name]["selected"], selected)
        record["first_captures"] = None if first is None else float(scores[first[name]["selected"]].sum()) / total
        out[name] = record
    return out


def matrix_kind(name: str) -> str:
    """``blocks.2.mlp.fc.weight`` -> ``mlp.fc``; ``lm_head.weight`` -> ``lm_head``."""
    parts = name.split(".")[:-1]
    return ".".join(parts[2:]) if parts[0] == "blocks" else ".".join(parts)


def summarise_probes(per_seed: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Mean over matrices at each probe step (and over seeds), plus a per-kind table at the first and last probe."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for seed_probes in per_seed:
        for entry in seed_probes:
            by_step.setdefault(entry["step"], []).append(entry["matrices"])
    steps = []
    for step, seed_matrices in sorted(by_step.items()):
        values: dict[str, list[float]] = {}
        for matrices in seed_matrices:
            for record in matrices.values():
                for key, value in record.items():
                    if key != "selected" and value is not None:
                        values.setdefault(key, []).append(value)
        steps.append({"step": step, **{key: statistics.fmean(v) for key, v in values.items()}})
    kinds: dict[str, dict[str, float]] = {}
    for label, position in (("first", 0), ("last", -1)):
        step = sorted(by_step)[position]
        grouped: dict[str, list[float]] = {}
        for matrices in by_step[step]:
            for name, record in matrices.items():
                for key in ("top0.01", "top0.1", "first_captures"):
                    if record[key] is not None:
                        grouped.setdefault(f"{matrix_kind(name)}|{key}", []).append(record[key])
        for compound, values in grouped.items():
            kind, key = compound.split("|")
            kinds.setdefault(kind, {})[f"{label}_{key}"] = statistics.fmean(values)
    return {"steps": steps, "kinds": kinds}


# ------------------------------------------------------------------------------------------ stage 2: fine-tune
@dataclasses.dataclass
class Setting:
    args: argparse.Namespace
    base: dict[str, torch.Tensor]
    corpora: Corpora
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]]
    train_cores: list[int]
    steps_per_epoch: int

    def batch(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fine-tuning batch of windows of the prose corpus starting at ``starts``."""
        return bench_utils.windows(self.corpora.prose_train, starts, self.args.block_size)

    def start(self, seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.AdamW, Any, torch.Tensor]:
        """A fine-tune's model (the base), optimizer, lr schedule and batch starts (fixed by ``seed``)."""
        args = self.args
        torch.manual_seed(seed)
        model = demo_gpt(args)
        model.load_state_dict(self.base)
        model.to(getattr(torch, args.weights_dtype))
        optimizer = make_optimizer(model, lr)
        scheduler = lr_schedule(optimizer, args.finetune_warmup, args.finetune_schedule, args.finetune_steps)
        starts = random_batches(
            self.corpora.prose_train, args.finetune_steps, args.finetune_batch, args.block_size, seed, "fine"
        )
        return model, optimizer, scheduler, starts


def build_setting(args: argparse.Namespace, corpora: Corpora, base: dict[str, torch.Tensor]) -> Setting:
    """The fine-tunes' shared inputs: the held-out prose blocks, the engine's training cores, the epoch length."""
    eval_batches = eval_set(corpora.prose_heldout, args.eval_blocks, args.block_size, 16)
    steps_per_epoch = max(1, corpora.prose_train.numel() // (args.finetune_batch * args.block_size))
    train_cores, _ = ZenFlowConfig().core_split()
    return Setting(args, base, corpora, eval_batches, train_cores, steps_per_epoch)


def fp32_view(model: torch.nn.Module) -> torch.nn.Module:
    """The model to evaluate: itself with fp32 weights; an fp32 copy of bf16 ones (the weights exactly as trained),
    so the held-out loss is not rounded to bf16 (whose step near 2.5 is 0.016, several per cent of a gap)."""
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return model
    return copy.deepcopy(model).float()


def finetune(row: Row, seed: int, setting: Setting, lr: float | None = None) -> dict[str, Any]:
    """One fine-tune from the base: held-out loss at step 0, every ``eval_every`` steps and at the end."""
    args = setting.args
    lr = args.finetune_lr if lr is None else lr
    model, optimizer, scheduler, starts = setting.start(seed, lr)
    config = None if row.knobs is None else ZenFlowConfig(**row.knobs)
    probes: list[dict[str, Any]] = []

    def record_probe(step: int) -> None:
        if step == 1 or step % args.probe_every == 0:
            previous = probes[-1]["matrices"] if probes else None
            first = probes[0]["matrices"] if probes else None
            probes.append({"step": step, "matrices": probe(matrix_grads(model), previous, first)})

    def engine() -> ZenFlowEngine:
        names = {p: n for n, p in model.named_parameters()}
        steps_per_epoch = None if args.epoch_unknown else setting.steps_per_epoch
        return ZenFlowEngine(optimizer, config, param_names=names, steps_per_epoch=steps_per_epoch)

    with stepping(optimizer, None if config is None else engine, setting.train_cores) as stepper:
        curve = train(
            model,
            optimizer,
            stepper,
            starts,
            steps=args.finetune_steps,
            eval_every=args.eval_every,
            evaluate=lambda: evaluate(fp32_view(model), setting.eval_batches),
            scheduler=scheduler,
            batch_of=setting.batch,
            after_backward=record_probe if config is None else None,  # the premise, measured on AdamW's gradients
        )
    for entry in probes:
        for record in entry["matrices"].values():
            record["selected"] = record["selected"].tolist()
    return {
        "row": row.name if args.lrs is None else f"{row.name} lr={lr:g}",
        "optimizer": row.name,
        "lr": lr,
        "seed": seed,
        "config": None if config is None else dataclasses.asdict(config),
        "eval_steps": curve.eval_steps,
        "eval_loss": curve.eval_loss,
        "eval_train_s": curve.eval_train_s,
        "train_loss": curve.train_loss,
        "final_eval_loss": curve.eval_loss[-1],
        "train_s": curve.train_s,
        "stall_s": curve.stall_s,
        "selections": getattr(stepper, "selections", []),
        "probes": probes,
    }


def paired_gaps(runs: list[dict[str, Any]]) -> dict[str, tuple[list[dict[str, Any]], list[float]]]:
    """The runs of each row (in order) and their gaps to AdamW's final held-out loss of the same seed, in %."""
    reference = {run["seed"]: run["final_eval_loss"] for run in runs if run["row"] == "adamw"}
    rows: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        rows.setdefault(run["row"], []).append(run)
    return {
        name: (
            row_runs,
            [100 * (r["final_eval_loss"] / reference[r["seed"]] - 1) for r in row_runs if r["seed"] in reference],
        )
        for name, row_runs in rows.items()
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: final loss and paired gap to AdamW (same seed) over seeds, and the mean curve."""
    rows: dict[str, dict[str, Any]] = {}
    for name, (row_runs, gaps) in paired_gaps(runs).items():
        finals = [run["final_eval_loss"] for run in row_runs]
        curves = torch.tensor([run["eval_loss"] for run in row_runs], dtype=torch.float64)
        times = torch.tensor([run["eval_train_s"] for run in row_runs], dtype=torch.float64)
        stall = sum(run["stall_s"] for run in row_runs) / max(1e-9, sum(run["train_s"] for run in row_runs))
        rows[name] = {
            "seeds": [run["seed"] for run in row_runs],
            "final_losses": finals,
            "final_mean": bench_utils.mean_std(finals)[0],
            "final_std": bench_utils.mean_std(finals)[1],
            "gaps_percent": gaps,
            "gap_mean_percent": bench_utils.mean_std(gaps)[0] if gaps else None,
            "gap_std_percent": bench_utils.mean_std(gaps)[1] if gaps else None,
            "eval_steps": row_runs[0]["eval_steps"],
            "mean_eval_loss": curves.mean(0).tolist(),
            "mean_eval_train_s": times.mean(0).tolist(),
            "train_s_mean": statistics.fmean(run["train_s"] for run in row_runs),
            "stall_share": stall,
        }
    return rows


def print_tables(summary: dict[str, dict[str, Any]], rows: list[Row]) -> None:
    def line(row: Row) -> list[Any]:
        entry = summary[row.name]
        gaps = entry["gaps_percent"]
        return [
            row.name,
            len(entry["seeds"]),
            bench_utils.pm(entry["final_losses"], 4),
            bench_utils.pm(gaps, 2, " %") if gaps and row.name != "adamw" else "-",
            entry["train_s_mean"],
            100 * entry["stall_share"] if row.knobs is not None else None,
        ]

    headers = ["row", "seeds", "final held-out loss", "vs AdamW (paired)", "train s", "stall %"]
    main = [row for row in rows if row in MAIN_ROWS and row.name in summary]
    bench_utils.print_table(
        "\nMain rows: final held-out loss (nats per byte), mean ± std over seeds",
        headers,
        [line(row) for row in main],
        digits=4,
    )
    ablations = [row for row in rows if row not in MAIN_ROWS and row.name in summary]
    if ablations:
        bench_utils.print_table(
            "\nAblations (the paper's rule with the change in the last column)",
            [*headers, "change"],
            [[*line(r), r.what] for r in ablations],
            digits=4,
        )
    names = [row.name for row in main]
    steps = summary[names[0]]["eval_steps"]
    curve_rows = [
        [step]
        + [summary[name]["mean_eval_loss"][i] for name in names]
        + [summary[name]["mean_eval_train_s"][i] for name in names]
        for i, step in enumerate(steps)
    ]
    bench_utils.print_table(
        "\nHeld-out loss during fine-tuning (mean over seeds) and the training wall time at that point (s)",
        ["step", *names, *[f"s {name}" for name in names]],
        curve_rows,
        digits=4,
    )


def print_probes(probes: dict[str, Any]) -> None:
    rows = [
        [
            entry["step"],
            100 * entry["top0.01"],
            100 * entry["top0.1"],
            entry.get("jaccard_prev"),
            None if "first_captures" not in entry else 100 * entry["first_captures"],
        ]
        for entry in probes["steps"]
    ]
    bench_utils.print_table(
        "\nGradient concentration and stability in the AdamW fine-tunes (mean over matrices and seeds)",
        ["step", "top 1 % cols, % of |g|²", "top 10 %", "Jaccard top-10 % vs prev", "step-1 set captures %"],
        rows,
        digits=3,
    )
    print(
        "(a uniform spread would give 1 % and 10 %; two random 10 % sets overlap by Jaccard ~0.053; "
        "'step-1 set captures' is the share the selection made at step 1 still holds at that step)"
    )
    kind_rows = [
        [kind, 100 * v.get("first_top0.01", math.nan), 100 * v.get("first_top0.1", math.nan),
         100 * v.get("last_top0.01", math.nan), 100 * v.get("last_top0.1", math.nan),
         100 * v.get("last_first_captures", math.nan)]
        for kind, v in probes["kinds"].items()
    ]  # fmt: skip
    bench_utils.print_table(
        "\nBy matrix kind (mean over layers and seeds): first and last probe",
        ["matrix", "top 1 % first", "top 10 % first", "top 1 % last", "top 10 % last", "step-1 set last"],
        kind_rows,
        digits=3,
    )


def plot(summary: dict[str, dict[str, Any]], names: list[str], path: pathlib.Path, title: str) -> None:
    plt = bench_utils.matplotlib_pyplot()
    if plt is None:
        return
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        entry = summary[name]
        by_step.plot(entry["eval_steps"], entry["mean_eval_loss"], "-o", label=name, markersize=3)
        by_time.plot(entry["mean_eval_train_s"], entry["mean_eval_loss"], "-o", label=name, markersize=3)
    by_step.set_xlabel("fine-tuning step")
    by_time.set_xlabel("training wall time (s, CPU surrogate)")
    for axes in (by_step, by_time):
        axes.set_ylabel("held-out loss (nats per byte)")
        axes.legend(fontsize=7)
    bench_utils.save_figure(plt, figure, by_step, path, title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_rows:
        for row in (*MAIN_ROWS, *ABLATION_ROWS):
            print(f"{row.name:14s} {row.knobs!s:70s} {row.what}")
        return 0
    info = bench_utils.announce(
        "finetune_quality: pre-train on code, fine-tune on prose; AdamW vs offload vs ZenFlow and its ablations",
        torch.device("cpu"),
    )
    train_cores, host_cores = ZenFlowConfig().core_split()
    started = time.perf_counter()
    corpora = with_finetune_text(build_corpora(args.max_files), args.finetune_text)  # the base's key: code only
    parts = ("code_train", "code_heldout", "prose_train", "prose_heldout")
    sizes = {name: getattr(corpora, name).numel() for name in parts}
    unigram = {
        "code": unigram_cross_entropy(corpora.code_train, corpora.code_heldout),
        "prose": unigram_cross_entropy(corpora.prose_train, corpora.prose_heldout),
    }
    print(
        f"corpora ({time.perf_counter() - started:.1f} s): {corpora.files} stdlib files and {corpora.topics} reference "
        f"topics; code (docstrings removed) {sizes['code_train'] / 1e6:.2f} MB train / "
        f"{sizes['code_heldout'] / 1e6:.2f} MB held out; fine-tune text ({args.finetune_text}) "
        f"{sizes['prose_train'] / 1e6:.2f} / {sizes['prose_heldout'] / 1e6:.2f} MB; unigram cross-entropy "
        f"code {unigram['code']:.3f}, prose {unigram['prose']:.3f} nats/byte"
    )
    base, base_record = load_or_pretrain(args, corpora)
    setting = build_setting(args, corpora, base)
    model = demo_gpt(args)
    model.load_state_dict(base)
    base_loss = {
        "code": evaluate(model, eval_set(corpora.code_heldout, args.eval_blocks, args.block_size, 16)),
        "prose": evaluate(model, setting.eval_batches),
    }
    n_params = model.num_parameters()
    del model
    steps_per_epoch = setting.steps_per_epoch
    print(
        f"base: GPT {n_params / 1e6:.3f}M parameters ({args.n_layer} layers, width {args.n_embd}, block "
        f"{args.block_size}); held-out loss code {base_loss['code']:.3f}, prose {base_loss['prose']:.3f} nats/byte"
    )
    print(
        f"fine-tune: {args.finetune_steps} steps of {args.finetune_batch} x {args.block_size} bytes, lr "
        f"{args.finetune_lr} ({args.finetune_warmup} warm-up steps, then {args.finetune_schedule}); an epoch is "
        f"{steps_per_epoch} steps; held-out loss on {args.eval_blocks} blocks every {args.eval_every} steps; "
        f"cores: training {train_cores} ({len(train_cores)} thread(s)), host worker {host_cores}"
    )
    plan: list[tuple[Row, int]] = []
    main_rows = [row for row in MAIN_ROWS if row.name in args.main_rows]
    for row in main_rows:
        plan += [(row, seed) for seed in range(args.sync_seeds if row.name == "sync-offload" else args.seeds)]
    chosen = [row for row in ABLATION_ROWS if row.name in args.ablations] + [
        Row(name, knobs, f"the defaults with {json.dumps(knobs)}") for name, knobs in args.custom.items()
    ]
    plan += [(row, seed) for row in chosen for seed in range(args.ablation_seeds)]
    if args.lrs is not None:  # the sweep: every row at every rate, the seeds of the main rows
        plan = [(row, seed) for row in (*main_rows, *chosen) for seed in range(args.seeds)]
    rates = args.lrs or [args.finetune_lr]
    if any(row.name != "adamw" and seed >= args.seeds for row, seed in plan):
        print(f"note: rows with more seeds than the {args.seeds} AdamW seeds report gaps over the paired seeds only")

    runs: list[dict[str, Any]] = []
    payload = bench_utils.payload(
        "finetune_quality",
        info,
        revision=True,
        settings=bench_utils.settings_of(args),
        n_params=n_params,
        cores={"training_process": train_cores, "host_worker": host_cores},
        corpora={"bytes": sizes, "files": corpora.files, "topics": corpora.topics, "sha256": corpora.digest},
        unigram_cross_entropy=unigram,
        base={**base_record, "heldout_loss": base_loss},
        steps_per_epoch=steps_per_epoch,
        rows={row.name: {"knobs": row.knobs, "what": row.what} for row in (*main_rows, *chosen)},
        runs=runs,
    )
    plan_by_rate = [(row, seed, lr) for lr in rates for row, seed in plan]
    for index, (row, seed, lr) in enumerate(plan_by_rate, start=1):
        print(f"[{index}/{len(plan_by_rate)}] {row.name} lr {lr:g} seed {seed} ...", end="", flush=True)
        run = finetune(row, seed, setting, lr)
        runs.append(run)
        print(f" held-out {run['eval_loss'][0]:.4f} -> {run['final_eval_loss']:.4f} ({run['train_s']:.1f} s)")
        bench_utils.write_partial(args.out, payload)  # a run cut short keeps what it measured

    if args.lrs is not None:
        best = rate_sweep.best_of_rates(runs)
        rate_sweep.print_best_of_rates(best)
        payload.update(best_of_rates=best, total_s=time.perf_counter() - started)
        bench_utils.write_results(args.out, payload)
        return 0 if all(math.isfinite(run["final_eval_loss"]) for run in runs) else 1
    summary = summarise(runs)
    print_tables(summary, [*main_rows, *chosen])
    probes = summarise_probes([run["probes"] for run in runs if run["row"] == "adamw"])
    print_probes(probes)
    refresh = [s for run in runs if run["row"] == "refresh-16" for s in run["selections"] if s["overlap"] is not None]
    if refresh:
        print(
            "engine's own refresh diagnostics (refresh-16 row): Jaccard of consecutive selections "
            f"{bench_utils.pm([s['overlap'] for s in refresh], 3)}, selected share of the column scores "
            f"{bench_utils.pm([s['captured'] for s in refresh], 3)} (over {len(refresh)} refreshes)"
        )
    adamw_final = {run["seed"]: run["final_eval_loss"] for run in runs if run["row"] == "adamw"}
    sync_differences = [
        abs(run["final_eval_loss"] / adamw_final[run["seed"]] - 1)
        for run in runs
        if run["row"] == "sync-offload" and run["seed"] in adamw_final
    ]
    sync_difference = max(sync_differences) if sync_differences else None
    sync_ok = sync_difference is None or sync_difference <= 1e-3
    if sync_difference is not None:
        verdict = "ok (equal up to float rounding)" if sync_ok else "LARGER THAN 1e-3: a harness or engine fault"
        print(f"sync-offload vs AdamW, final held-out loss: relative difference {sync_difference:.2e} -> {verdict}")
    payload.update(
        summary={name: {k: v for k, v in entry.items() if k != "runs"} for name, entry in summary.items()},
        gradient_statistics=probes,
        engine_refresh_diagnostics=refresh,
        sync_offload_relative_difference=sync_difference,
        sync_offload_matches_adamw=sync_ok,
        total_s=time.perf_counter() - started,
    )
    bench_utils.write_results(args.out, payload)
    if args.plot:
        title = f"GPT {n_params / 1e6:.2f}M, code -> prose fine-tune, mean of seeds; {info['date']}"
        plot(summary, [row.name for row in (*main_rows, *chosen)], args.out.with_suffix(".png"), title)
    print(f"total {time.perf_counter() - started:.0f} s")
    if not all(math.isfinite(run["final_eval_loss"]) for run in runs):
        print("a run diverged (non-finite loss).")
        return 1
    return 0 if sync_ok else 1


if __name__ == "__main__":
    sys.exit(main())
