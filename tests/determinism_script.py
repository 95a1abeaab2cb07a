"""One seeded Lightning fine-tune of a small GPT with dropout, run in a process of its own; prints what a rerun must
reproduce bit for bit, as one JSON line.

The model and the knobs are what a new user would write: the demo GPT (2 layers, width 64, byte vocabulary, blocks
of 48, dropout 0.1), AdamW with two param groups (weight decay on the matrices only), ``gradient_clip_val=1.0``,
``torch.set_num_threads(1)``, everything seeded. Printed: a digest of the final weights, a digest of the torch RNG
state seen at every ``training_step`` (what dropout draws from), the default dtype seen at every ``training_step``
and every ``on_before_optimizer_step``, and the kernels' mode. ``tests/test_reproducible.py`` runs it twice (once
beside a CPU hog, once with an empty compile cache) and against plain AdamW.

    python tests/determinism_script.py --precision bf16-true --strategy zenflow --kernels compiled --steps 60
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from typing import Any

import torch
from lightning import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_zenflow
from lightning_zenflow.demo.gpt import GPT, GPTConfig


class SmallGPT(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=256, block_size=48, n_layer=2, n_head=2, n_embd=64, dropout=0.1))
        self.rng_seen = hashlib.sha256()
        self.dtypes_seen: dict[str, set[str]] = {"training_step": set(), "before_optimizer_step": set()}
        self.kernels: str | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.rng_seen.update(torch.random.get_rng_state().numpy().tobytes())
        self.dtypes_seen["training_step"].add(str(torch.get_default_dtype()))
        tokens = batch[0]
        logits, _ = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.dtypes_seen["before_optimizer_step"].add(str(torch.get_default_dtype()))

    def on_train_end(self) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        self.kernels = engine.kernels.mode if engine is not None and hasattr(engine, "kernels") else None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def fit(
    precision: str = "bf16-true",
    strategy: str = "zenflow",
    kernels: str = "compiled",
    steps: int = 60,
    host_state: str = "bf16",
) -> dict[str, Any]:
    """One seeded fit; what a rerun must reproduce (see the module docstring)."""
    seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (steps * 4, 49), generator=generator)
    data = DataLoader(TensorDataset(tokens), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    module = SmallGPT()
    chosen: Any = "auto"
    if strategy == "zenflow":
        chosen = lightning_zenflow.ZenFlowStrategy(
            topk_ratio=0.25,
            update_interval=4,
            full_warm_up_rounds=2,
            interim_kernel=kernels,
            host_state=host_state,
            host_threads=1,
            bind_cores=False,
            log_telemetry=False,
        )
    trainer = Trainer(
        strategy=chosen,
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    weights = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        weights.update(name.encode())
        weights.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "weights": weights.hexdigest(),
        "rng": module.rng_seen.hexdigest(),
        "dtypes": {where: sorted(seen) for where, seen in module.dtypes_seen.items()},
        "default_dtype_after": str(torch.get_default_dtype()),
        "kernels": module.kernels,
        "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-true", choices=("32-true", "bf16-true"))
    parser.add_argument("--strategy", default="zenflow", choices=("zenflow", "auto"))
    parser.add_argument("--kernels", default="compiled", choices=("compiled", "eager", "auto"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--host-state", default="bf16", choices=("bf16", "fp32"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(json.dumps(fit(args.precision, args.strategy, args.kernels, args.steps, args.host_state)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
