"""litgpt with ZenFlowAdamW: ``litgpt finetune_full`` on a tiny model, torch AdamW against ZenFlowAdamW.

litgpt takes its optimizer as a class path, so ZenFlow needs no plugin there::

    litgpt finetune_full <checkpoint_dir> \\
        --optimizer '{"class_path": "lightning_zenflow.ZenFlowAdamW", "init_args": {"lr": 1e-3}}'

This recipe needs nothing downloaded. In ``--out`` it builds a checkpoint directory litgpt accepts: a tiny
Pythia-like ``litgpt.Config`` (2 layers, 64 wide, 2 heads, a 512-token vocabulary) saved as ``model_config.yaml``
and a randomly initialised ``lit_model.pth``, a byte-level BPE ``tokenizer.json`` (the ``tokenizers`` package)
trained on the standard library's docstrings, with ``tokenizer_config.json`` and ``generation_config.json``; and an
instruction file (``What does json.dumps do?`` -> the first line of its docstring) for litgpt's ``JSON`` data
module. It then runs ``litgpt finetune_full`` twice in subprocesses, the same steps, batches, seed and learning
rate, once with ``torch.optim.AdamW`` and once with ``lightning_zenflow.ZenFlowAdamW``, and prints each run's exit
status, final validation loss (litgpt's ``Final evaluation`` line) and wall time. Each run's full output is in
``<out>/<name>.log``. It shows that ZenFlowAdamW drops into litgpt's loop unchanged; with 20 steps on a random
model the losses are a smoke test, not a quality result (``finetune_quality.py`` and ``real_lm.py`` measure that).

    pip install litgpt
    python benchmarks/litgpt_recipe.py

litgpt 0.5.13 pins ``huggingface-hub<1.4`` and ``jsonargparse<=4.41``, which the transformers 5 of this project's test
extra does not import with: give litgpt an environment of its own (``torch==2.13.0``, ``litgpt``, this package).
Measured with litgpt 0.5.13, jsonargparse 4.41 and huggingface-hub 1.33.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_utils
import torch

MODULES = (
    "os", "os.path", "json", "re", "string", "textwrap", "collections", "itertools", "functools", "pathlib",
    "shutil", "inspect", "math", "random", "statistics", "heapq", "bisect", "copy", "base64", "hashlib",
    "zipfile", "tarfile", "csv", "datetime", "time", "urllib.parse", "difflib", "fnmatch", "glob", "operator",
    "typing", "dataclasses", "contextlib", "subprocess", "threading", "logging", "argparse", "pickle", "struct",
)  # fmt: skip
EOS = "<|endoftext|>"


def stdlib_docs(limit: int) -> tuple[list[dict], str]:
    """Instruction/output pairs from public functions' docstrings, and all their docstrings as tokenizer text."""
    pairs, corpus = [], []
    for name in MODULES:
        module = importlib.import_module(name)
        corpus.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not callable(obj) or not (doc := inspect.getdoc(obj)):
                continue
            first = doc.strip().splitlines()[0].strip()
            corpus.append(doc)
            if 10 <= len(first) <= 200 and len(pairs) < limit:
                pairs.append({"instruction": f"What does {name}.{attr} do?", "input": "", "output": first})
    return pairs, "\n\n".join(corpus)


def build(out: Path, samples: int) -> Path:
    """The tiny checkpoint directory, tokenizer and data file under ``out``; returns the checkpoint directory."""
    from litgpt import GPT, Config
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ckpt = out / "checkpoint" / "tiny-zenflow"
    ckpt.mkdir(parents=True, exist_ok=True)
    pairs, corpus = stdlib_docs(samples)
    (out / "data.json").write_text(json.dumps(pairs, indent=1))
    alpaca = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOS], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([corpus, alpaca * 20, "### Instruction:\n### Response:\n" * 20], trainer=trainer)
    tok.save(str(ckpt / "tokenizer.json"))
    special = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS}
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**special, "add_bos_token": False}))
    eos_id = tok.token_to_id(EOS)
    (ckpt / "generation_config.json").write_text(json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id}))
    config = Config(
        name="tiny-zenflow", block_size=256, vocab_size=512, padded_vocab_size=512, n_layer=2, n_head=2, n_embd=64,
        rotary_percentage=0.25, parallel_residual=True, bias=True, norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP", intermediate_size=256,
    )  # fmt: skip
    save_config(config, ckpt)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), ckpt / "lit_model.pth")
    print(f"built {ckpt} ({len(pairs)} instruction pairs, vocabulary {tok.get_vocab_size()})")
    return ckpt


def finetune(name: str, optimizer: dict, ckpt: Path, out: Path, steps: int) -> dict:
    litgpt = shutil.which("litgpt") or str(Path(sys.executable).with_name("litgpt"))
    command = [
        litgpt, "finetune_full", str(ckpt), "--out_dir", str(out / name), "--precision", "32-true", "--devices", "1",
        "--data", "JSON", "--data.json_path", str(out / "data.json"), "--data.val_split_fraction", "0.1",
        "--train.max_steps", str(steps), "--train.epochs", "1", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "4", "--train.lr_warmup_steps", "2", "--train.max_seq_length", "256",
        "--train.save_interval", "100000", "--eval.interval", "100000", "--eval.final_validation", "true",
        "--eval.max_iters", "10", "--logger_name", "csv", "--seed", "1337", "--optimizer", json.dumps(optimizer),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(" ".join(command) + "\n\n" + log)
    found = re.findall(r"Final evaluation \| val loss: ([0-9.]+)", log)
    if proc.returncode != 0:
        tail = [line for line in log.strip().splitlines() if line.strip()][-6:]
        print(f"[{name}] exit {proc.returncode}; last lines:\n  " + "\n  ".join(tail))
    return {"name": name, "rc": proc.returncode, "val_loss": float(found[-1]) if found else None, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = bench_utils.make_parser(__doc__.splitlines()[0])
    bench_utils.add_common_args(
        parser,
        out=Path("benchmarks/out/litgpt"),
        out_help="folder for the checkpoint, the data, the logs and litgpt_recipe.json.",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--samples", type=int, default=400, help="instruction pairs to generate")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("litgpt") is None:
        print("litgpt is not installed: pip install litgpt")
        return 2
    info = bench_utils.announce(
        "litgpt_recipe: litgpt finetune_full on a tiny model, torch AdamW against ZenFlowAdamW", torch.device("cpu")
    )
    args.out = args.out.resolve()
    ckpt = build(args.out, args.samples)
    init = {"lr": args.lr, "weight_decay": 0.0}
    runs = [
        finetune("adamw", {"class_path": "torch.optim.AdamW", "init_args": init}, ckpt, args.out, args.steps),
        finetune("zenflow", {"class_path": "lightning_zenflow.ZenFlowAdamW", "init_args": init}, ckpt, args.out,
                 args.steps),
    ]  # fmt: skip
    print(f"\nlitgpt finetune_full, {args.steps} steps, batch 4, lr {args.lr}, CPU, 32-true")
    rows = [
        [run["name"], run["rc"], "n/a" if run["val_loss"] is None else f"{run['val_loss']:.3f}", f"{run['wall_s']:.1f}"]
        for run in runs
    ]
    bench_utils.print_table(None, ["optimizer", "exit", "final val loss", "wall s"], rows)
    print(f"logs: {args.out}/<optimizer>.log")
    payload = bench_utils.payload(
        "litgpt_recipe",
        info,
        settings={"steps": args.steps, "samples": args.samples, "lr": args.lr},
        checkpoint=str(ckpt),
        runs=runs,
    )
    bench_utils.write_results(args.out / "litgpt_recipe.json", payload)
    return 0 if all(run["rc"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
